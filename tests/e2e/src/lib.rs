//! Harness for end-to-end tests: a real control plane (etcd + kube-apiserver built from Go
//! modules by `tools/k8sbin/build.sh`) started on free loopback ports with a fresh PKI, driven
//! with the machine's `kubectl`, and stopped by PID when the test ends — even when it panics.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A running etcd + kube-apiserver, stopped on drop.
pub struct ControlPlane {
    run_dir: tempfile::TempDir,
    /// Variables written by `up.sh` (KUBECONFIG, K8S_API_URL, K8SBIN_DIR, ...).
    pub env: HashMap<String, String>,
}

impl ControlPlane {
    /// Starts a control plane. The binaries must have been built by `tools/k8sbin/build.sh`
    /// (the README's test command does it first); building here would blow test timeouts.
    pub fn start() -> ControlPlane {
        let root = repo_root();
        let bin_dir = std::env::var("K8SBIN_DIR")
            .ok()
            .unwrap_or_else(|| cached_bin_dir(&root));
        for b in ["etcd", "kube-apiserver", "helm"] {
            assert!(
                Path::new(&bin_dir).join(b).is_file(),
                "{bin_dir}/{b} is missing: build the test binaries with `tools/k8sbin/build.sh` \
                 (./tools/test-all.sh runs it), or point K8SBIN_DIR at them"
            );
        }
        assert!(
            which("kubectl"),
            "kubectl is not on PATH: install it (Debian: the kubernetes-client package) to run the end-to-end tests"
        );
        let run_dir = tempfile::Builder::new()
            .prefix("tollgate-e2e-")
            .tempdir()
            .expect("temp dir");
        let out = Command::new(root.join("tools/k8sbin/up.sh"))
            .arg(run_dir.path())
            .env("K8SBIN_DIR", &bin_dir)
            .stdin(Stdio::null())
            .output()
            .expect("run tools/k8sbin/up.sh");
        let mut cp = ControlPlane {
            run_dir,
            env: HashMap::new(),
        };
        assert!(
            out.status.success(),
            "up.sh failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            cp.log_tail()
        );
        let env = std::fs::read_to_string(cp.run_dir.path().join("env")).expect("up.sh env file");
        for line in env.lines() {
            let line = line.trim().trim_start_matches("export ");
            if let Some((k, v)) = line.split_once('=') {
                cp.env.insert(
                    k.to_string(),
                    v.trim_matches(|c| c == '"' || c == '\'').to_string(),
                );
            }
        }
        cp
    }

    pub fn kubeconfig(&self) -> PathBuf {
        self.run_dir.path().join("kubeconfig")
    }

    pub fn helm_bin(&self) -> PathBuf {
        PathBuf::from(self.env.get("K8SBIN_DIR").cloned().unwrap_or_default()).join("helm")
    }

    /// Runs helm against this control plane, from the repository root.
    pub fn helm(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(self.helm_bin());
        cmd.args(args)
            .current_dir(repo_root())
            .env("KUBECONFIG", self.kubeconfig())
            .stdin(Stdio::null());
        for (k, v) in &self.env {
            if k.starts_with("HELM_") {
                cmd.env(k, v);
            }
        }
        cmd.output().expect("run helm")
    }

    /// Runs kubectl against this control plane.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_stdin(args, None)
    }

    /// Runs kubectl with `stdin` piped in.
    pub fn kubectl_stdin(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut child = Command::new("kubectl")
            .args(args)
            .env("KUBECONFIG", self.kubeconfig())
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kubectl");
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(text.as_bytes())
                .expect("write kubectl stdin");
        }
        child.wait_with_output().expect("kubectl output")
    }

    /// `kubectl apply -f -`; Ok(stdout) or Err(stderr).
    pub fn apply(&self, yaml: &str) -> Result<String, String> {
        let out = self.kubectl_stdin(&["apply", "-f", "-"], Some(yaml));
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// kubectl that must succeed; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The last lines of the API server's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.run_dir.path().join("kube-apiserver.log"))
            .unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = Command::new(repo_root().join("tools/k8sbin/down.sh"))
            .arg(self.run_dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Where the Go-built test binaries are: `$K8SBIN_DIR`, else the cache folder `build.sh` writes
/// for the pinned versions.
pub fn k8sbin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("K8SBIN_DIR") {
        return PathBuf::from(dir);
    }
    PathBuf::from(cached_bin_dir(&repo_root()))
}

/// Runs the helm of [`k8sbin_dir`] without a cluster, with throw-away helm home directories.
pub fn helm_offline(args: &[&str]) -> Output {
    let bin = k8sbin_dir().join("helm");
    assert!(
        bin.is_file(),
        "{} is missing: build it with tools/k8sbin/build.sh (tools/test-all.sh does)",
        bin.display()
    );
    let home = tempfile::tempdir().expect("temp dir");
    Command::new(bin)
        .args(args)
        .current_dir(repo_root())
        .env("HELM_CACHE_HOME", home.path().join("cache"))
        .env("HELM_CONFIG_HOME", home.path().join("config"))
        .env("HELM_DATA_HOME", home.path().join("data"))
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .output()
        .expect("run helm")
}

/// A process's output as text (lossy).
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `prometheus` or `promtool`, built from Go modules by `tools/k8sbin/build.sh` into
/// [`k8sbin_dir`]; a missing one fails the test with how to get it.
pub fn prometheus_bin(name: &str) -> PathBuf {
    let bin = k8sbin_dir().join(name);
    assert!(
        bin.is_file(),
        "{} is missing: build it with `tools/k8sbin/build.sh` (./tools/test-all.sh runs it), \
         or point K8SBIN_DIR at a directory that holds it",
        bin.display()
    );
    bin
}

/// The cache folder `build.sh` writes for the pinned versions.
fn cached_bin_dir(root: &Path) -> String {
    let versions =
        std::fs::read_to_string(root.join("tools/k8sbin/versions.env")).unwrap_or_default();
    let get = |k: &str| {
        versions
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or("")
            .trim()
            .to_string()
    };
    root.join(".cache/k8sbin")
        .join(format!(
            "{}-{}-{}-{}",
            get("K8S_VERSION"),
            get("ETCD_VERSION"),
            get("HELM_VERSION"),
            get("COREDNS_VERSION")
        ))
        .to_string_lossy()
        .into_owned()
}

fn which(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}

/// A binary of this workspace, built next to the test executables (`cargo test --workspace`
/// builds every package's binaries before running tests).
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join(name))
        .unwrap_or_else(|| PathBuf::from(name));
    assert!(
        bin.is_file(),
        "{} is missing: build the workspace first (`cargo test --workspace --no-run`, as ./tools/test-all.sh does)",
        bin.display()
    );
    bin
}

pub use tollgate_testkit::{Redis, free_port};

/// A blocking HTTP client builder. reqwest is built with rustls and no crypto provider of its
/// own (as in the binaries), so the process's provider is installed first.
pub fn http_client() -> reqwest::blocking::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::blocking::Client::builder()
}

/// A child process whose stderr is collected in the background; killed (by PID) on drop.
pub struct Proc {
    child: std::process::Child,
    pub pid: u32,
    logs: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    name: String,
}

impl Proc {
    /// Spawns `cmd` with stderr captured.
    pub fn spawn(name: &str, mut cmd: Command) -> Proc {
        use std::io::BufRead;
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let pid = child.id();
        let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        // Both streams are collected: some programs log to stdout, some to stderr.
        let readers: Vec<Box<dyn std::io::Read + Send>> = [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        .collect();
        for reader in readers {
            let logs = logs.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(reader).lines() {
                    let Ok(line) = line else { break };
                    if let Ok(mut l) = logs.lock() {
                        l.push(line);
                    }
                }
            });
        }
        Proc {
            child,
            pid,
            logs,
            name: name.to_string(),
        }
    }

    /// Waits until a log line contains `needle`; panics with the log after `timeout`.
    pub fn wait_for_log(&self, needle: &str, timeout: std::time::Duration) -> String {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(line) = self.logs().into_iter().find(|l| l.contains(needle)) {
                return line;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} did not log {needle:?} within {timeout:?}; log:\n{}",
                self.name,
                self.logs().join("\n")
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// SIGTERM, then wait up to `timeout` for a clean exit (SIGKILL after that).
    pub fn stop(&mut self, timeout: std::time::Duration) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status();
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let logs = self.logs();
            let tail = &logs[logs.len().saturating_sub(40)..];
            eprintln!(
                "--- last log lines of {} ---\n{}",
                self.name,
                tail.join("\n")
            );
        }
    }
}

/// One test at a time: each runs a control plane and many processes on a small machine, and
/// several measure timings.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Polls `f` every 20 ms until it is true; returns the time it took.
pub fn wait(
    what: &str,
    timeout: std::time::Duration,
    mut f: impl FnMut() -> bool,
) -> std::time::Duration {
    let start = std::time::Instant::now();
    while !f() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    start.elapsed()
}

/// Applies the RateLimitPolicy CRD and waits until it is Established. Polled: `kubectl wait`
/// fails outright if it runs before the CRD has any status.
pub fn install_crd(cp: &ControlPlane) {
    let crd = repo_root().join("manifests/crds/tollgate.dev_ratelimitpolicies.yaml");
    cp.ok(&["apply", "-f", crd.to_str().unwrap()]);
    wait(
        "the CRD to be Established",
        std::time::Duration::from_secs(60),
        || {
            let out = cp.kubectl(&[
                "get",
                "crd/ratelimitpolicies.tollgate.dev",
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Established\")].status}",
            ]);
            String::from_utf8_lossy(&out.stdout).trim() == "True"
        },
    );
}

/// The CRD, and namespace `shop` with the service account `app` its pods run as.
pub fn install_crd_and_shop(cp: &ControlPlane) {
    install_crd(cp);
    cp.ok(&["create", "namespace", "shop"]);
    cp.ok(&["create", "serviceaccount", "app", "-n", "shop"]);
}

/// Pod `name` in `shop` (label `app: shop-api`) as an API object only (no kubelet runs it),
/// and a token bound to it, written to `dir/<name>`; returns the token file.
pub fn pod_with_token(cp: &ControlPlane, name: &str, dir: &Path) -> PathBuf {
    let pod = format!(
        r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"{name}","namespace":"shop","labels":{{"app":"shop-api"}}}},"spec":{{"serviceAccountName":"app","containers":[{{"name":"app","image":"example.invalid/app"}}]}}}}"#
    );
    cp.apply(&pod).expect("create pod");
    let uid = cp.ok(&[
        "get",
        "pod",
        name,
        "-n",
        "shop",
        "-o",
        "jsonpath={.metadata.uid}",
    ]);
    let token = cp.ok(&[
        "create",
        "token",
        "app",
        "-n",
        "shop",
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        name,
        "--bound-object-uid",
        uid.trim(),
        "--duration",
        "1h",
    ]);
    let path = dir.join(name);
    std::fs::write(&path, token.trim()).expect("write token");
    path
}

/// An upstream app answering 200 to everything, with keep-alive (so the sidecar's pool reuses
/// connections and the app costs little CPU).
pub fn app() -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind app");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let mut seen = Vec::new();
                loop {
                    while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                        seen.drain(..end + 4);
                        if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                            .is_err()
                        {
                            return;
                        }
                    }
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
            });
        }
    });
    port
}

/// `tollgate-controller` on 127.0.0.1:`port` against `cp`, with `--lease-namespace default`
/// and `args`; returns once it has synced.
pub fn start_controller(cp: &ControlPlane, name: &str, port: u16, args: &[&str]) -> Proc {
    let mut cmd = Command::new(workspace_bin("tollgate-controller"));
    cmd.args([
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--lease-namespace",
        "default",
    ])
    .args(args)
    .env("KUBECONFIG", cp.kubeconfig());
    let p = Proc::spawn(name, cmd);
    p.wait_for_log("synced: ready", std::time::Duration::from_secs(30));
    p
}

/// The port of `field` (`listen`, `admin`) in a start-up line, JSON (`"listen":"127.0.0.1:p"`)
/// or text (`listen=127.0.0.1:p`).
fn started_port(line: &str, field: &str) -> Option<u16> {
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
        let addr = v.get(field)?.as_str()?;
        return addr.parse::<std::net::SocketAddr>().ok().map(|a| a.port());
    }
    let prefix = format!("{field}=");
    line.split_whitespace()
        .find_map(|t| t.strip_prefix(&prefix))
        .and_then(|addr| addr.trim_matches('"').parse::<std::net::SocketAddr>().ok())
        .map(|a| a.port())
}

/// A `tollgate-sidecar` process on loopback ports it picked itself.
pub struct Sidecar {
    pub proc: Proc,
    pub listen: u16,
    pub admin: u16,
}

impl Sidecar {
    /// Starts one named `name` in front of `upstream` with `args`; returns once it has started.
    /// The sidecar binds port 0 and its start-up line says which ports it got: a port picked
    /// free beforehand can be taken by another process before the sidecar binds it.
    pub fn start(name: &str, upstream: &str, args: &[&str]) -> Sidecar {
        let mut cmd = Command::new(workspace_bin("tollgate-sidecar"));
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--upstream",
            upstream,
        ])
        .args(args);
        let proc = Proc::spawn(name, cmd);
        let line = proc.wait_for_log(
            "tollgate-sidecar started",
            std::time::Duration::from_secs(30),
        );
        let port = |field: &str| {
            started_port(&line, field)
                .unwrap_or_else(|| panic!("no {field} port in the start-up line: {line}"))
        };
        let (listen, admin) = (port("listen"), port("admin"));
        Sidecar {
            proc,
            listen,
            admin,
        }
    }

    /// The sidecar of pod `pod` in `shop` in front of the app on `app_port`: rules streamed
    /// from the controller on `controller_port` with the pod's `token`, JSON logs, and `extra`.
    pub fn for_pod(
        pod: &str,
        app_port: u16,
        controller_port: u16,
        token: &Path,
        extra: &[&str],
    ) -> Sidecar {
        let controller = format!("http://127.0.0.1:{controller_port}");
        Sidecar::for_pod_at(pod, app_port, &controller, token, extra)
    }

    /// [`Sidecar::for_pod`] with the controller at `controller` (e.g. an `https://` URL).
    pub fn for_pod_at(
        pod: &str,
        app_port: u16,
        controller: &str,
        token: &Path,
        extra: &[&str],
    ) -> Sidecar {
        let mut args = vec![
            "--controller",
            controller,
            "--pod-name",
            pod,
            "--pod-namespace",
            "shop",
            "--token-file",
            token.to_str().expect("UTF-8 token path"),
            "--log-format",
            "json",
        ];
        args.extend_from_slice(extra);
        Sidecar::start(
            &format!("tollgate-sidecar {pod}"),
            &format!("http://127.0.0.1:{app_port}"),
            &args,
        )
    }
}

impl Sidecar {
    /// The status of `/readyz` (200 once the sidecar holds rules), 0 if it did not answer.
    pub fn readyz(&self) -> u16 {
        static CLIENT: std::sync::OnceLock<reqwest::blocking::Client> = std::sync::OnceLock::new();
        let client = CLIENT.get_or_init(|| {
            http_client()
                .timeout(std::time::Duration::from_secs(5))
                .build()
                .expect("HTTP client")
        });
        client
            .get(format!("http://127.0.0.1:{}/readyz", self.admin))
            .send()
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    }

    /// Waits until the sidecar holds rules (`/readyz` 200).
    pub fn wait_ready(&self, what: &str, timeout: std::time::Duration) {
        wait(what, timeout, || self.readyz() == 200);
    }
}

/// Policy `shop/shop-api-keys`: `requests` a minute per `x-api-key` on the `app: shop-api` pods.
pub fn shop_policy(requests: u64) -> String {
    format!(
        r#"apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {{name: shop-api-keys, namespace: shop}}
spec:
  targetRef:
    selector: {{matchLabels: {{app: shop-api}}}}
  rules:
  - name: per-api-key
    key: [{{header: x-api-key}}]
    limit: {{requests: {requests}, period: 1m}}
"#
    )
}
