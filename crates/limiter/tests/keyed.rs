//! Behaviour of the keyed store: seed examples end to end, independence of keys, the memory
//! cap and overflow, idle eviction, concurrency permits, and use from several threads.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate_limiter::{
    Algorithm, Clock, FakeClock, KeyedLimiter, Limit, LimitError, MILLISECOND, MIN_SCAN_INTERVAL,
    NEVER, Permit, SECOND, StoreConfig,
};

fn limiter(q: Limit) -> KeyedLimiter {
    KeyedLimiter::new(q, StoreConfig::default())
}

fn admitted(l: &KeyedLimiter, key: &[u8], now: u64, n: usize) -> usize {
    (0..n).filter(|_| l.check(key, now, 1).allowed).count()
}

#[test]
fn seed_examples_through_the_store() {
    let clock = FakeClock::new(42 * SECOND);

    // Sliding window, 10/s: 10 of 15 immediate requests pass; halfway into the next window
    // only 5 more.
    let sw = limiter(Limit::per_period(Algorithm::SlidingWindow, 10, SECOND).unwrap());
    assert_eq!(admitted(&sw, b"client", clock.now(), 15), 10);
    clock.advance(SECOND + SECOND / 2);
    assert_eq!(admitted(&sw, b"client", clock.now(), 15), 5);

    // Token bucket, capacity 5, refill 2/s: 10 immediate -> 5; after 1 s exactly 2; after a
    // long idle the bucket caps at 5.
    let tb = limiter(Limit::new(Algorithm::TokenBucket, 2, SECOND, 5, 0).unwrap());
    let t0 = clock.now();
    assert_eq!(admitted(&tb, b"client", t0, 10), 5);
    assert_eq!(admitted(&tb, b"client", t0 + SECOND, 10), 2);
    assert_eq!(admitted(&tb, b"client", t0 + 3_600 * SECOND, 10), 5);

    // Fixed window: the full limit at the end of one window and again at the start of the
    // next, i.e. 2x within 2 ms (the documented flaw).
    let fw = limiter(Limit::per_period(Algorithm::FixedWindow, 10, SECOND).unwrap());
    assert_eq!(admitted(&fw, b"client", 100 * SECOND - MILLISECOND, 15), 10);
    assert_eq!(admitted(&fw, b"client", 100 * SECOND + MILLISECOND, 15), 10);
}

#[test]
fn keys_are_independent_and_headers_are_filled() {
    let l = limiter(Limit::per_period(Algorithm::FixedWindow, 3, SECOND).unwrap());
    assert_eq!(admitted(&l, b"a", 0, 5), 3);
    assert_eq!(admitted(&l, b"b", 0, 5), 3);
    assert_eq!(admitted(&l, b"", 0, 5), 3, "the empty key is a key too");
    let d = l.check(b"a", 250 * MILLISECOND, 1);
    assert!(!d.allowed);
    assert_eq!((d.limit, d.remaining), (3, 0));
    assert_eq!(d.reset, 750 * MILLISECOND);
    assert_eq!(d.retry_after, 750 * MILLISECOND);
    assert_eq!(l.len(), 3);
}

#[test]
fn leaky_bucket_delay_through_the_store() {
    let q = Limit::new(Algorithm::LeakyBucket, 10, SECOND, 1, 250 * MILLISECOND).unwrap();
    let l = limiter(q);
    let delays: Vec<_> = (0..4).map(|_| l.check(b"k", 0, 1)).collect();
    assert_eq!(
        delays
            .iter()
            .map(|d| (d.allowed, d.delay))
            .collect::<Vec<_>>(),
        vec![
            (true, 0),
            (true, 100 * MILLISECOND),
            (true, 200 * MILLISECOND),
            (false, 0)
        ]
    );
}

/// At the cap: existing keys keep their own state; new keys share one overflow state per
/// shard (so a flood cannot grow memory or get more than one limit between them); idle
/// entries are evicted to make room once they can be.
#[test]
fn at_capacity_new_keys_share_the_overflow_state() {
    let q = Limit::new(Algorithm::TokenBucket, 1, SECOND, 2, 0).unwrap();
    let cfg = StoreConfig {
        max_keys: 4,
        idle_ttl: 0,
        shards: 1,
    };
    let l = KeyedLimiter::new(q, cfg);
    assert_eq!((l.capacity(), l.shards()), (4, 1));
    let t = 10 * SECOND;
    for k in 0..4u8 {
        assert!(l.check(&[k], t, 1).allowed);
    }
    assert_eq!(l.len(), 4);
    assert_eq!(l.overflow_decisions(), 0);

    // A flood of new keys: together they get one bucket (2), not 2 each.
    let flood = (100..200u8)
        .filter(|k| l.check(&[*k], t, 1).allowed)
        .count();
    assert_eq!(flood, 2);
    assert_eq!(l.overflow_decisions(), 100);
    assert_eq!(l.len(), 4, "memory did not grow");

    // Existing keys are unaffected: each still has exactly its one remaining token.
    for k in 0..4u8 {
        assert!(l.check(&[k], t, 1).allowed);
        assert!(!l.check(&[k], t, 1).allowed);
    }

    // Once the old entries are idle (full again: 2 s at 1/s) and the scan interval passed,
    // a new key evicts them and gets its own state.
    let later = t + 2 * SECOND + MIN_SCAN_INTERVAL;
    assert!(l.check(b"new", later, 1).allowed);
    assert_eq!(l.overflow_decisions(), 100);
    assert_eq!(l.len(), 1);
}

/// A full shard is rescanned for idle entries at most every `MIN_SCAN_INTERVAL`, so a flood
/// of new keys cannot force an O(shard) scan per request.
#[test]
fn overflow_scan_is_rate_limited() {
    let q = Limit::new(Algorithm::TokenBucket, 1, SECOND, 1, 0).unwrap();
    let l = KeyedLimiter::new(
        q,
        StoreConfig {
            max_keys: 2,
            idle_ttl: 0,
            shards: 1,
        },
    );
    let ms = MILLISECOND;
    assert!(l.check(b"a", 0, 1).allowed); // idle from 1 s
    assert!(l.check(b"b", 50 * ms, 1).allowed); // idle from 1.05 s
    // Nothing can be idle before 1 s: no scan, straight to overflow.
    assert!(l.check(b"x", 500 * ms, 1).allowed);
    assert_eq!(l.overflow_decisions(), 1);
    // At 1 s the scan evicts "a"; "c" gets its own entry.
    assert!(l.check(b"c", 1_000 * ms, 1).allowed);
    assert_eq!(l.overflow_decisions(), 1);
    // "b" is idle at 1.06 s, but the shard was scanned < MIN_SCAN_INTERVAL ago: overflow.
    // (The overflow bucket was spent by "x" at 0.5 s, so "d" is refused.)
    assert!(!l.check(b"d", 1_060 * ms, 1).allowed);
    assert_eq!(l.overflow_decisions(), 2);
    // Once the interval has passed, the next new key triggers a scan that evicts "b".
    assert!(l.check(b"e", 1_000 * ms + MIN_SCAN_INTERVAL, 1).allowed);
    assert_eq!(l.overflow_decisions(), 2);
    assert_eq!(l.len(), 2);
}

#[test]
fn idle_eviction_is_lossless_and_honours_the_grace() {
    let q = Limit::new(Algorithm::TokenBucket, 10, SECOND, 5, 0).unwrap();
    let l = KeyedLimiter::new(
        q,
        StoreConfig {
            idle_ttl: 10 * SECOND,
            ..StoreConfig::default()
        },
    );
    for k in 0..100u32 {
        assert!(l.check(&k.to_le_bytes(), 0, 5).allowed);
    }
    assert_eq!(l.len(), 100);
    // Refilled after 0.5 s, but the grace keeps them until 10.5 s.
    assert_eq!(l.evict_idle(SECOND), 0);
    // Not idle yet: evicting would lose state, so nothing goes.
    assert_eq!(l.evict_idle(10 * SECOND), 0);
    assert_eq!(l.evict_idle(10 * SECOND + SECOND / 2), 100);
    assert!(l.is_empty());
    // A returning key starts full, exactly as if it had never been evicted.
    assert_eq!(admitted(&l, &7u32.to_le_bytes(), 11 * SECOND, 10), 5);
}

#[test]
fn default_ttl_is_derived_from_the_quota() {
    let cases = [
        (Algorithm::TokenBucket, SECOND), // 2 tokens at 2/s refill in 1 s
        (Algorithm::LeakyBucket, SECOND), // same
        (Algorithm::FixedWindow, SECOND), // window [0, 1 s)
        (Algorithm::SlidingWindow, 2 * SECOND), // current + previous window
        (Algorithm::SlidingLog, SECOND),  // newest entry + period
    ];
    for (alg, idle_at) in cases {
        let l = limiter(Limit::new(alg, 2, SECOND, 2, 0).unwrap());
        assert!(l.check(b"k", 0, 2).allowed, "{alg:?}");
        assert_eq!(l.evict_idle(idle_at - 1), 0, "{alg:?}");
        assert_eq!(l.evict_idle(idle_at), 1, "{alg:?}");
    }
}

#[test]
fn concurrency_permits_release_on_drop() {
    let q = Limit::per_period(Algorithm::Concurrency, 2, SECOND).unwrap();
    let l = limiter(q);
    let p1 = l.acquire_permit(b"k", 0, 1).unwrap();
    assert_eq!(p1.held(), 1);
    assert_eq!(p1.decision().remaining, 1);
    // `check` for concurrency = would it fit now? It holds nothing.
    assert!(l.check(b"k", 0, 1).allowed);
    assert!(!l.check(b"k", 0, 2).allowed);
    let p2 = l.acquire_permit(b"k", 0, 1).unwrap();
    let err = l.acquire_permit(b"k", 0, 1).unwrap_err();
    assert!(!err.allowed);
    assert_eq!(err.retry_after, SECOND, "period is the retry hint");
    assert_eq!(l.acquire_permit(b"k", 0, 3).unwrap_err().retry_after, NEVER);
    // Other keys are independent.
    let other = l.acquire_permit(b"other", 0, 2).unwrap();
    drop(p1);
    let p3 = l.acquire_permit(b"k", 0, 1).unwrap();
    drop((p2, p3, other));
    // Entries with nothing in flight are removed right away.
    assert_eq!(l.len(), 0);
    assert_eq!(l.acquire_permit(b"k", 0, 2).map(|p| p.held()), Ok(2));
}

#[test]
fn permits_are_send_static_and_release_on_another_thread() {
    fn assert_send_static<T: Send + 'static>(_: &T) {}
    let l = Arc::new(limiter(
        Limit::per_period(Algorithm::Concurrency, 1, SECOND).unwrap(),
    ));
    let p = l.acquire_permit(b"k", 0, 1).unwrap();
    assert_send_static(&p);
    assert!(l.acquire_permit(b"k", 0, 1).is_err());
    std::thread::spawn(move || drop(p)).join().unwrap();
    assert!(l.acquire_permit(b"k", 0, 1).is_ok());
}

#[test]
fn concurrency_overflow_permits_release_to_the_overflow_state() {
    let q = Limit::per_period(Algorithm::Concurrency, 1, SECOND).unwrap();
    let l = KeyedLimiter::new(
        q,
        StoreConfig {
            max_keys: 1,
            idle_ttl: 0,
            shards: 1,
        },
    );
    let a = l.acquire_permit(b"a", 0, 1).unwrap();
    let b = l.acquire_permit(b"b", 0, 1).unwrap();
    assert_eq!(l.overflow_decisions(), 1);
    assert!(
        l.acquire_permit(b"c", 0, 1).is_err(),
        "overflow slot taken by b"
    );
    drop(b);
    assert!(l.acquire_permit(b"c", 0, 1).is_ok());
    drop(a);
    assert_eq!(l.len(), 0);
}

#[test]
fn rate_algorithms_hand_out_empty_permits() {
    let l = limiter(Limit::per_period(Algorithm::FixedWindow, 1, SECOND).unwrap());
    let p: Permit = l.acquire_permit(b"k", 0, 1).unwrap();
    assert_eq!(p.held(), 0);
    assert!(p.decision().allowed);
    assert!(l.acquire_permit(b"k", 0, 1).is_err());
}

#[test]
fn config_is_normalised() {
    let q = Limit::per_period(Algorithm::FixedWindow, 1, SECOND).unwrap();
    let l = KeyedLimiter::new(
        q,
        StoreConfig {
            max_keys: 10,
            idle_ttl: 0,
            shards: 3,
        },
    );
    assert_eq!((l.shards(), l.capacity()), (4, 8));
    let l = KeyedLimiter::new(
        q,
        StoreConfig {
            max_keys: 3,
            idle_ttl: 0,
            shards: 64,
        },
    );
    assert_eq!((l.shards(), l.capacity()), (2, 2));
    let l = KeyedLimiter::new(
        q,
        StoreConfig {
            max_keys: 0,
            idle_ttl: 0,
            shards: 0,
        },
    );
    assert_eq!((l.shards(), l.capacity()), (1, 1));
    assert_eq!(StoreConfig::default().max_keys, 1_000_000);
}

#[test]
fn sliding_log_key_cap_bounds_total_memory() {
    let q = Limit::per_period(Algorithm::SlidingLog, 10_000, SECOND).unwrap();
    let l = limiter(q);
    assert!(l.capacity() as u64 * 10_000 * 8 <= tollgate_limiter::SLIDING_LOG_MAX_BYTES);
    assert!(l.capacity() >= 3_000);
    let small = limiter(Limit::per_period(Algorithm::SlidingLog, 10, SECOND).unwrap());
    assert_eq!(small.capacity(), 1_000_000);
}

#[test]
fn invalid_quotas() {
    let bad = Limit {
        algorithm: Algorithm::SlidingLog,
        requests: 20_000,
        period: SECOND,
        burst: 1,
        max_delay: 0,
    };
    assert!(matches!(
        KeyedLimiter::try_new(bad, StoreConfig::default()),
        Err(LimitError::SlidingLogTooLarge { .. })
    ));
    // `new` clamps instead of panicking.
    let l = KeyedLimiter::new(bad, StoreConfig::default());
    assert_eq!(
        l.limit().requests,
        tollgate_limiter::MAX_SLIDING_LOG_REQUESTS
    );
    let zero = Limit {
        algorithm: Algorithm::TokenBucket,
        requests: 0,
        period: 0,
        burst: 0,
        max_delay: 0,
    };
    let l = KeyedLimiter::new(zero, StoreConfig::default());
    assert!(l.check(b"k", 0, 1).allowed);
    assert!(!l.check(b"k", 0, 1).allowed);
}

/// Many threads, shared keys, no time passing: each key admits exactly its burst in total.
#[test]
fn threads_never_over_admit() {
    for alg in [
        Algorithm::TokenBucket,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::LeakyBucket,
    ] {
        let l = Arc::new(KeyedLimiter::new(
            Limit::new(alg, 50, 3_600 * SECOND, 50, 0).unwrap(),
            StoreConfig {
                shards: 4,
                ..StoreConfig::default()
            },
        ));
        let total = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (l, total) = (Arc::clone(&l), Arc::clone(&total));
                std::thread::spawn(move || {
                    for round in 0..40 {
                        for key in 0..64u32 {
                            if l.check(&key.to_le_bytes(), SECOND + round, 1).allowed {
                                total.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // 4 threads × 40 rounds = 160 attempts per key, 50 allowed per key.
        assert_eq!(total.load(Ordering::Relaxed), 64 * 50, "{alg:?}");
    }
}

/// In-flight units never exceed the limit while threads acquire and drop permits.
#[test]
fn threads_never_exceed_concurrency() {
    let l = Arc::new(limiter(
        Limit::per_period(Algorithm::Concurrency, 3, SECOND).unwrap(),
    ));
    let in_flight = Arc::new(AtomicU64::new(0));
    let max_seen = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (l, in_flight, max_seen) = (
                Arc::clone(&l),
                Arc::clone(&in_flight),
                Arc::clone(&max_seen),
            );
            std::thread::spawn(move || {
                for _ in 0..20_000 {
                    if let Ok(p) = l.acquire_permit(b"shared", 0, 1) {
                        let n = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        max_seen.fetch_max(n, Ordering::SeqCst);
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        drop(p);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(max_seen.load(Ordering::SeqCst) <= 3);
    assert!(max_seen.load(Ordering::SeqCst) >= 1);
    assert_eq!(l.len(), 0);
}

#[test]
fn keyed_limiter_is_send_sync() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<KeyedLimiter>();
    assert_send_sync::<Permit>();
    assert_send_sync::<FakeClock>();
}

#[test]
fn peek_reads_a_key_without_charging_or_creating_it() {
    let now = 42 * SECOND;
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::LeakyBucket,
    ] {
        let l = limiter(Limit::per_period(algorithm, 5, SECOND).unwrap());
        assert!(
            l.peek(b"k", now).is_none(),
            "{algorithm:?}: an unseen key has no state"
        );
        assert!(l.is_empty(), "{algorithm:?}: peeking created an entry");
        assert_eq!(admitted(&l, b"k", now, 3), 3, "{algorithm:?}");
        for _ in 0..10 {
            let d = l.peek(b"k", now).expect("a charged key has state");
            assert_eq!(d.remaining, 2, "{algorithm:?}: {d:?}");
            assert_eq!(d.limit, 5, "{algorithm:?}: {d:?}");
        }
        // Peeking 10 times took nothing: the 2 left are still there.
        assert_eq!(admitted(&l, b"k", now, 5), 2, "{algorithm:?}");
        assert_eq!(l.peek(b"k", now).map(|d| d.remaining), Some(0));
    }
    let c = limiter(Limit::per_period(Algorithm::Concurrency, 3, SECOND).unwrap());
    let held = c.acquire_permit(b"k", now, 1).expect("permit");
    assert_eq!(c.peek(b"k", now).map(|d| d.remaining), Some(2));
    drop(held);
    assert_eq!(c.peek(b"k", now).map(|d| d.remaining).unwrap_or(3), 3);
}
