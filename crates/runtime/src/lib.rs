//! tollgate-runtime: what both tollgate binaries run around their edge. The per-pod sidecar
//! (`tollgate-sidecar`, the HTTP proxy) and the Envoy rate limit service (`tollgate-ratelimit`)
//! share the rule sources (policy files, the controller's rule stream, the rules cache), the
//! admin port, the Redis runtime and membership, and the drain on shutdown; each adds only its
//! edge and its own flags.

pub mod admin;
pub mod args;
pub mod rule_stream;
pub mod rules_cache;
pub mod wiring;

/// Makes ring the process's rustls crypto provider, which the controller connection's TLS
/// configuration takes (rustls is built without a default one). Idempotent; called before it.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Runs `work` on the runtime `--workers` asks for. One worker (the usual sidecar CPU budget)
/// runs everything on one thread: no cross-thread wake-ups or work stealing on the request
/// path. More workers use the multi-thread runtime. Pending spans are flushed before the
/// runtime goes away.
pub fn block_on<T>(
    workers: usize,
    work: impl std::future::Future<Output = T>,
) -> std::io::Result<T> {
    let workers = match workers {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let runtime = if workers == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .thread_name("tollgate")
            .build()?
    };
    let result = runtime.block_on(work);
    tollgate_telemetry::shutdown();
    Ok(result)
}

/// Starts logging and tracing as the runtime flags say, for the binary `service`.
pub fn init_telemetry(args: &args::RuntimeArgs, service: &str) {
    // `--log` alone decides (RUST_LOG does not win), and JSON lines hold the event's own
    // fields only: what a per-request log line needs.
    let settings = tollgate_telemetry::Settings {
        service,
        log_filter: &args.log,
        rust_log_wins: false,
        format: args.log_format,
        json_span: false,
        otlp_endpoint: args.otlp_endpoint.as_deref(),
        otlp_ca_file: args.otlp_ca_file.as_deref(),
    };
    if let Err(e) = tollgate_telemetry::init_with(&settings) {
        eprintln!("{service}: telemetry: {e}");
    }
}

/// The process's exit status for what [`block_on`] returned, with a failure logged and printed
/// under the binary's name `service` (stderr too: logs may go to a collector nobody reads yet).
pub fn exit_code(
    service: &str,
    result: std::io::Result<anyhow::Result<()>>,
) -> std::process::ExitCode {
    match result {
        Ok(Ok(())) => std::process::ExitCode::SUCCESS,
        Ok(Err(e)) => {
            tracing::error!(error = %format!("{e:#}"), "{service} failed");
            eprintln!("{service}: {e:#}");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("{service}: cannot start runtime: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
