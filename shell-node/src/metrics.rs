//! Node metrics: the stall watchdog's observations as OpenTelemetry
//! instruments, exported as Prometheus text on the optional
//! `[node] metrics_listen` address (R-OBS-1: closed label values only).

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, MeterProvider as _};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use prometheus::{Encoder, TextEncoder};

/// Every Node instrument.
pub struct NodeMetrics {
    registry: prometheus::Registry,
    _provider: SdkMeterProvider,
    stalls: Counter<u64>,
    credential_rejections: Counter<u64>,
    stall_duration: Histogram<f64>,
}

impl std::fmt::Debug for NodeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeMetrics").finish_non_exhaustive()
    }
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeMetrics {
    /// Build the instruments on a private registry.
    pub fn new() -> Self {
        let registry = prometheus::Registry::new();
        let provider = match opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_units()
            .without_target_info()
            .scope_info_enabled(false)
            .build()
        {
            Ok(exporter) => SdkMeterProvider::builder().with_reader(exporter).build(),
            Err(e) => {
                tracing::error!(event = "node_metrics_exporter_failed", error = %e);
                SdkMeterProvider::builder().build()
            }
        };
        let meter = provider.meter("iop-node");
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
            registry,
            _provider: provider,
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

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(event = "node_metrics_encode_failed", error = %e);
        }
        String::from_utf8(out).unwrap_or_default()
    }
}
