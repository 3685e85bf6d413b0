//! Shared arithmetic of the token and leaky buckets (GCRA, "theoretical arrival time").
//!
//! Time is kept in *ticks* of `1 / den` nanoseconds, where `period / requests` reduced to
//! lowest terms is `interval / den`. The emission interval is then exactly `interval` ticks
//! and the capacity exactly `burst × interval` ticks: integer math, no rounding per request,
//! no float drift. Most real limits (`100/s`, `1000/min`) have `den = 1`, so ticks are
//! nanoseconds and a u64 fast path applies; otherwise values are u128 (`ns × den` always
//! fits). The state stores a tick count as two u64 halves so per-key entries keep 8-byte
//! alignment (no padding).

use crate::{Decision, NEVER, Nanos, Params};

/// A tick count stored as two u64 halves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Ticks {
    hi: u64,
    lo: u64,
}

impl Ticks {
    #[inline(always)]
    pub(crate) fn get(self) -> u128 {
        (u128::from(self.hi) << 64) | u128::from(self.lo)
    }

    #[inline(always)]
    pub(crate) fn set(&mut self, v: u128) {
        self.hi = (v >> 64) as u64;
        self.lo = v as u64;
    }

    /// Nanoseconds from which the bucket is full (rounded up).
    #[inline]
    pub(crate) fn to_ns(self, p: &Params) -> Nanos {
        p.den_div.div_ceil_u128(self.get())
    }
}

/// Whole tokens available at `now` (≤ burst).
pub(crate) fn available(tat: Ticks, p: &Params, now: Nanos) -> u64 {
    let now = u128::from(now) * u128::from(p.den);
    let ahead = tat.get().saturating_sub(now);
    p.interval_div.div_u128(p.burst_ticks.saturating_sub(ahead))
}

/// Moves the schedule by `delta` units: later (a debt that may exceed the burst) or earlier
/// (a refund, never before `now`, i.e. never fuller than full).
pub(crate) fn settle(tat: &mut Ticks, p: &Params, now: Nanos, delta: i64) {
    let now = u128::from(now) * u128::from(p.den);
    let start = tat.get().max(now);
    let shift = u128::from(delta.unsigned_abs()) * u128::from(p.interval);
    let moved = if delta >= 0 {
        start.saturating_add(shift)
    } else {
        start.saturating_sub(shift).max(now)
    };
    tat.set(moved);
}

/// Charges `cost` at `now`. Admits if the schedule runs at most `burst` ahead of `now`, or
/// with `SHAPING` at most `burst + max_delay` ahead, reporting the excess as the delay.
#[inline(always)]
pub(crate) fn acquire<const SHAPING: bool>(
    tat: &mut Ticks,
    p: &Params,
    now: Nanos,
    cost: u64,
) -> Decision {
    let limit = p.limit.burst;
    // Fast path: ticks are nanoseconds and everything fits in u64.
    if p.fast && tat.hi == 0 {
        let max = if SHAPING { p.shaping64 } else { p.burst64 };
        if let Some(inc) = cost.checked_mul(p.interval) {
            let start = tat.lo.max(now);
            if let Some(new_tat) = start.checked_add(inc) {
                let ahead = new_tat - now;
                if ahead <= max {
                    tat.lo = new_tat;
                    return Decision {
                        allowed: true,
                        limit,
                        remaining: p.interval_div.div(p.burst64.saturating_sub(ahead)),
                        reset: ahead,
                        retry_after: 0,
                        delay: if SHAPING {
                            ahead.saturating_sub(p.burst64)
                        } else {
                            0
                        },
                    };
                }
            }
        }
    }
    acquire_wide::<SHAPING>(tat, p, now, cost)
}

/// General path in u128 ticks (also every rejection).
#[inline(never)]
fn acquire_wide<const SHAPING: bool>(
    tat: &mut Ticks,
    p: &Params,
    now: Nanos,
    cost: u64,
) -> Decision {
    let limit = p.limit.burst;
    let max = if SHAPING {
        p.shaping_ticks
    } else {
        p.burst_ticks
    };
    let now = u128::from(now) * u128::from(p.den);
    let start = tat.get().max(now);
    let inc = u128::from(cost) * u128::from(p.interval);
    let new_tat = start.checked_add(inc);
    let ahead = new_tat.map(|t| t - now);
    if let (Some(t), Some(ahead)) = (new_tat, ahead)
        && ahead <= max
    {
        tat.set(t);
        return Decision {
            allowed: true,
            limit,
            remaining: p.interval_div.div_u128(p.burst_ticks.saturating_sub(ahead)),
            reset: p.den_div.div_ceil_u128(ahead),
            retry_after: 0,
            delay: if SHAPING {
                p.den_div.div_ceil_u128(ahead.saturating_sub(p.burst_ticks))
            } else {
                0
            },
        };
    }
    // Record the time even when refusing (`tat ≥` every `now` seen): the bucket is no fuller
    // for it, and a clock that later goes backwards is then judged against the latest time
    // seen, so it can never earn tokens twice.
    tat.set(start);
    let current = start - now;
    let retry = match ahead {
        // `cost` fits the bucket at all: wait until the lead has shrunk to `max`.
        Some(a) if inc <= max => p.den_div.div_ceil_u128(a - max),
        _ => NEVER,
    };
    Decision::reject(
        limit,
        p.interval_div
            .div_u128(p.burst_ticks.saturating_sub(current)),
        p.den_div.div_ceil_u128(current),
        retry,
    )
}
