//! Stable key hashes, end to end with real sidecar processes: two sidecars (as two pods,
//! or one pod before and after a restart) given the same key-hash secret log a client under
//! the same `key_hash`, which `tollgate-sidecar key-hash` computes from the raw key; audit
//! lines carry the request's policy, rule, method, path, status, client and trace id, and
//! count what the per-second allowance suppressed.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

const POLICY: &str = "rules:\n  - name: per-key\n    key: [{header: x-api-key}]\n    limit: {requests: 1, period: 1m}\n";
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// The audit lines a sidecar wrote so far, parsed.
fn audit_lines(sc: &Sidecar) -> Vec<serde_json::Value> {
    sc.logs()
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "tollgate::audit")
        .collect()
}

/// The `nth` audit line of a sidecar, once its log has it (logs arrive through a pipe).
async fn line(sc: &Sidecar, nth: usize) -> serde_json::Value {
    poll_until(Duration::from_secs(5), "the audit line", || async {
        audit_lines(sc).get(nth).cloned()
    })
    .await
}

/// Sends `n` requests for `key` through `sc`; returns the statuses.
async fn send(c: &reqwest::Client, sc: &Sidecar, key: &str, n: usize) -> Vec<u16> {
    let mut out = Vec::new();
    for _ in 0..n {
        let r = c
            .get(sc.url("/orders/42?token=secret"))
            .header("x-api-key", key)
            .header("traceparent", format!("00-{TRACE}-00f067aa0ba902b7-01"))
            .send()
            .await
            .expect("request");
        out.push(r.status().as_u16());
    }
    out
}

fn key_hash_cli(secret: &std::path::Path, parts: &[&str]) -> (i32, String, String) {
    let out = Command::new(BIN)
        .arg("key-hash")
        .arg("--secret-file")
        .arg(secret)
        .args(parts)
        .output()
        .expect("run key-hash");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_has_one_key_hash_in_every_sidecar_sharing_the_secret() {
    within(60, async {
        let dir = tempfile::tempdir().expect("temp dir");
        let secret = dir.path().join("key-hash-secret");
        std::fs::write(&secret, "an installation secret, 32 bytes\n").expect("secret");
        let upstream = Upstream::start().await;
        let policy = policy("ids", POLICY);
        let args = ["--key-hash-secret-file", secret.to_str().expect("path")];
        let a = Sidecar::start(&upstream.url(), &policy, &args).await;
        let b = Sidecar::start(&upstream.url(), &policy, &args).await;
        let c = client();
        assert_eq!(send(&c, &a, "customer-1", 2).await, [200, 429]);
        assert_eq!(send(&c, &b, "customer-1", 2).await, [200, 429]);
        assert_eq!(send(&c, &a, "customer-2", 2).await, [200, 429]);

        let (la, lb, other) = (line(&a, 0).await, line(&b, 0).await, line(&a, 1).await);
        let (code, expected, err) = key_hash_cli(&secret, &["customer-1"]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(la["key_hash"], expected.as_str(), "{la}");
        assert_eq!(
            lb["key_hash"],
            expected.as_str(),
            "another process, same key hash: {lb}"
        );
        assert_ne!(other["key_hash"], expected.as_str(), "another key: {other}");
        assert_eq!(
            key_hash_cli(&secret, &["customer-2"]).1,
            other["key_hash"].as_str().unwrap_or("")
        );

        // What support needs from one line, and no raw key or query string.
        assert_eq!(la["policy"], "test/ids", "{la}");
        assert_eq!(la["rule"], "test/ids/per-key", "{la}");
        assert_eq!(la["decision"], "rejected", "{la}");
        assert_eq!(la["status"], 429, "{la}");
        assert_eq!(la["method"], "GET", "{la}");
        assert_eq!(la["path"], "/orders/42", "{la}");
        assert_eq!(la["client"], "127.0.0.1", "{la}");
        assert_eq!(la["trace_id"], TRACE, "{la}");
        assert!(
            la.get("key").is_none_or(|k| k.is_null()),
            "raw key logged: {la}"
        );
        assert!(
            !la.to_string().contains("customer-1"),
            "raw key logged: {la}"
        );
        assert!(
            !la.to_string().contains("token=secret"),
            "query logged: {la}"
        );

        // Top keys show the same key hash.
        let top = a.admin_json(&c, "/debug/top-keys").await;
        let hashes: Vec<&str> = top["topKeys"]
            .as_array()
            .expect("topKeys")
            .iter()
            .filter_map(|e| e["keyHash"].as_str())
            .collect();
        assert!(hashes.contains(&expected.as_str()), "{top}");

        // Another secret, another key hash; a missing secret file is an error for key-hash.
        let other_secret = dir.path().join("other");
        std::fs::write(&other_secret, "a different secret of 32 bytes..").expect("secret");
        assert_ne!(key_hash_cli(&other_secret, &["customer-1"]).1, expected);
        let (code, _, err) = key_hash_cli(&dir.path().join("missing"), &["customer-1"]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("cannot read the key-hash secret"), "{err}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_secret_file_is_created_and_suppressed_lines_are_counted() {
    within(60, async {
        let dir = tempfile::tempdir().expect("temp dir");
        let secret = dir.path().join("generated");
        let upstream = Upstream::start().await;
        let policy = policy("ids", POLICY);
        let path = secret.to_str().expect("path");
        let args = ["--key-hash-secret-file", path, "--audit-per-second", "1"];
        let sc = Sidecar::start(&upstream.url(), &policy, &args).await;
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&secret)
            .expect("secret created")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the generated secret is private");
        let c = client();
        // One line per second: of 6 rejections in a burst, at most 2 lines (a second boundary).
        let statuses = send(&c, &sc, "flood", 7).await;
        assert_eq!(
            statuses.iter().filter(|s| **s == 429).count(),
            6,
            "{statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(1100)).await;
        send(&c, &sc, "flood", 1).await;
        line(&sc, 1).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let lines = audit_lines(&sc);
        let written = lines.len() as u64;
        let suppressed: u64 = lines
            .iter()
            .filter_map(|l| l["suppressed_before"].as_u64())
            .sum();
        assert!(written <= 3, "{lines:?}");
        assert_eq!(
            written + suppressed,
            7,
            "every rejection is a line or counted: {lines:?}"
        );
        let m = sc.metrics(&c).await;
        assert_eq!(
            metric(&m, "tollgate_audit_suppressed_total", &[]),
            Some(suppressed as f64)
        );

        // A restart with the generated secret keeps the key hash.
        let first = lines[0]["key_hash"].clone();
        drop(sc);
        let again = Sidecar::start(&upstream.url(), &policy, &args).await;
        send(&c, &again, "flood", 2).await;
        assert_eq!(line(&again, 0).await["key_hash"], first);
    })
    .await;
}

/// A fail-closed rule's 503 is a decision the client sees, as a 429 is: it gets an audit line
/// (decision `unavailable`, the reason, the key's key hash), on the HTTP/1.1 fast path and
/// through hyper (HTTP/2) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_closed_503_is_audited_with_its_reason() {
    within(60, async {
        let dir = tempfile::tempdir().expect("temp dir");
        let secret = dir.path().join("key-hash-secret");
        std::fs::write(&secret, "an installation secret, 32 bytes\n").expect("secret");
        let upstream = Upstream::start().await;
        let redis = format!("redis://{}", closed_port().await);
        let policy = policy(
            "closed",
            "rules:\n  - name: per-key\n    key: [{header: x-api-key}]\n    limit: {requests: 100, period: 1m}\n    scope: Global\n    failureMode: Closed\n",
        );
        let args = [
            "--key-hash-secret-file",
            secret.to_str().expect("path"),
            "--redis",
            &redis,
            "--redis-timeout",
            "50ms",
        ];
        let sc = Sidecar::start(&upstream.url(), &policy, &args).await;
        let h1 = client();
        let h2 = client_builder()
            .http2_prior_knowledge()
            .build()
            .expect("h2 client");
        for c in [&h1, &h2] {
            let r = c
                .get(sc.url("/orders/7?token=secret"))
                .header("x-api-key", "customer-1")
                .send()
                .await
                .expect("request");
            assert_eq!(r.status(), 503, "fail-closed without Redis");
        }
        let (code, expected, err) = key_hash_cli(&secret, &["customer-1"]);
        assert_eq!(code, 0, "{err}");
        for nth in 0..2 {
            let l = line(&sc, nth).await;
            assert_eq!(l["decision"], "unavailable", "{l}");
            assert_eq!(l["event"], "unavailable", "{l}");
            assert_eq!(l["status"], 503, "{l}");
            assert_eq!(l["rule"], "test/closed/per-key", "{l}");
            assert_eq!(l["policy"], "test/closed", "{l}");
            assert_eq!(l["path"], "/orders/7", "{l}");
            assert_eq!(l["client"], "127.0.0.1", "{l}");
            assert_eq!(l["key_hash"], expected.as_str(), "{l}");
            let reason = l["reason"].as_str().unwrap_or_default();
            assert!(reason.contains("fails closed"), "{l}");
            assert!(!l.to_string().contains("customer-1"), "raw key logged: {l}");
        }
        assert_eq!(upstream.hits(), 0, "nothing reached the app");
    })
    .await;
}

/// `pk` and `Retry-After` of one client's 429 from a sidecar, for `key`.
async fn rejection_of(c: &reqwest::Client, sc: &Sidecar, key: &str) -> (String, String) {
    let mut last = None;
    for _ in 0..2 {
        last = Some(
            c.get(sc.url("/orders"))
                .header("x-api-key", key)
                .send()
                .await
                .expect("request"),
        );
    }
    let r = last.expect("two requests");
    assert_eq!(r.status(), 429, "the second request of {key}");
    let pk = header(&r, "ratelimit")
        .split(';')
        .find_map(|p| p.strip_prefix("pk="))
        .expect("pk in RateLimit")
        .to_string();
    (pk, header(&r, "retry-after").to_string())
}

/// Sidecars sharing the installation's secret give one client the same partition key and the
/// same `Retry-After` (the jitter is seeded by the key's hash): a client moved to another pod
/// is not told another story. Another secret gives other partition keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_sharing_the_secret_give_a_client_one_pk_and_one_retry_after() {
    within(60, async {
        let dir = tempfile::tempdir().expect("temp dir");
        let secret = dir.path().join("key-hash-secret");
        std::fs::write(&secret, "an installation secret, 32 bytes\n").expect("secret");
        let other = dir.path().join("other");
        std::fs::write(&other, "a different secret of 32 bytes..").expect("secret");
        let upstream = Upstream::start().await;
        // A 10-minute wait: Retry-After spreads over 121 seconds, so equal values by chance
        // for six keys are out of the question.
        let policy = policy(
            "pk",
            "partitionKey: true\nrules:\n  - name: per-key\n    scope: Local\n    key: [{header: x-api-key}]\n    limit: {requests: 1, period: 10m}\n",
        );
        let start = |file: &std::path::Path| {
            let args = ["--key-hash-secret-file", file.to_str().expect("path")].map(String::from);
            let (url, policy) = (upstream.url(), policy.clone());
            tokio::task::spawn_blocking(move || Sidecar::start_blocking(&url, &policy, &args))
        };
        let (a, b, c_other) = (start(&secret), start(&secret), start(&other));
        let (a, b, c_other) = (a.await.unwrap(), b.await.unwrap(), c_other.await.unwrap());
        let c = client();
        let mut retry_afters = std::collections::BTreeSet::new();
        for n in 0..6 {
            let key = format!("customer-{n}");
            let from_a = rejection_of(&c, &a, &key).await;
            let from_b = rejection_of(&c, &b, &key).await;
            assert_eq!(from_a, from_b, "{key}: (pk, Retry-After) from two sidecars");
            let (pk_other, _) = rejection_of(&c, &c_other, &key).await;
            assert_ne!(from_a.0, pk_other, "{key}: another secret, another pk");
            retry_afters.insert(from_a.1);
        }
        assert!(retry_afters.len() > 1, "jitter still spreads keys: {retry_afters:?}");
    })
    .await;
}
