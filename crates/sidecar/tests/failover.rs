//! Redis failover under load, with real parts: a master, a replica and three `redis-sentinel`
//! processes (the sidecars find the master with `--redis-sentinel`), and a Redis Cluster of
//! three masters with a replica each. In both, the master holding the buckets is killed with
//! SIGKILL while three sidecars serve a fail-open and a fail-closed rule.
//!
//! Reported and checked: no request hangs; each rule keeps its failure mode during the switch
//! (fail-open never answers 503, fail-closed answers 503 rather than admitting unchecked);
//! after the switch both rules admit their limit again; and the recovery time.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

mod common;

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use tollgate_testkit::Sentinel;

/// One test at a time: they kill Redis processes and count rates.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Two global token buckets of 200/s (burst 20), one per failure mode.
const RULES: &str = "\
rules:
  - name: open
    match: {path: {prefix: /open}}
    key: [{header: x-api-key}]
    limit: {requests: 200, period: 1s, burst: 20}
    failureMode: Open
  - name: closed
    match: {path: {prefix: /closed}}
    key: [{header: x-api-key}]
    limit: {requests: 200, period: 1s, burst: 20}
    failureMode: Closed
";
const RATE: f64 = 200.0;

/// A request longer than this is hung: the request timeout is 50 ms, a sync round 100 ms.
const HUNG: Duration = Duration::from_secs(1);

/// One answered (or failed) request: when it was sent (since the start), how long it took,
/// its path and status (0: no answer).
#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Duration,
    took: Duration,
    closed: bool,
    status: u16,
}

/// Closed-loop clients on both rules of every sidecar until `stop` is set.
struct Load {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    t0: Instant,
}

impl Load {
    fn start(sidecars: &[Sidecar]) -> Load {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for s in sidecars {
            for closed in [false, true] {
                let url = s.url(if closed { "/closed" } else { "/open" });
                let (samples, stop) = (Arc::clone(&samples), Arc::clone(&stop));
                tasks.push(tokio::spawn(async move {
                    let c = client_builder()
                        .timeout(Duration::from_secs(5))
                        .build()
                        .expect("client");
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let sent = Instant::now();
                        let status = match c.get(&url).header("x-api-key", "k").send().await {
                            Ok(r) => r.status().as_u16(),
                            Err(_) => 0,
                        };
                        let sample = Sample {
                            at: sent - t0,
                            took: sent.elapsed(),
                            closed,
                            status,
                        };
                        samples.lock().expect("samples").push(sample);
                    }
                }));
            }
        }
        Load {
            samples,
            stop,
            tasks,
            t0,
        }
    }

    fn now(&self) -> Duration {
        self.t0.elapsed()
    }

    async fn stop(self) -> Vec<Sample> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("load task");
        }
        self.samples.lock().expect("samples").clone()
    }
}

/// What the run showed around the kill at `killed` (since the start of the load).
struct Report {
    hung: usize,
    open_503: usize,
    closed_503: usize,
    odd_statuses: Vec<u16>,
    /// From the kill to the last 503 of the fail-closed rule.
    recovery: Duration,
    /// Admitted per rule during the switch (kill to recovery + 1 s) and what the limit allowed
    /// in that time (the burst plus the refill).
    switch_admitted: [u64; 2],
    switch_allowed: f64,
    /// Admitted per rule from one second after recovery to the end, and the limit's refill.
    after_admitted: [u64; 2],
    after_allowed: f64,
}

fn report(samples: &[Sample], killed: Duration, end: Duration) -> Report {
    let hung = samples
        .iter()
        .filter(|s| s.status == 0 || s.took > HUNG)
        .count();
    let last_503 = samples
        .iter()
        .filter(|s| s.closed && s.status == 503 && s.at >= killed)
        .map(|s| s.at + s.took)
        .max()
        .unwrap_or(killed);
    let recovery = last_503.saturating_sub(killed);
    let switch_end = last_503 + Duration::from_secs(1);
    let admitted_in = |from: Duration, to: Duration, closed: bool| {
        samples
            .iter()
            .filter(|s| s.closed == closed && s.status == 200 && s.at >= from && s.at < to)
            .count() as u64
    };
    let mut odd: Vec<u16> = samples
        .iter()
        .map(|s| s.status)
        .filter(|s| ![200, 429, 503].contains(s))
        .collect();
    odd.dedup();
    Report {
        hung,
        open_503: samples
            .iter()
            .filter(|s| !s.closed && s.status == 503)
            .count(),
        closed_503: samples
            .iter()
            .filter(|s| s.closed && s.status == 503)
            .count(),
        odd_statuses: odd,
        recovery,
        switch_admitted: [
            admitted_in(killed, switch_end, false),
            admitted_in(killed, switch_end, true),
        ],
        switch_allowed: 20.0 + RATE * (switch_end - killed).as_secs_f64(),
        after_admitted: [
            admitted_in(switch_end, end, false),
            admitted_in(switch_end, end, true),
        ],
        after_allowed: RATE * end.saturating_sub(switch_end).as_secs_f64(),
    }
}

impl Report {
    fn print(&self, what: &str) {
        eprintln!(
            "{what}: hung {}, 503s open {} closed {}, recovery {:.2}s after the kill; \
             during the switch admitted open {} closed {} of {:.0} allowed; \
             after it open {} closed {} of {:.0}",
            self.hung,
            self.open_503,
            self.closed_503,
            self.recovery.as_secs_f64(),
            self.switch_admitted[0],
            self.switch_admitted[1],
            self.switch_allowed,
            self.after_admitted[0],
            self.after_admitted[1],
            self.after_allowed,
        );
    }

    fn assert_sound(&self, what: &str) {
        assert_eq!(self.hung, 0, "{what}: requests hung or failed");
        assert!(
            self.odd_statuses.is_empty(),
            "{what}: statuses {:?}",
            self.odd_statuses
        );
        assert_eq!(self.open_503, 0, "{what}: the fail-open rule answered 503");
        assert!(
            self.closed_503 > 0,
            "{what}: the fail-closed rule never saw the outage"
        );
        assert!(
            self.recovery < Duration::from_secs(15),
            "{what}: no recovery"
        );
        // Fail-closed admits only what Redis granted: at most the limit over the switch, plus
        // writes the dead master acknowledged but never replicated (one sync round of
        // grants, documented).
        let lost_writes = RATE * 0.5;
        assert!(
            self.switch_admitted[1] as f64 <= self.switch_allowed * 1.05 + lost_writes,
            "{what}: fail-closed over-admitted during the switch"
        );
        for (rule, admitted) in ["open", "closed"].iter().zip(self.after_admitted) {
            let ratio = admitted as f64 / self.after_allowed;
            assert!(
                (0.9..=1.05).contains(&ratio)
                    || admitted as f64 <= self.after_allowed + 60.0 && ratio >= 0.9,
                "{what}: {rule} admitted {admitted} of {:.0} after the switch",
                self.after_allowed
            );
        }
    }
}

async fn start_sidecars(redis_args: &[&str]) -> (Upstream, Vec<Sidecar>) {
    let upstream = Upstream::start().await;
    let p = policy("failover", RULES);
    let mut args = redis_args.to_vec();
    args.extend_from_slice(&["--redis-timeout", "50ms", "--membership-ttl", "3s"]);
    let mut sidecars = Vec::new();
    for _ in 0..3 {
        sidecars.push(Sidecar::start(&upstream.url(), &p, &args).await);
    }
    for s in &sidecars {
        s.wait_members("test/failover", 3, Duration::from_secs(20))
            .await;
    }
    (upstream, sidecars)
}

/// Waits until `check` holds, polling every 50 ms, for at most `timeout`.
fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_under_load_keeps_failure_modes_and_recovers() {
    within(120, async {
        let _serial = SERIAL.lock().await;
        let mut master = Redis::start();
        let replica = Redis::start_on(
            free_port(),
            &["--replicaof", "127.0.0.1", &master.port.to_string()],
        );
        wait_for("the replica to sync", Duration::from_secs(10), || {
            replica.cli(&["INFO", "replication"]).contains("master_link_status:up")
        });
        let sentinels: Vec<Sentinel> = (0..3)
            .map(|_| Sentinel::start("tg", master.port, 2, Duration::from_millis(1000)))
            .collect();
        wait_for("the sentinels to find each other", Duration::from_secs(20), || {
            sentinels.iter().all(|s| {
                s.cli(&["SENTINEL", "sentinels", "tg"]).matches("runid").count() >= 2
            })
        });
        let urls: Vec<String> = sentinels.iter().map(Sentinel::url).collect();
        let urls = urls.join(",");
        let (_upstream, sidecars) =
            start_sidecars(&["--redis", &urls, "--redis-sentinel", "tg"]).await;

        let load = Load::start(&sidecars);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let killed = load.now();
        master.kill();
        let promoted = tokio::task::spawn_blocking({
            let ports: Vec<u16> = sentinels.iter().map(|s| s.port).collect();
            let old = master.port;
            move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let out = Command::new("redis-cli")
                        .args(["-p", &ports[0].to_string(), "SENTINEL", "get-master-addr-by-name", "tg"])
                        .output()
                        .expect("redis-cli");
                    let text = String::from_utf8_lossy(&out.stdout).into_owned();
                    if text.lines().nth(1).and_then(|p| p.trim().parse::<u16>().ok()).is_some_and(|p| p != old) {
                        return Instant::now();
                    }
                    assert!(Instant::now() < deadline, "the sentinels did not promote the replica");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        })
        .await
        .expect("promotion watch");
        let promoted_after = promoted - load.t0 - killed;
        // Every sentinel names the promoted replica (they converge on their own schedule).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sentinels.iter().all(|s| s.master_port("tg") == Some(replica.port)) {
            assert!(Instant::now() < deadline, "the sentinels do not agree on the new master");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_secs(6)).await;
        let end = load.now();
        let samples = load.stop().await;
        let r = report(&samples, killed, end);
        r.print("sentinel failover");
        eprintln!(
            "sentinel failover: the sentinels promoted the replica {:.2}s after the kill; sidecars were back on Redis {:.2}s after that",
            promoted_after.as_secs_f64(),
            r.recovery.saturating_sub(promoted_after).as_secs_f64()
        );
        r.assert_sound("sentinel failover");
        // The buckets live on the promoted replica now.
        assert!(replica.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap_or(0) > 0);
    })
    .await;
}

/// Three masters with one replica each, a short node timeout so a replica takes over quickly.
struct ReplicatedCluster(tollgate_testkit::RedisCluster);

impl ReplicatedCluster {
    fn start() -> ReplicatedCluster {
        ReplicatedCluster(tollgate_testkit::RedisCluster::start(
            3,
            1,
            Duration::from_secs(1),
        ))
    }

    /// The node serving `slot` as master.
    fn master_of(&self, slot: u16) -> usize {
        self.0
            .nodes
            .iter()
            .position(|n| {
                n.cli(&["ROLE"]).starts_with("master")
                    && n.cli(&["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
                        .trim()
                        .parse::<u64>()
                        .unwrap_or(0)
                        > 0
            })
            .expect("a master holding the slot")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_failover_under_load_keeps_failure_modes_and_recovers() {
    within(150, async {
        let _serial = SERIAL.lock().await;
        let mut cluster = ReplicatedCluster::start();
        let urls = cluster.0.urls();
        // One group: every bucket lives in `tg:{g0}`, so the test knows which master to kill.
        let (_upstream, sidecars) =
            start_sidecars(&["--redis", &urls, "--redis-cluster", "--redis-groups", "1"]).await;
        let load = Load::start(&sidecars);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let slot: u16 = cluster.0.nodes[0]
            .cli(&["CLUSTER", "KEYSLOT", "tg:{g0}"])
            .trim()
            .parse()
            .expect("key slot");
        let victim = cluster.master_of(slot);
        let killed = load.now();
        cluster.0.nodes[victim].kill();
        let promoted = tokio::task::spawn_blocking({
            let ports: Vec<u16> = cluster
                .0
                .nodes
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != victim)
                .map(|(_, n)| n.port)
                .collect();
            move || {
                let cli = |port: u16, args: &[&str]| {
                    let out = Command::new("redis-cli")
                        .args(["-p", &port.to_string()])
                        .args(args)
                        .output()
                        .expect("redis-cli");
                    String::from_utf8_lossy(&out.stdout).into_owned()
                };
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    // The victim's replica holds the slot's keys; it takes over once it is
                    // master.
                    let taken_over = ports.iter().any(|&p| {
                        cli(p, &["ROLE"]).starts_with("master")
                            && cli(p, &["CLUSTER", "COUNTKEYSINSLOT", &slot.to_string()])
                                .trim()
                                .parse::<u64>()
                                .unwrap_or(0)
                                > 0
                    });
                    if taken_over {
                        return Instant::now();
                    }
                    assert!(Instant::now() < deadline, "the cluster did not fail over");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        })
        .await
        .expect("failover watch");
        let promoted_after = promoted - load.t0 - killed;
        tokio::time::sleep(Duration::from_secs(6)).await;
        let end = load.now();
        let samples = load.stop().await;
        let r = report(&samples, killed, end);
        r.print("cluster failover");
        eprintln!(
            "cluster failover: a replica took over {:.2}s after the kill; sidecars were back on Redis {:.2}s after that",
            promoted_after.as_secs_f64(),
            r.recovery.saturating_sub(promoted_after).as_secs_f64()
        );
        r.assert_sound("cluster failover");
    })
    .await;
}
