//! Wiring: load policies, start the proxy and admin listeners, reload and evict in the
//! background, drain on shutdown.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tollgate_limiter::{Clock, StoreConfig};

use crate::args::RunArgs;
use crate::controller::{Apply, ControllerConfig};
use tollgate_crd::files;
use tollgate_engine::audit::AuditLog;
use tollgate_engine::metrics::Metrics;
use tollgate_engine::rules::RuleSet;
use tollgate_engine::shared::Shared;
use tollgate_global::{GlobalRuntime, LeaseSettings, Membership};
use tollgate_http::proxy::{self, Proxy, ProxyConfig};

/// How often idle keys are evicted from the in-memory limiters.
const EVICT_INTERVAL: Duration = Duration::from_secs(10);

/// The CA an `https://` controller must chain to, from `--controller-ca` (PEM) or
/// `--controller-ca-file`; parsed once here, so a bad one stops start-up with a clear error.
fn controller_ca(
    args: &RunArgs,
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

/// Runs the sidecar until `shutdown` resolves.
pub async fn run(
    args: RunArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let upstream = if args.rate_limit_service {
        None
    } else {
        Some(args.upstream.clone().context(
            "--upstream (TOLLGATE_UPSTREAM) is required, e.g. --upstream http://127.0.0.1:8080 \
             (or --rate-limit-service to serve Envoy's rate limit service instead)",
        )?)
    };
    let source = match (&args.policies, &args.controller) {
        (Some(path), None) => Source::Files(path.clone()),
        (None, Some(url)) => Source::Controller(ControllerConfig {
            url: url.clone(),
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
            ca: controller_ca(&args)?,
            cache: args
                .rules_cache
                .clone()
                .map(|p| crate::rules_cache::RulesCache::new(p, url)),
            rules_wait: args.rules_wait,
            without_rules: args.without_rules,
        }),
        _ => anyhow::bail!(
            "give exactly one rule source: --policies FILE_OR_DIR (standalone) or --controller URL"
        ),
    };

    let identity = match &args.key_hash_secret_file {
        Some(path) => tollgate_engine::identity::KeyIdentity::load_or_create(path)
            .map_err(|e| anyhow::anyhow!("--key-hash-secret-file: {e}"))?,
        None => {
            if args.controller.is_none() {
                tracing::info!(
                    "no --key-hash-secret-file: key hashes in audit lines and top keys hold for this process only"
                );
            }
            tollgate_engine::identity::KeyIdentity::per_process().map_err(|e| anyhow::anyhow!(e))?
        }
    };
    let metrics = Metrics::new();
    let shared = Arc::new(Shared::new(
        metrics,
        AuditLog::new(
            args.audit_per_second,
            args.audit_raw_keys,
            identity,
            args.key_hash_secret_file.is_some(),
        ),
    ));
    let proxy = match upstream {
        Some(upstream) => Some(Arc::new(Proxy::new(
            Arc::clone(&shared),
            ProxyConfig {
                upstream,
                upstream_timeout: args.upstream_timeout,
                header_read_timeout: args.header_read_timeout,
                max_header_bytes: args.max_header_bytes,
                shadow_header: args.shadow_header,
                fast_http1: args.fast_http1,
            },
        )?)),
        None => None,
    };
    let store = StoreConfig {
        max_keys: args.max_keys_per_rule,
        ..StoreConfig::default()
    };

    let global = match &args.redis {
        Some(url) => {
            let options = tollgate_global::store::RedisOptions {
                url: url.clone(),
                cluster: args.redis_cluster,
                sentinel_master: args.redis_sentinel.clone(),
                sentinel_password_file: args.redis_sentinel_password_file.clone(),
                username: args.redis_username.clone(),
                password_file: args.redis_password_file.clone(),
                ca_file: args.redis_ca_file.clone(),
                client_cert_file: args.redis_client_cert_file.clone(),
                client_key_file: args.redis_client_key_file.clone(),
            };
            let store = tollgate_global::Store::with_options(
                options,
                args.redis_groups,
                args.sync_interval,
            )
            .map_err(|e| anyhow::anyhow!("--redis: {e}"))?;
            store.set_metrics(shared.metrics.global.clone());
            Some(Arc::new(GlobalRuntime {
                store,
                settings: LeaseSettings {
                    request_timeout: args.redis_timeout,
                    sync_timeout: args.sync_timeout,
                    sync_interval: args.sync_interval,
                    lease_ttl: args.lease_ttl,
                },
                metrics: shared.metrics.global.clone(),
                wake: tokio::sync::Notify::new(),
                synced: tokio::sync::Notify::new(),
                controller_members: arc_swap::ArcSwapOption::empty(),
                sync_rtt: std::sync::atomic::AtomicU64::new(0),
                next_refill: std::sync::atomic::AtomicU64::new(u64::MAX),
            }))
        }
        None => None,
    };
    let membership = Membership {
        sidecar_id: args.sidecar_id.clone().unwrap_or_else(default_sidecar_id),
        ttl: args.membership_ttl,
    };

    if let Source::Files(path) = &source {
        // Standalone: refuse to start on invalid files (later bad edits keep the last good rules).
        let policies = files::load(path).map_err(|errs| {
            let lines: Vec<String> = errs.iter().map(ToString::to_string).collect();
            anyhow::anyhow!("invalid policies:\n{}", lines.join("\n"))
        })?;
        install(&shared, 1, policies, &store, global.as_ref())?;
    }

    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let admin = TcpListener::bind(args.admin)
        .await
        .with_context(|| format!("cannot listen on {} (admin)", args.admin))?;
    if let Some(rt) = &global {
        let _ = shared.global.set(Arc::clone(rt));
    }
    let redis = global.as_ref().map(|rt| rt.store.options().redacted());
    tracing::info!(
        listen = %listener.local_addr()?,
        admin = %admin.local_addr()?,
        upstream = proxy.as_ref().map(|p| p.config.upstream.to_string()).as_deref(),
        edge = if proxy.is_some() { "http proxy" } else { "envoy rate limit service (RLS v3 and RLQS)" },
        rules = %source,
        redis = redis.as_deref(),
        "tollgate-sidecar started"
    );

    let stream_view = match &source {
        Source::Controller(c) => Some(crate::admin::StreamView {
            controller: c.url.clone(),
            health: Arc::default(),
        }),
        Source::Files(_) => None,
    };
    let admin_task = tokio::spawn(crate::admin::serve(
        admin,
        Arc::clone(&shared),
        args.admin_debug_remote,
        stream_view.clone(),
    ));
    let rules_task = match source {
        Source::Files(path) => tokio::spawn(reload_loop(
            Arc::clone(&shared),
            path,
            args.reload_interval,
            store,
            global.clone(),
        )),
        Source::Controller(config) => {
            let apply = Arc::new(ControllerApply {
                shared: Arc::clone(&shared),
                store,
                global: global.clone(),
            });
            let health = stream_view.map(|v| v.health).unwrap_or_default();
            tokio::spawn(crate::controller::run(
                config,
                Arc::clone(&shared),
                apply,
                health,
            ))
        }
    };
    let sync_task = global.as_ref().map(|rt| {
        tokio::spawn(tollgate_global::sync_loop(
            Arc::clone(&shared) as Arc<dyn tollgate_global::GlobalSource>,
            Arc::clone(rt),
            membership.clone(),
        ))
    });
    let evict_task = tokio::spawn(evict_loop(Arc::clone(&shared)));

    let mut fleet_task = None;
    match proxy {
        Some(proxy) => proxy::serve(listener, proxy, shutdown, args.drain_timeout).await,
        None => {
            let quota = tollgate_envoy::rlqs::QuotaEdge::new(
                Arc::clone(&shared),
                tollgate_envoy::rlqs::QuotaSettings {
                    assignment_ttl: args.rlqs_assignment_ttl,
                    sync_interval: args.rlqs_sync_interval,
                    replica: membership.sidecar_id.clone(),
                },
            );
            fleet_task = Some(tokio::spawn(tollgate_envoy::rlqs::fleet_loop(
                quota.clone(),
            )));
            tollgate_envoy::rls::serve(
                listener,
                Arc::clone(&shared),
                quota,
                shutdown,
                args.drain_timeout,
            )
            .await;
        }
    }
    if let Some(task) = sync_task {
        task.abort();
    }
    if let Some(task) = fleet_task {
        task.abort();
    }
    if let Some(rt) = &global {
        tollgate_global::leave(shared.as_ref(), rt, &membership).await;
    }
    rules_task.abort();
    evict_task.abort();
    admin_task.abort();
    tracing::info!("tollgate-sidecar stopped");
    Ok(())
}

/// Where rules come from.
enum Source {
    Files(std::path::PathBuf),
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
        install(
            &self.shared,
            version,
            policies,
            &self.store,
            self.global.as_ref(),
        )
        .map_err(|e| e.to_string())?;
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

/// Builds and swaps in a new rule set.
fn install(
    shared: &Shared,
    version: u64,
    policies: Vec<tollgate_crd::CompiledPolicy>,
    store: &StoreConfig,
    global: Option<&Arc<GlobalRuntime>>,
) -> anyhow::Result<()> {
    let previous = shared.rules.load();
    let set = RuleSet::build(
        version,
        policies,
        Some(&previous),
        store,
        &shared.metrics,
        global,
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    for id in &set.local_fallback_rules {
        tracing::warn!(
            rule = %id,
            "scope Global rule enforced per sidecar: no Redis configured (standalone mode)"
        );
    }
    let m = &shared.metrics;
    m.rules_version.set(version as i64);
    m.rules_loaded.set(set.rules.len() as i64);
    m.local_fallback_rules
        .set(set.local_fallback_rules.len() as i64);
    m.config_last_reload_ok.set(1);
    shared.rules.store(Arc::new(set));
    shared.config_error.store(None);
    shared.ready.store(true, Ordering::Release);
    Ok(())
}

async fn reload_loop(
    shared: Arc<Shared>,
    path: std::path::PathBuf,
    every: Duration,
    store: StoreConfig,
    global: Option<Arc<GlobalRuntime>>,
) {
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
        reload(&shared, &path, &mut version, &store, global.as_ref());
    }
}

fn reload(
    shared: &Shared,
    path: &Path,
    version: &mut u64,
    store: &StoreConfig,
    global: Option<&Arc<GlobalRuntime>>,
) {
    let result =
        files::load(path).map_err(|errs| errs.iter().map(ToString::to_string).collect::<Vec<_>>());
    let result = result.and_then(|policies| {
        install(shared, *version + 1, policies, store, global).map_err(|e| vec![e.to_string()])
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
            shared.metrics.config_errors.inc();
            shared.metrics.config_last_reload_ok.set(0);
            shared.config_error.store(Some(Arc::new(errors.join("\n"))));
        }
    }
}

async fn evict_loop(shared: Arc<Shared>) {
    let mut ticker = tokio::time::interval(EVICT_INTERVAL);
    loop {
        ticker.tick().await;
        let now = shared.clock.now();
        let evicted = shared.rules.load().evict_idle(now);
        if evicted > 0 {
            tracing::debug!(evicted, "evicted idle keys");
        }
    }
}

/// The demo policy, also checked in as manifests/examples/demo-local.yaml.
const DEMO_POLICY: &str = include_str!("../../../manifests/examples/demo-local.yaml");

/// `tollgate-sidecar demo`: a built-in upstream plus the sidecar enforcing the demo policy.
pub async fn run_demo(mut args: RunArgs) -> anyhow::Result<()> {
    let app = TcpListener::bind("127.0.0.1:0").await?;
    let app_addr = app.local_addr()?;
    tokio::spawn(demo_upstream(app));
    let dir = std::env::temp_dir().join(format!("tollgate-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let policy = dir.join("demo.yaml");
    std::fs::write(&policy, DEMO_POLICY)?;
    args.upstream = Some(format!("http://{app_addr}").parse()?);
    args.policies = Some(policy.clone());
    eprintln!(
        "tollgate demo: http://{listen} -> built-in app on {app_addr}\n\
         policy {policy} (edit it: changes apply within a second): 5 requests per 10 s per client\n\
         try:   for i in $(seq 7); do curl -s -o /dev/null -w '%{{http_code}}\\n' http://{listen}/; done\n\
         then:  curl -i http://{listen}/   and   curl http://{admin}/metrics\n",
        listen = args.listen,
        admin = args.admin,
        policy = policy.display(),
    );
    let result = run(args, tollgate_telemetry::shutdown_signal()).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn demo_upstream(listener: TcpListener) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let service = hyper::service::service_fn(|_req| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Full::new(
                bytes::Bytes::from_static(b"hello from the app behind tollgate\n"),
            )))
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        tokio::spawn(async move {
            let _ = conn.await;
        });
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
