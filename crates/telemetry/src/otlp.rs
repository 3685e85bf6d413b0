//! Trace export over OTLP/HTTP (protobuf) for both binaries.
//!
//! The exporter posts batches to `<endpoint>/v1/traces` from the SDK's own background thread
//! with a blocking HTTP client. `https://` endpoints are verified against the system's roots, or
//! only against the CA in `--otlp-ca-file` (else the standard
//! `OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE` / `OTEL_EXPORTER_OTLP_CERTIFICATE`). reqwest is built
//! without a crypto provider of its own: [`tracer_provider`] makes ring the process's provider
//! unless one is installed already (the binaries install ring at start-up too). A batch that
//! cannot be delivered is logged as an ERROR event (target `opentelemetry_sdk`, name
//! `BatchSpanProcessor.ExportError`), so a wrong endpoint or CA shows up in the logs.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The OpenTelemetry SDKs' standard endpoint variable, honoured when `--otlp-endpoint` is not
/// given.
pub const ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The standard variables naming the collector's CA, most specific first.
pub const CA_FILE_ENVS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
];
/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The endpoint traces go to: the flag, else [`ENDPOINT_ENV`]; `None` when neither is set (or
/// both are empty).
pub fn endpoint(flag: Option<&str>) -> Option<String> {
    flag.map(str::to_string)
        .or_else(|| std::env::var(ENDPOINT_ENV).ok())
        .filter(|s| !s.trim().is_empty())
}

/// The collector CA file: the flag, else the first of [`CA_FILE_ENVS`] that is set.
pub fn ca_file(flag: Option<&Path>) -> Option<PathBuf> {
    flag.map(Path::to_path_buf).or_else(|| {
        CA_FILE_ENVS
            .iter()
            .find_map(|v| std::env::var_os(v).filter(|s| !s.is_empty()))
            .map(PathBuf::from)
    })
}

/// A tracer provider exporting in batches to `<endpoint>/v1/traces` as `service`. Errors name
/// the flag and say what is wrong (unreadable CA, bad endpoint).
pub fn tracer_provider(
    endpoint: &str,
    ca_file: Option<&Path>,
    service: &str,
) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, String> {
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    let ca = match ca_file {
        None => None,
        Some(path) => {
            let pem = std::fs::read(path)
                .map_err(|e| format!("--otlp-ca-file {}: {e}", path.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("--otlp-ca-file {}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!(
                    "--otlp-ca-file {}: no PEM certificate in it",
                    path.display()
                ));
            }
            Some(certs)
        }
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    // A blocking client owns a runtime of its own, which must not be built (or dropped) on a
    // Tokio worker: build it on a thread of its own, as the exporter's default client is.
    let client = std::thread::spawn(move || {
        let builder = reqwest::blocking::Client::builder().timeout(EXPORT_TIMEOUT);
        match ca {
            Some(certs) => builder.tls_certs_only(certs),
            None => builder,
        }
        .build()
    })
    .join()
    .map_err(|_| "the OTLP HTTP client panicked while starting".to_string())?
    .map_err(|e| format!("OTLP HTTP client: {e}"))?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
        .build()
        .map_err(|e| format!("--otlp-endpoint {endpoint}: {e}"))?;
    Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service.to_string())
                .build(),
        )
        .build())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flags win; blank values count as unset. (The variables themselves are not touched: tests
    /// run in parallel in one process.)
    #[test]
    fn flags_win_and_blank_endpoints_are_unset() {
        assert_eq!(
            endpoint(Some("http://collector:4318")).as_deref(),
            Some("http://collector:4318")
        );
        assert_eq!(endpoint(Some(" ")), None);
        assert_eq!(
            ca_file(Some(Path::new("/etc/otel/ca.pem"))),
            Some(PathBuf::from("/etc/otel/ca.pem"))
        );
    }

    #[test]
    fn an_unusable_ca_file_is_a_clear_error() {
        let dir =
            std::env::temp_dir().join(format!("tollgate-telemetry-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        let err = tracer_provider("https://collector:4318", Some(&missing), "t").unwrap_err();
        assert!(
            err.starts_with("--otlp-ca-file") && err.contains("missing.pem"),
            "{err}"
        );
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = tracer_provider("https://collector:4318", Some(&empty), "t").unwrap_err();
        assert!(err.contains("no PEM certificate"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
