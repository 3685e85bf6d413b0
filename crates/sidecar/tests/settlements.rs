//! Costs settled at the response against a real `redis-server`: a settlement is charged once
//! even when the call carrying it timed out after reaching Redis, a refund clears a refusal
//! remembered in exact mode, and costs settled while Redis is down are charged when it is back.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;

/// These tests time Redis round trips: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A rule whose cost is the app's `x-tokens` header: 100 tokens per 10 minutes (6 s a token),
/// a burst of `burst`.
fn tokens_rule(name: &str, burst: u64, accuracy: &str, failure: &str) -> String {
    rules_policy(
        name,
        &format!(
            "
            - name: tokens
              key: [{{header: x-user}}]
              limit: {{requests: 100, period: 10m, burst: {burst}}}
              cost: {{responseHeader: x-tokens, max: 1000}}
              accuracy: {accuracy}
              failureMode: {failure}
            "
        ),
    )
}

/// Microseconds per token of [`tokens_rule`].
const TOKEN_US: f64 = 6_000_000.0;

/// Tokens taken from every token bucket in Redis, read from the buckets' GCRA state (the
/// theoretical arrival time, `tokens × 6 s` ahead of Redis' clock for a bucket of 6 s a token).
fn tokens_taken(redis: &Redis) -> f64 {
    let time: Vec<f64> = redis
        .cli(&["TIME"])
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let now_us = time[0] * 1e6 + time[1];
    let mut taken = 0.0;
    for key in redis.cli(&["--scan", "--pattern", "tg:{g*}"]).lines() {
        if key.contains(":b:") || key.contains(":s:") {
            continue;
        }
        let values = redis.cli(&["HVALS", key.trim()]);
        for v in values.lines() {
            if let Ok(tat) = v.trim().parse::<f64>() {
                taken += ((tat - now_us) / TOKEN_US).max(0.0);
            }
        }
    }
    taken
}

async fn tokens(c: &reqwest::Client, base: &str, user: &str, n: u64) -> u16 {
    c.get(format!("{base}/respond?tokens={n}"))
        .header("x-user", user)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// A settlement whose call timed out after Redis applied it is sent again under its id, and
/// Redis applies it once: before, the debt was restored and charged again at every sync round
/// that timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_that_timed_out_after_reaching_redis_is_charged_once() {
    within(120, async {
        let _serial = SERIAL.lock().await;
        let redis = Redis::start();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (relay, _relay_task) = delaying_relay(redis.port, delay_ms.clone()).await;
        let relay_url = format!("redis://127.0.0.1:{relay}");
        let up = Upstream::start().await;
        for accuracy in ["Leased", "Strict"] {
            let name = format!("once-{}", accuracy.to_lowercase());
            let s = Sidecar::start(
                &up.url(),
                // A burst of 30: the response's 30 tokens empty the bucket, so lease calls
                // during the test grant nothing and only settlements move it.
                &tokens_rule(&name, 30, accuracy, "Open"),
                &["--redis", &relay_url, "--redis-timeout", "2s", "--sync-timeout", "100ms"],
            )
            .await;
            let c = client();
            let base = s.url("");
            let base = base.trim_end_matches('/');
            // Each chunk is delayed 70 ms each way: a call reaches Redis after 70 ms and its
            // answer comes back after 140, past the 100 ms sync timeout.
            delay_ms.store(70, Ordering::Relaxed);
            assert_eq!(tokens(&c, base, "u", 30).await, 200);
            // The settlement of 29 (30 less the reservation) goes out with the syncs, which
            // time out for a second and a half.
            tokio::time::sleep(Duration::from_millis(1500)).await;
            delay_ms.store(0, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let taken = tokens_taken(&redis);
            let m = s.metrics(&c).await;
            let leased = metric(&m, "tollgate_tokens_leased_total", &[]).unwrap_or(0.0);
            let returned = metric(&m, "tollgate_tokens_returned_total", &[]).unwrap_or(0.0);
            eprintln!("{accuracy}: {taken:.2} tokens taken for one response of 30 (leased {leased}, returned {returned})");
            assert!(
                (29.0..=31.0).contains(&taken),
                "{accuracy}: {taken:.2} tokens taken for one response of 30 (charged more than once?)"
            );
            drop(s);
            redis.cli(&["FLUSHALL"]);
        }
    })
    .await;
}

/// Exact mode remembers a refusal until the retry time Redis gave; a refund (here: responses
/// whose status does not count) puts tokens back, and the next request is decided by Redis
/// again instead of refused from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_clears_a_refusal_remembered_in_exact_mode() {
    within(60, async {
        let _serial = SERIAL.lock().await;
        let redis = Redis::start();
        let up = Upstream::start().await;
        let yaml = rules_policy(
            "logins",
            "
            - name: failed
              key: [{header: x-user}]
              limit: {requests: 2, period: 10m}
              count: {statuses: [401]}
              accuracy: Strict
            ",
        );
        let s = Sidecar::start(
            &up.url(),
            &yaml,
            &["--redis", &redis.url(), "--redis-timeout", "1s"],
        )
        .await;
        let c = client();
        // Two requests in flight reserve the two tokens.
        let held: Vec<_> = (0..2)
            .map(|_| {
                let req = c.get(s.url("/hold")).header("x-user", "u").send();
                tokio::spawn(req)
            })
            .collect();
        poll_until(
            Duration::from_secs(5),
            "two requests held upstream",
            || async { (up.in_flight() == 2).then_some(()) },
        )
        .await;
        // A third is refused by Redis, and the refusal is remembered (retry in 5 minutes).
        assert_eq!(
            status_of(&c, &s.url("/"), &[("x-user", "u")])
                .await
                .as_u16(),
            429
        );
        // Both held requests succeed (200 does not count): their reservations are refunded.
        up.release();
        for h in held {
            assert_eq!(h.await.unwrap().unwrap().status().as_u16(), 200);
        }
        // The refunds reach Redis off the request path.
        let admitted = poll_until(
            Duration::from_secs(3),
            "a request admitted after the refunds",
            || async {
                let status = status_of(&c, &s.url("/"), &[("x-user", "u")])
                    .await
                    .as_u16();
                tokio::time::sleep(Duration::from_millis(50)).await;
                (status == 200).then_some(status)
            },
        )
        .await;
        assert_eq!(admitted, 200);
    })
    .await;
}

/// Costs settled at the response while Redis is down: the fail-open fallback takes them (its
/// share honours the real cost), and Redis is charged when it is back instead of never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn costs_settled_while_redis_is_down_are_charged_when_it_is_back() {
    within(120, async {
        let _serial = SERIAL.lock().await;
        for accuracy in ["Leased", "Strict"] {
            let mut redis = Redis::start();
            let port = redis.port;
            let up = Upstream::start().await;
            let name = format!("outage-{}", accuracy.to_lowercase());
            let s = Sidecar::start(
                &up.url(),
                &tokens_rule(&name, 100, accuracy, "Open"),
                &["--redis", &redis.url(), "--redis-timeout", "200ms"],
            )
            .await;
            let c = client();
            let base = s.url("");
            let base = base.trim_end_matches('/');
            assert_eq!(tokens(&c, base, "warm", 1).await, 200);
            redis.kill();
            // Open the breaker with another key: from then on the fallback decides.
            poll_until(Duration::from_secs(5), "the breaker open", || async {
                tokens(&c, base, "other", 1).await;
                let m = s.metrics(&c).await;
                (metric(&m, "tollgate_redis_breaker_open", &[]) == Some(1.0)).then_some(())
            })
            .await;
            // The fallback's share is the whole limit (one sidecar): 100 tokens. Responses of
            // 30 tokens: the fourth takes it to 120, so the fifth and sixth are refused.
            let mut statuses = Vec::new();
            for _ in 0..6 {
                statuses.push(tokens(&c, base, "u", 30).await);
            }
            eprintln!("{accuracy}: during the outage {statuses:?}");
            assert_eq!(
                statuses.iter().filter(|s| **s == 200).count(),
                4,
                "{accuracy}: the fallback must honour the settled costs: {statuses:?}"
            );
            let _back = Redis::start_on(port, &[]);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let taken = tokens_taken(&_back);
            eprintln!("{accuracy}: {taken:.2} tokens charged to Redis after the outage");
            // Four admitted responses settled 29 each beyond their reservation (which the
            // fallback admitted without Redis); the refused ones cost nothing.
            assert!(
                (115.0..=118.0).contains(&taken),
                "{accuracy}: {taken:.2} tokens charged after the outage, 116 settled during it"
            );
        }
    })
    .await;
}
