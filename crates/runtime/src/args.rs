//! Options both binaries run with (`tollgate-sidecar` and `tollgate-ratelimit`): where rules
//! come from, Redis, the admin port, audit and key hashes, membership, logs and drain. Each
//! binary flattens them beside its own edge's options.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use tollgate_crd::duration::parse_flag;
use tollgate_telemetry::LogFormat;

/// Options of the runtime (each also settable through the `TOLLGATE_*` variable shown).
#[derive(Args, Debug, Clone)]
pub struct RuntimeArgs {
    /// RateLimitPolicy YAML: one file (multi-document allowed) or a directory of them.
    /// Standalone mode: enforced in memory and reloaded when the files change; a bad edit keeps
    /// the last good rules and is reported on the admin port.
    #[arg(long, env = "TOLLGATE_POLICIES")]
    pub policies: Option<PathBuf>,

    /// Address of the admin endpoints (/healthz, /readyz, /metrics, /debug/rules).
    #[arg(long, env = "TOLLGATE_ADMIN", default_value = "127.0.0.1:9091")]
    pub admin: SocketAddr,

    /// Answer /debug/* on the admin port from any address, not only loopback (where
    /// `kubectl port-forward` and `kubectl exec` arrive). Off by default: in a pod the admin
    /// port listens on the pod IP for the kubelet's probes and Prometheus, and
    /// `PUT /debug/log-level` changes logging.
    #[arg(long, env = "TOLLGATE_ADMIN_DEBUG_REMOTE")]
    pub admin_debug_remote: bool,

    /// Most client keys tracked per rule; beyond it new keys share an overflow bucket so a flood
    /// of distinct keys cannot exhaust memory.
    #[arg(long, env = "TOLLGATE_MAX_KEYS_PER_RULE", default_value_t = 1_000_000)]
    pub max_keys_per_rule: usize,

    /// Runtime worker threads; 0 uses the CPUs this process may run on (affinity and cgroup
    /// quota). 1 runs the whole proxy on a single thread, which is cheapest per request.
    #[arg(long, env = "TOLLGATE_WORKERS", default_value_t = 0)]
    pub workers: usize,

    /// How often policy files are checked for changes.
    #[arg(long, env = "TOLLGATE_RELOAD_INTERVAL", default_value = "1s", value_parser = parse_flag)]
    pub reload_interval: Duration,

    /// Most audit lines (429 rejections and fail-closed 503s) written per second; the rest are
    /// only counted.
    #[arg(long, env = "TOLLGATE_AUDIT_PER_SECOND", default_value_t = 100)]
    pub audit_per_second: u64,

    /// Put the raw counter key (API key, user, address) in audit lines instead of only its
    /// hash. Off by default: keys are often credentials or personal data.
    #[arg(long, env = "TOLLGATE_AUDIT_RAW_KEYS", default_value_t = false)]
    pub audit_raw_keys: bool,

    /// Secret under which counter keys get their stable key hash (the `key_hash` of audit
    /// lines and top keys, an HMAC-SHA256): the same file in every pod of an installation
    /// gives a client the same key hash everywhere and across restarts. A path that does not
    /// exist yet gets a generated secret (mode 0600). Without it, key hashes hold for this
    /// process only. See docs/operations.md (rotating it).
    #[arg(long, env = "TOLLGATE_KEY_HASH_SECRET_FILE")]
    pub key_hash_secret_file: Option<PathBuf>,

    /// How long SIGTERM waits for in-flight requests before closing connections.
    #[arg(long, env = "TOLLGATE_DRAIN_TIMEOUT", default_value = "20s", value_parser = parse_flag)]
    pub drain_timeout: Duration,

    /// tollgate-controller's rule stream, e.g. http://tollgate-controller.tollgate-system:8080.
    /// Rules and membership come from the controller instead of --policies files.
    #[arg(long, env = "TOLLGATE_CONTROLLER_URL", conflicts_with = "policies")]
    pub controller: Option<String>,

    /// PEM CA certificate(s) an `https://` controller must chain to, instead of the system
    /// roots (the injection webhook sets this to the controller's CA).
    #[arg(
        long,
        env = "TOLLGATE_CONTROLLER_CA",
        hide_env_values = true,
        conflicts_with = "controller_ca_file"
    )]
    pub controller_ca: Option<String>,

    /// File with the PEM CA certificate(s) an `https://` controller must chain to.
    #[arg(long, env = "TOLLGATE_CONTROLLER_CA_FILE")]
    pub controller_ca_file: Option<PathBuf>,

    /// This pod's name (downward API `metadata.name`), sent to the controller.
    #[arg(long, env = "TOLLGATE_POD_NAME")]
    pub pod_name: Option<String>,

    /// This pod's namespace (downward API `metadata.namespace`).
    #[arg(long, env = "TOLLGATE_POD_NAMESPACE")]
    pub pod_namespace: Option<String>,

    /// Projected ServiceAccount token presented to the controller (re-read at every connect).
    #[arg(
        long,
        env = "TOLLGATE_TOKEN_FILE",
        default_value = "/var/run/secrets/tollgate/token"
    )]
    pub token_file: PathBuf,

    /// Reconnect to the controller when nothing arrived for this long (heartbeats come every 5 s).
    #[arg(long, env = "TOLLGATE_CONTROLLER_IDLE_TIMEOUT", default_value = "15s", value_parser = parse_flag)]
    pub controller_idle_timeout: Duration,

    /// How often this sidecar sends the keys it rejected most to the controller, which merges
    /// them fleet-wide into each policy's `status.topLimitedKeys`. Only key hashes travel.
    #[arg(long, env = "TOLLGATE_TOP_KEYS_REPORT_INTERVAL", default_value = "10s", value_parser = parse_flag)]
    pub top_keys_report_interval: Duration,

    /// File keeping the last good rule set from the controller (the injection webhook mounts an
    /// `emptyDir` here). A sidecar that starts while the controller is unreachable enforces it
    /// instead of staying unready; written atomically, checked on read.
    #[arg(long, env = "TOLLGATE_RULES_CACHE", requires = "controller")]
    pub rules_cache: Option<PathBuf>,

    /// How long a sidecar that has no rules (none streamed, no usable cache) waits for the
    /// controller before `--without-rules` applies.
    #[arg(long, env = "TOLLGATE_RULES_WAIT", default_value = "30s", value_parser = parse_flag)]
    pub rules_wait: Duration,

    /// What a sidecar without rules does once `--rules-wait` is over: `pass-through` turns ready
    /// and forwards every request unlimited (reported by `tollgate_rules_passthrough` and a log
    /// line) so a controller outage cannot block a rollout; `unready` stays unready.
    #[arg(long, env = "TOLLGATE_WITHOUT_RULES", value_enum, default_value_t = WithoutRules::PassThrough)]
    pub without_rules: WithoutRules,

    /// Redis for global limits (`redis://host:port`, `rediss://` for TLS). Without it,
    /// `scope: Global` rules are enforced per sidecar. A `user:password@` in the URL works, but
    /// --redis-password-file keeps the password off the command line; the URL is only ever
    /// logged or shown with its password replaced by `***`.
    #[arg(long, env = "TOLLGATE_REDIS_URL", hide_env_values = true)]
    pub redis: Option<String>,

    /// Treat --redis as a comma-separated list of Redis Cluster seed nodes.
    #[arg(long, env = "TOLLGATE_REDIS_CLUSTER", default_value_t = false)]
    pub redis_cluster: bool,

    /// Find the Redis master through Redis Sentinel: --redis is then a comma-separated list of
    /// sentinels (`redis://host:26379`, `rediss://` for TLS to them and to the master) and
    /// this is the master's name as the sentinels know it. After a failover the sidecar asks
    /// the sentinels again and follows the promoted replica. --redis-username,
    /// --redis-password-file and the TLS files apply to the master.
    #[arg(
        long,
        env = "TOLLGATE_REDIS_SENTINEL",
        value_name = "MASTER_NAME",
        conflicts_with = "redis_cluster"
    )]
    pub redis_sentinel: Option<String>,

    /// File holding the password of the sentinels themselves (their `requirepass`), when they
    /// have one; read at every new connection like --redis-password-file.
    #[arg(
        long,
        env = "TOLLGATE_REDIS_SENTINEL_PASSWORD_FILE",
        requires = "redis_sentinel"
    )]
    pub redis_sentinel_password_file: Option<PathBuf>,

    /// Redis ACL user name (Redis 6+); overrides a user in the URL.
    #[arg(long, env = "TOLLGATE_REDIS_USERNAME")]
    pub redis_username: Option<String>,

    /// File holding the Redis password (a mounted Secret); overrides a password in the URL. Read
    /// at every new connection, so a rotated password is picked up without a restart. While it
    /// is missing or wrong, global rules follow their failure mode.
    #[arg(long, env = "TOLLGATE_REDIS_PASSWORD_FILE")]
    pub redis_password_file: Option<PathBuf>,

    /// PEM CA bundle the Redis server's certificate must chain to (needs `rediss://`); without
    /// it the system roots are used.
    #[arg(long, env = "TOLLGATE_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,

    /// PEM client certificate for Redis servers that require mutual TLS (`tls-auth-clients`).
    #[arg(
        long,
        env = "TOLLGATE_REDIS_CLIENT_CERT_FILE",
        requires = "redis_client_key_file"
    )]
    pub redis_client_cert_file: Option<PathBuf>,

    /// PEM private key of --redis-client-cert-file.
    #[arg(
        long,
        env = "TOLLGATE_REDIS_CLIENT_KEY_FILE",
        requires = "redis_client_cert_file"
    )]
    pub redis_client_key_file: Option<PathBuf>,

    /// Longest a request waits for Redis (cold keys, dry leases, strict rules) before the
    /// rule's failure mode applies (`accuracy: Strict` waits up to --sync-timeout if that is
    /// longer). Above the slowest round trips of a healthy, loaded Redis, so a fail-closed rule
    /// never answers 503 while Redis is fine; hot keys never wait (they spend leases).
    #[arg(long, env = "TOLLGATE_REDIS_TIMEOUT", default_value = "100ms", value_parser = parse_flag)]
    pub redis_timeout: Duration,

    /// How often leases are synced: unused tokens returned, hot keys topped up.
    #[arg(long, env = "TOLLGATE_SYNC_INTERVAL", default_value = "250ms", value_parser = parse_flag)]
    pub sync_interval: Duration,

    /// Timeout of one background sync round trip.
    #[arg(long, env = "TOLLGATE_SYNC_TIMEOUT", default_value = "100ms", value_parser = parse_flag)]
    pub sync_timeout: Duration,

    /// How long leased tokens stay spendable without a successful sync (bounds spending of
    /// already-leased tokens during an outage).
    #[arg(long, env = "TOLLGATE_LEASE_TTL", default_value = "1s", value_parser = parse_flag)]
    pub lease_ttl: Duration,

    /// Number of Redis hashes buckets are spread over; about active keys / 16 keeps each hash
    /// small and compactly encoded.
    #[arg(long, env = "TOLLGATE_REDIS_GROUPS", default_value_t = 65536)]
    pub redis_groups: u32,

    /// This sidecar's identity in membership (defaults to the pod name and process id).
    #[arg(long, env = "TOLLGATE_SIDECAR_ID")]
    pub sidecar_id: Option<String>,

    /// A sidecar that stops heartbeating leaves the membership count after this long.
    #[arg(long, env = "TOLLGATE_MEMBERSHIP_TTL", default_value = "5s", value_parser = parse_flag)]
    pub membership_ttl: Duration,

    /// Export traces over OTLP/HTTP to this collector (e.g. http://otel-collector:4318). Off by
    /// default; when off no span is created on the request path.
    #[arg(long, env = "TOLLGATE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// PEM CA the `https://` OTLP collector's certificate must chain to (instead of the system
    /// roots); else `OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE` or `OTEL_EXPORTER_OTLP_CERTIFICATE`.
    #[arg(long, env = "TOLLGATE_OTLP_CA_FILE")]
    pub otlp_ca_file: Option<PathBuf>,

    /// Log format: json (default, for log pipelines) or text.
    #[arg(long, env = "TOLLGATE_LOG_FORMAT", default_value = "json")]
    pub log_format: LogFormat,

    /// Log filter, e.g. `info` or `info,tollgate::audit=off` (RUST_LOG syntax).
    #[arg(long, env = "TOLLGATE_LOG", default_value = "info")]
    pub log: String,
}

/// Start-up mode of a sidecar that has no rules after `--rules-wait`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WithoutRules {
    /// Ready, every request forwarded without limits.
    PassThrough,
    /// Not ready until rules arrive.
    Unready,
}
