//! Token bucket as GCRA ("theoretical arrival time"): one exact fixed-point timestamp per
//! key instead of a token count plus a refill time, so there is no float drift and refill is
//! implicit in comparing with `now`.

use super::LimiterState;
use super::gcra::{self, Ticks};
use crate::{Decision, Nanos, Params};

/// Capacity `burst`, refilled at `requests` per `period`.
///
/// State is the time `tat` at which the bucket will be full again. A request of cost `c` at
/// `now` fits if `max(tat, now) + c·T − now ≤ burst·T` (with `T = period / requests`, kept
/// exact by counting time in `1/requests` ns ticks). `limit` in decisions is `burst`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenBucket {
    tat: Ticks,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whole tokens available at `now` (never more than `burst`).
    pub fn available(&self, params: &Params, now: Nanos) -> u64 {
        gcra::available(self.tat, params, now)
    }
}

impl LimiterState for TokenBucket {
    #[inline]
    fn acquire_with(&mut self, p: &Params, now: Nanos, cost: u64) -> Decision {
        gcra::acquire::<false>(&mut self.tat, p, now, cost)
    }

    #[inline]
    fn idle_at(&self, p: &Params) -> Nanos {
        self.tat.to_ns(p)
    }

    fn settle(&mut self, p: &Params, now: Nanos, delta: i64) {
        gcra::settle(&mut self.tat, p, now, delta);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Limit, NEVER, SECOND};

    fn params(requests: u64, period: Nanos, burst: u64) -> Params {
        Params::new(&Limit::new(Algorithm::TokenBucket, requests, period, burst, 0).unwrap())
    }

    /// A cost known only at the response: settled into debt, waited off, refunded up to full.
    #[test]
    fn settle_can_go_into_debt_and_refunds_stop_at_full() {
        let p = params(10, SECOND, 10);
        let mut b = TokenBucket::new();
        let t0 = 100 * SECOND;
        assert!(b.acquire_with(&p, t0, 1).allowed);
        // The response said 15: 14 more, 5 beyond the bucket.
        b.settle(&p, t0, 14);
        let d = b.acquire_with(&p, t0, 1);
        assert!(!d.allowed);
        // 5 owed plus the 1 wanted, at 10/s.
        assert_eq!(d.retry_after, 600 * crate::MILLISECOND);
        assert!(b.acquire_with(&p, t0 + 600 * crate::MILLISECOND, 1).allowed);
        // A refund larger than what was spent leaves the bucket full, not fuller.
        b.settle(&p, t0 + SECOND, -100);
        assert_eq!(b.available(&p, t0 + SECOND), 10);
    }

    /// Seed example: capacity 5, refill 2/s.
    #[test]
    fn seed_capacity_5_refill_2_per_second() {
        let p = params(2, SECOND, 5);
        let mut b = TokenBucket::new();
        let t0 = 1_000 * SECOND;
        let allowed = (0..10)
            .filter(|_| b.acquire_with(&p, t0, 1).allowed)
            .count();
        assert_eq!(allowed, 5, "10 immediate requests -> the burst of 5");

        let t1 = t0 + SECOND;
        let allowed = (0..10)
            .filter(|_| b.acquire_with(&p, t1, 1).allowed)
            .count();
        assert_eq!(allowed, 2, "after 1 s exactly 2");

        let t2 = t1 + 3_600 * SECOND;
        assert_eq!(b.available(&p, t2), 5, "caps at capacity after a long idle");
        let allowed = (0..10)
            .filter(|_| b.acquire_with(&p, t2, 1).allowed)
            .count();
        assert_eq!(allowed, 5);
    }

    #[test]
    fn decision_headers() {
        let p = params(2, SECOND, 5);
        let mut b = TokenBucket::new();
        let d = b.acquire_with(&p, 0, 1);
        assert_eq!(d, Decision::allow(5, 4, SECOND / 2));
        let d = b.acquire_with(&p, 0, 4);
        assert_eq!(d, Decision::allow(5, 0, 5 * SECOND / 2));
        let d = b.acquire_with(&p, 0, 1);
        assert_eq!(d, Decision::reject(5, 0, 5 * SECOND / 2, SECOND / 2));
        // Cost above capacity can never be admitted.
        let d = b.acquire_with(&p, 10 * SECOND, 6);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, NEVER);
        assert_eq!(d.remaining, 5);
    }

    #[test]
    fn fractional_interval_does_not_drift() {
        // 3 per second: T = 333_333_333.33 ns. Over 3_000 s exactly 9_000 (+ burst) pass.
        // (Burst 2 so the bucket is never full while polled, i.e. no refill is wasted.)
        let p = params(3, SECOND, 2);
        let mut b = TokenBucket::new();
        let mut admitted = 0u64;
        let mut now = 0;
        while now <= 3_000 * SECOND {
            while b.acquire_with(&p, now, 1).allowed {
                admitted += 1;
            }
            now += 1_000_000; // poll every ms
        }
        assert_eq!(admitted, 9_002);
    }

    #[test]
    fn reset_and_retry_round_up() {
        // T = 1/3 s: after one request the bucket is full again in 333_333_333.33 ns.
        let p = params(3, SECOND, 1);
        let mut b = TokenBucket::new();
        assert_eq!(b.acquire_with(&p, 0, 1).reset, 333_333_334);
        let d = b.acquire_with(&p, 0, 1);
        assert_eq!(d.retry_after, 333_333_334);
        assert!(!b.acquire_with(&p, 333_333_333, 1).allowed);
        assert!(b.acquire_with(&p, 333_333_334, 1).allowed);
    }

    #[test]
    fn clock_backwards_is_stricter_not_looser() {
        let p = params(1, SECOND, 2);
        let mut b = TokenBucket::new();
        assert!(b.acquire_with(&p, 10 * SECOND, 2).allowed);
        let d = b.acquire_with(&p, 5 * SECOND, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, 6 * SECOND);
    }

    #[test]
    fn end_of_time_does_not_panic_or_admit_forever() {
        let p = params(1, 1, u64::MAX);
        let mut b = TokenBucket::new();
        let n = (0..5)
            .filter(|_| b.acquire_with(&p, Nanos::MAX, u64::MAX).allowed)
            .count();
        assert!(n <= 2, "{n}");
        let p = params(u64::MAX, u64::MAX, u64::MAX);
        let mut b = TokenBucket::new();
        let d = b.acquire_with(&p, Nanos::MAX, u64::MAX);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
    }
}
