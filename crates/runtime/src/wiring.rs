//! Start-up and drain as a list of calls. Each component has a config read from the flags and
//! its own `build` (ports are bound there, so a port in use stops start-up with a clear error
//! before anything runs); [`RuntimeConfig::build`] builds them in order, the binary builds its
//! edge, then [`Runtime::spawn`] starts one task per background job. On shutdown the edge
//! drains its in-flight requests first, then [`Running::shutdown`] stops the background tasks
//! at their next cancellation point and gives the global leases back.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tollgate_crd::files;
use tollgate_engine::audit::AuditLog;
use tollgate_engine::key_hash::KeyHashes;
use tollgate_engine::metrics::Metrics;
use tollgate_engine::shared::Shared;
use tollgate_global::store::RedisOptions;
use tollgate_global::{GlobalRuntime, LeaseSettings, Membership};
use tollgate_limiter::{Clock, StoreConfig};

use crate::admin::StreamView;
use crate::args::RuntimeArgs;
use crate::rule_stream::{Apply, ControllerConfig};

/// How often idle keys are evicted from the in-memory limiters.
const EVICT_INTERVAL: Duration = Duration::from_secs(10);

/// Where rules come from.
pub enum Source {
    Files(PathBuf),
    Controller(ControllerConfig),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Files(p) => write!(f, "files {}", p.display()),
            Source::Controller(c) => write!(f, "controller {}", c.url),
        }
    }
}

impl Source {
    /// The one rule source the flags name.
    pub fn from_args(args: &RuntimeArgs) -> anyhow::Result<Source> {
        match (&args.policies, &args.controller) {
            (Some(path), None) => Ok(Source::Files(path.clone())),
            (None, Some(url)) => Ok(Source::Controller(controller_config(args, url)?)),
            _ => anyhow::bail!(
                "give exactly one rule source: --policies FILE_OR_DIR (standalone) or --controller URL"
            ),
        }
    }
}

fn controller_config(args: &RuntimeArgs, url: &str) -> anyhow::Result<ControllerConfig> {
    Ok(ControllerConfig {
        url: url.to_string(),
        namespace: args
            .pod_namespace
            .clone()
            .context("--controller needs --pod-namespace (TOLLGATE_POD_NAMESPACE)")?,
        pod: args
            .pod_name
            .clone()
            .context("--controller needs --pod-name (TOLLGATE_POD_NAME)")?,
        token_file: args.token_file.clone(),
        idle_timeout: args.controller_idle_timeout,
        top_keys_interval: args.top_keys_report_interval,
        ca: controller_ca(args)?,
        cache: args
            .rules_cache
            .clone()
            .map(|p| crate::rules_cache::RulesCache::new(p, url)),
        rules_wait: args.rules_wait,
        without_rules: args.without_rules,
    })
}

/// The CA an `https://` controller must chain to, from `--controller-ca` (PEM) or
/// `--controller-ca-file`; parsed once here, so a bad one stops start-up with a clear error.
fn controller_ca(
    args: &RuntimeArgs,
) -> anyhow::Result<Option<Vec<rustls::pki_types::CertificateDer<'static>>>> {
    use rustls::pki_types::pem::PemObject;
    let pem = match (&args.controller_ca, &args.controller_ca_file) {
        (Some(pem), _) => pem.as_bytes().to_vec(),
        (None, Some(path)) => std::fs::read(path)
            .with_context(|| format!("--controller-ca-file {}: cannot read", path.display()))?,
        (None, None) => return Ok(None),
    };
    let roots: Result<Vec<_>, _> =
        rustls::pki_types::CertificateDer::pem_slice_iter(&pem).collect();
    match roots {
        Ok(roots) if !roots.is_empty() => Ok(Some(roots)),
        _ => anyhow::bail!(
            "--controller-ca / --controller-ca-file: no PEM certificate in what was given"
        ),
    }
}

/// The decision engine's settings: audit, key hashes, how many keys a rule tracks.
pub struct EngineConfig {
    audit_per_second: u64,
    audit_raw_keys: bool,
    key_hash_secret_file: Option<PathBuf>,
    /// Identities that hold for this process only are worth a log line in standalone mode
    /// (the controller hands out an installation-wide secret otherwise).
    standalone: bool,
    pub store: StoreConfig,
}

impl EngineConfig {
    pub fn from_args(args: &RuntimeArgs) -> EngineConfig {
        EngineConfig {
            audit_per_second: args.audit_per_second,
            audit_raw_keys: args.audit_raw_keys,
            key_hash_secret_file: args.key_hash_secret_file.clone(),
            standalone: args.controller.is_none(),
            store: StoreConfig {
                max_keys: args.max_keys_per_rule,
                ..StoreConfig::default()
            },
        }
    }

    /// The engine with no rules yet (not ready).
    pub fn build(&self) -> anyhow::Result<Arc<Shared>> {
        let key_hashes = match &self.key_hash_secret_file {
            Some(path) => KeyHashes::load_or_create(path)
                .map_err(|e| anyhow::anyhow!("--key-hash-secret-file: {e}"))?,
            None => {
                if self.standalone {
                    tracing::info!(
                        "no --key-hash-secret-file: key hashes in audit lines and top keys hold for this process only"
                    );
                }
                KeyHashes::per_process().map_err(|e| anyhow::anyhow!(e))?
            }
        };
        let audit = AuditLog::new(
            self.audit_per_second,
            self.audit_raw_keys,
            key_hashes,
            self.key_hash_secret_file.is_some(),
        );
        Ok(Arc::new(Shared::new(Metrics::new(), audit)))
    }
}

/// Global limits through Redis, when `--redis` is given; and this process's membership.
pub struct GlobalConfig {
    redis: Option<RedisOptions>,
    groups: u32,
    settings: LeaseSettings,
    pub membership: Membership,
}

impl GlobalConfig {
    pub fn from_args(args: &RuntimeArgs) -> GlobalConfig {
        let redis = args.redis.as_ref().map(|url| RedisOptions {
            url: url.clone(),
            cluster: args.redis_cluster,
            sentinel_master: args.redis_sentinel.clone(),
            sentinel_password_file: args.redis_sentinel_password_file.clone(),
            username: args.redis_username.clone(),
            password_file: args.redis_password_file.clone(),
            ca_file: args.redis_ca_file.clone(),
            client_cert_file: args.redis_client_cert_file.clone(),
            client_key_file: args.redis_client_key_file.clone(),
        });
        GlobalConfig {
            redis,
            groups: args.redis_groups,
            settings: LeaseSettings {
                request_timeout: args.redis_timeout,
                sync_timeout: args.sync_timeout,
                sync_interval: args.sync_interval,
                lease_ttl: args.lease_ttl,
            },
            membership: Membership {
                sidecar_id: args.sidecar_id.clone().unwrap_or_else(default_sidecar_id),
                ttl: args.membership_ttl,
            },
        }
    }

    /// The Redis runtime, attached to `shared` before any rule set is built.
    pub fn build(self, shared: &Shared) -> anyhow::Result<Option<Arc<GlobalRuntime>>> {
        let Some(options) = self.redis else {
            return Ok(None);
        };
        let store =
            tollgate_global::Store::with_options(options, self.groups, self.settings.sync_interval)
                .map_err(|e| anyhow::anyhow!("--redis: {e}"))?;
        let metrics = shared.metrics().global.clone();
        store.set_metrics(metrics.clone());
        let runtime = Arc::new(GlobalRuntime::new(store, self.settings, metrics));
        shared.set_global(Arc::clone(&runtime));
        Ok(Some(runtime))
    }
}

/// Pod name (HOSTNAME in Kubernetes) plus the process id, unique among live sidecars.
fn default_sidecar_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "sidecar".to_string());
    format!("{host}-{}", std::process::id())
}

/// The admin port (probes, metrics, debug views).
pub struct AdminConfig {
    addr: SocketAddr,
    debug_remote: bool,
}

impl AdminConfig {
    pub fn from_args(args: &RuntimeArgs) -> AdminConfig {
        AdminConfig {
            addr: args.admin,
            debug_remote: args.admin_debug_remote,
        }
    }

    /// Binds the port now, so a port in use stops start-up.
    pub async fn build(self) -> anyhow::Result<Admin> {
        let listener = TcpListener::bind(self.addr)
            .await
            .with_context(|| format!("cannot listen on {} (admin)", self.addr))?;
        Ok(Admin {
            listener,
            debug_remote: self.debug_remote,
        })
    }
}

/// The bound admin port.
pub struct Admin {
    listener: TcpListener,
    debug_remote: bool,
}

/// Everything of the runtime, read from the flags; nothing started yet.
pub struct RuntimeConfig {
    pub source: Source,
    pub engine: EngineConfig,
    pub global: GlobalConfig,
    pub admin: AdminConfig,
    reload_interval: Duration,
    drain_timeout: Duration,
}

impl RuntimeConfig {
    pub fn from_args(args: &RuntimeArgs) -> anyhow::Result<RuntimeConfig> {
        Ok(RuntimeConfig {
            source: Source::from_args(args)?,
            engine: EngineConfig::from_args(args),
            global: GlobalConfig::from_args(args),
            admin: AdminConfig::from_args(args),
            reload_interval: args.reload_interval,
            drain_timeout: args.drain_timeout,
        })
    }

    /// Builds the engine and the Redis runtime, loads policy files (standalone: invalid files
    /// stop start-up; later bad edits keep the last good rules) and binds the admin port.
    pub async fn build(self) -> anyhow::Result<Runtime> {
        let shared = self.engine.build()?;
        let membership = self.global.membership.clone();
        let global = self.global.build(&shared)?;
        let store = self.engine.store;
        if let Source::Files(path) = &self.source {
            let policies = files::load(path).map_err(|errs| {
                let lines: Vec<String> = errs.iter().map(ToString::to_string).collect();
                anyhow::anyhow!("invalid policies:\n{}", lines.join("\n"))
            })?;
            shared
                .install(1, policies, &store)
                .map_err(|e| anyhow::anyhow!(e))?;
        }
        let admin = self.admin.build().await?;
        Ok(Runtime {
            shared,
            global,
            membership,
            source: self.source,
            store,
            admin,
            reload_interval: self.reload_interval,
            drain_timeout: self.drain_timeout,
        })
    }
}

/// The built runtime: engine, Redis runtime, rule source and admin port; nothing runs yet.
pub struct Runtime {
    shared: Arc<Shared>,
    global: Option<Arc<GlobalRuntime>>,
    membership: Membership,
    source: Source,
    store: StoreConfig,
    admin: Admin,
    reload_interval: Duration,
    drain_timeout: Duration,
}

impl Runtime {
    /// The engine every edge decides with.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// This process's identity in membership (also its replica name in the RLQS exchange).
    pub fn member_id(&self) -> &str {
        &self.membership.sidecar_id
    }

    /// How long the edge waits for in-flight requests on shutdown (`--drain-timeout`).
    pub fn drain_timeout(&self) -> Duration {
        self.drain_timeout
    }

    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin.listener.local_addr()
    }

    /// The rule source, for the start-up line.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// The Redis in use with its password replaced, for the start-up line.
    pub fn redis_redacted(&self) -> Option<String> {
        self.global.as_ref().map(|rt| rt.store.options().redacted())
    }

    /// Starts the background tasks: the admin port, the rule source, the Redis sync and the
    /// eviction of idle keys.
    pub fn spawn(self) -> Running {
        let mut running = Running {
            shared: Arc::clone(&self.shared),
            global: self.global.clone(),
            membership: self.membership.clone(),
            stop: CancellationToken::new(),
            tasks: Vec::new(),
        };
        let stream_view = match &self.source {
            Source::Controller(c) => Some(StreamView {
                controller: c.url.clone(),
                health: Arc::default(),
            }),
            Source::Files(_) => None,
        };
        running.spawn_admin(self.admin, stream_view.clone());
        match self.source {
            Source::Files(path) => running.spawn_reload(path, self.reload_interval, self.store),
            Source::Controller(config) => {
                running.spawn_rule_stream(config, stream_view, self.store)
            }
        }
        running.spawn_sync();
        running.spawn_evict();
        running
    }
}

/// The background tasks of a started runtime.
pub struct Running {
    shared: Arc<Shared>,
    global: Option<Arc<GlobalRuntime>>,
    membership: Membership,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Runs `task` until it ends or shutdown reaches its next await point, whichever is
    /// first. For jobs whose every await is a safe place to stop (no request is in them).
    pub fn spawn_until_stopped(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        let stop = self.stop.clone();
        self.tasks.push(tokio::spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = task => {}
            }
        }));
    }

    fn spawn_admin(&mut self, admin: Admin, stream_view: Option<StreamView>) {
        self.spawn_until_stopped(crate::admin::serve(
            admin.listener,
            Arc::clone(&self.shared),
            admin.debug_remote,
            stream_view,
        ));
    }

    fn spawn_reload(&mut self, path: PathBuf, every: Duration, store: StoreConfig) {
        let shared = Arc::clone(&self.shared);
        self.spawn_until_stopped(reload_loop(shared, path, every, store));
    }

    fn spawn_rule_stream(
        &mut self,
        config: ControllerConfig,
        stream_view: Option<StreamView>,
        store: StoreConfig,
    ) {
        let apply = Arc::new(ControllerApply {
            shared: Arc::clone(&self.shared),
            store,
            global: self.global.clone(),
        });
        let health = stream_view.map(|v| v.health).unwrap_or_default();
        self.spawn_until_stopped(crate::rule_stream::run(
            config,
            Arc::clone(&self.shared),
            apply,
            health,
        ));
    }

    fn spawn_sync(&mut self) {
        if let Some(rt) = &self.global {
            self.spawn_until_stopped(tollgate_global::sync_loop(
                Arc::clone(&self.shared) as Arc<dyn tollgate_global::GlobalSource>,
                Arc::clone(rt),
                self.membership.clone(),
            ));
        }
    }

    fn spawn_evict(&mut self) {
        self.spawn_until_stopped(evict_loop(Arc::clone(&self.shared)));
    }

    /// After the edge has drained: stops the background tasks at their next cancellation
    /// point, waits for them, then gives this process's global leases back to Redis.
    pub async fn shutdown(self) {
        self.stop.cancel();
        for task in self.tasks {
            if let Err(e) = task.await
                && e.is_panic()
            {
                tracing::error!(error = %e, "a background task panicked");
            }
        }
        if let Some(rt) = &self.global {
            tollgate_global::leave(self.shared.as_ref(), rt, &self.membership).await;
        }
    }
}

/// Applies what the controller streams.
struct ControllerApply {
    shared: Arc<Shared>,
    store: StoreConfig,
    global: Option<Arc<GlobalRuntime>>,
}

impl Apply for ControllerApply {
    fn rules(
        &self,
        version: u64,
        policies: Vec<tollgate_crd::CompiledPolicy>,
    ) -> Result<(), String> {
        self.shared.install(version, policies, &self.store)?;
        tracing::info!(version, "rules from the controller applied");
        Ok(())
    }

    fn members(&self, members: std::collections::BTreeMap<String, u32>) {
        if let Some(rt) = &self.global {
            rt.controller_members.store(Some(Arc::new(members)));
            rt.wake.notify_one();
        }
    }
}

/// Standalone mode: reloads the policy files when they change (a reload runs between awaits,
/// so shutdown never stops one halfway).
async fn reload_loop(shared: Arc<Shared>, path: PathBuf, every: Duration, store: StoreConfig) {
    let mut last = files::fingerprint(&path);
    let mut version = 1;
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let now = files::fingerprint(&path);
        if now == last {
            continue;
        }
        last = now;
        reload(&shared, &path, &mut version, &store);
    }
}

fn reload(shared: &Shared, path: &Path, version: &mut u64, store: &StoreConfig) {
    let result =
        files::load(path).map_err(|errs| errs.iter().map(ToString::to_string).collect::<Vec<_>>());
    let result = result.and_then(|policies| {
        shared
            .install(*version + 1, policies, store)
            .map_err(|e| vec![e])
    });
    match result {
        Ok(()) => {
            *version += 1;
            tracing::info!(version = *version, "policies reloaded");
        }
        Err(errors) => {
            for e in &errors {
                tracing::error!(error = %e, "policy reload refused; keeping the last good rules");
            }
            shared.refuse_config(&errors);
        }
    }
}

/// Drops idle keys from the in-memory limiters every [`EVICT_INTERVAL`].
async fn evict_loop(shared: Arc<Shared>) {
    let mut ticker = tokio::time::interval(EVICT_INTERVAL);
    loop {
        ticker.tick().await;
        let evicted = shared.evict_idle(shared.clock().now());
        if evicted > 0 {
            tracing::debug!(evicted, "evicted idle keys");
        }
    }
}
