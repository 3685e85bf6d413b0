//! Single-key state machines, one per [`Algorithm`](crate::Algorithm).
//!
//! Each type is the whole per-key state: small, `Default` = a key never seen, and updated
//! lazily from the `now` passed in (no timers). They are not synchronised; the keyed store
//! wraps them in sharded locks, and they can be reused elsewhere (e.g. for leased global
//! tokens) under whatever synchronisation the caller has.

mod concurrency;
mod fixed_window;
mod gcra;
mod leaky_bucket;
mod sliding_log;
mod sliding_window;
mod token_bucket;

pub use concurrency::ConcurrencyLimit;
pub use fixed_window::FixedWindow;
pub use leaky_bucket::LeakyBucket;
pub use sliding_log::SlidingLog;
pub use sliding_window::SlidingWindow;
pub use token_bucket::TokenBucket;

use crate::{Decision, Limit, Nanos, Params};

/// Common interface of the single-key states.
///
/// Clock going backwards is tolerated: no panic, and a state never admits more than it would
/// if every `now` were replaced by the latest `now` it has seen (time is effectively clamped;
/// a key evicted and re-created loses that memory, so keyed stores want a monotonic clock).
pub trait LimiterState: Default + Send + 'static {
    /// Charges `cost` units at `now` against a precomputed limit. A rejection charges nothing
    /// (the state may still note the time). `cost = 0` is a query.
    fn acquire_with(&mut self, params: &Params, now: Nanos, cost: u64) -> Decision;

    /// Convenience form of [`acquire_with`](Self::acquire_with) that precomputes `limit` on
    /// every call (a few divisions); use `acquire_with` on hot paths.
    fn acquire(&mut self, limit: &Limit, now: Nanos, cost: u64) -> Decision {
        self.acquire_with(&Params::new(limit), now, cost)
    }

    /// Earliest time from which this state behaves exactly like `Default` (bucket full,
    /// windows empty, nothing in flight), so dropping it then loses nothing. This is what
    /// idle eviction keys on. [`NEVER`](crate::NEVER) while that is not foreseeable.
    fn idle_at(&self, params: &Params) -> Nanos;

    /// Settles a charge after the fact (cost known only at the response): `delta > 0` takes
    /// that many more units *unconditionally*, so the balance may go below zero and later
    /// requests wait it off; `delta < 0` gives units back, never beyond full. Algorithms whose
    /// state cannot express a debt (sliding log, leaky bucket, concurrency) ignore it; the
    /// policy compiler refuses response-side costs for them.
    fn settle(&mut self, _params: &Params, _now: Nanos, _delta: i64) {}
}

/// `a / b` for a 128-bit dividend and 64-bit divisor, using the cheap 64-bit instruction when
/// the dividend fits. Saturates if the quotient does not fit in u64.
#[inline]
pub(crate) fn div_u128(a: u128, b: u64) -> u64 {
    let b = b.max(1);
    match u64::try_from(a) {
        Ok(a) => a / b,
        Err(_) => u64::try_from(a / u128::from(b)).unwrap_or(u64::MAX),
    }
}
