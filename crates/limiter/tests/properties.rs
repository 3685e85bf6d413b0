//! Property tests: every algorithm against a simple reference model.
//!
//! * Monotonic time: decisions equal the model's (token bucket: exact rational token count;
//!   windows and log: recomputed from the list of admitted requests).
//! * Any time, including a clock that goes backwards: no panic; nothing admitted beyond what
//!   the limit allows over any window of *effective* time (the latest time seen so far);
//!   `remaining` never exceeds capacity; `retry_after` is exact (admitted after waiting that
//!   long, refused 1 ns earlier) or `NEVER` really means never.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

use std::collections::HashMap;

use proptest::prelude::*;
use tollgate_limiter::{
    Algorithm, ConcurrencyLimit, Decision, FixedWindow, KeyedLimiter, LeakyBucket, Limit,
    LimiterState, NEVER, Nanos, Params, SECOND, SlidingLog, SlidingWindow, StoreConfig,
    TokenBucket,
};

// ---------------------------------------------------------------------------------------
// Generators

#[derive(Clone, Debug)]
struct Case {
    requests: u64,
    period: Nanos,
    burst: u64,
    max_delay: Nanos,
    times: Vec<Nanos>,
    costs: Vec<u64>,
}

impl Case {
    fn limit(&self, algorithm: Algorithm) -> Limit {
        Limit::new(
            algorithm,
            self.requests,
            self.period,
            self.burst,
            self.max_delay,
        )
        .unwrap()
    }
    fn monotonic(&self) -> bool {
        self.times.windows(2).all(|w| w[0] <= w[1])
    }
    /// Latest time seen up to and including each step.
    fn effective(&self) -> Vec<Nanos> {
        let mut max = 0;
        self.times
            .iter()
            .map(|&t| {
                max = max.max(t);
                max
            })
            .collect()
    }
}

fn case(backwards: bool) -> impl Strategy<Value = Case> {
    let period = prop_oneof![1u64..5_000, Just(SECOND), Just(999_999_937u64)];
    (1u64..=12, period, 1u64..=12, 0u64..=3)
        .prop_flat_map(move |(requests, period, burst, delay_periods)| {
            let span = i64::try_from(period.saturating_mul(3)).unwrap_or(i64::MAX);
            let back = if backwards { 1 } else { 0 };
            let step = prop_oneof![
                8 => 0..=span,
                back => -span..=0,
                1 => Just(0i64),
            ];
            let start = prop_oneof![Just(0u64), 0u64..(1 << 40), Just(u64::MAX - (1 << 36))];
            let cost = prop_oneof![6 => 0u64..=3, 1 => 0u64..=15];
            (
                Just((requests, period, burst, delay_periods)),
                start,
                prop::collection::vec((step, cost), 1..80),
            )
        })
        .prop_map(|((requests, period, burst, delay_periods), start, ops)| {
            let mut now = start;
            let mut times = Vec::with_capacity(ops.len());
            let mut costs = Vec::with_capacity(ops.len());
            for (dt, cost) in ops {
                now = now.saturating_add_signed(dt);
                times.push(now);
                costs.push(cost);
            }
            Case {
                requests,
                period,
                burst,
                max_delay: delay_periods * period / 2,
                times,
                costs,
            }
        })
}

// ---------------------------------------------------------------------------------------
// Generic checks

/// Runs `state` over the case; returns the decisions.
fn run<S: LimiterState + Clone>(c: &Case, q: &Limit) -> (Vec<Decision>, S) {
    let p = Params::new(q);
    let mut s = S::default();
    let ds = c
        .times
        .iter()
        .zip(&c.costs)
        .map(|(&now, &cost)| s.acquire_with(&p, now, cost))
        .collect();
    (ds, s)
}

/// `retry_after` is exact: admitted after waiting exactly that long, refused 1 ns earlier;
/// `NEVER` is never admitted. Checked on a copy of the state at every rejection.
fn check_retry_after<S: LimiterState + Clone>(c: &Case, q: &Limit) -> Result<(), TestCaseError> {
    let p = Params::new(q);
    let mut s = S::default();
    for (&now, &cost) in c.times.iter().zip(&c.costs) {
        let before = s.clone();
        let d = s.acquire_with(&p, now, cost);
        prop_assert_eq!(d.allowed, d.retry_after == 0 || d.allowed);
        if d.allowed {
            prop_assert_eq!(d.retry_after, 0);
            continue;
        }
        prop_assert!(d.retry_after > 0);
        if d.retry_after == NEVER {
            let mut probe = before.clone();
            prop_assert!(
                !probe
                    .acquire_with(&p, now.saturating_add(1 << 50), cost)
                    .allowed
            );
            continue;
        }
        if let Some(at) = now.checked_add(d.retry_after) {
            let mut probe = before.clone();
            prop_assert!(
                probe.acquire_with(&p, at, cost).allowed,
                "not admitted at retry_after {:?}",
                d
            );
            let mut probe = before.clone();
            prop_assert!(
                !probe.acquire_with(&p, at - 1, cost).allowed,
                "admitted before retry_after {:?}",
                d
            );
        }
    }
    Ok(())
}

/// Nothing admitted beyond `capacity + elapsed × requests / period` between any two
/// admissions (in effective time): the token bucket envelope.
fn check_bucket_envelope(c: &Case, ds: &[Decision]) -> Result<(), TestCaseError> {
    let eff = c.effective();
    let (req, per, cap) = (
        u128::from(c.requests),
        u128::from(c.period),
        u128::from(c.burst) * u128::from(c.period),
    );
    let admitted: Vec<usize> = (0..ds.len()).filter(|&i| ds[i].allowed).collect();
    for (a, &i) in admitted.iter().enumerate() {
        let mut sum = 0u128;
        for &j in &admitted[a..] {
            sum += u128::from(c.costs[j]) * per;
            let elapsed = u128::from(eff[j] - eff[i]);
            prop_assert!(
                sum <= cap + elapsed * req,
                "admitted {} units over {} ns between steps {} and {}",
                sum / per,
                elapsed,
                i,
                j
            );
        }
    }
    Ok(())
}

fn check_remaining_bounded(ds: &[Decision], cap: u64) -> Result<(), TestCaseError> {
    for d in ds {
        prop_assert!(d.remaining <= cap, "{:?}", d);
        prop_assert_eq!(d.limit, cap);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Reference models

/// The seed's token bucket with exact rational arithmetic: `level` is tokens × period.
struct BucketModel {
    level: u128,
    last: Option<Nanos>,
    cap: u128,
    req: u128,
    per: u128,
    burst: u64,
}

impl BucketModel {
    fn new(c: &Case) -> Self {
        let cap = u128::from(c.burst) * u128::from(c.period);
        Self {
            level: cap,
            last: None,
            cap,
            req: u128::from(c.requests),
            per: u128::from(c.period),
            burst: c.burst,
        }
    }

    fn step(&mut self, now: Nanos, cost: u64) -> Decision {
        if let Some(last) = self.last
            && now > last
        {
            self.level = (self.level + u128::from(now - last) * self.req).min(self.cap);
        }
        self.last = Some(self.last.map_or(now, |l| l.max(now)));
        let need = u128::from(cost) * self.per;
        let allowed = self.level >= need;
        let mut retry = 0;
        if allowed {
            self.level -= need;
        } else if cost > self.burst {
            retry = NEVER;
        } else {
            retry = u64::try_from((need - self.level).div_ceil(self.req)).unwrap();
        }
        Decision {
            allowed,
            limit: self.burst,
            remaining: u64::try_from(self.level / self.per).unwrap(),
            reset: u64::try_from((self.cap - self.level).div_ceil(self.req)).unwrap(),
            retry_after: retry,
            delay: 0,
        }
    }
}

/// Sliding window estimate recomputed from the admitted requests (effective times).
fn window_estimate_scaled(admitted: &[(Nanos, u64)], t: Nanos, w: Nanos) -> u128 {
    let k = t / w;
    let start = k * w;
    let (mut prev, mut cur) = (0u128, 0u128);
    for &(at, cost) in admitted {
        if at / w == k {
            cur += u128::from(cost);
        } else if k > 0 && at / w == k - 1 {
            prev += u128::from(cost);
        }
    }
    prev * u128::from(w - (t - start)) + cur * u128::from(w)
}

// ---------------------------------------------------------------------------------------
// Properties

proptest! {
    // 512 cases by default; PROPTEST_CASES overrides (e.g. 50_000 for a long soak).
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
    ))]

    #[test]
    fn token_bucket_equals_exact_model(c in case(false)) {
        let q = c.limit(Algorithm::TokenBucket);
        let (ds, _) = run::<TokenBucket>(&c, &q);
        let mut m = BucketModel::new(&c);
        for (i, (&now, &cost)) in c.times.iter().zip(&c.costs).enumerate() {
            prop_assert_eq!(ds[i], m.step(now, cost), "step {}", i);
        }
    }

    #[test]
    fn token_bucket_never_over_admits(c in case(true)) {
        let q = c.limit(Algorithm::TokenBucket);
        let (ds, bucket) = run::<TokenBucket>(&c, &q);
        check_bucket_envelope(&c, &ds)?;
        check_remaining_bounded(&ds, c.burst)?;
        check_retry_after::<TokenBucket>(&c, &q)?;
        // Refill never exceeds capacity: long after the last request the bucket holds burst.
        let p = Params::new(&q);
        let last = *c.times.iter().max().unwrap();
        let idle = last.saturating_add(c.burst * c.period + 1);
        if idle < u64::MAX - (1 << 37) {
            prop_assert_eq!(bucket.available(&p, idle), c.burst);
            prop_assert_eq!(bucket.available(&p, idle + (1 << 36)), c.burst);
        }
        prop_assert!(bucket.idle_at(&p) <= idle.max(last));
    }

    #[test]
    fn leaky_bucket_shapes_within_envelope(c in case(true)) {
        let q = c.limit(Algorithm::LeakyBucket);
        let (ds, _) = run::<LeakyBucket>(&c, &q);
        check_remaining_bounded(&ds, c.burst)?;
        check_retry_after::<LeakyBucket>(&c, &q)?;
        let (req, per) = (i128::from(c.requests as i64), i128::from(c.period as i64));
        let admitted: Vec<usize> = (0..ds.len()).filter(|&i| ds[i].allowed).collect();
        for &i in &admitted {
            prop_assert!(ds[i].delay <= c.max_delay, "{:?}", ds[i]);
        }
        // Forwarded at now + delay; between any two forwarded requests (in order) the units
        // forwarded fit `max(burst, first cost)` plus the drain over the time between them.
        let fwd = |i: usize| i128::from(c.times[i]) + i128::from(ds[i].delay);
        for (a, &i) in admitted.iter().enumerate() {
            let mut sum = 0i128;
            for &j in &admitted[a..] {
                sum += i128::from(c.costs[j]) * per;
                let allowance = i128::from(c.burst.max(c.costs[i])) * per + (fwd(j) - fwd(i)) * req + req;
                prop_assert!(sum <= allowance, "steps {}..={}", i, j);
            }
        }
    }

    #[test]
    fn leaky_bucket_without_delay_is_the_token_bucket(mut c in case(true)) {
        c.max_delay = 0;
        let (l, _) = run::<LeakyBucket>(&c, &c.limit(Algorithm::LeakyBucket));
        let (t, _) = run::<TokenBucket>(&c, &c.limit(Algorithm::TokenBucket));
        prop_assert_eq!(l, t);
    }

    #[test]
    fn sliding_window_equals_model(c in case(true)) {
        let q = c.limit(Algorithm::SlidingWindow);
        let (ds, _) = run::<SlidingWindow>(&c, &q);
        check_remaining_bounded(&ds, c.requests)?;
        check_retry_after::<SlidingWindow>(&c, &q)?;
        let eff = c.effective();
        let w = c.period;
        let (limit, w128) = (u128::from(c.requests), u128::from(w));
        let mut admitted: Vec<(Nanos, u64)> = Vec::new();
        for i in 0..ds.len() {
            let before = window_estimate_scaled(&admitted, eff[i], w);
            let fits = before + u128::from(c.costs[i]) * w128 <= limit * w128;
            if c.monotonic() {
                // Monotonic time: exactly the seed's formula.
                prop_assert_eq!(ds[i].allowed, fits, "step {}", i);
                if fits {
                    let after = before + u128::from(c.costs[i]) * w128;
                    prop_assert_eq!(u128::from(ds[i].remaining), (limit * w128 - after) / w128);
                }
            } else if ds[i].allowed {
                // Backwards: never more generous than the model at the latest time seen.
                prop_assert!(fits, "step {} over-admitted", i);
            }
            if ds[i].allowed {
                admitted.push((eff[i], c.costs[i]));
            }
        }
        // No aligned window ever holds more than the limit.
        let mut per_window: HashMap<u64, u64> = HashMap::new();
        for (t, cost) in admitted {
            *per_window.entry(t / w).or_default() += cost;
        }
        prop_assert!(per_window.values().all(|&n| n <= c.requests));
    }

    #[test]
    fn fixed_window_equals_model(c in case(true)) {
        let q = c.limit(Algorithm::FixedWindow);
        let (ds, _) = run::<FixedWindow>(&c, &q);
        check_remaining_bounded(&ds, c.requests)?;
        check_retry_after::<FixedWindow>(&c, &q)?;
        let eff = c.effective();
        let mut count: HashMap<u64, u64> = HashMap::new();
        for i in 0..ds.len() {
            let n = count.entry(eff[i] / c.period).or_default();
            let fits = *n + c.costs[i] <= c.requests;
            prop_assert_eq!(ds[i].allowed, fits, "step {}", i);
            if fits {
                *n += c.costs[i];
            }
            prop_assert_eq!(ds[i].remaining, c.requests - *n);
        }
    }

    #[test]
    fn sliding_log_is_exact(c in case(true)) {
        let q = c.limit(Algorithm::SlidingLog);
        let (ds, log) = run::<SlidingLog>(&c, &q);
        check_remaining_bounded(&ds, c.requests)?;
        check_retry_after::<SlidingLog>(&c, &q)?;
        let eff = c.effective();
        let mut admitted: Vec<(Nanos, u64)> = Vec::new();
        for i in 0..ds.len() {
            let t = eff[i];
            let live: u64 = admitted
                .iter()
                .filter(|&&(at, _)| at.saturating_add(c.period) > t)
                .map(|&(_, n)| n)
                .sum();
            let fits = live + c.costs[i] <= c.requests;
            prop_assert_eq!(ds[i].allowed, fits, "step {}", i);
            if fits {
                admitted.push((t, c.costs[i]));
                prop_assert_eq!(ds[i].remaining, c.requests - live - c.costs[i]);
            }
        }
        prop_assert!(log.len() as u64 <= c.requests);
    }

    #[test]
    fn concurrency_equals_counter(requests in 1u64..8, ops in prop::collection::vec((any::<bool>(), 0u64..4), 1..100)) {
        let p = Params::new(&Limit::per_period(Algorithm::Concurrency, requests, SECOND).unwrap());
        let mut s = ConcurrencyLimit::new();
        let mut held: Vec<u64> = Vec::new();
        let mut model = 0u64;
        for (acquire, cost) in ops {
            if acquire || held.is_empty() {
                let d = s.acquire_with(&p, 0, cost);
                prop_assert_eq!(d.allowed, model + cost <= requests);
                if d.allowed {
                    model += cost;
                    held.push(cost);
                }
            } else {
                let cost = held.swap_remove(0);
                s.release(cost);
                model -= cost;
            }
            prop_assert_eq!(s.in_flight(), model);
            prop_assert!(model <= requests);
        }
    }

    /// The keyed store decides exactly like independent per-key states (idle eviction loses
    /// nothing) as long as it never overflows.
    #[test]
    fn keyed_store_equals_per_key_states(
        c in case(false),
        alg in prop_oneof![
            Just(Algorithm::TokenBucket),
            Just(Algorithm::SlidingWindow),
            Just(Algorithm::FixedWindow),
            Just(Algorithm::SlidingLog),
            Just(Algorithm::LeakyBucket),
        ],
        keys in prop::collection::vec(0u8..6, 80),
        evict in prop::collection::vec(any::<bool>(), 80),
    ) {
        let q = c.limit(alg);
        let p = Params::new(&q);
        let store = KeyedLimiter::new(q, StoreConfig { max_keys: 64, idle_ttl: 0, shards: 2 });
        let mut tb: HashMap<u8, TokenBucket> = HashMap::new();
        let mut sw: HashMap<u8, SlidingWindow> = HashMap::new();
        let mut fw: HashMap<u8, FixedWindow> = HashMap::new();
        let mut sl: HashMap<u8, SlidingLog> = HashMap::new();
        let mut lb: HashMap<u8, LeakyBucket> = HashMap::new();
        for (i, (&now, &cost)) in c.times.iter().zip(&c.costs).enumerate() {
            let k = keys[i];
            let expected = match alg {
                Algorithm::TokenBucket => tb.entry(k).or_default().acquire_with(&p, now, cost),
                Algorithm::SlidingWindow => sw.entry(k).or_default().acquire_with(&p, now, cost),
                Algorithm::FixedWindow => fw.entry(k).or_default().acquire_with(&p, now, cost),
                Algorithm::SlidingLog => sl.entry(k).or_default().acquire_with(&p, now, cost),
                Algorithm::LeakyBucket => lb.entry(k).or_default().acquire_with(&p, now, cost),
                Algorithm::Concurrency => unreachable!(),
            };
            prop_assert_eq!(store.check(&[k], now, cost), expected, "step {}", i);
            if evict[i] {
                store.evict_idle(now);
            }
        }
        prop_assert_eq!(store.overflow_decisions(), 0);
        prop_assert!(store.len() <= 6);
    }
}
