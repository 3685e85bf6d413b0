//! The status writer: `RateLimitPolicy.status`, written by the leader only.
//!
//! On every index change (debounced), the writer computes each policy's desired status from its
//! [`PolicyView`] and server-side-applies it (`patch_status`, field manager
//! [`FIELD_MANAGER`]) when it differs from what the object already carries. Writes are limited
//! to one per policy per `min_interval`; a write that the watch has not echoed back yet is not
//! repeated. `lastTransitionTime` only moves when a condition's status does. A policy whose
//! generation is rejected also gets one Warning Event per generation.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::watch;
use tokio::time::Instant;
use tollgate_crd::policy::conditions;
use tollgate_crd::{RateLimitPolicy, RateLimitPolicyStatus};

use crate::index::{PolicyView, SharedIndex};
use crate::metrics::Metrics;
use crate::top_keys::FleetTopKeys;

/// Field manager of every status write.
pub const FIELD_MANAGER: &str = "tollgate-controller";
/// Default minimum time between two status writes of one policy.
pub const DEFAULT_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// Coalesces bursts of index changes (a rollout connecting many sidecars) into one pass.
const DEBOUNCE: Duration = Duration::from_millis(200);
/// A write not yet echoed by the watch is trusted for this long before it is repeated.
const ECHO_WAIT: Duration = Duration::from_secs(10);
/// Wait after a failed write.
const RETRY_AFTER_ERROR: Duration = Duration::from_secs(2);
/// Kubernetes limits condition messages to 32768 bytes.
const MAX_CONDITION_MESSAGE: usize = 32 * 1024;
/// Kubernetes limits event notes to 1 kB.
const MAX_EVENT_NOTE: usize = 1024;

/// The Accepted condition: compiled, not compiled yet, or refused with its errors and which
/// version stays in force.
fn accepted_condition(
    view: &PolicyView,
    rule_count: Option<usize>,
) -> (&'static str, &'static str, String) {
    if view.errors.is_empty() {
        match rule_count {
            Some(n) => (
                "True",
                conditions::REASON_ACCEPTED,
                format!("compiled {n} rule{}", if n == 1 { "" } else { "s" }),
            ),
            None => (
                "Unknown",
                conditions::REASON_PENDING,
                "not compiled yet".to_string(),
            ),
        }
    } else {
        let errors: Vec<String> = view.errors.iter().map(ToString::to_string).collect();
        let tail = match &view.compiled {
            Some(c) => format!(
                "; the last accepted version (generation {}) stays in force",
                c.generation
            ),
            None => "; no version of this policy is enforced".to_string(),
        };
        (
            "False",
            conditions::REASON_INVALID,
            format!(
                "{} error{}: {}{tail}",
                errors.len(),
                if errors.len() == 1 { "" } else { "s" },
                errors.join("; ")
            ),
        )
    }
}

/// The Programmed condition: how many of the selected sidecars enforce the rules in force,
/// and which are behind.
fn programmed_condition(view: &PolicyView) -> (&'static str, &'static str, String) {
    let (total, in_sync) = (view.sidecars_total, view.sidecars_in_sync);
    match &view.compiled {
        None => (
            "False",
            conditions::REASON_PENDING,
            "no accepted version of the policy to program".to_string(),
        ),
        Some(c) => {
            let which = if view.errors.is_empty() {
                String::new()
            } else {
                format!(" (generation {}, the last accepted one)", c.generation)
            };
            if total == 0 {
                (
                    "False",
                    conditions::REASON_NO_SIDECARS,
                    format!(
                        "no connected tollgate sidecar is selected by spec.targetRef.selector{which}"
                    ),
                )
            } else if in_sync == total {
                (
                    "True",
                    conditions::REASON_PROGRAMMED,
                    format!(
                        "{total} of {total} selected sidecars enforce the current rules{which}"
                    ),
                )
            } else {
                (
                    "False",
                    conditions::REASON_PENDING,
                    format!(
                        "{in_sync} of {total} selected sidecars enforce the current rules{which}; waiting for {} to acknowledge",
                        lagging_pods(view)
                    ),
                )
            }
        }
    }
}

/// The status a policy should have. `base` is the latest status known to be on the object; its
/// `lastTransitionTime`s are kept for conditions whose status does not change.
pub fn desired_status(
    view: &PolicyView,
    base: Option<&RateLimitPolicyStatus>,
    now: &Time,
) -> RateLimitPolicyStatus {
    let rule_count = view.compiled.as_ref().map(|c| c.rules.len());
    let accepted = accepted_condition(view, rule_count);
    let (total, in_sync) = (view.sidecars_total, view.sidecars_in_sync);
    let programmed = programmed_condition(view);

    let is_programmed = programmed.0 == "True";
    let condition = |type_: &str, (status, reason, message): (&str, &str, String)| {
        let previous = base.and_then(|b| b.conditions.iter().find(|c| c.type_ == type_));
        let last_transition_time = match previous {
            Some(p) if p.status == status => p.last_transition_time.clone(),
            _ => now.clone(),
        };
        Condition {
            type_: type_.to_string(),
            status: status.to_string(),
            reason: reason.to_string(),
            message: truncate(message, MAX_CONDITION_MESSAGE),
            observed_generation: view.generation,
            last_transition_time,
        }
    };

    RateLimitPolicyStatus {
        observed_generation: view.generation,
        conditions: vec![
            condition(conditions::ACCEPTED, accepted),
            condition(conditions::PROGRAMMED, programmed),
        ],
        rule_count: rule_count.map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        sidecars_in_sync: Some(in_sync),
        sidecars_total: Some(total),
        rules_version: view.compiled.as_ref().map(|_| view.version),
        global_rules: view
            .compiled
            .as_ref()
            .map(|c| global_rule_modes(c, total, view.sidecars_without_redis))
            .unwrap_or_default(),
        // Filled from the fleet's reports by the writer (`crate::top_keys`).
        top_limited_keys: None,
        propagation: propagation(view, base, is_programmed, now),
        // Written by `crate::coverage` under a field manager of its own.
        pods_without_sidecar: None,
    }
}

/// The pods that have not acknowledged yet, for the Pending message: `api-1, api-2` or
/// `api-1, ... and 40 more`.
fn lagging_pods(view: &PolicyView) -> String {
    let waiting = view.sidecars_total.saturating_sub(view.sidecars_in_sync) as usize;
    if view.lagging.is_empty() {
        return "the others".to_string();
    }
    let names = view.lagging.join(", ");
    match waiting.saturating_sub(view.lagging.len()) {
        0 => names,
        more => format!("{names} and {more} more"),
    }
}

/// The last accepted generation's propagation: measured once, from the change to the
/// acknowledgement that completed it (every connected selected sidecar runs it), then kept (a
/// sidecar joining later does not move it). Before that, the previous generation's figure
/// stays.
fn propagation(
    view: &PolicyView,
    base: Option<&RateLimitPolicyStatus>,
    programmed: bool,
    now: &Time,
) -> Option<tollgate_crd::policy::Propagation> {
    let previous = base.and_then(|b| b.propagation.clone());
    let Some(generation) = view.compiled.as_ref().map(|c| c.generation) else {
        return previous;
    };
    if previous
        .as_ref()
        .is_some_and(|p| p.generation == generation)
        || !programmed
    {
        return previous;
    }
    // The index stamps the completing acknowledgement; a view without the stamp (completed
    // by a change the index does not stamp) falls back to the time of this status pass.
    let (took, completed) = match view.programmed {
        Some(p) => (p.after, completed_at(now, p.ago)),
        None => (view.compiled_age, now.clone()),
    };
    Some(tollgate_crd::policy::Propagation {
        generation,
        duration_millis: u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
        completed: completed.0.to_string(),
    })
}

/// `ago` before `now`, in whole seconds like every time the API server keeps.
fn completed_at(now: &Time, ago: Duration) -> Time {
    let ago = i64::try_from(ago.as_secs()).unwrap_or(i64::MAX);
    match Timestamp::from_second(now.0.as_second().saturating_sub(ago)) {
        Ok(t) => Time(t),
        Err(_) => now.clone(),
    }
}

/// Each Global rule's mode with `sidecars` connected (what `accuracy: Auto` chooses). The
/// reason also says when `without_redis` of them have no Redis store: those enforce the rule
/// per pod, each with the whole limit, whatever the mode.
fn global_rule_modes(
    compiled: &tollgate_crd::CompiledPolicy,
    sidecars: u32,
    without_redis: u32,
) -> Vec<tollgate_crd::policy::GlobalRuleStatus> {
    let per_pod = match without_redis {
        0 => String::new(),
        n if n >= sidecars => format!(
            "; but none of the {sidecars} selected sidecars has Redis: each pod enforces the whole limit on its own"
        ),
        n => format!(
            "; but {n} of the {sidecars} selected sidecars have no Redis: each of those enforces the whole limit on its own"
        ),
    };
    use tollgate_crd::policy::{Accuracy, GlobalRuleStatus, Scope};
    let n = u64::from(sidecars.max(1));
    compiled
        .rules
        .iter()
        .filter(|r| r.scope == Scope::Global)
        .map(|r| {
            let capacity = r.capacity();
            let min = tollgate_crd::compiled::AUTO_MIN_SHARE;
            let exact = tollgate_crd::compiled::decides_exactly(r.accuracy, capacity, n);
            let (mode, reason) = match r.accuracy {
                Accuracy::Strict => ("Exact", "accuracy: Strict".to_string()),
                Accuracy::Leased => ("Leased", "accuracy: Leased".to_string()),
                Accuracy::Auto if exact => (
                    "Exact",
                    format!("Auto: {capacity} tokens over {n} sidecars is a share under {min}"),
                ),
                Accuracy::Auto => (
                    "Leased",
                    format!(
                        "Auto: {capacity} tokens over {n} sidecars is a share of at least {min}"
                    ),
                ),
            };
            GlobalRuleStatus {
                name: r.name.clone(),
                mode: mode.to_string(),
                reason: reason + &per_pod,
            }
        })
        .collect()
}

/// Cuts a message at a char boundary, marking the cut.
fn truncate(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push_str("...");
    s
}

/// Now, in whole seconds (what the API server keeps), so written and echoed times compare equal.
pub fn now_seconds() -> Time {
    let now = Timestamp::now();
    Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
}

type Key = (String, String, Option<String>);

struct Written {
    /// `None` after a failed write.
    status: Option<RateLimitPolicyStatus>,
    at: Instant,
}

/// Writes status and events while this replica leads.
pub struct StatusWriter {
    client: kube::Client,
    index: SharedIndex,
    metrics: Metrics,
    recorder: Recorder,
    min_interval: Duration,
    written: HashMap<Key, Written>,
    events_sent: HashSet<(Key, Option<i64>)>,
    top_keys: Option<Arc<FleetTopKeys>>,
}

impl StatusWriter {
    pub fn new(
        client: kube::Client,
        index: SharedIndex,
        metrics: Metrics,
        instance: String,
        min_interval: Duration,
    ) -> StatusWriter {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.to_string(),
                instance: Some(instance),
            },
        );
        StatusWriter {
            client,
            index,
            metrics,
            recorder,
            min_interval,
            written: HashMap::new(),
            events_sent: HashSet::new(),
            top_keys: None,
        }
    }

    /// Publishes the fleet's top limited keys in each policy's status too.
    pub fn with_top_keys(mut self, top_keys: Arc<FleetTopKeys>) -> StatusWriter {
        self.top_keys = Some(top_keys);
        self
    }

    /// Runs until `shutdown` turns true or the index or leader channel goes away.
    pub async fn run(
        mut self,
        mut leader: watch::Receiver<bool>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut changes = self.index.read().changes_rx();
        let mut top_keys = self.top_keys.as_ref().map(|t| t.published());
        let mut retry_at: Option<Instant> = None;
        let mut pending = true;
        loop {
            if !pending {
                let retry = async {
                    match retry_at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    r = changes.changed() => if r.is_err() { return },
                    Some(r) = async {
                        match top_keys.as_mut() {
                            Some(rx) => Some(rx.changed().await),
                            None => None,
                        }
                    } => if r.is_err() { return },
                    r = leader.changed() => if r.is_err() { return },
                    r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { return },
                    () = retry => {}
                }
            }
            pending = false;
            if !*leader.borrow_and_update() {
                if !self.written.is_empty() {
                    tracing::info!("not the leader: status writes paused");
                }
                self.written.clear();
                retry_at = None;
                continue;
            }
            tokio::time::sleep(DEBOUNCE).await;
            changes.borrow_and_update();
            if let Some(rx) = top_keys.as_mut() {
                rx.borrow_and_update();
            }
            retry_at = self.sync_once().await;
        }
    }

    /// One pass over every policy; returns when the next deferred write is due.
    pub async fn sync_once(&mut self) -> Option<Instant> {
        let views = self.index.read().policy_views();
        let now_time = now_seconds();
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let mut due = |at: Instant| {
            next = Some(next.map_or(at, |n: Instant| n.min(at)));
        };

        let live: HashSet<Key> = views
            .iter()
            .map(|v| (v.namespace.clone(), v.name.clone(), v.uid.clone()))
            .collect();
        self.written.retain(|k, _| live.contains(k));
        self.events_sent.retain(|(k, _)| live.contains(k));

        for view in views {
            let key: Key = (view.namespace.clone(), view.name.clone(), view.uid.clone());
            if !view.errors.is_empty() && self.events_sent.insert((key.clone(), view.generation)) {
                self.publish_rejected(&view).await;
            }
            let previous = self.written.get(&key);
            let base = previous
                .and_then(|w| w.status.as_ref())
                .filter(|_| previous.is_some_and(|w| now.duration_since(w.at) < ECHO_WAIT))
                .or(view.observed_status.as_ref());
            let mut desired = desired_status(&view, base, &now_time);
            desired.top_limited_keys = self
                .top_keys
                .as_ref()
                .and_then(|t| t.of(&view.namespace, &view.name, view.uid.as_deref()));
            // Compared without the fields `crate::coverage` writes under its own field manager.
            let observed = view
                .observed_status
                .as_ref()
                .map(crate::coverage::without_coverage);
            if observed.as_ref() == Some(&desired) {
                continue;
            }
            if let Some(w) = previous {
                let since = now.duration_since(w.at);
                if w.status.as_ref() == Some(&desired) && since < ECHO_WAIT {
                    continue;
                }
                let wait = if w.status.is_some() {
                    self.min_interval
                } else {
                    RETRY_AFTER_ERROR.max(self.min_interval)
                };
                if since < wait {
                    due(w.at + wait);
                    continue;
                }
            }
            let ok = self.patch(&view, &desired).await;
            self.written.insert(
                key,
                Written {
                    status: ok.then_some(desired),
                    at: Instant::now(),
                },
            );
            if !ok {
                due(Instant::now() + RETRY_AFTER_ERROR.max(self.min_interval));
            }
        }
        next
    }

    async fn patch(&self, view: &PolicyView, status: &RateLimitPolicyStatus) -> bool {
        // The response is not read: untyped, so a stored policy that does not decode (a required
        // field missing, stored while no validating webhook ran) still gets its status.
        let api: Api<kube::api::DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &view.namespace,
            &kube::api::ApiResource::erase::<RateLimitPolicy>(&()),
        );
        let body = serde_json::json!({
            "apiVersion": "tollgate.dev/v1alpha1",
            "kind": "RateLimitPolicy",
            "status": status,
        });
        let params = PatchParams::apply(FIELD_MANAGER).force();
        match api
            .patch_status(&view.name, &params, &Patch::Apply(&body))
            .await
        {
            Ok(_) => {
                self.metrics.status_patch("ok");
                tracing::debug!(namespace = %view.namespace, policy = %view.name, "status written");
                true
            }
            Err(kube::Error::Api(e)) if e.code == 404 => {
                // Deleted meanwhile; the watch will drop it from the index.
                self.metrics.status_patch("not_found");
                true
            }
            Err(error) => {
                self.metrics.status_patch("error");
                tracing::warn!(namespace = %view.namespace, policy = %view.name, %error, "status write failed");
                false
            }
        }
    }

    async fn publish_rejected(&self, view: &PolicyView) {
        let errors: Vec<String> = view.errors.iter().map(ToString::to_string).collect();
        let note = truncate(
            format!("policy rejected: {}", errors.join("; ")),
            MAX_EVENT_NOTE,
        );
        let reference = view.object_reference();
        let event = Event {
            type_: EventType::Warning,
            reason: conditions::REASON_INVALID.to_string(),
            note: Some(note),
            action: "Compile".to_string(),
            secondary: None,
        };
        match self.recorder.publish(&event, &reference).await {
            Ok(()) => self.metrics.event("ok"),
            Err(error) => {
                self.metrics.event("error");
                tracing::warn!(namespace = %view.namespace, policy = %view.name, %error, "cannot publish event");
            }
        }
    }
}

#[cfg(test)]
mod tests;
