//! Support for the sidecar's integration tests: the real `tollgate-sidecar` binary (or the rate
//! limit service, `tollgate-ratelimit`) as a child process, an in-test upstream application,
//! policy builders and small HTTP helpers.
//!
//! Everything listens on 127.0.0.1 with ports chosen by the kernel. The sidecar's bound
//! addresses come from its JSON start-up log line; its stderr keeps being drained in the
//! background (and is printed when a test fails). The child is killed by PID when the
//! [`Sidecar`] is dropped, so a panicking test never leaks a process.

#![allow(dead_code)]

use std::convert::Infallible;
use std::future::Future;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;

mod relay;
#[allow(unused_imports)] // Only the tests of global rules use them.
pub use relay::{Replaceable, delaying_relay};
#[allow(unused_imports)]
pub use tollgate_testkit::{Redis, free_port};

/// Path of the binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_tollgate-sidecar");

/// Path of `tollgate-ratelimit`, in the same target directory as [`BIN`] (where the
/// `--rate-limit-service` alias finds it too). Cargo builds only this package's binaries for
/// its tests, so the first call builds it (quick when it is up to date).
pub fn ratelimit_bin() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let bin = Path::new(BIN).with_file_name("tollgate-ratelimit");
            let profile_dir = Path::new(BIN).parent().expect("profile dir");
            let target_dir = profile_dir.parent().expect("target dir");
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
            let mut cmd = Command::new(cargo);
            cmd.args([
                "build",
                "--quiet",
                "-p",
                "tollgate-ratelimit",
                "--manifest-path",
            ])
            .arg(&manifest)
            .arg("--target-dir")
            .arg(target_dir);
            match profile_dir.file_name().and_then(|n| n.to_str()) {
                Some("debug") => {}
                Some("release") => {
                    cmd.arg("--release");
                }
                Some(profile) => {
                    cmd.args(["--profile", profile]);
                }
                None => {}
            }
            let status = cmd.status().expect("run cargo build -p tollgate-ratelimit");
            assert!(
                status.success(),
                "cargo build -p tollgate-ratelimit: {status}"
            );
            assert!(bin.is_file(), "{} was not built", bin.display());
            bin
        })
        .clone()
}

/// How long the sidecar may take to log that it started (debug build on a busy machine).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `f`, failing the test if it takes longer than `secs` seconds.
pub async fn within<T>(secs: u64, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(secs), f).await {
        Ok(v) => v,
        Err(_) => panic!("test did not finish within {secs} s"),
    }
}

/// Polls `check` every 50 ms until it returns `Some`, for at most `timeout`.
pub async fn poll_until<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Policies

/// Removes the indentation common to all non-blank lines.
pub fn dedent(s: &str) -> String {
    let indent = s
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    s.lines()
        .map(|l| {
            if l.len() >= indent {
                &l[indent..]
            } else {
                l.trim_start()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A policy that matches every request and never gets close to limiting a test: for tests of
/// what the proxy does with bytes.
pub fn roomy_policy() -> String {
    policy(
        "roomy",
        "
        rules:
          - name: roomy
            limit:
              requests: 100000
              period: 1m
            scope: Local
        ",
    )
}

/// A RateLimitPolicy document named `name` in namespace `test` selecting every pod, whose
/// `spec` (after `targetRef`) is `spec` (any indentation; it is re-indented).
/// A policy of `rules`, a YAML list of rules indented however the caller likes.
pub fn rules_policy(name: &str, rules: &str) -> String {
    let rules: String = dedent(rules).lines().map(|l| format!("  {l}\n")).collect();
    policy(name, &format!("rules:\n{rules}"))
}

pub fn policy(name: &str, spec: &str) -> String {
    let mut out = format!(
        "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata:\n  name: {name}\n  \
         namespace: test\nspec:\n  targetRef:\n    selector: {{}}\n"
    );
    for line in dedent(spec).lines() {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The sidecar process

/// A running `tollgate-sidecar` child process, killed when dropped.
pub struct Sidecar {
    child: Child,
    pub pid: u32,
    /// The proxy listener.
    pub listen: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
    logs: Arc<Mutex<Vec<String>>>,
    /// Directory holding the policy file (passed as `--policies`).
    pub dir: tempfile::TempDir,
    exited: Option<ExitStatus>,
}

impl Sidecar {
    /// Starts the sidecar in front of `upstream` enforcing `policy_yaml`, with extra arguments
    /// (an empty `upstream` passes no `--upstream`: the rate limit service edge).
    /// Blocks until it has logged its bound addresses.
    pub fn start_blocking(upstream: &str, policy_yaml: &str, extra: &[String]) -> Sidecar {
        Sidecar::start_inner(Path::new(BIN), upstream, Some(policy_yaml), extra)
    }

    /// Starts the rate limit service (`tollgate-ratelimit`) enforcing `policy_yaml`, with
    /// extra arguments; returns once it has logged its bound addresses.
    pub async fn start_ratelimit(policy_yaml: &str, extra: &[&str]) -> Sidecar {
        let policy_yaml = policy_yaml.to_string();
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        tokio::task::spawn_blocking(move || {
            Sidecar::start_inner(&ratelimit_bin(), "", Some(&policy_yaml), &extra)
        })
        .await
        .expect("rate limit service start panicked")
    }

    /// Starts the sidecar without `--policies` (the rule source is in `extra`).
    pub async fn start_with_source(upstream: &str, extra: &[&str]) -> Sidecar {
        let upstream = upstream.to_string();
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        tokio::task::spawn_blocking(move || {
            Sidecar::start_inner(Path::new(BIN), &upstream, None, &extra)
        })
        .await
        .expect("sidecar start panicked")
    }

    fn start_inner(
        program: &Path,
        upstream: &str,
        policy_yaml: Option<&str>,
        extra: &[String],
    ) -> Sidecar {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut cmd = Command::new(program);
        if let Some(yaml) = policy_yaml {
            std::fs::write(dir.path().join("policy.yaml"), yaml).expect("write policy");
            cmd.arg("--policies").arg(dir.path());
        }
        let mut child = cmd
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--admin")
            .arg("127.0.0.1:0")
            .arg("--log-format")
            .arg("json")
            .args(
                ["--upstream", upstream]
                    .iter()
                    .filter(|_| !upstream.is_empty()),
            )
            .args(extra)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
        let pid = child.id();
        let stderr = child.stderr.take().expect("stderr piped");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel::<(SocketAddr, SocketAddr)>();
        {
            let logs = Arc::clone(&logs);
            std::thread::spawn(move || {
                let mut tx = Some(tx);
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if tx.is_some()
                        && let Some(addrs) = started_line(&line)
                    {
                        let _ = tx.take().expect("sender").send(addrs);
                    }
                    logs.lock().unwrap().push(line);
                }
            });
        }
        let mut sidecar = Sidecar {
            child,
            pid,
            listen: ([0, 0, 0, 0], 0).into(),
            admin: ([0, 0, 0, 0], 0).into(),
            logs,
            dir,
            exited: None,
        };
        match rx.recv_timeout(START_TIMEOUT) {
            Ok((listen, admin)) => {
                sidecar.listen = listen;
                sidecar.admin = admin;
                sidecar
            }
            Err(e) => {
                let logs = sidecar.logs();
                panic!("sidecar did not start ({e}); stderr:\n{}", logs.join("\n"));
            }
        }
    }

    /// [`Sidecar::start_blocking`] off the async runtime's worker threads.
    pub async fn start(upstream: &str, policy_yaml: &str, extra: &[&str]) -> Sidecar {
        let upstream = upstream.to_string();
        let policy_yaml = policy_yaml.to_string();
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        tokio::task::spawn_blocking(move || {
            Sidecar::start_blocking(&upstream, &policy_yaml, &extra)
        })
        .await
        .expect("sidecar start panicked")
    }

    /// `http://<listen>` followed by `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listen)
    }

    /// `http://<admin>` followed by `path`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// Everything the sidecar logged so far.
    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().unwrap().clone()
    }

    /// The policy file the sidecar watches.
    pub fn policy_path(&self) -> PathBuf {
        self.dir.path().join("policy.yaml")
    }

    /// Replaces the policy file atomically (write a hidden temp file, rename over it), so the
    /// sidecar never reads a half-written file.
    pub fn write_policy(&self, yaml: &str) {
        let tmp = self.dir.path().join(".policy.yaml.tmp");
        std::fs::write(&tmp, yaml).expect("write policy");
        std::fs::rename(&tmp, self.policy_path()).expect("rename policy");
    }

    /// Resident set size of the process, in bytes.
    pub fn rss_bytes(&self) -> u64 {
        rss_bytes(self.pid)
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        if self.exited.is_some() {
            return false;
        }
        match self.child.try_wait() {
            Ok(None) => true,
            Ok(Some(status)) => {
                self.exited = Some(status);
                false
            }
            Err(_) => false,
        }
    }

    /// Sends SIGTERM to the process.
    pub fn terminate(&self) {
        self.signal(libc::SIGTERM);
    }

    /// Sends SIGKILL to the process: no chance to return tokens or deregister.
    pub fn kill_hard(&self) {
        self.signal(libc::SIGKILL);
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: plain syscall on the PID of our own child, which has not been reaped yet
        // (`exited` is only set after a successful wait), so the PID cannot have been reused.
        #[allow(unsafe_code, reason = "signals to our own child")]
        let rc = unsafe { libc::kill(self.pid as libc::pid_t, sig) };
        assert_eq!(
            rc,
            0,
            "kill({sig}) failed: {}",
            std::io::Error::last_os_error()
        );
    }

    /// Waits (polling) up to `timeout` for the process to exit and returns its status.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if !self.is_running() {
                if let Some(status) = self.exited {
                    return status;
                }
                panic!("cannot determine the exit status of the sidecar");
            }
            assert!(
                Instant::now() < deadline,
                "sidecar still running {timeout:?} after being asked to stop"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The text of `/metrics` on the admin port.
    /// An admin endpoint's JSON (`/debug/rules`, `/debug/stream`, ...).
    pub async fn admin_json(&self, client: &reqwest::Client, path: &str) -> serde_json::Value {
        let resp = client
            .get(self.admin_url(path))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        resp.json()
            .await
            .unwrap_or_else(|e| panic!("{path}: not JSON: {e}"))
    }

    pub async fn metrics(&self, client: &reqwest::Client) -> String {
        let resp = client
            .get(self.admin_url("/metrics"))
            .send()
            .await
            .expect("GET /metrics");
        assert_eq!(resp.status(), 200, "/metrics status");
        resp.text().await.expect("metrics body")
    }

    /// Waits until this sidecar counts `n` live members of `policy` (`namespace/name`).
    pub async fn wait_members(&self, policy: &str, n: usize, timeout: Duration) {
        poll_until(timeout, &format!("membership of {n}"), || async {
            let m = self.metrics(&client()).await;
            (metric(&m, "tollgate_live_sidecars", &[("policy", policy)]) == Some(n as f64))
                .then_some(())
        })
        .await;
    }

    /// The member count of `policy` this sidecar reports; `None` while `/metrics` does not
    /// answer (a sidecar being stopped).
    pub async fn live_members(&self, policy: &str) -> Option<f64> {
        let text = client()
            .get(self.admin_url("/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        metric(&text, "tollgate_live_sidecars", &[("policy", policy)])
    }

    /// Asserts the process is alive and still proxies requests.
    pub async fn assert_serving(&mut self, client: &reqwest::Client, path: &str) {
        assert!(
            self.is_running(),
            "sidecar died; stderr:\n{}",
            self.logs().join("\n")
        );
        let resp = client
            .get(self.url(path))
            .send()
            .await
            .expect("request after abuse");
        assert_eq!(resp.status(), 200, "sidecar no longer serves normally");
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if self.exited.is_none() {
            // `Child::kill` sends SIGKILL to this child's PID only.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            let logs = self.logs();
            let tail = &logs[logs.len().saturating_sub(60)..];
            eprintln!(
                "---- sidecar {} stderr (last {} lines) ----",
                self.pid,
                tail.len()
            );
            for l in tail {
                eprintln!("{l}");
            }
        }
    }
}

/// Parses the JSON start-up line: `{"message":"tollgate-sidecar started","listen":..,"admin":..}`
/// (`tollgate-ratelimit started` for the rate limit service).
pub fn started_line(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let message = v.get("message")?.as_str()?;
    if message != "tollgate-sidecar started" && message != "tollgate-ratelimit started" {
        return None;
    }
    let listen = v.get("listen")?.as_str()?.parse().ok()?;
    let admin = v.get("admin")?.as_str()?.parse().ok()?;
    Some((listen, admin))
}

/// `n` sidecars in front of `upstream` on one Redis (200 ms timeout), each enforcing
/// `policy_yaml`, returned once every one counts `n` members of `policy` (`namespace/name`).
pub async fn redis_fleet(
    n: usize,
    redis: &Redis,
    upstream: &Upstream,
    policy_yaml: &str,
    policy: &str,
) -> Vec<Sidecar> {
    let url = redis.url();
    let mut sidecars = Vec::new();
    for _ in 0..n {
        let args = ["--redis", url.as_str(), "--redis-timeout", "200ms"];
        sidecars.push(Sidecar::start(&upstream.url(), policy_yaml, &args).await);
    }
    for s in &sidecars {
        s.wait_members(policy, n, Duration::from_secs(20)).await;
    }
    sidecars
}

/// `INFO commandstats` of `redis`: per command (lowercase, as `cmdstat_<name>`), its calls and
/// the microseconds Redis spent executing them since the last `CONFIG RESETSTAT`.
pub fn command_stats(redis: &Redis) -> std::collections::BTreeMap<String, (u64, u64)> {
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .filter_map(|l| l.strip_prefix("cmdstat_")?.split_once(':'))
        .map(|(name, fields)| {
            let field = |k: &str| {
                fields
                    .split(',')
                    .find_map(|f| f.strip_prefix(k))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0)
            };
            (name.to_string(), (field("calls="), field("usec=")))
        })
        .collect()
}

/// `$name` as a whole number, else `default` (the knobs of the long-running tests).
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub const MIB: f64 = 1024.0 * 1024.0;

/// VmRSS of a process from `/proc/<pid>/status`, in bytes.
pub fn rss_bytes(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmRSS")
}

/// A `/proc/<pid>/status` field in bytes (`VmRSS`, `VmHWM`: the peak RSS).
pub fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        * 1024
}

/// Runs `tollgate-sidecar check <paths>` and returns (exit status, stdout, stderr).
pub fn run_check(paths: &[&Path]) -> (ExitStatus, String, String) {
    let out = Command::new(BIN)
        .arg("check")
        .args(paths)
        .stdin(Stdio::null())
        .output()
        .expect("run check");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

// ---------------------------------------------------------------------------------------------
// HTTP clients and metrics

/// A client with a per-request timeout that ignores proxy environment variables.
pub fn client() -> reqwest::Client {
    client_builder().build().expect("client")
}

/// The builder behind [`client`], for variants (e.g. a different local address).
pub fn client_builder() -> reqwest::ClientBuilder {
    // reqwest has rustls without a provider of its own, as in the binary.
    tollgate_sidecar::install_crypto_provider();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .connect_timeout(Duration::from_secs(5))
        .no_proxy()
}

/// A client whose connections come from `ip` (any 127.0.0.0/8 address is local on Linux).
pub fn client_from(ip: [u8; 4]) -> reqwest::Client {
    client_builder()
        .local_address(std::net::IpAddr::from(ip))
        .build()
        .expect("client")
}

/// A header value as text (panics if absent).
pub fn header<'a>(resp: &'a reqwest::Response, name: &str) -> &'a str {
    resp.headers()
        .get(name)
        .unwrap_or_else(|| panic!("response has no {name} header: {:?}", resp.headers()))
        .to_str()
        .expect("ASCII header")
}

/// A numeric header (panics if absent or not a whole number).
pub fn header_u64(resp: &reqwest::Response, name: &str) -> u64 {
    header(resp, name)
        .parse()
        .unwrap_or_else(|_| panic!("{name}: {:?} is not a whole number", header(resp, name)))
}

/// Sends `GET path` with the given headers and returns the status code.
pub async fn status_of(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
) -> reqwest::StatusCode {
    let mut req = client.get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = resp.status();
    // Drain the body so the connection is reused.
    let _ = resp.bytes().await;
    status
}

/// Sends `n` sequential GETs and returns their status codes.
pub async fn statuses(
    client: &reqwest::Client,
    url: &str,
    headers: &[(&str, &str)],
    n: usize,
) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(status_of(client, url, headers).await.as_u16());
    }
    out
}

/// Sum of the samples of metric `name` whose labels include every pair in `labels`; `None`
/// when no sample matches.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut total = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (metric_name, label_text) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        if metric_name != name {
            continue;
        }
        if labels
            .iter()
            .all(|(k, v)| label_text.split(',').any(|p| p == format!("{k}=\"{v}\"")))
        {
            let v: f64 = value.parse().expect("metric value");
            total = Some(total.unwrap_or(0.0) + v);
        }
    }
    total
}

// ---------------------------------------------------------------------------------------------
// The upstream application

/// State of the in-test upstream, shared with the test.
pub struct UpstreamState {
    /// Requests received.
    pub hits: AtomicUsize,
    /// Requests currently being handled (`/slow`, `/hold`).
    pub in_flight: AtomicUsize,
    /// TCP connections accepted (keep-alive reuse shows as few connections, many hits).
    pub connections: AtomicUsize,
    release: watch::Sender<bool>,
}

/// An HTTP/1.1 application on 127.0.0.1 for the sidecar to proxy to. Routes:
///
/// - `/slow?ms=N`: answers 200 after N milliseconds.
/// - `/hold`: answers 200 once the test calls [`Upstream::release`].
/// - `/download?bytes=N`: streams N bytes in 64 KiB chunks.
/// - `/upload`: consumes the request body chunk by chunk and answers with its length.
/// - `/respond?status=N&tokens=N` (also `/login`): answers with that status and `x-tokens: N`.
/// - `/ws`: WebSocket echo.
/// - anything else: 200 `ok`, echoing what it saw in `x-upstream-xff` (the X-Forwarded-For
///   it received) and `x-upstream-path`.
pub struct Upstream {
    pub addr: SocketAddr,
    pub state: Arc<UpstreamState>,
    task: tokio::task::JoinHandle<()>,
}

type UpBody = BoxBody<Bytes, Infallible>;

static CHUNK: [u8; 64 * 1024] = [b'x'; 64 * 1024];

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let (release, _) = watch::channel(false);
        let state = Arc::new(UpstreamState {
            hits: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            release,
        });
        let st = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                st.connections.fetch_add(1, Ordering::SeqCst);
                let st = Arc::clone(&st);
                let service = hyper::service::service_fn(move |req| {
                    let st = Arc::clone(&st);
                    async move { Ok::<_, Infallible>(upstream_handle(st, req).await) }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .with_upgrades()
                        .await;
                });
            }
        });
        Upstream { addr, state, task }
    }

    /// `http://<addr>`, for `--upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Lets every `/hold` request (current and future) complete.
    pub fn release(&self) {
        self.state.release.send_replace(true);
    }

    pub fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    pub fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }

    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn full(body: impl Into<Bytes>) -> UpBody {
    Full::new(body.into()).boxed()
}

fn query_u64(req: &Request<Incoming>, name: &str) -> Option<u64> {
    req.uri().query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == name).then(|| v.parse().ok()).flatten()
    })
}

/// Decrements the in-flight count when a handler finishes (or is cancelled).
struct InFlight(Arc<UpstreamState>);

impl InFlight {
    fn new(st: &Arc<UpstreamState>) -> InFlight {
        st.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(Arc::clone(st))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The test app's answer per path: one arm per behaviour the tests ask for.
#[allow(
    clippy::too_many_lines,
    reason = "a flat table of the test app's paths reads better than one helper per arm"
)]
async fn upstream_handle(st: Arc<UpstreamState>, req: Request<Incoming>) -> Response<UpBody> {
    st.hits.fetch_add(1, Ordering::SeqCst);
    match req.uri().path() {
        "/slow" => {
            let _guard = InFlight::new(&st);
            let ms = query_u64(&req, "ms").unwrap_or(1000);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Response::new(full("slow ok"))
        }
        "/respond" | "/login" => {
            // `?status=N&tokens=N`: that status, and the cost in `x-tokens` when given.
            let mut resp = Response::new(full("responded"));
            if let Some(s) =
                query_u64(&req, "status").and_then(|s| StatusCode::from_u16(s as u16).ok())
            {
                *resp.status_mut() = s;
            }
            if let Some(t) = query_u64(&req, "tokens") {
                resp.headers_mut()
                    .insert("x-tokens", http::HeaderValue::from(t));
            }
            resp
        }
        "/hold" => {
            let _guard = InFlight::new(&st);
            let mut rx = st.release.subscribe();
            let _ = rx.wait_for(|released| *released).await;
            Response::new(full("held ok"))
        }
        "/download" => {
            let total = query_u64(&req, "bytes").unwrap_or(0);
            let stream = futures_util::stream::unfold(total, |left| async move {
                if left == 0 {
                    return None;
                }
                let n = left.min(CHUNK.len() as u64);
                let frame = Frame::data(Bytes::from_static(&CHUNK[..n as usize]));
                Some((Ok::<_, Infallible>(frame), left - n))
            });
            let mut resp = Response::new(StreamBody::new(stream).boxed());
            resp.headers_mut()
                .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(total));
            resp
        }
        "/upload" => {
            let mut body = req.into_body();
            let mut received: u64 = 0;
            let mut largest_chunk: usize = 0;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => {
                        if let Ok(data) = f.into_data() {
                            received += data.len() as u64;
                            largest_chunk = largest_chunk.max(data.len());
                        }
                    }
                    Err(_) => {
                        let mut resp = Response::new(full("body error"));
                        *resp.status_mut() = StatusCode::BAD_REQUEST;
                        return resp;
                    }
                }
            }
            let mut resp = Response::new(full(received.to_string()));
            resp.headers_mut().insert(
                "x-largest-chunk",
                http::HeaderValue::from(largest_chunk as u64),
            );
            resp
        }
        "/ws" => websocket_echo(req),
        _ => {
            let mut resp = Response::new(full("ok"));
            let xff: Vec<&str> = req
                .headers()
                .get_all("x-forwarded-for")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            if !xff.is_empty()
                && let Ok(v) = http::HeaderValue::from_str(&xff.join(", "))
            {
                resp.headers_mut().insert("x-upstream-xff", v);
            }
            if let Ok(v) = http::HeaderValue::from_str(req.uri().path()) {
                resp.headers_mut().insert("x-upstream-path", v);
            }
            resp
        }
    }
}

/// Answers a WebSocket upgrade with 101 and echoes every data message on the upgraded
/// connection.
fn websocket_echo(mut req: Request<Incoming>) -> Response<UpBody> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::WebSocketStream;
    use tokio_tungstenite::tungstenite::protocol::Role;

    let Some(key) = req.headers().get("sec-websocket-key").cloned() else {
        let mut resp = Response::new(full("not a websocket request"));
        *resp.status_mut() = StatusCode::BAD_REQUEST;
        return resp;
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let Ok(upgraded) = on_upgrade.await else {
            return;
        };
        let mut ws =
            WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
        while let Some(Ok(msg)) = ws.next().await {
            if msg.is_text() || msg.is_binary() {
                if ws.send(msg).await.is_err() {
                    break;
                }
            } else if msg.is_close() {
                break;
            }
        }
    });
    let mut resp = Response::new(full(Bytes::new()));
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(
        http::header::UPGRADE,
        http::HeaderValue::from_static("websocket"),
    );
    h.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("upgrade"),
    );
    h.insert(
        "sec-websocket-accept",
        http::HeaderValue::from_str(&accept).expect("accept key"),
    );
    resp
}

/// An address on 127.0.0.1 where nothing listens (bound, then released).
pub async fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    addr
}

/// A TLS server config for tests: a new CA `ca_name` in `dir` issues the certificate `leaf`
/// (common name `cn`, extension lines `ext` as for `openssl x509 -extfile`). Returns the
/// acceptor and the CA certificate's path for the client to trust.
pub fn tls_acceptor(
    dir: &Path,
    ca_name: &str,
    leaf: &str,
    cn: &str,
    ext: &str,
) -> (tokio_rustls::TlsAcceptor, PathBuf) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let ca = tollgate_testkit::pki::Ca::new(dir, ca_name, &format!("{ca_name}-ca"));
    ca.issue(leaf, cn, ext);
    let certs = CertificateDer::pem_file_iter(dir.join(format!("{leaf}.crt")))
        .expect("leaf certificate")
        .collect::<Result<Vec<_>, _>>()
        .expect("leaf certificate PEM");
    let key = PrivateKeyDer::from_pem_file(dir.join(format!("{leaf}.key"))).expect("leaf key");
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .expect("server certificate");
    (
        tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)),
        ca.crt(),
    )
}

/// One member of a `RateLimit-Policy` or `RateLimit` list, parsed by a structured-field
/// parser (RFC 9651): the policy name (an sf-string) and its parameters.
#[derive(Debug, Clone)]
pub struct SfItem {
    pub name: String,
    pub params: Vec<(String, sfv::BareItem)>,
}

impl SfItem {
    /// The parameter as an sf-integer; panics (the test fails) if it has another type.
    pub fn int(&self, key: &str) -> Option<i64> {
        self.params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| match v {
                sfv::BareItem::Integer(i) => i64::from(*i),
                other => panic!(
                    "{}: parameter {key} is not an integer: {other:?}",
                    self.name
                ),
            })
    }

    pub fn has(&self, key: &str) -> bool {
        self.params.iter().any(|(k, _)| k == key)
    }
}

/// Parses every line of the field `name` as one sf-list (lines join with ", ", RFC 9110
/// §5.3), failing the test on a syntax error or a member that is not a string item.
pub fn sf_list(headers: &http::HeaderMap, name: &str) -> Vec<SfItem> {
    let joined = headers
        .get_all(name)
        .iter()
        .map(|v| v.to_str().expect("ascii field"))
        .collect::<Vec<_>>()
        .join(", ");
    let list: sfv::List = sfv::Parser::new(&joined)
        .parse()
        .unwrap_or_else(|e| panic!("{name}: {joined:?} is not an sf-list: {e}"));
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => SfItem {
                name: match item.bare_item {
                    sfv::BareItem::String(s) => s.as_str().to_string(),
                    other => panic!("{name}: member {other:?} is not an sf-string"),
                },
                params: item
                    .params
                    .into_iter()
                    .map(|(k, v)| (k.as_str().to_string(), v))
                    .collect(),
            },
            sfv::ListEntry::InnerList(l) => panic!("{name}: inner list {l:?}"),
        })
        .collect()
}

/// The `RateLimit` item of `rule`, checked against the draft: `r` a required non-negative
/// integer, `t` (when present) a non-negative integer, and never `q`.
pub fn service_limit(headers: &http::HeaderMap, rule: &str) -> (i64, Option<i64>) {
    let items = sf_list(headers, "ratelimit");
    let item = items
        .iter()
        .find(|i| i.name == rule)
        .unwrap_or_else(|| panic!("RateLimit lacks {rule}: {items:?}"));
    assert!(!item.has("q"), "q in RateLimit: {item:?}");
    let r = item.int("r").expect("r is required");
    assert!(r >= 0, "{item:?}");
    let t = item.int("t");
    assert!(t.is_none_or(|t| t >= 0), "{item:?}");
    (r, t)
}
