//! The RLQS edge: Envoy's `StreamRateLimitQuotas`, for gateways whose Envoys decide locally
//! from an assignment instead of asking per request.
//!
//! Each Envoy stream reports, per bucket (a `BucketId` map built by the filter's
//! `bucket_matchers`), what it allowed and denied. A bucket is a descriptor to the engine: its
//! entries go through the same rule matching and key building as an RLS descriptor, and the
//! tightest enforcing rule that counts it is the bucket's limit. The [`share`](crate::share)
//! book splits that limit by demand among every Envoy reporting the bucket, on this replica
//! and (for Global rules with Redis) on the others, whose demand and assignments come through
//! Redis every `--rlqs-sync-interval`. Answers, in one place ([`action`]):
//!
//! - a token bucket (its part of the limit's rate and burst) with a TTL, renewed by every
//!   report; Envoys that now hold more than their part are told at once;
//! - `ALLOW_ALL` for a bucket no rule limits (shadow rules only observe);
//! - `DENY_ALL` for a fail-closed Global rule while Redis has not been read for a while;
//!   a fail-open one keeps splitting by what it last read;
//! - abandon, for a bucket idle for a few reports.
//!
//! A stream that ends leaves the book; the Envoy keeps its assignments until their TTL and
//! then applies its `expired_assignment_behavior`.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::TokenBucket;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::RateLimitStrategy;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use futures_util::Stream;
use tollgate_crd::compiled::{Algorithm, FailureMode, Mode, Scope};
use tollgate_limiter::{Clock, Nanos};

use crate::metrics::QuotaMetrics;
use crate::share::{Answer, Assignment, Book, Limit, Remote, StreamId, Usage};
use tollgate_engine::keys::Descriptor;
use tollgate_engine::rules::{Applies, RuleSet};
use tollgate_engine::shared::Shared;
use tollgate_global::store::ShareOp;

/// RLQS has no client address, as RLS.
const NO_PEER: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
/// Buckets one report may carry; beyond, the stream is refused.
const MAX_BUCKETS_PER_REPORT: usize = 10_000;
/// Entries of one `BucketId`.
const MAX_BUCKET_ENTRIES: usize = 32;
/// Outgoing messages queued per stream before pushes to it are dropped (its next report
/// brings it up to date).
const STREAM_QUEUE: usize = 64;
/// How long the first Redis read of a new Global bucket may take before the rule's failure
/// mode decides its first assignment.
const FIRST_READ_TIMEOUT: Duration = Duration::from_millis(100);

/// Settings of the RLQS edge.
#[derive(Clone, Debug)]
pub struct QuotaSettings {
    /// TTL of every assignment.
    pub assignment_ttl: Duration,
    /// How often demand is shared with the other replicas through Redis.
    pub sync_interval: Duration,
    /// This replica's name in Redis.
    pub replica: String,
}

impl QuotaSettings {
    /// How long a replica's figures stay in Redis without a refresh: three sync rounds, so
    /// one slow round does not drop them.
    fn entry_lifetime(&self) -> Duration {
        self.sync_interval * 3
    }

    /// Redis figures older than this no longer describe the other replicas: a fail-closed
    /// rule denies, a fail-open one goes on with them.
    fn stale_after(&self) -> Nanos {
        (self.sync_interval * 4)
            .max(Duration::from_secs(1))
            .as_nanos() as Nanos
    }
}

/// A bucket in the book: the rule that limits it and the counter key it builds.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct BucketKey {
    rule: Arc<str>,
    key: Vec<u8>,
    /// Shared with other replicas through Redis (a Global rule with Redis configured).
    fleet: bool,
    /// The rule fails closed: without fresh figures from Redis its buckets are denied.
    fail_closed: bool,
}

impl BucketKey {
    fn redis_name(&self) -> String {
        format!("{}:{}", self.rule, hex::encode(&self.key))
    }
}

/// What limits a bucket.
struct Target {
    key: BucketKey,
    limit: Limit,
    /// The rule's index in the rule set the report was decided with.
    rule: usize,
}

type Outgoing = Result<RateLimitQuotaResponse, tonic::Status>;

/// One connected Envoy stream.
struct StreamHandle {
    tx: tokio::sync::mpsc::Sender<Outgoing>,
    /// The Envoy's own `BucketId` of each bucket it reported, to address pushes.
    ids: HashMap<BucketKey, BucketId>,
}

/// The RLQS server over the shared engine.
#[derive(Clone)]
pub struct QuotaEdge {
    state: Arc<QuotaState>,
}

struct QuotaState {
    engine: Arc<Shared>,
    /// The edge's own metrics, in the engine's registry.
    metrics: QuotaMetrics,
    settings: QuotaSettings,
    book: parking_lot::Mutex<Book<BucketKey>>,
    streams: parking_lot::Mutex<HashMap<StreamId, StreamHandle>>,
    next_stream: AtomicU64,
}

impl QuotaEdge {
    /// The edge on `engine`, its metrics registered in the engine's registry (one RLQS edge
    /// per engine: a name is registered once).
    pub fn new(engine: Arc<Shared>, settings: QuotaSettings) -> QuotaEdge {
        let metrics = engine.metrics().register(QuotaMetrics::register);
        QuotaEdge {
            state: Arc::new(QuotaState {
                engine,
                metrics,
                settings,
                book: parking_lot::Mutex::new(Book::new()),
                streams: parking_lot::Mutex::new(HashMap::new()),
                next_stream: AtomicU64::new(1),
            }),
        }
    }
}

type QuotaStream = Pin<Box<dyn Stream<Item = Outgoing> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaEdge {
    type StreamRateLimitQuotasStream = QuotaStream;

    async fn stream_rate_limit_quotas(
        &self,
        request: tonic::Request<tonic::Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<tonic::Response<QuotaStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Outgoing>(STREAM_QUEUE);
        let id = self.state.next_stream.fetch_add(1, Ordering::Relaxed);
        self.state.streams.lock().insert(
            id,
            StreamHandle {
                tx: tx.clone(),
                ids: HashMap::new(),
            },
        );
        self.state.metrics.streams.inc();
        let state = Arc::clone(&self.state);
        tokio::spawn(async move {
            loop {
                match inbound.message().await {
                    Ok(Some(reports)) => {
                        if let Err(status) = state.on_reports(id, reports).await {
                            let _ = tx.send(Err(status)).await;
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) if undecodable(&e) => {
                        // A client bug, not a hang-up: say so on both ends.
                        tracing::warn!(stream = id, error = %e, "RLQS usage report could not be decoded; ending the stream");
                        let status = tonic::Status::invalid_argument(format!(
                            "the usage report could not be decoded: {}",
                            e.message()
                        ));
                        let _ = tx.send(Err(status)).await;
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(stream = id, error = %e, "RLQS stream ended with an error");
                        break;
                    }
                }
            }
            state.leave(id);
        });
        let outgoing = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        Ok(tonic::Response::new(Box::pin(outgoing)))
    }
}

/// Whether a stream error is a message that arrived but is not a usage report (tonic's
/// decoder reports it as `Internal`), rather than the client going away.
fn undecodable(e: &tonic::Status) -> bool {
    e.code() == tonic::Code::Internal && e.message().contains("decode")
}

impl QuotaState {
    fn leave(&self, stream: StreamId) {
        self.streams.lock().remove(&stream);
        let mut book = self.book.lock();
        book.leave(stream);
        self.metrics.buckets.set(book.len() as i64);
        drop(book);
        self.metrics.streams.dec();
    }

    /// Answers one report message: an action for every bucket in it, and pushes to other
    /// streams that must give room back.
    async fn on_reports(
        &self,
        stream: StreamId,
        reports: RateLimitQuotaUsageReports,
    ) -> Result<(), tonic::Status> {
        check_reports(&reports)?;
        let rules = self.engine.rules();
        let usages: Vec<(BucketId, Option<Target>, Usage)> = reports
            .bucket_quota_usages
            .into_iter()
            .map(|u| {
                let id = u.bucket_id.unwrap_or_default();
                let target = target_for(&rules, &id);
                (
                    id,
                    target,
                    usage_of(
                        u.num_requests_allowed,
                        u.num_requests_denied,
                        u.time_elapsed,
                    ),
                )
            })
            .collect();
        self.read_new_fleet_buckets(&usages).await;
        let now = self.engine.clock().now();
        let mut actions = Vec::with_capacity(usages.len());
        let mut pushes = Vec::new();
        {
            let mut book = self.book.lock();
            for (id, target, usage) in usages {
                let (answer, more) = self.answer(&mut book, stream, target.as_ref(), usage, now);
                tracing::debug!(stream, ?usage, ?answer, pushes = ?more, remote = ?target.as_ref().and_then(|t| book.remote(&t.key)), "RLQS report");
                if let Some(t) = &target {
                    pushes.extend(more.into_iter().map(|(s, a)| (s, t.key.clone(), a)));
                    self.remember_id(stream, &t.key, &id, &answer);
                    // Envoy's own decisions count as the rule's, so dashboards and alerts see
                    // a gateway's traffic as they see a sidecar's.
                    let metrics = &rules.rules[t.rule].metrics;
                    metrics.allowed.inc_by(usage.allowed);
                    metrics.rejected.inc_by(usage.denied);
                }
                actions.push(action(id, answer, self.settings.assignment_ttl));
            }
            self.metrics.buckets.set(book.len() as i64);
        }
        self.metrics.reports.inc_by(actions.len() as u64);
        self.send(
            stream,
            RateLimitQuotaResponse {
                bucket_action: actions,
            },
        );
        self.push(pushes);
        Ok(())
    }

    /// The answer for one bucket of a report (the book locked by the caller).
    fn answer(
        &self,
        book: &mut Book<BucketKey>,
        stream: StreamId,
        target: Option<&Target>,
        usage: Usage,
        now: Nanos,
    ) -> (Reply, Vec<(StreamId, Assignment)>) {
        let Some(t) = target else {
            return (Reply::AllowAll, Vec::new());
        };
        let remote = if t.key.fleet {
            book.remote(&t.key)
        } else {
            None
        };
        let stale = self.stale(&t.key, remote, now);
        let (answer, pushes) = book.report(&t.key, stream, usage, t.limit, remote, now);
        match answer {
            Answer::Abandon => (Reply::Abandon, Vec::new()),
            // Redis unreachable: the rule's failure mode.
            _ if stale && t.key.fail_closed => (Reply::DenyAll, Vec::new()),
            Answer::Assign(a) => (Reply::of(a), pushes),
        }
    }

    /// Whether a fleet bucket's figures from the other replicas are too old to split by.
    fn stale(&self, key: &BucketKey, remote: Option<Remote>, now: Nanos) -> bool {
        key.fleet
            && remote.is_none_or(|r| now.saturating_sub(r.read_at) > self.settings.stale_after())
    }

    /// A new Global bucket is read from Redis before its first assignment, so it starts from
    /// the fleet's demand rather than from this replica's alone.
    async fn read_new_fleet_buckets(&self, usages: &[(BucketId, Option<Target>, Usage)]) {
        let Some(global) = self.engine.global() else {
            return;
        };
        let fresh: Vec<(BucketKey, ShareOp)> = {
            let book = self.book.lock();
            usages
                .iter()
                .filter_map(|(_, t, u)| t.as_ref().map(|t| (t, u)))
                .filter(|(t, _)| t.key.fleet && book.remote(&t.key).is_none())
                .map(|(t, u)| {
                    let demand =
                        (u.allowed + u.denied) as f64 / u.elapsed.unwrap_or(1.0).max(0.001);
                    (
                        t.key.clone(),
                        ShareOp {
                            bucket: t.key.redis_name(),
                            demand_milli: (demand * 1000.0) as u64,
                            assigned_milli: 0,
                            streams: 1,
                        },
                    )
                })
                .collect()
        };
        if fresh.is_empty() {
            return;
        }
        let ops: Vec<ShareOp> = fresh.iter().map(|(_, op)| op.clone()).collect();
        let lifetime = self.settings.entry_lifetime();
        let replies = global
            .store
            .share_batch(&ops, &self.settings.replica, lifetime, FIRST_READ_TIMEOUT)
            .await;
        let Ok(replies) = replies else {
            return;
        };
        let now = self.engine.clock().now();
        let mut book = self.book.lock();
        for ((key, _), reply) in fresh.iter().zip(replies) {
            book.prime_remote(key, remote_of(reply, now));
        }
    }

    fn remember_id(&self, stream: StreamId, key: &BucketKey, id: &BucketId, reply: &Reply) {
        let mut streams = self.streams.lock();
        let Some(handle) = streams.get_mut(&stream) else {
            return;
        };
        if matches!(reply, Reply::Abandon) {
            handle.ids.remove(key);
        } else if !handle.ids.contains_key(key) {
            handle.ids.insert(key.clone(), id.clone());
        }
    }

    fn send(&self, stream: StreamId, response: RateLimitQuotaResponse) {
        let tx = self.streams.lock().get(&stream).map(|h| h.tx.clone());
        if let Some(tx) = tx
            && tx.try_send(Ok(response)).is_err()
        {
            tracing::warn!(
                stream,
                "RLQS stream not reading its answers; this one is dropped"
            );
        }
    }

    /// New, smaller assignments for other streams of this replica.
    fn push(&self, pushes: Vec<(StreamId, BucketKey, Assignment)>) {
        let mut per_stream: BTreeMap<StreamId, Vec<BucketAction>> = BTreeMap::new();
        {
            let streams = self.streams.lock();
            for (stream, key, a) in pushes {
                let Some(id) = streams.get(&stream).and_then(|h| h.ids.get(&key).cloned()) else {
                    continue;
                };
                per_stream.entry(stream).or_default().push(action(
                    id,
                    Reply::of(a),
                    self.settings.assignment_ttl,
                ));
            }
        }
        for (stream, actions) in per_stream {
            self.send(
                stream,
                RateLimitQuotaResponse {
                    bucket_action: actions,
                },
            );
        }
    }

    /// One round between reports: with Redis, publish this replica's demand and assignments
    /// per Global bucket and read the others'; then bring every stream to its fair part and
    /// push what changed.
    async fn sync_fleet(&self) {
        if let Some(global) = self.engine.global() {
            self.exchange(global).await;
        }
        let now = self.engine.clock().now();
        let changed: Vec<_> = {
            let mut book = self.book.lock();
            let changed = book.rebalance();
            // A fail-closed bucket without fresh figures keeps the DENY_ALL its reports get.
            changed
                .into_iter()
                .filter(|(k, ..)| !(k.fail_closed && self.stale(k, book.remote(k), now)))
                .collect()
        };
        if !changed.is_empty() {
            tracing::debug!(?changed, "RLQS rebalance");
        }
        self.push(
            changed
                .into_iter()
                .map(|(key, stream, a)| (stream, key, a))
                .collect(),
        );
    }

    async fn exchange(&self, global: &tollgate_global::GlobalRuntime) {
        let streams = self.streams.lock().len() as u32;
        let (keys, mut ops): (Vec<BucketKey>, Vec<ShareOp>) = self
            .book
            .lock()
            .totals()
            .into_iter()
            .filter(|(k, ..)| k.fleet)
            .map(|(k, demand, assigned, members)| {
                let op = ShareOp {
                    bucket: k.redis_name(),
                    demand_milli: (demand * 1000.0) as u64,
                    assigned_milli: (assigned * 1000.0).ceil() as u64,
                    streams: members,
                };
                (k, op)
            })
            .unzip();
        // The fleet's Envoy streams, for the metric and for splitting idle buckets.
        ops.push(ShareOp {
            bucket: "streams".to_string(),
            demand_milli: 0,
            assigned_milli: 0,
            streams: streams.max(1),
        });
        let lifetime = self.settings.entry_lifetime();
        // Redis spends about 4 µs per bucket of an exchange (100,000 buckets: 782 calls, about
        // 0.4 s of Redis CPU, 0.55 s on the wire; crates/sidecar/tests/lease_batches.rs): a
        // fixed timeout would drop every exchange of a large fleet, so it grows by 10 µs a
        // bucket.
        let per_bucket =
            Duration::from_micros(10).saturating_mul(u32::try_from(ops.len()).unwrap_or(u32::MAX));
        let timeout = self.settings.sync_interval.min(Duration::from_millis(250)) + per_bucket;
        let Ok(mut replies) = global
            .store
            .share_batch(&ops, &self.settings.replica, lifetime, timeout)
            .await
        else {
            return;
        };
        if let Some(all) = replies.pop() {
            let fleet = i64::from(all.streams) + i64::from(streams);
            self.metrics.fleet_streams.set(fleet);
        }
        let now = self.engine.clock().now();
        let mut book = self.book.lock();
        for (key, reply) in keys.iter().zip(replies) {
            book.set_remote(key, remote_of(reply, now));
        }
    }
}

fn remote_of(reply: tollgate_global::store::ShareReply, now: Nanos) -> Remote {
    Remote {
        demand: reply.demand_milli as f64 / 1000.0,
        assigned: reply.assigned_milli as f64 / 1000.0,
        streams: reply.streams,
        read_at: now,
    }
}

/// Shares demand with the other replicas every `sync_interval` until the process ends.
pub async fn fleet_loop(edge: QuotaEdge) {
    let mut tick = tokio::time::interval(edge.state.settings.sync_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        edge.state.sync_fleet().await;
    }
}

/// What a bucket is told.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Reply {
    Assign(Assignment),
    AllowAll,
    DenyAll,
    Abandon,
}

impl Reply {
    /// An assignment, or `DENY_ALL` for a share of nothing (a token bucket cannot say it).
    fn of(a: Assignment) -> Reply {
        if a.rate > 0.0 {
            Reply::Assign(a)
        } else {
            Reply::DenyAll
        }
    }
}

/// A reply in RLQS terms.
fn action(bucket_id: BucketId, reply: Reply, ttl: Duration) -> BucketAction {
    let assign = |strategy: Strategy| {
        Action::QuotaAssignmentAction(QuotaAssignmentAction {
            // Envoy reads whole seconds; under one it expires at once.
            assignment_time_to_live: Some(PbDuration {
                seconds: i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX),
                nanos: 0,
            }),
            rate_limit_strategy: Some(RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })
    };
    let action = match reply {
        Reply::Assign(a) => assign(Strategy::TokenBucket(token_bucket(a))),
        Reply::AllowAll => assign(Strategy::BlanketRule(BlanketRule::AllowAll as i32)),
        Reply::DenyAll => assign(Strategy::BlanketRule(BlanketRule::DenyAll as i32)),
        Reply::Abandon => Action::AbandonAction(AbandonAction {}),
    };
    BucketAction {
        bucket_id: Some(bucket_id),
        bucket_action: Some(action),
    }
}

/// A token bucket refilling `rate` per second. Envoy 1.40 refills continuously at
/// `tokens_per_fill` per `fill_interval`, reads the interval in whole seconds (a shorter one
/// refills without limit), and tells a new bucket from the one it holds by `tokens_per_fill`
/// and `max_tokens`, not by the interval's seconds. So the interval is always a minute and
/// the tokens per fill carry the rate, to a sixtieth of a request per second, rounded down so
/// that shares never add up past the limit.
fn token_bucket(a: Assignment) -> TokenBucket {
    TokenBucket {
        max_tokens: u32::try_from(a.burst.max(1)).unwrap_or(u32::MAX),
        tokens_per_fill: Some(UInt32Value {
            value: (a.rate * FILL_SECONDS as f64)
                .floor()
                .clamp(1.0, f64::from(u32::MAX)) as u32,
        }),
        fill_interval: Some(PbDuration {
            seconds: FILL_SECONDS,
            nanos: 0,
        }),
    }
}

/// The fill interval of every token bucket assigned.
const FILL_SECONDS: i64 = 60;

fn usage_of(allowed: u64, denied: u64, elapsed: Option<PbDuration>) -> Usage {
    // Envoy's first report of a new bucket covers no time (`0s`): no rate can be read from it.
    let elapsed = elapsed
        .map(|d| d.seconds.max(0) as f64 + f64::from(d.nanos.max(0)) / 1e9)
        .filter(|s| *s > 0.0);
    Usage {
        allowed,
        denied,
        elapsed,
    }
}

/// Refuses what Envoy never sends.
#[allow(
    clippy::result_large_err,
    reason = "tonic::Status is the trait's error type"
)]
fn check_reports(reports: &RateLimitQuotaUsageReports) -> Result<(), tonic::Status> {
    if reports.bucket_quota_usages.len() > MAX_BUCKETS_PER_REPORT {
        return Err(tonic::Status::invalid_argument(format!(
            "{} buckets in one report; at most {MAX_BUCKETS_PER_REPORT} are accepted",
            reports.bucket_quota_usages.len()
        )));
    }
    for (i, u) in reports.bucket_quota_usages.iter().enumerate() {
        let Some(id) = &u.bucket_id else {
            return Err(tonic::Status::invalid_argument(format!(
                "bucket_quota_usages[{i}].bucket_id is missing"
            )));
        };
        if id.bucket.is_empty() || id.bucket.len() > MAX_BUCKET_ENTRIES {
            return Err(tonic::Status::invalid_argument(format!(
                "bucket_quota_usages[{i}].bucket_id has {} entries; 1 to {MAX_BUCKET_ENTRIES} are accepted",
                id.bucket.len()
            )));
        }
    }
    Ok(())
}

/// The tightest enforcing rule that counts this bucket, with its key: the bucket's entries
/// are a descriptor to the engine. `None`: no rule limits it.
fn target_for(rules: &RuleSet, id: &BucketId) -> Option<Target> {
    let mut entries: Vec<(String, String)> = id
        .bucket
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    entries.sort();
    let mut parts = http::Request::new(()).into_parts().0;
    parts.extensions.insert(Descriptor { entries, hits: 1 });
    let mut key_buf = Vec::new();
    let mut best: Option<Target> = None;
    for (ri, active) in rules.rules.iter().enumerate() {
        let rule = &active.rule;
        if rule.mode != Mode::Enforce
            || rule.limit.algorithm == Algorithm::Concurrency
            || rule.limit.period_ms == 0
            || rules.applies(ri, &parts, &NO_PEER, &mut key_buf) != Applies::Counted
        {
            continue;
        }
        let cost = f64::from(rule.cost.amount.max(1));
        let limit = Limit {
            rate: rule.limit.requests as f64 * 1000.0 / rule.limit.period_ms as f64 / cost,
            burst: (rule.capacity() as f64 / cost) as u64,
        };
        if best.as_ref().is_some_and(|b| b.limit.rate <= limit.rate) {
            continue;
        }
        best = Some(Target {
            key: BucketKey {
                rule: Arc::from(rule.id.as_str()),
                key: key_buf.clone(),
                fleet: rule.scope == Scope::Global && active.global.is_some(),
                fail_closed: rule.failure_mode == FailureMode::Closed,
            },
            limit,
            rule: ri,
        });
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_buckets_refill_at_the_assigned_rate_in_whole_seconds() {
        for (rate, per_fill) in [
            (0.001, 1),
            (0.5, 30),
            (3.0, 180),
            (33.5, 2010),
            (900.0, 54_000),
        ] {
            let tb = token_bucket(Assignment { rate, burst: 5 });
            assert_eq!(tb.tokens_per_fill.unwrap().value, per_fill, "{rate}");
            assert_eq!(
                tb.fill_interval.unwrap(),
                PbDuration {
                    seconds: 60,
                    nanos: 0
                }
            );
            assert_eq!(tb.max_tokens, 5);
        }
    }

    #[test]
    fn a_report_without_elapsed_time_has_no_rate() {
        assert_eq!(usage_of(3, 1, None).elapsed, None);
        let zero = PbDuration {
            seconds: 0,
            nanos: 0,
        };
        assert_eq!(usage_of(1, 0, Some(zero)).elapsed, None);
        let half = PbDuration {
            seconds: 0,
            nanos: 500_000_000,
        };
        assert_eq!(usage_of(3, 1, Some(half)).elapsed, Some(0.5));
    }
}
