//! Plain HTTP/1.1 on the wire, through the fast path (`--fast-http1 true`, the default) and
//! through hyper (`--fast-http1 false`): every way an app can frame a response reaches the
//! client intact, pipelined requests are answered in order, the app gets the same request head
//! from both paths, and a kept app connection the app closed is replaced.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and the shared harness may block"
)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// An app written on raw sockets, so each response is framed exactly as scripted by path:
///
/// - `/length`: `Content-Length` body (and no body for HEAD);
/// - `/chunked`: chunked body with a trailer;
/// - `/until-close`: no length, body ends when the app closes;
/// - `/early`: a 103 Early Hints before the 200;
/// - `/then-close`: `Connection: close`, then the app closes;
/// - `/hop`: hop-by-hop lines, one named by `Connection`;
/// - `/echo`: the request head and body the app received, as the body;
/// - `/garbage`: not HTTP at all.
struct ScriptedApp {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedApp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedApp {
    async fn start() -> ScriptedApp {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&connections);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve_scripted(stream));
            }
        });
        ScriptedApp {
            addr,
            connections,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn serve_scripted(mut stream: TcpStream) {
    let mut buf = Vec::new();
    loop {
        let Some((method, path, raw)) = read_request(&mut stream, &mut buf).await else {
            return;
        };
        let head_only = method == "HEAD";
        let reply: Vec<u8> = match path.as_str() {
            "/length" if head_only => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-App: 1\r\n\r\n".to_vec(),
            "/length" => b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-App: 1\r\n\r\nhello".to_vec(),
            "/chunked" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-App: 1\r\n\r\n\
5\r\nhello\r\n6;x=y\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
                .to_vec(),
            "/until-close" => b"HTTP/1.1 200 OK\r\nX-App: 1\r\n\r\nuntil the end".to_vec(),
            "/early" => b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n\
HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-App: 1\r\n\r\nok"
                .to_vec(),
            "/then-close" => {
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\nX-App: 1\r\n\r\nok"
                    .to_vec()
            }
            "/hop" => b"HTTP/1.1 200 OK\r\nConnection: X-Secret\r\nX-Secret: s\r\nKeep-Alive: timeout=5\r\n\
Proxy-Connection: keep-alive\r\nX-App: 1\r\nContent-Length: 2\r\n\r\nok"
                .to_vec(),
            "/echo" => {
                let mut r = format!(
                    "HTTP/1.1 200 OK\r\nX-App: 1\r\nContent-Length: {}\r\n\r\n",
                    raw.len()
                )
                .into_bytes();
                r.extend_from_slice(&raw);
                r
            }
            _ => b"NOT HTTP AT ALL\r\n\r\n".to_vec(),
        };
        if stream.write_all(&reply).await.is_err() {
            return;
        }
        if matches!(path.as_str(), "/until-close" | "/then-close" | "/garbage") {
            return;
        }
    }
}

/// Reads one request (head and `Content-Length` body) off `stream`, keeping extra bytes in
/// `buf`. Returns the method, the path and the raw request.
async fn read_request(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> Option<(String, String, Vec<u8>)> {
    loop {
        if let Some(end) = find(buf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (n, v) = l.split_once(':')?;
                    n.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                let raw: Vec<u8> = buf.drain(..end + 4 + length).collect();
                let mut first = head.split(' ');
                let method = first.next()?.to_string();
                let target = first.next()?;
                let path = target.split('?').next()?.to_string();
                return Some((method, path, raw));
            }
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Both paths: the fast one and hyper's.
const PATHS: [&str; 2] = ["true", "false"];

async fn sidecar(app: &ScriptedApp, fast: &str) -> Sidecar {
    Sidecar::start(&app.url(), &roomy_policy(), &["--fast-http1", fast]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_app_framing_reaches_the_client_intact() {
    within(60, async {
        let app = ScriptedApp::start().await;
        for fast in PATHS {
            eprintln!("--- fast-http1={fast}");
            let sc = sidecar(&app, fast).await;
            let c = client();
            for (path, body) in [
                ("/length", "hello"),
                ("/chunked", "hello world"),
                ("/until-close", "until the end"),
                ("/early", "ok"),
                ("/then-close", "ok"),
                ("/hop", "ok"),
                ("/length", "hello"),
            ] {
                let resp = c.get(sc.url(path)).send().await.unwrap();
                let what = format!("fast-http1={fast} GET {path}");
                assert_eq!(resp.status(), 200, "{what}");
                assert_eq!(header(&resp, "x-app"), "1", "{what}");
                assert!(
                    resp.headers().contains_key("ratelimit"),
                    "{what}: no RateLimit field"
                );
                assert!(resp.headers().contains_key("date"), "{what}: no Date");
                for hop in ["x-secret", "keep-alive", "proxy-connection"] {
                    assert!(
                        !resp.headers().contains_key(hop),
                        "{what}: {hop} passed through"
                    );
                }
                assert_eq!(resp.text().await.unwrap(), body, "{what}");
            }
            let resp = c.head(sc.url("/length")).send().await.unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(
                header(&resp, "content-length"),
                "5",
                "fast-http1={fast} HEAD"
            );
            assert_eq!(resp.bytes().await.unwrap().len(), 0);
            let resp = c.get(sc.url("/garbage")).send().await.unwrap();
            assert_eq!(
                resp.status(),
                502,
                "fast-http1={fast}: garbage from the app"
            );
            // Both paths say in the log why the app could not be read.
            let logged = poll_until(
                Duration::from_secs(5),
                "the upstream failure's log line",
                || async {
                    sc.logs()
                        .into_iter()
                        .find(|l| l.contains("upstream request failed"))
                },
            )
            .await;
            assert!(
                logged.contains(&app.addr.to_string()),
                "fast-http1={fast}: {logged}"
            );
        }
    })
    .await;
}

/// Reads one response from a raw client connection: its head and its `Content-Length` or
/// chunked body (left encoded).
async fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>) -> (String, Vec<u8>) {
    loop {
        if let Some(end) = find(buf, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end + 4]).to_lowercase();
            let body_end = if head.contains("transfer-encoding: chunked") {
                // The last chunk ("0" at the start or after a chunk's CRLF), then the trailer
                // section up to its empty line.
                let body = &buf[end + 4..];
                let last = if body.starts_with(b"0\r\n") {
                    Some(0)
                } else {
                    find(body, b"\r\n0\r\n").map(|i| i + 2)
                };
                last.and_then(|l| find(&body[l..], b"\r\n\r\n").map(|t| end + 4 + l + t + 4))
            } else {
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: ")?.trim().parse().ok())
                    .unwrap_or(0);
                (buf.len() >= end + 4 + length).then_some(end + 4 + length)
            };
            if let Some(body_end) = body_end {
                let body = buf[end + 4..body_end].to_vec();
                buf.drain(..body_end);
                return (head, body);
            }
        }
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .expect("no response within 10 s")
            .expect("read");
        assert!(
            n > 0,
            "connection closed mid-response: {:?}",
            String::from_utf8_lossy(buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    within(60, async {
        let app = ScriptedApp::start().await;
        for fast in PATHS {
            eprintln!("--- fast-http1={fast}");
            let sc = sidecar(&app, fast).await;
            let mut s = TcpStream::connect(sc.listen).await.unwrap();
            s.write_all(
                b"GET /length HTTP/1.1\r\nHost: a\r\n\r\n\
POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\nping\
GET /chunked HTTP/1.1\r\nHost: a\r\n\r\n",
            )
            .await
            .unwrap();
            let mut buf = Vec::new();
            let (h1, b1) = read_response(&mut s, &mut buf).await;
            let (h2, b2) = read_response(&mut s, &mut buf).await;
            let (h3, b3) = read_response(&mut s, &mut buf).await;
            for h in [&h1, &h2, &h3] {
                assert!(h.starts_with("http/1.1 200 "), "fast-http1={fast}: {h}");
            }
            assert_eq!(b1, b"hello");
            assert!(
                b2.starts_with(b"POST /echo HTTP/1.1\r\n"),
                "{}",
                String::from_utf8_lossy(&b2)
            );
            assert!(
                b2.ends_with(b"\r\n\r\nping"),
                "{}",
                String::from_utf8_lossy(&b2)
            );
            assert!(
                find(&b3, b"hello").is_some() && find(&b3, b" world").is_some(),
                "fast-http1={fast}: {}",
                String::from_utf8_lossy(&b3)
            );
            // The fast path relays the chunked body as the app framed it, trailers included
            // (hyper sends trailers only to clients that asked with `TE: trailers`).
            if fast == "true" {
                assert!(
                    find(&b3, b"X-Trailer: t").is_some(),
                    "{}",
                    String::from_utf8_lossy(&b3)
                );
            }
        }
    })
    .await;
}

/// The request head the app received for one request, as a set of lower-cased lines.
async fn head_seen_by_app(sc: &Sidecar, request: &[u8]) -> BTreeSet<String> {
    let mut s = TcpStream::connect(sc.listen).await.unwrap();
    s.write_all(request).await.unwrap();
    let (head, body) = read_response(&mut s, &mut Vec::new()).await;
    assert!(head.starts_with("http/1.1 200 "), "{head}");
    let text = String::from_utf8_lossy(&body).to_lowercase();
    let head_end = text.find("\r\n\r\n").expect("echoed head");
    text[..head_end].split("\r\n").map(str::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_app_gets_the_same_head_from_both_paths() {
    within(60, async {
        let app = ScriptedApp::start().await;
        let request = b"POST /echo?q=1 HTTP/1.1\r\nHost: shop.example\r\nConnection: keep-alive, X-Hop\r\n\
X-Hop: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nX-Forwarded-For: 203.0.113.9\r\nX-Api-Key: k\r\n\
Content-Length: 2\r\n\r\nhi";
        let mut seen = Vec::new();
        for fast in PATHS {
            eprintln!("--- fast-http1={fast}");
            let sc = sidecar(&app, fast).await;
            seen.push(head_seen_by_app(&sc, request).await);
        }
        assert_eq!(seen[0], seen[1], "the fast path and hyper sent the app different heads");
        let expected: BTreeSet<String> = [
            "post /echo?q=1 http/1.1",
            "host: shop.example",
            "x-forwarded-for: 203.0.113.9, 127.0.0.1",
            "x-api-key: k",
            "content-length: 2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(seen[0], expected);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_connection_the_app_closed_is_replaced() {
    within(60, async {
        let app = ScriptedApp::start().await;
        for fast in PATHS {
            eprintln!("--- fast-http1={fast}");
            let sc = sidecar(&app, fast).await;
            let before = app.connections.load(Ordering::SeqCst);
            let mut s = TcpStream::connect(sc.listen).await.unwrap();
            let mut buf = Vec::new();
            // Each /then-close ends its app connection; the next request needs a new one.
            for path in [
                "/then-close",
                "/length",
                "/then-close",
                "/length",
                "/length",
            ] {
                s.write_all(format!("GET {path} HTTP/1.1\r\nHost: a\r\n\r\n").as_bytes())
                    .await
                    .unwrap();
                let (head, _) = read_response(&mut s, &mut buf).await;
                assert!(
                    head.starts_with("http/1.1 200 "),
                    "fast-http1={fast} {path}: {head}"
                );
                assert!(
                    !head.contains("connection: close"),
                    "fast-http1={fast}: the app's close reached the client"
                );
            }
            let opened = app.connections.load(Ordering::SeqCst) - before;
            assert_eq!(
                opened, 3,
                "fast-http1={fast}: app connections for 5 requests"
            );
        }
    })
    .await;
}

/// A request refused before its body was read, from a client waiting for `100 Continue`: the
/// 429 says `Connection: close`, and the connection then closes (the body never came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_429_to_expect_continue_says_connection_close() {
    within(60, async {
        let app = ScriptedApp::start().await;
        let one = policy(
            "one",
            "rules:\n  - name: one\n    scope: Local\n    limit: {requests: 1, period: 1m}\n",
        );
        for fast in PATHS {
            let sc = Sidecar::start(&app.url(), &one, &["--fast-http1", fast]).await;
            let mut s = TcpStream::connect(sc.listen).await.unwrap();
            let mut buf = Vec::new();
            s.write_all(b"GET /length HTTP/1.1\r\nHost: a\r\n\r\n").await.unwrap();
            let (head, _) = read_response(&mut s, &mut buf).await;
            assert!(head.starts_with("http/1.1 200 "), "fast-http1={fast}: {head}");
            s.write_all(
                b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
            )
            .await
            .unwrap();
            let (head, _) = read_response(&mut s, &mut buf).await;
            assert!(head.starts_with("http/1.1 429 "), "fast-http1={fast}: {head}");
            assert!(
                head.contains("\r\nconnection: close\r\n"),
                "fast-http1={fast}: no Connection: close on {head}"
            );
            let mut rest = [0u8; 64];
            let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut rest))
                .await
                .expect("the connection stays open")
                .unwrap_or(0);
            assert_eq!(n, 0, "fast-http1={fast}: more after the 429: {:?}", &rest[..n]);
        }
    })
    .await;
}
