//! Why an endpoint could not be built or a connection could not be made:
//! one error type for the TLS configs and the endpoints, so neither
//! module depends on the other for it.

use std::net::SocketAddr;

use iop_wire::CloseCode;
use quinn::crypto::rustls::NoInitialCipherSuite;

/// Why an endpoint could not be built or a connection could not be made.
///
/// `Local*`, trust-anchor, tuning and bind variants are this process's
/// configuration's fault; [`TransportError::Handshake`] is the peer's or the
/// network's.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// Our certificate, key or TLS settings were refused by rustls (e.g. the
    /// key does not match the certificate).
    #[error("local TLS configuration refused: {0}")]
    LocalTlsConfig(#[source] rustls::Error),
    /// The client-certificate verifier could not be built from the CA.
    #[error("cannot build the client certificate verifier: {0}")]
    ClientVerifier(#[source] rustls::server::VerifierBuilderError),
    /// No CA certificate was given: nobody could be verified.
    #[error("no CA certificate configured")]
    NoTrustAnchor,
    /// A CA certificate could not be used as a trust anchor.
    #[error("CA certificate unusable as a trust anchor: {0}")]
    InvalidTrustAnchor(#[source] rustls::Error),
    /// The TLS config lacks the cipher suite QUIC's initial packets need.
    #[error("TLS config unusable for QUIC: {0}")]
    NoInitialCipherSuite(#[source] NoInitialCipherSuite),
    /// A [`QuicTuning`](crate::QuicTuning) value is out of range.
    #[error("invalid QUIC tuning {field}: {reason}")]
    InvalidTuning {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The UDP socket could not be bound.
    #[error("cannot bind UDP {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The connection attempt could not start (bad server name, endpoint
    /// closing, ...): a local error.
    #[error("cannot start connecting: {0}")]
    Connect(#[source] quinn::ConnectError),
    /// The handshake failed: the peer refused us, its certificate failed
    /// verification, or the network is down.
    #[error("handshake failed{}: {source}", close_code.map(|c| format!(" ({c})")).unwrap_or_default())]
    Handshake {
        /// The peer's close code, when it closed with a known one.
        close_code: Option<CloseCode>,
        /// What quinn reported.
        source: quinn::ConnectionError,
    },
}
