//! The decision engine every edge shares: the rule set in force, decision metrics, key
//! hashes, the audit log and the global (Redis) runtime. The edges (the HTTP proxy, the
//! Envoy rate limit service) read it and map its decisions to their protocol; it knows
//! nothing of them.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::{ArcSwap, ArcSwapOption};
use http::request::Parts;
use tollgate_crd::CompiledPolicy;
use tollgate_global::GlobalRuntime;
use tollgate_limiter::{Clock, MonotonicClock, Nanos, StoreConfig};

use crate::audit::AuditLog;
use crate::metrics::Metrics;
use crate::rules::{RuleSet, Verdict};

/// State shared by every connection of every edge. Its fields are private to the engine: the
/// binaries change it only through [`Shared::install`], [`Shared::refuse_config`],
/// [`Shared::set_ready`] and [`Shared::evict_idle`], so the metrics that describe it stay in
/// step with it.
pub struct Shared {
    pub(crate) rules: ArcSwap<RuleSet>,
    pub(crate) metrics: Metrics,
    pub(crate) clock: MonotonicClock,
    /// Also holds the key hashes and the hot path's fingerprints (`audit.key_hashes()`).
    pub(crate) audit: AuditLog,
    /// True once a rule set has been loaded.
    pub(crate) ready: AtomicBool,
    /// The last configuration error, while the previous good rules stay in force.
    pub(crate) config_error: ArcSwapOption<String>,
    /// The global limiter, when Redis is configured (for `/debug/config`).
    pub(crate) global: std::sync::OnceLock<Arc<tollgate_global::GlobalRuntime>>,
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
        let key_hashes = self.audit.key_hashes();
        let mut verdict = KEY_BUF.with(|buf| {
            let mut buf = buf.borrow_mut();
            rules.evaluate(parts, peer, started, &mut buf, &key_hashes.fingerprinter)
        });
        drop(key_hashes);
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

    /// The rule set in force.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules.load_full()
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn clock(&self) -> &MonotonicClock {
        &self.clock
    }

    /// The audit log, which also holds the key hashes.
    pub fn audit(&self) -> &AuditLog {
        &self.audit
    }

    /// The global limiter, when Redis is configured.
    pub fn global(&self) -> Option<&Arc<GlobalRuntime>> {
        self.global.get()
    }

    /// Attaches the global limiter; set once, before the first rule set is installed (rule
    /// sets built before it enforce global rules per process).
    pub fn set_global(&self, global: Arc<GlobalRuntime>) {
        let _ = self.global.set(global);
    }

    /// The last configuration error, while the previous good rules stay in force.
    pub fn config_error(&self) -> Option<Arc<String>> {
        self.config_error.load_full()
    }

    /// Whether the readiness probe should pass.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Ready without a rule set (a pass-through granted), or no longer ready (withdrawn).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Builds a rule set from `policies` (keeping the counters of rules that did not change)
    /// and swaps it in: requests see the old or the new set, never a mix. On success the
    /// engine is ready and the last configuration error is cleared.
    pub fn install(
        &self,
        version: u64,
        policies: Vec<CompiledPolicy>,
        store: &StoreConfig,
    ) -> Result<(), String> {
        let previous = self.rules.load();
        let set = RuleSet::build(
            version,
            policies,
            Some(&previous),
            store,
            &self.metrics,
            self.global.get(),
        )?;
        for id in &set.local_fallback_rules {
            tracing::warn!(
                rule = %id,
                "scope Global rule enforced per sidecar: no Redis configured (standalone mode)"
            );
        }
        let m = &self.metrics;
        m.rules_version.set(version as i64);
        m.rules_loaded.set(set.rules.len() as i64);
        m.local_fallback_rules
            .set(set.local_fallback_rules.len() as i64);
        m.config_last_reload_ok.set(1);
        self.rules.store(Arc::new(set));
        self.config_error.store(None);
        self.set_ready(true);
        Ok(())
    }

    /// A configuration that could not be installed: counted, and shown on the admin port
    /// while the previous good rules stay in force.
    pub fn refuse_config(&self, errors: &[String]) {
        self.metrics.config_errors.inc();
        self.metrics.config_last_reload_ok.set(0);
        self.config_error.store(Some(Arc::new(errors.join("\n"))));
    }

    /// Drops the keys of the rule set in force that were idle at `now`; returns how many.
    pub fn evict_idle(&self, now: Nanos) -> usize {
        self.rules.load().evict_idle(now)
    }
}

/// Whether the readiness probe should pass.
pub fn is_ready(shared: &Shared) -> bool {
    shared.is_ready()
}
