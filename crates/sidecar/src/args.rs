//! Options of the proxy: what `tollgate-sidecar` (and `demo`) run with. The options both
//! binaries share (rule source, Redis, admin, audit, logs, drain) are
//! `tollgate_runtime::args::RuntimeArgs`, flattened here.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;
use tollgate_crd::duration::parse_flag;
use tollgate_runtime::args::RuntimeArgs;

/// Options of the proxy (each also settable through the `TOLLGATE_*` variable shown).
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Address the proxy listens on for client traffic.
    #[arg(long, env = "TOLLGATE_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,

    /// The application behind the sidecar, e.g. http://127.0.0.1:8080.
    #[arg(long, env = "TOLLGATE_UPSTREAM")]
    pub upstream: Option<http::Uri>,

    /// Deprecated alias, kept for one release: runs `tollgate-ratelimit` (found next to this
    /// binary, else on PATH) with the other arguments, after a warning. Run `tollgate-ratelimit`
    /// instead; its flags are the ones this binary had with --rate-limit-service.
    #[arg(long, env = "TOLLGATE_RATE_LIMIT_SERVICE", conflicts_with = "upstream")]
    pub rate_limit_service: bool,

    /// How long to wait for the upstream's response headers before answering 504.
    #[arg(long, env = "TOLLGATE_UPSTREAM_TIMEOUT", default_value = "30s", value_parser = parse_flag)]
    pub upstream_timeout: Duration,

    /// How long a client may take to send request headers (cuts off slowloris clients); also
    /// closes idle keep-alive connections.
    #[arg(long, env = "TOLLGATE_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_flag)]
    pub header_read_timeout: Duration,

    /// Largest request head (request line and headers) accepted, in bytes.
    #[arg(long, env = "TOLLGATE_MAX_HEADER_BYTES", default_value_t = 64 * 1024)]
    pub max_header_bytes: usize,

    /// Add `tollgate-shadow-rejected: <n>` to responses that shadow rules would have rejected.
    #[arg(long, env = "TOLLGATE_SHADOW_HEADER", default_value_t = false)]
    pub shadow_header: bool,

    /// Serve plain keep-alive HTTP/1.1 requests on the lean single-task path (hyper still
    /// serves HTTP/2, upgrades and streamed request bodies). `false` sends all traffic through
    /// hyper.
    #[arg(long, env = "TOLLGATE_FAST_HTTP1", default_value_t = true, action = clap::ArgAction::Set)]
    pub fast_http1: bool,

    #[command(flatten)]
    pub runtime: RuntimeArgs,
}
