//! libFuzzer entry point for [`tollgate_fuzz::http1_wire`]. Without `--cfg fuzzing` (a plain
//! `cargo build`/`cargo run` on stable) the binary replays the files or directories given as
//! arguments instead, which is handy for reproducing a crash without nightly.
#![cfg_attr(fuzzing, no_main)]

#[cfg(fuzzing)]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_fuzz::http1_wire(data));

#[cfg(not(fuzzing))]
fn main() {
    tollgate_fuzz::replay_args(tollgate_fuzz::http1_wire);
}
