//! The decision engine every edge shares: the rule set in force, decision metrics, key
//! identities, the audit log and the global (Redis) runtime. The edges (the HTTP proxy, the
//! Envoy rate limit service) read it and map its decisions to their protocol; it knows
//! nothing of them.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::{ArcSwap, ArcSwapOption};
use http::request::Parts;
use tollgate_limiter::{Clock, MonotonicClock};

use crate::audit::AuditLog;
use crate::metrics::Metrics;
use crate::rules::{RuleSet, Verdict};

/// State shared by every connection of every edge.
pub struct Shared {
    pub rules: ArcSwap<RuleSet>,
    pub metrics: Metrics,
    pub clock: MonotonicClock,
    /// Also holds the key identities and the hot path's key hash (`audit.identity()`).
    pub audit: AuditLog,
    /// True once a rule set has been loaded.
    pub ready: AtomicBool,
    /// The last configuration error, while the previous good rules stay in force.
    pub config_error: ArcSwapOption<String>,
    /// The global limiter, when Redis is configured (for `/debug/config`).
    pub global: std::sync::OnceLock<Arc<tollgate_global::GlobalRuntime>>,
}

/// The global engine's view: the global rules of the rule set in force.
impl tollgate_global::GlobalSource for Shared {
    fn global_rules(&self) -> Vec<Arc<tollgate_global::GlobalRule>> {
        self.rules
            .load()
            .rules
            .iter()
            .filter_map(|r| r.global.clone())
            .collect()
    }

    fn now(&self) -> tollgate_limiter::Nanos {
        self.clock.now()
    }
}

thread_local! {
    /// Reused key buffer: building a counter key allocates only while the buffer grows.
    static KEY_BUF: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(256));
}

impl Shared {
    /// The decision for one request (HTTP, or a descriptor in its extensions): local rules and
    /// leases at once, and one bounded Redis round trip for cold or dry global keys of a
    /// request nothing else refused.
    pub async fn decide(&self, rules: &RuleSet, parts: &Parts, peer: &SocketAddr) -> Verdict {
        let started = self.clock.now();
        let identity = self.audit.identity();
        let mut verdict = KEY_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            rules.decide(parts, peer, started, &mut buf, &identity.hasher)
        });
        drop(identity);
        if !verdict.pending.is_empty()
            && verdict.rejected.is_none()
            && verdict.unavailable.is_none()
        {
            rules.resolve_pending(&mut verdict, started).await;
        }
        self.metrics
            .decision_seconds
            .observe(self.clock.now().saturating_sub(started) as f64 / 1e9);
        verdict
    }

    pub fn new(metrics: Metrics, audit: AuditLog) -> Shared {
        Shared {
            rules: ArcSwap::from_pointee(RuleSet::empty()),
            metrics,
            clock: MonotonicClock::new(),
            audit,
            ready: AtomicBool::new(false),
            config_error: ArcSwapOption::empty(),
            global: std::sync::OnceLock::new(),
        }
    }
}

/// Whether the readiness probe should pass.
pub fn is_ready(shared: &Shared) -> bool {
    shared.ready.load(Ordering::Acquire)
}
