//! Fuzz target bodies for every tollgate parser that sees untrusted input.
//!
//! Each `pub fn <target>(data: &[u8])` is what `fuzz_targets/<target>.rs` hands to libFuzzer, and
//! what `tests/replay.rs` runs (on stable) over the checked-in corpora and a few thousand
//! pseudo-random inputs. A target must never panic; the assertions in here are the invariants a
//! fuzzer should check beyond "no panic" (round trips, agreement between the components that
//! parse the same thing).

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use base64::Engine;
use http::request::Parts;
use http::{HeaderName, HeaderValue};
use tollgate_crd::compiled::{CompiledPolicy, KeySource};
use tollgate_crd::duration::{self, DurationError};
use tollgate_crd::stream::{StreamMessage, parse_line};
use tollgate_limiter::{Nanos, StoreConfig};
use tollgate_global::store::{LeaseReply, parse_lease_reply};
use tollgate_engine::keys::{self, ClientAddr, PartValue};
use tollgate_engine::metrics::Metrics;
use tollgate_global::limit::for_limiter;
use tollgate_engine::rules::{Fingerprinter, RuleSet};

/// A target body: must not panic on any input.
pub type Target = fn(&[u8]);

/// Every target, by name, for the replay test and `replay_args`.
pub const TARGETS: &[(&str, Target)] = &[
    ("policy_yaml", policy_yaml),
    ("duration", duration),
    ("key_extraction", key_extraction),
    ("stream_line", stream_line),
    ("lease_reply", lease_reply),
    ("http1_wire", http1_wire),
];

// ---------------------------------------------------------------------------------------------
// policy_yaml: policy files (standalone sidecar, `tollgate-sidecar check`) and, through the JSON
// round trip, what the admission webhook and controller see.
// ---------------------------------------------------------------------------------------------

/// YAML text → `parse_yaml` → `compile` for every document; accepted policies must survive the
/// wire format and be accepted by the sidecar's rule-set builder.
///
/// Inputs starting with a NUL byte (which YAML text never does) select the structured mode: the
/// rest of the input overrides the strings and numbers of a policy that uses every feature, and
/// that policy object is compiled and checked like a parsed one. Byte-level mutation of YAML
/// rarely produces, say, a valid header name with a control character in its value; this does.
pub fn policy_yaml(data: &[u8]) {
    if let Some((0, rest)) = data.split_first() {
        if let Some(policy) = arbitrary_policy(rest) {
            check_policies(&[policy]);
        }
        return;
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match tollgate_crd::parse_yaml(text) {
        Ok(policies) => check_policies(&policies),
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

/// Compiles policies as `config::load` does; what compiles must survive the wire format and be
/// accepted by the sidecar's rule-set builder.
fn check_policies(policies: &[tollgate_crd::RateLimitPolicy]) {
    let mut compiled: Vec<CompiledPolicy> = Vec::new();
    for policy in policies {
        let result = tollgate_crd::compile(policy);
        // The API server hands the webhook and the controller the same object as JSON: it must
        // be the object the YAML described (so both compile to the same verdict).
        let json = serde_json::to_value(policy).expect("a parsed policy serializes to JSON");
        let from_json: tollgate_crd::RateLimitPolicy =
            serde_json::from_value(json).expect("a policy's own JSON deserializes");
        assert!(
            from_json.metadata == policy.metadata && from_json.spec == policy.spec,
            "a policy changes through its JSON form: {policy:?} became {from_json:?}"
        );
        match result {
            Ok(c) => {
                check_compiled(&c);
                // `config::load` refuses duplicate ids; mirror it so the rule set is what a
                // sidecar would install.
                if !compiled.iter().any(|p| p.id() == c.id()) {
                    compiled.push(c);
                }
            }
            Err(errs) => {
                assert!(!errs.0.is_empty(), "compile failed without an error");
                let _ = errs.to_string();
            }
        }
    }
    if compiled.is_empty() {
        return;
    }
    let set = build_rule_set(1, compiled, None)
        .unwrap_or_else(|e| panic!("the sidecar refuses policies that compile accepted: {e}"));
    decide_all(&set);
}

/// Invariants of a policy `compile` accepted.
fn check_compiled(c: &CompiledPolicy) {
    let json = serde_json::to_string(c).expect("a compiled policy serializes");
    let back: CompiledPolicy =
        serde_json::from_str(&json).expect("a compiled policy deserializes from its own JSON");
    assert_eq!(&back, c, "compiled policy JSON round trip");
    // What the controller streams: the policy inside a snapshot line.
    let line = serde_json::to_vec(&StreamMessage::Snapshot {
        wire_version: tollgate_crd::WIRE_VERSION,
        version: 1,
        policies: vec![c.clone()],
        members: Default::default(),
        epoch: "e".to_string(),
        key_hash_secret: None,
    })
    .expect("a snapshot serializes");
    match parse_line(&line).expect("a snapshot line parses") {
        StreamMessage::Snapshot { policies, .. } => assert_eq!(policies, std::slice::from_ref(c)),
        other => panic!("snapshot parsed as {other:?}"),
    }
    let _ = c.id();
    for rule in &c.rules {
        let _ = rule.describe();
        for_limiter(&rule.limit)
            .unwrap_or_else(|e| panic!("compiled limit {:?} is no valid limiter limit: {e}", rule.limit));
    }
}

/// The policy with every feature, its strings and numbers replaced where the input says so.
fn arbitrary_policy(data: &[u8]) -> Option<tollgate_crd::RateLimitPolicy> {
    use tollgate_crd::policy::*;
    static TEMPLATE: OnceLock<tollgate_crd::RateLimitPolicy> = OnceLock::new();
    let mut u = arbitrary::Unstructured::new(data);
    let u = &mut u;
    let mut p = TEMPLATE
        .get_or_init(|| tollgate_crd::parse_yaml(KEY_POLICY).unwrap().pop().unwrap())
        .clone();
    const NAMES: &[&str] = &["keys", "a", "my-policy", "x", "-a", "A", ""];
    const HEADERS: &[&str] = &[
        "x-api-key",
        "X-Tenant",
        "authorization",
        "x-cost",
        "a b",
        "",
    ];
    const VALUES: &[&str] = &["prod", "a b", "\u{e9}", "", " x "];
    const PATHS: &[&str] = &["/api", "/", "//", "/a?b", "/a#b", "a", "/users/", ""];
    const REGEXES: &[&str] = &["[a-z]+", "(", "\\w{1,5}", "a|", "", "(?i)x", "\\b", "^a$"];
    const DURATIONS: &[&str] = &[
        "1s", "0s", "24h", "24h1ms", "1m", "1m1ms", "500ms", "1.5s", "",
    ];
    const CIDRS: &[&str] = &["10.0.0.0/8", "10.0.0.1", "::/0", "2001:db8::/129", "x", ""];
    const CLAIMS: &[&str] = &["sub", "org.id", "a..b", ".", "", "a.b.c"];
    if maybe(u) {
        p.metadata.name = Some(pick(u, NAMES)?);
    }
    if maybe(u) {
        p.metadata.namespace = Some(pick(u, NAMES)?);
    }
    let labels = p
        .spec
        .target_ref
        .selector
        .match_labels
        .get_or_insert_default();
    while maybe(u) {
        labels.insert(pick(u, NAMES)?, pick(u, NAMES)?);
    }
    let bypass = p.spec.bypass.get_or_insert_default();
    while maybe(u) {
        bypass.cidrs.push(pick(u, CIDRS)?);
    }
    while maybe(u) {
        bypass.keys.push(pick(u, VALUES)?);
    }
    if maybe(u) {
        bypass.trusted_hops = edge_u32(u)?;
    }
    // One to three of the template's rules (all of them would make every run slow).
    let template = std::mem::take(&mut p.spec.rules);
    for _ in 0..u.int_in_range(1..=3).ok()? {
        p.spec.rules.push(u.choose(&template).ok()?.clone());
    }
    for rule in &mut p.spec.rules {
        if maybe(u) {
            rule.name = pick(u, NAMES)?;
        }
        let m = rule.matches.get_or_insert_default();
        if maybe(u) {
            m.path = Some(match u.int_in_range(0..=3).ok()? {
                0 => PathMatch {
                    exact: Some(pick(u, PATHS)?),
                    ..Default::default()
                },
                1 => PathMatch {
                    prefix: Some(pick(u, PATHS)?),
                    ..Default::default()
                },
                2 => PathMatch {
                    regex: Some(pick(u, REGEXES)?),
                    ..Default::default()
                },
                _ => PathMatch::default(),
            });
        }
        while maybe(u) {
            let mut h = HeaderMatch {
                name: pick(u, HEADERS)?,
                ..Default::default()
            };
            match u.int_in_range(0..=3).ok()? {
                0 => h.value = Some(pick(u, VALUES)?),
                1 => h.regex = Some(pick(u, REGEXES)?),
                2 => {
                    h.value = Some(pick(u, VALUES)?);
                    h.regex = Some(pick(u, REGEXES)?);
                }
                _ => {}
            }
            m.headers.push(h);
        }
        if maybe(u) {
            m.methods
                .push(*u.choose(&[Method::GET, Method::POST, Method::TRACE]).ok()?);
        }
        while maybe(u) {
            let mut k = KeyPart::default();
            match u.int_in_range(0..=6).ok()? {
                0 => k.header = Some(pick(u, HEADERS)?),
                1 => {
                    k.client_ip = Some(ClientIp {
                        trusted_hops: edge_u32(u)?,
                    })
                }
                2 => k.query_param = Some(pick(u, VALUES)?),
                3 => {
                    k.jwt_claim = Some(JwtClaim {
                        header: pick(u, HEADERS)?,
                        claim: pick(u, CLAIMS)?,
                    })
                }
                4 => k.constant = Some(pick(u, VALUES)?),
                5 => k.endpoint = Some(EndpointKey {}),
                _ => {
                    k.header = Some(pick(u, HEADERS)?);
                    k.constant = Some(pick(u, VALUES)?);
                }
            }
            rule.key.push(k);
        }
        if maybe(u) {
            rule.limit.algorithm = *u
                .choose(&[
                    Algorithm::TokenBucket,
                    Algorithm::SlidingWindow,
                    Algorithm::FixedWindow,
                    Algorithm::SlidingLog,
                    Algorithm::LeakyBucket,
                    Algorithm::Concurrency,
                ])
                .ok()?;
            rule.scope = if u.arbitrary().ok()? {
                Scope::Local
            } else {
                Scope::Global
            };
            rule.accuracy = if u.arbitrary().ok()? {
                Accuracy::Strict
            } else {
                Accuracy::Leased
            };
        }
        if maybe(u) {
            rule.limit.requests = edge_u64(u)?;
        }
        if maybe(u) {
            rule.limit.period = if u.arbitrary().ok()? {
                Some(pick(u, DURATIONS)?)
            } else {
                None
            };
        }
        if maybe(u) {
            rule.limit.burst = Some(edge_u64(u)?);
        }
        if maybe(u) {
            rule.limit.max_delay = Some(pick(u, DURATIONS)?);
        }
        if maybe(u) {
            rule.cost = Some(Cost {
                amount: u.arbitrary::<bool>().ok()?.then(|| edge_u32(u)).flatten(),
                header: if u.arbitrary().ok()? {
                    Some(pick(u, HEADERS)?)
                } else {
                    None
                },
                max: u.arbitrary::<bool>().ok()?.then(|| edge_u32(u)).flatten(),
                response_header: if u.arbitrary().ok()? {
                    Some(pick(u, HEADERS)?)
                } else {
                    None
                },
                reserve: u.arbitrary::<bool>().ok()?.then(|| edge_u32(u)).flatten(),
            });
        }
    }
    Some(p)
}

/// One of `good` (sometimes with an arbitrary character inserted), or an arbitrary string.
fn pick(u: &mut arbitrary::Unstructured<'_>, good: &[&str]) -> Option<String> {
    Some(match u.int_in_range(0..=3).ok()? {
        0 | 1 => u.choose(good).ok()?.to_string(),
        2 => {
            let mut s = u.choose(good).ok()?.to_string();
            let c: char = u.arbitrary().ok()?;
            let at = s
                .char_indices()
                .map(|(i, _)| i)
                .nth(u.int_in_range(0..=s.len()).ok()?);
            s.insert(at.unwrap_or(s.len()), c);
            s
        }
        _ => u.arbitrary().ok()?,
    })
}

/// Whether to apply the next optional change (false once the input is used up).
fn maybe(u: &mut arbitrary::Unstructured<'_>) -> bool {
    !u.is_empty() && u.ratio(1, 3).unwrap_or(false)
}

/// A number biased towards the boundaries the code under test cares about.
fn edge_u64(u: &mut arbitrary::Unstructured<'_>) -> Option<u64> {
    const EDGES: &[u64] = &[
        0,
        1,
        2,
        1_000,
        10_000,
        10_001,
        60_000,
        86_400_000,
        1_000_000_000,
        1_000_000_001,
        18_446_744_073_709,
        18_446_744_073_710,
        u32::MAX as u64,
        i64::MAX as u64,
        u64::MAX / 1_000_000,
        u64::MAX - 1,
        u64::MAX,
    ];
    match u.int_in_range(0..=3).ok()? {
        0 => u.choose(EDGES).ok().copied(),
        1 => u.int_in_range(0..=100).ok(),
        _ => u.arbitrary().ok(),
    }
}

fn edge_u32(u: &mut arbitrary::Unstructured<'_>) -> Option<u32> {
    match u.int_in_range(0..=2).ok()? {
        0 => u
            .choose(&[0, 1, 16, 17, 100, 1_000_000, 1_000_001, u32::MAX])
            .ok()
            .copied(),
        1 => u.int_in_range(0..=20).ok(),
        _ => u.arbitrary().ok(),
    }
}

// ---------------------------------------------------------------------------------------------
// duration
// ---------------------------------------------------------------------------------------------

fn duration_pattern() -> &'static regex::Regex {
    static RE: OnceLock<regex::Regex> = OnceLock::new();
    RE.get_or_init(|| regex::Regex::new(tollgate_crd::policy::DURATION_PATTERN).unwrap())
}

/// `duration::parse` never panics, agrees with the schema pattern, and `format` round-trips.
pub fn duration(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        let parsed = duration::parse(s);
        if let Ok(d) = parsed {
            assert_eq!(
                d.subsec_nanos() % 1_000_000,
                0,
                "{s:?}: sub-millisecond duration"
            );
            let f = duration::format(d);
            assert_eq!(duration::parse(&f), Ok(d), "{s:?} formats as {f:?}");
        }
        // The parser takes numbers of any length (checking overflow); the pattern at most 9
        // digits. Where neither limit applies they must agree, or the API server and the
        // sidecar would disagree about a policy.
        let long_number = s
            .split(|c: char| !c.is_ascii_digit())
            .any(|run| run.len() > 9);
        if !long_number && parsed != Err(DurationError::Overflow) {
            assert_eq!(
                duration_pattern().is_match(s),
                parsed.is_ok(),
                "{s:?}: parser and DURATION_PATTERN disagree ({parsed:?})"
            );
        }
    }
    if let Some(ms) = data.get(..8) {
        let d = Duration::from_millis(u64::from_le_bytes(ms.try_into().unwrap()));
        let f = duration::format(d);
        assert_eq!(duration::parse(&f), Ok(d), "{d:?} formats as {f:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// key_extraction
// ---------------------------------------------------------------------------------------------

const DEFAULT_PEER: &str = "192.0.2.9:5555";

/// A request in a line format that is easy to seed and mutate:
///
/// ```text
/// <uri>                 e.g. /api?key=abc
/// <peer>                a socket address; anything else means 192.0.2.9:5555
/// <query param name>
/// <jwt claim path>      dot-separated
/// <name>: <value>       any number of header lines (values as raw bytes)
/// <value>               a line without ':' is another X-Forwarded-For line
/// ```
///
/// A `jwt-payload: <json>` header line is wrapped into a `Bearer` token (base64url) and read
/// through the claim path, so the fuzzer can reach the JSON walk without inventing base64.
pub fn key_extraction(data: &[u8]) {
    let mut lines = data.split(|b| *b == b'\n');
    let uri = lines.next().unwrap_or_default();
    let peer: SocketAddr = lines
        .next()
        .and_then(|l| std::str::from_utf8(l).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| DEFAULT_PEER.parse().unwrap());
    let param = String::from_utf8_lossy(lines.next().unwrap_or_default()).into_owned();
    let claim: Vec<String> = String::from_utf8_lossy(lines.next().unwrap_or_default())
        .split('.')
        .map(str::to_string)
        .collect();

    let mut builder = http::Request::builder();
    if let Ok(u) = http::Uri::try_from(uri) {
        builder = builder.uri(u);
    }
    let mut jwt_payloads: Vec<&[u8]> = Vec::new();
    let mut xff_lines = 0usize;
    let mut header_names: Vec<HeaderName> = Vec::new();
    for line in lines {
        let (name, value) = match line.iter().position(|b| *b == b':') {
            Some(i) => (&line[..i], trim_ows(&line[i + 1..])),
            None => (&b"x-forwarded-for"[..], line),
        };
        if name.eq_ignore_ascii_case(b"jwt-payload") {
            jwt_payloads.push(value);
            continue;
        }
        let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) else {
            continue;
        };
        if n == "x-forwarded-for" {
            xff_lines += 1;
        }
        if !header_names.contains(&n) {
            header_names.push(n.clone());
        }
        builder = builder.header(n, v);
    }
    let Ok(req) = builder.body(()) else {
        return;
    };
    let (parts, ()) = req.into_parts();

    check_client_ip(&parts, &peer, xff_lines);

    // Query parameters, through the URI the request carries and raw (no URI validation).
    let _ = keys::query_param(parts.uri.query(), &param);
    if let Some(q) = std::str::from_utf8(uri)
        .ok()
        .and_then(|u| u.split_once('?'))
        .map(|(_, q)| q)
    {
        check_query_param(q, &param);
    }

    // JWT claims: every header value as a token, and the structured payloads.
    for name in &header_names {
        for v in parts.headers.get_all(name) {
            let r = keys::jwt_claim(v.as_bytes(), &claim);
            if v.len() > 8 * 1024 {
                assert_eq!(r, None, "oversized token decoded");
            }
        }
    }
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    for payload in jwt_payloads {
        let token = format!(
            "Bearer {}.{}.c2ln",
            b64.encode(br#"{"alg":"RS256","typ":"JWT"}"#),
            b64.encode(payload)
        );
        let got = keys::jwt_claim(token.as_bytes(), &claim);
        if token.len() <= 8 * 1024 {
            let expected = serde_json::from_slice::<serde_json::Value>(payload)
                .ok()
                .and_then(|v| {
                    let mut cur = &v;
                    for name in &claim {
                        cur = cur.as_object()?.get(name)?;
                    }
                    cur.as_str().map(str::to_string)
                });
            if expected.is_some() {
                assert_eq!(got, expected, "string claim {claim:?} of {token:?}");
            }
        }
    }

    // Every key source, as a rule would use it.
    let mut sources: Vec<KeySource> = header_names
        .iter()
        .map(|n| KeySource::Header(n.as_str().to_string()))
        .collect();
    sources.extend((0..=16).map(|trusted_hops| KeySource::ClientIp { trusted_hops }));
    sources.push(KeySource::QueryParam(param.clone()));
    sources.push(KeySource::JwtClaim {
        header: "authorization".to_string(),
        claim: claim.clone(),
    });
    sources.push(KeySource::Constant(param.clone()));
    sources.push(KeySource::Endpoint);
    sources.push(KeySource::Descriptor(param.clone()));
    let bypass = [param.clone(), "203.0.113.7".to_string(), "k1".to_string()];
    let mut buf = Vec::new();
    for s in &sources {
        let v = keys::extract(s, &parts, &peer);
        let _ = v.is_bypass_key(&bypass);
        let before = buf.len();
        v.append_to(&mut buf);
        assert!(
            buf.len() > before,
            "a key part appends at least its separator"
        );
        if let (KeySource::Header(_), PartValue::Missing) = (s, &v) {
            panic!("header {s:?} is present but extracted as missing");
        }
    }

    // And the whole decision path over a rule set that uses all of them.
    decide(key_rule_set(), &parts, &peer);
}

/// Optional whitespace around a header value, as an HTTP parser strips it.
fn trim_ows(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(start, |i| i + 1);
    &v[start..end]
}

fn check_client_ip(parts: &Parts, peer: &SocketAddr, xff_lines: usize) {
    let values: Vec<&HeaderValue> = parts.headers.get_all("x-forwarded-for").iter().collect();
    assert_eq!(values.len(), xff_lines);
    // Entries from the right, if every line is text (otherwise the peer is used from the first
    // non-text line on).
    let texts: Option<Vec<&str>> = values.iter().map(|v| v.to_str().ok()).collect();
    let entries: Option<Vec<&str>> =
        texts.map(|t| t.iter().rev().flat_map(|l| l.rsplit(',')).collect());
    for hops in 0..=17u32 {
        let got = keys::client_ip(parts, peer, hops);
        match got {
            ClientAddr::Peer(ip) => assert_eq!(ip, peer.ip()),
            ClientAddr::Forwarded(_) => assert!(hops > 0),
            ClientAddr::Unparsed(s) => {
                assert!(hops > 0);
                assert_eq!(s, s.trim(), "unparsed entry is not trimmed");
                assert!(s.parse::<IpAddr>().is_err(), "{s:?} is an address");
            }
        }
        if let Some(entries) = &entries {
            let expect_forwarded = hops > 0 && hops as usize <= entries.len();
            assert_eq!(
                !matches!(got, ClientAddr::Peer(_)),
                expect_forwarded,
                "hops {hops}, entries {entries:?}: {got:?}"
            );
            if expect_forwarded {
                let entry = entries[hops as usize - 1].trim();
                match got {
                    ClientAddr::Unparsed(s) => assert_eq!(s, entry),
                    ClientAddr::Forwarded(ip) => {
                        if let Ok(direct) = entry.parse::<IpAddr>() {
                            assert_eq!(ip, direct);
                        }
                    }
                    ClientAddr::Peer(_) => unreachable!(),
                }
            }
        }
    }
}

fn check_query_param(query: &str, name: &str) {
    // Borrowed values are verbatim slices of the query: nothing to decode in them.
    if let Some(std::borrow::Cow::Borrowed(v)) = keys::query_param(Some(query), name) {
        assert!(
            !v.contains(&b'%') && !v.contains(&b'+'),
            "{query:?}: {v:?} undecoded"
        );
        let range = query.as_bytes().as_ptr_range();
        assert!(
            v.is_empty() || range.contains(&v.as_ptr()),
            "value outside the query"
        );
    }
}

/// A policy using every key source, a bypass list, header matchers and a cost header.
const KEY_POLICY: &str = r#"
apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: keys, namespace: fuzz}
spec:
  targetRef: {selector: {}}
  bypass:
    cidrs: [10.0.0.0/8, "2001:db8:ffff::/48"]
    keys: [internal-batch]
    trustedHops: 1
  rules:
    - name: per-ip
      key: [{clientIP: {trustedHops: 2}}]
      limit: {requests: 5, period: 1s}
    - name: per-key-and-claim
      match:
        methods: [GET, POST]
        path: {prefix: /api}
        headers: [{name: x-tenant, regex: "[a-z]+"}]
      key: [{header: x-api-key}, {jwtClaim: {claim: org.id}}, {queryParam: key}]
      onMissingKey: Skip
      cost: {header: x-cost, max: 50}
      limit: {requests: 100, period: 1m, burst: 20, algorithm: TokenBucket}
    - name: endpoint
      match: {path: {regex: "/(users|items)/[0-9]+"}}
      key: [{endpoint: {}}, {constant: c}]
      scope: Local
      limit: {requests: 3, period: 10s, algorithm: SlidingLog}
    - name: inflight
      key: [{jwtClaim: {header: x-token, claim: sub}}]
      scope: Local
      limit: {requests: 2, algorithm: Concurrency}
    - name: shaped
      match: {headers: [{name: x-shape}]}
      scope: Local
      limit: {requests: 10, period: 1s, algorithm: LeakyBucket, maxDelay: 500ms}
    - name: windows
      key: [{header: x-forwarded-for}]
      mode: Shadow
      limit: {requests: 10, period: 1m, algorithm: FixedWindow}
"#;

fn key_policies() -> &'static [CompiledPolicy] {
    static POLICIES: OnceLock<Vec<CompiledPolicy>> = OnceLock::new();
    POLICIES.get_or_init(|| {
        tollgate_crd::parse_yaml(KEY_POLICY)
            .expect("KEY_POLICY parses")
            .iter()
            .map(|p| tollgate_crd::compile(p).expect("KEY_POLICY compiles"))
            .collect()
    })
}

/// Built once: compiling its regexes would otherwise dominate every run. Limiter state carries
/// over between inputs, which only makes the decisions vary, not the code paths that must hold.
fn key_rule_set() -> &'static RuleSet {
    static SET: OnceLock<RuleSet> = OnceLock::new();
    SET.get_or_init(|| build_rule_set(1, key_policies().to_vec(), None).expect("KEY_POLICY builds"))
}

// ---------------------------------------------------------------------------------------------
// stream_line: the controller → sidecar rule stream, framed and applied as the sidecar does.
// ---------------------------------------------------------------------------------------------

/// Splits the input into lines like `controller::stream_once`, parses each with `parse_line`
/// and installs snapshots with `RuleSet::build` (reusing the previous set), then decides a few
/// requests against every installed set.
///
/// Inputs starting with a NUL byte (which no JSON line does) select the structured mode: the
/// rest overrides the numbers and enums of the compiled policies a controller would send (as an
/// untrusted peer could), and the resulting snapshot line goes through the same path.
pub fn stream_line(data: &[u8]) {
    if let Some((0, rest)) = data.split_first() {
        if let Some(line) = arbitrary_snapshot_line(rest) {
            stream_lines(&line);
        }
        return;
    }
    stream_lines(data);
}

/// A snapshot of the every-feature policy with arbitrary limits, costs, hops and modes.
fn arbitrary_snapshot_line(data: &[u8]) -> Option<Vec<u8>> {
    use tollgate_crd::compiled::*;
    let mut u = arbitrary::Unstructured::new(data);
    let u = &mut u;
    let mut policy = key_policies().first()?.clone();
    if maybe(u) {
        policy.bypass.trusted_hops = edge_u32(u)?;
    }
    // One to three of the template's rules (all of them would make every run slow).
    let template = std::mem::take(&mut policy.rules);
    for i in 0..u.int_in_range(1..=3).ok()? {
        let mut r = u.choose(&template).ok()?.clone();
        r.id = format!("{}-{i}", r.id);
        policy.rules.push(r);
    }
    for rule in &mut policy.rules {
        if maybe(u) {
            rule.limit.algorithm = *u
                .choose(&[
                    Algorithm::TokenBucket,
                    Algorithm::SlidingWindow,
                    Algorithm::FixedWindow,
                    Algorithm::SlidingLog,
                    Algorithm::LeakyBucket,
                    Algorithm::Concurrency,
                ])
                .ok()?;
        }
        if maybe(u) {
            rule.limit.requests = edge_u64(u)?;
        }
        if maybe(u) {
            rule.limit.period_ms = edge_u64(u)?;
        }
        if maybe(u) {
            rule.limit.burst = edge_u64(u)?;
        }
        if maybe(u) {
            rule.limit.max_delay_ms = edge_u64(u)?;
        }
        if maybe(u) {
            rule.cost.amount = edge_u32(u)?;
        }
        if maybe(u) {
            rule.cost.max = edge_u32(u)?;
        }
        if maybe(u) {
            rule.cost.header = Some("x-cost".to_string());
        }
        if maybe(u) {
            rule.mode = if u.arbitrary().ok()? {
                Mode::Shadow
            } else {
                Mode::Enforce
            };
            rule.on_missing_key = if u.arbitrary().ok()? {
                MissingKey::Skip
            } else {
                MissingKey::OwnBucket
            };
        }
        for k in &mut rule.key {
            if let KeySource::ClientIp { trusted_hops } = k
                && maybe(u)
            {
                *trusted_hops = edge_u32(u)?;
            }
        }
    }
    let msg = StreamMessage::Snapshot {
        wire_version: tollgate_crd::WIRE_VERSION,
        version: u.arbitrary().ok()?,
        policies: vec![policy],
        members: Default::default(),
        epoch: "e".to_string(),
        key_hash_secret: None,
    };
    let mut line = serde_json::to_vec(&msg).ok()?;
    line.push(b'\n');
    Some(line)
}

fn stream_lines(data: &[u8]) {
    let _ = parse_line(data);
    let mut previous: Option<RuleSet> = None;
    for line in data.split(|b| *b == b'\n') {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        // A bad line ends the stream (the sidecar reconnects).
        let Ok(msg) = parse_line(line) else {
            break;
        };
        let again = serde_json::to_vec(&msg).expect("a stream message serializes");
        assert_eq!(
            parse_line(&again).as_ref(),
            Ok(&msg),
            "stream message JSON round trip"
        );
        match msg {
            StreamMessage::Snapshot {
                wire_version,
                version,
                policies,
                members,
                epoch,
                ..
            } => {
                if wire_version != tollgate_crd::WIRE_VERSION {
                    break;
                }
                let _ = (members, epoch);
                for p in &policies {
                    let _ = p.id();
                    for r in &p.rules {
                        let _ = r.describe();
                        let _ = for_limiter(&r.limit);
                    }
                }
                // A refused snapshot keeps the rules in force.
                if let Ok(set) = build_rule_set(version, policies, previous.as_ref()) {
                    decide_all(&set);
                    previous = Some(set);
                }
            }
            StreamMessage::Members { .. } | StreamMessage::Heartbeat { .. } => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// lease_reply: Redis script replies.
// ---------------------------------------------------------------------------------------------

/// The input as a RESP reply (through the redis crate's parser) and as an arbitrary
/// `redis::Value` tree; both through `parse_lease_reply` and the heartbeat's `u32` conversion.
pub fn lease_reply(data: &[u8]) {
    if let Ok(v) = redis::parse_redis_value(data) {
        check_lease_reply(&v);
    }
    let mut u = arbitrary::Unstructured::new(data);
    if let Ok(v) = arbitrary_value(&mut u, 0) {
        check_lease_reply(&v);
    }
}

fn check_lease_reply(v: &redis::Value) {
    let expected = match v {
        redis::Value::Array(items) if items.len() == 7 => {
            let n: Option<Vec<u64>> = items
                .iter()
                .map(|i| match i {
                    redis::Value::Int(x) => u64::try_from(*x).ok(),
                    _ => None,
                })
                .collect();
            n.map(|n| LeaseReply {
                granted: n[0],
                remaining: n[1],
                reset_ms: n[2],
                retry_after_ms: n[3],
                window: n[4],
                ready_us: n[5],
                blocked_ms: n[6],
            })
        }
        _ => None,
    };
    match parse_lease_reply(v) {
        Ok(r) => assert_eq!(Some(r), expected, "{v:?}"),
        Err(e) => {
            assert_eq!(expected, None, "{v:?} refused: {e}");
            let _ = (e.kind(), e.to_string());
        }
    }
    // The membership script's reply, read as the heartbeat reads it.
    let _ = redis::from_redis_value_ref::<u32>(v);
}

const MAX_VALUE_DEPTH: usize = 6;

/// An arbitrary `redis::Value` (redis does not implement `Arbitrary`); server errors come from
/// the RESP path instead, since they cannot be built outside the crate.
fn arbitrary_value(
    u: &mut arbitrary::Unstructured<'_>,
    depth: usize,
) -> arbitrary::Result<redis::Value> {
    use redis::Value as V;
    let leaf = depth >= MAX_VALUE_DEPTH;
    let tag = u.int_in_range(0..=if leaf { 8 } else { 14 })?;
    let list = |u: &mut arbitrary::Unstructured<'_>| -> arbitrary::Result<Vec<V>> {
        let n = u.int_in_range(0..=6)?;
        (0..n).map(|_| arbitrary_value(u, depth + 1)).collect()
    };
    let pairs = |u: &mut arbitrary::Unstructured<'_>| -> arbitrary::Result<Vec<(V, V)>> {
        let n = u.int_in_range(0..=4)?;
        (0..n)
            .map(|_| {
                Ok((
                    arbitrary_value(u, depth + 1)?,
                    arbitrary_value(u, depth + 1)?,
                ))
            })
            .collect()
    };
    Ok(match tag {
        0 => V::Nil,
        1 | 2 => V::Int(u.arbitrary()?),
        3 => V::BulkString(u.arbitrary()?),
        4 => V::SimpleString(u.arbitrary()?),
        5 => V::Okay,
        6 => V::Double(u.arbitrary()?),
        7 => V::Boolean(u.arbitrary()?),
        8 => V::BigNumber(u.arbitrary()?),
        9 | 10 => V::Array(list(u)?),
        11 => V::Map(pairs(u)?),
        12 => V::Set(list(u)?),
        13 => V::Attribute {
            data: Box::new(arbitrary_value(u, depth + 1)?),
            attributes: pairs(u)?,
        },
        _ => {
            if u.arbitrary()? {
                V::Push {
                    kind: redis::PushKind::Other(u.arbitrary()?),
                    data: list(u)?,
                }
            } else {
                V::VerbatimString {
                    format: redis::VerbatimFormat::Text,
                    text: u.arbitrary()?,
                }
            }
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Shared: building a rule set and deciding requests, as the sidecar does.
// ---------------------------------------------------------------------------------------------

fn build_rule_set(
    version: u64,
    policies: Vec<CompiledPolicy>,
    previous: Option<&RuleSet>,
) -> Result<RuleSet, String> {
    // Small stores: the point is the code path, not capacity.
    let store = StoreConfig {
        max_keys: 64,
        idle_ttl: 0,
        shards: 2,
    };
    RuleSet::build(version, policies, previous, &store, &Metrics::new(), None)
}

fn fingerprinter() -> &'static Fingerprinter {
    static H: OnceLock<Fingerprinter> = OnceLock::new();
    H.get_or_init(Fingerprinter::random)
}

const NOW: Nanos = 1_700_000_000_000_000_000;

fn decide(set: &RuleSet, parts: &Parts, peer: &SocketAddr) {
    let mut buf = Vec::new();
    // Twice, so the second request meets state the first left behind.
    for now in [NOW, NOW + 1] {
        let verdict = set.evaluate(parts, peer, now, &mut buf, fingerprinter());
        let _ = verdict.rejected.as_ref().map(|r| r.limited.decision);
        let _ = set.evict_idle(now + 3_600_000_000_000);
    }
}

/// A few representative requests, including hostile ones.
fn sample_requests() -> &'static [(Parts, SocketAddr)] {
    static REQS: OnceLock<Vec<(Parts, SocketAddr)>> = OnceLock::new();
    REQS.get_or_init(|| {
        let jwt = {
            let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
            format!(
                "Bearer {}.{}.c2ln",
                b64.encode(br#"{"alg":"none"}"#),
                b64.encode(br#"{"sub":"u1","tenant":"acme","org":{"id":7}}"#)
            )
        };
        let req = |method: &str, uri: &str, headers: &[(&str, &str)], peer: &str| {
            let mut b = http::Request::builder().method(method).uri(uri);
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            (b.body(()).unwrap().into_parts().0, peer.parse().unwrap())
        };
        vec![
            req(
                "GET",
                "/api/v1/items/42?key=abc&api_key=k1&tenant=acme",
                &[
                    ("x-forwarded-for", "6.6.6.6, 203.0.113.7"),
                    ("x-forwarded-for", "10.0.0.2"),
                    ("x-api-key", "k1"),
                    ("authorization", &jwt),
                    ("x-token", &jwt),
                    ("x-cost", "5"),
                    ("x-tenant", "acme"),
                    ("x-shape", "1"),
                ],
                DEFAULT_PEER,
            ),
            req(
                "POST",
                "/payments/charge?key=a%20b+c",
                &[
                    ("x-forwarded-for", "unknown, [2001:db8::1]:443"),
                    ("x-cost", "1000000000000"),
                    ("authorization", "Bearer not.a.jwt"),
                    ("x-api-key", "internal-batch"),
                ],
                "[2001:db8::9]:443",
            ),
            req("DELETE", "/", &[], "10.1.2.3:80"),
        ]
    })
}

fn decide_all(set: &RuleSet) {
    for (parts, peer) in sample_requests() {
        decide(set, parts, peer);
    }
}

// ---------------------------------------------------------------------------------------------
// Replaying files without libFuzzer.
// ---------------------------------------------------------------------------------------------

/// Every regular file under `dir` (non-recursive), sorted.
pub fn files_in(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// What a structured input (first byte NUL) of `policy_yaml` or `stream_line` expands to, as
/// pretty JSON (the policy) or the snapshot line, to read a crash artifact; `None` otherwise.
pub fn expand(target: &str, data: &[u8]) -> Option<String> {
    let (0, rest) = data.split_first()? else {
        return None;
    };
    match target {
        "policy_yaml" => serde_json::to_string_pretty(&arbitrary_policy(rest)?).ok(),
        "stream_line" => String::from_utf8(arbitrary_snapshot_line(rest)?).ok(),
        _ => None,
    }
}

/// Runs `target` over every file (or every file in every directory) named on the command line.
/// With `TOLLGATE_FUZZ_SHOW` set, structured inputs are printed expanded (see [`expand`]).
pub fn replay_args(target: Target) {
    let mut n = 0;
    for arg in std::env::args_os().skip(1) {
        let path = Path::new(&arg);
        let files = if path.is_dir() {
            files_in(path)
        } else {
            vec![path.to_path_buf()]
        };
        for f in files {
            let data = std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            eprintln!("running {}", f.display());
            if std::env::var_os("TOLLGATE_FUZZ_SHOW").is_some() {
                let name = TARGETS.iter().find(|(_, t)| *t as usize == target as usize);
                if let Some(text) = name.and_then(|(n, _)| expand(n, &data)) {
                    eprintln!("{text}");
                }
            }
            target(&data);
            n += 1;
        }
    }
    eprintln!("{n} inputs ran without a crash");
}

// ---------------------------------------------------------------------------------------------
// http1_wire: what clients and the app send the HTTP/1.1 fast path.
// ---------------------------------------------------------------------------------------------

/// The input as a client's bytes (a request head and body) and as the app's (a response head
/// and body), through the fast path's scanners and encoders:
///
/// - a scanned request stays within the input, and once its head is built and encoded for the
///   app it scans again to the same method, target and headers;
/// - a scanned response stays within the input, its head re-encoded for the client scans to
///   the same status and framing (unless the added `Date` takes it past 100 lines), and the
///   body tracker never takes more bytes than it is given;
/// - a chunked body fed in two pieces ends where it ends when fed whole.
pub fn http1_wire(data: &[u8]) {
    use tollgate_http::proxy::h1::FieldLines;
    use tollgate_http::proxy::h1::wire::{self, Body, Framing, Scan};

    if let Scan::Complete(head) = wire::scan_request(data) {
        assert!(head.len + head.body_len <= data.len());
        let bytes = bytes::Bytes::copy_from_slice(&data[..head.len]);
        if let Some(parts) = head.parts(&bytes) {
            let body = &data[head.len..head.len + head.body_len];
            let mut out = Vec::new();
            wire::encode_request(&mut out, &parts, body);
            let Scan::Complete(again) = wire::scan_request(&out) else {
                panic!("an encoded request does not scan: {:?}", String::from_utf8_lossy(&out));
            };
            let again_bytes = bytes::Bytes::copy_from_slice(&out[..again.len]);
            let reparsed = again.parts(&again_bytes).expect("an encoded request builds");
            assert_eq!(reparsed.method, parts.method);
            assert_eq!(reparsed.headers, parts.headers);
            assert_eq!(again.body_len, head.body_len);
        }
    }
    for head_only in [false, true] {
        let Scan::Complete(head) = wire::scan_response(data, head_only) else {
            continue;
        };
        assert!(head.len <= data.len());
        let mut out = Vec::new();
        wire::encode_response_head(&mut out, data, &head, &FieldLines::default(), false);
        let Scan::Complete(again) = wire::scan_response(&out, head_only) else {
            // The `Date` the sidecar adds can make 100 lines 101, past what the scanner (like
            // hyper's) reads; anything else is a broken encoding.
            let lines = out.windows(2).filter(|w| *w == b"\r\n").count() - 2;
            assert!(
                lines > 100,
                "an encoded response does not scan: {:?}",
                String::from_utf8_lossy(&out)
            );
            continue;
        };
        assert_eq!(again.status, head.status);
        assert_eq!(again.framing, head.framing);
        let rest = &data[head.len..];
        if let Ok((taken, _)) = Body::new(head.framing).take(rest) {
            assert!(taken <= rest.len());
        }
    }
    let whole = Body::new(Framing::Chunked).take(data);
    let split = data.first().map_or(0, |&b| usize::from(b) % (data.len() + 1));
    let mut body = Body::new(Framing::Chunked);
    let pieces = body.take(&data[..split]).and_then(|(a, done)| {
        if done {
            Ok((a, true))
        } else {
            body.take(&data[split..]).map(|(b, done)| (split + b, done))
        }
    });
    match (whole, pieces) {
        (Ok((w, true)), Ok((p, true))) => assert_eq!(w, p, "split at {split}"),
        (Ok((w, false)), Ok((p, false))) => assert_eq!((w, p), (data.len(), data.len())),
        (Err(_), Err(_)) => {}
        (w, p) => panic!("whole {w:?} vs split at {split} {p:?}"),
    }
}
