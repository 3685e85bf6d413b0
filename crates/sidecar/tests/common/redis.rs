//! A real `redis-server` (and a delaying relay in front of it) for the tests of global rules.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (the kernel picks it; the listener is closed before return).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

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

/// A TCP relay on loopback to `target` that delays every chunk by `delay_ms` (changeable while
/// running) in both directions: a slow Redis without touching Redis. Returns its port and the
/// accept task.
pub async fn delaying_relay(
    target: u16,
    delay_ms: Arc<AtomicU64>,
) -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind relay");
    let port = listener.local_addr().expect("addr").port();
    let task = tokio::spawn(async move {
        loop {
            let Ok((inbound, _)) = listener.accept().await else {
                return;
            };
            let delay = delay_ms.clone();
            tokio::spawn(async move {
                let Ok(outbound) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                else {
                    return;
                };
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::spawn(pump(ri, wo, delay.clone()));
                tokio::spawn(pump(ro, wi, delay));
            });
        }
    });
    (port, task)
}

/// Copies `from` to `to`, each chunk written `delay_ms` after it was read (order kept).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay_ms: Arc<AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Duration, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((at, delay, data)) = rx.recv().await {
            tokio::time::sleep_until((at + delay).into()).await;
            if to.write_all(&data).await.is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = from.read(&mut buf).await {
        let delay = Duration::from_millis(delay_ms.load(Ordering::Relaxed));
        if n == 0 || tx.send((Instant::now(), delay, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.await;
}
