//! The rejection audit log: one structured JSON line per rejected request, for support triage.
//!
//! It is itself rate limited (a fixed number of lines per second, the rest counted in
//! `tollgate_audit_suppressed_total`) so that a flood of rejected requests cannot flood the log.
//! Keys are logged as a keyed hash unless raw keys are explicitly enabled: counter keys are API
//! keys, user ids and addresses, which log pipelines should not collect by default.

use std::sync::atomic::{AtomicU64, Ordering};

use tollgate_limiter::{Clock, MonotonicClock};

use crate::metrics::Metrics;
use crate::rules::{ActiveRule, Rejection};

pub struct AuditLog {
    per_second: u64,
    raw_keys: bool,
    /// Most-rejected keys, for `/debug/top-keys`.
    pub top: crate::topkeys::TopKeys,
    /// High 32 bits: the current second; low 32 bits: lines written in it.
    window: AtomicU64,
    clock: MonotonicClock,
}

impl AuditLog {
    pub fn new(per_second: u64, raw_keys: bool) -> AuditLog {
        AuditLog {
            per_second,
            raw_keys,
            top: crate::topkeys::TopKeys::default(),
            window: AtomicU64::new(0),
            clock: MonotonicClock::new(),
        }
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

    pub fn rejected(&self, rule: &ActiveRule, rejection: &Rejection, metrics: &Metrics) {
        let limited = &rejection.limited;
        self.top.record(&rule.rule.id, limited.key_hash, || {
            self.raw_keys.then(|| printable(&rejection.key))
        });
        if !self.admit() {
            metrics.audit_suppressed.inc();
            return;
        }
        let raw = self.raw_keys.then(|| printable(&rejection.key));
        tracing::info!(
            target: "tollgate::audit",
            event = "rejected",
            rule = %rule.rule.id,
            key_hash = %format_args!("{:016x}", limited.key_hash),
            key = raw.as_deref(),
            limit = limited.decision.limit,
            retry_after_ms = limited.decision.retry_after / 1_000_000,
            "request rejected"
        );
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
        let log = AuditLog::new(5, false);
        let admitted = (0..100).filter(|_| log.admit()).count();
        // The test may straddle a second boundary once.
        assert!((5..=10).contains(&admitted), "{admitted}");
    }
}
