//! What the proxy does with bytes: streaming both ways, WebSocket upgrades, upstream failures,
//! malformed and abusive clients.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const HUNDRED_MB: u64 = 100 * 1024 * 1024;
/// How much the sidecar's RSS may grow while 100 MB pass through it.
const MAX_RSS_GROWTH: u64 = 30 * 1024 * 1024;

/// Samples the RSS of `pid` every 10 ms until dropped; `peak()` is the highest seen.
struct RssSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl RssSampler {
    fn start(pid: u32) -> RssSampler {
        let peak = Arc::new(AtomicU64::new(rss_bytes(pid)));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (Arc::clone(&peak), Arc::clone(&stop));
        let task = tokio::spawn(async move {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(rss_bytes(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        RssSampler { peak, stop, task }
    }

    async fn finish(self, pid: u32) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        self.peak.fetch_max(rss_bytes(pid), Ordering::Relaxed);
        self.peak.load(Ordering::Relaxed)
    }
}

fn streaming_client() -> reqwest::Client {
    client_builder()
        .timeout(Duration::from_secs(150))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_download_is_streamed_not_buffered() {
    within(180, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &roomy_policy(), &[]).await;
        let c = streaming_client();
        // Warm up the connection pools and buffers.
        let warm = c
            .get(sc.url("/download?bytes=1048576"))
            .send()
            .await
            .unwrap();
        assert_eq!(warm.bytes().await.unwrap().len(), 1024 * 1024);

        let baseline = sc.rss_bytes();
        let sampler = RssSampler::start(sc.pid);
        let resp = c
            .get(sc.url(&format!("/download?bytes={HUNDRED_MB}")))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(header_u64(&resp, "content-length"), HUNDRED_MB);
        let mut body = resp.bytes_stream();
        let mut received: u64 = 0;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.expect("download chunk");
            assert!(chunk.iter().all(|&b| b == b'x'), "corrupted download");
            received += chunk.len() as u64;
        }
        let peak = sampler.finish(sc.pid).await;
        assert_eq!(received, HUNDRED_MB);
        let growth = peak.saturating_sub(baseline);
        assert!(
            growth < MAX_RSS_GROWTH,
            "sidecar RSS grew by {} MiB during a 100 MiB download (baseline {} MiB)",
            growth >> 20,
            baseline >> 20
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_upload_is_streamed_not_buffered() {
    within(180, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &roomy_policy(), &[]).await;
        let c = streaming_client();
        let warm = c
            .post(sc.url("/upload"))
            .body(vec![b'y'; 1 << 20])
            .send()
            .await
            .unwrap();
        assert_eq!(warm.text().await.unwrap(), (1u64 << 20).to_string());

        let baseline = sc.rss_bytes();
        let sampler = RssSampler::start(sc.pid);
        const CHUNK: usize = 64 * 1024;
        let chunks = (HUNDRED_MB as usize) / CHUNK;
        let stream = futures_util::stream::iter(
            (0..chunks).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from_static(&[b'y'; CHUNK]))),
        );
        let resp = c
            .post(sc.url("/upload"))
            .body(reqwest::Body::wrap_stream(stream))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let largest_chunk = header_u64(&resp, "x-largest-chunk");
        let text = resp.text().await.unwrap();
        let peak = sampler.finish(sc.pid).await;
        assert_eq!(
            text,
            HUNDRED_MB.to_string(),
            "the app received the whole body"
        );
        assert!(
            largest_chunk < 16 << 20,
            "the app received a {largest_chunk}-byte chunk: the body was buffered"
        );
        let growth = peak.saturating_sub(baseline);
        assert!(
            growth < MAX_RSS_GROWTH,
            "sidecar RSS grew by {} MiB during a 100 MiB upload (baseline {} MiB)",
            growth >> 20,
            baseline >> 20
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_upgrade_passes_through() {
    use tokio_tungstenite::tungstenite::Message;
    within(60, async {
        let up = Upstream::start().await;
        let yaml = policy(
            "ws",
            "
            rules:
              - name: one-socket
                match:
                  path:
                    exact: /ws
                limit:
                  requests: 1
                  period: 1m
                scope: Local
            ",
        );
        let sc = Sidecar::start(&up.url(), &yaml, &[]).await;
        let url = format!("ws://{}/ws", sc.listen);
        let (mut ws, resp) = tokio_tungstenite::connect_async(url.as_str())
            .await
            .expect("WebSocket handshake through the sidecar");
        assert_eq!(resp.status(), 101);
        ws.send(Message::text("hello through tollgate"))
            .await
            .unwrap();
        let echoed = ws.next().await.expect("echo").expect("echo frame");
        assert_eq!(echoed.to_text().unwrap(), "hello through tollgate");
        let blob: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        ws.send(Message::binary(blob.clone())).await.unwrap();
        let echoed = ws.next().await.expect("echo").expect("echo frame");
        assert_eq!(echoed.into_data().as_ref(), blob.as_slice());
        ws.close(None).await.unwrap();

        // Upgrades are rate limited like any request.
        match tokio_tungstenite::connect_async(url.as_str()).await {
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                assert_eq!(resp.status(), 429)
            }
            Err(e) => panic!("second upgrade failed with {e}, expected a 429"),
            Ok(_) => panic!("second upgrade was admitted past a 1-per-minute limit"),
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_is_502_not_429() {
    within(60, async {
        let dead = closed_port().await;
        let sc = Sidecar::start(&format!("http://{dead}"), &roomy_policy(), &[]).await;
        let c = client();
        for _ in 0..3 {
            let resp = c.get(sc.url("/")).send().await.unwrap();
            assert_eq!(resp.status(), 502);
            assert_eq!(header(&resp, "content-type"), "application/problem+json");
            let body: serde_json::Value = resp.json().await.unwrap();
            assert_eq!(body["status"], 502, "{body}");
            assert!(
                body["title"].is_string() && body["detail"].is_string(),
                "{body}"
            );
        }
        let m = sc.metrics(&c).await;
        assert_eq!(
            metric(&m, "tollgate_upstream_errors_total", &[("kind", "connect")]),
            Some(3.0)
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_upstream_is_504_not_429() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &roomy_policy(), &["--upstream-timeout", "500ms"]).await;
        let c = client();
        let started = Instant::now();
        let resp = c.get(sc.url("/slow?ms=5000")).send().await.unwrap();
        let took = started.elapsed();
        assert_eq!(resp.status(), 504);
        assert!(
            took >= Duration::from_millis(450) && took < Duration::from_millis(3000),
            "504 after {took:?} with a 500 ms upstream timeout"
        );
        assert_eq!(header(&resp, "content-type"), "application/problem+json");
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["status"], 504, "{body}");
        // A fast answer still passes.
        assert_eq!(status_of(&c, &sc.url("/slow?ms=10"), &[]).await, 200);
        let m = sc.metrics(&c).await;
        assert_eq!(
            metric(&m, "tollgate_upstream_errors_total", &[("kind", "timeout")]),
            Some(1.0)
        );
    })
    .await;
}

/// Writes `request` on a fresh connection and reads until the server closes it (or 10 s pass).
/// Returns what was read; a reset connection ends the read like a close.
async fn raw_exchange(addr: std::net::SocketAddr, request: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    // The server may stop reading and close early (oversized heads): ignore write errors.
    let _ = s.write_all(request).await;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!(
                "server kept the connection open 10 s after {:?}",
                String::from_utf8_lossy(&request[..request.len().min(80)])
            ),
        }
    }
    got
}

/// The status code of a raw HTTP/1.1 response, if there is one.
fn raw_status(resp: &[u8]) -> Option<u16> {
    let text = std::str::from_utf8(resp.get(..12)?).ok()?;
    text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_400_and_the_proxy_survives() {
    within(60, async {
        let up = Upstream::start().await;
        let mut sc = Sidecar::start(&up.url(), &roomy_policy(), &[]).await;
        let cases: [&[u8]; 5] = [
            b"GARBAGE\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nno-colon-here\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        ];
        for case in cases {
            let resp = raw_exchange(sc.listen, case).await;
            assert_eq!(
                raw_status(&resp),
                Some(400),
                "{:?} -> {:?}",
                String::from_utf8_lossy(case),
                String::from_utf8_lossy(&resp)
            );
        }
        assert_eq!(up.hits(), 0, "a malformed request reached the app");
        sc.assert_serving(&client(), "/").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_are_refused() {
    within(60, async {
        let up = Upstream::start().await;
        let mut sc =
            Sidecar::start(&up.url(), &roomy_policy(), &["--max-header-bytes", "16384"]).await;
        let c = client();
        // Under the limit: proxied.
        let fits = "a".repeat(8 * 1024);
        assert_eq!(status_of(&c, &sc.url("/"), &[("x-big", &fits)]).await, 200);
        let hits_before = up.hits();
        // Over the limit: 431, or the connection is closed without a response.
        let big = format!(
            "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(64 * 1024)
        );
        let resp = raw_exchange(sc.listen, big.as_bytes()).await;
        assert!(
            resp.is_empty() || raw_status(&resp) == Some(431),
            "oversized head answered with {:?}",
            String::from_utf8_lossy(&resp[..resp.len().min(200)])
        );
        // Many medium headers adding up past the limit.
        let mut many = String::from("GET / HTTP/1.1\r\nHost: x\r\n");
        for i in 0..64 {
            many.push_str(&format!("X-H{i}: {}\r\n", "b".repeat(500)));
        }
        many.push_str("\r\n");
        let resp = raw_exchange(sc.listen, many.as_bytes()).await;
        assert!(
            resp.is_empty() || raw_status(&resp) == Some(431),
            "many headers answered with {:?}",
            String::from_utf8_lossy(&resp[..resp.len().min(200)])
        );
        assert_eq!(
            up.hits(),
            hits_before,
            "an oversized request reached the app"
        );
        sc.assert_serving(&c, "/").await;
    })
    .await;
}

/// Connects, sends `prefix` at once and then `drip` one byte every 100 ms, and returns how
/// long the server took to close the connection (and what it sent), or panics after 8 s.
async fn time_until_cut_off(
    addr: std::net::SocketAddr,
    prefix: &[u8],
    drip: &[u8],
) -> (Duration, Vec<u8>) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    let started = Instant::now();
    let reader = async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        got
    };
    let writer = async move {
        if wr.write_all(prefix).await.is_ok() {
            for b in drip {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if wr.write_all(std::slice::from_ref(b)).await.is_err() {
                    break;
                }
            }
        }
        // Keep the write half open; only the server may end this.
        std::future::pending::<()>().await;
    };
    let got = tokio::time::timeout(Duration::from_secs(8), async {
        tokio::select! {
            got = reader => got,
            () = writer => unreachable!(),
        }
    })
    .await
    .expect("the server never cut off the slow client");
    (started.elapsed(), got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_header_dripping_is_cut_off() {
    within(60, async {
        let up = Upstream::start().await;
        let mut sc =
            Sidecar::start(&up.url(), &roomy_policy(), &["--header-read-timeout", "1s"]).await;
        let drip: Vec<u8> = (0..200)
            .flat_map(|i| format!("X-Slow-{i}: a\r\n").into_bytes())
            .collect();
        let (took, got) = time_until_cut_off(
            sc.listen,
            b"",
            &[b"GET / HTTP/1.1\r\nHost: x\r\n".as_slice(), &drip].concat(),
        )
        .await;
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(3),
            "slow client cut off after {took:?} with a 1 s header timeout"
        );
        assert!(
            got.is_empty() || raw_status(&got).is_some_and(|s| s == 408 || s == 400),
            "unexpected answer to a slow client: {:?}",
            String::from_utf8_lossy(&got)
        );
        assert_eq!(up.hits(), 0);
        sc.assert_serving(&client(), "/").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_idle_connections_are_cut_off() {
    within(60, async {
        let up = Upstream::start().await;
        let mut sc =
            Sidecar::start(&up.url(), &roomy_policy(), &["--header-read-timeout", "1s"]).await;
        // Connects and never sends a byte.
        let (took, got) = time_until_cut_off(sc.listen, b"", b"").await;
        assert!(
            took < Duration::from_secs(3),
            "silent client kept for {took:?}"
        );
        assert!(
            got.is_empty() || raw_status(&got) == Some(408),
            "{:?}",
            String::from_utf8_lossy(&got)
        );
        // Sends the first bytes of the HTTP/2 preface and stalls.
        let (took, _) = time_until_cut_off(sc.listen, b"PRI * HT", b"").await;
        assert!(
            took < Duration::from_secs(3),
            "stalled preface kept for {took:?}"
        );
        // Finishes one request, then idles on the keep-alive connection.
        let (took, got) =
            time_until_cut_off(sc.listen, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"").await;
        assert_eq!(
            raw_status(&got),
            Some(200),
            "{:?}",
            String::from_utf8_lossy(&got)
        );
        assert!(
            took < Duration::from_secs(3),
            "idle keep-alive connection kept for {took:?}"
        );
        sc.assert_serving(&client(), "/").await;
    })
    .await;
}

/// Connections to the app are kept alive and reused: sequential requests share one, and
/// concurrent clients need about one each, not one per request (a connect per request would
/// double the sidecar's system calls and exhaust the app's ports under load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_reused() {
    within(60, async {
        let up = Upstream::start().await;
        let sc = Sidecar::start(&up.url(), &roomy_policy(), &[]).await;
        let c = client();
        for _ in 0..200 {
            let r = c.get(sc.url("/")).send().await.expect("request");
            assert_eq!(r.status(), 200);
            r.bytes().await.expect("body");
        }
        assert_eq!(up.hits(), 200);
        assert!(
            up.connections() <= 2,
            "200 sequential requests opened {} connections to the app",
            up.connections()
        );

        let before = up.connections();
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (c, url) = (client(), sc.url("/"));
                tokio::spawn(async move {
                    for _ in 0..50 {
                        let r = c.get(&url).send().await.expect("request");
                        assert_eq!(r.status(), 200);
                        r.bytes().await.expect("body");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("client task");
        }
        assert_eq!(up.hits(), 600);
        let opened = up.connections() - before;
        assert!(
            opened <= 16,
            "8 concurrent clients x 50 requests opened {opened} more connections to the app"
        );
    })
    .await;
}
