//! tollgate-ratelimit: Envoy's rate limit services on one gRPC port (h2c): RLS v3
//! `ShouldRateLimit` (the descriptors of `envoy.filters.http.ratelimit`) and RLQS v3
//! `StreamRateLimitQuotas` (the buckets of `envoy.filters.http.rate_limit_quota`), with the
//! same rules, keys, leases and failure modes as the sidecar. Only the edge is its own: the
//! runtime around it is `tollgate-runtime`'s.

use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tokio::net::TcpListener;
use tollgate_crd::duration::parse_flag;
use tollgate_envoy::rlqs::{QuotaEdge, QuotaSettings};
use tollgate_runtime::args::RuntimeArgs;
use tollgate_runtime::wiring::{Running, Runtime, RuntimeConfig};

/// `tollgate-ratelimit [OPTIONS]` (each option also settable through the `TOLLGATE_*` variable
/// shown).
#[derive(Parser, Debug, Clone)]
#[command(
    name = "tollgate-ratelimit",
    version,
    about = "Envoy's rate limit services (RLS v3 and RLQS) enforcing tollgate RateLimitPolicies"
)]
pub struct Args {
    /// Address Envoy's gRPC calls (RLS and RLQS, h2c) arrive on.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,

    /// RLQS: how long an Envoy may use an assignment without hearing from this service again.
    /// After it, the Envoy filter's `expired_assignment_behavior` applies (derive it from the
    /// rule's failureMode). Longer than Envoy's `reporting_interval`: each report renews the
    /// assignments.
    #[arg(long, env = "TOLLGATE_RLQS_ASSIGNMENT_TTL", default_value = "10s", value_parser = parse_flag)]
    pub rlqs_assignment_ttl: Duration,

    /// RLQS: how often this replica shares its Envoys' demand per bucket with the other
    /// replicas through Redis (and reads theirs).
    #[arg(long, env = "TOLLGATE_RLQS_SYNC_INTERVAL", default_value = "500ms", value_parser = parse_flag)]
    pub rlqs_sync_interval: Duration,

    #[command(flatten)]
    pub runtime: RuntimeArgs,
}

/// The gRPC edge, read from the flags.
pub struct ServiceConfig {
    listen: SocketAddr,
    assignment_ttl: Duration,
    sync_interval: Duration,
}

impl ServiceConfig {
    pub fn from_args(args: &Args) -> ServiceConfig {
        ServiceConfig {
            listen: args.listen,
            assignment_ttl: args.rlqs_assignment_ttl,
            sync_interval: args.rlqs_sync_interval,
        }
    }

    /// Binds the gRPC port now, so a port in use stops start-up.
    pub async fn build(self, runtime: &Runtime) -> anyhow::Result<Service> {
        let listener = TcpListener::bind(self.listen)
            .await
            .with_context(|| format!("cannot listen on {}", self.listen))?;
        let quota = QuotaEdge::new(
            std::sync::Arc::clone(runtime.shared()),
            QuotaSettings {
                assignment_ttl: self.assignment_ttl,
                sync_interval: self.sync_interval,
                replica: runtime.member_id().to_string(),
            },
        );
        Ok(Service { listener, quota })
    }
}

/// The bound gRPC edge.
pub struct Service {
    listener: TcpListener,
    quota: QuotaEdge,
}

impl Service {
    /// The RLQS demand exchange with the other replicas (through Redis).
    fn spawn_fleet(&self, running: &mut Running) {
        running.spawn_until_stopped(tollgate_envoy::rlqs::fleet_loop(self.quota.clone()));
    }
}

/// Runs the rate limit service until `shutdown` resolves, then drains it.
pub async fn run(args: Args, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let config = RuntimeConfig::from_args(&args.runtime)?;
    let runtime = config.build().await?;
    let service = ServiceConfig::from_args(&args).build(&runtime).await?;
    let redis = runtime.redis_redacted();
    tracing::info!(
        listen = %service.listener.local_addr()?,
        admin = %runtime.admin_addr()?,
        edge = "envoy rate limit service (RLS v3 and RLQS)",
        rules = %runtime.source(),
        redis = redis.as_deref(),
        "tollgate-ratelimit started"
    );
    let (shared, drain) = (
        std::sync::Arc::clone(runtime.shared()),
        runtime.drain_timeout(),
    );
    let mut running = runtime.spawn();
    service.spawn_fleet(&mut running);
    tollgate_envoy::rls::serve(service.listener, shared, service.quota, shutdown, drain).await;
    running.shutdown().await;
    tracing::info!("tollgate-ratelimit stopped");
    Ok(())
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let args = Args::parse();
    tollgate_runtime::init_telemetry(&args.runtime, "tollgate-ratelimit");
    let workers = args.runtime.workers;
    let result =
        tollgate_runtime::block_on(workers, run(args, tollgate_telemetry::shutdown_signal()));
    tollgate_runtime::exit_code("tollgate-ratelimit", result)
}
