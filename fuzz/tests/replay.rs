//! The fuzz smoke test that needs no nightly: every checked-in input through its target, then a
//! few thousand deterministic pseudo-random inputs per target (mutations of those inputs and
//! plain random bytes). The inputs are `corpus/<target>/` (found by the fuzzers, minimized with
//! `cargo fuzz cmin`), `seeds/<target>/` (hand-written examples) and `regressions/<target>/`
//! (hand-written reproductions of crashes the fuzzers found).
//!
//! `TOLLGATE_FUZZ_ITERS` sets the number of pseudo-random inputs per target (default 3000) and
//! `TOLLGATE_FUZZ_SEED` the seed, so CI can run longer without code changes. A failure prints the
//! input as a Rust byte string; save it under `regressions/<target>/` to keep it as a regression.

use std::path::{Path, PathBuf};

fn dir(kind: &str, target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(kind)
        .join(target)
}

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    read_all(&dir("corpus", target))
}

fn read_all(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    tollgate_fuzz::files_in(dir)
        .into_iter()
        .map(|p| {
            let data = std::fs::read(&p).unwrap();
            (p, data)
        })
        .collect()
}

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }

    fn byte(&mut self) -> u8 {
        // Bias towards bytes that matter to the parsers under test.
        const INTERESTING: &[u8] = b"\0\n\r\t :,.=&%+-[]{}\"'\\/*$#0123456789msh?!\x7f\xff";
        if self.next().is_multiple_of(3) {
            INTERESTING[self.below(INTERESTING.len())]
        } else {
            self.next() as u8
        }
    }
}

/// One libFuzzer-style mutation round: a handful of byte edits, inserts, deletes, duplications
/// and splices with another corpus entry.
fn mutate(rng: &mut Rng, input: &[u8], corpus: &[(PathBuf, Vec<u8>)]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..=rng.below(6) {
        let len = out.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] = rng.byte();
            }
            1 => {
                let i = rng.below(len + 1);
                let b = rng.byte();
                out.insert(i, b);
            }
            2 if len > 0 => {
                let i = rng.below(len);
                let n = rng.below((len - i).min(16)) + 1;
                out.drain(i..i + n);
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let n = rng.below((len - i).min(32)) + 1;
                let chunk = out[i..i + n].to_vec();
                let at = rng.below(out.len() + 1);
                out.splice(at..at, chunk);
            }
            4 if !corpus.is_empty() => {
                let other = &corpus[rng.below(corpus.len())].1;
                if !other.is_empty() {
                    let i = rng.below(other.len());
                    let n = rng.below((other.len() - i).min(64)) + 1;
                    let at = rng.below(out.len() + 1);
                    out.splice(at..at, other[i..i + n].iter().copied());
                }
            }
            5 if len > 0 => {
                // Replace a digit run with an extreme number.
                let i = rng.below(len);
                if out[i].is_ascii_digit() {
                    let extreme: &[&[u8]] = &[
                        b"0",
                        b"18446744073709551615",
                        b"18446744073709551616",
                        b"9223372036854775807",
                        b"-1",
                        b"4294967295",
                        b"999999999",
                    ];
                    let e = extreme[rng.below(extreme.len())];
                    out.splice(i..i + 1, e.iter().copied());
                }
            }
            _ => {
                if len > 1 {
                    let cut = rng.below(len);
                    out.truncate(cut.max(1));
                }
            }
        }
    }
    out
}

fn run_one(name: &str, target: tollgate_fuzz::Target, data: &[u8], origin: &str) {
    let result = std::panic::catch_unwind(|| target(data));
    if let Err(e) = result {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        panic!(
            "{name} panicked on {origin}: {msg}\ninput: b\"{}\"",
            data.escape_ascii()
        );
    }
}

fn iterations() -> usize {
    std::env::var("TOLLGATE_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000)
}

fn seed() -> u64 {
    std::env::var("TOLLGATE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x746f_6c6c_6761_7465)
}

fn replay(name: &str) {
    let target = tollgate_fuzz::TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| *f)
        .unwrap();
    let mut files = corpus(name);
    files.extend(read_all(&dir("seeds", name)));
    assert!(!files.is_empty(), "no corpus or seeds for {name}");
    for (path, data) in files.iter().chain(&read_all(&dir("regressions", name))) {
        run_one(name, target, data, &path.display().to_string());
    }
    let mut rng = Rng(seed()
        ^ name
            .bytes()
            .fold(0u64, |h, b| h.rotate_left(5) ^ u64::from(b))
        | 1);
    for i in 0..iterations() {
        let data = if i % 8 == 7 {
            let n = rng.below(256);
            (0..n).map(|_| rng.byte()).collect()
        } else {
            let base = &files[rng.below(files.len())].1;
            mutate(&mut rng, base, &files)
        };
        run_one(name, target, &data, &format!("pseudo-random input {i}"));
    }
}

#[test]
fn policy_yaml() {
    replay("policy_yaml");
}

#[test]
fn duration() {
    replay("duration");
}

#[test]
fn key_extraction() {
    replay("key_extraction");
}

#[test]
fn stream_line() {
    replay("stream_line");
}

#[test]
fn lease_reply() {
    replay("lease_reply");
}

#[test]
fn http1_wire() {
    replay("http1_wire");
}

/// Corpora stay small enough to check in and to replay in seconds: `minimize.sh` keeps corpus
/// and seeds together at 200 files at most.
#[test]
fn every_target_has_a_small_corpus() {
    for (name, _) in tollgate_fuzz::TARGETS {
        let mut files = corpus(name);
        files.extend(read_all(&dir("seeds", name)));
        assert!(
            (1..=200).contains(&files.len()),
            "corpus/{name} and seeds/{name} hold {} files (keep 1..=200; run fuzz/minimize.sh)",
            files.len()
        );
        let bytes: usize = files.iter().map(|(_, data)| data.len()).sum();
        assert!(
            bytes <= 1 << 20,
            "corpus/{name} and seeds/{name} hold {bytes} bytes (keep ≤ 1 MiB)"
        );
    }
}

/// Every seed and regression directory belongs to a target (a typo in a directory name would
/// skip its inputs).
#[test]
fn input_directories_name_targets() {
    for kind in ["corpus", "seeds", "regressions"] {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(kind);
        for entry in std::fs::read_dir(&root).unwrap() {
            let name = entry.unwrap().file_name();
            let name = name.to_string_lossy();
            assert!(
                tollgate_fuzz::TARGETS.iter().any(|(t, _)| *t == name),
                "{kind}/{name} is not a fuzz target"
            );
        }
    }
}
