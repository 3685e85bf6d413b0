//! The compiled-rule wire format: what the controller streams and the sidecar enforces.
//!
//! A compiled policy is fully validated and normalised (header names lowercased, durations in
//! milliseconds, defaults and the policy-level failure mode resolved into each rule), so the
//! sidecar never re-interprets the user's YAML. The format is versioned by [`WIRE_VERSION`];
//! additive changes keep the version, anything a v1 reader would misunderstand bumps it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::policy::{
    Accuracy, Algorithm, FailureMode, HeaderProfile, Method, MissingKey, Mode, ResponseHeaders,
    Scope,
};

/// Version of the wire format below.
pub const WIRE_VERSION: u32 = 1;

/// One policy, compiled.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CompiledPolicy {
    pub namespace: String,
    pub name: String,
    /// `metadata.generation` of the source object (0 for files without one).
    #[serde(default)]
    pub generation: i64,
    pub selector: Selector,
    pub rules: Vec<CompiledRule>,
    #[serde(default)]
    pub bypass: CompiledBypass,
    #[serde(default)]
    pub response_headers: ResponseHeaders,
    #[serde(default)]
    pub header_profile: HeaderProfile,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub partition_key: bool,
}

impl CompiledPolicy {
    /// `namespace/name`, the policy's identity in metrics, membership and Redis keys.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A pod label selector in a form that needs no Kubernetes types to evaluate.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Selector {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<SelectorRequirement>,
}

/// One `matchExpressions` entry.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SelectorRequirement {
    pub key: String,
    pub operator: SelectorOperator,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// Label selector operators.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SelectorOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

impl Selector {
    /// Whether a pod with these labels is selected (Kubernetes semantics: all terms must hold).
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|req| {
                let value = labels.get(&req.key);
                match req.operator {
                    SelectorOperator::In => value.is_some_and(|v| req.values.contains(v)),
                    SelectorOperator::NotIn => value.is_none_or(|v| !req.values.contains(v)),
                    SelectorOperator::Exists => value.is_some(),
                    SelectorOperator::DoesNotExist => value.is_none(),
                }
            })
    }
}

/// One rule, compiled.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CompiledRule {
    /// `namespace/policy/rule`: stable identity of the rule's counters.
    pub id: String,
    pub name: String,
    #[serde(default)]
    pub matches: CompiledMatch,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub key: Vec<KeySource>,
    #[serde(default)]
    pub on_missing_key: MissingKey,
    pub limit: CompiledLimit,
    pub cost: CompiledCost,
    pub scope: Scope,
    pub accuracy: Accuracy,
    pub mode: Mode,
    /// Resolved from the rule's override or the policy default.
    pub failure_mode: FailureMode,
    /// Response statuses that count (inclusive ranges); empty: every request counts when it
    /// arrives.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub count_statuses: Vec<StatusRange>,
}

impl CompiledRule {
    /// Whether the rule decides Envoy rate limit descriptors (tollgate's rate limit service)
    /// rather than HTTP requests: it has descriptor conditions or descriptor key parts.
    pub fn for_descriptors(&self) -> bool {
        !self.matches.descriptors.is_empty()
            || self
                .key
                .iter()
                .any(|k| matches!(k, KeySource::Descriptor(_)))
    }

    /// Whether the rule's cost is settled when the response arrives (a response-header cost
    /// or status-filtered counting): the request takes `cost.reserve` up front.
    pub fn settles_at_response(&self) -> bool {
        self.cost.response_header.is_some() || !self.count_statuses.is_empty()
    }

    /// Whether a response with `status` counts.
    pub fn counts_status(&self, status: u16) -> bool {
        self.count_statuses.is_empty()
            || self
                .count_statuses
                .iter()
                .any(|r| (r.from..=r.to).contains(&status))
    }
}

/// An inclusive range of response statuses (`401..=401`, or `500..=599` for `"5xx"`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatusRange {
    pub from: u16,
    pub to: u16,
}

/// Request conditions; empty lists and `None` match everything.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CompiledMatch {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<Method>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathCondition>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HeaderCondition>,
    /// Envoy descriptor entries the request must carry (rate limit service rules only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub descriptors: Vec<DescriptorCondition>,
}

/// A descriptor entry condition: the entry is present, with `value` if given.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DescriptorCondition {
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// A path condition. Regexes are validated and match the whole path.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum PathCondition {
    Exact(String),
    /// Segment-aware prefix; stored without a trailing slash (except for `/` itself).
    Prefix(String),
    Regex(String),
}

/// A header condition; `name` is lowercase.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct HeaderCondition {
    pub name: String,
    pub value: HeaderValueMatch,
}

/// How a header value is matched.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum HeaderValueMatch {
    Present,
    Exact(String),
    Regex(String),
}

/// Where one part of the counter key comes from. Header names are lowercase.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum KeySource {
    Header(String),
    #[serde(rename_all = "camelCase")]
    ClientIp {
        trusted_hops: u32,
    },
    QueryParam(String),
    #[serde(rename_all = "camelCase")]
    JwtClaim {
        header: String,
        /// The claim path split at dots.
        claim: Vec<String>,
    },
    Constant(String),
    Endpoint,
    /// An entry of an Envoy rate limit descriptor, by key.
    Descriptor(String),
}

/// The limit with durations in milliseconds and defaults applied.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CompiledLimit {
    pub algorithm: Algorithm,
    pub requests: u64,
    /// 0 for Concurrency, which has no period.
    pub period_ms: u64,
    /// Token bucket capacity; equals `requests` for the other algorithms.
    pub burst: u64,
    /// LeakyBucket: the longest a request may be delayed; 0 elsewhere.
    #[serde(default)]
    pub max_delay_ms: u64,
    /// How long a key stays rejected once it exceeded the limit; 0 = not at all.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub block_for_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Tokens spent per request.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CompiledCost {
    pub amount: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    pub max: u32,
    /// Response header carrying the real cost, settled when the response arrives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_header: Option<String>,
    /// Taken up front when the cost is settled at the response.
    #[serde(default = "one")]
    pub reserve: u32,
}

fn one() -> u32 {
    1
}

impl Default for CompiledCost {
    fn default() -> Self {
        CompiledCost {
            amount: 1,
            header: None,
            max: DEFAULT_MAX_COST,
            response_header: None,
            reserve: 1,
        }
    }
}

/// Cap on header-supplied costs when the policy does not set `cost.max`.
pub const DEFAULT_MAX_COST: u32 = 100;

/// Exemptions, parsed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CompiledBypass {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cidrs: Vec<ipnet::IpNet>,
    #[serde(default)]
    pub trusted_hops: u32,
}

/// Builds the regex a compiled `Regex` condition means: anchored at both ends, with a size limit
/// so a policy cannot make the sidecar build an enormous automaton.
pub fn full_match_regex(src: &str) -> Result<regex::Regex, regex::Error> {
    regex::RegexBuilder::new(&format!("^(?:{src})$"))
        .size_limit(1 << 20)
        .dfa_size_limit(1 << 20)
        .build()
}

/// Whether Global rules have a shared store behind them where a rule is described.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GlobalBackend {
    Redis,
    /// Standalone without `--redis`: Global rules fall back to local enforcement.
    None,
}

/// `accuracy: Auto` leases while each sidecar's share of the capacity is at least this many
/// tokens (the sidecar's `AUTO_MIN_SHARE`).
pub const AUTO_MIN_SHARE: u64 = 5;

/// Whether a Global rule with `accuracy` and `capacity` decides each request with one Redis
/// call while `sidecars` enforce it: `Strict`, or `Auto` with a share under
/// [`AUTO_MIN_SHARE`]. The sidecar and the controller's status both decide with this.
pub fn decides_exactly(accuracy: Accuracy, capacity: u64, sidecars: u64) -> bool {
    match accuracy {
        Accuracy::Strict => true,
        Accuracy::Leased => false,
        Accuracy::Auto => capacity < AUTO_MIN_SHARE * sidecars.max(1),
    }
}

impl CompiledRule {
    /// The capacity a global bucket counts down from: the burst of a token bucket, the
    /// requests of a window.
    pub fn capacity(&self) -> u64 {
        match self.limit.algorithm {
            Algorithm::TokenBucket => self.limit.burst,
            _ => self.limit.requests,
        }
    }

    /// The most sidecars with which `accuracy: Auto` still leases (0: never).
    pub fn auto_lease_sidecars(&self) -> u64 {
        self.capacity() / AUTO_MIN_SHARE
    }

    fn describe_auto(&self) -> String {
        let capacity = self.capacity();
        match self.auto_lease_sidecars() {
            0 => format!(
                "shared by all sidecars (one Redis call per request: {capacity} tokens leave no \
                 sidecar a share of {AUTO_MIN_SHARE})"
            ),
            1 => format!(
                "shared by all sidecars (leased from Redis while one sidecar enforces it; with \
                 more, a share of the {capacity} tokens is under {AUTO_MIN_SHARE} and each request \
                 makes one Redis call)"
            ),
            n => format!(
                "shared by all sidecars (leased from Redis with up to {n} sidecars, whose shares \
                 of the {capacity} tokens are then at least {AUTO_MIN_SHARE} each; one Redis call \
                 per request with more)"
            ),
        }
    }

    /// What the rule does, in plain words (used by `tollgate-sidecar check` and dry runs), as
    /// deployed with Redis.
    pub fn describe(&self) -> String {
        self.describe_where(GlobalBackend::Redis)
    }

    /// What the rule does where it runs: a sidecar without Redis enforces a Global rule on its
    /// own, and saying "shared by all sidecars" there would be untrue.
    pub fn describe_where(&self, backend: GlobalBackend) -> String {
        let what = if self.for_descriptors() && self.matches.descriptors.is_empty() {
            "rate limit service descriptors".to_string()
        } else {
            self.matches.describe()
        };
        let per = if self.key.is_empty() {
            "one counter shared by all matching requests".to_string()
        } else {
            let parts: Vec<String> = self.key.iter().map(KeySource::describe).collect();
            format!("per {}", parts.join(" + "))
        };
        let l = &self.limit;
        let limit = self.describe_limit();
        let cost = self.describe_cost();
        let auto = self.describe_auto();
        let scope = match (self.scope, self.accuracy) {
            (Scope::Local, _) => "each sidecar on its own",
            (Scope::Global, _) if backend == GlobalBackend::None => {
                "Global, but enforced by this sidecar on its own: no Redis is configured, so each \
                 sidecar allows the full limit"
            }
            (Scope::Global, Accuracy::Auto) => auto.as_str(),
            (Scope::Global, Accuracy::Leased) => "shared by all sidecars (leased from Redis)",
            (Scope::Global, Accuracy::Strict) => {
                "shared by all sidecars (one Redis call per request)"
            }
        };
        let mode = match self.mode {
            Mode::Enforce => "rejects excess with 429",
            Mode::Shadow => "shadow: only reports what it would reject",
        };
        let failure = match (self.scope, self.failure_mode) {
            (Scope::Local, _) => "",
            (Scope::Global, _) if backend == GlobalBackend::None => "",
            (Scope::Global, FailureMode::Open) => {
                "; if Redis is unreachable: keeps serving at this sidecar's share"
            }
            (Scope::Global, FailureMode::Closed) => "; if Redis is unreachable: rejects",
        };
        let missing = match (self.key.is_empty(), self.on_missing_key) {
            (true, _) => "",
            (false, MissingKey::OwnBucket) => "; requests missing a key part share one bucket",
            (false, MissingKey::Skip) => "; requests missing a key part are not limited",
        };
        let block = if l.block_for_ms > 0 {
            format!(
                "; a key that exceeds it stays rejected for {}",
                crate::duration::format(std::time::Duration::from_millis(l.block_for_ms))
            )
        } else {
            String::new()
        };
        let said = format!(
            "{}: {what}: {limit}, {per}{cost}; {scope}; {mode}{block}{failure}{missing}",
            self.name
        );
        if self.for_descriptors() {
            at_the_gateway(&said)
        } else {
            said
        }
    }

    /// The limit clause of [`describe_where`](Self::describe_where): the rate or the
    /// concurrency, and what the algorithm does with a burst.
    fn describe_limit(&self) -> String {
        let l = &self.limit;
        match l.algorithm {
            Algorithm::Concurrency => format!("at most {} requests in flight", l.requests),
            Algorithm::TokenBucket => format!(
                "{} requests per {} (token bucket, bursts up to {})",
                l.requests,
                crate::duration::format(std::time::Duration::from_millis(l.period_ms)),
                l.burst
            ),
            Algorithm::LeakyBucket => format!(
                "{} requests per {} (leaky bucket: delays requests up to {} to smooth the rate, rejects beyond)",
                l.requests,
                crate::duration::format(std::time::Duration::from_millis(l.period_ms)),
                crate::duration::format(std::time::Duration::from_millis(l.max_delay_ms))
            ),
            other => format!(
                "{} requests per {} ({})",
                l.requests,
                crate::duration::format(std::time::Duration::from_millis(l.period_ms)),
                match other {
                    Algorithm::SlidingWindow => "sliding window counter",
                    Algorithm::FixedWindow => "fixed window: up to 2x at window boundaries",
                    _ => "sliding log, exact",
                }
            ),
        }
    }

    /// The cost clause of [`describe_where`](Self::describe_where): fixed, from a request
    /// header, or settled at the response, and which responses count.
    fn describe_cost(&self) -> String {
        let c = &self.cost;
        let mut out = match (&c.header, &c.response_header) {
            (Some(h), _) => format!(
                "; each request costs header {h} (default {}, at most {})",
                c.amount, c.max
            ),
            (None, Some(h)) => format!(
                "; each request reserves {} tokens, then costs the response header {h} (at most {}; \
                 the balance may go negative, so later requests wait)",
                c.reserve, c.max
            ),
            (None, None) if c.amount != 1 => format!("; each request costs {} tokens", c.amount),
            (None, None) => String::new(),
        };
        if !self.count_statuses.is_empty() {
            let statuses: Vec<String> = self
                .count_statuses
                .iter()
                .map(|r| match (r.from, r.to) {
                    (a, b) if a == b => a.to_string(),
                    (a, _) => format!("{}xx", a / 100),
                })
                .collect();
            out.push_str(&format!(
                "; only responses with status {} count (each request reserves {} until its response)",
                statuses.join(", "),
                c.reserve
            ));
        }
        out
    }
}

/// A descriptor rule's description in the rate limit service's terms: it runs in the
/// service's replicas, not in sidecars, and Envoy does the refusing.
fn at_the_gateway(said: &str) -> String {
    said.replace(
        "each sidecar on its own",
        "each rate limit service replica on its own",
    )
    .replace("sidecars", "rate limit service replicas")
    .replace("sidecar", "replica")
    .replace(
        "rejects excess with 429",
        "excess is refused by Envoy (RLS: OVER_LIMIT per request; RLQS: each Envoy holds a \
             token bucket of its demand-weighted share)",
    )
    .replace(
        "if Redis is unreachable: rejects",
        "if Redis is unreachable: refuses (RLS: OVER_LIMIT; RLQS: DENY_ALL)",
    )
}

impl CompiledMatch {
    fn describe(&self) -> String {
        if !self.descriptors.is_empty() {
            let entries: Vec<String> = self
                .descriptors
                .iter()
                .map(|d| match &d.value {
                    Some(v) => format!("{}={v}", d.key),
                    None => d.key.clone(),
                })
                .collect();
            return format!("rate limit service descriptors with {}", entries.join(", "));
        }
        let mut out = if self.methods.is_empty() {
            "all requests".to_string()
        } else {
            let m: Vec<&str> = self.methods.iter().map(|m| m.as_str()).collect();
            format!("{} requests", m.join("/"))
        };
        match &self.path {
            Some(PathCondition::Exact(p)) => out.push_str(&format!(" to exactly {p}")),
            Some(PathCondition::Prefix(p)) => out.push_str(&format!(" under {p}")),
            Some(PathCondition::Regex(r)) => out.push_str(&format!(" with path matching /{r}/")),
            None => {}
        }
        for h in &self.headers {
            match &h.value {
                HeaderValueMatch::Present => out.push_str(&format!(" with header {}", h.name)),
                HeaderValueMatch::Exact(v) => out.push_str(&format!(" with {}: {v}", h.name)),
                HeaderValueMatch::Regex(r) => {
                    out.push_str(&format!(" with {} matching /{r}/", h.name))
                }
            }
        }
        out
    }
}

impl KeySource {
    fn describe(&self) -> String {
        match self {
            KeySource::Header(h) => format!("header {h}"),
            KeySource::ClientIp { trusted_hops: 0 } => "client IP (TCP peer)".to_string(),
            KeySource::ClientIp { trusted_hops } => {
                format!("client IP (X-Forwarded-For entry {trusted_hops} from the right)")
            }
            KeySource::QueryParam(q) => format!("query parameter {q}"),
            KeySource::JwtClaim { header, claim } => {
                format!("JWT claim {} from {header} (not verified)", claim.join("."))
            }
            KeySource::Constant(c) => format!("constant {c:?}"),
            KeySource::Endpoint => "method and path".to_string(),
            KeySource::Descriptor(k) => format!("descriptor entry {k}"),
        }
    }
}
