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
    fingerprint: u64,
}

impl Entry<'_> {
    fn draft(&self) -> bool {
        matches!(
            self.profile,
            HeaderProfile::Draft12 | HeaderProfile::Draft10
        )
    }
}

/// A field value being built: on the stack for up to a few rules.
type FieldValue = SmallVec<[u8; 256]>;

/// Appends `;pk=:<base64>:`, the partition key: the counter key's hash, never the key.
fn push_pk(buf: &mut FieldValue, fingerprint: u64) {
    let mut b64 = [0u8; 12];
    let n = base64::engine::general_purpose::STANDARD
        .encode_slice(fingerprint.to_be_bytes(), &mut b64)
        .unwrap_or(0);
    buf.extend_from_slice(b";pk=:");
    buf.extend_from_slice(&b64[..n]);
    buf.push(b':');
}

fn push_list_sep(buf: &mut FieldValue, first: &mut bool) {
    if !std::mem::replace(first, false) {
        buf.extend_from_slice(b", ");
    }
}

/// Where response fields go: a header map (responses built for hyper), or an HTTP/1 head being
/// encoded (the fast path, which copies the app's head line by line and never builds a map).
pub trait FieldSink {
    /// Sets `name`, replacing any value the response already had. A value that is not a valid
    /// field value (never the case for what this module writes) is left out.
    fn set(&mut self, name: &HeaderName, value: &[u8]);

    fn set_u64(&mut self, name: &HeaderName, value: u64) {
        self.set(name, itoa::Buffer::new().format(value).as_bytes());
    }
}

impl FieldSink for HeaderMap {
    fn set(&mut self, name: &HeaderName, value: &[u8]) {
        if let Ok(v) = HeaderValue::from_bytes(value) {
            self.insert(name.clone(), v);
        }
    }

    fn set_u64(&mut self, name: &HeaderName, value: u64) {
        self.insert(name.clone(), HeaderValue::from(value));
    }
}

/// Writes the fields of `entries` per their policies' profiles. `retry` is the 429's
/// `Retry-After`, which the legacy `Reset` fields repeat so that they agree with it.
fn write_fields(headers: &mut impl FieldSink, entries: &[Entry<'_>], retry: Option<u64>) {
    let mut num = itoa::Buffer::new();
    // On the stack for up to a few rules.
    let mut buf = FieldValue::new();
    let mut first = true;
    for e in entries.iter().filter(|e| e.draft()) {
        push_list_sep(&mut buf, &mut first);
        buf.extend_from_slice(e.item);
        if e.partition_key {
            push_pk(&mut buf, e.fingerprint);
        }
    }
    if !buf.is_empty() {
        headers.set(&RATELIMIT_POLICY, &buf);
    }
    buf.clear();
    first = true;
    for e in entries.iter().filter(|e| e.draft()) {
        push_list_sep(&mut buf, &mut first);
        buf.push(b'"');
        buf.extend_from_slice(e.rule.name.as_bytes());
        buf.extend_from_slice(b"\";r=");
        buf.extend_from_slice(num.format(e.decision.remaining).as_bytes());
        if let Some(t) = effective_window(e.rule, e.decision) {
            buf.extend_from_slice(b";t=");
            buf.extend_from_slice(num.format(ceil_secs(t, 0)).as_bytes());
        }
        if e.partition_key {
            push_pk(&mut buf, e.fingerprint);
        }
    }
    if !buf.is_empty() {
        headers.set(&RATELIMIT, &buf);
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
                headers.set_u64(name, value);
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
                fingerprint: l.fingerprint,
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
    // Sized for the headers written, so the map never grows.
    let mut headers = HeaderMap::with_capacity(8);
    let mut body = Vec::with_capacity(512);
    if write_too_many_requests(&mut headers, &mut body, rules, verdict, client_seed).is_none() {
        return problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Internal error",
            "no rejection",
        );
    }
    let mut resp = Response::new(Bytes::from(body));
    *resp.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    *resp.headers_mut() = headers;
    resp
}

/// The 429's header fields into `sink` and its body onto `body`, for writers that encode the
/// head themselves (and for [`too_many_requests`]). None when the verdict rejected nothing.
pub fn write_too_many_requests(
    sink: &mut impl FieldSink,
    body: &mut Vec<u8>,
    rules: &RuleSet,
    verdict: &Verdict,
    client_seed: u64,
) -> Option<()> {
    let limited = &verdict.rejected.as_ref()?.limited;
    let active = &rules.rules[limited.rule];
    let retry = retry_after_secs(limited.decision.retry_after, client_seed);
    active.rejection_body.write(&active.rule, retry, body);
    sink.set(&http::header::CONTENT_TYPE, b"application/problem+json");
    sink.set_u64(&http::header::RETRY_AFTER, retry);
    sink.set(&http::header::CACHE_CONTROL, b"no-store");
    let entries = entries(
        rules,
        verdict.admitted.iter().chain(std::iter::once(limited)),
        true,
    );
    write_fields(sink, &entries, Some(retry));
    Some(())
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
    let status = StatusCode::SERVICE_UNAVAILABLE;
    unavailable_as(rules, verdict, rule_index, client_seed, status)
}

/// [`unavailable`] with the status the client will get, for an edge whose gateway picks the
/// status itself (Envoy's rate limit filter sends one status for every refusal): the problem
/// body's `status` must be the response's (RFC 9457).
pub fn unavailable_as(
    rules: &RuleSet,
    verdict: &Verdict,
    rule_index: usize,
    client_seed: u64,
    status: StatusCode,
) -> Response<Bytes> {
    let active = &rules.rules[rule_index];
    let retry = unavailable_retry_secs(client_seed);
    let body = unavailable_body(&active.rule, retry, status.as_u16());
    let mut resp = Response::new(Bytes::from(body));
    *resp.status_mut() = status;
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

/// The problem+json body of the fail-closed 503 (off the hot path: serde_json is fine here).
fn unavailable_body(rule: &CompiledRule, retry: u64, status: u16) -> String {
    serde_json::json!({
        "type": REDUCED_CAPACITY,
        "title": "Request cannot be satisfied due to temporary server capacity constraints",
        "status": status,
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

    #[test]
    fn retry_after_spreads_clients() {
        let distinct: std::collections::HashSet<u64> = (0..100u64)
            .map(|h| retry_after_secs(60 * NANOS_PER_SEC, h))
            .collect();
        assert!(distinct.len() >= 10, "{distinct:?}");
    }
}
