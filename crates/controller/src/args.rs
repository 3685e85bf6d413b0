//! Command-line flags; each also reads a `TOLLGATE_*` environment variable.

use std::net::SocketAddr;
use std::time::Duration;

use tollgate_crd::duration::parse_flag;

use clap::Parser;
use tollgate_telemetry::LogFormat;

/// tollgate-controller: compiles RateLimitPolicies, streams them to sidecars, writes status.
///
/// Connects to Kubernetes through the in-cluster service account or `KUBECONFIG`.
#[derive(Parser, Debug, Clone)]
#[command(name = "tollgate-controller", version, about, long_about = None)]
pub struct Args {
    /// Address of the rule-stream server (also serves /healthz, /readyz and /metrics).
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "0.0.0.0:8090")]
    pub listen: SocketAddr,

    /// Also serve the rule stream (and the same endpoints) over TLS on this address, with the
    /// webhook's serving certificate from `--webhook-cert-dir` (self-signed or cert-manager);
    /// injected sidecars then connect with https and trust that certificate's CA.
    #[arg(long, env = "TOLLGATE_TLS_LISTEN")]
    pub tls_listen: Option<SocketAddr>,

    /// Serve the rule stream (`/v1/watch`, `/v1/ack`) on the plain `--listen` address too.
    /// Set false with `--tls-listen` once every injected sidecar uses https, so no sidecar token
    /// crosses the network in the clear; health and metrics stay on the plain address.
    #[arg(long, env = "TOLLGATE_PLAIN_STREAM", default_value_t = true, action = clap::ArgAction::Set)]
    pub plain_stream: bool,

    /// Namespaces to watch (repeat the flag or separate with commas); all namespaces if unset.
    #[arg(long = "namespace", env = "TOLLGATE_NAMESPACES", value_delimiter = ',')]
    pub namespaces: Vec<String>,

    /// Label selector restricting which pods are indexed, e.g. `tollgate.dev/inject=true`.
    /// Pods outside it cannot open a rule stream.
    #[arg(long, env = "TOLLGATE_POD_SELECTOR")]
    pub pod_selector: Option<String>,

    /// Heartbeat interval of idle rule streams.
    #[arg(long, env = "TOLLGATE_HEARTBEAT_INTERVAL", default_value = "5s", value_parser = parse_flag)]
    pub heartbeat_interval: Duration,

    /// How long a stream request for a pod the watch has not delivered yet waits before 404.
    #[arg(long, env = "TOLLGATE_UNKNOWN_POD_GRACE", default_value = "2s", value_parser = parse_flag)]
    pub unknown_pod_grace: Duration,

    /// Audiences a sidecar token must be issued for (TokenReview `spec.audiences`); any
    /// audience the API server accepts when unset.
    #[arg(
        long = "token-audience",
        env = "TOLLGATE_TOKEN_AUDIENCES",
        value_delimiter = ','
    )]
    pub token_audiences: Vec<String>,

    /// How long a successful token review is cached.
    #[arg(long, env = "TOLLGATE_TOKEN_CACHE_TTL", default_value = "60s", value_parser = parse_flag)]
    pub token_cache_ttl: Duration,

    /// Elect a leader with a Lease; only the leader writes status. Disable for a single replica
    /// without Lease permissions.
    #[arg(long, env = "TOLLGATE_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_election: bool,

    /// Name of the Lease used for leader election.
    #[arg(
        long,
        env = "TOLLGATE_LEASE_NAME",
        default_value = "tollgate-controller"
    )]
    pub lease_name: String,

    /// Namespace of the Lease; defaults to the service account's (or kubeconfig's) namespace.
    #[arg(long, env = "TOLLGATE_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,

    /// Secret (in the lease namespace) holding the installation's key-hash secret, which the
    /// controller hands to every sidecar over the rule stream so that a client has one
    /// identity (`key_hash`) in the audit lines and top keys of every pod. The chart creates
    /// it empty; the controller fills it once with 32 random bytes and never changes it.
    /// Empty: no secret (sidecars use per-process identities).
    #[arg(
        long,
        env = "TOLLGATE_KEY_HASH_SECRET",
        default_value = "tollgate-key-hash"
    )]
    pub key_hash_secret: String,

    /// How long the Lease stays valid without renewal.
    #[arg(long, env = "TOLLGATE_LEASE_DURATION", default_value = "15s", value_parser = parse_flag)]
    pub lease_duration: Duration,

    /// Share membership with the other replicas through per-replica Leases (in the lease
    /// namespace), so member counts and status cover sidecars connected to any replica.
    #[arg(long, env = "TOLLGATE_PEER_MEMBERSHIP", default_value_t = true, action = clap::ArgAction::Set)]
    pub peer_membership: bool,

    /// This replica's identity in the Lease and in Events; defaults to `POD_NAME` or the host name.
    #[arg(long, env = "TOLLGATE_IDENTITY")]
    pub identity: Option<String>,

    /// This replica's Pod (name and UID, from the downward API): its membership Lease is owned
    /// by the Pod, so the garbage collector removes the Lease with the Pod even when the
    /// controller could not (an uninstall deletes the RBAC before the Pods stop).
    #[arg(long, env = "POD_UID")]
    pub pod_uid: Option<String>,

    /// Minimum time between two status writes of one policy.
    #[arg(long, env = "TOLLGATE_STATUS_MIN_INTERVAL", default_value = "1s", value_parser = parse_flag)]
    pub status_min_interval: Duration,

    /// The span of `status.topLimitedKeys`: sidecars' rejections are counted over this long.
    #[arg(long, env = "TOLLGATE_TOP_KEYS_WINDOW", default_value = "10m", value_parser = parse_flag)]
    pub top_keys_window: Duration,

    /// How often the fleet's top limited keys are merged into status (and shared with peer
    /// replicas); an unchanged list writes nothing.
    #[arg(long, env = "TOLLGATE_TOP_KEYS_INTERVAL", default_value = "30s", value_parser = parse_flag)]
    pub top_keys_interval: Duration,

    /// How often the leader looks for pods a policy selects that run without the sidecar
    /// (Events, `status.podsWithoutSidecar`, `tollgate_controller_pods_without_sidecar`).
    #[arg(long, env = "TOLLGATE_COVERAGE_INTERVAL", default_value = "15s", value_parser = parse_flag)]
    pub coverage_interval: Duration,

    /// Evict such pods when a ReplicaSet, StatefulSet, DaemonSet or ReplicationController owns
    /// them, so they come back through the injection webhook (PodDisruptionBudgets apply; one
    /// pod per owner at a time; an owner whose new pod has no sidecar either is left alone).
    #[arg(long, env = "TOLLGATE_RESTART_PODS_WITHOUT_SIDECAR", default_value_t = false, action = clap::ArgAction::Set)]
    pub restart_pods_without_sidecar: bool,

    /// Do not run the controller: tell every replica that tollgate is being removed, wait
    /// `--retire-wait`, and exit (the chart's `pre-delete` hook). Creates the Lease
    /// `<--lease-name>-retire` in `--lease-namespace`; a replica that sees it streams an empty
    /// rule set to every sidecar (they enforce nothing from then on, and their rules cache
    /// holds nothing) and ignores policies until it exits.
    #[arg(long, default_value_t = false)]
    pub retire: bool,

    /// With `--retire`: how long the running replicas get to push the empty rule set.
    #[arg(long, default_value = "15s", value_parser = parse_flag)]
    pub retire_wait: Duration,

    /// How long open streams get to close on shutdown.
    #[arg(long, env = "TOLLGATE_SHUTDOWN_GRACE", default_value = "5s", value_parser = parse_flag)]
    pub shutdown_grace: Duration,

    /// Log format.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log filter (tracing `EnvFilter` syntax); `RUST_LOG` overrides it.
    #[arg(long, env = "TOLLGATE_LOG", default_value = "info")]
    pub log: String,

    /// Export traces over OTLP/HTTP to this collector (e.g. http://otel-collector:4318); the
    /// standard `OTEL_EXPORTER_OTLP_ENDPOINT` is used when unset. Off by default; when off no
    /// span is created.
    #[arg(long, env = "TOLLGATE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// PEM CA the `https://` OTLP collector's certificate must chain to (instead of the system
    /// roots); else `OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE` or `OTEL_EXPORTER_OTLP_CERTIFICATE`.
    #[arg(long, env = "TOLLGATE_OTLP_CA_FILE")]
    pub otlp_ca_file: Option<std::path::PathBuf>,

    /// Admission webhooks and the injected sidecar.
    #[command(flatten)]
    pub webhook: crate::webhook::args::WebhookArgs,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_lists_parse() {
        let a = Args::try_parse_from(["tollgate-controller"]).unwrap();
        assert_eq!(a.listen.port(), 8090);
        assert!(a.namespaces.is_empty());
        assert_eq!(a.heartbeat_interval, Duration::from_secs(5));
        assert!(a.leader_election);
        let a = Args::try_parse_from([
            "tollgate-controller",
            "--namespace",
            "a,b",
            "--namespace=c",
            "--leader-election=false",
            "--heartbeat-interval=250ms",
        ])
        .unwrap();
        assert_eq!(a.namespaces, ["a", "b", "c"]);
        assert!(!a.leader_election);
        assert_eq!(a.heartbeat_interval, Duration::from_millis(250));
        assert!(
            Args::try_parse_from(["tollgate-controller", "--heartbeat-interval=soon"]).is_err()
        );
    }
}
