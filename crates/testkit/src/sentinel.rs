//! Real `redis-sentinel` processes watching a master, killed by PID when dropped.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// A `redis-sentinel` child on a loopback port monitoring one master, killed when dropped.
pub struct Sentinel {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    /// A sentinel monitoring `master` (its name) at `127.0.0.1:master_port` with `quorum`,
    /// declaring the master down after `down_after`; returns once it answers PING.
    pub fn start(master: &str, master_port: u16, quorum: u32, down_after: Duration) -> Sentinel {
        crate::require_tool(
            "redis-sentinel",
            "install it with `apt-get install redis-sentinel` (./tools/test-all.sh does this)",
        );
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        // Sentinel rewrites its configuration file, so each gets a writable one of its own.
        let conf = dir.path().join("sentinel.conf");
        let ms = down_after.as_millis();
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                 sentinel monitor {master} 127.0.0.1 {master_port} {quorum}\n\
                 sentinel down-after-milliseconds {master} {ms}\n\
                 sentinel failover-timeout {master} {timeout}\n\
                 sentinel parallel-syncs {master} 1\n",
                dir = dir.path().display(),
                timeout = (ms * 4).max(3000),
            ),
        )
        .expect("write sentinel.conf");
        let child = Command::new("redis-sentinel")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-sentinel ({e})"));
        let s = Sentinel {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.cli(&["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < deadline,
                "redis-sentinel on port {port} did not answer PING"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        s
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `redis-cli` against this sentinel; stdout.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The port of the master this sentinel currently names for `master`.
    pub fn master_port(&self, master: &str) -> Option<u16> {
        let out = self.cli(&["SENTINEL", "get-master-addr-by-name", master]);
        out.lines().nth(1).and_then(|p| p.trim().parse().ok())
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
