//! The rule-stream server (HTTP/1.1 and h2c on one port).
//!
//! - `GET /v1/watch?namespace=NS&pod=NAME[&since=VERSION&epoch=EPOCH]`: a long-lived
//!   `application/x-ndjson` response of [`StreamMessage`]s for one pod.
//! - `POST /v1/ack`: a sidecar reports the version it enforces ([`Ack`]).
//! - `POST /v1/top-keys`: a sidecar reports the keys it rejected most ([`TopKeysReport`]).
//! - `GET /healthz`, `GET /readyz`, `GET /metrics`.
//!
//! The protocol is specified in `docs/rule-stream.md`. Each stream reads its pod's watch channel
//! only when hyper asks for the next chunk, i.e. when the connection can take more bytes, so a
//! slow consumer skips straight to the latest state and nothing ever queues per stream.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tollgate_crd::WIRE_VERSION;
use tollgate_crd::stream::{Ack, StreamMessage, TopKeysReport};

use crate::auth::{AuthError, Authenticator, Identity, authorize, bearer_token, same_incarnation};
use crate::index::{AckError, PodRules, SharedIndex, Subscription};
use crate::membership::{self, Connection};
use crate::metrics::{Metrics, OpenStream};
use crate::top_keys::FleetTopKeys;

/// How a request reached the server; the rule stream may be refused on [`Transport::Plain`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Plain,
    Tls,
}

/// Response body type of every endpoint.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Default interval between heartbeats on an idle stream.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);
/// Default wait for a pod the pod watch has not delivered yet.
pub const DEFAULT_UNKNOWN_POD_GRACE: Duration = Duration::from_secs(2);
/// Largest accepted ack body.
const MAX_ACK_BYTES: usize = 64 * 1024;
/// Largest accepted top-keys report (64 keys of about 150 bytes each, with room).
const MAX_TOP_KEYS_BYTES: usize = 64 * 1024;
/// How long open connections get to finish after streams are told to end.
const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub heartbeat: Duration,
    pub unknown_pod_grace: Duration,
    pub shutdown_grace: Duration,
    /// Serve `/v1/watch` and `/v1/ack` on plain HTTP too (`--plain-stream`). Off, a sidecar
    /// misconfigured with `http://` is refused before its token is reviewed, and only the TLS
    /// listener streams rules; health and metrics stay on the plain port either way.
    pub plain_stream: bool,
    /// The installation's key-hash secret, once loaded (`crate::key_hash`): every snapshot
    /// carries it, so sidecars in every namespace log a client under one identity.
    pub key_hash_secret: watch::Receiver<Option<Arc<str>>>,
    /// Where sidecars' top-keys reports are merged.
    pub top_keys: Arc<FleetTopKeys>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            heartbeat: DEFAULT_HEARTBEAT,
            unknown_pod_grace: DEFAULT_UNKNOWN_POD_GRACE,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            plain_stream: true,
            key_hash_secret: watch::channel(None).1,
            top_keys: FleetTopKeys::new(crate::top_keys::DEFAULT_WINDOW),
        }
    }
}

/// The server; cheap to clone.
#[derive(Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

struct Inner {
    index: SharedIndex,
    auth: Arc<dyn Authenticator>,
    metrics: Arc<Metrics>,
    registry: Arc<Registry>,
    config: ServerConfig,
    ready: watch::Receiver<bool>,
    drain_tx: watch::Sender<bool>,
}

// === impl Server ===

impl Server {
    pub fn new(
        index: SharedIndex,
        auth: Arc<dyn Authenticator>,
        metrics: Metrics,
        registry: Registry,
        config: ServerConfig,
        ready: watch::Receiver<bool>,
    ) -> Server {
        Server {
            inner: Arc::new(Inner {
                index,
                auth,
                metrics: Arc::new(metrics),
                registry: Arc::new(registry),
                config,
                ready,
                drain_tx: watch::Sender::new(false),
            }),
        }
    }

    /// Serves connections until `shutdown` completes, then ends every stream (sidecars
    /// reconnect elsewhere) and waits up to the shutdown grace for connections to close.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        self.serve_with(listener, None, shutdown).await
    }

    /// [`Server::serve`] over TLS (`--tls-listen`): the same endpoints, so a sidecar's bearer
    /// token and its rules never cross the network in the clear.
    pub async fn serve_tls(
        self,
        listener: TcpListener,
        tls: Arc<rustls::ServerConfig>,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        self.serve_with(listener, Some(acceptor), shutdown).await
    }

    async fn serve_with(
        self,
        listener: TcpListener,
        tls: Option<tokio_rustls::TlsAcceptor>,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        let graceful = GracefulShutdown::new();
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_secs(10))
            .keep_alive(true);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(Some(Duration::from_secs(10)))
            .keep_alive_timeout(Duration::from_secs(5));
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(a) => a,
                        Err(error) => {
                            // EMFILE and friends: back off instead of spinning.
                            tracing::warn!(%error, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let _ = stream.set_nodelay(true);
                    let server = self.clone();
                    let transport = if tls.is_some() { Transport::Tls } else { Transport::Plain };
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let server = server.clone();
                        async move { Ok::<_, Infallible>(server.handle(req, transport).await) }
                    });
                    let Some(acceptor) = tls.clone() else {
                        let conn = builder.serve_connection(TokioIo::new(stream), svc).into_owned();
                        let conn = graceful.watch(conn);
                        tokio::spawn(async move {
                            if let Err(error) = conn.await {
                                tracing::debug!(%peer, %error, "connection ended with an error");
                            }
                        });
                        continue;
                    };
                    let builder = builder.clone();
                    let watcher = graceful.watcher();
                    tokio::spawn(async move {
                        let Some(stream) =
                            crate::webhook::tls::accept(&acceptor, stream, peer, "rule stream").await
                        else {
                            return;
                        };
                        let conn = builder.serve_connection(TokioIo::new(stream), svc).into_owned();
                        if let Err(error) = watcher.watch(conn).await {
                            tracing::debug!(%peer, %error, "connection ended with an error");
                        }
                    });
                }
                () = &mut shutdown => break,
            }
        }
        drop(listener);
        self.inner.drain_tx.send_replace(true);
        tokio::select! {
            () = graceful.shutdown() => {}
            () = tokio::time::sleep(self.inner.config.shutdown_grace) => {
                tracing::warn!("connections still open after the shutdown grace period");
            }
        }
        Ok(())
    }

    /// Handles one request that arrived over `transport`.
    pub async fn handle(&self, req: Request<Incoming>, transport: Transport) -> Response<Body> {
        let stream_refused = transport == Transport::Plain && !self.inner.config.plain_stream;
        let (endpoint, rsp) = match (req.method(), req.uri().path()) {
            (&Method::GET, "/v1/watch") if stream_refused => ("watch", tls_only()),
            (&Method::POST, "/v1/ack") if stream_refused => ("ack", tls_only()),
            (&Method::POST, "/v1/top-keys") if stream_refused => ("top_keys", tls_only()),
            (&Method::GET, "/v1/watch") => ("watch", self.watch(req).await),
            (&Method::POST, "/v1/ack") => ("ack", self.ack(req).await),
            (&Method::POST, "/v1/top-keys") => ("top_keys", self.top_keys(req).await),
            (&Method::GET | &Method::HEAD, "/healthz") => ("healthz", text(StatusCode::OK, "ok\n")),
            (&Method::GET | &Method::HEAD, "/readyz") => ("readyz", self.readyz()),
            (&Method::GET, "/metrics") => ("metrics", self.metrics()),
            (_, "/v1/watch" | "/healthz" | "/readyz" | "/metrics") => {
                ("other", method_not_allowed("GET"))
            }
            (_, "/v1/ack" | "/v1/top-keys") => ("other", method_not_allowed("POST")),
            _ => (
                "other",
                problem(StatusCode::NOT_FOUND, "no such endpoint".to_string()),
            ),
        };
        self.inner.metrics.request(endpoint, rsp.status().as_u16());
        rsp
    }

    fn readyz(&self) -> Response<Body> {
        if *self.inner.ready.borrow() && !*self.inner.drain_tx.borrow() {
            text(StatusCode::OK, "ok\n")
        } else {
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: waiting for the initial list of policies and pods\n",
            )
        }
    }

    fn metrics(&self) -> Response<Body> {
        match crate::metrics::encode(&self.inner.registry) {
            Ok(body) => {
                let mut rsp = Response::new(full(body));
                rsp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static(
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    ),
                );
                rsp
            }
            Err(_) => problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "metrics encoding failed".to_string(),
            ),
        }
    }

    async fn authenticate<B>(&self, req: &Request<B>) -> Result<Identity, Response<Body>> {
        let Some(token) = bearer_token(req.headers()) else {
            return Err(unauthorized(
                "missing Authorization: Bearer <service account token>",
            ));
        };
        match self.inner.auth.authenticate(token).await {
            Ok(identity) => Ok(identity),
            Err(AuthError::Unauthenticated(why)) => Err(unauthorized(&why)),
            Err(AuthError::Unavailable(why)) => {
                tracing::warn!(error = %why, "cannot review tokens");
                Err(retry_later("cannot verify the token right now"))
            }
        }
    }

    async fn watch(&self, req: Request<Incoming>) -> Response<Body> {
        let q = match WatchQuery::parse(req.uri().query()) {
            Ok(q) => q,
            Err(e) => return problem(StatusCode::BAD_REQUEST, e),
        };
        let identity = match self.authenticate(&req).await {
            Ok(i) => i,
            Err(rsp) => return rsp,
        };
        if let Err(why) = authorize(&identity, &q.namespace, &q.pod) {
            tracing::info!(user = %identity.username, namespace = %q.namespace, pod = %q.pod, %why, "stream refused");
            return problem(StatusCode::FORBIDDEN, why);
        }
        if !*self.inner.ready.borrow() {
            return retry_later("the controller has not synced its watches yet");
        }
        if *self.inner.drain_tx.borrow() {
            return retry_later("the controller is shutting down");
        }
        if !self.wait_for_pod(&q.namespace, &q.pod, &identity).await {
            return problem(
                StatusCode::NOT_FOUND,
                format!(
                    "pod {}/{} is not known to the controller",
                    q.namespace, q.pod
                ),
            );
        }
        if let Err(why) = self.same_incarnation(&identity, &q.namespace, &q.pod) {
            return problem(StatusCode::FORBIDDEN, why);
        }
        let resume = q.since.zip(q.epoch.as_deref());
        let Some((conn, sub)) =
            membership::connect(&self.inner.index, &q.namespace, &q.pod, resume, q.redis)
        else {
            return problem(
                StatusCode::NOT_FOUND,
                format!(
                    "pod {}/{} is not known to the controller",
                    q.namespace, q.pod
                ),
            );
        };
        self.open_stream(&q, conn, sub)
    }

    /// The NDJSON body of an accepted stream: the first snapshot, then changes and heartbeats
    /// until the sidecar goes away or the controller drains.
    fn open_stream(&self, q: &WatchQuery, conn: Connection, sub: Subscription) -> Response<Body> {
        for lag in &sub.lag {
            self.inner.metrics.stream_lag(*lag);
        }
        tracing::info!(namespace = %q.namespace, pod = %q.pod, resumed = sub.resumed, "rule stream opened");
        let epoch = self.inner.index.read().epoch().to_string();
        let heartbeat = self.inner.config.heartbeat.max(Duration::from_millis(10));
        let mut ticker = tokio::time::interval_at(Instant::now() + heartbeat, heartbeat);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let stream = RuleStream {
            rx: sub.rx,
            drain: self.inner.drain_tx.subscribe(),
            heartbeat: ticker,
            epoch: epoch.clone(),
            resume: sub.resumed.then_some(q.since).flatten(),
            first: true,
            check: false,
            sent_version: None,
            sent_members: None,
            metrics: self.inner.metrics.clone(),
            key_hash_secret: self.inner.config.key_hash_secret.clone(),
            key_hash_final: false,
            _open: OpenStream::new(self.inner.metrics.clone()),
            _conn: conn,
        };
        let body = futures_util::stream::unfold(stream, |mut s| async move {
            let line = s.next_line().await?;
            Some((Ok::<_, Infallible>(Frame::data(line)), s))
        });
        let mut rsp = Response::new(StreamBody::new(body).boxed_unsync());
        let h = rsp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Ok(v) = HeaderValue::from_str(&epoch) {
            h.insert("x-tollgate-epoch", v);
        }
        rsp
    }

    /// [`same_incarnation`] against the pod the index knows under this name.
    fn same_incarnation(
        &self,
        identity: &Identity,
        namespace: &str,
        pod: &str,
    ) -> Result<(), String> {
        let current = self.inner.index.read().pod_uid(namespace, pod);
        same_incarnation(identity, current.as_deref()).inspect_err(|why| {
            tracing::info!(namespace, pod, %why, "stale pod token refused");
        })
    }

    /// Waits up to the grace period for the pod watch to deliver `pod`, and, for a token bound
    /// to a pod UID, that incarnation of it ([`same_incarnation`]): a re-created pod's sidecar
    /// may connect before the watch has replaced the earlier pod. Whether the pod (any
    /// incarnation) is known.
    async fn wait_for_pod(&self, namespace: &str, pod: &str, identity: &Identity) -> bool {
        let mut rx = self.inner.index.read().pods_rx();
        let deadline = Instant::now() + self.inner.config.unknown_pod_grace;
        let current = |index: &crate::index::Index| {
            index.has_pod(namespace, pod)
                && same_incarnation(identity, index.pod_uid(namespace, pod).as_deref()).is_ok()
        };
        loop {
            if current(&self.inner.index.read()) {
                return true;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => continue,
                _ => return self.inner.index.read().has_pod(namespace, pod),
            }
        }
    }

    async fn ack(&self, req: Request<Incoming>) -> Response<Body> {
        let identity = match self.authenticate(&req).await {
            Ok(i) => i,
            Err(rsp) => return rsp,
        };
        let body = match read_body(req.into_body(), MAX_ACK_BYTES, "ack").await {
            Ok(b) => b,
            Err(rsp) => return rsp,
        };
        let ack: Ack = match serde_json::from_slice(&body) {
            Ok(a) => a,
            Err(e) => {
                self.inner.metrics.ack("bad_request");
                return problem(StatusCode::BAD_REQUEST, format!("invalid ack: {e}"));
            }
        };
        if let Err(why) = authorize(&identity, &ack.namespace, &ack.pod)
            .and_then(|()| self.same_incarnation(&identity, &ack.namespace, &ack.pod))
        {
            return problem(StatusCode::FORBIDDEN, why);
        }
        match membership::ack(
            &self.inner.index,
            &ack.namespace,
            &ack.pod,
            ack.version,
            &ack.epoch,
        ) {
            Ok(lags) => {
                self.inner.metrics.ack("ok");
                for lag in lags {
                    self.inner.metrics.stream_lag(lag);
                }
                let mut rsp = Response::new(empty());
                *rsp.status_mut() = StatusCode::NO_CONTENT;
                rsp
            }
            Err(e @ AckError::UnknownPod) => {
                self.inner.metrics.ack("unknown_pod");
                problem(StatusCode::NOT_FOUND, e.to_string())
            }
            Err(e @ AckError::EpochMismatch { .. }) => {
                self.inner.metrics.ack("epoch_mismatch");
                problem(StatusCode::CONFLICT, e.to_string())
            }
            Err(e @ AckError::FutureVersion { .. }) => {
                self.inner.metrics.ack("future_version");
                problem(StatusCode::CONFLICT, e.to_string())
            }
        }
    }
}

impl Server {
    /// `POST /v1/top-keys`: merged whole or refused whole (422 says why), so a sidecar that
    /// sends keys of another namespace's policy counts for nothing.
    async fn top_keys(&self, req: Request<Incoming>) -> Response<Body> {
        let identity = match self.authenticate(&req).await {
            Ok(i) => i,
            Err(rsp) => return rsp,
        };
        let body = match read_body(req.into_body(), MAX_TOP_KEYS_BYTES, "top-keys").await {
            Ok(b) => b,
            Err(rsp) => return rsp,
        };
        let report: TopKeysReport = match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    format!("invalid top-keys report: {e}"),
                );
            }
        };
        if let Err(why) = authorize(&identity, &report.namespace, &report.pod)
            .and_then(|()| self.same_incarnation(&identity, &report.namespace, &report.pod))
        {
            return problem(StatusCode::FORBIDDEN, why);
        }
        let index = &self.inner.index;
        let uid_of = |namespace: &str, name: &str| index.read().policy_uid(namespace, name);
        match self
            .inner
            .config
            .top_keys
            .record(&report, &uid_of, Instant::now())
        {
            Ok(()) => {
                let mut rsp = Response::new(empty());
                *rsp.status_mut() = StatusCode::NO_CONTENT;
                rsp
            }
            Err(why) => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("top-keys report refused: {why}"),
            ),
        }
    }
}

/// Reads a small request body; too large is 413, broken is 400.
async fn read_body(body: Incoming, max: usize, what: &str) -> Result<Bytes, Response<Body>> {
    match Limited::new(body, max).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => {
            let code = if e.is::<http_body_util::LengthLimitError>() {
                StatusCode::PAYLOAD_TOO_LARGE
            } else {
                StatusCode::BAD_REQUEST
            };
            Err(problem(code, format!("cannot read the {what} body: {e}")))
        }
    }
}

/// Parsed `/v1/watch` query.
#[derive(Debug, PartialEq, Eq)]
struct WatchQuery {
    namespace: String,
    pod: String,
    since: Option<u64>,
    epoch: Option<String>,
    /// `redis=false`: the sidecar has no Redis store and enforces Global rules per pod.
    redis: bool,
}

impl WatchQuery {
    fn parse(query: Option<&str>) -> Result<WatchQuery, String> {
        let mut namespace = None;
        let mut pod = None;
        let mut since = None;
        let mut epoch = None;
        let mut redis = true;
        for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match &*k {
                "namespace" => namespace = Some(v.into_owned()),
                "pod" => pod = Some(v.into_owned()),
                "since" => {
                    since = Some(v.parse::<u64>().map_err(|_| {
                        format!("since={v:?} is not a version (a non-negative integer)")
                    })?)
                }
                "epoch" => epoch = Some(v.into_owned()).filter(|e| !e.is_empty()),
                "redis" => redis = v != "false",
                _ => {}
            }
        }
        let namespace = namespace
            .filter(|n| !n.is_empty())
            .ok_or("query parameter namespace is required")?;
        let pod = pod
            .filter(|n| !n.is_empty())
            .ok_or("query parameter pod is required")?;
        Ok(WatchQuery {
            namespace,
            pod,
            since,
            epoch,
            redis,
        })
    }
}

/// One open stream: produces the next line when hyper asks for it.
struct RuleStream {
    rx: watch::Receiver<PodRules>,
    drain: watch::Receiver<bool>,
    heartbeat: tokio::time::Interval,
    epoch: String,
    /// The client resumed at this (current) version: start with a heartbeat, not a snapshot.
    resume: Option<u64>,
    first: bool,
    /// The pod state may differ from what was sent.
    check: bool,
    sent_version: Option<u64>,
    sent_members: Option<BTreeMap<String, u32>>,
    metrics: Arc<Metrics>,
    /// A new value (a rotation) is sent at once, in a snapshot of the current version.
    key_hash_secret: watch::Receiver<Option<Arc<str>>>,
    /// The secret's sender is gone (no Secret to follow): stop waiting for changes.
    key_hash_final: bool,
    _open: OpenStream,
    _conn: Connection,
}

impl RuleStream {
    async fn next_line(&mut self) -> Option<Bytes> {
        let msg = self.next_message().await?;
        let kind = match &msg {
            StreamMessage::Snapshot { .. } => "snapshot",
            StreamMessage::Members { .. } => "members",
            StreamMessage::Heartbeat { .. } => "heartbeat",
        };
        match serde_json::to_vec(&msg) {
            Ok(mut line) => {
                line.push(b'\n');
                self.metrics.stream_message(kind);
                self.heartbeat.reset();
                Some(Bytes::from(line))
            }
            Err(error) => {
                tracing::error!(%error, "cannot encode a stream message; closing the stream");
                None
            }
        }
    }

    async fn next_message(&mut self) -> Option<StreamMessage> {
        loop {
            if *self.drain.borrow() {
                return None;
            }
            if self.first {
                self.first = false;
                let cur = self.rx.borrow_and_update().clone();
                if let Some(v) = self.resume.take().filter(|v| *v == cur.version) {
                    // The client holds this version; its member counts may be stale, so a
                    // members message follows the heartbeat.
                    self.sent_version = Some(v);
                    self.sent_members = None;
                    self.check = true;
                    return Some(StreamMessage::Heartbeat { version: v });
                }
                return Some(self.snapshot(cur));
            }
            if self.check || self.rx.has_changed().unwrap_or(false) {
                self.check = false;
                let cur = self.rx.borrow_and_update().clone();
                if Some(cur.version) != self.sent_version {
                    return Some(self.snapshot(cur));
                }
                if Some(&cur.members) != self.sent_members.as_ref() {
                    self.sent_members = Some(cur.members.clone());
                    return Some(StreamMessage::Members {
                        version: cur.version,
                        members: cur.members,
                    });
                }
            }
            tokio::select! {
                biased;
                r = self.drain.changed() => {
                    if r.is_err() || *self.drain.borrow() {
                        return None;
                    }
                }
                r = self.rx.changed() => {
                    if r.is_err() {
                        // The pod left the index: end the stream; a reconnect gets 404.
                        tracing::info!(namespace = %self._conn.namespace(), pod = %self._conn.pod(), "pod deleted; closing its rule stream");
                        return None;
                    }
                    self.check = true;
                }
                r = self.key_hash_secret.changed(), if !self.key_hash_final => {
                    match r {
                        // Sidecars take the secret from snapshots: send the current one again.
                        Ok(()) => {
                            self.sent_version = None;
                            self.check = true;
                        }
                        Err(_) => self.key_hash_final = true,
                    }
                }
                _ = self.heartbeat.tick() => {
                    return Some(StreamMessage::Heartbeat {
                        version: self.sent_version.unwrap_or(0),
                    });
                }
            }
        }
    }

    fn snapshot(&mut self, cur: PodRules) -> StreamMessage {
        self.sent_version = Some(cur.version);
        self.sent_members = Some(cur.members.clone());
        StreamMessage::Snapshot {
            wire_version: WIRE_VERSION,
            version: cur.version,
            policies: cur.policies.iter().map(|p| (**p).clone()).collect(),
            members: cur.members,
            epoch: self.epoch.clone(),
            key_hash_secret: self
                .key_hash_secret
                .borrow_and_update()
                .as_deref()
                .map(str::to_string),
        }
    }
}

// --- responses ---

fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into()).boxed_unsync()
}

fn empty() -> Body {
    Full::new(Bytes::new()).boxed_unsync()
}

fn text(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut rsp = Response::new(full(body));
    *rsp.status_mut() = status;
    rsp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    rsp
}

/// An RFC 9457 problem response.
fn problem(status: StatusCode, detail: String) -> Response<Body> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut rsp = Response::new(full(body.to_string()));
    *rsp.status_mut() = status;
    rsp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    rsp
}

fn unauthorized(why: &str) -> Response<Body> {
    let mut rsp = problem(StatusCode::UNAUTHORIZED, why.to_string());
    rsp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"tollgate\""),
    );
    rsp
}

fn retry_later(why: &str) -> Response<Body> {
    let mut rsp = problem(StatusCode::SERVICE_UNAVAILABLE, why.to_string());
    rsp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    rsp
}

/// The answer on the plain port when `--plain-stream=false`.
fn tls_only() -> Response<Body> {
    problem(
        StatusCode::FORBIDDEN,
        "this controller serves the rule stream over TLS only (--plain-stream=false): connect \
         with https to its --tls-listen port"
            .to_string(),
    )
}

fn method_not_allowed(allow: &'static str) -> Response<Body> {
    let mut rsp = problem(StatusCode::METHOD_NOT_ALLOWED, format!("use {allow}"));
    rsp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    rsp
}

#[cfg(test)]
mod tests;
