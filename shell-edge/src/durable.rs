//! Durable responses at the Edge (SPEC §6): the store, the runs this Edge
//! writes, following a record, and the restart scan.
//!
//! A durable request's run is not tied to its client: its driver
//! ([`crate::driver::spawn_durable`]) writes every delivery to the
//! response's journal through the request machine (publish after durable,
//! R-JRN-1, decided in `iop_core::edge::durable`), and **every reader
//! follows the journal** with a [`Follower`]: the client that sent the
//! request, a client that resumes it (`starting_after`, `Last-Event-ID`),
//! a retry with the same `Idempotency-Key`. So what any client sees is
//! durable, and a resumed stream is the same stream (R-JRN-2): the API's
//! encoder renders the record's events from the first one and the reader
//! skips what it already has.
//!
//! Every Edge keeps an ownership lease in the store ([`Durable::take_lease`],
//! renewed by [`Durable::spawn_lease_renewal`]). The records no run of
//! this Edge writes are in the custody of
//! [`iop_core::edge::custody::Custody`], driven by
//! [`crate::custody::CustodyTask`]: a record this Edge's previous run, or
//! an Edge whose lease expired, left behind waits the park window (its
//! node may report the run parked, and an Edge adopt it), then is
//! continued on its pool when its route continues answers, or ends
//! `incomplete` with its durable prefix (R-TAKE-1, R-CONT-1, R-MULTI-1).
//!
//! Nothing here decides a journal rule: numbering, fencing, the one
//! terminal, retention, idempotency, lease expiry and which record is an
//! orphan are `iop_core::journal`'s, applied by the store
//! ([`iop_store::JournalStore`]) or by the custody machine.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iop_core::edge::durable::{
    JournalAck, JournalWrite, WRITE_RETRY, WriteRetry, WriteRetryPolicy, WriteVerdict,
    decode_delivery,
};
use iop_core::edge::request::Delivery;
use iop_core::journal::availability::{AvailabilityView, StoreState};
use iop_core::journal::{
    ClaimVerdict, CreateOutcome, EdgeLease, JournalError, LeaseClaim, LeaseState, NewRecord,
    PeerLease, RecordMeta, RecordStatus, TakeoverScan, Terminal,
};
use iop_store::{JournalStore, Progress};
use iop_wire::ChatMessage;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use crate::config::{JournalSection, JournalStoreKind};
use crate::metrics::EdgeMetrics;

mod keeper;
mod slot;

use slot::{Opened, SlotJournal, SlotTenants, StoreSlot};

/// Events read from the store at a time by a follower.
const FOLLOW_BATCH: usize = 256;

/// The closed reason of a record ended because the Edge that ran it
/// restarted (R-TAKE-1).
pub const EDGE_RESTART_REASON: &str = iop_core::journal::EDGE_RESTART_REASON;

/// The closed reason of a record ended because the Edge that ran it is
/// gone: its ownership lease expired (R-TAKE-1, R-MULTI-1).
pub const EDGE_LOST_REASON: &str = iop_core::journal::EDGE_LOST_REASON;

/// What a durable record keeps of its request: enough to render its
/// answer again (the API's own encoder over the stored events), to list
/// its input and to continue its conversation (`previous_response_id`).
///
/// A continued conversation is stored link by link (R-LIM-6): a record
/// keeps its own request and the id of the response it continues
/// ([`Self::previous`]), and the conversation is rebuilt by walking the
/// links back ([`crate::stored`]). Builds before that stored the whole
/// conversation before the request in every link ([`Self::history`]);
/// such records are still read and continued.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredRequest {
    /// The seed of the answer's ids ([`crate::api::ids`]).
    pub id_seed: u64,
    /// When the request was admitted, Unix milliseconds (the answer's
    /// `created` times come from it, so every rendering is the same).
    pub created_unix_ms: u64,
    /// `store` as decided (sent, or the Edge's default).
    pub store: bool,
    /// `background: true` was sent.
    pub background: bool,
    /// The request body as sent.
    pub body: Vec<u8>,
    /// The conversation before this request's own input, without
    /// instructions, as older builds stored it in every link of a
    /// continued conversation. This build writes [`Self::previous`]
    /// instead, and reads this from the records older builds wrote.
    pub history: Option<Vec<ChatMessage>>,
    /// The stored response this request continues (`previous_response_id`):
    /// its conversation is that response's, rebuilt link by link. Written
    /// in its own format ([`LINK_FORMAT`]), so a build that does not walk
    /// links never reads such a record as one without a conversation.
    #[serde(skip)]
    pub previous: Option<String>,
    /// The record holds a history this build cannot read (written by a
    /// build whose messages had other fields): its answer is served as
    /// stored, but its conversation cannot be continued. Never stored.
    #[serde(skip)]
    pub history_unreadable: bool,
}

/// A [`StoredRequest`] without its history: the fields before it, as every
/// build since the format began writes them (postcard writes fields in
/// order, so a history this build cannot read leaves these readable). A
/// link of a conversation ([`LINK_FORMAT`]) is these, then its previous
/// response's id.
#[derive(Deserialize)]
struct StoredRequestHead {
    id_seed: u64,
    created_unix_ms: u64,
    store: bool,
    background: bool,
    body: Vec<u8>,
}

/// [`StoredRequestHead`] and the previous response's id, as a link is
/// written.
#[derive(Serialize)]
struct LinkRef<'a> {
    id_seed: u64,
    created_unix_ms: u64,
    store: bool,
    background: bool,
    body: &'a [u8],
    previous: &'a str,
}

impl StoredRequest {
    /// The bytes kept in the record.
    pub fn encode(&self) -> Vec<u8> {
        // Plain data: postcard cannot fail on it short of running out of
        // memory.
        match &self.previous {
            Some(previous) if self.history.is_none() => {
                let mut out = vec![LINK_FORMAT];
                out.extend(
                    postcard::to_allocvec(&LinkRef {
                        id_seed: self.id_seed,
                        created_unix_ms: self.created_unix_ms,
                        store: self.store,
                        background: self.background,
                        body: &self.body,
                        previous,
                    })
                    .unwrap_or_default(),
                );
                out
            }
            _ => {
                let mut out = vec![STORED_REQUEST_FORMAT];
                out.extend(postcard::to_allocvec(self).unwrap_or_default());
                out
            }
        }
    }

    /// Read them back; `None` for bytes this build does not understand.
    /// A record whose history does not decode (its messages were written
    /// by a build with other message fields) is read without it, marked
    /// [`Self::history_unreadable`], so its answer stays retrievable.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        match bytes.split_first() {
            Some((&STORED_REQUEST_FORMAT, rest)) => Self::decode_whole(rest),
            Some((&LINK_FORMAT, rest)) => {
                let (head, after): (StoredRequestHead, &[u8]) =
                    postcard::take_from_bytes(rest).ok()?;
                let previous: String = postcard::from_bytes(after).ok()?;
                Some(StoredRequest {
                    id_seed: head.id_seed,
                    created_unix_ms: head.created_unix_ms,
                    store: head.store,
                    background: head.background,
                    body: head.body,
                    history: None,
                    previous: Some(previous),
                    history_unreadable: false,
                })
            }
            _ => None,
        }
    }

    fn decode_whole(rest: &[u8]) -> Option<Self> {
        if let Ok(whole) = postcard::from_bytes(rest) {
            return Some(whole);
        }
        let (head, after): (StoredRequestHead, &[u8]) = postcard::take_from_bytes(rest).ok()?;
        // The history was written (`Some`: postcard's tag 1) but is unreadable.
        let unreadable = after.first() == Some(&1);
        Some(StoredRequest {
            id_seed: head.id_seed,
            created_unix_ms: head.created_unix_ms,
            store: head.store,
            background: head.background,
            body: head.body,
            history: None,
            previous: None,
            history_unreadable: unreadable,
        })
    }
}

/// The format byte in front of a [`StoredRequest`] that continues no
/// stored response, or (older builds) holds its whole history.
const STORED_REQUEST_FORMAT: u8 = 1;

/// The format byte in front of a link of a continued conversation: its
/// own request and its previous response's id (R-LIM-6). A build that
/// knows only [`STORED_REQUEST_FORMAT`] does not read it (it answers
/// such a record as unreadable rather than continue it without its
/// conversation).
const LINK_FORMAT: u8 = 2;

/// Why the journal of durable responses cannot be set up. A store that
/// cannot be reached or opened is none of these: the Edge starts without
/// it and opens it in the background (R-JRN-6).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// `[journal.nats]` is unusable (checked at load; the environment may
    /// have changed since).
    #[error("{0}")]
    Config(#[from] iop_transport::settings::ConfigError),
}

/// How often a starting Edge reads its id's lease while it watches it
/// (R-TAKE-2).
const CLAIM_READ_INTERVAL: Duration = Duration::from_millis(250);

/// Why a starting Edge could not take its ownership lease.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Another live process renews this `edge_id`'s lease (R-TAKE-2).
    #[error(
        "edge_id {edge_id:?} is in use: another Edge process renews its ownership lease \
         (it moved within {renew_interval_ms} ms while this one started); every Edge \
         process sharing a journal store needs its own [edge] edge_id"
    )]
    InUse {
        /// The id.
        edge_id: String,
        /// How often the holder renews it.
        renew_interval_ms: u64,
    },
    /// The store could not be read or written.
    #[error("journal: ownership lease: {0}")]
    Store(#[from] JournalError),
}

/// How the journal store has answered lately (for `/status` and the
/// `iop_edge_journal_store_up` gauge): only a store failure
/// ([`JournalError::Store`]) counts against it, never a rule's refusal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StoreHealth {
    /// The last operation the store answered, Unix ms.
    pub last_ok_unix_ms: Option<u64>,
    /// The last operation the store failed, Unix ms.
    pub last_error_unix_ms: Option<u64>,
    /// What that failure was (a closed code).
    pub last_error: Option<&'static str>,
    /// Store failures since start.
    pub errors: u64,
}

impl StoreHealth {
    /// `ok`, `failing` (the last answer was a failure) or `unknown`
    /// (nothing asked yet).
    pub fn state(&self) -> &'static str {
        match (self.last_ok_unix_ms, self.last_error_unix_ms) {
            (_, None) if self.last_ok_unix_ms.is_some() => "ok",
            (None, None) => "unknown",
            (Some(ok), Some(err)) if ok > err => "ok",
            _ => "failing",
        }
    }
}

/// Where the journal store stands (R-JRN-6), for `/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StoreAvailability {
    /// `connecting`, `up`, `reopening` or `refused`
    /// ([`StoreState::as_str`]).
    pub state: &'static str,
    /// Since when, Unix ms.
    pub since_unix_ms: u64,
    /// Attempts to open it since it was last up.
    pub attempts: u32,
    /// Why the last attempt failed (a closed code).
    pub last_failure: Option<&'static str>,
    /// When the next attempt is due, Unix ms.
    pub next_attempt_unix_ms: Option<u64>,
}

/// What `/status` shows of the journal.
#[derive(Debug, Clone, Serialize)]
pub struct JournalStatus {
    /// `embedded`, `memory` or `nats`.
    pub store: &'static str,
    /// This Edge's id.
    pub edge_id: String,
    /// Whether the store is open (durable requests are served only then).
    pub availability: StoreAvailability,
    /// The store's recent answers.
    pub health: StoreHealth,
    /// Records set aside because they do not decode (R-JRN-6).
    pub quarantined: u64,
    /// Records held.
    pub records: u64,
    /// Bytes held.
    pub bytes: u64,
    /// Orphans waiting for their park window (R-TAKE-1).
    pub orphans_waiting: usize,
    /// Records left open wait for the custody: new durable requests are
    /// refused (R-TEN-2, R-JRN-6).
    pub durable_backlog: bool,
    /// The Edges whose ownership leases the last takeover scan read.
    pub edges: Vec<PeerLease>,
}

/// What the takeover scan last saw, for `/status`.
#[derive(Debug, Clone, Default)]
struct ScanView {
    orphans_waiting: usize,
    edges: Vec<PeerLease>,
}

/// This Edge's lease as it holds it: the value and the revision it last
/// wrote.
#[derive(Debug, Clone)]
pub struct HeldLease {
    /// The value.
    pub lease: EdgeLease,
    /// The store's revision of the last write.
    pub revision: u64,
}

/// The Edge's durable responses: the store and the runs this process
/// writes.
pub struct Durable {
    /// The journal through [`Self::slot`]: the store open now, or a
    /// refusal at once while none is (R-JRN-6).
    store: Arc<dyn JournalStore>,
    /// Tenants' shared state (SPEC §9) in the same deployment store,
    /// through the slot too.
    tenant_store: Arc<dyn iop_store::TenantStore>,
    /// The store open now, filled and emptied by the keeper task.
    slot: Arc<StoreSlot>,
    /// What the keeper task opens; taken when it starts (`None`: handed
    /// over open).
    opener: Mutex<Option<keeper::Opener>>,
    /// Wakes the keeper after a store failure (it asks the store whether
    /// it must be reopened).
    keeper_wake: tokio::sync::Notify,
    /// Where the store stands, as the keeper last published it.
    availability: Mutex<StoreAvailability>,
    /// Set once the store refuses this Edge for good (R-TAKE-2): the
    /// process stops, naming why.
    refused: watch::Sender<Option<String>>,
    /// How a run's journal write the store failed is tried again.
    write_retry: WriteRetryPolicy,
    /// Set once the keeper's first attempt ended, either way.
    first_attempt: watch::Sender<bool>,
    store_kind: JournalStoreKind,
    /// This Edge's id: records it creates or takes over name it.
    edge_id: String,
    metrics: Option<Arc<EdgeMetrics>>,
    responses_store_default: bool,
    park_grace_ms: u64,
    lease_ttl_ms: u64,
    /// Other processes can open the store (NATS): a starting Edge watches
    /// its id's lease before it takes it (R-TAKE-2).
    shared_store: bool,
    /// The runs this Edge writes, by response id.
    live: Mutex<HashMap<String, LiveHandle>>,
    /// Background requests waiting for their run's first admission answer
    /// (taken or refused), by response id.
    admissions: Mutex<HashMap<String, tokio::sync::oneshot::Sender<bool>>>,
    health: Mutex<StoreHealth>,
    scan_view: Mutex<ScanView>,
    /// The responses this Edge ran last, newest last (at most
    /// [`MAX_RECENT_RESPONSES`]), for the status surface.
    recent: Mutex<std::collections::VecDeque<String>>,
    /// Records a run of this Edge ended without their terminal (the store
    /// refused it too often), for the custody to end (R-JRN-4): one
    /// entry per such run, taken at once by the custody task.
    left_open: mpsc::UnboundedSender<String>,
    /// Its receiving end, until the custody task takes it.
    left_open_rx: Mutex<Option<mpsc::UnboundedReceiver<String>>>,
    /// Set by the custody task while records left open wait for room in
    /// its tasks: new durable requests are refused meanwhile
    /// ([`iop_core::edge::custody::Custody::refuses_durable`]).
    custody_backlog: std::sync::atomic::AtomicBool,
}

/// The most response ids [`Durable::recent`] keeps.
pub const MAX_RECENT_RESPONSES: usize = 20;

/// What reaches a run this Edge writes besides a cancel.
#[derive(Debug)]
pub enum LiveCommand {
    /// Its node reported its run parked (R-PARK-2).
    Parked(iop_core::edge::dispatch::ParkedOffer),
    /// A node registered and named the runs it keeps (R-PARK-2).
    Kept(Arc<iop_core::edge::dispatch::KeptRuns>),
}

/// How other tasks reach a run this Edge writes.
#[derive(Debug, Clone)]
pub(crate) struct LiveHandle {
    /// Its commands (bounded: a sender waits for room).
    pub(crate) commands: mpsc::Sender<LiveCommand>,
    /// Its cancel: a flag, so a cancel is never dropped, however many
    /// commands wait (`POST .../cancel`, `DELETE`).
    cancel: tokio::sync::watch::Sender<bool>,
}

/// What a run this Edge writes hears: its commands and its cancel.
#[derive(Debug)]
pub struct LiveCommands {
    /// Its node's reports of its parked run (R-PARK-2).
    pub commands: mpsc::Receiver<LiveCommand>,
    /// Set once the run is to be canceled.
    pub cancel: tokio::sync::watch::Receiver<bool>,
}

impl Durable {
    /// Durable responses on the store `section` names, as Edge
    /// `edge_id`; `state_dir` holds the embedded store's default file.
    /// Nothing is opened here: [`Self::spawn_keeper`] opens the store in
    /// the background (R-JRN-6), and until it is open every durable
    /// request is refused with [`JournalError::Unavailable`] while
    /// ephemeral ones are served.
    pub async fn open(
        section: &JournalSection,
        state_dir: &std::path::Path,
        edge_id: &str,
        metrics: Arc<EdgeMetrics>,
    ) -> Result<Self, OpenError> {
        let limits = section.limits();
        // Tenants' state lives in the same store (SPEC §9).
        let opener = match section.store {
            JournalStoreKind::Memory => keeper::Opener::Memory(limits),
            JournalStoreKind::Embedded => keeper::Opener::Embedded {
                path: section.file(state_dir),
                limits,
                options: section.embedded_options(),
            },
            JournalStoreKind::Nats => {
                let nats = section.nats.as_ref().ok_or_else(|| {
                    iop_transport::settings::field_err("journal.nats", "required")
                })?;
                // Paths were resolved at load.
                let options = nats.options(limits, state_dir)?;
                let plaintext = options.plaintext_secret_servers();
                if !plaintext.is_empty() {
                    // A password or a token sent in the clear: accepted (a
                    // private network may be why), never silently.
                    tracing::warn!(
                        event = "edge_nats_plaintext_secret",
                        servers = %plaintext.join(","),
                        "[journal.nats] sends a password or token over plaintext nats://: \
                         use tls:// URLs or tls_ca_file"
                    );
                }
                keeper::Opener::Nats(Box::new(options))
            }
        };
        let mut durable = Self::with_slot(
            Arc::new(StoreSlot::connecting()),
            section.responses_store_default,
        );
        *durable.opener.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(opener);
        durable.store_kind = section.store;
        edge_id.clone_into(&mut durable.edge_id);
        durable.metrics = Some(metrics);
        durable.park_grace_ms = section.park_grace_ms;
        durable.lease_ttl_ms = section.lease_ttl_ms;
        durable.shared_store = section.store == JournalStoreKind::Nats;
        durable.write_retry = section.write_retry();
        *durable
            .availability
            .get_mut()
            .unwrap_or_else(|e| e.into_inner()) = StoreAvailability {
            state: StoreState::Connecting.as_str(),
            since_unix_ms: iop_transport::clock::unix_ms(),
            ..StoreAvailability::default()
        };
        if let Some(metrics) = &durable.metrics {
            metrics.journal_store_state(StoreState::Connecting);
        }
        Ok(durable)
    }

    /// Durable responses on `store`, open already, as the only Edge
    /// ([`crate::config::DEFAULT_EDGE_ID`]).
    pub fn with_store(store: Arc<dyn JournalStore>, responses_store_default: bool) -> Self {
        let slot = StoreSlot::open(Opened {
            journal: store,
            tenants: Arc::new(iop_store::MemoryTenantStore::new()),
        });
        let durable = Self::with_slot(Arc::new(slot), responses_store_default);
        *durable
            .availability
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = StoreAvailability {
            state: StoreState::Up.as_str(),
            ..StoreAvailability::default()
        };
        durable
    }

    fn with_slot(slot: Arc<StoreSlot>, responses_store_default: bool) -> Self {
        let (left_open, left_open_rx) = mpsc::unbounded_channel();
        Durable {
            store: Arc::new(SlotJournal(slot.clone())),
            tenant_store: Arc::new(SlotTenants(slot.clone())),
            slot,
            opener: Mutex::new(None),
            keeper_wake: tokio::sync::Notify::new(),
            availability: Mutex::new(StoreAvailability::default()),
            refused: watch::channel(None).0,
            write_retry: WRITE_RETRY,
            first_attempt: watch::channel(false).0,
            store_kind: JournalStoreKind::Memory,
            edge_id: crate::config::DEFAULT_EDGE_ID.to_owned(),
            metrics: None,
            responses_store_default,
            park_grace_ms: iop_wire::DEFAULT_PARK_GRACE_MS,
            lease_ttl_ms: 15_000,
            shared_store: false,
            live: Mutex::new(HashMap::new()),
            admissions: Mutex::new(HashMap::new()),
            health: Mutex::new(StoreHealth::default()),
            scan_view: Mutex::new(ScanView::default()),
            recent: Mutex::new(std::collections::VecDeque::new()),
            left_open,
            left_open_rx: Mutex::new(Some(left_open_rx)),
            custody_backlog: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The records runs of this Edge left without their terminal, as they
    /// end (the custody task's to end, R-JRN-4); `None` once taken.
    pub fn left_open_runs(&self) -> Option<mpsc::UnboundedReceiver<String>> {
        self.left_open_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// As Edge `edge_id` with a lease of `lease_ttl_ms` (several Edges on
    /// one store in a test).
    pub fn with_identity(mut self, edge_id: &str, lease_ttl_ms: u64) -> Self {
        edge_id.clone_into(&mut self.edge_id);
        self.lease_ttl_ms = lease_ttl_ms;
        self
    }

    /// As one of several processes that open the store (a test's stand-in
    /// for NATS): [`Self::take_lease`] watches the id's lease first.
    pub fn sharing_the_store(mut self) -> Self {
        self.shared_store = true;
        self
    }

    /// Tenants' shared state: counters, usage and runtime keys (SPEC §9).
    pub fn tenant_store(&self) -> &Arc<dyn iop_store::TenantStore> {
        &self.tenant_store
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn JournalStore> {
        &self.store
    }

    /// This Edge's id: the owner of the records it creates or takes over.
    pub fn edge_id(&self) -> &str {
        &self.edge_id
    }

    /// How long a durable run may stay parked on its node (R-PARK-1).
    pub fn park_grace_ms(&self) -> u64 {
        self.park_grace_ms
    }

    /// Whether a Responses request without `store` is stored.
    pub fn responses_store_default(&self) -> bool {
        self.responses_store_default
    }

    pub(crate) fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, LiveHandle>> {
        // The map's entries are inserted and removed whole: a panic while
        // holding the lock leaves it consistent.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tell every run this Edge writes which runs a registering node keeps
    /// (R-PARK-2): the one whose run that node lost stops waiting for it.
    /// A run whose commands are full misses it and waits out its park
    /// grace, as without the report.
    pub(crate) fn tell_kept(&self, kept: &Arc<iop_core::edge::dispatch::KeptRuns>) {
        let mut missed = 0usize;
        for handle in self.live().values() {
            if handle
                .commands
                .try_send(LiveCommand::Kept(kept.clone()))
                .is_err_and(|e| matches!(e, mpsc::error::TrySendError::Full(_)))
            {
                missed += 1;
            }
        }
        if missed > 0 {
            tracing::info!(event = "edge_kept_runs_not_told", node = %kept.node, runs = missed);
        }
    }

    /// Register the run of `response_id` as written by this Edge: its
    /// cancel receiver, and a guard that unregisters it when the run ends.
    pub fn register(self: &Arc<Self>, response_id: &str) -> (LiveRun, LiveCommands) {
        {
            let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
            recent.retain(|id| id != response_id);
            if recent.len() == MAX_RECENT_RESPONSES {
                recent.pop_front();
            }
            recent.push_back(response_id.to_owned());
        }
        let (tx, rx) = mpsc::channel(8);
        let (cancel_tx, cancel_rx) = tokio::sync::watch::channel(false);
        self.live().insert(
            response_id.to_owned(),
            LiveHandle {
                commands: tx,
                cancel: cancel_tx,
            },
        );
        (
            LiveRun {
                durable: self.clone(),
                response_id: response_id.to_owned(),
                left_open: false,
            },
            LiveCommands {
                commands: rx,
                cancel: cancel_rx,
            },
        )
    }

    /// Hear whether admission takes the run of `response_id` (leased or
    /// queued: `true`) or refuses it (`false`): a background request is
    /// answered only then, so a refusal is its HTTP error, as for any
    /// request. Call before the run starts.
    pub fn await_admission(&self, response_id: &str) -> tokio::sync::oneshot::Receiver<bool> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.admissions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(response_id.to_owned(), tx);
        rx
    }

    /// The run of `response_id` heard its first admission answer.
    pub fn admission_answered(&self, response_id: &str, taken: bool) {
        let waiter = self
            .admissions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(response_id);
        if let Some(tx) = waiter {
            let _ = tx.send(taken);
        }
    }

    /// Ask the run of `response_id` to cancel; false if this Edge does not
    /// run it.
    pub fn cancel(&self, response_id: &str) -> bool {
        match self.live().get(response_id) {
            Some(handle) => {
                // A flag: never lost behind queued commands.
                handle.cancel.send_replace(true);
                true
            }
            None => false,
        }
    }

    /// The responses this Edge ran last (created or taken over), newest
    /// first.
    pub fn recent(&self) -> Vec<String> {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        recent.iter().rev().cloned().collect()
    }

    /// Whether this Edge runs `response_id` now.
    pub fn is_live(&self, response_id: &str) -> bool {
        self.live().contains_key(response_id)
    }

    /// Count one store operation and publish the store's size.
    pub(crate) fn observe<T>(
        &self,
        op: &'static str,
        started: std::time::Instant,
        result: &Result<T, JournalError>,
    ) {
        if let Some(metrics) = &self.metrics {
            metrics.journal_write(op, result.as_ref().map(|_| ()), started.elapsed());
        }
        self.note(result.as_ref().map(|_| ()));
        self.publish_stats();
    }

    /// The store answered (`Ok`, or a rule's refusal) or failed. A
    /// refusal because no store is open says nothing of the store's
    /// answers: the availability shows it. A failure wakes the keeper,
    /// which asks the store whether it must be reopened (R-JRN-6).
    fn note(&self, result: Result<(), &JournalError>) {
        let now = iop_transport::clock::unix_ms();
        {
            let mut h = self.health.lock().unwrap_or_else(|e| e.into_inner());
            match result {
                Err(JournalError::Unavailable(_)) => {}
                Err(e @ JournalError::Store(_)) => {
                    h.last_error_unix_ms = Some(now);
                    h.last_error = Some(e.as_str());
                    h.errors += 1;
                }
                _ => h.last_ok_unix_ms = Some(now),
            }
        }
        if matches!(result, Err(JournalError::Store(_))) {
            self.keeper_wake.notify_one();
        }
        self.publish_up();
    }

    /// `iop_edge_journal_store_up`: 1 while the store is open and its last
    /// answer was not a failure.
    fn publish_up(&self) {
        if let Some(metrics) = &self.metrics {
            let open = self.slot.state() == StoreState::Up;
            let failing = self
                .health
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .state()
                == "failing";
            metrics
                .gauges
                .journal_store_up
                .store(u64::from(open && !failing), Ordering::Relaxed);
        }
    }

    /// What `/status` shows of the journal.
    pub fn status(&self) -> JournalStatus {
        let stats = self.store.stats();
        let health = *self.health.lock().unwrap_or_else(|e| e.into_inner());
        let view = self
            .scan_view
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        JournalStatus {
            store: self.store_kind.as_str(),
            edge_id: self.edge_id.clone(),
            availability: *self.availability.lock().unwrap_or_else(|e| e.into_inner()),
            health,
            quarantined: stats.quarantined,
            records: stats.records,
            bytes: stats.used_bytes,
            orphans_waiting: view.orphans_waiting,
            durable_backlog: self.custody_backlog.load(Ordering::Relaxed),
            edges: view.edges,
        }
    }

    /// Publish where the store stands (`view`, at `now` on the keeper's
    /// clock), for `/status` and metrics.
    fn publish_availability(&self, view: &AvailabilityView, now: iop_core::time::Instant) {
        let unix_now = iop_transport::clock::unix_ms();
        let unix = |at: iop_core::time::Instant| {
            if at >= now {
                unix_now.saturating_add(at.saturating_duration_since(now).as_millis() as u64)
            } else {
                unix_now.saturating_sub(now.saturating_duration_since(at).as_millis() as u64)
            }
        };
        let shown = StoreAvailability {
            state: view.state.as_str(),
            since_unix_ms: unix(view.since),
            attempts: view.attempts,
            last_failure: view.last_failure.map(|f| f.as_str()),
            next_attempt_unix_ms: view.next_attempt_at.map(unix),
        };
        let changed = {
            let mut a = self.availability.lock().unwrap_or_else(|e| e.into_inner());
            let changed = a.state != shown.state;
            *a = shown;
            changed
        };
        if let Some(metrics) = &self.metrics {
            metrics.journal_store_state(view.state);
        }
        if changed {
            self.publish_up();
        }
    }

    /// Where the store stands now.
    pub fn store_state(&self) -> StoreState {
        self.slot.state()
    }

    /// Resolves once the keeper's first attempt to open the store ended,
    /// up or not (at once for a store handed over open).
    pub async fn first_attempt(&self) {
        if self.slot.state() == StoreState::Up {
            return;
        }
        let mut rx = self.first_attempt.subscribe();
        let _ = rx.wait_for(|done| *done).await;
    }

    /// The store refused this Edge for good (R-TAKE-2): tell whoever
    /// runs the Edge to stop it.
    fn refuse(&self, why: String) {
        self.refused.send_replace(Some(why));
    }

    /// Resolves once the store refuses this Edge for good (its `edge_id`
    /// is another live process's, R-TAKE-2), with why: the Edge must stop.
    pub fn refused(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        let mut rx = self.refused.subscribe();
        async move {
            loop {
                if let Some(why) = rx.borrow_and_update().clone() {
                    return why;
                }
                if rx.changed().await.is_err() {
                    return std::future::pending().await;
                }
            }
        }
    }

    fn publish_stats(&self) {
        if let Some(metrics) = &self.metrics {
            let stats = self.store.stats();
            let gauges = &metrics.gauges;
            gauges
                .journal_records
                .store(stats.records, std::sync::atomic::Ordering::Relaxed);
            gauges
                .journal_bytes
                .store(stats.used_bytes, std::sync::atomic::Ordering::Relaxed);
            gauges
                .journal_quarantined
                .store(stats.quarantined, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The custody says whether records left open wait for room in its
    /// tasks (R-TEN-2, R-JRN-6); `true` when that changed.
    pub fn set_custody_backlog(&self, backlog: bool) -> bool {
        self.custody_backlog.swap(backlog, Ordering::Relaxed) != backlog
    }

    /// Create a record (or find the one its idempotency key names);
    /// refused at once while the custody is behind
    /// ([`Self::set_custody_backlog`]).
    pub async fn create(&self, record: NewRecord) -> Result<CreateOutcome, JournalError> {
        if self.custody_backlog.load(Ordering::Relaxed) {
            // Counted (`outcome="backlog"`), not a store answer: the
            // store's health is not touched.
            if let Some(metrics) = &self.metrics {
                metrics.journal_refused("create", &JournalError::Backlog);
            }
            return Err(JournalError::Backlog);
        }
        let started = std::time::Instant::now();
        let result = self.store.create(record).await;
        self.observe("create", started, &result);
        result
    }

    /// Carry out one journal write of a run (a [`JournalWrite`] from its
    /// request machine): the store's answer, for
    /// [`iop_core::edge::request::RequestInput::Journaled`]. A transient
    /// failure of the store is tried again within the bound core's
    /// [`WriteRetry`] sets (R-JRN-6); the run waits meanwhile, and nothing
    /// of it is published before its write is durable (R-JRN-1).
    pub async fn write(self: Arc<Self>, write: JournalWrite) -> JournalAck {
        let write = match write {
            // Core reads no clock: the terminal is stamped here, once.
            JournalWrite::Finish {
                response_id,
                epoch,
                mut terminal,
            } => {
                terminal.at_unix_ms = iop_transport::clock::unix_ms();
                JournalWrite::Finish {
                    response_id,
                    epoch,
                    terminal,
                }
            }
            append => append,
        };
        let origin = tokio::time::Instant::now();
        let at = |t: tokio::time::Instant| {
            iop_core::time::Instant::from_micros(
                u64::try_from(t.saturating_duration_since(origin).as_micros()).unwrap_or(u64::MAX),
            )
        };
        let mut retry = WriteRetry::new(self.write_retry, at(origin));
        loop {
            let started = std::time::Instant::now();
            let (op, result) = match &write {
                JournalWrite::Append {
                    response_id,
                    epoch,
                    events,
                } => (
                    "append",
                    self.store
                        .append(response_id.clone(), *epoch, events.clone())
                        .await
                        .map(|_| ()),
                ),
                JournalWrite::Finish {
                    response_id,
                    epoch,
                    terminal,
                } => (
                    "finish",
                    self.store
                        .finish(response_id.clone(), *epoch, terminal.clone())
                        .await
                        .map(|_| ()),
                ),
            };
            self.observe(op, started, &result);
            match retry.answered(at(tokio::time::Instant::now()), &write, result) {
                WriteVerdict::Answer(ack) => return ack,
                WriteVerdict::RetryAt(when) => {
                    if let Some(metrics) = &self.metrics {
                        metrics.journal_write_retry(op);
                    }
                    tokio::time::sleep_until(origin + Duration::from_micros(when.as_micros()))
                        .await;
                }
            }
        }
    }

    /// Take this Edge's ownership lease on the store open now (R-TAKE-1):
    /// see [`Self::take_lease_on`].
    pub async fn take_lease(&self) -> Result<HeldLease, LeaseError> {
        self.take_lease_on(&*self.store).await
    }

    /// Take this Edge's ownership lease on `store` (R-TAKE-1), before any
    /// record is created or taken over there. On a shared store the lease
    /// its id has is watched first ([`LeaseClaim`], R-TAKE-2): if another
    /// process renews it, it is refused ([`LeaseError::InUse`]); a lease
    /// that does not move (this Edge's previous run's) is replaced by this
    /// run's.
    pub async fn take_lease_on(&self, store: &dyn JournalStore) -> Result<HeldLease, LeaseError> {
        let started = std::time::Instant::now();
        let at = |t: std::time::Instant| {
            iop_core::time::Instant::from_micros(
                u64::try_from(t.duration_since(started).as_micros()).unwrap_or(u64::MAX),
            )
        };
        let first = self.read_own_lease(store).await?;
        let mut claim = LeaseClaim::new(first.as_ref(), at(started), self.shared_store);
        if first.is_some() && self.shared_store {
            tracing::info!(
                event = "edge_lease_watched",
                edge_id = %self.edge_id,
                watch_ms = claim.watch_until().as_millis(),
                "watching this edge_id's lease: another process may hold it"
            );
        }
        let verdict = loop {
            let now = std::time::Instant::now();
            if let Some(verdict) = claim.verdict(at(now)) {
                break verdict;
            }
            let left = claim.watch_until().saturating_duration_since(at(now));
            tokio::time::sleep(left.min(CLAIM_READ_INTERVAL)).await;
            let read = self.read_own_lease(store).await?;
            claim.observe(read.as_ref(), at(std::time::Instant::now()));
        };
        let expected_revision = match verdict {
            ClaimVerdict::Take { expected_revision } => expected_revision,
            ClaimVerdict::InUse { holder } => return Err(self.in_use(&holder)),
        };
        if let Some(previous) = &first {
            tracing::info!(
                event = "edge_lease_taken",
                edge_id = %self.edge_id,
                previous_renewed_unix_ms = previous.lease.renewed_unix_ms
            );
        }
        let lease = EdgeLease {
            edge_id: self.edge_id.clone(),
            incarnation: rand::random(),
            ttl_ms: self.lease_ttl_ms,
            renewed_unix_ms: iop_transport::clock::unix_ms(),
        };
        let revision = store.put_lease(lease.clone(), expected_revision).await;
        self.note(revision.as_ref().map(|_| ()));
        match revision {
            Ok(revision) => Ok(HeldLease { lease, revision }),
            // Written by another process between the last read and this
            // write: it started at the same moment (R-TAKE-2).
            Err(JournalError::Fenced { .. }) => {
                let holder = self.read_own_lease(store).await?;
                Err(match holder {
                    Some(holder) => self.in_use(&holder.lease),
                    None => LeaseError::Store(JournalError::Fenced {
                        current: 0,
                        writer: expected_revision,
                    }),
                })
            }
            Err(e) => Err(LeaseError::Store(e)),
        }
    }

    async fn read_own_lease(
        &self,
        store: &dyn JournalStore,
    ) -> Result<Option<iop_core::journal::StoredLease>, JournalError> {
        let read = store.lease(self.edge_id.clone()).await;
        self.note(read.as_ref().map(|_| ()));
        read
    }

    fn in_use(&self, holder: &EdgeLease) -> LeaseError {
        tracing::error!(
            event = "edge_id_in_use",
            edge_id = %self.edge_id,
            holder_renewed_unix_ms = holder.renewed_unix_ms,
            "another process renews this edge_id's lease: every Edge needs its own edge_id"
        );
        LeaseError::InUse {
            edge_id: self.edge_id.clone(),
            renew_interval_ms: u64::try_from(holder.renew_interval().as_millis())
                .unwrap_or(u64::MAX),
        }
    }

    /// Renew `held` once. A renewal refused because something else wrote
    /// the lease (a second process configured with this `edge_id`) is
    /// logged (`edge_lease_conflict`) and the lease taken again; a store
    /// failure is tried again at the next renewal.
    async fn renew(&self, held: &mut HeldLease) {
        held.lease.renewed_unix_ms = iop_transport::clock::unix_ms();
        let written = self
            .store
            .put_lease(held.lease.clone(), held.revision)
            .await;
        self.note(written.as_ref().map(|_| ()));
        match written {
            Ok(revision) => held.revision = revision,
            Err(JournalError::Fenced { current, .. }) => {
                tracing::error!(
                    event = "edge_lease_conflict",
                    edge_id = %self.edge_id,
                    "another writer holds this edge_id's lease: every Edge needs its own edge_id"
                );
                held.revision = current;
            }
            Err(e) => {
                tracing::warn!(event = "edge_lease_renewal_failed", error = %e);
            }
        }
    }

    /// Renew `held` every third of its TTL for as long as the Edge runs
    /// ([`Self::renew`]; the keeper task renews the lease it takes itself).
    pub fn spawn_lease_renewal(
        self: &Arc<Self>,
        mut held: HeldLease,
    ) -> tokio::task::JoinHandle<()> {
        let durable = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(held.lease.renew_interval());
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                durable.renew(&mut held).await;
            }
        })
    }

    /// The custody machine's setup for this Edge (R-TAKE-1): orphans wait
    /// `window` for their nodes' reports; a shared store is scanned every
    /// `interval`.
    pub fn custody_config(
        &self,
        window: Duration,
        interval: Duration,
    ) -> iop_core::edge::custody::CustodyConfig {
        iop_core::edge::custody::CustodyConfig {
            edge_id: self.edge_id.clone(),
            park_window: window,
            lease_ttl: Duration::from_millis(self.lease_ttl_ms),
            sole: !self.store_kind.is_shared(),
            scan_interval: interval,
            max_tasks: iop_core::edge::custody::MAX_TASKS,
        }
    }

    /// Publish what the custody's scan sees, for `/status` and metrics.
    pub(crate) fn publish_scan(&self, scan: &TakeoverScan, now: iop_core::time::Instant) {
        // A store of this Edge's own has no other Edges to show.
        let edges = if scan.is_sole() {
            Vec::new()
        } else {
            scan.leases().peers(now)
        };
        if let Some(metrics) = &self.metrics {
            let live = if scan.is_sole() {
                1
            } else {
                edges
                    .iter()
                    .filter(|p| p.lease.is_some() && p.state != LeaseState::Expired)
                    .count()
            };
            metrics
                .gauges
                .journal_live_edges
                .store(live as u64, Ordering::Relaxed);
        }
        *self.scan_view.lock().unwrap_or_else(|e| e.into_inner()) = ScanView {
            orphans_waiting: scan.waiting(),
            edges,
        };
    }

    /// Note a store answer for the store's health.
    pub(crate) fn noted<T>(&self, result: &Result<T, JournalError>) {
        self.note(result.as_ref().map(|_| ()));
    }

    /// Take a record over and end it (`status`, `reason`) with its durable
    /// prefix: its epoch is raised first (R-JRN-3), with this Edge as its
    /// owner, so whatever still writes it is fenced from then on.
    pub async fn end_as(
        &self,
        meta: &RecordMeta,
        status: RecordStatus,
        reason: &str,
    ) -> Result<(), JournalError> {
        let started = std::time::Instant::now();
        let raised = self
            .store
            .raise_epoch(meta.id.clone(), meta.epoch, self.edge_id.clone())
            .await;
        self.observe("raise_epoch", started, &raised);
        let terminal = Terminal {
            status,
            reason: Some(reason.to_owned()),
            message: None,
            at_unix_ms: iop_transport::clock::unix_ms(),
        };
        let started = std::time::Instant::now();
        let finished = self
            .store
            .finish(meta.id.clone(), raised?.epoch, terminal)
            .await;
        self.observe("finish", started, &finished);
        finished.map(|_| ())
    }

    /// Remove expired records every `interval`, for as long as the Edge
    /// runs.
    pub fn spawn_sweeper(self: &Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        let durable = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match durable.store.sweep(iop_transport::clock::unix_ms()).await {
                    Ok(0) => {}
                    Ok(n) => {
                        durable.publish_stats();
                        tracing::info!(event = "edge_journal_swept", records = n);
                    }
                    // Nothing open to sweep yet (R-JRN-6).
                    Err(JournalError::Unavailable(_)) => {}
                    Err(e) => tracing::warn!(event = "edge_journal_sweep_failed", error = %e),
                }
            }
        })
    }
}

/// A run this Edge writes; dropping it (the run's driver ended, however)
/// unregisters it.
pub struct LiveRun {
    durable: Arc<Durable>,
    response_id: String,
    left_open: bool,
}

impl LiveRun {
    /// The run ends without its record's terminal (the store refused it
    /// too often): once it is unregistered, the custody ends the record
    /// (R-JRN-4).
    pub fn leave_open(&mut self) {
        self.left_open = true;
    }
}

impl Drop for LiveRun {
    fn drop(&mut self) {
        self.durable.live().remove(&self.response_id);
        if self.left_open {
            // After it is unregistered: the custody must not find it live.
            let _ = self.durable.left_open.send(self.response_id.clone());
        }
        // A run that ended before any admission answer: its waiter hears
        // nothing more (the sender dropped) and answers as the record is.
        self.durable
            .admissions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.response_id);
    }
}

/// What a follower reads next.
#[derive(Debug, Clone, PartialEq)]
pub enum Followed {
    /// The record's next event.
    Event(Delivery),
    /// The record's terminal: nothing follows.
    Ended(Terminal),
}

/// Reads one record's events in order, then follows its live tail: the
/// only way a client sees a durable response, so it sees only what is
/// durable (R-JRN-1).
pub struct Follower {
    store: Arc<dyn JournalStore>,
    id: String,
    /// The last event taken.
    after: u64,
    progress: watch::Receiver<Progress>,
    ready: VecDeque<Delivery>,
    ended: bool,
}

impl Follower {
    /// Follow `id` from its first event.
    pub async fn open(store: Arc<dyn JournalStore>, id: &str) -> Result<Self, JournalError> {
        let progress = store.watch(id.to_owned()).await?;
        Ok(Follower {
            store,
            id: id.to_owned(),
            after: 0,
            progress,
            ready: VecDeque::new(),
            ended: false,
        })
    }

    /// Events taken so far.
    pub fn taken(&self) -> u64 {
        self.after - self.ready.len() as u64
    }

    /// An event already read, if any (no I/O).
    pub fn ready(&mut self) -> Option<Followed> {
        self.ready.pop_front().map(Followed::Event)
    }

    /// The next event or the terminal, waiting for it if need be;
    /// `Ok(None)` after the terminal. Cancel-safe: dropping the future
    /// loses nothing.
    pub async fn next(&mut self) -> Result<Option<Followed>, JournalError> {
        self.read(true).await
    }

    /// The next event or the terminal if it is durable now; `Ok(None)`
    /// when the reader is at the live tail (or after the terminal).
    pub async fn next_now(&mut self) -> Result<Option<Followed>, JournalError> {
        self.read(false).await
    }

    async fn read(&mut self, wait: bool) -> Result<Option<Followed>, JournalError> {
        loop {
            if let Some(delivery) = self.ready.pop_front() {
                return Ok(Some(Followed::Event(delivery)));
            }
            if self.ended {
                return Ok(None);
            }
            // Read the progress before the events: an append that lands in
            // between changes it again, so no wake-up is missed.
            let progress = *self.progress.borrow_and_update();
            if progress.last_seq > self.after {
                let events = self
                    .store
                    .events(self.id.clone(), self.after, FOLLOW_BATCH)
                    .await?;
                for event in events {
                    if event.seq != self.after + 1 {
                        // The store broke R-JRN-2; render nothing past it.
                        return Err(JournalError::Store(format!(
                            "event {} after {}",
                            event.seq, self.after
                        )));
                    }
                    self.after = event.seq;
                    match decode_delivery(&event.payload) {
                        Some(delivery) => self.ready.push_back(delivery),
                        None => {
                            return Err(JournalError::Store(format!(
                                "event {} is unreadable",
                                event.seq
                            )));
                        }
                    }
                }
                continue;
            }
            if progress.ended {
                let terminal = self
                    .store
                    .get(self.id.clone(), 0)
                    .await?
                    .and_then(|(meta, _)| meta.terminal)
                    .ok_or(JournalError::NotFound)?;
                self.ended = true;
                return Ok(Some(Followed::Ended(terminal)));
            }
            if !wait {
                return Ok(None);
            }
            if self.progress.changed().await.is_err() {
                // The store dropped the record (deleted) while we waited,
                // or the store itself was closed to be opened again
                // (R-JRN-6): follow it again there, if it is there.
                self.progress = self.store.watch(self.id.clone()).await?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use iop_core::journal::{JournalApi, JournalEvent, JournalLimits, NewRecord, fingerprint};
    use iop_store::MemoryStore;
    use iop_wire::RunEventKind;

    use super::*;

    fn stored() -> StoredRequest {
        StoredRequest {
            id_seed: 7,
            created_unix_ms: 1_700_000_000_000,
            store: true,
            background: false,
            body: br#"{"model":"m","input":"hi"}"#.to_vec(),
            history: None,
            previous: None,
            history_unreadable: false,
        }
    }

    fn memory() -> Arc<dyn JournalStore> {
        Arc::new(MemoryStore::new(JournalLimits::default()))
    }

    async fn create(store: &Arc<dyn JournalStore>, id: &str) -> RecordMeta {
        create_as(store, id, crate::config::DEFAULT_EDGE_ID).await
    }

    async fn create_as(store: &Arc<dyn JournalStore>, id: &str, owner: &str) -> RecordMeta {
        let new = NewRecord {
            id: id.into(),
            principal: "p".into(),
            api: JournalApi::Responses,
            model: "m".into(),
            fingerprint: fingerprint("responses", b"{}"),
            idempotency_key: None,
            background: false,
            request: stored().encode(),
            created_unix_ms: 1,
            owner: owner.into(),
            key_id: "k".into(),
        };
        match store.create(new).await.unwrap() {
            iop_store::CreateOutcome::Create(meta) => meta,
            other => panic!("{other:?}"),
        }
    }

    fn text(s: &str) -> Delivery {
        Delivery::Event(RunEventKind::TextDelta(s.into()))
    }

    fn event(seq: u64, d: &Delivery) -> JournalEvent {
        JournalEvent {
            seq,
            payload: iop_core::edge::durable::encode_delivery(d),
        }
    }

    #[test]
    fn a_stored_request_reads_back_and_foreign_bytes_do_not() {
        let s = stored();
        assert_eq!(StoredRequest::decode(&s.encode()), Some(s));
        assert_eq!(StoredRequest::decode(b""), None);
        assert_eq!(StoredRequest::decode(&[9, 1, 2]), None, "unknown format");
    }

    #[test]
    fn a_link_reads_back_with_its_previous_id_and_without_a_history_r_lim_6() {
        let link = StoredRequest {
            previous: Some("resp_0123456789abcdef".into()),
            ..stored()
        };
        let bytes = link.encode();
        assert_eq!(bytes[0], LINK_FORMAT);
        assert_eq!(StoredRequest::decode(&bytes), Some(link.clone()));
        // Only its own request and the id: a few bytes over a record that
        // continues nothing.
        let alone = stored().encode();
        assert!(bytes.len() <= alone.len() + 1 + "resp_0123456789abcdef".len());
        // A link cut short is not read as some other request.
        assert_eq!(StoredRequest::decode(&bytes[..bytes.len() - 3]), None);
        // A request that continues nothing keeps the format older builds
        // read.
        assert_eq!(alone[0], STORED_REQUEST_FORMAT);
    }

    #[test]
    fn a_record_an_older_build_wrote_with_its_history_is_read_with_it() {
        let old = StoredRequest {
            history: Some(vec![ChatMessage {
                role: iop_wire::Role::User,
                content: "before".into(),
                tool_calls: Vec::new(),
                tool_call_id: None,
                name: None,
                images: Vec::new(),
                cache_control: None,
                documents: Vec::new(),
            }]),
            ..stored()
        };
        let bytes = old.encode();
        assert_eq!(bytes[0], STORED_REQUEST_FORMAT);
        assert_eq!(StoredRequest::decode(&bytes), Some(old));
    }

    #[test]
    fn a_record_whose_history_does_not_decode_is_read_without_it() {
        // A history as a build with other message fields wrote it: bytes
        // this build's messages do not decode.
        let head = StoredRequestHead {
            id_seed: 7,
            created_unix_ms: 1_000,
            store: true,
            background: false,
            body: b"{}".to_vec(),
        };
        let mut bytes = vec![STORED_REQUEST_FORMAT];
        bytes.extend(
            postcard::to_allocvec(&(
                head.id_seed,
                head.created_unix_ms,
                head.store,
                head.background,
                &head.body,
            ))
            .unwrap(),
        );
        bytes.extend([1, 1, 0xff, 0xff, 0xff]);
        let read = StoredRequest::decode(&bytes).expect("readable without its history");
        assert_eq!((read.id_seed, read.body.as_slice()), (7, &b"{}"[..]));
        assert!(read.history.is_none() && read.history_unreadable);
    }

    #[tokio::test]
    async fn a_follower_reads_the_prefix_then_the_live_tail_then_the_terminal_r_jrn_1() {
        let store = memory();
        create(&store, "r").await;
        store
            .append("r".into(), 1, vec![event(1, &text("a"))])
            .await
            .unwrap();
        let mut f = Follower::open(store.clone(), "r").await.unwrap();
        assert_eq!(f.next().await.unwrap(), Some(Followed::Event(text("a"))));
        assert_eq!(f.next_now().await.unwrap(), None, "at the live tail");
        let writer = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .append("r".into(), 1, vec![event(2, &text("b"))])
                    .await
                    .unwrap();
                let t = Terminal {
                    status: RecordStatus::Completed,
                    reason: None,
                    message: None,
                    at_unix_ms: 5,
                };
                store.finish("r".into(), 1, t).await.unwrap();
            })
        };
        assert_eq!(f.next().await.unwrap(), Some(Followed::Event(text("b"))));
        let Some(Followed::Ended(t)) = f.next().await.unwrap() else {
            panic!("the terminal");
        };
        assert_eq!(t.status, RecordStatus::Completed);
        assert_eq!(f.next().await.unwrap(), None);
        assert_eq!(f.taken(), 2);
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn a_follower_of_a_deleted_record_ends_with_not_found() {
        let store = memory();
        create(&store, "r").await;
        let mut f = Follower::open(store.clone(), "r").await.unwrap();
        let waiting = tokio::spawn(async move { f.next().await });
        tokio::task::yield_now().await;
        store.delete("r".into()).await.unwrap();
        assert_eq!(waiting.await.unwrap(), Err(JournalError::NotFound));
    }

    const TTL_MS: u64 = 3_000;

    #[tokio::test]
    async fn a_lease_written_by_another_process_with_this_id_is_taken_again() {
        let store = memory();
        let a = Durable::with_store(store.clone(), true).with_identity("edge-a", TTL_MS);
        let first = a.take_lease().await.unwrap();
        let twin = Durable::with_store(store.clone(), true).with_identity("edge-a", TTL_MS);
        let second = twin.take_lease().await.unwrap();
        assert!(second.revision > first.revision);
        assert_ne!(first.lease.incarnation, second.lease.incarnation);
        assert!(matches!(
            store.put_lease(first.lease.clone(), first.revision).await,
            Err(JournalError::Fenced { current, .. }) if current == second.revision
        ));
        assert_eq!(a.status().health.state(), "ok");
    }

    #[tokio::test]
    async fn a_second_process_with_a_renewed_edge_id_is_refused_and_a_crashed_ones_is_taken_r_take_2()
     {
        let store = memory();
        let live = Arc::new(
            Durable::with_store(store.clone(), true)
                .with_identity("edge-a", TTL_MS)
                .sharing_the_store(),
        );
        let held = live.take_lease().await.unwrap();
        let renewal = live.spawn_lease_renewal(held);
        let twin = Durable::with_store(store.clone(), true)
            .with_identity("edge-a", TTL_MS)
            .sharing_the_store();
        let started = std::time::Instant::now();
        match twin.take_lease().await {
            Err(LeaseError::InUse { edge_id, .. }) => assert_eq!(edge_id, "edge-a"),
            other => panic!("expected in use, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_millis(TTL_MS));
        // The first process crashes: its lease stops moving, and a restart
        // takes it within one TTL.
        renewal.abort();
        let started = std::time::Instant::now();
        let restarted = twin.take_lease().await.unwrap();
        assert!(started.elapsed() < Duration::from_millis(TTL_MS));
        assert_eq!(
            store
                .lease("edge-a".into())
                .await
                .unwrap()
                .unwrap()
                .revision,
            restarted.revision
        );
    }

    #[tokio::test]
    async fn cancel_reaches_only_a_run_this_edge_writes() {
        let durable = Arc::new(Durable::with_store(memory(), true));
        assert!(!durable.cancel("r"));
        let (live, mut heard) = durable.register("r");
        assert!(durable.is_live("r"));
        // A cancel is heard even behind a full command channel (R-LIM-4:
        // the channel is bounded; a cancel must never be the one dropped).
        let handle = durable.live().get("r").cloned().expect("live");
        let offer = || {
            LiveCommand::Parked(iop_core::edge::dispatch::ParkedOffer {
                run: iop_wire::ParkedRun {
                    key: iop_wire::RunKey {
                        generation: 1,
                        run_id: 1,
                    },
                    response_id: "r".into(),
                    adapter: iop_wire::AdapterKind::Mock,
                    target: "t".into(),
                    first_kept_frame: 1,
                    last_frame: 0,
                    ended: false,
                },
                provider_id: iop_core::ids::ProviderId::from("p"),
                node: iop_core::ids::NodeId::from("n"),
            })
        };
        while handle.commands.try_send(offer()).is_ok() {}
        assert!(durable.cancel("r"));
        heard.cancel.changed().await.expect("cancel heard");
        assert!(*heard.cancel.borrow());
        drop(live);
        assert!(!durable.is_live("r"), "unregistered when the run ends");
        assert!(!durable.cancel("r"));
    }

    fn metrics() -> Arc<EdgeMetrics> {
        EdgeMetrics::new(iop_transport::telemetry::MetricsPipeline::prometheus_only(
            "iop-edge",
        ))
    }

    fn new_record(id: &str, principal: &str) -> NewRecord {
        NewRecord {
            id: id.into(),
            principal: principal.into(),
            api: JournalApi::Responses,
            model: "m".into(),
            fingerprint: fingerprint("responses", b"{}"),
            idempotency_key: None,
            background: false,
            request: stored().encode(),
            created_unix_ms: 1,
            owner: crate::config::DEFAULT_EDGE_ID.into(),
            key_id: "k".into(),
        }
    }

    async fn until(what: &str, mut check: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !check() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// R-JRN-6: an embedded file that cannot be opened does not stop the
    /// Edge: durable requests are refused at once with the store's state
    /// while the keeper tries again; once the file can be opened (here:
    /// the damaged file moved aside), the store is up without a restart.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unopenable_embedded_file_is_opened_in_the_background_once_it_can_be() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.redb");
        std::fs::write(&path, vec![0xa5; 64 * 1024]).unwrap();
        let section = JournalSection {
            path: Some(path.clone()),
            ..JournalSection::default()
        };
        let durable = Arc::new(
            Durable::open(&section, dir.path(), "edge-a", metrics())
                .await
                .unwrap(),
        );
        let (up_tx, up_rx) = tokio::sync::oneshot::channel();
        let keeper =
            durable.spawn_keeper(Arc::new(iop_trace::TraceFiles::off()), move |unfinished| {
                let _ = up_tx.send(unfinished);
            });
        until("a failed attempt", || {
            durable.status().availability.last_failure == Some("damaged")
        })
        .await;
        assert_eq!(durable.store_state(), StoreState::Connecting);
        assert_eq!(
            durable.create(new_record("r", "p")).await,
            Err(JournalError::Unavailable(StoreState::Connecting))
        );
        assert!(matches!(
            durable.tenant_store().keys().await,
            Err(iop_store::TenantStoreError::Unavailable(_))
        ));
        std::fs::rename(&path, dir.path().join("journal.redb.damaged")).unwrap();
        let unfinished = tokio::time::timeout(Duration::from_secs(10), up_rx)
            .await
            .expect("up within the backoff's bound")
            .unwrap();
        assert!(unfinished.is_empty());
        assert_eq!(durable.store_state(), StoreState::Up);
        assert!(matches!(
            durable.create(new_record("r", "p")).await,
            Ok(CreateOutcome::Create(_))
        ));
        // Its lease was taken before it served (R-TAKE-1).
        assert!(
            durable
                .store()
                .lease("edge-a".into())
                .await
                .unwrap()
                .is_some()
        );
        assert_eq!(durable.status().availability.state, "up");
        keeper.abort();
    }

    /// A store that fails every operation for a while, then works.
    struct Flaky {
        inner: MemoryStore,
        failures_left: std::sync::atomic::AtomicU32,
    }

    impl Flaky {
        fn fail(&self) -> Option<JournalError> {
            self.failures_left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .ok()
                .map(|_| JournalError::Store("the journal's write queue is full".into()))
        }
    }

    impl JournalStore for Flaky {
        fn create(
            &self,
            record: NewRecord,
        ) -> iop_store::BoxFuture<'_, Result<CreateOutcome, JournalError>> {
            self.inner.create(record)
        }
        fn append(
            &self,
            id: String,
            epoch: u64,
            events: Vec<JournalEvent>,
        ) -> iop_store::BoxFuture<'_, Result<RecordMeta, JournalError>> {
            match self.fail() {
                Some(e) => Box::pin(async move { Err(e) }),
                None => self.inner.append(id, epoch, events),
            }
        }
        fn finish(
            &self,
            id: String,
            epoch: u64,
            terminal: Terminal,
        ) -> iop_store::BoxFuture<'_, Result<RecordMeta, JournalError>> {
            self.inner.finish(id, epoch, terminal)
        }
        fn raise_epoch(
            &self,
            id: String,
            expected: u64,
            owner: String,
        ) -> iop_store::BoxFuture<'_, Result<RecordMeta, JournalError>> {
            self.inner.raise_epoch(id, expected, owner)
        }
        fn get(
            &self,
            id: String,
            now_unix_ms: u64,
        ) -> iop_store::BoxFuture<'_, Result<Option<iop_store::StoredRecord>, JournalError>>
        {
            self.inner.get(id, now_unix_ms)
        }
        fn events(
            &self,
            id: String,
            after: u64,
            max: usize,
        ) -> iop_store::BoxFuture<'_, Result<Vec<JournalEvent>, JournalError>> {
            self.inner.events(id, after, max)
        }
        fn delete(&self, id: String) -> iop_store::BoxFuture<'_, Result<(), JournalError>> {
            self.inner.delete(id)
        }
        fn unfinished(&self) -> iop_store::BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>> {
            self.inner.unfinished()
        }
        fn sweep(&self, now_unix_ms: u64) -> iop_store::BoxFuture<'_, Result<usize, JournalError>> {
            self.inner.sweep(now_unix_ms)
        }
        fn watch(
            &self,
            id: String,
        ) -> iop_store::BoxFuture<'_, Result<watch::Receiver<Progress>, JournalError>> {
            self.inner.watch(id)
        }
        fn stats(&self) -> iop_store::StoreStats {
            self.inner.stats()
        }
        fn put_lease(
            &self,
            lease: EdgeLease,
            expected: u64,
        ) -> iop_store::BoxFuture<'_, Result<u64, JournalError>> {
            self.inner.put_lease(lease, expected)
        }
        fn lease(
            &self,
            edge_id: String,
        ) -> iop_store::BoxFuture<'_, Result<Option<iop_core::journal::StoredLease>, JournalError>>
        {
            self.inner.lease(edge_id)
        }
        fn leases(
            &self,
        ) -> iop_store::BoxFuture<'_, Result<Vec<iop_core::journal::StoredLease>, JournalError>>
        {
            self.inner.leases()
        }
        fn held(&self, subject: &iop_core::tenant::Subject) -> iop_core::tenant::Held {
            self.inner.held(subject)
        }
    }

    /// R-JRN-6: an append the store refuses a few times is written once
    /// it takes it, within the retry bound, instead of failing the run.
    #[tokio::test(start_paused = true)]
    async fn an_append_the_store_refuses_for_a_moment_is_written_once_it_can_be() {
        let flaky = Arc::new(Flaky {
            inner: MemoryStore::new(JournalLimits::default()),
            failures_left: std::sync::atomic::AtomicU32::new(3),
        });
        let store: Arc<dyn JournalStore> = flaky.clone();
        create(&store, "r").await;
        let durable = Arc::new(Durable::with_store(store.clone(), true));
        let write = JournalWrite::Append {
            response_id: "r".into(),
            epoch: 1,
            events: vec![event(1, &text("a"))],
        };
        assert_eq!(durable.clone().write(write).await, JournalAck::Appended);
        assert_eq!(store.events("r".into(), 0, 10).await.unwrap().len(), 1);
        // Past the bound, the refusal is the answer.
        flaky
            .failures_left
            .store(u32::MAX, std::sync::atomic::Ordering::SeqCst);
        let write = JournalWrite::Append {
            response_id: "r".into(),
            epoch: 1,
            events: vec![event(2, &text("b"))],
        };
        let started = tokio::time::Instant::now();
        assert!(matches!(
            durable.clone().write(write).await,
            JournalAck::Refused(JournalError::Store(_))
        ));
        assert!(started.elapsed() <= WRITE_RETRY.deadline + Duration::from_secs(1));
        // Without retries (write_retry_ms = 0) the first refusal answers,
        // as before R-JRN-6.
        let section = JournalSection {
            write_retry_ms: 0,
            ..JournalSection::default()
        };
        let mut once = Durable::with_store(store.clone(), true);
        once.write_retry = section.write_retry();
        let once = Arc::new(once);
        let started = tokio::time::Instant::now();
        let write = JournalWrite::Append {
            response_id: "r".into(),
            epoch: 1,
            events: vec![event(2, &text("b"))],
        };
        assert!(matches!(
            once.write(write).await,
            JournalAck::Refused(JournalError::Store(_))
        ));
        assert_eq!(started.elapsed(), Duration::ZERO);
    }
}
