//! Why the node could not start.

use std::net::SocketAddr;

/// Why the node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Certificates could not be loaded.
    #[error("tls: {0}")]
    Tls(#[from] iop_transport::PkiError),
    /// The QUIC endpoint could not be created.
    #[error("quic: {0}")]
    Transport(#[from] iop_transport::TransportError),
    /// The lease recipient key or the node identity could not be loaded.
    #[error("node identity or recipient key: {0}")]
    Credentials(String),
    /// The metrics pipeline (Prometheus or OTLP exporter) could not be built.
    #[error("metrics: {0}")]
    Metrics(#[from] iop_transport::telemetry::TelemetryError),
    /// The `[node] metrics_listen` address could not be bound.
    #[error("metrics listen address {addr}: {source}")]
    MetricsListen {
        /// The configured address.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
}
