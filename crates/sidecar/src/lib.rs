//! tollgate-sidecar: a localhost reverse proxy in front of an application that matches
//! requests against RateLimitPolicy rules, decides locally, and answers excess with a 429 that
//! tells clients exactly how to back off.

pub mod admin;
pub mod app;
pub mod args;
pub mod audit;
pub mod block;
pub mod cli;
pub mod config;
pub mod controller;
pub mod engine;
pub mod explain;
pub mod global;
pub mod identity;
pub mod keys;
pub mod listen;
pub mod metrics;
pub mod problem;
pub mod proxy;
pub mod quota;
pub mod replay;
pub mod response;
pub mod rlqs;
pub mod rls;
pub mod rules;
pub mod rules_cache;
pub mod share;
pub mod telemetry;
pub mod topkeys;
pub mod upstream;

/// Makes ring the process's rustls crypto provider, which the controller connection's TLS
/// configuration takes (rustls is built without a default one). Idempotent; called before it.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
