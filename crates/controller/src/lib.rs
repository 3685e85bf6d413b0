//! tollgate-controller: the Kubernetes side of tollgate.
//!
//! ```text
//!  kube-apiserver ──watch──▶ runtime ──apply/delete/reset──▶ index ──watch::Sender per pod──┐
//!   RateLimitPolicy, Pod        (one task per kind)        (compile, select,               │
//!        ▲                                                  membership counts)              ▼
//!        │ patch_status (leader)                                 server: GET /v1/watch (ndjson)
//!        └──── status ◀── policy views ◀── acks ◀────────────────────── POST /v1/ack
//!                 ▲
//!               leader (Lease)          auth: TokenReview → namespace/pod scoping
//! ```
//!
//! - [`index`]: pure state (no client): policies compiled with `tollgate_crd::compile`, the last
//!   good version kept when an update is invalid, pods and the policies selecting them, one
//!   `watch` channel per pod, a global version.
//! - [`membership`]: connected sidecars per policy, acks, the connection guard.
//! - [`server`]: the rule-stream HTTP server (see `docs/rule-stream.md`).
//! - [`auth`]: bearer tokens via TokenReview, request scoping.
//! - [`status`]: conditions and counters on `RateLimitPolicy.status`, Events (leader only).
//! - [`leader`]: Lease-based leader election.
//! - [`metrics`]: Prometheus metrics (`tollgate_controller_*`).
//! - [`webhook`]: admission webhooks (sidecar injection, RateLimitPolicy validation) and their TLS.
//! - [`telemetry`]: the controller's trace spans (reconciles, status writes, token reviews);
//!   logs and the exporter are set up by `tollgate-telemetry`, as for the sidecar.
//! - [`args`], [`runtime`]: flags, and the wiring (a build per component that binds its port,
//!   a spawn per task, a drain that lets each task finish the work in hand).

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms)]

pub mod args;
pub mod auth;
pub mod coverage;
pub mod index;
pub mod key_hash;
pub mod leader;
pub mod membership;
pub mod metrics;
pub mod peers;
pub mod retire;
pub mod runtime;
pub mod server;
pub mod status;
pub mod telemetry;
pub mod top_keys;
pub mod webhook;

#[cfg(test)]
pub(crate) mod test_util;
