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
            "{}-{}-{}",
            get("K8S_VERSION"),
            get("ETCD_VERSION"),
            get("HELM_VERSION")
        ))
        .to_string_lossy()
        .into_owned()
}

fn which(bin: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
}
