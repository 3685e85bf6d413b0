//! `GET /debug/why`: which rules one request would meet in this sidecar and the state of the key
//! each would count it under, read without charging anything. `kubectl tollgate why` asks it
//! through the API server's port-forward. The steps are the decision core's own
//! ([`RuleSet::applies`]), so the explanation cannot drift from what `decide` does; keys appear as
//! their identity (`keyHash`), never raw.

use std::net::{IpAddr, SocketAddr};

use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, Request, Uri};
use serde_json::{Value, json};
use tollgate_crd::compiled::{Algorithm, GlobalBackend, MissingKey};
use tollgate_limiter::Nanos;

use crate::engine::Shared;
use crate::global::GlobalRule;
use crate::keys::{self, PartValue};
use crate::rules::{ActiveRule, Applies, KeySkip, RuleSet, request_cost};

/// The request to explain, from the query: `method` (default GET), `path` (default `/`, may carry
/// a query string), `header=name:value` (repeatable) and `clientIp` (the peer address key parts
/// and bypass networks see; default 127.0.0.1).
struct WhyRequest {
    parts: Parts,
    peer: SocketAddr,
    header_names: Vec<String>,
}

/// The explanation as JSON, or why the query is malformed (the admin server answers 400).
pub fn why(shared: &Shared, query: Option<&str>) -> Result<Value, String> {
    let req = parse_query(query)?;
    let rules = shared.rules.load();
    let now = tollgate_limiter::Clock::now(&shared.clock);
    let backend = if shared.global.get().is_some() {
        GlobalBackend::Redis
    } else {
        GlobalBackend::None
    };
    let mut key = Vec::new();
    let explained: Vec<Value> = (0..rules.rules.len())
        .map(|ri| explain_rule(shared, &rules, ri, &req, backend, now, &mut key))
        .collect();
    Ok(json!({
        "version": rules.version,
        "request": {
            "method": req.parts.method.as_str(),
            "path": req.parts.uri.to_string(),
            "headers": req.header_names,
            "clientIp": req.peer.ip().to_string(),
        },
        "rules": explained,
    }))
}

fn parse_query(query: Option<&str>) -> Result<WhyRequest, String> {
    let mut method = Method::GET;
    let mut path = String::from("/");
    let mut headers: Vec<(HeaderName, HeaderValue)> = Vec::new();
    let mut ip = IpAddr::from([127, 0, 0, 1]);
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
            other => {
                return Err(format!(
                    "unknown parameter {other:?}: use method, path, header=name:value, clientIp"
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
) -> Value {
    let active = &rules.rules[ri];
    let rule = &active.rule;
    let mut entry = json!({
        "policy": rules.policies[active.policy].id,
        "rule": rule.name,
        "mode": rule.mode,
        "scope": rule.scope,
        "algorithm": rule.limit.algorithm,
        "describe": rule.describe_where(backend),
    });
    let applies = rules.applies(ri, &req.parts, &req.peer, key);
    entry["matches"] =
        (applies != Applies::NotMatched && applies != Applies::BypassedNetwork).into();
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
        Applies::Counted => "limited",
    };
    entry["outcome"] = outcome.into();
    if applies != Applies::Counted {
        return entry;
    }
    if rule.on_missing_key != MissingKey::Skip
        && let Some(source) = rule
            .key
            .iter()
            .find(|s| matches!(keys::extract(s, &req.parts, &req.peer), PartValue::Missing))
    {
        entry["missingKeyPart"] = serde_json::to_value(source).unwrap_or_default();
    }
    entry["keyHash"] = crate::identity::display(shared.audit.key_identity(key)).into();
    entry["cost"] = request_cost(&rule.cost, &req.parts).into();
    entry["state"] = key_state(shared, active, key, now);
    entry
}

/// The key's state in this pod: a `blockFor` block, the lease of a Global rule, or the local
/// limiter's counter.
fn key_state(shared: &Shared, active: &ActiveRule, key: &[u8], now: Nanos) -> Value {
    let blocked = active
        .blocks
        .as_ref()
        .and_then(|b| b.remaining(shared.audit.identity().hasher.hash(key), now));
    if let Some(wait) = blocked {
        return json!({ "tracked": true, "blockedForMs": wait / 1_000_000 });
    }
    if let Some(global) = &active.global {
        return lease_state(global, key);
    }
    match active.limiter.peek(key, now) {
        Some(d) => {
            let mut s = json!({
                "tracked": true,
                "limit": d.limit,
                "remaining": d.remaining,
                "resetMs": d.reset / 1_000_000,
            });
            if active.rule.limit.algorithm == Algorithm::Concurrency {
                s["inFlight"] = d.limit.saturating_sub(d.remaining).into();
            }
            s
        }
        None => json!({
            "tracked": false,
            "note": "no state for this key in this pod: its next request starts from the full limit",
        }),
    }
}

fn lease_state(global: &GlobalRule, key: &[u8]) -> Value {
    let (mode, mode_why) = global.mode();
    let mut s = json!({
        "tracked": false,
        "store": "redis",
        "globalMode": mode,
        "globalModeWhy": mode_why,
        "liveSidecars": global.live_sidecars(),
    });
    match global.peek_lease(key) {
        Some((here, remaining)) => {
            s["tracked"] = true.into();
            s["leasedHere"] = here.into();
            // u64::MAX: Redis has not answered for this key yet.
            if remaining != u64::MAX {
                s["bucketRemaining"] = remaining.into();
            }
        }
        None => {
            s["note"] =
                "this pod holds no lease for the key: its balance is in Redis, not read here"
                    .into();
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
