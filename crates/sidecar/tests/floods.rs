//! Floods and abuse through a real sidecar process.
//!
//! - A flood of distinct keys keeps the sidecar's memory under a bound that follows from the
//!   key cap: `idle RSS + 2 × (key table at the cap) + 16 MiB`. The table size at the cap is
//!   measured with the same store code (`KeyedLimiter::table_bytes`); the factor 2 covers the
//!   smaller tables freed while the table grew (a geometric series, at most the final size)
//!   that the allocator may keep; the 16 MiB cover connection buffers and allocator arenas.
//!   CI floods 60k keys into a 20k cap (so the overflow path runs); the documented run is
//!   `TOLLGATE_FLOOD_KEYS=1000000 TOLLGATE_FLOOD_CAP=1000000 cargo test --release -p
//!   tollgate-sidecar --test floods -- --nocapture` (figures in docs/reliability.md).
//! - Spoofed `X-Forwarded-For` values from one client behind `trustedHops` proxies all count
//!   against that one client and create no keys.
//!
//! Slowloris header dripping, silent and idle connections and oversized headers are covered in
//! `transport.rs` (`slowloris_header_dripping_is_cut_off`, `silent_and_idle_connections_are_cut_off`,
//! `oversized_headers_are_refused`); they are not repeated here.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]
#![allow(
    clippy::too_many_lines,
    reason = "a scenario test reads top to bottom as one story: setup, steps, checks"
)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tollgate_limiter::{Algorithm, KeyedLimiter, Limit, StoreConfig};

/// Counts of one flood.
#[derive(Default, Debug)]
struct FloodCounts {
    ok: AtomicU64,
    limited: AtomicU64,
    other: AtomicU64,
    /// Requests lost to a connection that closed or failed before answering.
    conn_errors: AtomicU64,
}

/// Parses one HTTP/1.1 response at the start of `buf`: (status, total length), or `None` if
/// it is not complete yet. Only what the sidecar sends is supported (Content-Length bodies).
fn parse_response(buf: &[u8]) -> Option<(u16, usize)> {
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buf[..head_end]).expect("ASCII response head");
    let status: u16 = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head:?}"));
    let mut len = 0usize;
    for line in head.split("\r\n").skip(1) {
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                len = value.trim().parse().expect("content-length");
            }
            assert!(
                !name.eq_ignore_ascii_case("transfer-encoding"),
                "unexpected chunked response: {head:?}"
            );
        }
    }
    (buf.len() >= head_end + len).then_some((status, head_end + len))
}

/// One keep-alive connection sending `window` pipelined requests at a time, each with the next
/// key (`<prefix><n>`) from `next`, until `total` keys are used. Reconnects if the server closes.
async fn flood_connection(
    addr: SocketAddr,
    prefix: &'static str,
    next: Arc<AtomicU64>,
    total: u64,
    window: u64,
    counts: Arc<FloodCounts>,
) {
    let mut stream: Option<TcpStream> = None;
    let mut out = Vec::with_capacity(window as usize * 64);
    let mut inbuf = vec![0u8; 64 * 1024];
    let mut pending = Vec::with_capacity(64 * 1024);
    loop {
        let first = next.fetch_add(window, Ordering::Relaxed);
        if first >= total {
            return;
        }
        let n = window.min(total - first);
        out.clear();
        for k in first..first + n {
            out.extend_from_slice(b"GET /f HTTP/1.1\r\nhost: flood\r\nx-api-key: ");
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(k.to_string().as_bytes());
            out.extend_from_slice(b"\r\n\r\n");
        }
        if stream.is_none() {
            match TcpStream::connect(addr).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    stream = Some(s);
                }
                Err(_) => {
                    counts.conn_errors.fetch_add(n, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            }
        }
        let s = stream.as_mut().expect("connected");
        let mut answered = 0u64;
        if s.write_all(&out).await.is_ok() {
            pending.clear();
            while answered < n {
                while let Some((status, used)) = parse_response(&pending) {
                    match status {
                        200 => &counts.ok,
                        429 => &counts.limited,
                        _ => &counts.other,
                    }
                    .fetch_add(1, Ordering::Relaxed);
                    pending.drain(..used);
                    answered += 1;
                }
                if answered == n {
                    break;
                }
                match s.read(&mut inbuf).await {
                    Ok(0) | Err(_) => break,
                    Ok(got) => pending.extend_from_slice(&inbuf[..got]),
                }
            }
        }
        if answered < n {
            counts
                .conn_errors
                .fetch_add(n - answered, Ordering::Relaxed);
            stream = None;
        }
    }
}

/// Sends one request for each of `total` distinct keys (`<prefix>0`, `<prefix>1`, …) over `conns`
/// keep-alive connections, `window` pipelined requests at a time on each.
async fn flood(
    addr: SocketAddr,
    prefix: &'static str,
    total: u64,
    conns: usize,
    window: u64,
) -> FloodCounts {
    let counts = Arc::new(FloodCounts::default());
    let next = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..conns)
        .map(|_| {
            tokio::spawn(flood_connection(
                addr,
                prefix,
                Arc::clone(&next),
                total,
                window,
                Arc::clone(&counts),
            ))
        })
        .collect();
    for t in tasks {
        t.await.expect("flood connection task");
    }
    Arc::try_unwrap(counts).expect("tasks done")
}

/// Bytes of the key table of one rule holding `cap` keys: a store with the sidecar's default
/// sizing and this limit, filled until every shard is at its cap.
fn table_bytes_at_cap(limit: Limit, cap: usize) -> (usize, usize) {
    let store = StoreConfig {
        max_keys: cap,
        ..StoreConfig::default()
    };
    let l = KeyedLimiter::new(limit, store);
    let capacity = l.capacity();
    let mut k = 0u64;
    // Keys spread over shards at random: go on until the store is full.
    while l.len() < capacity {
        for _ in 0..capacity {
            l.check(format!("k{k}").as_bytes(), 0, 1);
            k += 1;
        }
    }
    (l.table_bytes(), capacity)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_flood_keeps_memory_under_the_cap_bound() {
    let keys = env_u64("TOLLGATE_FLOOD_KEYS", 60_000);
    let cap = env_u64("TOLLGATE_FLOOD_CAP", 20_000) as usize;
    let conns = env_u64("TOLLGATE_FLOOD_CONNS", 32) as usize;
    // Scales with the key count: 60k keys take ~10 s in a debug build on a busy 2-core VM.
    let budget = 60 + keys / 2_000;
    within(budget, async {
        // 10 per hour: one request leaves a key's bucket below full for 6 minutes, so no key
        // becomes evictable during the test: the worst case for memory.
        let limit =
            Limit::new(Algorithm::TokenBucket, 10, 3_600_000_000_000, 10, 0).expect("limit");
        let (table_at_cap, capacity) =
            tokio::task::spawn_blocking(move || table_bytes_at_cap(limit, cap))
                .await
                .expect("table size");
        let up = Upstream::start().await;
        let p = policy(
            "flood",
            "
            rules:
              - name: per-key
                key: [{header: x-api-key}]
                limit: {requests: 10, period: 1h}
                scope: Local
            ",
        );
        let cap_arg = cap.to_string();
        let sc = Sidecar::start(&up.url(), &p, &["--max-keys-per-rule", &cap_arg]).await;
        let c = client();
        // A client that was there before the flood.
        assert_eq!(
            status_of(&c, &sc.url("/"), &[("x-api-key", "victim")]).await,
            200
        );
        // Warm up the connection paths, then take the idle figure.
        let warm = flood(sc.listen, "w", 64, 4, 16).await;
        assert_eq!(warm.ok.load(Ordering::Relaxed), 64);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let idle = proc_status_bytes(sc.pid, "VmRSS");

        // Sample RSS while flooding (VmHWM gives the kernel's exact peak as well).
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (stop, pid) = (Arc::clone(&stop), sc.pid);
            tokio::spawn(async move {
                let mut samples = Vec::new();
                let t0 = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    samples.push((t0.elapsed().as_secs_f64(), proc_status_bytes(pid, "VmRSS")));
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                samples
            })
        };
        let t0 = Instant::now();
        let counts = flood(sc.listen, "k", keys, conns, 32).await;
        let elapsed = t0.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        let samples = sampler.await.expect("sampler");
        let rss_end = proc_status_bytes(sc.pid, "VmRSS");
        let peak = proc_status_bytes(sc.pid, "VmHWM");

        let m = sc.metrics(&c).await;
        let active = metric(&m, "tollgate_active_keys", &[]).unwrap_or(0.0) as usize;
        let overflow = metric(&m, "tollgate_key_overflow_decisions", &[]).unwrap_or(0.0) as u64;
        let (ok, limited, other, conn_errors) = (
            counts.ok.load(Ordering::Relaxed),
            counts.limited.load(Ordering::Relaxed),
            counts.other.load(Ordering::Relaxed),
            counts.conn_errors.load(Ordering::Relaxed),
        );
        let bound = idle as f64 + 2.0 * table_at_cap as f64 + 16.0 * MIB;
        eprintln!(
            "flood: {keys} distinct keys in {elapsed:.1} s ({:.0} keys/s) over {conns} \
             connections; 200: {ok}, 429: {limited}, other: {other}, connection errors: \
             {conn_errors}",
            keys as f64 / elapsed
        );
        eprintln!(
            "flood: cap {cap} (store capacity {capacity}), active keys {active}, overflow \
             decisions {overflow}; key table at the cap {:.1} MiB ({:.1} B/key)",
            table_at_cap as f64 / MIB,
            table_at_cap as f64 / capacity as f64
        );
        eprintln!(
            "flood: RSS idle {:.1} MiB, end {:.1} MiB, peak (VmHWM) {:.1} MiB; bound {:.1} MiB \
             (idle + 2 × table + 16 MiB)",
            idle as f64 / MIB,
            rss_end as f64 / MIB,
            peak as f64 / MIB,
            bound / MIB
        );
        let curve: Vec<String> = samples
            .iter()
            .map(|(t, b)| format!("{t:.1}s:{:.1}", *b as f64 / MIB))
            .collect();
        eprintln!("flood: RSS MiB over time: {}", curve.join(" "));

        assert_eq!(other, 0, "statuses other than 200 and 429");
        assert_eq!(conn_errors, 0, "requests lost to connection errors");
        assert_eq!(ok + limited, keys, "every request answered once");
        // The store never holds more than its capacity.
        assert!(
            active <= capacity,
            "{active} keys stored, capacity {capacity}"
        );
        // Every flood key was either stored or decided against its shard's shared overflow
        // bucket (shards fill unevenly, so some overflow before the total reaches the cap).
        let stored_by_flood = active.saturating_sub(1 + 64) as u64; // minus the victim and the warm-up keys
        assert_eq!(
            stored_by_flood + overflow,
            keys,
            "stored {stored_by_flood} + overflow {overflow} != {keys} keys"
        );
        // Overflow buckets admit at most one burst (10) per shard: a flood of new keys beyond
        // the cap starves itself instead of being unlimited.
        let shards = KeyedLimiter::new(
            limit,
            StoreConfig {
                max_keys: cap,
                ..StoreConfig::default()
            },
        )
        .shards() as u64;
        assert!(
            ok >= stored_by_flood && ok <= stored_by_flood + shards * 10,
            "{ok} admitted: expected {stored_by_flood} stored keys + at most {} from overflow",
            shards * 10
        );
        if keys >= 2 * capacity as u64 {
            // Every shard's overflow bucket is long exhausted: a brand-new key is limited.
            assert_eq!(
                status_of(&c, &sc.url("/"), &[("x-api-key", "late-newcomer")]).await,
                429
            );
        }
        // A key stored before the flood keeps its own bucket.
        assert_eq!(
            status_of(&c, &sc.url("/"), &[("x-api-key", "victim")]).await,
            200
        );
        assert!(
            (peak as f64) <= bound,
            "peak RSS {:.1} MiB above the bound {:.1} MiB",
            peak as f64 / MIB,
            bound / MIB
        );
    })
    .await;
}

/// A client behind `hops` trusted proxies rotates everything it controls in X-Forwarded-For:
/// left-most entries (addresses, garbage, IPv6, ports, long chains) and extra header lines
/// before the proxies' line. Every request still counts against the address the outermost
/// trusted proxy wrote, and no extra keys are created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_forwarded_for_values_are_limited_as_one_client() {
    within(60, async {
        for hops in [1u32, 2] {
            let up = Upstream::start().await;
            let p = policy(
                "xff",
                &format!(
                    "
                    rules:
                      - name: per-ip
                        key: [{{clientIP: {{trustedHops: {hops}}}}}]
                        limit: {{requests: 5, period: 1m}}
                        scope: Local
                    "
                ),
            );
            let sc = Sidecar::start(&up.url(), &p, &[]).await;
            let c = client();
            // What the trusted proxies append: the client's address as the outermost proxy saw
            // it, then (for 2 hops) the inner proxy's peer.
            let proxies = if hops == 1 {
                "203.0.113.7".to_string()
            } else {
                "203.0.113.7, 10.0.0.2".to_string()
            };
            let n = 400;
            let mut admitted = 0;
            for i in 0..n {
                let fake = match i % 6 {
                    0 => format!("198.51.{}.{}", i / 256 % 256, i % 256),
                    1 => format!("10.{}.0.1, 192.0.2.{}", i % 256, i % 200),
                    2 => format!("2001:db8::{i:x}"),
                    3 => format!("[2001:db8::{i:x}]:443, 198.51.100.{}:8080", i % 256),
                    4 => format!("unknown-{i}"),
                    _ => (0..(i % 20 + 1))
                        .map(|j| format!("192.0.2.{j}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                };
                let mut req = c.get(sc.url("/"));
                if i % 2 == 0 {
                    // One header: the proxies appended to the client's value.
                    req = req.header("x-forwarded-for", format!("{fake}, {proxies}"));
                } else {
                    // The client's own header line, then the proxies' line.
                    req = req
                        .header("x-forwarded-for", fake)
                        .header("x-forwarded-for", proxies.clone());
                }
                let status = req.send().await.expect("request").status();
                match status.as_u16() {
                    200 => admitted += 1,
                    429 => {}
                    s => panic!("unexpected status {s}"),
                }
            }
            assert_eq!(
                admitted, 5,
                "trustedHops {hops}: {admitted} of {n} spoofed requests admitted (limit 5)"
            );
            let m = sc.metrics(&c).await;
            assert_eq!(
                metric(&m, "tollgate_active_keys", &[]),
                Some(1.0),
                "trustedHops {hops}: spoofed values created keys"
            );
            // The real client behind the same proxies is limited; another client is not.
            let other = if hops == 1 {
                "198.51.100.20".to_string()
            } else {
                "198.51.100.20, 10.0.0.2".to_string()
            };
            assert_eq!(
                status_of(&c, &sc.url("/"), &[("x-forwarded-for", &other)]).await,
                200
            );
        }
    })
    .await;
}
