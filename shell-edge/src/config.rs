//! The Edge's TOML configuration, validated at load. Every error names the
//! field that is wrong.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use iop_core::edge::admission::{AdmissionConfig, ProviderSpec};
use iop_core::edge::gate::{GateBudget, GateBudgetError};
use iop_core::ids::{NodeId, ProviderId};
use iop_core::liveness::heartbeat::HeartbeatConfig;
use iop_transport::settings::{ConfigError, HeartbeatSection, TlsFiles, field_err, valid_name};
use iop_transport::telemetry::OtlpSection;
use iop_wire::{AdapterKind, MAX_RESPONSE_STALL_TIMEOUT_MS, MIN_RESPONSE_STALL_TIMEOUT_MS};
use serde::Deserialize;

use crate::catalog::model_matches;

/// How a provider's OpenAI traffic travels to its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ProviderMode {
    /// Parsed into a RunRequest; the node's adapter speaks to the provider.
    #[default]
    Normalized,
    /// The client's HTTP request is relayed to the provider as is.
    Tunnel,
}

/// One `[[providers]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderEntry {
    /// Stable id.
    pub id: String,
    /// Node id (as in the node's certificate).
    pub node: String,
    /// `openai`, `ollama` or `mock`.
    pub adapter: String,
    /// Target on the node.
    pub target: String,
    /// Models served.
    #[serde(default)]
    pub models: Vec<String>,
    /// Concurrent requests. Without it: what the node reports for the
    /// target (its `[[providers]] max_concurrent_runs`), else 4.
    #[serde(default)]
    pub capacity: Option<u32>,
    /// Stall timeout; 0 = 300000 ms.
    #[serde(default)]
    pub stall_timeout_ms: u64,
    /// `normalized` or `tunnel`.
    #[serde(default)]
    pub mode: ProviderMode,
    /// Managed credential profile (sealed lease per dispatch).
    #[serde(default)]
    pub credential: Option<String>,
    /// Route the models the provider reports (model discovery) without a
    /// `[[routes]]` entry; default true.
    #[serde(default = "default_true")]
    pub discover_models: bool,
}

fn default_true() -> bool {
    true
}

fn default_capacity() -> u32 {
    4
}

/// One `[[routes]]` entry: a model name to a provider pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteEntry {
    /// Model name clients ask for.
    pub model: String,
    /// Provider ids, in preference order.
    pub providers: Vec<String>,
    /// R-CONT-1: continue a committed answer on another provider of the
    /// pool when its own fails for good (default: `[admission]
    /// continuation`).
    #[serde(default)]
    pub continuation: Option<bool>,
}

/// `[discovered_models]`: what clients see of the models providers report
/// (model discovery, [`crate::catalog`]).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveredModelsSection {
    /// Discovered names (exact, or a prefix ending in `*`) neither listed
    /// nor routed by discovery.
    #[serde(default)]
    pub hide: Vec<String>,
    /// Discovered name = the name clients use for it; providers are still
    /// asked for the discovered name.
    #[serde(default)]
    pub rename: BTreeMap<String, String>,
}

/// One `[[api_keys]]` entry. The key itself comes from a file or the
/// environment, never from this file, and is never logged.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyEntry {
    /// Who this key belongs to.
    pub principal: String,
    /// Environment variable holding the key.
    #[serde(default)]
    pub key_env: Option<String>,
    /// File holding the key (first line).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Models the key may use; `["*"]` for all.
    #[serde(default = "all_models")]
    pub models: Vec<String>,
    /// May read `/status`.
    #[serde(default)]
    pub admin: bool,
}

fn all_models() -> Vec<String> {
    vec!["*".into()]
}

/// One `[[credentials]]` entry: a managed credential profile. The secret
/// comes from the environment or a file, never from this file, and is never
/// logged.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialEntry {
    /// Profile name providers refer to with `credential = "..."`.
    pub profile: String,
    /// Environment variable holding the secret.
    #[serde(default)]
    pub secret_env: Option<String>,
    /// File holding the secret (first line).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// Revision; bump it when the secret is rotated.
    #[serde(default = "one")]
    pub revision: u64,
    /// A disabled profile's leases are refused by every Node.
    #[serde(default)]
    pub disabled: bool,
}

fn one() -> u64 {
    1
}

/// A validated managed credential profile.
#[derive(Clone)]
pub struct CredentialProfile {
    /// Profile name.
    pub profile: String,
    /// The secret (never logged: Debug is redacted).
    pub secret: zeroize::Zeroizing<Vec<u8>>,
    /// Current revision.
    pub revision: u64,
    /// False when disabled (or revoked at runtime).
    pub active: bool,
}

impl std::fmt::Debug for CredentialProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialProfile")
            .field("profile", &self.profile)
            .field("secret", &"<redacted>")
            .field("revision", &self.revision)
            .field("active", &self.active)
            .finish()
    }
}

/// `[admission]`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionSection {
    /// Requests that may wait for capacity.
    pub queue_capacity: usize,
    /// How long one may wait.
    pub queue_timeout_ms: u64,
    /// Attempts per client request (first + re-admissions).
    pub max_attempts: u32,
    /// Total time budget per client request across attempts.
    pub request_budget_ms: u64,
    /// R-CONT-1: whether a committed answer whose provider fails for good
    /// continues on another provider of its pool, for routes that do not
    /// say (`[[routes]] continuation`). Off by default: the continued part
    /// comes from another model instance.
    pub continuation: bool,
}

impl AdmissionSection {
    /// The per-request budget of attempts and total time, as core's
    /// [`GateBudget`] (bounded by
    /// [`iop_core::edge::gate::MAX_ATTEMPTS_LIMIT`]).
    pub fn gate_budget(&self) -> Result<GateBudget, GateBudgetError> {
        GateBudget::new(
            self.max_attempts,
            Duration::from_millis(self.request_budget_ms),
        )
    }
}

/// Bytes of a node request frame kept for everything but the client's body
/// (run id, target, model, headers, credential lease, encoding overhead).
pub const WIRE_HEADROOM_BYTES: usize = 64 * 1024;

/// The largest `edge.max_body_bytes`: a request body must fit in one wire
/// frame ([`iop_wire::MAX_FRAME_LEN`]) with [`WIRE_HEADROOM_BYTES`] to spare.
pub const MAX_BODY_BYTES_LIMIT: usize = iop_wire::MAX_FRAME_LEN - WIRE_HEADROOM_BYTES;

impl Default for AdmissionSection {
    fn default() -> Self {
        Self {
            queue_capacity: 256,
            queue_timeout_ms: 30_000,
            max_attempts: 2,
            request_budget_ms: 600_000,
            continuation: false,
        }
    }
}

/// `[health]`: the provider health tracker (R-HT-3).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthSection {
    /// Regular capability refresh cadence.
    pub refresh_interval_ms: u64,
    /// First recovery backoff of a failing provider.
    pub backoff_base_ms: u64,
    /// Backoff cap during a long outage.
    pub backoff_cap_ms: u64,
    /// An `ok` older than this without a fresh success becomes `stale`.
    pub stale_after_ms: u64,
    /// Bound of one CAPABILITIES probe.
    pub probe_timeout_ms: u64,
}

impl HealthSection {
    /// The core's tracker settings.
    pub fn to_core(&self) -> iop_core::edge::health::HealthConfig {
        iop_core::edge::health::HealthConfig {
            refresh_interval: Duration::from_millis(self.refresh_interval_ms),
            backoff_base: Duration::from_millis(self.backoff_base_ms),
            backoff_cap: Duration::from_millis(self.backoff_cap_ms),
            stale_after: Duration::from_millis(self.stale_after_ms),
            probe_timeout: Duration::from_millis(self.probe_timeout_ms),
        }
    }
}

impl Default for HealthSection {
    fn default() -> Self {
        let d = iop_core::edge::health::HealthConfig::default();
        Self {
            refresh_interval_ms: d.refresh_interval.as_millis() as u64,
            backoff_base_ms: d.backoff_base.as_millis() as u64,
            backoff_cap_ms: d.backoff_cap.as_millis() as u64,
            stale_after_ms: d.stale_after.as_millis() as u64,
            probe_timeout_ms: d.probe_timeout.as_millis() as u64,
        }
    }
}

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

/// R-LIM-1/2: the client connection and body limits.
fn validate_client_limits(e: &EdgeSection) -> Result<(), ConfigError> {
    for (field, value) in [
        ("edge.first_request_timeout_ms", e.first_request_timeout_ms),
        ("edge.idle_timeout_ms", e.idle_timeout_ms),
        ("edge.max_connection_age_ms", e.max_connection_age_ms),
        ("edge.body_read_timeout_ms", e.body_read_timeout_ms),
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

/// The raw file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeFile {
    /// `[edge]`.
    pub edge: EdgeSection,
    /// `[tls]`.
    pub tls: TlsFiles,
    /// `[heartbeat]`.
    #[serde(default)]
    pub heartbeat: HeartbeatSection,
    /// `[admission]`.
    #[serde(default)]
    pub admission: AdmissionSection,
    /// `[health]`.
    #[serde(default)]
    pub health: HealthSection,
    /// `[[providers]]`.
    #[serde(default)]
    pub providers: Vec<ProviderEntry>,
    /// `[[routes]]`.
    #[serde(default)]
    pub routes: Vec<RouteEntry>,
    /// `[[api_keys]]`.
    #[serde(default)]
    pub api_keys: Vec<ApiKeyEntry>,
    /// `[discovered_models]`: hide or rename models providers report.
    #[serde(default)]
    pub discovered_models: DiscoveredModelsSection,
    /// `[[credentials]]`.
    #[serde(default)]
    pub credentials: Vec<CredentialEntry>,
    /// `[otlp]`: optional OTLP metrics export.
    #[serde(default)]
    pub otlp: Option<OtlpSection>,
    /// `[otlp_traces]`: optional OTLP span export.
    #[serde(default)]
    pub otlp_traces: Option<iop_transport::traces::OtlpTracesSection>,
    /// `[journal]`: where durable responses are kept (SPEC §6).
    #[serde(default)]
    pub journal: JournalSection,
}

/// Which store keeps the journal of durable responses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum JournalStoreKind {
    /// An embedded ACID store in one file under `state_dir` (the default:
    /// no server to run; survives a crash and a restart).
    #[default]
    Embedded,
    /// Process memory: lost at a restart. For tests and throwaway
    /// deployments only.
    Memory,
    /// NATS JetStream (`[journal.nats]`): one store shared by many Edges,
    /// so a client may resume on any Edge and any Edge takes over a dead
    /// one's responses (R-MULTI-1).
    Nats,
}

impl JournalStoreKind {
    /// The stable lower-case name (as configured).
    pub fn as_str(self) -> &'static str {
        match self {
            JournalStoreKind::Embedded => "embedded",
            JournalStoreKind::Memory => "memory",
            JournalStoreKind::Nats => "nats",
        }
    }

    /// Do other Edges open this store too?
    pub fn is_shared(self) -> bool {
        matches!(self, JournalStoreKind::Nats)
    }
}

/// `[journal.nats]`: the NATS JetStream store (`[journal] store =
/// "nats"`). Secrets never sit in the file: a password or token comes
/// from the environment variable named here, credentials from a file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSection {
    /// Server URLs (`nats://host:4222`, `tls://host:4222`), any of the
    /// cluster's; the client fails over between them.
    pub servers: Vec<String>,
    /// A NATS credentials file (user JWT and NKey seed).
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// A user name, with `password_env`.
    #[serde(default)]
    pub user: Option<String>,
    /// The environment variable holding `user`'s password.
    #[serde(default)]
    pub password_env: Option<String>,
    /// The environment variable holding a token.
    #[serde(default)]
    pub token_env: Option<String>,
    /// A PEM file of CA certificates to trust; TLS is then required.
    #[serde(default)]
    pub tls_ca_file: Option<PathBuf>,
    /// The stream of events and requests (created if missing).
    #[serde(default = "default_nats_stream")]
    pub stream: String,
    /// The key-value bucket of records, epochs, idempotency keys and
    /// ownership leases (created if missing).
    #[serde(default = "default_nats_bucket")]
    pub bucket: String,
    /// The stream's subjects: `<subject_prefix>.ev.<id>`, `.req.<id>`.
    #[serde(default = "default_nats_subject_prefix")]
    pub subject_prefix: String,
    /// Replicas of the stream and the bucket: 1, or 3 or 5 on a cluster.
    #[serde(default = "default_nats_replicas")]
    pub replicas: usize,
    /// The stream's byte limit (default four times `journal.max_bytes`).
    #[serde(default)]
    pub stream_max_bytes: Option<u64>,
    /// Room kept free in the stream for accepted records (default twice
    /// `journal.max_bytes`).
    #[serde(default)]
    pub stream_reserve_bytes: Option<u64>,
    /// The bucket's byte limit (default twice `journal.max_bytes`).
    #[serde(default)]
    pub bucket_max_bytes: Option<u64>,
    /// Room kept free in the bucket (default `journal.max_bytes`).
    #[serde(default)]
    pub bucket_reserve_bytes: Option<u64>,
    /// How long the Edge waits at start to connect and load the bucket.
    #[serde(default = "default_nats_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
    /// How long one server answer (an ack, a read) may take.
    #[serde(default = "default_nats_request_timeout_ms")]
    pub request_timeout_ms: u64,
    /// The largest message written (default: what the server allows).
    #[serde(default)]
    pub max_message_bytes: Option<usize>,
}

fn default_nats_stream() -> String {
    "IOP_JOURNAL".into()
}
fn default_nats_bucket() -> String {
    "iop_journal".into()
}
fn default_nats_subject_prefix() -> String {
    "iop.journal".into()
}
fn default_nats_replicas() -> usize {
    1
}
fn default_nats_connect_timeout_ms() -> u64 {
    10_000
}
fn default_nats_request_timeout_ms() -> u64 {
    5_000
}

impl NatsSection {
    /// The store's options: the secrets read from the environment, paths
    /// resolved against `base`. The error names the field.
    pub fn options(
        &self,
        limits: iop_core::journal::JournalLimits,
        base: &Path,
    ) -> Result<iop_store_nats::NatsOptions, ConfigError> {
        use iop_store_nats::NatsAuth;
        let f = |name: &str| format!("journal.nats.{name}");
        let secret = |field: &str, var: &str| -> Result<String, ConfigError> {
            match std::env::var(var) {
                Ok(v) if !v.trim().is_empty() => Ok(v.trim().to_owned()),
                _ => Err(field_err(
                    f(field),
                    format!("environment variable `{var}` is not set"),
                )),
            }
        };
        let resolve = |p: &Path| {
            if p.is_relative() {
                base.join(p)
            } else {
                p.to_path_buf()
            }
        };
        let ways = [
            self.credentials_file.is_some(),
            self.user.is_some() || self.password_env.is_some(),
            self.token_env.is_some(),
        ];
        if ways.iter().filter(|w| **w).count() > 1 {
            return Err(field_err(
                f("credentials_file"),
                "give one of credentials_file, user with password_env, token_env",
            ));
        }
        let auth = match (
            &self.credentials_file,
            &self.user,
            &self.password_env,
            &self.token_env,
        ) {
            (Some(path), ..) => NatsAuth::CredentialsFile(resolve(path)),
            (None, Some(user), Some(var), None) => NatsAuth::UserPassword {
                user: user.clone(),
                password: secret("password_env", var)?,
            },
            (None, Some(_), None, None) => {
                return Err(field_err(f("password_env"), "required with user"));
            }
            (None, None, Some(_), None) => {
                return Err(field_err(f("user"), "required with password_env"));
            }
            (None, None, None, Some(var)) => NatsAuth::Token(secret("token_env", var)?),
            _ => NatsAuth::None,
        };
        for (field, ms) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("request_timeout_ms", self.request_timeout_ms),
        ] {
            if !(100..=600_000).contains(&ms) {
                return Err(field_err(f(field), "must be between 100 and 600000"));
            }
        }
        // Secrets never sit in the file, nor in a URL (it is logged).
        if self.servers.iter().any(|s| s.contains('@')) {
            return Err(field_err(
                f("servers"),
                "a URL must not carry credentials: use credentials_file, user with \
                 password_env, or token_env",
            ));
        }
        let mut o = iop_store_nats::NatsOptions::new(self.servers.clone(), limits);
        o.auth = auth;
        o.tls_ca_file = self.tls_ca_file.as_deref().map(resolve);
        o.stream.clone_from(&self.stream);
        o.bucket.clone_from(&self.bucket);
        o.subject_prefix.clone_from(&self.subject_prefix);
        o.replicas = self.replicas;
        if let Some(n) = self.stream_max_bytes {
            o.stream_max_bytes = n;
        }
        if let Some(n) = self.stream_reserve_bytes {
            o.stream_reserve_bytes = n;
        }
        if let Some(n) = self.bucket_max_bytes {
            o.bucket_max_bytes = n;
        }
        if let Some(n) = self.bucket_reserve_bytes {
            o.bucket_reserve_bytes = n;
        }
        o.connect_timeout = Duration::from_millis(self.connect_timeout_ms);
        o.request_timeout = Duration::from_millis(self.request_timeout_ms);
        o.max_message_bytes = self.max_message_bytes;
        match o.validate() {
            Ok(()) => Ok(o),
            Err(iop_store_nats::ConnectError::Options { field, reason }) => {
                let field = match field {
                    "limits" => "journal.max_bytes".to_owned(),
                    "connect_timeout" => f("connect_timeout_ms"),
                    "request_timeout" => f("request_timeout_ms"),
                    other => f(other),
                };
                Err(field_err(field, reason))
            }
            Err(other) => Err(field_err(f("servers"), other.to_string())),
        }
    }
}

/// `[journal]`: durable responses (SPEC §6): stored and background
/// Responses, stored chat completions, `Idempotency-Key` requests.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalSection {
    /// The store.
    #[serde(default)]
    pub store: JournalStoreKind,
    /// The embedded store's file (default `<state_dir>/journal.redb`;
    /// relative paths resolve against the config file's directory).
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// Whether a Responses request that does not send `store` is stored
    /// (OpenAI's default is `true`).
    #[serde(default = "yes")]
    pub responses_store_default: bool,
    /// How long a finished response is kept, and its `Idempotency-Key`
    /// holds.
    #[serde(default = "default_journal_retention_ms")]
    pub retention_ms: u64,
    /// The store's bound in bytes: past it new durable requests get 503
    /// (accepted ones still finish, R-JRN-5).
    #[serde(default = "default_journal_max_bytes")]
    pub max_bytes: u64,
    /// The most bytes one response (its request and events) may hold.
    #[serde(default = "default_journal_max_record_bytes")]
    pub max_record_bytes: u64,
    /// How often expired responses are removed.
    #[serde(default = "default_journal_sweep_interval_ms")]
    pub sweep_interval_ms: u64,
    /// How long a node keeps a durable run going after losing its Edge
    /// connection, for an Edge to adopt it (R-PARK-1); after an Edge
    /// restart, records not adopted within it (plus a few seconds) end
    /// `incomplete`.
    #[serde(default = "default_park_grace_ms")]
    pub park_grace_ms: u64,
    /// The TTL of this Edge's ownership lease (R-TAKE-1): it is rewritten
    /// every third of it, and another Edge that sees it unchanged for this
    /// long takes this Edge's unfinished responses over (after the park
    /// window).
    #[serde(default = "default_lease_ttl_ms")]
    pub lease_ttl_ms: u64,
    /// How often unfinished records are scanned for orphans (a previous
    /// run's, a dead Edge's).
    #[serde(default = "default_takeover_scan_interval_ms")]
    pub takeover_scan_interval_ms: u64,
    /// `[journal.nats]`, with `store = "nats"`.
    #[serde(default)]
    pub nats: Option<NatsSection>,
}

fn default_lease_ttl_ms() -> u64 {
    15_000
}

fn default_takeover_scan_interval_ms() -> u64 {
    5_000
}

fn default_park_grace_ms() -> u64 {
    iop_wire::DEFAULT_PARK_GRACE_MS
}

impl Default for JournalSection {
    fn default() -> Self {
        JournalSection {
            store: JournalStoreKind::default(),
            path: None,
            responses_store_default: true,
            retention_ms: default_journal_retention_ms(),
            max_bytes: default_journal_max_bytes(),
            max_record_bytes: default_journal_max_record_bytes(),
            sweep_interval_ms: default_journal_sweep_interval_ms(),
            park_grace_ms: default_park_grace_ms(),
            lease_ttl_ms: default_lease_ttl_ms(),
            takeover_scan_interval_ms: default_takeover_scan_interval_ms(),
            nats: None,
        }
    }
}

fn default_journal_retention_ms() -> u64 {
    iop_core::journal::JournalLimits::default().retention_ms
}

fn default_journal_max_bytes() -> u64 {
    iop_core::journal::JournalLimits::default().max_bytes
}

fn default_journal_max_record_bytes() -> u64 {
    iop_core::journal::JournalLimits::default().max_record_bytes
}

fn default_journal_sweep_interval_ms() -> u64 {
    60_000
}

impl JournalSection {
    /// The journal's limits (validated against core's rules at load).
    pub fn limits(&self) -> iop_core::journal::JournalLimits {
        iop_core::journal::JournalLimits {
            retention_ms: self.retention_ms,
            max_bytes: self.max_bytes,
            max_record_bytes: self.max_record_bytes,
        }
    }

    /// The embedded store's file.
    pub fn file(&self, state_dir: &Path) -> PathBuf {
        self.path
            .clone()
            .unwrap_or_else(|| state_dir.join("journal.redb"))
    }

    /// How long an orphan waits for its node to report its run parked
    /// (R-PARK-2) before it ends `incomplete` (R-TAKE-1): the park grace
    /// and the slack for the reports.
    pub fn park_window(&self) -> Duration {
        Duration::from_millis(self.park_grace_ms) + iop_core::edge::request::PARK_REPORT_SLACK
    }

    fn validate(&mut self, base: &Path) -> Result<(), ConfigError> {
        use iop_core::journal::JournalLimitsError;
        if let Err(e) = self.limits().validate() {
            let field = match e {
                JournalLimitsError::Retention(_) => "journal.retention_ms",
                JournalLimitsError::MaxBytes { .. } => "journal.max_bytes",
                JournalLimitsError::MaxRecordBytes(_) => "journal.max_record_bytes",
            };
            return Err(field_err(field, e.to_string()));
        }
        if !(1000..=3_600_000).contains(&self.sweep_interval_ms) {
            return Err(field_err(
                "journal.sweep_interval_ms",
                "must be between 1000 and 3600000",
            ));
        }
        if !(100..=600_000).contains(&self.park_grace_ms) {
            return Err(field_err(
                "journal.park_grace_ms",
                "must be between 100 and 600000",
            ));
        }
        if let Some(path) = &mut self.path {
            if path.as_os_str().is_empty() {
                return Err(field_err("journal.path", "must not be empty"));
            }
            if path.is_relative() {
                *path = base.join(&*path);
            }
        }
        if !(iop_core::journal::MIN_LEASE_TTL_MS..=iop_core::journal::MAX_LEASE_TTL_MS)
            .contains(&self.lease_ttl_ms)
        {
            return Err(field_err(
                "journal.lease_ttl_ms",
                format!(
                    "must be between {} and {}",
                    iop_core::journal::MIN_LEASE_TTL_MS,
                    iop_core::journal::MAX_LEASE_TTL_MS
                ),
            ));
        }
        if !(100..=600_000).contains(&self.takeover_scan_interval_ms) {
            return Err(field_err(
                "journal.takeover_scan_interval_ms",
                "must be between 100 and 600000",
            ));
        }
        let limits = self.limits();
        match (self.store, &mut self.nats) {
            (JournalStoreKind::Nats, None) => {
                return Err(field_err(
                    "journal.nats",
                    "required with store = \"nats\" (at least `servers`)",
                ));
            }
            (JournalStoreKind::Nats, Some(nats)) => {
                // Checked now (secrets read, every option validated), so a
                // bad one is refused at load, by name; used at start.
                nats.options(limits, base)?;
                for p in [&mut nats.credentials_file, &mut nats.tls_ca_file]
                    .into_iter()
                    .flatten()
                {
                    if p.is_relative() {
                        *p = base.join(&*p);
                    }
                }
            }
            (_, Some(_)) => {
                return Err(field_err(
                    "journal.store",
                    "must be \"nats\" when [journal.nats] is given",
                ));
            }
            (_, None) => {}
        }
        Ok(())
    }
}

/// A validated provider.
#[derive(Debug, Clone)]
pub struct Provider {
    /// Core view.
    pub spec: ProviderSpec,
    /// Models served.
    pub models: Vec<String>,
    /// Transport mode.
    pub mode: ProviderMode,
    /// Managed credential profile.
    pub credential: Option<String>,
    /// Its reported models are routed without a `[[routes]]` entry.
    pub discover_models: bool,
    /// No `capacity` configured: its node's reported limit for the target,
    /// if any, is its capacity.
    pub capacity_from_node: bool,
}

/// A validated API key.
#[derive(Clone)]
pub struct ApiKey {
    /// Principal.
    pub principal: String,
    /// The secret (never logged: Debug is redacted).
    pub key: String,
    /// Allowed models (`*` = all).
    pub models: Vec<String>,
    /// May read `/status`.
    pub admin: bool,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("principal", &self.principal)
            .field("key", &"<redacted>")
            .field("models", &self.models)
            .finish()
    }
}

impl ApiKey {
    /// May this key use `model`?
    pub fn allows(&self, model: &str) -> bool {
        self.models.iter().any(|m| model_matches(m, model))
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    /// `[edge]`.
    pub edge: EdgeSection,
    /// `[tls]`.
    pub tls: TlsFiles,
    /// Heartbeat profile.
    pub heartbeat: HeartbeatConfig,
    /// QUIC settings from `[heartbeat] loss_detect_ms` (R-FAIL-2).
    pub quic_tuning: iop_transport::QuicTuning,
    /// Admission.
    pub admission: AdmissionSection,
    /// Health tracker.
    pub health: HealthSection,
    /// Providers.
    pub providers: Vec<Provider>,
    /// Routes: model -> provider pool.
    pub routes: Vec<(String, Vec<ProviderId>)>,
    /// Routes that say whether they continue answers (R-CONT-1).
    pub continuation_routes: Vec<(String, bool)>,
    /// `[discovered_models]`: hidden and renamed models.
    pub model_names: crate::catalog::ModelNames,
    /// API keys.
    pub api_keys: Vec<ApiKey>,
    /// Managed credential profiles.
    pub credentials: Vec<CredentialProfile>,
    /// OTLP metrics export (`None`: off).
    pub otlp: Option<OtlpSection>,
    /// OTLP span export (`None`: off).
    pub otlp_traces: Option<iop_transport::traces::OtlpTracesSection>,
    /// Durable responses.
    pub journal: JournalSection,
}

impl EdgeConfig {
    /// Load and validate a file. Relative paths resolve against the file's
    /// directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, base)
    }

    /// Parse and validate TOML text.
    pub fn parse(text: &str, base: &Path) -> Result<Self, ConfigError> {
        let file: EdgeFile = toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        Self::validate(file, base)
    }

    fn validate(mut file: EdgeFile, base: &Path) -> Result<Self, ConfigError> {
        file.heartbeat.validate("heartbeat")?;
        if let Some(traces) = &mut file.otlp_traces {
            traces.validate("otlp_traces")?;
        }
        if let Some(otlp) = &mut file.otlp {
            otlp.validate("otlp")?;
        }
        file.tls.resolve(base);
        file.journal.validate(base)?;
        match &file.edge.edge_id {
            Some(id) if !valid_name(id) => {
                return Err(field_err(
                    "edge.edge_id",
                    "must be 1-128 chars of [A-Za-z0-9._-]",
                ));
            }
            None if file.journal.store.is_shared() => {
                return Err(field_err(
                    "edge.edge_id",
                    "required with journal.store = \"nats\": each Edge sharing the store needs \
                     its own id",
                ));
            }
            _ => {}
        }
        if file.edge.state_dir.is_relative() {
            file.edge.state_dir = base.join(&file.edge.state_dir);
        }
        let a = &file.admission;
        if a.queue_capacity == 0 {
            return Err(field_err("admission.queue_capacity", "must be > 0"));
        }
        if a.queue_timeout_ms == 0 {
            return Err(field_err("admission.queue_timeout_ms", "must be > 0"));
        }
        // The request budget is core's (R-GATE-2): validate it with core's
        // own constructor so the driver can never be handed one it refuses.
        if let Err(e) = a.gate_budget() {
            let field = match e {
                GateBudgetError::MaxAttemptsOutOfRange(_) => "admission.max_attempts",
                GateBudgetError::ZeroTotal => "admission.request_budget_ms",
            };
            return Err(field_err(field, e.to_string()));
        }
        if file.edge.max_body_bytes == 0 {
            return Err(field_err("edge.max_body_bytes", "must be > 0"));
        }
        if file.edge.max_connections == 0 || file.edge.max_connections > MAX_CONNECTIONS_LIMIT {
            return Err(field_err(
                "edge.max_connections",
                format!("must be between 1 and {MAX_CONNECTIONS_LIMIT}"),
            ));
        }
        if file.edge.client_write_timeout_ms == 0 {
            return Err(field_err("edge.client_write_timeout_ms", "must be > 0"));
        }
        if file.edge.header_read_timeout_ms == 0 {
            return Err(field_err("edge.header_read_timeout_ms", "must be > 0"));
        }
        validate_client_limits(&file.edge)?;
        if file.edge.max_body_bytes > MAX_BODY_BYTES_LIMIT {
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

        let credentials = parse_credentials(&file.credentials, base)?;

        let mut ids = BTreeSet::new();
        let mut providers = Vec::new();
        for (i, p) in file.providers.iter().enumerate() {
            let f = |name: &str| format!("providers[{i}].{name}");
            if !valid_name(&p.id) {
                return Err(field_err(f("id"), "must be 1-128 chars of [A-Za-z0-9._-]"));
            }
            if !ids.insert(p.id.clone()) {
                return Err(field_err(
                    f("id"),
                    format!("duplicate provider id `{}`", p.id),
                ));
            }
            if !valid_name(&p.node) {
                return Err(field_err(
                    f("node"),
                    "must be 1-128 chars of [A-Za-z0-9._-]",
                ));
            }
            let adapter = AdapterKind::parse(&p.adapter).ok_or_else(|| {
                field_err(f("adapter"), "must be one of `openai`, `ollama`, `mock`")
            })?;
            if p.target.is_empty() {
                return Err(field_err(f("target"), "must not be empty"));
            }
            if p.capacity == Some(0) {
                return Err(field_err(f("capacity"), "must be > 0"));
            }
            if p.stall_timeout_ms != 0
                && !(MIN_RESPONSE_STALL_TIMEOUT_MS..=MAX_RESPONSE_STALL_TIMEOUT_MS)
                    .contains(&p.stall_timeout_ms)
            {
                return Err(field_err(
                    f("stall_timeout_ms"),
                    format!(
                        "must be 0 (default 300000) or between {MIN_RESPONSE_STALL_TIMEOUT_MS} and {MAX_RESPONSE_STALL_TIMEOUT_MS}"
                    ),
                ));
            }
            if let Some(profile) = &p.credential
                && !credentials.iter().any(|c| &c.profile == profile)
            {
                return Err(field_err(
                    f("credential"),
                    format!("unknown credential profile `{profile}`"),
                ));
            }
            providers.push(Provider {
                spec: ProviderSpec {
                    id: ProviderId::new(&p.id),
                    node: NodeId::new(&p.node),
                    adapter,
                    target: p.target.clone(),
                    capacity: p.capacity.unwrap_or_else(default_capacity),
                    stall_timeout_ms: p.stall_timeout_ms,
                },
                models: p.models.clone(),
                mode: p.mode,
                credential: p.credential.clone(),
                discover_models: p.discover_models,
                capacity_from_node: p.capacity.is_none(),
            });
        }

        let mut routes = Vec::new();
        let mut continuation_routes = Vec::new();
        let mut models = BTreeSet::new();
        for (i, r) in file.routes.iter().enumerate() {
            if r.model.is_empty() {
                return Err(field_err(format!("routes[{i}].model"), "must not be empty"));
            }
            if !models.insert(r.model.clone()) {
                return Err(field_err(
                    format!("routes[{i}].model"),
                    format!("duplicate route for model `{}`", r.model),
                ));
            }
            if r.providers.is_empty() {
                return Err(field_err(
                    format!("routes[{i}].providers"),
                    "must not be empty",
                ));
            }
            for (j, id) in r.providers.iter().enumerate() {
                if !ids.contains(id) {
                    return Err(field_err(
                        format!("routes[{i}].providers[{j}]"),
                        format!("unknown provider `{id}`"),
                    ));
                }
            }
            routes.push((
                r.model.clone(),
                r.providers.iter().map(ProviderId::new).collect::<Vec<_>>(),
            ));
            if let Some(continuation) = r.continuation {
                continuation_routes.push((r.model.clone(), continuation));
            }
        }
        // Providers' own model lists become implicit routes.
        for p in &providers {
            for m in &p.models {
                if models.contains(m) {
                    continue;
                }
                match routes.iter_mut().find(|(model, _)| model == m) {
                    Some((_, pool)) => pool.push(p.spec.id.clone()),
                    None => routes.push((m.clone(), vec![p.spec.id.clone()])),
                }
            }
        }

        let model_names = file.discovered_models.validate()?;

        let mut api_keys: Vec<ApiKey> = Vec::new();
        for (i, k) in file.api_keys.iter().enumerate() {
            let f = |name: &str| format!("api_keys[{i}].{name}");
            if k.principal.is_empty() {
                return Err(field_err(f("principal"), "must not be empty"));
            }
            // Errors name the field the key actually came from.
            let (key, source) = read_secret(
                k.key_env.as_deref(),
                k.key_file.as_deref(),
                base,
                ("key_env", "key_file"),
                &f,
            )?;
            let key: String = key.to_string();
            if key.len() < 16 {
                return Err(field_err(
                    f(source),
                    "the key must be at least 16 characters",
                ));
            }
            // Two entries with one key would silently share (or steal) a
            // principal; the error names the second entry, never the key.
            if let Some(first) = api_keys.iter().position(|a| a.key == key) {
                return Err(field_err(
                    f(source),
                    format!("the same key as api_keys[{first}]"),
                ));
            }
            api_keys.push(ApiKey {
                principal: k.principal.clone(),
                key,
                models: k.models.clone(),
                admin: k.admin,
            });
        }

        let health = file.health;
        // The rules are core's (`HealthConfig::validate_deployment`); the
        // error is given the field's name here.
        if let Err(e) = health.to_core().validate_deployment() {
            use iop_core::edge::health::HealthTrackerError as E;
            return Err(match e {
                E::ZeroDuration(name) => field_err(format!("health.{name}_ms"), "must be > 0"),
                E::BackoffBaseAboveCap => {
                    field_err("health.backoff_cap_ms", "must be >= health.backoff_base_ms")
                }
                E::StaleBeforeNextProbe => field_err(
                    "health.stale_after_ms",
                    "must be > health.refresh_interval_ms + health.probe_timeout_ms",
                ),
                other => field_err("health", other.to_string()),
            });
        }
        Ok(Self {
            heartbeat: file.heartbeat.to_core(),
            quic_tuning: file.heartbeat.quic_tuning(),
            admission: file.admission,
            health,
            edge: file.edge,
            tls: file.tls,
            providers,
            routes,
            continuation_routes,
            model_names,
            api_keys,
            credentials,
            otlp: file.otlp,
            otlp_traces: file.otlp_traces,
            journal: file.journal,
        })
    }

    /// Re-read only the `[[credentials]]` section of the file at `path`
    /// (secrets, revisions, disabled flags), for a reload (SIGHUP).
    pub fn load_credentials(path: &Path) -> Result<Vec<CredentialProfile>, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let file: EdgeFile =
            toml::from_str(&text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        parse_credentials(&file.credentials, base)
    }

    /// The core's health tracker settings.
    pub fn health_config(&self) -> iop_core::edge::health::HealthConfig {
        self.health.to_core()
    }

    /// The core's admission bounds.
    pub fn admission_config(&self) -> AdmissionConfig {
        AdmissionConfig {
            queue_capacity: self.admission.queue_capacity,
            queue_timeout: Duration::from_millis(self.admission.queue_timeout_ms),
        }
    }

    /// Providers without a configured `capacity`: their node's reported
    /// limit for the target becomes their capacity.
    pub fn capacity_from_node(&self) -> BTreeSet<ProviderId> {
        self.providers
            .iter()
            .filter(|p| p.capacity_from_node)
            .map(|p| p.spec.id.clone())
            .collect()
    }

    /// Node ids named by providers.
    pub fn known_nodes(&self) -> BTreeSet<NodeId> {
        self.providers.iter().map(|p| p.spec.node.clone()).collect()
    }

    /// The provider pool serving `model`: an exact route, else the longest
    /// prefix route (`model = "llama3*"`).
    pub fn route(&self, model: &str) -> Option<&[ProviderId]> {
        if let Some((_, pool)) = self.routes.iter().find(|(m, _)| m == model) {
            return Some(pool);
        }
        self.routes
            .iter()
            .filter(|(m, _)| m.ends_with('*') && model_matches(m, model))
            .max_by_key(|(m, _)| m.len())
            .map(|(_, pool)| pool.as_slice())
    }

    /// Whether answers of `model` continue on another provider when theirs
    /// fails after commit (R-CONT-1): its route's setting (exact, else the
    /// longest matching pattern), else `[admission] continuation`.
    pub fn continuation_for(&self, model: &str) -> bool {
        if let Some((_, c)) = self.continuation_routes.iter().find(|(m, _)| m == model) {
            return *c;
        }
        self.continuation_routes
            .iter()
            .filter(|(m, _)| m.ends_with('*') && model_matches(m, model))
            .max_by_key(|(m, _)| m.len())
            .map_or(self.admission.continuation, |(_, c)| *c)
    }

    /// The pool of an exact `[[routes]]` entry for `model` (a pin: it wins
    /// over discovered models).
    pub fn exact_route(&self, model: &str) -> Option<&[ProviderId]> {
        self.routes
            .iter()
            .find(|(m, _)| m == model)
            .map(|(_, pool)| pool.as_slice())
    }

    /// Model names to list (exact routes only, not prefix patterns).
    pub fn listed_models(&self) -> impl Iterator<Item = &str> {
        self.routes
            .iter()
            .map(|(m, _)| m.as_str())
            .filter(|m| !m.ends_with('*'))
    }

    /// A provider by id.
    pub fn provider(&self, id: &ProviderId) -> Option<&Provider> {
        self.providers.iter().find(|p| &p.spec.id == id)
    }
}

fn parse_credentials(
    entries: &[CredentialEntry],
    base: &Path,
) -> Result<Vec<CredentialProfile>, ConfigError> {
    let mut out: Vec<CredentialProfile> = Vec::new();
    for (i, c) in entries.iter().enumerate() {
        let f = |name: &str| format!("credentials[{i}].{name}");
        if !valid_name(&c.profile) {
            return Err(field_err(
                f("profile"),
                "must be 1-128 chars of [A-Za-z0-9._-]",
            ));
        }
        if out.iter().any(|p| p.profile == c.profile) {
            return Err(field_err(
                f("profile"),
                format!("duplicate credential profile `{}`", c.profile),
            ));
        }
        let (secret, source) = read_secret(
            c.secret_env.as_deref(),
            c.secret_file.as_deref(),
            base,
            ("secret_env", "secret_file"),
            &f,
        )?;
        let secret = zeroize::Zeroizing::new(secret.as_bytes().to_vec());
        if secret.is_empty() || secret.len() > iop_core::cred::MAX_SECRET_BYTES {
            return Err(field_err(
                f(source),
                format!(
                    "the secret must be 1 to {} bytes",
                    iop_core::cred::MAX_SECRET_BYTES
                ),
            ));
        }
        if c.revision == 0 {
            return Err(field_err(f("revision"), "must be > 0"));
        }
        out.push(CredentialProfile {
            profile: c.profile.clone(),
            secret,
            revision: c.revision,
            active: !c.disabled,
        });
    }
    Ok(out)
}

impl DiscoveredModelsSection {
    /// The names, or the first field that is wrong.
    fn validate(&self) -> Result<crate::catalog::ModelNames, ConfigError> {
        for (i, pattern) in self.hide.iter().enumerate() {
            let field = format!("discovered_models.hide[{i}]");
            if pattern.is_empty() || pattern == "*" {
                return Err(field_err(
                    field,
                    "must name models (exact, or a prefix ending in `*`), not be empty or `*`",
                ));
            }
            if pattern.trim_end_matches('*').contains('*') {
                return Err(field_err(field, "`*` may only end a pattern"));
            }
        }
        let mut targets = BTreeSet::new();
        for (from, to) in &self.rename {
            let field = format!("discovered_models.rename.{from:?}");
            if from.is_empty() || from.contains('*') || to.is_empty() || to.contains('*') {
                return Err(field_err(
                    field,
                    "both names must be non-empty and without `*`",
                ));
            }
            if from == to {
                return Err(field_err(field, "renames a model to its own name"));
            }
            if !targets.insert(to.as_str()) {
                return Err(field_err(
                    field,
                    format!("`{to}` is already the new name of another model"),
                ));
            }
            if self.rename.contains_key(to) {
                return Err(field_err(
                    field,
                    format!("`{to}` is itself renamed; renames do not chain"),
                ));
            }
        }
        Ok(crate::catalog::ModelNames::new(
            self.hide.clone(),
            self.rename.clone(),
        ))
    }
}

/// A key or secret from exactly one of an environment variable or a file
/// (its first line, trimmed), and the field it came from. Errors name that
/// field and never show the value.
fn read_secret(
    env: Option<&str>,
    file: Option<&Path>,
    base: &Path,
    (env_field, file_field): (&'static str, &'static str),
    f: &dyn Fn(&str) -> String,
) -> Result<(zeroize::Zeroizing<String>, &'static str), ConfigError> {
    match (env, file) {
        (Some(var), None) => {
            let value = std::env::var(var).map_err(|_| {
                field_err(
                    f(env_field),
                    format!("environment variable `{var}` is not set"),
                )
            })?;
            // Trimmed as a file's line is, and as a presented key is.
            Ok((zeroize::Zeroizing::new(value.trim().to_owned()), env_field))
        }
        (None, Some(path)) => {
            let path = if path.is_relative() {
                base.join(path)
            } else {
                path.to_path_buf()
            };
            match iop_transport::insecure_secret_file_mode(&path) {
                Ok(None) => {}
                Ok(Some(mode)) => {
                    return Err(field_err(
                        f(file_field),
                        format!(
                            "{} has mode {mode:o}: a secret file must not be readable by its \
                             group or others (chmod 600)",
                            path.display()
                        ),
                    ));
                }
                Err(e) => {
                    return Err(field_err(
                        f(file_field),
                        format!("cannot read {}: {}", path.display(), e.kind()),
                    ));
                }
            }
            let text = zeroize::Zeroizing::new(std::fs::read_to_string(&path).map_err(|e| {
                field_err(
                    f(file_field),
                    format!("cannot read {}: {}", path.display(), e.kind()),
                )
            })?);
            let first = text.lines().next().unwrap_or("").trim().to_owned();
            Ok((zeroize::Zeroizing::new(first), file_field))
        }
        _ => Err(field_err(
            f(env_field),
            format!("exactly one of `{env_field}` or `{file_field}` must be set"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[edge]
state_dir = "state"
[tls]
ca = "ca.pem"
cert = "edge.pem"
key = "edge.key"
"#;

    fn parse(extra: &str) -> Result<EdgeConfig, ConfigError> {
        EdgeConfig::parse(&format!("{BASE}{extra}"), Path::new("/etc/iop"))
    }

    /// A secret file as an operator must write it: mode 0600.
    fn write_secret(path: &Path, text: &str) {
        use std::os::unix::fs::OpenOptionsExt as _;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
            .unwrap();
        std::io::Write::write_all(&mut file, text.as_bytes()).unwrap();
    }

    fn field_of(e: ConfigError) -> String {
        match e {
            ConfigError::Field { field, .. } => field,
            other => panic!("expected a field error, got {other}"),
        }
    }

    #[test]
    fn defaults_are_production_values() {
        let c = parse("").unwrap();
        assert_eq!(c.heartbeat, HeartbeatConfig::default());
        assert_eq!(c.tls.ca, Path::new("/etc/iop/ca.pem"));
        assert_eq!(c.admission.queue_capacity, 256);
        assert!(c.otlp.is_none(), "OTLP export is off unless configured");
        let c = parse("[otlp]\nendpoint = 'http://collector:4318'\n").unwrap();
        let otlp = c.otlp.unwrap();
        assert_eq!(otlp.endpoint, "http://collector:4318/v1/metrics");
        assert_eq!((otlp.interval_ms, otlp.timeout_ms), (15_000, 5_000));
    }

    #[test]
    fn errors_name_the_bad_field() {
        let e = parse("[heartbeat]\ninterval_ms = 0\n").unwrap_err();
        assert_eq!(field_of(e), "heartbeat.interval_ms");
        let e = parse("[[providers]]\nid='a'\nnode='n'\nadapter='nope'\ntarget='t'\n").unwrap_err();
        assert_eq!(field_of(e), "providers[0].adapter");
        let e = parse(
            "[[providers]]\nid='a'\nnode='n'\nadapter='mock'\ntarget='t'\nstall_timeout_ms=5\n",
        )
        .unwrap_err();
        assert_eq!(field_of(e), "providers[0].stall_timeout_ms");
        let e = parse("[[routes]]\nmodel='m'\nproviders=['ghost']\n").unwrap_err();
        assert_eq!(field_of(e), "routes[0].providers[0]");
        for bad in ["0", "99999999999"] {
            let text = BASE.replace(
                "state_dir = \"state\"",
                &format!("state_dir = \"state\"\nmax_connections = {bad}"),
            );
            let e = EdgeConfig::parse(&text, Path::new("/etc/iop")).unwrap_err();
            assert_eq!(field_of(e), "edge.max_connections");
        }
        let e = parse("[otlp]\nendpoint = 'collector:4318'\n").unwrap_err();
        assert_eq!(field_of(e), "otlp.endpoint");
        let e = parse("[otlp]\nendpoint = 'http://c:4318'\ninterval_ms = 1\n").unwrap_err();
        assert_eq!(field_of(e), "otlp.interval_ms");
    }

    #[test]
    fn a_secret_file_readable_by_its_group_or_others_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        write_secret(&path, "sk-team-key-0123456789\n");
        let parse_in = |extra: &str| EdgeConfig::parse(&format!("{BASE}{extra}"), dir.path());
        parse_in("[[api_keys]]\nprincipal='a'\nkey_file='k'\n").unwrap();
        for mode in [0o640, 0o604] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = parse_in("[[api_keys]]\nprincipal='a'\nkey_file='k'\n").unwrap_err();
            assert!(e.to_string().contains("chmod 600"), "{e}");
            assert_eq!(field_of(e), "api_keys[0].key_file");
        }
    }

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
    fn unknown_fields_are_refused_with_their_name() {
        let e = parse("[admission]\nqueue_size = 3\n").unwrap_err();
        assert!(e.to_string().contains("queue_size"), "{e}");
    }

    #[test]
    fn stale_after_must_exceed_refresh_interval_plus_probe_timeout() {
        let health = |stale: u64| {
            parse(&format!(
                "[health]\nrefresh_interval_ms = 1000\nprobe_timeout_ms = 500\nstale_after_ms = {stale}\n"
            ))
        };
        assert_eq!(field_of(health(1500).unwrap_err()), "health.stale_after_ms");
        assert_eq!(field_of(health(900).unwrap_err()), "health.stale_after_ms");
        assert_eq!(health(1501).unwrap().health.stale_after_ms, 1501);
    }

    #[test]
    fn provider_models_become_routes() {
        let c = parse(
            "[[providers]]\nid='a'\nnode='n'\nadapter='mock'\ntarget='t'\nmodels=['m1']\n\
             [[providers]]\nid='b'\nnode='n2'\nadapter='mock'\ntarget='t'\nmodels=['m1']\n",
        )
        .unwrap();
        assert_eq!(
            c.route("m1").unwrap(),
            &[ProviderId::from("a"), ProviderId::from("b")]
        );
        assert!(c.route("m2").is_none());
    }

    #[test]
    fn discovered_model_names_are_validated_by_field() {
        let ok = parse(
            "[discovered_models]\nhide = ['embed*', 'x']\n\
             [discovered_models.rename]\n'llama3.2:1b' = 'fast'\n",
        )
        .unwrap();
        assert_eq!(ok.model_names.provider_model("fast"), "llama3.2:1b");
        assert_eq!(ok.model_names.client_name("embed-1"), None);
        for (extra, field) in [
            (
                "[discovered_models]\nhide = ['*']\n",
                "discovered_models.hide[0]",
            ),
            (
                "[discovered_models]\nhide = ['a', '']\n",
                "discovered_models.hide[1]",
            ),
            (
                "[discovered_models]\nhide = ['*a']\n",
                "discovered_models.hide[0]",
            ),
            (
                "[discovered_models.rename]\na = 'a'\n",
                "discovered_models.rename.\"a\"",
            ),
            (
                "[discovered_models.rename]\na = 'c'\nb = 'c'\n",
                "discovered_models.rename.\"b\"",
            ),
            (
                "[discovered_models.rename]\na = 'b'\nb = 'c'\n",
                "discovered_models.rename.\"a\"",
            ),
            (
                "[discovered_models.rename]\n'a*' = 'b'\n",
                "discovered_models.rename.\"a*\"",
            ),
        ] {
            assert_eq!(field_of(parse(extra).unwrap_err()), field, "{extra}");
        }
    }

    #[test]
    fn prefix_routes_match_after_exact_ones() {
        let c = parse(
            "[[providers]]\nid='a'\nnode='n'\nadapter='mock'\ntarget='t'\n\
             [[providers]]\nid='b'\nnode='n'\nadapter='mock'\ntarget='u'\n\
             [[routes]]\nmodel='llama*'\nproviders=['a']\n\
             [[routes]]\nmodel='llama3'\nproviders=['b']\n",
        )
        .unwrap();
        assert_eq!(c.route("llama3").unwrap(), &[ProviderId::from("b")]);
        assert_eq!(c.route("llama3.1").unwrap(), &[ProviderId::from("a")]);
        assert!(c.route("mistral").is_none());
        assert_eq!(c.listed_models().collect::<Vec<_>>(), vec!["llama3"]);
    }

    #[test]
    fn credentials_are_validated_by_field_and_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        write_secret(&dir.path().join("cred"), "sk-managed-secret\n");
        let parse_in = |extra: &str| EdgeConfig::parse(&format!("{BASE}{extra}"), dir.path());
        let c = parse_in(
            "[[credentials]]\nprofile='k'\nsecret_file='cred'\nrevision=3\n\
             [[providers]]\nid='a'\nnode='n'\nadapter='openai'\ntarget='t'\ncredential='k'\n",
        )
        .unwrap();
        assert_eq!(c.credentials[0].secret.as_slice(), b"sk-managed-secret");
        assert_eq!(c.credentials[0].revision, 3);
        assert!(c.credentials[0].active);
        assert!(!format!("{c:?}").contains("sk-managed-secret"));
        let e = parse_in(
            "[[providers]]\nid='a'\nnode='n'\nadapter='openai'\ntarget='t'\ncredential='ghost'\n",
        )
        .unwrap_err();
        assert_eq!(field_of(e), "providers[0].credential");
        let e = parse_in("[[credentials]]\nprofile='k'\n").unwrap_err();
        assert_eq!(field_of(e), "credentials[0].secret_env");
        let e = parse_in("[[credentials]]\nprofile='k'\nsecret_file='cred'\nsecret_env='X'\n")
            .unwrap_err();
        assert_eq!(field_of(e), "credentials[0].secret_env");
        let e = parse_in("[[credentials]]\nprofile='k'\nsecret_file='missing'\n").unwrap_err();
        assert_eq!(field_of(e), "credentials[0].secret_file");
        let e = parse_in(
            "[[credentials]]\nprofile='k'\nsecret_file='cred'\n[[credentials]]\nprofile='k'\nsecret_file='cred'\n",
        )
        .unwrap_err();
        assert_eq!(field_of(e), "credentials[1].profile");
        let c =
            parse_in("[[credentials]]\nprofile='k'\nsecret_file='cred'\ndisabled=true\n").unwrap();
        assert!(!c.credentials[0].active);
    }

    #[test]
    fn request_budget_is_validated_against_cores_limits() {
        let limit = iop_core::edge::gate::MAX_ATTEMPTS_LIMIT;
        let c = parse(&format!("[admission]\nmax_attempts = {limit}\n")).unwrap();
        assert_eq!(c.admission.gate_budget().unwrap().max_attempts(), limit);
        for bad in [0, limit + 1, 10] {
            let e = parse(&format!("[admission]\nmax_attempts = {bad}\n")).unwrap_err();
            assert_eq!(
                field_of(e),
                "admission.max_attempts",
                "max_attempts = {bad}"
            );
        }
        let e = parse("[admission]\nrequest_budget_ms = 0\n").unwrap_err();
        assert_eq!(field_of(e), "admission.request_budget_ms");
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

    #[test]
    fn api_key_errors_name_the_field_used_and_duplicates_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_secret(&dir.path().join("short"), "too-short\n");
        write_secret(&dir.path().join("k1"), "sk-first-key-0123456789\n");
        write_secret(&dir.path().join("k2"), "sk-first-key-0123456789\n");
        let parse_in = |extra: &str| EdgeConfig::parse(&format!("{BASE}{extra}"), dir.path());
        let e = parse_in("[[api_keys]]\nprincipal='a'\nkey_file='short'\n").unwrap_err();
        assert_eq!(field_of(e), "api_keys[0].key_file");
        let e = parse_in("[[api_keys]]\nprincipal='a'\nkey_file='missing'\n").unwrap_err();
        assert_eq!(field_of(e), "api_keys[0].key_file");
        let e = parse_in(
            "[[api_keys]]\nprincipal='a'\nkey_file='k1'\n\
             [[api_keys]]\nprincipal='b'\nkey_file='k2'\n",
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            !text.contains("sk-first-key"),
            "the key is never shown: {text}"
        );
        assert_eq!(field_of(e), "api_keys[1].key_file");
        write_secret(&dir.path().join("tiny"), "\n");
        let e = parse_in("[[credentials]]\nprofile='k'\nsecret_file='tiny'\n").unwrap_err();
        assert_eq!(field_of(e), "credentials[0].secret_file");
    }

    #[test]
    fn api_key_debug_never_shows_the_key() {
        let k = ApiKey {
            principal: "p".into(),
            key: "sk-secret-secret-secret".into(),
            models: vec![],
            admin: false,
        };
        assert!(!format!("{k:?}").contains("secret-secret"));
    }

    #[test]
    fn a_nats_journal_needs_an_edge_id_and_its_section_and_each_bad_field_is_named() {
        // Defaults: one Edge on its own store.
        let c = parse("").unwrap();
        assert_eq!(c.edge.edge_id(), DEFAULT_EDGE_ID);
        assert_eq!(c.journal.store, JournalStoreKind::Embedded);
        assert_eq!(
            (c.journal.lease_ttl_ms, c.journal.takeover_scan_interval_ms),
            (15_000, 5_000)
        );
        let with_id = |id: &str, extra: &str| {
            let text = BASE.replace("[edge]\n", &format!("[edge]\nedge_id = \"{id}\"\n"));
            EdgeConfig::parse(&format!("{text}{extra}"), Path::new("/etc/iop"))
        };
        let nats = "[journal]\nstore = \"nats\"\n[journal.nats]\nservers = [\"nats://10.0.0.1:4222\", \"nats://10.0.0.2:4222\"]\n";
        let e = parse(nats).unwrap_err();
        assert_eq!(field_of(e), "edge.edge_id", "a shared store needs an id");
        let c = with_id("edge-a", nats).unwrap();
        assert_eq!(c.edge.edge_id(), "edge-a");
        let n = c.journal.nats.as_ref().unwrap();
        let o = n
            .options(c.journal.limits(), Path::new("/etc/iop"))
            .unwrap();
        assert_eq!(
            (o.stream.as_str(), o.bucket.as_str(), o.replicas),
            ("IOP_JOURNAL", "iop_journal", 1)
        );
        assert_eq!(o.servers.len(), 2);
        let e = with_id("edge a", nats).unwrap_err();
        assert_eq!(field_of(e), "edge.edge_id");
        let e = with_id("edge-a", "[journal]\nstore = \"nats\"\n").unwrap_err();
        assert_eq!(field_of(e), "journal.nats");
        let e = with_id(
            "edge-a",
            "[journal.nats]\nservers = [\"nats://127.0.0.1:4222\"]\n",
        )
        .unwrap_err();
        assert_eq!(
            field_of(e),
            "journal.store",
            "[journal.nats] without store = nats"
        );
        for (line, field) in [
            ("servers = []", "journal.nats.servers"),
            ("servers = [\"nats://[::1\"]", "journal.nats.servers"),
            (
                "servers = [\"nats://iop:pw@h:4222\"]",
                "journal.nats.servers",
            ),
            (
                "servers = [\"nats://h:4222\"]\nreplicas = 2",
                "journal.nats.replicas",
            ),
            (
                "servers = [\"nats://h:4222\"]\nbucket = \"a.b\"",
                "journal.nats.bucket",
            ),
            (
                "servers = [\"nats://h:4222\"]\nconnect_timeout_ms = 0",
                "journal.nats.connect_timeout_ms",
            ),
            (
                "servers = [\"nats://h:4222\"]\nuser = \"iop\"",
                "journal.nats.password_env",
            ),
            (
                "servers = [\"nats://h:4222\"]\npassword_env = \"IOP_TEST_NATS_PASSWORD_SET\"",
                "journal.nats.user",
            ),
            (
                "servers = [\"nats://h:4222\"]\ntoken_env = \"IOP_TEST_NATS_TOKEN_UNSET\"",
                "journal.nats.token_env",
            ),
            (
                "servers = [\"nats://h:4222\"]\ntoken_env = \"T\"\ncredentials_file = \"c.creds\"",
                "journal.nats.credentials_file",
            ),
            ("servers = [\"nats://h:4222\"]\nsurprise = 1", ""),
        ] {
            let text = format!("[journal]\nstore = \"nats\"\n[journal.nats]\n{line}\n");
            match with_id("edge-a", &text) {
                Err(ConfigError::Parse(msg)) if field.is_empty() => {
                    assert!(msg.contains("surprise"), "{msg}");
                }
                Err(e) => assert_eq!(field_of(e), field, "{line}"),
                Ok(_) => panic!("{line} was accepted"),
            }
        }
        for (line, field) in [
            ("lease_ttl_ms = 10", "journal.lease_ttl_ms"),
            (
                "takeover_scan_interval_ms = 0",
                "journal.takeover_scan_interval_ms",
            ),
        ] {
            let e = parse(&format!("[journal]\n{line}\n")).unwrap_err();
            assert_eq!(field_of(e), field);
        }
    }

    #[test]
    fn nats_secrets_come_from_the_environment_and_paths_resolve_against_the_file() {
        // A variable every process has (tests set none).
        let var = "PATH";
        let secret = std::env::var(var).unwrap();
        let text = BASE.replace("[edge]\n", "[edge]\nedge_id = \"edge-b\"\n");
        let c = EdgeConfig::parse(
            &format!(
                "{text}[journal]\nstore = \"nats\"\n[journal.nats]\nservers = [\"tls://nats.internal:4222\"]\n\
                 user = \"iop\"\npassword_env = \"{var}\"\ntls_ca_file = \"nats-ca.pem\"\nreplicas = 3\n"
            ),
            Path::new("/etc/iop"),
        )
        .unwrap();
        let n = c.journal.nats.as_ref().unwrap();
        assert_eq!(
            n.tls_ca_file.as_deref(),
            Some(Path::new("/etc/iop/nats-ca.pem"))
        );
        let o = n
            .options(c.journal.limits(), Path::new("/elsewhere"))
            .unwrap();
        assert_eq!(
            o.auth,
            iop_store_nats::NatsAuth::UserPassword {
                user: "iop".into(),
                password: secret.trim().to_owned()
            }
        );
        assert_eq!(
            o.tls_ca_file.as_deref(),
            Some(Path::new("/etc/iop/nats-ca.pem"))
        );
        assert_eq!(o.replicas, 3);
        assert!(
            !format!("{c:?}").contains(&secret),
            "the password is never shown"
        );
        assert!(
            !format!("{o:?}").contains(&secret),
            "the password is never shown"
        );
    }
}
