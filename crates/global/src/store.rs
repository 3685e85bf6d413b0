//! Redis access for global limits: the lease and membership scripts, batching, timeouts and the
//! circuit breaker.
//!
//! Every state change is one Lua script reading Redis `TIME`; scripts are sent by SHA and
//! reloaded when Redis answers NOSCRIPT (after a restart or failover). Every call has a timeout
//! and reports to the breaker, so a slow or dead Redis costs a request at most one timeout and
//! then nothing until the breaker lets a probe through.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::ConnectionLike;
use tollgate_limiter::{Clock, MonotonicClock, Nanos};

const LEASE_LUA: &str = include_str!("lease.lua");
/// Most buckets one lease script call decides: a bucket costs Redis tens of microseconds, so
/// a call holds Redis for a few milliseconds at most, and a round of many keys still costs
/// one command per 64 of them instead of one per key.
pub const MAX_LEASE_BATCH: usize = 64;
/// Most RLQS buckets one fleet-exchange script call carries (a bucket costs Redis a hash read
/// and write).
pub const MAX_SHARE_BATCH: usize = 128;
const MEMBERS_LUA: &str = include_str!("members.lua");
const SHARE_LUA: &str = include_str!("share.lua");

/// Why a Redis call failed. Every kind is transient from the limiter's point of view: the rule's
/// failure mode applies and the breaker decides when to try again.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("redis call timed out after {0:?}")]
    Timeout(Duration),
    #[error("redis unavailable (circuit breaker open)")]
    BreakerOpen,
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected script reply: {0}")]
    BadReply(String),
    /// A credential or certificate file cannot be used, or the options contradict each other.
    /// The message names the flag and the path, never a secret.
    #[error("redis configuration: {0}")]
    Config(String),
}

impl StoreError {
    /// Metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::BreakerOpen => "breaker_open",
            _ if self.is_auth() => "auth",
            StoreError::Redis(e) if e.is_connection_dropped() || e.is_connection_refusal() => {
                "connection"
            }
            StoreError::Redis(e) if e.kind() == redis::ErrorKind::Io => "connection",
            // The node is no longer the master (a failover demoted it) or has none.
            StoreError::Redis(e)
                if matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING")) =>
            {
                "not_master"
            }
            StoreError::Redis(_) => "error",
            StoreError::BadReply(_) => "bad_reply",
            StoreError::Config(_) => "config",
        }
    }

    /// Whether Redis refused the credentials (wrong password or user, or none given).
    pub fn is_auth(&self) -> bool {
        let StoreError::Redis(e) = self else {
            return false;
        };
        if e.kind() == redis::ErrorKind::AuthenticationFailed {
            return true;
        }
        // The cluster client wraps the cause ("Failed to create initial connections - ...").
        let code = e.code().unwrap_or_default();
        let text = e.to_string();
        ["WRONGPASS", "NOAUTH", "NOPERM", "AuthenticationFailed"]
            .iter()
            .any(|c| code == *c || text.contains(c))
    }
}

/// How to reach and authenticate to Redis. Secrets stay in files that are read at every new
/// connection (a rotated password or certificate is picked up without a restart); the URL is
/// only ever shown redacted ([`redact_url`]).
#[derive(Clone, Default)]
pub struct RedisOptions {
    /// `redis://` or `rediss://` (TLS) URL; with `cluster`, a comma-separated list of seeds.
    /// May carry `user:password@`, though `password_file` keeps the password off the command
    /// line and out of the environment.
    pub url: String,
    pub cluster: bool,
    /// Master name: `url` lists sentinels, which say where the master is.
    pub sentinel_master: Option<String>,
    /// File holding the sentinels' own password (their `requirepass`).
    pub sentinel_password_file: Option<PathBuf>,
    /// ACL user (Redis 6+); overrides a user in the URL.
    pub username: Option<String>,
    /// File whose content (one trailing newline ignored) is the password; overrides the URL's.
    pub password_file: Option<PathBuf>,
    /// PEM CA bundle the server certificate must chain to, instead of the system roots.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain and key, for servers that require mutual TLS.
    pub client_cert_file: Option<PathBuf>,
    pub client_key_file: Option<PathBuf>,
}

impl std::fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisOptions")
            .field("url", &redact_url(&self.url))
            .field("cluster", &self.cluster)
            .field("sentinel_master", &self.sentinel_master)
            .field("sentinel_password_file", &self.sentinel_password_file)
            .field("username", &self.username)
            .field("password_file", &self.password_file)
            .field("ca_file", &self.ca_file)
            .field("client_cert_file", &self.client_cert_file)
            .field("client_key_file", &self.client_key_file)
            .finish()
    }
}

/// The URL(s) with every password replaced by `***` (the user name is kept). Anything between
/// `://` and the last `@` that follows a `:` is treated as a password, so an unescaped `/`, `@`
/// or `#` in a password cannot make part of it visible.
pub fn redact_url(urls: &str) -> String {
    urls.split(',')
        .map(|u| {
            let u = u.trim();
            let Some((scheme, rest)) = u.split_once("://") else {
                return if u.contains('@') {
                    "<redacted>".to_string()
                } else {
                    u.to_string()
                };
            };
            match rest.rsplit_once('@') {
                Some((userinfo, host)) => match userinfo.split_once(':') {
                    Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                    None => format!("{scheme}://{userinfo}@{host}"),
                },
                None => u.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl RedisOptions {
    /// Options for a URL (or seed list) without files.
    pub fn new(url: &str, cluster: bool) -> RedisOptions {
        RedisOptions {
            url: url.to_string(),
            cluster,
            ..RedisOptions::default()
        }
    }

    fn urls(&self) -> Vec<&str> {
        if self.cluster || self.sentinel_master.is_some() {
            self.url.split(',').map(str::trim).collect()
        } else {
            vec![self.url.trim()]
        }
    }

    /// The URL(s) for logs and `/debug/config`.
    pub fn redacted(&self) -> String {
        redact_url(&self.url)
    }

    /// Whether connections use TLS (`rediss://`).
    pub fn tls(&self) -> bool {
        self.urls().iter().all(|u| u.starts_with("rediss://"))
    }

    /// Checks what can be checked without reading files or connecting. Messages never
    /// contain the URL unredacted.
    pub fn validate(&self) -> Result<(), StoreError> {
        use redis::IntoConnectionInfo;
        let urls = self.urls();
        for u in &urls {
            u.into_connection_info().map_err(|e| {
                StoreError::Config(format!(
                    "{} is not a Redis URL (redis://host:port or rediss://host:port): {e}",
                    redact_url(u)
                ))
            })?;
        }
        if self.cluster && self.sentinel_master.is_some() {
            return Err(StoreError::Config(
                "--redis-cluster and --redis-sentinel exclude each other".into(),
            ));
        }
        if self
            .sentinel_master
            .as_deref()
            .is_some_and(|m| m.trim().is_empty())
        {
            return Err(StoreError::Config(
                "--redis-sentinel needs the master's name as the sentinels know it".into(),
            ));
        }
        let tls = urls.iter().filter(|u| u.starts_with("rediss://")).count();
        if tls != 0 && tls != urls.len() {
            return Err(StoreError::Config(
                "mix of redis:// and rediss:// seeds; use one scheme".into(),
            ));
        }
        let files = [
            ("--redis-ca-file", &self.ca_file),
            ("--redis-client-cert-file", &self.client_cert_file),
            ("--redis-client-key-file", &self.client_key_file),
        ];
        for (flag, file) in files {
            if file.is_some() && tls == 0 {
                return Err(StoreError::Config(format!(
                    "{flag} needs a rediss:// URL (TLS); refusing to connect in plain text"
                )));
            }
        }
        if self.ca_file.is_some() && urls.iter().any(|u| u.ends_with("#insecure")) {
            return Err(StoreError::Config(
                "--redis-ca-file and #insecure (no certificate check) contradict each other".into(),
            ));
        }
        if self.client_cert_file.is_some() != self.client_key_file.is_some() {
            return Err(StoreError::Config(
                "--redis-client-cert-file and --redis-client-key-file go together".into(),
            ));
        }
        Ok(())
    }

    fn read(flag: &str, path: &PathBuf) -> Result<Vec<u8>, StoreError> {
        std::fs::read(path)
            .map_err(|e| StoreError::Config(format!("cannot read {flag} {}: {e}", path.display())))
    }

    /// The password from `password_file`, if set (a trailing newline is not part of it).
    fn password(&self) -> Result<Option<String>, StoreError> {
        Self::password_from("--redis-password-file", self.password_file.as_ref())
    }

    fn password_from(flag: &str, path: Option<&PathBuf>) -> Result<Option<String>, StoreError> {
        let Some(path) = path else {
            return Ok(None);
        };
        let bytes = Self::read(flag, path)?;
        let text = String::from_utf8(bytes)
            .map_err(|_| StoreError::Config(format!("{flag} {} is not UTF-8", path.display())))?;
        let password = text
            .strip_suffix("\r\n")
            .or_else(|| text.strip_suffix('\n'))
            .unwrap_or(&text);
        if password.is_empty() {
            return Err(StoreError::Config(format!(
                "{flag} {} is empty",
                path.display()
            )));
        }
        Ok(Some(password.to_string()))
    }

    /// Certificates from the files, when any is set.
    fn certificates(&self) -> Result<Option<redis::TlsCertificates>, StoreError> {
        let root_cert = match &self.ca_file {
            Some(p) => Some(Self::read("--redis-ca-file", p)?),
            None => None,
        };
        let client_tls = match (&self.client_cert_file, &self.client_key_file) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: Self::read("--redis-client-cert-file", cert)?,
                client_key: Self::read("--redis-client-key-file", key)?,
            }),
            _ => None,
        };
        if root_cert.is_none() && client_tls.is_none() {
            return Ok(None);
        }
        Ok(Some(redis::TlsCertificates {
            client_tls,
            root_cert,
        }))
    }

    /// Connects once: reads the files, builds the client, authenticates.
    async fn connect(&self) -> Result<Conn, StoreError> {
        use redis::IntoConnectionInfo;
        let password = self.password()?;
        let certs = self.certificates()?;
        if self.cluster {
            let mut builder = redis::cluster::ClusterClient::builder(self.urls())
                .connection_timeout(Duration::from_secs(2))
                .response_timeout(Duration::from_secs(2));
            if let Some(user) = &self.username {
                builder = builder.username(user);
            }
            if let Some(pw) = &password {
                builder = builder.password(pw);
            }
            if let Some(certs) = certs {
                builder = builder.certs(certs);
            }
            let client = builder.build()?;
            return Ok(Conn::Cluster(client.get_async_connection().await?));
        }
        if let Some(master) = &self.sentinel_master {
            let client = self.master_from_sentinels(master, password, certs).await?;
            return Ok(Conn::Single(Self::manager(client).await?));
        }
        let info = self.url.trim().into_connection_info()?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &self.username {
            settings = settings.set_username(user);
        }
        if let Some(pw) = &password {
            settings = settings.set_password(pw);
        }
        let info = info.set_redis_settings(settings);
        let client = match certs {
            Some(certs) => redis::Client::build_with_tls(info, certs)?,
            None => redis::Client::open(info)?,
        };
        Ok(Conn::Single(Self::manager(client).await?))
    }

    async fn manager(client: redis::Client) -> Result<redis::aio::ConnectionManager, StoreError> {
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(1);
        Ok(client.get_connection_manager_with_config(config).await?)
    }

    /// Asks the sentinels where the master is (the first sentinel that answers, with the
    /// master's `ROLE` checked) and returns a client for it. Called at every (re)connect, so
    /// a failover is followed at the first error on the old master's connection.
    async fn master_from_sentinels(
        &self,
        master: &str,
        password: Option<String>,
        certs: Option<redis::TlsCertificates>,
    ) -> Result<redis::Client, StoreError> {
        use redis::IntoConnectionInfo;
        use redis::sentinel::{SentinelClientBuilder, SentinelServerType};
        let mut sentinels = Vec::new();
        let mut sentinel_password = Self::password_from(
            "--redis-sentinel-password-file",
            self.sentinel_password_file.as_ref(),
        )?;
        for url in self.urls() {
            let info = url.into_connection_info()?;
            if sentinel_password.is_none() {
                sentinel_password = info.redis_settings().password().map(str::to_string);
            }
            sentinels.push(info.addr().clone());
        }
        let mut builder =
            SentinelClientBuilder::new(sentinels, master.trim(), SentinelServerType::Master)?;
        if self.tls() {
            let insecure = self.urls().iter().any(|u| u.ends_with("#insecure"));
            let mode = if insecure {
                redis::TlsMode::Insecure
            } else {
                redis::TlsMode::Secure
            };
            builder = builder
                .set_client_to_redis_tls_mode(mode)
                .set_client_to_sentinel_tls_mode(mode);
            if let Some(certs) = certs {
                builder = builder
                    .set_client_to_redis_certificates(certs.clone())
                    .set_client_to_sentinel_certificates(certs);
            }
        }
        if let Some(user) = &self.username {
            builder = builder.set_client_to_redis_username(user);
        }
        if let Some(pw) = &password {
            builder = builder.set_client_to_redis_password(pw);
        }
        if let Some(pw) = &sentinel_password {
            builder = builder.set_client_to_sentinel_password(pw);
        }
        let mut client = builder.build()?;
        Ok(client.async_get_client().await?)
    }
}

/// One lease/return against a bucket.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseOp {
    pub group: u32,
    pub field: [u8; 16],
    pub algorithm: u8,
    pub requests: u64,
    pub period_ms: u64,
    pub burst: u64,
    pub want: u64,
    pub give_back: u64,
    pub back_window: u64,
    pub all_or_nothing: bool,
    /// Tokens owed (costs settled at the response beyond what was held), taken even into debt.
    pub force: u64,
    /// Token buckets: how far ahead (ms) a grant may reach into tokens not yet refilled. A
    /// saturated key reserves its next interval in one call; the slot releases each such token
    /// at the time it becomes conformant (`LeaseReply::ready_us`).
    pub ahead_ms: u64,
    /// Token buckets: requests seen at this sidecar (admitted and refused) since its last
    /// report, so Redis splits a contested bucket's refill by demand (0: nothing to report).
    pub demand: u64,
    /// The period (ms) demand is reported over: the sync interval (0: no demand split).
    pub share_ms: u64,
    /// The rule's `blockFor` (ms; 0: none): the script then looks for a block of this bucket
    /// published by any sidecar and grants nothing while it lasts (`LeaseReply::blocked_ms`).
    pub block_ms: u64,
    /// Identifies the settlement `force` carries (0: none). Redis remembers it for
    /// [`SETTLEMENT_ID_TTL`] and applies a settlement once, so one sent again after a call whose
    /// outcome is unknown (a timeout that did reach Redis) is not charged twice.
    pub settle_id: u64,
}

/// How long Redis remembers a settlement id (the script's `SET ... PX`). A settlement is sent
/// again only within [`SETTLEMENT_RETRY_FOR`], less than this, so a retry always finds the id
/// of a first attempt that landed.
pub const SETTLEMENT_ID_TTL: Duration = Duration::from_secs(60);
/// How long a settlement that did not reach Redis is retried; then it is dropped (errs
/// towards admitting more, by at most the dropped cost).
pub const SETTLEMENT_RETRY_FOR: Duration = Duration::from_secs(50);

/// What the script answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LeaseReply {
    pub granted: u64,
    /// Tokens left in the global bucket after the grant.
    pub remaining: u64,
    pub reset_ms: u64,
    pub retry_after_ms: u64,
    /// Window index for window algorithms (to return tokens to the right window).
    pub window: u64,
    /// How long after the reply the last granted token becomes conformant (token buckets
    /// granting ahead); 0 when every granted token is spendable now.
    pub ready_us: u64,
    /// How much longer the bucket's key stays blocked (`blockFor`, published by the sidecar
    /// that blocked it); 0 when not blocked.
    pub blocked_ms: u64,
}

/// Parses a lease script reply; anything but seven non-negative integers is an error.
pub fn parse_lease_reply(v: &redis::Value) -> Result<LeaseReply, StoreError> {
    match parse_lease_replies(v, 1)?.pop() {
        Some(r) => Ok(r),
        None => Err(StoreError::BadReply(format!("{v:?}"))),
    }
}

/// Runs a pipeline of `script`'s calls on one node; when Redis no longer has the script (it
/// restarted or failed over), loads it once and runs the pipeline again.
async fn query_loading<C: ConnectionLike>(
    script: &redis::Script,
    pipe: &redis::Pipeline,
    conn: &mut C,
) -> Result<Vec<redis::Value>, StoreError> {
    match pipe.query_async(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.prepare_invoke().load_async(conn).await?;
            Ok(pipe.query_async(conn).await?)
        }
        other => Ok(other?),
    }
}

/// The flat reply of a script call for `n` buckets of `width` fields each, as one row per
/// bucket.
fn bucket_rows(
    v: &redis::Value,
    n: usize,
    width: usize,
) -> Result<std::slice::ChunksExact<'_, redis::Value>, StoreError> {
    let redis::Value::Array(items) = v else {
        return Err(StoreError::BadReply(format!("{v:?}")));
    };
    if items.len() != width * n {
        return Err(StoreError::BadReply(format!(
            "{} items for {n} buckets",
            items.len()
        )));
    }
    Ok(items.chunks_exact(width))
}

/// A reply field the scripts only ever answer with a non-negative integer.
fn non_negative(item: &redis::Value) -> Result<u64, StoreError> {
    match item {
        redis::Value::Int(i) if *i >= 0 => Ok(*i as u64),
        other => Err(StoreError::BadReply(format!("{other:?}"))),
    }
}

/// Parses the reply of a fleet-exchange call for `n` RLQS buckets: three fields each.
fn parse_share_replies(v: &redis::Value, n: usize) -> Result<Vec<ShareReply>, StoreError> {
    bucket_rows(v, n, 3)?
        .map(|r| {
            Ok(ShareReply {
                demand_milli: non_negative(&r[0])?,
                assigned_milli: non_negative(&r[1])?,
                streams: u32::try_from(non_negative(&r[2])?).unwrap_or(u32::MAX),
            })
        })
        .collect()
}

/// Parses the reply of a lease call that decided `n` buckets: their 7 fields each, in order.
pub fn parse_lease_replies(v: &redis::Value, n: usize) -> Result<Vec<LeaseReply>, StoreError> {
    bucket_rows(v, n, 7)?.map(lease_reply_from).collect()
}

fn lease_reply_from(items: &[redis::Value]) -> Result<LeaseReply, StoreError> {
    let mut n = [0u64; 7];
    for (slot, item) in n.iter_mut().zip(items) {
        *slot = non_negative(item)?;
    }
    Ok(LeaseReply {
        granted: n[0],
        remaining: n[1],
        reset_ms: n[2],
        retry_after_ms: n[3],
        window: n[4],
        ready_us: n[5],
        blocked_ms: n[6],
    })
}

/// The connection: one multiplexed connection to a single node (auto-reconnecting), or a
/// Redis Cluster client routing each bucket's group key to its shard.
#[derive(Clone)]
enum Conn {
    Single(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

/// How long the breaker stays open before one probe may go out; the sidecar sets it to the
/// sync interval so recovery after Redis returns takes at most one interval.
pub const DEFAULT_BREAKER_OPEN: Duration = Duration::from_millis(250);

/// Consecutive failures that open the breaker.
const BREAKER_THRESHOLD: u32 = 3;

/// Circuit breaker: after a few consecutive failures Redis is not called for `open_for`; then
/// one probe is let through, and its success closes the breaker.
pub struct Breaker {
    failures: AtomicU32,
    open_until: AtomicU64,
    open_for: Nanos,
    clock: MonotonicClock,
}

impl Breaker {
    pub fn new(open_for: Duration) -> Breaker {
        Breaker {
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            open_for: open_for.as_nanos() as Nanos,
            clock: MonotonicClock::new(),
        }
    }

    /// Whether a call may go out now. While open, one caller per `open_for` gets through as
    /// the probe.
    pub fn allow(&self) -> bool {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return true;
        }
        let now = self.clock.now();
        now >= until
            && self
                .open_until
                .compare_exchange(
                    until,
                    now + self.open_for,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    pub fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }

    pub fn success(&self) {
        self.failures.store(0, Ordering::Release);
        self.open_until.store(0, Ordering::Release);
    }

    /// Returns true when this failure opened the breaker.
    pub fn failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= BREAKER_THRESHOLD {
            let until = self.clock.now() + self.open_for;
            return self.open_until.swap(until, Ordering::AcqRel) == 0;
        }
        false
    }
}

/// Longest a connection attempt (TCP, TLS handshake, AUTH) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Makes and keeps the connection. Attempts run in their own task, so a request that stops
/// waiting (its timeout is a few milliseconds) does not cancel a TLS handshake half-way.
struct Connector {
    options: RedisOptions,
    conn: arc_swap::ArcSwapOption<Conn>,
    connecting: AtomicBool,
    /// Bumped after every attempt; waiters subscribe before starting or joining one.
    attempts: tokio::sync::watch::Sender<u64>,
    last_error: parking_lot::Mutex<Option<StoreError>>,
    /// The failure last logged at warn level: a failure is logged once, not every attempt.
    reported: parking_lot::Mutex<Option<String>>,
    /// Failed attempts are counted here (callers that stop waiting only see a timeout).
    metrics: std::sync::OnceLock<crate::GlobalMetrics>,
    /// Calls that timed out since the last one that succeeded; see [`Store::after_error`].
    timeouts_in_a_row: AtomicU32,
    /// When a call last succeeded (on `clock`).
    last_success: AtomicU64,
    clock: MonotonicClock,
}

/// A connection is taken for dead, dropped and made again, after this many timeouts in a row
/// spanning at least [`SILENCE_BEFORE_RECONNECT`] without a single success. A Redis pod that is
/// replaced behind a Service leaves its connections silent (no RST reaches the client: the
/// pod's network is gone), and the multiplexed connection only reconnects on errors it sees,
/// never on a caller's timeout, so without this every call would time out until the kernel
/// gives up on the socket, many minutes later. Both conditions: request-path calls have a
/// budget of a few milliseconds and time out on a busy but healthy Redis, while the background
/// sync (every 250 ms, 100 ms budget) succeeds then.
const TIMEOUTS_BEFORE_RECONNECT: u32 = 3;
const SILENCE_BEFORE_RECONNECT: Duration = Duration::from_secs(1);
/// Timeouts of calls given at least this long count towards a reconnect (the background sync's
/// 100 ms does; a request's 5 ms does not).
const GENEROUS_BUDGET: Duration = Duration::from_millis(50);

impl Connector {
    async fn attempt(self: Arc<Self>) {
        let result = match tokio::time::timeout(CONNECT_TIMEOUT, self.options.connect()).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(CONNECT_TIMEOUT)),
        };
        match result {
            Ok(conn) => {
                // Silence is counted from the connection's birth, not from the last success
                // of the one it replaces (or from start-up).
                self.last_success.store(self.clock.now(), Ordering::Release);
                self.timeouts_in_a_row.store(0, Ordering::Release);
                self.conn.store(Some(Arc::new(conn)));
                *self.last_error.lock() = None;
                *self.reported.lock() = None;
                tracing::info!(
                    redis = %self.options.redacted(),
                    tls = self.options.tls(),
                    "connected to redis"
                );
            }
            Err(e) => {
                if let Some(m) = self.metrics.get() {
                    m.redis_error(e.kind());
                }
                let message = e.to_string();
                let mut reported = self.reported.lock();
                if reported.as_deref() != Some(message.as_str()) {
                    tracing::warn!(
                        redis = %self.options.redacted(),
                        kind = e.kind(),
                        error = %message,
                        "cannot connect to redis; global rules follow their failure mode until it succeeds"
                    );
                    *reported = Some(message);
                } else {
                    tracing::debug!(error = %message, "redis connection attempt failed");
                }
                drop(reported);
                *self.last_error.lock() = Some(e);
            }
        }
        self.connecting.store(false, Ordering::Release);
        self.attempts.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// One RLQS bucket's figures for [`Store::share_batch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareOp {
    /// The bucket's name in Redis (rule id and hex key); the hash tag keeps it on one shard.
    pub bucket: String,
    pub demand_milli: u64,
    pub assigned_milli: u64,
    /// This replica's streams on the bucket; 0 removes its entry.
    pub streams: u32,
}

/// What the other replicas hold for one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareReply {
    pub demand_milli: u64,
    pub assigned_milli: u64,
    pub streams: u32,
}

/// Redis with the tollgate scripts. The connection is made lazily and re-made after failures,
/// so a sidecar starts (and follows its failure modes) while Redis is down.
pub struct Store {
    connector: Arc<Connector>,
    lease: redis::Script,
    members: redis::Script,
    share: redis::Script,
    pub breaker: Breaker,
    pub groups: u32,
    pub prefix: String,
}

impl Store {
    /// Prepares a store for `url` (`redis://`, or `rediss://` for TLS; credentials in the URL),
    /// or for a cluster when `cluster` is set (then `url` is a comma-separated list of seed
    /// nodes). Does not connect yet.
    pub fn new(url: &str, cluster: bool, groups: u32) -> Result<Store, StoreError> {
        Store::with_breaker(url, cluster, groups, DEFAULT_BREAKER_OPEN)
    }

    /// Like [`Store::new`], with the breaker's open time.
    pub fn with_breaker(
        url: &str,
        cluster: bool,
        groups: u32,
        breaker_open: Duration,
    ) -> Result<Store, StoreError> {
        Store::with_options(RedisOptions::new(url, cluster), groups, breaker_open)
    }

    /// A store with credentials and TLS settings. Validates the options; does not connect or
    /// read the files yet (they are read at every connection attempt).
    pub fn with_options(
        options: RedisOptions,
        groups: u32,
        breaker_open: Duration,
    ) -> Result<Store, StoreError> {
        options.validate()?;
        Ok(Store {
            connector: Arc::new(Connector {
                options,
                conn: arc_swap::ArcSwapOption::empty(),
                connecting: AtomicBool::new(false),
                attempts: tokio::sync::watch::Sender::new(0),
                last_error: parking_lot::Mutex::new(None),
                reported: parking_lot::Mutex::new(None),
                metrics: std::sync::OnceLock::new(),
                timeouts_in_a_row: AtomicU32::new(0),
                last_success: AtomicU64::new(0),
                clock: MonotonicClock::new(),
            }),
            lease: redis::Script::new(LEASE_LUA),
            members: redis::Script::new(MEMBERS_LUA),
            share: redis::Script::new(SHARE_LUA),
            breaker: Breaker::new(breaker_open),
            groups: groups.max(1),
            prefix: "tg".to_string(),
        })
    }

    /// Where failed connection attempts are counted (`tollgate_redis_errors_total{kind}`).
    pub fn set_metrics(&self, metrics: crate::GlobalMetrics) {
        let _ = self.connector.metrics.set(metrics);
    }

    /// How Redis is reached (for logs; the URL is only shown redacted).
    pub fn options(&self) -> &RedisOptions {
        &self.connector.options
    }

    /// The connection settings and state for `/debug/config`, without secrets.
    pub fn describe(&self) -> serde_json::Value {
        let o = &self.connector.options;
        serde_json::json!({
            "url": o.redacted(),
            "cluster": o.cluster,
            "sentinelMaster": o.sentinel_master,
            "tls": o.tls(),
            "username": o.username,
            "passwordFile": o.password_file,
            "caFile": o.ca_file,
            "clientCertFile": o.client_cert_file,
            "connected": self.connector.conn.load().is_some(),
            "lastError": self.connector.last_error.lock().as_ref().map(ToString::to_string),
        })
    }

    /// The connection, connecting first if needed. Callers bound this with their timeout; an
    /// attempt they stop waiting for still completes.
    async fn conn(&self) -> Result<Conn, StoreError> {
        let c = &self.connector;
        if let Some(conn) = c.conn.load_full() {
            return Ok((*conn).clone());
        }
        let mut attempts = c.attempts.subscribe();
        if let Some(conn) = c.conn.load_full() {
            return Ok((*conn).clone());
        }
        if !c.connecting.swap(true, Ordering::AcqRel) {
            tokio::spawn(Arc::clone(c).attempt());
        }
        let _ = attempts.changed().await;
        match c.conn.load_full() {
            Some(conn) => Ok((*conn).clone()),
            None => Err(c
                .last_error
                .lock()
                .clone()
                .unwrap_or_else(|| StoreError::Config("no connection to redis yet".into()))),
        }
    }

    /// After an error: credentials refused on a live connection (the password was rotated)
    /// drop it, so the next call reconnects with the current password file.
    fn after_error(&self, e: &StoreError) {
        if e.is_auth() {
            self.connector.conn.store(None);
        }
        if matches!(e.kind(), "connection" | "not_master") {
            // A broken single-node connection is made again by our own connect task, which
            // runs to completion whatever the caller's budget; left to the connection
            // manager, a reconnect that failed while the Service had no endpoints was never
            // retried on the real node. With Sentinel the connect task asks the sentinels again,
            // so a master that died or was demoted (READONLY) is left for the promoted one.
            // The cluster client re-routes broken shards itself.
            let c = &self.connector;
            let single = c
                .conn
                .load()
                .as_deref()
                .is_some_and(|c| matches!(c, Conn::Single(_)));
            if single && c.conn.swap(None).is_some() {
                tracing::info!(redis = %c.options.redacted(), error = %e, "redis connection broken; connecting again");
            }
        }
        // Only calls with a budget a healthy Redis always meets count: request-path calls (a
        // few ms) time out on a merely busy machine.
        if matches!(e, StoreError::Timeout(budget) if *budget >= GENEROUS_BUDGET) {
            let c = &self.connector;
            let n = c.timeouts_in_a_row.fetch_add(1, Ordering::AcqRel) + 1;
            let silent_for = c
                .clock
                .now()
                .saturating_sub(c.last_success.load(Ordering::Acquire));
            if n >= TIMEOUTS_BEFORE_RECONNECT
                && silent_for >= SILENCE_BEFORE_RECONNECT.as_nanos() as Nanos
                && c.conn.swap(None).is_some()
            {
                c.timeouts_in_a_row.store(0, Ordering::Release);
                tracing::warn!(
                    redis = %c.options.redacted(),
                    timeouts = n,
                    "redis stopped answering on its connection; connecting again"
                );
            }
        }
        if !matches!(e, StoreError::Timeout(_) | StoreError::BreakerOpen) {
            *self.connector.last_error.lock() = Some(e.clone());
        }
    }

    /// A call succeeded: the connection answers.
    fn after_success(&self) {
        let c = &self.connector;
        c.timeouts_in_a_row.store(0, Ordering::Release);
        c.last_success.store(c.clock.now(), Ordering::Release);
        *self.connector.last_error.lock() = None;
    }

    /// The last error other than a timeout, since the last successful call (no secrets: Redis
    /// errors and file paths only).
    pub fn last_error(&self) -> Option<String> {
        self.connector
            .last_error
            .lock()
            .as_ref()
            .map(ToString::to_string)
    }

    /// Name of the group hash a bucket lives in. The braces are a Redis Cluster hash tag; every
    /// script touches exactly one group, so scripts never cross slots.
    pub fn group_key(&self, group: u32) -> String {
        format!("{}:{{g{group}}}", self.prefix)
    }

    /// The key a bucket's `blockFor` block is published under: beside its group, in the same
    /// Redis Cluster slot (the hash tag), so the lease script can read it.
    pub fn block_key(&self, group: u32, field: &[u8; 16]) -> String {
        use std::fmt::Write as _;
        let mut key = self.group_key(group);
        key.reserve(3 + 2 * field.len());
        key.push_str(":b:");
        for b in field {
            // Writing into the key itself: no string per byte (every lease call builds it).
            let _ = write!(key, "{b:02x}");
        }
        key
    }

    /// The key a settlement id is remembered under, in the bucket's slot.
    fn settlement_key(&self, group: u32, id: u64) -> String {
        format!("{}:s:{id:016x}", self.group_key(group))
    }

    /// One script call deciding `ops` (at most [`MAX_LEASE_BATCH`], all in one Cluster slot).
    fn lease_invocation<'a>(
        &self,
        ops: impl IntoIterator<Item = &'a LeaseOp>,
    ) -> redis::ScriptInvocation<'_> {
        let mut inv = self.lease.prepare_invoke();
        for op in ops {
            self.add_lease_op(&mut inv, op);
        }
        inv
    }

    fn add_lease_op(&self, inv: &mut redis::ScriptInvocation<'_>, op: &LeaseOp) {
        inv.key(self.group_key(op.group))
            .key(self.block_key(op.group, &op.field))
            .key(self.settlement_key(op.group, op.settle_id))
            .arg(&op.field[..])
            .arg(op.algorithm)
            .arg(op.requests)
            .arg(op.period_ms)
            .arg(op.burst)
            .arg(op.want)
            .arg(op.give_back)
            .arg(op.back_window)
            .arg(if op.all_or_nothing { 1 } else { 0 })
            .arg(op.force)
            .arg(op.ahead_ms)
            .arg(op.demand)
            .arg(op.share_ms)
            .arg(op.block_ms)
            .arg(op.settle_id)
            .arg(SETTLEMENT_ID_TTL.as_millis() as u64);
    }

    /// Publishes a `blockFor` block of one bucket for `block_ms`: one write per block, which
    /// every sidecar's next lease call for the bucket reads. `NX`: a block already published
    /// by another sidecar is not extended.
    pub async fn publish_block(
        &self,
        group: u32,
        field: &[u8; 16],
        block_ms: u64,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.block_key(group, field))
            .arg(1)
            .arg("PX")
            .arg(block_ms.max(1))
            .arg("NX");
        let fut = async {
            let _: redis::Value = match self.conn().await? {
                Conn::Single(mut c) => cmd.query_async(&mut c).await?,
                Conn::Cluster(mut c) => cmd.query_async(&mut c).await?,
            };
            Ok::<(), StoreError>(())
        };
        self.bounded(timeout, fut).await
    }

    /// Runs a batch of lease operations in one round trip (a pipeline on a single node; the
    /// cluster client multiplexes them per shard), bounded by `timeout`.
    pub async fn lease_batch(
        &self,
        ops: &[LeaseOp],
        timeout: Duration,
    ) -> Result<Vec<LeaseReply>, StoreError> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let result = tokio::time::timeout(timeout, self.lease_batch_inner(ops)).await;
        let result = match result {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(timeout)),
        };
        match &result {
            Ok(_) => {
                self.breaker.success();
                self.after_success();
            }
            Err(e) => {
                self.after_error(e);
                self.breaker.failure();
            }
        }
        result
    }

    /// A single node decides the ops in script calls of up to [`MAX_LEASE_BATCH`] buckets,
    /// pipelined; a Cluster in one script call per group (a group is one hash slot) and
    /// batch, the groups' calls concurrent. Replies come back in the order of `ops`.
    async fn lease_batch_inner(&self, ops: &[LeaseOp]) -> Result<Vec<LeaseReply>, StoreError> {
        match self.conn().await? {
            Conn::Single(mut conn) => {
                let mut pipe = redis::pipe();
                for batch in ops.chunks(MAX_LEASE_BATCH) {
                    pipe.invoke_script(&self.lease_invocation(batch));
                }
                let values = query_loading(&self.lease, &pipe, &mut conn).await?;
                let mut replies = Vec::with_capacity(ops.len());
                for (v, batch) in values.iter().zip(ops.chunks(MAX_LEASE_BATCH)) {
                    replies.extend(parse_lease_replies(v, batch.len())?);
                }
                Ok(replies)
            }
            Conn::Cluster(c) => {
                let mut by_group: std::collections::BTreeMap<u32, Vec<usize>> =
                    std::collections::BTreeMap::new();
                for (i, op) in ops.iter().enumerate() {
                    by_group.entry(op.group).or_default().push(i);
                }
                let calls = by_group.values().flat_map(|indices| {
                    indices.chunks(MAX_LEASE_BATCH).map(|chunk| {
                        let mut conn = c.clone();
                        let inv = self.lease_invocation(chunk.iter().map(|&i| &ops[i]));
                        async move {
                            let v: redis::Value = inv.invoke_async(&mut conn).await?;
                            Ok::<_, StoreError>((chunk, parse_lease_replies(&v, chunk.len())?))
                        }
                    })
                });
                let decided = futures_util::future::try_join_all(calls).await?;
                let mut replies = vec![LeaseReply::default(); ops.len()];
                for (chunk, got) in decided {
                    for (&i, r) in chunk.iter().zip(got) {
                        replies[i] = r;
                    }
                }
                Ok(replies)
            }
        }
    }

    /// Connects and loads the lease script ahead of the first request that needs Redis, so
    /// that request does not pay a connection and a `NOSCRIPT` round trip inside its timeout
    /// (best effort: a failure is met again, and handled, by the first real call).
    pub async fn warm_up(&self, timeout: Duration) -> Result<(), StoreError> {
        let fut = async {
            if let Conn::Single(mut c) = self.conn().await? {
                self.lease.prepare_invoke().load_async(&mut c).await?;
                // The RLQS exchange pipelines its batches: unloaded, each would meet NOSCRIPT.
                self.share.prepare_invoke().load_async(&mut c).await?;
            }
            Ok::<(), StoreError>(())
        };
        self.bounded(timeout, fut).await
    }

    /// `PING`, bounded by `timeout`: whether Redis answers at all.
    pub async fn ping(&self, timeout: Duration) -> Result<(), StoreError> {
        let fut = async {
            let cmd = redis::cmd("PING");
            let _: redis::Value = match self.conn().await? {
                Conn::Single(mut c) => cmd.query_async(&mut c).await?,
                Conn::Cluster(mut c) => cmd.query_async(&mut c).await?,
            };
            Ok::<(), StoreError>(())
        };
        self.bounded(timeout, fut).await
    }

    /// A background call bounded by `timeout`, its outcome counted for the reconnect logic
    /// (a timeout counts as an error).
    async fn bounded<T>(
        &self,
        timeout: Duration,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(timeout)),
        };
        match &result {
            Ok(_) => self.after_success(),
            Err(e) => self.after_error(e),
        }
        result
    }

    /// Publishes this replica's RLQS demand and assignments for each bucket and reads what the
    /// other replicas hold (`share.lua`), in one round trip bounded by `timeout`: on a single
    /// node one script call per [`MAX_SHARE_BATCH`] buckets, pipelined; on a Cluster one call
    /// per bucket (each bucket's hash is its own slot), concurrent. Replies in the order of
    /// `ops`.
    pub async fn share_batch(
        &self,
        ops: &[ShareOp],
        replica: &str,
        lifetime: Duration,
        timeout: Duration,
    ) -> Result<Vec<ShareReply>, StoreError> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let life_ms = lifetime.as_millis() as u64;
        let invocation = |batch: &[ShareOp]| {
            let mut inv = self.share.prepare_invoke();
            inv.arg(replica).arg(life_ms);
            for op in batch {
                inv.key(format!("{}:q:{{{}}}", self.prefix, op.bucket))
                    .arg(op.demand_milli)
                    .arg(op.assigned_milli)
                    .arg(op.streams);
            }
            inv
        };
        let fut = async {
            match self.conn().await? {
                Conn::Single(mut c) => {
                    let mut pipe = redis::pipe();
                    for batch in ops.chunks(MAX_SHARE_BATCH) {
                        pipe.invoke_script(&invocation(batch));
                    }
                    let values = query_loading(&self.share, &pipe, &mut c).await?;
                    let mut replies = Vec::with_capacity(ops.len());
                    for (v, batch) in values.iter().zip(ops.chunks(MAX_SHARE_BATCH)) {
                        replies.extend(parse_share_replies(v, batch.len())?);
                    }
                    Ok(replies)
                }
                Conn::Cluster(c) => {
                    let calls = ops.chunks(1).map(|one| {
                        let inv = invocation(one);
                        let mut c = c.clone();
                        async move {
                            let v: redis::Value = inv.invoke_async(&mut c).await?;
                            parse_share_replies(&v, 1)
                        }
                    });
                    let replies = futures_util::future::try_join_all(calls).await?;
                    Ok(replies.into_iter().flatten().collect())
                }
            }
        };
        self.bounded(timeout, fut).await
    }

    /// Registers (or deregisters) this sidecar for each policy and returns the live counts.
    pub async fn heartbeat(
        &self,
        policies: &[String],
        sidecar_id: &str,
        ttl: Duration,
        register: bool,
        timeout: Duration,
    ) -> Result<Vec<u32>, StoreError> {
        let ttl_ms = ttl.as_millis() as u64;
        let fut = async {
            let conn = self.conn().await?;
            let calls = policies.iter().map(|p| {
                let mut inv = self.members.prepare_invoke();
                inv.key(format!("{}:{{m}}:{p}", self.prefix))
                    .arg(sidecar_id)
                    .arg(ttl_ms)
                    .arg(if register { 1 } else { 0 });
                let mut conn = conn.clone();
                async move {
                    let n: u32 = match &mut conn {
                        Conn::Single(c) => inv.invoke_async(c).await?,
                        Conn::Cluster(c) => inv.invoke_async(c).await?,
                    };
                    Ok::<u32, StoreError>(n)
                }
            });
            futures_util::future::try_join_all(calls).await
        };
        self.bounded(timeout, fut).await
    }
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "synchronous tests wait with thread::sleep"
)]
mod tests {
    use super::*;

    #[test]
    fn lease_replies_are_validated() {
        use redis::Value::{Array, Int, Nil};
        let ok = Array(vec![
            Int(3),
            Int(7),
            Int(100),
            Int(0),
            Int(9),
            Int(250),
            Int(0),
        ]);
        assert_eq!(
            parse_lease_reply(&ok).unwrap(),
            LeaseReply {
                granted: 3,
                remaining: 7,
                reset_ms: 100,
                retry_after_ms: 0,
                window: 9,
                ready_us: 250,
                blocked_ms: 0,
            }
        );
        assert!(parse_lease_reply(&Nil).is_err());
        assert!(parse_lease_reply(&Array(vec![Int(1)])).is_err());
        let six = Array(vec![Int(1), Int(0), Int(0), Int(0), Int(0), Int(0)]);
        assert!(
            parse_lease_reply(&six).is_err(),
            "a reply of an older script"
        );
        let negative = Array(vec![
            Int(-1),
            Int(0),
            Int(0),
            Int(0),
            Int(0),
            Int(0),
            Int(0),
        ]);
        assert!(parse_lease_reply(&negative).is_err());
        let nil = Array(vec![Nil, Int(0), Int(0), Int(0), Int(0), Int(0), Int(0)]);
        assert!(parse_lease_reply(&nil).is_err());
    }

    #[test]
    fn urls_are_redacted() {
        for (url, want) in [
            ("redis://h:6379", "redis://h:6379"),
            ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
            ("rediss://app:s3cret@h:6380", "rediss://app:***@h:6380"),
            ("rediss://app@h:6380", "rediss://app@h:6380"),
            // Unescaped separators in the password do not expose any part of it.
            ("redis://u:p/a@ss#w@h:1", "redis://u:***@h:1"),
            (
                "redis://:a@h1:1, rediss://:b@h2:2",
                "redis://:***@h1:1,rediss://:***@h2:2",
            ),
            ("not a url with pw@h", "<redacted>"),
        ] {
            assert_eq!(redact_url(url), want, "{url}");
        }
        let o = RedisOptions::new("rediss://u:hunter2@h:1", false);
        assert!(!format!("{o:?}").contains("hunter2"));
    }

    #[test]
    fn options_are_validated_without_leaking_the_url() {
        let mut o = RedisOptions::new("redis://:hunter2@h:1", false);
        o.validate().unwrap();
        o.ca_file = Some("/ca.pem".into());
        let e = o.validate().unwrap_err().to_string();
        assert!(e.contains("--redis-ca-file needs a rediss:// URL"), "{e}");
        o.url = "rediss://:hunter2@h:1/#insecure".into();
        assert!(o.validate().is_err());
        o.url = "rediss://:hunter2@h:1".into();
        o.validate().unwrap();
        o.client_cert_file = Some("/c.pem".into());
        assert!(o.validate().is_err(), "cert without key");
        let o = RedisOptions::new("http://:hunter2@h:1", false);
        let e = o.validate().unwrap_err().to_string();
        assert!(!e.contains("hunter2"), "{e}");
        let o = RedisOptions::new("redis://a:1,rediss://b:2", true);
        assert!(o.validate().is_err(), "mixed schemes");
    }

    #[test]
    fn password_files_lose_one_trailing_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        let mut o = RedisOptions::new("redis://h:1", false);
        o.password_file = Some(path.clone());
        let e = o.password().unwrap_err();
        assert_eq!(e.kind(), "config");
        assert!(e.to_string().contains("--redis-password-file"), "{e}");
        std::fs::write(&path, "p w\n\n").unwrap();
        assert_eq!(o.password().unwrap().as_deref(), Some("p w\n"));
        std::fs::write(&path, "pw\r\n").unwrap();
        assert_eq!(o.password().unwrap().as_deref(), Some("pw"));
        std::fs::write(&path, "\n").unwrap();
        assert!(o.password().is_err(), "empty");
    }

    #[test]
    fn breaker_opens_after_consecutive_failures_and_probes() {
        let b = Breaker::new(Duration::from_millis(20));
        assert!(b.allow());
        assert!(!b.failure());
        assert!(!b.failure());
        assert!(b.failure(), "third failure opens");
        assert!(!b.allow(), "open: no calls");
        std::thread::sleep(Duration::from_millis(25));
        assert!(b.allow(), "one probe after open_for");
        assert!(!b.allow(), "only one probe");
        b.success();
        assert!(b.allow() && !b.is_open());
    }
}
