//! Two controller replicas behind one address, on a real API server.
//!
//! A small TCP balancer stands in for the controller's Service: each new connection goes to the
//! next replica (skipping one that refuses). Sidecars therefore stream from both replicas, and
//! the test shows what users of `replicas: 2` rely on:
//!
//! - every sidecar is told the fleet-wide member count, whichever replica it talks to, and a
//!   global limit holds across all of them;
//! - the leader's status counts every sidecar in sync (acks travel on the stream's HTTP/2
//!   connection, so they reach the replica that serves the stream);
//! - a sidecar joining through one replica reaches the counts of the other quickly (measured);
//! - a replica stopped cleanly drops out at once, and one killed outright is forgotten after
//!   its Lease duration; its sidecars reconnect to the survivor and keep enforcing;
//! - a policy edited after 95 s of quiet (past an HTTP pool's idle timeout) is Programmed on
//!   both replicas with no extra connection and no `409`, and its propagation figure is the
//!   time to the last ack (57 ms measured, the other replica's Lease trip included).

use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tollgate_e2e::{
    ControlPlane, Proc, Redis, Sidecar, app, free_port, install_crd_and_shop, pod_with_token,
    shop_policy, start_controller, wait,
};

const POLICY: &str = "shop/shop-api-keys";
const LEASE_SECONDS: u64 = 6;

/// Round-robin TCP balancer over `backends` (a Service's behaviour, per connection).
fn balancer(backends: Vec<u16>) -> u16 {
    counting_balancer(backends).0
}

/// [`balancer`], with the number of connections it accepted so far.
fn counting_balancer(backends: Vec<u16>) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind balancer");
    let port = listener.local_addr().expect("addr").port();
    let next = Arc::new(AtomicUsize::new(0));
    let accepted = next.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { continue };
            let start = next.fetch_add(1, Ordering::Relaxed);
            let upstream = (0..backends.len()).find_map(|i| {
                let port = backends[(start + i) % backends.len()];
                TcpStream::connect(("127.0.0.1", port)).ok()
            });
            let Some(upstream) = upstream else { continue };
            let _ = client.set_nodelay(true);
            let _ = upstream.set_nodelay(true);
            for (mut from, mut to) in [
                (client.try_clone().unwrap(), upstream.try_clone().unwrap()),
                (upstream, client),
            ] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(Shutdown::Both);
                    let _ = from.shutdown(Shutdown::Both);
                });
            }
        }
    });
    (port, accepted)
}

/// The value of the first sample of `name` (with `labels` in its label set) on a metrics page.
fn metric(client: &reqwest::blocking::Client, url: &str, name: &str, labels: &str) -> Option<f64> {
    let text = client.get(url).send().ok()?.text().ok()?;
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.split(['{', ' ']).next() == Some(name) && (labels.is_empty() || l.contains(labels))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

struct Replica {
    proc: Proc,
    port: u16,
}

struct Fleet {
    cp: ControlPlane,
    client: reqwest::blocking::Client,
    tokens: tempfile::TempDir,
    redis_port: u16,
    app_port: u16,
    balancer_port: u16,
    sidecars: Vec<Sidecar>,
}

impl Fleet {
    /// Starts replicas `ctrl-a` and `ctrl-b`, waits until they see each other, then starts
    /// `sidecars` sidecars and waits until the balancer spread their streams over both.
    fn two_replicas_with_sidecars(
        &mut self,
        ports: (u16, u16),
        sidecars: usize,
    ) -> (Replica, Replica) {
        let a = self.replica("ctrl-a", ports.0);
        let b = self.replica("ctrl-b", ports.1);
        wait(
            "each replica to see the other",
            Duration::from_secs(15),
            || peers(&self.client, &a) == 1 && peers(&self.client, &b) == 1,
        );
        for i in 0..sidecars {
            self.sidecar(i);
        }
        wait(
            "the streams over both replicas",
            Duration::from_secs(20),
            || {
                let (ca, cb) = (connected(&self.client, &a), connected(&self.client, &b));
                ca + cb == sidecars as u64 && ca > 0 && cb > 0
            },
        );
        (a, b)
    }

    fn replica(&self, identity: &str, port: u16) -> Replica {
        let lease = format!("{LEASE_SECONDS}s");
        let proc = start_controller(
            &self.cp,
            &format!("tollgate-controller {identity}"),
            port,
            &[
                "--identity",
                identity,
                "--lease-duration",
                &lease,
                "--heartbeat-interval",
                "1s",
            ],
        );
        Replica { proc, port }
    }

    /// A pod object with a bound token, and a sidecar process for it behind the balancer.
    fn sidecar(&mut self, i: usize) {
        let name = format!("p{i}");
        let token = pod_with_token(&self.cp, &name, self.tokens.path());
        let redis = format!("redis://127.0.0.1:{}", self.redis_port);
        self.sidecars.push(Sidecar::for_pod(
            &name,
            self.app_port,
            self.balancer_port,
            &token,
            &["--redis", &redis, "--redis-timeout", "200ms"],
        ));
    }

    /// The member count each sidecar was last told (its `tollgate_live_sidecars` gauge).
    fn members_seen(&self) -> Vec<u64> {
        self.sidecars
            .iter()
            .map(|s| {
                metric(
                    &self.client,
                    &format!("http://127.0.0.1:{}/metrics", s.admin),
                    "tollgate_live_sidecars",
                    POLICY,
                )
                .unwrap_or(-1.0) as u64
            })
            .collect()
    }

    fn status(&self, path: &str) -> String {
        self.cp
            .ok(&[
                "get",
                "rlp",
                "-n",
                "shop",
                "shop-api-keys",
                "-o",
                &format!("jsonpath={path}"),
            ])
            .trim()
            .to_string()
    }
}

fn connected(client: &reqwest::blocking::Client, r: &Replica) -> u64 {
    metric(
        client,
        &format!("http://127.0.0.1:{}/metrics", r.port),
        "tollgate_controller_connected_sidecars",
        POLICY,
    )
    .unwrap_or(0.0) as u64
}

fn peers(client: &reqwest::blocking::Client, r: &Replica) -> u64 {
    metric(
        client,
        &format!("http://127.0.0.1:{}/metrics", r.port),
        "tollgate_controller_peer_replicas",
        "",
    )
    .unwrap_or(0.0) as u64
}

#[test]
fn two_replicas_share_membership_status_and_the_global_limit() {
    let cp = ControlPlane::start();
    install_crd_and_shop(&cp);
    cp.apply(&shop_policy(40)).expect("apply policy");

    let redis = Redis::start();
    let redis_port = redis.port;
    let (port_a, port_b) = (free_port(), free_port());
    let mut fleet = Fleet {
        client: tollgate_e2e::http_client()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
        tokens: tempfile::tempdir().unwrap(),
        redis_port,
        app_port: app(),
        balancer_port: balancer(vec![port_a, port_b]),
        sidecars: Vec::new(),
        cp,
    };
    // The balancer spreads the four streams over both replicas...
    let (a, mut b) = fleet.two_replicas_with_sidecars((port_a, port_b), 4);
    eprintln!(
        "streams: {} on ctrl-a, {} on ctrl-b",
        connected(&fleet.client, &a),
        connected(&fleet.client, &b)
    );
    // ...yet every sidecar is told the fleet-wide count,
    wait(
        "every sidecar to count 4 members",
        Duration::from_secs(20),
        || fleet.members_seen() == [4, 4, 4, 4],
    );
    // and the leader's status counts every sidecar in sync (acks reached the right replica).
    wait(
        "status: 4 sidecars, 4 in sync, Programmed",
        Duration::from_secs(30),
        || {
            fleet.status("{.status.sidecarsTotal}/{.status.sidecarsInSync}") == "4/4"
                && fleet.status("{.status.conditions[?(@.type==\"Programmed\")].status}") == "True"
        },
    );

    // The global limit (40/min) holds across the four sidecars on two replicas.
    let admitted = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = fleet
        .sidecars
        .iter()
        .map(|s| {
            let (port, admitted, client) = (s.listen, admitted.clone(), fleet.client.clone());
            std::thread::spawn(move || {
                for _ in 0..30 {
                    let ok = client
                        .get(format!("http://127.0.0.1:{port}/"))
                        .header("x-api-key", "k1")
                        .send()
                        .is_ok_and(|r| r.status() == 200);
                    if ok {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let admitted = admitted.load(Ordering::Relaxed);
    eprintln!("global limit 40/min across 4 sidecars on 2 replicas: admitted {admitted} of 120");
    assert!(
        (40..=41).contains(&admitted),
        "admitted {admitted}, limit 40 (+1 token of refill at most)"
    );

    // A fifth sidecar joins (through whichever replica): time until all five are told.
    let t0 = Instant::now();
    fleet.sidecar(4);
    let joined = wait("every sidecar to count 5", Duration::from_secs(20), || {
        fleet.members_seen().iter().all(|n| *n == 5)
    });
    eprintln!(
        "sidecar p4 started and counted by all 5 sidecars on both replicas after {:?} \
         (process start included: {:?})",
        joined,
        t0.elapsed()
    );

    // Clean stop of ctrl-b: its Lease goes at once, its sidecars reconnect to ctrl-a, and the
    // count never drops below the five sidecars that keep running.
    let moved = connected(&fleet.client, &b);
    let t0 = Instant::now();
    b.proc.stop(Duration::from_secs(10));
    let left = wait("ctrl-a to drop ctrl-b", Duration::from_secs(5), || {
        peers(&fleet.client, &a) == 0
    });
    wait("all 5 streams on ctrl-a", Duration::from_secs(20), || {
        connected(&fleet.client, &a) == 5
    });
    eprintln!(
        "ctrl-b stopped: dropped by ctrl-a after {left:?}; its {moved} sidecars back on ctrl-a after {:?}",
        t0.elapsed()
    );
    wait(
        "every sidecar to count 5 again",
        Duration::from_secs(20),
        || fleet.members_seen().iter().all(|n| *n == 5),
    );

    // ctrl-b comes back; a sixth sidecar lands on it; then ctrl-b is killed outright (no
    // cleanup): ctrl-a forgets it once its Lease has gone unrenewed for the lease duration.
    b = fleet.replica("ctrl-b", port_b);
    wait(
        "ctrl-a to see ctrl-b again",
        Duration::from_secs(15),
        || peers(&fleet.client, &a) == 1,
    );
    fleet.sidecar(5);
    wait("6 streams", Duration::from_secs(20), || {
        connected(&fleet.client, &a) + connected(&fleet.client, &b) == 6
    });
    let t0 = Instant::now();
    drop(b.proc); // SIGKILL
    let expired = wait(
        "ctrl-a to forget the killed replica",
        Duration::from_secs(LEASE_SECONDS + 5),
        || peers(&fleet.client, &a) == 0,
    );
    eprintln!("ctrl-b killed: forgotten by ctrl-a after {expired:?} (lease {LEASE_SECONDS}s)");
    assert!(
        expired >= Duration::from_secs(LEASE_SECONDS - 2),
        "{expired:?}"
    );
    wait(
        "all 6 sidecars on ctrl-a, each counting 6",
        Duration::from_secs(25),
        || connected(&fleet.client, &a) == 6 && fleet.members_seen().iter().all(|n| *n == 6),
    );
    eprintln!(
        "after the kill: all 6 sidecars on ctrl-a after {:?}",
        t0.elapsed()
    );
    wait("status: 6/6 in sync", Duration::from_secs(30), || {
        fleet.status("{.status.sidecarsTotal}/{.status.sidecarsInSync}") == "6/6"
    });
    drop(a);
}

/// A policy edited long after the sidecars connected (past the 90 s after which a pooled HTTP
/// client would have moved their acks to a new connection, which the balancer may send to the
/// other replica) still becomes Programmed, with every ack on its stream's own connection: no
/// connection beyond the sidecars' streams, no `409`. Its propagation figure is the time to the
/// last ack, not to a status write.
#[test]
fn a_policy_edited_after_a_quiet_time_is_programmed_on_two_replicas() {
    let cp = ControlPlane::start();
    install_crd_and_shop(&cp);
    cp.apply(&shop_policy(40)).expect("apply policy");
    let redis = Redis::start();
    let (port_a, port_b) = (free_port(), free_port());
    let (balancer_port, accepted) = counting_balancer(vec![port_a, port_b]);
    let mut fleet = Fleet {
        client: tollgate_e2e::http_client()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap(),
        tokens: tempfile::tempdir().unwrap(),
        redis_port: redis.port,
        app_port: app(),
        balancer_port,
        sidecars: Vec::new(),
        cp,
    };
    let (a, b) = fleet.two_replicas_with_sidecars((port_a, port_b), 3);
    let programmed = |fleet: &Fleet, generation: &str| {
        fleet.status("{.status.sidecarsTotal}/{.status.sidecarsInSync}") == "3/3"
            && fleet.status("{.status.conditions[?(@.type==\"Programmed\")].status}") == "True"
            && fleet.status("{.status.conditions[?(@.type==\"Programmed\")].observedGeneration}")
                == generation
    };
    wait(
        "Programmed at generation 1",
        Duration::from_secs(30),
        || programmed(&fleet, "1"),
    );
    let streams = accepted.load(Ordering::Relaxed);

    let quiet = Duration::from_secs(95);
    eprintln!("quiet for {quiet:?}");
    std::thread::sleep(quiet);
    fleet.cp.apply(&shop_policy(41)).expect("edit policy");
    let took = wait(
        "Programmed at generation 2",
        Duration::from_secs(30),
        || programmed(&fleet, "2"),
    );
    let propagation: u64 = fleet
        .status("{.status.propagation.durationMillis}")
        .parse()
        .expect("propagation measured");
    eprintln!(
        "edited after {quiet:?} of quiet: Programmed seen {took:?} after the apply; \
         status.propagation {propagation} ms"
    );
    assert_eq!(
        accepted.load(Ordering::Relaxed),
        streams,
        "no connection beyond the streams: acks travel on them"
    );
    for r in [&a, &b] {
        let conflicts = metric(
            &fleet.client,
            &format!("http://127.0.0.1:{}/metrics", r.port),
            "tollgate_controller_acks_total",
            "epoch_mismatch",
        )
        .unwrap_or(0.0);
        assert_eq!(conflicts, 0.0, "acks that reached the wrong replica");
    }
    assert!(
        propagation < 500,
        "propagation {propagation} ms: the sidecars on loopback ack within milliseconds"
    );
}
