//! Traces reach a real OTLP/HTTP endpoint (an in-test collector decoding the protobuf export),
//! continue the caller's trace, and are passed on to the upstream; background lease syncs with a
//! real `redis-server` get spans too; the log filter can be changed at runtime.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;
use tokio::net::TcpListener;

/// Starts an HTTP server that records every request's headers and body, answering 200.
async fn recorder() -> (String, Arc<Mutex<Vec<(http::HeaderMap, Bytes)>>>) {
    recorder_with(None).await
}

/// [`recorder`], over TLS when given an acceptor (then its URL is `https://localhost:PORT`).
async fn recorder_with(
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> (String, Arc<Mutex<Vec<(http::HeaderMap, Bytes)>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let url = match tls {
        Some(_) => format!("https://localhost:{}", addr.port()),
        None => format!("http://{addr}"),
    };
    let seen: Arc<Mutex<Vec<(http::HeaderMap, Bytes)>>> = Arc::default();
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let seen = seen2.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let stream: Box<dyn Io> = match tls {
                    None => Box::new(tcp),
                    Some(acceptor) => match acceptor.accept(tcp).await {
                        Ok(s) => Box::new(s),
                        Err(_) => return, // a client that does not trust us
                    },
                };
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let headers = req.headers().clone();
                        let body = req
                            .into_body()
                            .collect()
                            .await
                            .map(|b| b.to_bytes())
                            .unwrap_or_default();
                        seen.lock().unwrap().push((headers, body));
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(TokioIo::new(stream), svc)
                .await;
            });
        }
    });
    (url, seen)
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// A TLS acceptor for `localhost`/127.0.0.1 with a certificate from a fresh test CA; returns it
/// with the CA's PEM file.
fn collector_tls(dir: &std::path::Path) -> (tokio_rustls::TlsAcceptor, std::path::PathBuf) {
    tls_acceptor(
        dir,
        "otel-collector",
        "collector",
        "localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
}

/// An `https://` collector is reached when the sidecar trusts its CA (`--otlp-ca-file`); one
/// whose CA it does not trust gets nothing, and the failed export is logged, not lost in
/// silence. (Before, the exporter had no TLS at all and said nothing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_https_collector_that_trusts_the_given_ca() {
    within(90, async {
        let dir = tempfile::tempdir().unwrap();
        let (acceptor, ca) = collector_tls(dir.path());
        let (collector, exports) = recorder_with(Some(acceptor)).await;
        let (app, _) = recorder().await;
        let p = policy(
            "tls",
            "rules:\n- name: all\n  limit: {requests: 100, period: 1m}\n  scope: Local\n",
        );
        let ca = ca.to_str().unwrap();

        let mut trusting = Sidecar::start(
            &app,
            &p,
            &["--otlp-endpoint", &collector, "--otlp-ca-file", ca],
        )
        .await;
        let c = client();
        assert_eq!(c.get(trusting.url("/")).send().await.unwrap().status(), 200);
        trusting.terminate();
        trusting.wait_exit(Duration::from_secs(15)).await;
        let spans = exported_spans(&exports);
        assert!(
            spans.iter().any(|s| s.name == "tollgate proxy"),
            "no span over TLS: {:?}\n{}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>(),
            trusting.logs().join("\n")
        );

        // System roots only: the collector's private CA is not among them.
        exports.lock().unwrap().clear();
        let mut other = Sidecar::start(&app, &p, &["--otlp-endpoint", &collector]).await;
        assert_eq!(c.get(other.url("/")).send().await.unwrap().status(), 200);
        other.terminate();
        other.wait_exit(Duration::from_secs(15)).await;
        assert!(
            exports.lock().unwrap().is_empty(),
            "an untrusted collector got spans"
        );
        let logs = other.logs().join("\n");
        assert!(
            logs.contains("BatchSpanProcessor.ExportError"),
            "the failed export is logged:\n{logs}"
        );
    })
    .await;
}

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_and_trace_context_propagates() {
    within(60, async {
        let (collector, exports) = recorder().await;
        let (app, app_seen) = recorder().await;
        let p = policy("traced", "rules:\n- name: per-client\n  key: [{header: x-api-key}]\n  limit: {requests: 1, period: 1m}\n  scope: Local\n");
        let mut s = Sidecar::start(&app, &p, &["--otlp-endpoint", &collector]).await;
        let c = client();
        let traceparent = format!("00-{TRACE_ID}-{PARENT_ID}-01");
        let ok = c.get(s.url("/a")).header("traceparent", &traceparent).header("x-api-key", "k").send().await.unwrap();
        assert_eq!(ok.status(), 200);
        let limited = c.get(s.url("/a")).header("traceparent", &traceparent).header("x-api-key", "k").send().await.unwrap();
        assert_eq!(limited.status(), 429);

        // The upstream sees the same trace, with the sidecar's span as the parent.
        let forwarded = app_seen.lock().unwrap()[0].0.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string).expect("traceparent forwarded");
        let parts: Vec<&str> = forwarded.split('-').collect();
        assert_eq!(parts[1], TRACE_ID, "{forwarded}");
        assert_ne!(parts[2], PARENT_ID, "the sidecar's own span must be the parent: {forwarded}");

        // Shutdown flushes the batch exporter.
        s.terminate();
        s.wait_exit(Duration::from_secs(15)).await;
        let mut spans = Vec::new();
        for (headers, body) in exports.lock().unwrap().iter() {
            assert_eq!(headers.get("content-type").unwrap(), "application/x-protobuf");
            let req = ExportTraceServiceRequest::decode(body.as_ref()).expect("OTLP protobuf");
            for rs in req.resource_spans {
                for ss in rs.scope_spans {
                    spans.extend(ss.spans);
                }
            }
        }
        let proxy: Vec<_> = spans.iter().filter(|s| s.name == "tollgate proxy").collect();
        assert_eq!(proxy.len(), 2, "one span per request: {:?}", spans.iter().map(|s| &s.name).collect::<Vec<_>>());
        let attr = |span: &opentelemetry_proto::tonic::trace::v1::Span, key: &str| -> Option<String> {
            span.attributes.iter().find(|a| a.key == key).and_then(|a| a.value.as_ref()).map(|v| format!("{:?}", v.value))
        };
        let decisions: Vec<String> = proxy.iter().filter_map(|s| attr(s, "tollgate.decision")).collect();
        assert!(decisions.iter().any(|d| d.contains("allowed")) && decisions.iter().any(|d| d.contains("rejected")), "{decisions:?}");
        for span in &proxy {
            assert_eq!(hex(&span.trace_id), TRACE_ID, "continues the caller's trace");
            assert_eq!(hex(&span.parent_span_id), PARENT_ID);
            assert!(attr(span, "tollgate.rule").is_some_and(|r| r.contains("test/traced/per-client")));
        }
    })
    .await;
}

/// Every span in the OTLP/HTTP protobuf exports a [`recorder`] received.
fn exported_spans(
    exports: &Mutex<Vec<(http::HeaderMap, Bytes)>>,
) -> Vec<opentelemetry_proto::tonic::trace::v1::Span> {
    let mut spans = Vec::new();
    for (headers, body) in exports.lock().unwrap().iter() {
        assert_eq!(
            headers.get("content-type").unwrap(),
            "application/x-protobuf"
        );
        let req = ExportTraceServiceRequest::decode(body.as_ref()).expect("OTLP protobuf");
        for rs in req.resource_spans {
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
    }
    spans
}

/// An attribute of an exported span, as an OTLP `AnyValue`.
fn attr_value(
    span: &opentelemetry_proto::tonic::trace::v1::Span,
    key: &str,
) -> Option<opentelemetry_proto::tonic::common::v1::any_value::Value> {
    span.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.as_ref())
        .and_then(|v| v.value.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_sync_rounds_are_traced_with_redis_backed_global_rules() {
    within(60, async {
        let redis = Redis::start();
        let (collector, exports) = recorder().await;
        let upstream = Upstream::start().await;
        let p = policy(
            "shared",
            "rules:\n- name: per-client\n  key: [{header: x-api-key}]\n  limit: {requests: 1000, period: 1m}\n  scope: Global\n",
        );
        let redis_url = redis.url();
        let mut s = Sidecar::start(
            &upstream.url(),
            &p,
            &[
                "--redis",
                &redis_url,
                "--otlp-endpoint",
                &collector,
                "--sync-interval",
                "50ms",
                // Trace spans are info level: the log filter must not hide them from export.
                "--log",
                "warn,tollgate_sidecar=info",
            ],
        )
        .await;
        let c = client();
        // Keys held under a lease give the background sync something to top up or return.
        for i in 0..20 {
            let r = c.get(s.url("/")).header("x-api-key", format!("k{}", i % 4)).send().await.unwrap();
            assert_eq!(r.status(), 200);
        }
        // Several sync intervals (and one membership heartbeat, due once per second).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        s.terminate();
        s.wait_exit(Duration::from_secs(15)).await;

        let spans = exported_spans(&exports);
        let syncs: Vec<_> = spans.iter().filter(|s| s.name == "tollgate lease sync").collect();
        assert!(
            syncs.len() >= 3,
            "a span per sync round: {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        use opentelemetry_proto::tonic::common::v1::any_value::Value;
        // `usize` attributes arrive as strings from tracing-opentelemetry.
        let ops = |s: &opentelemetry_proto::tonic::trace::v1::Span| match attr_value(s, "lease.ops") {
            Some(Value::IntValue(n)) => n,
            Some(Value::StringValue(t)) => t.parse().unwrap_or(-1),
            other => panic!("lease.ops missing: {other:?}"),
        };
        assert!(
            syncs.iter().any(|s| ops(s) > 0),
            "some round leased or returned tokens: {:?}",
            syncs.iter().map(|s| ops(s)).collect::<Vec<_>>()
        );
        assert!(
            syncs.iter().any(|s| attr_value(s, "membership.heartbeat") == Some(Value::BoolValue(true))),
            "some round carried the membership heartbeat"
        );
        for span in &syncs {
            assert!(span.end_time_unix_nano >= span.start_time_unix_nano);
            assert!(span.parent_span_id.is_empty(), "a background round is a root span");
        }
        // The requests were traced too.
        assert_eq!(spans.iter().filter(|s| s.name == "tollgate proxy").count(), 20);
    })
    .await;
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_filter_changes_at_runtime() {
    within(30, async {
        let upstream = Upstream::start().await;
        let p = policy(
            "logs",
            "rules:\n- name: r\n  limit: {requests: 100, period: 1s}\n  scope: Local\n",
        );
        let s = Sidecar::start(&upstream.url(), &p, &[]).await;
        let c = client();
        let r = c
            .put(s.admin_url("/debug/log-level"))
            .body("debug")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        poll_until(
            Duration::from_secs(5),
            "the change to be logged",
            || async {
                s.logs()
                    .iter()
                    .any(|l| l.contains("log filter changed"))
                    .then_some(())
            },
        )
        .await;
        let bad = c
            .put(s.admin_url("/debug/log-level"))
            .body("info,[[[")
            .send()
            .await
            .unwrap();
        assert_eq!(bad.status(), 400);
        let get = c.get(s.admin_url("/debug/log-level")).send().await.unwrap();
        assert_eq!(get.status(), 405);
    })
    .await;
}

/// Text logs written to a pipe (a file, a log collector) carry no terminal colour codes.
#[test]
fn text_logs_to_a_pipe_have_no_colour_codes() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.yaml"), roomy_policy()).unwrap();
    let mut child = std::process::Command::new(BIN)
        .arg("--policies")
        .arg(dir.path())
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
        .args(["--upstream", "http://127.0.0.1:9", "--log-format", "text"])
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut chunk = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("tollgate-sidecar started") {
            match stderr.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&chunk[..n]),
            }
        }
        seen
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !reader.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::process::Command::new("kill")
        .arg(pid.to_string())
        .status();
    let _ = child.wait();
    let log = reader.join().unwrap();
    let text = String::from_utf8_lossy(&log);
    assert!(text.contains("tollgate-sidecar started"), "{text}");
    assert!(
        !log.contains(&0x1b),
        "colour codes in a piped log: {text:?}"
    );
}
