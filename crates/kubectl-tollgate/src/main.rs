//! `kubectl tollgate`: a kubectl plugin for tollgate. On `PATH` as `kubectl-tollgate`, kubectl
//! runs it for `kubectl tollgate ...`.

mod cli;
mod client;
mod output;
mod status;
mod top;
mod why;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Usage errors exit 2 (clap), `--help` and `--version` 0.
    let cli = cli::Cli::parse();
    if let cli::Command::Check { paths } = &cli.command {
        // Offline: no cluster, no runtime. The sidecar's own `check`, so both say the same.
        return tollgate_crd::check::run(paths);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: cli::Cli) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let timeout = cli.global.request_timeout;
    let work = async {
        let kube = client::connect(&cli.global).await?;
        match cli.command {
            cli::Command::Status(args) => status::run(&kube, &args).await,
            cli::Command::Top(args) => top::run(&kube, &args).await,
            cli::Command::Why(args) => why::run(&kube, &args).await,
            cli::Command::Check { .. } => Ok(()),
        }
    };
    match timeout {
        Some(t) if !t.is_zero() => tokio::time::timeout(t, work).await.map_err(|_| {
            anyhow::anyhow!(
                "no answer within --request-timeout {}",
                humantime::format_duration(t)
            )
        })?,
        _ => work.await,
    }
}
