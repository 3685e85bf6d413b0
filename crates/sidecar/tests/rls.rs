//! The Envoy rate limit service edge (`tollgate-ratelimit`, RLS v3) behind a real Envoy 1.40
//! (`envoy.filters.http.ratelimit`, descriptors from `rate_limits` actions) in front of an app:
//! exact counts for a small per-key limit, the RateLimit fields and the 429 body reaching the
//! client, a request's cost set the documented way (the filter state Envoy sends as
//! `hits_addend`), Envoy's `x-ratelimit-reset` agreeing with `t`, a fail-closed refusal whose
//! body says the status Envoy sends; and, over gRPC directly, per-descriptor statuses and
//! malformed requests refused.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;
#[allow(dead_code, reason = "not every test file uses every helper")]
#[path = "common/envoy.rs"]
mod envoy;

use std::time::{Duration, Instant};

use common::*;
use envoy::{Envoy, between, doc_config, open_loop};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate_testkit::Redis;

const POLICY: &str = r#"apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: gateway, namespace: shop}
spec:
  targetRef: {selector: {}}
  rules:
  - name: per-key
    scope: Local
    match: {descriptors: [{key: route, value: checkout}]}
    key: [{descriptor: api_key}]
    onMissingKey: Skip
    limit: {requests: 5, period: 1m}
  - name: shadowed
    scope: Local
    mode: Shadow
    key: [{descriptor: api_key}]
    onMissingKey: Skip
    limit: {requests: 1, period: 1m}
"#;

/// A global per-key rule of `requests` a second with the given failure mode.
fn global_policy(requests: u64, failure: &str) -> String {
    format!(
        r#"apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {{name: gateway, namespace: shop}}
spec:
  targetRef: {{selector: {{}}}}
  rules:
  - name: per-key
    scope: Global
    failureMode: {failure}
    match: {{descriptors: [{{key: route, value: checkout}}]}}
    key: [{{descriptor: api_key}}]
    limit: {{requests: {requests}, period: 1s, algorithm: TokenBucket, burst: {requests}}}
"#
    )
}

/// An Envoy from the documented RLS snippet (`docs/envoy/rls.yaml`) in front of `app`,
/// asking tollgate on `rls`. Started on this thread, which must outlive it (Envoy asks for
/// SIGTERM when its parent thread ends).
fn envoy(app: u16, rls: u16) -> Envoy {
    envoy_with(app, rls, &[])
}

/// [`envoy`] with more replacements in the documented configuration.
fn envoy_with(app: u16, rls: u16, more: &[(&str, String)]) -> Envoy {
    let mut replace = vec![
        (
            "socket_address: {address: 127.0.0.1, port_value: 8080}",
            format!("socket_address: {{address: 127.0.0.1, port_value: {app}}}"),
        ),
        (
            "socket_address: {address: 127.0.0.1, port_value: 8081}",
            format!("socket_address: {{address: 127.0.0.1, port_value: {rls}}}"),
        ),
    ];
    replace.extend(more.iter().map(|(from, to)| (*from, to.clone())));
    tokio::task::block_in_place(|| Envoy::start(&doc_config("rls"), &replace))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_enforces_a_descriptor_rule_through_the_rate_limit_service() {
    let app = Upstream::start().await;
    let service = Sidecar::start_ratelimit(POLICY, &[]).await;
    let envoy = envoy(app.addr.port(), service.listen.port());
    let client = client();
    let url = envoy.url("/orders");
    let mut statuses = Vec::new();
    let mut first = None;
    let mut limited = None;
    for _ in 0..8 {
        let resp = client
            .get(&url)
            .header("x-api-key", "k1")
            .send()
            .await
            .unwrap();
        statuses.push(resp.status().as_u16());
        if resp.status() == 200 && first.is_none() {
            first = Some(resp.headers().clone());
        } else if resp.status() == 429 && limited.is_none() {
            let headers = resp.headers().clone();
            limited = Some((headers, resp.text().await.unwrap()));
        }
    }
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429, 429]);
    // Admitted: the RateLimit fields of the rule, passed on by Envoy.
    let first = first.unwrap();
    let fields = first
        .get("ratelimit")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    assert!(
        fields.contains("r=4"),
        "RateLimit on the first 200: {first:?}"
    );
    assert!(first.contains_key("ratelimit-policy"), "{first:?}");
    // Limited: the sidecar's 429 as Envoy's local reply.
    let (headers, body) = limited.unwrap();
    assert!(
        headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.parse::<u64>().ok())
            .is_some_and(|s| s >= 1),
        "{headers:?}"
    );
    assert!(
        headers
            .get("ratelimit")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("r=0")),
        "{headers:?}"
    );
    let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(problem["status"], 429, "{body}");
    // Another key has its own counter; without the header the descriptor has no api_key and
    // the rule skips it.
    for key in ["k2", "k3"] {
        let status = client
            .get(&url)
            .header("x-api-key", key)
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 200, "{key}");
    }
    assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
    // The app saw exactly the admitted requests.
    assert_eq!(
        app.state.hits.load(std::sync::atomic::Ordering::SeqCst),
        5 + 3
    );
    // The rule's metrics count the descriptors, and the shadow rule would have rejected.
    let metrics = service.metrics(&client).await;
    let rejected = metric(
        &metrics,
        "tollgate_requests_total",
        &[("rule", "per-key"), ("decision", "rejected")],
    );
    assert_eq!(rejected, Some(3.0), "{metrics}");
    drop(envoy);
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

#[tokio::test]
async fn grpc_callers_get_per_descriptor_statuses_hits_as_cost_and_clear_errors() {
    let service = Sidecar::start_ratelimit(POLICY, &[]).await;
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", service.listen))
        .await
        .unwrap();
    let call = |descriptors: Vec<RateLimitDescriptor>, hits: u32| RateLimitRequest {
        domain: "shop".into(),
        descriptors,
        hits_addend: hits,
    };
    // 4 hits at once of the 5 a minute: OK with 1 left; then 2 more is over.
    let orders = || descriptor(&[("route", "checkout"), ("api_key", "g1")]);
    let first = rls
        .should_rate_limit(call(vec![orders()], 4))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.overall_code, Code::Ok as i32);
    let status = &first.statuses[0];
    assert_eq!(status.limit_remaining, 1, "{first:?}");
    let limit = status.current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.name.as_str(), limit.requests_per_unit),
        ("shop/gateway/per-key", 5)
    );
    let second = rls
        .should_rate_limit(call(vec![orders()], 2))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(second.overall_code, Code::OverLimit as i32);
    assert!(
        second
            .response_headers_to_add
            .iter()
            .any(|h| h.key == "retry-after"),
        "{second:?}"
    );
    assert!(!second.raw_body.is_empty());
    // Two descriptors: one over its limit (2 hits, 1 left), one no rule limits; each gets
    // its own status.
    let mixed = rls
        .should_rate_limit(call(vec![orders(), descriptor(&[("route", "search")])], 2))
        .await
        .unwrap()
        .into_inner();
    let codes: Vec<i32> = mixed.statuses.iter().map(|s| s.code).collect();
    assert_eq!(codes, [Code::OverLimit as i32, Code::Ok as i32]);
    assert_eq!(mixed.overall_code, Code::OverLimit as i32);
    // Malformed: no descriptors, a descriptor without entries, an empty entry key.
    let err = rls.should_rate_limit(call(vec![], 1)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    let err = rls
        .should_rate_limit(call(vec![orders(), descriptor(&[])], 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("descriptors[1] has no entries"),
        "{err:?}"
    );
    let err = rls
        .should_rate_limit(call(vec![descriptor(&[("", "x")])], 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("descriptors[0].entries[0].key"),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_global_limit_holds_within_one_percent_across_three_envoys() {
    let redis = Redis::start();
    let app = Upstream::start().await;
    let policy = global_policy(300, "Open");
    let service = Sidecar::start_ratelimit(&policy, &["--redis", &redis.url()]).await;
    let envoys: Vec<Envoy> = (0..3)
        .map(|_| envoy(app.addr.port(), service.listen.port()))
        .collect();
    // 600 a second offered for 300, 200 through each Envoy; measured after 3 s.
    let start = Instant::now();
    let (from, until) = (Duration::from_secs(3), start + Duration::from_secs(13));
    let runs: Vec<_> = envoys
        .iter()
        .map(|e| open_loop(e.url("/"), "hot", 200, start, until))
        .collect();
    let (mut admitted, mut sent) = (0, 0);
    for r in runs {
        let measured = between(&r.await.unwrap(), from, until - start);
        admitted += measured.iter().filter(|&&s| s == 200).count() as u64;
        sent += measured.len() as u64;
    }
    let limit = 300.0 * 10.0;
    let error = (admitted as f64 - limit) / limit;
    eprintln!(
        "RLS global 300/s through 3 Envoys for 10 s: admitted {admitted} of {sent} ({:+.2} %)",
        error * 100.0
    );
    assert!(
        error.abs() <= 0.01,
        "admitted {admitted} of {sent} vs {limit}"
    );
    for e in &envoys {
        assert_service_answered(e);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_down_each_rule_keeps_its_failure_mode_without_waiting() {
    let mut redis = Redis::start();
    let app = Upstream::start().await;
    let open =
        Sidecar::start_ratelimit(&global_policy(1000, "Open"), &["--redis", &redis.url()]).await;
    let closed =
        Sidecar::start_ratelimit(&global_policy(1000, "Closed"), &["--redis", &redis.url()]).await;
    let via_open = envoy(app.addr.port(), open.listen.port());
    let via_closed = envoy(app.addr.port(), closed.listen.port());
    // Both serve while Redis is up; then Redis goes away for good.
    let client = client();
    for e in [&via_open, &via_closed] {
        let status = client
            .get(e.url("/"))
            .header("x-api-key", "k")
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 200);
    }
    redis.kill();
    // Past the lease TTL (1 s): nothing is left to spend.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let start = Instant::now();
    let until = start + Duration::from_secs(3);
    let a = open_loop(via_open.url("/"), "k", 50, start, until);
    let b = open_loop(via_closed.url("/"), "k", 50, start, until);
    let (open_sent, closed_sent) = (a.await.unwrap(), b.await.unwrap());
    let admitted = |sent: &[envoy::Sent]| sent.iter().filter(|s| s.status == 200).count();
    let (o_sent, o_ok) = (open_sent.len(), admitted(&open_sent));
    let (c_sent, c_ok) = (closed_sent.len(), admitted(&closed_sent));
    let slowest = open_sent
        .iter()
        .chain(&closed_sent)
        .map(|s| s.took.as_millis())
        .max()
        .unwrap_or(0);
    eprintln!(
        "Redis down: fail-open admitted {o_ok} of {o_sent}, fail-closed {c_ok} of {c_sent}, slowest answer {slowest} ms"
    );
    assert_eq!(o_ok, o_sent, "fail-open admits everything");
    assert_eq!(c_ok, 0, "fail-closed refuses everything");
    // The refusal Envoy sends is its rate_limited_status (429): the problem body says the same
    // status, and what kind of refusal it is.
    let refused = client
        .get(via_closed.url("/"))
        .header("x-api-key", "k")
        .send()
        .await
        .unwrap();
    let status = refused.status().as_u16();
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(status, 429);
    assert_eq!(problem["status"], status, "{problem}");
    assert!(
        problem["type"]
            .as_str()
            .unwrap_or("")
            .ends_with("temporary-reduced-capacity"),
        "{problem}"
    );
    // Envoy's filter waits 250 ms for tollgate; tollgate answers within its Redis timeout
    // (the default 100 ms, which only the calls made before the breaker opens can spend).
    assert!(slowest < 200, "slowest answer {slowest} ms");
    for e in [&via_open, &via_closed] {
        assert_service_answered(e);
    }
}

/// Envoy's rate limit filter counted answers from tollgate and no error (a timeout or a
/// failed call: Envoy creates the error counter at its first use).
fn assert_service_answered(envoy: &Envoy) {
    let (ok, over, errors) = tokio::task::block_in_place(|| {
        (
            envoy.stat("cluster.app.ratelimit.ok"),
            envoy.stat("cluster.app.ratelimit.over_limit"),
            envoy.stat("cluster.app.ratelimit.error"),
        )
    });
    assert!(
        ok.unwrap_or(0) + over.unwrap_or(0) > 0,
        "no answers counted: {ok:?} {over:?}"
    );
    assert_eq!(errors.unwrap_or(0), 0, "calls to tollgate failed");
}

/// A request's cost through a real Envoy: the documented `set_filter_state` of
/// `envoy.ratelimit.hits_addend` from `x-cost` reaches tollgate as `hits_addend`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_sends_a_request_cost_from_the_documented_filter_state() {
    let app = Upstream::start().await;
    let service = Sidecar::start_ratelimit(POLICY, &[]).await;
    let envoy = envoy(app.addr.port(), service.listen.port());
    let client = client();
    let send = |key: &'static str, cost: Option<&'static str>| {
        let mut r = client.get(envoy.url("/orders")).header("x-api-key", key);
        if let Some(cost) = cost {
            r = r.header("x-cost", cost);
        }
        async move { r.send().await.unwrap() }
    };
    // 5 a minute: a cost of 4 leaves 1, so a cost of 2 is over and a cost of 1 fits.
    let first = send("c1", Some("4")).await;
    assert_eq!(first.status(), 200);
    let fields = header(&first, "ratelimit").to_string();
    assert!(fields.contains("r=1"), "a cost of 4 of 5: {fields}");
    assert_eq!(send("c1", Some("2")).await.status(), 429);
    assert_eq!(
        send("c1", None).await.status(),
        200,
        "no x-cost: a cost of 1"
    );
    assert_eq!(send("c1", None).await.status(), 429);
    // A value that is not a number costs 1.
    assert_eq!(send("c2", Some("lots")).await.status(), 200);
    let fields = header(&send("c2", None).await, "ratelimit").to_string();
    assert!(fields.contains("r=3"), "{fields}");
    drop(envoy);
}

/// Envoy's `x-ratelimit-reset` (from `duration_until_reset`) and tollgate's `RateLimit` `t` on
/// the same response agree, hit after hit of a token bucket, admitted and rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_x_ratelimit_reset_agrees_with_the_ratelimit_field() {
    let app = Upstream::start().await;
    let policy = POLICY.replace(
        "limit: {requests: 5, period: 1m}",
        "limit: {requests: 3, period: 36s, algorithm: TokenBucket}",
    );
    let service = Sidecar::start_ratelimit(&policy, &[]).await;
    let x_headers = (
        "failure_mode_deny: false",
        "failure_mode_deny: false\n                      enable_x_ratelimit_headers: DRAFT_VERSION_03"
            .to_string(),
    );
    let envoy = envoy_with(app.addr.port(), service.listen.port(), &[x_headers]);
    let client = client();
    let mut seen = Vec::new();
    for _ in 0..5 {
        let r = client
            .get(envoy.url("/orders"))
            .header("x-api-key", "r1")
            .send()
            .await
            .unwrap();
        let reset = header_u64(&r, "x-ratelimit-reset");
        let t = sf_list(r.headers(), "ratelimit")
            .iter()
            .find_map(|i| i.int("t"))
            .expect("t in RateLimit");
        seen.push((r.status().as_u16(), reset, t));
    }
    eprintln!("(status, x-ratelimit-reset, t): {seen:?}");
    for (status, reset, t) in &seen {
        assert_eq!(*reset as i64, *t, "status {status}: {seen:?}");
    }
    assert_eq!(seen.iter().filter(|s| s.0 == 429).count(), 2, "{seen:?}");
    drop(envoy);
}

/// `tollgate-sidecar --rate-limit-service` (the alias kept for one release) warns and hands
/// over to `tollgate-ratelimit` next to it, which serves RLS with the other flags as given.
#[tokio::test]
async fn the_deprecated_sidecar_flag_still_serves_rls_through_tollgate_ratelimit() {
    ratelimit_bin(); // Built next to tollgate-sidecar, where the alias looks first.
    let service = Sidecar::start("", POLICY, &["--rate-limit-service"]).await;
    let logs = service.logs().join("\n");
    assert!(
        logs.contains("--rate-limit-service is deprecated"),
        "{logs}"
    );
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", service.listen))
        .await
        .unwrap();
    let orders = || descriptor(&[("route", "checkout"), ("api_key", "alias")]);
    let call = |hits: u32| RateLimitRequest {
        domain: "shop".into(),
        descriptors: vec![orders()],
        hits_addend: hits,
    };
    let first = rls.should_rate_limit(call(5)).await.unwrap().into_inner();
    assert_eq!(first.overall_code, Code::Ok as i32, "{first:?}");
    let second = rls.should_rate_limit(call(1)).await.unwrap().into_inner();
    assert_eq!(second.overall_code, Code::OverLimit as i32, "{second:?}");
}
