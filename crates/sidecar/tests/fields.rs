//! The client contract, parsed the way a client parses it: every `RateLimit-Policy` and
//! `RateLimit` field goes through a structured-field parser (RFC 9651), per algorithm and per
//! header profile; waiting exactly `Retry-After` succeeds; clients of one shared bucket are sent
//! back at different times; the fail-closed 503 says what it can.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]
#![allow(
    clippy::too_many_lines,
    reason = "a scenario test reads top to bottom as one story: setup, steps, checks"
)]

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::*;

const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";
const REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// One rule per algorithm, each on its own path, 2 per 2 s per `x-api-key`.
fn every_algorithm_policy() -> String {
    let mut rules = String::from("rules:\n");
    for (name, prefix, limit) in [
        ("token-bucket", "/tb", "{requests: 2, period: 2s}"),
        (
            "sliding-window",
            "/sw",
            "{requests: 2, period: 2s, algorithm: SlidingWindow}",
        ),
        (
            "fixed-window",
            "/fw",
            "{requests: 2, period: 2s, algorithm: FixedWindow}",
        ),
        (
            "sliding-log",
            "/sl",
            "{requests: 2, period: 2s, algorithm: SlidingLog}",
        ),
        (
            "leaky-bucket",
            "/lb",
            "{requests: 2, period: 2s, algorithm: LeakyBucket, maxDelay: 100ms}",
        ),
    ] {
        rules.push_str(&format!(
            "  - name: {name}\n    match: {{path: {{prefix: {prefix}}}}}\n    \
             key: [{{header: x-api-key}}]\n    limit: {limit}\n    scope: Local\n"
        ));
    }
    rules.push_str(
        "  - name: in-flight\n    match: {path: {exact: /hold}}\n    \
         limit: {requests: 1, algorithm: Concurrency}\n    scope: Local\n",
    );
    policy("fields", &rules)
}

/// Checks the 429's contract for `rule` and returns its `Retry-After`.
async fn check_429(resp: reqwest::Response, rule: &str) -> u64 {
    assert_eq!(resp.status(), 429, "{rule}");
    let h = resp.headers().clone();
    let retry = header_u64(&resp, "retry-after");
    let (r, t) = service_limit(&h, rule);
    assert_eq!(r, 0, "{rule}: r on a 429");
    if let Some(t) = t {
        assert!(
            t as u64 <= retry,
            "{rule}: Retry-After {retry} is earlier than t={t}"
        );
    }
    let policy = sf_list(&h, "ratelimit-policy");
    let item = policy.iter().find(|i| i.name == rule).expect("policy item");
    assert!(item.int("q").is_some_and(|q| q > 0), "{item:?}");
    assert!(!item.has("r") && !item.has("t"), "{item:?}");
    for legacy in ["ratelimit-limit", "ratelimit-reset", "x-ratelimit-limit"] {
        assert!(
            h.get(legacy).is_none(),
            "{rule}: {legacy} in the default profile"
        );
    }
    let body: serde_json::Value = resp.json().await.expect("problem+json");
    assert_eq!(body["type"], QUOTA_EXCEEDED, "{body}");
    assert_eq!(
        body["violated-policies"],
        serde_json::json!([rule]),
        "{body}"
    );
    assert_eq!(body["retryAfterSeconds"], retry, "{body}");
    retry
}

/// Spends `rule`'s quota until a 429, checks what every answer says, waits exactly
/// `Retry-After` and expects the next request to be admitted.
async fn exhaust_then_wait(c: reqwest::Client, url: String, rule: &'static str) {
    let key = [("x-api-key", rule)];
    let mut admitted = 0;
    let rejected = loop {
        let resp = c.get(&url).header(key[0].0, key[0].1).send().await.unwrap();
        if resp.status() != 200 {
            break resp;
        }
        admitted += 1;
        assert!(admitted <= 4, "{rule}: no 429 after {admitted} requests");
        let (r, t) = service_limit(resp.headers(), rule);
        assert!(r <= 2, "{rule}: r={r} above q=2");
        let t = t.expect("t on a timed rule");
        assert!((0..=2).contains(&t), "{rule}: t={t} beyond the 2 s window");
        let w = sf_list(resp.headers(), "ratelimit-policy")[0].int("w");
        assert_eq!(w, Some(2), "{rule}");
    };
    let retry = check_429(rejected, rule).await;
    tokio::time::sleep(Duration::from_secs(retry)).await;
    let status = status_of(&c, &url, &key).await;
    assert_eq!(
        status, 200,
        "{rule}: still limited after waiting Retry-After {retry} s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_tells_the_truth_and_waiting_retry_after_succeeds() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &every_algorithm_policy(), &[]).await;
        let c = client();
        let runs = [
            ("token-bucket", "/tb"),
            ("sliding-window", "/sw"),
            ("fixed-window", "/fw"),
            ("sliding-log", "/sl"),
            ("leaky-bucket", "/lb"),
        ]
        .map(|(rule, path)| tokio::spawn(exhaust_then_wait(c.clone(), sc.url(path), rule)));

        // Concurrency: one request held in flight; the next is refused with the unit
        // "concurrent-requests", no window and no `t`; after the held one ends, waiting
        // Retry-After succeeds.
        let held = tokio::spawn({
            let (c, url) = (c.clone(), sc.url("/hold"));
            async move { c.get(url).send().await.map(|r| r.status().as_u16()) }
        });
        poll_until(Duration::from_secs(5), "held request in flight", || async {
            (up.state.in_flight.load(std::sync::atomic::Ordering::SeqCst) == 1).then_some(())
        })
        .await;
        let resp = c.get(sc.url("/hold")).send().await.unwrap();
        let h = resp.headers().clone();
        let item = sf_list(&h, "ratelimit-policy").remove(0);
        assert_eq!(item.name, "in-flight");
        assert_eq!(item.int("q"), Some(1));
        assert!(
            !item.has("w"),
            "a concurrency limit has no window: {item:?}"
        );
        assert!(
            matches!(item.params.iter().find(|(k, _)| k == "qu"),
                Some((_, sfv::BareItem::String(s))) if s.as_str() == "concurrent-requests"),
            "{item:?}"
        );
        assert_eq!(service_limit(&h, "in-flight"), (0, None));
        let retry = check_429(resp, "in-flight").await;
        up.release();
        assert_eq!(held.await.unwrap().unwrap(), 200);
        tokio::time::sleep(Duration::from_secs(retry)).await;
        assert_eq!(status_of(&c, &sc.url("/hold"), &[]).await, 200);
        for run in runs {
            run.await.expect("algorithm run");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rule_that_applied_is_listed_in_both_fields() {
    within(30, async {
        let up = Upstream::start().await;
        let yaml = policy(
            "layers",
            "
            rules:
              - name: per-user
                key: [{header: x-user}]
                limit: {requests: 2, period: 1m}
                scope: Local
              - name: everyone
                limit: {requests: 10, period: 10s, algorithm: FixedWindow}
                scope: Local
            partitionKey: true
            ",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let c = client();
        let resp = c
            .get(sc.url("/"))
            .header("x-user", "user-one-raw-key")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let h = resp.headers();
        let policy = sf_list(h, "ratelimit-policy");
        let names: Vec<_> = policy.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["per-user", "everyone"]);
        assert_eq!(
            (policy[0].int("q"), policy[0].int("w")),
            (Some(2), Some(60))
        );
        assert_eq!(
            (policy[1].int("q"), policy[1].int("w")),
            (Some(10), Some(10))
        );
        let limits = sf_list(h, "ratelimit");
        assert_eq!(limits.len(), 2);
        // Token bucket 2/min, one spent: the next token is at most 30 s away.
        let (r, t) = service_limit(h, "per-user");
        assert_eq!(r, 1);
        assert!(t.is_some_and(|t| (1..=30).contains(&t)), "{t:?}");
        // Fixed window: t is the rest of the window.
        let (r, t) = service_limit(h, "everyone");
        assert_eq!(r, 9);
        assert!(t.is_some_and(|t| (1..=10).contains(&t)), "{t:?}");
        // pk: a byte sequence, the same in both fields, different per user, never the key.
        let pk = |items: &[SfItem], i: usize| match items[i].params.iter().find(|(k, _)| k == "pk")
        {
            Some((_, sfv::BareItem::ByteSequence(b))) => b.clone(),
            other => panic!("pk is not a byte sequence: {other:?}"),
        };
        assert_eq!(pk(&policy, 0), pk(&limits, 0));
        // A key this long cannot turn up in a 16-byte hash's base64 by chance.
        for field in ["ratelimit", "ratelimit-policy"] {
            assert!(!h[field].to_str().unwrap().contains("user-one"), "{field}");
        }
        assert!(!pk(&limits, 0).windows(8).any(|w| w == b"user-one"));
        let again = c
            .get(sc.url("/"))
            .header("x-user", "user-one-raw-key")
            .send()
            .await
            .unwrap();
        let other = c
            .get(sc.url("/"))
            .header("x-user", "user-two-raw-key")
            .send()
            .await
            .unwrap();
        assert_eq!(
            pk(&sf_list(again.headers(), "ratelimit"), 0),
            pk(&limits, 0)
        );
        assert_ne!(
            pk(&sf_list(other.headers(), "ratelimit"), 0),
            pk(&limits, 0)
        );
        // user one's third request: per-user rejects; both rules it reached are listed.
        let resp = c
            .get(sc.url("/"))
            .header("x-user", "user-one-raw-key")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 429);
        let names: Vec<_> = sf_list(resp.headers(), "ratelimit")
            .into_iter()
            .map(|i| i.name)
            .collect();
        assert_eq!(
            names,
            ["per-user"],
            "per-user is first and stops evaluation"
        );
        let retry = header_u64(&resp, "retry-after");
        let (_, t) = service_limit(resp.headers(), "per-user");
        assert!(
            t.is_some_and(|t| (t as u64) <= retry && t <= 30),
            "t={t:?} retry={retry}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_header_profile_sends_what_it_names() {
    within(60, async {
        let up = Upstream::start().await;
        let c = client();
        for profile in ["Draft12", "Draft10", "XRateLimit", "None"] {
            let yaml = policy(
                "profile",
                &format!(
                    "rules:\n  - name: per-key\n    key: [{{header: x-api-key}}]\n    \
                     limit: {{requests: 2, period: 1m}}\n    scope: Local\nheaderProfile: {profile}\n"
                ),
            );
            let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
            let get = || c.get(sc.url("/")).header("x-api-key", "k").send();
            let ok = get().await.unwrap();
            let _ = get().await.unwrap();
            let limited = get().await.unwrap();
            assert_eq!((ok.status().as_u16(), limited.status().as_u16()), (200, 429));
            let retry = header_u64(&limited, "retry-after");
            for (resp, rejected) in [(&ok, false), (&limited, true)] {
                let h = resp.headers();
                let has = |n: &str| h.contains_key(n);
                let draft = matches!(profile, "Draft12" | "Draft10");
                assert_eq!(has("ratelimit-policy"), draft, "{profile}");
                assert_eq!(has("ratelimit"), draft, "{profile}");
                assert_eq!(has("ratelimit-limit"), profile == "Draft10", "{profile}");
                assert_eq!(has("x-ratelimit-limit"), profile == "XRateLimit", "{profile}");
                if draft {
                    service_limit(h, "per-key");
                }
                let prefix = match profile {
                    "Draft10" => "ratelimit-",
                    "XRateLimit" => "x-ratelimit-",
                    _ => continue,
                };
                let num = |n: &str| header_u64(resp, &format!("{prefix}{n}"));
                assert_eq!(num("limit"), 2, "{profile}");
                assert_eq!(num("remaining"), if rejected { 0 } else { 1 }, "{profile}");
                if rejected {
                    assert_eq!(num("reset"), retry, "{profile}: Reset must agree with Retry-After");
                } else {
                    assert!((1..=30).contains(&num("reset")), "{profile}");
                }
            }
            let body: serde_json::Value = limited.json().await.unwrap();
            assert_eq!(body["type"], QUOTA_EXCEEDED, "{profile}: {body}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_of_one_shared_bucket_come_back_at_different_times() {
    within(60, async {
        let up = Upstream::start().await;
        let yaml = policy(
            "shared",
            "rules:\n  - name: everyone\n    limit: {requests: 10, period: 1m}\n    scope: Local\n",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let url = sc.url("/");
        let start = Instant::now();
        assert_eq!(statuses(&client(), &url, &[], 10).await, vec![200; 10]);
        let mut retries: HashMap<u8, u64> = HashMap::new();
        for i in 1..=50u8 {
            let c = client_from([127, 0, 1, i]);
            let resp = c.get(&url).send().await.unwrap();
            assert_eq!(resp.status(), 429, "client {i}");
            // The next token of a 10-per-minute bucket comes 6 s after it was emptied.
            let true_wait = Duration::from_secs(6).saturating_sub(start.elapsed());
            let retry = header_u64(&resp, "retry-after");
            assert!(
                Duration::from_secs(retry) >= true_wait,
                "client {i}: {retry} s < {true_wait:?}"
            );
            retries.insert(i, retry);
        }
        let distinct: HashSet<_> = retries.values().collect();
        assert!(
            distinct.len() >= 5,
            "50 clients, Retry-After values {distinct:?}"
        );
        // Each client's jitter is its own: asking again gives the same answer, less the time
        // that passed (at most a second's rounding).
        for i in [1u8, 17, 50] {
            let resp = client_from([127, 0, 1, i]).get(&url).send().await.unwrap();
            let again = header_u64(&resp, "retry-after");
            assert!(
                (retries[&i] - 1..=retries[&i]).contains(&again),
                "client {i}: {again} then {}",
                retries[&i]
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_503_is_jittered_and_says_what_it_can() {
    within(60, async {
        let up = Upstream::start().await;
        let redis = format!("redis://{}", closed_port().await);
        let yaml = policy(
            "closed",
            "
            rules:
              - name: per-user
                key: [{header: x-user}]
                limit: {requests: 100, period: 1m}
                scope: Local
              - name: logins
                key: [{header: x-user}]
                limit: {requests: 5, period: 15m}
                failureMode: Closed
            ",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &["--redis", &redis]).await;
        let mut retries = HashSet::new();
        for i in 1..=30u8 {
            let c = client_from([127, 0, 2, i]);
            let resp = c
                .get(sc.url("/"))
                .header("x-user", "u")
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 503, "client {i}");
            let retry = header_u64(&resp, "retry-after");
            assert!((1..=3).contains(&retry), "Retry-After {retry}");
            retries.insert(retry);
            let h = resp.headers().clone();
            // The rule decided before the unavailable one reports its state; the unavailable
            // one appears only in RateLimit-Policy (its quota, which cannot be counted now).
            let names = |f| {
                sf_list(&h, f)
                    .into_iter()
                    .map(|i| i.name)
                    .collect::<Vec<_>>()
            };
            assert_eq!(names("ratelimit"), ["per-user"]);
            assert_eq!(names("ratelimit-policy"), ["per-user", "logins"]);
            let body: serde_json::Value = resp.json().await.unwrap();
            assert_eq!(body["type"], REDUCED_CAPACITY, "{body}");
            assert_eq!(body["status"], 503, "{body}");
            assert_eq!(
                body["violated-policies"],
                serde_json::json!(["logins"]),
                "{body}"
            );
            assert_eq!(body["retryAfterSeconds"], retry, "{body}");
        }
        assert!(retries.len() >= 2, "30 clients all told {retries:?}");
    })
    .await;
}
