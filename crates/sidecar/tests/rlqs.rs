//! The RLQS edge (`tollgate-ratelimit`, `StreamRateLimitQuotas`) behind three real Envoy 1.40
//! (`envoy.filters.http.rate_limit_quota`, the documented `docs/envoy/rlqs.yaml`) in front of
//! one app, with a real Redis: a global limit split by demand across Envoys and server
//! replicas, assignments that outlive a server restart until their TTL, and a second replica
//! taking the streams over.
//!
//! Envoy 1.40 reports usage every 5 s whatever `reporting_interval` says, so shares settle
//! within two reports; the tests warm up for that long before they measure.
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
use tollgate_testkit::Redis;

/// A global per-key limit of 200 a second; `FAILURE` is Open or Closed.
fn policy(failure: &str) -> String {
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
    match: {{descriptors: [{{key: name, value: per-key}}]}}
    key: [{{descriptor: api_key}}]
    limit: {{requests: 200, period: 1s, algorithm: TokenBucket, burst: 20}}
"#
    )
}

/// A tollgate RLQS server on `redis` with an assignment TTL.
async fn server(redis: &Redis, failure: &str, ttl: &str) -> Sidecar {
    Sidecar::start_ratelimit(
        &policy(failure),
        &[
            "--redis",
            &redis.url(),
            "--rlqs-assignment-ttl",
            ttl,
            "--log",
            "info,tollgate_envoy::rlqs=debug",
        ],
    )
    .await
}

/// An Envoy from the documented RLQS snippet, asking the servers on `ports`; `closed` uses
/// the fail-closed behaviours the docs give for `failureMode: Closed`.
async fn envoy(app: u16, ports: &[u16], closed: bool) -> Envoy {
    let mut config = doc_config("rlqs");
    if closed {
        config = config.replace("blanket_rule: ALLOW_ALL", "blanket_rule: DENY_ALL");
    }
    let endpoint = |port: u16| {
        format!(
            "              - endpoint:\n                  address:\n                    socket_address: {{address: 127.0.0.1, port_value: {port}}}\n"
        )
    };
    let replace = vec![
        ("port_value: 8080}", format!("port_value: {app}}}")),
        (
            "              - endpoint:\n                  address:\n                    socket_address: {address: 127.0.0.1, port_value: 8081}\n",
            ports.iter().map(|p| endpoint(*p)).collect::<String>(),
        ),
    ];
    // Not from spawn_blocking: Envoy asks for SIGTERM when the thread that started it ends,
    // and the blocking pool ends idle threads after 10 s.
    tokio::task::block_in_place(|| Envoy::start(&config, &replace))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_skewed_load_across_envoys_and_replicas_admits_the_global_limit() {
    let redis = Redis::start();
    let app = Upstream::start().await;
    // Two server replicas sharing Redis: the heavy Envoy asks one, the light ones the other.
    let one = server(&redis, "Open", "10s").await;
    let two = server(&redis, "Open", "10s").await;
    let app_port = app.addr.port();
    let heavy = envoy(app_port, &[one.listen.port()], false).await;
    let light_a = envoy(app_port, &[two.listen.port()], false).await;
    let light_b = envoy(app_port, &[two.listen.port()], false).await;
    // 400 a second offered for a limit of 200: 90 / 5 / 5 of it.
    let start = Instant::now();
    let (warm, measure) = (Duration::from_secs(12), Duration::from_secs(10));
    let until = start + warm + measure;
    let runs = [
        open_loop(heavy.url("/"), "k1", 360, start, until),
        open_loop(light_a.url("/"), "k1", 20, start, until),
        open_loop(light_b.url("/"), "k1", 20, start, until),
    ];
    let mut admitted = Vec::new();
    let mut sent = Vec::new();
    for r in runs {
        let measured = between(&r.await.unwrap(), warm, warm + measure);
        admitted.push(measured.iter().filter(|&&s| s == 200).count() as u64);
        sent.push(measured.len() as u64);
    }
    let total: u64 = admitted.iter().sum();
    let limit = 200.0 * measure.as_secs_f64();
    let error = (total as f64 - limit) / limit;
    eprintln!(
        "RLQS 90/5/5 over {measure:?}: admitted {admitted:?} of {sent:?}, total {total} vs {limit} ({:+.2} %)",
        error * 100.0
    );
    assert!(
        error.abs() <= 0.02,
        "admitted {total} vs the limit's {limit}: {admitted:?} of {sent:?}"
    );
    // Shares follow demand: the heavy Envoy holds about 90 % of the limit, each light one 5 %.
    let heavy_part = admitted[0] as f64 / total as f64;
    assert!(
        (0.85..=0.95).contains(&heavy_part),
        "heavy part {heavy_part}: {admitted:?}"
    );
    for light in &admitted[1..] {
        let part = *light as f64 / total as f64;
        assert!(
            (0.025..=0.075).contains(&part),
            "light part {part}: {admitted:?}"
        );
    }
    // Both replicas counted the fleet's three streams, and the Envoys' reported decisions
    // count as the rule's (what dashboards and alerts read).
    let client = client();
    let (mut allowed, mut rejected) = (0.0, 0.0);
    for s in [&one, &two] {
        let m = s.metrics(&client).await;
        assert_eq!(
            metric(&m, "tollgate_rlqs_fleet_streams", &[]),
            Some(3.0),
            "{m}"
        );
        let count = |decision| {
            metric(
                &m,
                "tollgate_requests_total",
                &[("rule", "per-key"), ("decision", decision)],
            )
            .unwrap_or(0.0)
        };
        allowed += count("allowed");
        rejected += count("rejected");
    }
    // Reports come every 5 s: what the last ones covered, most of the 22 s run.
    assert!(
        allowed > 2000.0 && rejected > 2000.0,
        "allowed {allowed}, rejected {rejected}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envoys_keep_their_assignments_until_the_ttl_then_apply_the_declared_behaviour() {
    let redis = Redis::start();
    let app = Upstream::start().await;
    let service = server(&redis, "Closed", "8s").await;
    let port = service.listen.port();
    // One Envoy configured for a fail-open rule, one for a fail-closed rule.
    let open = envoy(app.addr.port(), &[port], false).await;
    let closed = envoy(app.addr.port(), &[port], true).await;
    let start = Instant::now();
    let until = start + Duration::from_secs(20);
    let a = open_loop(open.url("/"), "k1", 40, start, until);
    let b = open_loop(closed.url("/"), "k1", 40, start, until);
    // Two reports' worth of traffic, then the service is gone for good.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let killed = start.elapsed();
    service.kill_hard();
    let (open, closed) = (a.await.unwrap(), b.await.unwrap());
    // Envoy renews nothing without a stream: the last assignment came at most one report
    // (5 s) before the kill and lasts 8 s. Until 2.5 s after the kill both still hold it
    // (40 a second is well inside it); from 8.5 s on it has expired everywhere.
    let s = Duration::from_secs_f64;
    for (name, events) in [("open", &open), ("closed", &closed)] {
        let held = between(events, s(3.0), killed + s(2.5));
        assert!(
            held.len() > 100 && held.iter().all(|&st| st == 200),
            "{name}: assignment kept: {held:?}"
        );
    }
    let after_open = between(&open, killed + s(8.5), s(20.0));
    let after_closed = between(&closed, killed + s(8.5), s(20.0));
    assert!(
        after_open.len() > 100 && after_open.iter().all(|&st| st == 200),
        "{after_open:?}"
    );
    assert!(
        after_closed.len() > 100 && after_closed.iter().all(|&st| st == 429),
        "{after_closed:?}"
    );
    let expired_at = closed
        .iter()
        .find(|s| s.at > killed && s.status == 429)
        .map(|s| s.at.saturating_sub(killed));
    eprintln!(
        "RLQS server killed: the fail-closed Envoy refused from {expired_at:?} after the kill (TTL 8 s)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_replica_takes_the_streams_over() {
    let redis = Redis::start();
    let app = Upstream::start().await;
    let replicas = [
        server(&redis, "Closed", "10s").await,
        server(&redis, "Closed", "10s").await,
    ];
    let ports: Vec<u16> = replicas.iter().map(|r| r.listen.port()).collect();
    let mut envoys = Vec::new();
    for _ in 0..3 {
        envoys.push(envoy(app.addr.port(), &ports, true).await);
    }
    // 150 a second in all, under the limit of 200: every request is admitted while the
    // streams move.
    let start = Instant::now();
    let until = start + Duration::from_secs(22);
    let runs: Vec<_> = envoys
        .iter()
        .map(|e| open_loop(e.url("/"), "k1", 50, start, until))
        .collect();
    tokio::time::sleep(Duration::from_secs(7)).await;
    let client = client();
    let streams_on = |s: &Sidecar| {
        let (client, admin) = (client.clone(), s.admin);
        async move {
            let text = client
                .get(format!("http://{admin}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            metric(&text, "tollgate_rlqs_streams", &[]).unwrap_or(0.0)
        }
    };
    let before = [
        streams_on(&replicas[0]).await,
        streams_on(&replicas[1]).await,
    ];
    assert_eq!(before[0] + before[1], 3.0, "{before:?}");
    // Stop the replica holding the most streams; the other takes them all.
    let gone = usize::from(before[1] > before[0]);
    let stays = &replicas[1 - gone];
    let killed = start.elapsed();
    replicas[gone].kill_hard();
    poll_until(
        Duration::from_secs(12),
        "the remaining replica holds all 3 streams",
        || async { (streams_on(stays).await == 3.0).then_some(()) },
    )
    .await;
    let moved_after = start.elapsed() - killed;
    // Refusals from 3 s on (the first second is before any assignment), as seconds after the
    // kill.
    let mut refused = Vec::new();
    for r in runs {
        refused.extend(
            r.await
                .unwrap()
                .iter()
                .filter(|s| s.status != 200 && s.at >= Duration::from_secs(3))
                .map(|s| s.at.as_secs_f64() - killed.as_secs_f64()),
        );
    }
    eprintln!(
        "RLQS takeover: {before:?} streams; all on the remaining replica {moved_after:?} after the kill; {} requests refused",
        refused.len()
    );
    assert!(
        refused.is_empty(),
        "the assignments held until the new replica renewed them; refused at {refused:?} s after the kill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_down_a_fail_closed_rule_denies_and_a_fail_open_one_goes_on() {
    let mut redis = Redis::start();
    let app = Upstream::start().await;
    let open = server(&redis, "Open", "10s").await;
    let closed = server(&redis, "Closed", "10s").await;
    let via_open = envoy(app.addr.port(), &[open.listen.port()], false).await;
    let via_closed = envoy(app.addr.port(), &[closed.listen.port()], false).await;
    let start = Instant::now();
    let until = start + Duration::from_secs(20);
    let a = open_loop(via_open.url("/"), "k1", 40, start, until);
    let b = open_loop(via_closed.url("/"), "k1", 40, start, until);
    tokio::time::sleep(Duration::from_secs(7)).await;
    let killed = start.elapsed();
    redis.kill();
    let (open_events, closed_events) = (a.await.unwrap(), b.await.unwrap());
    let s = Duration::from_secs_f64;
    // The next report (within 5 s) after the figures went stale (2 s) is answered by the
    // rule's failure mode.
    let late_open = between(&open_events, killed + s(7.5), s(20.0));
    let late_closed = between(&closed_events, killed + s(7.5), s(20.0));
    assert!(
        late_open.len() > 100 && late_open.iter().all(|&st| st == 200),
        "{late_open:?}"
    );
    assert!(
        late_closed.len() > 100 && late_closed.iter().all(|&st| st == 429),
        "{late_closed:?}"
    );
    let before = between(&closed_events, s(3.0), killed);
    assert!(before.iter().all(|&st| st == 200), "{before:?}");
}

/// A usage report that is not a protobuf message ends the stream with a gRPC error
/// (`INVALID_ARGUMENT`) and a log line, not with status OK and silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_usage_report_ends_the_stream_with_an_error() {
    use http_body_util::BodyExt as _;
    within(60, async {
        let service = Sidecar::start_ratelimit(&roomy_policy(), &[]).await;
        let tcp = tokio::net::TcpStream::connect(service.listen).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        // One gRPC frame (uncompressed, 3 bytes) whose bytes are no protobuf message: field 1,
        // length-delimited, with a length running past the end.
        let frame = bytes::Bytes::from_static(&[0, 0, 0, 0, 3, 0x0a, 0x7f, 0x01]);
        let req = http::Request::post(format!(
            "http://{}/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
            service.listen
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::Full::new(frame))
        .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let (head, body) = resp.into_parts();
        let collected = tokio::time::timeout(Duration::from_secs(10), body.collect())
            .await
            .expect("the stream ends")
            .unwrap();
        let trailers = collected.trailers().cloned().unwrap_or_default();
        let status = head
            .headers
            .get("grpc-status")
            .or_else(|| trailers.get("grpc-status"))
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none")
            .to_string();
        assert_eq!(status, "3", "INVALID_ARGUMENT: {head:?} {trailers:?}");
        let logged = poll_until(Duration::from_secs(5), "the log line", || async {
            service
                .logs()
                .into_iter()
                .find(|l| l.contains("could not be decoded"))
        })
        .await;
        assert!(logged.contains("WARN"), "{logged}");
    })
    .await;
}
