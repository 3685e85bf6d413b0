//! Leased token batches: how a global limit is enforced without a Redis round trip per request.
//!
//! For each hot key a sidecar holds a local allowance taken from the global bucket. Requests
//! spend it with one atomic operation. A background task syncs every interval: it returns what
//! the key's recent demand does not need and tops up keys that ran low, all in one pipelined
//! round trip. A key that runs dry before the next sync, and a key seen for the first time, pay
//! one round trip bounded by a tight timeout. Tokens are taken from the global bucket before
//! they are spent, so leasing itself never over-admits; the cost of leasing is that tokens parked
//! in one sidecar are briefly unavailable to the others, bounded by each sidecar's share.
//!
//! A sidecar's share (the most it may hold for one key, and its fallback rate while Redis is
//! unreachable) is the limit divided by the live sidecars enforcing the policy.

use std::collections::HashMap;
use std::hash::Hasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tollgate_crd::compiled::{Accuracy, Algorithm, CompiledLimit, CompiledRule, FailureMode};
use tollgate_limiter::{Decision, KeyedLimiter, Limit, Nanos, StoreConfig};

use crate::GlobalMetrics;
use crate::store::{LeaseOp, LeaseReply, SETTLEMENT_RETRY_FOR, Store, StoreError};

const NANOS_PER_MS: Nanos = 1_000_000;
const SHARDS: usize = 16;
/// The smallest excess a key returns to Redis before it goes idle (see `plan_slot`).
const MIN_RETURN: u64 = 8;
/// `accuracy: Auto` leases while each sidecar's share of the capacity is at least this many
/// tokens, and decides each request with one Redis call below it (Tyk switches to exact
/// counting below servers × 5 the same way): a lease is at least a token per key per
/// sidecar, so with fewer tokens per sidecar leases park a large part of the limit where it
/// may not be needed.
pub use tollgate_crd::compiled::AUTO_MIN_SHARE;

/// Settings shared by every global rule.
pub struct LeaseSettings {
    /// Timeout of a Redis call made while a request waits (cold key, dry lease, strict rule).
    pub request_timeout: Duration,
    /// Timeout of the background sync round trip.
    pub sync_timeout: Duration,
    pub sync_interval: Duration,
    /// How long leased tokens stay spendable without a successful sync (outage bound).
    pub lease_ttl: Duration,
}

impl LeaseSettings {
    /// Until when a lease confirmed by Redis at `now` may be spent.
    fn lease_until(&self, now: Nanos) -> Nanos {
        now + self.lease_ttl.as_nanos() as Nanos
    }
}

/// The shared runtime: Redis, settings, metrics and the wake-up for early syncs.
pub struct GlobalRuntime {
    pub store: Store,
    pub settings: LeaseSettings,
    pub metrics: GlobalMetrics,
    /// Signalled when a hot key drops below its low watermark, so the sync runs early.
    pub wake: tokio::sync::Notify,
    /// Signalled after every sync round has credited its top-ups (see `Slot::topping_up`).
    pub synced: tokio::sync::Notify,
    /// Live sidecar counts pushed by the controller; when set they replace the Redis heartbeat
    /// membership (the controller sees every connected sidecar, including idle ones).
    pub controller_members: arc_swap::ArcSwapOption<std::collections::BTreeMap<String, u32>>,
    /// Smoothed round-trip time of sync batches (ns). Leases are sized to last through the
    /// next interval plus a few round trips, so a slow Redis does not drain hot keys.
    pub sync_rtt: AtomicU64,
    /// The earliest time (clock ns) a window key that Redis found full gets room again (its
    /// window resets, or a sliding window's previous count decays); `u64::MAX`: none. The
    /// sync runs then instead of at the next interval, once, where waking it at every
    /// rejected request cost a call per request.
    pub next_refill: AtomicU64,
}

impl GlobalRuntime {
    /// The runtime of one process: `store` already carries its metrics (`Store::set_metrics`);
    /// no sync has run, no membership was pushed, no refill is due.
    pub fn new(store: Store, settings: LeaseSettings, metrics: GlobalMetrics) -> GlobalRuntime {
        GlobalRuntime {
            store,
            settings,
            metrics,
            wake: tokio::sync::Notify::new(),
            synced: tokio::sync::Notify::new(),
            controller_members: arc_swap::ArcSwapOption::empty(),
            sync_rtt: AtomicU64::new(0),
            next_refill: AtomicU64::new(u64::MAX),
        }
    }
}

/// One key's local allowance.
pub struct Slot {
    field: [u8; 16],
    group: u32,
    tokens: AtomicU64,
    /// Tokens owed to Redis: costs settled at the response beyond what this slot held. The
    /// next round trip for the key takes them first, even into debt.
    debt: AtomicU64,
    spent: AtomicU64,
    target: AtomicU64,
    global_remaining: AtomicU64,
    reset_ms: AtomicU64,
    window: AtomicU64,
    valid_until: AtomicU64,
    last_used: AtomicU64,
    /// When the last sync planned this key (demand is measured since then).
    last_plan: AtomicU64,
    /// Single flight for round trips of this key: one request refills, the others wait for it.
    /// Held across the Redis call on purpose; only requests for a key whose lease ran dry meet it.
    #[allow(
        clippy::disallowed_types,
        reason = "the single flight of a dry key's refill"
    )]
    refill: tokio::sync::Mutex<()>,
    /// A background top-up of this key is in flight. Redis may answer a request's own call for
    /// the key with "empty" because that top-up took the last tokens: they are on their way to
    /// this slot, so the request waits for the sync instead of answering 429.
    topping_up: AtomicBool,
    /// Demand refused here since the last plan (429s decided locally): a saturated key's
    /// admitted count is capped by the bucket and says nothing about how much it wants.
    denied: AtomicU64,
    /// Of the demand (`spent` + `denied`) since the last plan, what a request-path call
    /// already reported to Redis, so the sync reports only the rest.
    reported: AtomicU64,
    /// Demand planned but not yet reported (rounds without a call for the key): it rides
    /// with the next call, so Redis sees all of a sidecar's demand however often it calls.
    unreported: AtomicU64,
    /// Redis granted less than the last call asked for: the bucket, not the timing of syncs,
    /// limits this key, so an early sync would only cost a call.
    saturated: AtomicBool,
    /// Tokens granted ahead of their time (see `Pending`).
    pending: Mutex<Pending>,
    /// When the next pending token becomes spendable (`u64::MAX` when none is pending), so the
    /// hot path looks at the pending tokens only when one is due.
    next_unlock: AtomicU64,
    /// Exact mode: Redis rejected this key; until then its answer stands (see
    /// `try_exact_local`).
    blocked_until: AtomicU64,
    /// A window key Redis found full: when it has room again (0: not waiting).
    refill_at: AtomicU64,
    /// Cost of the requests queued on `refill`: what the next round trip asks for them.
    waiting: AtomicU64,
    /// `blockFor`: until when (clock ns) the key is blocked, by this sidecar or, as a lease
    /// call learned, by another one (0: never blocked).
    block_ends: AtomicU64,
    /// Settlements (debts) sent to Redis and not confirmed yet. A call that carried one and
    /// failed may still have landed (a timeout), so it is sent again with the same id, which
    /// Redis applies once; confirmed ones are removed.
    unsettled: Mutex<Vec<Settlement>>,
}

/// A debt on its way to Redis, under the id Redis applies it once by.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Settlement {
    id: u64,
    force: u64,
    /// When it was first sent (clock ns): it is dropped after `SETTLEMENT_RETRY_FOR`.
    since: Nanos,
}

/// At most this many unconfirmed settlements are kept per key (a new debt is only taken once
/// the earlier ones are confirmed, so more would only come from response-time settlements
/// of a key without a lease failing together).
const MAX_UNSETTLED: usize = 8;

/// Keys per rule that may hold a debt for Redis while it is away (about 200 bytes each).
const MAX_OWING_KEYS: usize = 65_536;

/// A settlement id unique across sidecars: a random per-process base plus a counter.
fn settlement_id() -> u64 {
    static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = *BASE.get_or_init(|| {
        let mut b = [0u8; 8];
        if getrandom::fill(&mut b).is_err() {
            // No system randomness: the process's hash keys are the next best seed.
            use std::hash::BuildHasher;
            return std::collections::hash_map::RandomState::new().hash_one(std::process::id());
        }
        u64::from_le_bytes(b)
    });
    base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed))
        .max(1)
}

/// Tokens a saturated token bucket granted ahead. Each grant is a run of consecutive places of
/// the global schedule: `count` tokens, the last conformant at `ready_at`, one every `step`
/// before it. Runs are kept apart (other sidecars' grants fall between them) and released to
/// the slot at exactly those times, so a reservation never admits a burst the bucket itself
/// would not have, nor holds back a token past its time.
struct Pending {
    runs: std::collections::VecDeque<Run>,
    step: Nanos,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Run {
    count: u64,
    ready_at: Nanos,
}

impl Run {
    fn first_at(&self, step: Nanos) -> Nanos {
        self.ready_at.saturating_sub((self.count - 1) * step)
    }
}

impl Pending {
    fn new(step: Nanos) -> Pending {
        Pending {
            runs: std::collections::VecDeque::new(),
            step,
        }
    }

    fn count(&self) -> u64 {
        self.runs.iter().map(|r| r.count).sum()
    }

    /// When the next token is due (`u64::MAX`: none pending).
    fn next_unlock(&self) -> Nanos {
        self.runs
            .front()
            .map_or(u64::MAX, |r| r.first_at(self.step))
    }

    /// Adds a grant of `count` tokens ahead, the last due at `ready_at`. Redis's schedule
    /// only moves forward, so a grant never starts before an earlier one ends; if the
    /// receive times say otherwise the grant is queued right after the last run, which only
    /// delays tokens.
    fn push(&mut self, count: u64, ready_at: Nanos) {
        let step = self.step;
        match self.runs.back_mut() {
            Some(last) if Run { count, ready_at }.first_at(step) <= last.ready_at => {
                last.count += count;
                last.ready_at = ready_at.max(last.ready_at + count * step);
            }
            _ => self.runs.push_back(Run { count, ready_at }),
        }
    }

    /// Removes and returns the tokens due by `now`.
    fn release(&mut self, now: Nanos) -> u64 {
        let mut due = 0;
        while let Some(run) = self.runs.front_mut() {
            let not_yet = run
                .ready_at
                .saturating_sub(now)
                .div_ceil(self.step)
                .min(run.count);
            due += run.count - not_yet;
            if not_yet > 0 {
                run.count = not_yet;
                break;
            }
            self.runs.pop_front();
        }
        due
    }

    /// Takes up to `n` tokens from the end of the schedule (the latest ones).
    fn take_latest(&mut self, n: u64) -> u64 {
        let mut taken = 0;
        while taken < n {
            let Some(run) = self.runs.back_mut() else {
                break;
            };
            let take = run.count.min(n - taken);
            run.count -= take;
            run.ready_at = run.ready_at.saturating_sub(take * self.step);
            taken += take;
            if run.count == 0 {
                self.runs.pop_back();
            }
        }
        taken
    }

    /// When the `need`-th pending token is due, if that many are pending.
    fn due_at(&self, need: u64) -> Option<Nanos> {
        let mut before = 0;
        for run in &self.runs {
            if before + run.count >= need {
                return Some(run.first_at(self.step) + (need - before - 1) * self.step);
            }
            before += run.count;
        }
        None
    }
}

impl Slot {
    /// Takes in a reply of Redis for this key, received at `now`: the bucket's state, a lease
    /// valid until `valid_until`, and the tokens granted (those granted ahead become pending).
    fn credit(&self, r: &LeaseReply, want: u64, now: Nanos, valid_until: Nanos) {
        if r.blocked_ms > 0 {
            let ends = now.saturating_add(r.blocked_ms.saturating_mul(NANOS_PER_MS));
            self.block_ends.fetch_max(ends, Ordering::AcqRel);
        }
        self.global_remaining.store(r.remaining, Ordering::Relaxed);
        self.reset_ms.store(r.reset_ms, Ordering::Relaxed);
        self.window.store(r.window, Ordering::Relaxed);
        self.valid_until.store(valid_until, Ordering::Release);
        if want > 0 {
            self.saturated.store(r.granted < want, Ordering::Relaxed);
        }
        let mut ahead = 0;
        if r.ready_us > 0 && r.granted > 0 {
            let mut p = self.pending.lock();
            let ready_in = r.ready_us.saturating_mul(1000);
            ahead = ready_in.div_ceil(p.step).min(r.granted);
            if ahead > 0 {
                p.push(ahead, now.saturating_add(ready_in));
                self.next_unlock.store(p.next_unlock(), Ordering::Release);
            }
        }
        self.tokens.fetch_add(r.granted - ahead, Ordering::AcqRel);
    }

    /// Moves pending tokens that are due by `now` into the spendable allowance.
    fn release_due(&self, now: Nanos) -> bool {
        if now < self.next_unlock.load(Ordering::Acquire) {
            return false;
        }
        let mut p = self.pending.lock();
        let due = p.release(now);
        self.next_unlock.store(p.next_unlock(), Ordering::Release);
        drop(p);
        self.tokens.fetch_add(due, Ordering::AcqRel);
        due > 0
    }

    /// Takes up to `n` pending tokens from the end of the schedule (returned to Redis).
    fn take_pending(&self, n: u64) -> u64 {
        if self.next_unlock.load(Ordering::Acquire) == u64::MAX {
            return 0;
        }
        let mut p = self.pending.lock();
        let taken = p.take_latest(n);
        self.next_unlock.store(p.next_unlock(), Ordering::Release);
        taken
    }

    /// When the last token granted ahead becomes spendable (0: none pending).
    fn pending_until(&self) -> Nanos {
        if self.next_unlock.load(Ordering::Acquire) == u64::MAX {
            0
        } else {
            self.pending.lock().runs.back().map_or(0, |r| r.ready_at)
        }
    }

    /// The settlement the next call for this key carries: the oldest one not confirmed yet
    /// (sent again under its id, so a first attempt that landed is not charged twice), else
    /// the debt owed now under a new id. `force` 0: nothing owed. Settlements older than
    /// `SETTLEMENT_RETRY_FOR` are dropped: Redis has forgotten their ids by then.
    fn take_settlement(&self, now: Nanos) -> Settlement {
        let mut unsettled = self.unsettled.lock();
        let retry_for = SETTLEMENT_RETRY_FOR.as_nanos() as Nanos;
        unsettled.retain(|s| {
            let keep = now.saturating_sub(s.since) < retry_for;
            if !keep {
                tracing::warn!(
                    tokens = s.force,
                    "a settlement did not reach Redis in time and is dropped"
                );
            }
            keep
        });
        if let Some(s) = unsettled.first() {
            return *s;
        }
        let owed = self.debt.swap(0, Ordering::AcqRel);
        if owed == 0 {
            return Settlement {
                id: 0,
                force: 0,
                since: now,
            };
        }
        let s = Settlement {
            id: settlement_id(),
            force: owed,
            since: now,
        };
        if unsettled.len() < MAX_UNSETTLED {
            unsettled.push(s);
        }
        s
    }

    /// Redis answered a call that carried settlement `id`: it is applied.
    fn settled(&self, id: u64) {
        if id != 0 {
            self.unsettled.lock().retain(|s| s.id != id);
        }
    }

    /// A settlement of a call that could not be made at all (not sent, so not applied):
    /// owed again as plain debt.
    fn unsent(&self, s: Settlement) {
        if s.force > 0 {
            self.unsettled.lock().retain(|u| u.id != s.id);
            self.debt.fetch_add(s.force, Ordering::AcqRel);
        }
    }

    /// How much longer the key stays blocked at `now`, if it is.
    fn blocked_for(&self, now: Nanos) -> Option<Nanos> {
        let ends = self.block_ends.load(Ordering::Acquire);
        (ends > now).then(|| ends - now)
    }

    fn pending_count(&self) -> u64 {
        if self.next_unlock.load(Ordering::Acquire) == u64::MAX {
            0
        } else {
            self.pending.lock().count()
        }
    }

    /// When `cost` tokens will be spendable, if the pending ones cover it.
    fn ready_for(&self, cost: u64) -> Option<Nanos> {
        if self.next_unlock.load(Ordering::Acquire) == u64::MAX {
            return None;
        }
        let p = self.pending.lock();
        let need = cost
            .saturating_sub(self.tokens.load(Ordering::Acquire))
            .max(1);
        p.due_at(need)
    }
}

/// What a request may do without awaiting anything.
pub enum LocalOutcome {
    Decided(Decision),
    /// Redis is unavailable and the rule fails closed.
    Unavailable,
    /// A round trip is needed (cold key, exhausted lease, strict rule).
    NeedRemote,
}

/// A global rule's leasing state.
pub struct GlobalRule {
    pub rule_id: String,
    /// The compiled limit, divided among the live sidecars for the fallback share.
    limit: CompiledLimit,
    pub policy_id: String,
    algorithm: u8,
    requests: u64,
    period_ms: u64,
    burst: u64,
    /// What `remaining` counts down from: burst for token buckets, requests for windows.
    capacity: u64,
    /// Token buckets: the time one token takes to refill (the GCRA emission interval).
    step: Nanos,
    accuracy: Accuracy,
    pub failure_mode: FailureMode,
    /// `limit.blockFor` (0: none): a key this rule rejects is blocked at every sidecar.
    block_for: Nanos,
    shards: Vec<Mutex<HashMap<[u8; 16], Arc<Slot>>>>,
    live: AtomicU32,
    /// Local limiter at this sidecar's share, used while Redis is unreachable (fail open).
    fallback: ArcSwap<KeyedLimiter>,
    store_config: StoreConfig,
    pub runtime: Arc<GlobalRuntime>,
}

/// The algorithm code the lease script understands, or None if the algorithm cannot be global.
pub fn algorithm_code(a: Algorithm) -> Option<u8> {
    match a {
        Algorithm::TokenBucket => Some(1),
        Algorithm::SlidingWindow => Some(2),
        Algorithm::FixedWindow => Some(3),
        _ => None,
    }
}

impl GlobalRule {
    pub fn new(
        rule: &CompiledRule,
        policy_id: &str,
        runtime: Arc<GlobalRuntime>,
        store_config: StoreConfig,
    ) -> Result<GlobalRule, String> {
        let algorithm = algorithm_code(rule.limit.algorithm)
            .ok_or_else(|| format!("{}: {:?} cannot be global", rule.id, rule.limit.algorithm))?;
        let capacity = rule.capacity();
        let fallback = Arc::new(KeyedLimiter::new(
            share_limit(&rule.limit, 1).map_err(|e| format!("{}: {e}", rule.id))?,
            store_config,
        ));
        Ok(GlobalRule {
            rule_id: rule.id.clone(),
            limit: rule.limit,
            policy_id: policy_id.to_string(),
            algorithm,
            requests: rule.limit.requests,
            period_ms: rule.limit.period_ms,
            burst: rule.limit.burst,
            capacity,
            step: (u128::from(rule.limit.period_ms) * u128::from(NANOS_PER_MS)
                / u128::from(rule.limit.requests.max(1)))
            .clamp(1, u128::from(u64::MAX / 4)) as Nanos,
            accuracy: rule.accuracy,
            failure_mode: rule.failure_mode,
            block_for: rule.limit.block_for_ms.saturating_mul(NANOS_PER_MS),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            live: AtomicU32::new(1),
            fallback: ArcSwap::from(fallback),
            store_config,
            runtime,
        })
    }

    /// Whether `other` enforces the same bucket with the same parameters (state can be kept
    /// across a rule reload).
    pub fn same_bucket(&self, rule: &CompiledRule) -> bool {
        self.rule_id == rule.id
            && algorithm_code(rule.limit.algorithm) == Some(self.algorithm)
            && self.requests == rule.limit.requests
            && self.period_ms == rule.limit.period_ms
            && self.burst == rule.limit.burst
            && self.accuracy == rule.accuracy
            && self.failure_mode == rule.failure_mode
            && self.block_for == rule.limit.block_for_ms.saturating_mul(NANOS_PER_MS)
    }

    /// Live sidecars enforcing this rule's policy (at least 1).
    pub fn live_sidecars(&self) -> u32 {
        self.live.load(Ordering::Relaxed)
    }

    /// Updates the membership count; recomputes the share when it changed.
    pub fn set_live_sidecars(&self, n: u32) {
        let n = n.max(1);
        if self.live.swap(n, Ordering::Relaxed) != n
            && let Ok(q) = share_limit(&self.limit, n)
        {
            self.fallback
                .store(Arc::new(KeyedLimiter::new(q, self.store_config)));
        }
    }

    /// This sidecar's share of the capacity: its fallback allowance while Redis is away.
    pub fn share(&self) -> u64 {
        (self.capacity / u64::from(self.live_sidecars())).max(1)
    }

    /// Whether requests are decided by one atomic Redis call each rather than from leases:
    /// `Strict`, or `Auto` while this sidecar's share is below [`AUTO_MIN_SHARE`] tokens.
    pub fn exact(&self) -> bool {
        tollgate_crd::compiled::decides_exactly(
            self.accuracy,
            self.capacity,
            u64::from(self.live_sidecars()),
        )
    }

    /// The mode this rule runs in now and why, for `/debug/rules` and the metrics.
    pub fn mode(&self) -> (&'static str, String) {
        let live = self.live_sidecars();
        let share = self.capacity as f64 / f64::from(live);
        match (self.accuracy, self.exact()) {
            (Accuracy::Strict, _) => ("exact", "accuracy: Strict".to_string()),
            (Accuracy::Leased, _) => ("leased", "accuracy: Leased".to_string()),
            (Accuracy::Auto, true) => (
                "exact",
                format!(
                    "accuracy: Auto and a share of {share:.1} tokens ({} over {live} sidecars) is below {AUTO_MIN_SHARE}: leases would park tokens other sidecars need",
                    self.capacity
                ),
            ),
            (Accuracy::Auto, false) => (
                "leased",
                format!(
                    "accuracy: Auto and a share of {share:.1} tokens ({} over {live} sidecars) is at least {AUTO_MIN_SHARE}",
                    self.capacity
                ),
            ),
        }
    }

    /// The most this sidecar holds for one key now (spendable and reserved ahead).
    pub fn largest_allowance(&self) -> u64 {
        self.shards
            .iter()
            .flat_map(|s| {
                s.lock()
                    .values()
                    .map(|slot| slot.tokens.load(Ordering::Relaxed) + slot.pending_count())
                    .collect::<Vec<_>>()
            })
            .max()
            .unwrap_or(0)
    }

    /// How far ahead syncs plan: tokens must last until the next sync lands, the interval
    /// plus a few round trips.
    fn horizon(&self) -> Nanos {
        self.runtime.settings.sync_interval.as_nanos() as Nanos
            + 3 * self.runtime.sync_rtt.load(Ordering::Relaxed)
    }

    /// The most one sidecar asks for a key per call. Windows: its share of the window, as
    /// the window's whole limit is available at once. Token buckets: its share of the burst
    /// plus the refill through the horizon, so a sidecar carrying most of a key's traffic
    /// keeps up with the refill in one call per interval, while a burst spread over several
    /// sidecars is not drained by whichever of them planned first (parking tokens where a
    /// third of the requests arrive: false 429s elsewhere). Requests queued together still
    /// take what they need at once.
    fn lease_cap(&self, horizon: Nanos) -> u64 {
        if self.algorithm != 1 {
            return self.share();
        }
        let refill = (u128::from(horizon) / u128::from(self.step)).min(u128::from(u32::MAX));
        self.share().saturating_add(refill as u64).max(1)
    }

    /// Headroom a key asks for beyond what its queued requests need, limited to this
    /// sidecar's part of what Redis last said the bucket held. A burst that hit every sidecar
    /// projects its short, high rate into big targets; taken whole, the first sidecars to ask
    /// drained the bucket and the burst's last requests at another found it empty while they
    /// parked the tokens. Not limited: a saturated key, or a bucket down to less than
    /// `AUTO_MIN_SHARE` tokens per sidecar, which is contested, and what a call gets then is
    /// reserved ahead and split by demand in Redis (a part of a few tokens made every call
    /// of a contested key ask for one token).
    fn part_of_remaining(&self, slot: &Slot, headroom: u64) -> u64 {
        let remaining = slot.global_remaining.load(Ordering::Relaxed);
        let part = remaining / u64::from(self.live_sidecars());
        if self.algorithm != 1
            || remaining == u64::MAX
            || part < AUTO_MIN_SHARE
            || slot.saturated.load(Ordering::Relaxed)
        {
            return headroom;
        }
        headroom.min(part)
    }

    fn ahead_ms(horizon: Nanos) -> u64 {
        horizon.div_ceil(NANOS_PER_MS)
    }

    /// The bucket id all sidecars agree on for a counter key (not secret: it only has to be
    /// stable and collision-free; 128 bits make accidental or crafted collisions impractical).
    pub fn field_for(&self, key: &[u8]) -> ([u8; 16], u32) {
        let mut h = siphasher::sip128::SipHasher13::new_with_keys(0x746f_6c6c_6761_7465, 0);
        h.write(self.rule_id.as_bytes());
        h.write_u8(0xff);
        h.write(key);
        let field = siphasher::sip128::Hasher128::finish128(&h).as_bytes();
        let group = u32::from_le_bytes([field[0], field[1], field[2], field[3]])
            % self.runtime.store.groups;
        (field, group)
    }

    /// The bucket's balance in Redis for a counter key, read without taking anything (a lease
    /// call that wants no token): for `/debug/why?balance=redis`. `remaining` is what the bucket
    /// holds now, `blocked_ms` a `blockFor` block published by any sidecar.
    pub async fn peek_remote(
        &self,
        key: &[u8],
        timeout: Duration,
    ) -> Result<LeaseReply, StoreError> {
        let (field, group) = self.field_for(key);
        self.call(self.op(field, group, 0, 0, 0, true), timeout)
            .await
    }

    /// This pod's lease for a counter key, read without touching it (for `/debug/why`):
    /// the tokens held here and the bucket's balance at Redis's last answer. `None` when this
    /// pod holds no lease for the key.
    pub fn peek_lease(&self, key: &[u8]) -> Option<(u64, u64)> {
        let (field, _) = self.field_for(key);
        self.slot(&field).map(|s| {
            (
                s.tokens.load(Ordering::Acquire),
                s.global_remaining.load(Ordering::Acquire),
            )
        })
    }

    fn shard(&self, field: &[u8; 16]) -> &Mutex<HashMap<[u8; 16], Arc<Slot>>> {
        &self.shards[field[15] as usize % SHARDS]
    }

    fn slot(&self, field: &[u8; 16]) -> Option<Arc<Slot>> {
        self.shard(field).lock().get(field).cloned()
    }

    /// The key's slot, and whether it was created now.
    fn slot_or_insert(&self, field: [u8; 16], group: u32, now: Nanos) -> (Arc<Slot>, bool) {
        let mut shard = self.shard(&field).lock();
        let mut new = false;
        let slot = Arc::clone(shard.entry(field).or_insert_with(|| {
            new = true;
            Arc::new(Slot {
                field,
                group,
                tokens: AtomicU64::new(0),
                debt: AtomicU64::new(0),
                spent: AtomicU64::new(0),
                target: AtomicU64::new(1),
                // Unknown until Redis answers for this key.
                global_remaining: AtomicU64::new(u64::MAX),
                reset_ms: AtomicU64::new(0),
                window: AtomicU64::new(0),
                valid_until: AtomicU64::new(0),
                last_used: AtomicU64::new(now),
                last_plan: AtomicU64::new(now),
                #[allow(
                    clippy::disallowed_types,
                    reason = "the single flight of a dry key's refill"
                )]
                refill: tokio::sync::Mutex::new(()),
                topping_up: AtomicBool::new(false),
                denied: AtomicU64::new(0),
                saturated: AtomicBool::new(false),
                reported: AtomicU64::new(0),
                unreported: AtomicU64::new(0),
                pending: Mutex::new(Pending::new(self.step)),
                next_unlock: AtomicU64::new(u64::MAX),
                blocked_until: AtomicU64::new(0),
                refill_at: AtomicU64::new(0),
                waiting: AtomicU64::new(0),
                block_ends: AtomicU64::new(0),
                unsettled: Mutex::new(Vec::new()),
            })
        }));
        (slot, new)
    }

    /// Credits a reply to `slot` (received at `now`, for a call that asked for `want`). A
    /// window key that got less than it asked for comes back at the time Redis said there is
    /// room (its reset, or a sliding window's decay): `GlobalRuntime::next_refill`. Token
    /// buckets need no such wake-up: they are granted ahead instead.
    fn credit(&self, slot: &Slot, r: &LeaseReply, want: u64, now: Nanos) {
        slot.credit(r, want, now, self.runtime.settings.lease_until(now));
        if self.algorithm != 1 && want > r.granted && r.retry_after_ms > 0 {
            let at = now.saturating_add(r.retry_after_ms.saturating_mul(NANOS_PER_MS));
            slot.refill_at.store(at, Ordering::Relaxed);
            self.runtime.next_refill.fetch_min(at, Ordering::AcqRel);
        }
    }

    /// The hot path: spend from the local lease, or decide by the failure mode while Redis is
    /// known to be down. Never awaits, never touches the network.
    pub fn try_local(&self, field: &[u8; 16], key: &[u8], now: Nanos, cost: u64) -> LocalOutcome {
        if self.exact() {
            return self.try_exact_local(field, key, now, cost);
        }
        let slot = self.slot(field);
        if let Some(slot) = &slot {
            if let Some(wait) = slot.blocked_for(now) {
                return LocalOutcome::Decided(self.blocked_decision(wait));
            }
            if let Some(d) = self.spend(slot, now, cost) {
                return LocalOutcome::Decided(d);
            }
            // Over its limit by Redis's last answer: wait for the next sync rather than ask
            // Redis on every rejected request, which would cost a round trip each and, with
            // Redis slow, time out and leak the tokens the call took. Nor is the sync pulled
            // forward: it reserves through the next interval, so an earlier one only costs.
            if let Some(d) = self.known_exhausted(slot, now, cost) {
                slot.denied.fetch_add(cost, Ordering::Relaxed);
                return LocalOutcome::Decided(d);
            }
        }
        if self.runtime.store.breaker.is_open() {
            return self.degraded(slot.as_deref(), key, now, cost);
        }
        LocalOutcome::NeedRemote
    }

    /// Decision while Redis cannot be asked: the rule's failure mode, except for a key that is
    /// known to be over its limit (below).
    fn degraded(&self, slot: Option<&Slot>, key: &[u8], now: Nanos, cost: u64) -> LocalOutcome {
        if let Some(slot) = slot
            && let Some(d) = self.known_exhausted(slot, now, cost)
        {
            return LocalOutcome::Decided(d);
        }
        match self.failure_mode {
            FailureMode::Closed => LocalOutcome::Unavailable,
            FailureMode::Open => {
                let d = self.fallback.load().check(key, now, cost);
                if d.allowed {
                    self.runtime.metrics.fallback_admitted.inc_by(cost);
                }
                LocalOutcome::Decided(d)
            }
        }
    }

    /// A key whose lease is still valid (Redis answered a sync for it within the lease TTL) but
    /// spent, and whose global bucket Redis last reported empty, is over its limit: it gets a 429
    /// without a round trip, and never the failure mode, which is for requests Redis could not
    /// decide. Without this a slow Redis (request-path calls timing out while background syncs
    /// still succeed) sent every request above the limit to the failure mode: fail-open admitted
    /// them through the fallback on top of the leases (a second limit's worth), fail-closed
    /// answered 503, and each timed-out call lost the tokens it had taken.
    ///
    /// A key with tokens granted ahead (pending) is saturated too: its next tokens are already
    /// reserved here and arrive on their schedule, which gives the exact retry time.
    fn known_exhausted(&self, slot: &Slot, now: Nanos, cost: u64) -> Option<Decision> {
        if slot.valid_until.load(Ordering::Acquire) < now {
            return None;
        }
        let retry = match slot.ready_for(cost) {
            Some(at) => at.saturating_sub(now),
            None if slot.global_remaining.load(Ordering::Relaxed) >= cost => return None,
            // Time for `cost` tokens to refill (token bucket) or for the window to reset; the
            // next sync tops the lease up from whatever Redis holds by then.
            None => match self.algorithm {
                1 => cost.saturating_mul(self.step),
                _ => slot.reset_ms.load(Ordering::Relaxed) * NANOS_PER_MS,
            },
        };
        Some(Decision {
            allowed: false,
            limit: self.capacity,
            remaining: 0,
            reset: slot.reset_ms.load(Ordering::Relaxed) * NANOS_PER_MS,
            retry_after: retry.max(NANOS_PER_MS),
            delay: 0,
        })
    }

    /// Takes `cost` from the slot's allowance if it holds enough and the lease is valid.
    fn spend(&self, slot: &Slot, now: Nanos, cost: u64) -> Option<Decision> {
        if slot.valid_until.load(Ordering::Acquire) < now {
            return None;
        }
        let left = match take_exactly(&slot.tokens, cost) {
            Some(left) => left,
            None if slot.release_due(now) => take_exactly(&slot.tokens, cost)?,
            None => return None,
        };
        slot.spent.fetch_add(cost, Ordering::Relaxed);
        slot.last_used.store(now, Ordering::Relaxed);
        // Low watermark: ask the sync task for a top-up before this key runs dry, unless the
        // key shows no recurring demand (target 1), the bucket is what limits it (an earlier
        // sync would find nothing more) or tokens are already reserved for the interval.
        let target = slot.target.load(Ordering::Relaxed);
        if left * 4 < target
            && target > 1
            && !slot.saturated.load(Ordering::Relaxed)
            && slot.next_unlock.load(Ordering::Relaxed) == u64::MAX
        {
            self.runtime.wake.notify_one();
        }
        Some(Decision {
            allowed: true,
            limit: self.capacity,
            remaining: slot
                .global_remaining
                .load(Ordering::Relaxed)
                .saturating_add(left)
                .min(self.capacity),
            reset: slot.reset_ms.load(Ordering::Relaxed) * NANOS_PER_MS,
            retry_after: 0,
            delay: 0,
        })
    }

    /// Exact mode without a round trip: only a key that Redis rejected, until the time Redis
    /// said its next tokens come back. Nothing refills a bucket earlier but a refund: one
    /// settled through this sidecar clears the refusal once Redis has it (`settle_remote`);
    /// one settled through another sidecar is seen here at the retry time.
    fn try_exact_local(&self, field: &[u8; 16], key: &[u8], now: Nanos, cost: u64) -> LocalOutcome {
        if let Some(slot) = self.slot(field) {
            if let Some(wait) = slot.blocked_for(now) {
                return LocalOutcome::Decided(self.blocked_decision(wait));
            }
            let until = slot.blocked_until.load(Ordering::Acquire);
            if now < until {
                return LocalOutcome::Decided(Decision {
                    allowed: false,
                    limit: self.capacity,
                    remaining: 0,
                    reset: slot.reset_ms.load(Ordering::Relaxed) * NANOS_PER_MS,
                    retry_after: (until - now).max(NANOS_PER_MS),
                    delay: 0,
                });
            }
        }
        if self.runtime.store.breaker.is_open() {
            return self.degraded(None, key, now, cost);
        }
        LocalOutcome::NeedRemote
    }

    /// How long a request waits for its exact-mode call. `accuracy: Strict` waits up to the
    /// sync timeout: a request that stopped waiting sooner went to the fail-open fallback,
    /// which admitted it on top of the bucket while Redis was merely slower than
    /// `--redis-timeout` (the first call of a sidecar after a policy was applied also
    /// connected), one extra admission per sidecar for a new key. While Redis is known to be
    /// down (the breaker is open) no request waits at all.
    fn exact_timeout(&self) -> Duration {
        let settings = &self.runtime.settings;
        match self.accuracy {
            Accuracy::Strict => settings.request_timeout.max(settings.sync_timeout),
            _ => settings.request_timeout,
        }
    }

    /// Exact mode: one all-or-nothing call for this request. A rejection is remembered until
    /// its retry time, so a client far over a small limit costs one call per refill, not one
    /// per request.
    async fn acquire_exact(
        &self,
        field: [u8; 16],
        group: u32,
        key: &[u8],
        now: Nanos,
        cost: u64,
    ) -> LocalOutcome {
        let op = self.op(field, group, cost, 0, 0, true);
        match self.call(op, self.exact_timeout()).await {
            Ok(r) => {
                let allowed = r.granted >= cost;
                if r.blocked_ms > 0 {
                    let (slot, _) = self.slot_or_insert(field, group, now);
                    slot.credit(&r, 0, now, 0);
                    return LocalOutcome::Decided(
                        self.blocked_decision(r.blocked_ms * NANOS_PER_MS),
                    );
                }
                if !allowed && r.retry_after_ms > 0 {
                    let (slot, _) = self.slot_or_insert(field, group, now);
                    slot.reset_ms.store(r.reset_ms, Ordering::Relaxed);
                    slot.blocked_until
                        .store(now + r.retry_after_ms * NANOS_PER_MS, Ordering::Release);
                }
                LocalOutcome::Decided(self.decision_from(&r, allowed))
            }
            Err(_) => self.degraded(None, key, now, cost),
        }
    }

    /// The slow path: one round trip (single flight per key), bounded by the request timeout.
    pub async fn acquire_remote(&self, key: &[u8], now: Nanos, cost: u64) -> LocalOutcome {
        let (field, group) = self.field_for(key);
        let timeout = self.runtime.settings.request_timeout;
        if self.exact() {
            return self.acquire_exact(field, group, key, now, cost).await;
        }
        let (slot, new) = self.slot_or_insert(field, group, now);
        // One budget for waiting on another request's refill and making our own call, so a
        // request never waits longer than the timeout because of Redis.
        let deadline = tokio::time::Instant::now() + timeout;
        // Requests queued on this key's refill ask for exactly what they need together (a
        // burst takes no more than it spends, leaving the rest to other sidecars). A key back
        // for more with no queue, before a sync could measure its demand, doubles its target
        // per call: a new hot key ramps up in a few calls instead of one call per request,
        // while a key seen once stays at one token and one call.
        let queued_before = slot.waiting.fetch_add(cost, Ordering::AcqRel);
        if !new && queued_before == 0 {
            let target = slot.target.load(Ordering::Relaxed);
            let cap = self.lease_cap(self.horizon()).max(2);
            slot.target
                .store(target.saturating_mul(2).clamp(2, cap), Ordering::Relaxed);
        }
        let guard = tokio::time::timeout_at(deadline, slot.refill.lock()).await;
        slot.waiting.fetch_sub(cost, Ordering::AcqRel);
        let Ok(_guard) = guard else {
            return self.degraded(Some(&slot), key, now, cost);
        };
        // The refill we waited for may have brought enough tokens.
        if let Some(d) = self.spend(&slot, now, cost) {
            return LocalOutcome::Decided(d);
        }
        let timeout = deadline.saturating_duration_since(tokio::time::Instant::now());
        if timeout.is_zero() {
            return self.degraded(Some(&slot), key, now, cost);
        }
        let held = slot.tokens.load(Ordering::Acquire) + slot.pending_count();
        let horizon = self.horizon();
        let target = slot
            .target
            .load(Ordering::Relaxed)
            .min(self.lease_cap(horizon));
        let queued = cost + slot.waiting.load(Ordering::Acquire);
        let want = queued
            .saturating_sub(held)
            .max(self.part_of_remaining(&slot, target.saturating_sub(held)));
        let mut op = self.op(field, group, want, 0, 0, false);
        let settlement = slot.take_settlement(now);
        op.force = settlement.force;
        op.settle_id = settlement.id;
        op.ahead_ms = Self::ahead_ms(horizon);
        let seen = slot.spent.load(Ordering::Relaxed) + slot.denied.load(Ordering::Relaxed);
        let fresh = seen.saturating_sub(slot.reported.swap(seen, Ordering::AcqRel));
        self.report_demand(&mut op, fresh + slot.unreported.swap(0, Ordering::AcqRel));
        let started = std::time::Instant::now();
        match self.call_for_slot(&slot, op, now, timeout).await {
            Ok(r) => {
                let now = now.saturating_add(started.elapsed().as_nanos() as Nanos);
                self.credit(&slot, &r, want, now);
                if let Some(wait) = slot.blocked_for(now) {
                    return LocalOutcome::Decided(self.blocked_decision(wait));
                }
                if let Some(d) = self.spend(&slot, now, cost) {
                    return LocalOutcome::Decided(d);
                }
                if self.top_up_landed(&slot, deadline).await
                    && let Some(d) = self.spend(&slot, now, cost)
                {
                    return LocalOutcome::Decided(d);
                }
                slot.denied.fetch_add(cost, Ordering::Relaxed);
                if let Some(d) = self.known_exhausted(&slot, now, cost) {
                    return LocalOutcome::Decided(d);
                }
                LocalOutcome::Decided(self.decision_from(&r, false))
            }
            Err(e) => {
                // Whether a call that was made landed is unknown: its settlement stays
                // unconfirmed and goes again under its id. One never sent is owed again.
                if matches!(e, StoreError::BreakerOpen) {
                    slot.unsent(settlement);
                }
                self.degraded(Some(&slot), key, now, cost)
            }
        }
    }

    /// Settles a cost known only at the response (`delta` more tokens, or fewer when
    /// negative). Leased: from and back into this sidecar's allowance, whatever it cannot
    /// cover owed to Redis with the key's next round trip, so a settlement never costs a call
    /// of its own. Strict: one call, off the request path.
    pub fn settle(self: &Arc<Self>, key: &[u8], now: Nanos, delta: i64) {
        if delta == 0 {
            return;
        }
        if self.runtime.store.breaker.is_open() {
            // Redis is away and the fail-open fallback decides the key's requests: it takes
            // the real cost too. Redis gets it when it is back (below).
            self.fallback.load().settle(key, now, delta);
        }
        let (field, group) = self.field_for(key);
        let slot = if self.exact() {
            None
        } else {
            self.slot(&field)
        };
        let Some(slot) = slot else {
            return self.settle_remote(field, group, now, delta);
        };
        let n = delta.unsigned_abs();
        if delta < 0 {
            // Returned to Redis by the next sync if this sidecar does not need them.
            slot.tokens.fetch_add(n, Ordering::AcqRel);
            return;
        }
        slot.spent.fetch_add(n, Ordering::Relaxed);
        let owed = n - take_up_to(&slot.tokens, n);
        if owed > 0 {
            slot.debt.fetch_add(owed, Ordering::AcqRel);
            self.runtime.wake.notify_one();
        }
    }

    /// A settlement for a key this sidecar holds no lease for (strict rules, or a lease that
    /// went idle): one lease call that forces the charge or gives the refund back.
    fn settle_remote(self: &Arc<Self>, field: [u8; 16], group: u32, now: Nanos, delta: i64) {
        let n = delta.unsigned_abs();
        if delta > 0 && self.runtime.store.breaker.is_open() {
            return self.owe_later(field, group, now, None, n);
        }
        let mut op = self.op(field, group, 0, 0, 0, false);
        let settlement = Settlement {
            id: settlement_id(),
            force: n,
            since: now,
        };
        if delta > 0 {
            op.force = n;
            op.settle_id = settlement.id;
        } else {
            op.give_back = n;
            // Windows only take a refund for the window it was spent in: the current one.
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            op.back_window = now_ms / self.period_ms.max(1);
        }
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let timeout = this.runtime.settings.sync_timeout;
            let result = this.call(op.clone(), timeout).await;
            if result.is_ok() && op.give_back > 0 {
                // A refund put tokens back: a refusal remembered in exact mode no longer
                // stands (see `try_exact_local`); the next request asks Redis again.
                if let Some(slot) = this.slot(&field) {
                    slot.blocked_until.store(0, Ordering::Release);
                }
            }
            if let Err(e) = result {
                tracing::debug!(error = %e, rule = %this.rule_id, "settlement did not reach Redis");
                if op.force > 0 {
                    // Kept with the key and sent again by the sync under the same id (a
                    // timeout may have landed). A refund that fails is dropped: it errs
                    // towards admitting less.
                    let sent = !matches!(e, StoreError::BreakerOpen);
                    this.owe_later(field, group, now, sent.then_some(settlement), op.force);
                }
            }
        });
    }

    /// Keeps a charge Redis could not take (it was away, or the call was never made) with the
    /// key, for the sync to flush when Redis is back: response-time costs settled during an
    /// outage are charged then instead of lost. Bounded: at most [`MAX_OWING_KEYS`] keys per
    /// rule; beyond that a new key's charge is dropped (logged).
    /// `sent`: the settlement went out and may have landed, so it is kept under its id.
    fn owe_later(
        &self,
        field: [u8; 16],
        group: u32,
        now: Nanos,
        sent: Option<Settlement>,
        tokens: u64,
    ) {
        if self.slot(&field).is_none() && self.leased_keys() >= MAX_OWING_KEYS {
            tracing::debug!(rule = %self.rule_id, tokens, "too many keys owe Redis: a settlement is dropped");
            return;
        }
        let (slot, _) = self.slot_or_insert(field, group, now);
        if let Some(s) = sent {
            let mut unsettled = slot.unsettled.lock();
            if unsettled.len() < MAX_UNSETTLED {
                unsettled.push(s);
                return;
            }
        }
        slot.debt.fetch_add(tokens, Ordering::AcqRel);
    }

    /// Whether spending again may succeed: an in-flight top-up of this key has been credited
    /// (waiting for it until `deadline`), or none is in flight any more (one may have landed
    /// on another worker since the caller last looked). Only a request that already made a
    /// round trip and found Redis empty gets here, so the hot path never waits on a sync.
    async fn top_up_landed(&self, slot: &Slot, deadline: tokio::time::Instant) -> bool {
        let synced = self.runtime.synced.notified();
        tokio::pin!(synced);
        // Registered before the flag is read, so a round finishing in between is not missed.
        synced.as_mut().enable();
        if !slot.topping_up.load(Ordering::Acquire) {
            return true;
        }
        tokio::time::timeout_at(deadline, synced).await.is_ok()
    }

    fn op(
        &self,
        field: [u8; 16],
        group: u32,
        want: u64,
        give_back: u64,
        back_window: u64,
        all_or_nothing: bool,
    ) -> LeaseOp {
        LeaseOp {
            group,
            field,
            algorithm: self.algorithm,
            requests: self.requests,
            period_ms: self.period_ms,
            burst: self.burst,
            want,
            give_back,
            back_window,
            all_or_nothing,
            force: 0,
            ahead_ms: 0,
            demand: 0,
            share_ms: 0,
            block_ms: self.block_for / NANOS_PER_MS,
            settle_id: 0,
        }
    }

    /// A lease call for a slot that outlives the request waiting for it: the request waits at
    /// most `timeout`, the call may take up to the sync timeout, and a reply that lands after
    /// the request gave up is credited to the slot (spent by later requests, or returned at the
    /// next sync). Otherwise every timed-out call lost the tokens Redis had already taken for
    /// it, so a slow Redis made the limit under-admit.
    async fn call_for_slot(
        &self,
        slot: &Arc<Slot>,
        op: LeaseOp,
        now: Nanos,
        timeout: Duration,
    ) -> Result<LeaseReply, StoreError> {
        let runtime = &self.runtime;
        if !runtime.store.breaker.allow() {
            return Err(StoreError::BreakerOpen);
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let call = {
            let runtime = Arc::clone(runtime);
            let slot = Arc::clone(slot);
            let budget = runtime.settings.sync_timeout.max(timeout);
            async move {
                let started = std::time::Instant::now();
                let result = lease_one(&runtime, &op, budget).await;
                if result.is_ok() {
                    slot.settled(op.settle_id);
                }
                // The request stopped waiting: keep what Redis granted.
                if let Err(Ok(r)) = tx.send(result) {
                    let now = now.saturating_add(started.elapsed().as_nanos() as Nanos);
                    slot.credit(&r, op.want, now, runtime.settings.lease_until(now));
                    runtime.metrics.tokens_late.inc_by(r.granted);
                }
            }
        };
        tokio::spawn(call);
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(result)) => {
                if let Err(e) = &result {
                    runtime.metrics.redis_error(e.kind());
                }
                result
            }
            Ok(Err(_)) => Err(StoreError::BadReply("lease call dropped".into())),
            Err(_) => {
                // Counted as a failure now, as if the call had been cut off: a Redis too slow
                // for requests opens the breaker; the late reply closes it again.
                runtime.store.breaker.failure();
                runtime.metrics.redis_error("timeout");
                Err(StoreError::Timeout(timeout))
            }
        }
    }

    async fn call(&self, op: LeaseOp, timeout: Duration) -> Result<LeaseReply, StoreError> {
        let runtime = &self.runtime;
        if !runtime.store.breaker.allow() {
            return Err(StoreError::BreakerOpen);
        }
        let result = lease_one(runtime, &op, timeout).await;
        if let Err(e) = &result {
            runtime.metrics.redis_error(e.kind());
        }
        result
    }

    /// The 429 for a key serving its `blockFor`.
    fn blocked_decision(&self, wait: Nanos) -> Decision {
        Decision {
            allowed: false,
            limit: self.capacity,
            remaining: 0,
            reset: wait,
            retry_after: wait.max(NANOS_PER_MS),
            delay: 0,
        }
    }

    /// Blocks a key this rule rejected for `blockFor`, at every sidecar: kept with the key's
    /// lease here, and published to Redis once per block (not per request), where every
    /// sidecar's next lease call for the key finds it. A key blocked elsewhere and holding no
    /// lease here therefore costs one lookup. Returns how long the key stays blocked; requests
    /// during a block do not extend it.
    pub fn block(&self, key: &[u8], now: Nanos) -> Nanos {
        if self.block_for == 0 {
            return 0;
        }
        let (field, group) = self.field_for(key);
        let (slot, _) = self.slot_or_insert(field, group, now);
        let ends = slot.block_ends.load(Ordering::Acquire);
        if ends > now {
            return ends - now;
        }
        let until = now.saturating_add(self.block_for);
        if slot
            .block_ends
            .compare_exchange(ends, until, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // Another request blocked it (and publishes the block) meanwhile.
            return slot.blocked_for(now).unwrap_or(self.block_for);
        }
        let runtime = Arc::clone(&self.runtime);
        let block_ms = self.block_for / NANOS_PER_MS;
        tokio::spawn(async move {
            let timeout = runtime.settings.sync_timeout;
            if let Err(e) = runtime
                .store
                .publish_block(group, &field, block_ms, timeout)
                .await
            {
                runtime.metrics.redis_error(e.kind());
                tracing::debug!(error = %e, "block did not reach Redis: it holds at this sidecar only");
            }
        });
        self.block_for
    }

    fn decision_from(&self, r: &LeaseReply, allowed: bool) -> Decision {
        Decision {
            allowed,
            limit: self.capacity,
            remaining: r.remaining.min(self.capacity),
            reset: r.reset_ms * NANOS_PER_MS,
            retry_after: if allowed {
                0
            } else {
                r.retry_after_ms.max(1) * NANOS_PER_MS
            },
            delay: 0,
        }
    }

    /// Plans this rule's part of a sync round: returns and top-ups per key, and drops keys that
    /// went idle (returning their tokens).
    pub fn plan_sync(&self, now: Nanos, plan: &mut Vec<(Arc<Slot>, LeaseOp)>) {
        if self.exact() {
            return self.plan_exact(now, plan);
        }
        let horizon = self.horizon();
        let round = RoundPlan {
            now,
            horizon,
            cap: self.lease_cap(horizon),
            saturated_cap: self.lease_cap(2 * horizon),
            idle_after: 2 * self.runtime.settings.sync_interval.as_nanos() as Nanos,
        };
        for shard in &self.shards {
            shard
                .lock()
                .retain(|_, slot| self.plan_slot(slot, &round, plan));
        }
    }

    /// A sync round in exact mode: leases held from before the switch (membership grew past
    /// the Auto threshold) go back, and keys whose rejection has expired are dropped.
    fn plan_exact(&self, now: Nanos, plan: &mut Vec<(Arc<Slot>, LeaseOp)>) {
        for shard in &self.shards {
            shard.lock().retain(|_, slot| {
                let give = slot.tokens.swap(0, Ordering::AcqRel) + slot.take_pending(u64::MAX);
                let settlement = slot.take_settlement(now);
                if give > 0 || settlement.force > 0 {
                    let window = slot.window.load(Ordering::Relaxed);
                    let mut op = self.op(slot.field, slot.group, 0, give, window, false);
                    op.force = settlement.force;
                    op.settle_id = settlement.id;
                    plan.push((Arc::clone(slot), op));
                }
                now < slot.blocked_until.load(Ordering::Acquire)
                    || slot.blocked_for(now).is_some()
                    || settlement.force > 0
            });
        }
    }

    /// One key's part of a sync round; false drops the key (idle, nothing held or owed).
    fn plan_slot(
        &self,
        slot: &Arc<Slot>,
        round: &RoundPlan,
        plan: &mut Vec<(Arc<Slot>, LeaseOp)>,
    ) -> bool {
        let (target, demand) = self.plan_target(slot, round);
        let demand = demand.saturating_sub(slot.reported.swap(0, Ordering::AcqRel));
        slot.unreported.fetch_add(demand, Ordering::AcqRel);
        let idle = target == 0;
        slot.target.store(target.max(1), Ordering::Relaxed);
        let settlement = slot.take_settlement(round.now);
        let owed = settlement.force;
        let planned = plan.len();
        let held = slot.tokens.load(Ordering::Acquire) + slot.pending_count();
        // A shrinking target returns its excess only once that is worth a call of its own:
        // otherwise a key cooling down paid one return per round, halving its way to zero.
        let worth_returning = idle || (held > 2 * target && held - target >= MIN_RETURN);
        // A target of 1 (no recurring demand) is never topped up: a key seen once costs one
        // call.
        // A window key Redis found full asks again once its refill time has come.
        let refill_at = slot.refill_at.load(Ordering::Relaxed);
        let refilled = refill_at != 0 && refill_at <= round.now && held < target;
        if refilled {
            slot.refill_at.store(0, Ordering::Relaxed);
        } else if refill_at > round.now {
            // Still waiting: keep the sync's wake-up (the round cleared it).
            self.runtime
                .next_refill
                .fetch_min(refill_at, Ordering::AcqRel);
        }
        // A saturated key whose reservations reach past the next round skips this one: the
        // schedule up to there is taken, so a call now would only get tokens after it, which
        // the next round's call gets as well (Redis splits the refill by the demand reported,
        // not by how often a sidecar asks).
        let reserved_past_next = slot.saturated.load(Ordering::Relaxed)
            && slot.pending_until() > round.now + round.horizon;
        // Below two thirds of the target a key holds less than a horizon's demand (the target
        // has half again as headroom): top up now. At one half, a hot key on a slow Redis (a
        // horizon of the interval plus three 50 ms round trips) held more than that at the
        // start of a round, skipped it, and ran dry before the next one.
        let low = held * 3 < target * 2;
        let top_up = target > 1 && (low || refilled) && !reserved_past_next;
        if held > target && worth_returning {
            // Spendable tokens first, then the latest pending ones (the end of the schedule).
            let excess = held - target;
            let mut give = take_up_to(&slot.tokens, excess);
            give += slot.take_pending(excess - give);
            if give > 0 {
                let window = slot.window.load(Ordering::Relaxed);
                let op = self.op(slot.field, slot.group, 0, give, window, false);
                plan.push((Arc::clone(slot), op));
            }
        } else if top_up {
            slot.topping_up.store(true, Ordering::Release);
            let want = self.part_of_remaining(slot, target - held);
            let mut op = self.op(slot.field, slot.group, want, 0, 0, false);
            op.ahead_ms = Self::ahead_ms(round.horizon_for(slot));
            self.report_demand(&mut op, slot.unreported.swap(0, Ordering::AcqRel));
            plan.push((Arc::clone(slot), op));
        }
        if owed > 0 {
            // The debt rides with this round's call for the key, or one of its own.
            if plan.len() == planned {
                let op = self.op(slot.field, slot.group, 0, 0, 0, false);
                plan.push((Arc::clone(slot), op));
            }
            if let Some((_, op)) = plan.last_mut() {
                op.force = owed;
                op.settle_id = settlement.id;
            }
        }
        !idle
            || slot.tokens.load(Ordering::Acquire) > 0
            || slot.pending_count() > 0
            || owed > 0
            || slot.blocked_for(round.now).is_some()
    }

    /// What a key should hold through the next horizon (0: idle; 1: no recurring demand, so
    /// no top-up). Demand (admitted and refused here since the last plan) is projected over
    /// the horizon with half again as headroom. A single request is not projected, and the
    /// span measured is at least a quarter of the horizon: a new key's first request a few
    /// milliseconds before a sync is no rate, and extrapolating it leased dozens of tokens to
    /// every key seen once. A target shrinks at most by half per round so a short lull does
    /// not empty a hot key; never more than `lease_cap`.
    /// Returns the target and the demand it was planned from.
    fn plan_target(&self, slot: &Slot, round: &RoundPlan) -> (u64, u64) {
        let demand = slot.spent.swap(0, Ordering::AcqRel) + slot.denied.swap(0, Ordering::AcqRel);
        let since = round
            .now
            .saturating_sub(slot.last_plan.swap(round.now, Ordering::AcqRel));
        let previous = slot.target.load(Ordering::Relaxed);
        if demand == 0 {
            let unused_for = round
                .now
                .saturating_sub(slot.last_used.load(Ordering::Relaxed));
            let target = if unused_for > round.idle_after {
                0
            } else {
                (previous / 2).max(1)
            };
            return (target, 0);
        }
        let horizon = round.horizon_for(slot);
        let span = since.max(round.horizon / 4).max(1);
        // One request is no rate; two or more are projected in full (a hot key within its
        // quota must not run dry before the top-up lands, least of all when Redis is slow).
        let counted = if demand > 1 { demand } else { 0 };
        let projected = (u128::from(counted) * u128::from(horizon) / u128::from(span))
            .min(u128::from(u64::MAX)) as u64;
        let target = (projected + projected / 2 + 1)
            .max(previous / 2)
            .min(if horizon > round.horizon {
                round.saturated_cap
            } else {
                round.cap
            })
            .max(1);
        (target, demand)
    }

    /// Token buckets report the key's demand with a call, so that Redis splits a contested
    /// bucket's refill between sidecars by demand (see lease.lua).
    fn report_demand(&self, op: &mut LeaseOp, demand: u64) {
        if self.algorithm == 1 {
            op.demand = demand;
            op.share_ms = self.runtime.settings.sync_interval.as_millis() as u64;
        }
    }

    /// Applies a sync reply (or failure) to the slot it was planned for.
    /// The caller signals `GlobalRuntime::synced` once the whole round is applied.
    pub fn finish_sync(&self, slot: &Slot, op: &LeaseOp, reply: Option<&LeaseReply>, now: Nanos) {
        match reply {
            Some(r) => {
                slot.settled(op.settle_id);
                self.credit(slot, r, op.want, now);
            }
            // The return did not reach Redis: keep the tokens (they were taken legitimately).
            // A settlement it carried stays unconfirmed: the next call sends it again under
            // its id, and Redis applies it once whether or not this one landed.
            None => {
                slot.tokens.fetch_add(op.give_back, Ordering::AcqRel);
            }
        }
        slot.topping_up.store(false, Ordering::Release);
    }

    /// Extends the validity of every held lease after a successful round trip proved Redis
    /// reachable.
    pub fn refresh_validity(&self, now: Nanos) {
        let until = self.runtime.settings.lease_until(now);
        for shard in &self.shards {
            for slot in shard.lock().values() {
                slot.valid_until.store(until, Ordering::Release);
            }
        }
    }

    /// Keys with a lease held here.
    pub fn leased_keys(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Tokens held locally across keys (returned on shutdown).
    pub fn drain_ops(&self) -> Vec<LeaseOp> {
        let mut ops = Vec::new();
        for shard in &self.shards {
            for slot in shard.lock().values() {
                let give = slot.tokens.swap(0, Ordering::AcqRel) + slot.take_pending(u64::MAX);
                if give > 0 {
                    ops.push(self.op(
                        slot.field,
                        slot.group,
                        0,
                        give,
                        slot.window.load(Ordering::Relaxed),
                        false,
                    ));
                }
            }
        }
        ops
    }
}

/// One request-path lease call and its metrics (latency, calls, tokens leased); errors are
/// counted by the caller, which knows whether anyone waited for the answer.
async fn lease_one(
    runtime: &GlobalRuntime,
    op: &LeaseOp,
    timeout: Duration,
) -> Result<LeaseReply, StoreError> {
    let started = std::time::Instant::now();
    let result = runtime
        .store
        .lease_batch(std::slice::from_ref(op), timeout)
        .await
        .and_then(|mut replies| {
            replies
                .pop()
                .ok_or_else(|| StoreError::BadReply("empty".into()))
        });
    let m = &runtime.metrics;
    m.lease_seconds.observe(started.elapsed().as_secs_f64());
    m.lease_calls.inc();
    if let Ok(r) = &result {
        m.tokens_leased.inc_by(r.granted);
    }
    result
}

/// The parameters of one sync round, the same for every key of a rule.
struct RoundPlan {
    now: Nanos,
    horizon: Nanos,
    cap: u64,
    saturated_cap: u64,
    idle_after: Nanos,
}

impl RoundPlan {
    /// How far ahead a key plans. A saturated key plans two horizons: its tokens come from
    /// Redis reserved ahead at the refill rate whatever it asks, so a longer plan costs
    /// nothing in accuracy, and a sidecar with a small part of the key's traffic then tops
    /// up every other round instead of every round.
    fn horizon_for(&self, slot: &Slot) -> Nanos {
        if slot.saturated.load(Ordering::Relaxed) {
            2 * self.horizon
        } else {
            self.horizon
        }
    }
}

/// Atomically takes exactly `n` from `a` if it holds that many; returns what is left.
fn take_exactly(a: &AtomicU64, n: u64) -> Option<u64> {
    let mut cur = a.load(Ordering::Acquire);
    loop {
        if cur < n {
            return None;
        }
        match a.compare_exchange_weak(cur, cur - n, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(cur - n),
            Err(actual) => cur = actual,
        }
    }
}

/// Atomically takes up to `n` from `a`; returns how much was taken.
fn take_up_to(a: &AtomicU64, n: u64) -> u64 {
    let mut cur = a.load(Ordering::Acquire);
    loop {
        let take = cur.min(n);
        match a.compare_exchange_weak(cur, cur - take, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return take,
            Err(actual) => cur = actual,
        }
    }
}

/// The local fallback limit: the rule's limit divided among `n` sidecars.
fn share_limit(limit: &CompiledLimit, n: u32) -> Result<Limit, tollgate_limiter::LimitError> {
    let mut limit = *limit;
    let n = u64::from(n.max(1));
    limit.requests = (limit.requests / n).max(1);
    limit.burst = (limit.burst / n).max(1);
    crate::limit::for_limiter(&limit)
}

#[cfg(test)]
mod tests {
    use super::Pending;

    #[test]
    fn pending_tokens_are_released_at_their_places_in_the_schedule() {
        // One token per 10 ns; a grant of 3 ending at 100 (due 80, 90, 100), another sidecar's
        // grant in between, then ours of 2 ending at 150 (due 140, 150).
        let mut p = Pending::new(10);
        p.push(3, 100);
        p.push(2, 150);
        assert_eq!((p.count(), p.next_unlock()), (5, 80));
        assert_eq!(p.release(79), 0);
        assert_eq!(p.release(90), 2);
        assert_eq!(p.due_at(1), Some(100));
        assert_eq!(p.due_at(2), Some(140), "the second run keeps its own times");
        assert_eq!(p.due_at(4), None);
        assert_eq!(p.release(139), 1);
        assert_eq!(p.next_unlock(), 140);
        // Returning the latest token moves the run's end back one place.
        assert_eq!(p.take_latest(1), 1);
        assert_eq!((p.count(), p.next_unlock()), (1, 140));
        assert_eq!(p.release(1_000), 1);
        assert_eq!(p.next_unlock(), u64::MAX);
        assert_eq!(p.take_latest(5), 0);
    }

    #[test]
    fn overlapping_grants_merge_without_releasing_early() {
        let mut p = Pending::new(10);
        p.push(3, 100);
        // Starts (at 90) before the last run ends: queued after it, nothing released early.
        p.push(2, 100);
        assert_eq!((p.count(), p.next_unlock()), (5, 80));
        assert_eq!(p.runs.len(), 1);
        assert_eq!(p.release(119), 4);
        assert_eq!(p.release(120), 1);
    }
}
