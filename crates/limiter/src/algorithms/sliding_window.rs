//! Sliding window counter (the seed's `SlidingWindowCounter`): two counters per key, with the
//! previous window weighted by how much of it still overlaps the sliding window. Evaluated
//! in exact integer arithmetic (everything multiplied by the window length), so there is no
//! float rounding at the limit.

use super::{LimiterState, div_u128};
use crate::{Decision, NEVER, Nanos, Params};

/// `previous × (1 − elapsed/period) + current + cost ≤ requests`, windows aligned to
/// multiples of `period`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlidingWindow {
    start: Nanos,
    prev: u64,
    cur: u64,
}

impl SlidingWindow {
    /// Empty windows.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rolls to the window containing `now`; the old current window becomes the previous one
    /// only if it is directly adjacent. A clock that went back stays in the latest window.
    #[inline]
    fn roll(&mut self, now: Nanos, w: Nanos) {
        if now.saturating_sub(self.start) >= w {
            let start = now - now % w;
            self.prev = if start - self.start == w { self.cur } else { 0 };
            self.cur = 0;
            self.start = start;
        }
    }

    /// Time until both windows are empty, from offset `elapsed` into the current one.
    #[inline]
    fn reset(&self, elapsed: Nanos, w: Nanos) -> Nanos {
        if self.cur > 0 {
            w.saturating_mul(2) - elapsed
        } else if self.prev > 0 {
            w - elapsed
        } else {
            0
        }
    }

    /// Absolute time at which `cost` would fit if nothing else is admitted (`None` if that is
    /// past the end of time). Requires `cost ≤ limit` and a rejected request (so `prev > 0` or
    /// `cur + cost > limit`).
    fn fits_at(&self, w: Nanos, limit: u64, cost: u64) -> Option<Nanos> {
        let w128 = u128::from(w);
        if self.cur + cost <= limit {
            // This window: need prev·(w − e) ≤ (limit − cur − cost)·w.
            let slack = u128::from(limit - self.cur - cost) * w128;
            let weight = div_u128(slack, self.prev.max(1)).min(w);
            self.start.checked_add(w - weight)
        } else {
            // Next window, where the current count becomes the previous one.
            let slack = u128::from(limit - cost) * w128;
            let weight = div_u128(slack, self.cur.max(1)).min(w);
            self.start.checked_add(w)?.checked_add(w - weight)
        }
    }
}

impl LimiterState for SlidingWindow {
    #[inline]
    fn acquire_with(&mut self, p: &Params, now: Nanos, cost: u64) -> Decision {
        let w = p.limit.period;
        let limit = p.limit.requests;
        self.roll(now, w);
        let elapsed = now.saturating_sub(self.start);
        let w128 = u128::from(w);
        // Scaled by w: estimate·w = prev·(w − elapsed) + cur·w.
        let weighted_prev = u128::from(self.prev) * u128::from(w - elapsed);
        let used = weighted_prev + u128::from(self.cur) * w128;
        let capacity = u128::from(limit) * w128;
        let need = u128::from(cost) * w128;
        if used + need <= capacity {
            self.cur += cost;
            let remaining = if self.prev == 0 {
                limit - self.cur
            } else {
                p.window_div.div_u128(capacity - used - need)
            };
            return Decision::allow(limit, remaining, self.reset(elapsed, w));
        }
        let remaining = p.window_div.div_u128(capacity.saturating_sub(used));
        let retry = if cost > limit {
            NEVER
        } else {
            self.fits_at(w, limit, cost)
                .map_or(NEVER, |at| at.saturating_sub(now).max(1))
        };
        Decision::reject(limit, remaining, self.reset(elapsed, w), retry)
    }

    /// A charge counts in the window current at `now`; a refund comes off the current
    /// window only (a reservation refunded after a rollover stays counted: it errs towards
    /// admitting less).
    fn settle(&mut self, p: &Params, now: Nanos, delta: i64) {
        self.roll(now, p.limit.period);
        self.cur = self.cur.saturating_add_signed(delta);
    }

    #[inline]
    fn idle_at(&self, p: &Params) -> Nanos {
        let w = p.limit.period;
        if self.cur > 0 {
            self.start.saturating_add(w.saturating_mul(2))
        } else if self.prev > 0 {
            self.start.saturating_add(w)
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Limit, MILLISECOND, SECOND};

    fn params(limit: u64, w: Nanos) -> Params {
        Params::new(&Limit::per_period(Algorithm::SlidingWindow, limit, w).unwrap())
    }

    /// Seed example: limit 10/s; 10 of 15 immediate requests pass; halfway into the next
    /// window the previous window still counts 50 %, so only 5 more pass.
    #[test]
    fn seed_limit_10_per_second() {
        let p = params(10, SECOND);
        let mut s = SlidingWindow::new();
        let t0 = 100 * SECOND;
        let a = (0..15)
            .filter(|_| s.acquire_with(&p, t0, 1).allowed)
            .count();
        assert_eq!(a, 10);
        let half = t0 + SECOND + SECOND / 2;
        let b = (0..15)
            .filter(|_| s.acquire_with(&p, half, 1).allowed)
            .count();
        assert_eq!(
            b, 5,
            "a fixed window would allow 10 here (20 within a short span)"
        );
    }

    #[test]
    fn retry_after_is_exact() {
        let p = params(10, SECOND);
        let mut s = SlidingWindow::new();
        for _ in 0..10 {
            assert!(s.acquire_with(&p, 0, 1).allowed);
        }
        // Same window: must wait for the next one; at its start prev (10) counts fully,
        // each 100 ms frees one unit.
        let d = s.acquire_with(&p, 0, 1);
        assert_eq!(d.retry_after, SECOND + 100 * MILLISECOND);
        assert_eq!(d.reset, 2 * SECOND);
        assert!(
            !s.acquire_with(&p, SECOND + 100 * MILLISECOND - 1, 1)
                .allowed
        );
        let d = s.acquire_with(&p, SECOND + 100 * MILLISECOND, 1);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
        // Now in-window: prev 10 at weight 0.9 = 9, cur 1 -> full until 0.2 s.
        let d = s.acquire_with(&p, SECOND + 150 * MILLISECOND, 1);
        assert_eq!(d.retry_after, 50 * MILLISECOND);
        assert!(s.acquire_with(&p, SECOND + 200 * MILLISECOND, 1).allowed);
        assert_eq!(s.acquire_with(&p, 0, 11).retry_after, NEVER);
    }

    #[test]
    fn gap_longer_than_a_window_forgets_everything() {
        let p = params(2, SECOND);
        let mut s = SlidingWindow::new();
        assert!(s.acquire_with(&p, 0, 2).allowed);
        assert_eq!(s.idle_at(&p), 2 * SECOND);
        let d = s.acquire_with(&p, 2 * SECOND, 2);
        assert!(d.allowed);
        assert_eq!(d.remaining, 0);
    }
}
