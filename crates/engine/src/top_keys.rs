//! The most-limited keys, for `/debug/top-keys`: a bounded Space-Saving sketch fed by
//! rejections only, so its cost lands on requests that are being refused anyway and its memory
//! is fixed however many distinct keys an attacker rotates through.
//!
//! Space-Saving keeps `CAPACITY` counters; an unseen key replaces the smallest counter and
//! inherits its count (recorded as the possible over-count), which guarantees that every key
//! rejected more than `total / CAPACITY` times is listed.

use parking_lot::Mutex;

/// Counters kept; also the most keys listed.
pub const CAPACITY: usize = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub rule: String,
    /// The hot path's fingerprint of the key, which the sketch counts by.
    pub fingerprint: u64,
    /// The key's key hash (`crate::key_hash`), shown to operators.
    pub key_hash: u64,
    /// The raw key, only when `--audit-raw-keys` is set.
    pub key: Option<String>,
    pub count: u64,
    /// How much of `count` may belong to keys this entry replaced.
    pub error: u64,
}

/// The sketch.
#[derive(Default)]
pub struct TopKeys {
    entries: Mutex<Vec<Entry>>,
}

impl TopKeys {
    /// Counts one rejection of `fingerprint` by `rule`. `describe` gives the key's key hash and
    /// (with `--audit-raw-keys`) the raw key; it runs only when the key takes a counter, so a
    /// key already counted costs no HMAC.
    pub fn record(
        &self,
        rule: &str,
        fingerprint: u64,
        describe: impl FnOnce() -> (u64, Option<String>),
    ) {
        let mut entries = self.entries.lock();
        if let Some(e) = entries
            .iter_mut()
            .find(|e| e.fingerprint == fingerprint && e.rule == rule)
        {
            e.count += 1;
            return;
        }
        if entries.len() < CAPACITY {
            let (key_hash, key) = describe();
            entries.push(Entry {
                rule: rule.to_string(),
                fingerprint,
                key_hash,
                key,
                count: 1,
                error: 0,
            });
            return;
        }
        if let Some(min) = entries.iter_mut().min_by_key(|e| e.count) {
            let floor = min.count;
            let (key_hash, key) = describe();
            *min = Entry {
                rule: rule.to_string(),
                fingerprint,
                key_hash,
                key,
                count: floor + 1,
                error: floor,
            };
        }
    }

    /// Empties the sketch and returns what it held: the reporter's window starts over.
    pub fn take(&self) -> Vec<Entry> {
        std::mem::take(&mut *self.entries.lock())
    }

    /// The entries, most rejected first.
    pub fn snapshot(&self) -> Vec<Entry> {
        let mut v = self.entries.lock().clone();
        v.sort_by_key(|e| std::cmp::Reverse(e.count));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_hitters_survive_a_flood_of_distinct_keys() {
        let top = TopKeys::default();
        for i in 0..100_000u64 {
            // Two heavy hitters amid a flood of one-off keys.
            top.record("r", 1, || (0, None));
            if i % 2 == 0 {
                top.record("r", 2, || (0, None));
            }
            top.record("r", 1_000 + i, || (0, None));
        }
        let snap = top.snapshot();
        assert!(snap.len() <= CAPACITY);
        assert_eq!(snap[0].fingerprint, 1);
        assert_eq!(snap[1].fingerprint, 2);
        assert!(snap[0].count >= 100_000 && snap[0].count - snap[0].error <= 100_000);
    }

    #[test]
    fn rules_are_counted_apart() {
        let top = TopKeys::default();
        top.record("a", 7, || (7, Some("k".into())));
        top.record("b", 7, || (7, Some("k".into())));
        top.record("a", 7, || (7, Some("k".into())));
        let snap = top.snapshot();
        assert_eq!((snap[0].rule.as_str(), snap[0].count), ("a", 2));
        assert_eq!((snap[1].rule.as_str(), snap[1].count), ("b", 1));
        assert_eq!(snap[0].key.as_deref(), Some("k"));
    }
}
