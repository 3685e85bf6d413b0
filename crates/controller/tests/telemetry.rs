//! The controller's traces reach a real OTLP/HTTP endpoint (an in-test collector decoding the
//! protobuf export): a span per policy reconcile with its outcome, per status write and Event
//! (through the traced Kubernetes client, answered by a tower-test mock API server) and per
//! TokenReview.
//!
//! One test per binary: tracing is initialised once per process.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kube::client::Body;
use kube::core::DeserializeGuard;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;
use tollgate_controller::auth::{Authenticator, TokenReviewAuthenticator};
use tollgate_controller::index::Index;
use tollgate_controller::metrics::Metrics;
use tollgate_controller::runtime::{CompileLog, reconcile_policy};
use tollgate_controller::status::StatusWriter;
use tollgate_controller::telemetry;
use tollgate_crd::RateLimitPolicy;
use tower_test::mock;

type Exports = Arc<Mutex<Vec<Bytes>>>;

/// An OTLP/HTTP collector on 127.0.0.1: records every request body, answers 200.
async fn collector() -> (String, Exports) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Exports = Arc::default();
    let seen2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let seen = seen2.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        assert_eq!(
                            req.headers().get("content-type").unwrap(),
                            "application/x-protobuf"
                        );
                        let body = req.into_body().collect().await.map(|b| b.to_bytes());
                        seen.lock().unwrap().push(body.unwrap_or_default());
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
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
    (format!("http://{addr}"), seen)
}

fn spans(exports: &Exports) -> Vec<Span> {
    let mut out = Vec::new();
    for body in exports.lock().unwrap().iter() {
        let req = ExportTraceServiceRequest::decode(body.as_ref()).expect("OTLP protobuf");
        for rs in req.resource_spans {
            for ss in rs.scope_spans {
                out.extend(ss.spans);
            }
        }
    }
    out
}

/// An attribute as text (numbers and booleans formatted), whatever OTLP type it arrived as.
fn attr(span: &Span, key: &str) -> Option<String> {
    let value = span
        .attributes
        .iter()
        .find(|a| a.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()?;
    Some(match value {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

fn policy(name: &str, generation: i64, rules: usize, valid: bool) -> RateLimitPolicy {
    let mut yaml = format!(
        "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: {name}, namespace: shop, uid: uid-{name}, generation: {generation}}}\nspec:\n  targetRef: {{selector: {{matchLabels: {{app: api}}}}}}\n  rules:\n"
    );
    for i in 0..rules {
        let requests = if valid { 10 } else { 0 };
        yaml.push_str(&format!(
            "  - name: r{i}\n    limit: {{requests: {requests}, period: 1m}}\n"
        ));
    }
    tollgate_crd::parse_yaml(&yaml).unwrap().remove(0)
}

/// Answers the controller's API calls like an API server would (status patches, Events,
/// TokenReviews), until the client is dropped.
async fn api_server(
    mut handle: mock::Handle<Request<Body>, Response<Body>>,
    objects: HashMap<String, RateLimitPolicy>,
) {
    while let Some((req, send)) = handle.next_request().await {
        let path = req.uri().path().to_string();
        let body = req.into_body().collect().await.unwrap().to_bytes();
        let sent: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let (status, reply) = if path.ends_with("/status") {
            let name = path.rsplit('/').nth(1).unwrap();
            let mut obj = serde_json::to_value(&objects[name]).unwrap();
            obj["status"] = sent["status"].clone();
            (200, obj)
        } else if path.ends_with("/events") {
            (201, sent)
        } else if path.ends_with("/tokenreviews") {
            let mut reply = sent;
            reply["status"] = serde_json::json!({
                "authenticated": true,
                "user": {
                    "username": "system:serviceaccount:shop:api",
                    "extra": {"authentication.kubernetes.io/pod-name": ["api-1"]},
                }
            });
            (201, reply)
        } else {
            panic!("unexpected API call {path}");
        };
        send.send_response(
            Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                .unwrap(),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciles_status_writes_and_token_reviews_are_traced() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let (endpoint, exports) = collector().await;
        tollgate_telemetry::init_with(&tollgate_telemetry::Settings {
            service: "tollgate-controller-test",
            log_filter: "info",
            rust_log_wins: false,
            format: tollgate_telemetry::LogFormat::Json,
            json_span: true,
            otlp_endpoint: Some(&endpoint),
            otlp_ca_file: None,
        })
        .unwrap();
        assert!(tollgate_telemetry::enabled());

        // Reconciles: a valid policy with two rules, then an invalid generation of another.
        let index = Index::shared("epoch");
        let (metrics, _registry) = Metrics::new(index.clone());
        let good = policy("limits", 3, 2, true);
        let bad = policy("broken", 7, 1, false);
        let mut logged = CompileLog::new();
        for p in [&good, &bad] {
            reconcile_policy(
                &DeserializeGuard(Ok(p.clone().into())),
                &mut logged,
                |input| {
                    let mut ix = index.write();
                    let changed = ix.apply_policy(input);
                    Some((changed, ix.version()))
                },
            );
        }

        // Status writes (and the Event for the rejected policy) through the traced client.
        let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::client::ClientBuilder::new(svc, "default")
            .with_layer(&telemetry::KubeTraceLayer)
            .build();
        let objects = HashMap::from([
            ("limits".to_string(), good.clone()),
            ("broken".to_string(), bad.clone()),
        ]);
        let server = tokio::spawn(api_server(handle, objects));
        let mut writer = StatusWriter::new(
            client.clone(),
            index.clone(),
            metrics.clone(),
            "test-0".into(),
            Duration::ZERO,
        );
        writer.sync_once().await;

        // A TokenReview, then the same token again (cached: no second call, no second span).
        let auth = TokenReviewAuthenticator::new(client, vec![], Duration::from_secs(60));
        let id = auth.authenticate("secret-token").await.unwrap();
        assert_eq!(id.pod_name.as_deref(), Some("api-1"));
        auth.authenticate("secret-token").await.unwrap();
        drop((writer, auth));
        let _ = tokio::time::timeout(Duration::from_secs(5), server).await;

        tokio::task::spawn_blocking(tollgate_telemetry::shutdown)
            .await
            .unwrap();
        let spans = spans(&exports);
        check_reconcile_spans(&spans);
        check_status_write_and_event_spans(&spans);
        check_token_review_spans(&spans);
    })
    .await
    .expect("test timed out");
}

/// One reconcile span per policy, with its generation, outcome and rule count; a rejected
/// policy's span is marked as an error.
fn check_reconcile_spans(spans: &[Span]) {
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();

    let reconciles: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "tollgate reconcile")
        .collect();
    assert_eq!(reconciles.len(), 2, "{names:?}");
    let by_policy = |id: &str| {
        *reconciles
            .iter()
            .find(|s| attr(s, "tollgate.policy").as_deref() == Some(id))
            .unwrap_or_else(|| panic!("no reconcile span for {id}"))
    };
    let ok = by_policy("shop/limits");
    assert_eq!(attr(ok, "k8s.namespace.name").as_deref(), Some("shop"));
    assert_eq!(attr(ok, "tollgate.generation").as_deref(), Some("3"));
    assert_eq!(attr(ok, "tollgate.outcome").as_deref(), Some("accepted"));
    assert_eq!(attr(ok, "tollgate.rules").as_deref(), Some("2"));
    assert_eq!(
        attr(ok, "tollgate.changed").as_deref(),
        Some("false"),
        "no pods yet"
    );
    assert!(attr(ok, "tollgate.version").is_some());
    let rejected = by_policy("shop/broken");
    assert_eq!(attr(rejected, "tollgate.generation").as_deref(), Some("7"));
    assert_eq!(
        attr(rejected, "tollgate.outcome").as_deref(),
        Some("rejected")
    );
    assert_eq!(attr(rejected, "tollgate.errors").as_deref(), Some("1"));
    assert_eq!(
        rejected.status.as_ref().map(|s| s.code),
        Some(2),
        "rejected reconciles are marked as errors"
    );
}

/// One status write per policy (PATCH, 200), and one Event for the rejected policy (201).
fn check_status_write_and_event_spans(spans: &[Span]) {
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let writes: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "tollgate status write")
        .collect();
    assert_eq!(writes.len(), 2, "{names:?}");
    for w in &writes {
        assert_eq!(attr(w, "k8s.namespace.name").as_deref(), Some("shop"));
        assert_eq!(attr(w, "http.request.method").as_deref(), Some("PATCH"));
        assert_eq!(attr(w, "http.response.status_code").as_deref(), Some("200"));
        assert_eq!(attr(w, "tollgate.outcome").as_deref(), Some("ok"));
    }
    let mut written: Vec<String> = writes
        .iter()
        .filter_map(|w| attr(w, "tollgate.policy"))
        .collect();
    written.sort();
    assert_eq!(written, ["shop/broken", "shop/limits"]);
    let events: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "tollgate event")
        .collect();
    assert_eq!(events.len(), 1, "{names:?}");
    assert_eq!(
        attr(events[0], "http.response.status_code").as_deref(),
        Some("201")
    );
}

/// One TokenReview span for two authentications (the second is cached), and no token in
/// any span.
fn check_token_review_spans(spans: &[Span]) {
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let reviews: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "tollgate token review")
        .collect();
    assert_eq!(reviews.len(), 1, "cache hits make no call: {names:?}");
    assert_eq!(
        attr(reviews[0], "tollgate.outcome").as_deref(),
        Some("authenticated")
    );
    assert_eq!(
        attr(reviews[0], "k8s.namespace.name").as_deref(),
        Some("shop")
    );
    assert_eq!(attr(reviews[0], "k8s.pod.name").as_deref(), Some("api-1"));
    for s in spans {
        assert!(
            !format!("{:?}", s.attributes).contains("secret-token"),
            "tokens never reach traces"
        );
    }
}
