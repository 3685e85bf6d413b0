//! Leaky bucket as a shaper (virtual scheduling): instead of rejecting a request that does
//! not fit the burst, tell the caller how long to hold it so the forwarded stream drains at
//! the configured rate; reject only when the hold would exceed `max_delay`.

use super::LimiterState;
use super::gcra::{self, Ticks};
use crate::{Decision, Nanos, Params};

/// Drains `requests` per `period`; `burst` units pass without delay, later units are delayed
/// (see [`Decision::delay`]) by up to `max_delay`, beyond which they are rejected.
///
/// Same GCRA state as [`TokenBucket`](super::TokenBucket): a request is scheduled at
/// `max(tat, now) + c·T`; the part of that lead beyond `burst·T` is the delay. With
/// `max_delay = 0` it behaves exactly like the token bucket; with `burst = 1` requests leave
/// strictly `T` apart. `limit` is `burst`; `remaining` counts undelayed units.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeakyBucket {
    tat: Ticks,
}

impl LeakyBucket {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }
}

impl LimiterState for LeakyBucket {
    #[inline]
    fn acquire_with(&mut self, p: &Params, now: Nanos, cost: u64) -> Decision {
        gcra::acquire::<true>(&mut self.tat, p, now, cost)
    }

    #[inline]
    fn idle_at(&self, p: &Params) -> Nanos {
        self.tat.to_ns(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Limit, MILLISECOND, NEVER, SECOND};

    fn params(requests: u64, period: Nanos, burst: u64, max_delay: Nanos) -> Params {
        Params::new(
            &Limit::new(Algorithm::LeakyBucket, requests, period, burst, max_delay).unwrap(),
        )
    }

    #[test]
    fn shapes_instead_of_rejecting() {
        // 10/s (T = 100 ms), no burst beyond 1, hold up to 350 ms.
        let p = params(10, SECOND, 1, 350 * MILLISECOND);
        let mut b = LeakyBucket::new();
        let delays: Vec<_> = (0..6).map(|_| b.acquire_with(&p, 0, 1)).collect();
        let got: Vec<_> = delays.iter().map(|d| (d.allowed, d.delay)).collect();
        assert_eq!(
            got,
            vec![
                (true, 0),
                (true, 100 * MILLISECOND),
                (true, 200 * MILLISECOND),
                (true, 300 * MILLISECOND),
                (false, 0),
                (false, 0),
            ]
        );
        assert_eq!(delays[4].retry_after, 50 * MILLISECOND);
        assert_eq!(delays[3].remaining, 0);
        // Once drained, requests pass undelayed again.
        let d = b.acquire_with(&p, SECOND, 1);
        assert_eq!((d.allowed, d.delay), (true, 0));
    }

    #[test]
    fn burst_passes_undelayed() {
        let p = params(10, SECOND, 3, SECOND);
        let mut b = LeakyBucket::new();
        let delays: Vec<_> = (0..5).map(|_| b.acquire_with(&p, 0, 1).delay).collect();
        assert_eq!(delays, vec![0, 0, 0, 100 * MILLISECOND, 200 * MILLISECOND]);
    }

    #[test]
    fn never_when_cost_exceeds_queue() {
        let p = params(10, SECOND, 1, 100 * MILLISECOND);
        let mut b = LeakyBucket::new();
        assert_eq!(b.acquire_with(&p, 0, 3).retry_after, NEVER);
        assert!(b.acquire_with(&p, 0, 2).allowed);
    }

    #[test]
    fn zero_delay_is_a_token_bucket() {
        let q = Limit::new(Algorithm::LeakyBucket, 2, SECOND, 5, 0).unwrap();
        let mut tq = q;
        tq.algorithm = Algorithm::TokenBucket;
        let (mut l, mut t) = (LeakyBucket::new(), super::super::TokenBucket::new());
        for (i, now) in [0, 0, 1, 2, 3, 700_000_000, 700_000_000, 5 * SECOND]
            .into_iter()
            .enumerate()
        {
            let cost = (i as u64 % 3) + 1;
            assert_eq!(l.acquire(&q, now, cost), t.acquire(&tq, now, cost));
        }
    }
}
