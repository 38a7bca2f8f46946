//! The Edge's custody of the durable records no run of it writes
//! (R-TAKE-1, R-PARK-2, R-CONT-1, R-MULTI-1): one [`Custody`] per Edge.
//!
//! It runs the takeover scan ([`TakeoverScan`]: which record is an orphan,
//! how long it waits for its node to report the run parked), takes each
//! orphan past its park window over, and takes over the record of every
//! parked run a node reports that no request of this Edge waits for. Every
//! takeover goes the same way: **read, decide, raise the epoch (R-JRN-3),
//! read again, act**:
//!
//! * an orphan whose route continues answers ([`StoreAnswer::Record`]'s
//!   `continuable`) and whose journal holds text and no tool call is
//!   handed to a new request that continues it on its pool
//!   ([`CustodyOutput::Continue`], [`crate::edge::request::Request::continuing`]);
//!   any other orphan ends `incomplete` with its durable prefix;
//! * a parked run's record is handed to a request that adopts the run
//!   after the frame [`takeover_resume_point`] names, asked again after the
//!   raise ([`CustodyOutput::Adopt`]); a report the record does not match
//!   is let go ([`CustodyOutput::Release`]).
//!
//! One retry rule holds for every write of a takeover: a write another
//! writer fenced, or the store failed (after [`STORE_RETRY`]), is decided
//! again on a fresh read of the record and its owner's lease, and tried
//! again only while the record is still an orphan, at most
//! [`MAX_TAKEOVER_WRITES`] writes per takeover.
//!
//! Sans-IO: the inputs are the store's answers and the nodes' offers, the
//! outputs are store operations and the requests to start. The driver
//! loop is the crate's ([`crate::machine::Machine`]): feed an input or
//! fire the timeout, then drain [`Custody::poll_output`], carrying out
//! each [`StoreOp`] and feeding its answer back as
//! [`CustodyInput::Store`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use iop_wire::RunKey;

use crate::edge::dispatch::ParkedOffer;
use crate::edge::durable::{
    JournaledUse, NotContinuable, ResumedAnswer, TakeoverRefusal, journaled_terminal,
    journaled_use, resumed_answer, takeover_resume_point,
};
use crate::journal::{
    JOURNAL_UNAVAILABLE_REASON, JournalError, JournalEvent, LeaseState, MAX_TRACKED_EDGES,
    NO_OWNER, Orphan, RecordMeta, RecordStatus, StoredLease, TakeoverDecision, TakeoverScan,
    Terminal,
};
use crate::time::Instant;

/// Records one scan takes over at most; the rest wait for the next scan.
pub const MAX_TAKEOVERS_PER_SCAN: usize = 256;

/// Takeovers and adoptions in progress at once; an offer beyond is let go
/// (its node reports the run again at its next registration).
pub const MAX_TASKS: usize = 1024;

/// Records left open ([`CustodyInput::RunLeftOpen`]) that wait for room
/// among the tasks, at most. The Edge admits no durable request while any
/// waits ([`Custody::refuses_durable`]), so the set holds at most the
/// durable runs in flight when the first one had to wait; this bound is
/// the last defence (about 4 MiB of ids), past which a record is left to
/// the scans.
pub const MAX_LEFT_OPEN: usize = 65_536;

/// Writes (raises and terminals) one takeover tries at most.
pub const MAX_TAKEOVER_WRITES: u32 = 32;

/// How long a takeover waits after the store failed before it reads again.
pub const STORE_RETRY: Duration = Duration::from_millis(200);

/// The shortest pause between two scans.
pub const MIN_SCAN_PAUSE: Duration = Duration::from_millis(50);

/// How the custody of one Edge is set up.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CustodyConfig {
    /// This Edge's `edge_id`.
    pub edge_id: String,
    /// How long an orphan waits for its node's report (R-PARK-2).
    pub park_window: Duration,
    /// This Edge's lease TTL (an absent lease is judged by it).
    pub lease_ttl: Duration,
    /// The store is this Edge's alone: every record in it is its own.
    pub sole: bool,
    /// The pause between two scans of a shared store.
    pub scan_interval: Duration,
    /// Takeovers and adoptions in progress at once, at most
    /// ([`MAX_TASKS`]; the simulator tries small custodies too).
    #[serde(default = "default_max_tasks")]
    pub max_tasks: usize,
}

fn default_max_tasks() -> usize {
    MAX_TASKS
}

/// A store operation the driver carries out; its answer comes back as the
/// [`StoreAnswer`] of the same name.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreOp {
    /// Every record without a terminal (`hint`: the store's own, possibly
    /// lagging, view is enough).
    Unfinished {
        /// A lagging view will do.
        hint: bool,
    },
    /// Every Edge's ownership lease.
    Leases,
    /// One Edge's lease.
    Lease {
        /// The Edge.
        edge_id: String,
    },
    /// One record's metadata.
    Record {
        /// The record.
        id: String,
    },
    /// The payload of event `seq` of a record.
    Event {
        /// The record.
        id: String,
        /// The event.
        seq: u64,
    },
    /// Every event of a record, in order.
    Events {
        /// The record.
        id: String,
    },
    /// Raise a record's epoch from `expected`, this Edge its owner
    /// (R-JRN-3).
    RaiseEpoch {
        /// The record.
        id: String,
        /// The epoch read.
        expected: u64,
    },
    /// Write a record's terminal at `epoch`. `terminal.at_unix_ms` is 0:
    /// the driver stamps the wall-clock time.
    Finish {
        /// The record.
        id: String,
        /// The epoch the raise won.
        epoch: u64,
        /// The terminal.
        terminal: Terminal,
    },
}

impl StoreOp {
    /// Whether it reads the store (a scan, a record, its events): a
    /// takeover's read, which holds a place of the takeovers' own share
    /// of store reads while it runs
    /// ([`crate::edge::store_reads::StoreReads::begin_takeover`], R-LIM-6).
    /// Raising an epoch and writing a terminal are writes.
    pub fn reads(&self) -> bool {
        match self {
            StoreOp::Unfinished { .. }
            | StoreOp::Leases
            | StoreOp::Lease { .. }
            | StoreOp::Record { .. }
            | StoreOp::Event { .. }
            | StoreOp::Events { .. } => true,
            StoreOp::RaiseEpoch { .. } | StoreOp::Finish { .. } => false,
        }
    }
}

/// The store's answer to a [`StoreOp`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreAnswer {
    /// [`StoreOp::Unfinished`]: each record and whether a run of this Edge
    /// writes it.
    Unfinished(Result<Vec<(RecordMeta, bool)>, JournalError>),
    /// [`StoreOp::Leases`].
    Leases(Result<Vec<StoredLease>, JournalError>),
    /// [`StoreOp::Lease`].
    Lease {
        /// The Edge.
        edge_id: String,
        /// Its lease, if it has one.
        result: Result<Option<StoredLease>, JournalError>,
    },
    /// [`StoreOp::Record`].
    Record {
        /// The record.
        id: String,
        /// Its metadata, if it exists.
        result: Result<Option<RecordMeta>, JournalError>,
        /// A run of this Edge writes it.
        live_here: bool,
        /// Its route continues an answer on another provider (R-CONT-1:
        /// opted in, a chat API, a pool to continue on).
        continuable: bool,
    },
    /// [`StoreOp::Event`].
    Event {
        /// The record.
        id: String,
        /// The payload, if the event exists.
        result: Result<Option<Vec<u8>>, JournalError>,
    },
    /// [`StoreOp::Events`].
    Events {
        /// The record.
        id: String,
        /// Its events.
        result: Result<Vec<JournalEvent>, JournalError>,
    },
    /// [`StoreOp::RaiseEpoch`].
    Raised {
        /// The record.
        id: String,
        /// The record as raised.
        result: Result<RecordMeta, JournalError>,
    },
    /// [`StoreOp::Finish`].
    Finished {
        /// The record.
        id: String,
        /// Whether the terminal is durable.
        result: Result<(), JournalError>,
    },
}

/// One input of a [`Custody`].
// A store answer carries a record's metadata by value: inputs are made
// once per store answer and moved into the machine, so boxing it would
// only add an allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CustodyInput {
    /// A store operation's answer.
    Store(StoreAnswer),
    /// A parked run a node reported (R-PARK-2) that no request of this
    /// Edge waits for.
    Offer(ParkedOffer),
    /// A request of this Edge ended without its record's terminal: the
    /// store refused it too often
    /// ([`Request::record_left_open`](crate::edge::request::Request::record_left_open)).
    /// Its run is closed (nothing parks) and its answer settled: the
    /// custody ends the record now, as its journal says or `failed`
    /// ([`JOURNAL_UNAVAILABLE_REASON`]), trying again while the store
    /// fails, without waiting for a restart's scan (R-JRN-4, R-JRN-6).
    /// It charges nothing (the request did, R-TEN-2) and continues
    /// nothing.
    RunLeftOpen(String),
}

/// Why a reported parked run is not adopted here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReleaseReason {
    /// A takeover of its record is in progress, or too many are.
    Busy,
    /// No such record.
    UnknownResponse,
    /// A run of this Edge writes the record.
    LiveHere,
    /// The store failed.
    StoreError,
    /// The record is not this run's, or has ended.
    Refused(TakeoverRefusal),
    /// Another writer won the record's epoch.
    EpochLost,
    /// Another Edge owns the record and its lease did not expire while
    /// the adoption waited.
    OwnerAlive,
}

impl ReleaseReason {
    /// Whether the released run is of no use to any Edge: its record
    /// ended or is gone. Any other reason may leave it to another Edge or
    /// a later report (R-MULTI-1).
    pub fn ends_run(self) -> bool {
        matches!(
            self,
            ReleaseReason::UnknownResponse | ReleaseReason::Refused(TakeoverRefusal::Ended)
        )
    }

    /// The closed label for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Busy => "busy",
            ReleaseReason::UnknownResponse => "unknown_response",
            ReleaseReason::LiveHere => "live_here",
            ReleaseReason::StoreError => "store_error",
            ReleaseReason::Refused(why) => why.as_str(),
            ReleaseReason::EpochLost => "epoch_lost",
            ReleaseReason::OwnerAlive => "owner_alive",
        }
    }
}

/// What a [`Custody`] reports (for logs and metrics).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CustodyEvent {
    /// More orphans wait for their park window than before.
    OrphansWaiting(usize),
    /// A scan's read failed; every lease clock starts again.
    ScanFailed(JournalError),
    /// An orphan ended `incomplete` with its durable prefix.
    Ended {
        /// The record.
        id: String,
        /// The closed reason.
        reason: &'static str,
        /// Why it was not continued (`None`: its route does not continue).
        not_continued: Option<NotContinuable>,
    },
    /// A takeover's write was fenced or failed; it reads again.
    Retried {
        /// The record.
        id: String,
        /// The refusal.
        error: JournalError,
    },
    /// A takeover used its writes without winning; the record waits for a
    /// later scan.
    GaveUp {
        /// The record.
        id: String,
    },
}

/// What the driver carries out, in order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CustodyOutput {
    /// Run this store operation; feed its answer back.
    Store(StoreOp),
    /// Start a request that adopts the parked run (R-PARK-2), writing the
    /// record at `meta.epoch`, which this Edge won.
    Adopt {
        /// The node's report.
        offer: ParkedOffer,
        /// The record as raised.
        meta: RecordMeta,
        /// The run's frame the journal's last event came from.
        resume_after_frame: u64,
        /// The answer so far, when the route continues a lost adoption on
        /// its pool (R-CONT-1) and the journal allows it.
        resumed: Option<ResumedAnswer>,
    },
    /// Start a request that continues the orphan's answer on its pool
    /// (R-TAKE-1, R-CONT-1), writing the record at `meta.epoch`.
    Continue {
        /// The record as raised.
        meta: RecordMeta,
        /// What its journal holds.
        resumed: ResumedAnswer,
    },
    /// Charge the answer of record `meta`, which this Edge just ended
    /// `incomplete` (its terminal is durable at the epoch this Edge won),
    /// what its journal holds (R-TEN-2): to the key and principal the
    /// record names, once, by this Edge alone (a writer that lost the
    /// epoch never gets here). The driver estimates the prompt from the
    /// stored request as its reservation did
    /// ([`JournaledUse::charged`]).
    Charge {
        /// The record as raised.
        meta: RecordMeta,
        /// What its journal holds.
        used: JournaledUse,
    },
    /// Let the reported parked run go (its held capacity with it).
    Release {
        /// The node that reported it.
        node: crate::ids::NodeId,
        /// The run.
        key: RunKey,
        /// The durable response the node reported it for (for logs, and
        /// for a checker to compare `reason` with the record).
        response_id: String,
        /// Why.
        reason: ReleaseReason,
    },
    /// Tell the run's node to end it now (after its `Release`): its
    /// response ended or is gone, so no Edge can use it (R-PARK-1).
    CancelParked(ParkedOffer),
    /// Something to log or count.
    Event(CustodyEvent),
}

/// Where the current scan is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ScanStage {
    /// Reading the unfinished records.
    Records,
    /// Reading every lease.
    Leases(Vec<(RecordMeta, bool)>),
    /// Reading the leases the listing did not name.
    Owners {
        records: Vec<(RecordMeta, bool)>,
        pending: BTreeSet<String>,
    },
}

/// One takeover in progress, per record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Task {
    kind: TaskKind,
    stage: Stage,
    /// Writes tried.
    writes: u32,
    continuable: bool,
    /// What kind of orphan it was first found (an orphan's takeover).
    orphan: Option<Orphan>,
    /// A record a request of this Edge left open
    /// ([`CustodyInput::RunLeftOpen`]).
    left_open: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum TaskKind {
    /// An orphan past its park window.
    Orphan,
    /// A parked run a node reported.
    Adopt(ParkedOffer),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    /// Reading the record.
    Reading,
    /// Reading the owner's lease before deciding.
    Lease { meta: RecordMeta, live_here: bool },
    /// Waiting to read again after a store failure.
    Pause { until: Instant },
    /// Reading the record's last event (an adoption); `raised`: after the
    /// raise.
    Last { meta: RecordMeta, raised: bool },
    /// An adoption of another Edge's record waits for that Edge's lease to
    /// expire, until `until`.
    AwaitOwner { meta: RecordMeta, until: Instant },
    /// Raising the epoch from the one read.
    Raising,
    /// Reading the events of a raised orphan to continue it.
    Events { meta: RecordMeta },
    /// Reading the events of a raised orphan that is not continued, for
    /// what its answer is charged (R-TEN-2).
    EndEvents { meta: RecordMeta },
    /// Reading the events of a raised record whose run is adopted, for
    /// the answer so far (a route that continues).
    AdoptEvents { meta: RecordMeta, frame: u64 },
    /// Writing the terminal; then charging `charge` (R-TEN-2).
    Finishing {
        reason: &'static str,
        not_continued: Option<NotContinuable>,
        meta: RecordMeta,
        charge: Option<JournaledUse>,
    },
}

/// The custody of one Edge (see the module docs).
#[derive(Debug)]
pub struct Custody {
    cfg: CustodyConfig,
    scan: TakeoverScan,
    stage: Option<ScanStage>,
    /// When the next scan starts (`None`: no more scans, a sole store
    /// with no orphan left).
    next_scan: Option<Instant>,
    /// The first scan read every record.
    scanned: bool,
    /// A sole store's records as first read, while any of them waits.
    sole_records: Vec<RecordMeta>,
    tasks: BTreeMap<String, Task>,
    /// Records left open ([`CustodyInput::RunLeftOpen`]) waiting for room
    /// among the tasks (at most [`MAX_LEFT_OPEN`]).
    left_open: BTreeSet<String>,
    outputs: VecDeque<CustodyOutput>,
}

impl Custody {
    /// The custody of an Edge starting at `now`: its first scan is due at
    /// once.
    pub fn new(now: Instant, mut cfg: CustodyConfig) -> Self {
        cfg.max_tasks = cfg.max_tasks.max(1);
        let scan = if cfg.sole {
            TakeoverScan::sole(&cfg.edge_id, cfg.park_window)
        } else {
            TakeoverScan::new(&cfg.edge_id, cfg.park_window, cfg.lease_ttl)
        };
        Custody {
            cfg,
            scan,
            stage: None,
            next_scan: Some(now),
            scanned: false,
            sole_records: Vec::new(),
            tasks: BTreeMap::new(),
            left_open: BTreeSet::new(),
            outputs: VecDeque::new(),
        }
    }

    /// The scan's view: leases seen, orphans waiting.
    pub fn scan(&self) -> &TakeoverScan {
        &self.scan
    }

    /// Whether a takeover of `id` is in progress here (its record counts
    /// as written here meanwhile).
    pub fn is_taking(&self, id: &str) -> bool {
        self.tasks.contains_key(id)
    }

    /// Takeovers and adoptions in progress.
    pub fn tasks(&self) -> usize {
        self.tasks.len()
    }

    /// Records left open waiting for room among the tasks.
    pub fn left_open_waiting(&self) -> usize {
        self.left_open.len()
    }

    /// Whether the Edge must refuse new durable requests now (R-JRN-6,
    /// R-TEN-2): records its requests left open wait for room among the
    /// custody's tasks. Each such record is its request's settled answer,
    /// known as such only here; were the custody to let one go, a scan
    /// would end it as an orphan and charge its journal a second time. So
    /// while the custody cannot take them all, the Edge makes no new ones:
    /// a durable request gets 503 `response_store_unavailable`, as while
    /// the store is out, until the custody catches up (ephemeral requests
    /// are served meanwhile).
    pub fn refuses_durable(&self) -> bool {
        !self.left_open.is_empty()
    }

    /// Feed one input at `now`; drain [`Self::poll_output`] after.
    pub fn handle_input(&mut self, now: Instant, input: CustodyInput) {
        match input {
            CustodyInput::Offer(offer) => self.offer(offer),
            CustodyInput::Store(answer) => self.answer(now, answer),
            CustodyInput::RunLeftOpen(id) => {
                match self.tasks.get_mut(&id) {
                    // Found by a scan meanwhile: end it as left open.
                    Some(task) if task.kind == TaskKind::Orphan => task.left_open = true,
                    _ if self.left_open.len() < MAX_LEFT_OPEN => {
                        self.left_open.insert(id);
                    }
                    // Past the bound, the scans find it (a sole store's
                    // read whole again).
                    _ => self.gave_up(now, &id),
                }
            }
        }
        self.start_left_open();
    }

    /// Start the takeovers of records left open, while there is room.
    fn start_left_open(&mut self) {
        while self.tasks.len() < self.cfg.max_tasks {
            let Some(id) = self
                .left_open
                .iter()
                .find(|id| !self.tasks.contains_key(*id))
                .cloned()
            else {
                return;
            };
            self.left_open.remove(&id);
            self.take_orphan(id, true);
        }
    }

    /// Start taking orphan `id` over (`left_open`: a record a request of
    /// this Edge left open): its record is read first.
    fn take_orphan(&mut self, id: String, left_open: bool) {
        self.tasks.insert(
            id.clone(),
            Task {
                kind: TaskKind::Orphan,
                stage: Stage::Reading,
                writes: 0,
                continuable: false,
                orphan: None,
                left_open,
            },
        );
        self.push(StoreOp::Record { id });
    }

    /// The next output, in order.
    pub fn poll_output(&mut self) -> Option<CustodyOutput> {
        self.outputs.pop_front()
    }

    /// When [`Self::handle_timeout`] is due: the next scan, or a takeover
    /// that reads again after a store failure.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let scan = self.next_scan.filter(|_| self.stage.is_none());
        let pauses = self.tasks.values().filter_map(|t| match t.stage {
            Stage::Pause { until } | Stage::AwaitOwner { until, .. } => Some(until),
            _ => None,
        });
        pauses.chain(scan).min()
    }

    /// Fire what is due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<String> = self
            .tasks
            .iter()
            .filter(|(_, t)| matches!(t.stage, Stage::Pause { until } if now >= until))
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            self.read_again(now, &id);
        }
        // A timer alone never shows an owner gone (only a fresh read of its
        // lease does): here waits that are over only end.
        self.owners_checked(now, false);
        if self.stage.is_none() && self.next_scan.is_some_and(|at| now >= at) {
            self.next_scan = None;
            self.start_scan(now);
        }
        self.start_left_open();
    }

    // ---- The scan -----------------------------------------------------------

    fn start_scan(&mut self, now: Instant) {
        if self.cfg.sole && self.scanned {
            // A sole store holds no other Edge's records: only those found
            // at start can be orphans, each read again before it is ended.
            let scan = &self.scan;
            self.sole_records.retain(|m| scan.is_waiting(&m.id));
            if self.sole_records.is_empty() {
                return;
            }
            let records = self
                .sole_records
                .iter()
                .map(|m| (m.clone(), false))
                .collect();
            self.decide_all(now, records);
            return;
        }
        self.stage = Some(ScanStage::Records);
        self.push(StoreOp::Unfinished {
            hint: self.scanned && !self.cfg.sole,
        });
    }

    fn scan_failed(&mut self, now: Instant, error: JournalError) {
        self.scan.leases_mut().read_failed(now);
        self.stage = None;
        self.outputs
            .push_back(CustodyOutput::Event(CustodyEvent::ScanFailed(error)));
        self.next_scan = Some(now.saturating_add(self.cfg.scan_interval.max(MIN_SCAN_PAUSE)));
    }

    fn records_read(&mut self, now: Instant, records: Vec<(RecordMeta, bool)>) {
        if !self.scanned && self.cfg.sole {
            self.sole_records = records.iter().map(|(m, _)| m.clone()).collect();
        }
        self.scanned = true;
        if self.cfg.sole {
            self.stage = None;
            self.decide_all(now, records);
            return;
        }
        self.stage = Some(ScanStage::Leases(records));
        self.push(StoreOp::Leases);
    }

    fn leases_read(&mut self, now: Instant, leases: Vec<StoredLease>) {
        let Some(ScanStage::Leases(records)) = self.stage.take() else {
            return;
        };
        self.scan.leases_mut().observe_all(&leases, now);
        self.owners_checked(now, true);
        // Owners the listing did not name (the store's view lags behind a
        // new Edge): read each.
        let me = self.cfg.edge_id.as_str();
        let pending: BTreeSet<String> = records
            .iter()
            .map(|(m, _)| m.owner.as_str())
            .filter(|o| *o != me && *o != NO_OWNER)
            .filter(|o| self.scan.leases().state(o, now).is_none())
            .take(MAX_TRACKED_EDGES)
            .map(str::to_owned)
            .collect();
        if pending.is_empty() {
            self.decide_all(now, records);
            return;
        }
        for edge_id in &pending {
            self.push(StoreOp::Lease {
                edge_id: edge_id.clone(),
            });
        }
        self.stage = Some(ScanStage::Owners { records, pending });
    }

    /// Decide every record read; take those past their window over.
    fn decide_all(&mut self, now: Instant, records: Vec<(RecordMeta, bool)>) {
        self.stage = None;
        let waiting_before = self.scan.waiting();
        let mut due = Vec::new();
        for (meta, live_here) in &records {
            if self
                .tasks
                .get(&meta.id)
                .is_some_and(|t| t.kind == TaskKind::Orphan)
            {
                // Being taken over as an orphan: its takeover decides on
                // its own reads. Asked as live, the scan would forget the
                // orphan's window (and a sole store's scans the record
                // itself), so a takeover paused by a failed read would
                // find it within a new window and drop it.
                continue;
            }
            // An adoption in progress, or a record left open waiting: live
            // (a released adoption leaves its node a new window).
            let live = *live_here
                || self.tasks.contains_key(&meta.id)
                || self.left_open.contains(&meta.id);
            if let TakeoverDecision::End(_) = self.scan.decide(meta, live, now) {
                due.push(meta.id.clone());
            }
        }
        let ids: BTreeSet<&str> = records.iter().map(|(m, _)| m.id.as_str()).collect();
        self.scan.retain(|id| ids.contains(id));
        if self.scan.waiting() > waiting_before {
            self.outputs
                .push_back(CustodyOutput::Event(CustodyEvent::OrphansWaiting(
                    self.scan.waiting(),
                )));
        }
        // Records left open first: the scans find an orphan again.
        self.start_left_open();
        for id in due.into_iter().take(MAX_TAKEOVERS_PER_SCAN) {
            if self.tasks.len() >= self.cfg.max_tasks {
                break;
            }
            self.take_orphan(id, false);
        }
        let pause = match self.scan.poll_timeout() {
            Some(at) => self
                .cfg
                .scan_interval
                .min(at.saturating_duration_since(now)),
            None => self.cfg.scan_interval,
        };
        let more = !self.cfg.sole || self.scan.waiting() > 0;
        self.next_scan = more.then(|| now.saturating_add(pause.max(MIN_SCAN_PAUSE)));
    }

    // ---- Offers -------------------------------------------------------------

    fn offer(&mut self, offer: ParkedOffer) {
        let id = offer.run.response_id.clone();
        if self.tasks.contains_key(&id) || self.tasks.len() >= self.cfg.max_tasks {
            self.release(&offer, ReleaseReason::Busy);
            return;
        }
        self.tasks.insert(
            id.clone(),
            Task {
                kind: TaskKind::Adopt(offer),
                stage: Stage::Reading,
                writes: 0,
                continuable: false,
                orphan: None,
                left_open: false,
            },
        );
        self.push(StoreOp::Record { id });
    }

    fn release(&mut self, offer: &ParkedOffer, reason: ReleaseReason) {
        self.outputs.push_back(CustodyOutput::Release {
            node: offer.node.clone(),
            key: offer.run.key,
            response_id: offer.run.response_id.clone(),
            reason,
        });
    }

    /// End the task of `id`; an adoption's run is let go with `reason`.
    fn drop_task(&mut self, id: &str, reason: ReleaseReason) {
        if let Some(Task {
            kind: TaskKind::Adopt(offer),
            ..
        }) = self.tasks.remove(id)
        {
            self.release(&offer, reason);
            if reason.ends_run() {
                self.outputs.push_back(CustodyOutput::CancelParked(offer));
            }
        }
    }

    // ---- Answers ------------------------------------------------------------

    fn answer(&mut self, now: Instant, answer: StoreAnswer) {
        match answer {
            StoreAnswer::Unfinished(result) => {
                if self.stage != Some(ScanStage::Records) {
                    return;
                }
                match result {
                    Ok(records) => self.records_read(now, records),
                    Err(e) => self.scan_failed(now, e),
                }
            }
            StoreAnswer::Leases(result) => {
                if !matches!(self.stage, Some(ScanStage::Leases(_))) {
                    return;
                }
                match result {
                    Ok(leases) => self.leases_read(now, leases),
                    Err(e) => self.scan_failed(now, e),
                }
            }
            StoreAnswer::Lease { edge_id, result } => self.lease_read(now, &edge_id, result),
            StoreAnswer::Record {
                id,
                result,
                live_here,
                continuable,
            } => self.record_read(now, &id, result, live_here, continuable),
            StoreAnswer::Event { id, result } => self.event_read(&id, result),
            StoreAnswer::Events { id, result } => self.events_read(now, &id, result),
            StoreAnswer::Raised { id, result } => self.raised(now, &id, result),
            StoreAnswer::Finished { id, result } => self.finished(now, &id, result),
        }
    }

    fn lease_read(
        &mut self,
        now: Instant,
        edge_id: &str,
        result: Result<Option<StoredLease>, JournalError>,
    ) {
        let lease = match result {
            Ok(lease) => lease,
            Err(e) => {
                if matches!(self.stage, Some(ScanStage::Owners { .. })) {
                    self.scan_failed(now, e.clone());
                }
                self.scan.leases_mut().read_failed(now);
                // Every takeover waiting for a lease reads again later.
                let waiting: Vec<String> = self
                    .tasks
                    .iter()
                    .filter(|(_, t)| matches!(t.stage, Stage::Lease { .. }))
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in waiting {
                    self.pause(now, &id, e.clone());
                }
                return;
            }
        };
        self.scan.leases_mut().observe(edge_id, lease.as_ref(), now);
        self.owners_checked(now, true);
        if let Some(ScanStage::Owners { pending, .. }) = &mut self.stage {
            pending.remove(edge_id);
            if pending.is_empty()
                && let Some(ScanStage::Owners { records, .. }) = self.stage.take()
            {
                self.decide_all(now, records);
            }
        }
        let waiting: Vec<(String, RecordMeta, bool)> = self
            .tasks
            .iter()
            .filter_map(|(id, t)| match &t.stage {
                Stage::Lease { meta, live_here } if meta.owner == edge_id => {
                    Some((id.clone(), meta.clone(), *live_here))
                }
                _ => None,
            })
            .collect();
        for (id, meta, live_here) in waiting {
            self.decide_orphan(now, &id, meta, live_here);
        }
    }

    fn record_read(
        &mut self,
        now: Instant,
        id: &str,
        result: Result<Option<RecordMeta>, JournalError>,
        live_here: bool,
        continuable: bool,
    ) {
        let Some(task) = self.tasks.get_mut(id) else {
            return;
        };
        if task.stage != Stage::Reading {
            return;
        }
        // A record left open is ended, never continued.
        task.continuable = continuable && !task.left_open;
        let meta = match result {
            Ok(Some(meta)) => meta,
            Ok(None) => {
                self.scan.forget(id);
                return self.drop_task(id, ReleaseReason::UnknownResponse);
            }
            Err(e) => {
                return match task.kind {
                    TaskKind::Orphan => self.pause(now, id, e),
                    TaskKind::Adopt(_) => self.drop_task(id, ReleaseReason::StoreError),
                };
            }
        };
        let owner_wait = self
            .owner_may_be_alive(&meta, now)
            .then(|| self.owner_wait(&meta.owner, now));
        let owner_unread = self.scan.leases().state(&meta.owner, now).is_none();
        let Some(task) = self.tasks.get_mut(id) else {
            return;
        };
        match task.kind {
            TaskKind::Adopt(_) if live_here => self.drop_task(id, ReleaseReason::LiveHere),
            TaskKind::Adopt(_) if owner_wait.is_some() => {
                // R-PARK-2, R-MULTI-1: another Edge owns the record and is
                // not seen gone; its own request may take the run when the
                // node registers there. Adopt only once its lease expired.
                let until = now.saturating_add(owner_wait.unwrap_or_default());
                let owner = meta.owner.clone();
                task.stage = Stage::AwaitOwner { meta, until };
                if owner_unread {
                    self.push(StoreOp::Lease { edge_id: owner });
                }
            }
            TaskKind::Adopt(_) => self.read_last(id, meta),
            TaskKind::Orphan => {
                let needs_lease =
                    !self.cfg.sole && meta.owner != self.cfg.edge_id && meta.owner != NO_OWNER;
                if needs_lease {
                    let edge_id = meta.owner.clone();
                    task.stage = Stage::Lease { meta, live_here };
                    self.push(StoreOp::Lease { edge_id });
                } else {
                    self.decide_orphan(now, id, meta, live_here);
                }
            }
        }
    }

    /// An orphan's takeover, on a fresh read of the record and its owner's
    /// lease: raise its epoch while it is still an orphan.
    fn decide_orphan(&mut self, now: Instant, id: &str, meta: RecordMeta, live_here: bool) {
        // A record left open has no run to wait for: its request closed it.
        let first = self
            .tasks
            .get(id)
            .is_some_and(|t| t.writes == 0 && !t.left_open);
        let orphan = if first {
            // The scan's decision, asked again on the fresh read.
            match self.scan.decide(&meta, live_here, now) {
                TakeoverDecision::End(kind) => Some(kind),
                _ => None,
            }
        } else {
            // A raise another writer beat, or the store failed: the window
            // is over; only whether it is still an orphan counts.
            self.scan.orphan_now(&meta, live_here, now)
        };
        let Some(task) = self.tasks.get_mut(id) else {
            return;
        };
        if orphan.is_none() {
            self.tasks.remove(id);
            // Within a new window (its owner's lease seen otherwise): a
            // scan decides it again when the window ends.
            if let Some(until) = self
                .scan
                .is_waiting(id)
                .then(|| self.scan.poll_timeout())
                .flatten()
            {
                self.next_scan = Some(self.next_scan.map_or(until, |at| at.min(until)));
            }
            return;
        }
        if task.writes >= MAX_TAKEOVER_WRITES {
            self.give_up(now, id);
            return;
        }
        self.scan.forget(id);
        task.orphan = task.orphan.or(orphan);
        task.writes += 1;
        task.stage = Stage::Raising;
        self.push(StoreOp::RaiseEpoch {
            id: id.to_owned(),
            expected: meta.epoch,
        });
    }

    fn event_read(&mut self, id: &str, result: Result<Option<Vec<u8>>, JournalError>) {
        let Some(task) = self.tasks.get(id) else {
            return;
        };
        if !matches!(
            (&task.stage, &task.kind),
            (Stage::Last { .. }, TaskKind::Adopt(_))
        ) {
            return;
        }
        let Ok(payload) = result else {
            return self.drop_task(id, ReleaseReason::StoreError);
        };
        self.resume_from(id, payload);
    }

    /// An adoption's decision on the record's last event (`payload`, `None`
    /// when the record holds none), read before the raise or after it.
    fn resume_from(&mut self, id: &str, payload: Option<Vec<u8>>) {
        let Some(task) = self.tasks.get_mut(id) else {
            return;
        };
        let (Stage::Last { meta, raised }, TaskKind::Adopt(offer)) = (&task.stage, &task.kind)
        else {
            return;
        };
        // R-PARK-2, R-TAKE-1: whether the record is the reported run's,
        // and after which frame it resumes: asked before the raise and
        // again after it (the former writer may have appended between).
        let frame = match takeover_resume_point(meta, payload.as_deref(), offer) {
            Ok(frame) => frame,
            Err(why) => return self.drop_task(id, ReleaseReason::Refused(why)),
        };
        if !*raised {
            let expected = meta.epoch;
            task.writes += 1;
            task.stage = Stage::Raising;
            self.push(StoreOp::RaiseEpoch {
                id: id.to_owned(),
                expected,
            });
            return;
        }
        let meta = meta.clone();
        if meta.last_seq == 0 {
            // Nothing journaled: no answer so far to read.
            return self.adopt(id, meta, frame, None);
        }
        // The answer so far: what a lost adoption continues from on a
        // route that continues answers (R-CONT-1), and is charged by on
        // any (R-TEN-2: the text before the adoption, when the run is lost
        // without a usage report).
        #[cfg(feature = "planted-bugs")]
        if !task.continuable
            && crate::planted::in_thread(crate::planted::PlantedBug::EndedTextNotCharged)
        {
            return self.adopt(id, meta, frame, None);
        }
        task.stage = Stage::AdoptEvents { meta, frame };
        self.push(StoreOp::Events { id: id.to_owned() });
    }

    fn adopt(&mut self, id: &str, meta: RecordMeta, frame: u64, resumed: Option<ResumedAnswer>) {
        let Some(Task {
            kind: TaskKind::Adopt(offer),
            ..
        }) = self.tasks.remove(id)
        else {
            return;
        };
        self.outputs.push_back(CustodyOutput::Adopt {
            offer,
            meta,
            resume_after_frame: frame,
            resumed,
        });
    }

    fn raised(&mut self, now: Instant, id: &str, result: Result<RecordMeta, JournalError>) {
        let Some(task) = self.tasks.get_mut(id) else {
            return;
        };
        if task.stage != Stage::Raising {
            return;
        }
        match (&task.kind, result) {
            (TaskKind::Adopt(_), Ok(meta)) => {
                // R-JRN-3 won: read the last event again before adopting.
                let seq = meta.last_seq;
                task.stage = Stage::Last { meta, raised: true };
                self.read_last_event(id, seq);
            }
            // Another writer has the record.
            (TaskKind::Adopt(_), Err(_)) => self.drop_task(id, ReleaseReason::EpochLost),
            (TaskKind::Orphan, Ok(meta)) => {
                // Read its events either way: to continue it, or for what
                // its answer is charged when it ends here (R-TEN-2).
                task.stage = if task.continuable {
                    Stage::Events { meta }
                } else {
                    Stage::EndEvents { meta }
                };
                self.push(StoreOp::Events { id: id.to_owned() });
            }
            (TaskKind::Orphan, Err(e)) => self.refused(now, id, e),
        }
    }

    fn events_read(
        &mut self,
        now: Instant,
        id: &str,
        result: Result<Vec<JournalEvent>, JournalError>,
    ) {
        let Some(task) = self.tasks.get(id) else {
            return;
        };
        if let Stage::AdoptEvents { meta, frame } = &task.stage {
            let (meta, frame) = (meta.clone(), *frame);
            let events = match result {
                Ok(events) => events,
                // R-TEN-2, R-JRN-6: the answer so far is what a lost
                // adoption is charged by (and continued from): a store
                // that failed is read again (after a pause, raised again)
                // rather than the run adopted with nothing to charge.
                Err(e) if e.is_transient() => return self.refused(now, id, e),
                Err(_) => Vec::new(),
            };
            // Adopted either way; continued after a lost adoption only
            // from the whole answer so far.
            let resumed = resumed_answer(&events)
                .ok()
                .filter(|r| r.last_seq == meta.last_seq);
            return self.adopt(id, meta, frame, resumed);
        }
        let (meta, continued) = match &task.stage {
            Stage::Events { meta } => (meta.clone(), true),
            Stage::EndEvents { meta } => (meta.clone(), false),
            _ => return,
        };
        let events = match result {
            Ok(events) => events,
            Err(e) => return self.refused(now, id, e),
        };
        // R-TEN-2: what the answer is charged if it ends here (a record
        // left open: its request settled it).
        let charge = Some(journaled_use(&events))
            .filter(|u| *u != JournaledUse::default())
            .filter(|_| !task.left_open);
        #[cfg(feature = "planted-bugs")]
        let charge = charge.filter(|_| {
            continued || !crate::planted::in_thread(crate::planted::PlantedBug::EndedTextNotCharged)
        });
        // R-TAKE-1: an answer whose end is journaled (its writer died
        // before the record's terminal) ends as its journal says.
        let journaled = journaled_terminal(&events);
        #[cfg(feature = "planted-bugs")]
        let journaled = journaled
            .filter(|_| !crate::planted::in_thread(crate::planted::PlantedBug::IgnoreJournaledEnd));
        if let Some(terminal) = journaled {
            let not_continued = continued.then_some(NotContinuable::Ended);
            return self.finish_as(id, meta, not_continued, charge, Some(terminal));
        }
        if !continued {
            return self.finish(id, meta, None, charge);
        }
        match resumed_answer(&events) {
            // Only a journal read whole, up to the record's last event, is
            // continued: an answer the read missed would be sent twice.
            Ok(resumed) if resumed.last_seq == meta.last_seq => {
                self.tasks.remove(id);
                self.outputs
                    .push_back(CustodyOutput::Continue { meta, resumed });
            }
            Ok(_) => self.finish(id, meta, Some(NotContinuable::Unreadable), charge),
            Err(why) => self.finish(id, meta, Some(why), charge),
        }
    }

    /// End the raised orphan `id` (`meta` as raised) `incomplete` with its
    /// durable prefix; once its terminal is durable, charge `charge`
    /// (R-TEN-2).
    fn finish(
        &mut self,
        id: &str,
        meta: RecordMeta,
        not_continued: Option<NotContinuable>,
        charge: Option<JournaledUse>,
    ) {
        self.finish_as(id, meta, not_continued, charge, None);
    }

    /// [`Self::finish`] with `terminal` in place of `incomplete` when the
    /// journal already holds the answer's end.
    fn finish_as(
        &mut self,
        id: &str,
        meta: RecordMeta,
        not_continued: Option<NotContinuable>,
        charge: Option<JournaledUse>,
        terminal: Option<Terminal>,
    ) {
        let Some(task) = self.tasks.get_mut(id) else {
            return;
        };
        // The reason is the orphan's kind as first found: once raised,
        // the record's owner is this Edge.
        let (status, reason) = if task.left_open {
            (RecordStatus::Failed, JOURNAL_UNAVAILABLE_REASON)
        } else {
            (
                RecordStatus::Incomplete,
                task.orphan.unwrap_or(Orphan::EdgeRestart).reason(),
            )
        };
        task.writes += 1;
        let epoch = meta.epoch;
        task.stage = Stage::Finishing {
            reason,
            not_continued,
            meta,
            charge,
        };
        self.push(StoreOp::Finish {
            id: id.to_owned(),
            epoch,
            terminal: terminal.unwrap_or(Terminal {
                status,
                reason: Some(reason.to_owned()),
                message: None,
                at_unix_ms: 0,
            }),
        });
    }

    fn finished(&mut self, now: Instant, id: &str, result: Result<(), JournalError>) {
        let Some(task) = self.tasks.get(id) else {
            return;
        };
        let Stage::Finishing {
            reason,
            not_continued,
            ..
        } = task.stage
        else {
            return;
        };
        match result {
            Ok(()) => {
                // R-TEN-2: the terminal is this Edge's (the epoch it won):
                // its answer is charged here, once.
                if let Some(Task {
                    stage:
                        Stage::Finishing {
                            meta,
                            charge: Some(used),
                            ..
                        },
                    ..
                }) = self.tasks.remove(id)
                {
                    self.outputs.push_back(CustodyOutput::Charge { meta, used });
                }
                self.outputs
                    .push_back(CustodyOutput::Event(CustodyEvent::Ended {
                        id: id.to_owned(),
                        reason,
                        not_continued,
                    }));
            }
            Err(e) => self.refused(now, id, e),
        }
    }

    /// A takeover's write was refused: the one retry rule.
    fn refused(&mut self, now: Instant, id: &str, error: JournalError) {
        match error {
            // Ended, or gone, meanwhile: nothing to take over.
            JournalError::Terminated | JournalError::NotFound => {
                self.scan.forget(id);
                self.tasks.remove(id);
            }
            JournalError::Store(_) => self.pause(now, id, error),
            // Fenced (another writer won the epoch) or anything else: read
            // again and decide on what the store holds now.
            _ => {
                self.outputs
                    .push_back(CustodyOutput::Event(CustodyEvent::Retried {
                        id: id.to_owned(),
                        error,
                    }));
                self.read_again(now, id);
            }
        }
    }

    /// Read `id` again after [`STORE_RETRY`].
    fn pause(&mut self, now: Instant, id: &str, error: JournalError) {
        let Some(task) = self.tasks.get_mut(id) else {
            return;
        };
        task.stage = Stage::Pause {
            until: now.saturating_add(STORE_RETRY),
        };
        self.outputs
            .push_back(CustodyOutput::Event(CustodyEvent::Retried {
                id: id.to_owned(),
                error,
            }));
    }

    fn read_again(&mut self, now: Instant, id: &str) {
        let Some(task) = self.tasks.get_mut(id) else {
            return;
        };
        if task.writes >= MAX_TAKEOVER_WRITES {
            self.give_up(now, id);
            return;
        }
        task.stage = Stage::Reading;
        self.push(StoreOp::Record { id: id.to_owned() });
    }

    /// End the takeover of `id`, its writes used ([`Self::gave_up`]). A
    /// record left open starts again as one (a scan would take it for an
    /// orphan its request did not settle, R-TEN-2), tried for as long as
    /// the store refuses it (R-JRN-4).
    fn give_up(&mut self, now: Instant, id: &str) {
        let left_open = self.tasks.remove(id).is_some_and(|t| t.left_open);
        if left_open {
            self.outputs
                .push_back(CustodyOutput::Event(CustodyEvent::GaveUp {
                    id: id.to_owned(),
                }));
            self.left_open.insert(id.to_owned());
            return;
        }
        self.gave_up(now, id);
    }

    /// A takeover used its writes: the record is found again by a later
    /// scan (a sole store, whose scans stop once no orphan waits, is read
    /// whole again), and waits a new park window.
    fn gave_up(&mut self, now: Instant, id: &str) {
        self.outputs
            .push_back(CustodyOutput::Event(CustodyEvent::GaveUp {
                id: id.to_owned(),
            }));
        if self.cfg.sole {
            self.scanned = false;
        }
        let next = now.saturating_add(self.cfg.scan_interval.max(MIN_SCAN_PAUSE));
        self.next_scan = Some(self.next_scan.map_or(next, |at| at.min(next)));
    }

    /// Is `meta`'s owner another Edge not seen gone (R-MULTI-1)?
    fn owner_may_be_alive(&self, meta: &RecordMeta, now: Instant) -> bool {
        #[cfg(feature = "planted-bugs")]
        if crate::planted::in_thread(crate::planted::PlantedBug::AdoptWithoutOwnerWait) {
            return false;
        }
        !self.cfg.sole
            && meta.owner != self.cfg.edge_id
            && meta.owner != NO_OWNER
            && self.scan.leases().state(&meta.owner, now) != Some(LeaseState::Expired)
    }

    /// How long an adoption waits for `owner`'s lease to expire: its TTL
    /// and two scans, within the park window (the node keeps the run no
    /// longer).
    fn owner_wait(&self, owner: &str, now: Instant) -> Duration {
        let ttl = self
            .scan
            .leases()
            .peers(now)
            .into_iter()
            .find(|p| p.edge_id == owner)
            .and_then(|p| p.lease)
            .map_or(self.cfg.lease_ttl, |l| l.ttl());
        let wait = ttl + self.cfg.scan_interval.max(MIN_SCAN_PAUSE) * 2;
        wait.min(self.cfg.park_window)
    }

    /// Adoptions that wait for an owner's lease: go on once it expired
    /// (`read`: its lease was just read), let go once their wait is over.
    fn owners_checked(&mut self, now: Instant, read: bool) {
        let waiting: Vec<(String, bool, bool)> = self
            .tasks
            .iter()
            .filter_map(|(id, t)| match &t.stage {
                Stage::AwaitOwner { meta, until } => Some((
                    id.clone(),
                    read && !self.owner_may_be_alive(meta, now),
                    now >= *until,
                )),
                _ => None,
            })
            .collect();
        for (id, gone, over) in waiting {
            if gone {
                if let Some(Stage::AwaitOwner { meta, .. }) =
                    self.tasks.get(&id).map(|t| t.stage.clone())
                {
                    self.read_last(&id, meta);
                }
            } else if over {
                self.drop_task(&id, ReleaseReason::OwnerAlive);
            }
        }
    }

    /// An adoption reads the record's last event before its raise.
    fn read_last(&mut self, id: &str, meta: RecordMeta) {
        let Some(task) = self.tasks.get_mut(id) else {
            return;
        };
        let seq = meta.last_seq;
        task.stage = Stage::Last {
            meta,
            raised: false,
        };
        self.read_last_event(id, seq);
    }

    /// Read event `seq`, the last of record `id`, for [`Self::resume_from`];
    /// a record that holds none (`seq` 0) is decided at once.
    fn read_last_event(&mut self, id: &str, seq: u64) {
        if seq == 0 {
            return self.resume_from(id, None);
        }
        self.push(StoreOp::Event {
            id: id.to_owned(),
            seq,
        });
    }

    fn push(&mut self, op: StoreOp) {
        self.outputs.push_back(CustodyOutput::Store(op));
    }
}

#[cfg(test)]
mod tests;
