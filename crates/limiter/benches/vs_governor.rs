//! Decision cost, tollgate vs governor, same quota, same run.
//!
//! Both sides read time from the same near-free fake clock (a thread-local counter advanced
//! by the benchmark loop), so the numbers compare decision cost, not clock cost; the
//! `real_clock` group uses each side's real monotonic clock (both quanta-based).
//!
//! Quota: 1 000 000 per second (T = 1 µs), burst 100; each iteration advances the clock by
//! 1 µs per thread, so a single key is exactly at its rate (all admitted), 10k keys are far
//! below it, and two threads on one key offer 2× the rate (about half rejected).
//!
//! Keys: governor gets `u64` keys (its best case: hashing an integer); tollgate gets the same
//! value's 8 little-endian bytes.

use std::cell::Cell;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use governor::{Quota as GQuota, RateLimiter};
use tollgate_limiter::{
    Algorithm, Clock, KeyedLimiter, LimiterState, MonotonicClock, Params, Quota, SECOND,
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

/// Same quota as `gquota` (a literal: validated by construction, no `expect` needed).
fn quota() -> Quota {
    Quota {
        algorithm: Algorithm::TokenBucket,
        requests: u64::from(RATE),
        period: SECOND,
        burst: u64::from(BURST),
        max_delay: 0,
    }
}

fn keyed() -> KeyedLimiter {
    KeyedLimiter::new(quota(), StoreConfig::default())
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
        let p = Params::new(&quota());
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
    let barrier = Barrier::new(3);
    std::thread::scope(|s| {
        for t in 0..2 {
            let barrier = &barrier;
            s.spawn(move || {
                NOW.with(|c| c.set(base));
                barrier.wait();
                for i in 0..iters {
                    f(t, i);
                }
            });
        }
        barrier.wait();
        let start = Instant::now();
        // Scope end joins both threads.
        start
    })
    .elapsed()
}

fn contended(c: &mut Criterion) {
    let order = key_order();
    let bytes: Vec<[u8; 8]> = order.iter().map(|k| k.to_le_bytes()).collect();
    let mut g = c.benchmark_group("two_threads");
    // Two decisions per iteration (one per thread): criterion's elem/s is the aggregate.
    g.throughput(Throughput::Elements(2));

    g.bench_function("tollgate_hot_key", |b| {
        let lim = keyed();
        let key = 42u64.to_le_bytes();
        b.iter_custom(|iters| {
            two_threads(iters, &|_, _| {
                black_box(lim.check(&key, tick(), 1).allowed);
            })
        });
    });
    g.bench_function("governor_keyed_hot_key", |b| {
        let lim = RateLimiter::<u64, _, _, _>::dashmap_with_clock(gquota(), TlsClock);
        b.iter_custom(|iters| {
            two_threads(iters, &|_, _| {
                tick();
                black_box(lim.check_key(&42u64).is_ok());
            })
        });
    });
    g.bench_function("governor_direct", |b| {
        let lim = RateLimiter::direct_with_clock(gquota(), TlsClock);
        b.iter_custom(|iters| {
            two_threads(iters, &|_, _| {
                tick();
                black_box(lim.check().is_ok());
            })
        });
    });
    g.bench_function("tollgate_10k_keys", |b| {
        let lim = keyed();
        b.iter_custom(|iters| {
            two_threads(iters, &|t, i| {
                let k = (i as usize * 2 + t * 5_003) % KEYS;
                black_box(lim.check(&bytes[k], tick(), 1).allowed);
            })
        });
    });
    g.bench_function("governor_keyed_10k_keys", |b| {
        let lim = RateLimiter::<u64, _, _, _>::dashmap_with_clock(gquota(), TlsClock);
        b.iter_custom(|iters| {
            two_threads(iters, &|t, i| {
                let k = (i as usize * 2 + t * 5_003) % KEYS;
                tick();
                black_box(lim.check_key(&order[k]).is_ok());
            })
        });
    });
    g.finish();
}

fn real_clock(c: &mut Criterion) {
    // T = 1 ns so a tight loop stays under the rate (mostly admitted) on both sides.
    let q = Quota {
        requests: SECOND,
        burst: 1_000,
        ..quota()
    };
    let Some(gq) = GQuota::with_period(Duration::from_nanos(1)) else {
        return;
    };
    let gq = gq.allow_burst(nz(1_000));
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
