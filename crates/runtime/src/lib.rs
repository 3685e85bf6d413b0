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
    if let Err(e) = tollgate_telemetry::init(
        &args.log,
        args.log_format == tollgate_telemetry::LogFormat::Json,
        args.otlp_endpoint.as_deref(),
        args.otlp_ca_file.as_deref(),
        service,
    ) {
        eprintln!("{service}: telemetry: {e}");
    }
}
