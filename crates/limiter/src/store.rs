//! The keyed, sharded, memory-bounded map from key bytes to single-key states.
//!
//! Design (why):
//! * Keys are reduced to a 64-bit SipHash-1-3 of their bytes under random per-store keys, and
//!   the map stores only that hash: no per-key allocation and a fixed-size entry. SipHash is a
//!   keyed PRF, so an attacker cannot predict hashes (hash-flooding resistance) and making
//!   their key share a victim's state means hitting one 64-bit value blindly: ~2^63 requests.
//!   Accidental sharing among the ≤ `max_keys` live keys has probability ≤ n²/2^65 (3·10⁻⁸
//!   at 1 M keys). A 128-bit output would make both smaller still but costs three more SipHash
//!   rounds, about 6 ns per decision on the test VM (a quarter of the keyed decision).
//! * Hash bits 32.. pick one of N power-of-two shards, each a small spin lock (see `lock.rs`
//!   for why not `parking_lot`) around a `hashbrown::HashTable` keyed by the same hash (its
//!   bucket index uses the low bits and its tag the top 7, both independent of the shard
//!   bits; no re-hashing, no global lock). Shards are cache-line padded so two cores on
//!   different shards do not false-share.
//! * Memory is bounded by a hard cap per shard (`max_keys / shards`). An entry is evictable
//!   once its state is indistinguishable from a new key's (bucket full, windows empty,
//!   nothing in flight), plus an optional grace `idle_ttl`; evicting then loses nothing.
//! * At the cap, a new key first triggers a scan of its shard for evictable entries (rate
//!   limited, see [`MIN_SCAN_INTERVAL`]); if the shard is still full the request is decided
//!   against the shard's single shared *overflow* state with the same limit. Existing keys are
//!   unaffected, memory does not grow, and a flood of distinct keys starves itself.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

use hashbrown::HashTable;

use crate::algorithms::{ConcurrencyLimit, LimiterState};
use crate::lock::SpinMutex as Mutex;
use crate::siphash::SipHasher13;
use crate::{NEVER, Nanos, Params};

/// Minimum time between two at-capacity eviction scans of one shard. A scan is O(entries in
/// the shard); without this a flood of new keys at the cap could force one per request.
pub const MIN_SCAN_INTERVAL: Nanos = 100_000_000;

/// Sizing of a [`KeyedLimiter`](crate::KeyedLimiter)'s store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    /// Hard cap on stored keys (at least 1). Split evenly across shards, rounded down, so the
    /// store never holds more than this.
    pub max_keys: usize,
    /// Extra grace after an entry becomes idle (equivalent to a new key) before it is evicted.
    /// 0 (the default) derives the TTL from the limit: a token/leaky bucket entry lives until
    /// refilled (≤ `burst × period / requests` after its last request), a fixed window until
    /// its window ends (≤ `period`), a sliding window until both windows are empty
    /// (≤ 2 × `period`), a sliding log until its newest entry expires (`period`), and a
    /// concurrency entry exactly while permits are held.
    pub idle_ttl: Nanos,
    /// Number of shards, rounded up to a power of two (1..=65_536) and reduced if larger than
    /// `max_keys`. More shards mean less lock contention; each has its own overflow state.
    pub shards: usize,
}

impl Default for StoreConfig {
    /// 1 M keys, TTL derived from the limit, 64 shards (≥ 4 × cores on the machines we target,
    /// so two cores rarely meet on one lock).
    fn default() -> Self {
        Self {
            max_keys: 1_000_000,
            idle_ttl: 0,
            shards: 64,
        }
    }
}

/// Keyed hash of a key's bytes; the only thing stored per key besides its state.
pub(crate) type KeyHash = u64;

/// Bit offset of the shard index within a [`KeyHash`].
const SHARD_SHIFT: u32 = 32;
/// Shard indices use hash bits 32..48; hashbrown's bucket index uses the low bits (tables
/// would need 2^32 buckets to reach bit 32) and its tag bits 57..64.
const MAX_SHARDS: usize = 1 << 16;

struct Entry<S> {
    key: KeyHash,
    state: S,
}

struct Shard<S> {
    table: HashTable<Entry<S>>,
    /// Shared state for new keys that arrive while the shard is full.
    overflow: S,
    /// Lower bound on when any entry can become evictable (skip scans before it).
    min_idle_at: Nanos,
    /// Earliest time the next at-capacity scan may run.
    next_scan: Nanos,
    /// Decisions made against `overflow` (a plain counter: it is only touched under the
    /// shard lock, so a flood does not make cores fight over one shared atomic).
    overflow_decisions: u64,
}

/// Keeps each shard's lock on its own cache lines (128 bytes covers adjacent-line prefetch).
#[repr(align(128))]
struct Padded<T>(T);

/// Where a key's state lives, so a concurrency permit gives units back to the right place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    Entry,
    Overflow,
}

pub(crate) struct Store<S> {
    params: Params,
    hasher: SipHasher13,
    shards: Box<[Padded<Mutex<Shard<S>>>]>,
    mask: u64,
    shard_cap: usize,
    idle_ttl: Nanos,
}

/// Two random 64-bit keys. `RandomState` is seeded from the OS once per thread and varies per
/// instance; hashing through it turns that into independent secret-keyed outputs.
fn random_keys() -> (u64, u64) {
    let state = RandomState::new();
    let mut a = state.build_hasher();
    a.write_u64(0x746f_6c6c_6761_7465);
    let mut b = state.build_hasher();
    b.write_u64(0x6b65_7968_6173_6831);
    (a.finish(), b.finish())
}

impl<S: LimiterState> Store<S> {
    pub(crate) fn new(params: Params, cfg: &StoreConfig) -> Self {
        let max_keys = cfg.max_keys.max(1);
        let mut shards = cfg.shards.clamp(1, MAX_SHARDS).next_power_of_two();
        while shards > max_keys {
            shards /= 2;
        }
        let (k0, k1) = random_keys();
        Self {
            params,
            hasher: SipHasher13::new_with_keys(k0, k1),
            shards: (0..shards)
                .map(|_| {
                    Padded(Mutex::new(Shard {
                        table: HashTable::new(),
                        overflow: S::default(),
                        min_idle_at: NEVER,
                        next_scan: 0,
                        overflow_decisions: 0,
                    }))
                })
                .collect(),
            mask: shards as u64 - 1,
            shard_cap: max_keys / shards,
            idle_ttl: cfg.idle_ttl,
        }
    }

    #[inline]
    pub(crate) fn params(&self) -> &Params {
        &self.params
    }

    #[inline]
    pub(crate) fn hash(&self, key: &[u8]) -> KeyHash {
        self.hasher.hash(key)
    }

    #[inline]
    fn shard(&self, key: KeyHash) -> &Mutex<Shard<S>> {
        // `mask < shards.len()`, and the index is masked, so this cannot go out of bounds.
        &self.shards[((key >> SHARD_SHIFT) & self.mask) as usize].0
    }

    /// Charges `cost` for `key` at `now`.
    #[inline(always)]
    pub(crate) fn decide(&self, key: &[u8], now: Nanos, cost: u64) -> crate::Decision {
        self.with_state(self.hash(key), now, |s, p, _| s.acquire_with(p, now, cost))
    }

    /// Runs `f` on the key's state, creating it if absent, or on the shard's overflow state if
    /// the key is new and the shard is full (`f` is told which).
    #[inline(always)]
    pub(crate) fn with_state<R>(
        &self,
        key: KeyHash,
        now: Nanos,
        f: impl FnOnce(&mut S, &Params, Slot) -> R,
    ) -> R {
        let mut guard = self.shard(key).lock();
        let shard = &mut *guard;
        if let Some(e) = shard.table.find_mut(key, |e| e.key == key) {
            return f(&mut e.state, &self.params, Slot::Entry);
        }
        self.insert_slow(shard, key, now, f)
    }

    #[inline(never)]
    fn insert_slow<R>(
        &self,
        shard: &mut Shard<S>,
        key: KeyHash,
        now: Nanos,
        f: impl FnOnce(&mut S, &Params, Slot) -> R,
    ) -> R {
        if shard.table.len() >= self.shard_cap && now >= shard.min_idle_at && now >= shard.next_scan
        {
            self.scan(shard, now);
            shard.next_scan = now.saturating_add(MIN_SCAN_INTERVAL);
        }
        if shard.table.len() >= self.shard_cap {
            shard.overflow_decisions += 1;
            return f(&mut shard.overflow, &self.params, Slot::Overflow);
        }
        let mut state = S::default();
        let r = f(&mut state, &self.params, Slot::Entry);
        let idle = state.idle_at(&self.params).saturating_add(self.idle_ttl);
        // A state that is still pristine (e.g. a request too large to ever fit) needs no entry.
        if idle > now || idle == NEVER {
            shard.min_idle_at = shard.min_idle_at.min(idle);
            shard
                .table
                .insert_unique(key, Entry { key, state }, |e| e.key);
        }
        r
    }

    /// Removes evictable entries of one shard; returns how many.
    fn scan(&self, shard: &mut Shard<S>, now: Nanos) -> usize {
        let before = shard.table.len();
        let mut min_idle = NEVER;
        let (params, ttl) = (&self.params, self.idle_ttl);
        shard.table.retain(|e| {
            // Saturated (NEVER) means "not within the clock's range": keep.
            let t = e.state.idle_at(params).saturating_add(ttl);
            if t <= now && t != NEVER {
                false
            } else {
                min_idle = min_idle.min(t);
                true
            }
        });
        shard.min_idle_at = min_idle;
        before - shard.table.len()
    }

    /// Looks at the key's state (or a new key's) without creating an entry.
    #[inline]
    pub(crate) fn peek<R>(&self, key: KeyHash, f: impl FnOnce(&S, &Params) -> R) -> R {
        let guard = self.shard(key).lock();
        match guard.table.find(key, |e| e.key == key) {
            Some(e) => f(&e.state, &self.params),
            None => f(&S::default(), &self.params),
        }
    }

    /// Runs `f` on the key's stored state, if the key has one; creates nothing.
    #[inline]
    pub(crate) fn peek_entry<R>(
        &self,
        key: KeyHash,
        f: impl FnOnce(&S, &Params) -> R,
    ) -> Option<R> {
        let guard = self.shard(key).lock();
        guard
            .table
            .find(key, |e| e.key == key)
            .map(|e| f(&e.state, &self.params))
    }

    /// Evicts every idle entry (see [`StoreConfig::idle_ttl`]); returns how many.
    pub(crate) fn evict_idle(&self, now: Nanos) -> usize {
        self.shards
            .iter()
            .map(|s| self.scan(&mut s.0.lock(), now))
            .sum()
    }

    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().table.len()).sum()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.shard_cap * self.shards.len()
    }

    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    pub(crate) fn overflow_decisions(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.0.lock().overflow_decisions)
            .sum()
    }

    /// Bytes allocated for the shard tables (entries + control bytes), excluding any heap
    /// owned by the states themselves (only the sliding log has some).
    pub(crate) fn table_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.0.lock().table.allocation_size())
            .sum()
    }
}

impl Store<ConcurrencyLimit> {
    /// Gives `cost` in-flight units back; drops the entry when nothing is left in flight
    /// (it is then identical to a new key, so this is the concurrency "TTL").
    pub(crate) fn release(&self, key: KeyHash, slot: Slot, cost: u64) {
        let mut guard = self.shard(key).lock();
        let shard = &mut *guard;
        match slot {
            Slot::Overflow => shard.overflow.release(cost),
            Slot::Entry => {
                if let Ok(mut entry) = shard.table.find_entry(key, |e| e.key == key) {
                    entry.get_mut().state.release(cost);
                    if entry.get().state.in_flight() == 0 {
                        entry.remove();
                    }
                }
            }
        }
    }
}
