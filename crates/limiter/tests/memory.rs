//! Bytes per key in the keyed store, measured with a counting global allocator, next to
//! governor's keyed (DashMap) store for the same number of keys. Run with `--nocapture` to
//! see the table. The assertions pin the memory bound: 100 k active token-bucket keys must
//! stay far below the 32 MB budget for the whole sidecar (G8).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "test code: a failed unwrap is a failed test, and tests may block and sleep"
)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicIsize, Ordering};

use tollgate_limiter::{Algorithm, KeyedLimiter, Limit, SECOND, StoreConfig};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged and only counts sizes.
#[allow(
    unsafe_code,
    reason = "a counting allocator measures the store's memory"
)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const KEYS: u64 = 100_000;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Bytes per key after `KEYS` distinct keys made one request each.
fn ours(alg: Algorithm) -> (f64, f64) {
    let before = live();
    let l = KeyedLimiter::new(
        Limit::new(alg, 100, SECOND, 100, 0).unwrap(),
        StoreConfig::default(),
    );
    let empty = live() - before;
    for k in 0..KEYS {
        let _permit = l.acquire_permit(
            format!("ip:10.{}.{}.{}", k >> 16, (k >> 8) & 255, k & 255).as_bytes(),
            SECOND,
            1,
        );
        if alg == Algorithm::Concurrency {
            // Keep it held so the entry stays.
            std::mem::forget(_permit);
        }
    }
    assert_eq!(l.len() as u64, KEYS);
    let per_key = (live() - before - empty) as f64 / KEYS as f64;
    let table = l.table_bytes() as f64 / KEYS as f64;
    drop(l);
    (per_key, table)
}

fn governor_keyed() -> f64 {
    let q = governor::Quota::per_second(NonZeroU32::new(100).unwrap());
    let before = live();
    let l = governor::RateLimiter::<String, _, _>::keyed(q);
    let keys: Vec<String> = (0..KEYS)
        .map(|k| format!("ip:10.{}.{}.{}", k >> 16, (k >> 8) & 255, k & 255))
        .collect();
    let key_bytes = live() - before;
    for k in &keys {
        let _ = l.check_key(k);
    }
    // Count the map only; the caller-owned key Strings are cloned into it.
    let per_key = (live() - before - key_bytes) as f64 / KEYS as f64;
    drop(l);
    per_key
}

#[test]
fn bytes_per_key() {
    println!("\nbytes per key, {KEYS} keys of ~14 bytes, one request each:");
    println!("{:<28}{:>12}{:>14}", "store", "allocated", "table only");
    let mut results = Vec::new();
    for alg in [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::Concurrency,
    ] {
        let (per_key, table) = ours(alg);
        println!(
            "{:<28}{:>12.1}{:>14.1}",
            format!("tollgate {alg:?}"),
            per_key,
            table
        );
        results.push((alg, per_key));
    }
    let gov = governor_keyed();
    println!("{:<28}{:>12.1}", "governor keyed (DashMap)", gov);

    for (alg, per_key) in results {
        // 8-byte hash + 8..24-byte state, hashbrown control bytes, power-of-two growth.
        let bound = match alg {
            // One heap-allocated timestamp buffer (4 × 8 bytes) per key on top.
            Algorithm::SlidingLog => 160.0,
            _ => 80.0,
        };
        assert!(per_key <= bound, "{alg:?}: {per_key} bytes/key");
    }
    // 100 k token-bucket keys must fit the sidecar's 32 MB budget many times over.
    let (tb, _) = ours(Algorithm::TokenBucket);
    assert!(tb * KEYS as f64 <= 8.0 * 1024.0 * 1024.0);
}
