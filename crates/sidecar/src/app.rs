//! The sidecar's wiring: the runtime every tollgate binary runs (`tollgate_runtime::wiring`),
//! plus its edge, the HTTP proxy. Start-up is a list of calls: read each component's config,
//! build it (ports bound), spawn the background tasks, serve until shutdown, drain.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tollgate_http::proxy::{self, Proxy, ProxyConfig};
use tollgate_runtime::wiring::{Runtime, RuntimeConfig};

use crate::args::RunArgs;

/// The proxy edge, read from the flags.
pub struct EdgeConfig {
    listen: SocketAddr,
    proxy: ProxyConfig,
}

impl EdgeConfig {
    pub fn from_args(args: &RunArgs) -> anyhow::Result<EdgeConfig> {
        let upstream = args.upstream.clone().context(
            "--upstream (TOLLGATE_UPSTREAM) is required, e.g. --upstream http://127.0.0.1:8080 \
             (or run tollgate-ratelimit to serve Envoy's rate limit service instead)",
        )?;
        Ok(EdgeConfig {
            listen: args.listen,
            proxy: ProxyConfig {
                upstream,
                upstream_timeout: args.upstream_timeout,
                header_read_timeout: args.header_read_timeout,
                max_header_bytes: args.max_header_bytes,
                shadow_header: args.shadow_header,
                fast_http1: args.fast_http1,
            },
        })
    }

    /// The proxy on the engine of `runtime`, its port bound now (a port in use stops start-up).
    pub async fn build(self, runtime: &Runtime) -> anyhow::Result<Edge> {
        let proxy = Arc::new(Proxy::new(Arc::clone(runtime.shared()), self.proxy)?);
        let listener = TcpListener::bind(self.listen)
            .await
            .with_context(|| format!("cannot listen on {}", self.listen))?;
        Ok(Edge { listener, proxy })
    }
}

/// The bound proxy edge.
pub struct Edge {
    listener: TcpListener,
    proxy: Arc<Proxy>,
}

/// Runs the sidecar until `shutdown` resolves, then drains: the proxy finishes its in-flight
/// requests (up to `--drain-timeout`), the background tasks stop, leases go back to Redis.
pub async fn run(
    args: RunArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let edge = EdgeConfig::from_args(&args)?;
    let runtime = RuntimeConfig::from_args(&args.runtime)?.build().await?;
    let edge = edge.build(&runtime).await?;
    let redis = runtime.redis_redacted();
    tracing::info!(
        listen = %edge.listener.local_addr()?,
        admin = %runtime.admin_addr()?,
        upstream = %edge.proxy.config.upstream,
        edge = "http proxy",
        rules = %runtime.source(),
        redis = redis.as_deref(),
        "tollgate-sidecar started"
    );
    let drain = runtime.drain_timeout();
    let running = runtime.spawn();
    proxy::serve(edge.listener, edge.proxy, shutdown, drain).await;
    running.shutdown().await;
    tracing::info!("tollgate-sidecar stopped");
    Ok(())
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
    args.runtime.policies = Some(policy.clone());
    eprintln!(
        "tollgate demo: http://{listen} -> built-in app on {app_addr}\n\
         policy {policy} (edit it: changes apply within a second): 5 requests per 10 s per client\n\
         try:   for i in $(seq 7); do curl -s -o /dev/null -w '%{{http_code}}\\n' http://{listen}/; done\n\
         then:  curl -i http://{listen}/   and   curl http://{admin}/metrics\n",
        listen = args.listen,
        admin = args.runtime.admin,
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
