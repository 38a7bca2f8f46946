//! Fuzz harness bodies for the core machines, kept in the library so
//! `cargo test` on stable replays the committed seed corpus
//! (`fuzz/corpus/core_dispatch/`, `fuzz/corpus/core_watchdog/`) and
//! `cargo fuzz` drives the same code (`fuzz/fuzz_targets/core_*.rs`).
//!
//! Each harness decodes arbitrary bytes into a bounded sequence of core
//! inputs, drives one machine the way a shell does (input, drain every
//! output, fire timers at `poll_timeout()`), and checks, after every input,
//! the invariants of the core's property tests against a model of its own:
//!
//! * [`fuzz_dispatch_sequence`] (Edge `Dispatcher`): capacity never leaks or
//!   goes negative; each lease is released exactly once; nothing is leased or
//!   sent on a generation that is not current and ready; a message of a
//!   fenced generation is ignored and counted; stall evidence lowers the
//!   overlay only when fresh; the avoided provider is chosen only as R-SEL-1
//!   allows; generations strictly increase; once every node left, no lease
//!   is held.
//! * [`fuzz_watchdog_sequence`] (Node `Watchdog`): one terminal per run, and
//!   every run gets it once the connection ends; a stall is claimed once and
//!   its terminal comes by `claim + max(grace, probe bound)`; fenced output
//!   is never forwarded; the observation sequence increases by one.
//!
//! A panic is a bug: either in the core or in the harness's model. Bytes are
//! read through [`Bytes`], which yields zeros once the input is exhausted,
//! so every input decodes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use iop_core::Instant;
use iop_core::edge::admission::{
    AdmissionConfig, DispatchRequest, Lease, LeaseId, PreSend, ProviderSpec, RequestId,
};
use iop_core::edge::dispatch::{
    CapabilityVerdict, DispatchConfig, DispatchInput, DispatchOutput, Dispatcher, IgnoredTerminal,
    ProbeAnswer, RequestCommand, RequestEvent, TerminalVerdict,
};
use iop_core::edge::health::{HealthConfig, ProbeTicket};
use iop_core::edge::overlay::{EvidenceOutcome, RecoveryOutcome};
use iop_core::edge::registry::RejectCause;
use iop_core::ids::{Generation, NodeId, ProviderId, RunId};
use iop_core::node::session::ObservationSequence;
use iop_core::node::watchdog::{
    CancelReason, Emission, ProbeOutcome, Progress, ProviderOutcome, RunKind, RunTerminal,
    Watchdog, WatchdogConfig, WatchdogOutput,
};
use iop_wire::{
    AdapterKind, CapabilitiesReport, CloseCode, ExecutionFailure, FailureCode, HealthFailureCode,
    LivenessClassification, PROTOCOL_VERSION, ProviderHealth, RegisterRequest, TargetHealth,
};

/// The most inputs one harness run decodes.
pub const MAX_OPS: usize = 512;

/// The most timer firings one time step may take (a timer that never moves
/// past `now` is a liveness bug).
const MAX_FIRINGS_PER_ADVANCE: usize = 4096;

/// A cursor over the fuzz input; reads past the end yield zero.
#[derive(Debug)]
pub struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    /// Whether every byte was read.
    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    /// The next byte (0 past the end).
    pub fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos = self.pos.saturating_add(1);
        b
    }

    /// A value in `0..n` (`0` if `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            usize::from(self.byte()) % n
        }
    }

    /// A boolean.
    pub fn flag(&mut self) -> bool {
        self.byte() & 1 == 1
    }
}

// ---- Edge dispatcher -------------------------------------------------------

const NODES: [&str; 3] = ["a", "b", "c"];

fn register_request() -> RegisterRequest {
    RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        node_version: "fuzz".into(),
        providers: vec![],
        max_concurrent_runs: 8,
        recipient_public_key: None,
        parked: Vec::new(),
    }
}

fn health_of(b: u8) -> ProviderHealth {
    match b % 3 {
        0 => ProviderHealth::Available,
        1 => ProviderHealth::Unavailable,
        _ => ProviderHealth::Unknown,
    }
}

/// The harness's own model of what the dispatcher must hold.
#[derive(Debug, Default)]
struct DispatchModel {
    now: Instant,
    /// Every generation handed out, per node, in order.
    generations: BTreeMap<usize, Vec<Generation>>,
    /// Each node's current generation and whether it completed readiness.
    current: BTreeMap<usize, (Generation, bool)>,
    granted: BTreeMap<LeaseId, Lease>,
    released: BTreeSet<LeaseId>,
    requests: BTreeMap<RequestId, DispatchRequest>,
    next_request: RequestId,
    /// Observation sequence values handed out, per (node, generation).
    seqs: BTreeMap<(usize, Generation), u64>,
    /// Last applied evidence sequence and lowered state, per
    /// (provider, generation) (R-OVL-2, R-CAP-1).
    last_seq: BTreeMap<(ProviderId, Generation), u64>,
    lowered: BTreeSet<(ProviderId, Generation)>,
    tickets: Vec<(ProbeTicket, usize, Option<Generation>)>,
    /// The persisted generation mark (`None`: no store).
    durable_mark: Option<Generation>,
    /// Marks asked to be saved and not answered yet.
    saves: Vec<Generation>,
}

impl DispatchModel {
    fn node_index(node: &NodeId) -> usize {
        NODES.iter().position(|n| *n == node.as_str()).unwrap_or(0)
    }

    fn is_current(&self, node: usize, generation: Generation) -> bool {
        self.current.get(&node).map(|c| c.0) == Some(generation)
    }

    fn is_dispatchable(&self, node: usize, generation: Generation) -> bool {
        self.current.get(&node) == Some(&(generation, true))
    }

    /// A generation of `node`: its current one, an older one, or one never
    /// handed out.
    fn pick_generation(&self, node: usize, b: u8) -> Option<Generation> {
        let gens = self.generations.get(&node)?;
        let last = *gens.last()?;
        Some(match b % 4 {
            0 | 1 => last,
            2 => gens[usize::from(b / 4) % gens.len()],
            _ => last + 1,
        })
    }

    /// A sequence value for an observation of (`node`, `generation`): the
    /// next one, or one from the past or the future.
    fn seq(&mut self, node: usize, generation: Generation, b: u8) -> u64 {
        let next = self.seqs.entry((node, generation)).or_insert(0);
        match b % 4 {
            0 | 1 => {
                *next += 1;
                *next
            }
            2 => next.saturating_sub(u64::from(b / 4) % 4),
            _ => *next + 1 + u64::from(b / 4) % 3,
        }
    }

    fn release(&mut self, lease_id: LeaseId, how: &str) {
        assert!(
            self.granted.contains_key(&lease_id),
            "R-LEASE-2: {how} released lease {lease_id} that was never granted"
        );
        assert!(
            self.released.insert(lease_id),
            "R-LEASE-2: lease {lease_id} released twice (again by {how})"
        );
    }

    fn leased(&mut self, d: &Dispatcher, lease: Lease) {
        let node = Self::node_index(&lease.node);
        assert!(
            self.is_dispatchable(node, lease.generation),
            "R-GEN-2: lease {} granted on {} generation {} which is not current and ready",
            lease.lease_id,
            lease.node,
            lease.generation
        );
        if let Some(request) = self.requests.get(&lease.request_id) {
            check_avoid_rule(d, request, &lease);
        }
        assert!(
            self.granted.insert(lease.lease_id, lease).is_none(),
            "R-LEASE-1: a lease id was granted twice"
        );
    }

    /// R-OVL-2: what stall evidence must do, and the model after it.
    fn evidence(&mut self, lease: &Lease, failure: &ExecutionFailure, outcome: EvidenceOutcome) {
        let key = (lease.provider_id.clone(), lease.generation);
        let fresh = failure
            .health_observation_seq
            .is_some_and(|seq| self.last_seq.get(&key).is_none_or(|last| seq > *last));
        let health = failure.provider_health.unwrap_or(ProviderHealth::Unknown);
        let expected = match (fresh, health) {
            (false, _) => EvidenceOutcome::Stale,
            (true, ProviderHealth::Unavailable) => EvidenceOutcome::Lowered,
            (true, _) => EvidenceOutcome::Recorded,
        };
        assert_eq!(
            outcome, expected,
            "R-OVL-2: evidence {key:?} seq {:?} {health:?}",
            failure.health_observation_seq
        );
        if let (true, Some(seq)) = (fresh, failure.health_observation_seq) {
            self.last_seq.insert(key.clone(), seq);
        }
        if expected == EvidenceOutcome::Lowered {
            self.lowered.insert(key);
        }
    }

    /// R-CAP-1: what a CAPABILITIES answer from (`node`, `generation`) must
    /// do for each provider it matched exactly.
    fn capabilities(
        &mut self,
        node: usize,
        generation: Generation,
        report: &CapabilitiesReport,
        verdicts: &[CapabilityVerdict],
        counted: u64,
    ) {
        if !self.is_current(node, generation) {
            assert!(
                verdicts.is_empty(),
                "R-GEN-3: a CAPABILITIES answer of fenced generation {generation} was applied"
            );
            assert_eq!(counted, 1, "R-GEN-3: a fenced message is counted once");
            return;
        }
        let seq = report.health_observation_seq;
        for v in verdicts {
            let key = (v.provider_id.clone(), generation);
            let fresh = self.last_seq.get(&key).is_none_or(|last| seq > *last);
            let expected = if !fresh {
                RecoveryOutcome::Stale
            } else if v.health != ProviderHealth::Available {
                RecoveryOutcome::NotAvailable
            } else if !self.lowered.contains(&key) {
                RecoveryOutcome::NotLowered
            } else {
                RecoveryOutcome::Recovered
            };
            assert_eq!(v.recovery, expected, "R-CAP-1: {key:?} seq {seq}");
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
}

fn check_avoid_rule(d: &Dispatcher, request: &DispatchRequest, lease: &Lease) {
    if request.avoid_provider_id.as_ref() != Some(&lease.provider_id) {
        return;
    }
    assert!(
        request.allow_avoided_fallback,
        "R-SEL-1: avoided provider chosen without the fallback flag"
    );
    let alternate = request
        .pool
        .iter()
        .filter(|p| Some(*p) != request.avoid_provider_id.as_ref())
        .any(|p| d.admission().is_selectable(p));
    assert!(
        !alternate,
        "R-SEL-1: avoided provider chosen while an alternate is eligible"
    );
}

/// Feed one input; its answer is its first output (the harness drains
/// every output after every step).
fn answer(d: &mut Dispatcher, now: Instant, input: DispatchInput) -> Option<DispatchOutput> {
    d.handle_input(now, input);
    let first = d.poll_output();
    if let Some(DispatchOutput::ToRequest {
        event: RequestEvent::Leased(_),
        ..
    }) = &first
    {
        panic!("an answer the harness reads was a lease: {first:?}");
    }
    first
}

/// Feed one input and take every output it caused.
fn outputs_of(d: &mut Dispatcher, now: Instant, input: DispatchInput) -> Vec<DispatchOutput> {
    d.handle_input(now, input);
    std::iter::from_fn(|| d.poll_output()).collect()
}

/// The CAPABILITIES verdicts among `outputs`, in order.
fn verdicts_in(outputs: &[DispatchOutput]) -> Vec<CapabilityVerdict> {
    outputs
        .iter()
        .filter_map(|o| match o {
            DispatchOutput::Capability(v) => Some(v.clone()),
            _ => None,
        })
        .collect()
}

fn drain_dispatch(d: &mut Dispatcher, m: &mut DispatchModel) {
    while let Some(out) = d.poll_output() {
        carry(d, m, out);
    }
}

/// Check one output against the model and apply it there.
fn carry(d: &mut Dispatcher, m: &mut DispatchModel, out: DispatchOutput) {
    match out {
        DispatchOutput::ToRequest {
            event: RequestEvent::Leased(lease),
            ..
        } => m.leased(d, lease),
        DispatchOutput::ToRequest {
            event: RequestEvent::LeaseFenced(lease),
            ..
        } => {
            let node = DispatchModel::node_index(&lease.node);
            assert!(
                !m.is_current(node, lease.generation),
                "R-GEN-3: a lease of the current generation was fenced"
            );
            m.release(lease.lease_id, "the fence");
        }
        DispatchOutput::ToRequest {
            request_id,
            event: RequestEvent::QueueExpired,
        } => {
            assert!(
                d.admission().lease_of_request(request_id).is_none(),
                "an expired request holds a lease"
            );
        }
        DispatchOutput::ProbeDue {
            ticket,
            node,
            generation,
        } => {
            let node = DispatchModel::node_index(&node);
            if let Some(g) = generation {
                assert!(
                    m.is_dispatchable(node, g),
                    "a probe is due on a generation that is not current and ready"
                );
            }
            if m.tickets.len() < 64 {
                m.tickets.push((ticket, node, generation));
            }
        }
        DispatchOutput::SaveGenerationMark { mark } => {
            assert!(
                m.durable_mark.is_some(),
                "R-GEN-1: a save asked for with no store"
            );
            assert!(m.saves.is_empty(), "a second save while one is in flight");
            m.saves.push(mark);
        }
        DispatchOutput::CloseConnection { .. }
        | DispatchOutput::Fenced { .. }
        | DispatchOutput::NodeReady { .. }
        | DispatchOutput::Registered { .. }
        | DispatchOutput::ReadyAnswer { .. }
        | DispatchOutput::ToRequest { .. }
        | DispatchOutput::CancelRun { .. }
        | DispatchOutput::StallEvidence { .. }
        | DispatchOutput::Capability(_)
        | DispatchOutput::Health(_)
        | DispatchOutput::ParkedRuns { .. }
        | DispatchOutput::KeptRuns(_) => {}
    }
}

fn check_dispatch(d: &Dispatcher, m: &DispatchModel) {
    if let Err(e) = d.admission().check_invariants() {
        panic!("R-LEASE-2: admission: {e}");
    }
    let mut held = 0usize;
    for (id, lease) in &m.granted {
        let is_held = d.admission().lease(*id).is_some();
        assert_eq!(
            is_held,
            !m.released.contains(id),
            "R-LEASE-2: lease {id} held={is_held} but the model released={}",
            m.released.contains(id)
        );
        if is_held {
            held += 1;
            let node = DispatchModel::node_index(&lease.node);
            assert!(
                m.is_dispatchable(node, lease.generation),
                "R-GEN-3: lease {id} outlived its generation {}",
                lease.generation
            );
        }
    }
    assert_eq!(
        d.admission().leases_in_use(),
        held,
        "R-LEASE-2: leases in use differ from the granted, unreleased ones"
    );
    for (node, (g, _)) in &m.current {
        for p in d
            .admission()
            .providers()
            .filter(|p| p.node.as_str() == NODES[*node])
        {
            let key = (p.id.clone(), *g);
            assert_eq!(
                d.overlay().is_lowered(&p.id, *g),
                m.lowered.contains(&key),
                "R-OVL-2: overlay of {key:?} differs from the model"
            );
        }
    }
}

/// Decode `data` into a sequence of Edge dispatcher inputs (connect, ready,
/// disconnect, request, pre-send, terminal, cancel, CAPABILITIES answers,
/// probe answers, late messages, time) and check the dispatcher's rules
/// after each one. Panics on a violation.
pub fn fuzz_dispatch_sequence(data: &[u8]) {
    fuzz_dispatch_sequence_with(data, |_| {});
}

/// [`fuzz_dispatch_sequence`] with a hook called on the new dispatcher
/// first (a test plants a core bug there to see the harness catch it).
pub fn fuzz_dispatch_sequence_with(data: &[u8], setup: impl FnOnce(&Dispatcher)) {
    let mut input = Bytes::new(data);
    let nodes = 1 + input.below(3);
    let per_node = 1 + input.below(2);
    let providers: Vec<ProviderSpec> = (0..nodes * per_node)
        .map(|i| ProviderSpec {
            id: ProviderId::new(format!("p{i}")),
            node: NodeId::from(NODES[i / per_node]),
            adapter: AdapterKind::Mock,
            target: format!("t{i}"),
            capacity: 1 + input.below(3) as u32,
            stall_timeout_ms: 1000,
        })
        .collect();
    let refresh_ms = 100 + 50 * input.below(20) as u64;
    let floor = input.below(4) as u64 * 100;
    // R-GEN-1 across restarts: no store (every generation covered), or a
    // persisted mark a few generations ahead that saves must keep up with.
    let generation_mark = match input.below(3) {
        0 => None,
        k => Some(floor + 2 * k as u64),
    };
    let config = DispatchConfig {
        admission: AdmissionConfig {
            queue_capacity: input.below(5),
            queue_timeout: Duration::from_millis(50 + 100 * input.below(10) as u64),
        },
        providers: providers.clone(),
        generation_floor: floor,
        generation_mark,
        known_nodes: None,
        health: HealthConfig {
            refresh_interval: Duration::from_millis(refresh_ms),
            backoff_base: Duration::from_millis(100),
            backoff_cap: Duration::from_millis(refresh_ms * 4),
            stale_after: Duration::from_millis(refresh_ms * 3),
            probe_timeout: Duration::from_millis(500),
        },
        capacity_from_node: Default::default(),
        parked_hold_ms: 0,
    };
    let Ok(mut d) = Dispatcher::new(Instant::ZERO, config) else {
        return;
    };
    setup(&d);
    let mut m = DispatchModel {
        durable_mark: generation_mark,
        ..DispatchModel::default()
    };
    let provider_ids: Vec<ProviderId> = providers.iter().map(|p| p.id.clone()).collect();
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        let now = m.now;
        match input.below(12) {
            0 => {
                let node = input.below(nodes);
                // A save in flight ends first, well or not, or stays.
                if let Some(&mark) = m.saves.first() {
                    let how = input.below(3);
                    if how < 2 {
                        m.saves.clear();
                        let saved = how == 1;
                        d.handle_input(now, DispatchInput::GenerationMarkSaved { mark, saved });
                        if saved {
                            m.durable_mark = m.durable_mark.map(|d| d.max(mark));
                        }
                    }
                }
                let registered = answer(
                    &mut d,
                    now,
                    DispatchInput::Register {
                        node: NodeId::from(NODES[node]),
                        request: register_request(),
                    },
                );
                match registered {
                    Some(DispatchOutput::Registered {
                        result: Ok((g, _)), ..
                    }) => {
                        assert!(
                            m.durable_mark.is_none_or(|d| g <= d),
                            "R-GEN-1: generation {g} above the durable mark {:?} was used",
                            m.durable_mark
                        );
                        assert!(
                            m.generations.values().flatten().all(|earlier| *earlier < g),
                            "R-GEN-1: generation {g} is not above every earlier one"
                        );
                        m.generations.entry(node).or_default().push(g);
                        m.current.insert(node, (g, false));
                    }
                    Some(DispatchOutput::Registered {
                        result: Err(rejection),
                        ..
                    }) if rejection.cause == RejectCause::GenerationNotDurable => {
                        assert!(
                            m.durable_mark.is_some(),
                            "R-GEN-1: refused as not durable with no store"
                        );
                        // The node's earlier connection was replaced, the
                        // new generation fenced at once.
                        m.current.remove(&node);
                    }
                    other => panic!("a valid registration was refused: {other:?}"),
                }
            }
            1 => {
                let node = input.below(nodes);
                let b = input.byte();
                if let Some(g) = m.pick_generation(node, b) {
                    let accepted = matches!(
                        answer(
                            &mut d,
                            now,
                            DispatchInput::Ready {
                                node: NodeId::from(NODES[node]),
                                generation: g,
                            },
                        ),
                        Some(DispatchOutput::ReadyAnswer { accepted: true, .. })
                    );
                    assert_eq!(
                        accepted,
                        m.is_current(node, g),
                        "R-GEN-2: only the current generation becomes ready"
                    );
                    if accepted {
                        m.current.insert(node, (g, true));
                    }
                }
            }
            2 => {
                let node = input.below(nodes);
                let b = input.byte();
                if let Some(g) = m.pick_generation(node, b) {
                    d.handle_input(
                        now,
                        DispatchInput::ConnectionClosed {
                            node: NodeId::from(NODES[node]),
                            generation: g,
                            reason: CloseCode::HeartbeatTimeout,
                        },
                    );
                    if m.is_current(node, g) {
                        m.current.remove(&node);
                    }
                }
            }
            3 | 4 => {
                m.next_request += 1;
                let pool: Vec<ProviderId> = match input.below(3) {
                    0 => provider_ids.clone(),
                    1 => vec![provider_ids[input.below(provider_ids.len())].clone()],
                    _ => provider_ids.iter().rev().cloned().collect(),
                };
                let avoid = input
                    .flag()
                    .then(|| provider_ids[input.below(provider_ids.len())].clone());
                let request = DispatchRequest {
                    request_id: m.next_request,
                    pool,
                    avoid_provider_id: avoid,
                    allow_avoided_fallback: input.flag(),
                    stall_timeout_ms: None,
                };
                m.requests.insert(request.request_id, request.clone());
                // A lease it is given is checked as the outputs are drained.
                d.handle_input(now, DispatchInput::Request(RequestCommand::Admit(request)));
            }
            5 => {
                let Some(lease) = pick_lease(&m, input.byte()) else {
                    continue;
                };
                let pre_send = answer(
                    &mut d,
                    now,
                    DispatchInput::Request(RequestCommand::PreSend {
                        request_id: lease.request_id,
                        lease_id: lease.lease_id,
                    }),
                );
                let Some(DispatchOutput::ToRequest {
                    event: RequestEvent::PreSend(pre_send),
                    ..
                }) = pre_send
                else {
                    panic!("a pre-send was not answered: {pre_send:?}");
                };
                match pre_send {
                    PreSend::Send(l) => {
                        assert!(
                            !m.released.contains(&l.lease_id),
                            "R-GEN-4: pre-send answered Send for released lease {}",
                            l.lease_id
                        );
                        assert!(
                            m.is_dispatchable(DispatchModel::node_index(&l.node), l.generation),
                            "R-GEN-4: pre-send passed a generation that is not current and ready"
                        );
                    }
                    PreSend::Refenced => m.release(lease.lease_id, "the pre-send fence"),
                    PreSend::UnknownLease => assert!(
                        m.released.contains(&lease.lease_id),
                        "pre-send does not know held lease {}",
                        lease.lease_id
                    ),
                }
            }
            6 | 7 => dispatch_terminal(&mut d, &mut m, &mut input, nodes, now),
            8 => {
                let id = 1 + input.byte() as u64 % m.next_request.max(1);
                let held = d.admission().lease_of_request(id).cloned();
                let outputs = outputs_of(
                    &mut d,
                    now,
                    DispatchInput::Request(RequestCommand::Cancel { request_id: id }),
                );
                if let Some(lease) = held {
                    assert_eq!(lease.request_id, id);
                    assert!(
                        outputs.iter().any(|o| matches!(o,
                            DispatchOutput::CancelRun { run_id, .. } if *run_id == lease.run_id)),
                        "a canceled lease's run is not canceled on its node"
                    );
                    m.release(lease.lease_id, "a client cancel");
                }
                for out in outputs {
                    carry(&mut d, &mut m, out);
                }
                assert!(
                    d.admission().lease_of_request(id).is_none() && !d.admission().is_queued(id),
                    "R-LEASE-2: a canceled request keeps a lease or a queue slot"
                );
            }
            9 => dispatch_capabilities(&mut d, &mut m, &mut input, nodes, &providers, now),
            10 => dispatch_probe_answer(&mut d, &mut m, &mut input, &providers, now),
            _ => {
                let step = Duration::from_millis(u64::from(input.byte()) * 20);
                advance_dispatch(&mut d, &mut m, step);
            }
        }
        drain_dispatch(&mut d, &mut m);
        check_dispatch(&d, &m);
    }
    // Every node goes away: nothing may stay leased (R-LEASE-2).
    let now = m.now;
    // One at a time: the queue may drain to a node still connected.
    while let Some((node, (g, _))) = m.current.pop_first() {
        d.handle_input(
            now,
            DispatchInput::ConnectionClosed {
                node: NodeId::from(NODES[node]),
                generation: g,
                reason: CloseCode::Normal,
            },
        );
        drain_dispatch(&mut d, &mut m);
    }
    check_dispatch(&d, &m);
    assert_eq!(
        d.admission().leases_in_use(),
        0,
        "R-LEASE-2: leases leaked after every node left"
    );
}

fn pick_lease(m: &DispatchModel, b: u8) -> Option<Lease> {
    if m.granted.is_empty() {
        return None;
    }
    // Prefer recent leases (the ones still held) but reach old ones too.
    let len = m.granted.len();
    let back = usize::from(b) % len.min(8);
    let index = if b & 0x80 == 0 {
        len - 1 - back
    } else {
        usize::from(b) % len
    };
    m.granted.values().nth(index).cloned()
}

fn dispatch_terminal(
    d: &mut Dispatcher,
    m: &mut DispatchModel,
    input: &mut Bytes<'_>,
    nodes: usize,
    now: Instant,
) {
    let Some(lease) = pick_lease(m, input.byte()) else {
        return;
    };
    let lease_node = DispatchModel::node_index(&lease.node);
    // Reception: the lease's own connection, an older or newer generation
    // of its node, or another node's current connection.
    let (node, generation) = match input.below(6) {
        0..=2 => (lease_node, lease.generation),
        3 => {
            let other = input.below(nodes);
            (other, m.current.get(&other).map_or(1, |c| c.0))
        }
        _ => {
            let b = input.byte();
            (
                lease_node,
                m.pick_generation(lease_node, b).unwrap_or(lease.generation),
            )
        }
    };
    let failure = match input.below(4) {
        0 => None,
        1 => Some(ExecutionFailure::new(FailureCode::ProviderError)),
        _ => {
            let health = health_of(input.byte());
            let seq_byte = input.byte();
            let seq = (seq_byte != 0xFF).then(|| m.seq(node, generation, seq_byte));
            Some(ExecutionFailure {
                provider_health: Some(health),
                liveness_classification: Some(health.liveness_classification()),
                health_observation_seq: seq,
                ..ExecutionFailure::new(FailureCode::ResponseStalled)
            })
        }
    };
    let counted_before = d.registry().fenced_messages();
    let held = !m.released.contains(&lease.lease_id);
    let answered = answer(
        d,
        now,
        DispatchInput::Request(RequestCommand::Terminal {
            request_id: lease.request_id,
            lease_id: lease.lease_id,
            node: NodeId::from(NODES[node]),
            generation,
            failure: failure.clone(),
        }),
    );
    let Some(DispatchOutput::ToRequest {
        event: RequestEvent::Terminal { verdict, .. },
        ..
    }) = answered
    else {
        panic!("a terminal was not answered: {answered:?}");
    };
    let counted = d.registry().fenced_messages() - counted_before;
    if !m.is_current(node, generation) {
        assert_eq!(
            verdict,
            TerminalVerdict::Ignored(IgnoredTerminal::FencedGeneration),
            "R-GEN-3: a terminal of fenced generation {generation} was not ignored as fenced"
        );
        assert_eq!(counted, 1, "R-GEN-3: a fenced message is counted once");
        return;
    }
    let own = node == lease_node && generation == lease.generation;
    match verdict {
        TerminalVerdict::Applied {
            lease: applied,
            stall,
            evidence,
        } => {
            assert!(
                own && held,
                "R-LEASE-1: a terminal applied to a foreign or released lease"
            );
            assert_eq!(
                applied, lease,
                "R-LEASE-1: the applied lease is the one named"
            );
            m.release(lease.lease_id, "its terminal");
            let is_stall = failure
                .as_ref()
                .is_some_and(|f| f.code == FailureCode::ResponseStalled);
            assert_eq!(
                stall.is_some(),
                is_stall,
                "R-OVL-1: every valid stall is handed off"
            );
            if let (Some(f), Some(outcome)) = (failure.as_ref(), evidence) {
                m.evidence(&lease, f, outcome);
            }
        }
        TerminalVerdict::Ignored(_) => {
            assert!(
                !(own && held),
                "R-LEASE-1: the valid current terminal of held lease {} was ignored",
                lease.lease_id
            );
        }
    }
}

fn capabilities_report(
    m: &mut DispatchModel,
    input: &mut Bytes<'_>,
    providers: &[ProviderSpec],
    node: usize,
    generation: Generation,
) -> CapabilitiesReport {
    let mut targets: Vec<TargetHealth> = providers
        .iter()
        .filter(|p| p.node.as_str() == NODES[node])
        .map(|p| TargetHealth {
            adapter: AdapterKind::Mock,
            target: p.target.clone(),
            status: health_of(input.byte()),
            failure_code: None,
            models: vec![],
        })
        .collect();
    if input.flag()
        && let Some(first) = targets.first().cloned()
    {
        // An ambiguous answer: the same target twice.
        targets.push(first);
    }
    let seq_byte = input.byte();
    CapabilitiesReport {
        targets,
        health_observation_seq: m.seq(node, generation, seq_byte),
    }
}

fn dispatch_capabilities(
    d: &mut Dispatcher,
    m: &mut DispatchModel,
    input: &mut Bytes<'_>,
    nodes: usize,
    providers: &[ProviderSpec],
    now: Instant,
) {
    let node = input.below(nodes);
    let b = input.byte();
    let Some(generation) = m.pick_generation(node, b) else {
        return;
    };
    let report = capabilities_report(m, input, providers, node, generation);
    let counted_before = d.registry().fenced_messages();
    let outputs = outputs_of(
        d,
        now,
        DispatchInput::Capabilities {
            node: NodeId::from(NODES[node]),
            generation,
            report: report.clone(),
        },
    );
    let counted = d.registry().fenced_messages() - counted_before;
    m.capabilities(node, generation, &report, &verdicts_in(&outputs), counted);
    for out in outputs {
        carry(d, m, out);
    }
}

fn dispatch_probe_answer(
    d: &mut Dispatcher,
    m: &mut DispatchModel,
    input: &mut Bytes<'_>,
    providers: &[ProviderSpec],
    now: Instant,
) {
    if m.tickets.is_empty() {
        return;
    }
    let (ticket, node, generation) = m.tickets.remove(input.below(m.tickets.len()));
    let answer_kind = input.below(4);
    match (answer_kind, generation) {
        (0, _) | (_, None) => {
            d.handle_input(
                now,
                DispatchInput::ProbeAnswer {
                    ticket,
                    answer: ProbeAnswer::Failure(HealthFailureCode::TransportFailed),
                },
            );
        }
        (_, Some(g)) => {
            let report = capabilities_report(m, input, providers, node, g);
            let counted_before = d.registry().fenced_messages();
            let outputs = outputs_of(
                d,
                now,
                DispatchInput::ProbeAnswer {
                    ticket,
                    answer: ProbeAnswer::Report {
                        node: NodeId::from(NODES[node]),
                        generation: g,
                        report: report.clone(),
                    },
                },
            );
            let counted = d.registry().fenced_messages() - counted_before;
            m.capabilities(node, g, &report, &verdicts_in(&outputs), counted);
            for out in outputs {
                carry(d, m, out);
            }
        }
    }
}

fn advance_dispatch(d: &mut Dispatcher, m: &mut DispatchModel, step: Duration) {
    let target = m.now + step;
    for _ in 0..MAX_FIRINGS_PER_ADVANCE {
        let at = match d.poll_timeout() {
            Some(at) if at <= target => at,
            _ => {
                m.now = target;
                return;
            }
        };
        // Timers fire at their moment.
        m.now = m.now.max(at);
        let now = m.now;
        d.handle_timeout(now);
        drain_dispatch(d, m);
        check_dispatch(d, m);
        if d.poll_timeout().is_some_and(|next| next <= now) {
            panic!("the dispatcher's timer does not move past {now:?} after handle_timeout");
        }
    }
    panic!("the dispatcher fired more than {MAX_FIRINGS_PER_ADVANCE} timers in one step");
}

// ---- Node watchdog ----------------------------------------------------------

/// The harness's model of one run.
#[derive(Debug, Clone, Copy, Default)]
struct RunModel {
    claimed_at: Option<Instant>,
    /// When the provider call returned after the claim (first time).
    returned_at: Option<Instant>,
    /// The first probe verdict after the claim, and when.
    probe: Option<(Instant, ProbeOutcome)>,
    terminal: bool,
}

/// R-WD-5 as the rule states it, independently of the watchdog's code: the
/// evidence pair a stall terminal must carry for the probe verdict that
/// arrived within its bound (none: fail closed).
fn expected_evidence(probe: Option<ProbeOutcome>) -> (ProviderHealth, LivenessClassification) {
    match probe {
        Some(ProbeOutcome::Healthy) => (
            ProviderHealth::Available,
            LivenessClassification::RequestStalled,
        ),
        Some(ProbeOutcome::Unhealthy(_)) => (
            ProviderHealth::Unavailable,
            LivenessClassification::ProviderUnhealthy,
        ),
        Some(ProbeOutcome::Failed) | None => (
            ProviderHealth::Unknown,
            LivenessClassification::HealthUnknown,
        ),
    }
}

#[derive(Debug, Default)]
struct WatchdogModel {
    now: Instant,
    runs: BTreeMap<RunId, RunModel>,
    last_seq: u64,
    bound: bool,
    grace: Duration,
    probe_bound: Duration,
    /// A `StallObserved` was drained; its terminal must follow at once.
    stall_observed: Option<RunId>,
}

impl WatchdogModel {
    fn active(&self) -> usize {
        self.runs.values().filter(|r| !r.terminal).count()
    }

    fn next_seq(&mut self, seq: Option<u64>, what: &str) {
        if self.bound {
            let expected = self.last_seq + 1;
            assert_eq!(
                seq,
                Some(expected),
                "R-SEQ-1: {what} took {seq:?} where {expected} was due"
            );
            self.last_seq = expected;
        } else {
            assert_eq!(seq, None, "R-SEQ-1: an unbound path omits the sequence");
        }
    }
}

fn drain_watchdog(w: &mut Watchdog, m: &mut WatchdogModel) {
    while let Some(out) = w.poll_output() {
        if let Some(run_id) = m.stall_observed.take() {
            assert!(
                matches!(&out, WatchdogOutput::Terminal { run_id: r, terminal: RunTerminal::Failed(f) }
                    if *r == run_id && f.code == FailureCode::ResponseStalled),
                "a stall observation is followed by its stall terminal, got {out:?}"
            );
        }
        match out {
            WatchdogOutput::CancelProvider { run_id } => {
                assert!(
                    m.runs.contains_key(&run_id),
                    "cancel for run {run_id} that never started"
                );
            }
            WatchdogOutput::StartProbe { run_id } => {
                let now = m.now;
                let run = m
                    .runs
                    .get_mut(&run_id)
                    .unwrap_or_else(|| panic!("probe for run {run_id} that never started"));
                assert!(!run.terminal, "R-WD-2: a finished run's stall was claimed");
                assert!(
                    run.claimed_at.is_none(),
                    "R-WD-2: run {run_id}'s stall was claimed twice"
                );
                run.claimed_at = Some(now);
            }
            WatchdogOutput::StallObserved { run_id, .. } => m.stall_observed = Some(run_id),
            WatchdogOutput::Terminal { run_id, terminal } => {
                let now = m.now;
                let latest = m.grace.max(m.probe_bound);
                let run = m
                    .runs
                    .get_mut(&run_id)
                    .unwrap_or_else(|| panic!("terminal for run {run_id} that never started"));
                assert!(!run.terminal, "R-WD-6: second terminal for run {run_id}");
                run.terminal = true;
                let claimed_at = run.claimed_at;
                let (returned_at, probe) = (run.returned_at, run.probe);
                if let RunTerminal::Failed(f) = &terminal
                    && f.code == FailureCode::ResponseStalled
                {
                    let claim = claimed_at.unwrap_or_else(|| {
                        panic!("R-WD-2: stall terminal of run {run_id} without a claim")
                    });
                    assert!(
                        now <= claim + latest,
                        "R-WD-3: stall terminal of run {run_id} after claim + max(grace, probe bound)"
                    );
                    // R-WD-5 against the probe verdict the model saw
                    // within the bound (a verdict at or after it is no
                    // evidence).
                    let in_bound = probe
                        .filter(|(at, _)| *at < claim + m.probe_bound)
                        .map(|(_, outcome)| outcome);
                    let (health, classification) = expected_evidence(in_bound);
                    assert_eq!(
                        (f.provider_health, f.liveness_classification),
                        (Some(health), Some(classification)),
                        "R-WD-5: run {run_id}'s evidence for probe {probe:?} claimed at {claim:?}"
                    );
                    // R-WD-4: retryable exactly when the call returned
                    // within the close grace.
                    let within_grace = returned_at.is_some_and(|at| at < claim + m.grace);
                    assert_eq!(
                        f.retryable, within_grace,
                        "R-WD-4: run {run_id} returned at {returned_at:?}, claimed at {claim:?}"
                    );
                    m.next_seq(f.health_observation_seq, "a stall terminal");
                } else if let RunTerminal::Failed(f) = &terminal {
                    let may_fail_over = matches!(
                        f.code,
                        FailureCode::ProviderUnreachable | FailureCode::NodeOverloaded
                    ) || (f.code == FailureCode::ProviderError
                        && f.http_status
                            .is_none_or(|s| s == 429 || (500..=599).contains(&s)));
                    assert!(
                        f.retryable == may_fail_over && f.provider_health.is_none(),
                        "R-WD-8, R-FAIL-1: a non-stall terminal carries a wrong retry hint or evidence"
                    );
                }
            }
        }
    }
    assert!(
        m.stall_observed.is_none(),
        "a stall observation without its terminal"
    );
    assert_eq!(
        w.active_runs(),
        m.active(),
        "the watchdog watches other runs than the model"
    );
}

/// Decode `data` into a sequence of Node watchdog inputs (start, progress,
/// neutral output, provider return, probe verdict, cancel, disconnect,
/// observation sequence, time) and check its rules after each one. Panics
/// on a violation.
pub fn fuzz_watchdog_sequence(data: &[u8]) {
    fuzz_watchdog_sequence_with(data, |_| {});
}

/// [`fuzz_watchdog_sequence`] with a hook called on the new watchdog first.
pub fn fuzz_watchdog_sequence_with(data: &[u8], setup: impl FnOnce(&Watchdog)) {
    let mut input = Bytes::new(data);
    let config = WatchdogConfig {
        close_grace: Duration::from_millis(50 * input.below(20) as u64),
        probe_bound: Duration::from_millis(50 * input.below(20) as u64),
        max_active_runs: 1 + input.below(8),
    };
    let bound = input.flag();
    let mut w = Watchdog::new(config, bound.then(ObservationSequence::new));
    setup(&w);
    let mut m = WatchdogModel {
        bound,
        grace: config.close_grace,
        probe_bound: config.probe_bound,
        ..WatchdogModel::default()
    };
    let mut next_run: RunId = 1;
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        let now = m.now;
        // A run: mostly a live one, sometimes any id.
        let pick = |input: &mut Bytes<'_>, m: &WatchdogModel| -> RunId {
            let live: Vec<RunId> = m
                .runs
                .iter()
                .filter(|(_, r)| !r.terminal)
                .map(|(id, _)| *id)
                .collect();
            let b = input.byte();
            if b & 0x80 == 0 && !live.is_empty() {
                live[usize::from(b) % live.len()]
            } else {
                RunId::from(b & 0x0F) + 1
            }
        };
        match input.below(10) {
            0 | 1 => {
                let run_id = next_run;
                next_run += 1;
                let kind = if input.flag() {
                    RunKind::Tunnel
                } else {
                    RunKind::Normalized
                };
                let stall = Duration::from_millis(100 * (1 + input.below(20) as u64));
                let deadline_byte = input.byte();
                let deadline = (deadline_byte & 1 == 1)
                    .then(|| now + Duration::from_millis(100 * u64::from(deadline_byte / 2)));
                let active = m.active();
                match w.start(now, run_id, kind, stall, deadline) {
                    Ok(()) => {
                        m.runs.insert(run_id, RunModel::default());
                    }
                    Err(e) => assert!(
                        active >= config.max_active_runs,
                        "run {run_id} refused below the limit: {e}"
                    ),
                }
            }
            2 | 3 => {
                let run_id = pick(&mut input, &m);
                let progress = match input.below(5) {
                    0 => Progress::Content,
                    1 => Progress::ToolCall,
                    2 => Progress::TunnelHead,
                    3 => Progress::TunnelBody,
                    _ => Progress::Usage,
                };
                let emission = w.progress(now, run_id, progress);
                check_emission(&mut w, &mut m, run_id, emission, false);
            }
            4 => {
                let run_id = pick(&mut input, &m);
                let emission = w.neutral(now, run_id);
                check_emission(&mut w, &mut m, run_id, emission, false);
            }
            5 => {
                let run_id = pick(&mut input, &m);
                let outcome = if input.flag() {
                    ProviderOutcome::Completed
                } else {
                    let mut f = ExecutionFailure::new(FailureCode::ProviderError);
                    // A provider may claim evidence; only the watchdog grants it.
                    f.retryable = input.flag();
                    f.provider_health = input.flag().then_some(ProviderHealth::Available);
                    ProviderOutcome::Failed(f)
                };
                if let Some(r) = m.runs.get_mut(&run_id)
                    && r.claimed_at.is_some()
                    && !r.terminal
                    && r.returned_at.is_none()
                {
                    r.returned_at = Some(now);
                }
                let emission = w.provider_returned(now, run_id, outcome);
                check_emission(&mut w, &mut m, run_id, emission, true);
            }
            6 => {
                let run_id = pick(&mut input, &m);
                let outcome = match input.below(4) {
                    0 => ProbeOutcome::Healthy,
                    1 => ProbeOutcome::Unhealthy(None),
                    2 => ProbeOutcome::Unhealthy(Some(HealthFailureCode::Http5xx)),
                    _ => ProbeOutcome::Failed,
                };
                if let Some(r) = m.runs.get_mut(&run_id)
                    && r.claimed_at.is_some()
                    && !r.terminal
                    && r.probe.is_none()
                {
                    r.probe = Some((now, outcome));
                }
                w.probe_result(now, run_id, outcome);
            }
            7 => {
                let run_id = pick(&mut input, &m);
                let reason = if input.flag() {
                    CancelReason::Disconnect
                } else {
                    CancelReason::Client
                };
                w.cancel(now, run_id, reason);
            }
            8 => {
                if input.flag() {
                    let seq = w.take_observation_seq();
                    m.next_seq(seq, "a CAPABILITIES answer");
                } else {
                    w.cancel_all(now, CancelReason::Disconnect);
                    drain_watchdog(&mut w, &mut m);
                    assert_eq!(w.active_runs(), 0, "R-DISC-1: runs left after a disconnect");
                }
            }
            _ => {
                let step = Duration::from_millis(10 * u64::from(input.byte()));
                advance_watchdog(&mut w, &mut m, step);
            }
        }
        drain_watchdog(&mut w, &mut m);
    }
    // The connection ends: every run gets its one terminal (R-DISC-1).
    let now = m.now;
    w.cancel_all(now, CancelReason::Disconnect);
    drain_watchdog(&mut w, &mut m);
    assert!(
        m.runs.values().all(|r| r.terminal),
        "R-DISC-1: a run ended without a terminal"
    );
    assert_eq!(w.active_runs(), 0);
}

/// R-WD-6: provider output is forwarded only for a watched run whose stall
/// was not claimed (the input first fires what was due, so the check runs
/// after the drain): a returned call then has its one terminal, other output
/// none yet.
fn check_emission(
    w: &mut Watchdog,
    m: &mut WatchdogModel,
    run_id: RunId,
    emission: Emission,
    returned: bool,
) {
    let finished_before = m.runs.get(&run_id).is_none_or(|r| r.terminal);
    drain_watchdog(w, m);
    if emission == Emission::Forward {
        let run = m
            .runs
            .get(&run_id)
            .unwrap_or_else(|| panic!("output of unknown run {run_id} forwarded"));
        assert!(
            !finished_before && run.claimed_at.is_none(),
            "R-WD-6: output of run {run_id} forwarded after its claim or terminal"
        );
        assert_eq!(
            run.terminal, returned,
            "a forwarded provider return ends its run, other output does not"
        );
    }
}

fn advance_watchdog(w: &mut Watchdog, m: &mut WatchdogModel, step: Duration) {
    let target = m.now + step;
    for _ in 0..MAX_FIRINGS_PER_ADVANCE {
        match w.poll_timeout() {
            Some(at) if at <= target => {
                m.now = m.now.max(at);
                w.handle_timeout(m.now);
                drain_watchdog(w, m);
            }
            _ => {
                m.now = target;
                return;
            }
        }
    }
    panic!("the watchdog fired more than {MAX_FIRINGS_PER_ADVANCE} timers in one step");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes from a fixed generator (no RNG crate: the sim's own SplitMix).
    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut rng = crate::config::Rng::new(seed);
        (0..len).map(|_| rng.range(0, 255) as u8).collect()
    }

    #[test]
    fn empty_and_tiny_inputs_decode() {
        for data in [&b""[..], &[0], &[0xFF; 3], &[7; 40]] {
            fuzz_dispatch_sequence(data);
            fuzz_watchdog_sequence(data);
        }
    }

    #[test]
    fn generated_sequences_hold_every_invariant() {
        for seed in 0..200 {
            fuzz_dispatch_sequence(&bytes(seed, 600));
            fuzz_watchdog_sequence(&bytes(seed, 600));
        }
    }
}
