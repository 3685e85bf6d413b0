//! The reverse proxy: accept, decide, forward, answer.
//!
//! Bodies are streamed in both directions (never buffered), `Upgrade` (WebSocket) is passed
//! through, hop-by-hop headers are dropped per RFC 9110 §7.6.1 and `X-Forwarded-For` gets the
//! peer appended. Upstream failures map to 502 (connect) and 504 (timeout), never to 429.
//!
//! Plain HTTP/1.1 keep-alive traffic takes the fast path in [`h1`]; hyper serves the rest
//! (HTTP/2, upgrades, streamed request bodies, malformed heads).

pub mod h1;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Request, Response, StatusCode, Uri};
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tollgate_crd::compiled::KeySource;
use tollgate_limiter::{Clock, Permit};

use crate::metrics::ProxyMetrics;
use crate::upstream::{Lease, Upstream};
use tollgate_engine::keys;
use tollgate_engine::response;
use tollgate_engine::rules::{Outcome, Rejection, RuleSet, Verdict};
use tollgate_engine::shared::Shared;
use tollgate_telemetry as telemetry;
use tracing::Instrument;

/// Settings of the proxy path.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub upstream: Uri,
    pub upstream_timeout: Duration,
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    pub shadow_header: bool,
    /// Serve plain HTTP/1.1 on the fast path ([`h1`]); off, hyper serves everything.
    pub fast_http1: bool,
}

/// The proxy edge: the engine it decides with, and its own upstream.
pub struct Proxy {
    pub engine: Arc<Shared>,
    pub config: ProxyConfig,
    /// The proxy's own metrics, in the engine's registry.
    metrics: ProxyMetrics,
    upstream: Upstream,
    /// `Host` for requests that arrive without one (HTTP/1.0, HTTP/2 without `:authority`).
    upstream_host: HeaderValue,
}

impl Proxy {
    /// The proxy on `engine`, its metrics registered in the engine's registry (one proxy per
    /// engine: a name is registered once).
    pub fn new(engine: Arc<Shared>, config: ProxyConfig) -> anyhow::Result<Proxy> {
        let scheme = config
            .upstream
            .scheme()
            .cloned()
            .unwrap_or(http::uri::Scheme::HTTP);
        if scheme != http::uri::Scheme::HTTP {
            anyhow::bail!(
                "--upstream {}: only http:// upstreams are supported (the app is on localhost)",
                config.upstream
            );
        }
        let authority =
            config.upstream.authority().cloned().ok_or_else(|| {
                anyhow::anyhow!("--upstream {} has no host:port", config.upstream)
            })?;
        let host = authority.host();
        let port = authority.port_u16().unwrap_or(80);
        // As hyper-util's client did: the port only when it is not the scheme's default.
        let host_header = if port == 80 {
            host.to_string()
        } else {
            format!("{host}:{port}")
        };
        let upstream_host = HeaderValue::from_str(&host_header)
            .map_err(|_| anyhow::anyhow!("--upstream {}: invalid host", config.upstream))?;
        let metrics = engine.metrics().register(ProxyMetrics::register);
        Ok(Proxy {
            engine,
            config,
            metrics,
            upstream: Upstream::new(format!("{host}:{port}")),
            upstream_host,
        })
    }
}

/// Accepts connections until `shutdown` resolves, then drains in-flight requests for up to
/// `drain`.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Proxy>,
    shutdown: impl std::future::Future<Output = ()>,
    drain: Duration,
) {
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(shared.config.header_read_timeout)
        .max_buf_size(shared.config.max_header_bytes.max(8192))
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(shared.config.max_header_bytes as u32);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    // Tells connections still waiting for their first bytes that the server is stopping: they
    // hold a graceful-shutdown watcher, so without this a client that opened a connection and
    // sent nothing (a pre-warmed pool, a browser's speculative connection) delayed every
    // shutdown by the header read timeout.
    let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
    let head_timeout = shared.config.header_read_timeout;
    let fast_path = shared.config.fast_http1;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            (stream, peer) = tollgate_engine::listen::accept(&listener) => {
                let fast = fast_path.then(|| Arc::clone(&shared));
                let shared = Arc::clone(&shared);
                // Formatted once per connection, cloned (a refcount) per request.
                let peer_ip = HeaderValue::from_str(&peer.ip().to_string()).ok();
                let fast_peer_ip = peer_ip.clone();
                let service = hyper::service::service_fn(move |req| {
                    let shared = Arc::clone(&shared);
                    let peer_ip = peer_ip.clone();
                    async move { Ok::<_, Infallible>(handle(shared, peer, peer_ip, req).await) }
                });
                let builder = builder.clone();
                // Held by fast-path connections too, so the drain waits for them.
                let watcher = graceful.watcher();
                let mut stopping = stopping.clone();
                tokio::spawn(async move {
                    // hyper-util reads the first bytes (to tell HTTP/1 from HTTP/2) before the
                    // HTTP/1 header timer starts: bound that phase too, or a client that sends
                    // nothing holds the connection forever.
                    tokio::select! {
                        known = tokio::time::timeout(head_timeout, protocol_known(&stream)) => {
                            if !matches!(known, Ok(true)) {
                                tracing::debug!(%peer, "client sent no request in time; closing");
                                return;
                            }
                        }
                        _ = stopping.wait_for(|stopping| *stopping) => {
                            tracing::debug!(%peer, "stopping before the client sent a request; closing");
                            return;
                        }
                    }
                    let io = match fast {
                        Some(proxy) => match h1::serve(&proxy, stream, peer, fast_peer_ip, stopping).await {
                            Some(handed_off) => handed_off,
                            None => return,
                        },
                        None => h1::Prefixed::whole(stream),
                    };
                    let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
                    if let Err(e) = watcher.watch(conn.into_owned()).await {
                        tracing::debug!(error = %e, %peer, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    let _ = stopping_tx.send(true);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(?drain, "drain timed out; closing remaining connections");
    }
}

/// The HTTP/2 connection preface, which hyper-util's protocol detection waits for.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Waits until the client has sent enough to tell HTTP/1 from HTTP/2 (a byte that does not
/// continue the HTTP/2 preface, or the whole preface). False if it closed first.
async fn protocol_known(stream: &tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; H2_PREFACE.len()];
    loop {
        match stream.peek(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) if n == buf.len() || buf[..n] != H2_PREFACE[..n] => return true,
            // A partial preface: peek returns at once while no new bytes arrive, so poll.
            Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// Handles one request end to end.
pub async fn handle(
    shared: Arc<Proxy>,
    peer: SocketAddr,
    peer_ip: Option<HeaderValue>,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    if !telemetry::enabled() {
        return handle_inner(shared, peer, peer_ip, req, None).await;
    }
    let span = telemetry::request_span(req.method(), req.uri().path(), req.headers());
    let resp = handle_inner(shared, peer, peer_ip, req, Some(&span))
        .instrument(span.clone())
        .await;
    span.record("http.response.status_code", resp.status().as_u16());
    resp
}

/// The jitter seed of a request that gets a 429 or 503 (0 otherwise: nothing to spread). The
/// client's address is read the way the deciding rule reads it: its `clientIP` key's
/// `trustedHops`, else the policy's bypass `trustedHops`, else the TCP peer.
fn rejection_seed(rules: &RuleSet, verdict: &Verdict, parts: &Parts, peer: &SocketAddr) -> u64 {
    let (rule, fingerprint) = match (&verdict.rejected, verdict.unavailable) {
        (Some(r), _) => (r.limited.rule, r.limited.fingerprint),
        (None, Some(ri)) => (ri, 0),
        (None, None) => return 0,
    };
    keys::client_seed(parts, peer, trusted_hops(rules, rule), fingerprint)
}

/// The `X-Forwarded-For` entries trusted for the client address of a rule's requests: the
/// rule's `clientIp` key, else its policy's bypass setting.
fn trusted_hops(rules: &RuleSet, rule: usize) -> u32 {
    let active = &rules.rules[rule];
    active
        .rule
        .key
        .iter()
        .find_map(|k| match k {
            KeySource::ClientIp { trusted_hops } => Some(*trusted_hops),
            _ => None,
        })
        .unwrap_or(rules.policies[active.policy].compiled.bypass.trusted_hops)
}

async fn handle_inner(
    shared: Arc<Proxy>,
    peer: SocketAddr,
    peer_ip: Option<HeaderValue>,
    req: Request<Incoming>,
    span: Option<&tracing::Span>,
) -> Response<ProxyBody> {
    let rules = shared.engine.rules();
    let (parts, body) = req.into_parts();
    let verdict = shared.engine.decide(&rules, &parts, &peer).await;
    if let Some(span) = span {
        record_decision(span, &rules, &verdict);
    }
    match verdict.outcome() {
        Outcome::Unavailable(ri) => {
            let seed = rejection_seed(&rules, &verdict, &parts, &peer);
            audit_unavailable(&shared, &rules, ri, &parts, &peer, span);
            refusal(&parts, response::unavailable(&rules, &verdict, ri, seed))
        }
        Outcome::Reject(rejection) => {
            let seed = rejection_seed(&rules, &verdict, &parts, &peer);
            audit_rejection(&shared, &rules, rejection, &parts, &peer, span);
            refusal(&parts, response::too_many_requests(&rules, &verdict, seed))
        }
        Outcome::Admit => {
            let req = Request::from_parts(parts, body);
            forward(shared, rules, verdict, req, peer, peer_ip, span).await
        }
    }
}

/// A refusal made before the request body was read. A client that sent `Expect:
/// 100-continue` never gets its `100 Continue`, so whether it sends the body is unknown and
/// hyper closes the connection after the answer: the answer says so (`Connection: close`), as
/// RFC 9110 §9.6 asks of a server about to close.
fn refusal(parts: &Parts, mut resp: Response<Bytes>) -> Response<ProxyBody> {
    if parts.version <= http::Version::HTTP_11 && expects_continue(&parts.headers) {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    local(resp)
}

fn expects_continue(headers: &HeaderMap) -> bool {
    headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

fn record_decision(span: &tracing::Span, rules: &RuleSet, verdict: &Verdict) {
    let (decision, rule) = match (verdict.outcome(), verdict.tightest()) {
        (Outcome::Unavailable(ri), _) => ("unavailable", Some(ri)),
        (Outcome::Reject(r), _) => ("rejected", Some(r.limited.rule)),
        (Outcome::Admit, Some(t)) => ("allowed", Some(t.rule)),
        (Outcome::Admit, None) => ("unlimited", None),
    };
    span.record("tollgate.decision", decision);
    if let Some(ri) = rule {
        span.record("tollgate.rule", rules.rules[ri].rule.id.as_str());
    }
}

fn audit_rejection(
    shared: &Proxy,
    rules: &RuleSet,
    rejection: &Rejection,
    req: &Parts,
    peer: &SocketAddr,
    span: Option<&tracing::Span>,
) {
    let ri = rejection.limited.rule;
    let rule = &rules.rules[ri];
    let request = refused_request(rules, ri, req, peer, span);
    shared
        .engine
        .audit()
        .rejected(rule, rejection, &request, shared.engine.metrics());
}

/// The audit line of a fail-closed rule's 503. The verdict keeps no key for it, so the rule's
/// key is built again (off the hot path: the store is away).
fn audit_unavailable(
    shared: &Proxy,
    rules: &RuleSet,
    ri: usize,
    req: &Parts,
    peer: &SocketAddr,
    span: Option<&tracing::Span>,
) {
    let mut key = Vec::new();
    let counted =
        rules.applies(ri, req, peer, &mut key) == tollgate_engine::rules::Applies::Counted;
    let request = refused_request(rules, ri, req, peer, span);
    shared.engine.audit().unavailable(
        &rules.rules[ri],
        counted.then_some(key.as_slice()),
        &request,
        shared.engine.metrics(),
    );
}

fn refused_request<'a>(
    rules: &'a RuleSet,
    ri: usize,
    req: &'a Parts,
    peer: &'a SocketAddr,
    span: Option<&'a tracing::Span>,
) -> tollgate_engine::audit::RefusedRequest<'a> {
    tollgate_engine::audit::RefusedRequest {
        policy: &rules.policies[rules.rules[ri].policy].id,
        method: &req.method,
        path: req.uri.path(),
        headers: &req.headers,
        peer,
        trusted_hops: trusted_hops(rules, ri),
        span,
    }
}

/// An admitted request: shaped, sent to the app within the upstream timeout, and its response
/// (or the app's failure as 502/504) returned with the RateLimit fields.
async fn forward(
    shared: Arc<Proxy>,
    rules: Arc<RuleSet>,
    verdict: Verdict,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    peer_ip: Option<HeaderValue>,
    span: Option<&tracing::Span>,
) -> Response<ProxyBody> {
    if verdict.delay > 0 {
        tokio::time::sleep(Duration::from_nanos(verdict.delay)).await;
    }
    let inbound_upgrade = is_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
    let mut upstream_req = to_upstream(req, &peer, peer_ip, &shared);
    if let Some(span) = span {
        telemetry::inject(span, upstream_req.headers_mut());
    }
    let t0 = shared.engine.clock().now();
    let result = tokio::time::timeout(
        shared.config.upstream_timeout,
        shared.upstream.send(upstream_req),
    )
    .await;
    shared
        .metrics
        .upstream_seconds
        .observe(shared.engine.clock().now().saturating_sub(t0) as f64 / 1e9);
    let (resp, lease) = match result {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, upstream = %shared.config.upstream, "upstream request failed");
            return local(upstream_failure(&shared, &rules, &verdict, false));
        }
        Err(_) => return local(upstream_failure(&shared, &rules, &verdict, true)),
    };
    if !verdict.settlements.is_empty() {
        let now = shared.engine.clock().now();
        let status = resp.status().as_u16();
        rules.settle(&verdict.settlements, status, resp.headers(), now);
    }
    admitted_response(&shared, &rules, verdict, resp, lease, inbound_upgrade)
}

/// The app could not be reached (502) or did not answer in time (504): counted, the costs that
/// depend on the status settled, and the problem answer made.
fn upstream_failure(
    shared: &Proxy,
    rules: &RuleSet,
    verdict: &Verdict,
    timed_out: bool,
) -> Response<Bytes> {
    let (kind, status, title, detail) = if timed_out {
        (
            "timeout",
            StatusCode::GATEWAY_TIMEOUT,
            "Gateway Timeout",
            "The application behind the rate limiter did not answer in time.",
        )
    } else {
        (
            "connect",
            StatusCode::BAD_GATEWAY,
            "Bad Gateway",
            "The application behind the rate limiter could not be reached.",
        )
    };
    shared.metrics.upstream_error(kind);
    if !verdict.settlements.is_empty() {
        let now = shared.engine.clock().now();
        rules.settle(
            &verdict.settlements,
            status.as_u16(),
            &HeaderMap::new(),
            now,
        );
    }
    response::problem(status, title, detail)
}

/// The app's response on its way back: hop-by-hop fields dropped (or an upgrade spliced),
/// the RateLimit fields added, and the permits and pooled connection held until its body ends.
fn admitted_response(
    shared: &Proxy,
    rules: &RuleSet,
    verdict: Verdict,
    mut resp: Response<Incoming>,
    lease: crate::upstream::Lease,
    inbound_upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Response<ProxyBody> {
    let mut lease = Some(lease);
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        // The connection now belongs to the upgraded stream, never to the pool.
        lease = None;
        if let Some(inbound) = inbound_upgrade {
            let outbound = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                match (inbound.await, outbound.await) {
                    (Ok(client), Ok(app)) => {
                        let mut client = TokioIo::new(client);
                        let mut app = TokioIo::new(app);
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut app).await;
                    }
                    (Err(e), _) | (_, Err(e)) => tracing::debug!(error = %e, "upgrade failed"),
                }
            });
        }
    } else {
        strip_hop_by_hop(resp.headers_mut());
    }
    let headers = resp.headers_mut();
    response::add_admitted_fields(headers, rules, &verdict);
    if verdict.shadow_rejections > 0 && shared.config.shadow_header {
        headers.insert(
            response::SHADOW_HEADER.clone(),
            HeaderValue::from(verdict.shadow_rejections),
        );
    }
    resp.map(|body| ProxyBody::Upstream {
        body,
        permits: verdict.permits,
        lease,
    })
}

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers.get_all(header::CONNECTION).iter().any(|v| {
            v.to_str().is_ok_and(|s| {
                s.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
        })
}

/// Turns the inbound request into the upstream request.
fn to_upstream(
    req: Request<Incoming>,
    peer: &SocketAddr,
    peer_ip: Option<HeaderValue>,
    shared: &Proxy,
) -> Request<Incoming> {
    let (mut parts, body) = req.into_parts();
    prepare_upstream(&mut parts, peer, peer_ip, shared);
    Request::from_parts(parts, body)
}

/// The request head as the app gets it: origin-form target, HTTP/1.1, a `Host`, hop-by-hop
/// fields dropped (an upgrade's kept), and the peer appended to `X-Forwarded-For`.
fn prepare_upstream(
    parts: &mut Parts,
    peer: &SocketAddr,
    peer_ip: Option<HeaderValue>,
    shared: &Proxy,
) {
    let upgrade = is_upgrade(&parts.headers);
    let upgrade_proto = parts.headers.get(header::UPGRADE).cloned();
    if !parts.headers.contains_key(header::HOST) {
        let host = parts
            .uri
            .authority()
            .and_then(|auth| HeaderValue::from_str(auth.as_str()).ok())
            .unwrap_or_else(|| shared.upstream_host.clone());
        parts.headers.insert(header::HOST, host);
    }
    // The app gets origin-form (`/path?query`). HTTP/1 clients almost always send that already,
    // so only absolute-form targets (HTTP/2, proxy-style requests) are rebuilt.
    if parts.uri.scheme().is_some() || parts.uri.authority().is_some() {
        let path_and_query = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        parts.uri = Uri::from(path_and_query);
    } else if parts.uri.path_and_query().is_none() {
        parts.uri = Uri::from_static("/");
    }
    // The upstream connection is always HTTP/1.1, whatever the client spoke.
    parts.version = http::Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    if upgrade && let Some(proto) = upgrade_proto {
        parts.headers.insert(header::UPGRADE, proto);
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    append_forwarded_for(&mut parts.headers, peer, peer_ip);
}

static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Position of `name` in [`HOP_BY_HOP`]. The length test rejects nearly every other header
/// without comparing names.
fn hop_by_hop_index(name: &HeaderName) -> Option<usize> {
    match name.as_str().len() {
        2 | 7 | 10 | 16 | 17 | 18 => HOP_BY_HOP.iter().position(|h| h == name),
        _ => None,
    }
}

/// Removes hop-by-hop headers, including any named in `Connection`. One pass over the names
/// finds which are present, so a message without them (most requests) costs no hash lookups,
/// and one with only `Connection: keep-alive` (most responses) costs two.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut present = 0u8;
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return;
    }
    // HOP_BY_HOP[0] is `Connection`: the headers it names go too.
    if present & 1 != 0 {
        let mut values = headers.get_all(header::CONNECTION).iter();
        let first = values.next().cloned();
        // Rare: more than one `Connection` line (an empty Vec does not allocate).
        let more: Vec<HeaderValue> = values.cloned().collect();
        for v in first.iter().chain(&more) {
            for token in v.to_str().unwrap_or_default().split(',') {
                let token = token.trim();
                // `close` names no header and hop-by-hop names go below anyway: only other
                // names need a lookup (parsed on the stack; invalid names match nothing).
                if !token.is_empty()
                    && !token.eq_ignore_ascii_case("close")
                    && !HOP_BY_HOP
                        .iter()
                        .any(|h| token.eq_ignore_ascii_case(h.as_str()))
                {
                    headers.remove(token);
                }
            }
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
}

fn append_forwarded_for(headers: &mut HeaderMap, peer: &SocketAddr, peer_ip: Option<HeaderValue>) {
    static XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
    // Common case: no X-Forwarded-For yet, the peer's value is already formatted.
    if !headers.contains_key(&XFF)
        && let Some(v) = peer_ip
    {
        headers.insert(XFF.clone(), v);
        return;
    }
    let ip = peer.ip().to_string();
    let mut combined = String::new();
    for v in headers.get_all(&XFF) {
        if let Ok(s) = v.to_str() {
            if !combined.is_empty() {
                combined.push_str(", ");
            }
            combined.push_str(s);
        }
    }
    if !combined.is_empty() {
        combined.push_str(", ");
    }
    combined.push_str(&ip);
    if let Ok(v) = HeaderValue::from_str(&combined) {
        headers.insert(XFF.clone(), v);
    }
}

fn local(resp: Response<Bytes>) -> Response<ProxyBody> {
    resp.map(|b| ProxyBody::Local { body: Full::new(b) })
}

/// The response body: streamed from the upstream (holding the request's concurrency permits
/// and the app connection until it completes or the client goes away) or generated here.
pub enum ProxyBody {
    Upstream {
        body: Incoming,
        permits: Vec<Permit>,
        /// Returned to the pool once `body` has been read to the end; closed otherwise.
        lease: Option<Lease>,
    },
    Local {
        body: Full<Bytes>,
    },
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        // Both bodies are Unpin.
        match self.get_mut() {
            ProxyBody::Upstream { body, lease, .. } => {
                let frame = Pin::new(&mut *body).poll_frame(cx);
                if let Poll::Ready(None) = frame
                    && let Some(lease) = lease
                {
                    lease.release();
                }
                frame
            }
            ProxyBody::Local { body } => match Pin::new(body).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) => Poll::Ready(Some(Ok(f))),
                Poll::Ready(Some(Err(never))) => match never {},
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Upstream { body, .. } => body.is_end_stream(),
            ProxyBody::Local { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Upstream { body, .. } => body.size_hint(),
            ProxyBody::Local { body } => body.size_hint(),
        }
    }
}

impl Drop for ProxyBody {
    /// hyper stops polling a body once `is_end_stream` says it is done (a Content-Length body
    /// after its last byte, an empty one at once), so the end is also noticed here.
    fn drop(&mut self) {
        if let ProxyBody::Upstream {
            body,
            lease: Some(lease),
            ..
        } = self
            && body.is_end_stream()
        {
            lease.release();
        }
    }
}
