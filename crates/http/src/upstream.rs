//! Keep-alive HTTP/1.1 connections to the app.
//!
//! The app is one fixed address, so this is a plain stack of idle `hyper::client::conn::http1`
//! senders instead of hyper-util's generic pooled client. The generic client hashed its pool
//! key three times, rebuilt the URI and spawned a task for every request; together that was
//! about a fifth of the sidecar's instructions per proxied request (bench/cpu_per_decision.py).
//!
//! A connection goes back on the stack when its response body has been read to the end and
//! hyper reports it ready for the next request; anything else (an error, a dropped response, an
//! upgrade) closes it. The lock is held only to push or pop, never across an await.

use std::sync::{Arc, Weak};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpStream;

/// Most idle connections kept; more are closed when their response ends. More than the
/// concurrency one sidecar normally sees, few enough not to hold the app's descriptors.
const MAX_IDLE: usize = 256;
/// Bound on one TCP connect to the app (the request as a whole has `--upstream-timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle connections are closed after one to two of these (60 s before, as hyper-util's pool).
const IDLE_SWEEP: Duration = Duration::from_secs(30);

/// Why a request did not get a response from the app.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("connect to {addr}: {source}")]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    #[error("connect to {addr}: timed out after {CONNECT_TIMEOUT:?}")]
    ConnectTimeout { addr: String },
    #[error("HTTP handshake with {addr}: {source}")]
    Handshake { addr: String, source: hyper::Error },
    #[error("{0}")]
    Request(hyper::Error),
}

/// The pool of connections to the app.
#[derive(Clone)]
pub struct Upstream {
    inner: Arc<Inner>,
}

struct Inner {
    /// `host:port` as given on the command line (resolved at every connect, as before).
    addr: String,
    idle: Mutex<IdleList>,
    builder: http1::Builder,
}

struct IdleList {
    /// Most recently released last: reusing the warmest connection keeps the others idle long
    /// enough for the sweep to close them when traffic drops.
    conns: Vec<Idle>,
    /// Advanced by every sweep; a connection released in an older epoch is closed.
    epoch: u64,
    sweeper: bool,
}

struct Idle {
    sender: http1::SendRequest<Incoming>,
    epoch: u64,
}

/// A connection lent to one request. Dropping it closes the connection; [`Lease::release`]
/// returns it to the pool instead.
pub struct Lease {
    sender: Option<http1::SendRequest<Incoming>>,
    pool: Arc<Inner>,
}

impl Upstream {
    /// A pool for `addr` (`host:port`). Connects lazily.
    pub fn new(addr: String) -> Upstream {
        let builder = http1::Builder::new();
        Upstream {
            inner: Arc::new(Inner {
                addr,
                idle: Mutex::new(IdleList {
                    conns: Vec::new(),
                    epoch: 0,
                    sweeper: false,
                }),
                builder,
            }),
        }
    }

    /// Sends `req` (origin-form URI, Host set) and waits for the response head. A pooled
    /// connection that turns out to be closed before the request was written is replaced by a
    /// fresh one, so a keep-alive race with the app never fails a request.
    pub async fn send(
        &self,
        mut req: Request<Incoming>,
    ) -> Result<(Response<Incoming>, Lease), UpstreamError> {
        while let Some(mut sender) = self.inner.checkout() {
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok((resp, self.lease(sender))),
                Err(mut e) => match e.take_message() {
                    // Not written: the connection was closing. Try the next one.
                    Some(back) => req = back,
                    None => return Err(UpstreamError::Request(e.into_error())),
                },
            }
        }
        let mut sender = self.connect().await?;
        match sender.send_request(req).await {
            Ok(resp) => Ok((resp, self.lease(sender))),
            Err(e) => Err(UpstreamError::Request(e)),
        }
    }

    fn lease(&self, sender: http1::SendRequest<Incoming>) -> Lease {
        Lease {
            sender: Some(sender),
            pool: Arc::clone(&self.inner),
        }
    }

    /// The app's `host:port`.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    async fn connect(&self) -> Result<http1::SendRequest<Incoming>, UpstreamError> {
        let addr = &self.inner.addr;
        let stream = dial(addr).await?;
        let (sender, conn) = self
            .inner
            .builder
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|source| UpstreamError::Handshake {
                addr: addr.clone(),
                source,
            })?;
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        self.inner.start_sweeper();
        Ok(sender)
    }
}

/// A new TCP connection to the app, within [`CONNECT_TIMEOUT`].
pub async fn dial(addr: &str) -> Result<TcpStream, UpstreamError> {
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(source)) => {
            return Err(UpstreamError::Connect {
                addr: addr.to_string(),
                source,
            });
        }
        Err(_) => {
            return Err(UpstreamError::ConnectTimeout {
                addr: addr.to_string(),
            });
        }
    };
    // Requests and responses are written whole; Nagle would only delay the next one.
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

impl Inner {
    /// The most recently released connection that is still open.
    fn checkout(&self) -> Option<http1::SendRequest<Incoming>> {
        loop {
            let sender = self.idle.lock().conns.pop()?.sender;
            if !sender.is_closed() {
                return Some(sender);
            }
        }
    }

    fn put(&self, sender: http1::SendRequest<Incoming>) {
        let mut idle = self.idle.lock();
        if idle.conns.len() < MAX_IDLE {
            let epoch = idle.epoch;
            idle.conns.push(Idle { sender, epoch });
            return;
        }
        drop(idle);
        // Over the bound: `sender` is dropped here, outside the lock, closing the connection.
    }

    /// Starts the idle sweep once, from within the runtime (the first connect).
    fn start_sweeper(self: &Arc<Self>) {
        {
            let mut idle = self.idle.lock();
            if idle.sweeper {
                return;
            }
            idle.sweeper = true;
        }
        tokio::spawn(sweep(Arc::downgrade(self)));
    }
}

/// Closes connections idle for a whole sweep interval; ends with the pool.
async fn sweep(pool: Weak<Inner>) {
    let mut tick = tokio::time::interval(IDLE_SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(pool) = pool.upgrade() else { return };
        let stale: Vec<Idle> = {
            let mut idle = pool.idle.lock();
            let epoch = idle.epoch;
            idle.epoch += 1;
            idle.conns
                .extract_if(.., |c| c.epoch != epoch || c.sender.is_closed())
                .collect()
        };
        // Closed outside the lock.
        drop(stale);
    }
}

impl Lease {
    /// The response body was read to the end: keep the connection for the next request. If
    /// hyper has not yet seen the exchange finish (the request body may still be streaming), a
    /// small task waits for that instead of closing a healthy connection.
    pub fn release(&mut self) {
        let Some(mut sender) = self.sender.take() else {
            return;
        };
        if sender.is_ready() {
            self.pool.put(sender);
        } else if !sender.is_closed()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let pool = Arc::clone(&self.pool);
            rt.spawn(async move {
                if sender.ready().await.is_ok() {
                    pool.put(sender);
                }
            });
        }
    }
}
