//! Every Edge <-> Node message (SPEC §3) as serde types.
//!
//! Vocabularies are closed enums. Identifiers the Edge hands out (run ids,
//! generations, command ids) are integers; `session_id` is an opaque
//! correlation value that never links two runs.

use serde::{Deserialize, Serialize};

macro_rules! closed_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident { $( $(#[$vmeta:meta])* $variant:ident => $s:literal ),+ $(,)? }
    ) => {
        $(#[$meta])*
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum $name { $( $(#[$vmeta])* $variant ),+ }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The stable lower-case name (used in logs, metrics labels and JSON).
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $s),+ }
            }

            /// Parse the stable name back; `None` for anything else.
            pub fn parse(s: &str) -> Option<Self> {
                match s { $($s => Some($name::$variant),)+ _ => None }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

closed_enum! {
    /// The kind of provider server behind a Node.
    pub enum AdapterKind {
        /// Any OpenAI-compatible HTTP server.
        OpenAi => "openai",
        /// Ollama's native API.
        Ollama => "ollama",
        /// The built-in deterministic provider.
        Mock => "mock",
        /// Anthropic's Messages API (`POST /v1/messages`): Anthropic's own,
        /// or any Messages-compatible server.
        Anthropic => "anthropic",
    }
}

closed_enum! {
    /// Why an execution failed (SPEC §3).
    pub enum FailureCode {
        /// No progress for the effective stall timeout (R-WD-2).
        ResponseStalled => "response_stalled",
        /// The provider answered with an error.
        ProviderError => "provider_error",
        /// The provider could not be reached.
        ProviderUnreachable => "provider_unreachable",
        /// The run was canceled (Cancel, stream reset or disconnect).
        Canceled => "canceled",
        /// The hard deadline passed.
        DeadlineExceeded => "deadline_exceeded",
        /// A managed credential lease failed closed (R-CRED-3).
        CredentialRejected => "credential_rejected",
        /// The request was refused before any provider call.
        InvalidRequest => "invalid_request",
        /// The Node is at its concurrent-run limit.
        NodeOverloaded => "node_overloaded",
        /// The provider answered with something unparseable.
        MalformedResponse => "malformed_response",
        /// No such adapter/target on this Node.
        UnknownTarget => "unknown_target",
        /// The connection carrying the run ended.
        TransportClosed => "transport_closed",
        /// A Node-internal failure.
        Internal => "internal",
    }
}

closed_enum! {
    /// Health evidence attached to a failure (R-WD-5).
    pub enum ProviderHealth {
        /// The exact-target probe succeeded.
        Available => "available",
        /// The exact-target probe said the provider is unhealthy.
        Unavailable => "unavailable",
        /// The probe failed or timed out.
        Unknown => "unknown",
    }
}

closed_enum! {
    /// What a stall means, paired with [`ProviderHealth`] (R-WD-5).
    pub enum LivenessClassification {
        /// The provider is healthy; this request stalled.
        RequestStalled => "request_stalled",
        /// The provider itself is unhealthy.
        ProviderUnhealthy => "provider_unhealthy",
        /// Nothing is known about the provider's health.
        HealthUnknown => "health_unknown",
    }
}

closed_enum! {
    /// The sanitized reason a provider probe or call failed (R-HT-1).
    pub enum HealthFailureCode {
        /// The call timed out.
        Timeout => "timeout",
        /// HTTP 5xx.
        Http5xx => "http_5xx",
        /// HTTP 4xx other than auth.
        Http4xx => "http_4xx",
        /// Connect/transport failure.
        TransportFailed => "transport_failed",
        /// HTTP 401.
        AuthenticationFailed => "authentication_failed",
        /// A managed credential lease was rejected.
        CredentialFailed => "credential_failed",
        /// HTTP 403.
        AuthorizationFailed => "authorization_failed",
        /// The answer could not be parsed.
        MalformedResponse => "malformed_response",
        /// The provider refused the request for another reason.
        ProviderRejected => "provider_rejected",
        /// The answer was about a different target.
        OwnershipMismatch => "ownership_mismatch",
        /// The response stalled.
        ResponseStalled => "response_stalled",
    }
}

impl ProviderHealth {
    /// The classification that R-WD-5 pairs with this evidence.
    pub fn liveness_classification(self) -> LivenessClassification {
        match self {
            ProviderHealth::Available => LivenessClassification::RequestStalled,
            ProviderHealth::Unavailable => LivenessClassification::ProviderUnhealthy,
            ProviderHealth::Unknown => LivenessClassification::HealthUnknown,
        }
    }
}

/// Safe metadata of a stall: durations only, never payloads.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StallMetadata {
    /// Time since the last progress when the stall was claimed.
    pub elapsed_ms: u64,
    /// The effective stall timeout.
    pub stall_timeout_ms: u64,
}

/// The typed failure carried by a run or tunnel terminal (SPEC §3).
///
/// Never carries raw provider payloads or credentials; a provider's own
/// error message only as [`provider_message`] makes it (control characters
/// stripped, at most [`MAX_PROVIDER_MESSAGE_CHARS`]).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutionFailure {
    /// What went wrong.
    pub code: FailureCode,
    /// A capability hint only: the Node never retries (R-WD-4, R-WD-8).
    pub retryable: bool,
    /// Health evidence, present on stalls.
    pub provider_health: Option<ProviderHealth>,
    /// The classification paired with `provider_health`.
    pub liveness_classification: Option<LivenessClassification>,
    /// The Session's observation sequence (R-SEQ-1); absent with no bound connection.
    pub health_observation_seq: Option<u64>,
    /// Stall durations.
    pub stall: Option<StallMetadata>,
    /// The HTTP status the provider answered with, if any.
    pub http_status: Option<u16>,
    /// Sanitized failure class for health tracking.
    pub health_failure: Option<HealthFailureCode>,
    /// The provider's own error message, for the client ([`provider_message`]).
    #[serde(deserialize_with = "crate::bounded::provider_message")]
    #[cfg_attr(test, proptest(strategy = "proptest::option::of(\"[ -~]{0,40}\")"))]
    pub provider_message: Option<String>,
}

impl ExecutionFailure {
    /// A failure with only a code, not retryable, no evidence.
    pub fn new(code: FailureCode) -> Self {
        Self {
            code,
            retryable: false,
            provider_health: None,
            liveness_classification: None,
            health_observation_seq: None,
            stall: None,
            http_status: None,
            health_failure: None,
            provider_message: None,
        }
    }
}

/// The most characters of a provider's error message a failure carries.
pub const MAX_PROVIDER_MESSAGE_CHARS: usize = 1024;

/// A provider's own error message as a failure carries it to the client:
/// control characters (line breaks included) become spaces, runs of
/// whitespace one space, ends trimmed, at most [`MAX_PROVIDER_MESSAGE_CHARS`]
/// characters (cut with `…`); `None` when nothing is left.
pub fn provider_message(raw: &str) -> Option<String> {
    let words: Vec<&str> = raw
        .split(|c: char| c.is_control() || c.is_whitespace())
        .filter(|w| !w.is_empty())
        .collect();
    let text = words.join(" ");
    if text.is_empty() {
        return None;
    }
    if text.chars().count() <= MAX_PROVIDER_MESSAGE_CHARS {
        return Some(text);
    }
    let mut cut: String = text.chars().take(MAX_PROVIDER_MESSAGE_CHARS - 1).collect();
    cut.push('…');
    Some(cut)
}

/// A provider a Node offers at registration.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferedProvider {
    /// Kind of server.
    pub adapter: AdapterKind,
    /// Which server/model on this Node.
    pub target: String,
    /// Models the target serves (informational; the Edge config is authoritative).
    #[serde(deserialize_with = "crate::bounded::models")]
    pub models: Vec<String>,
    /// The most runs the Node takes for this target at once over every
    /// Edge (its `[[providers]] max_concurrent_runs`), if it sets one: the
    /// provider's capacity where the Edge's configuration gives none.
    pub max_concurrent_runs: Option<u32>,
}

/// Node -> Edge, first frame on the control stream.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// Must equal the Edge's [`crate::PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// The Node's software version (informational).
    pub node_version: String,
    /// Providers this Node can execute.
    #[serde(deserialize_with = "crate::bounded::offered_providers")]
    pub providers: Vec<OfferedProvider>,
    /// The Node's concurrent-run limit.
    pub max_concurrent_runs: u32,
    /// X25519 public key credential leases are sealed to (R-CRED-1).
    pub recipient_public_key: Option<[u8; 32]>,
    /// Durable runs the Node keeps going without a connection (R-PARK-2):
    /// an Edge may adopt them.
    #[serde(deserialize_with = "crate::bounded::parked_runs")]
    pub parked: Vec<ParkedRun>,
}

/// A run's identity for its whole life: the generation of the connection
/// it was started on and its run id there. A run keeps it when another
/// connection adopts it (R-PARK-2).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RunKey {
    /// The generation the run was started on.
    pub generation: u64,
    /// Its run id on that connection.
    pub run_id: u64,
}

/// Node -> Edge, at registration: a durable run whose connection was lost,
/// its provider call still going (R-PARK-1).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedRun {
    /// The run.
    pub key: RunKey,
    /// The durable response it writes.
    #[serde(deserialize_with = "crate::bounded::response_id")]
    #[cfg_attr(test, proptest(strategy = "\"[a-z0-9_]{0,40}\""))]
    pub response_id: String,
    /// Its adapter.
    pub adapter: AdapterKind,
    /// Its target.
    #[serde(deserialize_with = "crate::bounded::target")]
    #[cfg_attr(test, proptest(strategy = "\"[a-z0-9:._-]{0,40}\""))]
    pub target: String,
    /// The first frame the Node still keeps (frames before it were
    /// acknowledged durable).
    pub first_kept_frame: u64,
    /// The last frame the run produced (0: none yet).
    pub last_frame: u64,
    /// The run's terminal frame is among them (its provider call ended).
    pub ended: bool,
}

/// Edge -> Node: a parked run no Edge can use (its response ended or is
/// gone): the Node cancels it now instead of keeping its provider call
/// going for the rest of its grace (R-PARK-1).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelParked {
    /// The run.
    pub key: RunKey,
    /// The durable response it writes (a run key alone may name another
    /// Edge's run, R-MULTI-1).
    #[serde(deserialize_with = "crate::bounded::response_id")]
    #[cfg_attr(test, proptest(strategy = "\"[a-z0-9_]{0,40}\""))]
    pub response_id: String,
}

/// Edge -> Node, in a [`RunRequest`]: the run writes a durable response
/// (SPEC §6), so it outlives its connection (R-PARK-1).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkSpec {
    /// The response's id (what the Node reports when it parks the run).
    #[serde(deserialize_with = "crate::bounded::response_id")]
    #[cfg_attr(test, proptest(strategy = "\"[a-z0-9_]{0,40}\""))]
    pub response_id: String,
    /// How long the Node keeps the run going without a connection; `0`
    /// means [`crate::DEFAULT_PARK_GRACE_MS`].
    pub grace_ms: u64,
}

/// Edge -> Node: continue the parked run `key` on this stream as run
/// `run_id` (R-PARK-2); answered with [`RunEvent`]s, starting with frame
/// `resume_after_frame + 1`.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdoptRequest {
    /// The run id the run has on this connection from now on.
    pub run_id: u64,
    /// The parked run.
    pub key: RunKey,
    /// The durable response it writes: with `key`, it names the run on a
    /// node connected to several Edges, whose generations may coincide
    /// (R-MULTI-1).
    #[serde(deserialize_with = "crate::bounded::response_id")]
    #[cfg_attr(test, proptest(strategy = "\"[a-z0-9_]{0,40}\""))]
    pub response_id: String,
    /// The last frame the Edge's journal holds (0: none).
    pub resume_after_frame: u64,
    /// As in [`RunRequest`]: the stall timeout from now on.
    pub response_stall_timeout_ms: u64,
    /// As in [`RunRequest`]: the hard deadline from now on; `0` none.
    pub deadline_ms: u64,
}

/// Edge -> Node, on a durable run's stream after its request: the frames
/// the Edge's journal holds durably (R-PARK-1). The Node drops kept frames
/// through the acknowledged one.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunStreamFrame {
    /// Every frame through `through_frame` is durable.
    Ack {
        /// The last durable frame.
        through_frame: u64,
    },
}

/// The Edge's view of one provider, sent to its Node.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderSnapshot {
    /// The stable provider id from the Edge config.
    pub provider_id: String,
    /// Kind of server.
    pub adapter: AdapterKind,
    /// Which server/model.
    pub target: String,
    /// The effective stall timeout for this provider.
    pub response_stall_timeout_ms: u64,
}

/// The state of one managed credential profile, pushed to Nodes.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialProfileState {
    /// Profile name.
    pub profile: String,
    /// Current revision; leases of an older revision are stale.
    pub revision: u64,
    /// False once disabled or revoked.
    pub active: bool,
}

/// Configuration the Edge pushes at registration and on refresh.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ConfigSnapshot {
    /// Providers on this Node the Edge will use.
    pub providers: Vec<ProviderSnapshot>,
    /// Managed credential profiles and their revisions.
    pub credential_profiles: Vec<CredentialProfileState>,
    /// Ed25519 public key the Edge signs credential lease scopes with.
    pub lease_signing_key: Option<[u8; 32]>,
    /// Targets on this Node whose credential is managed by the Edge: a run
    /// for one of them needs a valid lease of that profile (R-CRED-3).
    pub managed_targets: Vec<ManagedTarget>,
}

/// One provider target whose credential comes in a sealed lease.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManagedTarget {
    /// Kind of server.
    pub adapter: AdapterKind,
    /// Which server/model.
    pub target: String,
    /// The credential profile leased for it.
    pub profile: String,
}

closed_enum! {
    /// Why the Edge refused a registration.
    pub enum RejectReason {
        /// The Node speaks another protocol version.
        ProtocolVersionMismatch => "protocol_version_mismatch",
        /// The certificate's node id is not configured.
        UnknownNode => "unknown_node",
        /// The request was malformed or inconsistent.
        InvalidRegistration => "invalid_registration",
        /// The Edge is shutting down.
        ShuttingDown => "shutting_down",
    }
}

/// Edge -> Node answer to [`RegisterRequest`].
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegisterResponse {
    /// Registered: this connection's generation and the config snapshot.
    Accepted {
        /// Strictly greater than every earlier generation of this node (R-GEN-1).
        generation: u64,
        /// Config for this Node.
        config: ConfigSnapshot,
    },
    /// Refused.
    Rejected {
        /// Closed reason.
        reason: RejectReason,
        /// Human-readable detail (no secrets).
        message: String,
        /// The protocol version the Edge speaks.
        edge_protocol_version: u32,
    },
}

/// Node -> Edge: the Node has applied the config and can take work.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReadyRequest {
    /// The generation from [`RegisterResponse::Accepted`].
    pub generation: u64,
}

/// Edge -> Node: readiness acknowledged (or refused for a stale generation).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReadyResponse {
    /// Echo of the generation.
    pub generation: u64,
    /// False when the generation is not current.
    pub accepted: bool,
}

/// A heartbeat ping or pong, matched by sequence (R-HB-1).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Sender's ping sequence; a pong echoes it.
    pub seq: u64,
}

/// Cancel exactly one run or tunnel (a stream reset is equivalent).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancel {
    /// The run or tunnel id.
    pub run_id: u64,
}

closed_enum! {
    /// Why a connection was closed. Sent as the QUIC application close code.
    pub enum CloseCode {
        /// Orderly close.
        Normal => "normal",
        /// No heartbeat answer within the wait (R-HB-2).
        HeartbeatTimeout => "heartbeat_timeout",
        /// The peer broke the protocol.
        ProtocolError => "protocol_error",
        /// A newer connection of the same node replaced this one.
        Superseded => "superseded",
        /// The process is shutting down.
        Shutdown => "shutdown",
        /// Registration was refused.
        RegistrationRejected => "registration_rejected",
        /// The peer's identity was not acceptable.
        Unauthorized => "unauthorized",
    }
}

impl CloseCode {
    /// The QUIC application error code.
    pub fn code(self) -> u32 {
        match self {
            CloseCode::Normal => 0,
            CloseCode::HeartbeatTimeout => 1,
            CloseCode::ProtocolError => 2,
            CloseCode::Superseded => 3,
            CloseCode::Shutdown => 4,
            CloseCode::RegistrationRejected => 5,
            CloseCode::Unauthorized => 6,
        }
    }

    /// Parse a QUIC application error code.
    pub fn from_code(code: u64) -> Option<Self> {
        CloseCode::ALL
            .iter()
            .copied()
            .find(|c| u64::from(c.code()) == code)
    }
}

closed_enum! {
    /// Why one stream was reset or stopped. Sent as the QUIC stream error code.
    pub enum StreamErrorCode {
        /// The run was canceled.
        Canceled => "canceled",
        /// A frame exceeded the maximum.
        FrameTooLarge => "frame_too_large",
        /// A frame did not decode.
        Malformed => "malformed",
        /// The stream ended inside a frame.
        Truncated => "truncated",
        /// A frame arrived that this stream does not carry.
        UnexpectedMessage => "unexpected_message",
        /// A local failure.
        Internal => "internal",
    }
}

impl StreamErrorCode {
    /// The QUIC stream error code.
    pub fn code(self) -> u32 {
        match self {
            StreamErrorCode::Canceled => 0x10,
            StreamErrorCode::FrameTooLarge => 0x11,
            StreamErrorCode::Malformed => 0x12,
            StreamErrorCode::Truncated => 0x13,
            StreamErrorCode::UnexpectedMessage => 0x14,
            StreamErrorCode::Internal => 0x15,
        }
    }

    /// Parse a QUIC stream error code.
    pub fn from_code(code: u64) -> Option<Self> {
        StreamErrorCode::ALL
            .iter()
            .copied()
            .find(|c| u64::from(c.code()) == code)
    }
}

/// Node -> Edge frames on the control stream.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeControl {
    /// First frame.
    Register(RegisterRequest),
    /// After an accepted registration.
    Ready(NodeReadyRequest),
    /// Heartbeat request.
    Ping(Heartbeat),
    /// Heartbeat answer.
    Pong(Heartbeat),
    /// The Node applied a config refresh.
    ConfigApplied {
        /// The generation the refresh was applied on.
        generation: u64,
    },
    /// The Node is closing the connection.
    Closing {
        /// Why.
        code: CloseCode,
    },
    /// Durable runs that parked since this connection registered (their
    /// own connection, to another Edge, was lost): this Edge may adopt
    /// them (R-PARK-2, R-TAKE-1, R-MULTI-1).
    Parked {
        /// The runs.
        #[serde(deserialize_with = "crate::bounded::parked_runs")]
        runs: Vec<ParkedRun>,
    },
}

/// Edge -> Node frames on the control stream.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EdgeControl {
    /// Answer to [`NodeControl::Register`].
    Registered(RegisterResponse),
    /// Answer to [`NodeControl::Ready`].
    ReadyAck(NodeReadyResponse),
    /// Heartbeat request.
    Ping(Heartbeat),
    /// Heartbeat answer.
    Pong(Heartbeat),
    /// New config for this Node (providers, credential revisions).
    ConfigRefresh(ConfigSnapshot),
    /// Cancel one run or tunnel.
    Cancel(Cancel),
    /// The Edge is closing the connection.
    Closing {
        /// Why.
        code: CloseCode,
    },
    /// Cancel a parked run no Edge can use (R-PARK-1).
    CancelParked(CancelParked),
}

/// Role of a chat message author.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    /// System prompt.
    System,
    /// End user.
    User,
    /// Model output.
    Assistant,
    /// Tool result.
    Tool,
}

impl Role {
    /// The OpenAI/Ollama role name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A complete tool call in a conversation history.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Call id.
    pub id: String,
    /// Function name.
    pub name: String,
    /// JSON-encoded arguments.
    pub arguments: String,
}

/// One chat message.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Author.
    pub role: Role,
    /// Text content.
    pub content: String,
    /// Tool calls made by an assistant message.
    pub tool_calls: Vec<ToolCall>,
    /// For a tool message: which call it answers.
    pub tool_call_id: Option<String>,
    /// Optional author name.
    pub name: Option<String>,
    /// Images attached to the message: `https://` URLs or `data:` URLs with
    /// base64 content, in the order the client gave them.
    pub images: Vec<String>,
    /// A prompt-cache breakpoint at the end of this message (the Messages
    /// API's `cache_control` on its last block): a provider that caches
    /// prompts may cache the conversation up to here. Providers without
    /// such a marker ignore it.
    #[serde(default)]
    pub cache_control: Option<CacheControl>,
    /// Documents (PDFs) attached to the message, in the order the client
    /// gave them (the Messages API's `document` blocks with a `base64` or
    /// `url` source; a text document is the message's text). A provider
    /// API that takes no documents is not chosen for such a run.
    #[serde(default)]
    pub documents: Vec<Document>,
}

/// A document attached to a chat message: a PDF.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Document {
    /// Where its bytes are.
    pub source: DocumentSource,
    /// Its title, if the client gave one.
    pub title: Option<String>,
    /// What the client said about it, outside the document itself (the
    /// Messages API's `context`).
    pub context: Option<String>,
}

/// Where a [`Document`]'s bytes are.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DocumentSource {
    /// The PDF itself, base64-encoded (standard alphabet, padded).
    PdfBase64(String),
    /// An `http(s)://` URL the provider fetches the PDF from.
    PdfUrl(String),
}

impl DocumentSource {
    /// The media type of every document a run carries.
    pub const PDF_MEDIA_TYPE: &'static str = "application/pdf";
}

closed_enum! {
    /// How long a prompt-cache entry lives (the Messages API's
    /// `cache_control.ttl`).
    pub enum CacheTtl {
        /// Five minutes (the default).
        FiveMinutes => "5m",
        /// One hour.
        OneHour => "1h",
    }
}

/// A prompt-cache breakpoint (the Messages API's `cache_control`, whose
/// one type is `ephemeral`).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CacheControl {
    /// The entry's lifetime; `None`: the provider's default.
    pub ttl: Option<CacheTtl>,
}

/// A function the model may call.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// Function name.
    pub name: String,
    /// Description.
    pub description: Option<String>,
    /// JSON Schema of the parameters, JSON-encoded.
    pub parameters_json: Option<String>,
    /// A prompt-cache breakpoint after this tool's definition (the
    /// Messages API's `cache_control` on a tool).
    #[serde(default)]
    pub cache_control: Option<CacheControl>,
}

/// Sampling and length parameters (all optional).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GenerationParams {
    /// Sampling temperature.
    #[cfg_attr(test, proptest(strategy = "crate::tests::finite_f32()"))]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[cfg_attr(test, proptest(strategy = "crate::tests::finite_f32()"))]
    pub top_p: Option<f32>,
    /// Maximum output tokens.
    pub max_tokens: Option<u32>,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Seed.
    pub seed: Option<i64>,
    /// Presence penalty.
    #[cfg_attr(test, proptest(strategy = "crate::tests::finite_f32()"))]
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    #[cfg_attr(test, proptest(strategy = "crate::tests::finite_f32()"))]
    pub frequency_penalty: Option<f32>,
    /// Tool choice, JSON-encoded as the client sent it.
    pub tool_choice_json: Option<String>,
    /// `response_format` as the client sent it (`json_object` or
    /// `json_schema`), JSON-encoded; `None` for plain text.
    pub response_format_json: Option<String>,
    /// Return the log probability of each output token.
    pub logprobs: bool,
    /// With `logprobs`: how many most likely alternatives per token.
    pub top_logprobs: Option<u8>,
    /// How much the model should reason (`minimal`, `low`, `medium`,
    /// `high`, ...), as the client sent it.
    pub reasoning_effort: Option<String>,
    /// Whether the model may call several tools in one turn.
    pub parallel_tool_calls: Option<bool>,
    /// Text after the insertion point of a fill-in-the-middle completion
    /// ([`RunApi::Completion`]).
    pub suffix: Option<String>,
    /// Top-level request fields the Edge does not interpret, as one JSON
    /// object: passed to OpenAI-compatible providers unchanged and mapped to
    /// Ollama `options` where Ollama has them.
    pub extra_json: Option<String>,
    /// The client takes the answer whole (no stream): a provider whose
    /// streams carry no usage may be called without streaming, so the
    /// answer's usage is the provider's own.
    pub whole_answer: bool,
    /// The Messages API beta features the client asked for (its
    /// `anthropic-beta` header), one name each: a Messages provider gets
    /// them as its `anthropic-beta`; no other provider gets them.
    #[serde(default)]
    pub betas: Vec<String>,
}

impl Eq for GenerationParams {}

/// Which provider API shape a normalized run should use.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunApi {
    /// Chat Completions (or the adapter's chat equivalent).
    Chat,
    /// Plain completion of a prompt (Ollama generate).
    Generate,
    /// Embeddings: one user message per input text, answered with one
    /// [`RunEventKind::Embedding`] per input.
    Embeddings,
    /// A legacy text completion (`/v1/completions`): the prompt is the one
    /// user message, [`GenerationParams::suffix`] the text after it.
    Completion,
}

/// A W3C trace context (`traceparent`, version `00`) in binary form: the
/// trace, the sender's span that is the parent of the receiver's spans, and
/// the trace flags. Random identifiers only, never anything from a payload.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TraceContext {
    /// 16-byte trace id (never all zero when valid).
    pub trace_id: [u8; 16],
    /// 8-byte id of the parent span (never all zero when valid).
    pub parent_span_id: [u8; 8],
    /// Trace flags; bit 0 is `sampled`.
    pub flags: u8,
}

impl TraceContext {
    /// The `sampled` trace flag.
    pub const FLAG_SAMPLED: u8 = 0x01;

    /// Whether both identifiers are non-zero (W3C: an all-zero id is invalid).
    pub fn is_valid(&self) -> bool {
        self.trace_id != [0; 16] && self.parent_span_id != [0; 8]
    }

    /// Whether the sender sampled the trace.
    pub fn is_sampled(&self) -> bool {
        self.flags & Self::FLAG_SAMPLED != 0
    }

    /// The `traceparent` header value: `00-<trace id>-<parent id>-<flags>`.
    pub fn to_traceparent(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::with_capacity(55);
        out.push_str("00-");
        for b in self.trace_id {
            let _ = write!(out, "{b:02x}");
        }
        out.push('-');
        for b in self.parent_span_id {
            let _ = write!(out, "{b:02x}");
        }
        let _ = write!(out, "-{:02x}", self.flags);
        out
    }

    /// Parse a `traceparent` header value (W3C Trace Context level 1):
    /// version `00` exactly as specified; a higher version is read by its
    /// first four fields. `None` for anything malformed or with an all-zero
    /// id, so a bad header starts a new trace instead of failing a request.
    pub fn from_traceparent(value: &str) -> Option<Self> {
        let value = value.trim();
        let mut parts = value.split('-');
        let version = parts.next()?;
        let trace = parts.next()?;
        let parent = parts.next()?;
        let flags = parts.next()?;
        let rest = parts.next();
        if version.len() != 2 || version == "ff" || !is_lower_hex(version) {
            return None;
        }
        // Version 00 has exactly four fields; later versions may add more.
        if version == "00" && (rest.is_some() || value.len() != 55) {
            return None;
        }
        let mut ctx = TraceContext {
            trace_id: [0; 16],
            parent_span_id: [0; 8],
            flags: 0,
        };
        decode_hex(trace, &mut ctx.trace_id)?;
        decode_hex(parent, &mut ctx.parent_span_id)?;
        let mut f = [0u8; 1];
        decode_hex(flags, &mut f)?;
        ctx.flags = f[0];
        ctx.is_valid().then_some(ctx)
    }
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn decode_hex(s: &str, out: &mut [u8]) -> Option<()> {
    if s.len() != out.len() * 2 || !is_lower_hex(s) {
        return None;
    }
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(())
}

/// Edge -> Node: execute one normalized run.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRequest {
    /// Unique per Edge process and connection.
    pub run_id: u64,
    /// Opaque correlation value.
    pub session_id: String,
    /// Adapter to use.
    pub adapter: AdapterKind,
    /// Target on that adapter.
    pub target: String,
    /// Model name to send to the provider.
    pub model: String,
    /// Chat or generate.
    pub api: RunApi,
    /// Conversation.
    pub messages: Vec<ChatMessage>,
    /// Tools the model may call.
    pub tools: Vec<ToolDefinition>,
    /// Parameters.
    pub params: GenerationParams,
    /// `0` means [`crate::DEFAULT_RESPONSE_STALL_TIMEOUT_MS`].
    pub response_stall_timeout_ms: u64,
    /// Hard deadline relative to receipt; `0` means none.
    pub deadline_ms: u64,
    /// A sealed credential lease for managed providers (R-CRED-1).
    #[serde(with = "serde_bytes")]
    pub credential_lease: Option<Vec<u8>>,
    /// The trace this request belongs to (W3C trace context), so the
    /// Node's spans join the Edge's trace. Identifiers only: no payload.
    pub trace_context: Option<TraceContext>,
    /// The durable response the run writes; `None`: an ephemeral run,
    /// canceled with its connection (R-DISC-1).
    pub park: Option<ParkSpec>,
    /// R-CONT-1: the last message is the assistant's partial answer (what
    /// the client already has from another provider); continue it, do not
    /// answer anew.
    pub continue_final: bool,
}

/// Token usage, as the provider reported it.
///
/// `prompt_tokens` counts every prompt token, cached or not (as the OpenAI
/// API counts them; a Messages API's `input_tokens` plus its two cache
/// counts). The cache counts are parts of it, `None` when the provider did
/// not report them: never invented.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens, cached ones included.
    pub prompt_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
    /// Of `prompt_tokens`, those read from the provider's prompt cache
    /// (OpenAI's `prompt_tokens_details.cached_tokens`, the Messages API's
    /// `cache_read_input_tokens`).
    #[serde(default)]
    pub cache_read_tokens: Option<u64>,
    /// Of `prompt_tokens`, those written to the provider's prompt cache
    /// (the Messages API's `cache_creation_input_tokens`, OpenAI's
    /// `prompt_tokens_details.cache_write_tokens`).
    #[serde(default)]
    pub cache_write_tokens: Option<u64>,
}

impl Usage {
    /// Usage of `prompt_tokens` and `completion_tokens`, no cache reported.
    pub const fn tokens(prompt_tokens: u64, completion_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            cache_read_tokens: None,
            cache_write_tokens: None,
        }
    }

    /// The prompt tokens neither read from nor written to a cache (the
    /// Messages API's `input_tokens`).
    pub fn uncached_prompt_tokens(&self) -> u64 {
        self.prompt_tokens
            .saturating_sub(self.cache_read_tokens.unwrap_or(0))
            .saturating_sub(self.cache_write_tokens.unwrap_or(0))
    }

    /// Whether the provider reported any cache count.
    pub fn reports_cache(&self) -> bool {
        self.cache_read_tokens.is_some() || self.cache_write_tokens.is_some()
    }
}

/// A fragment of a tool call being streamed.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    /// Which call (0-based) this fragment belongs to.
    pub index: u32,
    /// The call id, on its first fragment.
    pub id: Option<String>,
    /// The function name, on its first fragment.
    pub name: Option<String>,
    /// Next piece of the JSON arguments.
    pub arguments_delta: String,
}

closed_enum! {
    /// Why generation finished.
    pub enum FinishReason {
        /// Natural end (or a stop sequence the provider did not name).
        Stop => "stop",
        /// Token limit.
        Length => "length",
        /// The model called tools.
        ToolCalls => "tool_calls",
        /// Filtered.
        ContentFilter => "content_filter",
        /// One of the request's stop sequences matched (a provider that
        /// says so: the Messages API's `stop_sequence`, vLLM's
        /// `stop_reason`).
        StopSequence => "stop_sequence",
    }
}

impl FinishReason {
    /// The OpenAI (and Ollama) name: a matched stop sequence is `stop`
    /// there, as those APIs have no name of their own for it.
    pub fn openai_str(self) -> &'static str {
        match self {
            FinishReason::StopSequence => FinishReason::Stop.as_str(),
            other => other.as_str(),
        }
    }
}

/// One event of a normalized run.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunEventKind {
    /// The provider accepted the request.
    Started {
        /// Echo of the request's session id.
        session_id: String,
    },
    /// Next piece of text.
    TextDelta(String),
    /// Next piece of a tool call.
    ToolCallDelta(ToolCallDelta),
    /// Non-terminal usage report (progress, R-WD-1).
    Usage(Usage),
    /// Terminal: success.
    Completed {
        /// Why generation ended.
        finish_reason: FinishReason,
        /// Final usage, if known.
        usage: Option<Usage>,
    },
    /// Terminal: failure.
    Failed(ExecutionFailure),
    /// One embedding vector ([`RunApi::Embeddings`]).
    Embedding(Embedding),
    /// Next piece of the model's reasoning (`reasoning_content`).
    ReasoningDelta(String),
    /// Log probabilities of the tokens of the text deltas before it.
    Logprobs(Vec<TokenLogprob>),
}

/// One embedding vector of a [`RunApi::Embeddings`] run.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Embedding {
    /// Which input (0-based) it embeds.
    pub index: u32,
    /// The vector.
    #[cfg_attr(
        test,
        proptest(strategy = "proptest::collection::vec(-1.0e6f32..1.0e6f32, 0..8)")
    )]
    pub values: Vec<f32>,
}

impl Eq for Embedding {}

/// The log probability of one output token.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log probability.
    #[cfg_attr(test, proptest(strategy = "-1.0e6f32..1.0e6f32"))]
    pub logprob: f32,
    /// The most likely alternatives at this position, best first.
    #[cfg_attr(
        test,
        proptest(strategy = "proptest::collection::vec(crate::tests::top_logprob(), 0..3)")
    )]
    pub top: Vec<(String, f32)>,
}

impl Eq for TokenLogprob {}

impl RunEventKind {
    /// True for `Completed` and `Failed`. A terminal wins over any payload it carries (R-WD-1).
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            RunEventKind::Completed { .. } | RunEventKind::Failed(_)
        )
    }
}

/// Node -> Edge: one event of run `run_id`.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunEvent {
    /// The run.
    pub run_id: u64,
    /// What happened.
    pub kind: RunEventKind,
}

/// An HTTP header.
pub type Header = (String, String);

/// Edge -> Node: relay one raw HTTP request to a provider.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderTunnelRequest {
    /// Unique per Edge process and connection (shares the run id space).
    pub run_id: u64,
    /// Opaque correlation value.
    pub session_id: String,
    /// Adapter to use.
    pub adapter: AdapterKind,
    /// Target on that adapter.
    pub target: String,
    /// HTTP method.
    pub method: String,
    /// Path and query, starting with `/`.
    pub path: String,
    /// Request headers (hop-by-hop headers are dropped by the Node).
    #[serde(deserialize_with = "crate::bounded::headers")]
    pub headers: Vec<Header>,
    /// Request body.
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
    /// `0` means [`crate::DEFAULT_RESPONSE_STALL_TIMEOUT_MS`].
    pub response_stall_timeout_ms: u64,
    /// Hard deadline relative to receipt; `0` means none.
    pub deadline_ms: u64,
    /// A sealed credential lease for managed providers (R-CRED-1).
    #[serde(with = "serde_bytes")]
    pub credential_lease: Option<Vec<u8>>,
    /// The trace this request belongs to (W3C trace context), so the
    /// Node's spans join the Edge's trace. Identifiers only: no payload.
    pub trace_context: Option<TraceContext>,
}

/// Node -> Edge: one frame of a tunnelled response.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProviderTunnelFrame {
    /// Status and headers.
    Head {
        /// HTTP status.
        status: u16,
        /// Response headers.
        #[serde(deserialize_with = "crate::bounded::headers")]
        headers: Vec<Header>,
    },
    /// Next body bytes, passed through unbuffered.
    Body(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Terminal: the body ended normally.
    End,
    /// Terminal: the tunnel failed.
    Failure(ExecutionFailure),
}

impl ProviderTunnelFrame {
    /// True for `End` and `Failure`.
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            ProviderTunnelFrame::End | ProviderTunnelFrame::Failure(_)
        )
    }
}

/// An Ollama API call to run on the Node's Ollama.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OllamaApiCall {
    /// Target (Ollama server) on the Node.
    pub target: String,
    /// HTTP method.
    pub method: String,
    /// Path under `/api/`.
    pub path: String,
    /// Request body.
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
}

/// One adapter/target to probe.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeTarget {
    /// Adapter.
    pub adapter: AdapterKind,
    /// Target.
    pub target: String,
}

/// The closed set of commands (SPEC §3). Nothing else: no shell, no host commands.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommandKind {
    /// Exact-target health of every adapter/target (or only `target`), plus
    /// the next Session sequence. The Edge's health tracker asks for one
    /// target at a time, so a failing provider is probed only on its own
    /// backoff (R-HT-3).
    Capabilities {
        /// Probe only this adapter/target; `None`: every one.
        target: Option<ProbeTarget>,
    },
    /// Transport state of this connection.
    TransportStatus,
    /// An Ollama API call, answered as a stream of tunnel frames.
    OllamaApi(OllamaApiCall),
}

/// Edge -> Node: run one command.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command {
    /// Unique per connection.
    pub command_id: u64,
    /// Opaque correlation value.
    pub session_id: String,
    /// Which command.
    pub kind: CommandKind,
}

/// Exact-target health of one adapter/target.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetHealth {
    /// Adapter.
    pub adapter: AdapterKind,
    /// Target.
    pub target: String,
    /// Probe verdict.
    pub status: ProviderHealth,
    /// Why, when not available.
    pub failure_code: Option<HealthFailureCode>,
    /// Models the target reports (empty is a valid answer, R-HT-2).
    #[serde(deserialize_with = "crate::bounded::models")]
    pub models: Vec<String>,
}

/// Answer to [`CommandKind::Capabilities`] (R-CAP-1).
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapabilitiesReport {
    /// One entry per probed target.
    #[serde(deserialize_with = "crate::bounded::capability_targets")]
    pub targets: Vec<TargetHealth>,
    /// The Session sequence this observation took (R-SEQ-1).
    pub health_observation_seq: u64,
}

/// Answer to [`CommandKind::TransportStatus`].
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportStatusReport {
    /// This connection's generation.
    pub generation: u64,
    /// Time since the connection was accepted.
    pub connected_for_ms: u64,
    /// Runs and tunnels in flight.
    pub active_runs: u32,
    /// The Node's concurrent-run limit.
    pub max_concurrent_runs: u32,
    /// Heartbeats sent on this connection.
    pub heartbeats_sent: u64,
    /// Latest heartbeat round trip.
    pub last_heartbeat_rtt_ms: Option<u64>,
    /// Late provider outputs dropped after a terminal (R-WD-6).
    pub fenced_late_outputs: u64,
    /// Next Session observation sequence (not consumed).
    pub next_health_observation_seq: u64,
}

/// What a command produced.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommandResultBody {
    /// Capabilities answer.
    Capabilities(CapabilitiesReport),
    /// Transport status answer.
    TransportStatus(TransportStatusReport),
    /// One frame of an Ollama API answer (terminal frames end the stream).
    OllamaApi(ProviderTunnelFrame),
    /// The command failed.
    Failed(ExecutionFailure),
}

/// Node -> Edge: (part of) the answer to a [`Command`].
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandResult {
    /// Echo of the command id.
    pub command_id: u64,
    /// Echo of the session id.
    pub session_id: String,
    /// The answer.
    pub body: CommandResultBody,
}

impl CommandResult {
    /// True when no more frames follow on this stream.
    pub fn is_terminal(&self) -> bool {
        match &self.body {
            CommandResultBody::OllamaApi(frame) => frame.is_terminal(),
            _ => true,
        }
    }
}

/// Edge -> Node: the first frame on a data stream.
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
// One per data stream, decoded once and moved into its handler: the size of
// the run variant costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum DataRequest {
    /// A normalized run; answered with [`RunEvent`]s.
    Run(RunRequest),
    /// A raw tunnel; answered with [`ProviderTunnelFrame`]s.
    Tunnel(ProviderTunnelRequest),
    /// A command; answered with [`CommandResult`]s.
    Command(Command),
    /// Adopt a parked run (R-PARK-2); answered with [`RunEvent`]s.
    Adopt(AdoptRequest),
}
