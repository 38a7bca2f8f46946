//! Edge metrics: OpenTelemetry instruments exported as Prometheus text at
//! `/metrics` (R-OBS-1). Every label value is a closed, low-cardinality
//! enum's `as_str()`; no key, run id, payload or other unbounded value ever
//! becomes a label.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use iop_transport::telemetry::MetricsPipeline;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};

/// Values the hub publishes for the gauges.
#[derive(Debug, Default)]
pub struct Gauges {
    /// Requests waiting for capacity.
    pub queue_depth: AtomicU64,
    /// Leases held.
    pub leases_in_use: AtomicU64,
    /// Nodes with a current connection.
    pub nodes_connected: AtomicU64,
    /// Messages ignored because their generation was fenced (monotonic).
    pub fenced_late_messages: AtomicU64,
}

/// Every Edge instrument.
pub struct EdgeMetrics {
    pipeline: MetricsPipeline,
    /// Published by the hub.
    pub gauges: Arc<Gauges>,
    requests: Counter<u64>,
    ttft: Histogram<f64>,
    duration: Histogram<f64>,
    heartbeat_timeouts: Counter<u64>,
    generation_fences: Counter<u64>,
    health_evidence: Counter<u64>,
    health_transitions: Counter<u64>,
    recovery_eligibility: Counter<u64>,
    recovery_results: Counter<u64>,
    _observers: (
        opentelemetry::metrics::ObservableGauge<u64>,
        opentelemetry::metrics::ObservableGauge<u64>,
        opentelemetry::metrics::ObservableGauge<u64>,
        opentelemetry::metrics::ObservableCounter<u64>,
    ),
}

impl std::fmt::Debug for EdgeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeMetrics").finish_non_exhaustive()
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

impl EdgeMetrics {
    /// Build the instruments on `pipeline` (Prometheus, and OTLP when
    /// configured).
    pub fn new(pipeline: MetricsPipeline) -> Arc<Self> {
        let meter = pipeline.meter("iop-edge");
        let gauges = Arc::new(Gauges::default());
        let g = gauges.clone();
        let _queue = meter
            .u64_observable_gauge("iop_edge_queue_depth")
            .with_description("Requests waiting for capacity")
            .with_callback(move |o| o.observe(g.queue_depth.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _leases = meter
            .u64_observable_gauge("iop_edge_leases_in_use")
            .with_description("Capacity leases held")
            .with_callback(move |o| o.observe(g.leases_in_use.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _nodes = meter
            .u64_observable_gauge("iop_edge_nodes_connected")
            .with_description("Nodes with a current connection")
            .with_callback(move |o| o.observe(g.nodes_connected.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _late = meter
            .u64_observable_counter("iop_edge_fenced_late_messages")
            .with_description("Messages ignored because their generation was fenced (R-GEN-3)")
            .with_callback(move |o| o.observe(g.fenced_late_messages.load(Ordering::Relaxed), &[]))
            .build();
        Arc::new(Self {
            requests: meter
                .u64_counter("iop_edge_requests")
                .with_description("Client requests by route class and outcome")
                .build(),
            ttft: meter
                .f64_histogram("iop_edge_request_ttft_seconds")
                .with_description("Time from request to the first committed content")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            duration: meter
                .f64_histogram("iop_edge_request_duration_seconds")
                .with_description("Total request time")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            heartbeat_timeouts: meter
                .u64_counter("iop_edge_heartbeat_timeouts")
                .with_description("Node connections closed for heartbeat_timeout (R-HB-2)")
                .build(),
            generation_fences: meter
                .u64_counter("iop_edge_generation_fences")
                .with_description("Generations fenced, by close reason (R-GEN-3)")
                .build(),
            health_evidence: meter
                .u64_counter("iop_edge_provider_health_evidence")
                .with_description(
                    "Validated stall evidence by health and overlay outcome (R-OVL-2)",
                )
                .build(),
            health_transitions: meter
                .u64_counter("iop_edge_provider_health_transitions")
                .with_description("Runtime overlay transitions (R-OVL-2, R-CAP-1)")
                .build(),
            recovery_eligibility: meter
                .u64_counter("iop_edge_liveness_recovery_eligibility")
                .with_description("Stream-gate recovery eligibility decisions (R-GATE-2)")
                .build(),
            recovery_results: meter
                .u64_counter("iop_edge_liveness_recovery_results")
                .with_description("Stream-gate recovery results (R-GATE-2)")
                .build(),
            gauges,
            pipeline,
            _observers: (_queue, _leases, _nodes, _late),
        })
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        self.pipeline.render()
    }

    /// The pipeline (OTLP flush and shutdown).
    pub fn pipeline(&self) -> &MetricsPipeline {
        &self.pipeline
    }

    /// One finished client request.
    pub fn request(&self, route: &'static str, outcome: &'static str, total: Duration) {
        let labels = [
            KeyValue::new("route", route),
            KeyValue::new("outcome", outcome),
        ];
        self.requests.add(1, &labels);
        self.duration.record(total.as_secs_f64(), &labels);
    }

    /// Time to first content of a request.
    pub fn ttft(&self, route: &'static str, ttft: Duration) {
        self.ttft
            .record(ttft.as_secs_f64(), &[KeyValue::new("route", route)]);
    }

    /// A generation was fenced.
    pub fn fence(&self, reason: &'static str) {
        self.generation_fences
            .add(1, &[KeyValue::new("reason", reason)]);
        if reason == "heartbeat_timeout" {
            self.heartbeat_timeouts.add(1, &[]);
        }
    }

    /// Stall evidence was validated and applied.
    pub fn health_evidence(&self, health: &'static str, outcome: &'static str) {
        self.health_evidence.add(
            1,
            &[
                KeyValue::new("health", health),
                KeyValue::new("outcome", outcome),
            ],
        );
    }

    /// The overlay changed.
    pub fn health_transition(&self, transition: &'static str) {
        self.health_transitions
            .add(1, &[KeyValue::new("transition", transition)]);
    }

    /// A gate recovery eligibility decision.
    pub fn recovery_eligibility(&self, eligibility: &'static str) {
        self.recovery_eligibility
            .add(1, &[KeyValue::new("eligibility", eligibility)]);
    }

    /// A gate recovery result.
    pub fn recovery_result(&self, result: &'static str) {
        self.recovery_results
            .add(1, &[KeyValue::new("result", result)]);
    }
}

/// The value of a metric line in a Prometheus text document, summed over
/// lines whose labels contain every `label=value` pair given (test and
/// `iop-edge status` helper).
pub fn scrape_value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b'{') | Some(b' '))
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
