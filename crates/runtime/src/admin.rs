//! The admin port: probes, metrics and debug views. Bound separately from the proxy listener so
//! the kubelet can reach it on the pod IP while the proxy may stay on loopback.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::rule_stream::StreamHealth;
use tollgate_engine::shared::{Shared, is_ready};

/// The rule stream being reported on, in controller mode.
#[derive(Clone)]
pub struct StreamView {
    pub controller: String,
    pub health: Arc<StreamHealth>,
}

/// Serves the admin endpoints until the task is dropped. `/debug/*` answers only loopback
/// clients unless `debug_remote` is set.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    debug_remote: bool,
    rule_stream: Option<StreamView>,
) {
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let shared = Arc::clone(&shared);
        let rule_stream = rule_stream.clone();
        let debug_allowed = debug_remote || is_loopback(peer.ip());
        let service = hyper::service::service_fn(move |req| {
            let shared = Arc::clone(&shared);
            let rule_stream = rule_stream.clone();
            async move {
                let resp = if req.uri().path().starts_with("/debug/") && !debug_allowed {
                    text(
                        StatusCode::FORBIDDEN,
                        "/debug/* answers loopback clients only (kubectl port-forward or exec); \
                         --admin-debug-remote opens it\n",
                    )
                } else if req.uri().path() == "/debug/log-level" {
                    log_level(req).await
                } else if req.uri().path() == "/debug/why" {
                    // Async: `balance=redis` reads Redis.
                    match tollgate_engine::explain::why(&shared, req.uri().query()).await {
                        Ok(v) => json(&v),
                        Err(e) => text(StatusCode::BAD_REQUEST, format!("/debug/why: {e}\n")),
                    }
                } else {
                    route(&shared, rule_stream.as_ref(), &req)
                };
                Ok::<_, Infallible>(resp)
            }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
}

fn route(
    shared: &Shared,
    stream: Option<&StreamView>,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    match req.uri().path() {
        "/healthz" | "/livez" => text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            if is_ready(shared) {
                text(StatusCode::OK, "ready\n")
            } else {
                // Why the stream has not delivered rules, for whoever reads the body (the API
                // server's pod proxy; the kubelet's event only shows the status code).
                match stream.and_then(|s| s.health.last_error()) {
                    Some(e) => text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("no rules loaded yet: rule stream: {e}\n"),
                    ),
                    None => text(StatusCode::SERVICE_UNAVAILABLE, "no rules loaded yet\n"),
                }
            }
        }
        "/debug/stream" => match stream {
            Some(s) => json(&s.health.to_json(&s.controller)),
            None => json(&serde_json::json!({ "controller": null, "standalone": true })),
        },
        "/metrics" => metrics(shared),
        "/debug/rules" => debug_rules(shared),
        "/debug/top-keys" => {
            let top: Vec<serde_json::Value> = shared
                .audit()
                .top
                .snapshot()
                .into_iter()
                .map(|e| {
                    serde_json::json!({
                        "rule": e.rule,
                        "keyHash": tollgate_engine::key_hash::display(e.key_hash),
                        "key": e.key,
                        "rejected": e.count,
                        "maxOvercount": e.error,
                    })
                })
                .collect();
            json(&serde_json::json!({ "topKeys": top }))
        }
        "/debug/config" => json(&serde_json::json!({
            "version": shared.rules().version,
            "keyHashSecret": shared.audit().key_hash_source(),
            "configError": shared.config_error().as_deref().map(String::as_str),
            // Secrets are never shown: the URL is redacted, files are named, not read.
            "redis": shared.global().map(|g| g.store.describe()),
        })),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// `/metrics`, with the gauges read at scrape time brought up to date first.
fn metrics(shared: &Shared) -> Response<Full<Bytes>> {
    let rules = shared.rules();
    shared.metrics().active_keys.set(rules.active_keys() as i64);
    shared.metrics().key_overflow_decisions.set(
        rules
            .rules
            .iter()
            .map(|r| r.limiter.overflow_decisions())
            .sum::<u64>() as i64,
    );
    let mut resp = Response::new(Full::new(Bytes::from(shared.metrics().encode())));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

/// `/debug/rules`: the rule set in force, each rule in words, and how each global rule runs.
fn debug_rules(shared: &Shared) -> Response<Full<Bytes>> {
    let rules = shared.rules();
    let policies: Vec<_> = rules.policies.iter().map(|p| &p.compiled).collect();
    let backend = if shared.global().is_some() {
        tollgate_crd::compiled::GlobalBackend::Redis
    } else {
        tollgate_crd::compiled::GlobalBackend::None
    };
    let described: Vec<String> = rules
        .rules
        .iter()
        .map(|r| r.rule.describe_where(backend))
        .collect();
    // How each global rule runs now: leased or exact per request, and why.
    let global: Vec<serde_json::Value> = rules
        .rules
        .iter()
        .filter_map(|r| r.global.as_ref())
        .map(|g| {
            let (mode, why) = g.mode();
            let largest = g.largest_allowance();
            serde_json::json!({
                "policy": g.policy_id,
                "rule": g.rule_id,
                "mode": mode,
                "why": why,
                "liveSidecars": g.live_sidecars(),
                "largestAllowance": largest,
                "overAdmissionBound": largest * u64::from(g.live_sidecars()),
            })
        })
        .collect();
    json(&serde_json::json!({
        "version": rules.version,
        "wireVersion": tollgate_crd::WIRE_VERSION,
        "policies": policies,
        "rules": described,
        "globalModes": global,
        "globalRulesEnforcedLocally": rules.local_fallback_rules,
        "configError": shared.config_error().as_deref().map(String::as_str),
    }))
}

/// `PUT /debug/log-level` with a filter such as `debug` or `info,tollgate::audit=off` changes the
/// log filter without a restart; `GET` explains the usage.
async fn log_level(req: Request<Incoming>) -> Response<Full<Bytes>> {
    use http_body_util::BodyExt;
    if req.method() != http::Method::PUT {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "PUT a filter such as `debug` or `info,tollgate::audit=off`\n",
        );
    }
    let body = match http_body_util::Limited::new(req.into_body(), 4096)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => return text(StatusCode::PAYLOAD_TOO_LARGE, "filter too long\n"),
    };
    let directives = String::from_utf8_lossy(&body).trim().to_string();
    match tollgate_telemetry::set_log_filter(&directives) {
        Ok(()) => {
            tracing::info!(filter = %directives, "log filter changed");
            let mut resp = Response::new(Full::new(Bytes::from(format!(
                "log filter: {directives}\n"
            ))));
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            resp
        }
        Err(e) => {
            let mut resp = Response::new(Full::new(Bytes::from(format!("invalid filter: {e}\n"))));
            *resp.status_mut() = StatusCode::BAD_REQUEST;
            resp
        }
    }
}

/// Loopback, including IPv4 loopback seen on a dual-stack socket (`::ffff:127.0.0.1`).
fn is_loopback(ip: std::net::IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn json(v: &serde_json::Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(v.to_string())));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::is_loopback;

    #[test]
    fn only_loopback_peers_count_as_local() {
        for local in ["127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"] {
            assert!(is_loopback(local.parse().unwrap()), "{local}");
        }
        for remote in [
            "10.0.0.7",
            "192.168.1.2",
            "::ffff:10.0.0.7",
            "fe80::1",
            "0.0.0.0",
        ] {
            assert!(!is_loopback(remote.parse().unwrap()), "{remote}");
        }
    }
}
