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

use futures_util::StreamExt;
use tollgate_crd::stream::{
    Ack, MAX_LINE_BYTES, MAX_REPORTED_KEYS, ReportedKey, StreamMessage, TopKeysReport, parse_line,
};

use crate::args::WithoutRules;
use crate::engine::Shared;
use crate::rules_cache::RulesCache;

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
    pub ca: Option<Vec<reqwest::Certificate>>,
    /// Where the last good rule set is kept across restarts, if anywhere.
    pub cache: Option<RulesCache>,
    /// How long to wait for first rules before `without_rules` applies.
    pub rules_wait: Duration,
    pub without_rules: WithoutRules,
}

/// How a sidecar that has no rules yet gets started when the stream cannot deliver them.
struct Startup {
    /// The wait is over (or rules arrived): nothing more to decide.
    settled: bool,
    cache_tried: bool,
    deadline: tokio::time::Instant,
}

impl Startup {
    fn new(wait: Duration) -> Startup {
        Startup {
            settled: false,
            cache_tried: false,
            deadline: tokio::time::Instant::now() + wait,
        }
    }

    /// The stream failed before any rules arrived: enforce the cached set, once, if usable.
    fn try_cache(&mut self, config: &ControllerConfig, shared: &Shared, apply: &dyn Apply) {
        if self.cache_tried || shared.ready.load(std::sync::atomic::Ordering::Acquire) {
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
                        shared.metrics.rules_from_cache.set(1);
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
        if shared.ready.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        match config.without_rules {
            WithoutRules::PassThrough => {
                shared.metrics.rules_passthrough.set(1);
                shared
                    .ready
                    .store(true, std::sync::atomic::Ordering::Release);
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

/// The whole cause chain: reqwest's own message (`error sending request for url …`) reads the
/// same for a DNS failure, a refused connection and an unknown CA; the cause is in the sources.
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

/// Runs the stream client forever.
pub async fn run(
    config: ControllerConfig,
    shared: Arc<Shared>,
    apply: Arc<dyn Apply>,
    health: Arc<StreamHealth>,
) {
    // HTTP/2 (prior knowledge on plain http, ALPN on https): acks then travel on the stream's
    // own connection, so behind a Service they reach the replica that serves the stream.
    let mut builder = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .http2_keep_alive_timeout(Duration::from_secs(5))
        .http2_keep_alive_while_idle(true);
    if config.url.starts_with("http://") {
        builder = builder.http2_prior_knowledge();
    }
    if let Some(roots) = &config.ca {
        builder = builder.tls_certs_only(roots.iter().cloned());
    }
    crate::install_crypto_provider();
    let client = match builder.build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the controller client");
            return;
        }
    };
    shared.audit.start_reporting();
    tokio::spawn(report_top_keys(
        client.clone(),
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
            &client,
            &config,
            &shared,
            apply.as_ref(),
            &mut held,
            &mut saved,
            &health,
        );
        tokio::pin!(attempt);
        // The wait for first rules runs beside the attempt (a connect may hang for long).
        let outcome = loop {
            tokio::select! {
                r = &mut attempt => break r,
                () = tokio::time::sleep_until(startup.deadline), if !startup.settled => {
                    startup.wait_over(&config, &shared, apply.as_ref());
                }
            }
        };
        startup.try_cache(&config, &shared, apply.as_ref());
        let e = match outcome {
            Ok(()) => "stream ended".to_string(),
            Err(e) => e,
        };
        if shared.metrics.controller_connected.get() == 1 {
            // It had connected: a stream that broke after working starts over from the
            // shortest backoff.
            backoff.reset();
        }
        health.failed(&e);
        if shared.ready.load(std::sync::atomic::Ordering::Acquire) {
            tracing::warn!(error = %e, controller = %config.url, "rule stream interrupted; enforcing the last-known-good rules");
        } else {
            tracing::warn!(error = %e, hint = hint(&e), controller = %config.url, "rule stream unavailable; not ready until the first rules arrive");
        }
        shared.metrics.controller_connected.set(0);
        tokio::time::sleep(backoff.next()).await;
    }
}

async fn stream_once(
    client: &reqwest::Client,
    config: &ControllerConfig,
    shared: &Shared,
    apply: &dyn Apply,
    held: &mut Option<(String, u64)>,
    saved: &mut Option<(u64, Vec<tollgate_crd::CompiledPolicy>)>,
    health: &StreamHealth,
) -> Result<(), String> {
    let token = std::fs::read_to_string(&config.token_file)
        .map_err(|e| format!("cannot read token {}: {e}", config.token_file.display()))?;
    let mut url = reqwest::Url::parse(&format!("{}/v1/watch", config.url.trim_end_matches('/')))
        .map_err(|e| format!("--controller {}: {e}", config.url))?;
    {
        let mut q = url.query_pairs_mut();
        q.append_pair("namespace", &config.namespace)
            .append_pair("pod", &config.pod);
        if let Some((epoch, version)) = held.as_ref() {
            q.append_pair("since", &version.to_string())
                .append_pair("epoch", epoch);
        }
    }
    let resp = client
        .get(url)
        .bearer_auth(token.trim())
        .send()
        .await
        .map_err(|e| format!("connect {}: {}", config.url, error_chain(&e)))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        return Err(format!("controller answered {status}: {}", body.trim()));
    }
    shared.metrics.controller_connected.set(1);
    health.connected();
    tracing::info!(controller = %config.url, "rule stream connected");
    let mut body = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let chunk = match tokio::time::timeout(config.idle_timeout, body.next()).await {
            Err(_) => return Err(format!("no message for {:?}", config.idle_timeout)),
            Ok(None) => return Err("stream closed by the controller".to_string()),
            Ok(Some(Err(e))) => return Err(format!("read: {}", error_chain(&e))),
            Ok(Some(Ok(chunk))) => chunk,
        };
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            let line = &line[..line.len() - 1];
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match parse_line(line)? {
                StreamMessage::Snapshot {
                    wire_version,
                    version,
                    policies,
                    members,
                    epoch: new_epoch,
                    key_hash_secret,
                } => {
                    if let Some(secret) = &key_hash_secret {
                        shared.audit.adopt_controller_secret(secret);
                    }
                    if wire_version != tollgate_crd::WIRE_VERSION {
                        return Err(format!(
                            "controller speaks wire version {wire_version}, this sidecar {}",
                            tollgate_crd::WIRE_VERSION
                        ));
                    }
                    if let Some((held_epoch, held_version)) = held.as_ref()
                        && *held_epoch == new_epoch
                        && version < *held_version
                    {
                        // Versions only grow within one controller epoch: this one is stale.
                        tracing::warn!(version, held = *held_version, "ignoring an older snapshot");
                        continue;
                    }
                    let to_save = config
                        .cache
                        .as_ref()
                        .map(|c| (c.clone(), policies.clone(), members.clone()));
                    match apply.rules(version, policies) {
                        Ok(()) => {
                            shared.metrics.rules_from_cache.set(0);
                            shared.metrics.rules_passthrough.set(0);
                            apply.members(members);
                            shared.metrics.controller_version.set(version as i64);
                            ack(client, config, &new_epoch, version).await;
                            *held = Some((new_epoch, version));
                            // After the ack: the file sync must not delay propagation.
                            if let Some((cache, policies, members)) = to_save {
                                *saved = Some((version, policies.clone()));
                                save(cache, version, policies, members).await;
                            }
                        }
                        Err(e) => {
                            // Keep the rules in force; the controller's status shows the policy.
                            shared.metrics.config_errors.inc();
                            tracing::error!(error = %e, version, "snapshot refused; keeping the last good rules");
                        }
                    }
                }
                StreamMessage::Members { members, .. } => {
                    // The cache keeps the membership current too: a pod restarted from it
                    // while the controller is away divides fail-open shares by the live count
                    // it last heard of, not by the one of its last rules snapshot.
                    if let (Some(cache), Some((version, policies))) =
                        (&config.cache, saved.as_ref())
                    {
                        save(cache.clone(), *version, policies.clone(), members.clone()).await;
                    }
                    apply.members(members)
                }
                StreamMessage::Heartbeat { .. } => {}
            }
        }
        if buf.len() > MAX_LINE_BYTES {
            return Err(format!("stream line longer than {MAX_LINE_BYTES} bytes"));
        }
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

/// Tells the controller which version this sidecar enforces (best effort).
async fn ack(client: &reqwest::Client, config: &ControllerConfig, epoch: &str, version: u64) {
    let Ok(token) = std::fs::read_to_string(&config.token_file) else {
        return;
    };
    let body = Ack {
        namespace: config.namespace.clone(),
        pod: config.pod.clone(),
        version,
        epoch: epoch.to_string(),
    };
    let url = format!("{}/v1/ack", config.url.trim_end_matches('/'));
    let result = client
        .post(url)
        .bearer_auth(token.trim())
        .timeout(Duration::from_secs(5))
        .json(&body)
        .send()
        .await;
    if let Err(e) = result {
        tracing::debug!(error = %e, "ack failed");
    }
}

/// Sends the keys rejected most since the last report, every `top_keys_interval`, on the
/// stream's HTTP/2 connection (the client is shared). A report that fails is merged into the
/// next one, so a controller restart loses no counts; quiet intervals send nothing.
async fn report_top_keys(client: reqwest::Client, config: ControllerConfig, shared: Arc<Shared>) {
    let url = format!("{}/v1/top-keys", config.url.trim_end_matches('/'));
    let mut pending: Vec<ReportedKey> = Vec::new();
    let mut ticks = tokio::time::interval(config.top_keys_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        merge_reported(&mut pending, shared.audit.unreported.take());
        if pending.is_empty() {
            continue;
        }
        let Ok(token) = std::fs::read_to_string(&config.token_file) else {
            continue;
        };
        let body = TopKeysReport {
            namespace: config.namespace.clone(),
            pod: config.pod.clone(),
            keys: pending.clone(),
        };
        let sent = client
            .post(&url)
            .bearer_auth(token.trim())
            .timeout(Duration::from_secs(5))
            .json(&body)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status);
        match sent {
            Ok(_) => pending.clear(),
            Err(e) => {
                tracing::debug!(error = %e, keys = pending.len(), "top-keys report failed; kept for the next one")
            }
        }
    }
}

/// Adds a drained sketch to the keys not yet reported, keeping the most rejected
/// [`MAX_REPORTED_KEYS`] (what is cut is a key that no longer qualifies as a top key).
fn merge_reported(pending: &mut Vec<ReportedKey>, drained: Vec<crate::topkeys::Entry>) {
    for e in drained {
        let key_hash = crate::identity::display(e.identity);
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
        let entry = |identity: u64, count: u64| crate::topkeys::Entry {
            rule: "shop/limits/per-key".into(),
            key_hash: identity ^ 0xff,
            identity,
            key: Some("raw".into()),
            count,
            error: 1,
        };
        let mut pending = Vec::new();
        merge_reported(&mut pending, vec![entry(1, 5), entry(2, 3)]);
        merge_reported(&mut pending, vec![entry(2, 4)]);
        assert_eq!(pending[0].key_hash, crate::identity::display(2));
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
