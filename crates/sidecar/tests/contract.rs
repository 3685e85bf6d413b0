//! The response contract: the 429 header by header, RateLimit headers on admitted responses,
//! shadow mode, bypass lists and several rules at once.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;

/// One rule, `per-key`, limiting each `x-api-key` value; `extra` is appended to the spec
/// unindented (e.g. `responseHeaders: Rejected`).
fn per_key_policy(requests: u64, period: &str, extra: &str) -> String {
    let rules = dedent(&format!(
        "
        rules:
          - name: per-key
            key:
              - header: x-api-key
            limit:
              requests: {requests}
              period: {period}
            scope: Local
        "
    ));
    policy("contract", &format!("{rules}\n{extra}\n"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejection_carries_the_full_429_contract() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &per_key_policy(3, "1m", ""), &[]).await;
        let c = client();
        let url = sc.url("/things");
        let first = Instant::now();
        for i in 0..3 {
            let status = status_of(&c, &url, &[("x-api-key", "alice")]).await;
            assert_eq!(status, 200, "request {i} within the limit");
        }
        let resp = c
            .get(&url)
            .header("x-api-key", "alice")
            .send()
            .await
            .unwrap();
        let elapsed = first.elapsed();
        assert_eq!(resp.status(), 429);
        assert_eq!(header(&resp, "content-type"), "application/problem+json");
        // Token bucket, 3 per minute: the next token comes 20 s after the burst began.
        let real_wait = Duration::from_secs(20).saturating_sub(elapsed);
        let retry = header_u64(&resp, "retry-after");
        assert!(
            Duration::from_secs(retry) >= real_wait,
            "retry-after {retry}s is earlier than the real wait {real_wait:?}"
        );
        // At most the real wait rounded up plus the 20 % jitter.
        assert!(
            retry <= 20 + 4,
            "retry-after {retry}s is far beyond the real wait"
        );
        // The draft's fields: `t` on a 429 is the wait, which Retry-After never undercuts.
        let t = Duration::from_secs(20)
            .saturating_sub(elapsed)
            .as_secs_f64()
            .ceil() as u64;
        assert!(t <= retry);
        assert_eq!(header(&resp, "ratelimit-policy"), "\"per-key\";q=3;w=60");
        let limit = header(&resp, "ratelimit");
        assert!(
            [t, t + 1]
                .iter()
                .any(|t| limit == format!("\"per-key\";r=0;t={t}")),
            "RateLimit {limit:?}, expected t={t}"
        );
        assert!(
            resp.headers().get("ratelimit-limit").is_none(),
            "legacy field in the default profile"
        );
        assert_eq!(header(&resp, "cache-control"), "no-store");
        let body: serde_json::Value = resp.json().await.expect("problem+json body");
        assert!(
            body["type"].as_str().is_some_and(|t| !t.is_empty()),
            "{body}"
        );
        assert_eq!(
            body["type"], "https://iana.org/assignments/http-problem-types#quota-exceeded",
            "{body}"
        );
        assert_eq!(
            body["violated-policies"],
            serde_json::json!(["per-key"]),
            "{body}"
        );
        assert_eq!(body["status"], 429, "{body}");
        let detail = body["detail"].as_str().expect("detail");
        assert!(
            detail.contains("per-key"),
            "detail does not name the rule: {detail}"
        );
        assert!(
            detail.contains("3 requests per minute"),
            "detail does not state the limit: {detail}"
        );
        assert_eq!(body["retryAfterSeconds"], retry, "{body}");
        // Another client key is unaffected.
        assert_eq!(status_of(&c, &url, &[("x-api-key", "bob")]).await, 200);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_long_enough_to_be_admitted() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &per_key_policy(1, "2s", ""), &[]).await;
        let c = client();
        let url = sc.url("/");
        assert_eq!(status_of(&c, &url, &[("x-api-key", "k")]).await, 200);
        let resp = c.get(&url).header("x-api-key", "k").send().await.unwrap();
        assert_eq!(resp.status(), 429);
        let retry = header_u64(&resp, "retry-after");
        assert!(
            // The 2 s wait plus a jitter of up to MIN_SPREAD_SECS (4).
            (2..=6).contains(&retry),
            "retry-after {retry} for a 1-per-2s limit"
        );
        // Waiting exactly as long as told must be enough.
        tokio::time::sleep(Duration::from_secs(retry)).await;
        assert_eq!(status_of(&c, &url, &[("x-api-key", "k")]).await, 200);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_jitter_is_stable_per_key_and_spread_across_keys() {
    within(120, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(
            &up.url(),
            &per_key_policy(100, "1h", ""),
            &["--audit-per-second", "1"],
        )
        .await;
        let c = client();
        let url = sc.url("/");

        // 50 keys, each exhausted (100 admitted, then rejected), 5 keys at a time.
        let mut first_retry = Vec::new();
        for batch in 0..10 {
            let mut tasks = Vec::new();
            for k in 0..5 {
                let (c, url) = (c.clone(), url.clone());
                let key = format!("key-{batch}-{k}");
                tasks.push(tokio::spawn(async move {
                    for i in 0..100 {
                        let s = status_of(&c, &url, &[("x-api-key", &key)]).await;
                        assert_eq!(s, 200, "{key} request {i}");
                    }
                    let resp = c.get(&url).header("x-api-key", &key).send().await.unwrap();
                    assert_eq!(resp.status(), 429, "{key} after 100 requests");
                    header_u64(&resp, "retry-after")
                }));
            }
            for t in tasks {
                first_retry.push(t.await.expect("key task"));
            }
        }
        // 100 per hour: one token every 36 s; jitter adds up to 20 % (7 s).
        for r in &first_retry {
            assert!(
                (30..=44).contains(r),
                "retry-after {r} outside 36 s + jitter"
            );
        }
        let distinct: HashSet<u64> = first_retry.iter().copied().collect();
        assert!(
            distinct.len() >= 2,
            "50 keys rejected together all got the same Retry-After: {first_retry:?}"
        );

        // One key asked repeatedly gets the same answer: only the limiter's wait (rounded up to
        // a second) moves it, so over ten quick requests it changes at most once, by one second.
        let mut repeated = Vec::new();
        for _ in 0..10 {
            let resp = c
                .get(&url)
                .header("x-api-key", "key-0-0")
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 429);
            repeated.push(header_u64(&resp, "retry-after"));
        }
        let changes = repeated.windows(2).filter(|w| w[0] != w[1]).count();
        let spread = repeated.iter().max().unwrap() - repeated.iter().min().unwrap();
        assert!(
            changes <= 1 && spread <= 1,
            "Retry-After for one key is not deterministic: {repeated:?}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admitted_responses_report_decreasing_remaining() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &per_key_policy(5, "1m", ""), &[]).await;
        let c = client();
        let mut remaining = Vec::new();
        for _ in 0..4 {
            let resp = c
                .get(sc.url("/"))
                .header("x-api-key", "a")
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(header(&resp, "ratelimit-policy"), "\"per-key\";q=5;w=60");
            // 5 per minute: the next token is at most 12 s away.
            let (r, t) = service_limit(resp.headers(), "per-key");
            assert!(t.is_some_and(|t| (1..=12).contains(&t)), "t={t:?}");
            assert!(
                resp.headers().get("retry-after").is_none(),
                "retry-after on a 200"
            );
            remaining.push(r);
        }
        assert_eq!(remaining, vec![4, 3, 2, 1]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_headers_rejected_keeps_admitted_responses_clean() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(
            &up.url(),
            &per_key_policy(2, "1m", "responseHeaders: Rejected"),
            &[],
        )
        .await;
        let c = client();
        for _ in 0..2 {
            let resp = c
                .get(sc.url("/"))
                .header("x-api-key", "a")
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            for h in [
                "ratelimit-limit",
                "ratelimit-remaining",
                "ratelimit-reset",
                "ratelimit-policy",
                "ratelimit",
            ] {
                assert!(
                    resp.headers().get(h).is_none(),
                    "{h} on an admitted response"
                );
            }
        }
        let resp = c
            .get(sc.url("/"))
            .header("x-api-key", "a")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 429);
        assert_eq!(service_limit(resp.headers(), "per-key").0, 0);
        assert_eq!(header(&resp, "ratelimit-policy"), "\"per-key\";q=2;w=60");
        assert!(resp.headers().get("retry-after").is_some());
    })
    .await;
}

fn shadow_policy() -> String {
    policy(
        "shadow",
        "
        rules:
          - name: would-limit
            limit:
              requests: 2
              period: 1m
            scope: Local
            mode: Shadow
        ",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_rules_count_but_never_reject() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &shadow_policy(), &[]).await;
        let c = client();
        for i in 0..10 {
            let resp = c.get(sc.url("/")).send().await.unwrap();
            assert_eq!(resp.status(), 200, "shadow rule rejected request {i}");
            assert!(
                resp.headers().get("tollgate-shadow-rejected").is_none(),
                "shadow header without --shadow-header"
            );
        }
        assert_eq!(up.hits(), 10, "every request reaches the app");
        let m = sc.metrics(&c).await;
        let shadow = metric(
            &m,
            "tollgate_requests_total",
            &[("rule", "would-limit"), ("decision", "shadow_rejected")],
        )
        .expect("shadow_rejected series");
        assert_eq!(shadow, 8.0, "2 of 10 fit the shadow limit:\n{m}");
        let rejected = metric(
            &m,
            "tollgate_requests_total",
            &[("rule", "would-limit"), ("decision", "rejected")],
        );
        assert_eq!(rejected, Some(0.0));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_header_marks_would_be_rejections() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &shadow_policy(), &["--shadow-header"]).await;
        let c = client();
        let mut marks = Vec::new();
        for _ in 0..4 {
            let resp = c.get(sc.url("/")).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            marks.push(
                resp.headers()
                    .get("tollgate-shadow-rejected")
                    .map(|v| v.to_str().unwrap().to_string()),
            );
        }
        assert_eq!(marks, vec![None, None, Some("1".into()), Some("1".into())]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bypass_keys_are_never_limited() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(
            &up.url(),
            &per_key_policy(2, "1m", "bypass:\n  keys: [internal-batch]"),
            &[],
        )
        .await;
        let c = client();
        let url = sc.url("/");
        let s = statuses(&c, &url, &[("x-api-key", "internal-batch")], 20).await;
        assert!(s.iter().all(|&s| s == 200), "bypass key limited: {s:?}");
        let s = statuses(&c, &url, &[("x-api-key", "customer")], 3).await;
        assert_eq!(s, vec![200, 200, 429], "other keys are still limited");
        let m = sc.metrics(&c).await;
        let bypassed = metric(&m, "tollgate_requests_total", &[("decision", "bypassed")]).unwrap();
        assert_eq!(bypassed, 20.0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bypass_cidrs_are_never_limited() {
    within(60, async {
        let up = Upstream::start().await;
        // Two policies that differ only in their bypass network: the loopback client is exempt
        // from the first and limited by the second.
        let yaml = format!(
            "{}---\n{}",
            policy(
                "loopback-exempt",
                "
                rules:
                  - name: a
                    match:
                      path:
                        prefix: /a
                    limit:
                      requests: 2
                      period: 1m
                    scope: Local
                bypass:
                  cidrs: [127.0.0.0/8]
                "
            ),
            policy(
                "private-exempt",
                "
                rules:
                  - name: b
                    match:
                      path:
                        prefix: /b
                    limit:
                      requests: 2
                      period: 1m
                    scope: Local
                bypass:
                  cidrs: [10.0.0.0/8]
                "
            )
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let c = client();
        let s = statuses(&c, &sc.url("/a"), &[], 20).await;
        assert!(
            s.iter().all(|&s| s == 200),
            "bypassed network limited: {s:?}"
        );
        let s = statuses(&c, &sc.url("/b"), &[], 3).await;
        assert_eq!(s, vec![200, 200, 429]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rule_must_admit_and_every_rule_is_reported() {
    within(60, async {
        let up = Upstream::start().await;
        let yaml = policy(
            "layers",
            "
            rules:
              - name: per-user
                key:
                  - header: x-user
                limit:
                  requests: 2
                  period: 1m
                scope: Local
              - name: everyone
                limit:
                  requests: 4
                  period: 1m
                scope: Local
            ",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let c = client();
        let get = |user: &'static str| {
            let c = c.clone();
            let url = sc.url("/");
            async move {
                let resp = c.get(url).header("x-user", user).send().await.unwrap();
                let status = resp.status().as_u16();
                let listed: Vec<(String, i64)> = sf_list(resp.headers(), "ratelimit")
                    .into_iter()
                    .map(|i| (i.name.clone(), i.int("r").unwrap_or(-1)))
                    .collect();
                (status, listed)
            }
        };
        let both = |u: i64, e: i64| vec![("per-user".to_string(), u), ("everyone".to_string(), e)];
        // Every rule that admitted the request is listed, in rule order.
        assert_eq!(get("u1").await, (200, both(1, 3)));
        assert_eq!(get("u1").await, (200, both(0, 2)));
        // u1's own bucket is empty: rejected by per-user, the first rule (evaluation stops).
        assert_eq!(get("u1").await, (429, vec![("per-user".to_string(), 0)]));
        assert_eq!(get("u2").await, (200, both(1, 1)));
        assert_eq!(get("u2").await.0, 200);
        // u3 has a full per-user bucket but the shared rule is exhausted: both are listed.
        assert_eq!(get("u3").await, (429, both(1, 0)));
    })
    .await;
}
