//! HTTP/1.1 on the wire for the fast path: scanning heads (`httparse`), body framing, and
//! encoding heads. Pure functions over byte buffers, so each rule is unit-tested here (and
//! public for the fuzz target `http1_wire`).

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use smallvec::SmallVec;

use super::FieldLines;

/// Most header lines parsed (hyper's default; a longer head goes to hyper, which answers 431).
const MAX_HEADERS: usize = 100;
/// Largest app response head accepted (hyper's client allowed about as much); beyond: 502.
pub const MAX_APP_HEAD: usize = 64 * 1024;

/// Where a part of a head lies in the buffer it was scanned from. Half the size of a
/// `Range<usize>`: heads move through several async frames per request, and their line
/// tables were the largest part of what each move copied.
#[derive(Clone, Copy, Debug, Default)]
struct Span {
    start: u32,
    end: u32,
}

impl Span {
    fn range(self) -> Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// A header line's name and value.
type Line = (Span, Span);

/// The result of scanning a buffer for a head.
pub enum Scan<T> {
    Complete(T),
    /// Not all there yet.
    Partial,
    /// Not for this path: malformed, or a feature hyper serves (see the module above).
    HandOff,
}

/// A request head this path serves, with its body already buffered behind it.
pub struct RequestHead {
    pub len: usize,
    pub body_len: usize,
    pub close: bool,
    method: Method,
    target: Span,
    lines: SmallVec<[Line; 16]>,
}

/// Scans `input` for a request head this path can serve.
pub fn scan_request(input: &[u8]) -> Scan<RequestHead> {
    // Uninitialised: zeroing 100 slots (3.2 KB) per head cost more than parsing a short one.
    let mut lines = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let len = match req.parse_with_uninit_headers(input, &mut lines) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Scan::Partial,
        Err(_) => return Scan::HandOff,
    };
    let (Some(1), Some(method), Some(target)) = (req.version, req.method, req.path) else {
        return Scan::HandOff;
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Scan::HandOff;
    };
    if method == Method::CONNECT {
        return Scan::HandOff;
    }
    let mut head = RequestHead {
        len,
        body_len: 0,
        close: false,
        method,
        target: offset(input, target.as_bytes()),
        lines: SmallVec::new(),
    };
    let mut length = None;
    for line in req.headers.iter() {
        let name = line.name.as_bytes();
        match known(name) {
            Known::ContentLength => match (length, parse_length(line.value)) {
                (None, Some(n)) => length = Some(n),
                _ => return Scan::HandOff,
            },
            Known::TransferEncoding | Known::Upgrade | Known::Expect => return Scan::HandOff,
            Known::Connection => head.close |= has_token(line.value, "close"),
            Known::Date | Known::Other => {}
        }
        head.lines
            .push((offset(input, name), offset(input, line.value)));
    }
    let Ok(body_len) = usize::try_from(length.unwrap_or(0)) else {
        return Scan::HandOff;
    };
    if input.len() - len < body_len {
        // Not here whole yet: hyper streams it.
        return Scan::HandOff;
    }
    head.body_len = body_len;
    Scan::Complete(head)
}

impl RequestHead {
    /// The request as the engine and the hyper path see it. Header values are slices of
    /// `head` (the buffer scanned), not copies. None for what `http` refuses and `httparse`
    /// let through (an invalid URI, say).
    pub fn parts(&self, head: &Bytes) -> Option<Parts> {
        let uri = Uri::from_maybe_shared(head.slice(self.target.range())).ok()?;
        // Room for what `prepare_upstream` adds (`X-Forwarded-For`, `Host`), so it never grows.
        let mut headers = HeaderMap::with_capacity(self.lines.len() + 2);
        for (name, value) in &self.lines {
            let name = HeaderName::from_bytes(&head[name.range()]).ok()?;
            let value = HeaderValue::from_maybe_shared(head.slice(value.range())).ok()?;
            headers.append(name, value);
        }
        let (mut parts, ()) = Request::new(()).into_parts();
        parts.method = self.method.clone();
        parts.uri = uri;
        parts.version = Version::HTTP_11;
        parts.headers = headers;
        Some(parts)
    }
}

/// How a response body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// No body (HEAD, 204, 304, `Content-Length: 0`).
    Empty,
    Length(u64),
    Chunked,
    /// When the app closes the connection.
    UntilClose,
}

/// An app response head.
pub struct AppHead {
    pub len: usize,
    pub status: u16,
    /// A 1xx other than 101: skipped, the real response follows.
    pub interim: bool,
    pub framing: Framing,
    /// The app will close its connection after this response.
    pub app_closes: bool,
    has_date: bool,
    reason: Span,
    lines: SmallVec<[Line; 16]>,
    /// The values of its `Connection` lines: the headers they name are hop-by-hop too.
    connection: SmallVec<[Span; 1]>,
}

/// Scans `input` for the app's response head. `head_only`: the request was HEAD, so the
/// response has no body whatever its headers say. `HandOff` here means a broken response.
pub fn scan_response(input: &[u8], head_only: bool) -> Scan<AppHead> {
    let mut lines = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default()
        .parse_response_with_uninit_headers(&mut resp, input, &mut lines);
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Scan::Partial,
        Err(_) => return Scan::HandOff,
    };
    // 101: this path never asks for an upgrade.
    let (Some(version), Some(status @ 100..=599)) = (resp.version, resp.code) else {
        return Scan::HandOff;
    };
    if status == 101 {
        return Scan::HandOff;
    }
    let mut head = AppHead {
        len,
        status,
        interim: status < 200,
        framing: Framing::UntilClose,
        app_closes: version == 0,
        has_date: false,
        reason: offset(input, resp.reason.unwrap_or_default().as_bytes()),
        lines: SmallVec::new(),
        connection: SmallVec::new(),
    };
    let (mut length, mut chunked) = (None, None);
    for line in resp.headers.iter() {
        let name = line.name.as_bytes();
        match known(name) {
            Known::ContentLength => match (length, parse_length(line.value)) {
                (_, None) => return Scan::HandOff,
                (Some(a), Some(b)) if a != b => return Scan::HandOff,
                (_, n) => length = n,
            },
            Known::TransferEncoding => chunked = Some(last_token_is(line.value, "chunked")),
            Known::Connection => {
                head.app_closes |= has_token(line.value, "close");
                if version == 0 && has_token(line.value, "keep-alive") {
                    head.app_closes = false;
                }
                head.connection.push(offset(input, line.value));
            }
            Known::Date => head.has_date = true,
            Known::Upgrade | Known::Expect | Known::Other => {}
        }
        head.lines
            .push((offset(input, name), offset(input, line.value)));
    }
    head.framing = if head_only || head.interim || status == 204 || status == 304 {
        Framing::Empty
    } else {
        match (chunked, length) {
            (Some(true), _) => Framing::Chunked,
            (Some(false), _) | (None, None) => Framing::UntilClose,
            (None, Some(0)) => Framing::Empty,
            (None, Some(n)) => Framing::Length(n),
        }
    };
    Scan::Complete(head)
}

impl AppHead {
    /// The app's headers as a map, for the rules whose cost is settled by the response.
    pub fn header_map(&self, input: &[u8]) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.lines.len());
        for (name, value) in &self.lines {
            if let (Ok(n), Ok(v)) = (
                HeaderName::from_bytes(&input[name.range()]),
                HeaderValue::from_bytes(&input[value.range()]),
            ) {
                map.append(n, v);
            }
        }
        map
    }

    /// `name` is listed in the app's `Connection` header.
    fn named_by_connection(&self, input: &[u8], name: &[u8]) -> bool {
        self.connection.iter().any(|v| {
            input[v.range()]
                .split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(name))
        })
    }
}

/// Hop-by-hop response lines (RFC 9110 §7.6.1), dropped. `Transfer-Encoding` stays: the body
/// is relayed as the app framed it. `Trailer` stays: so are its trailers.
fn is_hop_by_hop(name: &[u8]) -> bool {
    const NAMES: [&[u8]; 6] = [
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"te",
        b"upgrade",
    ];
    matches!(name.len(), 2 | 7 | 10 | 16 | 18) && NAMES.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// Encodes the response to the client: the app's status and headers minus hop-by-hop lines
/// and those `fields` replaces, then `fields`, a `Date` if the app sent none (as hyper adds),
/// and `Connection: close` when this connection ends after the response.
pub fn encode_response_head(
    out: &mut Vec<u8>,
    input: &[u8],
    head: &AppHead,
    fields: &FieldLines,
    closing: bool,
) {
    out.clear();
    let reason = &input[head.reason.range()];
    push_status_line(out, head.status, reason);
    // Lines kept as the app wrote them are copied in runs: one copy for consecutive lines.
    let mut run: Option<Range<usize>> = None;
    for (name_at, value_at) in &head.lines {
        let (name_at, value_at) = (name_at.range(), value_at.range());
        let name = &input[name_at.clone()];
        if is_hop_by_hop(name) || head.named_by_connection(input, name) || fields.sets(name) {
            flush_run(out, input, &mut run);
            continue;
        }
        let line_end = value_at.end + 2;
        let whole_line = !value_at.is_empty() && input.get(value_at.end..line_end) == Some(b"\r\n");
        match &mut run {
            Some(r) if whole_line && r.end == name_at.start => r.end = line_end,
            _ if whole_line => {
                flush_run(out, input, &mut run);
                run = Some(name_at.start..line_end);
            }
            _ => {
                flush_run(out, input, &mut run);
                push_header(out, name, &input[value_at.clone()]);
            }
        }
    }
    flush_run(out, input, &mut run);
    out.extend_from_slice(&fields.lines);
    finish_head(out, !head.has_date, closing);
}

fn flush_run(out: &mut Vec<u8>, input: &[u8], run: &mut Option<Range<usize>>) {
    if let Some(r) = run.take() {
        out.extend_from_slice(&input[r]);
    }
}

/// Encodes the request to the app: origin-form target, HTTP/1.1, `parts`' headers (already
/// prepared for the app), then the body.
pub fn encode_request(out: &mut Vec<u8>, parts: &Parts, body: &[u8]) {
    out.clear();
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        push_header(out, name.as_str().as_bytes(), value.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
}

/// Encodes a response made here, with `Content-Length` and `Date` as hyper adds them.
pub fn encode_local(out: &mut Vec<u8>, resp: &Response<Bytes>, closing: bool) {
    out.clear();
    push_status_line(out, resp.status().as_u16(), b"");
    for (name, value) in resp.headers() {
        push_header(out, name.as_str().as_bytes(), value.as_bytes());
    }
    if !resp.headers().contains_key(http::header::CONTENT_LENGTH) {
        let mut n = itoa::Buffer::new();
        push_header(
            out,
            b"content-length",
            n.format(resp.body().len()).as_bytes(),
        );
    }
    finish_head(
        out,
        !resp.headers().contains_key(http::header::DATE),
        closing,
    );
    out.extend_from_slice(resp.body());
}

/// Encodes a response made here from its parts: `fields` (all its header lines) and `body`.
pub fn encode_made_here(
    out: &mut Vec<u8>,
    status: StatusCode,
    fields: &FieldLines,
    body: &[u8],
    closing: bool,
) {
    out.clear();
    push_status_line(out, status.as_u16(), b"");
    out.extend_from_slice(&fields.lines);
    let mut n = itoa::Buffer::new();
    push_header(out, b"content-length", n.format(body.len()).as_bytes());
    finish_head(out, true, closing);
    out.extend_from_slice(body);
}

fn push_status_line(out: &mut Vec<u8>, status: u16, reason: &[u8]) {
    out.extend_from_slice(b"HTTP/1.1 ");
    let mut n = itoa::Buffer::new();
    out.extend_from_slice(n.format(status).as_bytes());
    out.push(b' ');
    if reason.is_empty() {
        let canonical = StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("");
        out.extend_from_slice(canonical.as_bytes());
    } else {
        out.extend_from_slice(reason);
    }
    out.extend_from_slice(b"\r\n");
}

fn finish_head(out: &mut Vec<u8>, date: bool, closing: bool) {
    if date {
        push_date(out);
    }
    if closing {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

pub fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// `date: <IMF-fixdate>`, formatted once a second per thread.
fn push_date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with(|cache| {
        let mut cache = cache.borrow_mut();
        if cache.0 != secs {
            *cache = (secs, httpdate::fmt_http_date(now));
        }
        push_header(out, b"date", cache.1.as_bytes());
    });
}

/// Methods a request can be repeated with (RFC 9110 §9.2.2): the only ones resent on a fresh
/// app connection when a kept one closed under the request.
pub fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// A chunked body whose framing is broken: the relay stops and the connection closes.
#[derive(Debug, PartialEq, Eq)]
pub struct BrokenFraming;

/// Tracks where a response body ends while its bytes are relayed as they are.
pub struct Body {
    framing: Framing,
    left: u64,
    chunks: Chunks,
}

impl Body {
    pub fn new(framing: Framing) -> Body {
        let left = match framing {
            Framing::Length(n) => n,
            _ => 0,
        };
        Body {
            framing,
            left,
            chunks: Chunks::default(),
        }
    }

    /// How many bytes at the start of `buf` belong to the body, and whether the body ends
    /// there.
    pub fn take(&mut self, buf: &[u8]) -> Result<(usize, bool), BrokenFraming> {
        match self.framing {
            Framing::Empty => Ok((0, true)),
            Framing::UntilClose => Ok((buf.len(), false)),
            Framing::Length(_) => {
                let n = usize::try_from(self.left).map_or(buf.len(), |l| l.min(buf.len()));
                self.left -= n as u64;
                Ok((n, self.left == 0))
            }
            Framing::Chunked => Ok(match self.chunks.feed(buf)? {
                Some(end) => (end, true),
                None => (buf.len(), false),
            }),
        }
    }

    pub fn ends_at_close(&self) -> bool {
        self.framing == Framing::UntilClose
    }
}

/// Where a chunked body ends (RFC 9112 §7.1): sizes, extensions, data, trailers.
#[derive(Default)]
struct Chunks {
    state: ChunkState,
    size: u64,
    digits: u8,
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    #[default]
    Size,
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    TrailerStart,
    Trailer,
    FinalLf,
}

impl Chunks {
    /// Feeds the next bytes; Some(position after the body's last byte) once it ends.
    fn feed(&mut self, buf: &[u8]) -> Result<Option<usize>, BrokenFraming> {
        let mut i = 0;
        while i < buf.len() {
            if self.state == ChunkState::Data {
                let n = usize::try_from(self.size).map_or(buf.len() - i, |s| s.min(buf.len() - i));
                self.size -= n as u64;
                i += n;
                if self.size == 0 {
                    self.state = ChunkState::DataCr;
                }
                continue;
            }
            let b = buf[i];
            i += 1;
            if self.step(b)? {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// One byte outside chunk data; true when it ends the body.
    fn step(&mut self, b: u8) -> Result<bool, BrokenFraming> {
        use ChunkState::*;
        self.state = match (self.state, b) {
            (Size, _) if b.is_ascii_hexdigit() => {
                if self.digits >= 15 {
                    return Err(BrokenFraming);
                }
                self.digits += 1;
                self.size = self.size * 16 + u64::from((b as char).to_digit(16).unwrap_or(0));
                Size
            }
            (Size, b';' | b' ' | b'\t') if self.digits > 0 => Extension,
            (Size, b'\r') if self.digits > 0 => SizeLf,
            (Size | Extension | SizeLf, b'\n') if self.digits > 0 => self.size_line_done(),
            (Extension, _) => Extension,
            (DataCr, b'\r') => DataLf,
            (DataCr | DataLf, b'\n') => {
                self.digits = 0;
                Size
            }
            (TrailerStart, b'\r') => FinalLf,
            (TrailerStart | FinalLf, b'\n') => return Ok(true),
            (Trailer, b'\n') => TrailerStart,
            (TrailerStart | Trailer, _) => Trailer,
            _ => return Err(BrokenFraming),
        };
        Ok(false)
    }

    fn size_line_done(&mut self) -> ChunkState {
        if self.size == 0 {
            ChunkState::TrailerStart
        } else {
            ChunkState::Data
        }
    }
}

/// The header names this path acts on.
enum Known {
    ContentLength,
    TransferEncoding,
    Connection,
    Upgrade,
    Expect,
    Date,
    Other,
}

/// Recognised by length first: most names are none of these and cost one comparison.
fn known(name: &[u8]) -> Known {
    let is = |known: &[u8]| name.eq_ignore_ascii_case(known);
    match name.len() {
        4 if is(b"date") => Known::Date,
        6 if is(b"expect") => Known::Expect,
        7 if is(b"upgrade") => Known::Upgrade,
        10 if is(b"connection") => Known::Connection,
        14 if is(b"content-length") => Known::ContentLength,
        17 if is(b"transfer-encoding") => Known::TransferEncoding,
        _ => Known::Other,
    }
}

/// Where `part` lies within `base` (`httparse` hands out slices of the buffer it scanned).
/// Heads are far below 4 GiB (both are bounded by the head size limits).
fn offset(base: &[u8], part: &[u8]) -> Span {
    let start = (part.as_ptr() as usize).wrapping_sub(base.as_ptr() as usize);
    match (u32::try_from(start), u32::try_from(start + part.len())) {
        (Ok(start), Ok(end)) if !part.is_empty() && (end as usize) <= base.len() => {
            Span { start, end }
        }
        _ => Span::default(),
    }
}

/// A `Content-Length` value: digits only (hyper refuses the rest with 400).
fn parse_length(value: &[u8]) -> Option<u64> {
    if value.is_empty() || value.len() > 19 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    value.iter().try_fold(0u64, |n, &d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// The comma-separated `value` lists `token` (case-insensitive).
fn has_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

fn last_token_is(value: &[u8], token: &str) -> bool {
    value
        .rsplit(|&b| b == b',')
        .next()
        .is_some_and(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_engine::response::FieldSink;

    fn request(raw: &[u8]) -> Scan<RequestHead> {
        scan_request(raw)
    }

    #[test]
    fn plain_requests_are_served_here_and_features_go_to_hyper() {
        let Scan::Complete(head) = request(b"GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-K: v\r\n\r\n")
        else {
            panic!("a plain GET is not served here");
        };
        let parts = head
            .parts(&Bytes::from_static(
                b"GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-K: v\r\n\r\n",
            ))
            .unwrap();
        assert_eq!(parts.uri, "/a?b=1");
        assert_eq!(parts.headers["x-k"], "v");
        assert!(!head.close);
        for raw in [
            &b"GET / HTTP/1.0\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nonly5",
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\na",
            b"GET / HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
            b"CONNECT x:443 HTTP/1.1\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"GET / HTTP/1.1\r\nBad Header: y\r\n\r\n",
        ] {
            assert!(
                matches!(request(raw), Scan::HandOff),
                "{:?} was not handed to hyper",
                String::from_utf8_lossy(raw)
            );
        }
        assert!(matches!(
            request(b"GET / HTTP/1.1\r\nHost: x\r\n"),
            Scan::Partial
        ));
    }

    #[test]
    fn a_body_that_arrived_whole_is_taken_with_its_head() {
        let raw = b"POST /p HTTP/1.1\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabcGET";
        let Scan::Complete(head) = request(raw) else {
            panic!("not served here");
        };
        assert_eq!(&raw[head.len..head.len + head.body_len], b"abc");
        assert!(head.close);
    }

    fn response(raw: &[u8], head_only: bool) -> AppHead {
        match scan_response(raw, head_only) {
            Scan::Complete(h) => h,
            _ => panic!("{:?} not scanned", String::from_utf8_lossy(raw)),
        }
    }

    #[test]
    fn response_framing_follows_rfc_9112() {
        let f = |raw: &[u8]| response(raw, false).framing;
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"),
            Framing::Length(5)
        );
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"),
            Framing::Empty
        );
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 5\r\n\r\n"),
            Framing::Chunked
        );
        assert_eq!(
            f(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"),
            Framing::UntilClose
        );
        assert_eq!(f(b"HTTP/1.1 200 OK\r\n\r\n"), Framing::UntilClose);
        assert_eq!(
            f(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"),
            Framing::Empty
        );
        assert_eq!(f(b"HTTP/1.1 304 Not Modified\r\n\r\n"), Framing::Empty);
        assert_eq!(
            response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", true).framing,
            Framing::Empty
        );
        assert!(response(b"HTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n", false).interim);
        assert!(response(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n", false).app_closes);
        assert!(!response(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n\r\n", false).app_closes);
        assert!(response(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", false).app_closes);
        for broken in [
            &b"HTTP/1.1 101 Switching Protocols\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
            b"NOT HTTP\r\n\r\n",
        ] {
            assert!(matches!(scan_response(broken, false), Scan::HandOff));
        }
    }

    #[test]
    fn the_head_sent_on_drops_hop_by_hop_and_replaced_lines() {
        let raw = b"HTTP/1.1 200 Fine\r\nConnection: keep-alive, X-Private\r\nKeep-Alive: timeout=5\r\n\
X-Private: secret\r\nRateLimit: \"app\";r=1\r\nTransfer-Encoding: chunked\r\nDate: Mon, 07 Dec 2026 00:00:00 GMT\r\n\
X-App: 1\r\n\r\n";
        let head = response(raw, false);
        let mut fields = FieldLines::default();
        fields.set(&tollgate_engine::response::RATELIMIT, b"\"r\";r=4");
        let mut out = Vec::new();
        encode_response_head(&mut out, raw, &head, &fields, true);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 Fine\r\nTransfer-Encoding: chunked\r\nDate: Mon, 07 Dec 2026 00:00:00 GMT\r\n\
X-App: 1\r\nratelimit: \"r\";r=4\r\nconnection: close\r\n\r\n"
        );
    }

    #[test]
    fn local_responses_carry_length_and_date() {
        let resp =
            tollgate_engine::response::problem(StatusCode::BAD_GATEWAY, "Bad Gateway", "down");
        let mut out = Vec::new();
        encode_local(&mut out, &resp, false);
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 502 Bad Gateway\r\n"), "{text}");
        assert!(text.contains(&format!("content-length: {}\r\n", resp.body().len())));
        assert!(text.contains("\r\ndate: "));
        assert!(!text.contains("connection: close"));
        assert!(text.ends_with(std::str::from_utf8(resp.body()).unwrap()));
    }

    #[test]
    fn chunked_bodies_end_after_the_last_chunk_and_trailers() {
        let whole = b"5;ext=1\r\nhello\r\nA\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\nNEXT";
        let end = whole.len() - 4;
        // Whole, and fed in every split.
        for split in 0..whole.len() {
            let mut body = Body::new(Framing::Chunked);
            let (a, done_a) = body.take(&whole[..split]).unwrap();
            if done_a {
                assert_eq!(a, end);
                continue;
            }
            assert_eq!(a, split);
            let (b, done_b) = body.take(&whole[split..]).unwrap();
            assert!(done_b, "split at {split}");
            assert_eq!(split + b, end, "split at {split}");
        }
        let mut body = Body::new(Framing::Chunked);
        assert_eq!(body.take(b"0\r\n\r\n").unwrap(), (5, true));
        for broken in [
            &b"xyz\r\n"[..],
            b"\r\n",
            b"5\r\nhelloXX",
            b"fffffffffffffffff\r\n",
        ] {
            assert!(
                Body::new(Framing::Chunked).take(broken).is_err(),
                "{broken:?}"
            );
        }
    }

    #[test]
    fn length_bodies_stop_at_their_length() {
        let mut body = Body::new(Framing::Length(5));
        assert_eq!(body.take(b"abc").unwrap(), (3, false));
        assert_eq!(body.take(b"deNEXT").unwrap(), (2, true));
        assert_eq!(Body::new(Framing::Empty).take(b"x").unwrap(), (0, true));
        assert_eq!(
            Body::new(Framing::UntilClose).take(b"xy").unwrap(),
            (2, false)
        );
    }
}
