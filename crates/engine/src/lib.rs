//! tollgate-engine: the decision core that every edge (the HTTP proxy, Envoy's RLS and RLQS,
//! replay and `/debug/why`) shares. Matches a request's facts against the rules in force,
//! extracts client keys, decides locally or from leases, and shapes the answer a rejected
//! client gets. It knows no protocol server and no process wiring.

pub mod audit;
pub mod block;
pub mod explain;
pub mod key_hash;
pub mod keys;
pub mod listen;
pub mod metrics;
pub mod problem;
pub mod replay;
pub mod response;
pub mod rules;
pub mod shared;
pub mod top_keys;
