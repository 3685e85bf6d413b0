//! tollgate-telemetry: logs and OpenTelemetry traces, set up the same way by every binary
//! ([`init_with`]; [`Settings`] holds the few ways the binaries differ).
//!
//! Logs are structured (JSON by default) with a filter that can be changed at runtime (the
//! sidecar's admin port: `PUT /debug/log-level`). Traces are off unless an OTLP endpoint is
//! configured; when off, the request path checks one atomic flag and creates no span at all.
//! When on, every proxied request gets a span carrying the decision and the rule, continues the
//! caller's W3C trace context, and passes its own context on to the upstream; Redis lease calls
//! get spans too.

pub mod otlp;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use http::HeaderMap;
use opentelemetry::trace::TracerProvider as _;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, reload};

/// Target of trace spans; only these reach the OpenTelemetry layer.
pub const TRACE_TARGET: &str = "tollgate::trace";

static ENABLED: AtomicBool = AtomicBool::new(false);
static PROVIDER: OnceLock<opentelemetry_sdk::trace::SdkTracerProvider> = OnceLock::new();
static FILTER: OnceLock<reload::Handle<EnvFilter, tracing_subscriber::Registry>> = OnceLock::new();

/// Whether traces are exported (checked on the hot path before creating any span).
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// How a binary sets up its logs and traces ([`init_with`]). The two binaries differ only in
/// the fields that say so; everything else (stderr, the JSON layout, colour only at a
/// terminal, the runtime log filter, the trace exporter) is the same.
#[derive(Clone, Copy, Debug)]
pub struct Settings<'a> {
    /// `service.name` of the spans (`tollgate-sidecar`, `tollgate-controller`).
    pub service: &'a str,
    /// `--log` (RUST_LOG syntax); one that does not parse falls back to `info`.
    pub log_filter: &'a str,
    /// `RUST_LOG`, when set and valid, wins over `log_filter` (the controller's rule; the
    /// sidecar's `--log` alone decides).
    pub rust_log_wins: bool,
    /// `--log-format`.
    pub format: LogFormat,
    /// JSON lines carry `span`, the innermost span's fields (the controller's reconcile or
    /// task); the sidecar's lines have only the event's own fields.
    pub json_span: bool,
    /// `--otlp-endpoint`, else [`otlp::ENDPOINT_ENV`]; with neither, no traces.
    pub otlp_endpoint: Option<&'a str>,
    /// `--otlp-ca-file`, else the standard variables (see [`otlp::ca_file`]).
    pub otlp_ca_file: Option<&'a std::path::Path>,
}

/// Sets up logging (the filter applies to logs only, so `--log warn` does not switch traces
/// off; [`set_log_filter`] changes it at runtime) and, with an OTLP endpoint, trace export
/// with the W3C trace-context propagator. Fails if a global subscriber is already set (then
/// nothing here is switched on), or, after setting up logging, if the exporter cannot be built.
pub fn init_with(settings: &Settings<'_>) -> Result<(), String> {
    let (filter, handle) = reload::Layer::new(log_filter(settings));
    let (otel, provider, export_error) = match trace_provider(settings) {
        None => (None, None, None),
        Some(Err(e)) => (None, None, Some(e)),
        Some(Ok(provider)) => {
            let tracer = provider.tracer(settings.service.to_string());
            let layer = tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                    m.target() == TRACE_TARGET
                }));
            (Some(layer), Some(provider), None)
        }
    };
    tracing_subscriber::registry()
        .with(log_layer(settings).with_filter(filter))
        .with(otel)
        .try_init()
        .map_err(|e| e.to_string())?;
    let _ = FILTER.set(handle);
    if let Some(provider) = provider {
        let _ = PROVIDER.set(provider);
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        ENABLED.store(true, Ordering::Relaxed);
    }
    export_error.map_or(Ok(()), Err)
}

/// The log filter: `RUST_LOG` first when it wins, then `--log`, then `info`.
fn log_filter(settings: &Settings<'_>) -> EnvFilter {
    settings
        .rust_log_wins
        .then(EnvFilter::try_from_default_env)
        .and_then(Result::ok)
        .or_else(|| EnvFilter::try_new(settings.log_filter).ok())
        .unwrap_or_else(|| EnvFilter::new("info"))
}

/// The stderr layer: JSON with the event's fields at the top level, or text.
fn log_layer<S>(settings: &Settings<'_>) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'l> tracing_subscriber::registry::LookupSpan<'l>,
{
    let json = settings.format == LogFormat::Json;
    // Colour only for a person at a terminal: a file or a pipe (a log collector, `> demo.log`)
    // would keep the escape codes as bytes.
    let ansi = !json && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    if json {
        fmt.json()
            .flatten_event(true)
            .with_current_span(settings.json_span)
            .with_span_list(false)
            .boxed()
    } else {
        fmt.boxed()
    }
}

/// The trace exporter, when an endpoint is configured.
fn trace_provider(
    settings: &Settings<'_>,
) -> Option<Result<opentelemetry_sdk::trace::SdkTracerProvider, String>> {
    let endpoint = otlp::endpoint(settings.otlp_endpoint)?;
    let ca = otlp::ca_file(settings.otlp_ca_file);
    Some(otlp::tracer_provider(
        &endpoint,
        ca.as_deref(),
        settings.service,
    ))
}

/// Changes the log filter at runtime (e.g. `debug` or `info,tollgate::audit=off`).
pub fn set_log_filter(directives: &str) -> Result<(), String> {
    let filter = EnvFilter::try_new(directives).map_err(|e| e.to_string())?;
    let handle = FILTER.get().ok_or("logging is not initialised")?;
    handle.reload(filter).map_err(|e| e.to_string())
}

/// Flushes pending spans (called on shutdown; blocks until the exporter is done, so keep it off
/// the async workers).
pub fn shutdown() {
    if let Some(p) = PROVIDER.get() {
        let _ = p.shutdown();
    }
}

/// The span of one proxied request, continuing the caller's trace context.
pub fn request_span(method: &http::Method, path: &str, headers: &HeaderMap) -> Span {
    let span = tracing::info_span!(
        target: TRACE_TARGET,
        "proxy",
        otel.name = "tollgate proxy",
        otel.kind = "server",
        http.request.method = %method,
        url.path = %path,
        tollgate.decision = tracing::field::Empty,
        tollgate.rule = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    let parent = opentelemetry::global::get_text_map_propagator(|p| {
        p.extract(&opentelemetry_http::HeaderExtractor(headers))
    });
    let _ = span.set_parent(parent);
    span
}

/// Writes the current span's context (`traceparent`) into the upstream request's headers.
pub fn inject(span: &Span, headers: &mut HeaderMap) {
    let cx = span.context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut opentelemetry_http::HeaderInjector(headers))
    });
}

/// The trace id an audit line carries: the request span's when traces are on (it continues
/// the caller's context or starts one), else the caller's `traceparent`, if well formed.
pub fn trace_id(span: Option<&Span>, headers: &HeaderMap) -> Option<String> {
    use opentelemetry::trace::TraceContextExt as _;
    if let Some(span) = span {
        let cx = span.context();
        let id = cx.span().span_context().trace_id();
        if id != opentelemetry::trace::TraceId::INVALID {
            return Some(id.to_string());
        }
    }
    let value = headers.get("traceparent")?.to_str().ok()?;
    let mut fields = value.split('-');
    let (_version, id) = (fields.next()?, fields.next()?);
    let valid = id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        && id.bytes().any(|b| b != b'0');
    valid.then(|| id.to_string())
}

/// How logs are written: `--log-format` of every binary.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line, for log collectors.
    Json,
    /// Human-readable lines (`plain`, the controller's earlier name, is accepted too).
    #[value(alias = "plain")]
    Text,
}

/// Resolves on SIGTERM or Ctrl-C, and logs that the drain begins: every binary waits on this
/// before it stops accepting work.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
    tracing::info!("shutdown requested; draining");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(log_filter: &str) -> Settings<'_> {
        Settings {
            service: "t",
            log_filter,
            rust_log_wins: false,
            format: LogFormat::Json,
            json_span: false,
            otlp_endpoint: None,
            otlp_ca_file: None,
        }
    }

    /// A filter that does not parse leaves logs at `info` rather than off. (`RUST_LOG` itself is
    /// not touched: tests run in parallel in one process.)
    #[test]
    fn a_bad_log_filter_falls_back_to_info() {
        assert_eq!(log_filter(&settings("not a [filter")).to_string(), "info");
        assert_eq!(
            log_filter(&settings("warn,tollgate::audit=off")).to_string(),
            "tollgate::audit=off,warn"
        );
    }
}
