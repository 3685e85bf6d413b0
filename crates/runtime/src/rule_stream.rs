//! Controller mode: rules and membership come from tollgate-controller's rule stream.
//!
//! The sidecar opens `GET /v1/watch` with its projected ServiceAccount token, applies each
//! snapshot atomically (a request sees the old or the new rule set, never a mix), acknowledges
//! the version it enforces, and reconnects with jittered exponential backoff when the stream
//! breaks — enforcing the last-known-good rules meanwhile. With `--rules-cache` the last good
//! set is also kept on disk, so a sidecar that (re)starts while the controller is unreachable
//! enforces it; one with no rules at all waits `--rules-wait`, then follows `--without-rules`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::{CertificateDer, ServerName};
use tollgate_crd::stream::{
    Ack, MAX_LINE_BYTES, MAX_REPORTED_KEYS, ReportedKey, StreamMessage, TopKeysReport, parse_line,
};

use crate::args::WithoutRules;
use crate::rules_cache::RulesCache;
use tollgate_engine::shared::Shared;

/// Where and as whom to connect.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    pub url: String,
    pub namespace: String,
    pub pod: String,
    /// Projected ServiceAccount token; re-read at every connect because the kubelet rotates it.
    pub token_file: PathBuf,
    /// Reconnect when nothing (not even a heartbeat) arrived for this long.
    pub idle_timeout: Duration,
    /// How often the most-rejected keys are reported (`POST /v1/top-keys`).
    pub top_keys_interval: Duration,
    /// CA certificates an `https://` controller must chain to (they replace the system roots).
    pub ca: Option<Vec<CertificateDer<'static>>>,
    /// Where the last good rule set is kept across restarts, if anywhere.
    pub cache: Option<RulesCache>,
    /// How long to wait for first rules before `without_rules` applies.
    pub rules_wait: Duration,
    pub without_rules: WithoutRules,
}

/// How long a TCP connect or a TLS handshake to the controller may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How a sidecar that has no rules yet gets started when the stream cannot deliver them.
struct Startup {
    /// The wait is over (or rules arrived): nothing more to decide.
    settled: bool,
    cache_tried: bool,
    deadline: tokio::time::Instant,
    /// The last attempt ended with the controller refusing this pod's identity.
    identity_refused: bool,
}

impl Startup {
    fn new(wait: Duration) -> Startup {
        Startup {
            settled: false,
            cache_tried: false,
            deadline: tokio::time::Instant::now() + wait,
            identity_refused: false,
        }
    }

    /// After each attempt: whether the controller refused this pod's identity (`401`/`403`).
    /// That is an authentication failure, not a missing controller: it never leads to serving
    /// without limits, and a pass-through already granted is withdrawn (the pod turns unready).
    /// Cached rules, already in force, stay.
    fn refused(&mut self, refused: bool, config: &ControllerConfig, shared: &Shared) {
        self.identity_refused = refused;
        shared
            .metrics()
            .controller_stream_refused
            .set(i64::from(refused));
        if refused && shared.metrics().rules_passthrough.get() == 1 {
            shared.metrics().rules_passthrough.set(0);
            shared.set_ready(false);
            tracing::error!(controller = %config.url, "the controller refuses this pod's identity: no longer ready without rules (--without-rules=pass-through covers an unreachable controller, not a refused one)");
        }
    }

    /// The stream failed before any rules arrived: enforce the cached set, once, if usable.
    fn try_cache(&mut self, config: &ControllerConfig, shared: &Shared, apply: &dyn Apply) {
        if self.cache_tried || shared.is_ready() {
            return;
        }
        self.cache_tried = true;
        let Some(cache) = &config.cache else {
            return;
        };
        let path = cache.path().display().to_string();
        match cache.load() {
            Ok(Some(cached)) => {
                let (version, age) = (cached.version, cached.age_seconds);
                match apply.rules(version, cached.policies) {
                    Ok(()) => {
                        // The last membership seen keeps fail-open shares near their size.
                        apply.members(cached.members);
                        shared.metrics().rules_from_cache.set(1);
                        self.settled = true;
                        tracing::warn!(version, age_seconds = age, cache = %path, "controller unreachable: enforcing the rules this pod last received until the stream is back");
                    }
                    Err(e) => {
                        tracing::error!(error = %e, cache = %path, "cached rules refused")
                    }
                }
            }
            Ok(None) => tracing::info!(cache = %path, "no cached rules (a new pod)"),
            Err(e) => tracing::warn!(error = %e, "cached rules not used"),
        }
    }

    /// `--rules-wait` is over: if there are still no rules, follow `--without-rules`.
    fn wait_over(&mut self, config: &ControllerConfig, shared: &Shared, apply: &dyn Apply) {
        self.try_cache(config, shared, apply);
        self.settled = true;
        if shared.is_ready() {
            return;
        }
        if self.identity_refused {
            tracing::error!(waited = ?config.rules_wait, controller = %config.url, "no rules: the controller refuses this pod's identity; staying unready until it accepts it");
            return;
        }
        match config.without_rules {
            WithoutRules::PassThrough => {
                shared.metrics().rules_passthrough.set(1);
                shared.set_ready(true);
                tracing::warn!(waited = ?config.rules_wait, controller = %config.url, "no rules from the controller: ready, forwarding every request without limits until rules arrive (--without-rules=pass-through)");
            }
            WithoutRules::Unready => {
                tracing::warn!(waited = ?config.rules_wait, controller = %config.url, "no rules from the controller: staying unready until rules arrive (--without-rules=unready)");
            }
        }
    }
}

/// What the stream delivers to the rest of the sidecar.
pub trait Apply: Send + Sync {
    /// Installs a rule set; returns an error message if it could not be built.
    fn rules(
        &self,
        version: u64,
        policies: Vec<tollgate_crd::CompiledPolicy>,
    ) -> Result<(), String>;
    /// Live sidecar counts per policy, as the controller sees them.
    fn members(&self, members: BTreeMap<String, u32>);
}

/// The rule stream's health, for the admin port: a sidecar without rules keeps its pod unready,
/// and its readiness body and `/debug/stream` must say why. Updated once per connect attempt.
#[derive(Default)]
pub struct StreamHealth {
    state: parking_lot::Mutex<StreamState>,
}

#[derive(Default)]
struct StreamState {
    connected: bool,
    failed_attempts: u64,
    last_error: Option<(String, std::time::Instant)>,
}

impl StreamHealth {
    fn connected(&self) {
        let mut s = self.state.lock();
        s.connected = true;
        s.failed_attempts = 0;
    }

    fn failed(&self, error: &str) {
        let mut s = self.state.lock();
        s.connected = false;
        s.failed_attempts += 1;
        s.last_error = Some((error.to_string(), std::time::Instant::now()));
    }

    /// The last error with a hint at its usual cause, if the stream ever failed.
    pub fn last_error(&self) -> Option<String> {
        let s = self.state.lock();
        s.last_error.as_ref().map(|(e, _)| match hint(e) {
            Some(h) => format!("{e} ({h})"),
            None => e.clone(),
        })
    }

    /// `/debug/stream`.
    pub fn to_json(&self, controller: &str) -> serde_json::Value {
        let s = self.state.lock();
        let (error, ago) = match &s.last_error {
            Some((e, at)) => (Some(e.as_str()), Some(at.elapsed().as_secs())),
            None => (None, None),
        };
        serde_json::json!({
            "controller": controller,
            "connected": s.connected,
            "failedAttemptsSinceConnected": s.failed_attempts,
            "lastError": error,
            "lastErrorSecondsAgo": ago,
            "hint": error.and_then(hint),
        })
    }
}

/// The whole cause chain: an error's own message often reads the same for a DNS failure, a
/// refused connection and an unknown CA; the cause is in its sources.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

/// What usually causes an error like this one, in the words a user can act on.
fn hint(chain: &str) -> Option<&'static str> {
    let lower = chain.to_ascii_lowercase();
    let hints: [(&[&str], &'static str); 5] = [
        (
            &[
                "dns error",
                "failed to lookup address",
                "name or service not known",
            ],
            "the controller's host name does not resolve: check --controller and cluster DNS",
        ),
        (
            &["connection refused"],
            "nothing listens there: is the controller running, and does its Service have endpoints?",
        ),
        (
            &["unknownissuer", "invalid peer certificate", "certificate"],
            "the controller's certificate does not chain to --controller-ca: was tollgate \
             reinstalled with a new CA? restart the pod to pick up the current bundle",
        ),
        (
            &["timed out", "deadline"],
            "no answer: a NetworkPolicy or firewall may drop traffic to the controller",
        ),
        (
            &["401", "403", "unauthorized", "forbidden"],
            "the controller refused this pod's ServiceAccount token",
        ),
    ];
    hints
        .iter()
        .find(|(needles, _)| needles.iter().any(|n| lower.contains(n)))
        .map(|(_, h)| *h)
}

/// Why one stream attempt ended.
struct Ended {
    error: String,
    cause: EndCause,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum EndCause {
    /// No stream: the controller could not be reached, or answered with an error other than a
    /// refusal of this pod's identity.
    Unavailable,
    /// The controller refused this pod's identity (`401`/`403`): an authentication failure,
    /// which never counts as "no controller yet".
    Refused,
    /// The stream worked, then broke or was ended by the controller.
    Interrupted,
    /// The controller refused an ack sent on the stream's own connection (`409`): what this
    /// stream delivered is no longer what the replica holds. A new stream sorts it out; its
    /// backoff is not reset, so a replica that keeps refusing cannot cause a reconnect loop.
    AckConflict,
}

impl Ended {
    fn new(cause: EndCause, error: impl Into<String>) -> Ended {
        Ended {
            error: error.into(),
            cause,
        }
    }
}

/// Runs the stream client forever.
pub async fn run(
    config: ControllerConfig,
    shared: Arc<Shared>,
    apply: Arc<dyn Apply>,
    health: Arc<StreamHealth>,
) {
    crate::install_crypto_provider();
    let target = match Target::parse(&config) {
        Ok(t) => t,
        Err(e) => {
            health.failed(&e);
            tracing::error!(error = %e, "cannot use the controller URL; no rules will arrive");
            return;
        }
    };
    shared.audit().start_reporting();
    let current: CurrentSession = Arc::default();
    tokio::spawn(report_top_keys(
        Arc::clone(&current),
        config.clone(),
        Arc::clone(&shared),
    ));
    let mut held: Option<(String, u64)> = None; // (epoch, version)
    // The rules last written to the cache, so membership changes can be written with them.
    let mut saved: Option<(u64, Vec<tollgate_crd::CompiledPolicy>)> = None;
    let mut backoff = Backoff::new();
    let mut startup = Startup::new(config.rules_wait);
    loop {
        let attempt = stream_once(
            &target,
            &current,
            &config,
            &shared,
            apply.as_ref(),
            &mut held,
            &mut saved,
            &health,
        );
        tokio::pin!(attempt);
        // The wait for first rules runs beside the attempt (a connect may hang for long).
        let ended = loop {
            tokio::select! {
                r = &mut attempt => break r,
                () = tokio::time::sleep_until(startup.deadline), if !startup.settled => {
                    startup.wait_over(&config, &shared, apply.as_ref());
                }
            }
        };
        *current.lock() = None;
        startup.try_cache(&config, &shared, apply.as_ref());
        startup.refused(ended.cause == EndCause::Refused, &config, &shared);
        if ended.cause == EndCause::Interrupted {
            // It had worked: a stream that broke starts over from the shortest backoff.
            backoff.reset();
        }
        let e = ended.error;
        health.failed(&e);
        if ended.cause == EndCause::Refused {
            tracing::error!(error = %e, controller = %config.url, "the controller refuses this pod's rule stream (401/403, its answer says why: usually the token's audience against the controller's --token-audience, or a plain http:// URL where it serves TLS only); no new rules until it accepts it");
        } else if shared.is_ready() {
            tracing::warn!(error = %e, controller = %config.url, "rule stream interrupted; enforcing the last-known-good rules");
        } else {
            tracing::warn!(error = %e, hint = hint(&e), controller = %config.url, "rule stream unavailable; not ready until the first rules arrive");
        }
        shared.metrics().controller_connected.set(0);
        tokio::time::sleep(backoff.next()).await;
    }
}

/// The session of the open stream, if any: top-keys reports go through it.
type CurrentSession = Arc<parking_lot::Mutex<Option<Session>>>;

/// The `/v1/watch` path and query for this pod.
fn watch_path(config: &ControllerConfig, shared: &Shared, held: Option<&(String, u64)>) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    q.append_pair("namespace", &config.namespace)
        .append_pair("pod", &config.pod);
    if let Some((epoch, version)) = held {
        q.append_pair("since", &version.to_string())
            .append_pair("epoch", epoch);
    }
    if shared.global().is_none() {
        // Global rules are enforced per sidecar here: the controller's status says so.
        q.append_pair("redis", "false");
    }
    format!("/v1/watch?{}", q.finish())
}

/// Opens one session and its stream; returns the accepted response's body.
async fn open_stream(
    target: &Target,
    current: &CurrentSession,
    config: &ControllerConfig,
    path: &str,
) -> Result<(Session, hyper::body::Incoming), Ended> {
    let unavailable = |e: String| Ended::new(EndCause::Unavailable, e);
    let token = std::fs::read_to_string(&config.token_file).map_err(|e| {
        unavailable(format!(
            "cannot read token {}: {e}",
            config.token_file.display()
        ))
    })?;
    let session = Session::open(target)
        .await
        .map_err(|e| unavailable(format!("connect {}: {e}", config.url)))?;
    let resp = session
        .send(http::Method::GET, path, token.trim(), None)
        .await
        .map_err(|e| unavailable(format!("connect {}: {e}", config.url)))?;
    let status = resp.status();
    if !status.is_success() {
        let body = small_body(resp.into_body()).await;
        let cause = match status.as_u16() {
            401 | 403 => EndCause::Refused,
            _ => EndCause::Unavailable,
        };
        return Err(Ended::new(
            cause,
            format!("controller answered {status}: {body}"),
        ));
    }
    *current.lock() = Some(session.clone());
    Ok((session, resp.into_body()))
}

#[allow(clippy::too_many_arguments)]
async fn stream_once(
    target: &Target,
    current: &CurrentSession,
    config: &ControllerConfig,
    shared: &Shared,
    apply: &dyn Apply,
    held: &mut Option<(String, u64)>,
    saved: &mut Option<(u64, Vec<tollgate_crd::CompiledPolicy>)>,
    health: &StreamHealth,
) -> Ended {
    let path = watch_path(config, shared, held.as_ref());
    let (session, mut body) = match open_stream(target, current, config, &path).await {
        Ok(s) => s,
        Err(ended) => return ended,
    };
    connected(config, shared, health);
    let interrupted = |e: String| Ended::new(EndCause::Interrupted, e);
    let mut buf: Vec<u8> = Vec::new();
    // (epoch, version) of the last snapshot this stream delivered and this sidecar applied.
    let mut applied_here: Option<(String, u64)> = None;
    loop {
        let frame = match tokio::time::timeout(config.idle_timeout, body.frame()).await {
            Err(_) => return interrupted(format!("no message for {:?}", config.idle_timeout)),
            Ok(None) => return interrupted("stream closed by the controller".to_string()),
            Ok(Some(Err(e))) => return interrupted(format!("read: {}", error_chain(&e))),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(chunk) = frame.into_data() else {
            continue; // trailers
        };
        buf.extend_from_slice(&chunk);
        while let Some(line) = next_line(&mut buf) {
            let message = match parse_line(&line) {
                Ok(m) => m,
                Err(e) => return interrupted(e),
            };
            let handled = match message {
                StreamMessage::Snapshot {
                    wire_version,
                    version,
                    policies,
                    members,
                    epoch,
                    key_hash_secret,
                } => {
                    if let Some(secret) = &key_hash_secret {
                        shared.audit().adopt_controller_secret(secret);
                    }
                    if applied_here.as_ref() == Some(&(epoch.clone(), version)) {
                        // The same rules sent again on this stream for a rotated key-hash
                        // secret (taken above): nothing to apply or acknowledge.
                        continue;
                    }
                    applied_here = Some((epoch.clone(), version));
                    let snapshot = Snapshot {
                        wire_version,
                        version,
                        policies,
                        members,
                        epoch,
                    };
                    on_snapshot(&session, config, shared, apply, held, saved, snapshot).await
                }
                StreamMessage::Members { members, .. } => {
                    on_members(config, apply, saved.as_ref(), members).await;
                    Ok(())
                }
                StreamMessage::Heartbeat { .. } => Ok(()),
            };
            if let Err(ended) = handled {
                return ended;
            }
        }
        if buf.len() > MAX_LINE_BYTES {
            return interrupted(format!("stream line longer than {MAX_LINE_BYTES} bytes"));
        }
    }
}

/// The stream is open: the metrics, `/debug/stream` and the log say so.
fn connected(config: &ControllerConfig, shared: &Shared, health: &StreamHealth) {
    shared.metrics().controller_connected.set(1);
    shared.metrics().controller_stream_refused.set(0);
    health.connected();
    tracing::info!(controller = %config.url, "rule stream connected");
}

/// The next non-blank line of `buf` without its newline, taken out of it; `None` until a
/// whole line has arrived.
fn next_line(buf: &mut Vec<u8>) -> Option<Vec<u8>> {
    while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
        let mut line: Vec<u8> = buf.drain(..=pos).collect();
        line.pop();
        if !line.iter().all(u8::is_ascii_whitespace) {
            return Some(line);
        }
    }
    None
}

/// A membership update: applied, and kept in the cache with the rules last saved. A pod
/// restarted from the cache while the controller is away then divides fail-open shares by the
/// live count it last heard of, not by the one of its last rules snapshot.
async fn on_members(
    config: &ControllerConfig,
    apply: &dyn Apply,
    saved: Option<&(u64, Vec<tollgate_crd::CompiledPolicy>)>,
    members: BTreeMap<String, u32>,
) {
    if let (Some(cache), Some((version, policies))) = (&config.cache, saved) {
        save(cache.clone(), *version, policies.clone(), members.clone()).await;
    }
    apply.members(members);
}

/// A snapshot as it came off the stream.
struct Snapshot {
    wire_version: u32,
    version: u64,
    policies: Vec<tollgate_crd::CompiledPolicy>,
    members: BTreeMap<String, u32>,
    epoch: String,
}

/// Applies a snapshot, acknowledges it on the stream's connection and caches it.
async fn on_snapshot(
    session: &Session,
    config: &ControllerConfig,
    shared: &Shared,
    apply: &dyn Apply,
    held: &mut Option<(String, u64)>,
    saved: &mut Option<(u64, Vec<tollgate_crd::CompiledPolicy>)>,
    s: Snapshot,
) -> Result<(), Ended> {
    if s.wire_version != tollgate_crd::WIRE_VERSION {
        return Err(Ended::new(
            EndCause::Interrupted,
            format!(
                "controller speaks wire version {}, this sidecar {}",
                s.wire_version,
                tollgate_crd::WIRE_VERSION
            ),
        ));
    }
    if let Some((held_epoch, held_version)) = held.as_ref()
        && *held_epoch == s.epoch
        && s.version < *held_version
    {
        // Versions only grow within one controller epoch: this one is stale.
        tracing::warn!(
            version = s.version,
            held = *held_version,
            "ignoring an older snapshot"
        );
        return Ok(());
    }
    let to_save = config
        .cache
        .as_ref()
        .map(|c| (c.clone(), s.policies.clone(), s.members.clone()));
    if let Err(e) = apply.rules(s.version, s.policies) {
        // Keep the rules in force; the controller's status shows the policy.
        shared.metrics().config_errors.inc();
        tracing::error!(error = %e, version = s.version, "snapshot refused; keeping the last good rules");
        return Ok(());
    }
    shared.metrics().rules_from_cache.set(0);
    shared.metrics().rules_passthrough.set(0);
    apply.members(s.members);
    shared.metrics().controller_version.set(s.version as i64);
    let acked = ack(session, config, &s.epoch, s.version).await;
    *held = Some((s.epoch, s.version));
    // After the ack: the file sync must not delay propagation.
    if let Some((cache, policies, members)) = to_save {
        *saved = Some((s.version, policies.clone()));
        save(cache, s.version, policies, members).await;
    }
    acked
}

/// Where the controller is, parsed once from `--controller`.
struct Target {
    host: String,
    port: u16,
    /// `scheme://authority[/prefix]`, without a trailing slash.
    base: String,
    tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
}

impl Target {
    fn parse(config: &ControllerConfig) -> Result<Target, String> {
        let bad = |why: &dyn std::fmt::Display| format!("--controller {}: {why}", config.url);
        let url: http::Uri = config.url.parse().map_err(|e| bad(&e))?;
        let host = url
            .host()
            .ok_or_else(|| bad(&"no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let scheme = url.scheme_str().unwrap_or("");
        let port = match (url.port_u16(), scheme) {
            (Some(port), _) => port,
            (None, "https") => 443,
            (None, _) => 80,
        };
        if url.query().is_some() {
            return Err(bad(&"a query is not allowed"));
        }
        let tls = match scheme {
            "http" => None,
            "https" => {
                let name = ServerName::try_from(host.clone()).map_err(|e| bad(&e))?;
                Some((tls_connector(config.ca.as_deref())?, name))
            }
            other => return Err(bad(&format!("scheme {other:?} is not http or https"))),
        };
        Ok(Target {
            host,
            port,
            base: config.url.trim_end_matches('/').to_string(),
            tls,
        })
    }
}

/// TLS to the controller: only the given CA when there is one, the platform's roots otherwise;
/// ALPN `h2` only, since the session is one HTTP/2 connection.
fn tls_connector(
    ca: Option<&[CertificateDer<'static>]>,
) -> Result<tokio_rustls::TlsConnector, String> {
    let mut config = match ca {
        Some(certs) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in certs {
                roots
                    .add(cert.clone())
                    .map_err(|e| format!("--controller-ca: {e}"))?;
            }
            rustls::ClientConfig::builder()
                .with_root_certificates(roots)
                .with_no_client_auth()
        }
        None => {
            use rustls_platform_verifier::ConfigVerifierExt;
            rustls::ClientConfig::with_platform_verifier()
                .map_err(|e| format!("the platform's certificate roots: {e}"))?
        }
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// Resolves the controller's host, then connects to its addresses in turn. A failed lookup is
/// labelled `dns error` so that logs, `/readyz` and `/debug/stream` tell it apart from a refused
/// connection (the resolver's own text differs between libc versions).
async fn connect_tcp(target: &Target) -> Result<tokio::net::TcpStream, String> {
    let addrs = tokio::net::lookup_host((target.host.as_str(), target.port))
        .await
        .map_err(|e| format!("dns error: {}", error_chain(&e)))?;
    let mut last = format!("dns error: {} has no addresses", target.host);
    for addr in addrs {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(tcp) => return Ok(tcp),
            Err(e) => last = format!("{addr}: {}", error_chain(&e)),
        }
    }
    Err(last)
}

/// One HTTP/2 connection to one controller replica, for as long as one rule stream lasts. The
/// stream, its acks and the top-keys reports all go through it and never through another
/// connection: behind a Service another connection may reach another replica, which does not
/// serve this pod's stream and refuses its acks (`409`). When the connection is gone, requests
/// on it fail instead of opening a new one.
#[derive(Clone)]
struct Session {
    sender: http2::SendRequest<Full<Bytes>>,
    base: Arc<str>,
}

impl Session {
    async fn open(target: &Target) -> Result<Session, String> {
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, connect_tcp(target))
            .await
            .map_err(|_| format!("connect timed out after {CONNECT_TIMEOUT:?}"))??;
        let _ = tcp.set_nodelay(true);
        let sender = match &target.tls {
            None => handshake(tcp).await?,
            Some((connector, name)) => {
                let tls =
                    tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name.clone(), tcp))
                        .await
                        .map_err(|_| format!("TLS handshake timed out after {CONNECT_TIMEOUT:?}"))?
                        .map_err(|e| format!("TLS: {}", error_chain(&e)))?;
                if tls.get_ref().1.alpn_protocol() != Some(b"h2".as_slice()) {
                    return Err("the controller did not agree to HTTP/2 (ALPN h2)".to_string());
                }
                handshake(tls).await?
            }
        };
        Ok(Session {
            sender,
            base: Arc::from(target.base.as_str()),
        })
    }

    /// Sends one request on this connection.
    async fn send(
        &self,
        method: http::Method,
        path_and_query: &str,
        token: &str,
        json: Option<Vec<u8>>,
    ) -> Result<http::Response<hyper::body::Incoming>, String> {
        let mut builder = http::Request::builder()
            .method(method)
            .uri(format!("{}{path_and_query}", self.base))
            .header(http::header::AUTHORIZATION, format!("Bearer {token}"));
        if json.is_some() {
            builder = builder.header(http::header::CONTENT_TYPE, "application/json");
        }
        let req = builder
            .body(Full::new(Bytes::from(json.unwrap_or_default())))
            .map_err(|e| e.to_string())?;
        let mut sender = self.sender.clone();
        sender.ready().await.map_err(|e| error_chain(&e))?;
        sender.send_request(req).await.map_err(|e| error_chain(&e))
    }
}

/// HTTP/2 over an open connection (prior knowledge on plain TCP, ALPN on TLS), PINGed so a
/// dead peer is noticed; the connection runs until every [`Session`] clone is dropped.
async fn handshake<IO>(io: IO) -> Result<http2::SendRequest<Full<Bytes>>, String>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .handshake(TokioIo::new(io))
        .await
        .map_err(|e| format!("HTTP/2 handshake: {}", error_chain(&e)))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "controller connection ended with an error");
        }
    });
    Ok(sender)
}

/// Reads a small response body (an error's problem details), bounded in size and time.
async fn small_body(body: hyper::body::Incoming) -> String {
    let read = Limited::new(body, 16 * 1024).collect();
    match tokio::time::timeout(Duration::from_secs(5), read).await {
        Ok(Ok(b)) => String::from_utf8_lossy(&b.to_bytes()).trim().to_string(),
        _ => String::new(),
    }
}

/// Keeps an applied snapshot on disk (off the async workers: it syncs the file). A failure
/// only costs the next start-up without the controller; it is logged, not fatal.
async fn save(
    cache: RulesCache,
    version: u64,
    policies: Vec<tollgate_crd::CompiledPolicy>,
    members: BTreeMap<String, u32>,
) {
    let path = cache.path().display().to_string();
    let result = tokio::task::spawn_blocking(move || cache.save(version, &policies, &members))
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
    match result {
        Ok(()) => tracing::debug!(version, cache = %path, "rules cached"),
        Err(e) => tracing::warn!(error = %e, "cannot cache the rules"),
    }
}

/// Tells the controller which version this sidecar enforces, on the stream's own connection.
/// A lost ack only delays the policy's `Programmed` status, except for a `409`: the replica
/// serving this very stream does not know what it delivered, so the stream is started over.
async fn ack(
    session: &Session,
    config: &ControllerConfig,
    epoch: &str,
    version: u64,
) -> Result<(), Ended> {
    let Ok(token) = std::fs::read_to_string(&config.token_file) else {
        tracing::warn!(version, "ack not sent: cannot read the token file");
        return Ok(());
    };
    let body = Ack {
        namespace: config.namespace.clone(),
        pod: config.pod.clone(),
        version,
        epoch: epoch.to_string(),
    };
    let Ok(json) = serde_json::to_vec(&body) else {
        return Ok(());
    };
    let sent = session.send(http::Method::POST, "/v1/ack", token.trim(), Some(json));
    let resp = match tokio::time::timeout(Duration::from_secs(5), sent).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, version, "ack failed");
            return Ok(());
        }
        Err(_) => {
            tracing::warn!(version, "ack timed out after 5 s");
            return Ok(());
        }
    };
    let status = resp.status();
    if status.is_success() {
        return Ok(());
    }
    let detail = small_body(resp.into_body()).await;
    if status == http::StatusCode::CONFLICT {
        return Err(Ended::new(
            EndCause::AckConflict,
            format!(
                "the controller refused the ack of version {version} (409: {detail}); reconnecting"
            ),
        ));
    }
    tracing::warn!(%status, detail, version, "ack refused");
    Ok(())
}

/// Sends the keys rejected most since the last report, every `top_keys_interval`, through the
/// open stream's connection (none while there is no stream). A report that fails is merged
/// into the next one, so a controller restart loses no counts; quiet intervals send nothing.
async fn report_top_keys(current: CurrentSession, config: ControllerConfig, shared: Arc<Shared>) {
    let mut pending: Vec<ReportedKey> = Vec::new();
    let mut ticks = tokio::time::interval(config.top_keys_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        merge_reported(&mut pending, shared.audit().unreported.take());
        if pending.is_empty() {
            continue;
        }
        let Some(session) = current.lock().clone() else {
            continue;
        };
        let Ok(token) = std::fs::read_to_string(&config.token_file) else {
            continue;
        };
        let body = TopKeysReport {
            namespace: config.namespace.clone(),
            pod: config.pod.clone(),
            keys: pending.clone(),
        };
        let Ok(json) = serde_json::to_vec(&body) else {
            continue;
        };
        let sent = session.send(http::Method::POST, "/v1/top-keys", token.trim(), Some(json));
        match tokio::time::timeout(Duration::from_secs(5), sent).await {
            Ok(Ok(resp)) if resp.status().is_success() => pending.clear(),
            Ok(Ok(resp)) => {
                tracing::debug!(status = %resp.status(), keys = pending.len(), "top-keys report refused; kept for the next one")
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, keys = pending.len(), "top-keys report failed; kept for the next one")
            }
            Err(_) => tracing::debug!(
                keys = pending.len(),
                "top-keys report timed out; kept for the next one"
            ),
        }
    }
}

/// Adds a drained sketch to the keys not yet reported, keeping the most rejected
/// [`MAX_REPORTED_KEYS`] (what is cut is a key that no longer qualifies as a top key).
fn merge_reported(pending: &mut Vec<ReportedKey>, drained: Vec<tollgate_engine::top_keys::Entry>) {
    for e in drained {
        let key_hash = tollgate_engine::key_hash::display(e.key_hash);
        match pending
            .iter_mut()
            .find(|p| p.rule == e.rule && p.key_hash == key_hash)
        {
            Some(p) => {
                p.rejected += e.count;
                p.max_overcount += e.error;
            }
            None => pending.push(ReportedKey {
                rule: e.rule,
                key_hash,
                rejected: e.count,
                max_overcount: e.error,
            }),
        }
    }
    pending.sort_by_key(|p| std::cmp::Reverse(p.rejected));
    pending.truncate(MAX_REPORTED_KEYS);
}

/// Exponential backoff from 100 ms to 10 s with full jitter, so sidecars restarted together do
/// not reconnect together.
struct Backoff {
    attempt: u32,
    seed: u64,
}

impl Backoff {
    fn new() -> Backoff {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        Backoff {
            attempt: 0,
            seed: h.finish() | 1,
        }
    }

    fn reset(&mut self) {
        self.attempt = 0;
    }

    fn next(&mut self) -> Duration {
        let cap_ms = (100u64 << self.attempt.min(7)).min(10_000);
        self.attempt = self.attempt.saturating_add(1);
        // xorshift: cheap, good enough for jitter.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        Duration::from_millis(cap_ms / 2 + self.seed % (cap_ms / 2 + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsent_top_keys_add_up_and_keep_the_heaviest() {
        let entry = |key_hash: u64, count: u64| tollgate_engine::top_keys::Entry {
            rule: "shop/limits/per-key".into(),
            fingerprint: key_hash ^ 0xff,
            key_hash,
            key: Some("raw".into()),
            count,
            error: 1,
        };
        let mut pending = Vec::new();
        merge_reported(&mut pending, vec![entry(1, 5), entry(2, 3)]);
        merge_reported(&mut pending, vec![entry(2, 4)]);
        assert_eq!(pending[0].key_hash, tollgate_engine::key_hash::display(2));
        assert_eq!((pending[0].rejected, pending[0].max_overcount), (7, 2));
        assert_eq!(pending[1].rejected, 5);
        let flood: Vec<_> = (10..10 + MAX_REPORTED_KEYS as u64)
            .map(|i| entry(i, 1))
            .collect();
        merge_reported(&mut pending, flood);
        assert_eq!(pending.len(), MAX_REPORTED_KEYS);
        assert_eq!(pending[0].rejected, 7, "the heaviest stay");
        let json = serde_json::to_string(&pending[0]).unwrap();
        assert!(
            !json.contains("raw"),
            "raw keys never leave the pod: {json}"
        );
    }

    #[test]
    fn backoff_grows_to_a_cap_with_jitter() {
        let mut b = Backoff::new();
        let first = b.next();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
        let mut last = Duration::ZERO;
        for _ in 0..20 {
            last = b.next();
        }
        assert!(
            last >= Duration::from_secs(5) && last <= Duration::from_secs(10),
            "{last:?}"
        );
        b.reset();
        assert!(b.next() <= Duration::from_millis(100));
    }
}
