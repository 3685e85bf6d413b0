//! Server tests over real 127.0.0.1 sockets, with a fake authenticator.

use std::net::SocketAddr;

use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tollgate_crd::stream::parse_line;

use super::*;
use crate::index::Index;
use crate::test_util::*;

const EPOCH: &str = "epoch-test";
const API1: &str = "pod:shop:api:api-1";
const API2: &str = "pod:shop:api:api-2";

struct TestServer {
    addr: SocketAddr,
    index: SharedIndex,
    ready: watch::Sender<bool>,
    metrics: Arc<Metrics>,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

fn config() -> ServerConfig {
    ServerConfig {
        heartbeat: Duration::from_secs(30),
        unknown_pod_grace: Duration::from_millis(300),
        shutdown_grace: Duration::from_secs(2),
        plain_stream: true,
        ..ServerConfig::default()
    }
}

async fn start(config: ServerConfig) -> TestServer {
    let index = Index::shared(EPOCH);
    {
        let mut i = index.write();
        i.apply_pod(mk_pod("shop", "api-1", &[("app", "api")]));
        i.apply_pod(mk_pod("shop", "api-2", &[("app", "api")]));
        i.apply_pod(mk_pod("shop", "web-1", &[("app", "web")]));
        i.apply_pod(mk_pod("bank", "api-1", &[("app", "api")]));
        i.apply_policy(input(&mk_policy("shop", "limits", "api", 10)));
    }
    let (metrics, registry) = Metrics::new(index.clone());
    let (ready, ready_rx) = watch::channel(true);
    let server = Server::new(
        index.clone(),
        Arc::new(FakeAuth::default()),
        metrics,
        registry,
        config,
        ready_rx,
    );
    let metrics = server.inner.metrics.clone();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(listener, async move {
        let _ = rx.await;
    }));
    TestServer {
        addr,
        index,
        ready,
        metrics,
        shutdown: Some(tx),
        task,
    }
}

/// An HTTP/1.1 client connection; aborting `conn` closes the socket.
struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
    conn: JoinHandle<()>,
}

async fn connect_stream(stream: TcpStream) -> Conn {
    let (sender, conn) = http1::handshake(TokioIo::new(stream)).await.unwrap();
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    Conn { sender, conn }
}

async fn connect(addr: SocketAddr) -> Conn {
    connect_stream(TcpStream::connect(addr).await.unwrap()).await
}

fn request(method: Method, path: &str, token: Option<&str>, body: &str) -> Request<Full<Bytes>> {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "controller");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    req.body(Full::new(Bytes::from(body.to_string()))).unwrap()
}

impl Conn {
    async fn send(&mut self, req: Request<Full<Bytes>>) -> Response<Incoming> {
        self.sender.send_request(req).await.unwrap()
    }
}

async fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> (Conn, Response<Incoming>) {
    let mut c = connect(addr).await;
    let rsp = c.send(request(Method::GET, path, token, "")).await;
    (c, rsp)
}

async fn body_string(rsp: Response<Incoming>) -> String {
    String::from_utf8(rsp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap()
}

/// Reads NDJSON lines from a streaming body.
struct Lines {
    body: Incoming,
    buf: Vec<u8>,
}

impl Lines {
    fn new(rsp: Response<Incoming>) -> Lines {
        assert_eq!(rsp.status(), StatusCode::OK);
        assert_eq!(rsp.headers()[header::CONTENT_TYPE], "application/x-ndjson");
        Lines {
            body: rsp.into_body(),
            buf: Vec::new(),
        }
    }

    /// The next message, or `None` when the stream ended.
    async fn try_next(&mut self, within: Duration) -> Option<StreamMessage> {
        tokio::time::timeout(within, async {
            loop {
                if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = self.buf.drain(..=pos).collect();
                    return Some(parse_line(&line[..line.len() - 1]).unwrap());
                }
                match self.body.frame().await {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            self.buf.extend_from_slice(&data);
                        }
                    }
                    _ => return None,
                }
            }
        })
        .await
        .expect("a stream message in time")
    }

    async fn next(&mut self) -> StreamMessage {
        self.try_next(Duration::from_secs(5))
            .await
            .expect("stream still open")
    }
}

async fn watch(addr: SocketAddr, query: &str, token: &str) -> (Conn, Lines) {
    let (c, rsp) = get(addr, &format!("/v1/watch?{query}"), Some(token)).await;
    (c, Lines::new(rsp))
}

fn snapshot(
    m: StreamMessage,
) -> (
    u64,
    Vec<tollgate_crd::CompiledPolicy>,
    BTreeMap<String, u32>,
    String,
) {
    match m {
        StreamMessage::Snapshot {
            wire_version,
            version,
            policies,
            members,
            epoch,
            ..
        } => {
            assert_eq!(wire_version, WIRE_VERSION);
            (version, policies, members, epoch)
        }
        other => panic!("expected a snapshot, got {other:?}"),
    }
}

#[tokio::test]
async fn stream_starts_with_snapshot_then_updates_on_change() {
    let s = start(config()).await;
    let (_c, mut lines) = watch(s.addr, "namespace=shop&pod=api-1", API1).await;
    let (v1, policies, members, epoch) = snapshot(lines.next().await);
    assert_eq!(epoch, EPOCH);
    assert_eq!(policies.len(), 1);
    assert_eq!(policies[0].id(), "shop/limits");
    assert_eq!(policies[0].rules[0].limit.requests, 10);
    assert_eq!(members, BTreeMap::from([("shop/limits".to_string(), 1)]));

    s.index
        .write()
        .apply_policy(input(&mk_policy("shop", "limits", "api", 20)));
    let (v2, policies, _, _) = snapshot(lines.next().await);
    assert!(v2 > v1);
    assert_eq!(policies[0].rules[0].limit.requests, 20);

    // A policy for other pods changes nothing on this stream.
    s.index
        .write()
        .apply_policy(input(&mk_policy("shop", "web-limits", "web", 5)));
    s.index
        .write()
        .apply_policy(input(&mk_policy("shop", "extra", "api", 5)));
    let (_, policies, _, _) = snapshot(lines.next().await);
    let ids: Vec<String> = policies.iter().map(|p| p.id()).collect();
    assert_eq!(ids, ["shop/extra", "shop/limits"]);
    assert_eq!(s.metrics.streams_open(), 1);
}

#[tokio::test]
async fn snapshots_carry_the_key_hash_secret_once_loaded() {
    let (tx, rx) = tokio::sync::watch::channel(None);
    let s = start(ServerConfig {
        key_hash_secret: rx,
        ..config()
    })
    .await;
    let (_c, mut lines) = watch(s.addr, "namespace=shop&pod=api-1", API1).await;
    assert_eq!(
        key_hash_secret_of(lines.next().await),
        None,
        "not loaded yet: the field is left out"
    );
    tx.send_replace(Some("0123456789abcdef0123456789abcdef".into()));
    s.index
        .write()
        .apply_policy(input(&mk_policy("shop", "limits", "api", 20)));
    assert_eq!(
        key_hash_secret_of(lines.next().await).as_deref(),
        Some("0123456789abcdef0123456789abcdef")
    );
}

/// A rotated key-hash secret reaches open streams at once, in a snapshot of the version they
/// hold (the rules did not change).
#[tokio::test]
async fn a_rotated_key_hash_secret_reaches_open_streams() {
    let (tx, rx) = tokio::sync::watch::channel(Some("0123456789abcdef-old".into()));
    let s = start(ServerConfig {
        key_hash_secret: rx,
        ..config()
    })
    .await;
    let (_c, mut lines) = watch(s.addr, "namespace=shop&pod=api-1", API1).await;
    let first = lines.next().await;
    let StreamMessage::Snapshot { version, .. } = first.clone() else {
        panic!("{first:?}")
    };
    assert_eq!(
        key_hash_secret_of(first).as_deref(),
        Some("0123456789abcdef-old")
    );
    tx.send_replace(Some("0123456789abcdef-new".into()));
    let next = lines.next().await;
    let StreamMessage::Snapshot { version: again, .. } = next.clone() else {
        panic!("{next:?}")
    };
    assert_eq!(again, version, "same rules, same version");
    assert_eq!(
        key_hash_secret_of(next).as_deref(),
        Some("0123456789abcdef-new")
    );
}

/// The key-hash secret a snapshot carries.
fn key_hash_secret_of(m: StreamMessage) -> Option<String> {
    match m {
        StreamMessage::Snapshot {
            key_hash_secret, ..
        } => key_hash_secret,
        other => panic!("expected a snapshot, got {other:?}"),
    }
}

#[tokio::test]
async fn stream_works_over_h2c() {
    let s = start(config()).await;
    let stream = TcpStream::connect(s.addr).await.unwrap();
    let (mut sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let rsp = sender
        .send_request(request(
            Method::GET,
            "http://controller/v1/watch?namespace=shop&pod=api-1",
            Some(API1),
            "",
        ))
        .await
        .unwrap();
    assert_eq!(rsp.version(), http::Version::HTTP_2);
    let mut lines = Lines::new(rsp);
    let (v, _, _, epoch) = snapshot(lines.next().await);
    // The ack travels on the same connection (and so reaches the same replica).
    let ack =
        serde_json::json!({"namespace": "shop", "pod": "api-1", "version": v, "epoch": epoch});
    let rsp = sender
        .send_request(request(
            Method::POST,
            "http://controller/v1/ack",
            Some(API1),
            &ack.to_string(),
        ))
        .await
        .unwrap();
    assert_eq!(rsp.status(), StatusCode::NO_CONTENT);
    let view = s.index.read().policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (1, 1));
}

#[tokio::test]
async fn members_messages_follow_connects_and_disconnects() {
    let s = start(config()).await;
    let (_c1, mut one) = watch(s.addr, "namespace=shop&pod=api-1", API1).await;
    let (v, _, members, _) = snapshot(one.next().await);
    assert_eq!(members["shop/limits"], 1);

    let (c2, mut two) = watch(s.addr, "namespace=shop&pod=api-2", API2).await;
    let (_, _, members, _) = snapshot(two.next().await);
    assert_eq!(members["shop/limits"], 2);
    assert_eq!(
        one.next().await,
        StreamMessage::Members {
            version: v,
            members: BTreeMap::from([("shop/limits".to_string(), 2)]),
        }
    );

    // The second sidecar goes away (socket closed): detected without waiting for a heartbeat.
    let started = Instant::now();
    c2.conn.abort();
    drop(two);
    assert_eq!(
        one.next().await,
        StreamMessage::Members {
            version: v,
            members: BTreeMap::from([("shop/limits".to_string(), 1)]),
        }
    );
    eprintln!("disconnect noticed after {:?}", started.elapsed());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "disconnect noticed after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn idle_streams_get_heartbeats() {
    let s = start(ServerConfig {
        heartbeat: Duration::from_millis(100),
        ..config()
    })
    .await;
    let (_c, mut lines) = watch(s.addr, "namespace=shop&pod=api-1", API1).await;
    let (v, _, _, _) = snapshot(lines.next().await);
    for _ in 0..3 {
        assert_eq!(
            lines.try_next(Duration::from_secs(1)).await,
            Some(StreamMessage::Heartbeat { version: v })
        );
    }
}

#[tokio::test]
async fn resume_with_since_and_epoch_skips_the_snapshot() {
    let s = start(config()).await;
    let v = s.index.read().pod_rules("shop", "api-1").unwrap().version;

    let (_c, mut lines) = watch(
        s.addr,
        &format!("namespace=shop&pod=api-1&since={v}&epoch={EPOCH}"),
        API1,
    )
    .await;
    assert_eq!(lines.next().await, StreamMessage::Heartbeat { version: v });
    assert_eq!(
        lines.next().await,
        StreamMessage::Members {
            version: v,
            members: BTreeMap::from([("shop/limits".to_string(), 1)]),
        }
    );
    // The resume counts as an ack of that version.
    let view = s.index.read().policy_view("shop", "limits").unwrap();
    assert_eq!(view.sidecars_in_sync, 1);
    // Later changes arrive as usual.
    s.index
        .write()
        .apply_policy(input(&mk_policy("shop", "limits", "api", 20)));
    let (v2, _, _, _) = snapshot(lines.next().await);
    assert!(v2 > v);

    // Another epoch (a restarted controller) or an old version: a full snapshot.
    let (_c2, mut other) = watch(
        s.addr,
        &format!("namespace=shop&pod=api-2&since={v}&epoch=previous"),
        API2,
    )
    .await;
    snapshot(other.next().await);
    let (_c3, mut old) = watch(
        s.addr,
        &format!("namespace=shop&pod=api-2&since={v}&epoch={EPOCH}"),
        API2,
    )
    .await;
    let (v3, _, _, _) = snapshot(old.next().await);
    assert_eq!(v3, v2);
}

/// `--plain-stream=false`: the plain port refuses watch and ack with a 403 that says where to
/// go, before any token review (the "down" token would otherwise give 503), and still answers
/// health and metrics.
#[tokio::test]
async fn plain_stream_off_refuses_the_stream_before_reviewing_the_token() {
    let s = start(ServerConfig {
        plain_stream: false,
        ..config()
    })
    .await;
    for token in [API1, "down"] {
        let (_c, rsp) = get(s.addr, "/v1/watch?namespace=shop&pod=api-1", Some(token)).await;
        assert_eq!(rsp.status(), StatusCode::FORBIDDEN);
        let body: serde_json::Value = serde_json::from_str(&body_string(rsp).await).unwrap();
        assert!(
            body["detail"].as_str().unwrap().contains("TLS only"),
            "{body}"
        );
    }
    let mut c = connect(s.addr).await;
    let rsp = c
        .send(request(Method::POST, "/v1/ack", Some(API1), "{}"))
        .await;
    assert_eq!(rsp.status(), StatusCode::FORBIDDEN);
    for path in ["/healthz", "/readyz", "/metrics"] {
        let (_c, rsp) = get(s.addr, path, None).await;
        assert_eq!(rsp.status(), StatusCode::OK, "{path}");
    }
    assert_eq!(s.metrics.streams_open(), 0);
}

#[tokio::test]
async fn missing_or_invalid_token_is_401() {
    let s = start(config()).await;
    let (_c, rsp) = get(s.addr, "/v1/watch?namespace=shop&pod=api-1", None).await;
    assert_eq!(rsp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        rsp.headers()[header::WWW_AUTHENTICATE],
        "Bearer realm=\"tollgate\""
    );
    assert_eq!(
        rsp.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let (_c, rsp) = get(
        s.addr,
        "/v1/watch?namespace=shop&pod=api-1",
        Some("garbage"),
    )
    .await;
    assert_eq!(rsp.status(), StatusCode::UNAUTHORIZED);
    let body: serde_json::Value = serde_json::from_str(&body_string(rsp).await).unwrap();
    assert_eq!(body["status"], 401);
    // The token reviewer is down: retry later, not "unauthorized".
    let (_c, rsp) = get(s.addr, "/v1/watch?namespace=shop&pod=api-1", Some("down")).await;
    assert_eq!(rsp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(rsp.headers()[header::RETRY_AFTER], "1");
    // Acks need a token too.
    let mut c = connect(s.addr).await;
    let rsp = c.send(request(Method::POST, "/v1/ack", None, "{}")).await;
    assert_eq!(rsp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(s.metrics.streams_open(), 0);
}

#[tokio::test]
async fn other_namespace_or_pod_is_403() {
    let s = start(config()).await;
    let (_c, rsp) = get(s.addr, "/v1/watch?namespace=bank&pod=api-1", Some(API1)).await;
    assert_eq!(rsp.status(), StatusCode::FORBIDDEN);
    let body = body_string(rsp).await;
    assert!(body.contains("bank"), "{body}");
    // A token bound to api-1 may not stream for api-2.
    let (_c, rsp) = get(s.addr, "/v1/watch?namespace=shop&pod=api-2", Some(API1)).await;
    assert_eq!(rsp.status(), StatusCode::FORBIDDEN);
    // An unbound service account token of the namespace may.
    let (_c, rsp) = get(
        s.addr,
        "/v1/watch?namespace=shop&pod=api-2",
        Some("sa:shop:api"),
    )
    .await;
    assert_eq!(rsp.status(), StatusCode::OK);
    // Acks are scoped the same way.
    let mut c = connect(s.addr).await;
    let ack = format!(r#"{{"namespace":"bank","pod":"api-1","version":1,"epoch":"{EPOCH}"}}"#);
    let rsp = c
        .send(request(Method::POST, "/v1/ack", Some(API1), &ack))
        .await;
    assert_eq!(rsp.status(), StatusCode::FORBIDDEN);
}

/// The pod was re-created under its name: a token bound to the earlier pod's UID (its review
/// may still be cached) can neither stream nor ack for the new one; the new pod's token can.
#[tokio::test]
async fn tokens_of_an_earlier_pod_of_the_same_name_are_403() {
    let s = start(config()).await;
    s.index
        .write()
        .apply_pod(mk_pod_uid("shop", "api-1", "uid-2", &[("app", "api")]));
    let query = "/v1/watch?namespace=shop&pod=api-1";
    let (_c, rsp) = get(s.addr, query, Some("pod:shop:api:api-1:uid-1")).await;
    assert_eq!(rsp.status(), StatusCode::FORBIDDEN);
    let body = body_string(rsp).await;
    assert!(body.contains("earlier pod"), "{body}");
    let mut c = connect(s.addr).await;
    let ack = format!(r#"{{"namespace":"shop","pod":"api-1","version":1,"epoch":"{EPOCH}"}}"#);
    let rsp = c
        .send(request(
            Method::POST,
            "/v1/ack",
            Some("pod:shop:api:api-1:uid-1"),
            &ack,
        ))
        .await;
    assert_eq!(rsp.status(), StatusCode::FORBIDDEN);
    assert_eq!(s.metrics.streams_open(), 0);

    let (_c, rsp) = get(s.addr, query, Some("pod:shop:api:api-1:uid-2")).await;
    assert_eq!(rsp.status(), StatusCode::OK);
}

/// The re-created pod's sidecar connects before the watch has replaced the earlier pod: the
/// request waits (up to the unknown-pod grace) for its own incarnation instead of a 403.
#[tokio::test]
async fn a_new_pods_token_waits_for_the_watch_to_catch_up() {
    let s = start(config()).await;
    let pod = |uid: &str| mk_pod_uid("shop", "api-1", uid, &[("app", "api")]);
    s.index.write().apply_pod(pod("uid-1"));
    let index = s.index.clone();
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        index.write().apply_pod(pod("uid-2"));
    });
    let (_c, rsp) = get(
        s.addr,
        "/v1/watch?namespace=shop&pod=api-1",
        Some("pod:shop:api:api-1:uid-2"),
    )
    .await;
    assert_eq!(rsp.status(), StatusCode::OK);
    late.await.unwrap();
}

#[tokio::test]
async fn bad_queries_are_400() {
    let s = start(config()).await;
    for q in [
        "namespace=shop",
        "pod=api-1",
        "namespace=shop&pod=api-1&since=x",
    ] {
        let (_c, rsp) = get(s.addr, &format!("/v1/watch?{q}"), Some(API1)).await;
        assert_eq!(rsp.status(), StatusCode::BAD_REQUEST, "{q}");
    }
    let (_c, rsp) = get(s.addr, "/v1/nothing", Some(API1)).await;
    assert_eq!(rsp.status(), StatusCode::NOT_FOUND);
    let mut c = connect(s.addr).await;
    let rsp = c
        .send(request(Method::POST, "/v1/watch", Some(API1), ""))
        .await;
    assert_eq!(rsp.status(), StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn unknown_pod_is_404_after_a_grace_wait() {
    let s = start(config()).await;
    let started = Instant::now();
    let token = "pod:shop:api:api-9";
    let (_c, rsp) = get(s.addr, "/v1/watch?namespace=shop&pod=api-9", Some(token)).await;
    assert_eq!(rsp.status(), StatusCode::NOT_FOUND);
    assert!(started.elapsed() >= Duration::from_millis(250));

    // A pod the watch delivers during the wait streams normally.
    let index = s.index.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        index
            .write()
            .apply_pod(mk_pod("shop", "api-9", &[("app", "api")]));
    });
    let (_c, mut lines) = watch(s.addr, "namespace=shop&pod=api-9", token).await;
    let (_, policies, _, _) = snapshot(lines.next().await);
    assert_eq!(policies.len(), 1);
}

#[tokio::test]
async fn not_ready_is_503() {
    let s = start(config()).await;
    s.ready.send_replace(false);
    let (_c, rsp) = get(s.addr, "/v1/watch?namespace=shop&pod=api-1", Some(API1)).await;
    assert_eq!(rsp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(rsp.headers()[header::RETRY_AFTER], "1");
    let (_c, rsp) = get(s.addr, "/readyz", None).await;
    assert_eq!(rsp.status(), StatusCode::SERVICE_UNAVAILABLE);
    s.ready.send_replace(true);
    let (_c, rsp) = get(s.addr, "/readyz", None).await;
    assert_eq!(rsp.status(), StatusCode::OK);
}

#[tokio::test]
async fn slow_consumer_gets_the_latest_state_only() {
    let s = start(config()).await;
    // Big snapshots (64 rules) and a small receive buffer, so the connection fills up.
    s.index
        .write()
        .apply_policy(input(&mk_policy_rules("shop", "limits", "api", 1, 64)));
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(s.addr).await.unwrap();
    let mut c = connect_stream(stream).await;
    let rsp = c
        .send(request(
            Method::GET,
            "/v1/watch?namespace=shop&pod=api-1",
            Some(API1),
            "",
        ))
        .await;
    let mut lines = Lines::new(rsp);
    let (_, policies, _, _) = snapshot(lines.next().await);
    let line_len = serde_json::to_vec(&policies).unwrap().len();
    assert!(line_len > 16 * 1024, "snapshot is {line_len} bytes");

    // 300 updates (~6 MB of snapshots) while the client reads nothing.
    const UPDATES: u64 = 300;
    for i in 2..=UPDATES + 1 {
        s.index
            .write()
            .apply_policy(input(&mk_policy_rules("shop", "limits", "api", i, 64)));
        if i % 100 == 0 {
            tokio::task::yield_now().await;
        }
    }
    let last = s.index.read().version();
    let mut received = 0u64;
    loop {
        match lines.next().await {
            StreamMessage::Snapshot {
                version, policies, ..
            } => {
                received += 1;
                if version == last {
                    assert_eq!(policies[0].rules[0].limit.requests, UPDATES + 1);
                    break;
                }
            }
            StreamMessage::Members { .. } | StreamMessage::Heartbeat { .. } => {}
        }
    }
    eprintln!("slow consumer received {received} of {UPDATES} snapshots");
    assert!(
        received < UPDATES / 2,
        "received {received} of {UPDATES} snapshots: intermediate states should be skipped"
    );
}

#[tokio::test]
async fn acks_are_recorded_and_checked() {
    let s = start(config()).await;
    let (_c, mut lines) = watch(s.addr, "namespace=shop&pod=api-1", API1).await;
    let (v, _, _, epoch) = snapshot(lines.next().await);
    let mut c = connect(s.addr).await;
    let post = |body: String| request(Method::POST, "/v1/ack", Some(API1), &body);
    let ack = |version: u64, epoch: &str| {
        format!(r#"{{"namespace":"shop","pod":"api-1","version":{version},"epoch":"{epoch}"}}"#)
    };

    let rsp = c.send(post(ack(v, &epoch))).await;
    assert_eq!(rsp.status(), StatusCode::NO_CONTENT);
    let view = s.index.read().policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_in_sync), (1, 1));

    let rsp = c.send(post(ack(v, "another-controller"))).await;
    assert_eq!(rsp.status(), StatusCode::CONFLICT);
    body_string(rsp).await;
    let rsp = c.send(post(ack(v + 100, &epoch))).await;
    assert_eq!(rsp.status(), StatusCode::CONFLICT);
    body_string(rsp).await;
    let rsp = c.send(post("{not json".to_string())).await;
    assert_eq!(rsp.status(), StatusCode::BAD_REQUEST);
    body_string(rsp).await;
    let rsp = c.send(post("x".repeat(100 * 1024))).await;
    assert_eq!(rsp.status(), StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn deleting_the_pod_ends_its_stream() {
    let s = start(config()).await;
    let (_c, mut lines) = watch(s.addr, "namespace=shop&pod=api-1", API1).await;
    snapshot(lines.next().await);
    s.index.write().delete_pod("shop", "api-1");
    assert_eq!(lines.try_next(Duration::from_secs(5)).await, None);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(s.metrics.streams_open(), 0);
}

#[tokio::test]
async fn health_ready_and_metrics_endpoints() {
    let s = start(config()).await;
    let (_c, rsp) = get(s.addr, "/healthz", None).await;
    assert_eq!(rsp.status(), StatusCode::OK);
    let (_c, rsp) = get(s.addr, "/readyz", None).await;
    assert_eq!(rsp.status(), StatusCode::OK);
    let (_s, mut lines) = watch(s.addr, "namespace=shop&pod=api-1", API1).await;
    snapshot(lines.next().await);
    let (_c, rsp) = get(s.addr, "/metrics", None).await;
    assert_eq!(rsp.status(), StatusCode::OK);
    let text = body_string(rsp).await;
    for needle in [
        "tollgate_controller_index_version ",
        "tollgate_controller_policies 1",
        "tollgate_controller_connected_sidecars{policy=\"shop/limits\"} 1",
        "tollgate_controller_streams_open 1",
        "tollgate_controller_stream_messages_total{type=\"snapshot\"} 1",
        "tollgate_controller_compiles_total{result=\"ok\"} 1",
        "tollgate_controller_http_requests_total{endpoint=\"readyz\",code=\"200\"} 1",
        "tollgate_controller_stream_lag_seconds_bucket",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
}

#[tokio::test]
async fn shutdown_ends_streams_and_stops_serving() {
    let mut s = start(config()).await;
    let (_c, mut lines) = watch(s.addr, "namespace=shop&pod=api-1", API1).await;
    snapshot(lines.next().await);
    if let Some(tx) = s.shutdown.take() {
        let _ = tx.send(());
    }
    assert_eq!(lines.try_next(Duration::from_secs(5)).await, None);
    tokio::time::timeout(Duration::from_secs(5), &mut s.task)
        .await
        .expect("server stops")
        .unwrap()
        .unwrap();
    assert!(TcpStream::connect(s.addr).await.is_err());
}

/// Top-keys reports are scoped like acks (the pod's own token, its own namespace's rules),
/// merged whole or refused whole, and bounded in size.
#[tokio::test]
async fn top_keys_reports_are_merged_or_refused_whole() {
    let top = crate::top_keys::FleetTopKeys::new(Duration::from_secs(600));
    let s = start(ServerConfig {
        top_keys: Arc::clone(&top),
        ..config()
    })
    .await;
    let mut c = connect(s.addr).await;
    let report = |ns: &str, pod: &str, rule: &str| {
        serde_json::json!({"namespace": ns, "pod": pod, "keys": [
            {"rule": rule, "keyHash": "00000000000000aa", "rejected": 9, "maxOvercount": 0}
        ]})
        .to_string()
    };
    let mut post = async |token: Option<&str>, body: &str| {
        c.send(request(Method::POST, "/v1/top-keys", token, body))
            .await
            .status()
    };
    let ok = report("shop", "api-1", "shop/limits/per-key");
    assert_eq!(post(Some(API1), &ok).await, StatusCode::NO_CONTENT);
    assert_eq!(post(None, &ok).await, StatusCode::UNAUTHORIZED);
    assert_eq!(
        post(Some(API1), &report("shop", "api-2", "shop/limits/per-key")).await,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        post(Some(API1), &report("shop", "api-1", "bank/limits/per-key")).await,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(post(Some(API1), "{not json").await, StatusCode::BAD_REQUEST);
    let huge = " ".repeat(MAX_TOP_KEYS_BYTES + 1);
    assert_eq!(post(Some(API1), &huge).await, StatusCode::PAYLOAD_TOO_LARGE);
    top.refresh(Instant::now(), "now");
    let listed = top
        .of("shop", "limits", Some("uid-limits"))
        .expect("the accepted report is counted for the policy object it names now");
    assert_eq!(listed.keys.len(), 1);
    assert_eq!((listed.keys[0].rejected, listed.keys[0].pod_count), (9, 1));
    assert!(top.of("bank", "limits", None).is_none());
}

/// A sidecar without Redis says so on its stream (`redis=false`); the policy's view counts it,
/// so the status can say its Global rules are enforced per pod there.
#[tokio::test]
async fn a_sidecar_without_redis_is_counted_as_such() {
    let s = start(config()).await;
    let (_c1, mut one) = watch(s.addr, "namespace=shop&pod=api-1&redis=false", API1).await;
    snapshot(one.next().await);
    let (_c2, mut two) = watch(s.addr, "namespace=shop&pod=api-2", API2).await;
    snapshot(two.next().await);
    let view = s.index.read().policy_view("shop", "limits").unwrap();
    assert_eq!((view.sidecars_total, view.sidecars_without_redis), (2, 1));
}
