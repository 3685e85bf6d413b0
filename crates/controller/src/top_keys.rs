//! Fleet-wide top limited keys: the sidecars' reports merged per policy object (by UID, so a
//! policy re-created under its name starts empty), for `status.topLimitedKeys`.
//!
//! Every sidecar counts its rejections in a Space-Saving sketch (64 counters) and sends what it
//! counted since its last report (`POST /v1/top-keys`, [`TopKeysReport`]). This replica adds the
//! reports into time slots (a tenth of the window each), one bounded Space-Saving table per
//! policy per slot, so memory stays fixed however many keys an attacker rotates through. Every
//! refresh it sums the slots of the window, joins the other replicas' summaries (exchanged on
//! their membership Leases, `crate::peers`) and publishes each policy's top [`TOP_N`]; the
//! status writer copies them into the policy's status.
//!
//! Error: a count is never below the key's true rejections in the window, except for what a
//! sidecar or a replica cut from its top list. Any over-count is at most `maxOvercount`, the sum of
//! the over-counts of the sketches and tables it went through. A key rejected more often than
//! 1/64 of its sidecar's rejections in a report interval is always in that sidecar's report.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;
use tollgate_crd::policy::{LimitedKey, TopLimitedKeys};
use tollgate_crd::stream::{MAX_REPORTED_KEYS, TopKeysReport};

/// The span counted by default (`--top-keys-window`).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(600);
/// Keys a policy's status lists.
pub const TOP_N: usize = 10;
/// Keys per policy a replica shares with its peers.
pub const SHARED_N: usize = 32;
/// Slots a window is cut into.
const SLOTS: u32 = 10;
/// Keys per policy per slot; a new key past this takes the smallest counter (Space-Saving).
const SLOT_CAPACITY: usize = 256;
/// Pod names remembered per key.
const PODS_NAMED: usize = 5;
/// Distinct pods counted per key and slot; `podCount` stops there.
const PODS_COUNTED: usize = 128;

/// What one replica shares: policy id (`namespace/name`) → its top keys.
pub type Summary = BTreeMap<String, Vec<LimitedKey>>;

#[derive(Default)]
struct Counted {
    rejected: u64,
    max_overcount: u64,
    pods: BTreeSet<String>,
    /// Distinct pods, as hashes of their names, up to [`PODS_COUNTED`].
    pod_ids: HashSet<u64>,
}

impl Counted {
    fn add_pod(&mut self, pod: &str) {
        if self.pods.len() < PODS_NAMED {
            self.pods.insert(pod.to_string());
        }
        self.add_pod_id(pod_id(pod));
    }

    fn add_pod_id(&mut self, id: u64) {
        if self.pod_ids.len() < PODS_COUNTED {
            self.pod_ids.insert(id);
        }
    }
}

fn pod_id(pod: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    pod.hash(&mut h);
    h.finish()
}

/// `(rule name, key hash)` → counts.
type Table = HashMap<(String, String), Counted>;

struct Slot {
    number: u64,
    policies: HashMap<String, Table>,
}

/// Why a reported key was not counted.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    TooManyKeys(usize),
    /// A rule outside the reporting pod's namespace, or not `namespace/policy/rule`.
    ForeignRule(String),
    BadKeyHash(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::TooManyKeys(n) => {
                write!(f, "{n} keys; a report carries at most {MAX_REPORTED_KEYS}")
            }
            Refused::ForeignRule(r) => write!(
                f,
                "rule {r:?} is not namespace/policy/rule in the pod's namespace"
            ),
            Refused::BadKeyHash(h) => write!(f, "keyHash {h:?} is not 16 hex digits"),
        }
    }
}

/// The merged reports of this replica's sidecars, and its peers' summaries.
pub struct FleetTopKeys {
    window: Duration,
    slot_len: Duration,
    epoch: Instant,
    slots: Mutex<VecDeque<Slot>>,
    peers: Mutex<HashMap<String, Summary>>,
    /// This replica's own summary as of the last refresh, for its membership Lease.
    local: watch::Sender<Arc<Summary>>,
    /// What the status writer publishes: policy id → top keys.
    published: watch::Sender<Arc<BTreeMap<String, TopLimitedKeys>>>,
}

impl std::fmt::Debug for FleetTopKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetTopKeys")
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

impl FleetTopKeys {
    pub fn new(window: Duration) -> Arc<FleetTopKeys> {
        let window = window.max(Duration::from_secs(SLOTS.into()));
        Arc::new(FleetTopKeys {
            window,
            slot_len: window / SLOTS,
            epoch: Instant::now(),
            slots: Mutex::new(VecDeque::new()),
            peers: Mutex::new(HashMap::new()),
            local: watch::channel(Arc::default()).0,
            published: watch::channel(Arc::default()).0,
        })
    }

    pub fn published(&self) -> watch::Receiver<Arc<BTreeMap<String, TopLimitedKeys>>> {
        self.published.subscribe()
    }

    pub fn local(&self) -> watch::Receiver<Arc<Summary>> {
        self.local.subscribe()
    }

    /// The published top keys of one policy object (`uid`): a policy deleted and created again
    /// under its name starts with none of the deleted one's keys.
    pub fn of(&self, namespace: &str, name: &str, uid: Option<&str>) -> Option<TopLimitedKeys> {
        self.published
            .borrow()
            .get(&policy_key(namespace, name, uid))
            .cloned()
    }

    /// Adds one sidecar's report, whole or not at all, counting each key for the policy object
    /// `uid_of(namespace, policy)` names now (the report itself carries policy names only).
    pub fn record(
        &self,
        report: &TopKeysReport,
        uid_of: &dyn Fn(&str, &str) -> Option<String>,
        now: Instant,
    ) -> Result<(), Refused> {
        if report.keys.len() > MAX_REPORTED_KEYS {
            return Err(Refused::TooManyKeys(report.keys.len()));
        }
        let mut parsed = Vec::with_capacity(report.keys.len());
        for key in &report.keys {
            let mut parts = key.rule.splitn(3, '/');
            let (Some(ns), Some(policy), Some(rule)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(Refused::ForeignRule(key.rule.clone()));
            };
            if ns != report.namespace || policy.is_empty() || rule.is_empty() {
                return Err(Refused::ForeignRule(key.rule.clone()));
            }
            if key.key_hash.len() != 16 || !key.key_hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(Refused::BadKeyHash(key.key_hash.clone()));
            }
            parsed.push((
                policy_key(ns, policy, uid_of(ns, policy).as_deref()),
                rule,
                key,
            ));
        }
        let number = self.slot_number(now);
        let mut slots = self.slots.lock();
        if slots.back().is_none_or(|s| s.number != number) {
            slots.push_back(Slot {
                number,
                policies: HashMap::new(),
            });
        }
        while slots
            .front()
            .is_some_and(|s| s.number + u64::from(SLOTS) <= number)
        {
            slots.pop_front();
        }
        let Some(slot) = slots.back_mut() else {
            return Ok(());
        };
        for (policy, rule, key) in parsed {
            let table = slot.policies.entry(policy).or_default();
            let entry = counter(table, rule, &key.key_hash);
            entry.rejected = entry.rejected.saturating_add(key.rejected);
            entry.max_overcount = entry.max_overcount.saturating_add(key.max_overcount);
            entry.add_pod(&report.pod);
        }
        Ok(())
    }

    fn slot_number(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.epoch).as_millis();
        (elapsed / self.slot_len.as_millis().max(1)) as u64
    }

    /// A peer replica's summary (from its Lease), replacing its previous one.
    pub fn set_peer(&self, replica: &str, summary: Summary) {
        self.peers.lock().insert(replica.to_string(), summary);
    }

    pub fn forget_peer(&self, replica: &str) {
        self.peers.lock().remove(replica);
    }

    /// This replica's window, per policy, most rejected first, `n` keys each.
    fn local_summary(&self, now: Instant, n: usize) -> Summary {
        let oldest = self.slot_number(now).saturating_sub(u64::from(SLOTS) - 1);
        let mut sums: HashMap<String, Table> = HashMap::new();
        for slot in self.slots.lock().iter().filter(|s| s.number >= oldest) {
            for (policy, table) in &slot.policies {
                let into = sums.entry(policy.clone()).or_default();
                for ((rule, hash), c) in table {
                    let e = into.entry((rule.clone(), hash.clone())).or_default();
                    e.rejected += c.rejected;
                    e.max_overcount += c.max_overcount;
                    for pod in &c.pods {
                        if e.pods.len() < PODS_NAMED {
                            e.pods.insert(pod.clone());
                        }
                    }
                    for id in &c.pod_ids {
                        e.add_pod_id(*id);
                    }
                }
            }
        }
        sums.into_iter()
            .map(|(policy, table)| {
                let keys = table
                    .into_iter()
                    .map(|((rule, key_hash), c)| LimitedKey {
                        rule,
                        key_hash,
                        rejected: c.rejected,
                        max_overcount: c.max_overcount,
                        pod_count: u32::try_from(c.pod_ids.len()).unwrap_or(u32::MAX),
                        pods: c.pods.into_iter().collect(),
                    })
                    .collect();
                (policy, top(keys, n))
            })
            .collect()
    }

    /// Recomputes this replica's summary and the fleet's top keys; `updated` stamps a policy
    /// whose list changed (an unchanged list keeps its stamp, so it causes no status write).
    pub fn refresh(&self, now: Instant, updated: &str) {
        let local = self.local_summary(now, SHARED_N);
        let mut merged: BTreeMap<String, HashMap<(String, String), LimitedKey>> = BTreeMap::new();
        {
            let peers = self.peers.lock();
            for summary in std::iter::once(&local).chain(peers.values()) {
                for (policy, keys) in summary {
                    let into = merged.entry(policy.clone()).or_default();
                    for k in keys {
                        merge_key(into, k);
                    }
                }
            }
        }
        self.local.send_if_modified(|cur| {
            let changed = **cur != local;
            if changed {
                *cur = Arc::new(local);
            }
            changed
        });
        let window = tollgate_crd::duration::format(self.window);
        self.published.send_if_modified(|cur| {
            let mut next = BTreeMap::new();
            for (policy, keys) in merged {
                let keys = top(keys.into_values().collect(), TOP_N);
                if keys.is_empty() {
                    continue;
                }
                let entry = match cur.get(&policy) {
                    Some(old) if old.keys == keys && old.window == window => old.clone(),
                    _ => TopLimitedKeys {
                        window: window.clone(),
                        updated: updated.to_string(),
                        keys,
                    },
                };
                next.insert(policy, entry);
            }
            let changed = **cur != next;
            if changed {
                *cur = Arc::new(next);
            }
            changed
        });
    }

    /// Refreshes every `interval` until `shutdown`.
    pub async fn run(self: Arc<Self>, interval: Duration, mut shutdown: watch::Receiver<bool>) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { return },
            }
            let stamp = k8s_openapi::jiff::Timestamp::now()
                .round(k8s_openapi::jiff::Unit::Second)
                .unwrap_or_else(|_| k8s_openapi::jiff::Timestamp::now());
            self.refresh(Instant::now(), &stamp.to_string());
        }
    }
}

/// How counts of one policy object are filed: `namespace/name/uid` (or `namespace/name` for
/// an object without a UID). Shared with the peers in this form, so every replica keeps a
/// re-created policy's keys apart from those of the one it replaced.
fn policy_key(namespace: &str, name: &str, uid: Option<&str>) -> String {
    match uid {
        Some(uid) => format!("{namespace}/{name}/{uid}"),
        None => format!("{namespace}/{name}"),
    }
}

/// The counter of `(rule, hash)` in a slot's table; a new key in a full table takes over the
/// smallest counter and inherits its count as possible over-count.
fn counter<'t>(table: &'t mut Table, rule: &str, hash: &str) -> &'t mut Counted {
    let id = (rule.to_string(), hash.to_string());
    if !table.contains_key(&id) && table.len() >= SLOT_CAPACITY {
        let smallest = table
            .iter()
            .min_by_key(|(_, c)| c.rejected)
            .map(|(k, c)| (k.clone(), c.rejected));
        if let Some((k, floor)) = smallest {
            table.remove(&k);
            let c = table.entry(id.clone()).or_default();
            c.rejected = floor;
            c.max_overcount = floor;
        }
    }
    table.entry(id).or_default()
}

fn merge_key(into: &mut HashMap<(String, String), LimitedKey>, k: &LimitedKey) {
    let e = into
        .entry((k.rule.clone(), k.key_hash.clone()))
        .or_insert_with(|| LimitedKey {
            rule: k.rule.clone(),
            key_hash: k.key_hash.clone(),
            rejected: 0,
            max_overcount: 0,
            pods: Vec::new(),
            pod_count: 0,
        });
    e.rejected = e.rejected.saturating_add(k.rejected);
    e.max_overcount = e.max_overcount.saturating_add(k.max_overcount);
    e.pod_count = e.pod_count.saturating_add(k.pod_count);
    for pod in &k.pods {
        if e.pods.len() < PODS_NAMED && !e.pods.contains(pod) {
            e.pods.push(pod.clone());
        }
    }
    e.pods.sort();
}

/// The `n` most rejected, ties broken by rule and hash so the list is stable.
fn top(mut keys: Vec<LimitedKey>, n: usize) -> Vec<LimitedKey> {
    keys.sort_by(|a, b| {
        b.rejected
            .cmp(&a.rejected)
            .then_with(|| a.rule.cmp(&b.rule))
            .then_with(|| a.key_hash.cmp(&b.key_hash))
    });
    keys.truncate(n);
    keys
}

#[cfg(test)]
mod tests;
