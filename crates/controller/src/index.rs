//! The in-memory index: policies and pods per namespace, and what each pod must enforce.
//!
//! ```text
//!  RateLimitPolicy ──compile──▶ Policy { last good CompiledPolicy, errors }
//!                                   │ selector.matches(pod labels)
//!  Pod labels ────────────────▶ Pod { rules, connections, acked } ──watch──▶ /v1/watch stream
//! ```
//!
//! The index is pure: no Kubernetes client, no I/O, and it calls no other module of the
//! controller (layers above it do): the watch tasks of the runtime feed it (`apply_*`,
//! `delete_*`, `reset_*`), the rule-stream server subscribes to one pod's [`PodRules`] and
//! reports connections and acks through the membership module, and the status writer reads
//! [`PolicyView`]s.
//!
//! With several controller replicas, each one serves some of the streams. Replicas exchange
//! [`MembershipReport`]s (written and read by the peers module); the index merges the reports of the other
//! replicas into its counts, so every replica pushes the fleet-wide member count and the leader's
//! status counts every sidecar, whichever replica it is connected to.
//!
//! Every change that alters what some pod enforces bumps one global, monotonically increasing
//! version; the pods whose rule set changed take that version. Each pod has its own
//! `tokio::sync::watch` channel, updated with `send_if_modified`, so a no-op update (a relist, a
//! status write echoed back by the watch, a label change that selects the same policies) wakes
//! no stream, and a slow stream only ever sees the latest state.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use parking_lot::RwLock;
use tokio::sync::watch;
use tokio::time::Instant;
use tollgate_crd::{CompiledPolicy, FieldError, RateLimitPolicy, RateLimitPolicyStatus};

/// The index shared by the watch tasks, the server and the status writer.
pub type SharedIndex = Arc<RwLock<Index>>;

/// What one pod's sidecar must enforce: the value of the pod's watch channel.
#[derive(Clone, Debug, PartialEq)]
pub struct PodRules {
    /// The global version at which this pod's rule set last changed.
    pub version: u64,
    /// The last good compiled policies selecting the pod, ordered by policy name.
    pub policies: Vec<Arc<CompiledPolicy>>,
    /// Live (connected) sidecars per policy id, for the pod's policies only.
    pub members: BTreeMap<String, u32>,
}

/// A policy as the watch delivered it, already compiled (outside the index lock).
#[derive(Clone, Debug)]
pub struct PolicyInput {
    pub namespace: String,
    pub name: String,
    pub uid: Option<String>,
    pub generation: Option<i64>,
    /// The compiled policy, or every error with its field path.
    pub compiled: Result<CompiledPolicy, Vec<FieldError>>,
    /// The status currently on the object (so the status writer can skip no-op patches).
    pub status: Option<RateLimitPolicyStatus>,
}

impl PolicyInput {
    /// Compiles a policy object. `None` for objects without a name or namespace.
    pub fn from_policy(policy: &RateLimitPolicy) -> Option<PolicyInput> {
        let namespace = policy.metadata.namespace.clone()?;
        let name = policy.metadata.name.clone()?;
        let compiled = tollgate_crd::compile(policy).map_err(|e| e.0);
        Some(PolicyInput {
            namespace,
            name,
            uid: policy.metadata.uid.clone(),
            generation: policy.metadata.generation,
            compiled,
            status: policy.status.clone(),
        })
    }

    /// Compiles a policy object from the API server: unknown `spec` fields are errors too.
    pub fn from_decoded(decoded: &tollgate_crd::Decoded) -> Option<PolicyInput> {
        let policy = &decoded.policy;
        let mut input = PolicyInput::from_policy(policy)?;
        let unknown = decoded.unknown_spec_fields();
        if !unknown.is_empty() {
            let mut errors = unknown;
            if let Err(more) = input.compiled {
                errors.extend(more);
            }
            input.compiled = Err(errors);
        }
        Some(input)
    }

    /// An object that could not even be deserialized as a `RateLimitPolicy`.
    pub fn undecodable(metadata: &ObjectMeta, error: &str) -> Option<PolicyInput> {
        Some(PolicyInput {
            namespace: metadata.namespace.clone()?,
            name: metadata.name.clone()?,
            uid: metadata.uid.clone(),
            generation: metadata.generation,
            compiled: Err(vec![FieldError {
                path: "spec".to_string(),
                message: format!("cannot be decoded as a RateLimitPolicy: {error}"),
            }]),
            status: None,
        })
    }
}

/// A pod as the watch delivered it: only its identity and labels matter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodInput {
    pub namespace: String,
    pub name: String,
    /// Tells a re-created pod (same name, e.g. a StatefulSet's) from the one before it.
    pub uid: Option<String>,
    pub labels: BTreeMap<String, String>,
}

impl PodInput {
    /// From pod metadata. `None` without a name or namespace.
    pub fn from_metadata(metadata: &ObjectMeta) -> Option<PodInput> {
        Some(PodInput {
            namespace: metadata.namespace.clone()?,
            name: metadata.name.clone()?,
            uid: metadata.uid.clone(),
            labels: metadata.labels.clone().unwrap_or_default(),
        })
    }
}

/// What the status writer needs to know about one policy.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyView {
    pub namespace: String,
    pub name: String,
    pub uid: Option<String>,
    pub generation: Option<i64>,
    /// Errors of the latest generation; empty when it compiled.
    pub errors: Vec<FieldError>,
    /// The last good compiled version, still in force when the latest one is invalid.
    pub compiled: Option<Arc<CompiledPolicy>>,
    /// The index version at which `compiled` last changed.
    pub version: u64,
    /// Connected sidecars whose pod the last good version selects.
    pub sidecars_total: u32,
    /// Of those, the ones that acknowledged a version containing the current policy.
    pub sidecars_in_sync: u32,
    /// The status on the object as last seen by the watch.
    pub observed_status: Option<RateLimitPolicyStatus>,
    /// How long ago `compiled` last changed in this replica's index (propagation time).
    pub compiled_age: Duration,
    /// When every connected selected sidecar first ran `compiled`, the time from the change
    /// to that moment (the last acknowledgement), and how long ago that was.
    pub programmed: Option<Programmed>,
    /// Up to [`LAGGING_NAMED`] connected selected pods that do not run `compiled` yet, by name.
    pub lagging: Vec<String>,
    /// Of the connected selected sidecars, those without a Redis store (`redis=false` on their
    /// stream): they enforce the policy's Global rules per pod.
    pub sidecars_without_redis: u32,
}

impl PolicyView {
    /// The policy as the subject of an Event.
    pub fn object_reference(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("tollgate.dev/v1alpha1".to_string()),
            kind: Some("RateLimitPolicy".to_string()),
            name: Some(self.name.clone()),
            namespace: Some(self.namespace.clone()),
            uid: self.uid.clone(),
            ..Default::default()
        }
    }
}

/// Pods a policy view names among those that have not acknowledged its rules.
pub const LAGGING_NAMED: usize = 5;

/// When a compiled policy became fully acknowledged (see [`PolicyView::programmed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Programmed {
    /// From the change in this replica's index to the acknowledgement that completed it.
    pub after: Duration,
    /// How long ago that acknowledgement arrived.
    pub ago: Duration,
}

/// What one controller replica tells the others: the pods with an open stream to it and, for
/// each, the policies it runs as they are now (`name/uid` → `metadata.generation` it
/// acknowledged).
///
/// Versions are per replica (they mean nothing to another replica's index); generations and
/// UIDs are the API server's, so every replica reads them the same way. The UID keeps a policy
/// deleted and created again under its name (whose generations start over) from passing for
/// the one it replaced.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MembershipReport {
    /// namespace → pod → policy name → acknowledged generation.
    #[serde(default)]
    pub namespaces: BTreeMap<String, BTreeMap<String, BTreeMap<String, i64>>>,
    /// namespace → the pods among them whose sidecar has no Redis store. Absent from reports
    /// of replicas that do not know of it, which then count every sidecar as having one.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub without_redis: BTreeMap<String, BTreeSet<String>>,
}

impl MembershipReport {
    /// Number of pods in the report.
    pub fn pods(&self) -> usize {
        self.namespaces.values().map(BTreeMap::len).sum()
    }
}

/// Why an ack was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    #[error("pod is not known to the controller")]
    UnknownPod,
    #[error("epoch {got:?} is not this controller's epoch {want:?}; reconnect the stream")]
    EpochMismatch { got: String, want: String },
    #[error("version {got} was never sent to this pod (its current version is {current})")]
    FutureVersion { got: u64, current: u64 },
}

/// Counters the index keeps about itself; exported at scrape time by the metrics module.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub compiles_ok: u64,
    pub compiles_failed: u64,
}

/// A point-in-time summary for metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IndexSummary {
    pub version: u64,
    pub policies: u64,
    /// Policies whose latest generation failed to compile.
    pub invalid_policies: u64,
    pub pods: u64,
    /// Connected sidecars per policy id (policies with none are listed with 0).
    pub connected: BTreeMap<String, u32>,
    /// Other replicas whose membership reports are merged in.
    pub peers: u64,
    pub stats: IndexStats,
}

/// The index. See the module docs.
pub struct Index {
    epoch: String,
    version: u64,
    namespaces: HashMap<String, Namespace>,
    next_pod_id: u64,
    /// Bumped whenever a pod appears (wakes requests waiting for an unknown pod).
    pods_tx: watch::Sender<u64>,
    /// Bumped on every change the status writer may care about.
    changes_tx: watch::Sender<u64>,
    stats: IndexStats,
    /// The latest report of every other live replica.
    reports: HashMap<String, MembershipReport>,
    /// The reports merged, per namespace.
    remote: HashMap<String, RemotePods>,
}

/// Pods connected to other replicas, for one namespace, by name.
type RemotePods = HashMap<String, RemotePod>;

/// What other replicas report about one pod connected to them.
#[derive(Default)]
struct RemotePod {
    /// Policy (`name/uid`) → highest acknowledged generation.
    policies: BTreeMap<String, i64>,
    /// Its sidecar has no Redis store.
    without_redis: bool,
}

#[derive(Default)]
struct Namespace {
    policies: BTreeMap<String, Policy>,
    pods: HashMap<String, Pod>,
}

struct Policy {
    uid: Option<String>,
    generation: Option<i64>,
    compiled: Option<Arc<CompiledPolicy>>,
    errors: Vec<FieldError>,
    version: u64,
    changed_at: Instant,
    /// When every connected sidecar it selects (fleet-wide) first ran `compiled`.
    programmed_at: Option<Instant>,
    /// A change of `compiled` is waiting for every connected sidecar's ack (stream lag).
    lag_pending: bool,
    status: Option<RateLimitPolicyStatus>,
}

struct Pod {
    id: u64,
    uid: Option<String>,
    labels: BTreeMap<String, String>,
    version: u64,
    /// The pod's policies and, for each, the version since which the pod holds it unchanged.
    policies: Vec<(Arc<CompiledPolicy>, u64)>,
    tx: watch::Sender<PodRules>,
    connections: u32,
    acked: Option<u64>,
    /// Its latest stream said its sidecar has no Redis store.
    without_redis: bool,
}

/// A subscription to one pod, returned by [`Index::connect`].
#[derive(Debug)]
pub struct Subscription {
    /// Identifies the pod incarnation, so a disconnect never touches a re-created pod.
    pub pod_id: u64,
    pub rx: watch::Receiver<PodRules>,
    /// Whether the client resumed at the pod's current version (no snapshot needed).
    pub resumed: bool,
    /// Stream lag of policy changes that this (resumed) connection completed.
    pub lag: Vec<Duration>,
}

// === impl Index ===

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("epoch", &self.epoch)
            .field("version", &self.version)
            .field("namespaces", &self.namespaces.len())
            .finish_non_exhaustive()
    }
}

impl Index {
    pub fn new(epoch: impl Into<String>) -> Index {
        Index {
            epoch: epoch.into(),
            version: 0,
            namespaces: HashMap::new(),
            next_pod_id: 0,
            pods_tx: watch::Sender::new(0),
            changes_tx: watch::Sender::new(0),
            stats: IndexStats::default(),
            reports: HashMap::new(),
            remote: HashMap::new(),
        }
    }

    /// A new shared index.
    pub fn shared(epoch: impl Into<String>) -> SharedIndex {
        Arc::new(RwLock::new(Index::new(epoch)))
    }

    /// Identifies this controller process; versions are only comparable within one epoch.
    pub fn epoch(&self) -> &str {
        &self.epoch
    }

    /// The global version: the latest version any pod was given.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Ticks whenever a pod is added; used to wait briefly for a pod the watch has not seen yet.
    pub fn pods_rx(&self) -> watch::Receiver<u64> {
        self.pods_tx.subscribe()
    }

    /// Ticks on every change to policies, pods, connections or acks.
    pub fn changes_rx(&self) -> watch::Receiver<u64> {
        self.changes_tx.subscribe()
    }

    pub fn stats(&self) -> IndexStats {
        self.stats
    }

    /// The current rules of a pod, if the pod is known.
    pub fn pod_rules(&self, namespace: &str, pod: &str) -> Option<PodRules> {
        let pod = self.namespaces.get(namespace)?.pods.get(pod)?;
        Some(pod.tx.borrow().clone())
    }

    /// Subscribes to a pod's rules without registering a connection (tests, diagnostics).
    pub fn pod_rx(&self, namespace: &str, pod: &str) -> Option<watch::Receiver<PodRules>> {
        Some(
            self.namespaces
                .get(namespace)?
                .pods
                .get(pod)?
                .tx
                .subscribe(),
        )
    }

    /// The UID of the pod now known under this name, if the watch reported one.
    pub fn pod_uid(&self, namespace: &str, pod: &str) -> Option<String> {
        self.namespaces.get(namespace)?.pods.get(pod)?.uid.clone()
    }

    /// The UID of the policy object the index holds under this name.
    pub fn policy_uid(&self, namespace: &str, name: &str) -> Option<String> {
        self.namespaces
            .get(namespace)?
            .policies
            .get(name)?
            .uid
            .clone()
    }

    pub fn has_pod(&self, namespace: &str, pod: &str) -> bool {
        self.namespaces
            .get(namespace)
            .is_some_and(|ns| ns.pods.contains_key(pod))
    }

    // --- policies ---

    /// Adds or updates a policy. An invalid update keeps the last good version in force.
    /// Returns whether any pod's rules changed.
    pub fn apply_policy(&mut self, input: PolicyInput) -> bool {
        let v = self.version + 1;
        let ns_name = input.namespace.clone();
        let compiled_changed = self.apply_policy_inner(input, v);
        let rules_changed = if compiled_changed {
            self.reindex_namespace(&ns_name, v)
        } else {
            false
        };
        self.finish(compiled_changed || rules_changed, v);
        rules_changed
    }

    /// Removes a policy. Returns whether any pod's rules changed.
    pub fn delete_policy(&mut self, namespace: &str, name: &str) -> bool {
        let v = self.version + 1;
        let Some(ns) = self.namespaces.get_mut(namespace) else {
            return false;
        };
        let Some(removed) = ns.policies.remove(name) else {
            return false;
        };
        let rules_changed = removed.compiled.is_some() && self.reindex_namespace(namespace, v);
        self.gc_namespace(namespace);
        self.finish(rules_changed, v);
        self.bump_changes();
        rules_changed
    }

    /// Replaces every policy in `scope` (one namespace, or all when `None`) with `inputs`:
    /// what a watch relist delivers. Unchanged policies cost nothing and wake nobody.
    pub fn reset_policies(&mut self, scope: Option<&str>, inputs: Vec<PolicyInput>) -> bool {
        let v = self.version + 1;
        let mut dirty: Vec<String> = Vec::new();
        let keep: std::collections::HashSet<(String, String)> = inputs
            .iter()
            .map(|i| (i.namespace.clone(), i.name.clone()))
            .collect();
        let mut any = false;
        for (ns_name, ns) in self.namespaces.iter_mut() {
            if scope.is_some_and(|s| s != ns_name) {
                continue;
            }
            let before = ns.policies.len();
            let mut lost_good = false;
            ns.policies.retain(|name, p| {
                let stays = keep.contains(&(ns_name.clone(), name.clone()));
                if !stays && p.compiled.is_some() {
                    lost_good = true;
                }
                stays
            });
            if ns.policies.len() != before {
                any = true;
            }
            if lost_good {
                dirty.push(ns_name.clone());
            }
        }
        for input in inputs {
            if scope.is_some_and(|s| s != input.namespace) {
                continue;
            }
            let ns_name = input.namespace.clone();
            if self.apply_policy_inner(input, v) {
                dirty.push(ns_name);
            }
        }
        dirty.sort();
        dirty.dedup();
        let mut rules_changed = false;
        for ns in &dirty {
            rules_changed |= self.reindex_namespace(ns, v);
        }
        let namespaces: Vec<String> = self.namespaces.keys().cloned().collect();
        for ns in namespaces {
            self.gc_namespace(&ns);
        }
        self.finish(!dirty.is_empty() || rules_changed, v);
        if any {
            self.bump_changes();
        }
        rules_changed
    }

    /// Applies one policy without reindexing; returns whether its compiled version changed.
    fn apply_policy_inner(&mut self, input: PolicyInput, v: u64) -> bool {
        let now = Instant::now();
        match &input.compiled {
            Ok(_) => self.stats.compiles_ok += 1,
            Err(_) => self.stats.compiles_failed += 1,
        }
        let ns = self.namespaces.entry(input.namespace.clone()).or_default();
        let policy = ns
            .policies
            .entry(input.name.clone())
            .or_insert_with(|| Policy {
                uid: input.uid.clone(),
                generation: None,
                compiled: None,
                errors: Vec::new(),
                // Set when a version compiles.
                version: 0,
                changed_at: now,
                programmed_at: None,
                lag_pending: false,
                status: None,
            });
        let mut changed = false;
        // A different uid is a new object: the old one's last good version must not survive.
        if policy.uid != input.uid {
            policy.uid = input.uid.clone();
            if policy.compiled.take().is_some() {
                changed = true;
            }
        }
        let mut status_changed =
            policy.generation != input.generation || policy.status != input.status;
        policy.generation = input.generation;
        policy.status = input.status;
        match input.compiled {
            Ok(compiled) => {
                status_changed |= !policy.errors.is_empty();
                policy.errors.clear();
                if policy.compiled.as_deref() != Some(&compiled) {
                    policy.compiled = Some(Arc::new(compiled));
                    changed = true;
                }
            }
            Err(errors) => {
                status_changed |= policy.errors != errors;
                policy.errors = errors;
            }
        }
        if changed {
            policy.version = v;
            policy.changed_at = now;
            policy.programmed_at = None;
        }
        if changed || status_changed {
            self.bump_changes();
        }
        changed
    }

    // --- pods ---

    /// Adds or updates a pod. Returns whether its rules changed.
    pub fn apply_pod(&mut self, input: PodInput) -> bool {
        let v = self.version + 1;
        let (changed, created) = self.apply_pod_inner(input.clone(), v);
        if changed {
            self.publish_namespace(&input.namespace);
            self.note_programmed(&input.namespace);
        }
        self.finish(changed, v);
        if created {
            self.pods_tx.send_modify(|n| *n += 1);
        }
        changed
    }

    /// Removes a pod: its stream ends, and it leaves the membership counts.
    pub fn delete_pod(&mut self, namespace: &str, name: &str) -> bool {
        let Some(ns) = self.namespaces.get_mut(namespace) else {
            return false;
        };
        let Some(pod) = ns.pods.remove(name) else {
            return false;
        };
        if pod.connections > 0 {
            self.publish_namespace(namespace);
            self.note_programmed(namespace);
        }
        self.gc_namespace(namespace);
        self.bump_changes();
        true
    }

    /// Replaces every pod in `scope` with `inputs` (a relist).
    pub fn reset_pods(&mut self, scope: Option<&str>, inputs: Vec<PodInput>) -> bool {
        let v = self.version + 1;
        let keep: std::collections::HashSet<(String, String)> = inputs
            .iter()
            .map(|i| (i.namespace.clone(), i.name.clone()))
            .collect();
        let mut dirty: Vec<String> = Vec::new();
        for (ns_name, ns) in self.namespaces.iter_mut() {
            if scope.is_some_and(|s| s != ns_name) {
                continue;
            }
            let before = ns.pods.len();
            ns.pods
                .retain(|name, _| keep.contains(&(ns_name.clone(), name.clone())));
            if ns.pods.len() != before {
                dirty.push(ns_name.clone());
            }
        }
        let mut changed = false;
        let mut created = false;
        for input in inputs {
            if scope.is_some_and(|s| s != input.namespace) {
                continue;
            }
            let ns_name = input.namespace.clone();
            let (c, n) = self.apply_pod_inner(input, v);
            if c {
                changed = true;
                dirty.push(ns_name);
            }
            created |= n;
        }
        dirty.sort();
        dirty.dedup();
        for ns in &dirty {
            self.publish_namespace(ns);
            self.note_programmed(ns);
        }
        let namespaces: Vec<String> = self.namespaces.keys().cloned().collect();
        for ns in namespaces {
            self.gc_namespace(&ns);
        }
        self.finish(changed, v);
        if !dirty.is_empty() {
            self.bump_changes();
        }
        if created {
            self.pods_tx.send_modify(|n| *n += 1);
        }
        changed
    }

    /// Returns (rules changed, pod created).
    fn apply_pod_inner(&mut self, input: PodInput, v: u64) -> (bool, bool) {
        let ns = self.namespaces.entry(input.namespace).or_default();
        let Namespace { policies, pods } = ns;
        // Another UID under the same name is a new pod: the old one's streams end with it.
        if pods
            .get(&input.name)
            .is_some_and(|pod| pod.uid.is_some() && input.uid.is_some() && pod.uid != input.uid)
        {
            pods.remove(&input.name);
        }
        match pods.get_mut(&input.name) {
            Some(pod) => {
                if pod.uid.is_none() {
                    pod.uid = input.uid;
                }
                if pod.labels == input.labels {
                    return (false, false);
                }
                pod.labels = input.labels;
                (recompute_pod(policies, pod, v), false)
            }
            None => {
                self.next_pod_id += 1;
                let mut pod = Pod {
                    id: self.next_pod_id,
                    uid: input.uid,
                    labels: input.labels,
                    version: v,
                    policies: Vec::new(),
                    tx: watch::Sender::new(PodRules {
                        version: v,
                        policies: Vec::new(),
                        members: BTreeMap::new(),
                    }),
                    connections: 0,
                    acked: None,
                    without_redis: false,
                };
                recompute_pod(policies, &mut pod, v);
                // A new pod always takes a fresh version, so a stale `since` never matches it.
                pod.version = v;
                pods.insert(input.name, pod);
                (true, true)
            }
        }
    }

    // --- membership (the membership module's connection guards and acks call these) ---

    /// Registers a stream of `pod`. `resume` is the client's `(since, epoch)`, if it sent one.
    #[cfg(test)]
    pub(crate) fn connect(
        &mut self,
        namespace: &str,
        pod_name: &str,
        resume: Option<(u64, &str)>,
    ) -> Option<Subscription> {
        self.connect_with(namespace, pod_name, resume, true)
    }

    /// [`Index::connect`] from a sidecar that says whether it has a Redis store.
    pub(crate) fn connect_with(
        &mut self,
        namespace: &str,
        pod_name: &str,
        resume: Option<(u64, &str)>,
        has_redis: bool,
    ) -> Option<Subscription> {
        let epoch_ok = |e: &str| e == self.epoch;
        let resume_version = resume.filter(|(_, e)| epoch_ok(e)).map(|(v, _)| v);
        let ns = self.namespaces.get_mut(namespace)?;
        let pod = ns.pods.get_mut(pod_name)?;
        pod.connections += 1;
        pod.without_redis = !has_redis;
        // What the new stream's process holds: nothing, unless it resumed within this epoch.
        pod.acked = resume_version.filter(|v| *v <= pod.version);
        let resumed = resume_version == Some(pod.version);
        let pod_id = pod.id;
        let rx = pod.tx.subscribe();
        self.publish_namespace(namespace);
        self.note_programmed(namespace);
        let lag = self.check_lag(namespace, pod_name);
        self.bump_changes();
        Some(Subscription {
            pod_id,
            rx,
            resumed,
            lag,
        })
    }

    /// Unregisters a stream; a no-op when the pod is gone or was re-created.
    pub(crate) fn disconnect(&mut self, namespace: &str, pod_name: &str, pod_id: u64) {
        let Some(pod) = self
            .namespaces
            .get_mut(namespace)
            .and_then(|ns| ns.pods.get_mut(pod_name))
        else {
            return;
        };
        if pod.id != pod_id || pod.connections == 0 {
            return;
        }
        pod.connections -= 1;
        if pod.connections == 0 {
            self.publish_namespace(namespace);
            // The last sidecar that lagged may just have left.
            self.note_programmed(namespace);
        }
        self.bump_changes();
    }

    /// Records that `pod` enforces `version`. Returns the stream lag of every policy whose
    /// change this ack completed (all connected selected sidecars now run it).
    pub(crate) fn ack(
        &mut self,
        namespace: &str,
        pod_name: &str,
        version: u64,
        epoch: &str,
    ) -> Result<Vec<Duration>, AckError> {
        if epoch != self.epoch {
            return Err(AckError::EpochMismatch {
                got: epoch.to_string(),
                want: self.epoch.clone(),
            });
        }
        let pod = self
            .namespaces
            .get_mut(namespace)
            .and_then(|ns| ns.pods.get_mut(pod_name))
            .ok_or(AckError::UnknownPod)?;
        if version > pod.version {
            return Err(AckError::FutureVersion {
                got: version,
                current: pod.version,
            });
        }
        if pod.acked.is_some_and(|a| a >= version) {
            return Ok(Vec::new());
        }
        pod.acked = Some(version);
        self.bump_changes();
        self.note_programmed(namespace);
        Ok(self.check_lag(namespace, pod_name))
    }

    /// Stamps the policies of `namespace` that every connected sidecar they select (here or at
    /// another replica) now runs, for the first time since they changed: the end of their
    /// propagation, measured when the completing acknowledgement arrives, not when a status
    /// write gets to it.
    fn note_programmed(&mut self, namespace: &str) {
        let Some(ns) = self.namespaces.get_mut(namespace) else {
            return;
        };
        let remote = self.remote.get(namespace);
        let now = Instant::now();
        for p in ns.policies.values_mut() {
            let Some(c) = p.compiled.as_ref().filter(|_| p.programmed_at.is_none()) else {
                continue;
            };
            let sync = sync_counts(
                &ns.pods,
                remote,
                &c.name,
                &remote_key(c, p.uid.as_deref()),
                c.generation,
            );
            if sync.total > 0 && sync.total == sync.in_sync {
                p.programmed_at = Some(now);
            }
        }
    }

    /// For the policies of one pod: which pending changes are now acked by every connected
    /// sidecar they select.
    fn check_lag(&mut self, namespace: &str, pod_name: &str) -> Vec<Duration> {
        let Some(ns) = self.namespaces.get_mut(namespace) else {
            return Vec::new();
        };
        let Some(pod) = ns.pods.get(pod_name) else {
            return Vec::new();
        };
        let names: Vec<String> = pod.policies.iter().map(|(c, _)| c.name.clone()).collect();
        let mut out = Vec::new();
        for name in names {
            let Some(policy) = ns.policies.get(&name) else {
                continue;
            };
            if !policy.lag_pending {
                continue;
            }
            // Lag is this replica's: its own streams, its own acks.
            let sync = sync_counts(&ns.pods, None, &name, "", 0);
            if sync.total > 0 && sync.total == sync.in_sync {
                out.push(policy.changed_at.elapsed());
                if let Some(p) = ns.policies.get_mut(&name) {
                    p.lag_pending = false;
                }
            }
        }
        out
    }

    // --- other replicas ---

    /// This replica's report for the others: every pod with an open stream here, and the
    /// policies it acknowledged as they are now.
    pub fn membership_report(&self) -> MembershipReport {
        let mut report = MembershipReport::default();
        for (ns_name, ns) in &self.namespaces {
            for (pod_name, pod) in &ns.pods {
                if pod.connections == 0 {
                    continue;
                }
                let uid =
                    |c: &CompiledPolicy| ns.policies.get(&c.name).and_then(|p| p.uid.as_deref());
                let acked: BTreeMap<String, i64> = pod
                    .policies
                    .iter()
                    .filter(|(_, since)| pod.acked.is_some_and(|a| a >= *since))
                    .map(|(c, _)| (remote_key(c, uid(c)), c.generation))
                    .collect();
                report
                    .namespaces
                    .entry(ns_name.clone())
                    .or_default()
                    .insert(pod_name.clone(), acked);
                if pod.without_redis {
                    report
                        .without_redis
                        .entry(ns_name.clone())
                        .or_default()
                        .insert(pod_name.clone());
                }
            }
        }
        report
    }

    /// Takes in another replica's latest report (replacing its previous one). Returns whether
    /// anything changed.
    pub fn set_report(&mut self, replica: &str, report: MembershipReport) -> bool {
        if self.reports.get(replica) == Some(&report) {
            return false;
        }
        let mut touched: Vec<String> = report.namespaces.keys().cloned().collect();
        if let Some(old) = self.reports.insert(replica.to_string(), report) {
            touched.extend(old.namespaces.into_keys());
        }
        self.merge_reports(touched);
        true
    }

    /// Forgets a replica (it left, or its report expired). Returns whether it was known.
    pub fn remove_report(&mut self, replica: &str) -> bool {
        let Some(old) = self.reports.remove(replica) else {
            return false;
        };
        self.merge_reports(old.namespaces.into_keys().collect());
        true
    }

    /// The replicas whose reports are merged in.
    pub fn report_replicas(&self) -> Vec<String> {
        let mut out: Vec<String> = self.reports.keys().cloned().collect();
        out.sort();
        out
    }

    /// Re-merges the reports for `namespaces`, then pushes the new counts to their pods.
    fn merge_reports(&mut self, mut namespaces: Vec<String>) {
        namespaces.sort();
        namespaces.dedup();
        for ns in &namespaces {
            let mut merged: RemotePods = HashMap::new();
            for report in self.reports.values() {
                let Some(pods) = report.namespaces.get(ns) else {
                    continue;
                };
                let without_redis = report.without_redis.get(ns);
                for (pod, policies) in pods {
                    let entry = merged.entry(pod.clone()).or_default();
                    entry.without_redis |= without_redis.is_some_and(|w| w.contains(pod));
                    for (policy, generation) in policies {
                        let g = entry.policies.entry(policy.clone()).or_insert(*generation);
                        *g = (*g).max(*generation);
                    }
                }
            }
            if merged.is_empty() {
                self.remote.remove(ns);
            } else {
                self.remote.insert(ns.clone(), merged);
            }
            self.publish_namespace(ns);
            self.note_programmed(ns);
        }
        self.bump_changes();
    }

    // --- views ---

    /// Every policy, for the status writer.
    pub fn policy_views(&self) -> Vec<PolicyView> {
        let mut out = Vec::new();
        for (ns_name, ns) in &self.namespaces {
            let remote = self.remote.get(ns_name);
            for (name, p) in &ns.policies {
                out.push(view_of(ns_name, name, p, &ns.pods, remote));
            }
        }
        out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        out
    }

    /// One policy's view.
    pub fn policy_view(&self, namespace: &str, name: &str) -> Option<PolicyView> {
        let ns = self.namespaces.get(namespace)?;
        let p = ns.policies.get(name)?;
        Some(view_of(
            namespace,
            name,
            p,
            &ns.pods,
            self.remote.get(namespace),
        ))
    }

    /// A summary for metrics.
    pub fn summary(&self) -> IndexSummary {
        let mut s = IndexSummary {
            version: self.version,
            stats: self.stats,
            peers: self.reports.len() as u64,
            ..IndexSummary::default()
        };
        for (ns_name, ns) in &self.namespaces {
            s.pods += ns.pods.len() as u64;
            for (name, p) in &ns.policies {
                s.policies += 1;
                if !p.errors.is_empty() {
                    s.invalid_policies += 1;
                }
                if p.compiled.is_some() {
                    // This replica's streams only, so `sum` over replicas is the fleet.
                    s.connected.insert(
                        format!("{ns_name}/{name}"),
                        sync_counts(&ns.pods, None, name, "", 0).total,
                    );
                }
            }
        }
        s
    }

    // --- internals ---

    /// Recomputes every pod of a namespace after a policy change, then publishes.
    fn reindex_namespace(&mut self, namespace: &str, v: u64) -> bool {
        let Some(ns) = self.namespaces.get_mut(namespace) else {
            return false;
        };
        let Namespace { policies, pods } = ns;
        let mut changed = false;
        for pod in pods.values_mut() {
            changed |= recompute_pod(policies, pod, v);
        }
        // Changes waiting for acks: only when some connected sidecar has to apply them.
        for (name, p) in policies.iter_mut() {
            if p.version == v {
                p.lag_pending = pods.values().any(|pod| {
                    pod.connections > 0 && pod.policies.iter().any(|(c, _)| &c.name == name)
                });
            }
        }
        self.publish_namespace(namespace);
        self.note_programmed(namespace);
        changed
    }

    /// Recounts members and pushes each pod's state; pods whose state is unchanged are not woken.
    fn publish_namespace(&self, namespace: &str) {
        let Some(ns) = self.namespaces.get(namespace) else {
            return;
        };
        let remote = self.remote.get(namespace);
        let counts = count_members(
            ns.pods
                .iter()
                .filter(|(name, p)| {
                    p.connections > 0 || remote.is_some_and(|r| r.contains_key(*name))
                })
                .map(|(_, p)| p.policies.iter().map(|(c, _)| c.name.as_str())),
        );
        for pod in ns.pods.values() {
            let members: BTreeMap<String, u32> = pod
                .policies
                .iter()
                .map(|(c, _)| (c.id(), counts.get(c.name.as_str()).copied().unwrap_or(0)))
                .collect();
            pod.tx.send_if_modified(|cur| {
                let same_rules = cur.version == pod.version
                    && cur.policies.len() == pod.policies.len()
                    && cur
                        .policies
                        .iter()
                        .zip(&pod.policies)
                        .all(|(a, (b, _))| Arc::ptr_eq(a, b));
                if same_rules && cur.members == members {
                    return false;
                }
                *cur = PodRules {
                    version: pod.version,
                    policies: pod.policies.iter().map(|(c, _)| c.clone()).collect(),
                    members: members.clone(),
                };
                true
            });
        }
    }

    fn gc_namespace(&mut self, namespace: &str) {
        if self
            .namespaces
            .get(namespace)
            .is_some_and(|ns| ns.policies.is_empty() && ns.pods.is_empty())
        {
            self.namespaces.remove(namespace);
        }
    }

    fn finish(&mut self, changed: bool, v: u64) {
        if changed {
            self.version = v;
            self.bump_changes();
        }
    }

    fn bump_changes(&self) {
        self.changes_tx.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// Selects the policies for one pod; returns whether its rule set changed (and if so gives the
/// pod version `v`).
fn recompute_pod(policies: &BTreeMap<String, Policy>, pod: &mut Pod, v: u64) -> bool {
    let next: Vec<(Arc<CompiledPolicy>, u64)> = policies
        .values()
        .filter_map(|p| p.compiled.as_ref())
        .filter(|c| c.selector.matches(&pod.labels))
        .map(|c| {
            let since = pod
                .policies
                .iter()
                .find(|(old, _)| Arc::ptr_eq(old, c))
                .map(|(_, since)| *since)
                .unwrap_or(v);
            (c.clone(), since)
        })
        .collect();
    let same = next.len() == pod.policies.len()
        && next
            .iter()
            .zip(&pod.policies)
            .all(|((a, _), (b, _))| Arc::ptr_eq(a, b));
    pod.policies = next;
    if !same {
        pod.version = v;
    }
    !same
}

/// One policy's view for the status writer.
fn view_of(
    namespace: &str,
    name: &str,
    p: &Policy,
    pods: &HashMap<String, Pod>,
    remote: Option<&RemotePods>,
) -> PolicyView {
    let sync = match &p.compiled {
        Some(c) => sync_counts(
            pods,
            remote,
            name,
            &remote_key(c, p.uid.as_deref()),
            c.generation,
        ),
        None => SyncCounts::default(),
    };
    PolicyView {
        namespace: namespace.to_string(),
        name: name.to_string(),
        uid: p.uid.clone(),
        generation: p.generation,
        errors: p.errors.clone(),
        compiled: p.compiled.clone(),
        version: p.version,
        sidecars_total: sync.total,
        sidecars_in_sync: sync.in_sync,
        observed_status: p.status.clone(),
        compiled_age: p.changed_at.elapsed(),
        programmed: p.programmed_at.map(|at| Programmed {
            after: at.saturating_duration_since(p.changed_at),
            ago: at.elapsed(),
        }),
        lagging: sync.lagging,
        sidecars_without_redis: sync.without_redis,
    }
}

/// How a policy is named in a [`MembershipReport`]: `name/uid` (`name` alone without a UID).
fn remote_key(compiled: &CompiledPolicy, uid: Option<&str>) -> String {
    match uid {
        Some(uid) => format!("{}/{uid}", compiled.name),
        None => compiled.name.clone(),
    }
}

/// Connected sidecars holding a policy, and which of them run it as it is now.
#[derive(Debug, Default)]
struct SyncCounts {
    total: u32,
    in_sync: u32,
    /// Up to [`LAGGING_NAMED`] of those not in sync, by pod name, sorted.
    lagging: Vec<String>,
    /// Those whose sidecar has no Redis store.
    without_redis: u32,
}

/// Counts the connected sidecars holding `policy` and those that run it as it is now.
///
/// A pod counts when it has a stream to this replica or, with `remote`, to another one; it is
/// in sync when it acknowledged, here, a version containing the policy unchanged, or when
/// another replica reports it runs `generation` (or a later one) of the same policy object
/// (`remote_key`, which carries its UID).
fn sync_counts(
    pods: &HashMap<String, Pod>,
    remote: Option<&RemotePods>,
    policy: &str,
    remote_key: &str,
    generation: i64,
) -> SyncCounts {
    let mut sync = SyncCounts::default();
    for (pod_name, pod) in pods {
        let elsewhere = remote.and_then(|r| r.get(pod_name));
        if pod.connections == 0 && elsewhere.is_none() {
            continue;
        }
        if let Some((_, since)) = pod.policies.iter().find(|(c, _)| c.name == policy) {
            sync.total += 1;
            let here = pod.connections > 0 && pod.acked.is_some_and(|a| a >= *since);
            let there = elsewhere
                .and_then(|r| r.policies.get(remote_key))
                .is_some_and(|g| *g >= generation);
            let redis_here = pod.connections > 0 && !pod.without_redis;
            if !redis_here && elsewhere.is_none_or(|r| r.without_redis) {
                sync.without_redis += 1;
            }
            if here || there {
                sync.in_sync += 1;
            } else {
                name_first(&mut sync.lagging, pod_name);
            }
        }
    }
    sync
}

/// Keeps the [`LAGGING_NAMED`] alphabetically first names in `names` (sorted), so a status
/// lists the same pods from one pass to the next.
fn name_first(names: &mut Vec<String>, name: &str) {
    if names.len() >= LAGGING_NAMED && names.last().is_some_and(|last| last.as_str() <= name) {
        return;
    }
    let at = names.partition_point(|n| n.as_str() < name);
    names.insert(at, name.to_string());
    names.truncate(LAGGING_NAMED);
}

/// Counts, per policy name, the pods (given as their policies' names) that hold it.
pub fn count_members<'a, P, I>(pods: P) -> HashMap<&'a str, u32>
where
    P: IntoIterator<Item = I>,
    I: IntoIterator<Item = &'a str>,
{
    let mut counts: HashMap<&str, u32> = HashMap::new();
    for policies in pods {
        for name in policies {
            *counts.entry(name).or_default() += 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests;
