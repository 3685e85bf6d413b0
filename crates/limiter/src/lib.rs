//! Rate-limiting decisions for tollgate: pure Rust, no I/O, clock injected.
//!
//! Time is [`Nanos`]: monotonic nanoseconds passed in by the caller, so every algorithm is
//! deterministic and testable with a [`FakeClock`], and the hot path never reads a clock twice.
//!
//! * [`algorithms`] holds one single-key state type per [`Algorithm`]. Each refills or rolls
//!   over lazily from the `now` it is given (no timer per key) and charges a `cost`.
//! * [`KeyedLimiter`] is a concurrent, sharded, memory-bounded map from key bytes to those
//!   states, one per rule.
//! * Every decision is a [`Decision`] carrying what the `RateLimit-*` and `Retry-After`
//!   headers need.
//!
//! ```
//! use tollgate_limiter::{Algorithm, Clock, FakeClock, KeyedLimiter, Limit, SECOND, StoreConfig};
//!
//! // 2 requests per second, bursts of 5.
//! let limit = Limit::new(Algorithm::TokenBucket, 2, SECOND, 5, 0)?;
//! let limiter = KeyedLimiter::new(limit, StoreConfig::default());
//! let clock = FakeClock::new(0);
//!
//! let admitted = (0..10).filter(|_| limiter.check(b"ip:203.0.113.7", clock.now(), 1).allowed);
//! assert_eq!(admitted.count(), 5);
//!
//! let d = limiter.check(b"ip:203.0.113.7", clock.now(), 1);
//! assert!(!d.allowed);
//! assert_eq!((d.limit, d.remaining), (5, 0));
//! assert_eq!(d.retry_after, SECOND / 2); // one token refills in 0.5 s
//!
//! clock.advance(SECOND);
//! assert!(limiter.check(b"ip:203.0.113.7", clock.now(), 2).allowed);
//! # Ok::<(), tollgate_limiter::LimitError>(())
//! ```

pub mod algorithms;
mod clock;
mod decision;
mod divide;
mod keyed;
mod limit;
mod lock;
mod siphash;
mod store;

pub use algorithms::{
    ConcurrencyLimit, FixedWindow, LeakyBucket, LimiterState, SlidingLog, SlidingWindow,
    TokenBucket,
};
pub use clock::{Clock, FakeClock, MonotonicClock};
pub use decision::Decision;
pub use keyed::{KeyedLimiter, Permit};
pub use limit::{
    Algorithm, Limit, LimitError, MAX_SLIDING_LOG_REQUESTS, Params, SLIDING_LOG_MAX_BYTES,
};
pub use store::{MIN_SCAN_INTERVAL, StoreConfig};

/// Monotonic time in nanoseconds since an arbitrary origin chosen by the caller's [`Clock`].
pub type Nanos = u64;

/// Returned as [`Decision::retry_after`] when the request can never be admitted (its `cost`
/// exceeds what the limit can ever hold). Callers should map it to a plain 429 without a
/// meaningful `Retry-After` (or a large one).
pub const NEVER: Nanos = Nanos::MAX;

/// Nanoseconds per second, for building limits.
pub const SECOND: Nanos = 1_000_000_000;
/// Nanoseconds per millisecond.
pub const MILLISECOND: Nanos = 1_000_000;
