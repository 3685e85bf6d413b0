//! Quotas (what a rule allows) and their precomputed form used on the hot path.

use crate::Nanos;
use crate::divide::Divisor;

/// Largest `requests` accepted for [`Algorithm::SlidingLog`]: the log keeps one timestamp
/// (8 bytes) per admitted unit, so one key can hold up to 80 KB. Larger limits should use
/// [`Algorithm::SlidingWindow`], which is O(1) per key.
pub const MAX_SLIDING_LOG_REQUESTS: u64 = 10_000;

/// Budget for all sliding logs of one [`KeyedLimiter`](crate::KeyedLimiter): its key cap is
/// lowered to `SLIDING_LOG_MAX_BYTES / (8 × requests)` so a flood of keys each filling its
/// log cannot exhaust memory (e.g. 3 355 keys at 10 000 requests, 335 544 at 100).
pub const SLIDING_LOG_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// Which algorithm a limit is enforced with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// GCRA token bucket: capacity `burst`, refilled at `requests` per `period`.
    TokenBucket,
    /// Sliding window counter: `previous × (1 − elapsed/period) + current ≤ requests`.
    SlidingWindow,
    /// Fixed window counter: `requests` per aligned `period` (lets 2× through at a boundary).
    FixedWindow,
    /// Exact sliding log: at most `requests` in any `period` (bounded by
    /// [`MAX_SLIDING_LOG_REQUESTS`]).
    SlidingLog,
    /// Leaky bucket as a shaper: drains `requests` per `period`, `burst` pass undelayed, later
    /// ones are delayed up to `max_delay`, and rejected beyond that.
    LeakyBucket,
    /// At most `requests` in flight at once; `period` is only the `Retry-After` hint.
    Concurrency,
}

/// A rule's limit. Build with [`Limit::new`] (validated). The fields are public for
/// convenience; a limit built by hand with zeros is normalised (zero treated as 1, sliding-log
/// size clamped) rather than allowed to panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Limit {
    /// Algorithm.
    pub algorithm: Algorithm,
    /// Requests (cost units) per `period`; for [`Algorithm::Concurrency`], the in-flight cap.
    pub requests: u64,
    /// Window length / refill period in nanoseconds.
    pub period: Nanos,
    /// Bucket capacity for token and leaky bucket (units admitted at once, undelayed).
    /// Ignored by the other algorithms.
    pub burst: u64,
    /// Leaky bucket: the longest a request may be held to shape traffic. Ignored otherwise.
    pub max_delay: Nanos,
}

/// Why a limit was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// `requests` must be at least 1.
    #[error("requests must be greater than zero")]
    ZeroRequests,
    /// `period` must be at least 1 ns.
    #[error("period must be greater than zero")]
    ZeroPeriod,
    /// `burst` must be at least 1.
    #[error("burst must be greater than zero")]
    ZeroBurst,
    /// The sliding log keeps one timestamp per unit, so its size is capped.
    #[error(
        "sliding log allows at most {max} requests per period (got {requests}); use the sliding window counter"
    )]
    SlidingLogTooLarge {
        /// Requested size.
        requests: u64,
        /// [`MAX_SLIDING_LOG_REQUESTS`].
        max: u64,
    },
}

impl Limit {
    /// A validated limit.
    pub fn new(
        algorithm: Algorithm,
        requests: u64,
        period: Nanos,
        burst: u64,
        max_delay: Nanos,
    ) -> Result<Self, LimitError> {
        let q = Self {
            algorithm,
            requests,
            period,
            burst,
            max_delay,
        };
        q.validate()?;
        Ok(q)
    }

    /// `requests` per `period` with `burst = requests` and no shaping delay.
    pub fn per_period(
        algorithm: Algorithm,
        requests: u64,
        period: Nanos,
    ) -> Result<Self, LimitError> {
        Self::new(algorithm, requests, period, requests, 0)
    }

    /// Checks the invariants [`Limit::new`] enforces.
    pub fn validate(&self) -> Result<(), LimitError> {
        if self.requests == 0 {
            return Err(LimitError::ZeroRequests);
        }
        if self.period == 0 {
            return Err(LimitError::ZeroPeriod);
        }
        if self.burst == 0 {
            return Err(LimitError::ZeroBurst);
        }
        if self.algorithm == Algorithm::SlidingLog && self.requests > MAX_SLIDING_LOG_REQUESTS {
            return Err(LimitError::SlidingLogTooLarge {
                requests: self.requests,
                max: MAX_SLIDING_LOG_REQUESTS,
            });
        }
        Ok(())
    }

    /// The same limit with out-of-range fields clamped, so the math below can never divide
    /// by zero or allocate without bound.
    pub fn normalized(&self) -> Self {
        let mut q = *self;
        q.requests = q.requests.max(1);
        q.period = q.period.max(1);
        q.burst = q.burst.max(1);
        if q.algorithm == Algorithm::SlidingLog {
            q.requests = q.requests.min(MAX_SLIDING_LOG_REQUESTS);
        }
        q
    }
}

/// A limit with the derived constants the algorithms need precomputed (divisions done once
/// per rule rather than once per request). Build once per rule, reuse for every key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    pub(crate) limit: Limit,
    /// `period / requests` in lowest terms is `interval / den` ns (see `algorithms/gcra.rs`):
    /// GCRA time runs in ticks of `1/den` ns and the emission interval is `interval` ticks.
    pub(crate) den: u64,
    pub(crate) interval: u64,
    /// Bucket capacity in ticks: `burst × interval`.
    pub(crate) burst_ticks: u128,
    /// Leaky bucket: `burst_ticks + max_delay × den`, the longest lead accepted.
    pub(crate) shaping_ticks: u128,
    /// `den == 1` and both capacities fit in u64: GCRA can run in plain u64 nanoseconds.
    pub(crate) fast: bool,
    pub(crate) burst64: u64,
    pub(crate) shaping64: u64,
    /// Divisions by per-rule constants without a `div` instruction.
    pub(crate) interval_div: Divisor,
    pub(crate) den_div: Divisor,
    pub(crate) window_div: Divisor,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Params {
    /// Precomputes `limit` (normalised, see [`Limit::normalized`]).
    pub fn new(limit: &Limit) -> Self {
        let limit = limit.normalized();
        let g = gcd(limit.requests, limit.period);
        let (den, interval) = (limit.requests / g, limit.period / g);
        let burst_ticks = u128::from(limit.burst) * u128::from(interval);
        let shaping_ticks =
            burst_ticks.saturating_add(u128::from(limit.max_delay) * u128::from(den));
        let fast = den == 1 && shaping_ticks <= u128::from(u64::MAX);
        Self {
            limit,
            den,
            interval,
            burst_ticks,
            shaping_ticks,
            fast,
            burst64: u64::try_from(burst_ticks).unwrap_or(u64::MAX),
            shaping64: u64::try_from(shaping_ticks).unwrap_or(u64::MAX),
            interval_div: Divisor::new(interval),
            den_div: Divisor::new(den),
            window_div: Divisor::new(limit.period),
        }
    }

    /// The normalised limit.
    #[inline]
    pub fn limit(&self) -> &Limit {
        &self.limit
    }
}

impl From<Limit> for Params {
    fn from(q: Limit) -> Self {
        Params::new(&q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SECOND;

    #[test]
    fn validation() {
        use Algorithm::*;
        assert_eq!(
            Limit::new(TokenBucket, 0, SECOND, 1, 0),
            Err(LimitError::ZeroRequests)
        );
        assert_eq!(
            Limit::new(TokenBucket, 1, 0, 1, 0),
            Err(LimitError::ZeroPeriod)
        );
        assert_eq!(
            Limit::new(TokenBucket, 1, SECOND, 0, 0),
            Err(LimitError::ZeroBurst)
        );
        assert!(Limit::per_period(SlidingLog, MAX_SLIDING_LOG_REQUESTS, SECOND).is_ok());
        assert_eq!(
            Limit::per_period(SlidingLog, MAX_SLIDING_LOG_REQUESTS + 1, SECOND),
            Err(LimitError::SlidingLogTooLarge {
                requests: MAX_SLIDING_LOG_REQUESTS + 1,
                max: MAX_SLIDING_LOG_REQUESTS
            })
        );
        // Large windows are fine for the O(1) algorithms.
        assert!(Limit::per_period(SlidingWindow, 1 << 40, SECOND).is_ok());
    }

    #[test]
    fn params_are_exact() {
        let q = Limit::new(Algorithm::TokenBucket, 3, SECOND, 5, 7).unwrap();
        let p = Params::new(&q);
        assert_eq!((p.den, p.interval, p.fast), (3, SECOND, false));
        assert_eq!(p.burst_ticks, 5 * u128::from(SECOND));
        assert_eq!(p.shaping_ticks, 5 * u128::from(SECOND) + 21);
        let q = Limit::new(Algorithm::TokenBucket, 1000, 60 * SECOND, 50, 0).unwrap();
        let p = Params::new(&q);
        assert_eq!((p.den, p.interval, p.fast), (1, 60_000_000, true));
        let huge = Limit::new(
            Algorithm::LeakyBucket,
            u64::MAX,
            u64::MAX,
            u64::MAX,
            u64::MAX,
        )
        .unwrap();
        assert_eq!(Params::new(&huge).shaping_ticks, 2 * u128::from(u64::MAX));
    }

    #[test]
    fn hand_built_zero_quota_is_normalised() {
        let q = Limit {
            algorithm: Algorithm::SlidingLog,
            requests: 0,
            period: 0,
            burst: 0,
            max_delay: 0,
        };
        let p = Params::new(&q);
        assert_eq!(p.limit().requests, 1);
        assert_eq!(p.limit().period, 1);
        assert_eq!(p.limit().burst, 1);
    }
}
