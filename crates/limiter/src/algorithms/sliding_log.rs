//! Exact sliding log: one timestamp per admitted unit. Exact but O(limit) memory per key,
//! which is why `Limit` caps `requests` at [`MAX_SLIDING_LOG_REQUESTS`].
//!
//! [`MAX_SLIDING_LOG_REQUESTS`]: crate::MAX_SLIDING_LOG_REQUESTS

use std::collections::VecDeque;

use super::LimiterState;
use crate::{Decision, NEVER, Nanos, Params};

/// At most `requests` units in any interval `(t − period, t]`.
///
/// Memory: `8 × requests` bytes of timestamps at most (plus a 40-byte header); the buffer
/// grows on demand and is never larger than `requests` entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlidingLog {
    log: VecDeque<Nanos>,
    /// Latest `now` seen, so a clock going backwards cannot expire entries early.
    latest: Nanos,
}

impl SlidingLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Timestamps currently held (admitted units not yet known to be expired).
    pub fn len(&self) -> usize {
        self.log.len()
    }

    /// Whether no admitted unit is held.
    pub fn is_empty(&self) -> bool {
        self.log.is_empty()
    }

    /// Bytes of timestamp storage currently allocated.
    pub fn allocated_bytes(&self) -> usize {
        self.log.capacity() * size_of::<Nanos>()
    }
}

impl LimiterState for SlidingLog {
    fn acquire_with(&mut self, p: &Params, now: Nanos, cost: u64) -> Decision {
        let w = p.limit.period;
        let limit = p.limit.requests;
        // A clock that went back is treated as the latest time seen, so nothing expires early.
        self.latest = self.latest.max(now);
        let latest = self.latest;
        while let Some(&front) = self.log.front() {
            if front.saturating_add(w) <= latest {
                self.log.pop_front();
            } else {
                break;
            }
        }
        let used = self.log.len() as u64;
        let left = limit.saturating_sub(used);
        if cost <= left {
            // `cost ≤ limit ≤ MAX_SLIDING_LOG_REQUESTS`, so this fits in usize.
            let add = cost as usize;
            if self.log.len() + add > self.log.capacity() {
                let cap = limit as usize;
                let want = (self.log.capacity() * 2)
                    .max(4)
                    .min(cap)
                    .max(self.log.len() + add);
                self.log.reserve_exact(want - self.log.len());
            }
            self.log.extend(std::iter::repeat_n(latest, add));
            let reset = if self.log.is_empty() {
                0
            } else {
                latest.saturating_add(w).saturating_sub(now)
            };
            return Decision::allow(limit, left - cost, reset);
        }
        let reset = self
            .log
            .back()
            .map_or(0, |&b| b.saturating_add(w).saturating_sub(now));
        let retry = if cost > limit {
            NEVER
        } else {
            // The oldest `used + cost − limit` units must expire first.
            let idx = (used + cost - limit - 1) as usize;
            self.log
                .get(idx)
                .map_or(NEVER, |&t| t.saturating_add(w).saturating_sub(now).max(1))
        };
        Decision::reject(limit, left, reset, retry)
    }

    #[inline]
    fn idle_at(&self, p: &Params) -> Nanos {
        self.log
            .back()
            .map_or(0, |&b| b.saturating_add(p.limit.period))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Limit, MILLISECOND, SECOND};

    #[test]
    fn exact_over_any_window() {
        let p = Params::new(&Limit::per_period(Algorithm::SlidingLog, 3, SECOND).unwrap());
        let mut l = SlidingLog::new();
        assert!(l.acquire_with(&p, 0, 1).allowed);
        assert!(l.acquire_with(&p, 400 * MILLISECOND, 2).allowed);
        let d = l.acquire_with(&p, 900 * MILLISECOND, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, 100 * MILLISECOND);
        assert_eq!(d.reset, 500 * MILLISECOND);
        let d = l.acquire_with(&p, 900 * MILLISECOND, 2);
        assert_eq!(d.retry_after, 500 * MILLISECOND);
        assert!(l.acquire_with(&p, SECOND, 1).allowed);
        assert!(!l.acquire_with(&p, SECOND + 399 * MILLISECOND, 1).allowed);
        assert_eq!(l.acquire_with(&p, SECOND, 4).retry_after, NEVER);
        assert!(l.len() <= 3);
        assert!(l.allocated_bytes() <= 4 * 8);
    }

    #[test]
    fn buffer_never_exceeds_limit() {
        let p = Params::new(&Limit::per_period(Algorithm::SlidingLog, 1000, SECOND).unwrap());
        let mut l = SlidingLog::new();
        for i in 0..5_000 {
            l.acquire_with(&p, i * 1_000, 1);
        }
        assert_eq!(l.len(), 1000);
        assert!(l.log.capacity() <= 1000, "{}", l.log.capacity());
    }
}
