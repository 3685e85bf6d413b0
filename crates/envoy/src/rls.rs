//! The Envoy rate limit service edge: RLS v3 `ShouldRateLimit`, for gateways and meshes that
//! ask a service instead of running a sidecar per pod.
//!
//! Each descriptor of a request is one decision of the engine, exactly as an HTTP request is:
//! the descriptor rides in the extensions of an otherwise empty request
//! ([`keys::Descriptor`](tollgate_engine::keys::Descriptor)), so matching, keys, local and leased global
//! limits, shadow mode and failure modes are the sidecar's own, and a hot key spends its lease
//! with no Redis call. `hits_addend` multiplies the rule's cost. The answer maps the engine's
//! typed [`Outcome`] in one place ([`descriptor_answer`]):
//!
//! - admit: `OK`, with the tightest rule's limit and remaining;
//! - reject: `OVER_LIMIT`, and the sidecar's 429 as the response Envoy sends (`Retry-After`,
//!   the RateLimit fields, the problem body);
//! - unavailable (a fail-closed rule while Redis is unreachable): `OVER_LIMIT` with the
//!   sidecar's 503 headers and `temporary-reduced-capacity` body, so the rule's declared
//!   failure mode holds whatever the Envoy filter's own `failure_mode_deny` says. RLS has no
//!   per-response status: Envoy sends its `rate_limited_status` (429 by default), so the body
//!   says 429 too. A fail-open rule admits from its share.
//!
//! Envoy adds `response_headers_to_add` to the response the client gets, limited or not, so
//! the RateLimit fields reach the client on admitted requests too.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue as EnvoyHeader;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use http::request::Parts;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tonic::codegen::Service as _;

use tollgate_engine::keys::Descriptor;
use tollgate_engine::response;
use tollgate_engine::rules::{Outcome, RuleSet, Verdict};
use tollgate_engine::shared::Shared;

/// More descriptors than any route's `rate_limits` actions build; beyond, the request is
/// refused (`INVALID_ARGUMENT`) rather than decided in bulk.
const MAX_DESCRIPTORS: usize = 64;
/// Entries per descriptor, for the same reason.
const MAX_ENTRIES: usize = 32;
/// RLS has no client address: bypass networks never match and clientIP parts are not allowed
/// in descriptor rules.
const NO_PEER: SocketAddr = SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);

/// The RLS v3 server over the shared engine.
pub struct RateLimitEdge {
    engine: Arc<Shared>,
}

impl RateLimitEdge {
    pub fn new(engine: Arc<Shared>) -> RateLimitEdge {
        RateLimitEdge { engine }
    }
}

/// The gRPC path prefix of RLQS; every other path goes to RLS.
const RLQS_PREFIX: &str = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/";

/// Serves RLS v3 and RLQS (gRPC over HTTP/2 cleartext) on one port until `shutdown`
/// resolves; open connections then get up to `drain` to finish their calls (RLQS streams end
/// then, and Envoy keeps its assignments until their TTL). hyper serves the two generated
/// tonic services directly, told apart by path.
pub async fn serve(
    listener: TcpListener,
    engine: Arc<Shared>,
    quota: crate::rlqs::QuotaEdge,
    shutdown: impl std::future::Future<Output = ()>,
    drain: Duration,
) {
    let rls = RateLimitServiceServer::new(RateLimitEdge::new(engine));
    let rlqs = RateLimitQuotaServiceServer::new(quota);
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder.timer(TokioTimer::new());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            (stream, peer) = tollgate_engine::listen::accept(&listener) => {
                let (rls, rlqs) = (rls.clone(), rlqs.clone());
                let service = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let call: GrpcCall = if req.uri().path().starts_with(RLQS_PREFIX) {
                        Box::pin(rlqs.clone().call(req))
                    } else {
                        Box::pin(rls.clone().call(req))
                    };
                    call
                });
                let conn = builder.serve_connection(TokioIo::new(stream), service);
                let watched = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = watched.await {
                        tracing::debug!(error = %e, %peer, "rate limit service connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(?drain, "drain timed out; closing remaining connections");
    }
}

/// One gRPC call of either service.
type GrpcCall = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<http::Response<tonic::body::Body>, std::convert::Infallible>,
            > + Send,
    >,
>;

#[tonic::async_trait]
impl RateLimitService for RateLimitEdge {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let request = request.into_inner();
        check_request(&request)?;
        let rules = self.engine.rules();
        let mut answer = RateLimitResponse {
            overall_code: Code::Ok as i32,
            ..RateLimitResponse::default()
        };
        let mut headers_from: Option<(Verdict, bool)> = None;
        let (hits_addend, domain) = (request.hits_addend, request.domain);
        for descriptor in request.descriptors {
            let parts = descriptor_parts(descriptor, hits_addend);
            let verdict = self.engine.decide(&rules, &parts, &NO_PEER).await;
            let status = descriptor_answer(&rules, &verdict);
            let over = status.code == Code::OverLimit as i32;
            if over {
                answer.overall_code = Code::OverLimit as i32;
                match verdict.outcome() {
                    Outcome::Reject(r) => self.audit(&rules, r, &domain),
                    Outcome::Unavailable(ri) => self.audit_unavailable(&rules, ri, &parts, &domain),
                    Outcome::Admit => {}
                }
            }
            answer.statuses.push(status);
            // The first limited descriptor speaks for the response; else the last one that
            // met a rule.
            let keep = match &headers_from {
                None => over || !verdict.admitted.is_empty(),
                Some((_, was_over)) => !was_over && (over || !verdict.admitted.is_empty()),
            };
            if keep {
                headers_from = Some((verdict, over));
            }
        }
        if let Some((verdict, over)) = headers_from {
            write_response(&rules, &verdict, over, &mut answer);
        }
        Ok(tonic::Response::new(answer))
    }
}

impl RateLimitEdge {
    /// The audit line and top-keys count of a rejected descriptor, as for an HTTP request.
    fn audit(&self, rules: &RuleSet, rejection: &tollgate_engine::rules::Rejection, domain: &str) {
        let rule = &rules.rules[rejection.limited.rule];
        with_refused_request(rules, rule, domain, |request| {
            self.engine
                .audit()
                .rejected(rule, rejection, request, self.engine.metrics());
        });
    }

    /// The audit line of a descriptor a fail-closed rule refused because its store is away.
    fn audit_unavailable(
        &self,
        rules: &RuleSet,
        ri: usize,
        parts: &http::request::Parts,
        domain: &str,
    ) {
        let rule = &rules.rules[ri];
        let mut key = Vec::new();
        let counted = rules.applies(ri, parts, &NO_PEER, &mut key)
            == tollgate_engine::rules::Applies::Counted;
        with_refused_request(rules, rule, domain, |request| {
            self.engine.audit().unavailable(
                rule,
                counted.then_some(key.as_slice()),
                request,
                self.engine.metrics(),
            );
        });
    }
}

/// A refused descriptor as the audit sees requests: Envoy sent no method, path or headers of
/// the client's, so the line names the domain (`rls:<domain>`).
fn with_refused_request(
    rules: &RuleSet,
    rule: &tollgate_engine::rules::ActiveRule,
    domain: &str,
    write: impl FnOnce(&tollgate_engine::audit::RefusedRequest<'_>),
) {
    let path = format!("rls:{domain}");
    let headers = http::HeaderMap::new();
    write(&tollgate_engine::audit::RefusedRequest {
        policy: &rules.policies[rule.policy].id,
        method: &http::Method::POST,
        path: &path,
        headers: &headers,
        peer: &NO_PEER,
        trusted_hops: 0,
        span: None,
    });
}

/// Refuses what Envoy never sends: no descriptors, too many, a descriptor without entries,
/// or an empty entry key; the message names the descriptor's index.
#[allow(
    clippy::result_large_err,
    reason = "tonic::Status is the trait's error type"
)]
fn check_request(request: &RateLimitRequest) -> Result<(), tonic::Status> {
    if request.descriptors.is_empty() {
        return Err(tonic::Status::invalid_argument(
            "the request has no descriptors",
        ));
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return Err(tonic::Status::invalid_argument(format!(
            "{} descriptors; at most {MAX_DESCRIPTORS} are decided per request",
            request.descriptors.len()
        )));
    }
    for (i, d) in request.descriptors.iter().enumerate() {
        if d.entries.is_empty() {
            return Err(tonic::Status::invalid_argument(format!(
                "descriptors[{i}] has no entries"
            )));
        }
        if d.entries.len() > MAX_ENTRIES {
            return Err(tonic::Status::invalid_argument(format!(
                "descriptors[{i}] has {} entries; at most {MAX_ENTRIES} are allowed",
                d.entries.len()
            )));
        }
        if let Some(j) = d.entries.iter().position(|e| e.key.is_empty()) {
            return Err(tonic::Status::invalid_argument(format!(
                "descriptors[{i}].entries[{j}].key is empty"
            )));
        }
    }
    Ok(())
}

/// The request the engine decides for one descriptor: no method, path or headers of its own,
/// the descriptor in its extensions (its entries moved, not copied). A descriptor's own
/// `hits_addend` overrides the request's.
fn descriptor_parts(descriptor: RateLimitDescriptor, hits_addend: u32) -> Parts {
    let hits = descriptor
        .hits_addend
        .as_ref()
        .map_or(u64::from(hits_addend), |h| h.value);
    let mut parts = http::Request::new(()).into_parts().0;
    parts.extensions.insert(Descriptor {
        entries: descriptor
            .entries
            .into_iter()
            .map(|e| (e.key, e.value))
            .collect(),
        hits,
    });
    parts
}

/// The engine's outcome for one descriptor, in RLS terms.
fn descriptor_answer(rules: &RuleSet, verdict: &Verdict) -> DescriptorStatus {
    let limited = match verdict.outcome() {
        Outcome::Admit => verdict.tightest(),
        Outcome::Reject(r) => Some(&r.limited),
        Outcome::Unavailable(_) => None,
    };
    let code = match verdict.outcome() {
        Outcome::Admit => Code::Ok,
        Outcome::Reject(_) | Outcome::Unavailable(_) => Code::OverLimit,
    };
    let mut status = DescriptorStatus {
        code: code as i32,
        ..DescriptorStatus::default()
    };
    if let Some(l) = limited {
        let rule = &rules.rules[l.rule].rule;
        status.current_limit = Some(RateLimit {
            name: rule.id.clone(),
            requests_per_unit: u32::try_from(rule.limit.requests).unwrap_or(u32::MAX),
            unit: unit_of(rule.limit.period_ms) as i32,
        });
        status.limit_remaining = u32::try_from(l.decision.remaining).unwrap_or(u32::MAX);
        status.duration_until_reset = until_reset(rule, &l.decision);
    }
    status
}

/// `duration_until_reset`, which Envoy sends as `x-ratelimit-reset`: the draft's `t` of the
/// `RateLimit` field on the same response, in the same whole seconds (rounded up), so the two
/// never disagree. For a token bucket that is the time to the next token (or, rejected, until
/// this request's cost fits), not the time until the bucket is full, which grows with each hit.
/// None for concurrency limits, which have no time dimension.
fn until_reset(
    rule: &tollgate_crd::compiled::CompiledRule,
    decision: &tollgate_limiter::Decision,
) -> Option<envoy_types::pb::google::protobuf::Duration> {
    let t = response::effective_window(rule, decision)?;
    let seconds = Duration::from_nanos(t).as_secs_f64().ceil();
    Some(envoy_types::pb::google::protobuf::Duration {
        seconds: seconds as i64,
        nanos: 0,
    })
}

/// RLS names only whole units; a period that is not one is reported as its nearest smaller
/// unit (the `RateLimit-Policy` field Envoy passes on has the exact window).
fn unit_of(
    period_ms: u64,
) -> envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
    match period_ms {
        0 => Unit::Unknown,
        ms if ms < 60_000 => Unit::Second,
        ms if ms < 3_600_000 => Unit::Minute,
        ms if ms < 86_400_000 => Unit::Hour,
        _ => Unit::Day,
    }
}

/// The headers (and, when limited, the body) Envoy gives the client: the sidecar's own 429 or
/// 503, or the RateLimit fields of an admitted request.
fn write_response(rules: &RuleSet, verdict: &Verdict, over: bool, answer: &mut RateLimitResponse) {
    let seed = verdict.tightest().map_or(0, |l| l.fingerprint);
    let (headers, body) = match verdict.outcome() {
        Outcome::Reject(_) if over => {
            let (p, body) = response::too_many_requests(rules, verdict, seed).into_parts();
            (p.headers, body)
        }
        Outcome::Unavailable(ri) if over => {
            // Envoy answers every OVER_LIMIT with its filter's one `rate_limited_status` (429 by
            // default): the problem body says the status the client gets.
            let status = http::StatusCode::TOO_MANY_REQUESTS;
            let (p, body) = response::unavailable_as(rules, verdict, ri, seed, status).into_parts();
            (p.headers, body)
        }
        _ => {
            let mut h = http::HeaderMap::new();
            response::add_admitted_fields(&mut h, rules, verdict);
            (h, bytes::Bytes::new())
        }
    };
    answer.response_headers_to_add = headers
        .iter()
        .map(|(name, value)| EnvoyHeader {
            key: name.as_str().to_string(),
            value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
            raw_value: Vec::new(),
        })
        .collect();
    answer.raw_body = body.to_vec();
}
