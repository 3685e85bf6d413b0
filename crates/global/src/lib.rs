//! tollgate-global: global limits. Buckets live in Redis and are spent through local leases,
//! synced in the background. Knows the compiled rules and the limiter, nothing of requests,
//! protocols or the process around it.
//!
//! - [`store`]: Redis, the Lua scripts, timeouts and the circuit breaker.
//! - [`lease`]: per-rule local allowances and the hot path that spends them.
//! - [`sync`]: the background loop (returns, top-ups, membership heartbeats).
//! - [`limit`]: a compiled limit as the limiter's [`Limit`](tollgate_limiter::Limit) (the local rules use it too).
//! - this module: the metrics, registered by this crate.

pub mod lease;
pub mod limit;
pub mod store;
pub mod sync;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub use lease::{GlobalRule, GlobalRuntime, LeaseSettings, LocalOutcome};
pub use store::Store;
pub use sync::{GlobalSource, Membership, leave, sync_loop};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    policy: String,
    rule: String,
}

/// Metrics of the global limiter.
#[derive(Clone)]
pub struct GlobalMetrics {
    pub lease_seconds: Histogram,
    pub lease_calls: Counter,
    pub sync_rounds: Counter,
    pub tokens_leased: Counter,
    pub tokens_returned: Counter,
    pub tokens_late: Counter,
    redis_errors: Family<KindLabels, Counter>,
    pub breaker_open: Gauge,
    pub fallback_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    pub fallback_admitted: Counter,
    live_sidecars: Family<PolicyLabels, Gauge>,
    pub leased_keys: Gauge,
    exact_mode: Family<RuleLabels, Gauge>,
    overadmission_bound: Family<RuleLabels, Gauge>,
}

impl Default for GlobalMetrics {
    /// Unregistered: [`GlobalMetrics::register_in`] lists them in a registry.
    fn default() -> Self {
        GlobalMetrics {
            lease_seconds: Histogram::new(exponential_buckets(1e-5, 2.0, 16)),
            lease_calls: Counter::default(),
            sync_rounds: Counter::default(),
            tokens_leased: Counter::default(),
            tokens_returned: Counter::default(),
            tokens_late: Counter::default(),
            redis_errors: Family::default(),
            breaker_open: Gauge::default(),
            fallback_seconds: Counter::default(),
            fallback_admitted: Counter::default(),
            live_sidecars: Family::default(),
            leased_keys: Gauge::default(),
            exact_mode: Family::default(),
            overadmission_bound: Family::default(),
        }
    }
}

impl GlobalMetrics {
    /// New metrics, registered in `registry`.
    pub fn register(registry: &mut Registry) -> GlobalMetrics {
        let m = GlobalMetrics::default();
        m.register_in(registry);
        m
    }

    /// Registers these metrics in `registry` (the engine's, so one /metrics lists them all).
    pub fn register_in(&self, registry: &mut Registry) {
        let m = self;
        let r = registry;
        r.register(
            "lease_duration_seconds",
            "Round-trip time of Redis lease calls made while a request waits",
            m.lease_seconds.clone(),
        );
        r.register(
            "lease_calls",
            "Redis lease calls made while a request waited (cold keys, dry leases, strict rules)",
            m.lease_calls.clone(),
        );
        r.register(
            "sync_rounds",
            "Background sync round trips (returns, top-ups, heartbeats)",
            m.sync_rounds.clone(),
        );
        r.register(
            "tokens_leased",
            "Tokens taken from global buckets",
            m.tokens_leased.clone(),
        );
        r.register(
            "tokens_returned",
            "Unused tokens given back to global buckets",
            m.tokens_returned.clone(),
        );
        r.register(
            "tokens_late_credited",
            "Tokens granted by lease calls that answered after their request stopped waiting, kept for later requests instead of lost",
            m.tokens_late.clone(),
        );
        r.register(
            "redis_errors",
            "Failed Redis calls by kind (timeout, connection, not_master, auth, config, breaker_open, error, bad_reply)",
            m.redis_errors.clone(),
        );
        r.register(
            "redis_breaker_open",
            "1 while the Redis circuit breaker is open (failure modes apply)",
            m.breaker_open.clone(),
        );
        r.register(
            "fallback_seconds",
            "Time spent with Redis unreachable, deciding by each rule's failure mode",
            m.fallback_seconds.clone(),
        );
        r.register("fallback_admitted", "Tokens admitted by fail-open fallback limiters: an upper bound of global over-admission", m.fallback_admitted.clone());
        r.register(
            "live_sidecars",
            "Live sidecars enforcing the policy, as seen by membership",
            m.live_sidecars.clone(),
        );
        r.register(
            "global_rule_exact",
            "1 while a global rule decides each request with one Redis call (Strict, or Auto with a share under 5 tokens), 0 while it leases",
            m.exact_mode.clone(),
        );
        r.register(
            "global_rule_overadmission_bound_tokens",
            "Worst-case over-admission of a leased global rule: live sidecars times the largest allowance this sidecar holds for one key (what a burst after a quiet period can get on top of the bucket)",
            m.overadmission_bound.clone(),
        );
        r.register(
            "leased_keys",
            "Keys with a local lease on this sidecar",
            m.leased_keys.clone(),
        );
    }

    pub fn redis_error(&self, kind: &'static str) {
        self.redis_errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// The mode and over-admission bound of one global rule, refreshed every sync round.
    pub fn set_rule_state(&self, g: &GlobalRule) {
        let labels = RuleLabels {
            policy: g.policy_id.clone(),
            rule: g.rule_id.clone(),
        };
        let exact = g.exact();
        self.exact_mode.get_or_create(&labels).set(i64::from(exact));
        let bound = if exact {
            0
        } else {
            g.largest_allowance()
                .saturating_mul(u64::from(g.live_sidecars()))
        };
        self.overadmission_bound
            .get_or_create(&labels)
            .set(i64::try_from(bound).unwrap_or(i64::MAX));
    }

    pub fn set_live(&self, policy: &str, n: u32) {
        self.live_sidecars
            .get_or_create(&PolicyLabels {
                policy: policy.to_string(),
            })
            .set(i64::from(n));
    }
}
