//! Accepting client connections, for every edge that listens (the HTTP proxy, the Envoy rate
//! limit service).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

/// The next connection, with `TCP_NODELAY` set (answers are small and should leave at once).
/// An accept error (out of file descriptors and similar) backs off for 50 ms instead of
/// spinning.
pub async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                return (stream, peer);
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
