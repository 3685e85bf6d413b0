//! New keys of a fail-open token bucket admitted ahead of Redis, with real sidecars and a real
//! redis-server: the bound when another sidecar drained the bucket first (at most this
//! sidecar's share, then refusals once its sync round has charged what it spent), the memory
//! of keys below full after their lease is dropped, and the Redis cost of keys seen once.
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

/// 10 a minute, burst 10: two sidecars hold a share of 5 each (leased under `Auto`).
const RULES: &str = "
- name: per-key
  key: [{header: x-api-key}]
  limit: {requests: 10, period: 1m, burst: 10}
  failureMode: Open
";

async fn admitted(c: &reqwest::Client, sc: &Sidecar, key: &str, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        if status_of(c, &sc.url("/"), &[("x-api-key", key)])
            .await
            .as_u16()
            == 200
        {
            ok += 1;
        }
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_drained_elsewhere_gets_at_most_this_sidecars_share_ahead_of_redis() {
    within(90, async {
        let redis = Redis::start();
        let upstream = Upstream::start().await;
        let url = redis.url();
        let args = ["--redis", url.as_str(), "--redis-timeout", "200ms"];
        let p = rules_policy("ahead", RULES);
        let a = Sidecar::start(&upstream.url(), &p, &args).await;
        let b = Sidecar::start(&upstream.url(), &p, &args).await;
        for s in [&a, &b] {
            s.wait_members("test/ahead", 2, Duration::from_secs(20))
                .await;
        }
        let c = client();
        // A drains the key's bucket: its share ahead of Redis, then round trips for the rest.
        let at_a = admitted(&c, &a, "drained", 30).await;
        assert_eq!(
            at_a, 10,
            "the whole burst at the first sidecar, nothing more"
        );
        // B has never seen the key: it admits its share ahead of Redis, no more.
        let at_b = admitted(&c, &b, "drained", 20).await;
        assert!(
            at_b <= 5,
            "B admitted {at_b} of a drained bucket: more than its share"
        );
        // Once B's sync round has charged what it spent, B refuses the key.
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(admitted(&c, &b, "drained", 5).await, 0, "after B's round");
        // After the key's lease is dropped (idle for two rounds), B remembers that the bucket
        // is below full: no admission ahead of Redis again, Redis says no.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            admitted(&c, &b, "drained", 5).await,
            0,
            "after B dropped the lease"
        );
        let m = b.metrics(&c).await;
        let ahead = metric(&m, "tollgate_new_keys_admitted_ahead_total", &[]).unwrap_or(0.0);
        assert_eq!(ahead, 1.0, "one new key admitted ahead at B");
        eprintln!("drained at A: {at_a} admitted; then at B: {at_b} ahead of Redis, then none");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_seen_once_cost_redis_a_batched_call_not_a_round_trip_each() {
    within(90, async {
        let redis = Redis::start();
        let upstream = Upstream::start().await;
        let url = redis.url();
        let args = ["--redis", url.as_str(), "--redis-timeout", "200ms"];
        let p = rules_policy("ahead", RULES);
        let sc = Sidecar::start(&upstream.url(), &p, &args).await;
        sc.wait_members("test/ahead", 1, Duration::from_secs(20))
            .await;
        let c = client();
        let monitor = tollgate_testkit::Monitor::start(redis.port);
        let n: u64 = 500;
        for i in 0..n {
            let s = status_of(&c, &sc.url("/"), &[("x-api-key", &format!("once-{i}"))]).await;
            assert_eq!(s.as_u16(), 200, "key {i}");
        }
        // Every key's cost reaches Redis with the next rounds.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let calls = monitor.counts().get("evalsha").copied().unwrap_or(0);
        assert!(
            calls * 10 <= n,
            "{calls} lease calls for {n} keys seen once: not batched"
        );
        // Each key's bucket in Redis was charged its one token.
        let group_keys = redis.cli(&["KEYS", "*{g*}"]);
        let mut buckets = 0;
        for k in group_keys
            .lines()
            .filter(|l| !l.is_empty() && !l.contains(":b:") && !l.contains(":s:"))
        {
            buckets += redis.cli(&["HLEN", k]).trim().parse::<u64>().unwrap_or(0);
        }
        assert_eq!(buckets, n, "every key's bucket charged in Redis");
        eprintln!("{n} keys seen once: {calls} lease calls");
    })
    .await;
}
