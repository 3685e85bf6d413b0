//! Pods a policy selects that run without the sidecar, and ports the sidecar does not cover.
//!
//! The injection webhook fails open outside namespaces labelled `tollgate.dev/inject: required`:
//! a pod created while no controller answered runs without the sidecar, and its traffic is not
//! limited. The leader finds such pods from the pod watch (metadata only: a pod injected by the
//! webhook carries the `tollgate.dev/sidecar-version` annotation) and reports them:
//!
//! - a Warning Event `SidecarMissing` on each pod and `PodsWithoutSidecar` on the policy;
//! - `status.podsWithoutSidecar` and the condition `SidecarsInjected` on every policy (written
//!   with a field manager of its own, so the status writer's server-side apply keeps them);
//! - the gauge `tollgate_controller_pods_without_sidecar`;
//! - with `--restart-pods-without-sidecar`, an eviction (PodDisruptionBudgets apply) of each such
//!   pod owned by a ReplicaSet, StatefulSet, DaemonSet or ReplicationController, so it comes back
//!   through the webhook. One pod per owner at a time; when a pod the owner created after an
//!   eviction still has no sidecar (the webhook does not inject there), the owner is left alone.
//!
//! Injected pods whose app declares TCP ports besides the sidecar's upstream (the
//! `tollgate.dev/unprotected-ports` annotation the webhook writes) get a Warning Event
//! `UnprotectedPorts` when they are young (the creator already saw the admission warning).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, EvictParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tollgate_crd::RateLimitPolicy;

use crate::index::{PolicyView, SharedIndex};
use crate::webhook::inject::{
    DISABLED, INJECT, INJECTED_BY, SIDECAR_VERSION, UNPROTECTED_PORTS, parse_injector_id,
};

/// Field manager of the coverage fields of a policy's status.
pub const FIELD_MANAGER: &str = "tollgate-controller-coverage";
/// Label of tollgate's own pods, which the webhooks never inject.
pub const CONTROL_PLANE_LABEL: &str = "tollgate.dev/control-plane";
/// Condition type: True when every pod the policy selects has the sidecar.
pub const CONDITION: &str = tollgate_crd::policy::conditions::SIDECARS_INJECTED;
/// Pods younger than this get an `UnprotectedPorts` Event (older ones had theirs, or are old
/// news after a leader change).
const UNPROTECTED_PORTS_EVENT_AGE: i64 = 300;
/// A pod is judged only this many seconds after its creation: a sidecar added to the pod spec
/// by other means than the webhook connects within that time, and counts as enforcing from then.
const GRACE_SECONDS: i64 = 10;
/// Owner kinds whose pods an eviction brings back (through the webhook).
const RESTARTABLE_OWNERS: [&str; 4] = [
    "ReplicaSet",
    "StatefulSet",
    "DaemonSet",
    "ReplicationController",
];

// === what the pod watch tells ===

/// What coverage needs to know of one pod, from its metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub uid: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// Injected by the webhook (or a pod that carries the annotation, e.g. the chart's rate
    /// limit service).
    pub has_sidecar: bool,
    /// `tollgate.dev/inject: disabled` on the pod: left alone on purpose.
    pub opted_out: bool,
    pub unprotected_ports: Option<String>,
    /// The [`INJECTED_BY`] annotation: the injecting process's start and settings hash.
    pub injected_by: Option<(i64, String)>,
    /// The managing owner (`controller: true`).
    pub owner: Option<OwnerReference>,
    /// `metadata.creationTimestamp`, seconds since the epoch.
    pub created: Option<i64>,
    pub deleting: bool,
}

impl PodFacts {
    pub fn from_metadata(m: &ObjectMeta) -> Option<PodFacts> {
        let annotations = m.annotations.clone().unwrap_or_default();
        let labels = m.labels.clone().unwrap_or_default();
        // tollgate's own pods (`tollgate.dev/control-plane`, e.g. the rate limit service)
        // enforce policies themselves and are never injected.
        let opted_out = annotations.get(INJECT).map(String::as_str) == Some(DISABLED)
            || labels.get(INJECT).map(String::as_str) == Some(DISABLED)
            || labels.contains_key(CONTROL_PLANE_LABEL);
        Some(PodFacts {
            namespace: m.namespace.clone()?,
            name: m.name.clone()?,
            uid: m.uid.clone(),
            has_sidecar: annotations.contains_key(SIDECAR_VERSION),
            opted_out,
            unprotected_ports: annotations.get(UNPROTECTED_PORTS).cloned(),
            injected_by: annotations
                .get(INJECTED_BY)
                .and_then(|v| parse_injector_id(v))
                .map(|(t, h)| (t, h.to_string())),
            owner: m
                .owner_references
                .iter()
                .flatten()
                .find(|o| o.controller == Some(true))
                .cloned(),
            created: m.creation_timestamp.as_ref().map(|t| t.0.as_second()),
            deleting: m.deletion_timestamp.is_some(),
            labels,
        })
    }

    /// Runs without the sidecar although nothing says it should.
    fn bare(&self) -> bool {
        !self.has_sidecar && !self.opted_out && !self.deleting
    }
}

/// Every watched pod, fed by the pod watch next to the index.
#[derive(Debug, Default)]
pub struct PodTable {
    pods: HashMap<(String, String), PodFacts>,
}

pub type SharedPodTable = Arc<Mutex<PodTable>>;

impl PodTable {
    pub fn shared() -> SharedPodTable {
        Arc::new(Mutex::new(PodTable::default()))
    }

    pub fn apply(&mut self, pod: PodFacts) {
        self.pods
            .insert((pod.namespace.clone(), pod.name.clone()), pod);
    }

    pub fn delete(&mut self, namespace: &str, name: &str) {
        self.pods.remove(&(namespace.to_string(), name.to_string()));
    }

    /// Replaces the pods of `scope` (all namespaces with `None`) after a relist.
    pub fn reset(&mut self, scope: Option<&str>, pods: Vec<PodFacts>) {
        self.pods
            .retain(|(ns, _), _| scope.is_some_and(|s| s != ns.as_str()));
        for pod in pods {
            self.apply(pod);
        }
    }

    /// Per policy (namespace, name): the pods it selects that run without the sidecar, by name.
    /// `streamed` holds pods (namespace, name) whose sidecar has been seen on a rule stream (a
    /// sidecar added by other means than the webhook); pods younger than [`GRACE_SECONDS`] at
    /// `now` are not judged yet.
    pub fn bare_pods_by_policy(
        &self,
        policies: &[PolicyView],
        streamed: &HashSet<(String, String)>,
        now: i64,
    ) -> BTreeMap<(String, String), Vec<PodFacts>> {
        let mut out = BTreeMap::new();
        for view in policies {
            let Some(compiled) = &view.compiled else {
                continue;
            };
            let mut bare: Vec<PodFacts> = self
                .pods
                .values()
                .filter(|p| p.namespace == view.namespace && p.bare())
                .filter(|p| p.created.is_none_or(|c| now - c >= GRACE_SECONDS))
                .filter(|p| !streamed.contains(&(p.namespace.clone(), p.name.clone())))
                .filter(|p| compiled.selector.matches(&p.labels))
                .cloned()
                .collect();
            bare.sort_by(|a, b| a.name.cmp(&b.name));
            out.insert((view.namespace.clone(), view.name.clone()), bare);
        }
        out
    }

    /// Injected pods with ports the sidecar does not cover, created at or after `since`.
    fn young_with_unprotected_ports(&self, since: i64) -> Vec<PodFacts> {
        self.pods
            .values()
            .filter(|p| p.unprotected_ports.is_some() && p.created.is_some_and(|c| c >= since))
            .cloned()
            .collect()
    }

    /// Pods created after `current` (this process's injector id) started, but injected by an
    /// older process with other settings: an old replica answered the webhook during a
    /// rollout. Pods created before are left alone (an upgrade never re-injects running pods).
    /// Creation times have whole seconds: a pod created in our start's second may be older
    /// than us, so only later seconds count (a pod injected in that second is not flagged).
    fn outdated(&self, current: (i64, &str)) -> Vec<PodFacts> {
        let (started, hash) = current;
        self.pods
            .values()
            .filter(|p| p.has_sidecar && !p.deleting)
            .filter(|p| p.created.is_some_and(|c| c > started))
            .filter(|p| {
                p.injected_by
                    .as_ref()
                    .is_some_and(|(t, h)| *t < started && h != hash)
            })
            .cloned()
            .collect()
    }

    /// The pods `owner` manages.
    fn owned_by(&self, owner_uid: &str) -> impl Iterator<Item = &PodFacts> {
        self.pods
            .values()
            .filter(move |p| p.owner.as_ref().is_some_and(|o| o.uid == owner_uid))
    }
}

// === metrics ===

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// `tollgate_controller_pods_without_sidecar` (leader only; 0 elsewhere) and
/// `tollgate_controller_pod_restarts_total{result}` (`evicted`, `blocked` by a
/// PodDisruptionBudget, `error`, `given_up`).
#[derive(Clone, Debug, Default)]
pub struct CoverageMetrics {
    bare: Gauge,
    outdated: Gauge,
    restarts: Family<ResultLabels, Counter>,
}

impl CoverageMetrics {
    pub fn register(registry: &mut Registry) -> CoverageMetrics {
        let m = CoverageMetrics::default();
        registry.register(
            "pods_without_sidecar",
            "Pods a RateLimitPolicy selects that run without the tollgate sidecar (their traffic is not limited)",
            m.bare.clone(),
        );
        registry.register(
            "pods_with_outdated_sidecar",
            "Pods injected during a rollout by an older controller replica with other sidecar settings",
            m.outdated.clone(),
        );
        registry.register(
            "pod_restarts",
            "Evictions of pods without the sidecar (--restart-pods-without-sidecar), by result",
            m.restarts.clone(),
        );
        m
    }

    fn restart(&self, result: &'static str) {
        self.restarts.get_or_create(&ResultLabels { result }).inc();
    }
}

// === the task ===

/// The coverage fields of one policy's status as last written.
#[derive(Clone, Debug, PartialEq)]
struct Written {
    count: u32,
    generation: Option<i64>,
}

/// What the restart opt-in remembers of one owner.
#[derive(Clone, Debug)]
enum OwnerRestart {
    /// A pod was evicted at this second; waiting for the owner's next pod.
    Evicted { at: i64, pod_uid: Option<String> },
    /// A pod the owner created after an eviction had no sidecar either: leave the owner alone.
    GivenUp,
}

/// Reports (and with `restart`, evicts) pods without the sidecar while this replica leads.
pub struct Coverage {
    client: kube::Client,
    index: SharedIndex,
    pods: SharedPodTable,
    metrics: CoverageMetrics,
    recorder: Recorder,
    restart: bool,
    interval: Duration,
    written: HashMap<(String, String), Written>,
    pod_events: HashSet<String>,
    owners: HashMap<String, OwnerRestart>,
    /// Pods whose sidecar this replica has seen on a rule stream.
    streamed: HashSet<(String, String)>,
    /// This process's [`INJECTED_BY`] value, when it serves the injection webhook.
    injector: Option<(i64, String)>,
}

impl Coverage {
    #[allow(clippy::too_many_arguments, reason = "plain wiring from runtime")]
    pub fn new(
        client: kube::Client,
        index: SharedIndex,
        pods: SharedPodTable,
        metrics: CoverageMetrics,
        instance: String,
        restart: bool,
        interval: Duration,
    ) -> Coverage {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "tollgate-controller".to_string(),
                instance: Some(instance),
            },
        );
        Coverage {
            client,
            index,
            pods,
            metrics,
            recorder,
            restart,
            interval,
            written: HashMap::new(),
            pod_events: HashSet::new(),
            owners: HashMap::new(),
            streamed: HashSet::new(),
            injector: None,
        }
    }

    /// Also reports (and with `restart`, evicts) pods injected during a rollout by an older
    /// replica with other settings; `injector` is this process's [`INJECTED_BY`] value.
    pub fn with_injector(mut self, injector: Option<String>) -> Coverage {
        self.injector = injector
            .as_deref()
            .and_then(parse_injector_id)
            .map(|(t, h)| (t, h.to_string()));
        self
    }

    /// Checks every `interval` while leading, until `shutdown`.
    pub async fn run(mut self, leader: watch::Receiver<bool>, mut shutdown: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { return },
            }
            if !*leader.borrow() {
                self.metrics.bare.set(0);
                self.written.clear();
                continue;
            }
            self.check().await;
        }
    }

    /// One pass: status, Events, the gauge and, opted in, evictions.
    pub async fn check(&mut self) {
        let (views, report) = {
            let index = self.index.read();
            (index.policy_views(), index.membership_report())
        };
        for (ns, pods) in report.namespaces {
            for pod in pods.into_keys() {
                self.streamed.insert((ns.clone(), pod));
            }
        }
        let now = now_seconds();
        let (by_policy, young, outdated) = {
            let pods = self.pods.lock();
            self.streamed.retain(|key| pods.pods.contains_key(key));
            // Forget the Events of pods that are gone (keys are `<kind>/<uid>`).
            let live: HashSet<&str> = pods
                .pods
                .values()
                .filter_map(|p| p.uid.as_deref())
                .collect();
            self.pod_events
                .retain(|k| k.split_once('/').is_some_and(|(_, uid)| live.contains(uid)));
            (
                pods.bare_pods_by_policy(&views, &self.streamed, now),
                pods.young_with_unprotected_ports(now - UNPROTECTED_PORTS_EVENT_AGE),
                self.injector
                    .as_ref()
                    .map(|(t, h)| pods.outdated((*t, h)))
                    .unwrap_or_default(),
            )
        };
        let mut bare: BTreeMap<(String, String), (PodFacts, String)> = BTreeMap::new();
        for view in &views {
            let key = (view.namespace.clone(), view.name.clone());
            let pods = by_policy.get(&key).map(Vec::as_slice).unwrap_or_default();
            self.report_policy(view, pods).await;
            for pod in pods {
                bare.entry((pod.namespace.clone(), pod.name.clone()))
                    .or_insert_with(|| (pod.clone(), view.name.clone()));
            }
        }
        self.metrics
            .bare
            .set(i64::try_from(bare.len()).unwrap_or(i64::MAX));
        for (pod, policy) in bare.values() {
            self.report_pod(pod, policy).await;
        }
        for pod in &young {
            self.report_unprotected_ports(pod).await;
        }
        self.metrics
            .outdated
            .set(i64::try_from(outdated.len()).unwrap_or(i64::MAX));
        for pod in &outdated {
            self.report_outdated(pod).await;
        }
        if self.restart {
            let candidates: Vec<PodFacts> = bare
                .values()
                .map(|(p, _)| p.clone())
                .chain(outdated)
                .collect();
            self.restart_bare(candidates.iter()).await;
        }
    }

    async fn report_policy(&mut self, view: &PolicyView, pods: &[PodFacts]) {
        let key = (view.namespace.clone(), view.name.clone());
        let count = u32::try_from(pods.len()).unwrap_or(u32::MAX);
        let want = Written {
            count,
            generation: view.generation,
        };
        if self.written.get(&key) == Some(&want) {
            return;
        }
        let names: Vec<&str> = pods.iter().take(5).map(|p| p.name.as_str()).collect();
        let more = pods.len().saturating_sub(names.len());
        let listed = if more > 0 {
            format!("{} and {more} more", names.join(", "))
        } else {
            names.join(", ")
        };
        let message = if count == 0 {
            "every pod this policy selects runs the tollgate sidecar".to_string()
        } else {
            format!(
                "{count} selected pod(s) run without the tollgate sidecar, so this policy does \
                 not limit their traffic: {listed}. They were created while the injection \
                 webhook did not answer; delete them to re-create them with the sidecar \
                 (docs/install.md, \"Pods without the sidecar\")"
            )
        };
        if self.patch_status(view, count, &message).await {
            let previous = self.written.insert(key, want).map(|w| w.count);
            if count > 0 && previous != Some(count) {
                let reference = view.object_reference();
                self.publish(&reference, "PodsWithoutSidecar", &message)
                    .await;
            }
        }
    }

    async fn patch_status(&self, view: &PolicyView, count: u32, message: &str) -> bool {
        let (status, reason) = if count == 0 {
            ("True", "AllPodsInjected")
        } else {
            ("False", "PodsWithoutSidecar")
        };
        // Keep the transition time while the condition's status is unchanged.
        let since = view
            .observed_status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION))
            .filter(|c| c.status == status)
            .map(|c| c.last_transition_time.clone());
        let since =
            since.unwrap_or_else(|| {
                k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::now(),
                )
            });
        let mut condition = serde_json::json!({
            "type": CONDITION,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": since,
        });
        if let Some(g) = view.generation {
            condition["observedGeneration"] = serde_json::json!(g);
        }
        let body = serde_json::json!({
            "apiVersion": "tollgate.dev/v1alpha1",
            "kind": "RateLimitPolicy",
            "status": {"podsWithoutSidecar": count, "conditions": [condition]},
        });
        // The response is not read: untyped, so a stored policy that does not decode (a required
        // field missing, stored while no validating webhook ran) still gets its status.
        let api: Api<kube::api::DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &view.namespace,
            &kube::api::ApiResource::erase::<RateLimitPolicy>(&()),
        );
        let params = PatchParams::apply(FIELD_MANAGER).force();
        match api
            .patch_status(&view.name, &params, &Patch::Apply(&body))
            .await
        {
            Ok(_) => true,
            Err(kube::Error::Api(e)) if e.code == 404 => true,
            Err(error) => {
                tracing::warn!(namespace = %view.namespace, policy = %view.name, %error, "cannot write podsWithoutSidecar");
                false
            }
        }
    }

    async fn report_pod(&mut self, pod: &PodFacts, policy: &str) {
        let Some(uid) = &pod.uid else { return };
        if !self.pod_events.insert(format!("bare/{uid}")) {
            return;
        }
        tracing::warn!(namespace = %pod.namespace, pod = %pod.name, %policy, "pod selected by a policy runs without the sidecar: its traffic is not limited");
        let note = format!(
            "RateLimitPolicy {policy} selects this pod but it has no tollgate sidecar (it was \
             created while the injection webhook did not answer): its traffic is not limited. \
             Delete the pod to re-create it with the sidecar."
        );
        self.publish(&pod_reference(pod), "SidecarMissing", &note)
            .await;
    }

    async fn report_outdated(&mut self, pod: &PodFacts) {
        let Some(uid) = &pod.uid else { return };
        if !self.pod_events.insert(format!("outdated/{uid}")) {
            return;
        }
        let note = "injected during a rollout by an older tollgate controller replica, with \
                    sidecar settings that differ from the current ones: re-create the pod to get \
                    the current sidecar (docs/install.md, \"Upgrades\")";
        self.publish(&pod_reference(pod), "SidecarSettingsOutdated", note)
            .await;
    }

    async fn report_unprotected_ports(&mut self, pod: &PodFacts) {
        let (Some(uid), Some(ports)) = (&pod.uid, &pod.unprotected_ports) else {
            return;
        };
        if !self.pod_events.insert(format!("ports/{uid}")) {
            return;
        }
        let note = format!(
            "only the port the tollgate sidecar forwards to is rate limited; these ports of the \
             app reach it without limits: {ports} (docs/install.md, \"Pods with several ports\")"
        );
        self.publish(&pod_reference(pod), "UnprotectedPorts", &note)
            .await;
    }

    async fn publish(&self, reference: &ObjectReference, reason: &str, note: &str) {
        let event = Event {
            type_: EventType::Warning,
            reason: reason.to_string(),
            note: Some(note.chars().take(1024).collect()),
            action: "CheckSidecar".to_string(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, reference).await {
            tracing::warn!(name = ?reference.name, %error, "cannot publish event");
        }
    }

    /// Evicts bare pods, one per owner at a time, and stops for an owner whose new pods come
    /// back bare too (the webhook does not inject there, so evicting again would only churn).
    async fn restart_bare(&mut self, bare: impl Iterator<Item = &PodFacts>) {
        let mut busy: HashSet<String> = HashSet::new();
        let candidates: Vec<PodFacts> = bare.cloned().collect();
        for pod in candidates {
            let Some(owner) = pod.owner.clone() else {
                continue;
            };
            if !RESTARTABLE_OWNERS.contains(&owner.kind.as_str()) || busy.contains(&owner.uid) {
                continue;
            }
            if !self.owner_ready_for_eviction(&owner, &pod).await {
                busy.insert(owner.uid.clone());
                continue;
            }
            busy.insert(owner.uid.clone());
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace);
            match api.evict(&pod.name, &EvictParams::default()).await {
                Ok(_) => {
                    self.metrics.restart("evicted");
                    tracing::info!(namespace = %pod.namespace, pod = %pod.name, owner = %owner.name, "evicted a pod without the sidecar so it comes back with it");
                    self.owners.insert(
                        owner.uid.clone(),
                        OwnerRestart::Evicted {
                            at: now_seconds(),
                            pod_uid: pod.uid.clone(),
                        },
                    );
                    let note = "evicted: it has no tollgate sidecar, and its owner re-creates it \
                                through the injection webhook (--restart-pods-without-sidecar)";
                    self.publish(&pod_reference(&pod), "SidecarMissingEvicted", note)
                        .await;
                }
                Err(kube::Error::Api(e)) if e.code == 429 => {
                    self.metrics.restart("blocked");
                    tracing::info!(namespace = %pod.namespace, pod = %pod.name, "eviction blocked by a PodDisruptionBudget; retrying later");
                }
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(error) => {
                    self.metrics.restart("error");
                    tracing::warn!(namespace = %pod.namespace, pod = %pod.name, %error, "cannot evict a pod without the sidecar");
                }
            }
        }
    }

    /// Whether another pod of `owner` may be evicted now: nothing evicted yet, or a pod it
    /// created since the last eviction runs with the sidecar. Gives up (with an Event) when
    /// such a pod runs without it.
    async fn owner_ready_for_eviction(&mut self, owner: &OwnerReference, pod: &PodFacts) -> bool {
        let (at, evicted_uid) = match self.owners.get(&owner.uid) {
            None => return true,
            Some(OwnerRestart::GivenUp) => return false,
            Some(OwnerRestart::Evicted { at, pod_uid }) => (*at, pod_uid.clone()),
        };
        let (newer_bare, newer_injected) = {
            let pods = self.pods.lock();
            let newer: Vec<&PodFacts> = pods
                .owned_by(&owner.uid)
                .filter(|p| p.created.is_some_and(|c| c >= at) && p.uid != evicted_uid)
                .collect();
            (
                newer.iter().any(|p| p.bare()),
                newer.iter().any(|p| p.has_sidecar),
            )
        };
        if newer_bare {
            self.owners.insert(owner.uid.clone(), OwnerRestart::GivenUp);
            self.metrics.restart("given_up");
            let note = format!(
                "not evicting pods of {} {} any more: a pod it re-created after an eviction has \
                 no sidecar either (is the injection webhook reaching this controller, and is \
                 injection enabled for these pods?)",
                owner.kind, owner.name
            );
            tracing::warn!(namespace = %pod.namespace, owner = %owner.name, "{note}");
            self.publish(&pod_reference(pod), "SidecarMissing", &note)
                .await;
            return false;
        }
        newer_injected
    }
}

/// `status` without the fields this module writes (`podsWithoutSidecar`, the
/// `SidecarsInjected` condition), for the status writer to compare what it owns.
pub fn without_coverage(
    status: &tollgate_crd::policy::RateLimitPolicyStatus,
) -> tollgate_crd::policy::RateLimitPolicyStatus {
    let mut s = status.clone();
    s.pods_without_sidecar = None;
    s.conditions.retain(|c| c.type_ != CONDITION);
    s
}

fn now_seconds() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_second()
}

fn pod_reference(pod: &PodFacts) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_string()),
        kind: Some("Pod".to_string()),
        name: Some(pod.name.clone()),
        namespace: Some(pod.namespace.clone()),
        uid: pod.uid.clone(),
        ..ObjectReference::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> ObjectMeta {
        let map = |kv: &[(&str, &str)]| {
            Some(
                kv.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        ObjectMeta {
            namespace: Some("shop".into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            labels: map(labels),
            annotations: map(annotations),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn a_pod_is_bare_without_the_injection_annotation_unless_it_opted_out() {
        let facts = |m: ObjectMeta| PodFacts::from_metadata(&m).unwrap();
        assert!(facts(meta("a", &[], &[])).bare());
        assert!(!facts(meta("b", &[], &[(SIDECAR_VERSION, "0.1.0")])).bare());
        assert!(!facts(meta("c", &[(INJECT, DISABLED)], &[])).bare());
        assert!(!facts(meta("d", &[], &[(INJECT, DISABLED)])).bare());
        assert!(
            !facts(meta(
                "rls",
                &[(CONTROL_PLANE_LABEL, "rate-limit-service")],
                &[]
            ))
            .bare()
        );
        let mut deleting = meta("e", &[], &[]);
        deleting.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        ));
        assert!(!facts(deleting).bare());
    }

    #[test]
    fn pods_an_older_replica_injected_during_the_rollout_are_outdated() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let at = |secs: i64| {
            Some(Time(
                k8s_openapi::jiff::Timestamp::from_second(secs).unwrap(),
            ))
        };
        let mut t = PodTable::default();
        for (name, created, by) in [
            ("during-old", 1_000, "900.aaaa"), // old replica, other settings, after our start
            ("during-same", 1_000, "900.bbbb"), // old replica, the same settings
            ("before-old", 800, "700.aaaa"),   // created before our start: an upgrade leaves it
            ("start-second", 950, "900.aaaa"), // created in our start's second: maybe before us
            ("during-newer", 1_000, "990.cccc"), // a replica newer than us
        ] {
            let mut m = meta(name, &[], &[(SIDECAR_VERSION, "0.1.0"), (INJECTED_BY, by)]);
            m.creation_timestamp = at(created);
            t.apply(PodFacts::from_metadata(&m).unwrap());
        }
        let names: Vec<String> = t
            .outdated((950, "bbbb"))
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(names, ["during-old"]);
    }

    #[test]
    fn the_status_writer_compares_without_the_coverage_fields() {
        let mut status = tollgate_crd::policy::RateLimitPolicyStatus {
            rule_count: Some(1),
            pods_without_sidecar: Some(2),
            ..Default::default()
        };
        status
            .conditions
            .push(k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: CONDITION.into(),
                status: "False".into(),
                reason: "PodsWithoutSidecar".into(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::now(),
                ),
            });
        let own = without_coverage(&status);
        assert_eq!(
            own,
            tollgate_crd::policy::RateLimitPolicyStatus {
                rule_count: Some(1),
                ..Default::default()
            }
        );
    }

    #[test]
    fn relists_replace_only_their_scope() {
        let mut t = PodTable::default();
        let mut other = meta("x", &[], &[]);
        other.namespace = Some("other".into());
        t.apply(PodFacts::from_metadata(&other).unwrap());
        t.apply(PodFacts::from_metadata(&meta("a", &[], &[])).unwrap());
        t.reset(
            Some("shop"),
            vec![PodFacts::from_metadata(&meta("b", &[], &[])).unwrap()],
        );
        let mut names: Vec<&str> = t.pods.values().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["b", "x"]);
        t.reset(None, Vec::new());
        assert!(t.pods.is_empty());
    }
}
