//! Wiring: the Kubernetes client, one watch task per kind (and namespace), the index, the
//! rule-stream server, leader election and the status writer.

use std::hash::{BuildHasher, Hasher};
use std::pin::pin;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tollgate_crd::Decoded;
use tracing::Instrument;

use crate::args::Args;
use crate::auth::TokenReviewAuthenticator;
use crate::coverage::PodFacts;
use crate::index::{Index, PodInput, PolicyInput, SharedIndex};
use crate::leader::{self, LeaseConfig};
use crate::metrics::Metrics;
use crate::server::{Server, ServerConfig};
use crate::status::StatusWriter;
use crate::telemetry;
use tollgate_telemetry::LogFormat;

/// A random identifier for this controller process (32 hex characters). Versions are only
/// comparable within one epoch.
pub fn new_epoch() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut out = String::with_capacity(32);
    for i in 0u8..2 {
        // RandomState is seeded from the OS's randomness.
        let mut h = std::hash::RandomState::new().build_hasher();
        h.write_u128(nanos);
        h.write_u32(std::process::id());
        h.write_u8(i);
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

/// Sets up logging from the flags (`RUST_LOG` wins over `--log`) and, with `--otlp-endpoint`
/// (or `OTEL_EXPORTER_OTLP_ENDPOINT`), trace export; see [`crate::telemetry`].
pub fn init_tracing(args: &Args) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&args.log))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let endpoint = tollgate_telemetry::otlp::endpoint(args.otlp_endpoint.as_deref());
    let ca_file = tollgate_telemetry::otlp::ca_file(args.otlp_ca_file.as_deref());
    if let Err(e) = telemetry::init(
        filter,
        args.log_format == LogFormat::Json,
        endpoint.as_deref(),
        ca_file.as_deref(),
        "tollgate-controller",
    ) {
        eprintln!("tollgate-controller: telemetry: {e}");
    }
}

/// Runs the controller until SIGTERM or Ctrl-C.
pub async fn run(args: Args) -> anyhow::Result<()> {
    init_tracing(&args);
    if !args.plain_stream && args.tls_listen.is_none() {
        anyhow::bail!(
            "--plain-stream=false needs --tls-listen: otherwise no listener serves the rule stream"
        );
    }
    let client = telemetry::kube_client().await.context(
        "cannot configure a Kubernetes client (in-cluster service account or KUBECONFIG)",
    )?;
    if args.retire {
        let namespace = args
            .lease_namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_string());
        return crate::retire::announce(client, &namespace, &args.lease_name, args.retire_wait)
            .await;
    }
    let identity = args
        .identity
        .clone()
        .or_else(|| std::env::var("POD_NAME").ok())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "tollgate-controller".to_string());
    let epoch = new_epoch();
    tracing::info!(%epoch, %identity, listen = %args.listen, namespaces = ?args.namespaces, "starting tollgate-controller");

    let index = Index::shared(epoch);
    let (metrics, mut registry) = Metrics::new(index.clone());
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let pod_table = crate::coverage::PodTable::shared();
    // Written on every pod this process injects, with its settings' hash (see coverage).
    let started = k8s_openapi::jiff::Timestamp::now().as_second();
    let retired = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let coverage_metrics = crate::coverage::CoverageMetrics::register(&mut registry);

    // Watches: one per kind and namespace (or one per kind for all namespaces).
    let scopes: Vec<Option<String>> = if args.namespaces.is_empty() {
        vec![None]
    } else {
        args.namespaces.iter().cloned().map(Some).collect()
    };
    let mut synced = Vec::new();
    for scope in &scopes {
        let span_ns = scope.clone().unwrap_or_else(|| "*".to_string());
        let (tx, rx) = watch::channel(false);
        synced.push(rx);
        tokio::spawn(
            watch_policies(
                client.clone(),
                scope.clone(),
                (index.clone(), Arc::clone(&retired)),
                metrics.clone(),
                tx,
            )
            .instrument(tracing::info_span!("policies", namespace = %span_ns)),
        );
        let (tx, rx) = watch::channel(false);
        synced.push(rx);
        tokio::spawn(
            watch_pods(
                client.clone(),
                scope.clone(),
                args.pod_selector.clone(),
                (index.clone(), pod_table.clone()),
                metrics.clone(),
                tx,
            )
            .instrument(tracing::info_span!("pods", namespace = %span_ns)),
        );
    }
    let (ready_tx, ready_rx) = watch::channel(false);
    tokio::spawn(async move {
        for mut rx in synced {
            if rx.wait_for(|s| *s).await.is_err() {
                return;
            }
        }
        tracing::info!("initial list of policies and pods synced: ready");
        ready_tx.send_replace(true);
        // Keep the channel open for the life of the process.
        std::future::pending::<()>().await;
    });

    let lease_namespace = args
        .lease_namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());

    // `helm uninstall`'s pre-delete hook: stream no rules from then on.
    tokio::spawn(
        crate::retire::follow(
            client.clone(),
            lease_namespace.clone(),
            args.lease_name.clone(),
            index.clone(),
            scopes.clone(),
            Arc::clone(&retired),
        )
        .instrument(tracing::info_span!("retire")),
    );

    // The key-hash secret every snapshot carries.
    let (key_hash_tx, key_hash_rx) = watch::channel(None);
    if !args.key_hash_secret.is_empty() {
        tokio::spawn(
            crate::key_hash::follow(
                client.clone(),
                lease_namespace.clone(),
                args.key_hash_secret.clone(),
                key_hash_tx,
            )
            .instrument(tracing::info_span!("key_hash")),
        );
    }

    // The fleet's top limited keys, merged every interval.
    let top_keys = crate::top_keys::FleetTopKeys::new(args.top_keys_window);
    tokio::spawn(
        Arc::clone(&top_keys)
            .run(args.top_keys_interval, shutdown_rx.clone())
            .instrument(tracing::info_span!("top_keys")),
    );

    // Membership shared with the other replicas.
    let peers_task = if args.peer_membership {
        let peers = crate::peers::PeerConfig {
            namespace: lease_namespace.clone(),
            group: args.lease_name.clone(),
            identity: identity.clone(),
            duration: args.lease_duration,
            owner_pod: std::env::var("POD_NAME")
                .ok()
                .zip(args.pod_uid.clone())
                .filter(|(name, uid)| !name.is_empty() && !uid.is_empty()),
        };
        tokio::spawn(
            crate::peers::follow(
                client.clone(),
                peers.clone(),
                index.clone(),
                Arc::clone(&top_keys),
            )
            .instrument(tracing::info_span!("peers")),
        );
        Some(tokio::spawn(
            crate::peers::publish(
                client.clone(),
                peers,
                index.clone(),
                Arc::clone(&top_keys),
                shutdown_rx.clone(),
            )
            .instrument(tracing::info_span!("peers")),
        ))
    } else {
        None
    };

    // Leader election.
    let (leader_tx, leader_rx) = watch::channel(false);
    let leader_task = if args.leader_election {
        let lease = LeaseConfig {
            name: args.lease_name.clone(),
            namespace: lease_namespace.clone(),
            identity: identity.clone(),
            duration: args.lease_duration,
            grace: (args.lease_duration / 3).max(std::time::Duration::from_secs(1)),
        };
        Some(tokio::spawn(
            leader::run(
                client.clone(),
                lease,
                leader_tx,
                metrics.clone(),
                shutdown_rx.clone(),
            )
            .instrument(tracing::info_span!("leader")),
        ))
    } else {
        leader_tx.send_replace(true);
        metrics.set_leader(true);
        // Keep the sender alive so the status writer does not see a closed channel.
        tokio::spawn(async move {
            let _keep = leader_tx;
            std::future::pending::<()>().await;
        });
        None
    };

    // Status writer (acts only while leading).
    let writer = StatusWriter::new(
        client.clone(),
        index.clone(),
        metrics.clone(),
        identity.clone(),
        args.status_min_interval,
    )
    .with_top_keys(Arc::clone(&top_keys));
    // Pods a policy selects that run without the sidecar (leader only, like status).
    let coverage = crate::coverage::Coverage::new(
        client.clone(),
        index.clone(),
        pod_table,
        coverage_metrics,
        identity.clone(),
        args.restart_pods_without_sidecar,
        args.coverage_interval,
    )
    .with_injector(
        args.webhook
            .webhook_cert_dir
            .as_ref()
            .and_then(|_| args.webhook.inject_config().ok())
            .map(|cfg| crate::webhook::inject::injector_id(&cfg, started)),
    );
    tokio::spawn(
        coverage
            .run(leader_rx.clone(), shutdown_rx.clone())
            .instrument(tracing::info_span!("coverage")),
    );
    let status_task = tokio::spawn(
        writer
            .run(leader_rx, shutdown_rx.clone())
            .instrument(tracing::info_span!("status")),
    );

    // The rule-stream server.
    let auth = Arc::new(
        TokenReviewAuthenticator::new(
            client.clone(),
            args.token_audiences.clone(),
            args.token_cache_ttl,
        )
        .with_metrics(metrics.clone()),
    );
    // Admission webhooks (their metrics join the registry before the server takes it).
    let certs = crate::webhook::start(
        &client,
        &args.webhook,
        &mut registry,
        (started, shutdown_rx.clone()),
    )
    .await?;
    let tls_listener = match (args.tls_listen, &certs) {
        (None, _) => None,
        (Some(addr), Some(certs)) => {
            let tls = Arc::new(crate::webhook::tls::server_config(certs.clone())?);
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (--tls-listen)"))?;
            tracing::info!(listen = %addr, "serving rule streams over TLS too");
            Some((listener, tls))
        }
        (Some(_), None) => anyhow::bail!(
            "--tls-listen serves the webhook's certificate: it needs --webhook-cert-dir"
        ),
    };

    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let server = Server::new(
        index,
        auth,
        metrics,
        registry,
        ServerConfig {
            heartbeat: args.heartbeat_interval,
            unknown_pod_grace: args.unknown_pod_grace,
            shutdown_grace: args.shutdown_grace,
            plain_stream: args.plain_stream,
            key_hash_secret: key_hash_rx,
            top_keys,
        },
        ready_rx,
    );
    let signal = {
        let tx = shutdown_tx.clone();
        async move {
            tollgate_telemetry::shutdown_signal().await;
            tracing::info!("shutting down: closing rule streams");
            tx.send_replace(true);
        }
    };
    let tls_task = tls_listener.map(|(listener, tls)| {
        let mut stop = shutdown_rx.clone();
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        tokio::spawn(
            server
                .clone()
                .serve_tls(listener, tls, stopped)
                .instrument(tracing::info_span!("stream-tls")),
        )
    });
    server.serve(listener, signal).await?;
    if let Some(task) = tls_task {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), task).await;
    }
    shutdown_tx.send_replace(true);
    if let Some(task) = leader_task {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(10), task).await;
    }
    if let Some(task) = peers_task {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(3), task).await;
    }
    status_task.abort();
    tracing::info!("stopped");
    // Flushing waits for the exporter; keep it off the async workers.
    let _ = tokio::task::spawn_blocking(telemetry::shutdown).await;
    Ok(())
}

/// Feeds RateLimitPolicy watch events into the index. Objects that do not decode are indexed
/// as invalid (their last good version stays in force); nothing stops the loop. Decoding is
/// lenient: an object with an unknown `spec` field (stored while the validating webhook was
/// absent) decodes, and is indexed as invalid with `<path>: unknown field`, like any other
/// error (`Accepted=False`, last good version kept), instead of failing the whole watch.
/// Once `retired` (tollgate is being removed), events are dropped: the index keeps no policy.
async fn watch_policies(
    client: kube::Client,
    scope: Option<String>,
    (index, retired): (SharedIndex, Arc<std::sync::atomic::AtomicBool>),
    metrics: Metrics,
    synced: watch::Sender<bool>,
) {
    let api: Api<DeserializeGuard<Decoded>> = match &scope {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let mut stream = pin!(watcher::watcher(api, watcher::Config::default()).default_backoff());
    let mut buffer: Vec<PolicyInput> = Vec::new();
    let mut logged = CompileLog::new();
    while let Some(event) = stream.next().await {
        if retired.load(std::sync::atomic::Ordering::Acquire) {
            synced.send_replace(true);
            continue;
        }
        match event {
            Ok(Event::Apply(obj)) => {
                reconcile_policy(&obj, &mut logged, |input| {
                    let mut index = index.write();
                    // Checked under the lock `retire::follow` empties the index with.
                    if retired.load(std::sync::atomic::Ordering::Acquire) {
                        return None;
                    }
                    let changed = index.apply_policy(input);
                    metrics.watch_event("policy", "apply");
                    Some((changed, index.version()))
                });
            }
            Ok(Event::Delete(obj)) => {
                let meta = guard_metadata(&obj);
                if let (Some(ns), Some(name)) = (&meta.namespace, &meta.name) {
                    logged.remove(&(ns.clone(), name.clone()));
                    index.write().delete_policy(ns, name);
                    metrics.watch_event("policy", "delete");
                    tracing::info!(namespace = %ns, policy = %name, "policy deleted");
                }
            }
            Ok(Event::Init) => buffer.clear(),
            Ok(Event::InitApply(obj)) => {
                reconcile_policy(&obj, &mut logged, |input| {
                    buffer.push(input);
                    None
                });
            }
            Ok(Event::InitDone) => {
                let items = std::mem::take(&mut buffer);
                let n = items.len();
                {
                    let mut index = index.write();
                    if !retired.load(std::sync::atomic::Ordering::Acquire) {
                        index.reset_policies(scope.as_deref(), items);
                    }
                }
                metrics.watch_event("policy", "resync");
                tracing::info!(policies = n, "policies listed");
                synced.send_replace(true);
            }
            Err(error) => {
                metrics.watch_error("policy");
                tracing::warn!(%error, "RateLimitPolicy watch failed; retrying (is the CRD installed and may this service account list and watch it?)");
            }
        }
    }
}

fn guard_metadata(
    obj: &DeserializeGuard<Decoded>,
) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
    match &obj.0 {
        Ok(d) => &d.policy.metadata,
        Err(invalid) => &invalid.metadata,
    }
}

fn policy_input(obj: &DeserializeGuard<Decoded>) -> Option<PolicyInput> {
    match &obj.0 {
        Ok(decoded) => PolicyInput::from_decoded(decoded),
        Err(invalid) => PolicyInput::undecodable(&invalid.metadata, &invalid.error),
    }
}

/// The generation whose compile errors were last logged, per policy (namespace, name).
pub type CompileLog = std::collections::HashMap<(String, String), Option<i64>>;

/// One reconcile of a policy the watch delivered: compile it, log a rejection once per
/// generation, and hand the result to `apply` (the index, or the initial list's buffer), which
/// returns whether sidecars get new rules and the index version, when it knows. Traced as
/// `tollgate reconcile` when traces are on (see [`crate::telemetry`]).
pub fn reconcile_policy(
    obj: &DeserializeGuard<Decoded>,
    logged: &mut CompileLog,
    apply: impl FnOnce(PolicyInput) -> Option<(bool, u64)>,
) {
    let meta = guard_metadata(obj);
    let span = telemetry::reconcile_span(meta.namespace.as_deref(), meta.name.as_deref());
    let _entered = span.enter();
    let Some(input) = policy_input(obj) else {
        return;
    };
    telemetry::record_reconcile(&span, &input);
    log_compile(&input, logged);
    if let Some((changed, version)) = apply(input) {
        span.record("tollgate.changed", changed);
        span.record("tollgate.version", version);
    }
}

/// Logs compile errors once per generation.
fn log_compile(input: &PolicyInput, logged: &mut CompileLog) {
    let key = (input.namespace.clone(), input.name.clone());
    match &input.compiled {
        Ok(_) => {
            if logged.remove(&key).is_some() {
                tracing::info!(namespace = %input.namespace, policy = %input.name, generation = input.generation, "policy compiles again");
            }
        }
        Err(errors) => {
            if logged.get(&key) != Some(&input.generation) {
                logged.insert(key, input.generation);
                let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
                tracing::warn!(namespace = %input.namespace, policy = %input.name, generation = input.generation, errors = %errors.join("; "), "policy rejected; its last good version stays in force");
            }
        }
    }
}

/// Feeds pod metadata into the index (labels) and the coverage table (labels, the injection
/// annotations, the owner).
async fn watch_pods(
    client: kube::Client,
    scope: Option<String>,
    selector: Option<String>,
    (index, table): (SharedIndex, crate::coverage::SharedPodTable),
    metrics: Metrics,
    synced: watch::Sender<bool>,
) {
    // `PartialObjectMeta` makes the watch metadata-only: labels are all the index needs.
    let api: Api<PartialObjectMeta<Pod>> = match &scope {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let mut config = watcher::Config::default();
    if let Some(sel) = &selector {
        config = config.labels(sel);
    }
    let mut stream = pin!(watcher::watcher(api, config).default_backoff());
    let mut buffer: Vec<PodInput> = Vec::new();
    let mut facts: Vec<PodFacts> = Vec::new();
    while let Some(event) = stream.next().await {
        match event {
            Ok(Event::Apply(obj)) => {
                if let Some(input) = pod_input(&obj) {
                    index.write().apply_pod(input);
                    metrics.watch_event("pod", "apply");
                }
                if let Some(f) = PodFacts::from_metadata(&obj.metadata) {
                    table.lock().apply(f);
                }
            }
            Ok(Event::Delete(obj)) => {
                if let (Some(ns), Some(name)) = (&obj.metadata.namespace, &obj.metadata.name) {
                    index.write().delete_pod(ns, name);
                    table.lock().delete(ns, name);
                    metrics.watch_event("pod", "delete");
                }
            }
            Ok(Event::Init) => {
                buffer.clear();
                facts.clear();
            }
            Ok(Event::InitApply(obj)) => {
                buffer.extend(pod_input(&obj));
                facts.extend(PodFacts::from_metadata(&obj.metadata));
            }
            Ok(Event::InitDone) => {
                let items = std::mem::take(&mut buffer);
                let n = items.len();
                table
                    .lock()
                    .reset(scope.as_deref(), std::mem::take(&mut facts));
                index.write().reset_pods(scope.as_deref(), items);
                metrics.watch_event("pod", "resync");
                tracing::info!(pods = n, "pods listed");
                synced.send_replace(true);
            }
            Err(error) => {
                metrics.watch_error("pod");
                tracing::warn!(%error, "pod watch failed; retrying");
            }
        }
    }
}

fn pod_input(obj: &PartialObjectMeta<Pod>) -> Option<PodInput> {
    PodInput::from_metadata(&obj.metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_are_random_hex() {
        let a = new_epoch();
        let b = new_epoch();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
