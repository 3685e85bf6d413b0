//! Costs known when the response arrives (`cost.responseHeader`, the LLM-token case), counting
//! only some responses (`count.statuses`, the failed-login case) and `limit.blockFor`, through
//! the real binary; global settlements against a real `redis-server`.
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

/// `r` of the only rule in `RateLimit`.
fn available(resp: &reqwest::Response, rule: &str) -> i64 {
    service_limit(resp.headers(), rule).0
}

async fn tokens(c: &reqwest::Client, url: &str, user: &str, n: u64) -> reqwest::Response {
    c.get(format!("{url}/respond?tokens={n}"))
        .header("x-user", user)
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_header_cost_is_settled_and_can_run_into_debt() {
    within(60, async {
        let up = Upstream::start().await;
        let yaml = rules_policy(
            "llm",
            "
            - name: tokens
              key: [{header: x-user}]
              limit: {requests: 100, period: 1m}
              cost: {responseHeader: x-tokens, max: 1000, reserve: 10}
              scope: Local
            ",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let c = client();
        let base = sc.url("");
        let base = base.trim_end_matches('/');
        // The reservation (10) is what the headers show at admission...
        let first = tokens(&c, base, "u", 40).await;
        assert_eq!(first.status(), 200);
        assert_eq!(available(&first, "tokens"), 90);
        // ...and the next request sees the settled 40, plus its own reservation.
        let second = tokens(&c, base, "u", 40).await;
        assert_eq!(available(&second, "tokens"), 100 - 40 - 10);
        // A response that used less than reserved gives the rest back: 100 − 80 − 2 − 10.
        let third = tokens(&c, base, "u", 2).await;
        assert_eq!(available(&third, "tokens"), 100 - 40 - 40 - 10);
        // 40 + 40 + 2 + 70 = 152 of 100: 52 in debt. The next request waits the debt off
        // plus its reservation: (52 + 10) × 0.6 s ≈ 37 s.
        assert_eq!(tokens(&c, base, "u", 70).await.status(), 200);
        let limited = tokens(&c, base, "u", 1).await;
        assert_eq!(limited.status(), 429);
        let retry = header_u64(&limited, "retry-after");
        assert!(
            (37..=37 + 8).contains(&retry),
            "Retry-After {retry}, expected ~37 s"
        );
        // A value that is not a number keeps the reservation; other users are unaffected.
        let other = c
            .get(format!("{base}/"))
            .header("x-user", "v")
            .send()
            .await
            .unwrap();
        assert_eq!(available(&other, "tokens"), 90);
        let again = c
            .get(format!("{base}/"))
            .header("x-user", "v")
            .send()
            .await
            .unwrap();
        assert_eq!(
            available(&again, "tokens"),
            80,
            "the missing x-tokens kept its 10"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_matching_statuses_count() {
    within(60, async {
        let up = Upstream::start().await;
        let yaml = rules_policy(
            "logins",
            r#"
            - name: failed-logins
              key: [{header: x-user}]
              limit: {requests: 3, period: 15m}
              count: {statuses: [401, 403, "5xx"]}
              scope: Local
            "#,
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let c = client();
        let get = |status: u16| {
            let c = c.clone();
            let url = sc.url(&format!("/respond?status={status}"));
            async move {
                let resp = c.get(url).header("x-user", "mallory").send().await.unwrap();
                resp.status().as_u16()
            }
        };
        // Successful logins never count.
        for _ in 0..10 {
            assert_eq!(get(200).await, 200);
        }
        // Three failures (a 401, a 403, a 503) are admitted and counted...
        assert_eq!(get(401).await, 401);
        assert_eq!(get(403).await, 403);
        assert_eq!(get(503).await, 503);
        // ...so the next attempt is refused, whatever it would have answered.
        assert_eq!(get(200).await, 429);
        // Another user is unaffected.
        let other = c
            .get(sc.url("/respond?status=401"))
            .header("x-user", "alice")
            .send()
            .await
            .unwrap();
        assert_eq!(other.status(), 401);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_for_keeps_rejecting_after_the_bucket_refills() {
    within(60, async {
        let up = Upstream::start().await;
        let yaml = rules_policy(
            "brute",
            "
            - name: attempts
              key: [{header: x-user}]
              limit: {requests: 2, period: 1s, blockFor: 5s}
              scope: Local
            ",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let c = client();
        let url = sc.url("/");
        let key = [("x-user", "mallory")];
        assert_eq!(statuses(&c, &url, &key, 3).await, vec![200, 200, 429]);
        // The bucket refills in a second; the block holds for five.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let resp = c
            .get(&url)
            .header("x-user", "mallory")
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.status(),
            429,
            "blocked key admitted after the bucket refilled"
        );
        let retry = header_u64(&resp, "retry-after");
        let (_, t) = service_limit(resp.headers(), "attempts");
        // 3.5 s of block left (requests during a block do not extend it).
        assert!(
            t.is_some_and(|t| (3..=4).contains(&t)),
            "t={t:?} shows the block"
        );
        assert!((4..=8).contains(&retry), "Retry-After {retry}");
        assert_eq!(status_of(&c, &url, &[("x-user", "alice")]).await, 200);
        tokio::time::sleep(Duration::from_secs(retry)).await;
        assert_eq!(
            status_of(&c, &url, &key).await,
            200,
            "still blocked after Retry-After"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_settlements_reach_redis_with_the_sync_leased_and_strict() {
    within(90, async {
        let redis = Redis::start();
        let url = redis.url();
        let up = Upstream::start().await;
        for accuracy in ["Leased", "Strict"] {
            let yaml = rules_policy(
                &format!("llm-{}", accuracy.to_lowercase()),
                &format!(
                    "
                    - name: tokens
                      key: [{{header: x-user}}]
                      limit: {{requests: 100, period: 10m}}
                      cost: {{responseHeader: x-tokens, max: 1000}}
                      accuracy: {accuracy}
                    "
                ),
            );
            let policy_id = format!("test/llm-{}", accuracy.to_lowercase());
            let a = Sidecar::start(&up.url(), &yaml, &["--redis", &url]).await;
            let b = Sidecar::start(&up.url(), &yaml, &["--redis", &url]).await;
            a.wait_members(&policy_id, 2, Duration::from_secs(15)).await;
            let c = client();
            // Sidecar A's requests report 90 tokens in all (each reserved 1).
            for _ in 0..3 {
                let base = a.url("");
                assert_eq!(
                    tokens(&c, base.trim_end_matches('/'), "u", 30)
                        .await
                        .status(),
                    200
                );
            }
            // Two sync rounds carry A's settlement to Redis.
            tokio::time::sleep(Duration::from_millis(800)).await;
            // Sidecar B spends 5 per request: about 10 tokens are left of 100.
            let mut admitted = 0;
            for _ in 0..40 {
                let base = b.url("");
                let resp = tokens(&c, base.trim_end_matches('/'), "u", 5).await;
                if resp.status() == 429 {
                    break;
                }
                admitted += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            eprintln!("{accuracy}: B admitted {admitted} requests of 5 tokens after A settled 90");
            // Without settlement B would get ~97 admissions (1 reserved each). With it:
            // 10 left, so 2, plus at most a lease batch that B held before A's settlement landed.
            assert!(admitted >= 1, "{accuracy}: the 10 tokens left were lost");
            assert!(
                admitted <= 5,
                "{accuracy}: {admitted} admitted: A's settlement did not reach Redis"
            );
            redis.cli(&["FLUSHALL"]);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_is_given_back_when_a_later_rule_rejects() {
    within(60, async {
        let up = Upstream::start().await;
        let yaml = rules_policy(
            "layers",
            "
            - name: failed-logins
              key: [{header: x-user}]
              limit: {requests: 3, period: 15m}
              count: {statuses: [401]}
              scope: Local
            - name: busy-path
              match: {path: {prefix: /respond}}
              limit: {requests: 2, period: 1m}
              scope: Local
            ",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let c = client();
        let key = [("x-user", "u")];
        // Two pass, five are refused by the second rule: each reserved 1 of failed-logins
        // first, which must come back (else 3 would be gone).
        let s = statuses(&c, &sc.url("/respond?status=200"), &key, 7).await;
        assert_eq!(s, vec![200, 200, 429, 429, 429, 429, 429]);
        // failed-logins still has all 3: three 401s pass (on a path busy-path ignores).
        let s = statuses(&c, &sc.url("/login?status=401"), &key, 3).await;
        assert!(s.iter().all(|&s| s != 429), "{s:?}");
    })
    .await;
}
