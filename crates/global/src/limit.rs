//! Compiled limits as the limiter's `Limit`s: one translation for the local rules and
//! the global rules' fallback shares alike.

use tollgate_crd::compiled::{Algorithm, CompiledLimit};
use tollgate_limiter::{self as limiter, Limit, Nanos};

/// Translates a compiled limit into the limiter's `Limit`.
pub fn for_limiter(l: &CompiledLimit) -> Result<Limit, limiter::LimitError> {
    const MS: Nanos = 1_000_000;
    let algorithm = match l.algorithm {
        Algorithm::TokenBucket => limiter::Algorithm::TokenBucket,
        Algorithm::SlidingWindow => limiter::Algorithm::SlidingWindow,
        Algorithm::FixedWindow => limiter::Algorithm::FixedWindow,
        Algorithm::SlidingLog => limiter::Algorithm::SlidingLog,
        Algorithm::LeakyBucket => limiter::Algorithm::LeakyBucket,
        Algorithm::Concurrency => limiter::Algorithm::Concurrency,
    };
    // Concurrency has no period; one second is only the Retry-After hint. Saturating: a rule
    // from the stream is not re-validated, and a wrapped period would be a tiny one.
    let period = if l.period_ms == 0 {
        1_000 * MS
    } else {
        l.period_ms.saturating_mul(MS)
    };
    // A leaky bucket passes no bursts: every request beyond the drain rate is delayed.
    let burst = match l.algorithm {
        Algorithm::TokenBucket => l.burst,
        Algorithm::LeakyBucket => 1,
        _ => l.requests,
    };
    Limit::new(
        algorithm,
        l.requests,
        period,
        burst,
        l.max_delay_ms.saturating_mul(MS),
    )
}
