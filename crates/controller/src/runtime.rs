//! Wiring, as a list of calls ([`run`]): the components are built from their flags first, and
//! the ones with a port bind it then, so a port in use stops start-up with a clear error
//! before any task runs; then one spawn function per task; then the drain (`drain`), which
//! lets every task finish the work in hand.
//!
//! The tasks: one watch per kind (policies, pods) and namespace (at the end of this file), the
//! retire marker, the key-hash secret, the fleet's top keys, the membership Leases of the
//! replicas, leader election, coverage and status (leader only), the admission webhooks, and
//! the rule-stream servers (plain, and TLS with `--tls-listen`).

mod drain;

use std::hash::{BuildHasher, Hasher};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tollgate_crd::Decoded;
use tracing::Instrument;

use self::drain::{Drain, Tasks};
use crate::args::Args;
use crate::auth::TokenReviewAuthenticator;
use crate::coverage::{Coverage, CoverageMetrics, PodFacts, PodTable, SharedPodTable};
use crate::index::{Index, PodInput, PolicyInput, SharedIndex};
use crate::leader::{self, LeaseConfig};
use crate::metrics::Metrics;
use crate::server::{Server, ServerConfig};
use crate::status::StatusWriter;
use crate::telemetry;
use crate::top_keys::FleetTopKeys;
use crate::webhook::Webhooks;
use crate::webhook::tls::CertStore;

/// How long leader election gets to release the Lease at shutdown.
const LEADER_GRACE: Duration = Duration::from_secs(10);
/// How long this replica's membership report gets to delete its Lease at shutdown.
const PEERS_GRACE: Duration = Duration::from_secs(3);
/// How long the TLS rule-stream server gets after the plain one drained (both drain at once).
const STREAM_TLS_GRACE: Duration = Duration::from_secs(5);
/// How long a writer (status, coverage, certificates) gets to finish the pass it is in.
const WRITER_GRACE: Duration = Duration::from_secs(5);
/// How long the webhook server gets: its own drain of the reviews in flight, and a margin.
const WEBHOOK_GRACE: Duration = Duration::from_secs(6);
/// Tasks that only wait for events stop at once; this is a margin.
const WATCH_GRACE: Duration = Duration::from_secs(1);

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

/// Sets up logging from the flags (`RUST_LOG` wins over `--log`; JSON lines carry the current
/// span) and, with `--otlp-endpoint` (or `OTEL_EXPORTER_OTLP_ENDPOINT`), trace export: the
/// controller's [`tollgate_telemetry::Settings`]. Its spans are in [`crate::telemetry`].
pub fn init_tracing(args: &Args) {
    let settings = tollgate_telemetry::Settings {
        service: "tollgate-controller",
        log_filter: &args.log,
        rust_log_wins: true,
        format: args.log_format,
        json_span: true,
        otlp_endpoint: args.otlp_endpoint.as_deref(),
        otlp_ca_file: args.otlp_ca_file.as_deref(),
    };
    if let Err(e) = tollgate_telemetry::init_with(&settings) {
        eprintln!("tollgate-controller: telemetry: {e}");
    }
}

/// Runs the controller until SIGTERM or Ctrl-C.
///
/// Shutdown: the signal tells every task at once (leader election and the membership report
/// release their Leases, the servers stop accepting); the rule-stream servers end every stream
/// and wait up to `--shutdown-grace` for the connections to close; then every other task gets
/// its own grace to finish the work in hand. Nothing is aborted mid-request.
pub async fn run(args: Args) -> anyhow::Result<()> {
    init_tracing(&args);
    check_flags(&args)?;
    let client = telemetry::kube_client().await.context(
        "cannot configure a Kubernetes client (in-cluster service account or KUBECONFIG)",
    )?;
    if args.retire {
        return retire(client, &args).await;
    }
    let (shared, mut registry) = Shared::new(client, &args);
    // Every port before any task: one in use stops start-up here, with the flag to change.
    let webhooks =
        Webhooks::build(&shared.client, &args.webhook, &mut registry, shared.started).await?;
    let listeners = StreamListeners::bind(&args, webhooks.as_ref().map(Webhooks::certs)).await?;

    let drain = Drain::new();
    let mut tasks = Tasks::default();
    let ready = spawn_watches(&shared, &args, &drain, &mut tasks);
    spawn_retire(&shared, &args, &drain, &mut tasks);
    let key_hash = spawn_key_hash(&shared, &args, &drain, &mut tasks);
    spawn_top_keys(&shared, &args, &drain, &mut tasks);
    spawn_peers(&shared, &args, &drain, &mut tasks);
    let leader = spawn_leader(&shared, &args, &drain, &mut tasks);
    spawn_coverage(&shared, &args, &leader, &drain, &mut tasks);
    spawn_status(&shared, &args, &leader, &drain, &mut tasks);
    if let Some(webhooks) = webhooks {
        spawn_webhooks(webhooks, &shared, &drain, &mut tasks);
    }
    let server = stream_server(&shared, &args, registry, key_hash, ready);
    serve_streams(server, listeners, &drain, &mut tasks).await?;

    drain.signal();
    tasks.join().await;
    drop(leader);
    tracing::info!("stopped");
    // Flushing waits for the exporter; keep it off the async workers.
    let _ = tokio::task::spawn_blocking(tollgate_telemetry::shutdown).await;
    Ok(())
}

/// Flag combinations that cannot work, refused before anything starts.
fn check_flags(args: &Args) -> anyhow::Result<()> {
    if !args.plain_stream && args.tls_listen.is_none() {
        anyhow::bail!(
            "--plain-stream=false needs --tls-listen: otherwise no listener serves the rule stream"
        );
    }
    Ok(())
}

/// `--retire` (the chart's pre-delete hook): tells the running replicas, and exits.
async fn retire(client: kube::Client, args: &Args) -> anyhow::Result<()> {
    let namespace = lease_namespace(&client, args);
    crate::retire::announce(client, &namespace, &args.lease_name, args.retire_wait).await
}

/// Where the Leases live: `--lease-namespace`, else the client's namespace.
fn lease_namespace(client: &kube::Client, args: &Args) -> String {
    args.lease_namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string())
}

/// What the tasks share.
struct Shared {
    client: kube::Client,
    index: SharedIndex,
    metrics: Metrics,
    /// This replica's name in Leases, status and Events.
    identity: String,
    lease_namespace: String,
    /// The watches' scopes: one per `--namespace`, or `None` for every namespace.
    scopes: Vec<Option<String>>,
    /// Set for good once `helm uninstall` began ([`crate::retire`]).
    retired: Arc<AtomicBool>,
    pod_table: SharedPodTable,
    coverage_metrics: CoverageMetrics,
    top_keys: Arc<FleetTopKeys>,
    /// The process start (Unix seconds), written with its settings' hash on every pod this
    /// process injects (see [`crate::coverage`]).
    started: i64,
}

impl Shared {
    /// The index and its metrics (the registry, which the webhooks add to before the rule-stream
    /// server takes it).
    fn new(client: kube::Client, args: &Args) -> (Shared, Registry) {
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
        let shared = Shared {
            lease_namespace: lease_namespace(&client, args),
            client,
            index,
            metrics,
            identity,
            scopes: if args.namespaces.is_empty() {
                vec![None]
            } else {
                args.namespaces.iter().cloned().map(Some).collect()
            },
            retired: Arc::new(AtomicBool::new(false)),
            pod_table: PodTable::shared(),
            coverage_metrics: CoverageMetrics::register(&mut registry),
            top_keys: FleetTopKeys::new(args.top_keys_window),
            started: k8s_openapi::jiff::Timestamp::now().as_second(),
        };
        (shared, registry)
    }
}

/// The rule-stream listeners, bound at start-up: `--listen`, and `--tls-listen` with the
/// webhook's certificate.
struct StreamListeners {
    plain: TcpListener,
    tls: Option<(TcpListener, Arc<rustls::ServerConfig>)>,
}

impl StreamListeners {
    async fn bind(args: &Args, certs: Option<&Arc<CertStore>>) -> anyhow::Result<StreamListeners> {
        let tls = match (args.tls_listen, certs) {
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
        let plain = TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        Ok(StreamListeners { plain, tls })
    }
}

/// The policy and pod watches, one of each per scope; the returned channel turns true once
/// every one of them listed its objects (`/readyz`).
fn spawn_watches(
    shared: &Shared,
    args: &Args,
    drain: &Drain,
    tasks: &mut Tasks,
) -> watch::Receiver<bool> {
    let mut synced = Vec::new();
    for scope in &shared.scopes {
        let span_ns = scope.clone().unwrap_or_else(|| "*".to_string());
        let (tx, rx) = watch::channel(false);
        synced.push(rx);
        let policies = watch_policies(
            shared.client.clone(),
            scope.clone(),
            (shared.index.clone(), Arc::clone(&shared.retired)),
            shared.metrics.clone(),
            tx,
        )
        .instrument(tracing::info_span!("policies", namespace = %span_ns));
        tasks.spawn("policies", WATCH_GRACE, drain.until_signal(policies));
        let (tx, rx) = watch::channel(false);
        synced.push(rx);
        let pods = watch_pods(
            shared.client.clone(),
            scope.clone(),
            args.pod_selector.clone(),
            (shared.index.clone(), shared.pod_table.clone()),
            shared.metrics.clone(),
            tx,
        )
        .instrument(tracing::info_span!("pods", namespace = %span_ns));
        tasks.spawn("pods", WATCH_GRACE, drain.until_signal(pods));
    }
    let (ready_tx, ready_rx) = watch::channel(false);
    let gate = async move {
        for mut rx in synced {
            if rx.wait_for(|s| *s).await.is_err() {
                return;
            }
        }
        tracing::info!("initial list of policies and pods synced: ready");
        ready_tx.send_replace(true);
        // Keep the channel open for the life of the process.
        std::future::pending::<()>().await;
    };
    tasks.spawn("ready", WATCH_GRACE, drain.until_signal(gate));
    ready_rx
}

/// `helm uninstall`'s pre-delete hook: stream no rules from then on.
fn spawn_retire(shared: &Shared, args: &Args, drain: &Drain, tasks: &mut Tasks) {
    let follow = crate::retire::follow(
        shared.client.clone(),
        shared.lease_namespace.clone(),
        args.lease_name.clone(),
        shared.index.clone(),
        shared.scopes.clone(),
        Arc::clone(&shared.retired),
    )
    .instrument(tracing::info_span!("retire"));
    tasks.spawn("retire", WATCH_GRACE, drain.until_signal(follow));
}

/// The key-hash secret every snapshot carries (`--key-hash-secret`; none when empty).
fn spawn_key_hash(
    shared: &Shared,
    args: &Args,
    drain: &Drain,
    tasks: &mut Tasks,
) -> watch::Receiver<Option<Arc<str>>> {
    let (tx, rx) = watch::channel(None);
    if !args.key_hash_secret.is_empty() {
        let follow = crate::key_hash::follow(
            shared.client.clone(),
            shared.lease_namespace.clone(),
            args.key_hash_secret.clone(),
            tx,
            drain.receiver(),
        )
        .instrument(tracing::info_span!("key_hash"));
        tasks.spawn("key_hash", WRITER_GRACE, follow);
    }
    rx
}

/// The fleet's top limited keys, merged every `--top-keys-interval`.
fn spawn_top_keys(shared: &Shared, args: &Args, drain: &Drain, tasks: &mut Tasks) {
    let merge = Arc::clone(&shared.top_keys)
        .run(args.top_keys_interval, drain.receiver())
        .instrument(tracing::info_span!("top_keys"));
    tasks.spawn("top_keys", WRITER_GRACE, merge);
}

/// Membership shared with the other replicas (`--peer-membership`): their reports into the
/// index, and this replica's report into its own Lease (deleted at shutdown).
fn spawn_peers(shared: &Shared, args: &Args, drain: &Drain, tasks: &mut Tasks) {
    if !args.peer_membership {
        return;
    }
    let peers = crate::peers::PeerConfig {
        namespace: shared.lease_namespace.clone(),
        group: args.lease_name.clone(),
        identity: shared.identity.clone(),
        duration: args.lease_duration,
        owner_pod: std::env::var("POD_NAME")
            .ok()
            .zip(args.pod_uid.clone())
            .filter(|(name, uid)| !name.is_empty() && !uid.is_empty()),
    };
    let follow = crate::peers::follow(
        shared.client.clone(),
        peers.clone(),
        shared.index.clone(),
        Arc::clone(&shared.top_keys),
    )
    .instrument(tracing::info_span!("peers"));
    tasks.spawn("peers follow", WATCH_GRACE, drain.until_signal(follow));
    let publish = crate::peers::publish(
        shared.client.clone(),
        peers,
        shared.index.clone(),
        Arc::clone(&shared.top_keys),
        drain.receiver(),
    )
    .instrument(tracing::info_span!("peers"));
    tasks.spawn("peers publish", PEERS_GRACE, publish);
}

/// Whether this replica leads: leader election, or always (`--leader-election=false`).
struct Leadership {
    leading: watch::Receiver<bool>,
    /// Without election: the sender, kept until the end so the status writer does not see a
    /// closed channel.
    _always: Option<watch::Sender<bool>>,
}

fn spawn_leader(shared: &Shared, args: &Args, drain: &Drain, tasks: &mut Tasks) -> Leadership {
    let (tx, leading) = watch::channel(false);
    if !args.leader_election {
        tx.send_replace(true);
        shared.metrics.set_leader(true);
        return Leadership {
            leading,
            _always: Some(tx),
        };
    }
    let lease = LeaseConfig {
        name: args.lease_name.clone(),
        namespace: shared.lease_namespace.clone(),
        identity: shared.identity.clone(),
        duration: args.lease_duration,
        grace: (args.lease_duration / 3).max(Duration::from_secs(1)),
    };
    let election = leader::run(
        shared.client.clone(),
        lease,
        tx,
        shared.metrics.clone(),
        drain.receiver(),
    )
    .instrument(tracing::info_span!("leader"));
    tasks.spawn("leader", LEADER_GRACE, election);
    Leadership {
        leading,
        _always: None,
    }
}

/// Pods a policy selects that run without the sidecar (leader only, like status).
fn spawn_coverage(
    shared: &Shared,
    args: &Args,
    leader: &Leadership,
    drain: &Drain,
    tasks: &mut Tasks,
) {
    let injector = args
        .webhook
        .webhook_cert_dir
        .as_ref()
        .and_then(|_| args.webhook.inject_config().ok())
        .map(|cfg| crate::webhook::inject::injector_id(&cfg, shared.started));
    let coverage = Coverage::new(
        shared.client.clone(),
        shared.index.clone(),
        shared.pod_table.clone(),
        shared.coverage_metrics.clone(),
        shared.identity.clone(),
        args.restart_pods_without_sidecar,
        args.coverage_interval,
    )
    .with_injector(injector)
    .run(leader.leading.clone(), drain.receiver())
    .instrument(tracing::info_span!("coverage"));
    tasks.spawn("coverage", WRITER_GRACE, coverage);
}

/// The status writer (acts only while leading).
fn spawn_status(
    shared: &Shared,
    args: &Args,
    leader: &Leadership,
    drain: &Drain,
    tasks: &mut Tasks,
) {
    let writer = StatusWriter::new(
        shared.client.clone(),
        shared.index.clone(),
        shared.metrics.clone(),
        shared.identity.clone(),
        args.status_min_interval,
    )
    .with_top_keys(Arc::clone(&shared.top_keys))
    .run(leader.leading.clone(), drain.receiver())
    .instrument(tracing::info_span!("status"));
    tasks.spawn("status", WRITER_GRACE, writer);
}

/// The admission webhooks' server and certificate tasks.
fn spawn_webhooks(webhooks: Webhooks, shared: &Shared, drain: &Drain, tasks: &mut Tasks) {
    let webhooks = webhooks.tasks(&shared.client, &drain.receiver());
    if let Some(certs) = webhooks.certs {
        tasks.spawn("webhook-certs", WRITER_GRACE, certs);
    }
    tasks.spawn("webhook-tls", WRITER_GRACE, webhooks.reload);
    tasks.spawn("webhook", WEBHOOK_GRACE, webhooks.server);
}

/// The rule-stream server (its TokenReview authenticator, settings and readiness).
fn stream_server(
    shared: &Shared,
    args: &Args,
    registry: Registry,
    key_hash_secret: watch::Receiver<Option<Arc<str>>>,
    ready: watch::Receiver<bool>,
) -> Server {
    let auth = Arc::new(
        TokenReviewAuthenticator::new(
            shared.client.clone(),
            args.token_audiences.clone(),
            args.token_cache_ttl,
        )
        .with_metrics(shared.metrics.clone()),
    );
    let config = ServerConfig {
        heartbeat: args.heartbeat_interval,
        unknown_pod_grace: args.unknown_pod_grace,
        shutdown_grace: args.shutdown_grace,
        plain_stream: args.plain_stream,
        key_hash_secret,
        top_keys: Arc::clone(&shared.top_keys),
    };
    Server::new(
        shared.index.clone(),
        auth,
        shared.metrics.clone(),
        registry,
        config,
        ready,
    )
}

/// Serves rule streams until SIGTERM or Ctrl-C, which tells every task to stop; then ends every
/// stream (sidecars reconnect to another replica) and waits up to `--shutdown-grace` for the
/// connections to close. The TLS listener's server drains at the same time, as a task.
async fn serve_streams(
    server: Server,
    listeners: StreamListeners,
    drain: &Drain,
    tasks: &mut Tasks,
) -> anyhow::Result<()> {
    if let Some((listener, tls)) = listeners.tls {
        let serve = server
            .clone()
            .serve_tls(listener, tls, drain.signalled())
            .instrument(tracing::info_span!("stream-tls"));
        tasks.spawn("stream-tls", STREAM_TLS_GRACE, async move {
            let _ = serve.await;
        });
    }
    let signal = async {
        tollgate_telemetry::shutdown_signal().await;
        tracing::info!("shutting down: closing rule streams");
        drain.signal();
    };
    server.serve(listeners.plain, signal).await?;
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

    /// A port in use, or a TLS listener without a certificate, stops start-up with the flag
    /// to change, before any task runs.
    #[tokio::test]
    async fn listeners_that_cannot_be_bound_name_their_flag() {
        use clap::Parser as _;
        let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let args = Args::parse_from(["tollgate-controller", "--listen", &addr]);
        let err = StreamListeners::bind(&args, None).await.err().unwrap();
        assert_eq!(err.to_string(), format!("cannot listen on {addr}"));
        let args = Args::parse_from([
            "tollgate-controller",
            "--listen",
            "127.0.0.1:0",
            "--tls-listen",
            "127.0.0.1:0",
        ]);
        let err = StreamListeners::bind(&args, None).await.err().unwrap();
        assert!(
            err.to_string().contains("needs --webhook-cert-dir"),
            "{err}"
        );
    }
}
