//! The response contract: the 429, the 503 and the rate-limit fields on every response.
//!
//! - `Retry-After`: whole seconds, never earlier than the request could succeed, plus a jitter
//!   derived from the client (address and key) so that clients rejected together, even clients
//!   of one shared bucket, do not all return together.
//! - The fields follow the policy's [`HeaderProfile`]: by default `RateLimit-Policy` and
//!   `RateLimit` of draft-ietf-httpapi-ratelimit-headers-12, one item per rule that applied;
//!   or those plus the older `RateLimit-Limit/-Remaining/-Reset` (`Draft10`), or
//!   `X-RateLimit-Limit/-Remaining/-Reset`, or none. What `r` and `t` mean for each algorithm
//!   is [`effective_window`]; the table is in docs/policy.md.
//! - Bodies are RFC 9457 `application/problem+json` with the draft's problem types
//!   (`quota-exceeded`, `temporary-reduced-capacity`) and `violated-policies`.

use base64::Engine as _;
use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use smallvec::SmallVec;
use tollgate_crd::compiled::{Algorithm, CompiledRule, HeaderProfile, ResponseHeaders};
use tollgate_limiter::{Decision, NEVER, Nanos};

use crate::rules::{Limited, RuleSet, Verdict};

pub static RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
pub static RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
pub static RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static SHADOW_HEADER: HeaderName = HeaderName::from_static("tollgate-shadow-rejected");

/// The draft's problem types (IANA HTTP Problem Types registry).
const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";
const REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

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

/// Smallest jitter range in seconds: clients rejected together come back over at least five
/// distinct seconds, whatever the wait.
const MIN_SPREAD_SECS: u64 = 4;

/// `Retry-After` seconds: the limiter's wait rounded up (never earlier than the request could
/// succeed), plus up to 20 % of it, and at least [`MIN_SPREAD_SECS`] of range, chosen by the
/// client's seed ([`crate::keys::client_seed`]). Deterministic per client, spread across clients.
pub fn retry_after_secs(retry_after: Nanos, client_seed: u64) -> u64 {
    let base = ceil_secs(retry_after, 1);
    let spread = (base / 5).max(MIN_SPREAD_SECS);
    (base + client_seed % (spread + 1)).min(MAX_RETRY_AFTER_SECS)
}

/// `Retry-After` of the fail-closed 503: 1 to 3 s by the client's seed, so the clients of a
/// rule whose store is away do not all return in the same second.
pub fn unavailable_retry_secs(client_seed: u64) -> u64 {
    1 + client_seed % 3
}

/// The draft's `t` for one rule's decision, before rounding up to whole seconds: how long `r`
/// (the units available now) is all the client gets. `None` for concurrency limits, which have
/// no time dimension.
///
/// - Rejected, any algorithm: the wait until this request's cost would fit, so `t` agrees with
///   `Retry-After` (which is never earlier).
/// - `FixedWindow`: until the window ends, when the count resets.
/// - `TokenBucket`, `LeakyBucket`: until the next unit arrives (at most one emission interval,
///   `period / requests`; a full bucket refills a unit that long after it is spent).
/// - `SlidingWindow`: until the current window ends, after which it weighs only as the
///   previous one; units can free up earlier as the previous window's weight decays.
/// - `SlidingLog`: until the newest counted request stops counting; older ones expire sooner.
pub fn effective_window(rule: &CompiledRule, d: &Decision) -> Option<Nanos> {
    let l = &rule.limit;
    if l.algorithm == Algorithm::Concurrency {
        return None;
    }
    if !d.allowed {
        return Some(d.retry_after);
    }
    let period = l.period_ms.saturating_mul(1_000_000);
    Some(match l.algorithm {
        Algorithm::TokenBucket | Algorithm::LeakyBucket => {
            let interval = period / l.requests.max(1);
            match d.limit.checked_sub(d.remaining + 1) {
                // Below capacity: the bucket is full `reset` from now, one unit per interval.
                Some(missing) => d
                    .reset
                    .saturating_sub(missing.saturating_mul(interval))
                    .min(interval),
                None => interval,
            }
        }
        Algorithm::SlidingWindow if d.reset > period => d.reset - period,
        _ => d.reset,
    })
}

/// One rule's entry in the fields of a response.
struct Entry<'a> {
    rule: &'a CompiledRule,
    item: &'a Bytes,
    profile: HeaderProfile,
    partition_key: bool,
    decision: &'a Decision,
    key_hash: u64,
}

impl Entry<'_> {
    fn draft(&self) -> bool {
        matches!(
            self.profile,
            HeaderProfile::Draft12 | HeaderProfile::Draft10
        )
    }
}

/// Appends `;pk=:<base64>:`, the partition key: the counter key's hash, never the key.
fn push_pk(buf: &mut BytesMut, key_hash: u64) {
    let mut b64 = [0u8; 12];
    let n = base64::engine::general_purpose::STANDARD
        .encode_slice(key_hash.to_be_bytes(), &mut b64)
        .unwrap_or(0);
    buf.put_slice(b";pk=:");
    buf.put_slice(&b64[..n]);
    buf.put_u8(b':');
}

fn push_list_sep(buf: &mut BytesMut, first: &mut bool) {
    if !std::mem::replace(first, false) {
        buf.put_slice(b", ");
    }
}

/// Where response fields go: a header map (responses built for hyper), or an HTTP/1 head being
/// encoded (the fast path, which copies the app's head line by line and never builds a map).
pub trait FieldSink {
    /// Sets `name`, replacing any value the response already had.
    fn set(&mut self, name: &HeaderName, value: HeaderValue);
}

impl FieldSink for HeaderMap {
    fn set(&mut self, name: &HeaderName, value: HeaderValue) {
        self.insert(name.clone(), value);
    }
}

/// Writes the fields of `entries` per their policies' profiles. `retry` is the 429's
/// `Retry-After`, which the legacy `Reset` fields repeat so that they agree with it.
fn write_fields(headers: &mut impl FieldSink, entries: &[Entry<'_>], retry: Option<u64>) {
    let mut num = itoa::Buffer::new();
    let mut buf = BytesMut::with_capacity(entries.len() * 96);
    let mut first = true;
    for e in entries.iter().filter(|e| e.draft()) {
        push_list_sep(&mut buf, &mut first);
        buf.put_slice(e.item);
        if e.partition_key {
            push_pk(&mut buf, e.key_hash);
        }
    }
    let policy = buf.split().freeze();
    first = true;
    for e in entries.iter().filter(|e| e.draft()) {
        push_list_sep(&mut buf, &mut first);
        buf.put_u8(b'"');
        buf.put_slice(e.rule.name.as_bytes());
        buf.put_slice(b"\";r=");
        buf.put_slice(num.format(e.decision.remaining).as_bytes());
        if let Some(t) = effective_window(e.rule, e.decision) {
            buf.put_slice(b";t=");
            buf.put_slice(num.format(ceil_secs(t, 0)).as_bytes());
        }
        if e.partition_key {
            push_pk(&mut buf, e.key_hash);
        }
    }
    let service = buf.split().freeze();
    if !policy.is_empty() {
        for (name, value) in [(&RATELIMIT_POLICY, policy), (&RATELIMIT, service)] {
            if let Ok(v) = HeaderValue::from_maybe_shared(value) {
                headers.set(name, v);
            }
        }
    }
    for (profile, names) in [
        (
            HeaderProfile::Draft10,
            [&RATELIMIT_LIMIT, &RATELIMIT_REMAINING, &RATELIMIT_RESET],
        ),
        (
            HeaderProfile::XRateLimit,
            [
                &X_RATELIMIT_LIMIT,
                &X_RATELIMIT_REMAINING,
                &X_RATELIMIT_RESET,
            ],
        ),
    ] {
        if let Some(e) = tightest(entries.iter().filter(|e| e.profile == profile)) {
            let reset = retry.unwrap_or_else(|| {
                effective_window(e.rule, e.decision).map_or(0, |t| ceil_secs(t, 0))
            });
            for (name, value) in
                names
                    .into_iter()
                    .zip([e.decision.limit, e.decision.remaining, reset])
            {
                headers.set(name, HeaderValue::from(value));
            }
        }
    }
}

/// The entry closest to its limit (smallest remaining/limit); a rejection (remaining 0) wins.
fn tightest<'a, 'b>(entries: impl Iterator<Item = &'b Entry<'a>>) -> Option<&'b Entry<'a>>
where
    'a: 'b,
{
    entries.reduce(|t, e| {
        let tighter = !e.decision.allowed
            || (t.decision.allowed
                && u128::from(e.decision.remaining) * u128::from(t.decision.limit.max(1))
                    < u128::from(t.decision.remaining) * u128::from(e.decision.limit.max(1)));
        if tighter { e } else { t }
    })
}

/// Collects the entries of the rules whose policy wants fields on this response.
fn entries<'a>(
    rules: &'a RuleSet,
    decided: impl Iterator<Item = &'a Limited>,
    rejected: bool,
) -> SmallVec<[Entry<'a>; 4]> {
    decided
        .filter_map(|l| {
            let active = &rules.rules[l.rule];
            let policy = &rules.policies[active.policy].compiled;
            let wanted = policy.header_profile != HeaderProfile::None
                && (rejected || policy.response_headers == ResponseHeaders::All);
            wanted.then_some(Entry {
                rule: &active.rule,
                item: &active.policy_item,
                profile: policy.header_profile,
                partition_key: policy.partition_key,
                decision: &l.decision,
                key_hash: l.key_hash,
            })
        })
        .collect()
}

/// Adds the fields of every enforcing rule that admitted the request.
pub fn add_admitted_fields(headers: &mut impl FieldSink, rules: &RuleSet, verdict: &Verdict) {
    if verdict.admitted.is_empty() {
        return;
    }
    let entries = entries(rules, verdict.admitted.iter(), false);
    if !entries.is_empty() {
        write_fields(headers, &entries, None);
    }
}

/// The 429 for a rejected request: the rejecting rule's wait as `Retry-After`, and the fields
/// of every rule the request reached (those that admitted it, then the one that did not).
pub fn too_many_requests(rules: &RuleSet, verdict: &Verdict, client_seed: u64) -> Response<Bytes> {
    let Some(rejection) = &verdict.rejected else {
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Internal error",
            "no rejection",
        );
    };
    let limited = &rejection.limited;
    let rule = &rules.rules[limited.rule].rule;
    let retry = retry_after_secs(limited.decision.retry_after, client_seed);
    let mut resp = Response::new(Bytes::from(rejection_body(rule, retry)));
    *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    // Sized for the headers below, so the map never grows.
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
    let entries = entries(
        rules,
        verdict.admitted.iter().chain(std::iter::once(limited)),
        true,
    );
    write_fields(h, &entries, Some(retry));
    resp
}

/// The 503 of a fail-closed rule whose counter store is unreachable: a jittered `Retry-After`
/// of 1 to 3 s, the `temporary-reduced-capacity` problem, the unavailable rule's policy item
/// (its quota, which cannot be counted right now) and the fields of the rules that could be
/// decided before it.
pub fn unavailable(
    rules: &RuleSet,
    verdict: &Verdict,
    rule_index: usize,
    client_seed: u64,
) -> Response<Bytes> {
    let active = &rules.rules[rule_index];
    let retry = unavailable_retry_secs(client_seed);
    let mut resp = Response::new(Bytes::from(unavailable_body(&active.rule, retry)));
    *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
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
    let entries = entries(rules, verdict.admitted.iter(), true);
    write_fields(h, &entries, None);
    let profile = rules.policies[active.policy].compiled.header_profile;
    if matches!(profile, HeaderProfile::Draft12 | HeaderProfile::Draft10) {
        let mut policy = BytesMut::new();
        if let Some(v) = h.get(&RATELIMIT_POLICY) {
            policy.put_slice(v.as_bytes());
            policy.put_slice(b", ");
        }
        policy.put_slice(&active.policy_item);
        if let Ok(v) = HeaderValue::from_maybe_shared(policy.freeze()) {
            h.insert(RATELIMIT_POLICY.clone(), v);
        }
    }
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

/// The problem+json body of the fail-closed 503 (off the hot path: serde_json is fine here).
fn unavailable_body(rule: &CompiledRule, retry: u64) -> String {
    serde_json::json!({
        "type": REDUCED_CAPACITY,
        "title": "Request cannot be satisfied due to temporary server capacity constraints",
        "status": 503,
        "detail": format!(
            "Rule {:?} fails closed and its shared counter store is unreachable; retry after {retry} s.",
            rule.name
        ),
        "violated-policies": [rule.name],
        "rule": rule.name,
        "policy": rule.id.rsplit_once('/').map(|(p, _)| p).unwrap_or_default(),
        "retryAfterSeconds": retry,
    })
    .to_string()
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
            assert!((12..=16).contains(&r), "{r}");
            assert!((1..=3).contains(&unavailable_retry_secs(hash)));
        }
        let wide = retry_after_secs(100 * NANOS_PER_SEC, 7);
        assert!((100..=120).contains(&wide), "{wide}");
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
