//! Noise-resistant companion to `vs_governor`: the same scenarios and limit, but tollgate and
//! governor are measured in interleaved rounds (A B A B …) and each side's best round is
//! kept, so load from other processes on a shared 2-core machine affects both sides alike
//! and preempted rounds drop out. Prints a table of ns per decision and the ratios behind
//! the G6 goals. Run: `cargo bench -p tollgate-limiter --bench ratios`.
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

use governor::{Quota as GQuota, RateLimiter};
use tollgate_limiter::{
    Algorithm, Clock, KeyedLimiter, Limit, LimiterState, MonotonicClock, Params, SECOND,
    StoreConfig, TokenBucket,
};

const RATE: u32 = 1_000_000;
const BURST: u32 = 100;
const STEP: u64 = 1_000;
const KEYS: usize = 10_000;
const OPS: u64 = 200_000;
const ROUNDS: usize = 21;

thread_local! {
    static NOW: Cell<u64> = const { Cell::new(1 << 40) };
}

#[inline(always)]
fn tick() -> u64 {
    NOW.with(|c| {
        let t = c.get() + STEP;
        c.set(t);
        t
    })
}

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

fn limit() -> Limit {
    Limit {
        algorithm: Algorithm::TokenBucket,
        requests: u64::from(RATE),
        period: SECOND,
        burst: u64::from(BURST),
        max_delay: 0,
    }
}

fn gquota() -> GQuota {
    GQuota::per_second(nz(RATE)).allow_burst(nz(BURST))
}

fn keys() -> (Vec<u64>, Vec<[u8; 8]>) {
    let mut v: Vec<u64> = (0..KEYS as u64).collect();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let v: Vec<u64> = v
        .iter()
        .map(|k| k.wrapping_mul(0x2545_F491_4F6C_DD1D))
        .collect();
    let b = v.iter().map(|k| k.to_le_bytes()).collect();
    (v, b)
}

/// ns per decision of one single-threaded round.
fn round(mut f: impl FnMut(u64)) -> f64 {
    let t = Instant::now();
    for i in 0..OPS {
        f(i);
    }
    t.elapsed().as_nanos() as f64 / OPS as f64
}

/// Aggregate ns per decision of one round on two threads.
fn round2(f: &(dyn Fn(usize, u64) + Sync)) -> f64 {
    static BASE: AtomicU64 = AtomicU64::new(1 << 50);
    let base = BASE.fetch_add(OPS * STEP + SECOND, Ordering::Relaxed);
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
                    for i in 0..OPS {
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
    let span = match (first, last) {
        (Some(a), Some(b)) => b.duration_since(a),
        _ => Duration::ZERO,
    };
    span.as_nanos() as f64 / (2 * OPS) as f64
}

struct Row {
    name: &'static str,
    ours: Vec<f64>,
    theirs: Vec<f64>,
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::MAX, f64::min)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[allow(
    clippy::too_many_lines,
    reason = "every scenario runs inside one round, back to back, so clock drift and frequency changes hit both limiters alike"
)]
fn main() {
    let (gkeys, bkeys) = keys();
    let q = limit();
    let p = Params::new(&q);

    let names = [
        "single key: state vs governor direct",
        "single key: keyed vs governor keyed",
        "10k keys: keyed vs governor keyed",
        "2 threads, 10k keys, own halves, fake clocks",
        "2 threads, 10k shared keys, real clocks",
        "2 threads, one hot key, real clocks",
        "2 threads, hot key vs governor direct, real",
        "real clock: keyed vs governor direct",
        "real clock: keyed vs governor keyed",
    ];
    let mut rows: Vec<Row> = names
        .iter()
        .map(|&name| Row {
            name,
            ours: vec![],
            theirs: vec![],
        })
        .collect();

    let mut tb = TokenBucket::new();
    let one = KeyedLimiter::new(q, StoreConfig::default());
    let many = KeyedLimiter::new(q, StoreConfig::default());
    let two_many = KeyedLimiter::new(q, StoreConfig::default());
    let gd = RateLimiter::direct_with_clock(gquota(), TlsClock);
    let gk1 = RateLimiter::<u64, _, _, _>::dashmap_with_clock(gquota(), TlsClock);
    let gk = RateLimiter::<u64, _, _, _>::dashmap_with_clock(gquota(), TlsClock);
    let g2k = RateLimiter::<u64, _, _, _>::dashmap_with_clock(gquota(), TlsClock);
    // Real clocks: T = 1 ns, burst 1000, so a tight loop is mostly admitted on both sides.
    let rq = Limit {
        requests: SECOND,
        burst: 1_000,
        ..q
    };
    let clock = MonotonicClock::new();
    let Some(grq) = GQuota::with_period(Duration::from_nanos(1)) else {
        return;
    };
    let grq = grq.allow_burst(nz(1_000));
    let real = KeyedLimiter::new(rq, StoreConfig::default());
    let real_many = KeyedLimiter::new(rq, StoreConfig::default());
    let real_hot = KeyedLimiter::new(rq, StoreConfig::default());
    let grd = RateLimiter::direct(grq);
    let grk = RateLimiter::<u64, _, _>::keyed(grq);
    let grk_many = RateLimiter::<u64, _, _>::keyed(grq);
    let grk_hot = RateLimiter::<u64, _, _>::keyed(grq);
    let grd_hot = RateLimiter::direct(grq);
    let key = 42u64.to_le_bytes();

    for _ in 0..ROUNDS {
        rows[0].ours.push(round(|_| {
            black_box(tb.acquire_with(&p, tick(), 1).allowed);
        }));
        rows[0].theirs.push(round(|_| {
            tick();
            black_box(gd.check().is_ok());
        }));
        rows[1].ours.push(round(|_| {
            black_box(one.check(black_box(&key), tick(), 1).allowed);
        }));
        rows[1].theirs.push(round(|_| {
            tick();
            black_box(gk1.check_key(black_box(&42u64)).is_ok());
        }));
        rows[2].ours.push(round(|i| {
            black_box(many.check(&bkeys[i as usize % KEYS], tick(), 1).allowed);
        }));
        rows[2].theirs.push(round(|i| {
            tick();
            black_box(gk.check_key(&gkeys[i as usize % KEYS]).is_ok());
        }));
        rows[3].ours.push(round2(&|t, i| {
            let k = (i as usize * 2 + t) % KEYS;
            black_box(two_many.check(&bkeys[k], tick(), 1).allowed);
        }));
        rows[3].theirs.push(round2(&|t, i| {
            let k = (i as usize * 2 + t) % KEYS;
            tick();
            black_box(g2k.check_key(&gkeys[k]).is_ok());
        }));
        rows[4].ours.push(round2(&|t, i| {
            let k = (i as usize + t * 5_003) % KEYS;
            black_box(real_many.check(&bkeys[k], clock.now(), 1).allowed);
        }));
        rows[4].theirs.push(round2(&|t, i| {
            let k = (i as usize + t * 5_003) % KEYS;
            black_box(grk_many.check_key(&gkeys[k]).is_ok());
        }));
        let hot = round2(&|_, _| {
            black_box(real_hot.check(&key, clock.now(), 1).allowed);
        });
        rows[5].ours.push(hot);
        rows[5].theirs.push(round2(&|_, _| {
            black_box(grk_hot.check_key(&42u64).is_ok());
        }));
        rows[6].ours.push(hot);
        rows[6].theirs.push(round2(&|_, _| {
            black_box(grd_hot.check().is_ok());
        }));
        let real_ns = round(|_| {
            black_box(real.check(black_box(&key), clock.now(), 1).allowed);
        });
        rows[7].ours.push(real_ns);
        rows[7].theirs.push(round(|_| {
            black_box(grd.check().is_ok());
        }));
        rows[8].ours.push(real_ns);
        rows[8].theirs.push(round(|_| {
            black_box(grk.check_key(black_box(&42u64)).is_ok());
        }));
    }

    report(&rows);
}

/// The ratio table, then the throughput of the two-thread scenarios.
fn report(rows: &[Row]) {
    println!(
        "\n{} interleaved rounds of {} decisions; best (median) ns per decision",
        ROUNDS, OPS
    );
    println!(
        "| scenario | tollgate | governor | ratio (best) | ratio (median) |\n|---|---|---|---|---|"
    );
    for r in rows {
        let (ob, tb_) = (best(&r.ours), best(&r.theirs));
        let (om, tm) = (median(&r.ours), median(&r.theirs));
        println!(
            "| {} | {:.2} ({:.2}) | {:.2} ({:.2}) | {:.2}x | {:.2}x |",
            r.name,
            ob,
            om,
            tb_,
            tm,
            ob / tb_,
            om / tm
        );
    }
    for r in &rows[3..7] {
        println!(
            "{}: tollgate {:.1} M decisions/s vs governor {:.1} M/s = {:.2}x throughput",
            r.name,
            1e3 / best(&r.ours),
            1e3 / best(&r.theirs),
            best(&r.theirs) / best(&r.ours)
        );
    }
}
