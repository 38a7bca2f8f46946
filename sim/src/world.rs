//! The simulated world: one Edge, its nodes, their providers and the
//! clients, driven by one seeded RNG over virtual time.
//!
//! ## The step
//!
//! Like quinn-proto's test `Pair`, the world never sleeps: each step moves
//! virtual time to the earliest of (a) every core machine's
//! `poll_timeout()` and (b) the next scheduled event (a network delivery, a
//! provider action, a client action, a fault), handles exactly that, drains
//! every output it caused (the driver loop of `iop_core`, steps 2 and 3),
//! and then checks every invariant ([`crate::invariants`]).
//!
//! ## The shells, in miniature
//!
//! * **Edge**: one [`DrivenDispatcher`], one core
//!   [`Request`](iop_core::edge::request::Request) machine per client
//!   request (the very machine `iop-edge`'s request driver drives), one
//!   core [`DrivenEdgeLink`] per node connection (the machine `iop-edge`'s
//!   node link task drives: registration and readiness through the
//!   dispatcher, the heartbeat, the frame budgets). The world only carries the
//!   request machine's traffic, as the driver and the hub do: its commands
//!   to the dispatcher (the pre-send fence after a short delay, so fences
//!   can slip in between), the dispatcher's news back, the run to the node,
//!   its events back, deliveries to the client. A CAPABILITIES round goes to every ready
//!   node at a fixed cadence (R-CAP-1). Two races of the shell are modelled:
//!   what a connection the Edge ended still had on its way reaches the
//!   dispatcher for [`LINK_DRAIN`], attributed to the fenced generation, and
//!   a request's pre-send reaches the dispatcher after its lease's fence.
//! * **Durable responses** (`world/durable.rs`): a seeded share of requests
//!   writes its record in the simulated journal store
//!   ([`crate::journal_store`], the Edge's disk); the world carries the
//!   request machine's journal writes and the store's answers, takes over
//!   at every Edge start what the dead incarnation left open (R-TAKE-1),
//!   crashes the Edge at the store's crash points, replays lost writes as
//!   zombies, and lets clients leave, resume and cancel.
//! * **Node**: per process a [`Backoff`] supervisor; per connection the
//!   core's connection machine [`DrivenNodeLink`] (the very machine
//!   `iop-node`'s link task drives: handshake, heartbeat, watchdog with its
//!   observation sequence, each run's one terminal); per run one provider
//!   call ([`CallPlan`]), whose handler writes the provider's own terminal
//!   when the machine lets it through and the watchdog's when the machine
//!   ends the run, and reports a call it dropped on the watchdog's cancel.
//!
//! ## Phases
//!
//! 1. *Faults* (the first two thirds of `steps`): faults fire as the seed's
//!    profile says.
//! 2. *Quiet* (the rest of `steps`): no new faults, partitions healed,
//!    frozen nodes going on, every provider call healthy; at its start `T_q` the liveness checks are
//!    scheduled at `T_q + B_node` and `T_q + B_eligible`.
//! 3. *Drain*: no new client requests; the world runs until every request
//!    ended and both liveness checks ran (at most [`MAX_DRAIN_STEPS`]).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use iop_core::Instant;
use iop_core::cred::ReplayCache;
use iop_core::edge::admission::{
    DispatchRequest, Lease, LeaseId, PreSend, ProviderSpec, RequestId,
};
use iop_core::edge::dispatch::{
    CapabilityVerdict, DispatchConfig, DispatchInput, DispatchOutput, IgnoredTerminal,
    ProbeAnswer as DispatchProbeAnswer, RequestCommand, RequestEvent, TerminalVerdict,
};
use iop_core::edge::gate::{AttemptEvent, AttemptFrame, GateBudget, GateEnd};
use iop_core::edge::link::{EdgeLinkConfig, EdgeLinkInput, EdgeLinkOutput};
use iop_core::edge::overlay::EvidenceOutcome;
use iop_core::edge::request::{
    AdoptSpec, Delivery, NodeFrame, OpenFailure, Request, RequestInput, RequestObservation,
    RequestOutput, RequestSpec,
};
use iop_core::ids::{Generation, NodeId, ProviderId, RunId};
use iop_core::liveness::backoff::{Backoff, BackoffConfig};
use iop_core::liveness::heartbeat::HeartbeatConfig;
use iop_core::node::link::{LinkEnd, NodeLinkConfig, NodeLinkInput, NodeLinkOutput};
use iop_core::node::provider::ProviderCallError;
use iop_core::node::watchdog::{ProviderEvent, ProviderOutcome, WatchdogConfig};
use iop_wire::{
    AdapterKind, CapabilitiesReport, CloseCode, Command, CommandKind, CommandResult,
    CommandResultBody, DataRequest, EdgeControl, ExecutionFailure, FailureCode, GenerationParams,
    NodeControl, PROTOCOL_VERSION, RegisterRequest, RunApi, RunEvent, RunEventKind, RunRequest,
    TargetHealth,
};
use serde::Serialize;

use crate::config::{PPM, Rng, SimConfig};
use crate::core_bugs::CoreBugs;
use crate::invariants::{Checker, ClientSaw, Violation, WatchdogTiming};
use crate::journal_store::{OpKind, OpResult, PendingWrite, SimJournal, Writer};
use crate::net::{
    ConnId, Dir, Envelope, NetFaults, Network, PartitionKind, Payload, SendOutcome, StreamKey,
};
use crate::provider::{CallPlan, Ending, ProbeAnswer};
use crate::record::{Capture, Recorder};
use crate::trace::{
    DispatchConfigRec, Driven, DrivenDispatcher, DrivenEdgeLink, DrivenNodeLink, EdgeLinkConfigRec,
    MachineKind, NodeLinkConfigRec, RequestBegin, RequestConfigRec,
};

mod custody;
mod durable;
mod node_run;
mod park;
mod tenants;

/// The most steps the drain phase may take before the run is declared
/// stuck.
pub const MAX_DRAIN_STEPS: u64 = 400_000;

/// The most steps in a row at one virtual instant (a timer that never
/// advances is a liveness bug).
pub const MAX_STEPS_AT_ONE_INSTANT: u64 = 20_000;

/// How long after the Edge ends a live connection the messages already on
/// their way still reach its dispatcher, attributed to the fenced
/// generation: the shell's link task hands frames it read before the close
/// to the hub after the hub fenced the generation (R-GEN-3).
pub const LINK_DRAIN: Duration = Duration::from_millis(50);

/// A deliberate fault in the simulated world outside the Edge's core
/// machines (the node's provider calls, the Edge's generation store), to
/// prove the invariants bite. Bugs of the request path live in the core
/// machines themselves (`iop_core::planted`, [`CoreBugs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Bug {
    /// Call the provider twice for one run.
    DoubleProviderCall,
    /// Restart the Edge without the persisted generation floor.
    ForgetGenerationFloor,
}

impl Bug {
    /// Every planted bug.
    pub const ALL: [Bug; 2] = [Bug::DoubleProviderCall, Bug::ForgetGenerationFloor];

    /// The name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Bug::DoubleProviderCall => "double-provider-call",
            Bug::ForgetGenerationFloor => "forget-generation-floor",
        }
    }

    /// Parse a command-line name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.as_str() == s)
    }
}

/// How to run one seed.
#[derive(Debug, Default)]
pub struct RunOptions {
    /// Steps of the fault and quiet phases (the drain comes on top).
    pub steps: u64,
    /// Keep the determinism hash.
    pub hash: bool,
    /// Write one machine's trace.
    pub capture: Option<Capture>,
    /// Planted driver bugs.
    pub bugs: BTreeSet<Bug>,
    /// Bugs planted in the core machines (`iop-core` feature
    /// `planted-bugs`).
    pub core_bugs: CoreBugs,
    /// Treat known core issues as violations.
    pub strict: bool,
    /// No durable requests, whatever the seed says: the world as it was
    /// before durable responses (for seeds found then).
    pub ephemeral_only: bool,
    /// Let the journal store fail syncs (I/O errors) while faults are on.
    pub store_faults: bool,
    /// No tenants, whatever the seed says: the world as it was before
    /// tenants' limits (for seeds found then).
    pub no_tenants: bool,
    /// Edges in the world (1..=[`MAX_EDGES`]; 0 counts as 1), sharing one
    /// store, every node connected to each (SPEC §8).
    pub edges: usize,
}

/// The most Edges one world runs.
pub const MAX_EDGES: usize = 4;

/// Counters of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Steps, drain included.
    pub steps: u64,
    /// Steps of the drain phase.
    pub drain_steps: u64,
    /// Virtual time at the end, microseconds.
    pub virtual_us: u64,
    /// Client requests accepted.
    pub requests: u64,
    /// Requests that finished normally.
    pub finished: u64,
    /// Requests that ended with an error terminal.
    pub failed: u64,
    /// Requests whose client left.
    pub client_left: u64,
    /// Requests lost with the Edge process.
    pub edge_lost: u64,
    /// Stall re-admissions.
    pub readmissions: u64,
    /// Stall terminals emitted by nodes.
    pub stalls: u64,
    /// Provider outputs fenced (R-WD-6).
    pub fenced_outputs: u64,
    /// Generations fenced at the Edge.
    pub fences: u64,
    /// Heartbeat timeouts (both sides).
    pub heartbeat_timeouts: u64,
    /// Node crashes.
    pub node_crashes: u64,
    /// Edge restarts.
    pub edge_restarts: u64,
    /// Ownership lease writes the store accepted (several Edges).
    pub lease_writes: u64,
    /// Ownership lease writes the store failed.
    pub lease_failures: u64,
    /// Records whose owner another Edge was, raised by a peer's custody
    /// (R-TAKE-1: taken over after the owner's lease expired).
    pub peer_takeovers: u64,
    /// Partitions started.
    pub partitions: u64,
    /// Connections killed by loss.
    pub conns_killed: u64,
    /// Messages lost (heartbeat loss, close frames into partitions).
    pub messages_lost: u64,
    /// Messages delayed by a retransmission.
    pub retransmits: u64,
    /// Provider freezes (correlated stalls).
    pub provider_freezes: u64,
    /// Node processes frozen (silent node loss: no close notice, nothing
    /// sent or acknowledged until it thaws, if ever before the faults stop).
    pub node_freezes: u64,
    /// Of those, the freezes that last until the faults stop.
    pub node_freezes_forever: u64,
    /// Connections to a frozen node the Edge's loss detection (its
    /// heartbeat) declared lost while the node was frozen (R-FAIL-2).
    pub freeze_losses: u64,
    /// Provider calls that answered HTTP 5xx before any content.
    pub provider_5xx: u64,
    /// Provider outages the Edge's health tracker detected from an HTTP
    /// 5xx run failure (R-FAIL-3: run evidence, `run_health`).
    pub outages_5xx: u64,
    /// Provider calls.
    pub provider_calls: u64,
    /// Overlay recoveries by CAPABILITIES.
    pub recoveries: u64,
    /// Overlay lowerings by fresh `unavailable` stall evidence.
    pub lowerings: u64,
    /// Stall evidence found stale (not strictly newer) by the overlay.
    pub stale_evidence: u64,
    /// Leases refused by the pre-send fence (R-GEN-4).
    pub pre_send_refenced: u64,
    /// Leases fenced before their run was sent (re-admitted).
    pub fenced_before_send: u64,
    /// Late terminals and CAPABILITIES answers of a fenced generation that
    /// reached the dispatcher (R-GEN-3: ignored and counted).
    pub late_fenced_messages: u64,
    /// Durable client requests accepted (their record created).
    pub durable_requests: u64,
    /// Journal writes applied by a sync (accepted or refused).
    pub journal_writes: u64,
    /// Syncs of the journal store.
    pub journal_syncs: u64,
    /// Writes that shared their sync with another write (group commit).
    pub journal_batched: u64,
    /// Edge crashes at a crash point of the journal store (during a sync).
    pub crash_points: u64,
    /// Edge crashes at the end's crash point: between the durable write of
    /// a record's end (its last journal event) and the write of its
    /// terminal (R-TAKE-1, R-JRN-3).
    pub end_crash_points: u64,
    /// Records whose journal held the answer's end without the record's
    /// terminal when their Edge died (at any crash: the state a takeover
    /// must end as the journal says).
    pub journaled_ends_open: u64,
    /// Of those, records a takeover's custody ended with the journaled
    /// end, never running them again (R-TAKE-1).
    pub journaled_ends_taken: u64,
    /// Records a request left without its terminal (the store refused
    /// it too often) and handed to its Edge's custody (R-JRN-4).
    pub records_left_open: u64,
    /// Durable requests refused while records left open waited for room
    /// in their Edge's custody (R-TEN-2).
    pub durable_backlog_refused: u64,
    /// Outages of the journal store (`--store-faults`): every operation
    /// fails until it ends.
    pub journal_outages: u64,
    /// Syncs that failed (store faults).
    pub sync_failures: u64,
    /// Writes lost by an Edge crash (never durable).
    pub journal_lost: u64,
    /// Writes made durable by a sync that completed just before an Edge
    /// crash, never acknowledged.
    pub journal_unacked: u64,
    /// Zombie writes (a dead owner's, late) that reached the store.
    pub zombies: u64,
    /// Zombies the store accepted (their epoch was still current).
    pub zombies_accepted: u64,
    /// Zombies the store refused as fenced (R-JRN-3).
    pub zombies_fenced: u64,
    /// Of those, the ones whose record was still open: only the epoch
    /// stood between them and the record (a takeover had raised it).
    pub zombies_fenced_open: u64,
    /// Records ended `incomplete` by a takeover (R-TAKE-1).
    pub takeovers: u64,
    /// Takeover writes tried again (on a fresh read) after losing the
    /// epoch to a zombie or a store failure.
    pub takeover_retries: u64,
    /// Takeovers that used their writes without winning (the record
    /// waits for the next Edge start).
    pub takeovers_given_up: u64,
    /// Orphans continued from their journal on their pool (R-TAKE-1,
    /// R-CONT-1) instead of ended.
    pub takeover_continued: u64,
    /// Attempts sent that continue an answer on another provider
    /// (R-CONT-1).
    pub continued_attempts: u64,
    /// Durable clients that left while their request went on.
    pub durable_left: u64,
    /// Durable requests fenced by the Edge that took their record over,
    /// whose client read on from the record (R-JRN-3, R-JRN-1).
    pub records_taken: u64,
    /// Durable responses cancelled by their client.
    pub durable_cancels: u64,
    /// Client resumes (`starting_after`).
    pub resumes: u64,
    /// Events resumed clients read from the store.
    pub resumed_events: u64,
    /// Requests durable clients sent again with their idempotency key,
    /// having lost their stream before any event (R-IDEM-1).
    pub idempotent_retries: u64,
    /// Of those, the ones answered with the response the key named.
    pub idempotent_existing: u64,
    /// Of those, the ones that ran afresh (the key's response had failed
    /// before any event).
    pub idempotent_fresh: u64,
    /// Durable runs parked by their node when their connection ended (R-PARK-1).
    pub runs_parked: u64,
    /// Provider reads a parked or attached durable run put off because its kept frames were at their bound (R-PARK-1).
    pub park_paused: u64,
    /// Parked runs whose grace ended without an adoption (R-PARK-1).
    pub park_expired: u64,
    /// Parked runs an Edge let go because their response ended or is gone
    /// (`CancelParked`, R-PARK-1).
    pub parked_released: u64,
    /// Durable runs (attached or parked) that died with their node's process.
    pub durable_runs_crashed: u64,
    /// Parked runs a node reported at registration and the dispatcher held (R-PARK-2).
    pub parked_reported: u64,
    /// Park waits ended at once because their node registered again without the run (R-PARK-2), not at the grace's end.
    pub parks_ended_not_kept: u64,
    /// Adoptions sent to a node (R-PARK-2).
    pub adoptions_sent: u64,
    /// Adoptions a node accepted: the run replayed after the resume point and went on live.
    pub node_adoptions: u64,
    /// Adoptions a node refused (the run attached, over, or without the frames asked for) or did not know.
    pub adoptions_refused: u64,
    /// Records taken over by adopting their parked run after an Edge restart (R-TAKE-1): the epoch raised, the run adopted.
    pub takeover_adoptions: u64,
    /// Parked runs offered that no request took (their held capacity let go).
    pub offers_released: u64,
    /// Adoptions whose record gained events between the offer's read and
    /// the raise (a dead owner's append): the resume point read after the
    /// raise is used.
    pub adoption_reads_moved: u64,
    /// Requests admitted by their tenant's limits (SPEC §9).
    pub tenant_admitted: u64,
    /// Requests their tenant's limits refused (429).
    pub tenant_refused: u64,
    /// Of them, refused by a limit per model (R-TEN-1).
    pub tenant_model_refused: u64,
    /// Further attempts reserved again (R-TEN-2).
    pub tenant_attempts_reserved: u64,
    /// Further attempts their tenant's limits refused (R-TEN-2).
    pub tenant_attempts_refused: u64,
    /// Further attempts told to ask again: a claim was on its way (R-TEN-3).
    pub tenant_attempts_waited: u64,
    /// Admitted requests settled or released.
    pub tenant_settled: u64,
    /// Takeovers' adoptions held to their record's key, their run
    /// reserved on credit (R-TEN-2).
    pub tenant_adoptions_held: u64,
    /// Takeovers' continuations held to their record's key (R-TEN-2).
    pub tenant_continuations_held: u64,
    /// Output tokens charged by estimate: no usage report covered them
    /// (R-TEN-2).
    pub tenant_unmetered_tokens: u64,
    /// Claims an Edge sent to the tenants' store (R-TEN-3).
    pub tenant_claims: u64,
    /// Tenants' store operations that failed or whose answer was lost.
    pub tenant_store_failures: u64,
    /// Times the tenants' store went down.
    pub tenant_store_outages: u64,
    /// Edge restarts that were graceful stops handing back what the
    /// process held (R-TEN-3).
    pub tenant_graceful_stops: u64,
    /// What their give-backs freed in the store, summed over meters.
    pub tenant_given_back: u64,
    /// Failed requests by failure kind (`GateFailure::as_str`).
    pub failures: BTreeMap<String, u64>,
}

impl Stats {
    /// Add another run's counters.
    pub fn add(&mut self, o: &Stats) {
        self.steps += o.steps;
        self.drain_steps += o.drain_steps;
        self.virtual_us += o.virtual_us;
        self.requests += o.requests;
        self.finished += o.finished;
        self.failed += o.failed;
        self.client_left += o.client_left;
        self.edge_lost += o.edge_lost;
        self.readmissions += o.readmissions;
        self.stalls += o.stalls;
        self.fenced_outputs += o.fenced_outputs;
        self.fences += o.fences;
        self.heartbeat_timeouts += o.heartbeat_timeouts;
        self.node_crashes += o.node_crashes;
        self.edge_restarts += o.edge_restarts;
        self.lease_writes += o.lease_writes;
        self.lease_failures += o.lease_failures;
        self.peer_takeovers += o.peer_takeovers;
        self.partitions += o.partitions;
        self.conns_killed += o.conns_killed;
        self.messages_lost += o.messages_lost;
        self.retransmits += o.retransmits;
        self.provider_freezes += o.provider_freezes;
        self.node_freezes += o.node_freezes;
        self.node_freezes_forever += o.node_freezes_forever;
        self.freeze_losses += o.freeze_losses;
        self.provider_5xx += o.provider_5xx;
        self.outages_5xx += o.outages_5xx;
        self.provider_calls += o.provider_calls;
        self.recoveries += o.recoveries;
        self.lowerings += o.lowerings;
        self.stale_evidence += o.stale_evidence;
        self.pre_send_refenced += o.pre_send_refenced;
        self.fenced_before_send += o.fenced_before_send;
        self.late_fenced_messages += o.late_fenced_messages;
        self.durable_requests += o.durable_requests;
        self.journal_writes += o.journal_writes;
        self.journal_syncs += o.journal_syncs;
        self.journal_batched += o.journal_batched;
        self.crash_points += o.crash_points;
        self.end_crash_points += o.end_crash_points;
        self.journaled_ends_open += o.journaled_ends_open;
        self.journaled_ends_taken += o.journaled_ends_taken;
        self.sync_failures += o.sync_failures;
        self.records_left_open += o.records_left_open;
        self.durable_backlog_refused += o.durable_backlog_refused;
        self.journal_outages += o.journal_outages;
        self.journal_lost += o.journal_lost;
        self.journal_unacked += o.journal_unacked;
        self.zombies += o.zombies;
        self.zombies_accepted += o.zombies_accepted;
        self.zombies_fenced += o.zombies_fenced;
        self.zombies_fenced_open += o.zombies_fenced_open;
        self.takeovers += o.takeovers;
        self.takeover_retries += o.takeover_retries;
        self.takeovers_given_up += o.takeovers_given_up;
        self.takeover_continued += o.takeover_continued;
        self.continued_attempts += o.continued_attempts;
        self.durable_left += o.durable_left;
        self.records_taken += o.records_taken;
        self.durable_cancels += o.durable_cancels;
        self.resumes += o.resumes;
        self.resumed_events += o.resumed_events;
        self.idempotent_retries += o.idempotent_retries;
        self.idempotent_existing += o.idempotent_existing;
        self.idempotent_fresh += o.idempotent_fresh;
        self.runs_parked += o.runs_parked;
        self.park_paused += o.park_paused;
        self.park_expired += o.park_expired;
        self.parked_released += o.parked_released;
        self.durable_runs_crashed += o.durable_runs_crashed;
        self.parked_reported += o.parked_reported;
        self.parks_ended_not_kept += o.parks_ended_not_kept;
        self.adoptions_sent += o.adoptions_sent;
        self.node_adoptions += o.node_adoptions;
        self.adoptions_refused += o.adoptions_refused;
        self.takeover_adoptions += o.takeover_adoptions;
        self.offers_released += o.offers_released;
        self.adoption_reads_moved += o.adoption_reads_moved;
        self.tenant_admitted += o.tenant_admitted;
        self.tenant_refused += o.tenant_refused;
        self.tenant_model_refused += o.tenant_model_refused;
        self.tenant_attempts_reserved += o.tenant_attempts_reserved;
        self.tenant_attempts_refused += o.tenant_attempts_refused;
        self.tenant_attempts_waited += o.tenant_attempts_waited;
        self.tenant_settled += o.tenant_settled;
        self.tenant_adoptions_held += o.tenant_adoptions_held;
        self.tenant_continuations_held += o.tenant_continuations_held;
        self.tenant_unmetered_tokens += o.tenant_unmetered_tokens;
        self.tenant_claims += o.tenant_claims;
        self.tenant_store_failures += o.tenant_store_failures;
        self.tenant_store_outages += o.tenant_store_outages;
        self.tenant_graceful_stops += o.tenant_graceful_stops;
        self.tenant_given_back += o.tenant_given_back;
        for (k, v) in &o.failures {
            *self.failures.entry(k.clone()).or_default() += v;
        }
    }
}

/// The result of one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunReport {
    /// The seed.
    pub seed: u64,
    /// The `--steps` it ran with.
    pub steps: u64,
    /// The planted driver bugs it ran with.
    pub bugs: BTreeSet<Bug>,
    /// The planted core bugs it ran with, by name.
    pub core_bugs: Vec<&'static str>,
    /// Whether known core issues counted as violations.
    pub strict: bool,
    /// Whether durable requests were switched off.
    pub ephemeral_only: bool,
    /// Whether the journal store failed syncs.
    pub store_faults: bool,
    /// Whether tenants were switched off.
    pub no_tenants: bool,
    /// Edges in the world.
    pub edges: usize,
    /// The first violation, if any.
    pub violation: Option<Violation>,
    /// Known core issues seen (see `invariants::KNOWN_CORE_ISSUES`).
    pub findings: Vec<Violation>,
    /// The determinism hash (hex) and lines hashed, if kept.
    pub trace_hash: Option<(String, u64)>,
    /// Counters.
    pub stats: Stats,
}

impl RunReport {
    /// The one command that reproduces this run, planted bugs included
    /// (a `--core-bug` needs the binary built with `--features
    /// planted-bugs`).
    pub fn repro_command(&self) -> String {
        let strict = if self.strict { " --strict" } else { "" };
        format!("{}{strict}", self.base_command())
    }

    /// The command that reproduces a finding as a violation.
    pub fn strict_repro_command(&self) -> String {
        format!("{} --strict", self.base_command())
    }

    fn base_command(&self) -> String {
        let bugs: String = self
            .bugs
            .iter()
            .map(|b| format!(" --bug {}", b.as_str()))
            .collect();
        let core: String = self
            .core_bugs
            .iter()
            .map(|n| format!(" --core-bug {n}"))
            .collect();
        let ephemeral = if self.ephemeral_only {
            " --ephemeral-only"
        } else {
            ""
        };
        let store = if self.store_faults {
            " --store-faults"
        } else {
            ""
        };
        let edges = if self.edges > 1 {
            format!(" --edges {}", self.edges)
        } else {
            String::new()
        };
        let tenants = if self.no_tenants { " --no-tenants" } else { "" };
        format!(
            "iop-sim run {} --steps {}{edges}{ephemeral}{store}{tenants}{bugs}{core}",
            self.seed, self.steps
        )
    }
}

/// Run one seed.
pub fn run(seed: u64, options: RunOptions) -> RunReport {
    let steps = options.steps;
    let bugs = options.bugs.clone();
    let core_bugs = options.core_bugs.names().to_vec();
    let strict = options.strict;
    let ephemeral_only = options.ephemeral_only;
    let store_faults = options.store_faults;
    let no_tenants = options.no_tenants;
    let edges = options.edges.clamp(1, MAX_EDGES);
    let mut cfg = SimConfig::from_seed(seed);
    if edges > 1 {
        // A dead Edge stays down long enough, at times, for its peers to
        // see its lease expire and take its records over (R-TAKE-1).
        cfg.faults.edge_down_max += Duration::from_millis(3 * iop_core::journal::MIN_LEASE_TTL_MS);
    }
    if ephemeral_only {
        cfg.journal.durable_ppm = 0;
    }
    if !store_faults {
        cfg.journal.sync_failure_ppm = 0;
        cfg.journal.outage_ppm = 0;
    }
    let mut world = World::new(cfg, options);
    let violation = world.run_to_end(steps).err();
    world.stats.steps = world.step;
    world.stats.virtual_us = world.now.as_micros();
    world.stats.conns_killed = world.net.killed;
    world.stats.messages_lost = world.net.lost;
    world.stats.retransmits = world.net.retransmitted;
    let journal = world.journal.stats();
    world.stats.journal_syncs = journal.syncs;
    world.stats.journal_batched = journal.batched_ops;
    RunReport {
        seed,
        steps,
        bugs,
        core_bugs,
        strict,
        ephemeral_only,
        store_faults,
        no_tenants,
        edges,
        violation,
        findings: world
            .checkers
            .iter()
            .flat_map(|c| c.findings().to_vec())
            .collect(),
        trace_hash: world.recorder.digest(),
        stats: std::mem::take(&mut world.stats),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Faults,
    Quiet,
    Drain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Edge,
    Node,
}

#[derive(Debug)]
enum Event {
    Deliver(Box<Envelope>),
    ConnLost {
        conn: ConnId,
        side: Side,
    },
    NodeDial {
        node: usize,
        /// The Edge slot it dials.
        edge: usize,
        process: u64,
    },
    DialDone {
        node: usize,
        edge: usize,
        process: u64,
        conn: Option<ConnId>,
    },
    NodeRestart {
        node: usize,
    },
    EdgeStart {
        slot: usize,
    },
    /// An Edge renews its ownership lease (R-TAKE-1, R-MULTI-1).
    LeaseRenew {
        incarnation: u64,
    },
    /// A run's provider call takes its next step.
    RunStep {
        node: usize,
        process: u64,
        run: u64,
    },
    /// A cancel reaches a run's provider.
    RunCancel {
        node: usize,
        process: u64,
        run: u64,
    },
    /// A canceled run's provider call returns.
    RunReturn {
        node: usize,
        process: u64,
        run: u64,
    },
    /// A parked run's grace may have ended (R-PARK-1).
    RunTimer {
        node: usize,
        process: u64,
        run: u64,
    },
    /// What the run's handler hears late: its connection machine's
    /// terminal, or the Edge's reset of its stream.
    RunHears {
        node: usize,
        process: u64,
        run: u64,
        input: Box<iop_core::node::run::NodeRunInput<RunEventKind>>,
    },
    ProbeDone {
        node: usize,
        process: u64,
        conn: ConnId,
        run_id: RunId,
        answer: ProbeAnswer,
    },
    CapsAnswer {
        node: usize,
        process: u64,
        conn: ConnId,
        command_id: u64,
    },
    CapsTick {
        incarnation: u64,
    },
    ClientArrival,
    ClientLeave {
        incarnation: u64,
        request_id: RequestId,
    },
    ToHub {
        incarnation: u64,
        command: RequestCommand,
    },
    FaultTick,
    CheckNodes,
    CheckEligible,
    /// The journal store's running sync of this writer generation ends.
    JournalSync {
        /// The Edge slot whose writer syncs.
        edge: usize,
        generation: u64,
    },
    /// The store's answer reaches its writer.
    JournalAnswer {
        writer: Writer,
        record: String,
        kind: OpKind,
        result: Box<OpResult>,
    },
    /// A dead owner's write reaches the store late.
    Zombie(Box<PendingWrite>),
    /// A durable client cancels its response.
    ClientCancel {
        incarnation: u64,
        request_id: RequestId,
    },
    /// A durable client resumes.
    ClientResume {
        record: String,
    },
    /// A resumed client leaves again.
    FollowerLeave {
        record: String,
        incarnation: u64,
    },
    /// Parked runs a node reported reach the Edge's adoption task
    /// (R-PARK-2).
    ParkedOffers {
        incarnation: u64,
        offers: Vec<iop_core::edge::dispatch::ParkedOffer>,
    },
    /// The runs a registering node keeps reach the Edge's durable
    /// requests (R-PARK-2).
    KeptRuns {
        incarnation: u64,
        kept: std::sync::Arc<iop_core::edge::dispatch::KeptRuns>,
    },
    /// The timeout of an Edge's custody (R-TAKE-1): its next scan, or a
    /// takeover that reads again (`at`: the timeout it was armed for).
    CustodyTimeout {
        incarnation: u64,
        at: Option<Instant>,
    },
    /// A frozen node process goes on (the freeze that began at `since`).
    NodeThaw {
        node: usize,
        since: Instant,
    },
    /// Tenants' store traffic (SPEC §9): a claim's hop, or its answer.
    Tenant(Box<tenants::TenantEvent>),
}

#[derive(Debug)]
struct EdgeRequest {
    /// The request machine the Edge's request driver drives.
    machine: Driven<Request>,
    /// The attempt's run, once sent: its connection and run id.
    running: Option<(ConnId, RunId)>,
    /// The request's last admission command (its R-SEL-1 hints), for the
    /// selection check.
    admitted_with: Option<DispatchRequest>,
    /// The record of a durable request.
    durable: Option<String>,
    /// Its client is still on the request's stream (a durable request goes
    /// on without it).
    client_attached: bool,
}

/// A node connection at the Edge: the core connection machine `iop-edge`'s
/// node link task drives (handshake through the dispatcher, heartbeat,
/// frame budgets), the generation the dispatcher gave it, its runs.
#[derive(Debug)]
struct EdgeConn {
    node: usize,
    link: DrivenEdgeLink,
    generation: Option<Generation>,
    /// Runs sent on this connection, to their request.
    runs: BTreeMap<RunId, RequestId>,
}

/// A connection the Edge ended while the network still carried it (see
/// [`LINK_DRAIN`]).
#[derive(Debug)]
struct FencedLink {
    node: usize,
    generation: Generation,
    until: Instant,
    /// The request and lease of each run that was running on it.
    leases: BTreeMap<RunId, (RequestId, LeaseId)>,
}

#[derive(Debug)]
struct EdgeProc {
    incarnation: u64,
    dispatcher: DrivenDispatcher,
    conns: BTreeMap<ConnId, EdgeConn>,
    by_generation: BTreeMap<(usize, Generation), ConnId>,
    requests: BTreeMap<RequestId, EdgeRequest>,
    next_request_id: RequestId,
    next_command_id: u64,
    commands: BTreeMap<u64, ConnId>,
    /// CAPABILITIES commands sent for a health probe the dispatcher asked
    /// for, by command id.
    probes: BTreeMap<u64, iop_core::edge::health::ProbeTicket>,
    /// Connections ended within [`LINK_DRAIN`].
    fenced_links: BTreeMap<ConnId, FencedLink>,
    /// Leases released by their generation's fence (a pre-send that
    /// arrives after the fence is checked against them).
    fenced_leases: BTreeMap<LeaseId, Lease>,
    /// Durable requests whose record is being created.
    pending_creates: BTreeMap<RequestId, durable::PendingCreate>,
    /// Records whose end a sync made durable at the end's crash point:
    /// the process dies once their terminal's write is in a sync, before
    /// it is durable (R-TAKE-1).
    end_crash_armed: BTreeSet<String>,
    /// Its custody of the records no request of it writes (R-TAKE-1,
    /// R-PARK-2, R-CONT-1).
    custody: custody::EdgeCustody,
    /// Its tenants' machine and the requests it admitted (SPEC §9).
    tenants: Option<tenants::EdgeTenants>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallStage {
    NotStarted,
    Emitting(u32),
    Idle,
}

#[derive(Debug)]
struct Call {
    /// The provider's index (from the run's target).
    provider: usize,
    plan: CallPlan,
    stage: CallStage,
    canceled: bool,
    returned: bool,
}

impl Call {
    /// The call's next output by its plan and when the one after it is
    /// due; `None` when nothing comes out (a stall, or it is idle).
    fn advance(&mut self) -> Option<(ProviderEvent, Option<Duration>)> {
        let plan = self.plan;
        match self.stage {
            CallStage::NotStarted => {
                if let Ending::Http5xx(status) = plan.ending {
                    // An error status before any content: no `Started`.
                    self.stage = CallStage::Idle;
                    self.returned = true;
                    return Some((
                        ProviderEvent::Returned(ProviderOutcome::Failed(http_5xx(status))),
                        None,
                    ));
                }
                self.stage = CallStage::Emitting(0);
                let next = (plan.ending != Ending::Hang).then_some(plan.prefill);
                if next.is_none() {
                    self.stage = CallStage::Idle;
                }
                Some((ProviderEvent::Neutral, next))
            }
            CallStage::Emitting(k) => {
                if matches!(plan.ending, Ending::StallAfter(s) if k >= s) {
                    self.stage = CallStage::Idle;
                    return None;
                }
                if k < plan.tokens {
                    self.stage = CallStage::Emitting(k + 1);
                    Some((
                        ProviderEvent::Progress(iop_core::node::watchdog::Progress::Content),
                        Some(plan.token_gap),
                    ))
                } else {
                    self.stage = CallStage::Idle;
                    self.returned = true;
                    let outcome = match plan.ending {
                        // As iop-node's adapters classify them (core's rule):
                        // an error inside the stream, a connection cut mid-answer.
                        Ending::Error => {
                            ProviderOutcome::Failed(ProviderCallError::Reported.failure())
                        }
                        Ending::Abrupt => {
                            ProviderOutcome::Failed(ProviderCallError::ConnectionBroke.failure())
                        }
                        Ending::Complete
                        | Ending::StallAfter(_)
                        | Ending::Hang
                        | Ending::Http5xx(_) => ProviderOutcome::Completed,
                    };
                    Some((ProviderEvent::Returned(outcome), None))
                }
            }
            CallStage::Idle => None,
        }
    }

    /// The token the call emitted last (1 for its first), for the text it
    /// carries: each token of one call is told apart, so output published
    /// twice is seen (R-PARK-2).
    fn token(&self) -> u32 {
        match self.stage {
            CallStage::Emitting(k) => k,
            _ => 0,
        }
    }
}

/// The failure `iop-node`'s HTTP adapters report for an error status,
/// classified by core's rule (`ProviderCallError::Status`): `provider_error`
/// with the status and its health class (`http_5xx`); the watchdog marks it
/// retryable by class (R-FAIL-1) and the Edge's health tracker takes it as
/// run evidence (`run_health`, R-FAIL-3).
fn http_5xx(status: u16) -> ExecutionFailure {
    ProviderCallError::Status { status }.failure()
}

/// Whether a provider event is the end of a call that answered HTTP 5xx.
fn is_http_5xx(event: &ProviderEvent) -> bool {
    matches!(
        event,
        ProviderEvent::Returned(ProviderOutcome::Failed(f))
            if f.http_status.is_some_and(|s| (500..=599).contains(&s))
    )
}

/// A node's connection: the core connection machine the node shell drives
/// (handshake, heartbeat, watchdog, each run's one terminal), and the
/// provider calls of its runs.
#[derive(Debug)]
struct NodeConn {
    conn: ConnId,
    link: DrivenNodeLink,
}

#[derive(Debug)]
enum Link {
    /// Waiting for the next dial.
    Idle,
    /// Dialing on `conn` (`None`: the dial will fail).
    Dialing,
    /// Connected.
    Connected(Box<NodeConn>),
}

/// A node process that stopped (silent node loss): what reached it
/// meanwhile waits, in order, until it goes on.
#[derive(Debug)]
struct Freeze {
    since: Instant,
    /// What reached the stopped process (deliveries, its provider calls'
    /// steps, its dials and timers' events), in the order it came.
    held: Vec<Event>,
}

#[derive(Debug)]
struct SimNode {
    id: NodeId,
    process: u64,
    up: bool,
    /// Frozen: the process is stopped (`SIGSTOP`, a power cut): it sends
    /// nothing, acknowledges nothing, its timers do not fire.
    frozen: Option<Freeze>,
    /// Per Edge slot: the dial backoff and the connection (R-MULTI-1).
    backoff: Vec<Backoff>,
    link: Vec<Link>,
    providers: Vec<usize>,
    /// Its runs, by serial (`iop-node`'s run tasks): a durable one
    /// (R-PARK-1), attached or parked, outlives its connection, not its
    /// process.
    runs: BTreeMap<u64, node_run::SimRun>,
    /// The next run's serial.
    next_run: u64,
}

/// Mixed into the seed for the end's crash point's own stream.
const END_CRASH_STREAM: u64 = 0xE4D0_C2A5_4000_0007;

/// The salt of [`World::outage_rng`].
const OUTAGE_STREAM: u64 = 0x0A7A_6E57_0000_0009;

/// One simulated world.
pub struct World {
    cfg: SimConfig,
    rng: Rng,
    /// The end's crash point's own stream (R-TAKE-1): its draws take
    /// nothing from `rng`, so a seed where it never fires runs as it did
    /// before it existed.
    end_crash_rng: Rng,
    /// The journal store's outages' own stream (`--store-faults`), as
    /// `end_crash_rng`.
    outage_rng: Rng,
    /// While faults are on and until then, the journal store fails every
    /// operation (an outage, R-JRN-6).
    journal_down_until: Instant,
    now: Instant,
    step: u64,
    phase: Phase,
    quiet_since: Option<Instant>,
    queue: BTreeMap<(Instant, u64), Event>,
    next_event: u64,
    net: Network,
    /// The Edge processes, by slot (`None`: down).
    edges: Vec<Option<EdgeProc>>,
    /// The Edge slot the event being handled happens at.
    cur: usize,
    /// The slot of each Edge incarnation (incarnations count across slots).
    incarnation_slots: Vec<usize>,
    edge_incarnations: u64,
    /// Each slot's persisted generation floor (its generation store).
    persisted_high_water: Vec<Generation>,
    /// Each slot's ownership lease revision as it last wrote it, `None`
    /// while down (R-TAKE-1).
    lease_revision: Vec<Option<u64>>,
    /// Since when each live slot's lease writes all succeeded (R-MULTI-1:
    /// a peer takes none of its records over while they do).
    lease_ok_since: Vec<Option<Instant>>,
    nodes: Vec<SimNode>,
    providers: Vec<ProviderSpec>,
    /// Each provider with its node (built once; the checks run every step).
    provider_nodes: Vec<(ProviderId, NodeId)>,
    /// The invariant checker of each Edge slot; slot 0's also checks the
    /// shared store and the durable clients.
    checkers: Vec<Checker>,
    recorder: Recorder,
    bugs: BTreeSet<Bug>,
    core_bugs: CoreBugs,
    stats: Stats,
    checks_pending: u32,
    steps_at_instant: u64,
    /// Per provider: frozen until this moment (a correlated stall).
    frozen_until: Vec<Instant>,
    /// The journal store of durable responses (the Edge's disk: it
    /// survives Edge restarts).
    journal: SimJournal,
    /// The clients of durable responses, by record.
    durable_clients: BTreeMap<String, durable::DurableClient>,
    /// Records their request left open (a known core issue, reported as a
    /// finding): the drain does not wait for them.
    orphans: BTreeSet<String>,
    /// The record of each durable run sent and not yet started on its
    /// node, by connection and run id, and whether the attempt continues
    /// the answer so far (R-CONT-1): the provider-once check of R-PARK-2
    /// counts provider calls per response.
    run_records: BTreeMap<(ConnId, RunId), (String, bool)>,
    /// The route of every durable request's record (configuration: it
    /// outlives the Edge process).
    routes: BTreeMap<String, custody::Route>,
    /// Tenants and the shared store of their counters (SPEC §9); `None`:
    /// requests are held to no tenant's limits.
    tenancy: Option<tenants::SimTenancy>,
}

impl Drop for World {
    fn drop(&mut self) {
        // Bugs planted for the thread live as long as the world.
        self.core_bugs.clear_thread();
    }
}

fn provider_id(i: usize) -> ProviderId {
    ProviderId::new(format!("p{i}"))
}

fn node_id(i: usize) -> NodeId {
    NodeId::new(format!("n{i}"))
}

fn target(i: usize) -> String {
    format!("t{i}")
}

impl World {
    /// Build the world of `cfg`.
    pub fn new(cfg: SimConfig, options: RunOptions) -> Self {
        let providers: Vec<ProviderSpec> = (0..cfg.providers())
            .map(|i| ProviderSpec {
                id: provider_id(i),
                node: node_id(i / cfg.providers_per_node),
                adapter: AdapterKind::Mock,
                target: target(i),
                capacity: cfg.capacity[i],
                stall_timeout_ms: cfg.stall_timeout_ms[i],
            })
            .collect();
        let edges = options.edges.clamp(1, MAX_EDGES);
        let nodes = (0..cfg.nodes)
            .map(|n| SimNode {
                id: node_id(n),
                process: 0,
                up: true,
                frozen: None,
                backoff: (0..edges)
                    .map(|_| {
                        Backoff::new(BackoffConfig {
                            initial: cfg.backoff_initial,
                            max: cfg.backoff_max,
                        })
                    })
                    .collect(),
                link: (0..edges).map(|_| Link::Idle).collect(),
                providers: (0..cfg.providers_per_node)
                    .map(|k| n * cfg.providers_per_node + k)
                    .collect(),
                runs: BTreeMap::new(),
                next_run: 0,
            })
            .collect();
        let checkers = (0..edges)
            .map(|_| {
                let mut checker = Checker::new(WatchdogTiming {
                    close_grace: cfg.close_grace,
                    probe_bound: cfg.probe_bound,
                });
                checker.set_strict(options.strict);
                checker
            })
            .collect();
        options.core_bugs.plant_thread();
        let mut world = Self {
            rng: Rng::new(cfg.seed),
            end_crash_rng: Rng::new(cfg.seed ^ END_CRASH_STREAM),
            outage_rng: Rng::new(cfg.seed ^ OUTAGE_STREAM),
            journal_down_until: Instant::ZERO,
            now: Instant::ZERO,
            step: 0,
            phase: Phase::Faults,
            quiet_since: None,
            queue: BTreeMap::new(),
            next_event: 0,
            net: Network::new(&cfg),
            edges: (0..edges).map(|_| None).collect(),
            cur: 0,
            incarnation_slots: Vec::new(),
            edge_incarnations: 0,
            persisted_high_water: vec![0; edges],
            lease_revision: vec![None; edges],
            lease_ok_since: vec![None; edges],
            nodes,
            provider_nodes: providers
                .iter()
                .map(|p| (p.id.clone(), p.node.clone()))
                .collect(),
            providers,
            checkers,
            recorder: Recorder::new(options.hash, options.capture),
            bugs: options.bugs,
            core_bugs: options.core_bugs,
            stats: Stats::default(),
            checks_pending: 2,
            steps_at_instant: 0,
            frozen_until: vec![Instant::ZERO; cfg.providers()],
            journal: SimJournal::new(iop_core::journal::JournalLimits::default(), edges),
            durable_clients: BTreeMap::new(),
            orphans: BTreeSet::new(),
            run_records: BTreeMap::new(),
            routes: BTreeMap::new(),
            tenancy: cfg
                .tenants
                .clone()
                .filter(|_| !options.no_tenants)
                .map(|profile| tenants::SimTenancy::new(profile, cfg.seed)),
            cfg,
        };
        // A custody write the store failed is read again after
        // `STORE_RETRY` and written again: a failed terminal also raises
        // again first (two round trips).
        world.checkers[0].set_journal_retry_allowance(
            iop_core::edge::custody::STORE_RETRY + world.cfg.journal.round_trip_max() * 2,
        );
        let loss_bound = world.cfg.heartbeat_interval + world.cfg.heartbeat_wait;
        for checker in &mut world.checkers {
            checker.set_loss_bound(loss_bound);
        }
        world.set_net_faults();
        for slot in 0..edges {
            world.start_edge(slot);
        }
        // R-MULTI-1: every node dials every Edge.
        for n in 0..world.nodes.len() {
            for edge in 0..edges {
                world.schedule(
                    Instant::ZERO,
                    Event::NodeDial {
                        node: n,
                        edge,
                        process: 0,
                    },
                );
            }
        }
        world.schedule(Instant::ZERO, Event::ClientArrival);
        world.schedule(Instant::ZERO + world.cfg.fault_tick, Event::FaultTick);
        world
    }

    fn faults_on(&self) -> bool {
        self.phase == Phase::Faults
    }

    /// When a custody works on the journal again: now, or past the
    /// outage the store is in, its next scan (a shared store's are a third
    /// of a lease TTL apart, a sole store's 1 s) and the pause of a
    /// takeover whose read failed.
    fn journal_up_at(&self) -> Instant {
        if self.journal_down() {
            self.journal_down_until + Duration::from_secs(1) + iop_core::edge::custody::STORE_RETRY
        } else {
            self.now
        }
    }

    /// Whether the journal store is in an outage now: it fails every
    /// operation (store faults only).
    fn journal_down(&self) -> bool {
        self.faults_on() && self.now < self.journal_down_until
    }

    fn set_net_faults(&mut self) {
        let faults = if self.faults_on() {
            NetFaults {
                conn_kill_ppm: self.cfg.faults.conn_kill_ppm,
                heartbeat_loss_ppm: self.cfg.faults.heartbeat_loss_ppm,
                retransmit_ppm: self.cfg.faults.retransmit_ppm,
                retransmit_max: self.cfg.faults.retransmit_max,
            }
        } else {
            NetFaults::default()
        };
        self.net.set_faults(faults);
    }

    fn schedule(&mut self, at: Instant, event: Event) {
        let at = at.max(self.now);
        self.queue.insert((at, self.next_event), event);
        self.next_event += 1;
    }

    fn violation(&self) -> Option<Violation> {
        self.checkers.iter().find_map(|c| c.violation().cloned())
    }

    /// Requests open at every Edge.
    fn open_requests(&self) -> usize {
        self.checkers.iter().map(Checker::open_requests).sum()
    }

    /// Tell every checker the step and the time.
    fn checkers_at(&mut self) {
        for c in &mut self.checkers {
            c.at(self.step, self.now);
        }
    }

    /// Run the fault and quiet phases for `steps` steps, then drain.
    fn run_to_end(&mut self, steps: u64) -> Result<(), Violation> {
        let quiet_at = steps * 2 / 3;
        while self.step < steps {
            if self.step == quiet_at && self.phase == Phase::Faults {
                self.stop_faults();
            }
            self.step_once()?;
        }
        if self.phase == Phase::Faults {
            self.stop_faults();
        }
        self.phase = Phase::Drain;
        let drain_start = self.step;
        while !self.settled() {
            if self.step - drain_start > MAX_DRAIN_STEPS {
                self.checkers_at();
                let open = self.open_requests();
                // What still keeps the world from settling.
                let why = format!(
                    "{open} requests open, {} checks pending, {} Edges down, journal busy: {}, \
                     records open beyond orphans: {}, a follower waiting: {:?}",
                    self.checks_pending,
                    self.edges.iter().filter(|e| e.is_none()).count(),
                    self.journal.is_busy(),
                    !self.only_orphans_open(),
                    self.waiting_follower(),
                );
                self.checkers[self.cur].fail(
                    "liveness-drain",
                    format!(
                        "the world did not settle within {MAX_DRAIN_STEPS} drain steps ({why})"
                    ),
                );
                return Err(self.violation().unwrap_or_else(unreachable_violation));
            }
            if !self.step_once()? {
                self.checkers[self.cur].fail(
                    "liveness-drain",
                    "nothing left to do but the world has not settled",
                );
                break;
            }
        }
        self.stats.drain_steps = self.step - drain_start;
        let open = self.tenant_open_tickets();
        if open > 0 {
            self.checkers[self.cur].fail(
                "R-TEN-2",
                format!("{open} admitted requests were never settled or released"),
            );
        }
        match self.violation() {
            Some(v) => Err(v),
            None => Ok(()),
        }
    }

    fn settled(&self) -> bool {
        self.checks_pending == 0
            && self.open_requests() == 0
            && self.edges.iter().all(Option::is_some)
            && !self.journal.is_busy()
            && self.only_orphans_open()
            && self.followers_done()
    }

    fn stop_faults(&mut self) {
        self.phase = Phase::Quiet;
        self.quiet_since = Some(self.now);
        self.net.heal(self.now);
        self.set_net_faults();
        self.tenant_stop_faults();
        let now = self.now;
        self.frozen_until
            .iter_mut()
            .for_each(|t| *t = (*t).min(now));
        // Frozen node processes go on.
        for node in 0..self.nodes.len() {
            if let Some(since) = self.nodes[node].frozen.as_ref().map(|f| f.since) {
                self.schedule(now, Event::NodeThaw { node, since });
            }
        }
        let node_check = self.now + self.cfg.node_recovery_bound();
        let eligible_check = self.now + self.cfg.eligibility_bound();
        self.schedule(node_check, Event::CheckNodes);
        self.schedule(eligible_check, Event::CheckEligible);
    }

    fn earliest_timer(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut consider = |x: Option<Instant>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        for edge in self.edges.iter().flatten() {
            consider(edge.dispatcher.poll_timeout());
            for r in edge.requests.values() {
                consider(r.machine.poll_timeout());
            }
            for c in edge.conns.values() {
                consider(c.link.poll_timeout());
            }
        }
        for n in self.nodes.iter().filter(|n| n.frozen.is_none()) {
            for link in &n.link {
                if let Link::Connected(nc) = link {
                    consider(nc.link.poll_timeout());
                }
            }
        }
        t
    }

    /// One step. Returns `false` when nothing is left to do.
    fn step_once(&mut self) -> Result<bool, Violation> {
        let timer = self.earliest_timer();
        let event_at = self.queue.keys().next().map(|(t, _)| *t);
        let before = self.now;
        match (timer, event_at) {
            (None, None) => return Ok(false),
            (Some(t), e) if e.is_none_or(|e| t <= e) => {
                self.now = t.max(self.now);
                self.checkers_at();
                self.fire_timers();
            }
            _ => {
                let Some(((t, _), event)) = self.queue.pop_first() else {
                    return Ok(false);
                };
                self.now = t.max(self.now);
                self.checkers_at();
                self.handle_event(event);
            }
        }
        // The tenants' timers (leases on concurrency slots), as the
        // shell's periodic tick runs them.
        self.tenant_timers();
        self.step += 1;
        if self.now == before {
            self.steps_at_instant += 1;
            if self.steps_at_instant > MAX_STEPS_AT_ONE_INSTANT {
                self.checkers[self.cur].fail(
                    "liveness-time",
                    format!("{MAX_STEPS_AT_ONE_INSTANT} steps without time advancing"),
                );
            }
        } else {
            self.steps_at_instant = 0;
        }
        self.check_step();
        match self.violation() {
            Some(v) => Err(v),
            None => Ok(true),
        }
    }

    fn check_step(&mut self) {
        for (slot, edge) in self.edges.iter().enumerate() {
            let Some(edge) = edge else {
                continue;
            };
            let checker = &mut self.checkers[slot];
            checker.check_edge(edge.dispatcher.machine(), &self.provider_nodes);
            checker.check_links(edge.dispatcher.machine(), &self.provider_nodes);
        }
        for checker in &mut self.checkers {
            checker.check_deadlines();
        }
        self.check_raises();
        self.check_tenants();
        self.checkers[0].check_journal(&mut self.journal);
    }

    /// R-MULTI-1: an Edge raises (takes over) a record another Edge owns
    /// only once that Edge's lease could be seen expired: never while the
    /// owner lives and every one of its lease writes in the last two TTLs
    /// and two scans succeeded (its lease changed at least every third of
    /// a TTL, so no view can have seen it unchanged for a TTL). A dead
    /// writer's late raise (a zombie) decided nothing now and is not held
    /// to it.
    fn check_raises(&mut self) {
        if self.edges.len() == 1 {
            self.journal.take_raises();
            return;
        }
        let ttl = Duration::from_millis(iop_core::journal::MIN_LEASE_TTL_MS);
        let settled = ttl * 2 + Duration::from_secs(2);
        for raise in self.journal.take_raises() {
            if raise.from == raise.to || raise.zombie {
                continue;
            }
            self.stats.peer_takeovers += 1;
            let Some(owner) = self.slot_of_edge_id(&raise.from) else {
                continue;
            };
            let renewing_since = self.lease_ok_since[owner].filter(|_| self.edges[owner].is_some());
            if let Some(since) = renewing_since
                && self.now.saturating_duration_since(since) >= settled
            {
                let detail = format!(
                    "{} raised {} of {}, alive and renewing its lease without a miss for {}ms",
                    raise.to,
                    raise.id,
                    raise.from,
                    self.now.saturating_duration_since(since).as_millis()
                );
                self.checkers[0].fail("R-MULTI-1", detail);
            }
        }
    }

    fn fire_timers(&mut self) {
        for slot in 0..self.edges.len() {
            self.cur = slot;
            self.fire_timers_at();
        }
    }

    /// The timers due at the current Edge slot and its nodes' links to it.
    fn fire_timers_at(&mut self) {
        let now = self.now;
        if let Some(edge) = &mut self.edges[self.cur]
            && edge.dispatcher.fire_due(now)
        {
            self.drain_dispatch();
        }
        let requests: Vec<RequestId> = self.edges[self.cur].as_ref().map_or_else(Vec::new, |e| {
            e.requests
                .iter()
                .filter(|(_, r)| r.machine.is_due(now))
                .map(|(id, _)| *id)
                .collect()
        });
        for rid in requests {
            if let Some(r) = self.edges[self.cur]
                .as_mut()
                .and_then(|e| e.requests.get_mut(&rid))
            {
                r.machine.fire_due(now);
                self.drive_request(rid);
            }
        }
        let conns: Vec<ConnId> = self.edges[self.cur].as_ref().map_or_else(Vec::new, |e| {
            e.conns
                .iter()
                .filter(|(_, c)| c.link.is_due(now))
                .map(|(id, _)| *id)
                .collect()
        });
        for conn in conns {
            if let Some(c) = self.edges[self.cur]
                .as_mut()
                .and_then(|e| e.conns.get_mut(&conn))
            {
                c.link.fire_due(now);
                self.drain_edge_link(conn, false);
            }
        }
        for n in 0..self.nodes.len() {
            if self.nodes[n].frozen.is_some() {
                continue;
            }
            if let Link::Connected(nc) = &mut self.nodes[n].link[self.cur]
                && nc.link.fire_due(now)
            {
                self.drain_node_link(n);
            }
        }
    }

    fn handle_event(&mut self, event: Event) {
        if let Some(node) = self.event_node(&event)
            && let Some(freeze) = &mut self.nodes[node].frozen
        {
            // The process is stopped: it waits.
            freeze.held.push(event);
            return;
        }
        self.cur = self.event_slot(&event).unwrap_or(0);
        match event {
            Event::Deliver(env) => self.deliver(*env),
            Event::ConnLost { conn, side } => match side {
                Side::Edge => {
                    self.edge_link_lost(conn, CloseCode::Normal);
                }
                Side::Node => {
                    if let Some(n) = self.node_with_conn(conn) {
                        self.node_conn_ended(n, CloseCode::Normal);
                    }
                }
            },
            Event::NodeDial { node, process, .. } => self.node_dial(node, process),
            Event::DialDone {
                node,
                process,
                conn,
                ..
            } => self.node_dial_done(node, process, conn),
            Event::NodeRestart { node } => {
                let n = &mut self.nodes[node];
                n.up = true;
                for backoff in &mut n.backoff {
                    *backoff = Backoff::new(BackoffConfig {
                        initial: self.cfg.backoff_initial,
                        max: self.cfg.backoff_max,
                    });
                }
                n.link.iter_mut().for_each(|l| *l = Link::Idle);
                let process = n.process;
                for edge in 0..self.edges.len() {
                    self.schedule(
                        self.now,
                        Event::NodeDial {
                            node,
                            edge,
                            process,
                        },
                    );
                }
            }
            Event::EdgeStart { slot } => self.start_edge(slot),
            Event::LeaseRenew { incarnation } => self.renew_lease(incarnation),
            Event::RunStep { node, process, run } => self.run_step(node, process, run),
            Event::RunCancel { node, process, run } => self.run_cancel(node, process, run),
            Event::RunReturn { node, process, run } => self.run_return(node, process, run),
            Event::RunTimer { node, process, run } => self.run_timer(node, process, run),
            Event::RunHears {
                node,
                process,
                run,
                input,
            } => self.run_hears(node, process, run, *input),
            Event::ProbeDone {
                node,
                process,
                conn,
                run_id,
                answer,
            } => self.probe_done(node, process, conn, run_id, answer),
            Event::CapsAnswer {
                node,
                process,
                conn,
                command_id,
            } => self.caps_answer(node, process, conn, command_id),
            Event::CapsTick { incarnation } => self.caps_tick(incarnation),
            Event::ClientArrival => self.client_arrival(),
            Event::ClientLeave {
                incarnation,
                request_id,
            } => self.client_leave(incarnation, request_id),
            Event::ToHub {
                incarnation,
                command,
            } => self.command_at_hub(incarnation, command),
            Event::FaultTick => self.fault_tick(),
            Event::CheckNodes => self.check_nodes(),
            Event::CheckEligible => self.check_eligible(),
            Event::JournalSync { generation, .. } => self.journal_sync_done(generation),
            Event::JournalAnswer {
                writer,
                record,
                kind,
                result,
            } => self.journal_answer(writer, record, kind, *result),
            Event::Zombie(write) => self.journal_zombie(*write),
            Event::ClientCancel {
                incarnation,
                request_id,
            } => self.client_cancel(incarnation, request_id),
            Event::ClientResume { record } => self.client_resume(record),
            Event::FollowerLeave {
                record,
                incarnation,
            } => self.follower_leave(record, incarnation),
            Event::ParkedOffers {
                incarnation,
                offers,
            } => self.parked_offers(incarnation, offers),
            Event::KeptRuns { incarnation, kept } => self.kept_runs(incarnation, &kept),
            Event::CustodyTimeout { incarnation, at } => self.custody_wake(incarnation, at),
            Event::NodeThaw { node, since } => self.thaw_node(node, since),
            Event::Tenant(event) => self.tenant_event(*event),
        }
    }

    /// The Edge slot of incarnation `incarnation`.
    fn slot_of(&self, incarnation: u64) -> Option<usize> {
        usize::try_from(incarnation)
            .ok()
            .and_then(|i| self.incarnation_slots.get(i).copied())
    }

    /// The Edge slot a connection belongs to.
    fn slot_of_conn(&self, conn: ConnId) -> Option<usize> {
        self.slot_of(self.net.edge_incarnation_of(conn)?)
    }

    /// The Edge slot an event happens at (or concerns), if one.
    fn event_slot(&self, event: &Event) -> Option<usize> {
        match event {
            Event::Deliver(env) => self.slot_of_conn(env.conn),
            Event::ConnLost { conn, .. }
            | Event::ProbeDone { conn, .. }
            | Event::CapsAnswer { conn, .. } => self.slot_of_conn(*conn),
            Event::NodeDial { edge, .. }
            | Event::DialDone { edge, .. }
            | Event::JournalSync { edge, .. } => Some(*edge),
            Event::EdgeStart { slot } => Some(*slot),
            Event::CapsTick { incarnation }
            | Event::ClientLeave { incarnation, .. }
            | Event::ToHub { incarnation, .. }
            | Event::ClientCancel { incarnation, .. }
            | Event::FollowerLeave { incarnation, .. }
            | Event::ParkedOffers { incarnation, .. }
            | Event::KeptRuns { incarnation, .. }
            | Event::CustodyTimeout { incarnation, .. }
            | Event::LeaseRenew { incarnation } => self.slot_of(*incarnation),
            Event::JournalAnswer { writer, .. } => self.slot_of(writer.incarnation()),
            Event::Tenant(event) => self.slot_of(event.incarnation()),
            Event::RunStep { node, run, .. }
            | Event::RunCancel { node, run, .. }
            | Event::RunReturn { node, run, .. }
            | Event::RunTimer { node, run, .. }
            | Event::RunHears { node, run, .. } => {
                let conn = self.nodes[*node].runs.get(run)?.conn()?;
                self.slot_of_conn(conn)
            }
            Event::NodeRestart { .. }
            | Event::ClientArrival
            | Event::FaultTick
            | Event::CheckNodes
            | Event::CheckEligible
            | Event::Zombie(_)
            | Event::ClientResume { .. }
            | Event::NodeThaw { .. } => None,
        }
    }

    /// The node process an event happens in, if it happens in one (a
    /// frozen process holds it until it goes on).
    fn event_node(&self, event: &Event) -> Option<usize> {
        match event {
            Event::Deliver(env) if env.dir == Dir::EdgeToNode => self.net.node_of(env.conn),
            Event::ConnLost {
                conn,
                side: Side::Node,
            } => self.net.node_of(*conn),
            Event::NodeDial { node, .. }
            | Event::DialDone { node, .. }
            | Event::RunStep { node, .. }
            | Event::RunCancel { node, .. }
            | Event::RunReturn { node, .. }
            | Event::RunTimer { node, .. }
            | Event::RunHears { node, .. }
            | Event::ProbeDone { node, .. }
            | Event::CapsAnswer { node, .. } => Some(*node),
            _ => None,
        }
    }

    // ---- Network -------------------------------------------------------------

    fn transmit(&mut self, conn: ConnId, dir: Dir, stream: StreamKey, payload: Payload) {
        match self
            .net
            .send(&mut self.rng, self.now, conn, dir, stream, &payload)
        {
            SendOutcome::Deliver(at) => self.schedule(
                at,
                Event::Deliver(Box::new(Envelope {
                    conn,
                    dir,
                    stream,
                    payload,
                })),
            ),
            SendOutcome::Lost | SendOutcome::Dead => {}
            SendOutcome::Killed => self.conn_killed(conn),
        }
    }

    /// The network killed `conn`: each side is told after a short delay, or
    /// finds out through its heartbeat.
    fn conn_killed(&mut self, conn: ConnId) {
        let Some(node) = self.net.node_of(conn) else {
            return;
        };
        for side in [Side::Edge, Side::Node] {
            if self.rng.chance(self.cfg.faults.close_notice_ppm) {
                let delay = self.net.delay(&mut self.rng, node) * 2;
                self.schedule(self.now + delay, Event::ConnLost { conn, side });
            }
        }
    }

    fn deliver(&mut self, env: Envelope) {
        let is_close = matches!(env.payload, Payload::Close(_));
        if !is_close && !self.net.is_alive(env.conn) {
            if env.dir == Dir::NodeToEdge {
                self.edge_late_message(env.conn, env.payload);
            }
            return;
        }
        match env.dir {
            Dir::NodeToEdge => self.edge_receive(env.conn, env.stream, env.payload),
            Dir::EdgeToNode => {
                if let Some(n) = self.node_with_conn(env.conn) {
                    self.node_receive(n, env.stream, env.payload);
                }
            }
        }
    }

    fn node_with_conn(&self, conn: ConnId) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.link
                .iter()
                .any(|l| matches!(l, Link::Connected(nc) if nc.conn == conn))
                && n.up
        })
    }

    // ---- Edge: process and connections ----------------------------------------

    fn start_edge(&mut self, slot: usize) {
        self.cur = slot;
        let incarnation = self.edge_incarnations;
        self.edge_incarnations += 1;
        self.incarnation_slots.push(slot);
        let floor = if self.bugs.contains(&Bug::ForgetGenerationFloor) {
            0
        } else {
            self.persisted_high_water[slot]
        };
        let config = DispatchConfig {
            admission: iop_core::edge::admission::AdmissionConfig {
                queue_capacity: self.cfg.queue_capacity,
                queue_timeout: self.cfg.queue_timeout,
            },
            providers: self.providers.clone(),
            generation_floor: floor,
            generation_mark: None,
            known_nodes: None,
            health: self.cfg.health,
            capacity_from_node: Default::default(),
            // A reported run's capacity is held for the park window.
            parked_hold_ms: duration_ms(self.cfg.park_window()),
        };
        let rec = DispatchConfigRec::new(&config, self.now);
        let tap = self.recorder.tap(MachineKind::EdgeDispatch, &rec);
        let dispatcher = match DrivenDispatcher::new_dispatcher(self.now, config, tap) {
            Ok(d) => d,
            Err(e) => panic!("sim health config is invalid: {e}"),
        };
        self.core_bugs.plant_dispatcher(dispatcher.machine());
        let tenants = self.new_edge_tenants();
        let custody = custody::EdgeCustody::new(
            self.now,
            &self.edge_id(slot),
            self.cfg.park_window(),
            self.edges.len() == 1,
            self.cfg.journal.custody_tasks,
            &mut self.recorder,
        );
        self.edges[self.cur] = Some(EdgeProc {
            incarnation,
            dispatcher,
            conns: BTreeMap::new(),
            by_generation: BTreeMap::new(),
            requests: BTreeMap::new(),
            next_request_id: 1,
            next_command_id: 1,
            commands: BTreeMap::new(),
            probes: BTreeMap::new(),
            fenced_links: BTreeMap::new(),
            fenced_leases: BTreeMap::new(),
            pending_creates: BTreeMap::new(),
            end_crash_armed: BTreeSet::new(),
            custody,
            tenants,
        });
        if self.edges.len() > 1 {
            // R-TAKE-1: its lease first; renewed every third of its TTL.
            self.lease_revision[slot] = Some(
                self.journal
                    .lease(&self.edge_id(slot))
                    .map_or(0, |l| l.revision),
            );
            self.renew_lease(incarnation);
        }
        self.checkers[self.cur].edge_started();
        let at = self.now + self.cfg.capabilities_interval;
        self.schedule(at, Event::CapsTick { incarnation });
        // R-TAKE-1: what the dead incarnation left open is taken over
        // first (the custody's first scan is due at once).
        self.journal_edge_started();
        self.custody_wake(incarnation, None);
    }

    /// The Edge process dies. `sync_completed` fixes whether the store's
    /// running sync completed first (a crash point of the store); `None`
    /// lets the seed say.
    fn crash_edge(&mut self, sync_completed: Option<bool>) {
        let Some(edge) = self.edges[self.cur].take() else {
            return;
        };
        self.stats.edge_restarts += 1;
        self.stats.edge_lost += edge.requests.len() as u64;
        self.checkers[self.cur].edge_lost(edge.incarnation);
        self.recorder.world_line(&("edge_lost", edge.incarnation));
        // Its lease is renewed no more.
        self.lease_revision[self.cur] = None;
        self.lease_ok_since[self.cur] = None;
        // Dials in progress die with the process too.
        self.net.close_incarnation(edge.incarnation);
        for conn in edge.conns.keys() {
            self.net.close(*conn);
            if self.rng.chance(self.cfg.faults.close_notice_ppm) {
                let node = self.net.node_of(*conn).unwrap_or(0);
                let delay = self.net.delay(&mut self.rng, node);
                self.schedule(
                    self.now + delay,
                    Event::ConnLost {
                        conn: *conn,
                        side: Side::Node,
                    },
                );
            }
        }
        let down = self
            .rng
            .millis(10, duration_ms(self.cfg.faults.edge_down_max));
        self.schedule(self.now + down, Event::EdgeStart { slot: self.cur });
        self.journal_crash(edge.incarnation, self.now + down, sync_completed);
        // Clients whose request's record was still being created lost
        // their stream before any event: they may send it again with its
        // key (R-IDEM-1).
        for pending in edge.pending_creates.into_values() {
            self.creating_client_lost(pending);
        }
    }

    /// The `edge_id` of slot `slot`: one Edge keeps the single Edge's id.
    pub(crate) fn edge_id(&self, slot: usize) -> String {
        if self.edges.len() == 1 {
            crate::journal_store::SIM_EDGE.to_owned()
        } else {
            format!("{}-{slot}", crate::journal_store::SIM_EDGE)
        }
    }

    /// The slot whose `edge_id` is `id`.
    fn slot_of_edge_id(&self, id: &str) -> Option<usize> {
        (0..self.edges.len()).find(|&s| self.edge_id(s) == id)
    }

    /// The Edge of `incarnation` writes its ownership lease (compare-and-set
    /// on the revision it last wrote, as `put_lease` does) and renews it a
    /// third of its TTL later, while it lives. A write the store fails (a
    /// store fault) is tried at the next renewal; one something else wrote
    /// first is read again (R-TAKE-1, R-MULTI-1).
    fn renew_lease(&mut self, incarnation: u64) {
        let Some(slot) = self.slot_of(incarnation) else {
            return;
        };
        if self.edges[slot].as_ref().map(|e| e.incarnation) != Some(incarnation) {
            return;
        }
        let lease = iop_core::journal::EdgeLease {
            edge_id: self.edge_id(slot),
            incarnation,
            ttl_ms: iop_core::journal::MIN_LEASE_TTL_MS,
            renewed_unix_ms: self.unix_ms(),
        };
        let interval = lease.renew_interval();
        let failed = self.journal_down()
            || self.faults_on() && self.rng.chance(self.cfg.journal.sync_failure_ppm);
        let expected = self.lease_revision[slot].unwrap_or(0);
        if failed {
            self.stats.lease_failures += 1;
            self.lease_ok_since[slot] = None;
        } else {
            let edge_id = lease.edge_id.clone();
            match self.journal.put_lease(lease, expected) {
                Ok(revision) => {
                    self.stats.lease_writes += 1;
                    self.lease_revision[slot] = Some(revision);
                    self.lease_ok_since[slot].get_or_insert(self.now);
                }
                Err(_) => {
                    self.lease_revision[slot] =
                        Some(self.journal.lease(&edge_id).map_or(0, |l| l.revision));
                    self.lease_ok_since[slot] = None;
                }
            }
        }
        self.schedule(self.now + interval, Event::LeaseRenew { incarnation });
    }

    fn edge_receive(&mut self, conn: ConnId, stream: StreamKey, payload: Payload) {
        let heartbeat = self.heartbeat_config();
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        if self.net.edge_incarnation_of(conn) != Some(edge.incarnation) {
            return;
        }
        if let std::collections::btree_map::Entry::Vacant(slot) = edge.conns.entry(conn) {
            // Only a registration opens a connection at the Edge.
            let Some(node) = self
                .net
                .node_of(conn)
                .filter(|_| matches!(payload, Payload::NodeControl(NodeControl::Register(_))))
            else {
                return;
            };
            let config = EdgeLinkConfigRec {
                config: EdgeLinkConfig {
                    heartbeat,
                    // The heartbeat bounds a node that stops mid-handshake
                    // here.
                    handshake_timeout: None,
                },
                created_us: self.now.as_micros(),
            };
            let tap = self.recorder.tap(MachineKind::EdgeLink, &config);
            slot.insert(EdgeConn {
                node,
                link: DrivenEdgeLink::new_edge_link(config, tap),
                generation: None,
                runs: BTreeMap::new(),
            });
        }
        match payload {
            Payload::NodeControl(msg) => self.edge_control(conn, msg),
            Payload::RunEvent(ev) => self.edge_run_event(conn, ev),
            Payload::CommandResult(result) => self.edge_command_result(conn, stream, result),
            Payload::Close(code) => self.edge_link_lost(conn, code),
            Payload::RunReset { run_id } => self.edge_run_reset(conn, run_id),
            Payload::EdgeControl(_) | Payload::Data(_) | Payload::RunAck { .. } => {}
        }
    }

    fn edge_control(&mut self, conn: ConnId, msg: NodeControl) {
        let now = self.now;
        let Some(c) = self.edges[self.cur]
            .as_mut()
            .and_then(|e| e.conns.get_mut(&conn))
        else {
            return;
        };
        let pong = matches!(msg, NodeControl::Pong(_));
        let before = c.link.poll_timeout();
        c.link.handle_input(now, EdgeLinkInput::Control(msg));
        // An answer the heartbeat took (its outstanding ping's) moves its
        // timer: the peer was heard (R-FAIL-2).
        if pong
            && c.link.poll_timeout() != before
            && let Some(generation) = c.generation
        {
            let node = node_id(c.node);
            self.checkers[self.cur].link_heard(&node, generation);
        }
        self.drain_edge_link(conn, false);
    }

    /// The connection is gone at the Edge (the peer closed it, or it was
    /// lost): its machine ends it.
    fn edge_link_lost(&mut self, conn: ConnId, code: CloseCode) {
        let now = self.now;
        let Some(c) = self.edges[self.cur]
            .as_mut()
            .and_then(|e| e.conns.get_mut(&conn))
        else {
            return;
        };
        c.link.handle_input(now, EdgeLinkInput::Lost(code));
        self.drain_edge_link(conn, true);
    }

    /// Carry out a node connection machine's outputs, as `iop-edge`'s node
    /// link task does (`peer_gone`: the connection is already gone, so the
    /// end sends no close of its own).
    fn drain_edge_link(&mut self, conn: ConnId, peer_gone: bool) {
        loop {
            let now = self.now;
            let Some(c) = self.edges[self.cur]
                .as_mut()
                .and_then(|e| e.conns.get_mut(&conn))
            else {
                return;
            };
            let node = c.node;
            let Some(out) = c.link.poll_output(now) else {
                return;
            };
            match out {
                EdgeLinkOutput::Send(frame) => self.transmit(
                    conn,
                    Dir::EdgeToNode,
                    StreamKey::Control,
                    Payload::EdgeControl(frame),
                ),
                EdgeLinkOutput::Register(request) => {
                    let answer = self.edge_register(conn, node, request);
                    if let Some(c) = self.edges[self.cur]
                        .as_mut()
                        .and_then(|e| e.conns.get_mut(&conn))
                    {
                        c.link.handle_input(now, EdgeLinkInput::Registered(answer));
                    }
                }
                EdgeLinkOutput::Ready(generation) => {
                    let accepted = self
                        .dispatch(DispatchInput::Ready {
                            node: node_id(node),
                            generation,
                        })
                        .iter()
                        .any(|o| matches!(o, DispatchOutput::ReadyAnswer { accepted: true, .. }));
                    if let Some(c) = self.edges[self.cur]
                        .as_mut()
                        .and_then(|e| e.conns.get_mut(&conn))
                    {
                        c.link
                            .handle_input(now, EdgeLinkInput::ReadyAnswer { accepted });
                    }
                }
                EdgeLinkOutput::LateMessage(generation) => {
                    self.dispatch(DispatchInput::Message {
                        node: node_id(node),
                        generation,
                    });
                }
                EdgeLinkOutput::Parked { generation, runs } => {
                    self.dispatch(DispatchInput::Parked {
                        node: node_id(node),
                        generation,
                        runs,
                    });
                }
                EdgeLinkOutput::HeartbeatTimedOut => {
                    self.stats.heartbeat_timeouts += 1;
                    if self.nodes[node].frozen.is_some() {
                        self.stats.freeze_losses += 1;
                    }
                }
                EdgeLinkOutput::Connected(generation) => {
                    self.checkers[self.cur].link_opened(&node_id(node), generation);
                }
                EdgeLinkOutput::Flooded(_) => {}
                EdgeLinkOutput::End { code, .. } => {
                    if !peer_gone {
                        self.transmit(
                            conn,
                            Dir::EdgeToNode,
                            StreamKey::Close,
                            Payload::Close(code),
                        );
                    }
                    self.edge_conn_ended(conn, code);
                    return;
                }
            }
        }
    }

    /// The dispatcher's answer to a node's registration on `conn`.
    fn edge_register(
        &mut self,
        conn: ConnId,
        node: usize,
        request: RegisterRequest,
    ) -> Result<(Generation, iop_wire::ConfigSnapshot), iop_core::edge::registry::Rejection> {
        let node_id = node_id(node);
        let registered = self
            .dispatch(DispatchInput::Register {
                node: node_id.clone(),
                request,
            })
            .into_iter()
            .find_map(|o| match o {
                DispatchOutput::Registered { result, .. } => Some(result),
                _ => None,
            });
        let Some(registered) = registered else {
            panic!("the dispatcher did not answer a registration");
        };
        if let (Ok((generation, _)), Some(edge)) = (&registered, &mut self.edges[self.cur]) {
            let generation = *generation;
            let high_water = edge.dispatcher.machine().registry().high_water();
            self.persisted_high_water[self.cur] =
                self.persisted_high_water[self.cur].max(high_water);
            self.checkers[self.cur].generation_handed_out(&node_id, generation);
            if let Some(c) = edge.conns.get_mut(&conn) {
                c.generation = Some(generation);
            }
            edge.by_generation.insert((node, generation), conn);
        }
        registered
    }

    fn heartbeat_config(&self) -> HeartbeatConfig {
        HeartbeatConfig {
            interval: self.cfg.heartbeat_interval,
            wait: self.cfg.heartbeat_wait,
        }
    }

    /// The hub closes `conn` (the dispatcher said so): its machine ends it.
    fn edge_close_conn(&mut self, conn: ConnId, code: CloseCode) {
        let now = self.now;
        let Some(c) = self.edges[self.cur]
            .as_mut()
            .and_then(|e| e.conns.get_mut(&conn))
        else {
            return;
        };
        c.link.handle_input(now, EdgeLinkInput::Close(code));
        self.drain_edge_link(conn, false);
    }

    /// `conn` is over at the Edge: fence its generation (R-GEN-3).
    fn edge_conn_ended(&mut self, conn: ConnId, code: CloseCode) {
        let now = self.now;
        let alive = self.net.is_alive(conn);
        self.net.close(conn);
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let Some(c) = edge.conns.remove(&conn) else {
            return;
        };
        edge.commands.retain(|_, c| *c != conn);
        if let Some(generation) = c.generation {
            if alive {
                // What is already on its way still reaches the dispatcher.
                let leases = c
                    .runs
                    .iter()
                    .filter_map(|(run_id, rid)| {
                        let lease = edge.requests.get(rid)?.machine.machine().attempt_lease()?;
                        (lease.run_id == *run_id).then_some((*run_id, (*rid, lease.lease_id)))
                    })
                    .collect();
                edge.fenced_links.retain(|_, l| l.until >= now);
                edge.fenced_links.insert(
                    conn,
                    FencedLink {
                        node: c.node,
                        generation,
                        until: now + LINK_DRAIN,
                        leases,
                    },
                );
            }
            edge.by_generation.remove(&(c.node, generation));
            self.checkers[self.cur].link_declared_lost(&node_id(c.node), generation);
            self.dispatch(DispatchInput::ConnectionClosed {
                node: node_id(c.node),
                generation,
                reason: code,
            });
        }
    }

    /// A message on a connection the Edge already ended, within
    /// [`LINK_DRAIN`]: a terminal or CAPABILITIES answer reaches the
    /// dispatcher attributed to the fenced generation, which must ignore and
    /// count it (R-GEN-3). Nothing else of it is acted on.
    fn edge_late_message(&mut self, conn: ConnId, payload: Payload) {
        let now = self.now;
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let Some(link) = edge.fenced_links.get(&conn) else {
            return;
        };
        if now > link.until {
            edge.fenced_links.remove(&conn);
            return;
        }
        let (node, generation) = (node_id(link.node), link.generation);
        let counted_before = edge.dispatcher.machine().registry().fenced_messages();
        let ignored = match payload {
            Payload::RunEvent(RunEvent {
                run_id,
                kind: kind @ (RunEventKind::Completed { .. } | RunEventKind::Failed(_)),
            }) => {
                let Some(&(request_id, lease_id)) = link.leases.get(&run_id) else {
                    return;
                };
                let failure = match kind {
                    RunEventKind::Failed(f) => Some(f),
                    _ => None,
                };
                let outs = self.dispatch(DispatchInput::Request(RequestCommand::Terminal {
                    request_id,
                    lease_id,
                    node: node.clone(),
                    generation,
                    failure,
                }));
                outs.iter().any(|o| {
                    matches!(
                        o,
                        DispatchOutput::ToRequest {
                            event: RequestEvent::Terminal {
                                lease_id: l,
                                verdict: TerminalVerdict::Ignored(IgnoredTerminal::FencedGeneration),
                            },
                            ..
                        } if *l == lease_id
                    )
                })
            }
            Payload::CommandResult(CommandResult {
                body: CommandResultBody::Capabilities(report),
                ..
            }) => !self
                .dispatch(DispatchInput::Capabilities {
                    node: node.clone(),
                    generation,
                    report,
                })
                .iter()
                .any(|o| matches!(o, DispatchOutput::Capability(_))),
            _ => return,
        };
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let counted = edge.dispatcher.machine().registry().fenced_messages() - counted_before;
        self.stats.late_fenced_messages += 1;
        self.checkers[self.cur].fenced_message(&node, generation, ignored, counted);
    }

    /// Carry out the dispatcher's outputs (the hub's `drain`); returns them
    /// all, in order, for the caller that wants an answer among them.
    fn drain_dispatch(&mut self) -> Vec<DispatchOutput> {
        let mut drained = Vec::new();
        loop {
            let now = self.now;
            let Some(out) = self.edges[self.cur]
                .as_mut()
                .and_then(|e| e.dispatcher.poll_output(now))
            else {
                break;
            };
            drained.push(out.clone());
            match out {
                DispatchOutput::CloseConnection {
                    node,
                    generation,
                    code,
                } => {
                    if let Some(conn) = self.edge_conn_of(&node, generation) {
                        self.edge_close_conn(conn, code);
                    }
                }
                DispatchOutput::Fenced { .. } => self.stats.fences += 1,
                // The simulated Edge has no generation store (its config's
                // mark is `None`): the dispatcher never asks for a save.
                DispatchOutput::NodeReady { .. }
                | DispatchOutput::Registered { .. }
                | DispatchOutput::ReadyAnswer { .. }
                | DispatchOutput::SaveGenerationMark { .. } => {}
                DispatchOutput::Health(event) => {
                    if event.lifecycle == iop_core::edge::health::HealthLifecycle::Detected
                        && event.failure_code == Some(iop_wire::HealthFailureCode::Http5xx)
                    {
                        self.stats.outages_5xx += 1;
                    }
                }
                // R-PARK-2: the adoption task takes them (a hop later).
                DispatchOutput::ParkedRuns { runs, .. } => {
                    if let Some(incarnation) = self.edges[self.cur].as_ref().map(|e| e.incarnation)
                    {
                        self.stats.parked_reported += runs.len() as u64;
                        self.schedule(
                            self.now,
                            Event::ParkedOffers {
                                incarnation,
                                offers: runs,
                            },
                        );
                    }
                }
                // R-PARK-2: the adoption task tells every durable request
                // (a hop later).
                DispatchOutput::KeptRuns(kept) => {
                    if let Some(incarnation) = self.edges[self.cur].as_ref().map(|e| e.incarnation)
                    {
                        self.schedule(self.now, Event::KeptRuns { incarnation, kept });
                    }
                }
                DispatchOutput::StallEvidence { outcome, .. } => match outcome {
                    EvidenceOutcome::Lowered => self.stats.lowerings += 1,
                    EvidenceOutcome::Stale => self.stats.stale_evidence += 1,
                    EvidenceOutcome::Recorded => {}
                },
                DispatchOutput::Capability(v) => {
                    if v.recovery == iop_core::edge::overlay::RecoveryOutcome::Recovered {
                        self.stats.recoveries += 1;
                    }
                }
                DispatchOutput::ToRequest { request_id, event } => {
                    self.news_for_request(request_id, event);
                }
                DispatchOutput::CancelRun {
                    node,
                    generation,
                    run_id,
                } => {
                    if let Some(conn) = self.edge_conn_of(&node, generation) {
                        self.transmit(
                            conn,
                            Dir::EdgeToNode,
                            StreamKey::Control,
                            Payload::EdgeControl(EdgeControl::Cancel(iop_wire::Cancel { run_id })),
                        );
                    }
                }
                DispatchOutput::ProbeDue {
                    ticket,
                    node,
                    generation,
                } => self.health_probe(ticket, &node, generation),
            }
        }
        drained
    }

    /// The Edge's connection of (`node`, `generation`), if it still has it.
    fn edge_conn_of(&self, node: &NodeId, generation: Generation) -> Option<ConnId> {
        let idx = self.node_index(node);
        self.edges[self.cur]
            .as_ref()
            .and_then(|e| e.by_generation.get(&(idx, generation)).copied())
    }

    /// Feed one input to the dispatcher and carry out what it caused.
    fn dispatch(&mut self, input: DispatchInput) -> Vec<DispatchOutput> {
        let now = self.now;
        let Some(edge) = &mut self.edges[self.cur] else {
            return Vec::new();
        };
        edge.dispatcher.handle_input(now, input);
        self.drain_dispatch()
    }

    /// The dispatcher's news about a request: the checks that watch the
    /// traffic, then the request machine.
    fn news_for_request(&mut self, rid: RequestId, event: RequestEvent) {
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let key = (edge.incarnation, rid);
        match &event {
            RequestEvent::Leased(lease) => {
                self.checkers[self.cur].lease_granted(edge.dispatcher.machine(), lease);
                self.checkers[self.cur].dispatch_to_link(
                    &lease.node,
                    lease.generation,
                    "lease granted",
                );
                self.checkers[self.cur].request_dispatched(key, "leased");
                match edge.requests.get(&rid) {
                    Some(r) => {
                        if let Some(admit) = &r.admitted_with {
                            self.checkers[self.cur].selection(
                                edge.dispatcher.machine(),
                                lease,
                                admit.avoid_provider_id.as_ref(),
                                admit.allow_avoided_fallback,
                                &admit.pool,
                            );
                        }
                    }
                    None => {
                        let detail =
                            format!("lease {} granted to a finished request", lease.lease_id);
                        self.checkers[self.cur].fail("R-LEASE-2", detail);
                    }
                }
            }
            RequestEvent::Terminal { lease_id, verdict } => {
                // R-CONT-1: a committed answer on a route that continues
                // may go on after any provider-side failure.
                let may_continue = edge.requests.get(&rid).is_some_and(|r| {
                    r.machine.machine().gate().is_committed()
                        && r.durable
                            .as_deref()
                            .is_some_and(|record| custody::continues(&self.routes, record))
                });
                self.checkers[self.cur].terminal_verdict(key, *lease_id, verdict, may_continue);
            }
            RequestEvent::LeaseFenced(lease) => {
                self.checkers[self.cur].lease_released(lease.lease_id, "fence");
                edge.fenced_leases.insert(lease.lease_id, lease.clone());
                if let Some(r) = edge.requests.get(&rid)
                    && matches!(r.machine.machine().attempt_lease(), Some(l) if l.lease_id == lease.lease_id)
                {
                    // The attempt's stream dies with its connection.
                    if let Some(r) = edge.requests.get_mut(&rid) {
                        r.running = None;
                    }
                }
            }
            _ => {}
        }
        self.request_input(rid, RequestInput::Dispatch(event));
    }

    /// A request machine begun so at the current Edge, driven and
    /// recorded as the Edge's request driver holds it.
    fn new_request(&mut self, spec: RequestSpec, begin: RequestBegin) -> Driven<Request> {
        let config = RequestConfigRec::new(spec, begin, self.now);
        let tap = self.recorder.tap(MachineKind::EdgeRequest, &config);
        Driven::new(config.into_request(), tap)
    }

    /// Feed a request machine and carry out its outputs.
    fn request_input(&mut self, rid: RequestId, input: RequestInput) {
        let now = self.now;
        let Some(r) = self.edges[self.cur]
            .as_mut()
            .and_then(|e| e.requests.get_mut(&rid))
        else {
            return;
        };
        r.machine.handle_input(now, input);
        self.drive_request(rid);
    }

    /// Carry out a request machine's outputs (the request driver's
    /// `carry_out`), then finish the request if it ended.
    fn drive_request(&mut self, rid: RequestId) {
        loop {
            let Some(edge) = &mut self.edges[self.cur] else {
                return;
            };
            let incarnation = edge.incarnation;
            let Some(r) = edge.requests.get_mut(&rid) else {
                return;
            };
            let Some(out) = r.machine.poll_output(self.now) else {
                break;
            };
            self.carry_out(incarnation, rid, out);
        }
        self.finish_if_ended(rid);
    }

    fn carry_out(&mut self, incarnation: u64, rid: RequestId, out: RequestOutput) {
        let key = (incarnation, rid);
        match out {
            RequestOutput::Journal(write) => self.request_journal_write(incarnation, rid, write),
            // The Edge's driver calls the dispatcher directly, each
            // command under the hub's lock; its pre-send may still come
            // later than its lease (the lease reached it through its
            // queue, or another task took the lock between the two calls),
            // so fences slip in between (R-GEN-4). The other commands at
            // once.
            RequestOutput::Dispatch(command @ RequestCommand::PreSend { .. }) => {
                let at = self.now + self.rng.millis(0, 15);
                self.schedule(
                    at,
                    Event::ToHub {
                        incarnation,
                        command,
                    },
                );
            }
            RequestOutput::Dispatch(command) => self.command_at_hub(incarnation, command),
            RequestOutput::Open {
                lease,
                tunnel: _,
                deadline_ms,
                adopt,
                continuation,
            } => self.open_attempt(rid, lease, deadline_ms, adopt, continuation),
            // The node drops what is durable (R-PARK-1).
            RequestOutput::AckFrames { through_frame } => {
                let running = self.edges[self.cur]
                    .as_ref()
                    .and_then(|e| e.requests.get(&rid))
                    .and_then(|r| r.running);
                if let Some((conn, run_id)) = running {
                    self.transmit(
                        conn,
                        Dir::EdgeToNode,
                        StreamKey::Run(run_id),
                        Payload::RunAck {
                            run_id,
                            through_frame,
                        },
                    );
                }
            }
            RequestOutput::CloseAttempt => {
                let Some(r) = self.edges[self.cur]
                    .as_mut()
                    .and_then(|e| e.requests.get_mut(&rid))
                else {
                    return;
                };
                if let Some((conn, run_id)) = r.running.take() {
                    if let Some(c) = self.edges[self.cur]
                        .as_mut()
                        .and_then(|e| e.conns.get_mut(&conn))
                    {
                        c.runs.remove(&run_id);
                    }
                    // The stream reset reaches the node as a cancel.
                    self.transmit(
                        conn,
                        Dir::EdgeToNode,
                        StreamKey::Control,
                        Payload::EdgeControl(EdgeControl::Cancel(iop_wire::Cancel { run_id })),
                    );
                }
            }
            RequestOutput::ReserveAttempt {
                extra_input_tokens_max,
                ..
            } => {
                // R-TEN-2: the tenants' machine answers at once.
                let input = self.tenant_reserve(rid, extra_input_tokens_max);
                self.request_input(rid, input);
            }
            RequestOutput::Deliver(delivery) => {
                self.tenant_delivery(rid, &delivery);
                let record = self.edges[self.cur]
                    .as_ref()
                    .and_then(|e| e.requests.get(&rid))
                    .and_then(|r| r.durable.clone());
                if let Some(record) = record
                    && !self.durable_delivery(&record, &delivery)
                {
                    // Its client left: the delivery goes nowhere.
                    return;
                }
                self.client_delivery(key, delivery);
            }
            RequestOutput::Observe(RequestObservation::Readmitted) => {
                self.stats.readmissions += 1;
            }
            RequestOutput::Observe(RequestObservation::RecordTaken) => {
                self.durable_record_taken(rid)
            }
            RequestOutput::Observe(_) => {}
        }
    }

    /// A delivery reached the request's client: the checks that watch it.
    fn client_delivery(&mut self, key: (u64, RequestId), delivery: Delivery) {
        match delivery {
            Delivery::Commit { .. } => {
                self.checkers[self.cur].client(key, ClientSaw::Commit);
                self.recorder.world_line(&("commit", key));
            }
            Delivery::Event(kind) => {
                if matches!(
                    AttemptFrame::from_run_event(&kind),
                    AttemptFrame::Event(AttemptEvent::Content)
                ) {
                    self.checkers[self.cur].client(key, ClientSaw::Content);
                    self.recorder.world_line(&("content", key));
                }
            }
            Delivery::Body(_) => {}
            Delivery::Finish | Delivery::Fail { .. } => {
                match &delivery {
                    Delivery::Fail { kind, .. } => {
                        self.stats.failed += 1;
                        *self
                            .stats
                            .failures
                            .entry(kind.as_str().to_owned())
                            .or_default() += 1;
                    }
                    _ => self.stats.finished += 1,
                }
                self.checkers[self.cur].client(key, ClientSaw::Terminal);
                self.recorder
                    .world_line(&("terminal", key, format!("{delivery:?}")));
            }
        }
    }

    /// A request's command reaches the hub: feed it to the dispatcher, with
    /// the checks that watch the answer.
    fn command_at_hub(&mut self, incarnation: u64, command: RequestCommand) {
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        if edge.incarnation != incarnation {
            return;
        }
        let rid = command.request_id();
        let held = edge
            .dispatcher
            .machine()
            .admission()
            .lease_of_request(rid)
            .cloned();
        let check = match &command {
            RequestCommand::Admit(request) => {
                self.checkers[self.cur].request_dispatched((incarnation, rid), "admitted again");
                if let Some(r) = edge.requests.get_mut(&rid) {
                    r.admitted_with = Some(request.clone());
                }
                HubCheck::None
            }
            RequestCommand::Adopt { .. } => {
                // An adoption's lease comes from its run's held capacity,
                // not from a selection (R-PARK-2): no R-SEL-1 hints apply.
                if let Some(r) = edge.requests.get_mut(&rid) {
                    r.admitted_with = None;
                }
                HubCheck::None
            }
            RequestCommand::PreSend { lease_id, .. } => HubCheck::PreSend {
                lease_id: *lease_id,
                fenced: edge.fenced_leases.contains_key(lease_id),
            },
            RequestCommand::Terminal {
                failure, lease_id, ..
            } => {
                self.checkers[self.cur].terminal_sent(*lease_id, failure.as_ref());
                HubCheck::Terminal(failure.clone())
            }
            RequestCommand::Cancel { .. } => HubCheck::Cancel(held),
        };
        let outs = self.dispatch(DispatchInput::Request(command));
        // The answer among what the input caused (a nested drain may have
        // carried out older outputs first).
        let answer = outs.iter().find_map(|o| match (o, &check) {
            (
                DispatchOutput::ToRequest {
                    request_id,
                    event: event @ RequestEvent::PreSend(_),
                },
                HubCheck::PreSend { .. },
            )
            | (
                DispatchOutput::ToRequest {
                    request_id,
                    event: event @ RequestEvent::Terminal { .. },
                },
                HubCheck::Terminal(_),
            ) if *request_id == rid => Some(event.clone()),
            _ => None,
        });
        match (check, answer) {
            (HubCheck::PreSend { lease_id, fenced }, Some(RequestEvent::PreSend(answer))) => {
                let answer = &answer;
                if fenced {
                    if let Some(edge) = &self.edges[self.cur]
                        && let Some(lease) = edge.fenced_leases.get(&lease_id)
                    {
                        self.checkers[self.cur].pre_send_after_fence(
                            edge.dispatcher.machine(),
                            lease,
                            answer,
                        );
                    }
                    self.stats.fenced_before_send += 1;
                } else if *answer == PreSend::Refenced {
                    self.stats.pre_send_refenced += 1;
                    self.checkers[self.cur].lease_released(lease_id, "pre-send fence");
                }
            }
            (HubCheck::Terminal(failure), Some(RequestEvent::Terminal { verdict, .. })) => {
                self.checkers[self.cur].terminal_applied(&verdict, failure.as_ref());
            }
            (HubCheck::Cancel(Some(lease)), _) => {
                let released = outs.iter().any(|o| {
                    matches!(o, DispatchOutput::CancelRun { run_id, .. } if *run_id == lease.run_id)
                });
                if released {
                    self.checkers[self.cur].lease_released(lease.lease_id, "client cancel");
                }
            }
            _ => {}
        }
    }

    /// The request's `Open`: send the run on the lease's connection (or
    /// the adoption of its parked run, R-PARK-2).
    fn open_attempt(
        &mut self,
        rid: RequestId,
        lease: Lease,
        deadline_ms: u64,
        adopt: Option<AdoptSpec>,
        continuation: Option<String>,
    ) {
        let park_grace_ms = duration_ms(self.cfg.journal.park_grace);
        let node = self.node_index(&lease.node);
        // R-TEN-2: a call that sends the prompt is covered by a
        // reservation of its own, and an adoption by its adoption's.
        let metered = if adopt.is_none() {
            self.tenant_call(rid)
        } else {
            self.tenant_adoption_call(rid);
            None
        };
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let conn = edge.by_generation.get(&(node, lease.generation)).copied();
        self.checkers[self.cur].lease_sent(edge.dispatcher.machine(), &lease, conn.is_some());
        self.checkers[self.cur].dispatch_to_link(&lease.node, lease.generation, "run sent");
        self.checkers[self.cur].request_dispatched((edge.incarnation, rid), "sent a run");
        let Some(conn) = conn else {
            self.request_input(rid, RequestInput::OpenFailed(OpenFailure::NoConnection));
            return;
        };
        let run_id = lease.run_id;
        let record = edge.requests.get(&rid).and_then(|r| r.durable.clone());
        if let Some(r) = edge.requests.get_mut(&rid) {
            r.running = Some((conn, run_id));
        }
        if let Some(c) = edge.conns.get_mut(&conn) {
            c.runs.insert(run_id, rid);
        }
        if let Some(adopt) = adopt {
            let request = iop_wire::AdoptRequest {
                run_id,
                key: adopt.key,
                response_id: record.unwrap_or_default(),
                resume_after_frame: adopt.resume_after_frame,
                response_stall_timeout_ms: lease.stall_timeout_ms,
                deadline_ms,
            };
            self.stats.adoptions_sent += 1;
            self.transmit(
                conn,
                Dir::EdgeToNode,
                StreamKey::Run(run_id),
                Payload::Data(DataRequest::Adopt(request)),
            );
            self.request_input(rid, RequestInput::Opened);
            return;
        }
        // A durable run outlives its connection when runs park (R-PARK-1).
        let park = record
            .as_ref()
            .filter(|_| park_grace_ms > 0)
            .map(|record| iop_wire::ParkSpec {
                response_id: record.clone(),
                grace_ms: park_grace_ms,
            });
        if continuation.is_some() {
            self.stats.continued_attempts += 1;
        }
        if let Some(record) = record {
            self.run_records
                .insert((conn, run_id), (record, continuation.is_some()));
        }
        let request = RunRequest {
            run_id,
            session_id: format!("r{rid}"),
            adapter: lease.adapter,
            target: lease.target.clone(),
            model: "sim".into(),
            api: RunApi::Chat,
            messages: iop_core::edge::request::continued_messages(
                &metered.map_or_else(Vec::new, |(prompt_bytes, _)| vec![prompt(prompt_bytes)]),
                continuation.as_deref(),
            ),
            tools: vec![],
            params: GenerationParams {
                max_tokens: metered.map(|(_, output)| u32::try_from(output).unwrap_or(u32::MAX)),
                ..GenerationParams::default()
            },
            response_stall_timeout_ms: lease.stall_timeout_ms,
            deadline_ms,
            credential_lease: None,
            trace_context: None,
            park,
            // R-CONT-1: the answer so far is the conversation's last,
            // partial assistant message; the provider continues it.
            continue_final: continuation.is_some(),
        };
        self.transmit(
            conn,
            Dir::EdgeToNode,
            StreamKey::Run(run_id),
            Payload::Data(DataRequest::Run(request)),
        );
        self.request_input(rid, RequestInput::Opened);
    }

    fn edge_run_event(&mut self, conn: ConnId, ev: RunEvent) {
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let Some(c) = edge.conns.get_mut(&conn) else {
            return;
        };
        let Some(&rid) = c.runs.get(&ev.run_id) else {
            return;
        };
        if ev.kind.is_terminal() {
            c.runs.remove(&ev.run_id);
            self.net.stream_done(conn, StreamKey::Run(ev.run_id));
        }
        if let RunEventKind::Failed(f) = &ev.kind
            && f.code == FailureCode::ResponseStalled
        {
            self.checkers[self.cur].stall_evidence_received(conn, f.health_observation_seq);
        }
        let Some(r) = edge.requests.get(&rid) else {
            return;
        };
        if r.running != Some((conn, ev.run_id)) {
            return;
        }
        self.request_input(rid, RequestInput::Frame(NodeFrame::Run(ev.kind)));
    }

    /// The request ended: it is over.
    fn finish_if_ended(&mut self, rid: RequestId) {
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let incarnation = edge.incarnation;
        let Some(r) = edge.requests.get(&rid) else {
            return;
        };
        if !r.machine.machine().is_ended() {
            return;
        }
        // R-TEN-2: what no usage report covers, for its settlement, and a
        // report no delivery carried (the store refused its write).
        let unmetered = r.machine.machine().unmetered();
        let relayed = r.machine.machine().relayed_usage();
        // A durable record whose terminal the store refused too often: its
        // Edge's custody ends it (R-JRN-4).
        let left_open = r.machine.machine().record_left_open();
        // R-TEN-2: a record taken over is charged by its taker.
        let charged_elsewhere = r.machine.machine().answer_charged_elsewhere();
        // A durable request goes on without its client (only a cancel ends
        // it early); its client saw the terminal unless it left.
        let left = match &r.durable {
            Some(_) => !r.client_attached,
            None => r.machine.machine().gate().end() == Some(GateEnd::ClientDisconnected),
        };
        let record = r.durable.clone();
        if left {
            self.stats.client_left += 1;
            self.checkers[self.cur].client((incarnation, rid), ClientSaw::Left);
            self.recorder.world_line(&("left", (incarnation, rid)));
        }
        if let Some(r) = edge.requests.remove(&rid)
            && let Some((conn, run_id)) = r.running
            && let Some(c) = edge.conns.get_mut(&conn)
        {
            c.runs.remove(&run_id);
        }
        self.checkers[self.cur].gate_ended(edge.dispatcher.machine(), rid);
        if let Some(record) = record {
            self.durable_request_ended(
                &record,
                &Writer::Request {
                    incarnation,
                    request_id: rid,
                },
                left_open,
            );
        }
        // R-TEN-2: settled with what its answer reported (and the estimate
        // of what no report covers), or released.
        if let Some(usage) = relayed {
            self.tenant_delivery(rid, &Delivery::Event(RunEventKind::Usage(usage)));
        }
        if charged_elsewhere {
            self.tenant_forget_reported(rid);
        }
        self.tenant_unmetered(rid, unmetered);
        self.tenant_settle(rid);
    }

    /// A health probe the dispatcher asked for: a CAPABILITIES command on the
    /// node's ready connection, or a transport failure at once.
    fn health_probe(
        &mut self,
        ticket: iop_core::edge::health::ProbeTicket,
        node: &NodeId,
        generation: Option<Generation>,
    ) {
        let idx = self.node_index(node);
        let now = self.now;
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let conn = generation.and_then(|g| edge.by_generation.get(&(idx, g)).copied());
        let Some(conn) = conn else {
            edge.dispatcher.handle_input(
                now,
                DispatchInput::ProbeAnswer {
                    ticket,
                    answer: DispatchProbeAnswer::Failure(
                        iop_wire::HealthFailureCode::TransportFailed,
                    ),
                },
            );
            return;
        };
        let command_id = edge.next_command_id;
        edge.next_command_id += 1;
        edge.commands.insert(command_id, conn);
        edge.probes.insert(command_id, ticket);
        self.transmit(
            conn,
            Dir::EdgeToNode,
            StreamKey::Command(command_id),
            Payload::Data(DataRequest::Command(Command {
                command_id,
                session_id: "probe".into(),
                kind: CommandKind::Capabilities { target: None },
            })),
        );
    }

    fn node_index(&self, node: &NodeId) -> usize {
        self.nodes.iter().position(|n| &n.id == node).unwrap_or(0)
    }

    // ---- Edge: requests ----------------------------------------------------------

    fn client_arrival(&mut self) {
        if self.phase == Phase::Drain {
            return;
        }
        let gap_us = u64::try_from(self.cfg.client_gap_mean.as_micros()).unwrap_or(1000);
        let next = self.now + Duration::from_micros(self.rng.range(1, gap_us * 2));
        self.schedule(next, Event::ClientArrival);
        let n = self.providers.len();
        let pool: Vec<ProviderId> = if self.rng.chance(PPM / 2) {
            (0..n).map(provider_id).collect()
        } else {
            let first = self.rng.index(n);
            let len = self.rng.range(1, 2) as usize;
            (first..first + len)
                .map(|i| provider_id(i % n))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect()
        };
        let cancel = self.faults_on() && self.rng.chance(self.cfg.faults.client_cancel_ppm);
        let disconnect = self.faults_on() && self.rng.chance(self.cfg.faults.client_disconnect_ppm);
        let leave_after = if cancel {
            Some(self.rng.millis(0, duration_ms(self.cfg.queue_timeout)))
        } else if disconnect {
            Some(self.rng.millis(0, duration_ms(self.cfg.request_budget)))
        } else {
            None
        };
        self.cur = self.client_edge();
        let now = self.now;
        let Some(edge) = &mut self.edges[self.cur] else {
            // Connection refused: never accepted, nothing to end.
            return;
        };
        let Ok(budget) = GateBudget::new(self.cfg.max_attempts, self.cfg.request_budget) else {
            return;
        };
        let rid = edge.next_request_id;
        edge.next_request_id += 1;
        let incarnation = edge.incarnation;
        // R-TEN-1, R-TEN-2: its key's and principal's limits first; a
        // refused request is answered 429 and is nothing more.
        if !self.tenant_admit(rid) {
            return;
        }
        if self.rng.chance(self.cfg.journal.durable_ppm) {
            // Durable (SPEC §6): the record first, then the request. Its
            // client may cancel the response or leave while it goes on.
            if let Some(after) = leave_after {
                let event = if cancel {
                    Event::ClientCancel {
                        incarnation,
                        request_id: rid,
                    }
                } else {
                    Event::ClientLeave {
                        incarnation,
                        request_id: rid,
                    }
                };
                self.schedule(now + after, event);
            }
            self.durable_arrival(rid, pool, budget, None);
            return;
        }
        if self.edges[self.cur].is_none() {
            return;
        }
        let machine = self.new_request(
            RequestSpec {
                request_id: rid,
                pool,
                budget,
                tunnel_api: None,
                tunnel_providers: Vec::new(),
                journal: None,
                park_grace_ms: 0,
                continuation: false,
                prompt_tokens: self.tenant_prompt_tokens(rid),
            },
            RequestBegin::New,
        );
        self.core_bugs.plant_request(machine.machine());
        let deadline = machine.machine().gate().deadline();
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        edge.requests.insert(
            rid,
            EdgeRequest {
                machine,
                running: None,
                admitted_with: None,
                durable: None,
                client_attached: true,
            },
        );
        self.stats.requests += 1;
        self.checkers[self.cur].request_opened((incarnation, rid), deadline);
        if let Some(after) = leave_after {
            self.schedule(
                now + after,
                Event::ClientLeave {
                    incarnation,
                    request_id: rid,
                },
            );
        }
        self.drive_request(rid);
    }

    fn client_leave(&mut self, incarnation: u64, request_id: RequestId) {
        if self.edges[self.cur]
            .as_ref()
            .is_some_and(|e| e.incarnation == incarnation)
        {
            // A durable request ignores it and goes on (SPEC §6); the
            // driver still reports it.
            self.durable_leave(request_id);
            self.request_input(request_id, RequestInput::ClientDisconnected);
        }
    }

    fn caps_tick(&mut self, incarnation: u64) {
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        if edge.incarnation != incarnation {
            return;
        }
        let ready: Vec<ConnId> = edge
            .conns
            .iter()
            .filter(|(_, c)| {
                c.generation.is_some_and(|g| {
                    edge.dispatcher
                        .machine()
                        .registry()
                        .is_dispatchable(&node_id(c.node), g)
                })
            })
            .map(|(id, _)| *id)
            .collect();
        for conn in ready {
            let Some(edge) = &mut self.edges[self.cur] else {
                return;
            };
            let command_id = edge.next_command_id;
            edge.next_command_id += 1;
            edge.commands.insert(command_id, conn);
            self.transmit(
                conn,
                Dir::EdgeToNode,
                StreamKey::Command(command_id),
                Payload::Data(DataRequest::Command(Command {
                    command_id,
                    session_id: "caps".into(),
                    kind: CommandKind::Capabilities { target: None },
                })),
            );
        }
        let at = self.now + self.cfg.capabilities_interval;
        self.schedule(at, Event::CapsTick { incarnation });
    }

    fn edge_command_result(&mut self, conn: ConnId, stream: StreamKey, result: CommandResult) {
        self.net.stream_done(conn, stream);
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        if edge.commands.remove(&result.command_id) != Some(conn) {
            return;
        }
        let Some(c) = edge.conns.get(&conn) else {
            return;
        };
        let (Some(generation), CommandResultBody::Capabilities(report)) =
            (c.generation, &result.body)
        else {
            return;
        };
        let node = node_id(c.node);
        let seq = report.health_observation_seq;
        let input = match edge.probes.remove(&result.command_id) {
            Some(ticket) => DispatchInput::ProbeAnswer {
                ticket,
                answer: DispatchProbeAnswer::Report {
                    node,
                    generation,
                    report: report.clone(),
                },
            },
            None => DispatchInput::Capabilities {
                node,
                generation,
                report: report.clone(),
            },
        };
        let verdicts: Vec<CapabilityVerdict> = self
            .dispatch(input)
            .into_iter()
            .filter_map(|o| match o {
                DispatchOutput::Capability(v) => Some(v),
                _ => None,
            })
            .collect();
        self.checkers[self.cur].capabilities_applied(generation, seq, &verdicts);
    }

    // ---- Nodes ---------------------------------------------------------------------

    fn node_dial(&mut self, node: usize, process: u64) {
        let n = &self.nodes[node];
        if !n.up || n.process != process || !matches!(n.link[self.cur], Link::Idle) {
            return;
        }
        let edge = self.edges[self.cur].as_ref().map(|e| e.incarnation);
        let dial = self.net.dial(&mut self.rng, self.now, node, edge);
        self.nodes[node].link[self.cur] = Link::Dialing;
        match dial {
            Some((conn, at)) => self.schedule(
                at,
                Event::DialDone {
                    node,
                    edge: self.cur,
                    process,
                    conn: Some(conn),
                },
            ),
            None => {
                let at = self.now + self.cfg.connect_timeout;
                self.schedule(
                    at,
                    Event::DialDone {
                        node,
                        edge: self.cur,
                        process,
                        conn: None,
                    },
                );
            }
        }
    }

    fn schedule_redial(&mut self, node: usize) {
        let edge = self.cur;
        let delay = self.nodes[node].backoff[edge].next_delay(&mut self.rng);
        let process = self.nodes[node].process;
        self.nodes[node].link[edge] = Link::Idle;
        self.schedule(
            self.now + delay,
            Event::NodeDial {
                node,
                edge,
                process,
            },
        );
    }

    /// The Edge a new client reaches: with several, a live one the seed
    /// picks (a load balancer in front of them), else any.
    fn client_edge(&mut self) -> usize {
        if self.edges.len() == 1 {
            return 0;
        }
        let live: Vec<usize> = (0..self.edges.len())
            .filter(|&e| self.edges[e].is_some())
            .collect();
        if live.is_empty() {
            return self.rng.index(self.edges.len());
        }
        live[self.rng.index(live.len())]
    }

    fn node_dial_done(&mut self, node: usize, process: u64, conn: Option<ConnId>) {
        let now = self.now;
        let n = &self.nodes[node];
        if !n.up || n.process != process || !matches!(n.link[self.cur], Link::Dialing) {
            return;
        }
        let Some(conn) = conn.filter(|c| self.net.is_alive(*c)) else {
            self.schedule_redial(node);
            return;
        };
        let providers = self.nodes[node]
            .providers
            .iter()
            .map(|&p| iop_wire::OfferedProvider {
                adapter: AdapterKind::Mock,
                target: target(p),
                models: vec!["sim".into()],
                max_concurrent_runs: None,
            })
            .collect();
        let register = RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            node_version: "sim".into(),
            providers,
            max_concurrent_runs: 64,
            recipient_public_key: None,
            // R-PARK-2: the durable runs an Edge may adopt.
            parked: self.parked_reports(node),
        };
        let config = NodeLinkConfig {
            heartbeat: self.heartbeat_config(),
            watchdog: WatchdogConfig {
                close_grace: self.cfg.close_grace,
                probe_bound: self.cfg.probe_bound,
                max_active_runs: 64,
            },
            // The heartbeat bounds the handshake here.
            handshake_timeout: None,
        };
        let tap = self.recorder.tap(
            MachineKind::NodeLink,
            &NodeLinkConfigRec {
                config,
                created_us: now.as_micros(),
                register: register.clone(),
            },
        );
        let link = DrivenNodeLink::new_link(now, config, register, ReplayCache::new(), tap);
        self.core_bugs.plant_watchdog(link.machine().watchdog());
        self.nodes[node].link[self.cur] = Link::Connected(Box::new(NodeConn { conn, link }));
        // The registration goes first.
        self.drain_node_link(node);
    }

    fn node_receive(&mut self, node: usize, stream: StreamKey, payload: Payload) {
        let now = self.now;
        let Some(nc) = nconn(&mut self.nodes, node, self.cur) else {
            return;
        };
        let conn = nc.conn;
        match payload {
            Payload::EdgeControl(msg) => {
                if let EdgeControl::Cancel(iop_wire::Cancel { run_id }) = &msg {
                    // The world carries the Edge's reset of a run's stream
                    // as this frame: the run hears the reset.
                    self.run_reset_by_edge(node, conn, *run_id);
                }
                let Some(nc) = nconn(&mut self.nodes, node, self.cur) else {
                    return;
                };
                let registered = nc.link.machine().generation();
                nc.link.handle_input(now, NodeLinkInput::Control(msg));
                if registered.is_none()
                    && let Some(generation) = nc.link.machine().generation()
                {
                    self.checkers[self.cur].node_registered(node, generation);
                }
                self.drain_node_link(node);
            }
            Payload::Data(DataRequest::Run(request)) => self.node_start_run(node, request),
            Payload::Data(DataRequest::Adopt(request)) => self.node_adopt(node, conn, request),
            Payload::RunAck {
                run_id,
                through_frame,
            } => self.node_run_ack(node, conn, run_id, through_frame),
            Payload::Data(DataRequest::Command(command)) => {
                if matches!(command.kind, CommandKind::Capabilities { .. }) {
                    let delay = self.rng.millis(1, duration_ms(self.cfg.probe_delay_max));
                    let process = self.nodes[node].process;
                    self.schedule(
                        now + delay,
                        Event::CapsAnswer {
                            node,
                            process,
                            conn,
                            command_id: command.command_id,
                        },
                    );
                }
            }
            Payload::Data(DataRequest::Tunnel(_)) => {}
            Payload::Close(code) => self.node_conn_ended(node, code),
            Payload::NodeControl(_)
            | Payload::RunEvent(_)
            | Payload::CommandResult(_)
            | Payload::RunReset { .. } => {}
        }
        let _ = stream;
    }

    /// The node closes its connection itself.
    fn node_close(&mut self, node: usize, code: CloseCode) {
        let Some(nc) = nconn(&mut self.nodes, node, self.cur) else {
            return;
        };
        let conn = nc.conn;
        self.transmit(
            conn,
            Dir::NodeToEdge,
            StreamKey::Close,
            Payload::Close(code),
        );
        self.node_conn_ended(node, code);
    }

    /// The node's connection is over: cancel every run (R-DISC-1), back off,
    /// reconnect.
    fn node_conn_ended(&mut self, node: usize, _code: CloseCode) {
        let now = self.now;
        let Some(nc) = nconn(&mut self.nodes, node, self.cur) else {
            return;
        };
        let conn = nc.conn;
        self.net.close(conn);
        // Durable runs park instead of being canceled (R-DISC-1, R-PARK-1).
        self.runs_lose(node, conn);
        if let Some(nc) = nconn(&mut self.nodes, node, self.cur) {
            nc.link.handle_input(now, NodeLinkInput::Disconnected);
        }
        self.drain_node_link(node);
        if let Some(nc) = nconn(&mut self.nodes, node, self.cur)
            && nc.link.machine().watchdog().active_runs() > 0
        {
            let left = nc.link.machine().watchdog().active_runs();
            self.checkers[self.cur].fail(
                "R-DISC-1",
                format!("{left} runs still watched after the connection ended"),
            );
        }
        self.checkers[self.cur].node_conn_ended(conn);
        self.schedule_redial(node);
    }

    fn crash_node(&mut self, node: usize) {
        if !self.nodes[node].up {
            return;
        }
        self.stats.node_crashes += 1;
        for edge in 0..self.edges.len() {
            let Link::Connected(nc) = &self.nodes[node].link[edge] else {
                continue;
            };
            let conn = nc.conn;
            self.net.close(conn);
            self.checkers[edge].node_conn_ended(conn);
            if self.rng.chance(self.cfg.faults.close_notice_ppm) {
                let delay = self.net.delay(&mut self.rng, node);
                self.schedule(
                    self.now + delay,
                    Event::ConnLost {
                        conn,
                        side: Side::Edge,
                    },
                );
            }
        }
        // Its durable runs die with it, parked or not: their provider calls
        // end (nothing reports them any more).
        self.stats.durable_runs_crashed += self.nodes[node]
            .runs
            .values()
            .filter(|r| r.is_durable())
            .count() as u64;
        let n = &mut self.nodes[node];
        // A frozen process can be killed too: what it held is for a
        // process that no longer exists.
        n.frozen = None;
        n.up = false;
        n.process += 1;
        n.link.iter_mut().for_each(|l| *l = Link::Idle);
        n.runs.clear();
        let down = self
            .rng
            .millis(10, duration_ms(self.cfg.faults.node_down_max));
        self.schedule(self.now + down, Event::NodeRestart { node });
    }

    /// The node process stops (silent node loss: `SIGSTOP`, a power cut):
    /// no close notice, nothing sent or acknowledged, its timers and its
    /// provider calls stop. The Edge finds out only through its loss
    /// detection (R-FAIL-2). It goes on after at most `node_freeze_max`,
    /// or only when the faults stop.
    fn freeze_node(&mut self, node: usize) {
        let f = self.cfg.faults;
        let n = &self.nodes[node];
        if !n.up || n.frozen.is_some() {
            return;
        }
        self.stats.node_freezes += 1;
        let since = self.now;
        if self.rng.chance(f.node_freeze_forever_ppm) {
            self.stats.node_freezes_forever += 1;
        } else {
            let until = since + self.rng.millis(50, duration_ms(f.node_freeze_max));
            self.schedule(until, Event::NodeThaw { node, since });
        }
        self.recorder.world_line(&("node_frozen", node));
        self.nodes[node].frozen = Some(Freeze {
            since,
            held: Vec::new(),
        });
    }

    /// The frozen node process goes on where it stopped: what reached it
    /// meanwhile happens now, in order; its timers fire late.
    fn thaw_node(&mut self, node: usize, since: Instant) {
        if self.nodes[node].frozen.as_ref().map(|f| f.since) != Some(since) {
            return;
        }
        let Some(freeze) = self.nodes[node].frozen.take() else {
            return;
        };
        for edge in 0..self.edges.len() {
            if let Link::Connected(nc) = &self.nodes[node].link[edge] {
                self.checkers[edge].node_thawed(nc.conn, self.now - since);
            }
        }
        self.recorder.world_line(&("node_thawed", node));
        for event in freeze.held {
            self.handle_event(event);
        }
    }

    fn probe_done(
        &mut self,
        node: usize,
        process: u64,
        conn: ConnId,
        run_id: RunId,
        answer: ProbeAnswer,
    ) {
        let now = self.now;
        if self.nodes[node].process != process {
            return;
        }
        let Some(nc) = nconn(&mut self.nodes, node, self.cur) else {
            return;
        };
        if nc.conn != conn {
            return;
        }
        let Some(outcome) = answer.outcome() else {
            return;
        };
        nc.link
            .handle_input(now, NodeLinkInput::ProbeDone { run_id, outcome });
        self.checkers[self.cur].probe_answered(conn, run_id, answer.health());
        self.drain_node_link(node);
    }

    /// Carry out the node connection machine's outputs.
    fn drain_node_link(&mut self, node: usize) {
        while let Some(out) = self.poll_node_link(node) {
            self.node_link_output(node, out);
        }
    }

    fn poll_node_link(&mut self, node: usize) -> Option<NodeLinkOutput> {
        let now = self.now;
        nconn(&mut self.nodes, node, self.cur)?
            .link
            .poll_output(now)
    }

    fn node_link_output(&mut self, node: usize, out: NodeLinkOutput) {
        let now = self.now;
        let faults = self.faults_on();
        let process = self.nodes[node].process;
        let Some(conn) = nconn(&mut self.nodes, node, self.cur).map(|nc| nc.conn) else {
            return;
        };
        match out {
            NodeLinkOutput::Send(frame) => self.transmit(
                conn,
                Dir::NodeToEdge,
                StreamKey::Control,
                Payload::NodeControl(frame),
            ),
            NodeLinkOutput::Ready { .. } => self.nodes[node].backoff[self.cur].reset(),
            NodeLinkOutput::End(end) => {
                if end == LinkEnd::Closed(CloseCode::HeartbeatTimeout) {
                    self.stats.heartbeat_timeouts += 1;
                }
                self.node_close(node, end.close_code());
            }
            NodeLinkOutput::CancelProvider { run_id } => {
                self.run_cancel_provider(node, conn, run_id);
            }
            NodeLinkOutput::CancelParked(c) => self.run_cancel_parked(node, &c),
            NodeLinkOutput::StartProbe { run_id, .. } => {
                self.checkers[self.cur].stall_claimed(conn, run_id);
                let provider = self
                    .attached_run(node, conn, run_id)
                    .and_then(|serial| self.nodes[node].runs.get(&serial))
                    .and_then(|r| r.provider());
                let frozen = provider.is_some_and(|p| self.frozen_until[p] > now);
                let answer = if frozen {
                    // A frozen provider does not answer its probe either.
                    ProbeAnswer::Timeout
                } else {
                    ProbeAnswer::draw(&mut self.rng, &self.cfg.provider, faults)
                };
                if answer.outcome().is_some() {
                    let delay = self.rng.millis(0, duration_ms(self.cfg.probe_delay_max));
                    self.schedule(
                        now + delay,
                        Event::ProbeDone {
                            node,
                            process,
                            conn,
                            run_id,
                            answer,
                        },
                    );
                }
            }
            NodeLinkOutput::RunEnded {
                run_id,
                terminal,
                forwarded,
                ..
            } => {
                self.link_ended_run(conn, run_id, &terminal);
                if !forwarded {
                    self.run_ended_by_link(node, conn, run_id, terminal);
                }
            }
            NodeLinkOutput::Managed(_)
            | NodeLinkOutput::SigningKeyRefused
            | NodeLinkOutput::StallObserved { .. }
            | NodeLinkOutput::RunDetached { .. } => {}
        }
    }

    fn caps_answer(&mut self, node: usize, process: u64, conn: ConnId, command_id: u64) {
        let now = self.now;
        let faults = self.faults_on();
        if self.nodes[node].process != process {
            return;
        }
        let providers = self.nodes[node].providers.clone();
        let targets: Vec<TargetHealth> = providers
            .iter()
            .map(|&p| TargetHealth {
                adapter: AdapterKind::Mock,
                target: target(p),
                status: ProbeAnswer::draw(&mut self.rng, &self.cfg.provider, faults).health(),
                failure_code: None,
                models: vec![],
            })
            .collect();
        let Some(nc) = nconn(&mut self.nodes, node, self.cur) else {
            return;
        };
        if nc.conn != conn {
            return;
        }
        // Taken when the answer is finalized (R-SEQ-1).
        let seq = nc.link.take_observation_seq(now);
        self.drain_node_link(node);
        self.checkers[self.cur].observation_seq(conn, Some(seq));
        self.transmit(
            conn,
            Dir::NodeToEdge,
            StreamKey::Command(command_id),
            Payload::CommandResult(CommandResult {
                command_id,
                session_id: "caps".into(),
                body: CommandResultBody::Capabilities(CapabilitiesReport {
                    targets,
                    health_observation_seq: seq,
                }),
            }),
        );
    }

    // ---- Faults and liveness checks -------------------------------------------------

    fn fault_tick(&mut self) {
        if !self.faults_on() {
            return;
        }
        let f = self.cfg.faults;
        for node in 0..self.nodes.len() {
            if self.rng.chance(f.partition_ppm) {
                self.stats.partitions += 1;
                let kind = if self.rng.chance(f.partition_one_way_ppm) {
                    if self.rng.chance(PPM / 2) {
                        PartitionKind::EdgeToNode
                    } else {
                        PartitionKind::NodeToEdge
                    }
                } else {
                    PartitionKind::Symmetric
                };
                let duration = self.rng.millis(50, duration_ms(f.partition_max));
                self.net.partition(node, kind, self.now, duration);
            }
            if self.rng.chance(f.node_crash_ppm) {
                self.crash_node(node);
            }
            if self.rng.chance(f.node_freeze_ppm) {
                self.freeze_node(node);
            }
        }
        for p in 0..self.frozen_until.len() {
            if self.rng.chance(f.provider_freeze_ppm) {
                self.stats.provider_freezes += 1;
                let until = self.now + self.rng.millis(100, duration_ms(f.provider_freeze_max));
                self.frozen_until[p] = self.frozen_until[p].max(until);
            }
        }
        if self.rng.chance(f.edge_restart_ppm) {
            // One Edge of several: the seed says which.
            self.cur = if self.edges.len() > 1 {
                self.rng.index(self.edges.len())
            } else {
                0
            };
            // A stop (SIGTERM) hands back what the process holds first
            // (R-TEN-3), as the seed says; a kill does not.
            self.tenant_graceful_stop();
            self.crash_edge(None);
        }
        self.tenant_fault_tick();
        if self.outage_rng.chance(self.cfg.journal.outage_ppm) {
            self.stats.journal_outages += 1;
            let until = self.now
                + self
                    .outage_rng
                    .millis(100, duration_ms(self.cfg.journal.outage_max));
            self.journal_down_until = self.journal_down_until.max(until);
            let bound = self.owner_lost_bound();
            self.checkers[0].journal_outage(self.journal_down_until, bound);
        }
        let at = self.now + self.cfg.fault_tick;
        self.schedule(at, Event::FaultTick);
    }

    /// Liveness: by `T_q + B_node` every node is up, connected and ready,
    /// and the Edge agrees on its generation.
    fn check_nodes(&mut self) {
        self.checks_pending -= 1;
        for slot in 0..self.edges.len() {
            self.cur = slot;
            self.check_nodes_at();
        }
    }

    /// [`Self::check_nodes`] at the current Edge slot.
    fn check_nodes_at(&mut self) {
        let Some(edge) = &self.edges[self.cur] else {
            self.checkers[self.cur].fail("liveness-nodes", "the Edge is still down");
            return;
        };
        for (i, n) in self.nodes.iter().enumerate() {
            let node_view = match &n.link[self.cur] {
                Link::Connected(nc) if n.up && nc.link.machine().is_ready() => {
                    nc.link.machine().generation()
                }
                _ => None,
            };
            let edge_view = edge
                .dispatcher
                .machine()
                .registry()
                .dispatchable_generation(&n.id);
            if node_view.is_none() || node_view != edge_view {
                let detail = format!(
                    "node {i} not ready {}us after faults stopped (node sees {node_view:?}, edge {edge_view:?})",
                    self.cfg.node_recovery_bound().as_micros()
                );
                self.checkers[self.cur].fail("liveness-nodes", detail);
                return;
            }
        }
    }

    /// Liveness: by `T_q + B_eligible` every provider is selectable again.
    fn check_eligible(&mut self) {
        self.checks_pending -= 1;
        for slot in 0..self.edges.len() {
            self.cur = slot;
            self.check_eligible_at();
        }
    }

    /// [`Self::check_eligible`] at the current Edge slot.
    fn check_eligible_at(&mut self) {
        let Some(edge) = &self.edges[self.cur] else {
            self.checkers[self.cur].fail("liveness-eligible", "the Edge is still down");
            return;
        };
        for p in &self.providers {
            if !edge.dispatcher.machine().admission().is_selectable(&p.id) {
                let detail = format!(
                    "provider {} not selectable {}us after faults stopped",
                    p.id,
                    self.cfg.eligibility_bound().as_micros()
                );
                self.checkers[self.cur].fail("liveness-eligible", detail);
                return;
            }
        }
    }
}

/// What the world checks about a request command's answer.
enum HubCheck {
    None,
    PreSend { lease_id: LeaseId, fenced: bool },
    Terminal(Option<ExecutionFailure>),
    Cancel(Option<Lease>),
}

fn nconn(nodes: &mut [SimNode], node: usize, edge: usize) -> Option<&mut NodeConn> {
    match &mut nodes[node].link[edge] {
        Link::Connected(nc) => Some(nc),
        _ => None,
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn unreachable_violation() -> Violation {
    Violation {
        rule: "internal",
        detail: "a failure was recorded without a violation".into(),
        step: 0,
        at_us: 0,
    }
}

/// A user message of `bytes` bytes: a prompt held to a tenant's limits
/// (its bytes bound its tokens, `prompt_tokens_max`).
fn prompt(bytes: u64) -> iop_wire::ChatMessage {
    iop_wire::ChatMessage {
        role: iop_wire::Role::User,
        content: "x".repeat(usize::try_from(bytes).unwrap_or(0)),
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
        images: Vec::new(),
        documents: Vec::new(),
        cache_control: None,
    }
}
