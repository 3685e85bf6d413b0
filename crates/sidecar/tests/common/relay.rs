//! TCP relays in front of Redis: a slow Redis, or a Redis replaced behind a Service, without
//! touching Redis.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
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

/// A Service in front of Redis whose endpoint can be replaced, the way a Redis pod is: new
/// connections go to the current `target`; after [`Replaceable::replace`], connections made
/// before it go silent (data is dropped both ways, nothing is closed), as when the old pod's
/// network disappears and no RST ever reaches the client.
pub struct Replaceable {
    pub port: u16,
    target: Arc<AtomicU16>,
    generation: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Replaceable {
    pub async fn start(target: u16) -> Replaceable {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind relay");
        let port = listener.local_addr().expect("addr").port();
        let target = Arc::new(AtomicU16::new(target));
        let generation = Arc::new(AtomicU64::new(0));
        let (t, g) = (target.clone(), generation.clone());
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let (t, g) = (t.clone(), g.clone());
                tokio::spawn(async move {
                    let born = g.load(Ordering::Acquire);
                    let to = t.load(Ordering::Acquire);
                    let Ok(outbound) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await
                    else {
                        return;
                    };
                    let (ri, wi) = inbound.into_split();
                    let (ro, wo) = outbound.into_split();
                    tokio::spawn(pump_while(ri, wo, g.clone(), born));
                    tokio::spawn(pump_while(ro, wi, g, born));
                });
            }
        });
        Replaceable {
            port,
            target,
            generation,
            task,
        }
    }

    /// The endpoint is now `target`; every existing connection goes silent.
    pub fn replace(&self, target: u16) {
        self.target.store(target, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

impl Drop for Replaceable {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` while the relay's generation is `born`; after that, swallows what
/// arrives and keeps both sockets open (the half that would close is parked instead).
async fn pump_while(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    generation: Arc<AtomicU64>,
    born: u64,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(n) if n > 0 => n,
            _ => break,
        };
        if generation.load(Ordering::Acquire) != born {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    if generation.load(Ordering::Acquire) != born {
        // A vanished peer sends no FIN either: keep the client's socket open until the test ends.
        std::future::pending::<()>().await;
    }
}
