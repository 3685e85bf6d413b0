//! Turns a `RateLimitPolicy` into its compiled form, collecting every error with its field path.
//!
//! One function serves the admission webhook (deny with all errors), the controller (mark the
//! policy `Accepted=False`, keep the last good version) and the sidecar's standalone mode (refuse
//! a bad file, keep the last good rules). It re-checks everything the CRD schema checks, because
//! standalone files never pass through an API server.

use std::fmt;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::compiled::*;
use crate::duration;
use crate::policy::*;

/// A validation error and the field it is about, e.g. `spec.rules[1].limit.period`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl std::error::Error for FieldError {}

/// All errors of one policy, displayed one per line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileErrors(pub Vec<FieldError>);

impl fmt::Display for CompileErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for CompileErrors {}

/// Namespace used for policies read from files that do not set one.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Compiles a policy object.
pub fn compile(policy: &RateLimitPolicy) -> Result<CompiledPolicy, CompileErrors> {
    let mut errs = Errors::default();
    let name = match policy.metadata.name.as_deref() {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => {
            errs.push("metadata.name", "is required");
            String::new()
        }
    };
    let namespace = policy
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
    let generation = policy.metadata.generation.unwrap_or(0);
    let compiled = compile_spec(&namespace, &name, generation, &policy.spec, &mut errs);
    errs.finish(compiled)
}

/// Compiles a spec whose metadata is already known.
pub fn compile_parts(
    namespace: &str,
    name: &str,
    generation: i64,
    spec: &RateLimitPolicySpec,
) -> Result<CompiledPolicy, CompileErrors> {
    let mut errs = Errors::default();
    let compiled = compile_spec(namespace, name, generation, spec, &mut errs);
    errs.finish(compiled)
}

#[derive(Default)]
struct Errors(Vec<FieldError>);

impl Errors {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError {
            path: path.into(),
            message: message.into(),
        });
    }

    fn finish(self, compiled: CompiledPolicy) -> Result<CompiledPolicy, CompileErrors> {
        if self.0.is_empty() {
            Ok(compiled)
        } else {
            Err(CompileErrors(self.0))
        }
    }
}

fn compile_spec(
    namespace: &str,
    name: &str,
    generation: i64,
    spec: &RateLimitPolicySpec,
    errs: &mut Errors,
) -> CompiledPolicy {
    let selector = compile_selector(&spec.target_ref.selector, errs);

    if spec.rules.is_empty() {
        errs.push("spec.rules", "must contain at least one rule");
    }
    if spec.rules.len() > MAX_RULES {
        errs.push(
            "spec.rules",
            format!(
                "has {} rules; at most {MAX_RULES} are allowed",
                spec.rules.len()
            ),
        );
    }
    let mut rules = Vec::with_capacity(spec.rules.len());
    for (i, rule) in spec.rules.iter().enumerate() {
        let path = format!("spec.rules[{i}]");
        if let Some(j) = spec.rules[..i].iter().position(|r| r.name == rule.name) {
            errs.push(
                format!("{path}.name"),
                format!("duplicate rule name {:?} (also spec.rules[{j}])", rule.name),
            );
        }
        rules.push(compile_rule(namespace, name, spec, rule, &path, errs));
    }

    CompiledPolicy {
        namespace: namespace.to_string(),
        name: name.to_string(),
        generation,
        selector,
        rules,
        bypass: compile_bypass(spec.bypass.as_ref(), errs),
        response_headers: spec.response_headers,
        header_profile: spec.header_profile,
        partition_key: spec.partition_key,
    }
}

fn compile_selector(sel: &LabelSelector, errs: &mut Errors) -> Selector {
    let mut out = Selector {
        match_labels: sel.match_labels.clone().unwrap_or_default(),
        match_expressions: Vec::new(),
    };
    for (i, req) in sel.match_expressions.iter().flatten().enumerate() {
        let path = format!("spec.targetRef.selector.matchExpressions[{i}]");
        let values = req.values.clone().unwrap_or_default();
        let operator = match req.operator.as_str() {
            "In" => SelectorOperator::In,
            "NotIn" => SelectorOperator::NotIn,
            "Exists" => SelectorOperator::Exists,
            "DoesNotExist" => SelectorOperator::DoesNotExist,
            other => {
                errs.push(
                    format!("{path}.operator"),
                    format!("unknown operator {other:?}: use In, NotIn, Exists or DoesNotExist"),
                );
                continue;
            }
        };
        match operator {
            SelectorOperator::In | SelectorOperator::NotIn if values.is_empty() => errs.push(
                format!("{path}.values"),
                "must be non-empty for In and NotIn",
            ),
            SelectorOperator::Exists | SelectorOperator::DoesNotExist if !values.is_empty() => errs
                .push(
                    format!("{path}.values"),
                    "must be empty for Exists and DoesNotExist",
                ),
            _ => {}
        }
        out.match_expressions.push(SelectorRequirement {
            key: req.key.clone(),
            operator,
            values,
        });
    }
    out
}

fn compile_rule(
    namespace: &str,
    policy_name: &str,
    spec: &RateLimitPolicySpec,
    rule: &PolicyRule,
    path: &str,
    errs: &mut Errors,
) -> CompiledRule {
    if !is_dns_label(&rule.name) {
        errs.push(
            format!("{path}.name"),
            format!(
                "{:?} must be 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit",
                rule.name
            ),
        );
    }
    let matches = rule
        .matches
        .as_ref()
        .map(|m| compile_match(m, &format!("{path}.match"), errs))
        .unwrap_or_default();

    if rule.key.len() > MAX_KEY_PARTS {
        errs.push(
            format!("{path}.key"),
            format!(
                "has {} parts; at most {MAX_KEY_PARTS} are allowed",
                rule.key.len()
            ),
        );
    }
    let key = rule
        .key
        .iter()
        .enumerate()
        .filter_map(|(i, part)| compile_key_part(part, &format!("{path}.key[{i}]"), errs))
        .collect();

    let limit = compile_limit(&rule.limit, &format!("{path}.limit"), errs);
    let cost = compile_cost(rule.cost.as_ref(), &format!("{path}.cost"), errs);
    let count_statuses = rule
        .count
        .as_ref()
        .map(|c| compile_statuses(&c.statuses, &format!("{path}.count.statuses"), errs))
        .unwrap_or_default();
    check_rule_fits_its_algorithm(rule, &limit, &cost, &count_statuses, path, errs);

    let compiled = CompiledRule {
        id: format!("{namespace}/{policy_name}/{}", rule.name),
        name: rule.name.clone(),
        matches,
        key,
        on_missing_key: rule.on_missing_key,
        limit,
        cost,
        scope: rule.scope,
        accuracy: rule.accuracy,
        mode: rule.mode,
        failure_mode: rule.failure_mode.unwrap_or(spec.failure_mode),
        count_statuses,
    };
    check_one_kind_of_request(rule, &compiled, path, errs);
    compiled
}

/// What a rule asks of its algorithm and scope that they cannot give: a cost settled at the
/// response needs a limiter that can carry a debt, Global needs a limiter Redis keeps, and
/// Strict needs Global.
fn check_rule_fits_its_algorithm(
    rule: &PolicyRule,
    limit: &CompiledLimit,
    cost: &CompiledCost,
    count_statuses: &[StatusRange],
    path: &str,
    errs: &mut Errors,
) {
    let settles = cost.response_header.is_some() || !count_statuses.is_empty();
    if settles
        && !matches!(
            limit.algorithm,
            Algorithm::TokenBucket | Algorithm::SlidingWindow | Algorithm::FixedWindow
        )
    {
        let field = if cost.response_header.is_some() {
            "cost.responseHeader"
        } else {
            "count"
        };
        errs.push(
            format!("{path}.{field}"),
            format!(
                "a cost settled at the response needs TokenBucket, SlidingWindow or FixedWindow ({:?} cannot carry a debt)",
                limit.algorithm
            ),
        );
    }

    if rule.scope == Scope::Global
        && !matches!(
            limit.algorithm,
            Algorithm::TokenBucket | Algorithm::SlidingWindow | Algorithm::FixedWindow
        )
    {
        errs.push(
            format!("{path}.scope"),
            format!(
                "{:?} limits are kept per sidecar; set scope: Local (Global supports TokenBucket, SlidingWindow and FixedWindow)",
                limit.algorithm
            ),
        );
    }
    if rule.accuracy == Accuracy::Strict && rule.scope != Scope::Global {
        errs.push(
            format!("{path}.accuracy"),
            "Strict needs scope: Global (it is one atomic Redis call per request)",
        );
    }
}

/// `401` or `"4xx"` into inclusive ranges.
fn compile_statuses(statuses: &[StatusMatch], path: &str, errs: &mut Errors) -> Vec<StatusRange> {
    if statuses.is_empty() {
        errs.push(
            path,
            "must list at least one status, e.g. [401, 403] or [\"5xx\"]",
        );
    }
    statuses
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let range = match s {
                StatusMatch::Code(c) if (100..=599).contains(c) => {
                    Some(StatusRange { from: *c, to: *c })
                }
                StatusMatch::Class(c) => match c.to_ascii_lowercase().as_bytes() {
                    [d @ b'1'..=b'5', b'x', b'x'] => {
                        let from = u16::from(d - b'0') * 100;
                        Some(StatusRange {
                            from,
                            to: from + 99,
                        })
                    }
                    _ => None,
                },
                StatusMatch::Code(_) => None,
            };
            if range.is_none() {
                errs.push(
                    format!("{path}[{i}]"),
                    format!("{s:?} is not a status (100-599) or a class (\"1xx\" to \"5xx\")"),
                );
            }
            range
        })
        .collect()
}

fn compile_match(m: &Match, path: &str, errs: &mut Errors) -> CompiledMatch {
    let mut methods: Vec<Method> = Vec::new();
    for method in &m.methods {
        if !methods.contains(method) {
            methods.push(*method);
        }
    }
    let path_cond = m.path.as_ref().and_then(|p| {
        let ppath = format!("{path}.path");
        let set = [p.exact.is_some(), p.prefix.is_some(), p.regex.is_some()]
            .iter()
            .filter(|x| **x)
            .count();
        if set != 1 {
            errs.push(ppath, "set exactly one of exact, prefix or regex");
            return None;
        }
        if let Some(e) = &p.exact {
            check_path_literal(e, &format!("{ppath}.exact"), errs);
            return Some(PathCondition::Exact(e.clone()));
        }
        if let Some(pre) = &p.prefix {
            check_path_literal(pre, &format!("{ppath}.prefix"), errs);
            let trimmed = if pre.len() > 1 {
                pre.trim_end_matches('/')
            } else {
                pre.as_str()
            };
            let trimmed = if trimmed.is_empty() { "/" } else { trimmed };
            return Some(PathCondition::Prefix(trimmed.to_string()));
        }
        let r = p.regex.as_deref().unwrap_or_default();
        check_regex(r, &format!("{ppath}.regex"), errs);
        Some(PathCondition::Regex(r.to_string()))
    });

    let mut headers = Vec::with_capacity(m.headers.len());
    for (i, h) in m.headers.iter().enumerate() {
        let hpath = format!("{path}.headers[{i}]");
        check_header_name(&h.name, &format!("{hpath}.name"), errs);
        let value = match (&h.value, &h.regex) {
            (Some(_), Some(_)) => {
                errs.push(hpath, "set at most one of value or regex");
                continue;
            }
            (Some(v), None) => {
                check_header_value(v, &format!("{hpath}.value"), errs);
                HeaderValueMatch::Exact(v.clone())
            }
            (None, Some(r)) => {
                check_regex(r, &format!("{hpath}.regex"), errs);
                HeaderValueMatch::Regex(r.clone())
            }
            (None, None) => HeaderValueMatch::Present,
        };
        headers.push(HeaderCondition {
            name: h.name.to_ascii_lowercase(),
            value,
        });
    }
    let mut descriptors = Vec::with_capacity(m.descriptors.len());
    for (i, d) in m.descriptors.iter().enumerate() {
        if d.key.is_empty() {
            errs.push(format!("{path}.descriptors[{i}].key"), "must not be empty");
        }
        descriptors.push(DescriptorCondition {
            key: d.key.clone(),
            value: d.value.clone(),
        });
    }
    CompiledMatch {
        methods,
        path: path_cond,
        headers,
        descriptors,
    }
}

/// A rule decides either HTTP requests (sidecar) or Envoy descriptors (rate limit service):
/// refuses a rule that mixes the two, naming the first HTTP-only field.
fn check_one_kind_of_request(
    rule: &PolicyRule,
    compiled: &CompiledRule,
    path: &str,
    errs: &mut Errors,
) {
    if !compiled.for_descriptors() {
        return;
    }
    let m = &compiled.matches;
    let mut http_fields: Vec<String> = Vec::new();
    if !m.methods.is_empty() {
        http_fields.push(format!("{path}.match.methods"));
    }
    if m.path.is_some() {
        http_fields.push(format!("{path}.match.path"));
    }
    if !m.headers.is_empty() {
        http_fields.push(format!("{path}.match.headers"));
    }
    for (i, part) in rule.key.iter().enumerate() {
        if part.descriptor.is_none() && part.constant.is_none() {
            http_fields.push(format!("{path}.key[{i}]"));
        }
    }
    if rule
        .cost
        .as_ref()
        .is_some_and(|c| c.header.is_some() || c.response_header.is_some())
    {
        http_fields.push(format!("{path}.cost"));
    }
    if !compiled.count_statuses.is_empty() {
        http_fields.push(format!("{path}.count"));
    }
    if let Some(first) = http_fields.into_iter().next() {
        errs.push(
            first,
            "is about HTTP requests, but the rule matches or keys on rate limit service \
             descriptors: a rule decides one or the other (split it into two rules)",
        );
    }
}

fn compile_key_part(part: &KeyPart, path: &str, errs: &mut Errors) -> Option<KeySource> {
    let set = [
        part.header.is_some(),
        part.client_ip.is_some(),
        part.query_param.is_some(),
        part.jwt_claim.is_some(),
        part.constant.is_some(),
        part.endpoint.is_some(),
        part.descriptor.is_some(),
    ]
    .iter()
    .filter(|x| **x)
    .count();
    if set != 1 {
        errs.push(
            path,
            "set exactly one of header, clientIP, queryParam, jwtClaim, constant, endpoint or descriptor",
        );
        return None;
    }
    if let Some(d) = &part.descriptor {
        if d.is_empty() {
            errs.push(format!("{path}.descriptor"), "must not be empty");
        }
        return Some(KeySource::Descriptor(d.clone()));
    }
    if let Some(h) = &part.header {
        check_header_name(h, &format!("{path}.header"), errs);
        return Some(KeySource::Header(h.to_ascii_lowercase()));
    }
    if let Some(ip) = &part.client_ip {
        if ip.trusted_hops > MAX_TRUSTED_HOPS {
            errs.push(
                format!("{path}.clientIP.trustedHops"),
                format!("must be at most {MAX_TRUSTED_HOPS}"),
            );
        }
        return Some(KeySource::ClientIp {
            trusted_hops: ip.trusted_hops,
        });
    }
    if let Some(q) = &part.query_param {
        if q.is_empty() {
            errs.push(format!("{path}.queryParam"), "must not be empty");
        }
        return Some(KeySource::QueryParam(q.clone()));
    }
    if let Some(j) = &part.jwt_claim {
        check_header_name(&j.header, &format!("{path}.jwtClaim.header"), errs);
        let claim: Vec<String> = j.claim.split('.').map(str::to_string).collect();
        if claim.iter().any(String::is_empty) {
            errs.push(
                format!("{path}.jwtClaim.claim"),
                format!(
                    "{:?} must be a claim name, nested names joined by '.'",
                    j.claim
                ),
            );
        }
        return Some(KeySource::JwtClaim {
            header: j.header.to_ascii_lowercase(),
            claim,
        });
    }
    if let Some(c) = &part.constant {
        if c.is_empty() {
            errs.push(format!("{path}.constant"), "must not be empty");
        }
        return Some(KeySource::Constant(c.clone()));
    }
    Some(KeySource::Endpoint)
}

fn compile_limit(l: &Limit, path: &str, errs: &mut Errors) -> CompiledLimit {
    if l.requests == 0 || l.requests > 1_000_000_000 {
        errs.push(
            format!("{path}.requests"),
            format!("{} must be between 1 and 1000000000", l.requests),
        );
    }
    let period_ms = compile_period(l, path, errs);
    let burst = compile_burst(l, path, errs);
    let max_delay_ms = compile_max_delay(l, path, errs);
    if l.algorithm == Algorithm::SlidingLog && l.requests > MAX_SLIDING_LOG_REQUESTS {
        errs.push(
            format!("{path}.requests"),
            format!(
                "must be at most {MAX_SLIDING_LOG_REQUESTS} for SlidingLog (it stores one timestamp per request); use SlidingWindow for larger limits"
            ),
        );
    }
    let block_for_ms = compile_block_for(l, path, errs);
    CompiledLimit {
        algorithm: l.algorithm,
        requests: l.requests,
        period_ms,
        burst,
        max_delay_ms,
        block_for_ms,
    }
}

/// The window of a rate, in ms (0 for Concurrency, which has none).
fn compile_period(l: &Limit, path: &str, errs: &mut Errors) -> u64 {
    let max = Duration::from_secs(MAX_PERIOD_SECS);
    let period_ms = match (&l.period, l.algorithm) {
        (None, Algorithm::Concurrency) => 0,
        (None, _) => {
            errs.push(
                format!("{path}.period"),
                "is required unless algorithm is Concurrency",
            );
            0
        }
        (Some(p), _) => match duration::parse(p) {
            Ok(d) if d.is_zero() => {
                errs.push(format!("{path}.period"), "must be greater than 0");
                0
            }
            Ok(d) if d > max => {
                errs.push(
                    format!("{path}.period"),
                    format!("{p:?} is longer than 24h"),
                );
                0
            }
            Ok(d) => d.as_millis() as u64,
            Err(e) => {
                errs.push(format!("{path}.period"), format!("{p:?}: {e}"));
                0
            }
        },
    };
    if l.period.is_some() && l.algorithm == Algorithm::Concurrency {
        errs.push(
            format!("{path}.period"),
            "does not apply to Concurrency (it limits requests in flight, not a rate)",
        );
    }
    period_ms
}

/// The bucket size of a TokenBucket; the other algorithms hold `requests`.
fn compile_burst(l: &Limit, path: &str, errs: &mut Errors) -> u64 {
    match l.burst {
        Some(_) if l.algorithm != Algorithm::TokenBucket => {
            errs.push(
                format!("{path}.burst"),
                "only applies to algorithm TokenBucket",
            );
            l.requests
        }
        Some(0) => {
            errs.push(format!("{path}.burst"), "must be at least 1");
            l.requests
        }
        Some(b) if b > 1_000_000_000 => {
            errs.push(format!("{path}.burst"), "must be at most 1000000000");
            l.requests
        }
        Some(b) => b,
        None => l.requests,
    }
}

/// How long a LeakyBucket may queue a request, in ms.
fn compile_max_delay(l: &Limit, path: &str, errs: &mut Errors) -> u64 {
    match &l.max_delay {
        Some(_) if l.algorithm != Algorithm::LeakyBucket => {
            errs.push(
                format!("{path}.maxDelay"),
                "only applies to algorithm LeakyBucket",
            );
            0
        }
        Some(d) => match duration::parse(d) {
            Ok(d) if d > Duration::from_secs(60) => {
                errs.push(format!("{path}.maxDelay"), "must be at most 1m");
                0
            }
            Ok(d) => d.as_millis() as u64,
            Err(e) => {
                errs.push(format!("{path}.maxDelay"), format!("{d:?}: {e}"));
                0
            }
        },
        None => 0,
    }
}

/// How long a key that went over stays refused, in ms (0: no block).
fn compile_block_for(l: &Limit, path: &str, errs: &mut Errors) -> u64 {
    match &l.block_for {
        Some(_) if l.algorithm == Algorithm::Concurrency => {
            errs.push(
                format!("{path}.blockFor"),
                "does not apply to Concurrency (in-flight requests are not a rate to exceed)",
            );
            0
        }
        Some(d) => match duration::parse(d) {
            Ok(d) if d > Duration::from_secs(MAX_PERIOD_SECS) || d.is_zero() => {
                errs.push(
                    format!("{path}.blockFor"),
                    "must be greater than 0 and at most 24h",
                );
                0
            }
            Ok(d) => d.as_millis() as u64,
            Err(e) => {
                errs.push(format!("{path}.blockFor"), format!("{d:?}: {e}"));
                0
            }
        },
        None => 0,
    }
}

fn compile_cost(c: Option<&Cost>, path: &str, errs: &mut Errors) -> CompiledCost {
    let Some(c) = c else {
        return CompiledCost::default();
    };
    let amount = c.amount.unwrap_or(1);
    if amount == 0 || amount > 1_000_000 {
        errs.push(format!("{path}.amount"), "must be between 1 and 1000000");
    }
    let max = c.max.unwrap_or(DEFAULT_MAX_COST.max(amount));
    if max == 0 || max > 1_000_000 {
        errs.push(format!("{path}.max"), "must be between 1 and 1000000");
    }
    if amount > max {
        errs.push(
            format!("{path}.amount"),
            format!("{amount} must not exceed cost.max ({max})"),
        );
    }
    if let Some(h) = &c.header {
        check_header_name(h, &format!("{path}.header"), errs);
    }
    if let Some(h) = &c.response_header {
        check_header_name(h, &format!("{path}.responseHeader"), errs);
        if c.header.is_some() {
            errs.push(
                format!("{path}.responseHeader"),
                "header and responseHeader exclude each other: the cost is known either when the request arrives or when the response does",
            );
        }
    }
    let reserve = c.reserve.unwrap_or(1);
    if reserve > max {
        errs.push(
            format!("{path}.reserve"),
            format!("{reserve} must not exceed cost.max ({max})"),
        );
    }
    CompiledCost {
        amount,
        header: c.header.as_ref().map(|h| h.to_ascii_lowercase()),
        max,
        response_header: c.response_header.as_ref().map(|h| h.to_ascii_lowercase()),
        reserve,
    }
}

fn compile_bypass(b: Option<&Bypass>, errs: &mut Errors) -> CompiledBypass {
    let Some(b) = b else {
        return CompiledBypass::default();
    };
    let mut cidrs = Vec::with_capacity(b.cidrs.len());
    for (i, c) in b.cidrs.iter().enumerate() {
        match c.parse::<ipnet::IpNet>() {
            Ok(net) => cidrs.push(net),
            Err(_) => {
                let hint = if c.parse::<std::net::IpAddr>().is_ok() {
                    " (a single address needs a prefix length, e.g. /32 or /128)"
                } else {
                    ""
                };
                errs.push(
                    format!("spec.bypass.cidrs[{i}]"),
                    format!("{c:?} is not a CIDR such as 10.0.0.0/8{hint}"),
                );
            }
        }
    }
    for (i, k) in b.keys.iter().enumerate() {
        if k.is_empty() {
            errs.push(format!("spec.bypass.keys[{i}]"), "must not be empty");
        }
    }
    if b.trusted_hops > MAX_TRUSTED_HOPS {
        errs.push(
            "spec.bypass.trustedHops",
            format!("must be at most {MAX_TRUSTED_HOPS}"),
        );
    }
    CompiledBypass {
        keys: b.keys.clone(),
        cidrs,
        trusted_hops: b.trusted_hops,
    }
}

fn check_path_literal(p: &str, path: &str, errs: &mut Errors) {
    if !p.starts_with('/') {
        errs.push(path, format!("{p:?} must start with '/'"));
    }
    if p.contains('?') || p.contains('#') {
        errs.push(
            path,
            format!("{p:?} must not contain '?' or '#': paths are matched without the query"),
        );
    }
}

fn check_regex(r: &str, path: &str, errs: &mut Errors) {
    if let Err(e) = full_match_regex(r) {
        let msg = e.to_string();
        let first = msg.lines().last().unwrap_or("invalid").trim();
        errs.push(
            path,
            format!("{r:?} is not a valid regular expression: {first}"),
        );
    }
}

fn check_header_name(name: &str, path: &str, errs: &mut Errors) {
    if name.is_empty() || !name.bytes().all(is_tchar) {
        errs.push(path, format!("{name:?} is not a valid HTTP header name"));
    }
}

/// Header values hold no control characters but tab (what the sidecar's `HeaderValue` accepts;
/// found by fuzzing: such a value compiled, and then every sidecar refused the rule set).
fn check_header_value(value: &str, path: &str, errs: &mut Errors) {
    if value.bytes().any(|b| (b < 0x20 && b != b'\t') || b == 0x7f) {
        errs.push(
            path,
            format!("{value:?} is not a valid HTTP header value: it contains control characters"),
        );
    }
}

/// RFC 9110 token characters.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// A rule name's form: a DNS label (lowercase letters, digits, inner '-', at most 63 bytes).
/// Public so that the sidecar holds rule sets it did not compile (the controller's stream) to it.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}
