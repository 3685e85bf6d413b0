//! `GET /debug/why` on the admin port: which rules a request would meet and the state of its
//! key, read without charging anything, with keys shown only as their identity; malformed
//! queries answer 400 with the reason.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::time::Duration;

use common::*;

const RAW_KEY: &str = "customer-raw-key-7731";

fn why_policy() -> String {
    policy(
        "why",
        "
        rules:
          - name: per-key
            match: {path: {prefix: /api}}
            key: [{header: x-api-key}]
            limit: {requests: 5, period: 1m}
            scope: Local
          - name: per-user
            match: {path: {prefix: /api}}
            key: [{header: x-user}]
            onMissingKey: Skip
            limit: {requests: 5, period: 1m}
            scope: Local
          - name: admin-only
            match: {path: {prefix: /admin}}
            limit: {requests: 3, period: 1m}
            scope: Local
        ",
    )
}

async fn why(c: &reqwest::Client, sc: &Sidecar, query: &str) -> (u16, String) {
    let r = c
        .get(sc.admin_url(&format!("/debug/why?{query}")))
        .send()
        .await
        .expect("GET /debug/why");
    let status = r.status().as_u16();
    (status, r.text().await.expect("body"))
}

fn rule<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["rules"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["rule"] == name))
        .unwrap_or_else(|| panic!("rule {name} missing: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn why_explains_a_request_without_charging_it() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &why_policy(), &[]).await;
        let c = client();
        let query = format!("method=GET&path=%2Fapi%2Forders%3Fx%3D1&header=x-api-key%3A{RAW_KEY}");

        // Before any traffic: the rule applies, the key has no state yet.
        let (status, body) = why(&c, &sc, &query).await;
        assert_eq!(status, 200, "{body}");
        assert!(!body.contains(RAW_KEY), "the raw key leaked: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(v["request"]["path"], "/api/orders?x=1", "{v}");
        assert_eq!(
            v["request"]["headers"],
            serde_json::json!(["x-api-key"]),
            "{v}"
        );
        let per_key = rule(&v, "per-key");
        assert_eq!(per_key["policy"], "test/why");
        assert_eq!(per_key["matches"], true, "{per_key}");
        assert_eq!(per_key["outcome"], "counted", "{per_key}");
        // A key never sent would be admitted, with the whole limit left.
        assert_eq!(per_key["would"]["outcome"], "admitted", "{per_key}");
        assert_eq!(per_key["would"]["remaining"], 5, "{per_key}");
        assert_eq!(v["decision"]["outcome"], "admitted", "{v}");
        assert_eq!(per_key["mode"], "Enforce", "{per_key}");
        assert_eq!(per_key["state"]["tracked"], false, "{per_key}");
        let key_hash = per_key["keyHash"].as_str().expect("keyHash").to_string();
        assert_eq!(key_hash.len(), 16, "{key_hash}");
        let per_user = rule(&v, "per-user");
        assert_eq!(per_user["matches"], true);
        assert!(
            per_user["outcome"]
                .as_str()
                .unwrap_or("")
                .starts_with("skipped"),
            "{per_user}"
        );
        assert!(per_user.get("keyHash").is_none(), "{per_user}");
        let admin = rule(&v, "admin-only");
        assert_eq!(admin["matches"], false, "{admin}");

        // Two requests through the proxy take two of five.
        let url = sc.url("/api/orders");
        assert_eq!(
            statuses(&c, &url, &[("x-api-key", RAW_KEY)], 2).await,
            [200, 200]
        );
        for _ in 0..10 {
            let (status, body) = why(&c, &sc, &query).await;
            assert_eq!(status, 200, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
            let state = &rule(&v, "per-key")["state"];
            assert_eq!(state["tracked"], true, "{state}");
            assert_eq!(state["remaining"], 3, "{state}");
            assert_eq!(state["limit"], 5, "{state}");
            assert_eq!(rule(&v, "per-key")["keyHash"], key_hash.as_str());
        }
        // Ten explanations charged nothing: exactly three more are admitted.
        assert_eq!(
            statuses(&c, &url, &[("x-api-key", RAW_KEY)], 4).await,
            [200, 200, 200, 429]
        );
        // Now the same request would be rejected, and why says so and by which rule.
        let (_, body) = why(&c, &sc, &query).await;
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        let would = &rule(&v, "per-key")["would"];
        assert_eq!(would["outcome"], "rejected", "{v}");
        assert_eq!(would["remaining"], 0, "{v}");
        assert!(would["retryAfterMs"].as_u64().unwrap_or(0) > 0, "{v}");
        assert_eq!(v["decision"]["outcome"], "rejected", "{v}");
        assert_eq!(v["decision"]["rule"], "per-key", "{v}");
        // The identity is the audit line's key_hash for the same client.
        let audit = poll_until(Duration::from_secs(5), "the audit line", || async {
            sc.logs()
                .iter()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find(|v| v["target"] == "tollgate::audit")
        })
        .await;
        assert_eq!(audit["key_hash"], key_hash.as_str(), "{audit}");

        // The request the proxy never saw for another path matches only its rule.
        let (status, body) = why(&c, &sc, "path=/admin/x").await;
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(rule(&v, "admin-only")["matches"], true, "{v}");
        assert_eq!(rule(&v, "per-key")["matches"], false, "{v}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_why_queries_answer_400_with_the_reason() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &why_policy(), &[]).await;
        let c = client();
        for (query, reason) in [
            ("method=G%20T", "not an HTTP method"),
            ("path=api", "must start with /"),
            ("header=novalue", "expected name:value"),
            ("header=bad%20name:v", "invalid header name"),
            ("header=x:%01", "invalid header value"),
            ("clientIp=nowhere", "not an IP address"),
            ("colour=blue", "unknown parameter"),
            ("balance=etcd", "local or redis"),
            ("path=/a%20b", "not a valid request path"),
        ] {
            let (status, body) = why(&c, &sc, query).await;
            assert_eq!(status, 400, "{query}: {body}");
            assert!(body.contains(reason), "{query}: {body}");
        }
        // The sidecar is still serving.
        let (status, body) = why(&c, &sc, "").await;
        assert_eq!(status, 200, "{body}");
    })
    .await;
}

/// A Global rule's outcome needs the bucket in Redis: without `balance=redis` it is unknown (not
/// "limited"); with it, a fresh key reads admitted and a key another sidecar spent reads
/// rejected, and the read charges nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn why_reads_a_global_balance_in_redis_when_asked() {
    within(60, async {
        let redis = tollgate_testkit::Redis::start();
        let up = Upstream::start().await;
        let p = policy(
            "global",
            "rules:\n  - name: strict\n    key: [{header: x-api-key}]\n    limit: {requests: 3, period: 1m, burst: 3}\n    accuracy: Strict\n",
        );
        let url = redis.url();
        let args = ["--redis", url.as_str()];
        let (a, b) = (
            Sidecar::start(&up.url(), &p, &args).await,
            Sidecar::start(&up.url(), &p, &args).await,
        );
        let c = client();
        let ask = |sc: &Sidecar, key: &str, balance: &str| {
            let q = format!("path=/x&header=x-api-key%3A{key}{balance}");
            let (c, sc) = (c.clone(), sc.admin_url(&format!("/debug/why?{q}")));
            async move {
                let r = c.get(sc).send().await.expect("why");
                assert_eq!(r.status(), 200);
                r.json::<serde_json::Value>().await.expect("JSON")
            }
        };
        let v = ask(&a, "spent", "").await;
        assert_eq!(rule(&v, "strict")["would"]["outcome"], "unknown", "{v}");
        assert_eq!(v["decision"]["outcome"], "unknown", "{v}");
        for _ in 0..3 {
            let v = ask(&a, "spent", "&balance=redis").await;
            let would = &rule(&v, "strict")["would"];
            assert_eq!(would["outcome"], "admitted", "{v}");
            assert_eq!(would["remaining"], 3, "reads charge nothing: {v}");
        }
        // Another sidecar spends the key's bucket.
        assert_eq!(
            statuses(&c, &b.url("/x"), &[("x-api-key", "spent")], 4).await,
            [200, 200, 200, 429]
        );
        let v = ask(&a, "spent", "&balance=redis").await;
        let would = &rule(&v, "strict")["would"];
        assert_eq!(would["outcome"], "rejected", "{v}");
        assert_eq!(would["remaining"], 0, "{v}");
        assert_eq!(would["source"], "redis", "{v}");
        assert_eq!(v["decision"]["outcome"], "rejected", "{v}");
        let fresh = ask(&a, "fresh", "&balance=redis").await;
        assert_eq!(rule(&fresh, "strict")["would"]["outcome"], "admitted", "{fresh}");
        assert_eq!(fresh["decision"]["outcome"], "admitted", "{fresh}");
    })
    .await;
}
