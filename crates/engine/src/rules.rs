//! The rule set in force: compiled policies turned into matchers and limiters, and the
//! per-request decision over them.
//!
//! A [`RuleSet`] is immutable; a reload builds a new one and swaps it in atomically, so every
//! request sees either the old or the new rules, never a mix. Limiter state is carried over for
//! rules whose identity and limit did not change, so a reload does not hand every client a fresh
//! bucket.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use smallvec::SmallVec;

use http::request::Parts;
use http::{HeaderName, HeaderValue};
use tollgate_crd::compiled::*;
use tollgate_limiter::{self as limiter, KeyedLimiter, Limit, Nanos, Permit, StoreConfig};

use crate::block::BlockList;
use crate::keys::{self, PartValue};
use crate::metrics::{Metrics, RuleMetrics};
use tollgate_global::limit::for_limiter;
use tollgate_global::{GlobalRule, GlobalRuntime, LocalOutcome};

/// A rule ready to evaluate.
pub struct ActiveRule {
    pub rule: CompiledRule,
    /// Index into [`RuleSet::policies`].
    pub policy: usize,
    matcher: Matcher,
    pub limiter: Arc<KeyedLimiter>,
    /// Set for `scope: Global` rules when Redis is configured.
    pub global: Option<Arc<GlobalRule>>,
    pub metrics: RuleMetrics,
    /// Precomputed `RateLimit-Policy` item: `"name";q=100;w=60`.
    pub policy_item: bytes::Bytes,
    /// Its 429 body, rendered once with the seconds left open.
    pub rejection_body: crate::problem::RejectionBody,
    /// `limit.blockFor`: keys that exceeded the rule, kept across reloads of the same rule.
    pub blocks: Option<Arc<BlockList>>,
}

/// Per-policy settings evaluated once per request.
pub struct PolicyRuntime {
    pub compiled: CompiledPolicy,
    pub id: String,
}

/// An immutable snapshot of everything being enforced.
pub struct RuleSet {
    pub version: u64,
    pub policies: Vec<PolicyRuntime>,
    pub rules: Vec<ActiveRule>,
    /// Global rules enforced locally because no Redis is configured (standalone mode).
    pub local_fallback_rules: Vec<String>,
}

impl RuleSet {
    /// An empty rule set: every request passes.
    pub fn empty() -> Self {
        RuleSet {
            version: 0,
            policies: Vec::new(),
            rules: Vec::new(),
            local_fallback_rules: Vec::new(),
        }
    }

    /// Builds a rule set, reusing the limiters (and so the counters) of `previous` for rules
    /// whose id and limit are unchanged.
    pub fn build(
        version: u64,
        policies: Vec<CompiledPolicy>,
        previous: Option<&RuleSet>,
        store: &StoreConfig,
        metrics: &Metrics,
        global: Option<&Arc<GlobalRuntime>>,
    ) -> Result<RuleSet, String> {
        let mut reuse: HashMap<(&str, Limit), &Arc<KeyedLimiter>> = HashMap::new();
        if let Some(prev) = previous {
            for r in &prev.rules {
                reuse.insert((r.rule.id.as_str(), *r.limiter.limit()), &r.limiter);
            }
        }
        let mut rules = Vec::new();
        let mut runtimes = Vec::new();
        let mut local_fallback_rules = Vec::new();
        for (pi, policy) in policies.into_iter().enumerate() {
            let policy_id = policy.id();
            for rule in &policy.rules {
                let limit =
                    for_limiter(&rule.limit).map_err(|e| format!("{}: limit: {e}", rule.id))?;
                let limiter = match reuse.get(&(rule.id.as_str(), limit)) {
                    Some(l) => Arc::clone(l),
                    None => Arc::new(KeyedLimiter::new(limit, *store)),
                };
                let global_rule = match (rule.scope, global) {
                    (Scope::Global, Some(rt)) => {
                        let kept = previous.and_then(|p| {
                            p.rules
                                .iter()
                                .filter_map(|r| r.global.as_ref())
                                .find(|g| g.same_bucket(rule))
                        });
                        Some(match kept {
                            Some(g) => Arc::clone(g),
                            None => {
                                Arc::new(GlobalRule::new(rule, &policy_id, Arc::clone(rt), *store)?)
                            }
                        })
                    }
                    (Scope::Global, None) => {
                        local_fallback_rules.push(rule.id.clone());
                        None
                    }
                    (Scope::Local, _) => None,
                };
                // Rule names go into response fields as they are (the HTTP/1 fast path writes
                // them without a HeaderValue check): compile() allows only DNS labels, and a rule
                // set from anywhere else (the controller's stream) is held to the same.
                if !tollgate_crd::compile::is_dns_label(&rule.name) {
                    return Err(format!(
                        "{}: rule name {:?} is not a DNS label",
                        rule.id, rule.name
                    ));
                }
                let policy_item = policy_item(rule);
                let blocks = (rule.limit.block_for_ms > 0).then(|| {
                    previous
                        .and_then(|p| p.rules.iter().find(|r| r.rule.id == rule.id))
                        .filter(|r| r.rule.limit.block_for_ms == rule.limit.block_for_ms)
                        .and_then(|r| r.blocks.clone())
                        .unwrap_or_else(|| Arc::new(BlockList::new(rule.limit.block_for_ms)))
                });
                rules.push(ActiveRule {
                    matcher: Matcher::new(rule).map_err(|e| format!("{}: match: {e}", rule.id))?,
                    metrics: metrics.rule(&policy_id, &rule.name),
                    rule: rule.clone(),
                    policy: pi,
                    limiter,
                    global: global_rule,
                    policy_item,
                    rejection_body: crate::problem::RejectionBody::new(rule),
                    blocks,
                });
            }
            runtimes.push(PolicyRuntime {
                id: policy_id,
                compiled: policy,
            });
        }
        Ok(RuleSet {
            version,
            policies: runtimes,
            rules,
            local_fallback_rules,
        })
    }

    /// Drops idle keys from every limiter; returns how many were removed.
    pub fn evict_idle(&self, now: Nanos) -> usize {
        self.rules.iter().map(|r| r.limiter.evict_idle(now)).sum()
    }

    /// Number of live keys across all limiters.
    pub fn active_keys(&self) -> usize {
        self.rules.iter().map(|r| r.limiter.len()).sum()
    }
}

/// Request conditions compiled for evaluation.
struct Matcher {
    /// Bit per method in [`method_bit`]; 0 means any method.
    methods: u16,
    path: Option<PathMatcher>,
    headers: Vec<(HeaderName, ValueMatcher)>,
    /// The rule decides rate limit service descriptors ([`keys::Descriptor`]), not HTTP
    /// requests.
    for_descriptors: bool,
    descriptors: Vec<(String, Option<String>)>,
}

enum PathMatcher {
    Exact(String),
    Prefix(String),
    Regex(regex::Regex),
}

enum ValueMatcher {
    Present,
    Exact(HeaderValue),
    Regex(regex::Regex),
}

fn method_bit(m: &http::Method) -> u16 {
    match *m {
        http::Method::GET => 1,
        http::Method::HEAD => 1 << 1,
        http::Method::POST => 1 << 2,
        http::Method::PUT => 1 << 3,
        http::Method::PATCH => 1 << 4,
        http::Method::DELETE => 1 << 5,
        http::Method::OPTIONS => 1 << 6,
        http::Method::CONNECT => 1 << 7,
        http::Method::TRACE => 1 << 8,
        _ => 1 << 15,
    }
}

impl Matcher {
    fn new(rule: &CompiledRule) -> Result<Matcher, String> {
        let m = &rule.matches;
        let methods = m.methods.iter().fold(0u16, |acc, method| {
            acc | method_bit(
                &http::Method::from_bytes(method.as_str().as_bytes()).unwrap_or_default(),
            )
        });
        let path = match &m.path {
            None => None,
            Some(PathCondition::Exact(p)) => Some(PathMatcher::Exact(p.clone())),
            Some(PathCondition::Prefix(p)) => Some(PathMatcher::Prefix(p.clone())),
            Some(PathCondition::Regex(r)) => Some(PathMatcher::Regex(
                full_match_regex(r).map_err(|e| e.to_string())?,
            )),
        };
        let headers = m
            .headers
            .iter()
            .map(|h| {
                let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|e| e.to_string())?;
                let value = match &h.value {
                    HeaderValueMatch::Present => ValueMatcher::Present,
                    HeaderValueMatch::Exact(v) => {
                        ValueMatcher::Exact(HeaderValue::from_str(v).map_err(|e| e.to_string())?)
                    }
                    HeaderValueMatch::Regex(r) => {
                        ValueMatcher::Regex(full_match_regex(r).map_err(|e| e.to_string())?)
                    }
                };
                Ok((name, value))
            })
            .collect::<Result<_, String>>()?;
        Ok(Matcher {
            methods,
            path,
            headers,
            for_descriptors: rule.for_descriptors(),
            descriptors: m
                .descriptors
                .iter()
                .map(|d| (d.key.clone(), d.value.clone()))
                .collect(),
        })
    }

    fn matches(&self, parts: &Parts) -> bool {
        let descriptor = parts.extensions.get::<keys::Descriptor>();
        if self.for_descriptors != descriptor.is_some() {
            return false;
        }
        if let Some(d) = descriptor {
            return self.descriptors.iter().all(|(key, value)| {
                d.get(key)
                    .is_some_and(|v| value.as_deref().is_none_or(|want| want == v))
            });
        }
        if self.methods != 0 && self.methods & method_bit(&parts.method) == 0 {
            return false;
        }
        if let Some(p) = &self.path {
            let path = parts.uri.path();
            let ok = match p {
                PathMatcher::Exact(e) => path == e,
                PathMatcher::Prefix(pre) => {
                    pre == "/"
                        || (path.starts_with(pre.as_str())
                            && matches!(path.as_bytes().get(pre.len()), None | Some(b'/')))
                }
                PathMatcher::Regex(r) => r.is_match(path),
            };
            if !ok {
                return false;
            }
        }
        self.headers.iter().all(|(name, m)| {
            let mut values = parts.headers.get_all(name).iter();
            match m {
                ValueMatcher::Present => values.next().is_some(),
                ValueMatcher::Exact(v) => values.any(|x| x == v),
                ValueMatcher::Regex(r) => values.any(|x| x.to_str().is_ok_and(|s| r.is_match(s))),
            }
        })
    }
}

/// The outcome of evaluating every rule for one request.
#[derive(Default)]
pub struct Verdict {
    /// The enforcing rule that rejected the request and its decision.
    pub rejected: Option<Rejection>,
    /// The decisions of the enforcing rules that admitted the request (for a rejected one:
    /// those evaluated before the rejecting rule), in rule order, for the RateLimit fields.
    /// Inline for up to four rules: no allocation on the common path.
    pub admitted: SmallVec<[Limited; 4]>,
    /// Shadow rules that would have rejected the request.
    pub shadow_rejections: u32,
    /// Concurrency permits to hold until the response completes.
    pub permits: Vec<Permit>,
    /// Leaky-bucket shaping: hold the request this long before forwarding.
    pub delay: Nanos,
    /// Global rules that need a Redis round trip before the request can be decided.
    pub pending: Vec<Pending>,
    /// A fail-closed global rule while Redis is unreachable: answer 503.
    pub unavailable: Option<usize>,
    /// Rules whose cost is settled when the response arrives, with what they reserved.
    pub settlements: SmallVec<[Settlement; 1]>,
}

/// A reservation to settle at the response (`cost.responseHeader`, `count.statuses`).
pub struct Settlement {
    pub rule: usize,
    pub key: Vec<u8>,
    /// Taken when the request was admitted.
    pub reserved: u64,
    /// The cost if the response counts and carries no cost of its own (the request's cost).
    pub counted: u64,
}

/// What the core decided for one request, for an edge to map to its protocol in one place.
pub enum Outcome<'v> {
    /// Forward it (after [`Verdict::delay`], holding [`Verdict::permits`]).
    Admit,
    /// Refused by a rule: answer "too many requests".
    Reject(&'v Rejection),
    /// A fail-closed global rule (its index) cannot reach Redis: answer "unavailable".
    Unavailable(usize),
}

impl Verdict {
    /// The decision; an unavailable rule outranks a rejecting one (the client must not retry
    /// sooner because of a Retry-After that Redis's absence makes meaningless).
    pub fn outcome(&self) -> Outcome<'_> {
        match (self.unavailable, &self.rejected) {
            (Some(ri), _) => Outcome::Unavailable(ri),
            (None, Some(r)) => Outcome::Reject(r),
            (None, None) => Outcome::Admit,
        }
    }

    /// The admitting rule closest to its limit (smallest remaining/limit), which the
    /// single-rule header profiles report.
    pub fn tightest(&self) -> Option<&Limited> {
        self.admitted.iter().reduce(|t, d| {
            // Compare remaining/limit without division.
            let tighter = u128::from(d.decision.remaining) * u128::from(t.decision.limit.max(1))
                < u128::from(t.decision.remaining) * u128::from(d.decision.limit.max(1));
            if tighter { d } else { t }
        })
    }
}

/// A global rule whose decision needs a round trip.
pub struct Pending {
    pub rule: usize,
    pub key: Vec<u8>,
    /// What the round trip takes: the cost, or the reservation of a cost settled later.
    pub cost: u64,
    /// The request's own cost (see [`Settlement::counted`]).
    pub counted: u64,
    pub fingerprint: u64,
}

/// What a decision charged, for settling it at the response and for blocking.
#[derive(Clone, Copy)]
pub struct Charge {
    pub reserved: u64,
    pub counted: u64,
    pub now: Nanos,
}

/// A rule's decision for one request.
pub struct Limited {
    pub rule: usize,
    pub decision: limiter::Decision,
    /// Fingerprint of the counter key, for blocks, jitter and top keys.
    pub fingerprint: u64,
}

/// The rejecting rule, with the raw counter key kept for an audit log configured to show it.
pub struct Rejection {
    pub limited: Limited,
    pub key: Vec<u8>,
}

/// What happened at one rule for one request, for observers of [`RuleSet::evaluate_observed`]
/// (the replay dry-run). The rule's metrics count the same things.
pub enum RuleEvent<'a> {
    /// Exempt through the policy's bypass networks or keys.
    Bypassed,
    /// Matched, but a key part was missing and the rule says `onMissingKey: Skip`.
    SkippedMissingKey,
    /// Matched and decided locally.
    Decided {
        key: &'a [u8],
        fingerprint: u64,
        decision: &'a limiter::Decision,
    },
}

/// Why a matching rule does not count a request after all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeySkip {
    /// A key part is one of the policy's bypass keys.
    BypassKey,
    /// A key part is missing and the rule says `onMissingKey: Skip`.
    MissingKey,
}

/// How one rule treats one request, before any counter is read: what
/// [`RuleSet::applies`] tells `/debug/why`. [`RuleSet::evaluate`] takes the same steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applies {
    /// The client address is in the policy's bypass networks.
    BypassedNetwork,
    /// Method, path or headers differ from the rule's match.
    NotMatched,
    Skipped(KeySkip),
    /// The rule counts the request under the key now in `key_buf`.
    Counted,
}

/// Builds the rule's counter key into `key_buf`, or says why the rule does not apply to this
/// request after all. Pure: the caller counts what it skips.
#[inline]
fn build_key(
    active: &ActiveRule,
    policy: &CompiledPolicy,
    parts: &Parts,
    peer: &SocketAddr,
    key_buf: &mut Vec<u8>,
) -> Result<(), KeySkip> {
    key_buf.clear();
    for source in &active.rule.key {
        let value = keys::extract(source, parts, peer);
        if value.is_bypass_key(&policy.bypass.keys) {
            return Err(KeySkip::BypassKey);
        }
        if matches!(value, PartValue::Missing) && active.rule.on_missing_key == MissingKey::Skip {
            return Err(KeySkip::MissingKey);
        }
        value.append_to(key_buf);
    }
    Ok(())
}

/// Whether the client address is in the policy's bypass networks.
#[inline]
fn client_bypassed(bypass: &CompiledBypass, parts: &Parts, peer: &SocketAddr) -> bool {
    !bypass.cidrs.is_empty()
        && keys::client_ip(parts, peer, bypass.trusted_hops)
            .ip()
            .is_some_and(|ip| bypass.cidrs.iter().any(|n| n.contains(&ip)))
}

/// What [`RuleSet::decide_rule`] did with one rule.
enum RuleStep {
    Decided(limiter::Decision),
    /// Queued on `verdict.pending` for a Redis round trip.
    Pending,
    /// A fail-closed rule in shadow mode without Redis: counted, and the next rules decide.
    Unavailable,
    /// The verdict is final (fail-closed without Redis): evaluate no further rules.
    Stop,
}

impl RuleSet {
    /// Evaluates every matching rule locally (held leases included). Stops at the first
    /// enforcing rule that rejects, so a rejected request spends no tokens of the rules after
    /// it and costs less than an admitted one. Global keys that need Redis are left `pending`:
    /// [`crate::shared::Shared::decide`], the one decision every edge makes, resolves them.
    pub fn evaluate(
        &self,
        parts: &Parts,
        peer: &SocketAddr,
        now: Nanos,
        key_buf: &mut Vec<u8>,
        fingerprinter: &Fingerprinter,
    ) -> Verdict {
        self.evaluate_observed(parts, peer, now, key_buf, fingerprinter, &mut |_, _| {})
    }

    /// [`RuleSet::evaluate`], telling `observe` what happened at each rule the request reached
    /// (by rule index). `evaluate` passes a no-op, which compiles away. Global rules waiting for a
    /// Redis round trip (`pending`) are decided later and not observed.
    #[inline]
    pub fn evaluate_observed(
        &self,
        parts: &Parts,
        peer: &SocketAddr,
        now: Nanos,
        key_buf: &mut Vec<u8>,
        fingerprinter: &Fingerprinter,
        observe: &mut impl FnMut(usize, RuleEvent<'_>),
    ) -> Verdict {
        let mut verdict = Verdict::default();
        let mut bypassed_policy: Option<(usize, bool)> = None;
        for (ri, active) in self.rules.iter().enumerate() {
            let policy = &self.policies[active.policy].compiled;
            if self.bypassed(active, parts, peer, &mut bypassed_policy) {
                active.metrics.bypassed.inc();
                observe(ri, RuleEvent::Bypassed);
                continue;
            }
            if !active.matcher.matches(parts) {
                continue;
            }
            match build_key(active, policy, parts, peer, key_buf) {
                Ok(()) => {}
                Err(KeySkip::BypassKey) => {
                    active.metrics.bypassed.inc();
                    observe(ri, RuleEvent::Bypassed);
                    continue;
                }
                Err(KeySkip::MissingKey) => {
                    observe(ri, RuleEvent::SkippedMissingKey);
                    continue;
                }
            }
            let cost = request_cost(&active.rule.cost, parts);
            let fingerprint = fingerprinter.hash(key_buf);
            // A cost settled at the response takes only the reservation now.
            let charge = if active.rule.settles_at_response() {
                u64::from(active.rule.cost.reserve)
            } else {
                cost
            };
            let charged = Charge {
                reserved: charge,
                counted: cost,
                now,
            };
            let decision = match self.decide_rule(&mut verdict, ri, key_buf, fingerprint, &charged)
            {
                RuleStep::Decided(d) => d,
                RuleStep::Pending | RuleStep::Unavailable => continue,
                RuleStep::Stop => return verdict,
            };
            observe(
                ri,
                RuleEvent::Decided {
                    key: key_buf,
                    fingerprint,
                    decision: &decision,
                },
            );
            if self.account(&mut verdict, ri, decision, fingerprint, key_buf, charged) {
                return verdict;
            }
        }
        verdict
    }

    /// How rule `ri` treats a request, in the order [`RuleSet::evaluate`] checks: nothing is
    /// charged or counted. On [`Applies::Counted`] the rule's key is in `key_buf`.
    pub fn applies(
        &self,
        ri: usize,
        parts: &Parts,
        peer: &SocketAddr,
        key_buf: &mut Vec<u8>,
    ) -> Applies {
        let active = &self.rules[ri];
        let policy = &self.policies[active.policy].compiled;
        if client_bypassed(&policy.bypass, parts, peer) {
            return Applies::BypassedNetwork;
        }
        if !active.matcher.matches(parts) {
            return Applies::NotMatched;
        }
        match build_key(active, policy, parts, peer, key_buf) {
            Ok(()) => Applies::Counted,
            Err(skip) => Applies::Skipped(skip),
        }
    }

    /// Whether the request's client is in the rule's policy's bypass CIDRs; evaluated once per
    /// policy (`cache` holds the last policy's answer: rules of a policy are adjacent).
    #[inline]
    fn bypassed(
        &self,
        active: &ActiveRule,
        parts: &Parts,
        peer: &SocketAddr,
        cache: &mut Option<(usize, bool)>,
    ) -> bool {
        if let Some((pi, b)) = *cache
            && pi == active.policy
        {
            return b;
        }
        let b = client_bypassed(&self.policies[active.policy].compiled.bypass, parts, peer);
        *cache = Some((active.policy, b));
        b
    }

    /// One enforcing rule's decision for the key in `key_buf`: from its block list, its lease
    /// or its local limiter. A global key that needs Redis is queued on `verdict.pending`;
    /// a fail-closed rule without Redis marks the verdict unavailable.
    #[inline]
    fn decide_rule(
        &self,
        verdict: &mut Verdict,
        ri: usize,
        key_buf: &[u8],
        fingerprint: u64,
        charged: &Charge,
    ) -> RuleStep {
        let active = &self.rules[ri];
        let (now, charge) = (charged.now, charged.reserved);
        if let Some(wait) = active
            .blocks
            .as_ref()
            .and_then(|b| b.remaining(fingerprint, now))
        {
            return RuleStep::Decided(blocked_decision(&active.rule.limit, wait));
        }
        if let Some(g) = &active.global {
            let (field, _) = g.field_for(key_buf);
            return match g.try_local(&field, key_buf, now, charge) {
                LocalOutcome::Decided(d) => RuleStep::Decided(d),
                LocalOutcome::NeedRemote => {
                    verdict.pending.push(Pending {
                        rule: ri,
                        key: key_buf.to_vec(),
                        cost: charge,
                        counted: charged.counted,
                        fingerprint,
                    });
                    RuleStep::Pending
                }
                LocalOutcome::Unavailable if self.unavailable(verdict, ri, now) => RuleStep::Stop,
                LocalOutcome::Unavailable => RuleStep::Unavailable,
            };
        }
        if active.rule.limit.algorithm == Algorithm::Concurrency {
            return RuleStep::Decided(match active.limiter.acquire_permit(key_buf, now, charge) {
                Ok(permit) => {
                    // Remaining = the cap less what is in flight, this request included.
                    let d = *permit.decision();
                    verdict.permits.push(permit);
                    d
                }
                Err(d) => d,
            });
        }
        RuleStep::Decided(active.limiter.check(key_buf, now, charge))
    }

    /// Records one rule's decision; returns true when the request is rejected (stop evaluating).
    pub fn account(
        &self,
        verdict: &mut Verdict,
        ri: usize,
        mut decision: limiter::Decision,
        fingerprint: u64,
        key: &[u8],
        charge: Charge,
    ) -> bool {
        let active = &self.rules[ri];
        if decision.allowed {
            active.metrics.allowed.inc();
            verdict.delay = verdict.delay.max(decision.delay);
            if active.rule.settles_at_response() {
                verdict.settlements.push(Settlement {
                    rule: ri,
                    key: key.to_vec(),
                    reserved: charge.reserved,
                    counted: charge.counted,
                });
            }
            if active.rule.mode == Mode::Enforce {
                verdict.admitted.push(Limited {
                    rule: ri,
                    decision,
                    fingerprint,
                });
            }
            false
        } else if active.rule.mode == Mode::Shadow {
            active.metrics.shadow_rejected.inc();
            verdict.shadow_rejections += 1;
            false
        } else {
            active.metrics.rejected.inc();
            if let Some(blocks) = &active.blocks {
                // Requests during a block do not extend it: it ends `blockFor` after the first.
                // A Global rule's block holds at every sidecar (kept with its lease, published
                // to Redis once).
                let block = match &active.global {
                    Some(g) => g.block(key, charge.now),
                    None => blocks
                        .remaining(fingerprint, charge.now)
                        .unwrap_or_else(|| blocks.block(fingerprint, charge.now)),
                };
                decision.retry_after = decision.retry_after.max(block);
                decision.reset = decision.reset.max(block);
            }
            verdict.rejected = Some(Rejection {
                limited: Limited {
                    rule: ri,
                    decision,
                    fingerprint,
                },
                key: key.to_vec(),
            });
            verdict.permits.clear();
            self.release_reservations(verdict, charge.now);
            true
        }
    }

    /// A fail-closed rule with Redis unreachable; returns true when the request must stop.
    pub fn unavailable(&self, verdict: &mut Verdict, ri: usize, now: Nanos) -> bool {
        let active = &self.rules[ri];
        if active.rule.mode == Mode::Shadow {
            active.metrics.shadow_rejected.inc();
            verdict.shadow_rejections += 1;
            return false;
        }
        active.metrics.unavailable.inc();
        verdict.unavailable = Some(ri);
        verdict.permits.clear();
        self.release_reservations(verdict, now);
        true
    }

    /// A request stopped by a later rule never reaches the app: what earlier rules reserved
    /// for a cost settled at the response is given back.
    fn release_reservations(&self, verdict: &mut Verdict, now: Nanos) {
        for s in std::mem::take(&mut verdict.settlements) {
            let delta = -i64::try_from(s.reserved).unwrap_or(i64::MAX);
            match &self.rules[s.rule].global {
                Some(g) => g.settle(&s.key, now, delta),
                None => self.rules[s.rule].limiter.settle(&s.key, now, delta),
            }
        }
    }

    /// Resolves the round trips a verdict is waiting for.
    pub async fn resolve_pending(&self, verdict: &mut Verdict, now: Nanos) {
        let pending = std::mem::take(&mut verdict.pending);
        for p in pending {
            let Some(g) = &self.rules[p.rule].global else {
                continue;
            };
            let stop = match g.acquire_remote(&p.key, now, p.cost).await {
                LocalOutcome::Decided(d) => {
                    let charge = Charge {
                        reserved: p.cost,
                        counted: p.counted,
                        now,
                    };
                    self.account(verdict, p.rule, d, p.fingerprint, &p.key, charge)
                }
                LocalOutcome::Unavailable => self.unavailable(verdict, p.rule, now),
                LocalOutcome::NeedRemote => false,
            };
            if stop {
                return;
            }
        }
    }
}

/// The 429 decision for a key still serving its `blockFor`.
fn blocked_decision(l: &CompiledLimit, wait: Nanos) -> limiter::Decision {
    limiter::Decision {
        allowed: false,
        limit: l.burst,
        remaining: 0,
        reset: wait,
        retry_after: wait,
        delay: 0,
    }
}

impl RuleSet {
    /// Settles what admitted requests reserved, now that the response is known: a response
    /// whose status does not count costs nothing; one that counts costs its `responseHeader`
    /// value (clamped to `cost.max`; missing or not a number: the reservation stands) or the
    /// request's own cost. Local rules settle in their counters, global ones through their
    /// lease (see [`GlobalRule::settle`]).
    pub fn settle(
        &self,
        settlements: &[Settlement],
        status: u16,
        headers: &http::HeaderMap,
        now: Nanos,
    ) {
        for s in settlements {
            let active = &self.rules[s.rule];
            let rule = &active.rule;
            let actual = if !rule.counts_status(status) {
                0
            } else if let Some(name) = &rule.cost.response_header {
                headers
                    .get(name.as_str())
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map_or(s.reserved, |v| v.min(u64::from(rule.cost.max)))
            } else {
                s.counted
            };
            let delta = i64::try_from(actual).unwrap_or(i64::MAX)
                - i64::try_from(s.reserved).unwrap_or(i64::MAX);
            match &active.global {
                Some(g) => g.settle(&s.key, now, delta),
                None => active.limiter.settle(&s.key, now, delta),
            }
        }
    }
}

/// Tokens this request spends: the header value when present and numeric, clamped to
/// `[1, max]`; otherwise the fixed amount.
pub(crate) fn request_cost(cost: &CompiledCost, parts: &Parts) -> u64 {
    if let Some(d) = parts.extensions.get::<keys::Descriptor>() {
        // Envoy's `hits_addend`: this many requests at once (0 means 1).
        return u64::from(cost.amount).saturating_mul(d.hits.max(1));
    }
    let from_header = cost
        .header
        .as_deref()
        .and_then(|h| parts.headers.get(h))
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok());
    match from_header {
        // `max(1)`: a streamed rule with `max: 0` must not make `clamp` panic.
        Some(n) => n.clamp(1, u64::from(cost.max).max(1)),
        None => u64::from(cost.amount),
    }
}

/// Fingerprints of counter keys on the hot path (blocks, top keys, the `pk` partition key, the
/// `Retry-After` jitter): not reversible and not predictable by clients. Keyed from the
/// installation's key-hash secret ([`crate::key_hash::KeyHashes`]), so one client gets the
/// same `pk` and the same jitter from every sidecar of the installation; random where no
/// secret is shared (tests, replays).
#[derive(Clone)]
pub struct Fingerprinter(siphasher::sip::SipHasher13);

impl Fingerprinter {
    /// A fingerprinter under fixed keys (derived from a secret by the caller).
    pub fn with_keys(k0: u64, k1: u64) -> Self {
        Fingerprinter(siphasher::sip::SipHasher13::new_with_keys(k0, k1))
    }

    pub fn random() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let rs = std::collections::hash_map::RandomState::new();
        let mut a = rs.build_hasher();
        a.write_u8(1);
        let mut b = rs.build_hasher();
        b.write_u8(2);
        Fingerprinter(siphasher::sip::SipHasher13::new_with_keys(
            a.finish(),
            b.finish(),
        ))
    }

    pub fn hash(&self, key: &[u8]) -> u64 {
        use std::hash::Hasher;
        let mut h = self.0;
        h.write(key);
        h.finish()
    }
}

/// The rule's `RateLimit-Policy` item, built once per rule set: `"name";q=100;w=60`, or
/// `"name";q=10;qu="concurrent-requests"` for a concurrency limit (no window). Rule names are
/// `[a-z0-9-]`, so they need no escaping in an sf-string.
fn policy_item(rule: &CompiledRule) -> bytes::Bytes {
    let l = &rule.limit;
    let item = if l.algorithm == Algorithm::Concurrency {
        format!(
            "\"{}\";q={};qu=\"concurrent-requests\"",
            rule.name, l.requests
        )
    } else {
        let window = l.period_ms.div_ceil(1000).max(1);
        format!("\"{}\";q={};w={window}", rule.name, l.requests)
    };
    bytes::Bytes::from(item)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rule set of `policy` alone: no Redis, default store, fresh metrics.
    fn local_set(policy: CompiledPolicy) -> Result<RuleSet, String> {
        RuleSet::build(
            1,
            vec![policy],
            None,
            &StoreConfig::default(),
            &Metrics::new(),
            None,
        )
    }

    /// Found by fuzzing streamed rules, which are not re-validated by the sidecar.
    #[test]
    fn hostile_compiled_limits_do_not_panic() {
        let limit = CompiledLimit {
            algorithm: Algorithm::LeakyBucket,
            requests: 1,
            period_ms: u64::MAX,
            burst: 1,
            max_delay_ms: u64::MAX,
            block_for_ms: u64::MAX,
        };
        let _ = for_limiter(&limit);
        let parts = http::Request::builder()
            .header("x-cost", "50")
            .body(())
            .map(|r| r.into_parts().0)
            .unwrap();
        let cost = CompiledCost {
            amount: 1,
            header: Some("x-cost".into()),
            max: 0,
            ..CompiledCost::default()
        };
        assert_eq!(request_cost(&cost, &parts), 1);
    }

    /// A streamed rule set is not re-compiled: a rule name that could break a header line
    /// (the fast path writes names into responses as they are) refuses the whole set.
    #[test]
    fn a_rule_name_that_is_not_a_dns_label_refuses_the_set() {
        let yaml = "apiVersion: tollgate.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: p, \
                    namespace: ns}\nspec:\n  targetRef: {selector: {}}\n  rules:\n  - name: r\n    \
                    limit: {requests: 2, period: 1m}\n";
        let mut policy = tollgate_crd::parse_yaml_documents(yaml).unwrap()[0]
            .compile()
            .unwrap();
        policy.rules[0].name = "r\r\nx-injected: 1".into();
        let built = local_set(policy);
        let err = built.err().expect("a name with CR LF was accepted");
        assert!(err.contains("is not a DNS label"), "{err}");
    }

    fn descriptor_request(entries: &[(&str, &str)]) -> Parts {
        let mut parts = http::Request::new(()).into_parts().0;
        parts.extensions.insert(keys::Descriptor {
            entries: entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            hits: 1,
        });
        parts
    }

    /// One HTTP rule and two descriptor rules (Local, 2 per minute): HTTP requests meet only
    /// the first, descriptors only the others, keyed by their entry's value.
    #[test]
    fn descriptor_rules_decide_descriptors_and_http_rules_http_requests() {
        let yaml = r#"apiVersion: tollgate.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: p, namespace: ns}
spec:
  targetRef: {selector: {}}
  rules:
  - name: http
    scope: Local
    key: [{header: x-api-key}]
    limit: {requests: 2, period: 1m}
  - name: per-key
    scope: Local
    match: {descriptors: [{key: route, value: checkout}]}
    key: [{descriptor: api_key}]
    limit: {requests: 2, period: 1m}
  - name: any-route
    scope: Local
    key: [{descriptor: route}]
    onMissingKey: Skip
    limit: {requests: 100, period: 1m}
"#;
        let policy = tollgate_crd::parse_yaml_documents(yaml).unwrap()[0]
            .compile()
            .unwrap();
        let rules = local_set(policy).unwrap();
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let fingerprinter = Fingerprinter::random();
        let mut buf = Vec::new();
        let applies = |parts: &Parts, buf: &mut Vec<u8>| -> Vec<Applies> {
            (0..3)
                .map(|ri| rules.applies(ri, parts, &peer, buf))
                .collect()
        };
        let http = http::Request::builder()
            .header("x-api-key", "a")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        assert_eq!(
            applies(&http, &mut buf),
            [Applies::Counted, Applies::NotMatched, Applies::NotMatched]
        );
        let checkout = descriptor_request(&[("route", "checkout"), ("api_key", "k1")]);
        assert_eq!(
            applies(&checkout, &mut buf),
            [Applies::NotMatched, Applies::Counted, Applies::Counted]
        );
        let other = descriptor_request(&[("route", "search"), ("api_key", "k1")]);
        assert_eq!(
            applies(&other, &mut buf),
            [Applies::NotMatched, Applies::NotMatched, Applies::Counted]
        );
        let no_route = descriptor_request(&[("api_key", "k1")]);
        assert_eq!(
            applies(&no_route, &mut buf),
            [
                Applies::NotMatched,
                Applies::NotMatched,
                Applies::Skipped(KeySkip::MissingKey)
            ]
        );
        // The limit counts per api_key value: k1 gets 2, then k2 still gets 2.
        let admitted = |parts: &Parts, buf: &mut Vec<u8>| {
            rules
                .evaluate(parts, &peer, 0, buf, &fingerprinter)
                .rejected
                .is_none()
        };
        let k2 = descriptor_request(&[("route", "checkout"), ("api_key", "k2")]);
        let seen: Vec<bool> = (0..3).map(|_| admitted(&checkout, &mut buf)).collect();
        assert_eq!(seen, [true, true, false]);
        assert!(admitted(&k2, &mut buf));
        // HTTP requests keep their own counter.
        assert!(admitted(&http, &mut buf) && admitted(&http, &mut buf));
        assert!(!admitted(&http, &mut buf));
    }
}
