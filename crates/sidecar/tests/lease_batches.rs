//! Lease calls in batches, on a real redis-server and a real Redis Cluster: one script call
//! decides up to `MAX_LEASE_BATCH` buckets (a Cluster's per group, which is one hash slot),
//! the replies come back in the order asked, and a bucket asked twice in one batch sees its
//! first grant; the RLQS fleet exchange batches its buckets the same way.
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
use tollgate_global::store::{LeaseOp, MAX_LEASE_BATCH, MAX_SHARE_BATCH, ShareOp, Store};
use tollgate_testkit::{Monitor, RedisCluster};

const TIMEOUT: Duration = Duration::from_secs(5);

/// A token bucket of `burst` tokens (10 per second) in `group`, wanting `want` now.
fn op(group: u32, id: u16, burst: u64, want: u64) -> LeaseOp {
    let mut field = [0u8; 16];
    field[..2].copy_from_slice(&id.to_le_bytes());
    LeaseOp {
        group,
        field,
        algorithm: 1,
        requests: 10,
        period_ms: 1000,
        burst,
        want,
        ..LeaseOp::default()
    }
}

/// `n` ops over `groups` groups; bucket `i` has a burst of `i % 7 + 1` and wants 3, so each
/// reply says which bucket it answers.
fn ops(n: u16, groups: u32) -> Vec<LeaseOp> {
    (0..n)
        .map(|i| op(u32::from(i) % groups, i, u64::from(i % 7) + 1, 3))
        .collect()
}

fn check_in_order(ops: &[LeaseOp], replies: &[tollgate_global::store::LeaseReply]) {
    assert_eq!(replies.len(), ops.len());
    for (o, r) in ops.iter().zip(replies) {
        let expect = o.want.min(o.burst);
        assert_eq!(r.granted, expect, "bucket of burst {}: {r:?}", o.burst);
        assert_eq!(
            r.remaining,
            o.burst - expect,
            "bucket of burst {}: {r:?}",
            o.burst
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_many_buckets_costs_one_script_call_per_batch() {
    within(60, async {
        let redis = Redis::start();
        let store = Store::new(&redis.url(), false, 1024).expect("store");
        store.warm_up(TIMEOUT).await.expect("warm up");
        let monitor = Monitor::start(redis.port);
        let n = 150u16;
        let asked = ops(n, 1024);
        let replies = store.lease_batch(&asked, TIMEOUT).await.expect("lease");
        check_in_order(&asked, &replies);
        // Bucket 0 again, twice in one batch: the second call sees the first one's grant.
        let again = [op(0, 0, 1, 1), op(0, 0, 1, 1)];
        let replies = store.lease_batch(&again, TIMEOUT).await.expect("lease");
        assert_eq!(
            (replies[0].granted, replies[1].granted),
            (0, 0),
            "{replies:?}"
        );
        let fresh = [op(5, 900, 1, 1), op(5, 900, 1, 1)];
        let replies = store.lease_batch(&fresh, TIMEOUT).await.expect("lease");
        assert_eq!(
            (replies[0].granted, replies[1].granted),
            (1, 0),
            "{replies:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let counts = monitor.counts();
        let calls = counts.get("evalsha").copied().unwrap_or(0);
        let batches = (n as usize).div_ceil(MAX_LEASE_BATCH) as u64;
        assert_eq!(
            calls,
            batches + 2,
            "{n} buckets in {batches} calls, then two calls of two: {counts:?}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_decides_a_batch_per_group_and_answers_in_order() {
    within(120, async {
        let cluster = RedisCluster::start(3, 0, Duration::from_secs(5));
        let store = Store::new(&cluster.urls(), true, 8).expect("store");
        // 150 buckets in 8 groups (8 hash slots on 3 masters): 8 groups of 18-19, one call
        // each, answered in the order asked.
        let asked = ops(150, 8);
        let replies = store.lease_batch(&asked, TIMEOUT).await.expect("lease");
        check_in_order(&asked, &replies);
        // Across groups, more than a batch in one group.
        let many: Vec<LeaseOp> = (0..(MAX_LEASE_BATCH as u16 + 10))
            .map(|i| op(3, 1000 + i, 2, 1))
            .chain((0..5).map(|i| op(6, 2000 + i, 2, 2)))
            .collect();
        let replies = store.lease_batch(&many, TIMEOUT).await.expect("lease");
        check_in_order(&many, &replies);
    })
    .await;
}

/// The RLQS fleet exchange: 300 buckets cost one script call per 128, and each bucket's reply
/// holds what the other replica published for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rlqs_exchange_costs_one_script_call_per_batch_of_buckets() {
    within(60, async {
        let redis = Redis::start();
        let store = Store::new(&redis.url(), false, 1).expect("store");
        let ops = |replica_demand: u64| -> Vec<ShareOp> {
            (0..300u64)
                .map(|i| ShareOp {
                    bucket: format!("rule/k{i}"),
                    demand_milli: replica_demand + i,
                    assigned_milli: 2 * i,
                    streams: 1,
                })
                .collect()
        };
        let life = Duration::from_secs(5);
        let first = store
            .share_batch(&ops(1000), "a", life, TIMEOUT)
            .await
            .expect("replica a");
        assert!(first.iter().all(|r| r.demand_milli == 0 && r.streams == 0));
        let monitor = Monitor::start(redis.port);
        let seen = store
            .share_batch(&ops(5000), "b", life, TIMEOUT)
            .await
            .expect("replica b");
        for (i, r) in seen.iter().enumerate() {
            let i = i as u64;
            assert_eq!(
                (r.demand_milli, r.assigned_milli, r.streams),
                (1000 + i, 2 * i, 1),
                "bucket {i}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let counts = monitor.counts();
        let calls =
            counts.get("evalsha").copied().unwrap_or(0) + counts.get("eval").copied().unwrap_or(0);
        assert_eq!(
            calls,
            300usize.div_ceil(MAX_SHARE_BATCH) as u64,
            "{counts:?}"
        );
    })
    .await;
}

/// 100,000 active RLQS buckets over two replicas: what one exchange costs (printed for
/// docs/gateway.md: commands, wall time, Redis CPU from `INFO commandstats`), and that the
/// commands are one per batch and every bucket sees the other replica's figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_rlqs_buckets_exchange_in_batches() {
    within(300, async {
        let redis = Redis::start();
        let store = Store::new(&redis.url(), false, 1).expect("store");
        store.warm_up(TIMEOUT).await.expect("warm up");
        let n = 100_000u64;
        let ops = |base: u64| -> Vec<ShareOp> {
            (0..n)
                .map(|i| ShareOp {
                    bucket: format!("tenant-rule/{i:016x}"),
                    demand_milli: base + i % 1000,
                    assigned_milli: base,
                    streams: 1,
                })
                .collect()
        };
        let (a, b) = (ops(1_000), ops(2_000));
        let life = Duration::from_secs(30);
        let per_exchange = n.div_ceil(MAX_SHARE_BATCH as u64);
        for round in 0..3 {
            for (replica, mine, other) in [("a", &a, 2_000u64), ("b", &b, 1_000u64)] {
                redis.cli(&["CONFIG", "RESETSTAT"]);
                let started = std::time::Instant::now();
                let seen = store
                    .share_batch(mine, replica, life, Duration::from_secs(60))
                    .await
                    .expect("exchange");
                let took = started.elapsed();
                let stats = command_stats(&redis);
                let calls_usec = |name: &str| stats.get(name).copied().unwrap_or((0, 0));
                let (evalsha, usec_sha) = calls_usec("evalsha");
                let (eval, usec_eval) = calls_usec("eval");
                eprintln!(
                    "RLQS exchange, round {round}, replica {replica}: {n} buckets, {} script calls, {:.0} ms, Redis {:.0} ms of CPU ({:.2} µs per bucket)",
                    evalsha + eval,
                    took.as_secs_f64() * 1000.0,
                    (usec_sha + usec_eval) as f64 / 1000.0,
                    (usec_sha + usec_eval) as f64 / n as f64
                );
                assert_eq!(evalsha + eval, per_exchange, "one call per batch");
                if round > 0 || replica == "b" {
                    for (i, r) in seen.iter().enumerate() {
                        assert_eq!(r.assigned_milli, other, "bucket {i}");
                    }
                }
            }
        }
    })
    .await;
}
