//! Every key the Redis scripts write expires, and idle state disappears: against a real
//! `redis-server`, reading each key's TTL and watching Redis empty itself.
//!
//! Expiry is watched with `DBSIZE`, which does not touch keys: what goes away here is removed by
//! Redis' own active expiry, not by the test reading an expired key.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use tollgate_global::store::{LeaseOp, Store};

const TIMEOUT: Duration = Duration::from_secs(5);

fn op(group: u32, id: u8, algorithm: u8, requests: u64, period_ms: u64, want: u64) -> LeaseOp {
    let mut field = [0u8; 16];
    field[0] = id;
    LeaseOp {
        group,
        field,
        algorithm,
        requests,
        period_ms,
        burst: requests,
        want,
        give_back: 0,
        back_window: 0,
        all_or_nothing: false,
        force: 0,
        ahead_ms: 0,
        demand: 0,
        share_ms: 0,
        ..LeaseOp::default()
    }
}

fn keys(redis: &Redis) -> Vec<String> {
    let mut k: Vec<String> = redis
        .cli(&["KEYS", "*"])
        .lines()
        .map(str::to_string)
        .filter(|l| !l.is_empty())
        .collect();
    k.sort();
    k
}

fn dbsize(redis: &Redis) -> u64 {
    redis.cli(&["DBSIZE"]).trim().parse().unwrap_or(u64::MAX)
}

/// Each kind of key (token bucket, sliding window and fixed window groups, membership set)
/// carries a TTL within its documented bound, and all of them are gone once idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_the_scripts_write_expires() {
    within(30, async {
        let redis = Redis::start();
        let store = Store::new(&redis.url(), false, 8).expect("store");
        // 10 per second: a token bucket 5 tokens down refills in 500 ms.
        let ops = [
            op(0, 1, 1, 10, 1000, 5),
            op(1, 2, 2, 10, 1000, 3),
            op(2, 3, 3, 10, 1000, 3),
        ];
        let replies = store.lease_batch(&ops, TIMEOUT).await.expect("lease");
        assert!(replies.iter().all(|r| r.granted > 0), "{replies:?}");
        store
            .heartbeat(
                &["ns/p".into()],
                "sidecar-a",
                Duration::from_secs(1),
                true,
                TIMEOUT,
            )
            .await
            .expect("heartbeat");
        let written_at = Instant::now();

        // (key, type, bound in ms): the lease script keeps a group for its state's life + 1 s,
        // a membership set for twice the registration lifetime.
        let expected = [
            (store.group_key(0), "hash", 500 + 1000),
            (store.group_key(1), "hash", 2 * 1000 + 1000),
            (store.group_key(2), "hash", 1000 + 1000),
        ];
        let all = keys(&redis);
        assert_eq!(all.len(), 4, "one key per kind: {all:?}");
        let members = all
            .iter()
            .find(|k| k.contains("{m}"))
            .expect("a membership key")
            .clone();
        let mut table = Vec::new();
        for (key, kind, bound) in expected
            .iter()
            .map(|(k, t, b)| (k.clone(), *t, *b))
            .chain([(members, "zset", 2 * 1000)])
        {
            assert_eq!(redis.cli(&["TYPE", &key]).trim(), kind, "{key}");
            let pttl: i64 = redis.cli(&["PTTL", &key]).trim().parse().expect("PTTL");
            assert!(pttl > 0, "{key} has no TTL ({pttl}): it would live forever");
            assert!(
                pttl <= bound,
                "{key}: PTTL {pttl} ms over its bound {bound} ms"
            );
            table.push(format!("{key} {kind} PTTL {pttl} ms (bound {bound} ms)"));
        }
        eprintln!("EXPIRY keys written: {}", table.join("; "));

        // Active expiry removes them all without anyone reading them.
        let gone = poll_until(Duration::from_secs(6), "Redis empties itself", || async {
            (dbsize(&redis) == 0).then(|| written_at.elapsed())
        })
        .await;
        eprintln!(
            "EXPIRY all idle keys gone {} ms after the last write",
            gone.as_millis()
        );
        assert!(gone <= Duration::from_millis(3000 + 1000), "{gone:?}");
    })
    .await;
}

/// A group that stays alive (one long-lived bucket in it) still sheds its idle buckets: hash
/// fields have no TTL, so the script's sweep must drop them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_buckets_leave_a_live_group() {
    within(30, async {
        let redis = Redis::start();
        let store = Store::new(&redis.url(), false, 1).expect("store");
        let short: Vec<LeaseOp> = (0..100).map(|i| op(0, i, 1, 10, 200, 1)).collect();
        store.lease_batch(&short, TIMEOUT).await.expect("lease");
        let long = op(0, 200, 1, 10, 3_600_000, 1);
        store
            .lease_batch(std::slice::from_ref(&long), TIMEOUT)
            .await
            .expect("lease");
        let group = store.group_key(0);
        assert_eq!(redis.cli(&["HLEN", &group]).trim(), "101");
        // The short buckets are full again after 20 ms; the long one keeps the group alive.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut calls = 0;
        let mut look = long.clone();
        look.want = 0;
        while redis.cli(&["HLEN", &group]).trim() != "1" {
            assert!(calls < 1000, "idle buckets still there after {calls} calls");
            store
                .lease_batch(&[look.clone()], TIMEOUT)
                .await
                .expect("lease");
            calls += 1;
        }
        let pttl: i64 = redis.cli(&["PTTL", &group]).trim().parse().expect("PTTL");
        assert!(pttl > 0, "the live group has no TTL");
        eprintln!("EXPIRY 100 idle buckets swept from a live group after {calls} script calls");
    })
    .await;
}

/// End to end: a sidecar that served 50 keys of a global rule and then stopped leaves nothing in
/// Redis once the buckets' state has run out (it returns what it leased and deregisters).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_sidecar_leaves_redis_empty() {
    within(60, async {
        let redis = Redis::start();
        let upstream = Upstream::start().await;
        let p = policy(
            "ttl",
            "rules:\n  - name: per-key\n    key: [{header: x-api-key}]\n    limit: {requests: 20, period: 1s}\n",
        );
        let url = redis.url();
        let mut sc = Sidecar::start(
            &upstream.url(),
            &p,
            &["--redis", &url, "--membership-ttl", "1s"],
        )
        .await;
        let c = client();
        for i in 0..50 {
            let s = status_of(&c, &sc.url("/"), &[("x-api-key", &format!("k{i}"))]).await;
            assert_eq!(s.as_u16(), 200);
        }
        poll_until(Duration::from_secs(5), "buckets in Redis", || async {
            (dbsize(&redis) >= 2).then_some(())
        })
        .await;
        for key in keys(&redis) {
            let pttl: i64 = redis.cli(&["PTTL", &key]).trim().parse().expect("PTTL");
            // -2: already gone (the sidecar gave its lease back and the bucket emptied).
            assert!(pttl > 0 || pttl == -2, "{key} has no TTL ({pttl})");
        }
        sc.terminate();
        sc.wait_exit(Duration::from_secs(10)).await;
        let stopped = Instant::now();
        poll_until(Duration::from_secs(6), "Redis empty after the sidecar stopped", || async {
            (dbsize(&redis) == 0).then_some(())
        })
        .await;
        eprintln!(
            "EXPIRY sidecar stopped -> Redis empty after {} ms",
            stopped.elapsed().as_millis()
        );
    })
    .await;
}

/// A contested token bucket keeps the fleet's reported demand in a second field of its group,
/// grants each call its entitlement by it, and the field goes with the bucket once the
/// bucket is full again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contested_buckets_demand_is_split_and_then_forgotten() {
    within(30, async {
        let redis = Redis::start();
        let store = Store::new(&redis.url(), false, 1).expect("store");
        // 100 per second (one token every 10 ms), burst 10.
        let contested = |want: u64, demand: u64| {
            let mut o = op(0, 7, 1, 100, 1000, want);
            o.burst = 10;
            o.ahead_ms = 500;
            o.demand = demand;
            o.share_ms = 250;
            o
        };
        let lease = |o: LeaseOp| {
            let store = &store;
            async move {
                store
                    .lease_batch(std::slice::from_ref(&o), TIMEOUT)
                    .await
                    .expect("lease")[0]
            }
        };
        let group = store.group_key(0);
        // Uncontested: the whole burst, no demand kept.
        assert_eq!(lease(contested(10, 10)).await.granted, 10);
        assert_eq!(redis.cli(&["HLEN", &group]).trim(), "1");
        // The first sidecar to report is all of the demand seen: it may reserve its horizon.
        assert_eq!(lease(contested(20, 90)).await.granted, 20);
        assert_eq!(redis.cli(&["HLEN", &group]).trim(), "2", "the demand field");
        // A sidecar with a tenth of the demand (this report included) is entitled to a
        // tenth of the refill the fleet's demand leaves it, not all it asks for: the demand
        // of the contest's first share period (100) extrapolated to the 1 s demand window is
        // 400, so 100 tokens of refill × 10 / 400 = 2.5 (the half token granted by chance).
        let small = lease(contested(30, 10)).await;
        assert!(
            (2..=3).contains(&small.granted),
            "a tenth of the demand got {small:?}"
        );
        // Full again (everything granted is due within 0.6 s): the next call drops both fields.
        tokio::time::sleep(Duration::from_millis(800)).await;
        lease(contested(0, 0)).await;
        assert_eq!(dbsize(&redis), 0, "{:?}", keys(&redis));
    })
    .await;
}
