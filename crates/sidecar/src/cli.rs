//! Command line: `tollgate-sidecar [OPTIONS]` runs the proxy, `check` validates policies
//! offline, `demo` runs the sidecar with an example policy in front of a built-in upstream;
//! `--rate-limit-service` (deprecated) hands over to `tollgate-ratelimit`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::app;
use crate::args::RunArgs;
use tollgate_engine::replay;
use tollgate_telemetry::LogFormat;

#[derive(Parser, Debug)]
#[command(
    name = "tollgate-sidecar",
    version,
    about = "Localhost reverse proxy that enforces tollgate RateLimitPolicies in front of an app",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Validate policy files offline and print what each rule will do; exits 1 on errors.
    /// With --replay, replay an access log against them instead (a dry run, see
    /// docs/operations.md).
    Check {
        /// Policy files or directories (YAML, multi-document allowed).
        #[arg(required_unless_present = "policy")]
        paths: Vec<PathBuf>,
        /// Policy files or directories, as an alternative to positional paths.
        #[arg(long)]
        policy: Vec<PathBuf>,
        #[command(flatten)]
        replay: ReplayFlags,
    },
    /// Print the stable key hash (`key_hash` in audit lines and top keys) of a counter key,
    /// so support can find one client in the logs of every pod without raw keys being logged.
    KeyHash {
        /// The installation's key-hash secret (as given to the sidecars).
        #[arg(long, env = "TOLLGATE_KEY_HASH_SECRET_FILE")]
        secret_file: PathBuf,
        /// The key's parts in the rule's `key` order, e.g. the API key. A `clientIp` part is
        /// hashed as the address's bytes, not as text: give it as `ip:<address>`.
        #[arg(required = true)]
        parts: Vec<String>,
    },
    /// Run the sidecar enforcing manifests/examples/demo-local.yaml (5 requests per 10 s per
    /// client) in front of a built-in upstream that answers 200, for trying tollgate out.
    Demo {
        /// Where the demo sidecar listens.
        #[arg(long, default_value = "127.0.0.1:8081")]
        listen: SocketAddr,
        /// Where the demo's admin endpoints listen.
        #[arg(long, default_value = "127.0.0.1:9091")]
        admin: SocketAddr,
    },
}

/// Replay options of `tollgate-sidecar check`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ReplayFlags {
    /// Replay this access log (JSON lines, `-` for stdin) against the policies on a simulated
    /// clock and print what every rule would have done; nothing is enforced.
    #[arg(long, value_name = "ACCESS_LOG")]
    pub replay: Option<PathBuf>,

    /// With --replay: also replay the log against these policies (e.g. the ones in force) and
    /// show the difference.
    #[arg(long, value_name = "POLICY", requires = "replay")]
    pub baseline: Vec<PathBuf>,

    /// With --replay: show the most-rejected keys in clear instead of as hashes (keys are often
    /// credentials or personal data).
    #[arg(long, requires = "replay")]
    pub raw_keys: bool,

    /// With --replay: how many of the most-rejected keys to list per rule.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub top: usize,

    /// With --replay: `text` for people, `json` for pipelines (one object on stdout).
    #[arg(long, value_enum, default_value_t = ReportFormat::Text, requires = "replay")]
    pub output: ReportFormat,

    /// With --baseline: exit with status 3 when more than this percentage of the replayed
    /// requests would be rejected by the new policies and were admitted by the baseline; a
    /// gate for CI before a policy change is applied.
    #[arg(long, value_name = "PERCENT", requires = "baseline", value_parser = parse_percent)]
    pub max_newly_rejected: Option<f64>,
}

/// How `check --replay` prints its report.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReportFormat {
    #[default]
    Text,
    Json,
}

fn parse_percent(s: &str) -> Result<f64, String> {
    let p: f64 = s
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("{s:?} is not a percentage"))?;
    if (0.0..=100.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("{s:?} is not between 0 and 100"))
    }
}

impl From<ReplayFlags> for replay::ReplayArgs {
    fn from(f: ReplayFlags) -> Self {
        replay::ReplayArgs {
            replay: f.replay,
            baseline: f.baseline,
            raw_keys: f.raw_keys,
            top: f.top,
            output: match f.output {
                ReportFormat::Text => replay::ReportFormat::Text,
                ReportFormat::Json => replay::ReportFormat::Json,
            },
            max_newly_rejected: f.max_newly_rejected,
        }
    }
}

/// `key-hash`: prints the key hash of the key made of `parts`.
fn key_hash(secret_file: &std::path::Path, parts: &[String]) -> std::process::ExitCode {
    let key_hashes = match tollgate_engine::key_hash::KeyHashes::read(secret_file) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let mut bytes: Vec<Vec<u8>> = Vec::with_capacity(parts.len());
    for part in parts {
        match part.strip_prefix("ip:") {
            Some(addr) => match addr.parse::<std::net::IpAddr>() {
                Ok(std::net::IpAddr::V4(v4)) => bytes.push(v4.octets().to_vec()),
                Ok(std::net::IpAddr::V6(v6)) => bytes.push(v6.octets().to_vec()),
                Err(_) => {
                    eprintln!("error: {part:?} is not an address (ip:<address>)");
                    return std::process::ExitCode::from(2);
                }
            },
            None => bytes.push(part.as_bytes().to_vec()),
        }
    }
    println!(
        "{}",
        tollgate_engine::key_hash::display(key_hashes.of_parts(&bytes))
    );
    std::process::ExitCode::SUCCESS
}

/// Entry point of the binary.
pub fn main() -> std::process::ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if crate::alias::requested(&argv) {
        return crate::alias::exec(argv);
    }
    let cli = Cli::parse_from(argv);
    match cli.command {
        Some(Command::Check {
            mut paths,
            policy,
            replay,
        }) => {
            paths.extend(policy);
            if replay.replay.is_some() {
                replay::run(&paths, &replay.into())
            } else {
                tollgate_crd::check::run(&paths)
            }
        }
        Some(Command::KeyHash { secret_file, parts }) => key_hash(&secret_file, &parts),
        Some(Command::Demo { listen, admin }) => {
            let mut args = cli.run;
            args.listen = listen;
            args.runtime.admin = admin;
            args.runtime.log_format = LogFormat::Text;
            run_blocking(args, true)
        }
        None => run_blocking(cli.run, false),
    }
}

fn run_blocking(args: RunArgs, demo: bool) -> std::process::ExitCode {
    tollgate_runtime::init_telemetry(&args.runtime, "tollgate-sidecar");
    let workers = args.runtime.workers;
    let result = tollgate_runtime::block_on(workers, async move {
        if demo {
            app::run_demo(args).await
        } else {
            app::run(args, tollgate_telemetry::shutdown_signal()).await
        }
    });
    tollgate_runtime::exit_code("tollgate-sidecar", result)
}
