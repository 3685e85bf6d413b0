//! In-flight limit (bulkhead): a counter, not a rate. Units are taken by
//! [`acquire_with`](LimiterState::acquire_with) and given back by
//! [`release`](ConcurrencyLimit::release) when the request completes.

use super::LimiterState;
use crate::{Decision, NEVER, Nanos, Params};

/// At most `requests` units in flight. Decisions report `reset = 0` (no time dimension) and,
/// when rejected, the limit's `period` as a retry hint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConcurrencyLimit {
    in_flight: u64,
}

impl ConcurrencyLimit {
    /// Nothing in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// Units currently held.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// What [`acquire_with`](LimiterState::acquire_with) would decide, without taking units.
    #[inline]
    pub fn peek(&self, p: &Params, cost: u64) -> Decision {
        let limit = p.limit.requests;
        let left = limit.saturating_sub(self.in_flight);
        if cost <= left {
            Decision::allow(limit, left - cost, 0)
        } else {
            let retry = if cost > limit { NEVER } else { p.limit.period };
            Decision::reject(limit, left, 0, retry)
        }
    }

    /// Gives back `cost` units (saturating, so a double release cannot underflow).
    #[inline]
    pub fn release(&mut self, cost: u64) {
        self.in_flight = self.in_flight.saturating_sub(cost);
    }
}

impl LimiterState for ConcurrencyLimit {
    #[inline]
    fn acquire_with(&mut self, p: &Params, _now: Nanos, cost: u64) -> Decision {
        let d = self.peek(p, cost);
        if d.allowed {
            self.in_flight += cost;
        }
        d
    }

    #[inline]
    fn idle_at(&self, _params: &Params) -> Nanos {
        if self.in_flight == 0 { 0 } else { NEVER }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algorithm, Limit, SECOND};

    #[test]
    fn acquire_release() {
        let p = Params::new(&Limit::per_period(Algorithm::Concurrency, 2, SECOND).unwrap());
        let mut c = ConcurrencyLimit::new();
        assert_eq!(c.acquire_with(&p, 0, 1), Decision::allow(2, 1, 0));
        assert!(c.acquire_with(&p, 0, 1).allowed);
        assert_eq!(c.acquire_with(&p, 0, 1), Decision::reject(2, 0, 0, SECOND));
        assert_eq!(c.idle_at(&p), NEVER);
        c.release(1);
        assert!(c.peek(&p, 1).allowed);
        assert_eq!(c.in_flight(), 1);
        c.release(5);
        assert_eq!(c.in_flight(), 0);
        assert_eq!(c.acquire_with(&p, 0, 3).retry_after, NEVER);
    }
}
