//! # iop-transport: QUIC plumbing shared by the Edge and Node shells
//!
//! * [`pki`]: the deployment PKI (dev CA, Edge server certificate, Node
//!   client certificates carrying `node://<id>`), and loading PEM files.
//! * [`identity`]: the node id a certificate carries.
//! * [`tls`] and [`endpoint`]: mutual-TLS quinn endpoints (ring provider,
//!   TLS 1.3, ALPN `iop/1`), [`QuicTuning`], and [`peer_node_id`].
//! * [`error`]: [`TransportError`], why an endpoint or a connection could
//!   not be made (shared by [`tls`] and [`endpoint`]).
//! * [`framed`]: typed messages over quinn streams as length-prefixed
//!   postcard frames; malformed frames stop only their stream with a typed
//!   code.
//! * [`close`]: closing a connection with a [`iop_wire::CloseCode`] and
//!   reading one back.
//! * [`settings`], [`logging`], [`signals`], [`clock`]: what both shells
//!   share beyond QUIC: config pieces, structured logs, graceful shutdown,
//!   and the one place wall time becomes a core instant.
//! * [`runtime`]: `[runtime]`, the async runtime each binary runs on (one
//!   worker per CPU, or every task on one thread).
//! * [`health_check`]: the one bounded HTTP `GET` behind `iop-edge health`
//!   and `iop-node health` (a scratch container's `HEALTHCHECK`).
//! * [`environment`]: configuration from the environment (the
//!   `IOP_EDGE__SECTION__FIELD` overlay, secrets named by `*_env` fields).
//! * [`config_file`]: the one way both binaries load their configuration
//!   (the file, the environment over it, its validation) and start `run`.
//! * [`telemetry`]: the metrics pipeline (Prometheus text and optional
//!   OTLP/HTTP export) both shells build their instruments on, and the
//!   process metrics and build info both binaries expose.
//! * [`traces`]: OpenTelemetry spans, their optional OTLP/HTTP export, and
//!   the W3C trace context that joins Edge and Node spans into one trace.
//!
//! Trust model (SPEC §3): both sides present certificates chained to one
//! deployment CA. The Edge takes a Node's identity from its verified
//! certificate, never from a message. A Node without an acceptable
//! certificate fails at `incoming.await` on the Edge; on the Node, TLS 1.3
//! lets [`connect`] succeed and the refusal surfaces on the first stream
//! read or write.
//!
//! Every rustls config here is built with [`tls::crypto_provider`] (ring).
//! The one process-wide install is the OTLP exporter's: its HTTP client
//! takes the process default, so enabling `[otlp]` installs ring as the
//! default (idempotent; the binaries install the same at start).

pub mod clock;
pub mod close;
pub mod config_file;
pub mod endpoint;
pub mod environment;
pub mod error;
pub mod framed;
pub mod health_check;
pub mod identity;
pub mod keyfile;
pub mod logging;
pub mod pki;
pub mod runtime;
pub mod settings;
pub mod signals;
pub mod telemetry;
pub mod tls;
pub mod traces;

pub use close::{close_code_of, close_connection};
pub use endpoint::{
    AckFrequency, Congestion, QuicTuning, TransportError, client_endpoint, client_endpoint_on,
    connect, peer_node_id, server_endpoint, server_endpoint_with_denylist,
};
pub use framed::{
    FrameLimits, FramedError, FramedRecv, FramedSend, accept_framed, framed_for_side, open_framed,
};
pub use identity::{IdentityError, cert_not_after_unix, node_id_from_cert, validate_node_id};
pub use pki::{
    DevPki, IssuedCert, NodeCertFiles, PkiError, Validity, generate_dev_pki,
    insecure_provided_secret_mode, insecure_secret_file_mode, issue_node_cert, load_ca,
    load_cert_chain, load_private_key,
};
pub use tls::{
    CertDenylist, ClientTls, ServerTls, cert_fingerprint, enforce_denylist, parse_fingerprint,
};
