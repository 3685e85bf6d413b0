//! [`KeyedLimiter`]: one per rule, shared via `Arc` by every request task.

use std::fmt;
use std::sync::Arc;

use crate::algorithms::{
    ConcurrencyLimit, FixedWindow, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket,
};
use crate::store::{KeyHash, Slot, Store};
use crate::{
    Algorithm, Decision, Limit, LimitError, Nanos, Params, SLIDING_LOG_MAX_BYTES, StoreConfig,
};

enum Inner {
    TokenBucket(Store<TokenBucket>),
    SlidingWindow(Store<SlidingWindow>),
    FixedWindow(Store<FixedWindow>),
    SlidingLog(Store<SlidingLog>),
    LeakyBucket(Store<LeakyBucket>),
    // Behind an Arc so permits can outlive the borrow and give units back on drop.
    Concurrency(Arc<Store<ConcurrencyLimit>>),
}

/// Decides one rule's limit per key. `Send + Sync`; share it with `Arc`.
///
/// Keys are arbitrary bytes (e.g. `b"ip:203.0.113.7"`); use an empty key for a rule-wide
/// limit. See [`StoreConfig`] for the memory bound and what happens at the cap.
pub struct KeyedLimiter {
    inner: Inner,
}

impl KeyedLimiter {
    /// A limiter for `limit`. A limit that fails [`Limit::validate`] (only possible when built
    /// by hand) is normalised instead (see [`Limit::normalized`]); use
    /// [`try_new`](Self::try_new) to get the error.
    ///
    /// For [`Algorithm::SlidingLog`], `max_keys` is further capped so that all logs together
    /// stay within [`SLIDING_LOG_MAX_BYTES`] (8 bytes per unit of `requests` per key).
    pub fn new(limit: Limit, cfg: StoreConfig) -> Self {
        let params = Params::new(&limit);
        let inner = match limit.algorithm {
            Algorithm::TokenBucket => Inner::TokenBucket(Store::new(params, &cfg)),
            Algorithm::SlidingWindow => Inner::SlidingWindow(Store::new(params, &cfg)),
            Algorithm::FixedWindow => Inner::FixedWindow(Store::new(params, &cfg)),
            Algorithm::SlidingLog => {
                // Bound the logs' total memory, not just the number of keys.
                let per_key = params.limit().requests.saturating_mul(8).max(1);
                let fit = usize::try_from(SLIDING_LOG_MAX_BYTES / per_key).unwrap_or(usize::MAX);
                let cfg = StoreConfig {
                    max_keys: cfg.max_keys.min(fit.max(1)),
                    ..cfg
                };
                Inner::SlidingLog(Store::new(params, &cfg))
            }
            Algorithm::LeakyBucket => Inner::LeakyBucket(Store::new(params, &cfg)),
            Algorithm::Concurrency => Inner::Concurrency(Arc::new(Store::new(params, &cfg))),
        };
        Self { inner }
    }

    /// Like [`new`](Self::new) but refuses an invalid limit.
    pub fn try_new(limit: Limit, cfg: StoreConfig) -> Result<Self, LimitError> {
        limit.validate()?;
        Ok(Self::new(limit, cfg))
    }

    /// The (normalised) limit being enforced.
    pub fn limit(&self) -> &Limit {
        self.params().limit()
    }

    /// The precomputed limit.
    pub fn params(&self) -> &Params {
        self.stats().params()
    }

    /// Charges `cost` units for `key` at `now` (rate algorithms).
    ///
    /// For [`Algorithm::Concurrency`] this only reports whether `cost` more units would fit
    /// right now (acquire + immediate release) and changes nothing; use
    /// [`acquire_permit`](Self::acquire_permit) to hold units.
    #[inline]
    pub fn check(&self, key: &[u8], now: Nanos, cost: u64) -> Decision {
        match &self.inner {
            Inner::TokenBucket(s) => s.decide(key, now, cost),
            Inner::SlidingWindow(s) => s.decide(key, now, cost),
            Inner::FixedWindow(s) => s.decide(key, now, cost),
            Inner::SlidingLog(s) => s.decide(key, now, cost),
            Inner::LeakyBucket(s) => s.decide(key, now, cost),
            Inner::Concurrency(s) => s.peek(s.hash(key), |st, p| st.peek(p, cost)),
        }
    }

    /// The decision a request of `cost` would get at `now`, from the key's state (or a new
    /// key's full limit), without charging, creating or refreshing anything: for `why` views
    /// that must say "admitted", "delayed" or "rejected" and be right.
    pub fn preview(&self, key: &[u8], now: Nanos, cost: u64) -> Decision {
        fn query<S: crate::LimiterState + Clone>(
            s: &Store<S>,
            key: &[u8],
            now: Nanos,
            cost: u64,
        ) -> Decision {
            s.peek(s.hash(key), |st, p| st.clone().acquire_with(p, now, cost))
        }
        match &self.inner {
            Inner::TokenBucket(s) => query(s, key, now, cost),
            Inner::SlidingWindow(s) => query(s, key, now, cost),
            Inner::FixedWindow(s) => query(s, key, now, cost),
            Inner::SlidingLog(s) => query(s, key, now, cost),
            Inner::LeakyBucket(s) => query(s, key, now, cost),
            Inner::Concurrency(s) => s.peek(s.hash(key), |st, p| st.peek(p, cost)),
        }
    }

    /// The key's state at `now` as a zero-cost decision (`remaining`, `reset`), without
    /// charging, creating or refreshing anything: for debugging views. `None` when the key has
    /// no stored state (never seen, or evicted while idle): its next request sees the full
    /// limit. For [`Algorithm::Concurrency`], `remaining` is the cap less what is in flight.
    pub fn peek(&self, key: &[u8], now: Nanos) -> Option<Decision> {
        fn query<S: crate::LimiterState + Clone>(
            s: &Store<S>,
            key: &[u8],
            now: Nanos,
        ) -> Option<Decision> {
            // A copy decides, so the stored state is untouched (cost 0 is a query).
            s.peek_entry(s.hash(key), |st, p| st.clone().acquire_with(p, now, 0))
        }
        match &self.inner {
            Inner::TokenBucket(s) => query(s, key, now),
            Inner::SlidingWindow(s) => query(s, key, now),
            Inner::FixedWindow(s) => query(s, key, now),
            Inner::SlidingLog(s) => query(s, key, now),
            Inner::LeakyBucket(s) => query(s, key, now),
            Inner::Concurrency(s) => s.peek_entry(s.hash(key), |st, p| st.peek(p, 0)),
        }
    }

    /// Settles a charge whose size was known only after the decision (see
    /// [`LimiterState::settle`](crate::LimiterState::settle)): `delta` more units taken
    /// (possibly into debt), or given back when negative.
    pub fn settle(&self, key: &[u8], now: Nanos, delta: i64) {
        use crate::LimiterState as _;
        if delta == 0 {
            return;
        }
        match &self.inner {
            Inner::TokenBucket(s) => {
                s.with_state(s.hash(key), now, |st, p, _| st.settle(p, now, delta))
            }
            Inner::SlidingWindow(s) => {
                s.with_state(s.hash(key), now, |st, p, _| st.settle(p, now, delta))
            }
            Inner::FixedWindow(s) => {
                s.with_state(s.hash(key), now, |st, p, _| st.settle(p, now, delta))
            }
            Inner::SlidingLog(_) | Inner::LeakyBucket(_) | Inner::Concurrency(_) => {}
        }
    }

    /// Concurrency: takes `cost` in-flight units for `key`, held until the returned
    /// [`Permit`] is dropped (tie it to response completion or client disconnect). On
    /// rejection returns the decision for the 429.
    ///
    /// For rate algorithms this is [`check`](Self::check), with a permit that holds nothing,
    /// so callers can treat every rule alike.
    pub fn acquire_permit(&self, key: &[u8], now: Nanos, cost: u64) -> Result<Permit, Decision> {
        let Inner::Concurrency(store) = &self.inner else {
            let d = self.check(key, now, cost);
            return if d.allowed {
                Ok(Permit {
                    decision: d,
                    hold: None,
                })
            } else {
                Err(d)
            };
        };
        let key = store.hash(key);
        let (d, slot) = store.with_state(key, now, |st, p, slot| {
            (crate::LimiterState::acquire_with(st, p, now, cost), slot)
        });
        if !d.allowed {
            return Err(d);
        }
        let hold = (cost > 0).then(|| Hold {
            store: Arc::clone(store),
            key,
            slot,
            cost,
        });
        Ok(Permit { decision: d, hold })
    }

    /// Number of keys currently stored (locks each shard briefly; for metrics).
    pub fn len(&self) -> usize {
        self.stats().len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The hard cap on stored keys actually in force (`max_keys` rounded down to a multiple of
    /// the shard count).
    pub fn capacity(&self) -> usize {
        self.stats().capacity()
    }

    /// Number of shards in force.
    pub fn shards(&self) -> usize {
        self.stats().shard_count()
    }

    /// Removes entries that are idle at `now` (see [`StoreConfig::idle_ttl`]); returns how
    /// many. Call periodically from a background task; it locks one shard at a time.
    pub fn evict_idle(&self, now: Nanos) -> usize {
        self.stats().evict_idle(now)
    }

    /// How many decisions were made against a shard's shared overflow state because the store
    /// was full (a monotonically increasing counter worth exporting and alerting on; locks
    /// each shard briefly to sum the per-shard counts).
    pub fn overflow_decisions(&self) -> u64 {
        self.stats().overflow_decisions()
    }

    /// Bytes allocated by the shard tables (fixed-size entries and control bytes). The sliding
    /// log's timestamp buffers are extra (≤ 8 × `requests` per key).
    pub fn table_bytes(&self) -> usize {
        self.stats().table_bytes()
    }

    fn stats(&self) -> &dyn StoreStats {
        match &self.inner {
            Inner::TokenBucket(s) => s,
            Inner::SlidingWindow(s) => s,
            Inner::FixedWindow(s) => s,
            Inner::SlidingLog(s) => s,
            Inner::LeakyBucket(s) => s,
            Inner::Concurrency(s) => &**s,
        }
    }
}

/// Object-safe view of a store's bookkeeping, to avoid matching on every algorithm.
trait StoreStats {
    fn params(&self) -> &Params;
    fn evict_idle(&self, now: Nanos) -> usize;
    fn len(&self) -> usize;
    fn capacity(&self) -> usize;
    fn shard_count(&self) -> usize;
    fn overflow_decisions(&self) -> u64;
    fn table_bytes(&self) -> usize;
}

impl<S: crate::LimiterState> StoreStats for Store<S> {
    fn params(&self) -> &Params {
        Store::params(self)
    }
    fn evict_idle(&self, now: Nanos) -> usize {
        Store::evict_idle(self, now)
    }
    fn len(&self) -> usize {
        Store::len(self)
    }
    fn capacity(&self) -> usize {
        Store::capacity(self)
    }
    fn shard_count(&self) -> usize {
        Store::shard_count(self)
    }
    fn overflow_decisions(&self) -> u64 {
        Store::overflow_decisions(self)
    }
    fn table_bytes(&self) -> usize {
        Store::table_bytes(self)
    }
}

impl fmt::Debug for KeyedLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedLimiter")
            .field("limit", self.limit())
            .field("shards", &self.shards())
            .field("capacity", &self.capacity())
            .finish_non_exhaustive()
    }
}

struct Hold {
    store: Arc<Store<ConcurrencyLimit>>,
    key: KeyHash,
    slot: Slot,
    cost: u64,
}

/// Held in-flight units of a concurrency limit; released when dropped. `Send + 'static`, so
/// it can move into the task that streams the response.
#[must_use = "dropping the permit releases the units immediately"]
pub struct Permit {
    decision: Decision,
    hold: Option<Hold>,
}

impl Permit {
    /// The admission decision (for `RateLimit-*` headers on the successful response).
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// Units this permit holds (0 for rate algorithms).
    pub fn held(&self) -> u64 {
        self.hold.as_ref().map_or(0, |h| h.cost)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(h) = self.hold.take() {
            h.store.release(h.key, h.slot, h.cost);
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("decision", &self.decision)
            .field("held", &self.held())
            .finish()
    }
}
