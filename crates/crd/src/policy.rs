//! The `RateLimitPolicy` custom resource (`tollgate.dev/v1alpha1`).
//!
//! Doc comments on these types become the schema descriptions that `kubectl explain rlp.spec...`
//! prints, so they are written for the person applying a policy. Rules that the schema can check
//! on its own (bounds, enums, one-of, cross-field) are CEL rules here, so the API server rejects a
//! bad policy before any tollgate component sees it; what CEL cannot express (regex syntax, CIDR
//! parsing on old servers) is checked by [`crate::compile`], which the admission webhook, the
//! controller and the sidecar's standalone mode all call.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Longest duration accepted for `period` and `maxDelay`. A rate limit over a longer span is a
/// quota (monthly caps, billing), which needs durable counters rather than ephemeral buckets.
pub const MAX_PERIOD_SECS: u64 = 24 * 60 * 60;
/// Most rules one policy may hold; keeps per-request matching cost and status size bounded.
pub const MAX_RULES: usize = 64;
/// Most key parts one rule may join into its counter key.
pub const MAX_KEY_PARTS: usize = 8;
/// Highest `trustedHops`: more proxies than this in front of a pod is almost certainly a mistake.
pub const MAX_TRUSTED_HOPS: u32 = 16;
/// Sliding-log rules keep one timestamp per admitted request, so their limit is capped.
pub const MAX_SLIDING_LOG_REQUESTS: u64 = 10_000;

/// The pattern for durations: Go-style units without fractions, e.g. `500ms`, `1s`, `1m`, `1h30m`.
/// It is the subset both CEL's `duration()` and [`crate::duration::parse`] accept identically.
pub const DURATION_PATTERN: &str = "^([0-9]{1,9}(ms|s|m|h))+$";

/// A RateLimitPolicy attaches rate-limit rules to the tollgate sidecars of the pods it selects.
/// Each rule matches requests, derives a client key from them and admits at most `limit` requests
/// per key; excess requests get `429 Too Many Requests` with `Retry-After` and RateLimit headers.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "tollgate.dev",
    version = "v1alpha1",
    kind = "RateLimitPolicy",
    plural = "ratelimitpolicies",
    shortname = "rlp",
    category = "tollgate",
    namespaced,
    doc = "A RateLimitPolicy attaches rate-limit rules to the tollgate sidecars of the pods it selects.",
    status = "RateLimitPolicyStatus",
    printcolumn = r#"{"name":"Rules","type":"integer","description":"Number of rules in the policy","jsonPath":".status.ruleCount"}"#,
    printcolumn = r#"{"name":"Accepted","type":"string","description":"Whether the policy compiled","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#,
    printcolumn = r#"{"name":"Programmed","type":"string","description":"Whether every selected sidecar enforces the current version","jsonPath":".status.conditions[?(@.type==\"Programmed\")].status"}"#,
    printcolumn = r#"{"name":"Sidecars","type":"integer","description":"Sidecars enforcing the current version","jsonPath":".status.sidecarsInSync"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct RateLimitPolicySpec {
    /// Which pods' sidecars enforce this policy. Only pods in the policy's namespace are selected.
    pub target_ref: TargetRef,

    /// What every rule does while the shared counter store (Redis) is unreachable, unless the rule
    /// overrides it. `Open` keeps serving at the sidecar's local fallback share of the limit (never
    /// unlimited); `Closed` rejects. Choose `Closed` for abuse protection such as login attempts,
    /// `Open` for paid APIs where refusing customers is the worse outcome.
    #[serde(default)]
    pub failure_mode: FailureMode,

    /// The rules. A request must be admitted by every rule that matches it; the response reports
    /// the most restrictive one. Rule names are unique within the policy.
    #[x_kube(merge_strategy = ListMerge::Map(vec!["name".into()]))]
    #[schemars(length(min = 1, max = 64))]
    pub rules: Vec<PolicyRule>,

    /// Requests that no rule of this policy limits: internal batch jobs, health checkers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bypass: Option<Bypass>,

    /// Where the RateLimit headers appear. `All` (default) adds them to admitted responses too,
    /// so well-behaved clients can pace themselves; `Rejected` only on 429s.
    #[serde(default)]
    pub response_headers: ResponseHeaders,

    /// Which rate-limit fields responses carry. `Draft12` (default) sends `RateLimit-Policy` and
    /// `RateLimit` as the current IETF draft (-12) defines them, one item per rule that applied;
    /// `Draft10` adds the older `RateLimit-Limit`, `-Remaining` and `-Reset` fields; `XRateLimit`
    /// sends only `X-RateLimit-Limit`, `-Remaining` and `-Reset`; `None` sends none (a 429 still
    /// carries `Retry-After` and its problem body).
    #[serde(default)]
    pub header_profile: HeaderProfile,

    /// Adds `pk`, a keyed hash of the rule's counter key (never the key itself), to the draft
    /// fields, so a client holding several credentials can tell their quotas apart.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub partition_key: bool,
}

/// Selects the pods whose tollgate sidecars enforce the policy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TargetRef {
    /// A label selector over pods in the policy's namespace. An empty selector selects every
    /// pod with a tollgate sidecar in the namespace.
    pub selector: LabelSelector,
}

/// One rate limit: which requests, counted per which key, at what rate.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.limit) || !has(self.limit.algorithm) || self.limit.algorithm != 'Concurrency' || self.scope == 'Local'").message("spec.rules[].scope must be Local for a Concurrency limit: in-flight counts are per sidecar").field_path(".scope"),
    validation = Rule::new("self.accuracy != 'Strict' || self.scope == 'Global'").message("spec.rules[].accuracy: Strict needs scope Global (it is one atomic Redis call per request)").field_path(".accuracy"),
)]
pub struct PolicyRule {
    /// Name of the rule, unique in the policy. It appears in response headers, metrics and logs,
    /// so it is restricted to lowercase letters, digits and '-'.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,

    /// Which requests the rule applies to. All given conditions must hold; omitted means every
    /// request.
    #[serde(default, rename = "match", skip_serializing_if = "Option::is_none")]
    pub matches: Option<Match>,

    /// Parts joined into the counter key, in order: one bucket per distinct combination. Omitted
    /// means one counter shared by every matching request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[x_kube(merge_strategy = ListMerge::Atomic)]
    pub key: Vec<KeyPart>,

    /// What to do when a key part is absent from the request (no such header, no JWT, ...).
    /// `OwnBucket` (default) counts all such requests together under an empty value, so missing
    /// the header is not a way around the limit; `Skip` exempts the request from this rule.
    #[serde(default)]
    pub on_missing_key: MissingKey,

    /// How many requests per period each key may make.
    pub limit: Limit,

    /// How many tokens one request spends. Defaults to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<Cost>,

    /// `Global` (default) shares the limit across every sidecar enforcing the policy through
    /// token batches leased from Redis; `Local` limits each sidecar (pod) on its own.
    #[serde(default)]
    pub scope: Scope,

    /// `Auto` (default) leases while each sidecar's share is at least 5 tokens and decides each
    /// request exactly below that; `Leased` always spends locally held token batches, accurate
    /// within the outstanding leases; `Strict` makes one atomic Redis call per request, for
    /// exact quotas such as billing.
    #[serde(default)]
    pub accuracy: Accuracy,

    /// `Enforce` (default) rejects excess requests; `Shadow` only counts and reports what it would
    /// have rejected. Roll new rules out in Shadow first.
    #[serde(default)]
    pub mode: Mode,

    /// Overrides the policy's `failureMode` for this rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<FailureMode>,

    /// Which responses count against the limit. Omitted: every request counts when it arrives.
    /// With `statuses`, a request takes `cost.reserve` up front and keeps its cost only if the
    /// response status matches, e.g. 5 failed logins (`[401, 403]`) per user per 15 minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<Count>,
}

/// Which responses a rule counts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Count {
    /// Response statuses that count: codes such as `401`, or classes such as `"5xx"`.
    #[schemars(length(min = 1, max = 32))]
    #[x_kube(merge_strategy = ListMerge::Atomic)]
    pub statuses: Vec<StatusMatch>,
}

/// A response status (`401`) or a class of them (`"4xx"`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(untagged)]
pub enum StatusMatch {
    Code(u16),
    Class(String),
}

/// Written by hand, as Kubernetes' own `IntOrString`: the derived `anyOf` carried an integer
/// `format` the API server warns about inside an int-or-string.
impl JsonSchema for StatusMatch {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "StatusMatch".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A response status such as 401, or a class such as \"5xx\".",
            "x-kubernetes-int-or-string": true,
        })
    }
}

/// Conditions on a request. All given conditions must hold.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Match {
    /// HTTP methods the rule applies to; omitted means any method.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 9))]
    #[x_kube(merge_strategy = ListMerge::Set)]
    pub methods: Vec<Method>,

    /// Request path condition (without the query string).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathMatch>,

    /// Request header conditions; all must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[x_kube(merge_strategy = ListMerge::Atomic)]
    pub headers: Vec<HeaderMatch>,

    /// For tollgate's Envoy rate limit service: entries the descriptor Envoy sends must carry
    /// (all of them; other entries may be present too). A rule with descriptor conditions or
    /// descriptor key parts decides descriptors only, never HTTP requests, and cannot also
    /// have method, path or header conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[x_kube(merge_strategy = ListMerge::Atomic)]
    pub descriptors: Vec<DescriptorMatch>,
}

/// A descriptor entry condition. Without `value` the entry only has to be present.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DescriptorMatch {
    /// The entry's key, as Envoy's `rate_limits` actions name it (`descriptor_key`, or
    /// `generic_key`, `remote_address`, `header_match` for the built-in actions).
    #[schemars(length(min = 1, max = 256))]
    pub key: String,
    /// The entry's value equals this exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub value: Option<String>,
}

/// HTTP request method.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Method {
    GET,
    HEAD,
    POST,
    PUT,
    PATCH,
    DELETE,
    OPTIONS,
    CONNECT,
    TRACE,
}

impl Method {
    /// The method's wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::GET => "GET",
            Method::HEAD => "HEAD",
            Method::POST => "POST",
            Method::PUT => "PUT",
            Method::PATCH => "PATCH",
            Method::DELETE => "DELETE",
            Method::OPTIONS => "OPTIONS",
            Method::CONNECT => "CONNECT",
            Method::TRACE => "TRACE",
        }
    }
}

/// A path condition: exactly one of `exact`, `prefix` or `regex`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.exact), has(self.prefix), has(self.regex)].filter(x, x).size() == 1").message("spec.rules[].match.path: set exactly one of exact, prefix or regex"))]
pub struct PathMatch {
    /// The path equals this value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024), regex(pattern = "^/"))]
    pub exact: Option<String>,
    /// The path starts with this value at a segment boundary: `/payments` matches `/payments`
    /// and `/payments/42` but not `/paymentsx`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024), regex(pattern = "^/"))]
    pub prefix: Option<String>,
    /// The whole path matches this regular expression (RE2-like syntax; no look-around or
    /// backreferences, so matching time is linear).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub regex: Option<String>,
}

/// A header condition. With neither `value` nor `regex` the header only has to be present.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.value) && has(self.regex))").message("spec.rules[].match.headers[]: set at most one of value or regex"))]
pub struct HeaderMatch {
    /// Header name (case-insensitive).
    #[schemars(
        length(min = 1, max = 256),
        regex(pattern = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
    )]
    pub name: String,
    /// The header equals this value exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub value: Option<String>,
    /// The whole header value matches this regular expression.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub regex: Option<String>,
}

/// One part of the counter key: exactly one field is set.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.header), has(self.clientIP), has(self.queryParam), has(self.jwtClaim), has(self.constant), has(self.endpoint), has(self.descriptor)].filter(x, x).size() == 1").message("spec.rules[].key[]: set exactly one of header, clientIP, queryParam, jwtClaim, constant, endpoint or descriptor"))]
pub struct KeyPart {
    /// The value of this request header, e.g. `x-api-key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 256),
        regex(pattern = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
    )]
    pub header: Option<String>,
    /// The client's IP address.
    #[serde(default, rename = "clientIP", skip_serializing_if = "Option::is_none")]
    pub client_ip: Option<ClientIp>,
    /// The value of this query parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub query_param: Option<String>,
    /// A claim of a JWT bearer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt_claim: Option<JwtClaim>,
    /// A fixed string, e.g. to share one counter across rules or name a tenant tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub constant: Option<String>,
    /// The request's method and path (`POST /payments/42`): one bucket per endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<EndpointKey>,
    /// The value of this entry of an Envoy rate limit descriptor (tollgate's rate limit
    /// service), e.g. `api_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub descriptor: Option<String>,
}

/// The client IP address as a key part.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClientIp {
    /// How many proxies in front of the pod append to `X-Forwarded-For`. 0 (default) uses the
    /// TCP peer address. N uses the Nth entry from the right, the address the outermost trusted
    /// proxy saw; entries further left are client-supplied and never trusted. When the header has
    /// fewer entries than N, the leftmost entry's position cannot be trusted either and the peer
    /// address is used.
    #[serde(default)]
    #[schemars(range(min = 0, max = 16))]
    pub trusted_hops: u32,
}

/// A JWT claim as a key part. The token is decoded, **not verified**: tollgate sits in front of
/// the application that verifies it. A client forging a token only chooses which bucket it spends
/// from; pair a claim key with an IP rule if unverified tokens could reach the app.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct JwtClaim {
    /// Header carrying the token. For `authorization`, a `Bearer ` prefix is stripped.
    #[serde(default = "default_jwt_header")]
    #[schemars(
        length(min = 1, max = 256),
        regex(pattern = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
    )]
    pub header: String,
    /// The claim name; nested claims use dots (`org.id`).
    #[schemars(length(min = 1, max = 256))]
    pub claim: String,
}

fn default_jwt_header() -> String {
    "authorization".to_string()
}

/// Method and path of the request as a key part. Has no fields.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct EndpointKey {}

/// What a rule does when a key part is missing from the request.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MissingKey {
    /// All requests lacking the part share one bucket.
    #[default]
    OwnBucket,
    /// The rule does not apply to the request.
    Skip,
}

/// The limit of a rule.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.burst) || self.algorithm == 'TokenBucket'").message("spec.rules[].limit.burst only applies to algorithm TokenBucket").field_path(".burst"),
    validation = Rule::new("!has(self.maxDelay) || self.algorithm == 'LeakyBucket'").message("spec.rules[].limit.maxDelay only applies to algorithm LeakyBucket").field_path(".maxDelay"),
    validation = Rule::new("self.algorithm != 'SlidingLog' || !has(self.requests) || self.requests <= 10000").message("spec.rules[].limit.requests must be at most 10000 for SlidingLog (it stores one timestamp per request)").field_path(".requests"),
)]
pub struct Limit {
    /// Requests admitted per `period` for each key (for Concurrency: requests in flight at once).
    #[schemars(range(min = 1, max = 1_000_000_000))]
    pub requests: u64,
    /// The period, as a duration: `500ms`, `1s`, `1m`, `1h`, `1h30m`. At most 24h.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 2, max = 32),
        regex(pattern = "^([0-9]{1,9}(ms|s|m|h))+$")
    )]
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]{1,9}(ms|s|m|h))+$') || (duration(self) > duration('0s') && duration(self) <= duration('24h'))").message("spec.rules[].limit.period must be greater than 0 and at most 24h"))]
    pub period: Option<String>,
    /// Token bucket capacity: how many requests a key may send at once after being idle.
    /// Defaults to `requests`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000_000))]
    pub burst: Option<u64>,
    /// The algorithm. `TokenBucket` (default) allows bursts up to `burst` and a sustained rate
    /// of requests/period; `SlidingWindow` approximates a rolling window with two counters;
    /// `FixedWindow` counts per clock-aligned period (lets up to 2× through across a boundary);
    /// `SlidingLog` is exact but stores a timestamp per request; `LeakyBucket` delays requests to
    /// a constant rate (up to `maxDelay`) instead of rejecting them; `Concurrency` caps requests
    /// in flight.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// LeakyBucket only: the longest a request may be held to smooth the rate before it is
    /// rejected instead. Defaults to 0 (reject rather than queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 2, max = 32),
        regex(pattern = "^([0-9]{1,9}(ms|s|m|h))+$")
    )]
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]{1,9}(ms|s|m|h))+$') || duration(self) <= duration('1m')").message("spec.rules[].limit.maxDelay must be at most 1m"))]
    pub max_delay: Option<String>,
    /// Once a key exceeds the limit, keep rejecting it for this long, whatever the bucket
    /// holds (a mitigation timeout, for brute-force protection). At most 24h. Each sidecar
    /// blocks the key when it rejects it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 2, max = 32),
        regex(pattern = "^([0-9]{1,9}(ms|s|m|h))+$")
    )]
    #[x_kube(validation = Rule::new("!self.matches('^([0-9]{1,9}(ms|s|m|h))+$') || duration(self) <= duration('24h')").message("spec.rules[].limit.blockFor must be at most 24h"))]
    pub block_for: Option<String>,
}

/// Rate-limiting algorithm.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum Algorithm {
    #[default]
    TokenBucket,
    SlidingWindow,
    FixedWindow,
    SlidingLog,
    LeakyBucket,
    Concurrency,
}

/// Tokens spent by one request: a fixed `amount`, or read from a request `header`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.max) || !has(self.amount) || self.amount <= self.max").message("spec.rules[].cost.amount must not exceed cost.max"),
    validation = Rule::new("!has(self.header) || !has(self.responseHeader)").message("spec.rules[].cost: header and responseHeader exclude each other").field_path(".responseHeader"),
)]
pub struct Cost {
    /// Fixed cost, and the cost used when `header` is absent or not a whole number. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub amount: Option<u32>,
    /// Request header whose integer value is the cost (e.g. `x-cost`), clamped to `max`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 256),
        regex(pattern = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
    )]
    pub header: Option<String>,
    /// Upper bound for a header-supplied cost, so a client cannot claim a huge cost to drain a
    /// shared bucket. Default 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1_000_000))]
    pub max: Option<u32>,
    /// Response header whose integer value is the real cost, known only when the app answers
    /// (e.g. the tokens an LLM call used). The request takes `reserve` up front; the difference
    /// is settled when the response arrives, clamped to `max`, and may run the balance below
    /// zero so that the next requests wait. A missing or non-numeric value keeps the
    /// reservation. Excludes `header`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 256),
        regex(pattern = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
    )]
    pub response_header: Option<String>,
    /// Tokens taken up front by a request whose cost is settled at the response
    /// (`responseHeader` or `count.statuses`). Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1_000_000))]
    pub reserve: Option<u32>,
}

/// Where a rule's counters live.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum Scope {
    /// Shared across all sidecars of the policy (Redis, leased).
    #[default]
    Global,
    /// Per sidecar, in memory.
    Local,
}

/// How exact a global limit is.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum Accuracy {
    /// Leased while each sidecar's share of the limit is at least 5 tokens, one atomic Redis
    /// call per request below that (where leases would park a large part of a small limit).
    #[default]
    Auto,
    /// Spend locally leased token batches; over-admission is bounded by outstanding leases.
    Leased,
    /// One atomic Redis call per request.
    Strict,
}

/// Whether a rule rejects.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum Mode {
    /// Reject excess requests.
    #[default]
    Enforce,
    /// Count and report would-be rejections; never reject.
    Shadow,
}

/// Behaviour while the counter store is unreachable.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum FailureMode {
    /// Keep serving at the sidecar's local fallback share of the limit.
    #[default]
    Open,
    /// Reject (503 with a problem+json body saying the limiter is unavailable).
    Closed,
}

/// Where RateLimit headers are added.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum ResponseHeaders {
    /// On admitted and rejected responses.
    #[default]
    All,
    /// Only on rejected responses.
    Rejected,
}

/// Which rate-limit fields responses carry (see `docs/policy.md` for an example of each).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum HeaderProfile {
    /// `RateLimit-Policy` and `RateLimit`, draft-ietf-httpapi-ratelimit-headers-12.
    #[default]
    Draft12,
    /// The draft fields plus `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` for the
    /// most restrictive rule, as clients written against draft -10 and earlier read them.
    Draft10,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining` and `X-RateLimit-Reset` (seconds from now) for
    /// the most restrictive rule.
    XRateLimit,
    /// No rate-limit fields.
    None,
}

/// One entry of `spec.bypass.cidrs` in the schema: a string the API server checks with CEL's
/// `isCIDR`. The rule sits on the entry, so the API server's error carries its index
/// (`spec.bypass.cidrs[2]`), and its message names the value in `check`'s and the webhook's
/// words (a rule's own error shows only the type: `Invalid value: "string"`).
struct CidrEntry;

impl JsonSchema for CidrEntry {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "CidrEntry".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "minLength": 1,
            "maxLength": 64,
            "x-kubernetes-validations": [{
                "rule": "isCIDR(self)",
                "messageExpression": "'\"' + self + '\" is not a CIDR such as 10.0.0.0/8' + (isIP(self) ? ' (a single address needs a prefix length, e.g. /32 or /128)' : '')",
            }],
        })
    }
}

/// Requests exempt from every rule of the policy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Bypass {
    /// Key values that are never limited: a request is exempt from a rule when any key part the
    /// rule extracts equals one of these (e.g. an internal API key).
    #[serde(default)]
    #[schemars(length(max = 256), inner(length(min = 1, max = 256)))]
    #[x_kube(merge_strategy = ListMerge::Set)]
    pub keys: Vec<String>,
    /// Client networks that are never limited, e.g. `10.0.0.0/8`.
    #[serde(default)]
    #[schemars(with = "Vec<CidrEntry>", length(max = 256))]
    #[x_kube(merge_strategy = ListMerge::Set)]
    pub cidrs: Vec<String>,
    /// How the client address checked against `cidrs` is found; see `clientIP.trustedHops`.
    #[serde(default)]
    #[schemars(range(min = 0, max = 16))]
    pub trusted_hops: u32,
}

/// Observed state, written by the tollgate controller's leader.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RateLimitPolicyStatus {
    /// The generation the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Accepted`: the policy compiled. `Programmed`: every selected sidecar enforces it.
    #[serde(default)]
    #[x_kube(merge_strategy = ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// Number of rules in the compiled policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule_count: Option<u32>,
    /// Connected sidecars running the current version of the policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecars_in_sync: Option<u32>,
    /// Connected sidecars selected by the policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecars_total: Option<u32>,
    /// Version of the compiled rule set last streamed to sidecars.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules_version: Option<u64>,
    /// How each Global rule decides with the sidecars connected now: `Leased` or `Exact` (one
    /// Redis call per request), and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub global_rules: Vec<GlobalRuleStatus>,
    /// The keys this policy rejected most across every sidecar, merged by the controller from
    /// the sidecars' reports and refreshed at most every `--top-keys-interval`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_limited_keys: Option<TopLimitedKeys>,
    /// How long the last accepted generation took to reach every selected sidecar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub propagation: Option<Propagation>,
    /// Pods the policy selects that run without the sidecar (created while the injection
    /// webhook did not answer), so the policy does not limit their traffic. Written by the
    /// leader with the `SidecarsInjected` condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_without_sidecar: Option<u32>,
}

/// The time from the leader compiling a generation to every connected sidecar the policy
/// selects acknowledging it, as the leader learned it (acks reported by other controller
/// replicas arrive with their membership heartbeat, which the figure then includes).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Propagation {
    /// The generation measured.
    pub generation: i64,
    /// Milliseconds from compile to the last acknowledgement.
    pub duration_millis: u64,
    /// When the last acknowledgement was seen (RFC 3339).
    pub completed: String,
}

/// The most-rejected keys of a policy, fleet-wide.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TopLimitedKeys {
    /// The span the counts cover, ending at `updated` (for example `10m`).
    pub window: String,
    /// When the controller merged these counts (RFC 3339).
    pub updated: String,
    /// Most rejected first; at most 10.
    #[serde(default)]
    pub keys: Vec<LimitedKey>,
}

/// One key of [`TopLimitedKeys`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LimitedKey {
    /// The rule's name within the policy.
    pub rule: String,
    /// The key's stable identity (16 hex digits; `tollgate-sidecar key-hash` computes it).
    pub key_hash: String,
    /// Rejections counted for the key in the window.
    pub rejected: u64,
    /// At most this many of `rejected` may belong to other keys (the sketches' over-count).
    pub max_overcount: u64,
    /// Some of the pods that rejected it (at most 5).
    #[serde(default)]
    pub pods: Vec<String>,
    /// How many pods rejected it (each replica counts up to 128).
    pub pod_count: u32,
}

/// The mode a Global rule runs in (see `accuracy`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GlobalRuleStatus {
    pub name: String,
    /// `Leased` or `Exact`.
    pub mode: String,
    pub reason: String,
}

/// Condition types and reasons, shared by the controller and tests.
pub mod conditions {
    pub const ACCEPTED: &str = "Accepted";
    pub const PROGRAMMED: &str = "Programmed";
    /// True when every pod the policy selects runs the sidecar (written by the leader).
    pub const SIDECARS_INJECTED: &str = "SidecarsInjected";
    pub const REASON_ACCEPTED: &str = "Accepted";
    pub const REASON_INVALID: &str = "Invalid";
    pub const REASON_PROGRAMMED: &str = "Programmed";
    pub const REASON_PENDING: &str = "Pending";
    pub const REASON_NO_SIDECARS: &str = "NoSidecars";
}

/// Labels from a `matchLabels` map, for tests and builders.
pub fn match_labels<const N: usize>(pairs: [(&str, &str); N]) -> LabelSelector {
    LabelSelector {
        match_labels: Some(
            pairs
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        ),
        match_expressions: None,
    }
}
