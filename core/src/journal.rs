//! Durable responses: the journal's rules (SPEC §6: R-JRN-1..5, R-IDEM-1,
//! R-TAKE-1).
//!
//! A *record* is one durable response: who asked (principal), what
//! (model, API, a fingerprint of the request, the hashed idempotency key),
//! its writer epoch, how many events it has, and at most one terminal.
//! Its *events* are numbered 1, 2, 3, ... and their payloads are opaque
//! here (the Edge stores its encoded deliveries).
//!
//! Every store (the embedded one, a distributed one) keeps records and
//! events and runs each operation inside one of its transactions through
//! the `check_*` functions of this module: they decide, the store only
//! reads and writes. So the rules are the same whichever store runs:
//!
//! * [`check_create`]: idempotency (R-IDEM-1) and the byte bound for new
//!   records (R-JRN-5);
//! * [`check_append`]: writer epoch (R-JRN-3), no gap or duplicate
//!   (R-JRN-2), nothing after the terminal (R-JRN-4), the per-record bound;
//! * [`check_finish`]: exactly one terminal (R-JRN-4), fenced like an
//!   append;
//! * [`check_raise_epoch`]: the compare-and-set a takeover wins before its
//!   first append (R-JRN-3, R-TAKE-1); the winner becomes the record's
//!   owner;
//! * [`expired`]: retention; a record without a terminal never expires
//!   (R-JRN-5).
//!
//! [`GroupCommit`] is the batching rule of R-JRN-1 (many appends, one
//! sync), as a sans-IO queue the store's writer drives.
//!
//! # Ownership and takeover (R-TAKE-1, R-MULTI-1)
//!
//! Every record names its *owner*: the Edge (its `edge_id`) that created
//! it, or that last won its epoch. Every Edge keeps an *ownership lease*
//! in the store ([`EdgeLease`]), a value it rewrites every third of its
//! `ttl_ms`; each write gives the lease a new store revision. Another
//! Edge tells a live owner from a dead one without comparing clocks: a
//! [`LeaseView`] notes, on the observer's own monotonic clock, when it
//! first saw each lease's current revision, and a lease whose revision
//! has not moved for its `ttl_ms` of continuous observation is
//! [`LeaseState::Expired`] (a failed store read restarts every clock, so
//! an outage that stopped every Edge from writing never reads as death).
//!
//! A [`TakeoverScan`] decides, record by record, with [`orphan`]: a
//! record without a terminal and not written by a run of this Edge is an
//! orphan when its owner is this Edge (its previous incarnation, found at
//! start) or an Edge whose lease expired. An orphan waits the *park
//! window* (its node may report the run parked, and an Edge adopt it,
//! R-PARK-2), then is ended `incomplete` ([`EDGE_RESTART_REASON`],
//! [`EDGE_LOST_REASON`]) with its durable prefix. A record a live Edge
//! owns is never ended, and a takeover race has one winner: the epoch's
//! compare-and-set.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Duration;

pub mod availability;

use crate::tenant::Held;
use crate::time::Instant;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The API a durable response was asked through: it decides how its
/// events are rendered when fetched or resumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JournalApi {
    /// `POST /v1/responses`.
    Responses,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /api/chat`.
    OllamaChat,
    /// `POST /api/generate`.
    OllamaGenerate,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /api/embed`.
    OllamaEmbed,
    /// `POST /v1/messages` (the Anthropic Messages API).
    Messages,
}

impl JournalApi {
    /// The stable lower-case name (a closed label value).
    pub fn as_str(self) -> &'static str {
        match self {
            JournalApi::Responses => "responses",
            JournalApi::ChatCompletions => "chat",
            JournalApi::Completions => "completions",
            JournalApi::OllamaChat => "ollama_chat",
            JournalApi::OllamaGenerate => "ollama_generate",
            JournalApi::Embeddings => "embeddings",
            JournalApi::OllamaEmbed => "ollama_embed",
            JournalApi::Messages => "messages",
        }
    }
}

/// Where a record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordStatus {
    /// Running (or, after a restart, waiting for its takeover).
    InProgress,
    /// Ended normally.
    Completed,
    /// Ended with a partial answer: its durable prefix is all there is.
    Incomplete,
    /// Ended with an error.
    Failed,
    /// Cancelled by its client.
    Cancelled,
}

impl RecordStatus {
    /// Is this a terminal status?
    pub fn is_terminal(self) -> bool {
        !matches!(self, RecordStatus::InProgress)
    }

    /// The stable lower-case name, as the Responses API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordStatus::InProgress => "in_progress",
            RecordStatus::Completed => "completed",
            RecordStatus::Incomplete => "incomplete",
            RecordStatus::Failed => "failed",
            RecordStatus::Cancelled => "cancelled",
        }
    }
}

/// A record's one terminal (R-JRN-4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Terminal {
    /// How it ended; never [`RecordStatus::InProgress`].
    pub status: RecordStatus,
    /// A closed reason code (`edge_restart`, a failure code, ...).
    pub reason: Option<String>,
    /// A message for the client, for failures.
    pub message: Option<String>,
    /// When, in Unix milliseconds.
    pub at_unix_ms: u64,
}

/// A hash of what the client sent: two requests with the same fingerprint
/// are the same request (R-IDEM-1).
pub type Fingerprint = [u8; 32];

/// The fingerprint of a request: its route and body bytes.
pub fn fingerprint(route: &str, body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update((route.len() as u64).to_be_bytes());
    h.update(route.as_bytes());
    h.update(body);
    h.finalize().into()
}

/// How an idempotency key is stored: hashed with its principal, so a key
/// names a response only for the principal that sent it and the store
/// never holds the key itself (R-IDEM-1).
pub fn idempotency_hash(principal: &str, key: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"iop-idempotency-key\0");
    h.update((principal.len() as u64).to_be_bytes());
    h.update(principal.as_bytes());
    h.update(key.as_bytes());
    h.finalize().into()
}

/// A record to create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewRecord {
    /// The response id (unique, chosen by the Edge).
    pub id: String,
    /// The principal of the API key that asked.
    pub principal: String,
    /// The API asked through.
    pub api: JournalApi,
    /// The model asked for.
    pub model: String,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The hashed idempotency key ([`idempotency_hash`]), if one was sent.
    pub idempotency_key: Option<[u8; 32]>,
    /// Run in the background (`background: true`): no client waits.
    pub background: bool,
    /// The stored request (opaque here: what rendering, `input_items` and
    /// `previous_response_id` need).
    pub request: Vec<u8>,
    /// When, in Unix milliseconds.
    pub created_unix_ms: u64,
    /// The Edge that creates it (its `edge_id`): the record's first owner.
    pub owner: String,
    /// The id of the API key that asked (never its secret): whose
    /// journal-bytes and background quotas it counts against (R-TEN-1).
    pub key_id: String,
}

/// A record as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordMeta {
    /// The response id.
    pub id: String,
    /// The principal of the API key that asked.
    pub principal: String,
    /// The API asked through.
    pub api: JournalApi,
    /// The model asked for.
    pub model: String,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The hashed idempotency key, if one was sent.
    pub idempotency_key: Option<[u8; 32]>,
    /// Run in the background.
    pub background: bool,
    /// When it was created, Unix milliseconds.
    pub created_unix_ms: u64,
    /// The writer epoch: appends and the terminal must carry it (R-JRN-3).
    pub epoch: u64,
    /// The number of the last event appended (0: none yet).
    pub last_seq: u64,
    /// The terminal, once there is one.
    pub terminal: Option<Terminal>,
    /// When it may be removed, Unix milliseconds (set at the terminal;
    /// `u64::MAX` before: a running record never expires, R-JRN-5).
    pub expires_unix_ms: u64,
    /// Bytes it holds in the store (request and event payloads).
    pub stored_bytes: u64,
    /// The Edge that writes it: its creator, or the last Edge that won
    /// its epoch ([`check_raise_epoch`]); [`NO_OWNER`] for a record stored
    /// before owners were recorded.
    pub owner: String,
    /// The id of the API key that asked (never its secret); [`NO_KEY_ID`]
    /// for a record stored before records named their key.
    pub key_id: String,
}

/// The owner of a record stored before records named their owner: the
/// one Edge that wrote that store, so a takeover treats it as its own.
pub const NO_OWNER: &str = "";

/// The key id of a record stored before records named their API key: it
/// counts against its principal's quotas only.
pub const NO_KEY_ID: &str = "";

impl RecordMeta {
    /// Its status.
    pub fn status(&self) -> RecordStatus {
        self.terminal
            .as_ref()
            .map_or(RecordStatus::InProgress, |t| t.status)
    }

    /// What it holds against its key's and its principal's quotas
    /// (R-TEN-1): its stored bytes, and one background response while a
    /// background record has no terminal.
    pub fn held(&self) -> Held {
        Held {
            journal_bytes: self.stored_bytes,
            background: u64::from(self.background && self.terminal.is_none()),
        }
    }
}

/// One journal event: number and payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEvent {
    /// 1, 2, 3, ... per record (R-JRN-2).
    pub seq: u64,
    /// The payload, opaque to the journal.
    pub payload: Vec<u8>,
}

/// Bytes an event is counted as: its payload and a fixed overhead for its
/// key and framing, so that many empty events also count.
pub fn event_bytes(event: &JournalEvent) -> u64 {
    event.payload.len() as u64 + EVENT_OVERHEAD_BYTES
}

/// The most stored responses one conversation is rebuilt from when a
/// request continues it (`previous_response_id`, R-LIM-6). A continued
/// conversation is stored link by link, each message once: a record keeps
/// its own request and the id of the response it continues, and the
/// conversation is read back by walking the links. A longer chain is
/// refused (400 naming `previous_response_id`): the client sends the
/// conversation in its request instead.
pub const MAX_CONVERSATION_LINKS: usize = 1_000;

/// Bytes counted per event beyond its payload.
pub const EVENT_OVERHEAD_BYTES: u64 = 32;

/// Bytes counted per record beyond its request and events.
pub const RECORD_OVERHEAD_BYTES: u64 = 256;

/// The journal's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalLimits {
    /// How long a finished record is kept (and its idempotency key holds).
    pub retention_ms: u64,
    /// The store's byte bound: a new record is refused once the store
    /// holds this much (R-JRN-5). Records already accepted may still grow
    /// to their terminal, each by at most `max_record_bytes`.
    pub max_bytes: u64,
    /// The most bytes one record may hold; an append past it is refused
    /// and the response ends `failed` instead.
    pub max_record_bytes: u64,
}

impl Default for JournalLimits {
    fn default() -> Self {
        JournalLimits {
            retention_ms: 24 * 60 * 60 * 1000,
            max_bytes: 1024 * 1024 * 1024,
            max_record_bytes: 16 * 1024 * 1024,
        }
    }
}

/// A limit outside what the journal accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JournalLimitsError {
    /// Retention must be between one second and one year.
    #[error("retention_ms must be between 1000 and 31536000000, got {0}")]
    Retention(u64),
    /// The store bound must hold at least one full record.
    #[error("max_bytes ({max_bytes}) must be at least max_record_bytes ({max_record_bytes})")]
    MaxBytes {
        /// The configured store bound.
        max_bytes: u64,
        /// The configured record bound.
        max_record_bytes: u64,
    },
    /// A record bound below 64 KiB cannot hold a useful answer.
    #[error("max_record_bytes must be at least 65536, got {0}")]
    MaxRecordBytes(u64),
}

impl JournalLimits {
    /// Check the limits; the error names the field.
    pub fn validate(&self) -> Result<(), JournalLimitsError> {
        if !(1000..=365 * 24 * 60 * 60 * 1000).contains(&self.retention_ms) {
            return Err(JournalLimitsError::Retention(self.retention_ms));
        }
        if self.max_record_bytes < 64 * 1024 {
            return Err(JournalLimitsError::MaxRecordBytes(self.max_record_bytes));
        }
        if self.max_bytes < self.max_record_bytes {
            return Err(JournalLimitsError::MaxBytes {
                max_bytes: self.max_bytes,
                max_record_bytes: self.max_record_bytes,
            });
        }
        Ok(())
    }
}

/// Why a journal operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JournalError {
    /// No such record (or it expired).
    #[error("no such response")]
    NotFound,
    /// The operation carried an epoch that is not the record's (R-JRN-3).
    #[error("fenced: the record's epoch is {current}, the writer's {writer}")]
    Fenced {
        /// The record's epoch.
        current: u64,
        /// The epoch the writer carried.
        writer: u64,
    },
    /// The record already has its terminal (R-JRN-4).
    #[error("the response has already ended")]
    Terminated,
    /// Events must continue the record's numbering (R-JRN-2).
    #[error("out of order: expected event {expected}, got {got}")]
    OutOfOrder {
        /// The next number the record takes.
        expected: u64,
        /// What was sent.
        got: u64,
    },
    /// The idempotency key already names a response with another request
    /// (R-IDEM-1).
    #[error("the idempotency key was used with a different request")]
    IdempotencyConflict,
    /// A record with this id exists already.
    #[error("a response with this id exists")]
    DuplicateId,
    /// The store is full: new durable requests are refused (R-JRN-5).
    #[error("the response store is full")]
    Full,
    /// The record would grow past `max_record_bytes`.
    #[error("the response exceeds the store's per-response bound")]
    RecordTooLarge,
    /// The store could not run the operation (I/O, corruption, shutdown).
    #[error("the response store failed: {0}")]
    Store(String),
    /// The store is not open now: the Edge is connecting to it, or
    /// opening it again after a failure (R-JRN-6). Nothing was written;
    /// the request alone is refused, and may be retried.
    #[error("the response store is not reachable yet ({})", .0.as_str())]
    Unavailable(availability::StoreState),
    /// The Edge is still ending records its requests left open in a store
    /// outage, more than its custody takes at once: new durable requests
    /// are refused until it catches up
    /// ([`Custody::refuses_durable`](crate::edge::custody::Custody::refuses_durable)).
    /// Nothing was written; the request may be retried.
    #[error("the response store is still ending the responses an outage cut")]
    Backlog,
}

impl JournalError {
    /// The stable lower-case name (a closed label value).
    pub fn as_str(&self) -> &'static str {
        match self {
            JournalError::NotFound => "not_found",
            JournalError::Fenced { .. } => "fenced",
            JournalError::Terminated => "terminated",
            JournalError::OutOfOrder { .. } => "out_of_order",
            JournalError::IdempotencyConflict => "idempotency_conflict",
            JournalError::DuplicateId => "duplicate_id",
            JournalError::Full => "full",
            JournalError::RecordTooLarge => "record_too_large",
            JournalError::Store(_) => "store_error",
            JournalError::Unavailable(_) => "store_unavailable",
            JournalError::Backlog => "backlog",
        }
    }

    /// Every name [`Self::as_str`] gives.
    pub const NAMES: &'static [&'static str] = &[
        "not_found",
        "fenced",
        "terminated",
        "out_of_order",
        "idempotency_conflict",
        "duplicate_id",
        "full",
        "record_too_large",
        "store_error",
        "store_unavailable",
        "backlog",
    ];

    /// A failure of the store rather than a rule's refusal: the same
    /// operation may succeed if tried again (R-JRN-6).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            JournalError::Store(_) | JournalError::Unavailable(_) | JournalError::Backlog
        )
    }
}

/// What [`check_create`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateOutcome {
    /// Create this record (epoch 1, no events).
    Create(RecordMeta),
    /// The idempotency key names this live record with the same request:
    /// the caller gets it, and nothing runs again (R-IDEM-1).
    Existing(RecordMeta),
}

/// Decide a create. `same_id` is the record stored under `new.id`, if any;
/// `same_key` the one the idempotency key names, if any (expired ones are
/// passed as `None` or are treated so, and so are [`superseded`] ones);
/// `used_bytes` what the store holds. On [`CreateOutcome::Create`] the store
/// removes whatever record still holds the key.
pub fn check_create(
    now_unix_ms: u64,
    limits: &JournalLimits,
    used_bytes: u64,
    same_id: Option<&RecordMeta>,
    same_key: Option<&RecordMeta>,
    new: &NewRecord,
) -> Result<CreateOutcome, JournalError> {
    if let Some(existing) = same_key.filter(|r| !expired(r, now_unix_ms) && !superseded(r)) {
        // R-IDEM-1: one response per (principal, key); the principal is
        // inside the hash, the check here guards a hash collision.
        if existing.principal == new.principal
            && existing.fingerprint == new.fingerprint
            && existing.api == new.api
        {
            return Ok(CreateOutcome::Existing(existing.clone()));
        }
        return Err(JournalError::IdempotencyConflict);
    }
    if same_id.is_some_and(|r| !expired(r, now_unix_ms)) {
        return Err(JournalError::DuplicateId);
    }
    let bytes = new.request.len() as u64 + RECORD_OVERHEAD_BYTES;
    if bytes > limits.max_record_bytes {
        return Err(JournalError::RecordTooLarge);
    }
    // R-JRN-5: a full store refuses new records; it never drops accepted
    // ones to make room.
    if used_bytes.saturating_add(bytes) > limits.max_bytes {
        return Err(JournalError::Full);
    }
    Ok(CreateOutcome::Create(RecordMeta {
        id: new.id.clone(),
        principal: new.principal.clone(),
        api: new.api,
        model: new.model.clone(),
        fingerprint: new.fingerprint,
        idempotency_key: new.idempotency_key,
        background: new.background,
        created_unix_ms: new.created_unix_ms,
        epoch: 1,
        last_seq: 0,
        terminal: None,
        expires_unix_ms: u64::MAX,
        stored_bytes: bytes,
        owner: new.owner.clone(),
        key_id: new.key_id.clone(),
    }))
}

/// A record its idempotency key no longer names: it failed (or was cut
/// short by an Edge restart) before any event (admission refused it, its
/// attempts failed before commit, its Edge died before its first event), so
/// nothing of it was ever published and a retry with the same key runs
/// afresh instead of being told the same failure again (R-IDEM-1). The
/// store replaces it under the key.
pub fn superseded(meta: &RecordMeta) -> bool {
    #[cfg(feature = "planted-bugs")]
    let nothing_journaled = meta.last_seq == 0
        || crate::planted::in_thread(crate::planted::PlantedBug::SupersedeWithEvents);
    #[cfg(not(feature = "planted-bugs"))]
    let nothing_journaled = meta.last_seq == 0;
    nothing_journaled
        && meta
            .terminal
            .as_ref()
            .is_some_and(|t| matches!(t.status, RecordStatus::Failed | RecordStatus::Incomplete))
}

/// The writer-epoch check shared by appends and terminals (R-JRN-3, R-JRN-4).
fn check_writer(meta: &RecordMeta, epoch: u64) -> Result<(), JournalError> {
    if meta.epoch != epoch {
        return Err(JournalError::Fenced {
            current: meta.epoch,
            writer: epoch,
        });
    }
    if meta.terminal.is_some() {
        return Err(JournalError::Terminated);
    }
    Ok(())
}

/// Decide an append of `events` by a writer of `epoch`: the record after
/// it, or why not. Events must be numbered `last_seq + 1, + 2, ...`.
pub fn check_append(
    limits: &JournalLimits,
    meta: &RecordMeta,
    epoch: u64,
    events: &[JournalEvent],
) -> Result<RecordMeta, JournalError> {
    #[cfg(feature = "planted-bugs")]
    let epoch = if crate::planted::in_thread(crate::planted::PlantedBug::AppendIgnoresEpoch) {
        meta.epoch
    } else {
        epoch
    };
    check_writer(meta, epoch)?;
    let mut next = meta.clone();
    for event in events {
        let expected = next.last_seq + 1;
        if event.seq != expected {
            return Err(JournalError::OutOfOrder {
                expected,
                got: event.seq,
            });
        }
        next.last_seq = expected;
        next.stored_bytes = next.stored_bytes.saturating_add(event_bytes(event));
    }
    if next.stored_bytes > limits.max_record_bytes {
        return Err(JournalError::RecordTooLarge);
    }
    Ok(next)
}

/// Decide the terminal of a record by a writer of `epoch` (R-JRN-4): the
/// record after it, with its retention clock started.
pub fn check_finish(
    limits: &JournalLimits,
    meta: &RecordMeta,
    epoch: u64,
    terminal: &Terminal,
) -> Result<RecordMeta, JournalError> {
    check_writer(meta, epoch)?;
    let mut next = meta.clone();
    let mut terminal = terminal.clone();
    if !terminal.status.is_terminal() {
        // A terminal that says "in progress" is a caller's bug; it still
        // ends the record rather than leave it open forever.
        terminal.status = RecordStatus::Failed;
    }
    next.expires_unix_ms = terminal.at_unix_ms.saturating_add(limits.retention_ms);
    next.terminal = Some(terminal);
    Ok(next)
}

/// Decide a takeover: the record's epoch moves from `expected` to
/// `expected + 1` only if it still is `expected` (compare-and-set,
/// R-JRN-3), and `owner` (the winning Edge's id) becomes its owner. The
/// winner writes with the new epoch; the former owner's appends are
/// refused from then on.
pub fn check_raise_epoch(
    meta: &RecordMeta,
    expected: u64,
    owner: &str,
) -> Result<RecordMeta, JournalError> {
    if meta.epoch != expected {
        return Err(JournalError::Fenced {
            current: meta.epoch,
            writer: expected,
        });
    }
    if meta.terminal.is_some() {
        return Err(JournalError::Terminated);
    }
    let mut next = meta.clone();
    next.epoch = expected + 1;
    owner.clone_into(&mut next.owner);
    #[cfg(feature = "planted-bugs")]
    if crate::planted::in_thread(crate::planted::PlantedBug::TakeoverWithoutRaise) {
        next.epoch = expected;
    }
    Ok(next)
}

/// May the record be removed now? Only a finished record past its
/// retention; a running record never expires (R-JRN-5).
pub fn expired(meta: &RecordMeta, now_unix_ms: u64) -> bool {
    meta.terminal.is_some() && meta.expires_unix_ms <= now_unix_ms
}

/// The `incomplete` reason of a record whose owner was this Edge before
/// it restarted (R-TAKE-1).
pub const EDGE_RESTART_REASON: &str = "edge_restart";

/// The `incomplete` reason of a record whose owner was another Edge whose
/// ownership lease expired (R-TAKE-1, R-MULTI-1).
pub const EDGE_LOST_REASON: &str = "edge_lost";

/// The `failed` reason of a record its writer could not finish because
/// the store refused its writes (R-JRN-4, R-JRN-6): the request's own
/// terminal, or its Edge's custody's when the store refused that too.
pub const JOURNAL_UNAVAILABLE_REASON: &str = "journal_unavailable";

/// The shortest lease TTL an Edge may promise.
pub const MIN_LEASE_TTL_MS: u64 = 1_000;

/// The longest lease TTL an Edge may promise (and an observer waits).
pub const MAX_LEASE_TTL_MS: u64 = 600_000;

/// Edges a [`LeaseView`] follows at most; one more is not followed (its
/// records are never taken over by that view: the safe side).
pub const MAX_TRACKED_EDGES: usize = 1024;

/// An Edge's ownership lease, one per `edge_id` in the store: the Edge
/// rewrites it every [`EdgeLease::renew_interval`], and each write gives
/// it a new store revision (R-TAKE-1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EdgeLease {
    /// The Edge's `edge_id`.
    pub edge_id: String,
    /// Random per process start: tells a restart (or a second process
    /// configured with the same id) from a renewal.
    pub incarnation: u64,
    /// How long the lease holds without a renewal, as its Edge promises.
    pub ttl_ms: u64,
    /// When it was last written, in its Edge's Unix milliseconds (for
    /// operators: no decision compares another Edge's clock).
    pub renewed_unix_ms: u64,
}

impl EdgeLease {
    /// The TTL observers apply: `ttl_ms` within
    /// [`MIN_LEASE_TTL_MS`]..=[`MAX_LEASE_TTL_MS`].
    pub fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms.clamp(MIN_LEASE_TTL_MS, MAX_LEASE_TTL_MS))
    }

    /// How often its Edge rewrites it: a third of its TTL, so two lost
    /// renewals in a row still leave it alive.
    pub fn renew_interval(&self) -> Duration {
        self.ttl() / 3
    }
}

/// A lease as read from the store: its value and the store's revision of
/// it (every write makes a new, greater one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredLease {
    /// The store's revision of this value.
    pub revision: u64,
    /// The value.
    pub lease: EdgeLease,
}

/// Decide a lease write: it replaces the stored lease only if that is
/// still at revision `expected` (0: no lease), so an Edge learns when
/// something else (a second process with its `edge_id`) wrote it.
pub fn check_put_lease(stored: Option<&StoredLease>, expected: u64) -> Result<(), JournalError> {
    let current = stored.map_or(0, |s| s.revision);
    if current != expected {
        return Err(JournalError::Fenced {
            current,
            writer: expected,
        });
    }
    Ok(())
}

/// What an observer concludes of an Edge's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Seen to change while observed, the last change within its TTL: its
    /// Edge is alive.
    Renewing,
    /// Not seen to change yet, and not observed for a whole TTL either
    /// (this Edge just started, or a store read failed): treated as alive.
    Unconfirmed,
    /// Unchanged (or absent) for its whole TTL of continuous observation:
    /// its Edge is gone.
    Expired,
}

impl LeaseState {
    /// The stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseState::Renewing => "renewing",
            LeaseState::Unconfirmed => "unconfirmed",
            LeaseState::Expired => "expired",
        }
    }
}

/// One Edge as a [`LeaseView`] follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SeenLease {
    /// The revision last read; `None`: no lease was there.
    revision: Option<u64>,
    /// The value last read, if any.
    lease: Option<EdgeLease>,
    /// When this revision (or this absence) was first read, or the last
    /// failed read, whichever is later.
    since: Instant,
    /// A change was seen while observing (evidence of life).
    changed: bool,
}

/// An Edge's view of every Edge's lease, on its own clock (see the module
/// docs): when it first read each lease's current revision. A revision
/// that does not move for the lease's TTL of continuous observation means
/// its Edge stopped renewing; nothing compares two Edges' clocks.
#[derive(Debug, Clone)]
pub struct LeaseView {
    /// The TTL an absent lease is judged by.
    default_ttl: Duration,
    edges: BTreeMap<String, SeenLease>,
}

/// One Edge's lease as a [`LeaseView`] sees it now (for status surfaces).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerLease {
    /// The Edge's id.
    pub edge_id: String,
    /// What the view concludes.
    pub state: LeaseState,
    /// The lease last read, if there was one.
    pub lease: Option<EdgeLease>,
}

impl LeaseView {
    /// A view that judges an absent lease by `default_ttl` (the observer's
    /// own TTL).
    pub fn new(default_ttl: Duration) -> Self {
        LeaseView {
            default_ttl,
            edges: BTreeMap::new(),
        }
    }

    /// A fresh read of `edge_id`'s lease at `now`: its stored value, or
    /// `None` when the store holds none.
    pub fn observe(&mut self, edge_id: &str, read: Option<&StoredLease>, now: Instant) {
        let revision = read.map(|l| l.revision);
        let lease = read.map(|l| l.lease.clone());
        let full = self.edges.len() >= MAX_TRACKED_EDGES;
        match self.edges.get_mut(edge_id) {
            Some(seen) if seen.revision == revision => {
                if lease.is_some() {
                    seen.lease = lease;
                }
            }
            Some(seen) => {
                // A write while observed is life; a removal is not.
                seen.changed = read.is_some();
                seen.revision = revision;
                if lease.is_some() {
                    seen.lease = lease;
                }
                seen.since = now;
            }
            None if full => {}
            None => {
                self.edges.insert(
                    edge_id.to_owned(),
                    SeenLease {
                        revision,
                        lease,
                        since: now,
                        changed: false,
                    },
                );
            }
        }
    }

    /// A read of every lease the store holds: each Edge followed and not
    /// in `leases` has none now.
    pub fn observe_all(&mut self, leases: &[StoredLease], now: Instant) {
        for stored in leases {
            self.observe(&stored.lease.edge_id, Some(stored), now);
        }
        let absent: Vec<String> = self
            .edges
            .keys()
            .filter(|id| !leases.iter().any(|l| &l.lease.edge_id == *id))
            .cloned()
            .collect();
        for id in absent {
            self.observe(&id, None, now);
        }
    }

    /// A store read failed at `now`: what was seen before says nothing of
    /// the time since (the store may have been out for every Edge, none
    /// could renew), so every clock starts again.
    pub fn read_failed(&mut self, now: Instant) {
        for seen in self.edges.values_mut() {
            seen.since = seen.since.max(now);
        }
    }

    /// What the view concludes of `edge_id` at `now`; `None`: never read.
    pub fn state(&self, edge_id: &str, now: Instant) -> Option<LeaseState> {
        let seen = self.edges.get(edge_id)?;
        let ttl = seen.lease.as_ref().map_or(self.default_ttl, EdgeLease::ttl);
        #[cfg(feature = "planted-bugs")]
        if crate::planted::in_thread(crate::planted::PlantedBug::RenewingLeaseExpired)
            && seen.changed
            && seen.revision.is_some()
        {
            return Some(LeaseState::Expired);
        }
        Some(if now.saturating_duration_since(seen.since) >= ttl {
            LeaseState::Expired
        } else if seen.changed && seen.revision.is_some() {
            LeaseState::Renewing
        } else {
            LeaseState::Unconfirmed
        })
    }

    /// Every Edge followed, as seen at `now`, by id.
    pub fn peers(&self, now: Instant) -> Vec<PeerLease> {
        self.edges
            .iter()
            .filter_map(|(id, seen)| {
                Some(PeerLease {
                    edge_id: id.clone(),
                    state: self.state(id, now)?,
                    lease: seen.revision.and(seen.lease.clone()),
                })
            })
            .collect()
    }
}

/// Renewal intervals a starting Edge watches its own id's lease for
/// (R-TAKE-2): a live holder renews within one; two let one renewal fail.
pub const CLAIM_RENEWALS_WATCHED: u32 = 2;

/// What a starting Edge may do with its `edge_id`'s lease (R-TAKE-2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimVerdict {
    /// Take it: write this Edge's lease over the revision last read (0:
    /// none), so a process that writes it meanwhile still wins the race.
    Take {
        /// The revision the write expects.
        expected_revision: u64,
    },
    /// Another live process renews it: this one must not start.
    InUse {
        /// The lease as last read.
        holder: EdgeLease,
    },
}

/// A starting Edge's question about its own `edge_id` (R-TAKE-2): is
/// another process renewing its lease? The Edge reads the lease, then
/// reads it again until [`LeaseClaim::watch_until`]; a revision that
/// moves while watched is another live process ([`ClaimVerdict::InUse`]).
/// One that stays (a crashed predecessor's, this Edge's own last run's) or
/// is absent may be taken: a restart after a crash waits at most
/// [`CLAIM_RENEWALS_WATCHED`] renewal intervals, less than one TTL. On a
/// store only this process can open there is nobody to watch for.
/// Nothing compares clocks: the watch runs on the starting Edge's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseClaim {
    first: Option<StoredLease>,
    last: Option<StoredLease>,
    until: Instant,
    moved: bool,
}

impl LeaseClaim {
    /// A claim on the first read of the lease, at `now`. `shared`: other
    /// processes can open the store (else the lease can only be this
    /// Edge's own former run's, taken at once).
    pub fn new(read: Option<&StoredLease>, now: Instant, shared: bool) -> Self {
        let until = match read {
            Some(stored) if shared => {
                now.saturating_add(stored.lease.renew_interval() * CLAIM_RENEWALS_WATCHED)
            }
            _ => now,
        };
        LeaseClaim {
            first: read.cloned(),
            last: read.cloned(),
            until,
            moved: false,
        }
    }

    /// A later read of the lease at `now` (`None`: the store holds none).
    pub fn observe(&mut self, read: Option<&StoredLease>, _now: Instant) {
        let first = self.first.as_ref().map(|l| l.revision);
        if let Some(stored) = read
            && Some(stored.revision) != first
        {
            // A write while watched: a process renews it.
            self.moved = true;
        }
        self.last = read.cloned();
    }

    /// Until when the lease is to be watched (read again).
    pub fn watch_until(&self) -> Instant {
        self.until
    }

    /// The verdict at `now`, once there is one: `InUse` as soon as the
    /// lease moved, `Take` once it was watched without moving.
    pub fn verdict(&self, now: Instant) -> Option<ClaimVerdict> {
        if self.moved {
            let holder = self.last.as_ref().or(self.first.as_ref())?;
            return Some(ClaimVerdict::InUse {
                holder: holder.lease.clone(),
            });
        }
        (now >= self.until).then(|| ClaimVerdict::Take {
            expected_revision: self.last.as_ref().map_or(0, |l| l.revision),
        })
    }
}

/// Why a record without a terminal lost its writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Orphan {
    /// Its owner is this Edge, and no run of this Edge writes it: this
    /// Edge's previous incarnation wrote it (or its run ended without its
    /// terminal).
    EdgeRestart,
    /// Its owner is another Edge whose lease expired.
    EdgeLost,
}

impl Orphan {
    /// The closed `incomplete` reason a takeover ends it with.
    pub fn reason(self) -> &'static str {
        match self {
            Orphan::EdgeRestart => EDGE_RESTART_REASON,
            Orphan::EdgeLost => EDGE_LOST_REASON,
        }
    }
}

/// Is `meta` an orphan for Edge `me` (R-TAKE-1)? `live_here`: a run of
/// this Edge writes it; `owner`: its owner's lease as `me` sees it
/// (`None`: not read). A record with a terminal, one this Edge runs, and
/// one whose owner is not seen expired (renewing, unconfirmed, unread)
/// is not.
pub fn orphan(
    meta: &RecordMeta,
    me: &str,
    live_here: bool,
    owner: Option<LeaseState>,
) -> Option<Orphan> {
    if meta.terminal.is_some() || live_here {
        return None;
    }
    if meta.owner == me || meta.owner == NO_OWNER {
        return Some(Orphan::EdgeRestart);
    }
    (owner == Some(LeaseState::Expired)).then_some(Orphan::EdgeLost)
}

/// What [`TakeoverScan::decide`] says of one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TakeoverDecision {
    /// Not an orphan: leave it to its writer.
    Keep,
    /// An orphan within its park window: its node may still report the
    /// run parked (R-PARK-2). Look again at `until`.
    Wait {
        /// When the window ends.
        until: Instant,
    },
    /// An orphan past its park window: take it over (raise its epoch,
    /// R-JRN-3) and end it `incomplete` with [`Orphan::reason`] and its
    /// durable prefix. The caller decides again on a fresh read of the
    /// record and its owner's lease before it acts.
    End(Orphan),
}

/// The takeover scan's memory from one scan to the next (R-TAKE-1): the
/// leases it has seen ([`LeaseView`]) and since when each orphan waits.
/// Its size is bounded by the records passed in ([`TakeoverScan::retain`]
/// after each scan) and [`MAX_TRACKED_EDGES`].
#[derive(Debug, Clone)]
pub struct TakeoverScan {
    me: String,
    park_window: Duration,
    /// The store is this Edge's alone (embedded, in memory): every record
    /// in it is this Edge's, whatever owner it names (an `edge_id` changed
    /// between two runs).
    sole: bool,
    leases: LeaseView,
    waiting: HashMap<String, (Instant, Orphan)>,
}

impl TakeoverScan {
    /// The scan of Edge `me`: an orphan waits `park_window` (the nodes'
    /// park grace and the slack for their reports); an absent lease is
    /// judged by `lease_ttl` (this Edge's own).
    pub fn new(me: &str, park_window: Duration, lease_ttl: Duration) -> Self {
        TakeoverScan {
            me: me.to_owned(),
            park_window,
            sole: false,
            leases: LeaseView::new(lease_ttl),
            waiting: HashMap::new(),
        }
    }

    /// The scan of Edge `me` on a store no other Edge opens (embedded, in
    /// memory): no other Edge can be alive, so every record it did not
    /// write in this run is its own previous run's
    /// ([`Orphan::EdgeRestart`]), whatever owner it names.
    pub fn sole(me: &str, park_window: Duration) -> Self {
        TakeoverScan {
            sole: true,
            ..Self::new(me, park_window, Duration::from_millis(MIN_LEASE_TTL_MS))
        }
    }

    /// Is the store this Edge's alone ([`Self::sole`])?
    pub fn is_sole(&self) -> bool {
        self.sole
    }

    /// This Edge's id.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The leases seen.
    pub fn leases(&self) -> &LeaseView {
        &self.leases
    }

    /// The leases seen, to feed reads to.
    pub fn leases_mut(&mut self) -> &mut LeaseView {
        &mut self.leases
    }

    /// Decide on `meta` as read at `now`; `live_here`: a run of this Edge
    /// writes it. An orphan's park window starts when it is first found an
    /// orphan; one that stops being one (adopted, its owner back, ended)
    /// is forgotten.
    pub fn decide(&mut self, meta: &RecordMeta, live_here: bool, now: Instant) -> TakeoverDecision {
        let Some(kind) = self.orphan_now(meta, live_here, now) else {
            self.waiting.remove(&meta.id);
            return TakeoverDecision::Keep;
        };
        let (since, seen_kind) = self.waiting.entry(meta.id.clone()).or_insert((now, kind));
        if *seen_kind != kind {
            *seen_kind = kind;
            *since = now;
        }
        let until = since.saturating_add(self.park_window);
        if now >= until {
            TakeoverDecision::End(kind)
        } else {
            TakeoverDecision::Wait { until }
        }
    }

    /// Is `meta`, as read at `now`, an orphan, whatever its park window?
    /// A takeover decided by [`Self::decide`] asks this again on each
    /// fresh read before it writes once more (a raise another writer beat).
    pub fn orphan_now(&self, meta: &RecordMeta, live_here: bool, now: Instant) -> Option<Orphan> {
        if self.sole {
            orphan(meta, &meta.owner, live_here, None)
        } else {
            orphan(
                meta,
                &self.me,
                live_here,
                self.leases.state(&meta.owner, now),
            )
        }
    }

    /// Forget `id` (ended, or found gone).
    pub fn forget(&mut self, id: &str) {
        self.waiting.remove(id);
    }

    /// Keep only the orphans `keep` names (the records still unfinished).
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.waiting.retain(|id, _| keep(id));
    }

    /// Orphans waiting for their park window.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Is `id` an orphan waiting for its park window?
    pub fn is_waiting(&self, id: &str) -> bool {
        self.waiting.contains_key(id)
    }

    /// When the first waiting orphan's park window ends.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.waiting
            .values()
            .map(|(since, _)| since.saturating_add(self.park_window))
            .min()
    }
}

/// A ticket naming one submitted operation in [`GroupCommit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Ticket(pub u64);

/// The group-commit rule of R-JRN-1: operations submitted while a sync is
/// running wait and go together in the next one, so many appends (of one
/// response or many) share one sync. The queue is bounded (R-LIM-4): a
/// full queue refuses the submit, and the caller fails that request
/// rather than wait without bound.
///
/// The queue is shared by every tenant, so each *share* (an operation's
/// principal, named by the store) may hold at most `max_queued_per_share`
/// of it: one principal's burst meets its own bound and leaves the rest
/// of the queue to the others (R-TEN-1: one principal's use never takes
/// another's share). Operations of no share (sweeps, tenants' counters)
/// meet only the whole queue's bound.
///
/// Not a [`Machine`](crate::Machine): a bounded queue the store's writer
/// drains a batch at a time ([`GroupCommit::poll_batch`]); the rules it
/// carries (which operations wait, which are refused) are answers to
/// `submit`.
#[derive(Debug)]
pub struct GroupCommit<Op> {
    queue: VecDeque<Queued<Op>>,
    queued_bytes: usize,
    syncing: bool,
    max_queued: usize,
    max_batch_ops: usize,
    max_batch_bytes: usize,
    max_queued_per_share: usize,
    /// Operations queued per share (only shares with some).
    per_share: HashMap<u64, usize>,
}

#[derive(Debug)]
struct Queued<Op> {
    ticket: Ticket,
    op: Op,
    bytes: usize,
    share: Option<u64>,
}

/// The queue of [`GroupCommit`] is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueFull {
    /// Every place is taken.
    #[error("the journal's write queue is full")]
    Queue,
    /// The operation's share (its principal's) is taken.
    #[error("the journal's write queue is full for this principal")]
    Share,
}

/// The share of the operations of `principal` in [`GroupCommit`]: a hash
/// (the queue keeps counts, not names).
pub fn write_share(principal: &str) -> u64 {
    let digest = Sha256::digest(principal.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

impl<Op> GroupCommit<Op> {
    /// A queue holding at most `max_queued` operations; a batch takes at
    /// most `max_batch_ops` operations and, past its first, at most
    /// `max_batch_bytes` bytes. Each share may hold the whole queue (see
    /// [`Self::with_share_bound`]).
    pub fn new(max_queued: usize, max_batch_ops: usize, max_batch_bytes: usize) -> Self {
        GroupCommit {
            queue: VecDeque::new(),
            queued_bytes: 0,
            syncing: false,
            max_queued: max_queued.max(1),
            max_batch_ops: max_batch_ops.max(1),
            max_batch_bytes,
            max_queued_per_share: usize::MAX,
            per_share: HashMap::new(),
        }
    }

    /// Each share holds at most `max_queued_per_share` queued operations
    /// (at least one).
    pub fn with_share_bound(mut self, max_queued_per_share: usize) -> Self {
        self.max_queued_per_share = max_queued_per_share.max(1);
        self
    }

    /// Queue an operation of `bytes` bytes, of no share.
    pub fn submit(&mut self, ticket: Ticket, op: Op, bytes: usize) -> Result<(), QueueFull> {
        self.submit_as(ticket, op, bytes, None)
    }

    /// Queue an operation of `bytes` bytes counted against `share`
    /// ([`write_share`]), if any.
    pub fn submit_as(
        &mut self,
        ticket: Ticket,
        op: Op,
        bytes: usize,
        share: Option<u64>,
    ) -> Result<(), QueueFull> {
        if self.queue.len() >= self.max_queued {
            return Err(QueueFull::Queue);
        }
        if let Some(share) = share {
            let held = self.per_share.entry(share).or_insert(0);
            if *held >= self.max_queued_per_share {
                return Err(QueueFull::Share);
            }
            *held += 1;
        }
        self.queued_bytes += bytes;
        self.queue.push_back(Queued {
            ticket,
            op,
            bytes,
            share,
        });
        Ok(())
    }

    /// The next batch to write and sync, if no sync is running and
    /// something waits. The caller writes the batch in one transaction,
    /// syncs once, answers every ticket, then calls [`GroupCommit::synced`].
    pub fn poll_batch(&mut self) -> Option<Vec<(Ticket, Op)>> {
        if self.syncing || self.queue.is_empty() {
            return None;
        }
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        while let Some(next) = self.queue.front() {
            if !batch.is_empty()
                && (batch.len() >= self.max_batch_ops || bytes + next.bytes > self.max_batch_bytes)
            {
                break;
            }
            let Some(q) = self.queue.pop_front() else {
                break;
            };
            bytes += q.bytes;
            self.queued_bytes -= q.bytes;
            if let Some(share) = q.share
                && let Some(held) = self.per_share.get_mut(&share)
            {
                *held -= 1;
                if *held == 0 {
                    self.per_share.remove(&share);
                }
            }
            batch.push((q.ticket, q.op));
        }
        self.syncing = true;
        Some(batch)
    }

    /// The running sync finished.
    pub fn synced(&mut self) {
        self.syncing = false;
    }

    /// Operations waiting.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Operations of `share` waiting.
    pub fn queued_for(&self, share: u64) -> usize {
        self.per_share.get(&share).copied().unwrap_or(0)
    }

    /// Bytes waiting.
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }
}

#[cfg(test)]
mod tests;
