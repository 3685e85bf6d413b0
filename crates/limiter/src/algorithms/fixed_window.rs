//! Fixed window counter: the cheapest state (start + count). Windows are aligned to
//! multiples of `period` on the caller's clock, so all keys roll over together.

use super::LimiterState;
use crate::{Decision, NEVER, Nanos, Params};

/// At most `requests` units per aligned window of `period`.
///
/// Known flaw (kept for parity with common limiters): a client can spend the full limit at
/// the end of one window and again at the start of the next, i.e. 2× within a short span.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FixedWindow {
    start: Nanos,
    count: u64,
}

impl FixedWindow {
    /// An empty window.
    pub fn new() -> Self {
        Self::default()
    }
}

impl LimiterState for FixedWindow {
    #[inline]
    fn acquire_with(&mut self, p: &Params, now: Nanos, cost: u64) -> Decision {
        let w = p.limit.period;
        let limit = p.limit.requests;
        // Lazy rollover; a clock that went back stays in the latest window seen.
        if now.saturating_sub(self.start) >= w {
            self.start = now - now % w;
            self.count = 0;
        }
        // No next window before the end of time (u64 nanoseconds): it never resets.
        let reset = self
            .start
            .checked_add(w)
            .map_or(NEVER, |end| end.saturating_sub(now));
        let left = limit.saturating_sub(self.count);
        if cost <= left {
            self.count += cost;
            Decision::allow(limit, left - cost, reset)
        } else {
            let retry = if cost > limit { NEVER } else { reset };
            Decision::reject(limit, left, reset, retry)
        }
    }

    /// A charge counts in the window current at `now` (a debt lasts until that window ends);
    /// a refund only while the window the state holds is still current.
    fn settle(&mut self, p: &Params, now: Nanos, delta: i64) {
        let w = p.limit.period;
        if now.saturating_sub(self.start) >= w {
            if delta <= 0 {
                return;
            }
            self.start = now - now % w;
            self.count = 0;
        }
        self.count = self.count.saturating_add_signed(delta);
    }

    #[inline]
    fn idle_at(&self, p: &Params) -> Nanos {
        if self.count == 0 {
            0
        } else {
            self.start.saturating_add(p.limit.period)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settle_charges_the_current_window_and_refunds_only_within_it() {
        let p = Params::new(
            &crate::Limit::per_period(crate::Algorithm::FixedWindow, 10, crate::SECOND).unwrap(),
        );
        let mut w = FixedWindow::new();
        assert!(w.acquire_with(&p, 0, 1).allowed);
        w.settle(&p, 0, 11);
        assert!(!w.acquire_with(&p, 0, 1).allowed, "12 counted against 10");
        w.settle(&p, 0, -3);
        assert!(w.acquire_with(&p, 0, 1).allowed, "refunded to 9");
        // Next window: a refund for the old one changes nothing; a charge counts in the new one.
        w.settle(&p, crate::SECOND, -5);
        assert_eq!(w.acquire_with(&p, crate::SECOND, 0).remaining, 10);
        w.settle(&p, crate::SECOND, 10);
        assert!(!w.acquire_with(&p, crate::SECOND, 1).allowed);
    }
    use crate::{Algorithm, Limit, MILLISECOND, SECOND};

    /// Documents the boundary flaw: 2× the limit within a few milliseconds.
    #[test]
    fn lets_twice_the_limit_through_across_a_boundary() {
        let p = Params::new(&Limit::per_period(Algorithm::FixedWindow, 10, SECOND).unwrap());
        let mut w = FixedWindow::new();
        let end_of_window = 5 * SECOND - MILLISECOND;
        let a = (0..15)
            .filter(|_| w.acquire_with(&p, end_of_window, 1).allowed)
            .count();
        let start_of_next = 5 * SECOND + MILLISECOND;
        let b = (0..15)
            .filter(|_| w.acquire_with(&p, start_of_next, 1).allowed)
            .count();
        assert_eq!(
            (a, b),
            (10, 10),
            "20 admitted within 2 ms with a limit of 10/s"
        );
    }

    #[test]
    fn headers_and_never() {
        let p = Params::new(&Limit::per_period(Algorithm::FixedWindow, 3, SECOND).unwrap());
        let mut w = FixedWindow::new();
        let now = 10 * SECOND + 250 * MILLISECOND;
        assert_eq!(
            w.acquire_with(&p, now, 2),
            Decision::allow(3, 1, 750 * MILLISECOND)
        );
        assert_eq!(
            w.acquire_with(&p, now, 2),
            Decision::reject(3, 1, 750 * MILLISECOND, 750 * MILLISECOND)
        );
        assert_eq!(w.acquire_with(&p, now, 4).retry_after, NEVER);
        assert_eq!(w.idle_at(&p), 11 * SECOND);
        // Clock going back stays in the current window.
        assert!(w.acquire_with(&p, 0, 1).allowed);
        assert!(!w.acquire_with(&p, 0, 1).allowed);
    }
}
