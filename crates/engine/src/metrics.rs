//! Prometheus metrics of the engine, in the one registry /metrics encodes: the global limiter
//! and each edge register their own there (`tollgate_global::GlobalMetrics`, the proxy's
//! upstream metrics, the Envoy edge's RLQS metrics).
//!
//! Labels are bounded by configuration (policy and rule names), never by traffic: client keys
//! never become labels. Per-rule counters are resolved once when a rule set is built, so the hot
//! path increments an atomic without hashing a label set.

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    policy: String,
    rule: String,
    decision: &'static str,
}

/// Every metric of the engine, in the registry /metrics encodes. The edges register their own
/// in the same registry when they are built ([`Metrics::register`]): the proxy its upstream
/// timings and errors, the Envoy edge its RLQS streams.
pub struct Metrics {
    /// Locked only to register an edge's metrics and to encode /metrics, never per request.
    registry: Mutex<Registry>,
    decisions: Family<DecisionLabels, Counter>,
    pub decision_seconds: Histogram,
    pub active_keys: Gauge,
    pub key_overflow_decisions: Gauge,
    pub rules_version: Gauge,
    pub rules_loaded: Gauge,
    pub config_errors: Counter,
    pub config_last_reload_ok: Gauge,
    pub audit_suppressed: Counter,
    pub local_fallback_rules: Gauge,
    pub controller_connected: Gauge,
    pub controller_stream_refused: Gauge,
    pub controller_version: Gauge,
    pub rules_from_cache: Gauge,
    pub rules_passthrough: Gauge,
    pub global: tollgate_global::GlobalMetrics,
}

/// Counters of one rule, resolved ahead of time.
#[derive(Clone)]
pub struct RuleMetrics {
    pub allowed: Counter,
    pub rejected: Counter,
    pub shadow_rejected: Counter,
    pub bypassed: Counter,
    /// Rejected with 503 because Redis was unreachable and the rule fails closed.
    pub unavailable: Counter,
}

impl Metrics {
    pub fn new() -> Metrics {
        let metrics = Metrics {
            registry: Mutex::new(Registry::with_prefix("tollgate")),
            decisions: Family::default(),
            // 1 µs .. ~4 ms: a decision should sit in the lowest buckets.
            decision_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 13)),
            active_keys: Gauge::default(),
            key_overflow_decisions: Gauge::default(),
            rules_version: Gauge::default(),
            rules_loaded: Gauge::default(),
            config_errors: Counter::default(),
            config_last_reload_ok: Gauge::default(),
            audit_suppressed: Counter::default(),
            local_fallback_rules: Gauge::default(),
            controller_connected: Gauge::default(),
            controller_stream_refused: Gauge::default(),
            controller_version: Gauge::default(),
            rules_from_cache: Gauge::default(),
            rules_passthrough: Gauge::default(),
            global: tollgate_global::GlobalMetrics::default(),
        };
        metrics.register(|registry| {
            metrics.register_decisions(registry);
            metrics.register_rule_set(registry);
            metrics.register_rule_source(registry);
            metrics.global.register_in(registry);
        });
        metrics
    }

    /// Registers more metrics in the registry /metrics encodes: an edge's own, when it is
    /// built. Their families are listed after the engine's, in the order registered; each
    /// name must be registered once.
    pub fn register<T>(&self, register: impl FnOnce(&mut Registry) -> T) -> T {
        register(&mut self.registry.lock())
    }

    /// What was decided, and how long deciding took.
    fn register_decisions(&self, registry: &mut Registry) {
        registry.register(
            "requests",
            "Rate-limit decisions per policy, rule and outcome (allowed, rejected, shadow_rejected, bypassed, unavailable)",
            self.decisions.clone(),
        );
        registry.register(
            "decision_duration_seconds",
            "Time spent deciding one request (matching, key extraction, limiters)",
            self.decision_seconds.clone(),
        );
    }

    /// The rule set in force: its version and size, the keys its limiters hold, reloads that
    /// were refused, and what it could not do as configured.
    fn register_rule_set(&self, registry: &mut Registry) {
        registry.register(
            "active_keys",
            "Client keys currently tracked by the in-memory limiters",
            self.active_keys.clone(),
        );
        registry.register(
            "key_overflow_decisions",
            "Decisions made against a shared overflow bucket because the key store was full",
            self.key_overflow_decisions.clone(),
        );
        registry.register(
            "rules_version",
            "Version of the rule set in force",
            self.rules_version.clone(),
        );
        registry.register(
            "rules_loaded",
            "Number of rules in force",
            self.rules_loaded.clone(),
        );
        registry.register(
            "config_errors",
            "Policy reloads refused because the new policies were invalid",
            self.config_errors.clone(),
        );
        registry.register(
            "config_last_reload_successful",
            "1 if the last policy reload succeeded, 0 if the last good rules are still in force",
            self.config_last_reload_ok.clone(),
        );
        registry.register(
            "audit_suppressed",
            "Rejection audit lines dropped by the audit log's own rate limit",
            self.audit_suppressed.clone(),
        );
        registry.register(
            "global_rules_enforced_locally",
            "Global rules enforced per sidecar because no Redis is configured",
            self.local_fallback_rules.clone(),
        );
    }

    /// Where the rules came from: the controller's stream, the rules cache, or none at all.
    fn register_rule_source(&self, registry: &mut Registry) {
        registry.register(
            "controller_connected",
            "1 while the rule stream from tollgate-controller is connected",
            self.controller_connected.clone(),
        );
        registry.register(
            "controller_stream_refused",
            "1 while the controller refuses this pod's identity on the rule stream (401/403): no new rules arrive, and the sidecar never serves without limits because of it",
            self.controller_stream_refused.clone(),
        );
        registry.register(
            "controller_rules_version",
            "Version of the last rule snapshot applied from the controller",
            self.controller_version.clone(),
        );
        registry.register(
            "rules_from_cache",
            "1 while the rules in force were read from --rules-cache because the controller was unreachable at start-up",
            self.rules_from_cache.clone(),
        );
        registry.register(
            "rules_passthrough",
            "1 while the sidecar is ready without any rules (--without-rules=pass-through after --rules-wait): nothing is limited",
            self.rules_passthrough.clone(),
        );
    }

    /// Resolves the counters of one rule.
    pub fn rule(&self, policy: &str, rule: &str) -> RuleMetrics {
        let get = |decision| {
            self.decisions
                .get_or_create(&DecisionLabels {
                    policy: policy.to_string(),
                    rule: rule.to_string(),
                    decision,
                })
                .clone()
        };
        RuleMetrics {
            allowed: get("allowed"),
            rejected: get("rejected"),
            shadow_rejected: get("shadow_rejected"),
            bypassed: get("bypassed"),
            unavailable: get("unavailable"),
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry.lock());
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
