//! tollgate-http: the sidecar's HTTP edge. A localhost reverse proxy that asks the engine for a
//! decision on every request and forwards admitted ones to the app: hyper for HTTP/2, upgrades
//! and streamed bodies, and a fast path of its own for plain HTTP/1.1.

pub mod metrics;
pub mod proxy;
pub mod upstream;
