//! The HTTP/1.1 fast path of the proxy edge.
//!
//! Through hyper, each proxied request crossed to the upstream connection's own task and back
//! (a dispatch channel and two wake-ups), had the app's response head parsed into a header map
//! and encoded again, and armed a timer (bench/README.md has the profile). Here one task serves
//! a plain keep-alive HTTP/1.1 client connection end to end:
//!
//! - the request head is parsed with `httparse`, and the whole request (head and body) is taken
//!   off one buffer;
//! - the engine decides on the same [`Parts`] the hyper path builds, so rules, keys, audit lines
//!   and hop-by-hop rules are shared code;
//! - the request is written to this connection's own app connection (one per client connection
//!   while it lives, kept alive), and the app's response head is copied line by line: hop-by-hop
//!   lines dropped, the RateLimit fields added, the first body bytes in the same write;
//! - the header read timeout and the upstream timeout are deadlines per connection that touch
//!   the runtime's timer about once per period, not once per request ([`Deadline`]).
//!
//! Everything else is handed to hyper with the bytes already read ([`Prefixed`]), from that
//! request on: HTTP/2 with prior knowledge, `Upgrade`, `Expect`, HTTP/1.0, `Transfer-Encoding`
//! and bodies not yet received whole (hyper streams them), `CONNECT`, and every malformed or
//! oversized head, so that 400 and 431 come from the same code as before.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Response, StatusCode};
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use super::Proxy;
use tollgate_engine::response::{self, FieldSink};
use tollgate_engine::rules::{Outcome, RuleSet, Verdict};
use tollgate_limiter::Clock;
use tollgate_telemetry as telemetry;
use tracing::Instrument;

pub mod wire;

use wire::{AppHead, Body, Framing, RequestHead, Scan};

/// Room kept for each read from the client: requests are small, and an idle keep-alive
/// connection holds no more than this.
const CLIENT_READ: usize = 8 * 1024;
/// Room kept for each read from the app: bodies are relayed in reads of this size.
const APP_READ: usize = 16 * 1024;

/// Serves `client` until it closes, the server stops or a request needs hyper. In the last case
/// the connection comes back with the bytes already read, for hyper to serve from that request
/// on.
pub(super) async fn serve(
    proxy: &Proxy,
    client: TcpStream,
    peer: SocketAddr,
    peer_ip: Option<HeaderValue>,
    stopping: watch::Receiver<bool>,
) -> Option<Prefixed> {
    let mut conn = Connection::new(proxy, client, peer, peer_ip, stopping);
    loop {
        let keep_open = match conn.next_request().await {
            Next::Request(req) => conn.exchange(req).await,
            Next::Malformed => {
                let resp = response::problem(
                    StatusCode::BAD_REQUEST,
                    "Bad Request",
                    "The request head could not be read.",
                );
                conn.answer_locally(&resp, true).await
            }
            Next::HandOff => return Some(conn.into_prefixed()),
            Next::Close => false,
        };
        if !keep_open {
            return None;
        }
    }
}

/// What the client sent next.
// Lives on the stack for one request; boxing the request would add an allocation to each.
#[allow(clippy::large_enum_variant)]
enum Next {
    Request(Incoming),
    /// A head `httparse` accepted that `http` does not (an invalid URI, say): 400, then close.
    Malformed,
    /// Hyper takes the connection from here.
    HandOff,
    Close,
}

/// A request taken whole off the client's buffer.
struct Incoming {
    parts: Parts,
    body: Bytes,
    /// The client asked to close after this exchange (`Connection: close`).
    close: bool,
}

/// One client connection and what it owns: its buffers, its app connection and its deadlines.
struct Connection<'p> {
    proxy: &'p Proxy,
    client: TcpStream,
    peer: SocketAddr,
    /// The peer's address for `X-Forwarded-For`, formatted once per connection.
    peer_ip: Option<HeaderValue>,
    /// Bytes read from the client and not yet taken (the next head; pipelined requests).
    input: BytesMut,
    /// The encoded head (and first body bytes) of the next write, to either side.
    out: Vec<u8>,
    /// The fields this sidecar adds to the current response.
    fields: FieldLines,
    /// The body of a 429 being written.
    body: Vec<u8>,
    app: Option<AppConn>,
    head_deadline: Deadline,
    app_deadline: Deadline,
    stopping: watch::Receiver<bool>,
    max_head: usize,
    /// The status of the last response written (for its span).
    status: u16,
}

/// This client connection's connection to the app, and what was read from it.
struct AppConn {
    stream: TcpStream,
    input: BytesMut,
}

/// Why the app gave no usable response head.
enum AppFailure {
    /// Connecting failed, or the connection broke or answered garbage: 502. What happened, for
    /// the log line the hyper path writes too.
    Unreachable(String),
    /// No response head within the upstream timeout: 504.
    Timeout,
}

impl<'p> Connection<'p> {
    fn new(
        proxy: &'p Proxy,
        client: TcpStream,
        peer: SocketAddr,
        peer_ip: Option<HeaderValue>,
        stopping: watch::Receiver<bool>,
    ) -> Self {
        Connection {
            proxy,
            client,
            peer,
            peer_ip,
            input: BytesMut::with_capacity(CLIENT_READ),
            out: Vec::new(),
            fields: FieldLines::default(),
            body: Vec::new(),
            app: None,
            head_deadline: Deadline::new(proxy.config.header_read_timeout),
            app_deadline: Deadline::new(proxy.config.upstream_timeout),
            stopping,
            max_head: proxy.config.max_header_bytes.max(8192),
            status: 0,
        }
    }

    fn into_prefixed(self) -> Prefixed {
        Prefixed {
            prefix: self.input,
            stream: self.client,
        }
    }

    fn stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Reads until a whole request is buffered, within the header read timeout (which also
    /// ends an idle keep-alive connection, as hyper's did).
    async fn next_request(&mut self) -> Next {
        self.head_deadline.restart();
        loop {
            if !self.input.is_empty() {
                match wire::scan_request(&self.input) {
                    Scan::Complete(head) => return self.take(&head),
                    Scan::Partial if self.input.len() < self.max_head => {}
                    Scan::Partial | Scan::HandOff => return Next::HandOff,
                }
            }
            if !self.read_client().await {
                return Next::Close;
            }
        }
    }

    /// One read from the client. False when it closed, the head timed out, or the server is
    /// stopping and no request has begun.
    async fn read_client(&mut self) -> bool {
        let idle = self.input.is_empty();
        if idle && self.stopping() {
            return false;
        }
        self.input.reserve(CLIENT_READ);
        tokio::select! {
            biased;
            read = self.client.read_buf(&mut self.input) => matches!(read, Ok(n) if n > 0),
            () = self.head_deadline.expired() => false,
            _ = self.stopping.changed(), if idle => false,
        }
    }

    /// Takes the scanned request off the buffer. Its header values are slices of one shared
    /// buffer, not copies.
    fn take(&mut self, head: &RequestHead) -> Next {
        let bytes = self.input.split_to(head.len).freeze();
        let body = self.input.split_to(head.body_len).freeze();
        match head.parts(&bytes) {
            Some(parts) => Next::Request(Incoming {
                parts,
                body,
                close: head.close,
            }),
            None => Next::Malformed,
        }
    }

    /// Decides one request and answers it, in a span of its own when tracing is on. False when
    /// the connection is to close.
    async fn exchange(&mut self, req: Incoming) -> bool {
        if !telemetry::enabled() {
            return self.decide_and_answer(req, None).await;
        }
        let parts = &req.parts;
        let span = telemetry::request_span(&parts.method, parts.uri.path(), &parts.headers);
        let keep_open = self
            .decide_and_answer(req, Some(&span))
            .instrument(span.clone())
            .await;
        span.record("http.response.status_code", self.status);
        keep_open
    }

    async fn decide_and_answer(&mut self, mut req: Incoming, span: Option<&tracing::Span>) -> bool {
        let proxy = self.proxy;
        let rules = proxy.engine.rules();
        let verdict = proxy.engine.decide(&rules, &req.parts, &self.peer).await;
        if let Some(span) = span {
            super::record_decision(span, &rules, &verdict);
        }
        match verdict.outcome() {
            Outcome::Admit => self.forward(&rules, &verdict, &mut req, span).await,
            Outcome::Unavailable(ri) => {
                let seed = super::rejection_seed(&rules, &verdict, &req.parts, &self.peer);
                super::audit_unavailable(proxy, &rules, ri, &req.parts, &self.peer, span);
                let resp = response::unavailable(&rules, &verdict, ri, seed);
                self.answer_locally(&resp, req.close).await
            }
            Outcome::Reject(rejection) => {
                let seed = super::rejection_seed(&rules, &verdict, &req.parts, &self.peer);
                super::audit_rejection(proxy, &rules, rejection, &req.parts, &self.peer, span);
                self.reject(&rules, &verdict, seed, req.close).await
            }
        }
    }

    /// Writes the 429 straight from its parts: the rule's pre-rendered body and the fields,
    /// with no header map or response built. False when the connection is to close.
    async fn reject(&mut self, rules: &RuleSet, verdict: &Verdict, seed: u64, close: bool) -> bool {
        let closing = close || self.stopping();
        self.fields.clear();
        self.body.clear();
        let written = response::write_too_many_requests(
            &mut self.fields,
            &mut self.body,
            rules,
            verdict,
            seed,
        );
        if written.is_none() {
            return false;
        }
        let status = StatusCode::TOO_MANY_REQUESTS;
        self.status = status.as_u16();
        wire::encode_made_here(&mut self.out, status, &self.fields, &self.body, closing);
        self.client.write_all(&self.out).await.is_ok() && !closing
    }

    /// Writes a response made here (503, 502, 504, 400). False when the connection is to
    /// close.
    async fn answer_locally(&mut self, resp: &Response<Bytes>, close: bool) -> bool {
        let closing = close || self.stopping();
        self.status = resp.status().as_u16();
        wire::encode_local(&mut self.out, resp, closing);
        self.client.write_all(&self.out).await.is_ok() && !closing
    }

    /// An admitted request: shaped, sent to the app within the upstream timeout, and its
    /// response (or the app's failure as 502/504) relayed with the RateLimit fields. The
    /// verdict's concurrency permits are held until the response body has been relayed.
    async fn forward(
        &mut self,
        rules: &RuleSet,
        verdict: &Verdict,
        req: &mut Incoming,
        span: Option<&tracing::Span>,
    ) -> bool {
        if verdict.delay > 0 {
            tokio::time::sleep(Duration::from_nanos(verdict.delay)).await;
        }
        let proxy = self.proxy;
        super::prepare_upstream(&mut req.parts, &self.peer, self.peer_ip.clone(), proxy);
        if let Some(span) = span {
            telemetry::inject(span, &mut req.parts.headers);
        }
        wire::encode_request(&mut self.out, &req.parts, &req.body);
        let head_only = req.parts.method == Method::HEAD;
        let t0 = proxy.engine.clock().now();
        let answer = self
            .ask_app(wire::is_idempotent(&req.parts.method), head_only)
            .await;
        let elapsed = proxy.engine.clock().now().saturating_sub(t0);
        proxy.metrics.upstream_seconds.observe(elapsed as f64 / 1e9);
        let head = match answer {
            Ok(head) => head,
            Err(failure) => {
                if let AppFailure::Unreachable(error) = &failure {
                    tracing::warn!(%error, upstream = %proxy.config.upstream, "upstream request failed");
                }
                let resp = super::upstream_failure(proxy, rules, verdict, failure.is_timeout());
                return self.answer_locally(&resp, req.close).await;
            }
        };
        if !verdict.settlements.is_empty()
            && let Some(app) = &self.app
        {
            let headers = head.header_map(&app.input);
            let now = proxy.engine.clock().now();
            rules.settle(&verdict.settlements, head.status, &headers, now);
        }
        self.relay(rules, verdict, &head, req.close).await
    }

    /// Sends the encoded request and reads the app's response head, within the upstream
    /// timeout. A kept app connection that turns out to be closed is replaced once, when the
    /// app cannot have acted on the request.
    async fn ask_app(&mut self, idempotent: bool, head_only: bool) -> Result<AppHead, AppFailure> {
        self.app_deadline.restart();
        let addr = self.proxy.upstream.addr();
        let answer = tokio::select! {
            biased;
            answer = ask(&mut self.app, &self.out, addr, idempotent, head_only) => answer,
            () = self.app_deadline.expired() => Err(AppFailure::Timeout),
        };
        if answer.is_err() {
            // Broken, or the app may still answer this request later: never reused.
            self.app = None;
        }
        answer
    }

    /// Writes the app's response to the client: its head with this sidecar's changes, then its
    /// body as it arrives. False when the connection is to close.
    async fn relay(
        &mut self,
        rules: &RuleSet,
        verdict: &Verdict,
        head: &AppHead,
        close: bool,
    ) -> bool {
        let closing = close || self.stopping() || head.framing == Framing::UntilClose;
        self.fields.clear();
        response::add_admitted_fields(&mut self.fields, rules, verdict);
        if verdict.shadow_rejections > 0 && self.proxy.config.shadow_header {
            let count = u64::from(verdict.shadow_rejections);
            self.fields.set_u64(&response::SHADOW_HEADER, count);
        }
        let Some(app) = self.app.as_mut() else {
            return false;
        };
        self.status = head.status;
        wire::encode_response_head(&mut self.out, &app.input, head, &self.fields, closing);
        app.input.advance(head.len);
        let mut body = Body::new(head.framing);
        let reusable = match relay_body(&mut self.client, app, &mut body, &mut self.out).await {
            Ok(reusable) => reusable && !head.app_closes,
            Err(()) => {
                self.app = None;
                return false;
            }
        };
        if !reusable {
            self.app = None;
        }
        !closing
    }
}

impl AppFailure {
    fn is_timeout(&self) -> bool {
        matches!(self, AppFailure::Timeout)
    }
}

/// Sends `request` on the kept app connection (or a new one) and reads the response head.
async fn ask(
    app: &mut Option<AppConn>,
    request: &[u8],
    addr: &str,
    idempotent: bool,
    head_only: bool,
) -> Result<AppHead, AppFailure> {
    if app.as_ref().is_some_and(|a| a.closed_while_idle()) {
        *app = None;
    }
    for _attempt in 0..2 {
        let reused = app.is_some();
        let conn = match app {
            Some(conn) => conn,
            None => app.insert(AppConn::connect(addr).await?),
        };
        conn.input.clear();
        let written = conn.stream.write_all(request).await.is_ok();
        let answer = if written {
            conn.read_head(head_only).await
        } else {
            Err(HeadError::NothingBack)
        };
        match answer {
            Ok(head) => return Ok(head),
            // A kept connection the app had closed: it never saw the request (a failed write)
            // or could not have acted on it before closing (nothing came back).
            Err(HeadError::NothingBack) if reused && (idempotent || !written) => *app = None,
            Err(e) => return Err(AppFailure::Unreachable(e.to_string())),
        }
    }
    Err(AppFailure::Unreachable(HeadError::NothingBack.to_string()))
}

/// Why the app's response head could not be read.
enum HeadError {
    /// The connection ended before any byte of a response.
    NothingBack,
    /// It ended mid-head, or sent something that is not an HTTP/1 response head.
    Broken,
}

impl std::fmt::Display for HeadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HeadError::NothingBack => "the app closed the connection before answering",
            HeadError::Broken => {
                "the app's response head could not be read (cut short, oversized or not HTTP/1)"
            }
        })
    }
}

impl AppConn {
    async fn connect(addr: &str) -> Result<AppConn, AppFailure> {
        match crate::upstream::dial(addr).await {
            Ok(stream) => Ok(AppConn {
                stream,
                input: BytesMut::with_capacity(APP_READ),
            }),
            Err(e) => Err(AppFailure::Unreachable(format!("cannot connect: {e}"))),
        }
    }

    /// The app closed (or wrote to) the connection while it sat idle. The runtime's readiness
    /// answers without a system call when nothing arrived (the usual case); only a connection
    /// it saw readable is probed.
    fn closed_while_idle(&self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if self.stream.poll_read_ready(&mut cx).is_pending() {
            return false;
        }
        let mut probe = [0u8; 1];
        !matches!(
            self.stream.try_read(&mut probe),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock
        )
    }

    /// Reads until a whole response head is buffered, skipping interim (1xx) responses.
    async fn read_head(&mut self, head_only: bool) -> Result<AppHead, HeadError> {
        let mut received = false;
        loop {
            if !self.input.is_empty() {
                match wire::scan_response(&self.input, head_only) {
                    Scan::Complete(head) if head.interim => {
                        self.input.advance(head.len);
                        continue;
                    }
                    Scan::Complete(head) => return Ok(head),
                    Scan::Partial if self.input.len() < wire::MAX_APP_HEAD => {}
                    Scan::Partial | Scan::HandOff => return Err(HeadError::Broken),
                }
            }
            self.input.reserve(APP_READ);
            match self.stream.read_buf(&mut self.input).await {
                Ok(n) if n > 0 => received = true,
                _ if received => return Err(HeadError::Broken),
                _ => return Err(HeadError::NothingBack),
            }
        }
    }
}

/// Copies the response body from the app to the client: first what came with the head (in the
/// same write as the head in `out`), then each read as it arrives. Ok(true) when the body
/// ended exactly where the app's input does (the connection can carry the next request).
async fn relay_body(
    client: &mut TcpStream,
    app: &mut AppConn,
    body: &mut Body,
    out: &mut Vec<u8>,
) -> Result<bool, ()> {
    let (taken, mut done) = body.take(&app.input).map_err(|_| ())?;
    out.extend_from_slice(&app.input[..taken]);
    app.input.advance(taken);
    client.write_all(out).await.map_err(|_| ())?;
    while !done {
        app.input.clear();
        app.input.reserve(APP_READ);
        match app.stream.read_buf(&mut app.input).await {
            Ok(n) if n > 0 => {}
            // The app closed: the end of a close-delimited body, a truncation otherwise.
            _ if body.ends_at_close() => return Ok(false),
            _ => return Err(()),
        }
        let (taken, end) = body.take(&app.input).map_err(|_| ())?;
        client
            .write_all(&app.input[..taken])
            .await
            .map_err(|_| ())?;
        app.input.advance(taken);
        done = end;
    }
    Ok(app.input.is_empty())
}

/// The fields this sidecar adds to a response, encoded as header lines, and their names (the
/// app's own lines with those names are dropped, as `HeaderMap::insert` replaced them).
#[derive(Default)]
pub struct FieldLines {
    lines: Vec<u8>,
    names: SmallVec<[HeaderName; 4]>,
}

impl FieldLines {
    fn clear(&mut self) {
        self.lines.clear();
        self.names.clear();
    }

    fn sets(&self, name: &[u8]) -> bool {
        self.names
            .iter()
            .any(|n| n.as_str().as_bytes().eq_ignore_ascii_case(name))
    }
}

impl FieldSink for FieldLines {
    fn set(&mut self, name: &HeaderName, value: &[u8]) {
        // Values come from `response`: numbers, base64 and compiled rule names (`[a-z0-9-]`,
        // checked when the policy compiles), so they hold no CR or LF to check for here.
        debug_assert!(HeaderValue::from_bytes(value).is_ok(), "{value:?}");
        if !self.names.contains(name) {
            self.names.push(name.clone());
        }
        wire::push_header(&mut self.lines, name.as_str().as_bytes(), value);
    }
}

/// A timeout that touches the runtime's timer about once per `period` instead of once per
/// request: [`Deadline::restart`] only moves a stored instant forward, and the timer, armed at
/// an earlier instant, is re-armed to the current one when it fires.
struct Deadline {
    at: Instant,
    period: Duration,
    /// Never later than `at`.
    timer: Pin<Box<Sleep>>,
}

impl Deadline {
    fn new(period: Duration) -> Deadline {
        let at = after(period);
        Deadline {
            at,
            period,
            timer: Box::pin(tokio::time::sleep_until(at)),
        }
    }

    fn restart(&mut self) {
        self.at = after(self.period);
    }

    /// Resolves once the current deadline has passed.
    async fn expired(&mut self) {
        loop {
            self.timer.as_mut().await;
            if Instant::now() >= self.at {
                return;
            }
            self.timer.as_mut().reset(self.at);
        }
    }
}

/// `period` from now; for a period too long to add (a huge `--upstream-timeout`), about thirty
/// years, as tokio's own timeouts fall back to a far future instead of overflowing.
fn after(period: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(period)
        .unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 86_400))
}

/// A client connection handed to hyper: the bytes this path read but did not take come first.
pub(super) struct Prefixed {
    prefix: BytesMut,
    stream: TcpStream,
}

impl Prefixed {
    /// A connection hyper serves from its first byte.
    pub(super) fn whole(stream: TcpStream) -> Prefixed {
        Prefixed {
            prefix: BytesMut::new(),
            stream,
        }
    }
}

impl AsyncRead for Prefixed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.prefix.is_empty() {
            return Pin::new(&mut this.stream).poll_read(cx, buf);
        }
        let n = this.prefix.len().min(buf.remaining());
        buf.put_slice(&this.prefix[..n]);
        this.prefix.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
