//! A real `redis-server` on a loopback port, killed by PID when dropped.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// A `redis-server` child on a loopback port, killed (by PID) when dropped.
pub struct Redis {
    /// `None` once killed, so a test can kill it and start another on the same port.
    child: Option<Child>,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    /// A plain instance on a free port.
    pub fn start() -> Redis {
        Redis::start_on(free_port(), &[])
    }

    /// An instance on `port` (a restart reuses the old one) with extra `redis-server`
    /// arguments; returns once it answers PING.
    pub fn start_on(port: u16, extra: &[&str]) -> Redis {
        let dir = tempfile::tempdir().expect("temp dir");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(extra)
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start redis-server ({e}); install it with `apt-get install \
                     redis-server` (./tools/test-all.sh does this)"
                )
            });
        let r = Redis {
            child: Some(child),
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while r.cli(&["PING"]).trim() != "PONG" {
            assert!(
                Instant::now() < deadline,
                "redis-server on port {port} did not answer PING"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// PID of the server (for clean-up lists kept outside the test).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("redis-server running").id()
    }

    /// `redis-cli` against this server; its stdout, empty if it could not run.
    pub fn cli(&self, args: &[&str]) -> String {
        Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// `calls` of one command from INFO commandstats.
    pub fn command_calls(&self, cmd: &str) -> u64 {
        let info = self.cli(&["INFO", "commandstats"]);
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// `used_memory` from INFO memory, in bytes.
    pub fn used_memory(&self) -> u64 {
        self.cli(&["INFO", "memory"])
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// SIGKILL (no chance to persist or close connections cleanly).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}
