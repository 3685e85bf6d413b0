//! Decision cost, tollgate vs governor, same limit, same run.
//!
//! Single-threaded groups read time from the same near-free fake clock on both sides (a
//! thread-local counter advanced by the benchmark loop), so they compare decision cost, not
//! clock cost. Limit: 1 000 000 per second (T = 1 µs), burst 100; each iteration advances
//! the clock by 1 µs, so a single key runs exactly at its rate (all admitted) and 10k keys
//! far below it.
//!
//! `two_threads` reports aggregate throughput (criterion's elem/s counts both threads).
//! Threads on disjoint keys keep per-thread fake clocks; threads sharing keys need one clock,
//! so those runs use each side's real monotonic clock (both quanta-based) with T = 1 ns and
//! burst 1000 (mostly admitted). `real_clock` is the single-threaded real-clock variant.
//!
//! Keys: governor gets `u64` keys (its best case: hashing an integer); tollgate gets the same
//! value's 8 little-endian bytes. See also the `ratios` bench (interleaved rounds, robust to
//! load from other processes).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

use std::cell::Cell;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use governor::{Quota as GQuota, RateLimiter};
use tollgate_limiter::{
    Algorithm, Clock, KeyedLimiter, Limit, LimiterState, MonotonicClock, Params, SECOND,
    StoreConfig, TokenBucket,
};

const RATE: u32 = 1_000_000;
const BURST: u32 = 100;
const STEP: u64 = 1_000; // ns per iteration per thread = T
const KEYS: usize = 10_000;

thread_local! {
    static NOW: Cell<u64> = const { Cell::new(1_000_000_000) };
}

#[inline(always)]
fn tick() -> u64 {
    NOW.with(|c| {
        let t = c.get() + STEP;
        c.set(t);
        t
    })
}

/// governor clock reading the same thread-local time.
#[derive(Clone, Copy, Default)]
struct TlsClock;

impl governor::clock::Clock for TlsClock {
    type Instant = governor::nanos::Nanos;
    #[inline(always)]
    fn now(&self) -> Self::Instant {
        NOW.with(|c| c.get()).into()
    }
}

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::MIN.saturating_add(n.saturating_sub(1))
}

fn gquota() -> GQuota {
    GQuota::per_second(nz(RATE)).allow_burst(nz(BURST))
}

/// Same limit as `gquota` (a literal: validated by construction, no `expect` needed).
fn limit() -> Limit {
    Limit {
        algorithm: Algorithm::TokenBucket,
        requests: u64::from(RATE),
        period: SECOND,
        burst: u64::from(BURST),
        max_delay: 0,
    }
}

fn keyed() -> KeyedLimiter {
    KeyedLimiter::new(limit(), StoreConfig::default())
}

/// The same pseudo-random permutation of 0..KEYS for both sides.
fn key_order() -> Vec<u64> {
    let mut v: Vec<u64> = (0..KEYS as u64).collect();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v.iter()
        .map(|k| k.wrapping_mul(0x2545_F491_4F6C_DD1D))
        .collect()
}

fn single_key(c: &mut Criterion) {
    let mut g = c.benchmark_group("single_key");
    g.throughput(Throughput::Elements(1));

    g.bench_function("tollgate_state", |b| {
        let p = Params::new(&limit());
        let mut tb = TokenBucket::new();
        b.iter(|| black_box(tb.acquire_with(&p, tick(), 1).allowed));
    });
    g.bench_function("tollgate_keyed", |b| {
        let lim = keyed();
        let key = 42u64.to_le_bytes();
        b.iter(|| black_box(lim.check(black_box(&key), tick(), 1).allowed));
    });
    g.bench_function("governor_direct", |b| {
        let lim = RateLimiter::direct_with_clock(gquota(), TlsClock);
        b.iter(|| {
            tick();
            black_box(lim.check().is_ok())
        });
    });
    g.bench_function("governor_keyed_dashmap", |b| {
        let lim = RateLimiter::<u64, _, _, _>::dashmap_with_clock(gquota(), TlsClock);
        b.iter(|| {
            tick();
            black_box(lim.check_key(black_box(&42u64)).is_ok())
        });
    });
    g.finish();
}

fn keyed_10k(c: &mut Criterion) {
    let order = key_order();
    let bytes: Vec<[u8; 8]> = order.iter().map(|k| k.to_le_bytes()).collect();
    let mut g = c.benchmark_group("keyed_10k");
    g.throughput(Throughput::Elements(1));

    g.bench_function("tollgate", |b| {
        let lim = keyed();
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % KEYS;
            black_box(lim.check(&bytes[i], tick(), 1).allowed)
        });
    });
    g.bench_function("governor_dashmap", |b| {
        let lim = RateLimiter::<u64, _, _, _>::dashmap_with_clock(gquota(), TlsClock);
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % KEYS;
            tick();
            black_box(lim.check_key(&order[i]).is_ok())
        });
    });
    g.finish();
}

/// Runs `f(thread, iteration)` on 2 threads, `iters` times each; returns the wall time from
/// the common start until both are done.
fn two_threads(iters: u64, f: &(dyn Fn(usize, u64) + Sync)) -> Duration {
    // Fresh threads start their clocks where the previous sample's threads stopped, so the
    // limiter state (kept across samples) sees time moving forward.
    static BASE: AtomicU64 = AtomicU64::new(1 << 50);
    let base = BASE.fetch_add(iters * STEP + SECOND, Ordering::Relaxed);
    // Each thread times itself from the common start; the span is first start to last end
    // (timing from the spawning thread would miss work done while it was descheduled).
    let barrier = Barrier::new(2);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || {
                    NOW.with(|c| c.set(base));
                    barrier.wait();
                    let start = Instant::now();
                    for i in 0..iters {
                        f(t, i);
                    }
                    (start, Instant::now())
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let first = spans.iter().map(|s| s.0).min();
    let last = spans.iter().map(|s| s.1).max();
    match (first, last) {
        (Some(a), Some(b)) => b.duration_since(a),
        _ => Duration::ZERO,
    }
}

/// Quotas for real-clock runs: T = 1 ns, burst 1000, so a tight loop stays under the rate
/// (mostly admitted) on both sides.
fn real_quotas() -> Option<(Limit, GQuota)> {
    let q = Limit {
        requests: SECOND,
        burst: 1_000,
        ..limit()
    };
    let gq = GQuota::with_period(Duration::from_nanos(1))?.allow_burst(nz(1_000));
    Some((q, gq))
}

fn contended(c: &mut Criterion) {
    let order = key_order();
    let bytes: Vec<[u8; 8]> = order.iter().map(|k| k.to_le_bytes()).collect();
    let Some((rq, rgq)) = real_quotas() else {
        return;
    };
    let mut g = c.benchmark_group("two_threads");
    // Two decisions per iteration (one per thread): criterion's elem/s is the aggregate.
    g.throughput(Throughput::Elements(2));

    // 10k keys, each thread on its own half, per-thread fake clocks (a key only ever sees
    // one thread's clock).
    g.bench_function("tollgate_10k_keys", |b| {
        let lim = keyed();
        b.iter_custom(|iters| {
            two_threads(iters, &|t, i| {
                let k = (i as usize * 2 + t) % KEYS;
                black_box(lim.check(&bytes[k], tick(), 1).allowed);
            })
        });
    });
    g.bench_function("governor_keyed_10k_keys", |b| {
        let lim = RateLimiter::<u64, _, _, _>::dashmap_with_clock(gquota(), TlsClock);
        b.iter_custom(|iters| {
            two_threads(iters, &|t, i| {
                let k = (i as usize * 2 + t) % KEYS;
                tick();
                black_box(lim.check_key(&order[k]).is_ok());
            })
        });
    });
    // Both threads on shared keys need one clock: each side's real monotonic clock.
    let clock = MonotonicClock::new();
    g.bench_function("tollgate_10k_keys_real_clock", |b| {
        let lim = KeyedLimiter::new(rq, StoreConfig::default());
        b.iter_custom(|iters| {
            two_threads(iters, &|t, i| {
                let k = (i as usize + t * 5_003) % KEYS;
                black_box(lim.check(&bytes[k], clock.now(), 1).allowed);
            })
        });
    });
    g.bench_function("governor_keyed_10k_keys_real_clock", |b| {
        let lim = RateLimiter::<u64, _, _>::keyed(rgq);
        b.iter_custom(|iters| {
            two_threads(iters, &|t, i| {
                let k = (i as usize + t * 5_003) % KEYS;
                black_box(lim.check_key(&order[k]).is_ok());
            })
        });
    });
    g.bench_function("tollgate_hot_key_real_clock", |b| {
        let lim = KeyedLimiter::new(rq, StoreConfig::default());
        let key = 42u64.to_le_bytes();
        b.iter_custom(|iters| {
            two_threads(iters, &|_, _| {
                black_box(lim.check(&key, clock.now(), 1).allowed);
            })
        });
    });
    g.bench_function("governor_keyed_hot_key_real_clock", |b| {
        let lim = RateLimiter::<u64, _, _>::keyed(rgq);
        b.iter_custom(|iters| {
            two_threads(iters, &|_, _| {
                black_box(lim.check_key(&42u64).is_ok());
            })
        });
    });
    g.bench_function("governor_direct_real_clock", |b| {
        let lim = RateLimiter::direct(rgq);
        b.iter_custom(|iters| {
            two_threads(iters, &|_, _| {
                black_box(lim.check().is_ok());
            })
        });
    });
    g.finish();
}

fn real_clock(c: &mut Criterion) {
    let Some((q, gq)) = real_quotas() else {
        return;
    };
    let mut g = c.benchmark_group("real_clock");
    g.throughput(Throughput::Elements(1));

    g.bench_function("tollgate_clock_now", |b| {
        let clock = MonotonicClock::new();
        b.iter(|| black_box(clock.now()));
    });
    g.bench_function("tollgate_keyed", |b| {
        let lim = KeyedLimiter::new(q, StoreConfig::default());
        let clock = MonotonicClock::new();
        let key = 42u64.to_le_bytes();
        b.iter(|| black_box(lim.check(black_box(&key), clock.now(), 1).allowed));
    });
    g.bench_function("governor_direct", |b| {
        let lim = RateLimiter::direct(gq);
        b.iter(|| black_box(lim.check().is_ok()));
    });
    g.bench_function("governor_keyed_dashmap", |b| {
        let lim = RateLimiter::<u64, _, _>::keyed(gq);
        b.iter(|| black_box(lim.check_key(black_box(&42u64)).is_ok()));
    });
    g.finish();
}

criterion_group!(benches, single_key, keyed_10k, contended, real_clock);
criterion_main!(benches);
