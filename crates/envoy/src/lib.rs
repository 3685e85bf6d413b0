//! tollgate-envoy: the engine served to Envoy. The rate limit service (RLS v3,
//! `ShouldRateLimit`) decides each descriptor with the engine; the rate limit quota service
//! (RLQS) hands Envoys demand-weighted shares of each limit through the `share` book.

pub mod metrics;
pub mod rlqs;
pub mod rls;
pub mod share;
