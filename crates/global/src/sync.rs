//! The background sync: every interval (or earlier when a hot key runs low) return unused
//! tokens, top up hot keys and renew membership, in one batch.
//!
//! The loop reads the sidecar only through [`GlobalSource`] (the global rules in force and the
//! clock), so the engine knows nothing of the HTTP edge or of rule sets.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;
use tollgate_limiter::Nanos;

use crate::lease::{GlobalRule, GlobalRuntime, Slot};
use crate::store::{self, LeaseReply, StoreError};

/// What the sync loop reads of the sidecar.
pub trait GlobalSource: Send + Sync {
    /// The global rules of the rule set in force now (several may share a policy).
    fn global_rules(&self) -> Vec<Arc<GlobalRule>>;
    /// The clock the rules' leases are timed by.
    fn now(&self) -> Nanos;
}

/// Membership settings.
#[derive(Clone, Debug)]
pub struct Membership {
    pub sidecar_id: String,
    /// A sidecar that stops heartbeating drops out of the count after this long.
    pub ttl: Duration,
}

/// Runs the sync until the task is dropped.
pub async fn sync_loop(
    source: Arc<dyn GlobalSource>,
    runtime: Arc<GlobalRuntime>,
    membership: Membership,
) {
    let interval = runtime.settings.sync_interval;
    if let Err(e) = runtime.store.warm_up(runtime.settings.sync_timeout).await {
        tracing::debug!(error = %e, "redis not reachable at start; connecting on first use");
    }
    let mut sync = SyncLoop {
        source,
        runtime,
        membership,
        interval,
        // Early syncs triggered by low watermarks are spaced at least this far apart.
        min_spacing: (interval / 10).max(Duration::from_millis(5)),
        last_heartbeat: None,
        was_open: false,
        last_round: Instant::now(),
    };
    loop {
        sync.wait_for_round().await;
        sync.round().await;
    }
}

/// What the loop carries from one round to the next.
struct SyncLoop {
    source: Arc<dyn GlobalSource>,
    runtime: Arc<GlobalRuntime>,
    membership: Membership,
    interval: Duration,
    min_spacing: Duration,
    last_heartbeat: Option<Instant>,
    was_open: bool,
    last_round: Instant,
}

/// The keys one round syncs: each lease operation with its slot and the rule it belongs to.
struct Plan {
    slots: Vec<(Arc<Slot>, store::LeaseOp)>,
    owners: Vec<usize>,
}

impl SyncLoop {
    /// Sleeps until the interval is up, or until a window key gets room again or a hot key
    /// runs low, but never sooner than `min_spacing` after the last round.
    async fn wait_for_round(&self) {
        let refill_at = self.runtime.next_refill.load(Ordering::Acquire);
        let mut next_round = self.last_round + self.interval;
        if refill_at != u64::MAX {
            let refill_in = Duration::from_nanos(refill_at.saturating_sub(self.source.now()));
            if refill_in < self.interval {
                let at = (Instant::now() + refill_in).max(self.last_round + self.min_spacing);
                next_round = next_round.min(at);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep_until(next_round) => {}
            _ = self.runtime.wake.notified() => {
                let earliest = self.last_round + self.min_spacing;
                if Instant::now() < earliest {
                    tokio::time::sleep_until(earliest).await;
                }
            }
        }
    }

    async fn round(&mut self) {
        let elapsed = self.last_round.elapsed();
        self.last_round = Instant::now();
        let globals = self.source.global_rules();
        let open = self.note_breaker(elapsed);
        if globals.is_empty() {
            return;
        }
        let heartbeat_policies = self.membership_round(&globals);
        let plan = self.plan(&globals);
        let ops: Vec<store::LeaseOp> = plan.slots.iter().map(|(_, op)| op.clone()).collect();
        if open && ops.is_empty() && heartbeat_policies.is_empty() {
            probe(&self.runtime).await;
            return;
        }
        let sent = Instant::now();
        let (heartbeat, lease) = self.send(&heartbeat_policies, &ops).await;
        self.heard_members(heartbeat, &heartbeat_policies, &globals);
        let Some(result) = lease else {
            return;
        };
        if result.is_ok() {
            self.note_rtt(sent.elapsed());
        }
        self.runtime.metrics.sync_rounds.inc();
        self.finish(&globals, &plan, result);
        self.runtime.synced.notify_waiters();
    }

    /// Counts time spent on the fallback and logs the breaker's transitions; whether it is open.
    fn note_breaker(&mut self, elapsed: Duration) -> bool {
        let runtime = &self.runtime;
        let open = runtime.store.breaker.is_open();
        if open {
            runtime
                .metrics
                .fallback_seconds
                .inc_by(elapsed.as_secs_f64());
        }
        if open != self.was_open {
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
            self.was_open = open;
        }
        open
    }

    /// Applies the controller's member counts, if it sends them; otherwise returns the policies
    /// whose Redis heartbeat is due: three times per membership TTL, and on the first round.
    /// The heartbeat runs concurrently with the lease batch, so a slow Redis costs one round
    /// trip per sync, not two.
    fn membership_round(&self, globals: &[Arc<GlobalRule>]) -> Vec<String> {
        if let Some(members) = self.runtime.controller_members.load_full() {
            for g in globals {
                if let Some(n) = members.get(&g.policy_id) {
                    let before = g.live_sidecars();
                    g.set_live_sidecars(*n);
                    self.runtime.metrics.set_live(&g.policy_id, *n);
                    if before != (*n).max(1) {
                        tracing::info!(policy = %g.policy_id, sidecars = *n, share = g.share(), "membership changed (controller); shares recomputed");
                    }
                }
            }
            return Vec::new();
        }
        let due = self
            .last_heartbeat
            .is_none_or(|t| t.elapsed() >= self.membership.ttl / 3);
        if !due {
            return Vec::new();
        }
        let mut policies: Vec<String> = globals.iter().map(|g| g.policy_id.clone()).collect();
        policies.sort();
        policies.dedup();
        policies
    }

    /// Each rule's keys to sync this round, and the state gauges.
    fn plan(&self, globals: &[Arc<GlobalRule>]) -> Plan {
        let now = self.source.now();
        // Cleared before planning; replies of this round set it again.
        self.runtime.next_refill.store(u64::MAX, Ordering::Release);
        let mut plan = Plan {
            slots: Vec::new(),
            owners: Vec::new(),
        };
        for (gi, g) in globals.iter().enumerate() {
            let before = plan.slots.len();
            g.plan_sync(now, &mut plan.slots);
            let added = plan.slots.len() - before;
            plan.owners.extend(std::iter::repeat_n(gi, added));
        }
        let metrics = &self.runtime.metrics;
        metrics
            .leased_keys
            .set(globals.iter().map(|g| g.leased_keys() as i64).sum());
        for g in globals {
            metrics.set_rule_state(g);
        }
        plan
    }

    /// The heartbeat and the lease batch, concurrently, traced when traces are on. The sync is
    /// not gated by the breaker: it runs in the background with its own timeout and is the
    /// breaker's probe every interval. Gating it would let request-path timeouts (cold keys
    /// against a slow Redis) starve hot keys of top-ups and lease renewals.
    async fn send(
        &self,
        heartbeat_policies: &[String],
        ops: &[store::LeaseOp],
    ) -> (
        Option<Result<Vec<u32>, StoreError>>,
        Option<Result<Vec<LeaseReply>, StoreError>>,
    ) {
        let runtime = &self.runtime;
        let timeout = runtime.settings.sync_timeout;
        let heartbeat = async {
            if heartbeat_policies.is_empty() {
                return None;
            }
            let m = &self.membership;
            Some(
                runtime
                    .store
                    .heartbeat(heartbeat_policies, &m.sidecar_id, m.ttl, true, timeout)
                    .await,
            )
        };
        let lease = async {
            if ops.is_empty() {
                return None;
            }
            Some(runtime.store.lease_batch(ops, timeout).await)
        };
        let round = async { tokio::join!(heartbeat, lease) };
        if !tollgate_telemetry::enabled() {
            return round.await;
        }
        use tracing::Instrument;
        let span = tracing::info_span!(
            target: tollgate_telemetry::TRACE_TARGET,
            "lease sync",
            otel.name = "tollgate lease sync",
            lease.ops = ops.len(),
            membership.heartbeat = !heartbeat_policies.is_empty(),
        );
        round.instrument(span).await
    }

    /// Takes in Redis's member counts (or the heartbeat's failure).
    fn heard_members(
        &mut self,
        heartbeat: Option<Result<Vec<u32>, StoreError>>,
        policies: &[String],
        globals: &[Arc<GlobalRule>],
    ) {
        let runtime = &self.runtime;
        match heartbeat {
            Some(Ok(counts)) => {
                runtime.store.breaker.success();
                self.last_heartbeat = Some(Instant::now());
                for (policy, n) in policies.iter().zip(counts) {
                    runtime.metrics.set_live(policy, n);
                    for g in globals.iter().filter(|g| &g.policy_id == policy) {
                        let before = g.live_sidecars();
                        g.set_live_sidecars(n);
                        if before != n.max(1) {
                            tracing::info!(policy = %policy, sidecars = n, share = g.share(), "membership changed; shares recomputed");
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
    }

    /// Exponentially smoothed round-trip time of the lease batch (1/4 weight on the newest).
    fn note_rtt(&self, rtt: Duration) {
        let rtt = rtt.as_nanos() as u64;
        let old = self.runtime.sync_rtt.load(Ordering::Relaxed);
        let smoothed = if old == 0 {
            rtt
        } else {
            old - old / 4 + rtt / 4
        };
        self.runtime.sync_rtt.store(smoothed, Ordering::Relaxed);
    }

    /// Hands every reply (or the failure) to its slot.
    fn finish(
        &self,
        globals: &[Arc<GlobalRule>],
        plan: &Plan,
        result: Result<Vec<LeaseReply>, StoreError>,
    ) {
        let runtime = &self.runtime;
        let now = self.source.now();
        match result {
            Ok(replies) => {
                for (((slot, op), reply), gi) in plan.slots.iter().zip(&replies).zip(&plan.owners) {
                    globals[*gi].finish_sync(slot, op, Some(reply), now);
                    runtime.metrics.tokens_leased.inc_by(reply.granted);
                    runtime.metrics.tokens_returned.inc_by(op.give_back);
                }
                for g in globals {
                    g.refresh_validity(now);
                }
            }
            Err(e) => {
                runtime.metrics.redis_error(e.kind());
                tracing::debug!(error = %e, "lease sync failed");
                for ((slot, op), gi) in plan.slots.iter().zip(&plan.owners) {
                    globals[*gi].finish_sync(slot, op, None, now);
                }
            }
        }
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

/// On shutdown: give every held token back and leave the membership, best effort.
pub async fn leave(source: &dyn GlobalSource, runtime: &GlobalRuntime, membership: &Membership) {
    let mut ops = Vec::new();
    let mut policies = Vec::new();
    for g in source.global_rules() {
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
