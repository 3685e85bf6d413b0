//! The RLQS edge's own metrics, registered in the engine's registry when the edge is built:
//! the Envoy streams and the assignments they were given.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// Metrics of the RLQS edge: Envoy streams and the assignments they were given.
#[derive(Clone, Default)]
pub struct QuotaMetrics {
    /// Envoy RLQS streams connected to this replica.
    pub streams: Gauge,
    /// Envoy RLQS streams fleet-wide (every replica sharing Redis), as last read.
    pub fleet_streams: Gauge,
    /// Buckets this replica holds assignments for.
    pub buckets: Gauge,
    pub reports: Counter,
    answers: Family<KindLabels, Counter>,
}

impl QuotaMetrics {
    pub fn register(registry: &mut Registry) -> QuotaMetrics {
        let m = QuotaMetrics::default();
        registry.register(
            "rlqs_streams",
            "Envoy RLQS streams connected to this replica",
            m.streams.clone(),
        );
        registry.register(
            "rlqs_fleet_streams",
            "Envoy RLQS streams connected to any replica sharing this Redis, as last read",
            m.fleet_streams.clone(),
        );
        registry.register(
            "rlqs_buckets",
            "RLQS buckets this replica holds assignments for",
            m.buckets.clone(),
        );
        registry.register(
            "rlqs_bucket_reports",
            "Bucket usage reports received from Envoys",
            m.reports.clone(),
        );
        registry.register(
            "rlqs_actions",
            "Bucket actions sent to Envoys, by kind (token_bucket, deny_all, allow_all, abandon)",
            m.answers.clone(),
        );
        m
    }

    pub fn action(&self, kind: &'static str) {
        self.answers.get_or_create(&KindLabels { kind }).inc();
    }
}
