//! tollgate-sidecar: a localhost reverse proxy in front of an application that matches
//! requests against RateLimitPolicy rules, decides locally, and answers excess with a 429 that
//! tells clients exactly how to back off.

pub mod admin;
pub mod app;
pub mod args;
pub mod cli;
pub mod controller;
pub mod rules_cache;

/// Makes ring the process's rustls crypto provider, which the controller connection's TLS
/// configuration takes (rustls is built without a default one). Idempotent; called before it.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
