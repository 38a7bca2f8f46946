//! `[edge]`: the listeners, this Edge's id among the Edges sharing a
//! journal, and the bounds on client and node connections and request
//! bodies (R-LIM-1, R-LIM-2).

use std::net::SocketAddr;
use std::path::PathBuf;

use iop_transport::settings::{ConfigError, field_err};
use serde::Deserialize;

/// `[edge]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeSection {
    /// QUIC listen address for nodes.
    #[serde(default = "default_quic_listen")]
    pub quic_listen: SocketAddr,
    /// HTTP listen address for clients.
    #[serde(default = "default_http_listen")]
    pub http_listen: SocketAddr,
    /// Serve `/metrics` on this address only (not on `http_listen`), e.g.
    /// a port only the scraper can reach (R-OBS-1, issue of exposure).
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// `/metrics` asks for an admin key (`Authorization: Bearer`).
    #[serde(default)]
    pub metrics_require_admin: bool,
    /// Where the generation high-water mark is kept.
    pub state_dir: PathBuf,
    /// Largest accepted HTTP request body.
    #[serde(default = "default_body_limit")]
    pub max_body_bytes: usize,
    /// Only nodes named by providers may register.
    #[serde(default = "yes")]
    pub restrict_nodes: bool,
    /// Client connections open at once; past it an idle one makes room or
    /// the newcomer gets a fast 503 (R-LIM-1).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// An HTTP/1 request head must arrive within this once hyper waits for
    /// it (after the first request, this also bounds keep-alive idleness).
    #[serde(default = "default_header_read_timeout_ms")]
    pub header_read_timeout_ms: u64,
    /// At shutdown, how long in-flight responses may take to finish.
    #[serde(default = "default_drain_timeout_ms")]
    pub drain_timeout_ms: u64,
    /// A response part must be taken by the client within this; a client
    /// that stays connected but stops reading is then dropped and its
    /// request's lease released (R-LIM-4).
    #[serde(default = "default_client_write_timeout_ms")]
    pub client_write_timeout_ms: u64,
    /// Longest silence on a streamed SSE answer (OpenAI and Anthropic
    /// APIs) before the Edge sends a keep-alive (a comment line; a `ping`
    /// event on the Messages API), so proxies and clients with read
    /// timeouts keep a parked or slow stream open.
    #[serde(default = "default_sse_keep_alive_ms")]
    pub sse_keep_alive_ms: u64,
    /// From accept to the first complete request head: first byte,
    /// HTTP/1-or-2 detection and headers (R-LIM-1).
    #[serde(default = "default_first_request_timeout_ms")]
    pub first_request_timeout_ms: u64,
    /// A client connection with no request in flight is closed after this
    /// (HTTP/1 keep-alive and HTTP/2 alike).
    #[serde(default = "default_idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// A client connection stops taking requests at this age and is closed
    /// `admission.request_budget_ms` later whatever it is doing.
    #[serde(default = "default_max_connection_age_ms")]
    pub max_connection_age_ms: u64,
    /// Client connections one source address may hold (its share of
    /// `max_connections`); defaults to a quarter of `max_connections`.
    /// Behind a reverse proxy every client has the proxy's address: set it
    /// to `max_connections` there.
    #[serde(default)]
    pub max_connections_per_source: Option<usize>,
    /// Concurrent streams on one HTTP/2 client connection.
    #[serde(default = "default_h2_max_concurrent_streams")]
    pub h2_max_concurrent_streams: u32,
    /// Memory request bodies may take at once across all connections,
    /// accounted as decoded (R-LIM-2); a request whose body does not fit
    /// gets a fast 503.
    #[serde(default = "default_request_memory_bytes")]
    pub request_memory_bytes: usize,
    /// The share of `request_memory_bytes` one principal (API key owner)
    /// may take; defaults to a quarter of it.
    #[serde(default)]
    pub request_memory_bytes_per_key: Option<usize>,
    /// A request body must arrive within this once its head has.
    #[serde(default = "default_body_read_timeout_ms")]
    pub body_read_timeout_ms: u64,
    /// SHA-256 fingerprints (hex, `:` optional) of node certificates the
    /// Edge refuses although they chain to the CA; re-read on SIGHUP.
    #[serde(default)]
    pub revoked_node_certificates: Vec<String>,
    /// Answer a new node connection with a QUIC Retry first, so its source
    /// address is proven before any handshake work (spoofed floods).
    #[serde(default = "yes")]
    pub quic_address_validation: bool,
    /// Node connections open (or handshaking) at once; past it new ones
    /// are refused.
    #[serde(default = "default_max_node_connections")]
    pub max_node_connections: usize,
    /// This Edge's id among the Edges that share one journal store
    /// (R-MULTI-1): the records it creates or takes over name it, and its
    /// ownership lease is kept under it (R-TAKE-1). Unique per Edge;
    /// required with `[journal] store = "nats"`, [`DEFAULT_EDGE_ID`] for a
    /// store only this Edge opens.
    #[serde(default)]
    pub edge_id: Option<String>,
}

/// The `edge_id` of an Edge whose journal store no other Edge opens.
pub const DEFAULT_EDGE_ID: &str = "local";

fn default_max_node_connections() -> usize {
    1024
}

/// Largest accepted `edge.max_node_connections`.
pub const MAX_NODE_CONNECTIONS_LIMIT: usize = 65_536;

impl EdgeSection {
    /// This Edge's id (`edge_id`, or [`DEFAULT_EDGE_ID`]).
    pub fn edge_id(&self) -> &str {
        self.edge_id.as_deref().unwrap_or(DEFAULT_EDGE_ID)
    }

    /// The parsed `revoked_node_certificates` (validated at load).
    pub fn revoked_fingerprints(&self) -> Vec<iop_transport::tls::CertFingerprint> {
        self.revoked_node_certificates
            .iter()
            .filter_map(|f| iop_transport::parse_fingerprint(f))
            .collect()
    }

    /// `request_memory_bytes_per_key`, with its default applied.
    pub fn request_memory_per_key(&self) -> usize {
        self.request_memory_bytes_per_key
            .unwrap_or(self.request_memory_bytes / 4)
    }

    /// `max_connections_per_source`, with its default applied.
    pub fn connections_per_source(&self) -> usize {
        self.max_connections_per_source
            .unwrap_or((self.max_connections / 4).max(1))
    }
}

fn default_first_request_timeout_ms() -> u64 {
    10_000
}
fn default_idle_timeout_ms() -> u64 {
    30_000
}
fn default_max_connection_age_ms() -> u64 {
    3_600_000
}
fn default_h2_max_concurrent_streams() -> u32 {
    100
}
fn default_request_memory_bytes() -> usize {
    1024 * 1024 * 1024
}
fn default_body_read_timeout_ms() -> u64 {
    30_000
}

/// Largest accepted `edge.request_memory_bytes` (one semaphore permit per
/// byte).
pub const MAX_REQUEST_MEMORY_BYTES_LIMIT: usize = 1 << 40;

/// Largest accepted `edge.h2_max_concurrent_streams`.
pub const MAX_H2_CONCURRENT_STREAMS_LIMIT: u32 = 10_000;

/// Largest accepted `edge.max_connections` (one semaphore permit each).
pub const MAX_CONNECTIONS_LIMIT: usize = 1_000_000;

/// Bytes of a node request frame kept for everything but the client's body
/// (run id, target, model, headers, credential lease, encoding overhead).
pub const WIRE_HEADROOM_BYTES: usize = 64 * 1024;

/// The largest `edge.max_body_bytes`: a request body must fit in one wire
/// frame ([`iop_wire::MAX_FRAME_LEN`]) with [`WIRE_HEADROOM_BYTES`] to spare.
pub const MAX_BODY_BYTES_LIMIT: usize = iop_wire::MAX_FRAME_LEN - WIRE_HEADROOM_BYTES;

fn default_max_connections() -> usize {
    4096
}
fn default_header_read_timeout_ms() -> u64 {
    // hyper starts this clock when it waits for the next HTTP/1 request
    // head, so it also bounds keep-alive idleness: the same as
    // `idle_timeout_ms`, long enough that pooled clients rarely reuse a
    // connection the Edge is closing.
    30_000
}
fn default_drain_timeout_ms() -> u64 {
    30_000
}
fn default_client_write_timeout_ms() -> u64 {
    30_000
}
fn default_sse_keep_alive_ms() -> u64 {
    15_000
}

impl EdgeSection {
    /// The limits of `[edge]`: the first field that is wrong, if any.
    pub(super) fn validate_limits(&self) -> Result<(), ConfigError> {
        if self
            .metrics_listen
            .is_some_and(|a| a == self.http_listen && a.port() != 0)
        {
            return Err(field_err(
                "edge.metrics_listen",
                "must differ from http_listen (leave it out to serve /metrics there)",
            ));
        }
        if self.max_body_bytes == 0 {
            return Err(field_err("edge.max_body_bytes", "must be > 0"));
        }
        if self.max_connections == 0 || self.max_connections > MAX_CONNECTIONS_LIMIT {
            return Err(field_err(
                "edge.max_connections",
                format!("must be between 1 and {MAX_CONNECTIONS_LIMIT}"),
            ));
        }
        if self.client_write_timeout_ms == 0 {
            return Err(field_err("edge.client_write_timeout_ms", "must be > 0"));
        }
        if self.header_read_timeout_ms == 0 {
            return Err(field_err("edge.header_read_timeout_ms", "must be > 0"));
        }
        validate_client_limits(self)?;
        if self.max_body_bytes > MAX_BODY_BYTES_LIMIT {
            return Err(field_err(
                "edge.max_body_bytes",
                format!(
                    "must be <= {MAX_BODY_BYTES_LIMIT}: a body travels to the node in one wire \
                     frame of at most {} bytes, with {WIRE_HEADROOM_BYTES} bytes kept for the \
                     rest of the request",
                    iop_wire::MAX_FRAME_LEN
                ),
            ));
        }
        Ok(())
    }
}

/// R-LIM-1/2: the client connection and body limits.
fn validate_client_limits(e: &EdgeSection) -> Result<(), ConfigError> {
    for (field, value) in [
        ("edge.first_request_timeout_ms", e.first_request_timeout_ms),
        ("edge.idle_timeout_ms", e.idle_timeout_ms),
        ("edge.max_connection_age_ms", e.max_connection_age_ms),
        ("edge.body_read_timeout_ms", e.body_read_timeout_ms),
        ("edge.sse_keep_alive_ms", e.sse_keep_alive_ms),
    ] {
        if value == 0 {
            return Err(field_err(field, "must be > 0"));
        }
    }
    if let Some(share) = e.max_connections_per_source
        && (share == 0 || share > e.max_connections)
    {
        return Err(field_err(
            "edge.max_connections_per_source",
            format!(
                "must be between 1 and edge.max_connections ({})",
                e.max_connections
            ),
        ));
    }
    for (i, f) in e.revoked_node_certificates.iter().enumerate() {
        if iop_transport::parse_fingerprint(f).is_none() {
            return Err(field_err(
                format!("edge.revoked_node_certificates[{i}]"),
                "must be a SHA-256 fingerprint: 64 hex digits, `:` optional",
            ));
        }
    }
    if e.max_node_connections == 0 || e.max_node_connections > MAX_NODE_CONNECTIONS_LIMIT {
        return Err(field_err(
            "edge.max_node_connections",
            format!("must be between 1 and {MAX_NODE_CONNECTIONS_LIMIT}"),
        ));
    }
    if e.h2_max_concurrent_streams == 0
        || e.h2_max_concurrent_streams > MAX_H2_CONCURRENT_STREAMS_LIMIT
    {
        return Err(field_err(
            "edge.h2_max_concurrent_streams",
            format!("must be between 1 and {MAX_H2_CONCURRENT_STREAMS_LIMIT}"),
        ));
    }
    // One body of the largest size, decoded, must fit both budgets.
    let one_body = iop_core::edge::limits::BodyRule::new(e.max_body_bytes).most_decoded_bytes();
    if e.request_memory_bytes < one_body || e.request_memory_bytes > MAX_REQUEST_MEMORY_BYTES_LIMIT
    {
        return Err(field_err(
            "edge.request_memory_bytes",
            format!(
                "must be between {one_body} (edge.max_body_bytes x {} decoded bytes per body \
                 byte) and {MAX_REQUEST_MEMORY_BYTES_LIMIT}",
                iop_core::edge::limits::DECODED_BYTES_PER_BODY_BYTE
            ),
        ));
    }
    let per_key = e.request_memory_per_key();
    if per_key < one_body || per_key > e.request_memory_bytes {
        return Err(field_err(
            "edge.request_memory_bytes_per_key",
            format!(
                "must be between {one_body} (one largest body, decoded) and \
                 edge.request_memory_bytes ({})",
                e.request_memory_bytes
            ),
        ));
    }
    Ok(())
}

fn default_quic_listen() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 7443))
}
fn default_http_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
}
fn default_body_limit() -> usize {
    8 * 1024 * 1024
}
fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use iop_transport::config_file::ConfigFile as _;
    use std::path::Path;

    use super::*;
    use crate::config::EdgeConfig;
    use crate::config::fixture::{BASE, field_of, parse};

    #[test]
    fn client_limits_have_defaults_and_bad_values_name_their_field() {
        // R-LIM-1, R-LIM-2.
        let c = parse("").unwrap();
        assert_eq!(c.edge.connections_per_source(), 1024);
        assert_eq!(c.edge.first_request_timeout_ms, 10_000);
        assert_eq!(c.edge.request_memory_bytes, 1024 * 1024 * 1024);
        assert_eq!(c.edge.request_memory_per_key(), 256 * 1024 * 1024);
        let edge = |line: &str| {
            let text = BASE.replace("[edge]\n", &format!("[edge]\n{line}\n"));
            EdgeConfig::parse(&text, Path::new("/etc/iop"))
        };
        for (line, field) in [
            (
                "first_request_timeout_ms = 0",
                "edge.first_request_timeout_ms",
            ),
            ("idle_timeout_ms = 0", "edge.idle_timeout_ms"),
            ("max_connection_age_ms = 0", "edge.max_connection_age_ms"),
            ("body_read_timeout_ms = 0", "edge.body_read_timeout_ms"),
            ("sse_keep_alive_ms = 0", "edge.sse_keep_alive_ms"),
            (
                "max_connections_per_source = 0",
                "edge.max_connections_per_source",
            ),
            (
                "max_connections_per_source = 4097",
                "edge.max_connections_per_source",
            ),
            (
                "h2_max_concurrent_streams = 0",
                "edge.h2_max_concurrent_streams",
            ),
            ("request_memory_bytes = 1024", "edge.request_memory_bytes"),
            (
                "request_memory_bytes = 99999999999999",
                "edge.request_memory_bytes",
            ),
            (
                "request_memory_bytes_per_key = 1024",
                "edge.request_memory_bytes_per_key",
            ),
            ("max_node_connections = 0", "edge.max_node_connections"),
            (
                "revoked_node_certificates = ['ab']",
                "edge.revoked_node_certificates[0]",
            ),
        ] {
            assert_eq!(field_of(edge(line).unwrap_err()), field, "{line}");
        }
        let c = edge("max_connections = 10\nmax_connections_per_source = 10").unwrap();
        assert_eq!(c.edge.connections_per_source(), 10);
    }

    #[test]
    fn max_body_bytes_leaves_room_in_one_wire_frame() {
        let with_body_limit = |bytes: usize| {
            let text = BASE.replace("[edge]\n", &format!("[edge]\nmax_body_bytes = {bytes}\n"));
            EdgeConfig::parse(&text, Path::new("/etc/iop"))
        };
        let c = with_body_limit(MAX_BODY_BYTES_LIMIT).unwrap();
        assert_eq!(c.edge.max_body_bytes, MAX_BODY_BYTES_LIMIT);
        for bad in [MAX_BODY_BYTES_LIMIT + 1, iop_wire::MAX_FRAME_LEN] {
            let e = with_body_limit(bad).unwrap_err();
            assert_eq!(field_of(e), "edge.max_body_bytes", "max_body_bytes = {bad}");
        }
    }
}
