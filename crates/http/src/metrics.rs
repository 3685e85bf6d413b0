//! The proxy's own metrics, registered in the engine's registry when the proxy is built: how
//! long the app took to answer, and how often it could not.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// Metrics of the upstream (the app behind the proxy).
#[derive(Clone)]
pub struct ProxyMetrics {
    pub upstream_seconds: Histogram,
    upstream_errors: Family<KindLabels, Counter>,
}

impl ProxyMetrics {
    pub fn register(registry: &mut Registry) -> ProxyMetrics {
        let m = ProxyMetrics {
            // 100 µs .. ~13 s.
            upstream_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 18)),
            upstream_errors: Family::default(),
        };
        registry.register(
            "upstream_duration_seconds",
            "Time until the upstream application returned response headers",
            m.upstream_seconds.clone(),
        );
        registry.register(
            "upstream_errors",
            "Requests the upstream could not serve, by kind (connect: 502, timeout: 504)",
            m.upstream_errors.clone(),
        );
        m
    }

    /// A request the app could not serve: `connect` (502) or `timeout` (504).
    pub fn upstream_error(&self, kind: &'static str) {
        self.upstream_errors
            .get_or_create(&KindLabels { kind })
            .inc();
    }
}
