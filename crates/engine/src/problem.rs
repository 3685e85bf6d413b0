//! The problem+json body (RFC 9457) of the 429, per rule.
//!
//! The body depends on the rule and on `Retry-After` only, so each rule's body is rendered once
//! when a rule set is built, with the two places the seconds go left open
//! ([`RejectionBody`]); a rejection then costs two integers and three copies. Pure: no I/O, no
//! request, no other sidecar module.

use tollgate_crd::compiled::CompiledRule;

/// The draft's problem type for a 429 (IANA HTTP Problem Types registry).
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// A rule's 429 body, split around its two `Retry-After` values.
pub struct RejectionBody {
    /// `[before the detail's seconds, between the two, after the field's]`; None when the
    /// split is ambiguous (the placeholder also occurs in a name), then rendered per rejection.
    parts: Option<[Box<str>; 3]>,
}

/// Rendered in place of the seconds to find where they go: no real wait is this long.
const PLACEHOLDER: u64 = u64::MAX;

impl RejectionBody {
    pub fn new(rule: &CompiledRule) -> RejectionBody {
        let rendered = rejection_body(rule, PLACEHOLDER);
        let mut placeholder = itoa::Buffer::new();
        let mut pieces = rendered.split(placeholder.format(PLACEHOLDER));
        let parts = match (pieces.next(), pieces.next(), pieces.next(), pieces.next()) {
            (Some(a), Some(b), Some(c), None) => Some([a.into(), b.into(), c.into()]),
            _ => None,
        };
        RejectionBody { parts }
    }

    /// Appends the body for a wait of `retry` seconds: exactly [`rejection_body`]'s bytes.
    pub fn write(&self, rule: &CompiledRule, retry: u64, out: &mut Vec<u8>) {
        let Some([a, b, c]) = &self.parts else {
            out.extend_from_slice(rejection_body(rule, retry).as_bytes());
            return;
        };
        let mut n = itoa::Buffer::new();
        let retry = n.format(retry).as_bytes();
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(retry);
        out.extend_from_slice(b.as_bytes());
        out.extend_from_slice(retry);
        out.extend_from_slice(c.as_bytes());
    }
}

/// The problem+json body of a 429: byte for byte what `serde_json::json!` produces (keys in
/// sorted order), written directly. Each rule renders it once ([`RejectionBody`]).
pub fn rejection_body(rule: &CompiledRule, retry: u64) -> String {
    use std::fmt::Write as _;
    let detail = format!(
        "Rule {:?} allows {}; retry after {retry} s.",
        rule.name,
        limit_words(rule)
    );
    let policy = rule.id.rsplit_once('/').map(|(p, _)| p).unwrap_or_default();
    let mut out = String::with_capacity(256 + detail.len() + policy.len() + rule.name.len());
    out.push_str("{\"detail\":");
    push_json_str(&mut out, &detail);
    let _ = write!(out, ",\"limit\":{},\"policy\":", rule.limit.requests);
    push_json_str(&mut out, policy);
    let _ = write!(out, ",\"retryAfterSeconds\":{retry},\"rule\":");
    push_json_str(&mut out, &rule.name);
    let _ = write!(
        out,
        ",\"status\":429,\"title\":\"{QUOTA_EXCEEDED_TITLE}\",\"type\":\"{QUOTA_EXCEEDED}\",\
         \"violated-policies\":["
    );
    push_json_str(&mut out, &rule.name);
    let _ = write!(
        out,
        "],\"windowSeconds\":{}}}",
        rule.limit.period_ms.div_ceil(1000)
    );
    out
}

const QUOTA_EXCEEDED_TITLE: &str =
    "Request cannot be satisfied as assigned quota has been exceeded";

/// Appends `s` as a JSON string literal.
fn push_json_str(out: &mut String, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else if let Ok(quoted) = serde_json::to_string(s) {
        // Serialising a string cannot fail.
        out.push_str(&quoted);
    }
}

fn limit_words(rule: &CompiledRule) -> String {
    let l = &rule.limit;
    if l.period_ms == 0 {
        return format!("{} requests in flight", l.requests);
    }
    let period = match l.period_ms {
        1_000 => "second".to_string(),
        60_000 => "minute".to_string(),
        3_600_000 => "hour".to_string(),
        ms => tollgate_crd::duration::format(std::time::Duration::from_millis(ms)),
    };
    format!("{} requests per {period}", l.requests)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A compiled rule `r` of policy `ns/p`: 7 requests per 90 s.
    fn sample_rule() -> CompiledRule {
        let yaml = "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata:\n  \
                    name: p\n  namespace: ns\nspec:\n  targetRef:\n    selector: {}\n  \
                    rules:\n    - name: r\n      limit: {requests: 7, period: 90s}\n";
        let policy = &tollgate_crd::parse_yaml(yaml).unwrap()[0];
        tollgate_crd::compile(policy).unwrap().rules[0].clone()
    }

    /// The hand-written 429 body is exactly what serde_json builds, for any rule name.
    #[test]
    fn rejection_body_matches_serde_json() {
        let mut rule = sample_rule();
        for name in [
            "r",
            "per-key",
            "quote\"back\\slash",
            "tab\tnl\nctl\u{1}",
            "ünïcode ✓",
        ] {
            rule.name = name.to_string();
            for retry in [1, 61, 86_400] {
                let expected = serde_json::json!({
                    "type": QUOTA_EXCEEDED,
                    "title": QUOTA_EXCEEDED_TITLE,
                    "violated-policies": [rule.name],
                    "status": 429,
                    "detail": format!("Rule {:?} allows {}; retry after {retry} s.", rule.name, limit_words(&rule)),
                    "rule": rule.name,
                    "policy": rule.id.rsplit_once('/').map(|(p, _)| p).unwrap_or_default(),
                    "limit": rule.limit.requests,
                    "windowSeconds": rule.limit.period_ms.div_ceil(1000),
                    "retryAfterSeconds": retry,
                })
                .to_string();
                assert_eq!(rejection_body(&rule, retry), expected);
                let mut written = Vec::new();
                RejectionBody::new(&rule).write(&rule, retry, &mut written);
                assert_eq!(String::from_utf8(written).unwrap(), expected);
            }
        }
    }

    /// A name holding the placeholder cannot be split: the body is rendered per rejection.
    #[test]
    fn an_ambiguous_template_falls_back_to_rendering() {
        let mut rule = sample_rule();
        rule.name = format!("r-{}", u64::MAX);
        let template = RejectionBody::new(&rule);
        assert!(template.parts.is_none());
        let mut written = Vec::new();
        template.write(&rule, 42, &mut written);
        assert_eq!(
            String::from_utf8(written).unwrap(),
            rejection_body(&rule, 42)
        );
    }
}
