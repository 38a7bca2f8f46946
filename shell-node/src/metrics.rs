//! Node metrics: the stall watchdog's observations as OpenTelemetry
//! instruments, exported as Prometheus text on the optional
//! `[node] metrics_listen` address and over OTLP when `[otlp]` is set
//! (R-OBS-1: closed label values only).

use iop_transport::telemetry::MetricsPipeline;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram};

/// Reads one value off the link's shared state.
type ReadLink = fn(&crate::link::LinkShared) -> u64;

/// Every Node instrument.
pub struct NodeMetrics {
    pipeline: MetricsPipeline,
    stalls: Counter<u64>,
    credential_rejections: Counter<u64>,
    wire_protocol_errors: Counter<u64>,
    stall_duration: Histogram<f64>,
}

impl std::fmt::Debug for NodeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeMetrics").finish_non_exhaustive()
    }
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new(MetricsPipeline::prometheus_only("iop-node"))
    }
}

impl NodeMetrics {
    /// Build the instruments on `pipeline` (Prometheus, and OTLP when
    /// configured).
    pub fn new(pipeline: MetricsPipeline) -> Self {
        let meter = pipeline.meter("iop-node");
        Self {
            stalls: meter
                .u64_counter("iop_node_response_stalls")
                .with_description("Response stalls claimed by the watchdog (R-WD-2)")
                .build(),
            stall_duration: meter
                .f64_histogram("iop_node_response_stall_duration_seconds")
                .with_description("Time without progress when a stall was claimed")
                .with_boundaries(vec![
                    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                ])
                .build(),
            credential_rejections: meter
                .u64_counter("iop_node_credential_rejections")
                .with_description("Credential leases refused (R-CRED-3), by closed reason")
                .build(),
            wire_protocol_errors: meter
                .u64_counter("iop_node_wire_protocol_errors")
                .with_description(
                    "Malformed, oversize or truncated frames from the Edge; the stream or \
                     connection was closed with this code (SPEC §5)",
                )
                .build(),
            pipeline,
        }
    }

    /// One stall observation (closed labels only).
    pub fn stall(
        &self,
        kind: &'static str,
        health: &'static str,
        retryable: bool,
        elapsed_ms: u64,
    ) {
        let labels = [
            KeyValue::new("kind", kind),
            KeyValue::new("provider_health", health),
            KeyValue::new("retryable", if retryable { "true" } else { "false" }),
        ];
        self.stalls.add(1, &labels);
        self.stall_duration
            .record(elapsed_ms as f64 / 1000.0, &[KeyValue::new("kind", kind)]);
    }

    /// One refused credential lease (closed reason label only).
    pub fn credential_rejected(&self, reason: &'static str) {
        self.credential_rejections
            .add(1, &[KeyValue::new("reason", reason)]);
    }

    /// Count `error` if it is the peer's protocol error (a malformed,
    /// oversize or truncated frame), labelled with the code the stream was
    /// stopped with (a closed set). Other stream ends (resets, a lost
    /// connection) are not protocol errors and are not counted.
    pub fn wire_error(&self, error: &iop_transport::framed::FramedError) {
        if let iop_transport::framed::FramedError::PeerProtocol { code, .. } = error {
            self.wire_protocol_errors
                .add(1, &[KeyValue::new("code", code.as_str())]);
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        self.pipeline.render()
    }

    /// Gauges and counters read from the link's shared state at each
    /// collection: whether a connection is ready, and the connection and
    /// fencing counters. Holds only a weak reference (the state owns these
    /// metrics).
    pub fn observe_link(&self, shared: &std::sync::Arc<crate::link::LinkShared>) {
        use std::sync::atomic::Ordering;
        let meter = self.pipeline.meter("iop-node");
        let weak = std::sync::Arc::downgrade(shared);
        let read = move |f: ReadLink| {
            let weak = weak.clone();
            move || weak.upgrade().map(|s| f(&s))
        };
        let connected = read(|s| u64::from(s.ready.load(Ordering::Relaxed)));
        meter
            .u64_observable_gauge("iop_node_connected")
            .with_description("1 while a connection to the Edge is ready, else 0")
            .with_callback(move |o| {
                if let Some(v) = connected() {
                    o.observe(v, &[])
                }
            })
            .build();
        let counters: [(&'static str, &'static str, ReadLink); 3] = [
            (
                "iop_node_failed_connection_attempts",
                "Connection attempts that failed before readiness",
                |s| s.failed_attempts.load(Ordering::Relaxed),
            ),
            (
                "iop_node_disconnect_cancels",
                "Provider calls canceled because their connection ended (R-DISC-1)",
                |s| s.disconnect_cancels.load(Ordering::Relaxed),
            ),
            (
                "iop_node_fenced_late_outputs",
                "Provider outputs dropped after their run's terminal (R-WD-6)",
                |s| s.fenced_late_outputs.load(Ordering::Relaxed),
            ),
        ];
        for (name, description, f) in counters {
            let value = read(f);
            meter
                .u64_observable_counter(name)
                .with_description(description)
                .with_callback(move |o| {
                    if let Some(v) = value() {
                        o.observe(v, &[])
                    }
                })
                .build();
        }
    }

    /// The pipeline (OTLP flush and shutdown).
    pub fn pipeline(&self) -> &MetricsPipeline {
        &self.pipeline
    }
}
