//! Command line: `tollgate-sidecar [OPTIONS]` runs the proxy, `check` validates policies
//! offline, `demo` runs the sidecar with an example policy in front of a built-in upstream.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::app;
use crate::args::{LogFormat, RunArgs};

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
        replay: crate::replay::ReplayArgs,
    },
    /// Print the stable identity (`key_hash` in audit lines and top keys) of a counter key,
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

/// `key-hash`: prints the identity of the key made of `parts`.
fn key_hash(secret_file: &std::path::Path, parts: &[String]) -> std::process::ExitCode {
    let identity = match crate::identity::KeyIdentity::read(secret_file) {
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
    println!("{}", crate::identity::display(identity.of_parts(&bytes)));
    std::process::ExitCode::SUCCESS
}

/// Entry point of the binary.
pub fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Check {
            mut paths,
            policy,
            replay,
        }) => {
            paths.extend(policy);
            if replay.replay.is_some() {
                crate::replay::run(&paths, &replay)
            } else {
                check(&paths)
            }
        }
        Some(Command::KeyHash { secret_file, parts }) => key_hash(&secret_file, &parts),
        Some(Command::Demo { listen, admin }) => {
            let mut args = cli.run;
            args.listen = listen;
            args.admin = admin;
            args.log_format = LogFormat::Text;
            run_blocking(args, true)
        }
        None => run_blocking(cli.run, false),
    }
}

fn run_blocking(args: RunArgs, demo: bool) -> std::process::ExitCode {
    init_logging(&args);
    // One worker (the usual sidecar CPU budget) runs everything on one thread: no cross-thread
    // wake-ups or work stealing on the request path. More workers use the multi-thread runtime.
    let workers = match args.workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let built = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .thread_name("tollgate")
            .build()
    };
    let runtime = match built {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate-sidecar: cannot start runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        if demo {
            app::run_demo(args).await
        } else {
            app::run(args, app::shutdown_signal()).await.map(|_| ())
        }
    });
    crate::telemetry::shutdown();
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "tollgate-sidecar failed");
            eprintln!("tollgate-sidecar: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_logging(args: &RunArgs) {
    if let Err(e) = crate::telemetry::init(
        &args.log,
        args.log_format == LogFormat::Json,
        args.otlp_endpoint.as_deref(),
        args.otlp_ca_file.as_deref(),
        "tollgate-sidecar",
    ) {
        eprintln!("tollgate-sidecar: telemetry: {e}");
    }
}

/// `tollgate-sidecar check` (and `kubectl tollgate check`): prints each rule of the policy
/// files in words to stdout, or every error with its field path to stderr; FAILURE on errors.
pub fn check(paths: &[PathBuf]) -> std::process::ExitCode {
    let mut failed = false;
    for path in paths {
        match crate::config::load(path) {
            Ok(policies) => {
                for p in &policies {
                    println!(
                        "policy {} (selects {})",
                        p.id(),
                        describe_selector(&p.selector)
                    );
                    for r in &p.rules {
                        println!("  - {}", r.describe());
                    }
                    if !p.bypass.keys.is_empty() || !p.bypass.cidrs.is_empty() {
                        println!(
                            "  bypass: {} key(s), networks {:?}",
                            p.bypass.keys.len(),
                            p.bypass
                                .cidrs
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                        );
                    }
                }
            }
            Err(errors) => {
                failed = true;
                for e in errors {
                    eprintln!("error: {e}");
                }
            }
        }
    }
    if failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

fn describe_selector(s: &tollgate_crd::compiled::Selector) -> String {
    if s.match_labels.is_empty() && s.match_expressions.is_empty() {
        return "every pod in the namespace".to_string();
    }
    let mut parts: Vec<String> = s
        .match_labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in &s.match_expressions {
        parts.push(format!("{} {:?} {:?}", e.key, e.operator, e.values));
    }
    format!("pods with {}", parts.join(", "))
}
