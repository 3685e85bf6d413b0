//! Prometheus metrics of the sidecar.
//!
//! Labels are bounded by configuration (policy and rule names), never by traffic: client keys
//! never become labels. Per-rule counters are resolved once when a rule set is built, so the hot
//! path increments an atomic without hashing a label set.

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// Every metric the sidecar exports.
pub struct Metrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    pub decision_seconds: Histogram,
    pub upstream_seconds: Histogram,
    upstream_errors: Family<KindLabels, Counter>,
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
    pub quota: QuotaMetrics,
}

/// Metrics of the RLQS edge: Envoy streams and the assignments they were given.
#[derive(Clone, Default)]
pub struct QuotaMetrics {
    /// Envoy RLQS streams connected to this replica.
    pub streams: Gauge,
    /// Envoy RLQS streams fleet-wide (every replica sharing Redis), as last read.
    pub fleet_streams: Gauge,
    /// Buckets this replica holds assignments for.
    pub buckets: Gauge,
    pub reports: Counter,
    answers: Family<KindLabels, Counter>,
}

impl QuotaMetrics {
    fn register(registry: &mut Registry) -> QuotaMetrics {
        let m = QuotaMetrics::default();
        registry.register(
            "rlqs_streams",
            "Envoy RLQS streams connected to this replica",
            m.streams.clone(),
        );
        registry.register(
            "rlqs_fleet_streams",
            "Envoy RLQS streams connected to any replica sharing this Redis, as last read",
            m.fleet_streams.clone(),
        );
        registry.register(
            "rlqs_buckets",
            "RLQS buckets this replica holds assignments for",
            m.buckets.clone(),
        );
        registry.register(
            "rlqs_bucket_reports",
            "Bucket usage reports received from Envoys",
            m.reports.clone(),
        );
        registry.register(
            "rlqs_actions",
            "Bucket actions sent to Envoys, by kind (token_bucket, deny_all, allow_all, abandon)",
            m.answers.clone(),
        );
        m
    }

    pub fn action(&self, kind: &'static str) {
        self.answers.get_or_create(&KindLabels { kind }).inc();
    }
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
        let mut registry = Registry::with_prefix("tollgate");
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "requests",
            "Rate-limit decisions per policy, rule and outcome (allowed, rejected, shadow_rejected, bypassed, unavailable)",
            decisions.clone(),
        );
        // 1 µs .. ~4 ms: a decision should sit in the lowest buckets.
        let decision_seconds = Histogram::new(exponential_buckets(1e-6, 2.0, 13));
        registry.register(
            "decision_duration_seconds",
            "Time spent deciding one request (matching, key extraction, limiters)",
            decision_seconds.clone(),
        );
        // 100 µs .. ~13 s.
        let upstream_seconds = Histogram::new(exponential_buckets(1e-4, 2.0, 18));
        registry.register(
            "upstream_duration_seconds",
            "Time until the upstream application returned response headers",
            upstream_seconds.clone(),
        );
        let upstream_errors = Family::<KindLabels, Counter>::default();
        registry.register(
            "upstream_errors",
            "Requests the upstream could not serve, by kind (connect: 502, timeout: 504)",
            upstream_errors.clone(),
        );
        let active_keys = Gauge::default();
        registry.register(
            "active_keys",
            "Client keys currently tracked by the in-memory limiters",
            active_keys.clone(),
        );
        let key_overflow_decisions = Gauge::default();
        registry.register(
            "key_overflow_decisions",
            "Decisions made against a shared overflow bucket because the key store was full",
            key_overflow_decisions.clone(),
        );
        let rules_version = Gauge::default();
        registry.register(
            "rules_version",
            "Version of the rule set in force",
            rules_version.clone(),
        );
        let rules_loaded = Gauge::default();
        registry.register(
            "rules_loaded",
            "Number of rules in force",
            rules_loaded.clone(),
        );
        let config_errors = Counter::default();
        registry.register(
            "config_errors",
            "Policy reloads refused because the new policies were invalid",
            config_errors.clone(),
        );
        let config_last_reload_ok = Gauge::default();
        registry.register(
            "config_last_reload_successful",
            "1 if the last policy reload succeeded, 0 if the last good rules are still in force",
            config_last_reload_ok.clone(),
        );
        let audit_suppressed = Counter::default();
        registry.register(
            "audit_suppressed",
            "Rejection audit lines dropped by the audit log's own rate limit",
            audit_suppressed.clone(),
        );
        let local_fallback_rules = Gauge::default();
        registry.register(
            "global_rules_enforced_locally",
            "Global rules enforced per sidecar because no Redis is configured",
            local_fallback_rules.clone(),
        );
        let controller_connected = Gauge::default();
        registry.register(
            "controller_connected",
            "1 while the rule stream from tollgate-controller is connected",
            controller_connected.clone(),
        );
        let controller_stream_refused = Gauge::default();
        registry.register(
            "controller_stream_refused",
            "1 while the controller refuses this pod's identity on the rule stream (401/403): no new rules arrive, and the sidecar never serves without limits because of it",
            controller_stream_refused.clone(),
        );
        let controller_version = Gauge::default();
        registry.register(
            "controller_rules_version",
            "Version of the last rule snapshot applied from the controller",
            controller_version.clone(),
        );
        let rules_from_cache = Gauge::default();
        registry.register(
            "rules_from_cache",
            "1 while the rules in force were read from --rules-cache because the controller was unreachable at start-up",
            rules_from_cache.clone(),
        );
        let rules_passthrough = Gauge::default();
        registry.register(
            "rules_passthrough",
            "1 while the sidecar is ready without any rules (--without-rules=pass-through after --rules-wait): nothing is limited",
            rules_passthrough.clone(),
        );
        let global = tollgate_global::GlobalMetrics::register(&mut registry);
        let quota = QuotaMetrics::register(&mut registry);
        Metrics {
            quota,
            rules_from_cache,
            rules_passthrough,
            controller_connected,
            controller_stream_refused,
            controller_version,
            global,
            registry,
            decisions,
            decision_seconds,
            upstream_seconds,
            upstream_errors,
            active_keys,
            key_overflow_decisions,
            rules_version,
            rules_loaded,
            config_errors,
            config_last_reload_ok,
            audit_suppressed,
            local_fallback_rules,
        }
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

    pub fn upstream_error(&self, kind: &'static str) {
        self.upstream_errors
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
