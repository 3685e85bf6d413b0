//! Controller mode against an in-test rule stream speaking the documented protocol: snapshots
//! applied atomically, acks, bearer token, last-known-good rules while the controller is away,
//! and resume with `since`/`epoch` after a reconnect.
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

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// What the fake controller saw.
#[derive(Default)]
struct Seen {
    watches: Vec<String>,
    acks: Vec<serde_json::Value>,
    unauthorized: usize,
    /// TCP connections accepted so far.
    connections: usize,
    /// The connection (numbered from 1 in accept order) each watch and each ack came on.
    watch_connections: Vec<usize>,
    ack_connections: Vec<usize>,
    /// Answer acks with this status instead of 204 (e.g. 409).
    ack_status: Option<u16>,
    /// Acks answered 204.
    acks_taken: usize,
}

/// A fake controller: every watch gets the lines pushed through `lines` (one subscriber at a time).
struct FakeController {
    port: u16,
    seen: Arc<Mutex<Seen>>,
    lines: Arc<Mutex<Option<mpsc::UnboundedSender<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeController {
    async fn start(port: u16, first: Vec<String>) -> FakeController {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind fake controller");
        let port = listener.local_addr().expect("addr").port();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let lines: Arc<Mutex<Option<mpsc::UnboundedSender<String>>>> = Arc::new(Mutex::new(None));
        let (seen2, lines2) = (seen.clone(), lines.clone());
        let task = tokio::spawn(async move {
            // Connection tasks are aborted with the accept loop, so a stopped controller really
            // is gone (no pooled keep-alive connection keeps talking to the sidecar).
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let connection = {
                    let mut seen = seen2.lock().unwrap();
                    seen.connections += 1;
                    seen.connections
                };
                let (seen, lines, first) = (seen2.clone(), lines2.clone(), first.clone());
                conns.spawn(async move {
                    let svc =
                        hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                            let (seen, lines, first) = (seen.clone(), lines.clone(), first.clone());
                            async move {
                                let authorized = req
                                    .headers()
                                    .get("authorization")
                                    .and_then(|v| v.to_str().ok())
                                    == Some("Bearer test-token");
                                if !authorized {
                                    seen.lock().unwrap().unauthorized += 1;
                                    let mut r =
                                        Response::new(body_of(Bytes::from_static(b"unauthorized")));
                                    *r.status_mut() = hyper::StatusCode::UNAUTHORIZED;
                                    return Ok::<_, Infallible>(r);
                                }
                                if req.uri().path() == "/v1/ack" {
                                    let body = req
                                        .into_body()
                                        .collect()
                                        .await
                                        .map(|b| b.to_bytes())
                                        .unwrap_or_default();
                                    let mut seen = seen.lock().unwrap();
                                    if let Ok(v) = serde_json::from_slice(&body) {
                                        seen.acks.push(v);
                                        seen.ack_connections.push(connection);
                                    }
                                    let status = seen.ack_status.unwrap_or(204);
                                    if status == 204 {
                                        seen.acks_taken += 1;
                                    }
                                    let mut r = Response::new(body_of(Bytes::new()));
                                    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                                    return Ok(r);
                                }
                                {
                                    let mut seen = seen.lock().unwrap();
                                    seen.watches
                                        .push(req.uri().query().unwrap_or("").to_string());
                                    seen.watch_connections.push(connection);
                                }
                                let (tx, rx) = mpsc::unbounded_channel::<String>();
                                for l in &first {
                                    let _ = tx.send(l.clone());
                                }
                                *lines.lock().unwrap() = Some(tx);
                                let stream =
                                    futures_util::stream::unfold(rx, |mut rx| async move {
                                        rx.recv().await.map(|l| {
                                            (
                                                Ok::<_, Infallible>(Frame::data(Bytes::from(
                                                    l + "\n",
                                                ))),
                                                rx,
                                            )
                                        })
                                    });
                                let mut r = Response::new(StreamBody::new(stream).boxed_unsync());
                                r.headers_mut().insert(
                                    "content-type",
                                    "application/x-ndjson".parse().unwrap(),
                                );
                                Ok(r)
                            }
                        });
                    // HTTP/1.1 and h2c, like the real controller.
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
                });
            }
        });
        FakeController {
            port,
            seen,
            lines,
            task,
        }
    }

    fn push(&self, line: String) {
        if let Some(tx) = self.lines.lock().unwrap().as_ref() {
            let _ = tx.send(line);
        }
    }

    fn stop(self) -> u16 {
        self.task.abort();
        // Dropping the sender ends the open stream.
        *self.lines.lock().unwrap() = None;
        self.port
    }
}

fn body_of(b: Bytes) -> http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible> {
    http_body_util::Full::new(b).boxed_unsync()
}

fn snapshot(version: u64, requests: u64) -> String {
    let yaml = policy(
        "streamed",
        &format!(
            "rules:\n- name: per-client\n  key: [{{header: x-api-key}}]\n  limit: {{requests: {requests}, period: 1m}}\n  scope: Local\n"
        ),
    );
    let p = tollgate_crd::compile(&tollgate_crd::parse_yaml(&yaml).unwrap()[0]).unwrap();
    serde_json::to_string(&tollgate_crd::stream::StreamMessage::Snapshot {
        wire_version: tollgate_crd::WIRE_VERSION,
        version,
        policies: vec![p],
        members: Default::default(),
        epoch: "e1".into(),
        key_hash_secret: None,
    })
    .unwrap()
}

async fn admitted(s: &Sidecar, key: &str, n: usize) -> usize {
    let c = client();
    let mut ok = 0;
    for _ in 0..n {
        if c.get(s.url("/"))
            .header("x-api-key", key)
            .send()
            .await
            .map(|r| r.status() == 200)
            .unwrap_or(false)
        {
            ok += 1;
        }
    }
    ok
}

/// Starts a sidecar streaming from `url` as pod `test/p1`, its token file holding `token`.
/// The directory holding the token lives as long as the returned guard.
async fn stream_sidecar(
    upstream: &Upstream,
    url: &str,
    token: &str,
    extra: &[&str],
) -> (Sidecar, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, token).unwrap();
    let token_arg = token_file.to_string_lossy().to_string();
    let mut args = vec![
        "--controller",
        url,
        "--pod-name",
        "p1",
        "--pod-namespace",
        "test",
        "--token-file",
        &token_arg,
    ];
    args.extend_from_slice(extra);
    (
        Sidecar::start_with_source(&upstream.url(), &args).await,
        dir,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_arrive_over_the_stream_and_survive_a_controller_outage() {
    within(90, async {
        let upstream = Upstream::start().await;
        let controller = FakeController::start(0, vec![snapshot(1, 2)]).await;
        let url = format!("http://127.0.0.1:{}", controller.port);
        let (s, _token_dir) = stream_sidecar(
            &upstream,
            &url,
            "test-token\n",
            &["--controller-idle-timeout", "2s"],
        )
        .await;

        // Ready once the first snapshot is applied; then the streamed limit holds.
        poll_until(Duration::from_secs(10), "ready", || async {
            let r = client().get(s.admin_url("/readyz")).send().await.ok()?;
            (r.status() == 200).then_some(())
        })
        .await;
        assert_eq!(admitted(&s, "a", 4).await, 2);
        assert!(
            controller.seen.lock().unwrap().watches[0].contains("redis=false"),
            "a sidecar without Redis says so: {:?}",
            controller.seen.lock().unwrap().watches
        );
        poll_until(Duration::from_secs(5), "ack of v1", || async {
            controller
                .seen
                .lock()
                .unwrap()
                .acks
                .iter()
                .any(|a| a["version"] == 1 && a["pod"] == "p1" && a["namespace"] == "test")
                .then_some(())
        })
        .await;

        // An update raises the limit: enforced without a restart.
        controller.push(snapshot(2, 5));
        poll_until(Duration::from_secs(5), "v2 enforced", || async {
            (admitted(&s, &format!("k{}", rand_suffix()), 5).await == 5).then_some(())
        })
        .await;

        // Controller gone: the last-known-good rules stay in force.
        let port = controller.stop();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            admitted(&s, "b", 7).await,
            5,
            "v2 still enforced while the controller is away"
        );

        // Back on the same port: the sidecar resumes from the version it holds.
        let back = FakeController::start(
            port,
            vec![r#"{"type":"heartbeat","version":2}"#.to_string()],
        )
        .await;
        poll_until(Duration::from_secs(20), "reconnect with since", || async {
            back.seen
                .lock()
                .unwrap()
                .watches
                .iter()
                .any(|q| q.contains("since=2") && q.contains("epoch=e1") && q.contains("pod=p1"))
                .then_some(())
        })
        .await;
        assert_eq!(admitted(&s, "c", 7).await, 5);
    })
    .await;
}

/// A controller that refuses the pod's identity is an authentication failure, not an absent
/// controller: past `--rules-wait` the sidecar stays unready instead of passing traffic
/// through unlimited (`--without-rules=pass-through` is the default), and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_keeps_the_sidecar_unready() {
    within(60, async {
        let upstream = Upstream::start().await;
        let controller = FakeController::start(0, vec![snapshot(1, 2)]).await;
        let url = format!("http://127.0.0.1:{}", controller.port);
        let (s, token_dir) =
            stream_sidecar(&upstream, &url, "wrong", &["--rules-wait", "1s"]).await;
        poll_until(Duration::from_secs(10), "a refused attempt", || async {
            (controller.seen.lock().unwrap().unauthorized > 0).then_some(())
        })
        .await;
        poll_until(Duration::from_secs(10), "the wait given up", || async {
            s.logs()
                .iter()
                .any(|l| l.contains("refuses this pod's identity; staying unready"))
                .then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(readyz(&s).await, 503, "refused: never ready without rules");
        let m = s.metrics(&client()).await;
        assert_eq!(
            metric(&m, "tollgate_controller_stream_refused", &[]),
            Some(1.0),
            "{m}"
        );
        assert_eq!(
            metric(&m, "tollgate_rules_passthrough", &[]),
            Some(0.0),
            "{m}"
        );
        // Once the controller accepts the token, rules arrive and the gauge clears.
        std::fs::write(token_dir.path().join("token"), "test-token").unwrap();
        poll_until(Duration::from_secs(20), "ready with rules", || async {
            (readyz(&s).await == 200).then_some(())
        })
        .await;
        let m = s.metrics(&client()).await;
        assert_eq!(
            metric(&m, "tollgate_controller_stream_refused", &[]),
            Some(0.0),
            "{m}"
        );
        assert_eq!(admitted(&s, "a", 4).await, 2);
    })
    .await;
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(0);
    h.finish()
}

/// Starts a sidecar streaming from `url` (with `extra` flags) that never gets rules, and waits
/// until its readiness body names `expected` as the cause.
async fn unready_because(url: &str, extra: &[&str], expected: &[&str]) {
    let upstream = Upstream::start().await;
    let (s, _token_dir) = stream_sidecar(&upstream, url, "test-token", extra).await;
    let c = client();
    let body = poll_until(Duration::from_secs(30), "a failed attempt", || async {
        let r = c.get(s.admin_url("/readyz")).send().await.ok()?;
        assert_eq!(r.status(), 503, "no rules: not ready");
        let body = r.text().await.ok()?;
        body.contains("rule stream:").then_some(body)
    })
    .await;
    let lower = body.to_ascii_lowercase();
    assert!(
        expected.iter().any(|e| lower.contains(e)),
        "readiness body should name the cause ({expected:?}): {body}"
    );
    let debug = s.admin_json(&c, "/debug/stream").await;
    assert_eq!(debug["connected"], false, "{debug}");
    assert_eq!(debug["controller"], url, "{debug}");
    assert!(
        debug["failedAttemptsSinceConnected"].as_u64() >= Some(1),
        "{debug}"
    );
    assert!(debug["hint"].is_string(), "{debug}");
    let last = debug["lastError"]
        .as_str()
        .unwrap_or_default()
        .to_ascii_lowercase();
    assert!(expected.iter().any(|e| last.contains(e)), "{debug}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unresolvable_controller_is_named_as_a_dns_failure() {
    within(
        60,
        unready_because(
            "http://tollgate-controller.tollgate.invalid:8443",
            &[],
            &["dns error"],
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_controller_port_is_named_as_a_refused_connection() {
    let url = format!("http://{}", closed_port().await);
    within(60, unready_because(&url, &[], &["connection refused"])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_certificate_from_another_ca_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let (acceptor, _served_ca) = tls_acceptor(
        dir.path(),
        "served",
        "controller",
        "localhost",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    // The sidecar trusts a different CA: what a reinstall that made a new CA looks like.
    let trusted = tollgate_testkit::pki::Ca::new(dir.path(), "trusted", "old-controller-ca");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _ = acceptor.accept(tcp).await;
            });
        }
    });
    let url = format!("https://127.0.0.1:{port}");
    let ca_arg = trusted.crt().to_string_lossy().to_string();
    within(
        60,
        unready_because(
            &url,
            &["--controller-ca-file", &ca_arg],
            &["unknownissuer", "certificate"],
        ),
    )
    .await;
    server.abort();
}

async fn readyz(s: &Sidecar) -> u16 {
    client()
        .get(s.admin_url("/readyz"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_while_the_controller_is_away_starts_from_the_cached_rules() {
    within(90, async {
        let upstream = Upstream::start().await;
        let cache_dir = tempfile::tempdir().unwrap();
        let cache = cache_dir.path().join("rules.json");
        let cache_arg = cache.to_string_lossy().to_string();
        let controller = FakeController::start(0, vec![snapshot(3, 2)]).await;
        let url = format!("http://127.0.0.1:{}", controller.port);
        let args = ["--rules-cache", cache_arg.as_str(), "--rules-wait", "60s"];
        let (first, _t1) = stream_sidecar(&upstream, &url, "test-token", &args).await;
        poll_until(Duration::from_secs(10), "rules cached", || async {
            cache.exists().then_some(())
        })
        .await;
        drop(first);
        controller.stop();

        // Same pod, controller away: ready from the cache well before --rules-wait, enforcing.
        let started = std::time::Instant::now();
        let (s, _t2) = stream_sidecar(&upstream, &url, "test-token", &args).await;
        poll_until(Duration::from_secs(10), "ready from the cache", || async {
            (readyz(&s).await == 200).then_some(())
        })
        .await;
        eprintln!("ready from the cache {:?} after start", started.elapsed());
        assert_eq!(admitted(&s, "a", 4).await, 2, "the cached limit holds");
        let m = s.metrics(&client()).await;
        assert_eq!(
            metric(&m, "tollgate_rules_from_cache", &[]),
            Some(1.0),
            "{m}"
        );
        assert_eq!(metric(&m, "tollgate_rules_version", &[]), Some(3.0), "{m}");
        assert!(
            s.logs()
                .iter()
                .any(|l| l.contains("enforcing the rules this pod last received")),
            "{:?}",
            s.logs()
        );

        // A torn cache is refused with a reason, and the sidecar waits for the stream instead.
        drop(s);
        let text = std::fs::read(&cache).unwrap();
        std::fs::write(&cache, &text[..text.len() / 2]).unwrap();
        let (torn, _t3) = stream_sidecar(&upstream, &url, "test-token", &args).await;
        poll_until(
            Duration::from_secs(10),
            "the torn cache refused",
            || async {
                torn.logs()
                    .iter()
                    .any(|l| l.contains("cached rules not used") && l.contains("not a rule cache"))
                    .then_some(())
            },
        )
        .await;
        assert_eq!(readyz(&torn).await, 503);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_pod_without_rules_passes_through_after_the_wait_or_stays_unready() {
    within(60, async {
        let upstream = Upstream::start().await;
        // Nothing listens there: the controller is down.
        let url = format!("http://127.0.0.1:{}", free_port());
        let cache_dir = tempfile::tempdir().unwrap();
        let cache = cache_dir.path().join("rules.json");
        let cache_arg = cache.to_string_lossy().to_string();
        let (s, _t) = stream_sidecar(
            &upstream,
            &url,
            "test-token",
            &["--rules-cache", &cache_arg, "--rules-wait", "2s"],
        )
        .await;
        let (unready, _t2) = stream_sidecar(
            &upstream,
            &url,
            "test-token",
            &["--rules-wait", "2s", "--without-rules", "unready"],
        )
        .await;
        assert_eq!(readyz(&s).await, 503, "waiting for rules");
        let started = std::time::Instant::now();
        poll_until(Duration::from_secs(10), "ready without rules", || async {
            (readyz(&s).await == 200).then_some(())
        })
        .await;
        assert!(
            started.elapsed() >= Duration::from_millis(1000),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(admitted(&s, "a", 20).await, 20, "nothing is limited");
        let m = s.metrics(&client()).await;
        assert_eq!(
            metric(&m, "tollgate_rules_passthrough", &[]),
            Some(1.0),
            "{m}"
        );
        assert!(
            s.logs()
                .iter()
                .any(|l| l.contains("no cached rules (a new pod)"))
        );
        assert!(
            s.logs()
                .iter()
                .any(|l| l.contains("--without-rules=pass-through"))
        );

        // The other mode: still unready after the wait.
        poll_until(
            Duration::from_secs(10),
            "the unready one gives up waiting",
            || async {
                unready
                    .logs()
                    .iter()
                    .any(|l| l.contains("--without-rules=unready"))
                    .then_some(())
            },
        )
        .await;
        assert_eq!(readyz(&unready).await, 503);
        assert!(!cache.exists(), "nothing to cache without rules");
    })
    .await;
}

/// The acks of a snapshot that arrives long after the stream opened (past the 90 s after which
/// a pooled HTTP client drops an idle connection from its pool) still travel on the stream's
/// own connection: behind a Service, another connection may reach another controller replica,
/// which answers 409 and leaves the policy unprogrammed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_share_the_stream_connection_after_a_long_quiet_time() {
    within(180, async {
        let upstream = Upstream::start().await;
        let controller = FakeController::start(0, vec![snapshot(1, 2)]).await;
        let url = format!("http://127.0.0.1:{}", controller.port);
        let (_s, _token_dir) = stream_sidecar(&upstream, &url, "test-token", &[]).await;
        poll_until(Duration::from_secs(10), "ack of v1", || async {
            (!controller.seen.lock().unwrap().acks.is_empty()).then_some(())
        })
        .await;
        // Quiet but alive: heartbeats only, for longer than a pool's idle timeout.
        let quiet = Duration::from_secs(95);
        let started = std::time::Instant::now();
        while started.elapsed() < quiet {
            controller.push(r#"{"type":"heartbeat","version":1}"#.to_string());
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        controller.push(snapshot(2, 5));
        poll_until(Duration::from_secs(10), "ack of v2", || async {
            let seen = controller.seen.lock().unwrap();
            seen.acks.iter().any(|a| a["version"] == 2).then_some(())
        })
        .await;
        let seen = controller.seen.lock().unwrap();
        assert_eq!(
            seen.watch_connections,
            vec![1],
            "one stream, never reopened"
        );
        assert_eq!(
            seen.ack_connections,
            vec![1, 1],
            "both acks on the stream's connection ({} connections in all)",
            seen.connections
        );
        assert_eq!(seen.connections, 1);
    })
    .await;
}

/// A `409` to an ack sent on the stream's own connection means the replica does not know what
/// it delivered: the sidecar starts the stream over, with a growing backoff (a replica that
/// keeps refusing cannot make it loop), and settles once an ack is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_ack_starts_the_stream_over_with_backoff() {
    within(60, async {
        let upstream = Upstream::start().await;
        let controller = FakeController::start(0, vec![snapshot(1, 2)]).await;
        controller.seen.lock().unwrap().ack_status = Some(409);
        let url = format!("http://127.0.0.1:{}", controller.port);
        let (s, _token_dir) = stream_sidecar(&upstream, &url, "test-token", &[]).await;
        poll_until(Duration::from_secs(10), "ready", || async {
            (readyz(&s).await == 200).then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let watches = controller.seen.lock().unwrap().watches.len();
        // Backoff from 100 ms doubling (with jitter down to half): at most ~7 in 3 s; a loop
        // without backoff would make hundreds.
        assert!((2..=8).contains(&watches), "{watches} streams in 3 s");
        assert!(
            controller.seen.lock().unwrap().watches[1].contains("since=1"),
            "the new stream resumes from what the sidecar holds"
        );
        controller.seen.lock().unwrap().ack_status = None;
        poll_until(Duration::from_secs(15), "an ack taken", || async {
            (controller.seen.lock().unwrap().acks_taken > 0).then_some(())
        })
        .await;
        let settled = controller.seen.lock().unwrap().watches.len();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            controller.seen.lock().unwrap().watches.len(),
            settled,
            "no new stream once the ack is taken"
        );
        assert_eq!(admitted(&s, "a", 4).await, 2, "the rules stayed in force");
    })
    .await;
}

/// A rotated key-hash secret comes as the same snapshot again on the open stream: the sidecar
/// takes the secret and neither re-applies nor re-acknowledges the rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_snapshot_brings_a_rotated_key_hash_secret_only() {
    within(60, async {
        let upstream = Upstream::start().await;
        let controller = FakeController::start(0, vec![snapshot(1, 2)]).await;
        let url = format!("http://127.0.0.1:{}", controller.port);
        let (s, _token_dir) = stream_sidecar(&upstream, &url, "test-token", &[]).await;
        poll_until(Duration::from_secs(10), "ack of v1", || async {
            (controller.seen.lock().unwrap().acks.len() == 1).then_some(())
        })
        .await;
        assert_eq!(admitted(&s, "a", 1).await, 1);
        let mut resent: serde_json::Value = serde_json::from_str(&snapshot(1, 2)).unwrap();
        resent["keyHashSecret"] = "0123456789abcdef0123456789abcdef".into();
        controller.push(resent.to_string());
        poll_until(Duration::from_secs(10), "the secret taken", || async {
            s.logs()
                .iter()
                .any(|l| l.contains("key hashes now follow the installation's key-hash secret"))
                .then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            controller.seen.lock().unwrap().acks.len(),
            1,
            "not acked again"
        );
        assert_eq!(
            admitted(&s, "a", 3).await,
            1,
            "not re-applied: the key's bucket kept its count"
        );
    })
    .await;
}
