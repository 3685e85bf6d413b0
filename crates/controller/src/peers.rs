//! Membership across controller replicas.
//!
//! Every replica serves rule streams, so each one sees only the sidecars that happen to connect
//! to it. To push fleet-wide member counts (global limits are divided by them) and to let the
//! leader write a status that counts every sidecar, replicas exchange [`MembershipReport`]s
//! through the API server: each replica keeps one `coordination.k8s.io/v1` Lease of its own,
//! labelled `tollgate.dev/membership-of=<lease name>`, whose annotation holds its report. It
//! rewrites the Lease when its report changes (coalesced over [`DEBOUNCE`]) and renews it every
//! third of the lease duration. Each replica watches the others' Leases and merges their reports
//! into its [`Index`](crate::index::Index).
//!
//! A replica that stops cleanly deletes its Lease, so peers drop its sidecars at once. One that
//! dies is forgotten when its Lease has not been renewed for the lease duration; its sidecars
//! will have reconnected to a live replica by then (streams break with the process), so counts
//! are at worst briefly high, never low.
//!
//! Why the API server and not replica-to-replica calls: it needs no peer discovery, no extra
//! port or certificates, works with any number of replicas, and every replica already talks to
//! it. The cost is one small write per replica per membership change or renewal.

use std::collections::HashMap;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::index::{MembershipReport, SharedIndex};
use crate::top_keys::{FleetTopKeys, Summary};

/// The label that marks membership Leases; its value is the leader-election Lease name, so two
/// installations in one namespace do not mix.
pub const LABEL: &str = "tollgate.dev/membership-of";
/// The annotation holding the report: its JSON, gzipped, in standard base64 (see
/// [`encode_report`]). Gzip matters: pod names share long prefixes, so a report shrinks about
/// tenfold and one replica can report tens of thousands of sidecars within the size limit.
pub const ANNOTATION: &str = "tollgate.dev/members";
/// Largest report a peer's annotation may inflate to; anything bigger is refused.
const MAX_INFLATED_BYTES: u64 = 64 * 1024 * 1024;
/// The annotation holding this replica's top limited keys (`crate::top_keys::Summary`),
/// encoded like the members annotation; absent while it has none.
pub const TOP_KEYS_ANNOTATION: &str = "tollgate.dev/top-keys";
/// How long membership changes are coalesced before the Lease is rewritten.
pub const DEBOUNCE: Duration = Duration::from_millis(50);
/// Annotations are limited to 256 KiB in total; past this a report is not published (logged).
/// Gzipped, that is about 20,000 sidecars per replica (`a_report_of_20k_pods_fits_the_annotation`).
const MAX_REPORT_BYTES: usize = 240 * 1024;
/// Clock skew tolerated between replicas when judging a listed Lease stale.
const SKEW: Duration = Duration::from_secs(5);

/// Settings of the exchange.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// Namespace of the Leases (the leader-election namespace).
    pub namespace: String,
    /// The leader-election Lease name; prefixes this replica's Lease name and labels it.
    pub group: String,
    /// This replica's identity (unique per replica).
    pub identity: String,
    /// A report not renewed for this long is dropped.
    pub duration: Duration,
    /// The Pod this replica runs in, `(name, uid)`: owner of its Lease, so the Lease goes when
    /// the Pod does.
    pub owner_pod: Option<(String, String)>,
}

impl PeerConfig {
    /// This replica's Lease name: the group plus a hash of the identity, which keeps it a valid,
    /// bounded object name whatever the pod name is.
    pub fn lease_name(&self) -> String {
        let digest = Sha256::digest(self.identity.as_bytes());
        let hex: String = digest[..5].iter().map(|b| format!("{b:02x}")).collect();
        format!("{}-members-{hex}", self.group)
    }

    fn renew_every(&self) -> Duration {
        (self.duration / 3).max(Duration::from_millis(500))
    }
}

/// The Lease that carries `report` (server-side applied).
/// A report as the annotation's value: gzipped JSON in base64.
pub fn encode_report(report: &MembershipReport) -> std::io::Result<String> {
    encode(report)
}

/// Any annotation value: gzipped JSON in base64.
fn encode<T: serde::Serialize>(value: &T) -> std::io::Result<String> {
    use base64::Engine as _;
    use std::io::Write as _;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    serde_json::to_writer(&mut gz, value)?;
    gz.flush()?;
    Ok(base64::engine::general_purpose::STANDARD.encode(gz.finish()?))
}

/// Reads an annotation value written by [`encode_report`]; plain JSON (a value starting with
/// `{`, as written by hand or by an older replica) is accepted too.
pub fn decode_report(value: &str) -> Result<MembershipReport, String> {
    decode_report_within(value, MAX_INFLATED_BYTES)
}

fn decode_report_within(value: &str, max_inflated: u64) -> Result<MembershipReport, String> {
    decode(value, max_inflated, "members")
}

/// Reads a value written by [`encode`] (or plain JSON) whose name in errors is `what`.
fn decode<T: serde::de::DeserializeOwned>(
    value: &str,
    max_inflated: u64,
    what: &str,
) -> Result<T, String> {
    use base64::Engine as _;
    use std::io::Read as _;
    if value.trim_start().starts_with('{') {
        return serde_json::from_str(value).map_err(|e| format!("bad {what} annotation: {e}"));
    }
    let gz = base64::engine::general_purpose::STANDARD
        .decode(value.trim())
        .map_err(|e| format!("bad {what} annotation: not base64: {e}"))?;
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .take(max_inflated + 1)
        .read_to_end(&mut json)
        .map_err(|e| format!("bad {what} annotation: not gzip: {e}"))?;
    if json.len() as u64 > max_inflated {
        return Err(format!(
            "bad {what} annotation: inflates past {max_inflated} bytes"
        ));
    }
    serde_json::from_slice(&json).map_err(|e| format!("bad {what} annotation: {e}"))
}

pub fn lease_object(
    config: &PeerConfig,
    report: &MembershipReport,
    top_keys: &Summary,
) -> std::io::Result<Lease> {
    let mut annotations =
        std::collections::BTreeMap::from([(ANNOTATION.to_string(), encode_report(report)?)]);
    if !top_keys.is_empty() {
        annotations.insert(TOP_KEYS_ANNOTATION.to_string(), encode(top_keys)?);
    }
    Ok(Lease {
        metadata: ObjectMeta {
            name: Some(config.lease_name()),
            namespace: Some(config.namespace.clone()),
            labels: Some([(LABEL.to_string(), config.group.clone())].into()),
            annotations: Some(annotations),
            owner_references: config.owner_pod.as_ref().map(|(name, uid)| {
                vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Pod".into(),
                    name: name.clone(),
                    uid: uid.clone(),
                    ..OwnerReference::default()
                }]
            }),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(config.identity.clone()),
            lease_duration_seconds: Some(config.duration.as_secs().clamp(1, 3600) as i32),
            renew_time: Some(MicroTime(jiff_now())),
            ..LeaseSpec::default()
        }),
    })
}

fn jiff_now() -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::now()
}

/// What a peer's Lease says: `(holder, report)`, or why it is ignored.
pub fn read_lease(
    lease: &Lease,
    own_identity: &str,
    now: k8s_openapi::jiff::Timestamp,
) -> Result<Option<(String, MembershipReport)>, String> {
    let spec = lease.spec.as_ref().ok_or("no spec")?;
    let holder = spec.holder_identity.clone().ok_or("no holderIdentity")?;
    if holder == own_identity {
        return Ok(None);
    }
    let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(1) as u64);
    if let Some(MicroTime(renewed)) = &spec.renew_time {
        let age = now.duration_since(*renewed);
        if age > k8s_openapi::jiff::SignedDuration::try_from(duration + SKEW).unwrap_or_default() {
            return Ok(None);
        }
    }
    let json = lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION))
        .ok_or("no members annotation")?;
    Ok(Some((holder, decode_report(json)?)))
}

/// A peer's top limited keys; none when it has no annotation.
pub fn read_top_keys(lease: &Lease) -> Result<Summary, String> {
    match lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(TOP_KEYS_ANNOTATION))
    {
        Some(value) => decode(value, MAX_REPORT_BYTES as u64 * 64, "top-keys"),
        None => Ok(Summary::new()),
    }
}

/// Publishes this replica's report until `shutdown`, then deletes its Lease.
pub async fn publish(
    client: kube::Client,
    config: PeerConfig,
    index: SharedIndex,
    top_keys: Arc<FleetTopKeys>,
    mut shutdown: watch::Receiver<bool>,
) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let name = config.lease_name();
    let params = PatchParams::apply("tollgate-controller-membership").force();
    let mut changes = index.read().changes_rx();
    let mut top_changes = top_keys.local();
    let mut written: Option<(MembershipReport, Arc<Summary>)> = None;
    let mut renew_at = Instant::now();
    loop {
        if *shutdown.borrow() {
            break;
        }
        tokio::select! {
            _ = changes.changed() => {
                tokio::time::sleep(DEBOUNCE).await;
            }
            _ = top_changes.changed() => {}
            () = tokio::time::sleep_until(renew_at) => {}
            res = shutdown.changed() => {
                if res.is_err() || *shutdown.borrow() {
                    break;
                }
                continue;
            }
        }
        let report = index.read().membership_report();
        let top = top_changes.borrow_and_update().clone();
        if written
            .as_ref()
            .is_some_and(|(r, t)| *r == report && *t == top)
            && Instant::now() < renew_at
        {
            continue;
        }
        let lease = match publishable_lease(&config, &report, &top) {
            Ok(lease) => lease,
            Err(Unpublishable::Encoding) => continue,
            Err(Unpublishable::TooLarge) => {
                renew_at = Instant::now() + config.renew_every();
                continue;
            }
        };
        match api.patch(&name, &params, &Patch::Apply(&lease)).await {
            Ok(_) => {
                tracing::debug!(lease = %name, pods = report.pods(), "membership report published");
                written = Some((report, top));
                renew_at = Instant::now() + config.renew_every();
            }
            Err(error) => {
                tracing::warn!(%error, lease = %name, namespace = %config.namespace, "cannot publish the membership report; retrying (may this service account patch leases?)");
                written = None;
                renew_at = Instant::now() + Duration::from_secs(1);
            }
        }
    }
    delete_lease(&api, &name).await;
}

/// Why a report is not published this round.
enum Unpublishable {
    /// It could not be encoded (logged); the next change tries again.
    Encoding,
    /// Too large for a Lease annotation even without top keys (logged); peers keep the last
    /// one until the next renewal tries again.
    TooLarge,
}

/// The Lease that carries `report` and `top`, within [`MAX_REPORT_BYTES`]: membership counts
/// divide limits and top keys are only shown, so top keys are dropped first.
fn publishable_lease(
    config: &PeerConfig,
    report: &MembershipReport,
    top: &Summary,
) -> Result<Lease, Unpublishable> {
    let mut lease = match lease_object(config, report, top) {
        Ok(l) => l,
        Err(error) => {
            tracing::error!(%error, "cannot encode the membership report");
            return Err(Unpublishable::Encoding);
        }
    };
    let size = annotations_size(&lease);
    if size > MAX_REPORT_BYTES
        && let Some(a) = lease.metadata.annotations.as_mut()
        && a.remove(TOP_KEYS_ANNOTATION).is_some()
    {
        tracing::warn!(
            bytes = size,
            "top limited keys too large for the membership Lease; peers will not see this replica's"
        );
    }
    let size = annotations_size(&lease);
    if size > MAX_REPORT_BYTES {
        tracing::error!(
            bytes = size,
            pods = report.pods(),
            "membership report too large for a Lease annotation; other replicas keep the last one"
        );
        return Err(Unpublishable::TooLarge);
    }
    Ok(lease)
}

/// Deletes this replica's Lease at shutdown, so peers stop counting it at once rather than
/// when it expires; bounded, since shutdown must not wait on the API server.
async fn delete_lease(api: &Api<Lease>, name: &str) {
    let deleted = tokio::time::timeout(
        Duration::from_secs(2),
        api.delete(name, &DeleteParams::default()),
    )
    .await;
    match deleted {
        Ok(Ok(_)) => tracing::debug!(lease = %name, "membership lease deleted"),
        Ok(Err(error)) => {
            tracing::debug!(%error, lease = %name, "cannot delete the membership lease")
        }
        Err(_) => tracing::debug!(lease = %name, "deleting the membership lease timed out"),
    }
}

fn annotations_size(lease: &Lease) -> usize {
    lease
        .metadata
        .annotations
        .as_ref()
        .map_or(0, |a| a.values().map(String::len).sum())
}

/// Merges the other replicas' reports into the index until the process ends.
pub async fn follow(
    client: kube::Client,
    config: PeerConfig,
    index: SharedIndex,
    top_keys: Arc<FleetTopKeys>,
) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let selector = format!("{LABEL}={}", config.group);
    let mut stream =
        pin!(watcher::watcher(api, watcher::Config::default().labels(&selector)).default_backoff());
    // Lease name → (holder, when we last saw it renewed, how long it may go unrenewed).
    let mut seen: HashMap<String, (String, Instant, Duration)> = HashMap::new();
    let mut listing: Vec<String> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            event = stream.next() => {
                let Some(event) = event else { return };
                match event {
                    Ok(Event::Apply(lease) | Event::InitApply(lease)) => {
                        let name = lease.metadata.name.clone().unwrap_or_default();
                        listing.push(name.clone());
                        accept(&config, &index, &top_keys, &mut seen, name, &lease);
                    }
                    Ok(Event::Delete(lease)) => {
                        let name = lease.metadata.name.clone().unwrap_or_default();
                        if let Some((holder, _, _)) = seen.remove(&name) {
                            forget(&index, &top_keys, &seen, &holder, "left");
                        }
                    }
                    Ok(Event::Init) => listing.clear(),
                    Ok(Event::InitDone) => {
                        let gone: Vec<String> = seen
                            .keys()
                            .filter(|n| !listing.contains(n))
                            .cloned()
                            .collect();
                        for name in gone {
                            if let Some((holder, _, _)) = seen.remove(&name) {
                                forget(&index, &top_keys, &seen, &holder, "left");
                            }
                        }
                        listing.clear();
                    }
                    Err(error) => {
                        tracing::warn!(%error, "membership lease watch failed; retrying (may this service account list and watch leases?)");
                    }
                }
            }
            _ = tick.tick() => {
                let expired: Vec<String> = seen
                    .iter()
                    .filter(|(_, (_, at, ttl))| at.elapsed() > *ttl)
                    .map(|(n, _)| n.clone())
                    .collect();
                for name in expired {
                    if let Some((holder, _, _)) = seen.remove(&name) {
                        forget(&index, &top_keys, &seen, &holder, "expired");
                    }
                }
            }
        }
    }
}

fn accept(
    config: &PeerConfig,
    index: &SharedIndex,
    top_keys: &FleetTopKeys,
    seen: &mut HashMap<String, (String, Instant, Duration)>,
    name: String,
    lease: &Lease,
) {
    match read_lease(lease, &config.identity, jiff_now()) {
        Ok(Some((holder, report))) => {
            match read_top_keys(lease) {
                Ok(summary) => top_keys.set_peer(&holder, summary),
                Err(why) => tracing::warn!(lease = %name, %why, "ignoring a peer's top keys"),
            }
            let ttl = Duration::from_secs(
                lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.lease_duration_seconds)
                    .unwrap_or(15)
                    .max(1) as u64,
            );
            let pods = report.pods();
            if index.write().set_report(&holder, report) {
                tracing::debug!(replica = %holder, pods, "membership report of a peer merged");
            }
            if !seen.contains_key(&name) {
                tracing::info!(replica = %holder, pods, "peer replica joined the membership");
            }
            seen.insert(name, (holder, Instant::now(), ttl));
        }
        Ok(None) => {}
        Err(why) => tracing::warn!(lease = %name, %why, "ignoring a membership lease"),
    }
}

/// Drops a replica's report unless another of its Leases is still live.
fn forget(
    index: &SharedIndex,
    top_keys: &FleetTopKeys,
    seen: &HashMap<String, (String, Instant, Duration)>,
    holder: &str,
    why: &str,
) {
    if seen.values().any(|(h, _, _)| h == holder) {
        return;
    }
    top_keys.forget_peer(holder);
    if index.write().remove_report(holder) {
        tracing::info!(replica = %holder, why, "peer replica left the membership");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::{SignedDuration, Timestamp};

    fn config(identity: &str) -> PeerConfig {
        PeerConfig {
            namespace: "tollgate-system".into(),
            group: "tollgate-controller".into(),
            identity: identity.into(),
            duration: Duration::from_secs(15),
            owner_pod: None,
        }
    }

    fn report() -> MembershipReport {
        let mut r = MembershipReport::default();
        r.namespaces
            .entry("shop".into())
            .or_default()
            .insert("api-0".into(), [("limits".to_string(), 3)].into());
        r
    }

    #[test]
    fn lease_names_are_short_stable_and_distinct() {
        let long = "x".repeat(253);
        let a = config(&long).lease_name();
        assert!(a.len() < 63, "{a}");
        assert_eq!(a, config(&long).lease_name());
        assert_ne!(
            config("controller-0").lease_name(),
            config("controller-1").lease_name()
        );
    }

    #[test]
    fn the_lease_is_owned_by_the_replica_pod_when_known() {
        assert_eq!(
            lease_object(&config("b"), &report(), &Summary::new())
                .unwrap()
                .metadata
                .owner_references,
            None
        );
        let owned = PeerConfig {
            owner_pod: Some(("controller-b".into(), "uid-b".into())),
            ..config("b")
        };
        let refs = lease_object(&owned, &report(), &Summary::new())
            .unwrap()
            .metadata
            .owner_references;
        let owner = &refs.as_deref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("Pod", "controller-b", "uid-b")
        );
    }

    #[test]
    fn a_peer_lease_round_trips_and_our_own_is_skipped() {
        let lease = lease_object(&config("b"), &report(), &Summary::new()).unwrap();
        let now = Timestamp::now();
        let (holder, got) = read_lease(&lease, "a", now).unwrap().unwrap();
        assert_eq!(holder, "b");
        assert_eq!(got, report());
        assert_eq!(read_lease(&lease, "b", now).unwrap(), None);
    }

    #[test]
    fn top_keys_ride_on_the_lease_only_when_there_are_some() {
        let none = lease_object(&config("b"), &report(), &Summary::new()).unwrap();
        assert!(
            !none
                .metadata
                .annotations
                .as_ref()
                .unwrap()
                .contains_key(TOP_KEYS_ANNOTATION)
        );
        assert_eq!(read_top_keys(&none).unwrap(), Summary::new());
        let summary = Summary::from([(
            "shop/limits".to_string(),
            vec![tollgate_crd::policy::LimitedKey {
                rule: "per-key".into(),
                key_hash: "00000000000000aa".into(),
                rejected: 9,
                max_overcount: 0,
                pods: vec!["api-0".into()],
                pod_count: 1,
            }],
        )]);
        let some = lease_object(&config("b"), &report(), &summary).unwrap();
        assert_eq!(read_top_keys(&some).unwrap(), summary);
        let mut bad = some.clone();
        bad.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(TOP_KEYS_ANNOTATION.into(), "{not json".into());
        let err = read_top_keys(&bad).unwrap_err();
        assert!(err.contains("bad top-keys annotation"), "{err}");
    }

    #[test]
    fn stale_and_malformed_leases_are_ignored() {
        let lease = lease_object(&config("b"), &report(), &Summary::new()).unwrap();
        let later = Timestamp::now() + SignedDuration::from_secs(60);
        assert_eq!(read_lease(&lease, "a", later).unwrap(), None);

        let mut bad = lease.clone();
        bad.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(ANNOTATION.into(), "{not json".into());
        let err = read_lease(&bad, "a", Timestamp::now()).unwrap_err();
        assert!(err.contains("bad members annotation"), "{err}");
    }

    /// Deployment-style pod names (`<deployment>-<10 chars>-<5 chars>`, Kubernetes' own
    /// alphabet) from a fixed xorshift sequence, so the test is repeatable.
    fn fleet(pods: usize) -> MembershipReport {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut random = |n: usize| -> String {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    ALPHABET[(state % ALPHABET.len() as u64) as usize] as char
                })
                .collect()
        };
        let mut r = MembershipReport::default();
        let deployments: Vec<(String, String, String)> = (0..50)
            .map(|d| {
                let ns = format!("team-{:02}", d % 10);
                (ns, format!("service-{d:02}-api"), random(10))
            })
            .collect();
        for i in 0..pods {
            let (ns, deploy, hash) = &deployments[i % deployments.len()];
            r.namespaces.entry(ns.clone()).or_default().insert(
                format!("{deploy}-{hash}-{}", random(5)),
                [
                    ("default-limits".to_string(), 4),
                    (format!("{deploy}-limits"), 17),
                ]
                .into(),
            );
        }
        r
    }

    /// The annotation is capped at [`MAX_REPORT_BYTES`]; gzip lets one replica report about
    /// 20,000 sidecars (plain JSON stopped near 2,000).
    #[test]
    fn a_report_of_20k_pods_fits_the_annotation() {
        let report = fleet(20_000);
        assert_eq!(report.pods(), 20_000);
        let json = serde_json::to_string(&report).unwrap().len();
        let encoded = encode_report(&report).unwrap();
        eprintln!(
            "20,000 pods: JSON {json} bytes, annotation {} bytes ({:.1} bytes per pod)",
            encoded.len(),
            encoded.len() as f64 / 20_000.0
        );
        assert!(json > MAX_REPORT_BYTES, "plain JSON would not fit: {json}");
        assert!(encoded.len() <= MAX_REPORT_BYTES, "{}", encoded.len());
        assert_eq!(decode_report(&encoded).unwrap(), report);
    }

    #[test]
    fn reports_decode_from_gzip_or_plain_json_and_nothing_else() {
        let r = report();
        assert_eq!(decode_report(&encode_report(&r).unwrap()).unwrap(), r);
        let plain = serde_json::to_string(&r).unwrap();
        assert_eq!(decode_report(&plain).unwrap(), r);
        for (bad, why) in [
            ("not base64 !", "not base64"),
            ("aGVsbG8gd29ybGQ=", "not gzip"),
            ("", "not gzip"),
        ] {
            let err = decode_report(bad).unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
        // A peer's annotation cannot make us inflate without bound.
        let big = fleet(2_000);
        let err = decode_report_within(&encode_report(&big).unwrap(), 1024).unwrap_err();
        assert!(err.contains("inflates past 1024 bytes"), "{err}");
    }
}
