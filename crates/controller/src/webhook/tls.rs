//! The webhook's serving certificate: loaded from `tls.crt`/`tls.key` in a directory (a mounted
//! Secret from cert-manager, or the files self-signed mode writes), swapped in without a
//! restart when the files change. New TLS handshakes pick the new certificate up; open
//! connections keep the one they started with.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use parking_lot::{Mutex, RwLock};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

/// Bound on a TLS handshake, so a client that connects and stalls cannot hold a task.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Completes the server side of a TLS handshake on `tcp` (webhook and rule-stream listeners);
/// `None`, logged at debug with `what`, if it fails or stalls past [`HANDSHAKE_TIMEOUT`].
pub async fn accept(
    acceptor: &tokio_rustls::TlsAcceptor,
    tcp: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    what: &str,
) -> Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(stream)) => Some(stream),
        Ok(Err(error)) => {
            if client_distrusts_us(&error) {
                tracing::warn!(%peer, %error, "{what} client rejected this controller's certificate: it trusts another CA, \
                    typically a sidecar injected before the webhook CA Secret was re-created (reinstall without keeping it); \
                    restore that Secret or re-create the pod so it is injected with the current CA");
            } else {
                tracing::debug!(%peer, %error, "{what} TLS handshake failed");
            }
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "{what} TLS handshake timed out");
            None
        }
    }
}

/// Whether the client ended the handshake because it does not trust our certificate chain.
fn client_distrusts_us(error: &std::io::Error) -> bool {
    use rustls::AlertDescription as A;
    matches!(
        error
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>()),
        Some(rustls::Error::AlertReceived(
            A::UnknownCA | A::BadCertificate
        ))
    )
}

/// File names in the certificate directory (the `kubernetes.io/tls` Secret keys).
pub const CERT_FILE: &str = "tls.crt";
pub const KEY_FILE: &str = "tls.key";
pub const CA_FILE: &str = "ca.crt";

/// The current serving certificate; also the rustls certificate resolver.
#[derive(Debug, Default)]
pub struct CertStore {
    current: RwLock<Option<Arc<CertifiedKey>>>,
    /// SHA-256 of the PEM files last loaded, to notice changes cheaply.
    loaded: Mutex<Option<[u8; 32]>>,
}

impl CertStore {
    pub fn new() -> Arc<CertStore> {
        Arc::new(CertStore::default())
    }

    /// Whether a certificate is loaded.
    pub fn is_loaded(&self) -> bool {
        self.current.read().is_some()
    }

    /// Installs a certificate chain and key given as PEM. Returns `Ok(false)` when they are
    /// the ones already in use.
    pub fn set_pem(&self, cert_pem: &[u8], key_pem: &[u8]) -> anyhow::Result<bool> {
        let mut h = Sha256::new();
        h.update(cert_pem);
        h.update([0u8]);
        h.update(key_pem);
        let digest: [u8; 32] = h.finalize().into();
        let mut loaded = self.loaded.lock();
        if loaded.as_ref() == Some(&digest) {
            return Ok(false);
        }
        let key = certified_key(cert_pem, key_pem)?;
        *self.current.write() = Some(Arc::new(key));
        *loaded = Some(digest);
        Ok(true)
    }

    /// Loads `tls.crt` and `tls.key` from `dir`. Returns `Ok(true)` when a new certificate
    /// was installed.
    pub fn load_dir(&self, dir: &Path) -> anyhow::Result<bool> {
        let cert = std::fs::read(dir.join(CERT_FILE))
            .with_context(|| format!("cannot read {}", dir.join(CERT_FILE).display()))?;
        let key = std::fs::read(dir.join(KEY_FILE))
            .with_context(|| format!("cannot read {}", dir.join(KEY_FILE).display()))?;
        self.set_pem(&cert, &key)
    }

    /// Re-reads the directory every `interval` (every second until a first certificate is
    /// loaded) until shutdown. A broken update keeps the previous certificate.
    pub async fn watch_dir(
        self: Arc<Self>,
        dir: std::path::PathBuf,
        interval: Duration,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut last_error: Option<String> = None;
        loop {
            match self.load_dir(&dir) {
                Ok(true) => {
                    tracing::info!(dir = %dir.display(), "webhook serving certificate loaded");
                    last_error = None;
                }
                Ok(false) => last_error = None,
                Err(error) => {
                    let msg = format!("{error:#}");
                    if last_error.as_deref() != Some(msg.as_str()) {
                        if self.is_loaded() {
                            tracing::warn!(error = %msg, "cannot reload the webhook certificate; keeping the previous one");
                        } else {
                            tracing::warn!(error = %msg, "no webhook certificate yet; TLS handshakes fail until one is loaded");
                        }
                        last_error = Some(msg);
                    }
                }
            }
            let wait = if self.is_loaded() {
                interval
            } else {
                interval.min(Duration::from_secs(1))
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { return },
            }
        }
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current.read().clone()
    }
}

/// Parses a PEM chain and key into a rustls `CertifiedKey` (RSA, ECDSA or Ed25519 keys).
pub fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> anyhow::Result<CertifiedKey> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .context("tls.crt is not PEM")?;
    anyhow::ensure!(!certs.is_empty(), "tls.crt holds no certificate");
    let key = PrivateKeyDer::from_pem_slice(key_pem).context("tls.key holds no private key")?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| anyhow::anyhow!("tls.key: unsupported key: {e}"))?;
    let ck = CertifiedKey::new(certs, signing);
    ck.keys_match()
        .map_err(|e| anyhow::anyhow!("tls.crt and tls.key do not belong together: {e}"))?;
    Ok(ck)
}

/// A rustls server configuration that takes its certificate from `store` and speaks HTTP/2
/// and HTTP/1.1.
pub fn server_config(store: Arc<CertStore>) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_cert_resolver(store);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Writes `name` into `dir` atomically (temporary file + rename) unless it already holds
/// `content`. Returns whether it wrote.
pub fn write_if_changed(dir: &Path, name: &str, content: &[u8], mode: u32) -> anyhow::Result<bool> {
    let path = dir.join(name);
    if std::fs::read(&path).ok().as_deref() == Some(content) {
        return Ok(false);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, content).with_context(|| format!("cannot write {}", tmp.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot chmod {}", tmp.display()))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot replace {}", path.display()))?;
    Ok(true)
}
