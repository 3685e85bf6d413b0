//! The outcome of one decision, carrying what the 429 / `RateLimit-*` headers need.

use crate::Nanos;

/// Result of charging `cost` against a limit at some `now`.
///
/// All durations are relative to the `now` of the decision, in nanoseconds; the HTTP layer
/// rounds them up to whole seconds for headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request may proceed (possibly after [`delay`](Self::delay)).
    pub allowed: bool,
    /// The number to advertise in `RateLimit-Limit`: `requests` per period for the window
    /// algorithms, sliding log and concurrency; the capacity (`burst`) for token and leaky
    /// bucket, because that is what `remaining` counts down from.
    pub limit: u64,
    /// Units still available right after this decision (for `RateLimit-Remaining`). For the
    /// leaky bucket: units that would still be forwarded without delay.
    pub remaining: u64,
    /// Time until the limit is fully available again (bucket full / windows empty), or 0 if it
    /// already is. For the fixed window this is the time until the window resets.
    /// Concurrency limits have no time dimension and report 0.
    pub reset: Nanos,
    /// 0 when allowed. When rejected: how long until the same `cost` would be admitted if
    /// nothing else happened, or [`NEVER`](crate::NEVER) if `cost` can never fit. For
    /// concurrency limits this is only a hint (the limit's `period`), since admission depends
    /// on other requests finishing.
    pub retry_after: Nanos,
    /// Leaky bucket shaping: how long the caller must hold the request before forwarding it.
    /// 0 for every other algorithm and for requests that fit in the burst.
    pub delay: Nanos,
}

impl Decision {
    /// An admitted decision with no delay.
    #[inline]
    pub(crate) const fn allow(limit: u64, remaining: u64, reset: Nanos) -> Self {
        Self {
            allowed: true,
            limit,
            remaining,
            reset,
            retry_after: 0,
            delay: 0,
        }
    }

    /// A rejected decision.
    #[inline]
    pub(crate) const fn reject(
        limit: u64,
        remaining: u64,
        reset: Nanos,
        retry_after: Nanos,
    ) -> Self {
        Self {
            allowed: false,
            limit,
            remaining,
            reset,
            retry_after,
            delay: 0,
        }
    }
}
