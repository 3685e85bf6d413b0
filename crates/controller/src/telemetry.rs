//! The controller's own spans. Logs and the trace exporter are set up by `tollgate-telemetry`,
//! as for the sidecar ([`crate::runtime::init_tracing`] gives the controller's settings).
//!
//! Logs: JSON (`--log-format json`, what the chart sets) is the sidecar's layout — one object per
//! line with `timestamp`, `level`, `message`, `target` and the event's fields at the top level —
//! plus `span` (the innermost span's fields, e.g. the policy a reconcile is about). Both binaries
//! log to stderr.
//!
//! Traces are off unless an OTLP endpoint is configured (`--otlp-endpoint`, else the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT`); when off, no span is created and the Kubernetes client has no
//! extra layer. When on, spans (target [`TRACE_TARGET`], exported over OTLP/HTTP protobuf):
//!
//! | span | when | attributes |
//! |---|---|---|
//! | `tollgate reconcile` | every policy the watch delivers (compile, then index) | `k8s.namespace.name`, `tollgate.policy` (`namespace/name`), `tollgate.generation`, `tollgate.outcome` (`accepted`/`rejected`), `tollgate.rules`, `tollgate.errors`, `tollgate.changed` (sidecars get new rules), `tollgate.version` |
//! | `tollgate status write` | every status patch (client span) | `k8s.namespace.name`, `tollgate.policy`, `http.request.method`, `http.response.status_code`, `tollgate.outcome` (`ok`/`not_found`/`conflict`/`error`) |
//! | `tollgate event` | every Event published (client span) | `k8s.namespace.name`, `http.response.status_code` |
//! | `tollgate token review` | every TokenReview call (cache misses only) | `tollgate.outcome` (`authenticated`/`rejected`/`error`), `k8s.namespace.name`, `k8s.pod.name` of the reviewed token |
//!
//! The log filter applies to logs only: `--log warn` does not switch traces off.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tollgate_telemetry::{TRACE_TARGET, enabled};
use tracing::{Instrument, Span};

use crate::index::PolicyInput;

/// The span of one policy reconcile; fill it in with [`record_reconcile`]. Disabled (free) when
/// traces are off.
pub fn reconcile_span(namespace: Option<&str>, name: Option<&str>) -> Span {
    if !enabled() {
        return Span::none();
    }
    let namespace = namespace.unwrap_or("");
    let name = name.unwrap_or("");
    tracing::info_span!(
        target: TRACE_TARGET,
        "reconcile",
        otel.name = "tollgate reconcile",
        k8s.namespace.name = namespace,
        tollgate.policy = %format_args!("{namespace}/{name}"),
        tollgate.generation = tracing::field::Empty,
        tollgate.outcome = tracing::field::Empty,
        tollgate.rules = tracing::field::Empty,
        tollgate.errors = tracing::field::Empty,
        tollgate.changed = tracing::field::Empty,
        tollgate.version = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// Records a compile's outcome on a reconcile span.
pub fn record_reconcile(span: &Span, input: &PolicyInput) {
    if span.is_disabled() {
        return;
    }
    if let Some(g) = input.generation {
        span.record("tollgate.generation", g);
    }
    match &input.compiled {
        Ok(policy) => {
            span.record("tollgate.outcome", "accepted");
            span.record("tollgate.rules", policy.rules.len() as i64);
        }
        Err(errors) => {
            span.record("tollgate.outcome", "rejected");
            span.record("tollgate.errors", errors.len() as i64);
            span.record("otel.status_code", "ERROR");
        }
    }
}

/// The span of one TokenReview call.
pub fn token_review_span() -> Span {
    if !enabled() {
        return Span::none();
    }
    tracing::info_span!(
        target: TRACE_TARGET,
        "token review",
        otel.name = "tollgate token review",
        otel.kind = "client",
        tollgate.outcome = tracing::field::Empty,
        k8s.namespace.name = tracing::field::Empty,
        k8s.pod.name = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    )
}

/// A [`kube::Client`] from the environment (in-cluster or `KUBECONFIG`), with
/// [`KubeTraceLayer`] when traces are on.
pub async fn kube_client() -> Result<kube::Client, kube::Error> {
    if !enabled() {
        return kube::Client::try_default().await;
    }
    let config = kube::Config::infer()
        .await
        .map_err(kube::Error::InferConfig)?;
    Ok(kube::client::ClientBuilder::try_from(config)?
        .with_layer(&KubeTraceLayer)
        .build())
}

/// What a Kubernetes API request is, for tracing: only the controller's writes that matter
/// operationally get a span (status patches and Events); reads, watches, Lease renewals and
/// TokenReviews (traced where they are made, with their outcome) do not.
#[derive(Debug, PartialEq, Eq)]
enum ApiCall<'a> {
    StatusWrite { namespace: &'a str, name: &'a str },
    Event { namespace: &'a str },
}

fn classify<'a>(method: &http::Method, path: &'a str) -> Option<ApiCall<'a>> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        (
            &http::Method::PATCH | &http::Method::PUT,
            [
                "apis",
                "tollgate.dev",
                _,
                "namespaces",
                namespace,
                "ratelimitpolicies",
                name,
                "status",
            ],
        ) => Some(ApiCall::StatusWrite { namespace, name }),
        (
            &http::Method::POST,
            [
                "apis",
                "events.k8s.io",
                _,
                "namespaces",
                namespace,
                "events",
            ],
        )
        | (&http::Method::POST, ["api", "v1", "namespaces", namespace, "events"]) => {
            Some(ApiCall::Event { namespace })
        }
        _ => None,
    }
}

fn api_span(method: &http::Method, path: &str) -> Option<Span> {
    match classify(method, path)? {
        ApiCall::StatusWrite { namespace, name } => Some(tracing::info_span!(
            target: TRACE_TARGET,
            "status write",
            otel.name = "tollgate status write",
            otel.kind = "client",
            k8s.namespace.name = namespace,
            tollgate.policy = %format_args!("{namespace}/{name}"),
            http.request.method = %method,
            http.response.status_code = tracing::field::Empty,
            tollgate.outcome = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        )),
        ApiCall::Event { namespace } => Some(tracing::info_span!(
            target: TRACE_TARGET,
            "event",
            otel.name = "tollgate event",
            otel.kind = "client",
            k8s.namespace.name = namespace,
            http.response.status_code = tracing::field::Empty,
            tollgate.outcome = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        )),
    }
}

fn record_status(span: &Span, status: Option<http::StatusCode>) {
    let outcome = match status {
        Some(s) if s.is_success() => "ok",
        Some(http::StatusCode::NOT_FOUND) => "not_found",
        Some(http::StatusCode::CONFLICT) => "conflict",
        _ => "error",
    };
    if let Some(s) = status {
        span.record("http.response.status_code", i64::from(s.as_u16()));
    }
    span.record("tollgate.outcome", outcome);
    if outcome == "error" {
        span.record("otel.status_code", "ERROR");
    }
}

/// Tower layer for the Kubernetes client: a client span around status patches and Event writes.
#[derive(Clone, Copy, Debug, Default)]
pub struct KubeTraceLayer;

impl<S> tower_layer::Layer<S> for KubeTraceLayer {
    type Service = KubeTrace<S>;

    fn layer(&self, inner: S) -> KubeTrace<S> {
        KubeTrace { inner }
    }
}

/// The service [`KubeTraceLayer`] wraps around the client's stack.
#[derive(Clone, Debug)]
pub struct KubeTrace<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> tower_service::Service<http::Request<ReqBody>> for KubeTrace<S>
where
    S: tower_service::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    ResBody: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let span = if enabled() {
            api_span(req.method(), req.uri().path())
        } else {
            None
        };
        let fut = self.inner.call(req);
        match span {
            None => Box::pin(fut),
            Some(span) => Box::pin(async move {
                let result = fut.instrument(span.clone()).await;
                record_status(&span, result.as_ref().ok().map(|r| r.status()));
                result
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_status_writes_and_events_are_traced() {
        let patch = http::Method::PATCH;
        assert_eq!(
            classify(
                &patch,
                "/apis/tollgate.dev/v1alpha1/namespaces/shop/ratelimitpolicies/limits/status"
            ),
            Some(ApiCall::StatusWrite {
                namespace: "shop",
                name: "limits"
            })
        );
        assert_eq!(
            classify(
                &http::Method::POST,
                "/apis/events.k8s.io/v1/namespaces/shop/events"
            ),
            Some(ApiCall::Event { namespace: "shop" })
        );
        for (method, path) in [
            (
                http::Method::GET,
                "/apis/tollgate.dev/v1alpha1/namespaces/shop/ratelimitpolicies/limits/status",
            ),
            (
                http::Method::PATCH,
                "/apis/tollgate.dev/v1alpha1/namespaces/shop/ratelimitpolicies/limits",
            ),
            (
                http::Method::POST,
                "/apis/authentication.k8s.io/v1/tokenreviews",
            ),
            (
                http::Method::PUT,
                "/apis/coordination.k8s.io/v1/namespaces/tollgate-system/leases/tollgate-controller",
            ),
            (http::Method::GET, "/api/v1/pods"),
        ] {
            assert_eq!(classify(&method, path), None, "{method} {path}");
        }
    }
}
