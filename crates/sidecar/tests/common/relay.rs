//! A delaying TCP relay in front of Redis: a slow Redis without touching Redis.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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
