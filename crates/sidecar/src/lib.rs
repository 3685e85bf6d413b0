//! tollgate-sidecar: a localhost reverse proxy in front of an application that matches
//! requests against RateLimitPolicy rules, decides locally, and answers excess with a 429 that
//! tells clients exactly how to back off. The runtime around the proxy (rule sources, admin
//! port, Redis, drain) is `tollgate-runtime`'s, shared with `tollgate-ratelimit`.

pub mod alias;
pub mod app;
pub mod args;
pub mod cli;

pub use tollgate_runtime::install_crypto_provider;
