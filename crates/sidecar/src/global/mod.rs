//! Global limits: buckets in Redis, spent through local leases, synced in the background.
//!
//! - [`store`]: Redis, the Lua scripts, timeouts and the circuit breaker.
//! - [`lease`]: per-rule local allowances and the hot path that spends them.
//! - this module: the sync loop (returns, top-ups, membership heartbeats) and metrics.

pub mod lease;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tollgate_limiter::Clock;

pub use lease::{GlobalRule, GlobalRuntime, LeaseSettings, LocalOutcome};
pub use store::Store;

use crate::proxy::Shared;

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

impl GlobalMetrics {
    pub fn register(registry: &mut Registry) -> GlobalMetrics {
        let m = GlobalMetrics {
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
        };
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
        m
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

/// Asks Redis whether it is back when the round has nothing else to send. The sync is the
/// breaker's probe, but with membership from the controller (no heartbeats) and no key holding
/// a lease (fail-closed keys get none while Redis is away) a round sends nothing, and without
/// this the breaker would never close again: seen on the real node as 503s that outlived the
/// outage.
async fn probe(runtime: &GlobalRuntime) {
    match runtime.store.ping(runtime.settings.sync_timeout).await {
        Ok(()) => runtime.store.breaker.success(),
        Err(e) => {
            runtime.store.breaker.failure();
            runtime.metrics.redis_error(e.kind());
            tracing::debug!(error = %e, "redis probe failed");
        }
    }
}

/// Membership settings.
#[derive(Clone, Debug)]
pub struct Membership {
    pub sidecar_id: String,
    /// A sidecar that stops heartbeating drops out of the count after this long.
    pub ttl: Duration,
}

/// The background sync: every interval (or earlier when a hot key runs low) return unused
/// tokens, top up hot keys and renew membership, in one batch.
pub async fn sync_loop(shared: Arc<Shared>, runtime: Arc<GlobalRuntime>, membership: Membership) {
    let interval = runtime.settings.sync_interval;
    // Early syncs triggered by low watermarks are spaced at least this far apart.
    let min_spacing = (interval / 10).max(Duration::from_millis(5));
    let mut last_heartbeat = None::<tokio::time::Instant>;
    let mut was_open = false;
    let mut last_round = tokio::time::Instant::now();
    loop {
        // The next round: at the interval, or earlier when a window key gets room again.
        let refill_at = runtime
            .next_refill
            .load(std::sync::atomic::Ordering::Acquire);
        let mut next_round = last_round + interval;
        if refill_at != u64::MAX {
            let refill_in = Duration::from_nanos(refill_at.saturating_sub(shared.clock.now()));
            if refill_in < interval {
                let at = (tokio::time::Instant::now() + refill_in).max(last_round + min_spacing);
                next_round = next_round.min(at);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep_until(next_round) => {}
            _ = runtime.wake.notified() => {
                let earliest = last_round + min_spacing;
                if tokio::time::Instant::now() < earliest {
                    tokio::time::sleep_until(earliest).await;
                }
            }
        }
        let elapsed = last_round.elapsed();
        last_round = tokio::time::Instant::now();
        let rules = shared.rules.load_full();
        let globals: Vec<(&Arc<GlobalRule>, &tollgate_crd::CompiledRule)> = rules
            .rules
            .iter()
            .filter_map(|r| r.global.as_ref().map(|g| (g, &r.rule)))
            .collect();

        let open = runtime.store.breaker.is_open();
        if open {
            runtime
                .metrics
                .fallback_seconds
                .inc_by(elapsed.as_secs_f64());
        }
        if open != was_open {
            runtime.metrics.breaker_open.set(i64::from(open));
            if open {
                tracing::warn!(
                    redis = %runtime.store.options().redacted(),
                    error = runtime.store.last_error().as_deref(),
                    "redis unreachable: global rules follow their failure mode"
                );
            } else {
                tracing::info!("redis reachable again: global rules back on leases");
            }
            was_open = open;
        }
        if globals.is_empty() {
            continue;
        }

        // Heartbeat three times per membership TTL (and on the first round), concurrently with
        // the lease batch so a slow Redis costs one round trip per sync, not two.
        let heartbeat_due = last_heartbeat.is_none_or(|t| t.elapsed() >= membership.ttl / 3);
        let mut heartbeat_policies: Vec<String> = Vec::new();
        if let Some(members) = runtime.controller_members.load_full() {
            for (g, rule) in &globals {
                if let Some(n) = members.get(&g.policy_id) {
                    let before = g.live_sidecars();
                    g.set_live_sidecars(*n, Some(rule));
                    runtime.metrics.set_live(&g.policy_id, *n);
                    if before != (*n).max(1) {
                        tracing::info!(policy = %g.policy_id, sidecars = *n, share = g.share(), "membership changed (controller); shares recomputed");
                    }
                }
            }
        } else if heartbeat_due {
            heartbeat_policies = globals.iter().map(|(g, _)| g.policy_id.clone()).collect();
            heartbeat_policies.sort();
            heartbeat_policies.dedup();
        }

        let now = shared.clock.now();
        // Cleared before planning; replies of this round set it again.
        runtime
            .next_refill
            .store(u64::MAX, std::sync::atomic::Ordering::Release);
        let mut plan = Vec::new();
        let mut owners = Vec::new();
        for (gi, (g, _)) in globals.iter().enumerate() {
            let before = plan.len();
            g.plan_sync(now, &mut plan);
            owners.extend(std::iter::repeat_n(gi, plan.len() - before));
        }
        runtime
            .metrics
            .leased_keys
            .set(globals.iter().map(|(g, _)| g.leased_keys() as i64).sum());
        for (g, _) in &globals {
            runtime.metrics.set_rule_state(g);
        }
        let ops: Vec<store::LeaseOp> = plan.iter().map(|(_, op)| op.clone()).collect();
        if open && ops.is_empty() && heartbeat_policies.is_empty() {
            probe(&runtime).await;
            continue;
        }
        let heartbeat = async {
            if heartbeat_policies.is_empty() {
                return None;
            }
            Some(
                runtime
                    .store
                    .heartbeat(
                        &heartbeat_policies,
                        &membership.sidecar_id,
                        membership.ttl,
                        true,
                        runtime.settings.sync_timeout,
                    )
                    .await,
            )
        };
        let sent = tokio::time::Instant::now();
        // The sync is not gated by the breaker: it runs in the background with its own timeout
        // and is the breaker's probe every interval. Gating it would let request-path timeouts
        // (cold keys against a slow Redis) starve hot keys of top-ups and lease renewals.
        let lease = async {
            if ops.is_empty() {
                None
            } else {
                Some(
                    runtime
                        .store
                        .lease_batch(&ops, runtime.settings.sync_timeout)
                        .await,
                )
            }
        };
        let round = async { tokio::join!(heartbeat, lease) };
        let (heartbeat, lease) = if crate::telemetry::enabled() {
            use tracing::Instrument;
            let span = tracing::info_span!(
                target: crate::telemetry::TRACE_TARGET,
                "lease sync",
                otel.name = "tollgate lease sync",
                lease.ops = ops.len(),
                membership.heartbeat = !heartbeat_policies.is_empty(),
            );
            round.instrument(span).await
        } else {
            round.await
        };
        match heartbeat {
            Some(Ok(counts)) => {
                runtime.store.breaker.success();
                last_heartbeat = Some(tokio::time::Instant::now());
                for (policy, n) in heartbeat_policies.iter().zip(counts) {
                    runtime.metrics.set_live(policy, n);
                    for (g, rule) in &globals {
                        if &g.policy_id == policy {
                            let before = g.live_sidecars();
                            g.set_live_sidecars(n, Some(rule));
                            if before != n.max(1) {
                                tracing::info!(policy = %policy, sidecars = n, share = g.share(), "membership changed; shares recomputed");
                            }
                        }
                    }
                }
            }
            Some(Err(e)) => {
                runtime.store.breaker.failure();
                runtime.metrics.redis_error(e.kind());
                tracing::debug!(error = %e, "membership heartbeat failed");
            }
            None => {}
        }
        let Some(result) = lease else {
            continue;
        };
        if result.is_ok() {
            // Exponentially smoothed (1/4 weight on the newest sample).
            let rtt = sent.elapsed().as_nanos() as u64;
            let old = runtime.sync_rtt.load(std::sync::atomic::Ordering::Relaxed);
            let smoothed = if old == 0 {
                rtt
            } else {
                old - old / 4 + rtt / 4
            };
            runtime
                .sync_rtt
                .store(smoothed, std::sync::atomic::Ordering::Relaxed);
        }
        runtime.metrics.sync_rounds.inc();
        let now = shared.clock.now();
        match result {
            Ok(replies) => {
                for (((slot, op), reply), gi) in plan.iter().zip(&replies).zip(&owners) {
                    let g = globals[*gi].0;
                    g.finish_sync(slot, op, Some(reply), now);
                    runtime.metrics.tokens_leased.inc_by(reply.granted);
                    runtime.metrics.tokens_returned.inc_by(op.give_back);
                }
                for (g, _) in &globals {
                    g.refresh_validity(now);
                }
            }
            Err(e) => {
                runtime.metrics.redis_error(e.kind());
                tracing::debug!(error = %e, "lease sync failed");
                for ((slot, op), gi) in plan.iter().zip(&owners) {
                    globals[*gi].0.finish_sync(slot, op, None, now);
                }
            }
        }
        runtime.synced.notify_waiters();
    }
}

/// On shutdown: give every held token back and leave the membership, best effort.
pub async fn leave(shared: &Shared, runtime: &GlobalRuntime, membership: &Membership) {
    let rules = shared.rules.load_full();
    let mut ops = Vec::new();
    let mut policies = Vec::new();
    for g in rules.rules.iter().filter_map(|r| r.global.as_ref()) {
        ops.extend(g.drain_ops());
        policies.push(g.policy_id.clone());
    }
    policies.sort();
    policies.dedup();
    let timeout = runtime.settings.sync_timeout;
    let _ = runtime.store.lease_batch(&ops, timeout).await;
    let _ = runtime
        .store
        .heartbeat(
            &policies,
            &membership.sidecar_id,
            membership.ttl,
            false,
            timeout,
        )
        .await;
}
