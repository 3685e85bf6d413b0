//! Redis access for global limits: the lease and membership scripts, batching, timeouts and the
//! circuit breaker.
//!
//! Every state change is one Lua script reading Redis `TIME`; scripts are sent by SHA and
//! reloaded when Redis answers NOSCRIPT (after a restart or failover). Every call has a timeout
//! and reports to the breaker, so a slow or dead Redis costs a request at most one timeout and
//! then nothing until the breaker lets a probe through.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::ConnectionLike;
use tollgate_limiter::{Clock, MonotonicClock, Nanos};

const LEASE_LUA: &str = include_str!("lease.lua");
const MEMBERS_LUA: &str = include_str!("members.lua");

/// Why a Redis call failed. Every kind is transient from the limiter's point of view: the rule's
/// failure mode applies and the breaker decides when to try again.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("redis call timed out after {0:?}")]
    Timeout(Duration),
    #[error("redis unavailable (circuit breaker open)")]
    BreakerOpen,
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("unexpected script reply: {0}")]
    BadReply(String),
}

impl StoreError {
    /// Metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::BreakerOpen => "breaker_open",
            StoreError::Redis(e) if e.is_connection_dropped() || e.is_connection_refusal() => {
                "connection"
            }
            StoreError::Redis(_) => "error",
            StoreError::BadReply(_) => "bad_reply",
        }
    }
}

/// One lease/return against a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
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
}

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
}

/// Parses a lease script reply; anything but five non-negative integers is an error.
pub fn parse_lease_reply(v: &redis::Value) -> Result<LeaseReply, StoreError> {
    let redis::Value::Array(items) = v else {
        return Err(StoreError::BadReply(format!("{v:?}")));
    };
    if items.len() != 5 {
        return Err(StoreError::BadReply(format!("{} items", items.len())));
    }
    let mut n = [0u64; 5];
    for (slot, item) in n.iter_mut().zip(items) {
        *slot = match item {
            redis::Value::Int(i) if *i >= 0 => *i as u64,
            other => return Err(StoreError::BadReply(format!("{other:?}"))),
        };
    }
    Ok(LeaseReply {
        granted: n[0],
        remaining: n[1],
        reset_ms: n[2],
        retry_after_ms: n[3],
        window: n[4],
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

/// Where to connect: a single node (multiplexed, auto-reconnecting) or a Redis Cluster.
enum Target {
    Single(Box<redis::Client>),
    Cluster(Box<redis::cluster::ClusterClient>),
}

/// Redis with the tollgate scripts. The connection is made lazily and re-made after failures,
/// so a sidecar starts (and follows its failure modes) while Redis is down.
pub struct Store {
    target: Target,
    conn: arc_swap::ArcSwapOption<Conn>,
    connecting: tokio::sync::Mutex<()>,
    lease: redis::Script,
    members: redis::Script,
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
        let target = if cluster {
            let nodes: Vec<&str> = url.split(',').map(str::trim).collect();
            Target::Cluster(Box::new(
                redis::cluster::ClusterClient::builder(nodes).build()?,
            ))
        } else {
            Target::Single(Box::new(redis::Client::open(url)?))
        };
        Ok(Store {
            target,
            conn: arc_swap::ArcSwapOption::empty(),
            connecting: tokio::sync::Mutex::new(()),
            lease: redis::Script::new(LEASE_LUA),
            members: redis::Script::new(MEMBERS_LUA),
            breaker: Breaker::new(breaker_open),
            groups: groups.max(1),
            prefix: "tg".to_string(),
        })
    }

    /// The connection, connecting first if needed. Callers bound this with their timeout.
    async fn conn(&self) -> Result<Conn, StoreError> {
        if let Some(c) = self.conn.load_full() {
            return Ok((*c).clone());
        }
        let _guard = self.connecting.lock().await;
        if let Some(c) = self.conn.load_full() {
            return Ok((*c).clone());
        }
        let conn = match &self.target {
            Target::Single(client) => {
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(2)))
                    .set_response_timeout(Some(Duration::from_secs(2)))
                    .set_number_of_retries(1);
                Conn::Single(client.get_connection_manager_with_config(config).await?)
            }
            Target::Cluster(client) => Conn::Cluster(client.get_async_connection().await?),
        };
        self.conn.store(Some(std::sync::Arc::new(conn.clone())));
        Ok(conn)
    }

    /// Name of the group hash a bucket lives in. The braces are a Redis Cluster hash tag; every
    /// script touches exactly one group, so scripts never cross slots.
    pub fn group_key(&self, group: u32) -> String {
        format!("{}:{{g{group}}}", self.prefix)
    }

    fn lease_invocation(&self, op: &LeaseOp) -> redis::ScriptInvocation<'_> {
        let mut inv = self.lease.prepare_invoke();
        inv.key(self.group_key(op.group))
            .arg(&op.field[..])
            .arg(op.algorithm)
            .arg(op.requests)
            .arg(op.period_ms)
            .arg(op.burst)
            .arg(op.want)
            .arg(op.give_back)
            .arg(op.back_window)
            .arg(if op.all_or_nothing { 1 } else { 0 });
        inv
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
            Ok(_) => self.breaker.success(),
            Err(_) => {
                self.breaker.failure();
            }
        }
        result
    }

    async fn lease_batch_inner(&self, ops: &[LeaseOp]) -> Result<Vec<LeaseReply>, StoreError> {
        match self.conn().await? {
            Conn::Single(mut conn) => {
                let values = match self.pipeline(ops, &mut conn).await {
                    Err(StoreError::Redis(e))
                        if e.kind()
                            == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                    {
                        // Redis restarted or failed over: load the script once and retry.
                        self.lease.prepare_invoke().load_async(&mut conn).await?;
                        self.pipeline(ops, &mut conn).await?
                    }
                    other => other?,
                };
                values.iter().map(parse_lease_reply).collect()
            }
            Conn::Cluster(c) => {
                let calls = ops.iter().map(|op| {
                    let mut conn = c.clone();
                    let inv = self.lease_invocation(op);
                    async move {
                        let v: redis::Value = inv.invoke_async(&mut conn).await?;
                        parse_lease_reply(&v)
                    }
                });
                futures_util::future::try_join_all(calls).await
            }
        }
    }

    async fn pipeline<C: ConnectionLike>(
        &self,
        ops: &[LeaseOp],
        conn: &mut C,
    ) -> Result<Vec<redis::Value>, StoreError> {
        let mut pipe = redis::pipe();
        for op in ops {
            pipe.invoke_script(&self.lease_invocation(op));
        }
        Ok(pipe.query_async(conn).await?)
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
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_replies_are_validated() {
        use redis::Value::{Array, Int, Nil};
        let ok = Array(vec![Int(3), Int(7), Int(100), Int(0), Int(9)]);
        assert_eq!(
            parse_lease_reply(&ok).unwrap(),
            LeaseReply {
                granted: 3,
                remaining: 7,
                reset_ms: 100,
                retry_after_ms: 0,
                window: 9
            }
        );
        assert!(parse_lease_reply(&Nil).is_err());
        assert!(parse_lease_reply(&Array(vec![Int(1)])).is_err());
        assert!(parse_lease_reply(&Array(vec![Int(-1), Int(0), Int(0), Int(0), Int(0)])).is_err());
        assert!(parse_lease_reply(&Array(vec![Nil, Int(0), Int(0), Int(0), Int(0)])).is_err());
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
