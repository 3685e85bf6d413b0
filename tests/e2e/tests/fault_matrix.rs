//! The fault matrix's controller cells, and the seed's "counter store becomes slow" scenario, on
//! real processes: kube-apiserver + etcd, tollgate-controller, tollgate-sidecar processes for pods
//! that exist as API objects, and redis-server.
//!
//! Each test prints its rows of the table in docs/reliability.md ("FAULT-MATRIX |" lines):
//! `cargo test -p tollgate-e2e --test fault_matrix -- --nocapture --test-threads 1`
//! (after `cargo build -p tollgate-sidecar -p tollgate-controller`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tollgate_e2e::{
    ControlPlane, Proc, Redis, Sidecar, app, free_port, install_crd_and_shop, pod_with_token,
    serial, start_controller, wait,
};

const POLICY: &str = "shop/matrix";
/// Both global rules: `LIMIT` per second, burst `BURST`, shared by the sidecars.
const LIMIT: f64 = 60.0;
const BURST: f64 = 30.0;
/// Offered load per rule: twice the limit, so the bucket stays drained.
const OFFERED: f64 = 120.0;
/// No request may take this long (a hung one would take the client's 5 s timeout).
const HANG: Duration = Duration::from_secs(1);
const SLACK: f64 = 5.0;

// ---------------------------------------------------------------------------------------------
// Processes

/// A TCP relay on loopback that delays every chunk by `delay_ms` (changeable while running), in
/// both directions: a slow counter store without touching Redis. Stops accepting when dropped.
struct Relay {
    port: u16,
    delay_ms: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Relay {
    fn start(target: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (delay, stopping) = (delay_ms.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                let Ok((inbound, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let _ = inbound.set_nonblocking(false);
                let Ok(outbound) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                for s in [&inbound, &outbound] {
                    let _ = s.set_nodelay(true);
                }
                let (i2, o2) = (inbound.try_clone().unwrap(), outbound.try_clone().unwrap());
                pump(inbound, outbound, delay.clone(), stopping.clone());
                pump(o2, i2, delay.clone(), stopping.clone());
            }
        });
        Relay {
            port,
            delay_ms,
            stop,
        }
    }

    fn set_delay(&self, ms: u64) {
        self.delay_ms.store(ms, Ordering::Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Copies `from` to `to`, each chunk written `delay_ms` after it was read (order kept).
fn pump(mut from: TcpStream, mut to: TcpStream, delay_ms: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        for (due, data) in rx {
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            if to.write_all(&data).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 || stop.load(Ordering::Relaxed) {
                break;
            }
            let due = Instant::now() + Duration::from_millis(delay_ms.load(Ordering::Relaxed));
            if tx.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    });
}

/// Whether a child process is still running (not exited, not a zombie).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().chars().next())
        })
        .flatten()
        .is_some_and(|state| state != 'Z' && state != 'X')
}

/// The text of a sidecar's `/metrics`, empty if it does not answer.
fn metrics(client: &reqwest::blocking::Client, s: &Sidecar) -> String {
    client
        .get(format!("http://127.0.0.1:{}/metrics", s.admin))
        .send()
        .and_then(|r| r.text())
        .unwrap_or_default()
}

/// Sum of the samples of `name` whose label set contains every `k="v"` in `labels`.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut total = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (n, label_text) = series.split_once('{').unwrap_or((series, ""));
        if n != name
            || !labels
                .iter()
                .all(|(k, v)| label_text.contains(&format!("{k}=\"{v}\"")))
        {
            continue;
        }
        if let Ok(v) = value.parse::<f64>() {
            total = Some(total.unwrap_or(0.0) + v);
        }
    }
    total
}

/// A control plane with the CRD, namespace `shop`, a controller and `n` sidecars for pods
/// p0..pN (API objects with bound tokens), all with `sidecar_args` (Redis flags).
struct Cluster {
    cp: ControlPlane,
    client: reqwest::blocking::Client,
    controller_port: u16,
    controller: Option<Proc>,
    sidecars: Vec<Sidecar>,
    /// `namespace/name` of the policy, as in `tollgate_live_sidecars{policy}`.
    policy_id: &'static str,
    _tokens: tempfile::TempDir,
}

impl Cluster {
    fn start(n: usize, policy: &str, policy_id: &'static str, sidecar_args: &[String]) -> Cluster {
        let cp = ControlPlane::start();
        install_crd_and_shop(&cp);
        cp.apply(policy).expect("apply policy");
        let mut c = Cluster {
            cp,
            client: tollgate_e2e::http_client()
                .timeout(Duration::from_secs(5))
                .no_proxy()
                .build()
                .unwrap(),
            controller_port: free_port(),
            controller: None,
            sidecars: Vec::new(),
            policy_id,
            _tokens: tempfile::tempdir().unwrap(),
        };
        c.start_controller("ctrl-1");
        let app_port = app();
        for i in 0..n {
            c.sidecar(i, app_port, sidecar_args);
        }
        for s in &c.sidecars {
            s.wait_ready("sidecar ready", Duration::from_secs(30));
        }
        c.wait_members(n, Duration::from_secs(30));
        c
    }

    /// Starts the controller under `identity` (a replacement pod gets a new name).
    fn start_controller(&mut self, identity: &str) {
        self.controller = Some(start_controller(
            &self.cp,
            &format!("tollgate-controller {identity}"),
            self.controller_port,
            &["--identity", identity, "--heartbeat-interval", "1s"],
        ));
    }

    fn sidecar(&mut self, i: usize, app_port: u16, extra: &[String]) {
        let name = format!("p{i}");
        let token = pod_with_token(&self.cp, &name, self._tokens.path());
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        self.sidecars.push(Sidecar::for_pod(
            &name,
            app_port,
            self.controller_port,
            &token,
            &extra,
        ));
    }

    /// Sum of a metric over the sidecars.
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.sidecars
            .iter()
            .map(|s| metric(&metrics(&self.client, s), name, labels).unwrap_or(0.0))
            .sum()
    }

    /// Each sidecar's value of a metric.
    fn each(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.sidecars
            .iter()
            .map(|s| metric(&metrics(&self.client, s), name, labels).unwrap_or(-1.0))
            .collect()
    }

    fn wait_members(&self, n: usize, timeout: Duration) -> Duration {
        wait(&format!("every sidecar to count {n}"), timeout, || {
            self.each("tollgate_live_sidecars", &[("policy", self.policy_id)])
                .iter()
                .all(|m| *m == n as f64)
        })
    }

    /// No process died or panicked.
    fn assert_healthy(&self) {
        for s in &self.sidecars {
            assert!(alive(s.proc.pid), "sidecar {} died", s.proc.pid);
            let logs = s.proc.logs();
            assert!(
                !logs.iter().any(|l| l.contains("panicked")),
                "sidecar {} panicked:\n{}",
                s.proc.pid,
                logs.join("\n")
            );
        }
        if let Some(c) = &self.controller {
            assert!(alive(c.pid), "the controller died");
            assert!(
                !c.logs().iter().any(|l| l.contains("panicked")),
                "the controller panicked"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Paced load

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Open,
    Closed,
}

impl Mode {
    fn path(self) -> &'static str {
        match self {
            Mode::Open => "/open",
            Mode::Closed => "/closed",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Open => "Open",
            Mode::Closed => "Closed",
        }
    }
}

#[derive(Clone, Debug)]
struct Sample {
    at: Duration,
    mode: Mode,
    cold: bool,
    status: u16,
    latency: Duration,
    well_formed: bool,
}

/// One paced thread per (stream, sidecar): `rps` per stream spread evenly over the sidecars.
struct Load {
    t0: Instant,
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    /// `streams`: (mode, cold keys?, hot key name, requests per second).
    fn start(ports: &[u16], streams: &[(Mode, bool, &'static str, f64)]) -> Load {
        let t0 = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for (si, &(mode, cold, hot_key, rps)) in streams.iter().enumerate() {
            for (pi, &port) in ports.iter().enumerate() {
                let (stop, samples) = (stop.clone(), samples.clone());
                let gap = Duration::from_secs_f64(ports.len() as f64 / rps);
                // Stagger the threads so their requests interleave.
                let offset = gap.mul_f64(pi as f64 / ports.len() as f64);
                threads.push(std::thread::spawn(move || {
                    let client = tollgate_e2e::http_client()
                        .timeout(Duration::from_secs(5))
                        .no_proxy()
                        .build()
                        .unwrap();
                    let start = t0 + offset;
                    let mut n = 0u32;
                    while !stop.load(Ordering::Relaxed) {
                        let due = start + gap * n;
                        if let Some(w) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(w);
                        }
                        let key = if cold {
                            format!("cold-{si}-{pi}-{n}")
                        } else {
                            hot_key.to_string()
                        };
                        n += 1;
                        let at = t0.elapsed();
                        let sent = Instant::now();
                        let resp = client
                            .get(format!("http://127.0.0.1:{port}{}", mode.path()))
                            .header("x-api-key", key)
                            .send();
                        let (status, well_formed) = match resp {
                            Ok(r) => {
                                let h = |n: &str| {
                                    r.headers()
                                        .get(n)
                                        .and_then(|v| v.to_str().ok())
                                        .unwrap_or("")
                                        .to_string()
                                };
                                let status = r.status().as_u16();
                                let ok = match status {
                                    503 => {
                                        h("content-type") == "application/problem+json"
                                            && h("retry-after")
                                                .parse::<u64>()
                                                .is_ok_and(|s| (1..=3).contains(&s))
                                    }
                                    429 => {
                                        h("content-type") == "application/problem+json"
                                            && h("retry-after").parse::<u64>().is_ok_and(|s| s >= 1)
                                    }
                                    _ => true,
                                };
                                let _ = r.bytes();
                                (status, ok)
                            }
                            Err(_) => (0, false),
                        };
                        samples.lock().unwrap().push(Sample {
                            at,
                            mode,
                            cold,
                            status,
                            latency: sent.elapsed(),
                            well_formed,
                        });
                    }
                }));
            }
        }
        Load {
            t0,
            stop,
            samples,
            threads,
        }
    }

    fn now(&self) -> Duration {
        self.t0.elapsed()
    }

    fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().expect("load thread");
        }
        let mut s = std::mem::take(&mut *self.samples.lock().unwrap());
        s.sort_by_key(|s| s.at);
        s
    }
}

struct View<'a> {
    samples: Vec<&'a Sample>,
}

impl<'a> View<'a> {
    fn of(all: &'a [Sample], mode: Mode, cold: bool) -> View<'a> {
        View {
            samples: all
                .iter()
                .filter(|s| s.mode == mode && s.cold == cold)
                .collect(),
        }
    }

    fn between(&self, from: Duration, to: Duration) -> View<'a> {
        View {
            samples: self
                .samples
                .iter()
                .copied()
                .filter(|s| s.at >= from && s.at < to)
                .collect(),
        }
    }

    fn count(&self, status: u16) -> u64 {
        self.samples.iter().filter(|s| s.status == status).count() as u64
    }

    fn len(&self) -> u64 {
        self.samples.len() as u64
    }

    fn span(&self) -> f64 {
        match (self.samples.first(), self.samples.last()) {
            (Some(a), Some(b)) => (b.at - a.at).as_secs_f64(),
            _ => 0.0,
        }
    }

    fn max_latency(&self) -> Duration {
        self.samples
            .iter()
            .map(|s| s.latency)
            .max()
            .unwrap_or_default()
    }

    fn pctl(&self, status: u16, q: f64) -> Duration {
        let mut v: Vec<Duration> = self
            .samples
            .iter()
            .filter(|s| s.status == status)
            .map(|s| s.latency)
            .collect();
        v.sort();
        v.get(((v.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or_default()
    }

    fn others(&self, allowed: &[u16]) -> Vec<u16> {
        self.samples
            .iter()
            .map(|s| s.status)
            .filter(|s| !allowed.contains(s))
            .collect()
    }
}

/// Nothing hung, nothing failed at the transport level, 429/503 carry the documented headers.
fn assert_common(all: &[Sample]) {
    for s in all {
        assert!(s.latency < HANG, "request hung: {s:?}");
        assert_ne!(s.status, 0, "transport error: {s:?}");
        assert!(
            s.well_formed,
            "429/503 without the documented headers: {s:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Controller killed / restarted

fn matrix_policy() -> String {
    format!(
        r#"apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {{name: matrix, namespace: shop}}
spec:
  targetRef:
    selector: {{matchLabels: {{app: shop-api}}}}
  rules:
  - name: open
    match: {{path: {{prefix: /open}}}}
    key: [{{header: x-api-key}}]
    limit: {{requests: {LIMIT}, period: 1s, burst: {BURST}}}
    failureMode: Open
  - name: closed
    match: {{path: {{prefix: /closed}}}}
    key: [{{header: x-api-key}}]
    limit: {{requests: {LIMIT}, period: 1s, burst: {BURST}}}
    failureMode: Closed
"#
    )
}

/// The controller is SIGKILLed under load, stays down 4 s, and a replacement (new identity, as
/// a Deployment's new pod would have) starts. Redis stays up: the failure modes must not show;
/// sidecars keep enforcing the last rules and member counts, then reconnect on their own.
#[test]
fn controller_killed_and_restarted() {
    let _serial = serial();
    let redis = Redis::start();
    let redis_port = redis.port;
    let args: Vec<String> = [
        "--redis",
        &format!("redis://127.0.0.1:{redis_port}"),
        "--redis-timeout",
        "200ms",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut cluster = Cluster::start(3, &matrix_policy(), POLICY, &args);
    let ports: Vec<u16> = cluster.sidecars.iter().map(|s| s.listen).collect();
    let load = Load::start(
        &ports,
        &[
            (Mode::Open, false, "hot-open", OFFERED),
            (Mode::Closed, false, "hot-closed", OFFERED),
        ],
    );
    std::thread::sleep(Duration::from_secs(3));
    let fallback0 = cluster.sum("tollgate_fallback_admitted_total", &[]);

    // Kill: the streams break, sidecars notice at once and enforce what they have.
    let killed_at = load.now();
    drop(cluster.controller.take()); // SIGKILL, by PID
    let noticed = wait(
        "sidecars to notice the controller is gone",
        Duration::from_secs(10),
        || {
            cluster
                .each("tollgate_controller_connected", &[])
                .iter()
                .all(|c| *c == 0.0)
        },
    );
    std::thread::sleep(Duration::from_secs(4).saturating_sub(noticed));
    let members_during = cluster.each("tollgate_live_sidecars", &[("policy", POLICY)]);

    // A replacement starts; sidecars reconnect with jittered backoff and resume.
    let restart_at = load.now();
    let t0 = Instant::now();
    cluster.start_controller("ctrl-2");
    wait(
        "every sidecar back on the rule stream",
        Duration::from_secs(30),
        || {
            cluster
                .each("tollgate_controller_connected", &[])
                .iter()
                .all(|c| *c == 1.0)
        },
    );
    let reconnect = t0.elapsed();
    // The stream works again end to end: an edit reaches every sidecar.
    cluster
        .cp
        .apply(&format!(
            "{}  - name: marker\n    match: {{path: {{prefix: /marker}}}}\n    scope: Local\n    limit: {{requests: 7, period: 1s}}\n",
            matrix_policy()
        ))
        .expect("edit policy");
    for s in &cluster.sidecars {
        wait(
            "the edit to reach a sidecar",
            Duration::from_secs(10),
            || {
                cluster
                    .client
                    .get(format!("http://127.0.0.1:{}/debug/rules", s.admin))
                    .send()
                    .and_then(|r| r.text())
                    .is_ok_and(|t| t.contains("marker"))
            },
        );
    }
    let recovery = t0.elapsed();
    // Member counts after the restart (sampled for 2 s), then a little more load.
    let members_after: Vec<f64> = (0..10)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(200));
            cluster
                .each("tollgate_live_sidecars", &[("policy", POLICY)])
                .into_iter()
                .fold(0.0, f64::max)
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let fallback = cluster.sum("tollgate_fallback_admitted_total", &[]) - fallback0;
    let samples = load.finish();

    let max_members_after = members_after.iter().copied().fold(0.0, f64::max);
    let mut checks = Vec::new();
    for mode in [Mode::Open, Mode::Closed] {
        let v = View::of(&samples, mode, false);
        let down = v.between(killed_at, restart_at);
        let after = v.between(restart_at, Duration::MAX);
        for (fault, w, recovery_txt, observed) in [
            (
                "controller killed (4 s)",
                &down,
                format!(
                    "not needed (enforcement never stopped); sidecars noticed in {} ms",
                    noticed.as_millis()
                ),
                format!(
                    "last rules and member counts kept ({members_during:?}); {} × 503; fallback {fallback:.0} (Redis up)",
                    down.count(503)
                ),
            ),
            (
                "controller restarted (new identity)",
                &after,
                format!(
                    "all sidecars reconnected {} ms after start, an edit enforced by all after {} ms",
                    reconnect.as_millis(),
                    recovery.as_millis()
                ),
                format!(
                    "highest member count seen after: {max_members_after} (a dead replica's report may count until its Lease expires); {} × 503",
                    after.count(503)
                ),
            ),
        ] {
            // The bucket is drained when the window starts: exact = limit × span, plus at most
            // one lease batch per sidecar parked at the window's start.
            let (admitted, exact) = (w.count(200) as f64, LIMIT * w.span());
            eprintln!(
                "FAULT-MATRIX | {fault} | {} | {admitted} / {exact:.0} in {:.1} s | {:+.1} % | {} | {} / {} | {} ms | {recovery_txt} | {observed} |",
                mode.name(),
                w.span(),
                (admitted - exact) / exact * 100.0,
                if mode == Mode::Open {
                    format!("{fallback:.0}")
                } else {
                    "–".into()
                },
                w.count(429),
                w.count(503),
                w.max_latency().as_millis(),
            );
            checks.push((fault, mode, admitted, exact, w.others(&[200, 429])));
        }
    }
    cluster.assert_healthy();
    assert_common(&samples);
    for (fault, mode, admitted, exact, others) in checks {
        assert!(
            others.is_empty(),
            "{fault}, {mode:?}: Redis was up, yet {others:?}"
        );
        assert!(
            admitted <= exact + BURST + SLACK,
            "{fault}, {mode:?}: over-admitted {admitted} > {exact:.0} + one batch per sidecar"
        );
        assert!(
            admitted >= exact * 0.85,
            "{fault}, {mode:?}: enforcement stalled: {admitted} < {exact:.0}"
        );
    }
    assert_eq!(fallback, 0.0, "Redis was up: no fallback admissions");
    assert!(
        members_during.iter().all(|m| *m == 3.0),
        "member counts must be kept while the controller is down: {members_during:?}"
    );
    assert!(
        reconnect < Duration::from_secs(15),
        "sidecars took {reconnect:?} to reconnect"
    );
    // Whole run: the limit held throughout.
    for mode in [Mode::Open, Mode::Closed] {
        let v = View::of(&samples, mode, false);
        let (admitted, exact) = (v.count(200) as f64, LIMIT * v.span() + BURST);
        eprintln!(
            "whole run, {mode:?}: admitted {admitted} of exact {exact:.0} ({:+.1} %)",
            (admitted - exact) / exact * 100.0
        );
        assert!(
            admitted <= exact * 1.02 + SLACK,
            "{mode:?}: over-admitted over the run"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The seed's scenario (b): the counter store becomes slow

/// Policy of the slow-store scenario: limits far above the load (nobody is over quota, as in
/// the seed), one rule per failure mode.
fn generous_policy() -> String {
    matrix_policy()
        .replace("name: matrix", "name: slow-store")
        .replace(
            &format!("limit: {{requests: {LIMIT}, period: 1s, burst: {BURST}}}"),
            "limit: {requests: 1000, period: 1s}",
        )
}

/// "From t = 1.5 s to 2.3 s every limiter check takes 50× longer" (seed 002), scaled: every
/// Redis round trip gets +50 ms (a delaying relay, 25 ms each way) for 3 s while hot keys (one
/// API key per rule, within quota) and a trickle of first-time keys keep arriving. The sidecars
/// run with a tight `--redis-timeout` (5 ms, the default before it became 100 ms). Expected: hot keys keep their latency
/// (they hold leases the background sync keeps topped up); cold keys fail per their mode after
/// the timeout instead of waiting for Redis; everything recovers on its own.
#[test]
fn seed_scenario_slow_counter_store() {
    let _serial = serial();
    let redis = Redis::start();
    let redis_port = redis.port;
    let relay = Relay::start(redis_port);
    let args = vec![
        "--redis".to_string(),
        format!("redis://127.0.0.1:{}", relay.port),
        "--redis-timeout".to_string(),
        "5ms".to_string(),
    ];
    let cluster = Cluster::start(2, &generous_policy(), "shop/slow-store", &args);
    let ports: Vec<u16> = cluster.sidecars.iter().map(|s| s.listen).collect();
    // Warm the hot keys: their first request is a cold one (and may meet the 5 ms timeout on a
    // busy machine), and a key seen once holds no lease (it costs one call, not a lease that
    // goes back), so each gets a few requests over more than a sync interval: recurring demand,
    // which the next sync leases. The rounds go over every sidecar and key together, right
    // before the load: a key warmed first and then left idle for two sync intervals while the
    // others warmed was dropped, and met the load cold.
    let pairs: Vec<(u16, &str, &str)> = ports
        .iter()
        .flat_map(|&port| [(port, "/open", "hot-open"), (port, "/closed", "hot-closed")])
        .collect();
    let get = |&(port, path, key): &(u16, &str, &str)| {
        cluster
            .client
            .get(format!("http://127.0.0.1:{port}{path}"))
            .header("x-api-key", key)
            .send()
    };
    for pair in &pairs {
        wait("the hot key's first lease", Duration::from_secs(10), || {
            get(pair).is_ok_and(|r| r.status() == 200)
        });
    }
    for _ in 0..15 {
        std::thread::sleep(Duration::from_millis(25));
        for pair in &pairs {
            let _ = get(pair);
        }
    }
    let load = Load::start(
        &ports,
        &[
            (Mode::Open, false, "hot-open", 60.0),
            (Mode::Closed, false, "hot-closed", 60.0),
            (Mode::Open, true, "", 10.0),
            (Mode::Closed, true, "", 10.0),
        ],
    );
    std::thread::sleep(Duration::from_secs(3));
    // The no-fault Redis round trip as the sidecars measured it (request-path lease calls).
    let rtt = |c: &Cluster| {
        (
            c.sum("tollgate_lease_duration_seconds_sum", &[]),
            c.sum("tollgate_lease_duration_seconds_count", &[]),
        )
    };
    let (rtt_sum, rtt_count) = rtt(&cluster);
    let base_rtt_ms = rtt_sum / rtt_count.max(1.0) * 1e3;
    let fallback0 = cluster.sum("tollgate_fallback_admitted_total", &[]);
    let calls0 = cluster.sum("tollgate_lease_calls_total", &[]);
    let slow_at = load.now();
    relay.set_delay(25);
    std::thread::sleep(Duration::from_secs(3));
    let fast_at = load.now();
    let calls_slow = cluster.sum("tollgate_lease_calls_total", &[]) - calls0;
    let fallback_slow = cluster.sum("tollgate_fallback_admitted_total", &[]) - fallback0;
    relay.set_delay(0);
    // Recovery: a first-time key on the fail-closed rule is admitted again by every sidecar.
    let mut probe = 0;
    let recovery = wait("cold keys back on leases", Duration::from_secs(10), || {
        probe += 1;
        cluster.sidecars.iter().all(|s| {
            cluster
                .client
                .get(format!("http://127.0.0.1:{}/closed", s.listen))
                .header("x-api-key", format!("probe-{probe}"))
                .send()
                .is_ok_and(|r| r.status() == 200)
        })
    });
    let recovered_at = load.now();
    std::thread::sleep(Duration::from_secs(2));
    let samples = load.finish();

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut checks = Vec::new();
    for mode in [Mode::Open, Mode::Closed] {
        let hot = View::of(&samples, mode, false);
        let cold = View::of(&samples, mode, true);
        let (hot_base, hot_slow) = (
            hot.between(Duration::ZERO, slow_at),
            hot.between(slow_at, fast_at),
        );
        // Requests sent within the first delayed round trip may still have met the old latency.
        let cold_base = cold.between(Duration::ZERO, slow_at);
        let cold_slow = cold.between(slow_at + Duration::from_millis(60), fast_at);
        let cold_after = cold.between(recovered_at + Duration::from_millis(500), Duration::MAX);
        let fail = if mode == Mode::Open { 200 } else { 503 };
        let (b50, b99, s50, s99) = (
            hot_base.pctl(200, 0.5),
            hot_base.pctl(200, 0.99),
            hot_slow.pctl(200, 0.5),
            hot_slow.pctl(200, 0.99),
        );
        let cold_lat = |v: &View| {
            let mut l: Vec<Duration> = v.samples.iter().map(|s| s.latency).collect();
            l.sort();
            (
                l.get(l.len() / 2).copied().unwrap_or_default(),
                l.last().copied().unwrap_or_default(),
            )
        };
        let (c50, cmax) = cold_lat(&cold_slow);
        eprintln!(
            "SLOW-STORE | {} | hot key admitted p50 {:.2} ms → {:.2} ms ({:.2}×), p99 {:.2} ms → {:.2} ms ({:.2}×); {} of {} hot requests 200 while slow | cold keys while slow: {} of {} answered {fail} by the failure mode, p50 {:.1} ms, max {:.1} ms (before: {} of {} admitted on leases) | after: {} of {} cold keys on leases, recovered {} ms after the delay ended |",
            mode.name(),
            ms(b50),
            ms(s50),
            s50.as_secs_f64() / b50.as_secs_f64(),
            ms(b99),
            ms(s99),
            s99.as_secs_f64() / b99.as_secs_f64(),
            hot_slow.count(200),
            hot_slow.len(),
            cold_slow.count(fail),
            cold_slow.len(),
            ms(c50),
            ms(cmax),
            cold_base.count(200),
            cold_base.len(),
            cold_after.count(200),
            cold_after.len(),
            recovery.as_millis(),
        );
        // Where a hot request was not admitted, relative to the slow window, for the message.
        let hot_failures: Vec<String> = hot
            .samples
            .iter()
            .filter(|s| s.status != 200)
            .map(|s| {
                let at = s.at.as_secs_f64();
                format!(
                    "{} at {at:.3}s (slow {:.3}..{:.3}s, latency {:?})",
                    s.status,
                    slow_at.as_secs_f64(),
                    fast_at.as_secs_f64(),
                    s.latency
                )
            })
            .collect();
        checks.push((
            mode,
            hot_failures,
            (b50, b99, s50, s99),
            (cold_slow.count(fail), cold_slow.len(), c50),
            cold.others(&[200, fail]),
            (cold_after.count(200), cold_after.len()),
        ));
    }
    let cold_open_slow = View::of(&samples, Mode::Open, true)
        .between(slow_at, fast_at)
        .count(200) as f64;
    let cold_slow_all = View::of(&samples, Mode::Open, true)
        .between(slow_at, fast_at)
        .len()
        + View::of(&samples, Mode::Closed, true)
            .between(slow_at, fast_at)
            .len();
    eprintln!(
        "SLOW-STORE | Redis round trip {base_rtt_ms:.2} ms before, +50 ms while slow (≈{:.0}× slower); request-path Redis calls while slow: {calls_slow:.0} for {cold_slow_all} cold requests; fallback admissions {fallback_slow:.0} |",
        (base_rtt_ms + 50.0) / base_rtt_ms
    );
    cluster.assert_healthy();
    assert_common(&samples);
    for (
        mode,
        hot_others,
        (b50, b99, s50, s99),
        (failed, cold_n, c50),
        cold_others,
        (after_ok, after_n),
    ) in checks
    {
        // Hot keys hold leases: within quota they are admitted throughout and do not wait.
        assert!(
            hot_others.is_empty(),
            "{mode:?}: hot keys within quota must always be admitted: {hot_others:?}"
        );
        assert!(
            s50 < b50 * 2 + Duration::from_millis(5),
            "{mode:?}: hot-key p50 {s50:?} while slow vs {b50:?}: hot keys waited on Redis"
        );
        assert!(
            // p99 on a shared 2-core machine is noisy; waiting on the slow store would add 50 ms.
            s99 < b99 * 3 + Duration::from_millis(50),
            "{mode:?}: hot-key p99 {s99:?} while slow vs {b99:?}: hot keys waited on Redis"
        );
        // Cold keys: the failure mode after the tight timeout, never the 50 ms round trip.
        assert!(
            cold_n >= 20,
            "{mode:?}: too few cold requests ({cold_n}) to judge"
        );
        assert_eq!(
            failed, cold_n,
            "{mode:?}: every cold key must follow the failure mode while Redis is slow"
        );
        assert!(
            c50 < Duration::from_millis(25),
            "{mode:?}: cold keys waited for Redis (p50 {c50:?})"
        );
        assert!(cold_others.is_empty(), "{mode:?}: {cold_others:?}");
        assert!(
            after_ok as f64 >= 0.8 * after_n as f64,
            "{mode:?}: cold keys not back on leases: {after_ok} of {after_n}"
        );
    }
    // Hot keys made (almost) no request-path calls: those went to cold keys.
    assert!(
        calls_slow <= cold_slow_all as f64 + 3.0,
        "{calls_slow} request-path Redis calls for {cold_slow_all} cold requests: hot keys waited on Redis"
    );
    // Fail-open cold admissions are reported; hot keys did not fall back.
    assert!(fallback_slow >= cold_open_slow * 0.9);
    assert!(
        fallback_slow <= cold_open_slow + 3.0,
        "fallback admitted {fallback_slow} while only {cold_open_slow} cold fail-open requests were admitted"
    );
    assert!(
        recovery < Duration::from_secs(3),
        "recovery took {recovery:?}"
    );
}
