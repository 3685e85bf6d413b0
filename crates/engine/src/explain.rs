//! `GET /debug/why`: which rules one request would meet in this sidecar, the state of the key
//! each would count it under, and what would happen to it (admitted, delayed, rejected, or
//! unknown while a Global rule's balance is in Redis and not asked for: `balance=redis` reads
//! it), all read without charging anything. `kubectl tollgate why` asks it
//! through the API server's port-forward. The steps are the decision core's own
//! ([`RuleSet::applies`]), so the explanation cannot drift from what `decide` does; keys appear as
//! their key hash (`keyHash`), never raw. The answer's shape is [`WhyAnswer`], shared with the
//! plugin through `tollgate_crd::why`.

use std::net::{IpAddr, SocketAddr};

use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, Request, Uri};
use serde_json::Value;
use tollgate_crd::compiled::{Algorithm, GlobalBackend, MissingKey};
use tollgate_crd::why::{
    AskedRequest, COUNTED, Decision, ExplainedRule, KeyState, Outcome, WhyAnswer, Would,
};
use tollgate_limiter::Nanos;

use crate::keys::{self, PartValue};
use crate::rules::{ActiveRule, Applies, KeySkip, RuleSet, request_cost};
use crate::shared::Shared;
use tollgate_global::GlobalRule;

/// The request to explain, from the query: `method` (default GET), `path` (default `/`, may carry
/// a query string), `header=name:value` (repeatable), `clientIp` (the peer address key parts
/// and bypass networks see; default 127.0.0.1) and `balance=redis` (read Global rules' buckets
/// in Redis, one read-only call each, instead of saying their outcome is unknown).
struct WhyRequest {
    parts: Parts,
    peer: SocketAddr,
    header_names: Vec<String>,
    read_redis: bool,
}

/// How long one Redis read of `balance=redis` may take.
const REDIS_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The explanation as JSON, or why the query is malformed (the admin server answers 400).
pub async fn why(shared: &Shared, query: Option<&str>) -> Result<Value, String> {
    let answer = explain(shared, query).await?;
    serde_json::to_value(&answer).map_err(|e| format!("encoding the answer: {e}"))
}

/// The explanation, or why the query is malformed.
pub async fn explain(shared: &Shared, query: Option<&str>) -> Result<WhyAnswer, String> {
    let req = parse_query(query)?;
    let rules = shared.rules.load_full();
    let now = tollgate_limiter::Clock::now(&shared.clock);
    let backend = if shared.global.get().is_some() {
        GlobalBackend::Redis
    } else {
        GlobalBackend::None
    };
    let mut key = Vec::new();
    let mut explained = Vec::with_capacity(rules.rules.len());
    for ri in 0..rules.rules.len() {
        let mut entry = explain_rule(shared, &rules, ri, &req, backend, now, &mut key);
        if let Some(cost) = entry.cost {
            let w = would(shared, &rules.rules[ri], &key, cost, now, req.read_redis).await;
            entry.would = Some(w);
        }
        explained.push(entry);
    }
    Ok(WhyAnswer {
        decision: decision(&explained),
        version: rules.version,
        request: AskedRequest {
            method: req.parts.method.as_str().to_string(),
            path: req.parts.uri.to_string(),
            headers: req.header_names,
            client_ip: req.peer.ip().to_string(),
        },
        rules: explained,
    })
}

fn parse_query(query: Option<&str>) -> Result<WhyRequest, String> {
    let mut method = Method::GET;
    let mut path = String::from("/");
    let mut headers: Vec<(HeaderName, HeaderValue)> = Vec::new();
    let mut ip = IpAddr::from([127, 0, 0, 1]);
    let mut read_redis = false;
    for (name, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
        match name.as_ref() {
            "method" => {
                method = Method::from_bytes(value.as_bytes())
                    .map_err(|_| format!("method={value:?}: not an HTTP method"))?;
            }
            "path" if value.starts_with('/') => path = value.into_owned(),
            "path" => return Err(format!("path={value:?}: must start with /")),
            "header" => headers.push(parse_header(&value)?),
            "clientIp" => {
                ip = value
                    .parse()
                    .map_err(|_| format!("clientIp={value:?}: not an IP address"))?;
            }
            "balance" if value == "redis" => read_redis = true,
            "balance" if value == "local" => read_redis = false,
            "balance" => return Err(format!("balance={value:?}: local or redis")),
            other => {
                return Err(format!(
                    "unknown parameter {other:?}: use method, path, header=name:value, clientIp, balance"
                ));
            }
        }
    }
    let uri: Uri = path
        .parse()
        .map_err(|e| format!("path={path:?}: not a valid request path: {e}"))?;
    let header_names = headers
        .iter()
        .map(|(n, _)| n.as_str().to_string())
        .collect();
    let mut builder = Request::builder().method(method).uri(uri);
    for (n, v) in headers {
        builder = builder.header(n, v);
    }
    let (parts, ()) = builder
        .body(())
        .map_err(|e| format!("invalid request: {e}"))?
        .into_parts();
    Ok(WhyRequest {
        parts,
        peer: SocketAddr::new(ip, 0),
        header_names,
        read_redis,
    })
}

fn parse_header(value: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (n, v) = value
        .split_once(':')
        .ok_or_else(|| format!("header={value:?}: expected name:value"))?;
    let n = HeaderName::from_bytes(n.trim().as_bytes())
        .map_err(|_| format!("header={value:?}: invalid header name"))?;
    let v = HeaderValue::from_str(v.trim())
        .map_err(|_| format!("header={value:?}: invalid header value"))?;
    Ok((n, v))
}

/// One rule: what it is, whether it counts the request, and if so its key's state here.
fn explain_rule(
    shared: &Shared,
    rules: &RuleSet,
    ri: usize,
    req: &WhyRequest,
    backend: GlobalBackend,
    now: Nanos,
    key: &mut Vec<u8>,
) -> ExplainedRule {
    let active = &rules.rules[ri];
    let rule = &active.rule;
    let applies = rules.applies(ri, &req.parts, &req.peer, key);
    let outcome = match applies {
        Applies::BypassedNetwork => {
            "bypassed: the client address is in the policy's bypass networks"
        }
        Applies::NotMatched => "not matched: method, path or headers differ",
        Applies::Skipped(KeySkip::BypassKey) => {
            "bypassed: a key part is one of the policy's bypass keys"
        }
        Applies::Skipped(KeySkip::MissingKey) => {
            "skipped: a key part is missing and onMissingKey is Skip"
        }
        Applies::Counted => COUNTED,
    };
    let mut entry = ExplainedRule {
        policy: rules.policies[active.policy].id.clone(),
        rule: rule.name.clone(),
        mode: spelled(serde_json::to_value(rule.mode)),
        scope: spelled(serde_json::to_value(rule.scope)),
        algorithm: spelled(serde_json::to_value(rule.limit.algorithm)),
        describe: rule.describe_where(backend),
        matches: applies != Applies::NotMatched && applies != Applies::BypassedNetwork,
        outcome: outcome.to_string(),
        ..ExplainedRule::default()
    };
    if applies != Applies::Counted {
        return entry;
    }
    if rule.on_missing_key != MissingKey::Skip
        && let Some(source) = rule
            .key
            .iter()
            .find(|s| matches!(keys::extract(s, &req.parts, &req.peer), PartValue::Missing))
    {
        entry.missing_key_part = serde_json::to_value(source).ok();
    }
    entry.key_hash = Some(crate::key_hash::display(shared.audit.key_hash(key)));
    entry.cost = Some(request_cost(&rule.cost, &req.parts));
    entry.state = Some(key_state(shared, active, key, now));
    entry
}

/// A policy value (mode, scope, algorithm) as the policy spells it: the answer carries it as a
/// string so a plugin older than the sidecar still reads a value it does not know.
fn spelled(value: serde_json::Result<Value>) -> String {
    match value {
        Ok(Value::String(s)) => s,
        _ => String::new(),
    }
}

/// What the rule would do with the request now, from the balance it is decided by: this
/// sidecar's bucket for a Local rule, the lease held here or (with `read_redis`) the bucket in
/// Redis for a Global one. Nothing is charged.
async fn would(
    shared: &Shared,
    active: &ActiveRule,
    key: &[u8],
    cost: u64,
    now: Nanos,
    read_redis: bool,
) -> Would {
    let hash = shared.audit.key_hashes().fingerprinter.hash(key);
    if let Some(wait) = active.blocks.as_ref().and_then(|b| b.remaining(hash, now)) {
        return Would {
            retry_after_ms: Some(wait / 1_000_000),
            ..Would::new(Outcome::Rejected, "the key is blocked (blockFor)")
        };
    }
    let mut w = match &active.global {
        Some(global) => would_global(global, key, cost, read_redis).await,
        None => would_local(active, key, cost, now),
    };
    if active.rule.mode == tollgate_crd::compiled::Mode::Shadow && w.outcome == Outcome::Rejected {
        w.outcome = Outcome::Admitted;
        w.shadow_rejected = true;
        w.why = "Shadow mode: counted as a rejection, admitted".into();
    }
    w
}

/// An outcome of a balance read at `source`.
fn balance_at(source: &str, outcome: Outcome, why: &str) -> Would {
    Would {
        source: Some(source.into()),
        ..Would::new(outcome, why)
    }
}

fn would_local(active: &ActiveRule, key: &[u8], cost: u64, now: Nanos) -> Would {
    let before = active.limiter.preview(key, now, 0);
    let d = active.limiter.preview(key, now, cost);
    let mut w = match (d.allowed, d.delay) {
        (true, 0) => balance_at("local", Outcome::Admitted, "this sidecar's bucket has room"),
        (true, delay) => Would {
            delay_ms: Some(delay / 1_000_000),
            ..balance_at(
                "local",
                Outcome::Delayed,
                "shaped: held before it is forwarded",
            )
        },
        (false, _) => Would {
            retry_after_ms: Some(d.retry_after / 1_000_000),
            ..balance_at(
                "local",
                Outcome::Rejected,
                "this sidecar's bucket is empty for this cost",
            )
        },
    };
    w.remaining = Some(before.remaining);
    w.limit = Some(d.limit);
    w
}

async fn would_global(global: &GlobalRule, key: &[u8], cost: u64, read_redis: bool) -> Would {
    let here = global.peek_lease(key).map_or(0, |(here, _)| here);
    if here >= cost && !global.exact() {
        return Would {
            remaining: Some(here),
            ..balance_at(
                "lease",
                Outcome::Admitted,
                "this sidecar's lease for the key covers the cost",
            )
        };
    }
    if !read_redis {
        return Would {
            leased_here: Some(here),
            ..balance_at(
                "lease",
                Outcome::Unknown,
                "decided by the bucket in Redis, not read: ask with balance=redis (kubectl tollgate why --balance redis)",
            )
        };
    }
    match global.peek_remote(key, REDIS_READ_TIMEOUT).await {
        Ok(r) if r.blocked_ms > 0 => Would {
            retry_after_ms: Some(r.blocked_ms),
            ..balance_at(
                "redis",
                Outcome::Rejected,
                "the key is blocked (blockFor) at every sidecar",
            )
        },
        Ok(r) => {
            let mut w = if r.remaining.saturating_add(here) >= cost {
                balance_at("redis", Outcome::Admitted, "the bucket in Redis has room")
            } else {
                Would {
                    retry_after_ms: Some(r.reset_ms.min(r.retry_after_ms.max(r.reset_ms))),
                    ..balance_at(
                        "redis",
                        Outcome::Rejected,
                        "the bucket in Redis is empty for this cost",
                    )
                }
            };
            w.remaining = Some(r.remaining);
            w.leased_here = Some(here);
            w
        }
        Err(e) => {
            let (what, why) = match global.failure_mode {
                tollgate_crd::compiled::FailureMode::Closed => (
                    Outcome::Unavailable,
                    "Redis did not answer and the rule fails closed (503)",
                ),
                tollgate_crd::compiled::FailureMode::Open => (
                    Outcome::Unknown,
                    "Redis did not answer: the rule fails open, to this sidecar's share of the limit",
                ),
            };
            Would {
                error: Some(e.to_string()),
                ..balance_at("redis", what, why)
            }
        }
    }
}

/// The request's fate over all rules, in the order the decision checks them: the first
/// enforcing rule that rejects (or cannot decide) settles it; otherwise it is delayed if a rule
/// shapes it, unknown if a Global rule's balance was not read, and admitted.
fn decision(explained: &[ExplainedRule]) -> Decision {
    let rank = |o: Outcome| match o {
        Outcome::Rejected | Outcome::Unavailable => 3,
        Outcome::Unknown => 2,
        Outcome::Delayed => 1,
        Outcome::Admitted => 0,
    };
    let mut result = Decision {
        outcome: Outcome::Admitted,
        rule: None,
        policy: None,
    };
    let counted = explained
        .iter()
        .filter_map(|e| e.would.as_ref().map(|w| (e, w.outcome)));
    for (e, w) in counted {
        if rank(w) > rank(result.outcome) {
            result = Decision {
                outcome: w,
                rule: Some(e.rule.clone()),
                policy: Some(e.policy.clone()),
            };
            if rank(w) == 3 {
                break;
            }
        }
    }
    result
}

/// The key's state in this pod: a `blockFor` block, the lease of a Global rule, or the local
/// limiter's counter.
fn key_state(shared: &Shared, active: &ActiveRule, key: &[u8], now: Nanos) -> KeyState {
    let blocked = active
        .blocks
        .as_ref()
        .and_then(|b| b.remaining(shared.audit.key_hashes().fingerprinter.hash(key), now));
    if let Some(wait) = blocked {
        return KeyState {
            tracked: true,
            blocked_for_ms: Some(wait / 1_000_000),
            ..KeyState::default()
        };
    }
    if let Some(global) = &active.global {
        return lease_state(global, key);
    }
    match active.limiter.peek(key, now) {
        Some(d) => KeyState {
            tracked: true,
            limit: Some(d.limit),
            remaining: Some(d.remaining),
            reset_ms: Some(d.reset / 1_000_000),
            in_flight: (active.rule.limit.algorithm == Algorithm::Concurrency)
                .then(|| d.limit.saturating_sub(d.remaining)),
            ..KeyState::default()
        },
        None => KeyState {
            tracked: false,
            note: Some(
                "no state for this key in this pod: its next request starts from the full limit"
                    .into(),
            ),
            ..KeyState::default()
        },
    }
}

fn lease_state(global: &GlobalRule, key: &[u8]) -> KeyState {
    let (mode, mode_why) = global.mode();
    let mut s = KeyState {
        tracked: false,
        store: Some("redis".into()),
        global_mode: Some(mode.into()),
        global_mode_why: Some(mode_why),
        live_sidecars: Some(global.live_sidecars()),
        ..KeyState::default()
    };
    match global.peek_lease(key) {
        Some((here, remaining)) => {
            s.tracked = true;
            s.leased_here = Some(here);
            // u64::MAX: Redis has not answered for this key yet.
            if remaining != u64::MAX {
                s.bucket_remaining = Some(remaining);
            }
        }
        None => {
            s.note = Some(
                "this pod holds no lease for the key: its balance is in Redis, not read here"
                    .into(),
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_queries_are_refused_with_the_reason() {
        for (query, needle) in [
            ("method=GE%20T", "not an HTTP method"),
            ("path=orders", "must start with /"),
            ("header=novalue", "expected name:value"),
            ("header=bad%20name:v", "invalid header name"),
            ("clientIp=300.1.1.1", "not an IP address"),
            ("verb=GET", "unknown parameter"),
        ] {
            let err = parse_query(Some(query)).err().unwrap_or_default();
            assert!(err.contains(needle), "{query}: {err:?}");
        }
    }

    #[test]
    fn a_query_becomes_the_request_it_names() {
        let req = parse_query(Some(
            "method=POST&path=%2Fsearch%3Fq%3Dx&header=x-api-key:abc&clientIp=10.0.0.7",
        ))
        .unwrap();
        assert_eq!(req.parts.method, Method::POST);
        assert_eq!(req.parts.uri, "/search?q=x");
        assert_eq!(req.parts.headers["x-api-key"], "abc");
        assert_eq!(req.peer.ip(), IpAddr::from([10, 0, 0, 7]));
        assert_eq!(req.header_names, ["x-api-key"]);
    }
}
