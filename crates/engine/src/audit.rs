//! The decision audit log: one structured JSON line per refused request, for support triage:
//! a 429 (`decision: rejected`) and a fail-closed rule's 503 (`decision: unavailable`, with the
//! reason), the refusals a client sees.
//!
//! It is itself rate limited (a fixed number of lines per second): lines past the allowance are
//! counted in `tollgate_audit_suppressed_total`, and the next line written says how many were
//! suppressed before it, so a flood shows up in the log as a number instead of vanishing.
//! Keys appear as their stable key hash (`crate::key_hash`: the same in every pod of an
//! installation and across restarts) unless raw keys are explicitly enabled: counter keys are
//! API keys, user ids and addresses, which log pipelines should not collect by default.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use tollgate_limiter::{Clock, MonotonicClock};

use crate::key_hash::KeyHashes;
use crate::keys::ClientAddr;
use crate::metrics::Metrics;
use crate::rules::{ActiveRule, Rejection};

pub struct AuditLog {
    per_second: u64,
    raw_keys: bool,
    /// Swapped when the controller hands out the installation's secret.
    key_hashes: arc_swap::ArcSwap<KeyHashes>,
    /// The secret came from `--key-hash-secret-file`: an explicit choice the controller's
    /// secret does not override.
    pinned: bool,
    /// The controller's secret in use, so a snapshot repeating it changes nothing.
    adopted: parking_lot::Mutex<Option<String>>,
    /// Most-rejected keys, for `/debug/top-keys`.
    pub top: crate::top_keys::TopKeys,
    /// The same, since the last report to the controller (`tollgate_runtime::rule_stream`), which drains
    /// it; fed only once a reporter runs.
    pub unreported: crate::top_keys::TopKeys,
    reporting: std::sync::atomic::AtomicBool,
    /// High 32 bits: the current second; low 32 bits: lines written in it.
    window: AtomicU64,
    /// Lines suppressed since the last line written.
    suppressed: AtomicU64,
    clock: MonotonicClock,
}

/// What an audit line says about the request, borrowed from it: the line is built only when
/// it fits the allowance.
pub struct RefusedRequest<'a> {
    pub policy: &'a str,
    pub method: &'a http::Method,
    pub path: &'a str,
    pub headers: &'a http::HeaderMap,
    pub peer: &'a SocketAddr,
    /// `X-Forwarded-For` entries trusted for the client address (the rule's, else the
    /// policy's bypass setting).
    pub trusted_hops: u32,
    pub span: Option<&'a tracing::Span>,
}

impl AuditLog {
    pub fn new(per_second: u64, raw_keys: bool, key_hashes: KeyHashes, pinned: bool) -> AuditLog {
        AuditLog {
            per_second,
            raw_keys,
            key_hashes: arc_swap::ArcSwap::from_pointee(key_hashes),
            pinned,
            adopted: parking_lot::Mutex::new(None),
            top: crate::top_keys::TopKeys::default(),
            unreported: crate::top_keys::TopKeys::default(),
            reporting: std::sync::atomic::AtomicBool::new(false),
            window: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
            clock: MonotonicClock::new(),
        }
    }

    /// Where key hashes come from (never the secret).
    pub fn key_hash_source(&self) -> String {
        self.key_hashes.load().source.clone()
    }

    /// The key hashes in force now, and the hot path's SipHash under the same secret.
    pub fn key_hashes(&self) -> arc_swap::Guard<std::sync::Arc<KeyHashes>> {
        self.key_hashes.load()
    }

    /// The stable hash (`key_hash`) a counter key has in audit lines and top keys now.
    pub fn key_hash(&self, key: &[u8]) -> u64 {
        self.key_hashes.load().of(key)
    }

    /// Uses the installation's secret the controller streamed, unless the secret was pinned
    /// to a file. Keys already in the top-keys sketch keep the hash they were counted with.
    pub fn adopt_controller_secret(&self, secret: &str) {
        if self.pinned {
            return;
        }
        let mut adopted = self.adopted.lock();
        if adopted.as_deref() == Some(secret) {
            return;
        }
        match KeyHashes::from_secret(secret.as_bytes(), "the controller's key-hash Secret".into()) {
            Ok(key_hashes) => {
                self.key_hashes.store(std::sync::Arc::new(key_hashes));
                *adopted = Some(secret.to_string());
                tracing::info!("key hashes now follow the installation's key-hash secret");
            }
            Err(e) => tracing::warn!(error = %e, "ignoring the controller's key-hash secret"),
        }
    }

    /// Starts counting rejections for the controller's fleet-wide top keys.
    pub fn start_reporting(&self) {
        self.reporting.store(true, Ordering::Relaxed);
    }

    /// Whether one more line fits in this second's allowance.
    fn admit(&self) -> bool {
        let sec = (self.clock.now() / 1_000_000_000) & 0xffff_ffff;
        let mut cur = self.window.load(Ordering::Relaxed);
        loop {
            let (s, n) = (cur >> 32, cur & 0xffff_ffff);
            let next = if s == sec {
                if n >= self.per_second {
                    return false;
                }
                cur + 1
            } else {
                (sec << 32) | 1
            };
            match self
                .window
                .compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Counts a rejection in the top keys and writes its line if the allowance has room.
    pub fn rejected(
        &self,
        rule: &ActiveRule,
        rejection: &Rejection,
        request: &RefusedRequest<'_>,
        metrics: &Metrics,
    ) {
        let limited = &rejection.limited;
        let key_hashes = self.key_hashes.load();
        // One HMAC per rejection at most, for the sketch and the line alike.
        let key_id = std::cell::OnceCell::new();
        let key_id = || *key_id.get_or_init(|| key_hashes.of(&rejection.key));
        self.top.record(&rule.rule.id, limited.fingerprint, || {
            (key_id(), self.raw_keys.then(|| printable(&rejection.key)))
        });
        if self.reporting.load(Ordering::Relaxed) {
            // Raw keys never leave the pod.
            self.unreported
                .record(&rule.rule.id, limited.fingerprint, || (key_id(), None));
        }
        if !self.admit() {
            metrics.audit_suppressed.inc();
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let raw = self.raw_keys.then(|| printable(&rejection.key));
        let client = client_of(request);
        let trace_id = tollgate_telemetry::trace_id(request.span, request.headers);
        tracing::info!(
            target: "tollgate::audit",
            event = "rejected",
            policy = request.policy,
            rule = %rule.rule.id,
            decision = "rejected",
            status = 429u16,
            key_hash = %crate::key_hash::display(key_id()),
            key = raw.as_deref(),
            method = %request.method,
            path = request.path,
            client = %client,
            trace_id = trace_id.as_deref(),
            limit = limited.decision.limit,
            retry_after_ms = limited.decision.retry_after / 1_000_000,
            suppressed_before = self.suppressed.swap(0, Ordering::Relaxed),
            "request rejected"
        );
    }

    /// Writes the line of a request a fail-closed rule refused with 503 because its counter
    /// store could not decide, if the allowance has room. `key` is the rule's counter key when
    /// it could be rebuilt. Not counted in the top keys: they rank rejected clients, and an
    /// outage refuses every client alike.
    pub fn unavailable(
        &self,
        rule: &ActiveRule,
        key: Option<&[u8]>,
        request: &RefusedRequest<'_>,
        metrics: &Metrics,
    ) {
        if !self.admit() {
            metrics.audit_suppressed.inc();
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let key_hash = key.map(|k| crate::key_hash::display(self.key_hashes.load().of(k)));
        let raw = key.filter(|_| self.raw_keys).map(printable);
        let client = client_of(request);
        let trace_id = tollgate_telemetry::trace_id(request.span, request.headers);
        tracing::info!(
            target: "tollgate::audit",
            event = "unavailable",
            policy = request.policy,
            rule = %rule.rule.id,
            decision = "unavailable",
            status = 503u16,
            reason = UNAVAILABLE_REASON,
            key_hash = key_hash.as_deref(),
            key = raw.as_deref(),
            method = %request.method,
            path = request.path,
            client = %client,
            trace_id = trace_id.as_deref(),
            suppressed_before = self.suppressed.swap(0, Ordering::Relaxed),
            "request refused: counter store unavailable"
        );
    }
}

/// Why a fail-closed rule answers 503, in its audit line.
pub const UNAVAILABLE_REASON: &str = "the rule fails closed (failureMode: Closed) and its shared counter store (Redis) is unreachable or did not answer in time";

/// The client address the rule sees, as the line shows it.
fn client_of(request: &RefusedRequest<'_>) -> String {
    match crate::keys::client_ip_in(request.headers, request.peer, request.trusted_hops) {
        ClientAddr::Peer(ip) | ClientAddr::Forwarded(ip) => ip.to_string(),
        ClientAddr::Unparsed(text) => text.to_string(),
    }
}

/// A counter key for humans: parts (joined by 0x1f) shown as '|', anything unprintable escaped.
pub fn printable(key: &[u8]) -> String {
    key.strip_suffix(&[0x1f])
        .unwrap_or(key)
        .iter()
        .map(|b| if *b == 0x1f { b'|' } else { *b })
        .flat_map(std::ascii::escape_default)
        .map(char::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_n_lines_per_second() {
        let log = AuditLog::new(5, false, KeyHashes::per_process().unwrap(), false);
        let admitted = (0..100).filter(|_| log.admit()).count();
        // The test may straddle a second boundary once.
        assert!((5..=10).contains(&admitted), "{admitted}");
    }
}
