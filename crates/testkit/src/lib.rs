//! Real parts shared by the sidecar's integration tests and the end-to-end tests: free
//! loopback ports, `redis-server` processes stopped by PID, and a PKI made with the `openssl`
//! binary. Test support only; never a dependency of a shipped binary.

mod cluster;
mod monitor;
pub mod pki;
mod redis;
mod sentinel;

pub use cluster::RedisCluster;
pub use monitor::Monitor;
pub use redis::Redis;
pub use sentinel::Sentinel;

/// A free TCP port on 127.0.0.1 (the kernel picks it; the listener is closed before return).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Fails the test unless `bin` is on `PATH`; `how` says how to get it.
pub fn require_tool(bin: &str, how: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()));
    assert!(found, "`{bin}` is not on PATH; {how}");
}
