//! The invariants, checked after every step (and at the hooks where the
//! world hands a decision from one machine to another).
//!
//! The checker keeps its own model of what *must* be true (which leases were
//! granted and released, what each client saw, which sequence numbers each
//! connection handed out) and compares it with the core machines' state. It
//! never repairs anything: the first difference is a [`Violation`].
//!
//! | rule | what is checked |
//! | --- | --- |
//! | R-LEASE-2 | capacity never leaks or goes negative (`Admission::check_invariants`); every lease is released exactly once; held leases are exactly the granted, unreleased ones; a finished request holds no lease and no queue slot; with no request open, no lease is in use and the queue is empty |
//! | R-GEN-1 | each node's generations strictly increase, across Edge restarts, on both sides |
//! | R-GEN-2/3/4 | nothing is leased or sent on a generation that is not current and ready; every held lease is bound to a dispatchable generation; a late message of a fenced generation is ignored and counted once; a pre-send after its lease's fence is not answered `Send` |
//! | R-GATE-1/3/4 | every client request ends exactly once (one terminal, or a disconnect, or the Edge going away); nothing reaches the client after that; content only after the commit; at most one commit |
//! | R-WD-* | one terminal per node run; a stall terminal comes within `claim + max(grace, probe bound)` (R-WD-3), is retryable exactly when the canceled call returned within the grace (R-WD-4), and carries the probe's evidence pair (R-WD-5) |
//! | R-SEQ-1 | each connection's observation sequence starts at 1 and increases by one across stall terminals and CAPABILITIES answers |
//! | R-OVL-2, R-CAP-1 | the overlay is lowered only by fresh `unavailable` evidence and raised only by a strictly newer `available`; it always equals the checker's model |
//! | R-SEL-1 | an avoided provider is leased (immediately or from the queue) only with the fallback flag and no eligible alternate; after every step no queued request could be served (an eligible alternate with room, or the flagged avoided provider with room when no alternate is eligible) |
//! | R-FAIL-1 | no request is admitted, leased or sent again after an attempt of it ended with an applied terminal that is not retryable |
//! | R-FAIL-2 | no lease is granted on and no run sent to a node connection past its loss deadline (last heard + heartbeat interval + wait, or the moment it was declared lost); after every step no generation is dispatchable past it |
//! | provider | each attempt calls its provider at most once |
//! | liveness | every request ends within its budget (a durable one within B_durable more); after faults stop, nodes are ready within B_node and providers selectable within B_eligible (see [`crate::config::SimConfig`]) |
//!
//! Durable responses (R-JRN-1..4, R-TAKE-1) have their own model of the
//! journal, in [`journal`]; the failover rules (R-FAIL-1, R-FAIL-2) theirs,
//! in [`failover`].

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use iop_core::Instant;
use iop_core::edge::admission::{Lease, LeaseId, PreSend, RequestId};
use iop_core::edge::dispatch::{CapabilityVerdict, Dispatcher, TerminalVerdict};
use iop_core::edge::overlay::{EvidenceOutcome, RecoveryOutcome};
use iop_core::ids::{Generation, NodeId, ProviderId, RunId};
use iop_core::node::watchdog::RunTerminal;
use iop_wire::{ExecutionFailure, FailureCode, ProviderHealth};
use serde::Serialize;

use crate::net::ConnId;

pub mod failover;
pub mod journal;

/// A broken invariant: which rule, what happened, and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// The rule (a SPEC id or a simulator invariant name).
    pub rule: &'static str,
    /// What was observed.
    pub detail: String,
    /// The step it was found at.
    pub step: u64,
    /// Virtual time, microseconds.
    pub at_us: u64,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] {} (step {}, t={}us)",
            self.rule, self.detail, self.step, self.at_us
        )
    }
}

/// What a client saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ClientSaw {
    /// The response head (commit).
    Commit,
    /// A content chunk.
    Content,
    /// The one terminal (finish or error).
    Terminal,
    /// The client went away (its request ends without a terminal).
    Left,
    /// The Edge process went away under the request.
    EdgeLost,
}

#[derive(Debug, Clone)]
struct ClientModel {
    deadline: Instant,
    committed: bool,
}

#[derive(Debug, Clone, Default)]
struct NodeRunModel {
    claimed_at: Option<Instant>,
    returned_at: Option<Instant>,
    probe: Option<(Instant, ProviderHealth)>,
    terminated: bool,
    /// How long the node process was frozen after the claim: R-WD-3's
    /// bound is the process's running time.
    frozen: Duration,
}

#[derive(Debug, Clone, Copy)]
struct LeaseModel {
    sent: bool,
}

/// Known issues of `iop-core` the simulator found and that are not fixed
/// yet, by the rule name they are reported under. They are reported as
/// findings (with their reproduction) and become violations with
/// `--strict`.
///
/// Fixed so far: R-FAIL-1 on stalls (a confirmed stall was
/// re-admitted whatever the node's `retryable` mark; the request machine
/// now ends the attempt when it is not set), `journal-orphan` (with
/// `--store-faults`: a
/// durable request whose append or terminal the store refused left its
/// record without a terminal; a refused append now ends it `failed` and a
/// failed terminal is written again, R-JRN-4), R-SEL-1 on
/// readiness (a node's providers came online one at a time, so an avoided
/// provider could win before its alternate was online; `Admission::set_states`)
/// and R-SEL-1 on queued re-resolution (the queue was served between two
/// state changes of one input, e.g. a CAPABILITIES answer raising the
/// avoided provider before the same probe recovered its alternate; the
/// queue is now served once per input, at `Admission::poll_event`).
///
/// and `journal-fenced-client` (with `--store-faults` and several Edges:
/// a live Edge's lease renewals failed, a peer raised a record its
/// request still wrote, and the fenced request told its client `failed`
/// from outside the journal while the record went on under the peer,
/// R-JRN-1; a fenced request now tells its client nothing,
/// `RequestObservation::RecordTaken`, and its reader reads on from the
/// record).
///
/// None is open.
pub const KNOWN_CORE_ISSUES: &[&str] = &[];

/// The most findings one run keeps.
const MAX_FINDINGS: usize = 16;

/// How many released lease ids and ended requests the checker remembers to
/// recognise a second release or a late delivery (bounded model).
const REMEMBERED: usize = 8192;

fn remember<T: Ord + Copy>(set: &mut BTreeSet<T>, item: T) -> bool {
    let fresh = set.insert(item);
    if set.len() > REMEMBERED {
        set.pop_first();
    }
    fresh
}

/// Timing the stall rules depend on.
#[derive(Debug, Clone, Copy)]
pub struct WatchdogTiming {
    /// Close grace.
    pub close_grace: Duration,
    /// Probe bound.
    pub probe_bound: Duration,
}

/// The invariant checker.
#[derive(Debug)]
pub struct Checker {
    timing: WatchdogTiming,
    step: u64,
    now: Instant,
    violation: Option<Violation>,
    strict: bool,
    findings: Vec<Violation>,
    // Edge, current incarnation: held leases and recently released ids.
    leases: BTreeMap<LeaseId, LeaseModel>,
    released: BTreeSet<LeaseId>,
    last_seq: BTreeMap<(ProviderId, Generation), u64>,
    lowered: BTreeSet<(ProviderId, Generation)>,
    // Across incarnations.
    edge_generations: BTreeMap<NodeId, Generation>,
    node_generations: BTreeMap<usize, Generation>,
    clients: BTreeMap<(u64, RequestId), ClientModel>,
    ended: BTreeSet<(u64, RequestId)>,
    open: usize,
    // Node side.
    provider_calls: BTreeSet<(ConnId, RunId)>,
    node_runs: BTreeMap<(ConnId, RunId), NodeRunModel>,
    conn_seq: BTreeMap<ConnId, u64>,
    /// Observation sequence numbers each connection issued for stall
    /// terminals (R-SEQ-1 at the Edge).
    stall_seqs: BTreeSet<(ConnId, u64)>,
    // Durable responses, across incarnations.
    journal: journal::JournalModel,
    // Failover (R-FAIL-1, R-FAIL-2).
    failover: failover::FailoverModel,
}

impl Checker {
    /// A checker for a world with this watchdog timing.
    pub fn new(timing: WatchdogTiming) -> Self {
        Self {
            timing,
            step: 0,
            now: Instant::ZERO,
            violation: None,
            strict: false,
            findings: Vec::new(),
            leases: BTreeMap::new(),
            released: BTreeSet::new(),
            last_seq: BTreeMap::new(),
            lowered: BTreeSet::new(),
            edge_generations: BTreeMap::new(),
            node_generations: BTreeMap::new(),
            clients: BTreeMap::new(),
            ended: BTreeSet::new(),
            open: 0,
            provider_calls: BTreeSet::new(),
            node_runs: BTreeMap::new(),
            conn_seq: BTreeMap::new(),
            stall_seqs: BTreeSet::new(),
            journal: journal::JournalModel::default(),
            failover: failover::FailoverModel::default(),
        }
    }

    /// Record a violation (the first one wins); a known core issue
    /// ([`KNOWN_CORE_ISSUES`]) is a finding unless strict.
    pub fn fail(&mut self, rule: &'static str, detail: impl Into<String>) {
        let v = Violation {
            rule,
            detail: detail.into(),
            step: self.step,
            at_us: self.now.as_micros(),
        };
        if !self.strict && KNOWN_CORE_ISSUES.contains(&rule) {
            if self.findings.len() < MAX_FINDINGS {
                self.findings.push(v);
            }
            return;
        }
        if self.violation.is_none() {
            self.violation = Some(v);
        }
    }

    /// Treat known core issues ([`KNOWN_CORE_ISSUES`]) as violations.
    pub fn set_strict(&mut self, strict: bool) {
        self.strict = strict;
    }

    /// Known core issues seen (not violations unless strict).
    pub fn findings(&self) -> &[Violation] {
        &self.findings
    }

    /// The first violation, if any.
    pub fn violation(&self) -> Option<&Violation> {
        self.violation.as_ref()
    }

    /// Set the clock for the violations reported next.
    pub fn at(&mut self, step: u64, now: Instant) {
        self.step = step;
        self.now = now;
    }

    /// Client requests still open.
    pub fn open_requests(&self) -> usize {
        self.open
    }

    // ---- Edge lifecycle --------------------------------------------------

    /// A new Edge incarnation: a fresh dispatcher, nothing leased.
    pub fn edge_started(&mut self) {
        self.leases.clear();
        self.released.clear();
        self.last_seq.clear();
        self.lowered.clear();
        self.failover_edge_started();
    }

    /// The Edge process went away: every open request ended with it.
    pub fn edge_lost(&mut self, incarnation: u64) {
        let keys: Vec<_> = self
            .clients
            .keys()
            .filter(|(inc, _)| *inc == incarnation)
            .copied()
            .collect();
        for key in keys {
            self.client(key, ClientSaw::EdgeLost);
        }
    }

    /// R-GEN-1: the Edge handed `generation` to `node`.
    pub fn generation_handed_out(&mut self, node: &NodeId, generation: Generation) {
        let last = self.edge_generations.entry(node.clone()).or_insert(0);
        if generation <= *last {
            let last = *last;
            self.fail(
                "R-GEN-1",
                format!("{node} got generation {generation} after {last}"),
            );
            return;
        }
        *last = generation;
    }

    /// R-GEN-1 on the node side: node `node` was accepted on `generation`.
    pub fn node_registered(&mut self, node: usize, generation: Generation) {
        let last = self.node_generations.entry(node).or_insert(0);
        if generation <= *last {
            let last = *last;
            self.fail(
                "R-GEN-1",
                format!("node {node} accepted generation {generation} after {last}"),
            );
            return;
        }
        *last = generation;
    }

    // ---- Leases -----------------------------------------------------------

    /// A lease was granted (immediately or from the queue).
    pub fn lease_granted(&mut self, d: &Dispatcher, lease: &Lease) {
        if !d.registry().is_dispatchable(&lease.node, lease.generation) {
            self.fail(
                "R-GEN-2",
                format!(
                    "lease {} granted on {} generation {} which is not current and ready",
                    lease.lease_id, lease.node, lease.generation
                ),
            );
        }
        if self.released.contains(&lease.lease_id)
            || self
                .leases
                .insert(lease.lease_id, LeaseModel { sent: false })
                .is_some()
        {
            self.fail(
                "R-LEASE-1",
                format!("lease id {} granted twice", lease.lease_id),
            );
        }
    }

    /// R-SEL-1: the avoided provider is chosen only with the fallback flag
    /// and only when no alternate in the pool is runtime-eligible.
    pub fn selection(
        &mut self,
        d: &Dispatcher,
        lease: &Lease,
        avoid: Option<&ProviderId>,
        allow_avoided: bool,
        pool: &[ProviderId],
    ) {
        if avoid != Some(&lease.provider_id) {
            return;
        }
        if !allow_avoided {
            self.fail(
                "R-SEL-1",
                format!(
                    "avoided provider {} chosen without the fallback flag",
                    lease.provider_id
                ),
            );
            return;
        }
        if let Some(alternate) = pool
            .iter()
            .find(|p| Some(*p) != avoid && d.admission().is_selectable(p))
        {
            let detail = format!(
                "avoided provider {} chosen while {alternate} is eligible",
                lease.provider_id
            );
            self.fail("R-SEL-1", detail);
        }
    }

    /// A lease was released (terminal, fence, cancel, pre-send fence).
    pub fn lease_released(&mut self, lease_id: LeaseId, how: &str) {
        if self.leases.remove(&lease_id).is_some() {
            remember(&mut self.released, lease_id);
        } else if self.released.contains(&lease_id) {
            self.fail(
                "R-LEASE-2",
                format!("lease {lease_id} released twice (again by {how})"),
            );
        } else {
            self.fail(
                "R-LEASE-2",
                format!("release ({how}) of lease {lease_id} that was never granted"),
            );
        }
    }

    /// The Edge is about to send the run of `lease`.
    pub fn lease_sent(&mut self, d: &Dispatcher, lease: &Lease, has_link: bool) {
        if !d.registry().is_dispatchable(&lease.node, lease.generation) || !has_link {
            self.fail(
                "R-GEN-4",
                format!(
                    "run {} sent on {} generation {} which is not current and ready",
                    lease.run_id, lease.node, lease.generation
                ),
            );
        }
        if self.released.contains(&lease.lease_id) {
            self.fail(
                "R-LEASE-2",
                format!("run sent on released lease {}", lease.lease_id),
            );
            return;
        }
        match self.leases.get_mut(&lease.lease_id) {
            Some(l) if l.sent => self.fail(
                "provider-once",
                format!("lease {} sent twice", lease.lease_id),
            ),
            Some(l) => l.sent = true,
            None => self.fail(
                "R-LEASE-1",
                format!("run sent on unknown lease {}", lease.lease_id),
            ),
        }
    }

    /// R-GEN-3: a message attributed to the fenced `generation` of `node`
    /// reached the dispatcher; it must have been ignored and counted once.
    pub fn fenced_message(
        &mut self,
        node: &NodeId,
        generation: Generation,
        ignored: bool,
        counted: u64,
    ) {
        if !ignored {
            self.fail(
                "R-GEN-3",
                format!("a message of {node}'s fenced generation {generation} was processed"),
            );
        } else if counted != 1 {
            self.fail(
                "R-GEN-3",
                format!(
                    "a message of {node}'s fenced generation {generation} was counted {counted} times"
                ),
            );
        }
    }

    /// R-GEN-4: a pre-send for `lease` reached the dispatcher after the
    /// lease's generation was fenced (and the lease released): it must not
    /// be answered `Send`, nor release the lease again.
    pub fn pre_send_after_fence(&mut self, d: &Dispatcher, lease: &Lease, answer: &PreSend) {
        match answer {
            PreSend::UnknownLease => {}
            PreSend::Send(l) => {
                let dispatchable = d.registry().is_dispatchable(&l.node, l.generation);
                self.fail(
                    "R-GEN-4",
                    format!(
                        "pre-send answered Send for lease {} after its generation {} of {} was fenced (dispatchable: {dispatchable})",
                        lease.lease_id, lease.generation, lease.node
                    ),
                );
            }
            PreSend::Refenced => self.fail(
                "R-LEASE-2",
                format!(
                    "pre-send released lease {} again after its fence",
                    lease.lease_id
                ),
            ),
        }
    }

    /// A terminal was applied (or ignored) by the dispatcher. `was_lowered`
    /// is the overlay state of the lease's provider before the call.
    pub fn terminal_applied(
        &mut self,
        verdict: &TerminalVerdict,
        failure: Option<&ExecutionFailure>,
    ) {
        let TerminalVerdict::Applied {
            lease,
            stall,
            evidence,
        } = verdict
        else {
            return;
        };
        self.lease_released(lease.lease_id, "terminal");
        let is_stall = failure.is_some_and(|f| f.code == FailureCode::ResponseStalled);
        if is_stall != stall.is_some() {
            self.fail(
                "R-OVL-1",
                format!(
                    "stall handoff {} for a {} terminal",
                    stall.is_some(),
                    failure.map_or("success", |f| f.code.as_str())
                ),
            );
        }
        let (Some(f), Some(outcome)) = (failure, evidence) else {
            return;
        };
        let key = (lease.provider_id.clone(), lease.generation);
        let fresh = f
            .health_observation_seq
            .is_some_and(|seq| self.last_seq.get(&key).is_none_or(|last| seq > *last));
        let health = f.provider_health.unwrap_or(ProviderHealth::Unknown);
        let expected = match (fresh, health) {
            (false, _) => EvidenceOutcome::Stale,
            (true, ProviderHealth::Unavailable) => EvidenceOutcome::Lowered,
            (true, _) => EvidenceOutcome::Recorded,
        };
        if *outcome != expected {
            self.fail(
                "R-OVL-2",
                format!(
                    "evidence {:?} (seq {:?}, {}) gave {} where {} was due",
                    key,
                    f.health_observation_seq,
                    health.as_str(),
                    outcome.as_str(),
                    expected.as_str()
                ),
            );
        }
        if fresh && let Some(seq) = f.health_observation_seq {
            self.last_seq.insert(key.clone(), seq);
        }
        if expected == EvidenceOutcome::Lowered {
            self.lowered.insert(key);
        }
    }

    /// A CAPABILITIES answer from `generation` was applied.
    pub fn capabilities_applied(
        &mut self,
        generation: Generation,
        seq: u64,
        verdicts: &[CapabilityVerdict],
    ) {
        for v in verdicts {
            let key = (v.provider_id.clone(), generation);
            let fresh = self.last_seq.get(&key).is_none_or(|last| seq > *last);
            let lowered = self.lowered.contains(&key);
            let expected = if !fresh {
                RecoveryOutcome::Stale
            } else if v.health != ProviderHealth::Available {
                RecoveryOutcome::NotAvailable
            } else if !lowered {
                RecoveryOutcome::NotLowered
            } else {
                RecoveryOutcome::Recovered
            };
            if v.recovery != expected {
                self.fail(
                    "R-CAP-1",
                    format!(
                        "capabilities {key:?} seq {seq} {} gave {} where {} was due",
                        v.health.as_str(),
                        v.recovery.as_str(),
                        expected.as_str()
                    ),
                );
            }
            if expected == RecoveryOutcome::Recovered {
                self.lowered.remove(&key);
            }
            // Every fresh `available` moves the freshness mark (R-OVL-2).
            if matches!(
                expected,
                RecoveryOutcome::Recovered | RecoveryOutcome::NotLowered
            ) {
                self.last_seq.insert(key, seq);
            }
        }
    }

    // ---- Clients ------------------------------------------------------------

    /// A client request was accepted at `now` with this deadline.
    pub fn request_opened(&mut self, key: (u64, RequestId), deadline: Instant) {
        if self.ended.contains(&key)
            || self
                .clients
                .insert(
                    key,
                    ClientModel {
                        deadline,
                        committed: false,
                    },
                )
                .is_some()
        {
            self.fail("R-GATE-1", format!("request {key:?} opened twice"));
        } else {
            self.open += 1;
        }
    }

    /// The client of `key` saw `what`.
    pub fn client(&mut self, key: (u64, RequestId), what: ClientSaw) {
        if self.ended.contains(&key) {
            let detail = format!("{what:?} reached request {key:?} after its end");
            self.fail("R-GATE-3", detail);
            return;
        }
        let Some(c) = self.clients.get_mut(&key) else {
            self.fail(
                "R-GATE-1",
                format!("delivery {what:?} to unknown request {key:?}"),
            );
            return;
        };
        match what {
            ClientSaw::Commit if c.committed => {
                self.fail("R-GATE-2", format!("request {key:?} committed twice"));
            }
            ClientSaw::Commit => c.committed = true,
            ClientSaw::Content if !c.committed => {
                self.fail(
                    "R-GATE-2",
                    format!("content reached request {key:?} before the commit"),
                );
            }
            ClientSaw::Content => {}
            ClientSaw::Terminal | ClientSaw::Left | ClientSaw::EdgeLost => {
                self.clients.remove(&key);
                remember(&mut self.ended, key);
                self.open -= 1;
            }
        }
    }

    /// A request's gate ended: it must hold no lease and no queue slot.
    pub fn gate_ended(&mut self, d: &Dispatcher, request_id: RequestId) {
        if let Some(lease) = d.admission().lease_of_request(request_id) {
            let id = lease.lease_id;
            self.fail(
                "R-LEASE-2",
                format!("request {request_id} ended while still holding lease {id}"),
            );
        }
        if d.admission().is_queued(request_id) {
            self.fail(
                "R-LEASE-2",
                format!("request {request_id} ended while still queued"),
            );
        }
    }

    // ---- Node side ------------------------------------------------------------

    /// The node called the provider for run `run_id` on `conn`.
    pub fn provider_called(&mut self, conn: ConnId, run_id: RunId) {
        if !self.provider_calls.insert((conn, run_id)) {
            self.fail(
                "provider-once",
                format!("provider called twice for run {run_id} on {conn:?}"),
            );
        }
        self.node_runs
            .insert((conn, run_id), NodeRunModel::default());
    }

    /// The watchdog claimed a stall of the run (it asked for a probe).
    pub fn stall_claimed(&mut self, conn: ConnId, run_id: RunId) {
        let now = self.now;
        if let Some(r) = self.node_runs.get_mut(&(conn, run_id)) {
            if r.claimed_at.is_some() {
                self.fail("R-WD-2", format!("run {run_id} stall claimed twice"));
                return;
            }
            r.claimed_at = Some(now);
        }
    }

    /// The provider call of the run returned (reported to the watchdog).
    pub fn provider_returned(&mut self, conn: ConnId, run_id: RunId) {
        let now = self.now;
        if let Some(r) = self.node_runs.get_mut(&(conn, run_id))
            && r.returned_at.is_none()
        {
            r.returned_at = Some(now);
        }
    }

    /// The probe of the run answered (reported to the watchdog).
    pub fn probe_answered(&mut self, conn: ConnId, run_id: RunId, health: ProviderHealth) {
        let now = self.now;
        if let Some(r) = self.node_runs.get_mut(&(conn, run_id))
            && r.probe.is_none()
        {
            r.probe = Some((now, health));
        }
    }

    /// A connection's observation sequence handed out `seq` (R-SEQ-1).
    pub fn observation_seq(&mut self, conn: ConnId, seq: Option<u64>) {
        let last = self.conn_seq.entry(conn).or_insert(0);
        let expected = *last + 1;
        match seq {
            Some(s) if s == expected => *last = s,
            other => self.fail(
                "R-SEQ-1",
                format!("{conn:?} handed out {other:?} where {expected} was due"),
            ),
        }
    }

    /// The watchdog emitted the run's terminal.
    pub fn node_terminal(&mut self, conn: ConnId, run_id: RunId, terminal: &RunTerminal) {
        let now = self.now;
        let timing = self.timing;
        let Some(r) = self.node_runs.get_mut(&(conn, run_id)) else {
            return;
        };
        if r.terminated {
            self.fail("R-WD-6", format!("second terminal for run {run_id}"));
            return;
        }
        r.terminated = true;
        let r = r.clone();
        let RunTerminal::Failed(f) = terminal else {
            return;
        };
        if f.code != FailureCode::ResponseStalled {
            // Outside a stall the node marks retryable exactly what another
            // provider may answer (R-FAIL-1) and carries no evidence.
            let may_fail_over = matches!(
                f.code,
                FailureCode::ProviderUnreachable | FailureCode::NodeOverloaded
            ) || (f.code == FailureCode::ProviderError
                && f.http_status
                    .is_none_or(|s| s == 429 || (500..=599).contains(&s)));
            if f.retryable != may_fail_over || f.provider_health.is_some() {
                self.fail(
                    "R-WD-8",
                    format!(
                        "non-stall terminal of run {run_id} carries a wrong retry hint or evidence"
                    ),
                );
            }
            return;
        }
        let Some(claim) = r.claimed_at else {
            self.fail(
                "R-WD-2",
                format!("stall terminal of run {run_id} without a claim"),
            );
            return;
        };
        let latest = claim + timing.close_grace.max(timing.probe_bound) + r.frozen;
        if now > latest {
            self.fail(
                "R-WD-3",
                format!(
                    "stall terminal of run {run_id} {}us after the claim, bound {}us",
                    (now - claim).as_micros(),
                    (latest - claim).as_micros()
                ),
            );
        }
        let within_grace = r
            .returned_at
            .is_some_and(|at| at < claim + timing.close_grace);
        if f.retryable != within_grace {
            self.fail(
                "R-WD-4",
                format!(
                    "run {run_id} retryable={} but returned within grace={within_grace}",
                    f.retryable
                ),
            );
        }
        let expected = match r.probe {
            Some((at, health)) if at < claim + timing.probe_bound => health,
            _ => ProviderHealth::Unknown,
        };
        let health = f.provider_health.unwrap_or(ProviderHealth::Unknown);
        if health != expected
            || f.liveness_classification != Some(expected.liveness_classification())
        {
            self.fail(
                "R-WD-5",
                format!(
                    "run {run_id} evidence {}/{:?} where {} was due",
                    health.as_str(),
                    f.liveness_classification,
                    expected.as_str()
                ),
            );
        }
    }

    /// A node emitted a stall terminal on `conn` with observation sequence
    /// number `seq`.
    pub fn stall_seq_issued(&mut self, conn: ConnId, seq: Option<u64>) {
        if let Some(seq) = seq {
            self.stall_seqs.insert((conn, seq));
        }
    }

    /// The Edge read a stall terminal on `conn` carrying `seq`: it must be
    /// one that connection's sequence issued for a stall terminal (R-SEQ-1:
    /// evidence is read under the generation of the connection it arrives
    /// on, so evidence of another connection would be misattributed).
    pub fn stall_evidence_received(&mut self, conn: ConnId, seq: Option<u64>) {
        if let Some(seq) = seq
            && !self.stall_seqs.contains(&(conn, seq))
        {
            self.fail(
                "R-SEQ-1",
                format!(
                    "a stall terminal on {conn:?} carries observation sequence number {seq}, which that connection did not issue (evidence of another connection)"
                ),
            );
        }
    }

    /// The node process of `conn` went on after a freeze of `frozen`: a
    /// stall it had claimed gets its terminal that much later (R-WD-3
    /// bounds the process's running time).
    pub fn node_thawed(&mut self, conn: ConnId, frozen: Duration) {
        for ((c, _), r) in &mut self.node_runs {
            if *c == conn && r.claimed_at.is_some() && !r.terminated {
                r.frozen += frozen;
            }
        }
    }

    /// A node connection ended: forget its runs (bounded state).
    pub fn node_conn_ended(&mut self, conn: ConnId) {
        self.stall_seqs.retain(|(c, _)| *c != conn);
        self.node_runs.retain(|(c, _), _| *c != conn);
        self.provider_calls.retain(|(c, _)| *c != conn);
        self.conn_seq.remove(&conn);
    }

    // ---- After every step -----------------------------------------------------

    /// The per-step checks of the Edge state. `providers` lists every
    /// provider with its node.
    pub fn check_edge(&mut self, d: &Dispatcher, providers: &[(ProviderId, NodeId)]) {
        if let Err(e) = d.admission().check_invariants() {
            self.fail("R-LEASE-2", format!("admission: {e}"));
            return;
        }
        let mut held = 0usize;
        for id in self.leases.keys() {
            let Some(lease) = d.admission().lease(*id) else {
                let id = *id;
                self.fail(
                    "R-LEASE-2",
                    format!("lease {id} vanished without a release"),
                );
                return;
            };
            held += 1;
            if !d.registry().is_dispatchable(&lease.node, lease.generation) {
                let detail = format!(
                    "lease {id} outlived its generation {} of {}",
                    lease.generation, lease.node
                );
                self.fail("R-GEN-3", detail);
                return;
            }
        }
        if held != d.admission().leases_in_use() {
            let in_use = d.admission().leases_in_use();
            self.fail(
                "R-LEASE-2",
                format!("{in_use} leases in use, the model holds {held}"),
            );
            return;
        }
        for (p, node) in providers {
            let Some(g) = d.registry().view(node).generation else {
                continue;
            };
            let actual = d.overlay().is_lowered(p, g);
            let model = self.lowered.contains(&(p.clone(), g));
            if actual != model {
                self.fail(
                    "R-OVL-2",
                    format!("overlay of {p} in generation {g} is lowered={actual}, model {model}"),
                );
                return;
            }
        }
        if let Some(detail) = servable_queued_request(d) {
            self.fail("R-SEL-1", detail);
            return;
        }
        if self.open == 0 && (d.admission().leases_in_use() > 0 || d.admission().queue_depth() > 0)
        {
            let detail = format!(
                "no request open but {} leases in use and {} queued",
                d.admission().leases_in_use(),
                d.admission().queue_depth()
            );
            self.fail("quiet-zero", detail);
        }
    }

    /// Liveness: no request stays open past its deadline (the gate's total
    /// budget).
    pub fn check_deadlines(&mut self) {
        let now = self.now;
        if let Some((key, c)) = self.clients.iter().find(|(_, c)| now > c.deadline) {
            let detail = format!(
                "request {key:?} still open {}us past its budget",
                (now - c.deadline).as_micros()
            );
            self.fail("liveness-request", detail);
        }
    }
}

/// The other side of R-SEL-1: after every step, no queued request could be
/// served. A request waits only while no provider it may take has room: an
/// eligible alternate (not the avoided one) with room, or, with the
/// fallback flag and no eligible alternate at all, the avoided provider
/// with room.
fn servable_queued_request(d: &Dispatcher) -> Option<String> {
    let capacity: BTreeMap<ProviderId, bool> = d
        .admission()
        .capacity_view()
        .into_iter()
        .map(|c| (c.provider_id, c.in_use < c.capacity))
        .collect();
    let selectable = |p: &ProviderId| d.admission().is_selectable(p);
    let has_room = |p: &ProviderId| capacity.get(p).copied().unwrap_or(false);
    for r in d.admission().queued_requests() {
        let avoided = r.avoid_provider_id.as_ref();
        let alternates: Vec<&ProviderId> = r
            .pool
            .iter()
            .filter(|p| Some(*p) != avoided && selectable(p))
            .collect();
        if let Some(p) = alternates.iter().find(|p| has_room(p)) {
            return Some(format!(
                "request {} waits in the queue while {p} is eligible with room",
                r.request_id
            ));
        }
        if let Some(p) = avoided
            && alternates.is_empty()
            && r.allow_avoided_fallback
            && r.pool.contains(p)
            && selectable(p)
            && has_room(p)
        {
            return Some(format!(
                "request {} waits in the queue while its avoided {p} is its only eligible provider, with room and the fallback flag",
                r.request_id
            ));
        }
    }
    None
}
