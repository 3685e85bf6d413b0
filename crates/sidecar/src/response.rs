//! The response contract: the 429 and the RateLimit headers on every response.
//!
//! - `Retry-After`: whole seconds, never earlier than the limiter says, plus a jitter derived
//!   from the client's key so that clients rejected together do not all return together.
//! - `RateLimit-Limit` / `-Remaining` / `-Reset`: the widely read names.
//! - `RateLimit-Policy: "<rule>";q=<n>;w=<secs>` and `RateLimit: "<rule>";r=<n>;t=<secs>`: the
//!   IETF httpapi draft fields.
//! - The body is RFC 9457 `application/problem+json` naming the rule and the limit.

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use tollgate_crd::compiled::CompiledRule;
use tollgate_limiter::{Decision, NEVER, Nanos};

use crate::rules::ActiveRule;

pub static RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
pub static RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
pub static RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static SHADOW_HEADER: HeaderName = HeaderName::from_static("tollgate-shadow-rejected");

const NANOS_PER_SEC: Nanos = 1_000_000_000;
/// Longest Retry-After we advertise for a request that can never fit (cost above capacity).
const MAX_RETRY_AFTER_SECS: u64 = 24 * 60 * 60;

/// Whole seconds, rounded up, at least `min`.
fn ceil_secs(n: Nanos, min: u64) -> u64 {
    if n == NEVER {
        return MAX_RETRY_AFTER_SECS;
    }
    n.div_ceil(NANOS_PER_SEC).clamp(min, MAX_RETRY_AFTER_SECS)
}

/// `Retry-After` seconds: the limiter's wait rounded up, plus up to 20 % (at least one second
/// of spread) chosen by the key hash. Deterministic per client, spread across clients.
pub fn retry_after_secs(retry_after: Nanos, key_hash: u64) -> u64 {
    let base = ceil_secs(retry_after, 1);
    let spread = (base / 5).max(1);
    (base + key_hash % (spread + 1)).min(MAX_RETRY_AFTER_SECS)
}

/// Adds the RateLimit header set for one rule's decision.
///
/// Runs on every admitted and every rejected request, so the four varying values are written
/// into one buffer and handed out as slices of it: two allocations instead of five (one per
/// number and two for the formatted `RateLimit` item).
pub fn add_ratelimit_headers(headers: &mut HeaderMap, rule: &ActiveRule, d: &Decision) {
    let reset = ceil_secs(d.reset, 0);
    let name = rule.rule.name.as_bytes();
    let mut num = itoa::Buffer::new();
    let mut buf = BytesMut::with_capacity(3 * 20 + 2 * 20 + name.len() + 8);
    buf.extend_from_slice(num.format(d.limit).as_bytes());
    let limit = buf.split().freeze();
    let remaining = num.format(d.remaining).as_bytes();
    buf.extend_from_slice(remaining);
    let remaining_value = buf.split().freeze();
    let reset_str = num.format(reset).as_bytes();
    buf.extend_from_slice(reset_str);
    let reset_value = buf.split().freeze();
    buf.extend_from_slice(b"\"");
    buf.extend_from_slice(name);
    buf.extend_from_slice(b"\";r=");
    buf.extend_from_slice(&remaining_value);
    buf.extend_from_slice(b";t=");
    buf.extend_from_slice(&reset_value);
    let item = buf.freeze();
    headers.reserve(5);
    // Digits are always valid header values; only the rule name could make the item invalid.
    for (name, value) in [
        (&RATELIMIT_LIMIT, limit),
        (&RATELIMIT_REMAINING, remaining_value),
        (&RATELIMIT_RESET, reset_value),
    ] {
        if let Ok(v) = HeaderValue::from_maybe_shared(value) {
            headers.insert(name.clone(), v);
        }
    }
    headers.insert(RATELIMIT_POLICY.clone(), rule.policy_item.clone());
    if let Ok(v) = HeaderValue::from_maybe_shared(item) {
        headers.insert(RATELIMIT.clone(), v);
    }
}

/// The 429 for a rejected request.
pub fn too_many_requests(rule: &ActiveRule, d: &Decision, key_hash: u64) -> Response<Bytes> {
    let retry = retry_after_secs(d.retry_after, key_hash);
    let mut resp = Response::new(Bytes::from(rejection_body(&rule.rule, retry)));
    *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    // Sized for the eight headers below, so the map never grows.
    *resp.headers_mut() = HeaderMap::with_capacity(8);
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    h.insert(http::header::RETRY_AFTER, HeaderValue::from(retry));
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    add_ratelimit_headers(h, rule, d);
    resp
}

/// The problem+json body of a 429: byte for byte what `serde_json::json!` produces (keys in
/// sorted order), written directly. Building, serialising and dropping a `Value` map was over
/// a third of the instructions of a whole rejected request (bench/cpu_per_decision.py), which
/// must stay cheaper than an admitted one.
fn rejection_body(rule: &CompiledRule, retry: u64) -> String {
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
        ",\"status\":429,\"title\":\"Rate limit exceeded\",\
         \"type\":\"https://tollgate.dev/problems/rate-limited\",\"windowSeconds\":{}}}",
        rule.limit.period_ms.div_ceil(1000)
    );
    out
}

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

/// A problem+json response for errors the sidecar itself produces (502, 504, 400).
pub fn problem(status: StatusCode, title: &str, detail: &str) -> Response<Bytes> {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut resp = Response::new(Bytes::from(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    resp
}

/// "100 requests per minute" style wording for the problem detail.
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

    #[test]
    fn retry_after_never_undercuts_the_limiter() {
        for hash in 0..1000u64 {
            let r = retry_after_secs(12 * NANOS_PER_SEC - 5, hash);
            assert!((12..=14).contains(&r), "{r}");
        }
        assert_eq!(retry_after_secs(1, 0), 1);
        assert_eq!(retry_after_secs(NEVER, 7), MAX_RETRY_AFTER_SECS);
    }

    /// The hand-written 429 body is exactly what serde_json builds, for any rule name.
    #[test]
    fn rejection_body_matches_serde_json() {
        let yaml = "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata:\n  \
                    name: p\n  namespace: ns\nspec:\n  targetRef:\n    selector: {}\n  \
                    rules:\n    - name: r\n      limit: {requests: 7, period: 90s}\n";
        let policy = &tollgate_crd::parse_yaml(yaml).unwrap()[0];
        let mut rule = tollgate_crd::compile(policy).unwrap().rules[0].clone();
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
                    "type": "https://tollgate.dev/problems/rate-limited",
                    "title": "Rate limit exceeded",
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
            }
        }
    }

    #[test]
    fn retry_after_spreads_clients() {
        let distinct: std::collections::HashSet<u64> = (0..100u64)
            .map(|h| retry_after_secs(60 * NANOS_PER_SEC, h))
            .collect();
        assert!(distinct.len() >= 10, "{distinct:?}");
    }
}
