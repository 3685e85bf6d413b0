//! Prometheus metrics, prefixed `tollgate_controller_`.
//!
//! Event counters (watch events, stream requests, acks, token reviews, status patches) and the
//! stream-lag histogram are updated where things happen. Gauges that describe the index
//! (version, policies, connected sidecars per policy, compile errors) are read from the index at
//! scrape time by [`IndexCollector`], so they can never drift from it.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::index::SharedIndex;

pub const PREFIX: &str = "tollgate_controller";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    kind: &'static str,
    event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    endpoint: &'static str,
    code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TypeLabels {
    r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
}

/// The controller's metrics. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Metrics {
    watch_events: Family<EventLabels, Counter>,
    watch_errors: Family<KindLabels, Counter>,
    requests: Family<CodeLabels, Counter>,
    streams_open: Gauge,
    stream_messages: Family<TypeLabels, Counter>,
    acks: Family<ResultLabels, Counter>,
    stream_lag: Histogram,
    token_reviews: Family<ResultLabels, Counter>,
    status_patches: Family<ResultLabels, Counter>,
    events: Family<ResultLabels, Counter>,
    leader: Gauge,
}

impl Metrics {
    /// Creates the metrics and a registry holding them plus the index collector.
    pub fn new(index: SharedIndex) -> (Metrics, Registry) {
        let mut registry = Registry::with_prefix(PREFIX);
        let m = Metrics {
            watch_events: Family::default(),
            watch_errors: Family::default(),
            requests: Family::default(),
            streams_open: Gauge::default(),
            stream_messages: Family::default(),
            acks: Family::default(),
            stream_lag: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            token_reviews: Family::default(),
            status_patches: Family::default(),
            events: Family::default(),
            leader: Gauge::default(),
        };
        let r = &mut registry;
        r.register(
            "watch_events",
            "Kubernetes watch events applied to the index, by kind (policy, pod) and event (apply, delete, resync)",
            m.watch_events.clone(),
        );
        r.register(
            "watch_errors",
            "Kubernetes watch errors by kind; the watch retries with backoff",
            m.watch_errors.clone(),
        );
        r.register(
            "http_requests",
            "Rule-stream server responses by endpoint and status code",
            m.requests.clone(),
        );
        r.register(
            "streams_open",
            "Rule streams currently open",
            m.streams_open.clone(),
        );
        r.register(
            "stream_messages",
            "Messages written to rule streams by type (snapshot, members, heartbeat)",
            m.stream_messages.clone(),
        );
        r.register(
            "acks",
            "Sidecar acks by result (ok, epoch_mismatch, future_version, unknown_pod)",
            m.acks.clone(),
        );
        r.register(
            "stream_lag_seconds",
            "Time from a policy change to the ack of the last connected sidecar it selects",
            m.stream_lag.clone(),
        );
        r.register(
            "token_reviews",
            "Bearer token checks by result (authenticated, rejected, error, cached)",
            m.token_reviews.clone(),
        );
        r.register(
            "status_patches",
            "RateLimitPolicy status patches by result (ok, error)",
            m.status_patches.clone(),
        );
        r.register(
            "events",
            "Kubernetes Events published by result (ok, error)",
            m.events.clone(),
        );
        r.register(
            "leader",
            "Whether this replica holds the leader lease and writes status (1) or not (0)",
            m.leader.clone(),
        );
        registry.register_collector(Box::new(IndexCollector { index }));
        (m, registry)
    }

    pub fn watch_event(&self, kind: &'static str, event: &'static str) {
        self.watch_events
            .get_or_create(&EventLabels { kind, event })
            .inc();
    }

    pub fn watch_error(&self, kind: &'static str) {
        self.watch_errors.get_or_create(&KindLabels { kind }).inc();
    }

    pub fn request(&self, endpoint: &'static str, code: u16) {
        self.requests
            .get_or_create(&CodeLabels { endpoint, code })
            .inc();
    }

    pub fn stream_opened(&self) {
        self.streams_open.inc();
    }

    pub fn stream_closed(&self) {
        self.streams_open.dec();
    }

    pub fn streams_open(&self) -> i64 {
        self.streams_open.get()
    }

    pub fn stream_message(&self, r#type: &'static str) {
        self.stream_messages
            .get_or_create(&TypeLabels { r#type })
            .inc();
    }

    pub fn ack(&self, result: &'static str) {
        self.acks.get_or_create(&ResultLabels { result }).inc();
    }

    pub fn stream_lag(&self, lag: Duration) {
        self.stream_lag.observe(lag.as_secs_f64());
    }

    pub fn token_review(&self, result: &'static str) {
        self.token_reviews
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    pub fn status_patch(&self, result: &'static str) {
        self.status_patches
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    pub fn event(&self, result: &'static str) {
        self.events.get_or_create(&ResultLabels { result }).inc();
    }

    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }
}

/// Encodes a registry in the OpenMetrics text format.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

/// Reads index gauges at scrape time.
#[derive(Debug)]
struct IndexCollector {
    index: SharedIndex,
}

impl Collector for IndexCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let s = self.index.read().summary();
        let gauge = |encoder: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64| {
            let g = ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX));
            let m = encoder.encode_descriptor(name, help, None, g.metric_type())?;
            g.encode(m)
        };
        gauge(
            &mut encoder,
            "index_version",
            "Global rules version: bumped whenever some pod's rule set changes",
            s.version,
        )?;
        gauge(
            &mut encoder,
            "policies",
            "RateLimitPolicies in the index",
            s.policies,
        )?;
        gauge(
            &mut encoder,
            "compile_errors",
            "Policies whose latest generation failed to compile (their last good version stays in force)",
            s.invalid_policies,
        )?;
        gauge(&mut encoder, "pods", "Pods in the index", s.pods)?;
        gauge(
            &mut encoder,
            "peer_replicas",
            "Other controller replicas whose membership reports this replica merges",
            s.peers,
        )?;

        let compiles: Family<ResultLabels, Counter> = Family::default();
        compiles
            .get_or_create(&ResultLabels { result: "ok" })
            .inc_by(s.stats.compiles_ok);
        compiles
            .get_or_create(&ResultLabels { result: "error" })
            .inc_by(s.stats.compiles_failed);
        let m = encoder.encode_descriptor(
            "compiles",
            "Policy compilations by result (ok, error); every watch delivery compiles",
            None,
            compiles.metric_type(),
        )?;
        compiles.encode(m)?;

        let connected: Family<PolicyLabels, Gauge> = Family::default();
        for (policy, n) in &s.connected {
            connected
                .get_or_create(&PolicyLabels {
                    policy: policy.clone(),
                })
                .set(i64::from(*n));
        }
        let m = encoder.encode_descriptor(
            "connected_sidecars",
            "Sidecars per policy with a rule stream to this replica (sum over replicas for the fleet)",
            None,
            connected.metric_type(),
        )?;
        connected.encode(m)?;
        Ok(())
    }
}

/// A guard that counts an open stream for as long as it lives.
#[derive(Debug)]
pub struct OpenStream(Arc<Metrics>);

impl OpenStream {
    pub fn new(metrics: Arc<Metrics>) -> OpenStream {
        metrics.stream_opened();
        OpenStream(metrics)
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.stream_closed();
    }
}
