//! `limit.blockFor`: keys that exceeded a rule stay rejected for a while (a mitigation
//! timeout), whatever their bucket holds by then.
//!
//! Keyed by the counter key's hash and bounded: each shard holds at most [`SHARD_CAP`] keys.
//! A full shard first drops expired blocks; if it is still full the key is not blocked, so a
//! flood of distinct keys degrades to the rule's limit itself instead of growing memory.

use std::collections::HashMap;

use parking_lot::Mutex;
use tollgate_limiter::Nanos;

const SHARDS: usize = 16;
/// Blocked keys per shard (16 × 4096 ≈ 65k keys, about 1.5 MiB at most).
const SHARD_CAP: usize = 4096;

/// The keys a rule currently blocks, with the time each block ends.
pub struct BlockList {
    block_for: Nanos,
    shards: Vec<Mutex<HashMap<u64, Nanos>>>,
}

impl BlockList {
    pub fn new(block_for_ms: u64) -> BlockList {
        BlockList {
            block_for: block_for_ms.saturating_mul(1_000_000),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }

    fn shard(&self, fingerprint: u64) -> &Mutex<HashMap<u64, Nanos>> {
        &self.shards[(fingerprint >> 60) as usize % SHARDS]
    }

    /// How much longer `fingerprint` stays blocked at `now`, if it is.
    pub fn remaining(&self, fingerprint: u64, now: Nanos) -> Option<Nanos> {
        let until = *self.shard(fingerprint).lock().get(&fingerprint)?;
        (until > now).then(|| until - now)
    }

    /// Blocks `fingerprint` from `now` for the rule's `blockFor`; returns how long.
    pub fn block(&self, fingerprint: u64, now: Nanos) -> Nanos {
        let until = now.saturating_add(self.block_for);
        let mut shard = self.shard(fingerprint).lock();
        if shard.len() >= SHARD_CAP && !shard.contains_key(&fingerprint) {
            shard.retain(|_, &mut t| t > now);
            if shard.len() >= SHARD_CAP {
                return 0;
            }
        }
        shard.insert(fingerprint, until);
        self.block_for
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_expire_and_a_full_shard_stays_bounded() {
        let b = BlockList::new(1_000);
        assert_eq!(b.block(7, 0), 1_000_000_000);
        assert_eq!(b.remaining(7, 400_000_000), Some(600_000_000));
        assert_eq!(b.remaining(7, 1_000_000_000), None);
        // Fill one shard (same top bits) beyond its cap: memory stays bounded.
        for i in 0..(SHARD_CAP as u64 + 10) {
            b.block(i, 2_000_000_000);
        }
        assert!(b.shards.iter().all(|s| s.lock().len() <= SHARD_CAP));
    }
}
