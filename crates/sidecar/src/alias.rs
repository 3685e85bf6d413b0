//! `tollgate-sidecar --rate-limit-service`: the Envoy rate limit service is its own binary,
//! `tollgate-ratelimit`, so the per-pod sidecar does not link gRPC. The flag stays as a
//! documented alias for one release: it hands the process over to `tollgate-ratelimit` with
//! the same arguments, so existing manifests keep working while they move.

use std::ffi::{OsStr, OsString};
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

/// The deprecated flag, and its variable.
const FLAG: &str = "--rate-limit-service";
const ENV: &str = "TOLLGATE_RATE_LIMIT_SERVICE";
/// The binary it stands for.
const RATELIMIT: &str = "tollgate-ratelimit";
/// The subcommands, which never mean the rate limit service.
const SUBCOMMANDS: [&str; 4] = ["check", "key-hash", "demo", "help"];

/// Whether this invocation asks for the rate limit service (the flag, or its variable set to
/// anything clap reads as true). Checked before the command line is parsed: the rate limit
/// service's own flags (`--rlqs-*`) are not the sidecar's.
pub fn requested(args: &[OsString]) -> bool {
    if args
        .get(1)
        .is_some_and(|a| SUBCOMMANDS.iter().any(|s| a == OsStr::new(s)))
    {
        return false;
    }
    args.iter().skip(1).any(|a| a == OsStr::new(FLAG))
        || std::env::var(ENV).is_ok_and(|v| {
            !matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "" | "n" | "no" | "f" | "false" | "off" | "0"
            )
        })
}

/// Replaces this process with `tollgate-ratelimit` and the same arguments minus the flag;
/// returns only if that could not start.
pub fn exec(args: Vec<OsString>) -> ExitCode {
    let Some(program) = locate() else {
        eprintln!(
            "tollgate-sidecar: --rate-limit-service now runs the separate binary {RATELIMIT}, \
             found neither next to this executable nor on PATH. Run {RATELIMIT} with the same \
             flags instead (without --rate-limit-service): it is built from the same source \
             (cargo build --release -p {RATELIMIT}) and published as the image \
             ghcr.io/tollgate-dev/{RATELIMIT}"
        );
        return ExitCode::FAILURE;
    };
    eprintln!(
        "tollgate-sidecar: warning: --rate-limit-service is deprecated and goes away in the next \
         release; running {} with the same arguments (run {RATELIMIT} directly)",
        program.display()
    );
    let rest = args.into_iter().skip(1).filter(|a| a != OsStr::new(FLAG));
    let error = Command::new(&program).args(rest).env_remove(ENV).exec();
    eprintln!(
        "tollgate-sidecar: cannot run {}: {error}",
        program.display()
    );
    ExitCode::FAILURE
}

/// `tollgate-ratelimit` next to the running executable (where a build or `cargo install` puts
/// both), else the first on PATH. The sidecar image holds the sidecar only, so it stays lean:
/// a container that used the flag switches to the `tollgate-ratelimit` image (docs/gateway.md).
fn locate() -> Option<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(RATELIMIT)))
        .filter(|p| p.is_file());
    beside.or_else(|| {
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path)
            .map(|dir| dir.join(RATELIMIT))
            .find(|p| p.is_file())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_flag_is_the_alias_but_not_in_a_subcommand() {
        assert!(requested(&args(&[
            "tollgate-sidecar",
            "--policies",
            "p",
            FLAG
        ])));
        assert!(!requested(&args(&["tollgate-sidecar", "check", FLAG])));
        assert!(!requested(&args(&[
            "tollgate-sidecar",
            "--upstream",
            "http://a"
        ])));
    }
}
