//! The Edge's dispatch core: the registry, admission and the overlay
//! composed, so that every rule that spans them (a fence releases leases, a
//! ready generation brings providers online, a validated stall lowers the
//! overlay and takes the provider out of selection) is written here once and
//! not in a shell.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use iop_wire::{
    CapabilitiesReport, CloseCode, ConfigSnapshot, ExecutionFailure, FailureCode, ParkedRun,
    ProviderHealth, ProviderSnapshot, RegisterRequest, RejectReason, RunKey,
};

use crate::edge::admission::{
    Admission, AdmissionConfig, AdmissionEvent, Admit, AdmitRejection, DispatchRequest, Lease,
    LeaseId, PreSend, ProviderSpec, ReleaseReason, RequestId,
};
use crate::edge::gate::{AttemptEvent, ConfirmedStall};
use crate::edge::generations::GenerationReserve;
use crate::edge::health::{
    HealthConfig, HealthEvent, HealthTracker, HealthTrackerError, ProbeDisposition, ProbeResult,
    ProbeTicket,
};
use crate::edge::overlay::{EvidenceOutcome, Overlay, RecoveryOutcome};
use crate::edge::registry::{Registry, RegistryOutput, RejectCause, Rejection};
use crate::ids::{Generation, NodeId, ProviderId, RunId};
#[cfg(feature = "planted-bugs")]
use crate::planted::{Planted, PlantedBug};
use crate::time::{Instant, earliest};

/// Why a terminal was not applied (R-LEASE-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IgnoredTerminal {
    /// The lease is not held (already released: a late or duplicate terminal).
    NotHeld,
    /// The reception generation is fenced (counted as a fenced message).
    FencedGeneration,
    /// The reception node/generation does not match the lease (foreign).
    Mismatch,
}

impl IgnoredTerminal {
    /// Closed label value.
    pub fn as_str(self) -> &'static str {
        match self {
            IgnoredTerminal::NotHeld => "not_held",
            IgnoredTerminal::FencedGeneration => "fenced_generation",
            IgnoredTerminal::Mismatch => "mismatch",
        }
    }
}

/// What applying a terminal did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminalVerdict {
    /// Applied: the lease was released exactly once.
    Applied {
        /// The released lease.
        lease: Lease,
        /// Present for a typed stall (R-OVL-1).
        stall: Option<ConfirmedStall>,
        /// What the stall evidence did to the overlay.
        evidence: Option<EvidenceOutcome>,
    },
    /// Ignored; nothing changed.
    Ignored(IgnoredTerminal),
}

impl TerminalVerdict {
    /// The stream gate's event for an attempt whose terminal got this
    /// verdict (R-LEASE-1, R-GATE-2): a typed stall is
    /// [`AttemptEvent::Stalled`], an applied success or failure is
    /// [`AttemptEvent::Completed`] or [`AttemptEvent::Failed`], and an
    /// ignored terminal means its generation was fenced and the attempt's
    /// transport is gone: [`AttemptEvent::TransportLost`].
    pub fn attempt_event(self, failure: Option<FailureCode>) -> AttemptEvent {
        self.attempt_event_with(failure, false)
    }

    /// [`Self::attempt_event`] for a failure that may fail over
    /// ([`crate::edge::gate::failure_may_fail_over`], R-FAIL-1): an applied
    /// one becomes [`AttemptEvent::FailedRetryable`].
    pub fn attempt_event_with(
        self,
        failure: Option<FailureCode>,
        may_fail_over: bool,
    ) -> AttemptEvent {
        match (self, failure) {
            (
                TerminalVerdict::Applied {
                    stall: Some(stall), ..
                },
                _,
            ) => AttemptEvent::Stalled(stall),
            (TerminalVerdict::Applied { .. }, None) => AttemptEvent::Completed,
            (TerminalVerdict::Applied { .. }, Some(code)) if may_fail_over => {
                AttemptEvent::FailedRetryable { code }
            }
            (TerminalVerdict::Applied { .. }, Some(code)) => AttemptEvent::Failed { code },
            (TerminalVerdict::Ignored(_), _) => AttemptEvent::TransportLost,
        }
    }
}

/// One provider's outcome from a CAPABILITIES answer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CapabilityVerdict {
    /// The provider the answer matched exactly.
    pub provider_id: ProviderId,
    /// The probe's verdict.
    pub health: ProviderHealth,
    /// What it did to the overlay.
    pub recovery: RecoveryOutcome,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DispatchOutput {
    /// Close a connection (a newer one of the same node replaced it).
    CloseConnection {
        /// Node.
        node: NodeId,
        /// Generation of the connection to close.
        generation: Generation,
        /// Why.
        code: CloseCode,
    },
    /// A generation was fenced (for metrics; its leases follow as
    /// [`RequestEvent::LeaseFenced`] to their requests).
    Fenced {
        /// Node.
        node: NodeId,
        /// Fenced generation.
        generation: Generation,
        /// Why the connection ended.
        reason: CloseCode,
    },
    /// A node generation became dispatchable.
    NodeReady {
        /// Node.
        node: NodeId,
        /// Generation.
        generation: Generation,
    },
    /// The answer to [`DispatchInput::Register`]: the connection's
    /// generation and config snapshot, or why it was refused.
    Registered {
        /// Node.
        node: NodeId,
        /// The generation and snapshot, or the rejection.
        result: Result<(Generation, ConfigSnapshot), Rejection>,
    },
    /// The answer to [`DispatchInput::Ready`] (R-GEN-2).
    ReadyAnswer {
        /// Node.
        node: NodeId,
        /// Generation.
        generation: Generation,
        /// Whether that generation is now dispatchable.
        accepted: bool,
    },
    /// Carry `event` to the request session `request_id` (its
    /// [`crate::edge::request::Request`]).
    ToRequest {
        /// The request.
        request_id: RequestId,
        /// What the dispatcher tells it.
        event: RequestEvent,
    },
    /// A lease was released while its run may still be going on the node
    /// (client cancel, R-GATE-4): send `Cancel { run_id }` on that
    /// connection.
    CancelRun {
        /// Node.
        node: NodeId,
        /// Generation of the connection the run was sent on.
        generation: Generation,
        /// The run.
        run_id: RunId,
    },
    /// A validated current stall terminal's evidence was applied to the
    /// overlay (R-OVL-1, R-OVL-2); for the evidence counter and log.
    StallEvidence {
        /// The stalled provider.
        provider_id: ProviderId,
        /// The validated evidence.
        health: ProviderHealth,
        /// What it did.
        outcome: EvidenceOutcome,
    },
    /// A CAPABILITIES answer matched one provider exactly (R-CAP-1).
    Capability(CapabilityVerdict),
    /// The health tracker wants `ticket`'s provider probed (R-HT-3): send a
    /// CAPABILITIES command to its node's current generation and answer with
    /// [`DispatchInput::ProbeAnswer`]. With no ready generation, answer a
    /// transport failure at once.
    ProbeDue {
        /// Answer with this.
        ticket: ProbeTicket,
        /// The provider's node.
        node: NodeId,
        /// Its ready generation, if any.
        generation: Option<Generation>,
    },
    /// A provider health lifecycle event (R-HT-4), once per transition.
    Health(HealthEvent),
    /// A node that just became ready on `generation` reported durable runs
    /// it kept going without a connection (R-PARK-2); their capacity is
    /// held. Offer each to the request that writes its response (or a new
    /// one that adopts it); one nobody adopts is let go with
    /// [`DispatchInput::ReleaseParked`] or when its hold expires.
    ParkedRuns {
        /// Node.
        node: NodeId,
        /// The generation they may be adopted on.
        generation: Generation,
        /// The runs and their providers.
        runs: Vec<ParkedOffer>,
    },
    /// A node registered and named the runs it keeps (R-PARK-2): every
    /// durable request of this Edge hears it, and one whose run the node
    /// no longer has ends its wait for it at once. Emitted after the
    /// earlier generation's fencing, and only when the report is whole.
    KeptRuns(std::sync::Arc<KeptRuns>),
    /// Persist the generation mark `mark` (R-GEN-1 across restarts), off
    /// the task that serves every registration, then answer with
    /// [`DispatchInput::GenerationMarkSaved`]. Generations above the
    /// persisted mark are refused until a save covers them.
    SaveGenerationMark {
        /// The mark to persist.
        mark: Generation,
    },
}

/// A parked run a node reported, with the provider it runs on.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParkedOffer {
    /// The report.
    pub run: ParkedRun,
    /// The provider: the node's adapter and target.
    pub provider_id: ProviderId,
    /// The node that reported it: a hold is its node's and run's
    /// together, so no node's report can take or let go another's
    /// (R-PARK-2).
    pub node: NodeId,
}

/// The durable runs a node keeps, as its registration named them: a
/// registration names every run not over on the node (R-PARK-2), those
/// attached to a connection going away too. A run of this Edge on that
/// node, lost or parked on an earlier generation and not named, is gone
/// (the node restarted, or its grace ended there): its request need not
/// wait out the park grace for a report that cannot come.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeptRuns {
    /// The node.
    pub node: NodeId,
    /// The generation that registered with the report.
    pub generation: Generation,
    /// The runs named: key and response id (two Edges may hand out one
    /// key, R-MULTI-1), sorted.
    runs: Vec<(RunKey, String)>,
}

impl KeptRuns {
    /// The runs `parked` (a registration's report) names, or `None` when
    /// the report may have left runs out: at the wire bound a node names
    /// the first [`iop_wire::MAX_PARKED_RUNS`] only.
    pub fn from_registration(
        node: &NodeId,
        generation: Generation,
        parked: &[ParkedRun],
    ) -> Option<Self> {
        if parked.len() >= iop_wire::MAX_PARKED_RUNS {
            return None;
        }
        let mut runs: Vec<(RunKey, String)> = parked
            .iter()
            .map(|r| (r.key, r.response_id.clone()))
            .collect();
        runs.sort_unstable();
        runs.dedup();
        Some(Self {
            node: node.clone(),
            generation,
            runs,
        })
    }

    /// Whether the node still has run `key` of `response_id`.
    pub fn keeps(&self, key: RunKey, response_id: &str) -> bool {
        self.runs
            .binary_search_by(|(k, id)| (*k, id.as_str()).cmp(&(key, response_id)))
            .is_ok()
    }
}

/// How long the capacity of a reported parked run is held for its
/// adoption (R-PARK-2); adoption takes a moment after readiness.
pub const PARKED_HOLD: Duration = Duration::from_secs(10);

/// What a request session asks of the dispatcher (after quinn-proto's
/// `EndpointEvent`): the typed traffic from a
/// [`crate::edge::request::Request`] to the [`Dispatcher`]. Every answer
/// comes back as [`DispatchOutput::ToRequest`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestCommand {
    /// Ask for a lease (R-SEL-1 hints inside).
    Admit(DispatchRequest),
    /// The pre-send fence for a granted lease (R-GEN-4).
    PreSend {
        /// The request.
        request_id: RequestId,
        /// The lease to check.
        lease_id: LeaseId,
    },
    /// The attempt's terminal arrived on (`node`, `generation`)
    /// (R-LEASE-1).
    Terminal {
        /// The request.
        request_id: RequestId,
        /// The attempt's lease.
        lease_id: LeaseId,
        /// Reception node.
        node: NodeId,
        /// Reception generation.
        generation: Generation,
        /// The failure, if the terminal is one.
        failure: Option<ExecutionFailure>,
    },
    /// Let go of everything the request holds: its queue entry or its lease
    /// (the node run is canceled, [`DispatchOutput::CancelRun`]).
    Cancel {
        /// The request.
        request_id: RequestId,
    },
    /// Adopt the parked run `key` (R-PARK-2): its held capacity becomes a
    /// lease on its node's current generation; answered with
    /// [`RequestEvent::Leased`] or [`RequestEvent::Rejected`].
    Adopt {
        /// The request.
        request_id: RequestId,
        /// The node that reported the parked run.
        node: NodeId,
        /// The parked run.
        key: RunKey,
    },
}

impl RequestCommand {
    /// The request this command is about.
    pub fn request_id(&self) -> RequestId {
        match self {
            RequestCommand::Admit(r) => r.request_id,
            RequestCommand::PreSend { request_id, .. }
            | RequestCommand::Terminal { request_id, .. }
            | RequestCommand::Cancel { request_id }
            | RequestCommand::Adopt { request_id, .. } => *request_id,
        }
    }
}

/// What the dispatcher tells one request session (after quinn-proto's
/// `ConnectionEvent`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestEvent {
    /// A lease was granted, at once or from the queue: run the pre-send
    /// fence.
    Leased(Lease),
    /// No capacity now: the request waits in the queue.
    Queued,
    /// Admission refused the request.
    Rejected(AdmitRejection),
    /// The pre-send fence's answer.
    PreSend(PreSend),
    /// The request waited in the queue past the queue timeout.
    QueueExpired,
    /// The lease's generation was fenced (R-GEN-3): its run ends with one
    /// transport terminal.
    LeaseFenced(Lease),
    /// What applying the attempt's terminal did (R-LEASE-1).
    Terminal {
        /// The lease the terminal was about.
        lease_id: LeaseId,
        /// The verdict.
        verdict: TerminalVerdict,
    },
}

/// The answer to a [`DispatchOutput::ProbeDue`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbeAnswer {
    /// A CAPABILITIES report from (`node`, `generation`).
    Report {
        /// Node.
        node: NodeId,
        /// Generation.
        generation: Generation,
        /// The report.
        report: CapabilitiesReport,
    },
    /// No report: why (closed code).
    Failure(iop_wire::HealthFailureCode),
}

/// One input of the [`Dispatcher`]. Answers, when an input has one, are
/// outputs ([`Dispatcher::poll_output`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DispatchInput {
    /// A node registers on a new connection; answered by
    /// [`DispatchOutput::Registered`].
    Register {
        /// Node (from its certificate).
        node: NodeId,
        /// Its registration.
        request: RegisterRequest,
    },
    /// The node completed readiness on `generation` (R-GEN-2); answered by
    /// [`DispatchOutput::ReadyAnswer`].
    Ready {
        /// Node.
        node: NodeId,
        /// Generation.
        generation: Generation,
    },
    /// A connection ended: fence its generation (R-GEN-3).
    ConnectionClosed {
        /// Node.
        node: NodeId,
        /// Generation.
        generation: Generation,
        /// Why.
        reason: CloseCode,
    },
    /// A message attributed to `generation` arrived outside a request;
    /// one of a fenced generation is counted (R-GEN-3).
    Message {
        /// Node.
        node: NodeId,
        /// Generation.
        generation: Generation,
    },
    /// A request session's command.
    Request(RequestCommand),
    /// A CAPABILITIES answer outside a probe (R-CAP-1).
    Capabilities {
        /// Node.
        node: NodeId,
        /// Generation.
        generation: Generation,
        /// The report.
        report: CapabilitiesReport,
    },
    /// The answer to a [`DispatchOutput::ProbeDue`].
    ProbeAnswer {
        /// The ticket the output carried.
        ticket: ProbeTicket,
        /// The report, or why there is none.
        answer: ProbeAnswer,
    },
    /// A ready connection reported runs that parked since it registered
    /// (R-PARK-2): their capacity is held and they are offered at once.
    Parked {
        /// Node.
        node: NodeId,
        /// The reporting generation.
        generation: Generation,
        /// The runs.
        runs: Vec<ParkedRun>,
    },
    /// No request adopts this parked run: let its capacity go.
    ReleaseParked {
        /// The node that reported it (a report names its own node's runs
        /// only).
        node: NodeId,
        /// The run.
        key: RunKey,
    },
    /// The answer to [`DispatchOutput::SaveGenerationMark`].
    GenerationMarkSaved {
        /// The mark the output carried.
        mark: Generation,
        /// Whether it is durable now (a failed save is tried again with the
        /// next registration).
        saved: bool,
    },
}

/// Configuration of the dispatch core.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DispatchConfig {
    /// Queue bounds.
    pub admission: AdmissionConfig,
    /// Every configured provider.
    pub providers: Vec<ProviderSpec>,
    /// Generations start above this (R-GEN-1 across restarts).
    pub generation_floor: Generation,
    /// The generation mark already persisted at start
    /// ([`crate::edge::generations::initial_mark`]): generations above it
    /// are refused until a [`DispatchOutput::SaveGenerationMark`] covers
    /// them. `None` (no store: tests, the simulator) covers every
    /// generation.
    #[serde(default)]
    pub generation_mark: Option<Generation>,
    /// Only these nodes may register (`None`: any certified node).
    pub known_nodes: Option<std::collections::BTreeSet<NodeId>>,
    /// Provider health tracking.
    pub health: HealthConfig,
    /// Providers whose configuration gives no capacity: their node's
    /// reported `max_concurrent_runs` for the target, when it reports one,
    /// is their capacity from its registration on (their spec's capacity
    /// until then).
    pub capacity_from_node: std::collections::BTreeSet<ProviderId>,
    /// How long the capacity of a reported parked run is held for its
    /// adoption, at least [`PARKED_HOLD`]: the Edge's park window, since
    /// the run occupies its provider that long anyway and an adoption of
    /// another Edge's run waits for that Edge's lease to expire
    /// ([`crate::edge::custody`]). `0`: [`PARKED_HOLD`].
    #[serde(default)]
    pub parked_hold_ms: u64,
}

/// The composed Edge dispatch state.
#[derive(Debug)]
pub struct Dispatcher {
    registry: Registry,
    admission: Admission,
    overlay: Overlay,
    health: HealthTracker,
    outputs: VecDeque<DispatchOutput>,
    ignored_terminals: u64,
    /// See [`DispatchConfig::capacity_from_node`].
    capacity_from_node: std::collections::BTreeSet<ProviderId>,
    /// Parked runs reported at registration, offered at readiness.
    parked: BTreeMap<(NodeId, Generation), Vec<ParkedOffer>>,
    /// How long a parked run's capacity is held ([`DispatchConfig::parked_hold_ms`]).
    parked_hold: Duration,
    /// The durable reservation of generations (R-GEN-1 across restarts).
    reserve: GenerationReserve,
    #[cfg(feature = "planted-bugs")]
    planted: Planted,
}

impl Dispatcher {
    /// A dispatcher with no node connected, created at `now`.
    pub fn new(now: Instant, config: DispatchConfig) -> Result<Self, HealthTrackerError> {
        let mut registry = Registry::new(config.generation_floor);
        registry.set_known_nodes(config.known_nodes);
        let mut health = HealthTracker::new(config.health)?;
        for p in &config.providers {
            health.add_provider(now, p.id.clone())?;
            // No node is connected yet: nothing to probe through.
            health.suspend(now, &p.id);
        }
        Ok(Self {
            registry,
            admission: Admission::new(config.admission, config.providers),
            overlay: Overlay::new(),
            health,
            outputs: VecDeque::new(),
            ignored_terminals: 0,
            parked: BTreeMap::new(),
            parked_hold: PARKED_HOLD.max(Duration::from_millis(config.parked_hold_ms)),
            capacity_from_node: config.capacity_from_node,
            reserve: config
                .generation_mark
                .map_or_else(GenerationReserve::unbounded, GenerationReserve::new),
            #[cfg(feature = "planted-bugs")]
            planted: Planted::default(),
        })
    }

    /// Switch a planted bug on in this dispatcher and the registry,
    /// admission and overlay it composes (test-only; see
    /// [`crate::planted`]). Takes `&self`: the simulator holds its
    /// dispatchers inside recording wrappers that give read access only.
    #[cfg(feature = "planted-bugs")]
    pub fn plant(&self, bug: PlantedBug) {
        self.planted.plant(bug);
        self.registry.plant(bug);
        self.admission.plant(bug);
        self.overlay.plant(bug);
    }

    #[cfg(feature = "planted-bugs")]
    fn planted_any(&self) -> bool {
        self.planted.any()
    }

    #[cfg(not(feature = "planted-bugs"))]
    fn planted_any(&self) -> bool {
        false
    }

    /// Read access to the health tracker.
    pub fn health(&self) -> &HealthTracker {
        &self.health
    }

    /// R-HT-5 and R-OVL-2 together: a provider is runtime-eligible only
    /// when its health is `ok` and the overlay did not lower it in its
    /// current generation. `unavailable`, `stale` and `unknown` (no probe
    /// has answered yet: requests wait in the queue for the first answer,
    /// asked for as soon as its node is ready) are not (fail closed).
    fn refresh_eligibility(&mut self, now: Instant, provider: &ProviderId) {
        let online = self
            .admission
            .capacity_view()
            .iter()
            .find(|c| &c.provider_id == provider)
            .and_then(|c| c.online);
        let eligible = self.eligible(provider, online);
        self.admission.set_runtime_eligible(now, provider, eligible);
    }

    fn eligible(&self, provider: &ProviderId, online: Option<Generation>) -> bool {
        let lowered = online.is_some_and(|g| self.overlay.is_lowered(provider, g));
        !lowered && self.health.is_available(provider)
    }

    fn providers_of(&self, node: &NodeId) -> Vec<ProviderId> {
        self.admission
            .providers()
            .filter(|p| &p.node == node)
            .map(|p| p.id.clone())
            .collect()
    }

    /// The answer to a [`DispatchOutput::ProbeDue`]: the CAPABILITIES report
    /// from (`node`, `generation`), or the failure that prevented one. The
    /// report also goes through R-CAP-1; the ticket's provider gets a health
    /// result from the entry about its exact target (none: an ownership
    /// mismatch).
    pub(crate) fn probe_answer(
        &mut self,
        now: Instant,
        ticket: &ProbeTicket,
        answer: Result<(&NodeId, Generation, &CapabilitiesReport), iop_wire::HealthFailureCode>,
    ) -> (ProbeDisposition, Vec<CapabilityVerdict>) {
        let mut verdicts = Vec::new();
        let result = match answer {
            Err(code) => ProbeResult::Failure(code),
            Ok((node, generation, report)) => {
                // R-SEL-1: no pump between the report and the probe result.
                verdicts = self.apply_capabilities_report(now, node, generation, report);
                let spec = self.admission.provider(&ticket.provider_id).cloned();
                let entries: Vec<&iop_wire::TargetHealth> = report
                    .targets
                    .iter()
                    .filter(|e| {
                        spec.as_ref().is_some_and(|s| {
                            &s.node == node && e.adapter == s.adapter && e.target == s.target
                        })
                    })
                    .collect();
                match entries.as_slice() {
                    [entry] => refresh_result(entry),
                    [] => ProbeResult::Failure(iop_wire::HealthFailureCode::OwnershipMismatch),
                    _ => ProbeResult::Failure(iop_wire::HealthFailureCode::MalformedResponse),
                }
            }
        };
        let disposition = self.health.probe_result(now, ticket, result);
        self.refresh_eligibility(now, &ticket.provider_id);
        self.pump(now);
        (disposition, verdicts)
    }

    /// Read access to the registry.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Read access to admission.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// Read access to the overlay.
    pub fn overlay(&self) -> &Overlay {
        &self.overlay
    }

    /// Terminals ignored under R-LEASE-1.
    pub fn ignored_terminals(&self) -> u64 {
        self.ignored_terminals
    }

    /// A node registers on a new connection: its generation and config
    /// snapshot, or a rejection.
    pub(crate) fn register(
        &mut self,
        now: Instant,
        node: &NodeId,
        request: &RegisterRequest,
    ) -> Result<(Generation, ConfigSnapshot), Rejection> {
        let generation = self.registry.register(now, node, request)?;
        if let Some(mark) = self.reserve.poll_save(self.registry.high_water()) {
            self.outputs
                .push_back(DispatchOutput::SaveGenerationMark { mark });
        }
        if !self.reserve.covers(generation) {
            // R-GEN-1: a restart could hand this generation out again (its
            // mark's save failed, or registrations outran it). It is fenced
            // at once and never dispatched to; the node registers again.
            self.connection_closed(now, node, generation, CloseCode::RegistrationRejected);
            return Err(Rejection {
                reason: RejectReason::ShuttingDown,
                cause: RejectCause::GenerationNotDurable,
                message: "the edge could not store the connection generation".into(),
            });
        }
        self.take_reported_capacity(now, node, request);
        self.hold_parked(now, node, generation, &request.parked);
        let providers = self
            .admission
            .providers()
            .filter(|p| &p.node == node)
            .map(|p| ProviderSnapshot {
                provider_id: p.id.to_string(),
                adapter: p.adapter,
                target: p.target.clone(),
                response_stall_timeout_ms: p.stall_timeout_ms,
            })
            .collect();
        self.pump(now);
        // After the earlier generation's fencing: a request hears its
        // lease fenced before it hears whether its run is kept.
        if let Some(kept) = KeptRuns::from_registration(node, generation, &request.parked) {
            self.outputs
                .push_back(DispatchOutput::KeptRuns(std::sync::Arc::new(kept)));
        }
        #[cfg(feature = "planted-bugs")]
        self.planted_after_register(now, node, generation);
        Ok((
            generation,
            ConfigSnapshot {
                providers,
                ..ConfigSnapshot::default()
            },
        ))
    }

    /// The capacity a registering node reports for its targets becomes
    /// that of each `capacity_from_node` provider on the same adapter and
    /// target (the Edge's own configuration wins where it gives one).
    fn take_reported_capacity(&mut self, now: Instant, node: &NodeId, request: &RegisterRequest) {
        let updates: Vec<(ProviderId, u32)> = self
            .admission
            .providers()
            .filter(|p| &p.node == node && self.capacity_from_node.contains(&p.id))
            .filter_map(|p| {
                let offered = request
                    .providers
                    .iter()
                    .find(|o| o.adapter == p.adapter && o.target == p.target)?;
                Some((p.id.clone(), offered.max_concurrent_runs?))
            })
            .collect();
        for (provider, capacity) in updates {
            self.admission.set_capacity(now, &provider, capacity);
        }
    }

    /// R-PARK-2: hold capacity for each parked run the node reported on
    /// `generation` (its provider call is running), to offer them at
    /// readiness. A run whose provider is unknown or full is not held; its
    /// grace on the node ends it.
    fn hold_parked(
        &mut self,
        now: Instant,
        node: &NodeId,
        generation: Generation,
        parked: &[ParkedRun],
    ) {
        let mut offers = Vec::new();
        // One offer per run, however often a report names it: each offer
        // costs the custody a store read (R-LIM-4).
        let mut seen = std::collections::BTreeSet::new();
        for run in parked {
            if !seen.insert((run.key, run.response_id.as_str())) {
                continue;
            }
            let provider_id = self
                .admission
                .providers()
                .find(|p| &p.node == node && p.adapter == run.adapter && p.target == run.target)
                .map(|p| p.id.clone());
            let Some(provider_id) = provider_id else {
                continue;
            };
            if self
                .admission
                .hold(run.key, &provider_id, generation, now + self.parked_hold)
                .is_ok()
            {
                offers.push(ParkedOffer {
                    run: run.clone(),
                    provider_id,
                    node: node.clone(),
                });
            }
        }
        if !offers.is_empty() {
            self.parked.insert((node.clone(), generation), offers);
        }
    }

    /// Planted `DispatchBeforeReady`: bring the node's providers online and
    /// eligible on the generation it just registered, before readiness
    /// (and so before any probe of that generation answered).
    #[cfg(feature = "planted-bugs")]
    fn planted_after_register(&mut self, now: Instant, node: &NodeId, generation: Generation) {
        if !self.planted.has(PlantedBug::DispatchBeforeReady) {
            return;
        }
        let updates: Vec<(ProviderId, Option<Generation>, bool)> = self
            .providers_of(node)
            .into_iter()
            .map(|p| (p, Some(generation), true))
            .collect();
        self.admission.set_states(now, &updates);
        self.pump(now);
    }

    /// The node completed readiness on `generation` (R-GEN-2).
    pub(crate) fn ready(&mut self, now: Instant, node: &NodeId, generation: Generation) -> bool {
        let accepted = self.registry.ready(now, node, generation);
        self.pump(now);
        accepted
    }

    /// A connection ended: fence its generation (R-GEN-3).
    pub(crate) fn connection_closed(
        &mut self,
        now: Instant,
        node: &NodeId,
        generation: Generation,
        reason: CloseCode,
    ) {
        self.registry
            .connection_closed(now, node, generation, reason);
        self.pump(now);
    }

    /// Should a message attributed to `generation` be processed? Messages of
    /// a fenced generation are ignored and counted (R-GEN-3).
    pub(crate) fn admit_message(&mut self, node: &NodeId, generation: Generation) -> bool {
        self.registry.admit_message(node, generation)
    }

    /// Ask for a lease for a client request.
    pub(crate) fn request(&mut self, now: Instant, request: DispatchRequest) -> Admit {
        let admit = self.admission.request(now, request);
        self.pump(now);
        admit
    }

    /// The pre-send fence (R-GEN-4): send only if the lease's generation is
    /// still current and ready; otherwise the lease is released and the
    /// request re-resolved.
    pub(crate) fn pre_send(&mut self, now: Instant, lease_id: LeaseId) -> PreSend {
        let answer = self.admission.pre_send(now, lease_id);
        if let PreSend::Send(lease) = &answer {
            // Admission brings a generation online only from the registry's
            // Ready and takes it offline on its fence, so they agree here.
            // (A planted bug may break that on purpose; the simulator's
            // invariants must report it, not this assertion.)
            debug_assert!(
                self.planted_any() || self.registry.is_dispatchable(&lease.node, lease.generation)
            );
        }
        self.pump(now);
        answer
    }

    /// A terminal for `lease_id` arrived on the connection of
    /// (`reception_node`, `reception_generation`). Applied only if that
    /// generation is current and matches the lease (R-LEASE-1); then the
    /// lease is released exactly once and a typed stall is handed off with
    /// its validated evidence (R-OVL-1, R-OVL-2).
    pub(crate) fn apply_terminal(
        &mut self,
        now: Instant,
        lease_id: LeaseId,
        reception_node: &NodeId,
        reception_generation: Generation,
        failure: Option<&ExecutionFailure>,
    ) -> TerminalVerdict {
        let verdict = self.validate_terminal(lease_id, reception_node, reception_generation);
        if let Err(ignored) = verdict {
            self.ignored_terminals += 1;
            if ignored == IgnoredTerminal::FencedGeneration {
                self.registry
                    .admit_message(reception_node, reception_generation);
            }
            return TerminalVerdict::Ignored(ignored);
        }
        let Ok(lease) = self
            .admission
            .release(now, lease_id, ReleaseReason::Terminal)
        else {
            return TerminalVerdict::Ignored(IgnoredTerminal::NotHeld);
        };
        let (stall, evidence) = match failure {
            Some(f) if f.code == FailureCode::ResponseStalled => {
                // Fail closed: a stall without evidence is `unknown`.
                let health = f.provider_health.unwrap_or(ProviderHealth::Unknown);
                let outcome = self.overlay.apply_stall_evidence(
                    &lease.provider_id,
                    lease.generation,
                    f.health_observation_seq,
                    health,
                );
                if outcome == EvidenceOutcome::Lowered {
                    self.refresh_eligibility(now, &lease.provider_id);
                }
                (
                    Some(ConfirmedStall {
                        provider_id: lease.provider_id.clone(),
                        health,
                    }),
                    Some(outcome),
                )
            }
            _ => (None, None),
        };
        // R-FAIL-3: the run's outcome is evidence of its provider's health,
        // applied before the capacity it freed is handed out (as a stall's
        // evidence is), so it never goes to a provider this very terminal
        // takes out of selection.
        if self.health.run_outcome(
            now,
            &lease.provider_id,
            crate::edge::health::run_health(failure),
        ) {
            self.refresh_eligibility(now, &lease.provider_id);
        }
        self.pump(now);
        TerminalVerdict::Applied {
            lease,
            stall,
            evidence,
        }
    }

    fn validate_terminal(
        &self,
        lease_id: LeaseId,
        reception_node: &NodeId,
        reception_generation: Generation,
    ) -> Result<(), IgnoredTerminal> {
        if !self
            .registry
            .is_current(reception_node, reception_generation)
        {
            return Err(IgnoredTerminal::FencedGeneration);
        }
        let lease = self
            .admission
            .lease(lease_id)
            .ok_or(IgnoredTerminal::NotHeld)?;
        if &lease.node != reception_node || lease.generation != reception_generation {
            return Err(IgnoredTerminal::Mismatch);
        }
        Ok(())
    }

    /// The client went away (R-GATE-4): drop its queue entry or release its
    /// lease. Returns the released lease so the driver cancels the node run.
    pub(crate) fn cancel(&mut self, now: Instant, request_id: RequestId) -> Option<Lease> {
        let lease = self.admission.cancel(now, request_id);
        self.pump(now);
        lease
    }

    /// A CAPABILITIES answer from (`node`, `generation`) (R-CAP-1). For each
    /// entry that matches exactly one provider of that node, the verdict is
    /// applied to the overlay; malformed, ambiguous, stale, unknown and
    /// unavailable answers change nothing. Answers from a fenced generation
    /// are ignored entirely.
    pub(crate) fn apply_capabilities(
        &mut self,
        now: Instant,
        node: &NodeId,
        generation: Generation,
        report: &CapabilitiesReport,
    ) -> Vec<CapabilityVerdict> {
        let verdicts = self.apply_capabilities_report(now, node, generation, report);
        self.pump(now);
        verdicts
    }

    /// [`Self::apply_capabilities`] without serving the queue: the caller
    /// pumps once its whole input is applied (R-SEL-1).
    fn apply_capabilities_report(
        &mut self,
        now: Instant,
        node: &NodeId,
        generation: Generation,
        report: &CapabilitiesReport,
    ) -> Vec<CapabilityVerdict> {
        if !self.registry.admit_message(node, generation) {
            return Vec::new();
        }
        let mut verdicts = Vec::new();
        for entry in &report.targets {
            let duplicates = report
                .targets
                .iter()
                .filter(|e| e.adapter == entry.adapter && e.target == entry.target)
                .count();
            if duplicates != 1 {
                continue; // ambiguous answer
            }
            let matching: Vec<ProviderId> = self
                .admission
                .providers()
                .filter(|p| {
                    &p.node == node && p.adapter == entry.adapter && p.target == entry.target
                })
                .map(|p| p.id.clone())
                .collect();
            let [provider_id] = matching.as_slice() else {
                continue; // no provider or more than one: not exact
            };
            let recovery = self.overlay.apply_capability(
                provider_id,
                generation,
                report.health_observation_seq,
                entry.status,
            );
            if recovery == RecoveryOutcome::Recovered {
                // The overlay no longer holds it back, but its health still
                // may: unavailable or stale stays out (R-HT-5).
                self.refresh_eligibility(now, provider_id);
            }
            verdicts.push(CapabilityVerdict {
                provider_id: provider_id.clone(),
                health: entry.status,
                recovery,
            });
        }
        verdicts
    }

    /// Feed one input at `now`, then drain [`Self::poll_output`]. An input
    /// that has an answer ([`DispatchInput::Register`],
    /// [`DispatchInput::Ready`], every [`RequestCommand`]) queues it before
    /// anything else the input caused, so a request session learns the
    /// answer to its command before later news about the same request (a
    /// re-resolved lease after a stale pre-send fence, say).
    pub fn handle_input(&mut self, now: Instant, input: DispatchInput) {
        let mark = self.outputs.len();
        let answer = match input {
            DispatchInput::Register { node, request } => {
                let result = self.register(now, &node, &request);
                Some(DispatchOutput::Registered { node, result })
            }
            DispatchInput::Ready { node, generation } => {
                let accepted = self.ready(now, &node, generation);
                Some(DispatchOutput::ReadyAnswer {
                    node,
                    generation,
                    accepted,
                })
            }
            DispatchInput::ConnectionClosed {
                node,
                generation,
                reason,
            } => {
                self.connection_closed(now, &node, generation, reason);
                None
            }
            DispatchInput::Message { node, generation } => {
                let _ = self.admit_message(&node, generation);
                None
            }
            DispatchInput::Request(command) => self.request_command(now, command),
            DispatchInput::Capabilities {
                node,
                generation,
                report,
            } => {
                let verdicts = self.apply_capabilities(now, &node, generation, &report);
                self.outputs
                    .extend(verdicts.into_iter().map(DispatchOutput::Capability));
                None
            }
            DispatchInput::ProbeAnswer { ticket, answer } => {
                let answer = match &answer {
                    ProbeAnswer::Report {
                        node,
                        generation,
                        report,
                    } => Ok((node, *generation, report)),
                    ProbeAnswer::Failure(code) => Err(*code),
                };
                let (_, verdicts) = self.probe_answer(now, &ticket, answer);
                self.outputs
                    .extend(verdicts.into_iter().map(DispatchOutput::Capability));
                None
            }
            DispatchInput::Parked {
                node,
                generation,
                runs,
            } => {
                // Only a current, ready generation is adopted on (R-GEN-2,
                // R-GEN-3).
                if self.registry.is_dispatchable(&node, generation) {
                    self.hold_parked(now, &node, generation, &runs);
                    if let Some(runs) = self.parked.remove(&(node.clone(), generation)) {
                        self.outputs.push_back(DispatchOutput::ParkedRuns {
                            node,
                            generation,
                            runs,
                        });
                    }
                } else {
                    let _ = self.admit_message(&node, generation);
                }
                None
            }
            DispatchInput::ReleaseParked { node, key } => {
                self.admission.release_hold(now, &node, key);
                self.pump(now);
                None
            }
            DispatchInput::GenerationMarkSaved { mark, saved } => {
                if saved {
                    self.reserve.saved(mark);
                } else {
                    self.reserve.save_failed(mark);
                }
                None
            }
        };
        if let Some(answer) = answer {
            self.outputs.insert(mark, answer);
        }
    }

    fn request_command(&mut self, now: Instant, command: RequestCommand) -> Option<DispatchOutput> {
        let request_id = command.request_id();
        let event = match command {
            RequestCommand::Admit(request) => match self.request(now, request) {
                Admit::Leased(lease) => RequestEvent::Leased(lease),
                Admit::Queued => RequestEvent::Queued,
                Admit::Rejected(why) => RequestEvent::Rejected(why),
            },
            RequestCommand::PreSend { lease_id, .. } => {
                RequestEvent::PreSend(self.pre_send(now, lease_id))
            }
            RequestCommand::Terminal {
                lease_id,
                node,
                generation,
                failure,
                ..
            } => {
                let verdict =
                    self.apply_terminal(now, lease_id, &node, generation, failure.as_ref());
                if let TerminalVerdict::Applied {
                    lease,
                    stall: Some(stall),
                    evidence: Some(outcome),
                } = &verdict
                {
                    self.outputs.push_back(DispatchOutput::StallEvidence {
                        provider_id: lease.provider_id.clone(),
                        health: stall.health,
                        outcome: *outcome,
                    });
                }
                RequestEvent::Terminal { lease_id, verdict }
            }
            RequestCommand::Adopt { node, key, .. } => {
                let request = DispatchRequest::new(request_id, Vec::new());
                let event = match self.admission.adopt(now, &node, key, request) {
                    Ok(lease) => RequestEvent::Leased(lease),
                    Err(_) => RequestEvent::Rejected(AdmitRejection::NoRoute),
                };
                self.pump(now);
                event
            }
            RequestCommand::Cancel { .. } => {
                // Nothing to answer: a released lease's run is canceled on
                // its node; a withdrawn queue entry needs nothing more.
                if let Some(lease) = self.cancel(now, request_id) {
                    self.outputs.push_back(DispatchOutput::CancelRun {
                        node: lease.node,
                        generation: lease.generation,
                        run_id: lease.run_id,
                    });
                }
                return None;
            }
        };
        Some(DispatchOutput::ToRequest { request_id, event })
    }

    /// Fire due timers (queue expiry, health probes).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.admission.handle_timeout(now);
        self.health.handle_timeout(now);
        self.pump(now);
    }

    /// When to call [`Self::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        earliest(self.admission.poll_timeout(), self.health.poll_timeout())
    }

    /// Next output, until `None`.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<DispatchOutput> {
        self.outputs.pop_front()
    }

    /// Carry registry decisions into admission and collect outputs, until
    /// both are quiet.
    fn pump(&mut self, now: Instant) {
        loop {
            let mut progressed = false;
            while let Some(out) = self.registry.poll_output() {
                progressed = true;
                match out {
                    RegistryOutput::Fenced {
                        node,
                        generation,
                        reason,
                    } => {
                        self.outputs.push_back(DispatchOutput::Fenced {
                            node: node.clone(),
                            generation,
                            reason,
                        });
                        self.admission.fence(now, &node, generation);
                        self.parked.remove(&(node.clone(), generation));
                        if self.registry.view(&node).generation.is_none() {
                            for p in self.providers_of(&node) {
                                self.health.suspend(now, &p);
                                self.refresh_eligibility(now, &p);
                            }
                        }
                    }
                    RegistryOutput::Close {
                        node,
                        generation,
                        code,
                    } => self.outputs.push_back(DispatchOutput::CloseConnection {
                        node,
                        generation,
                        code,
                    }),
                    RegistryOutput::Ready { node, generation } => {
                        let providers = self.providers_of(&node);
                        // The overlay is scoped to its generation: a new
                        // generation starts clean (R-OVL-2); a fresh probe
                        // is asked for at once. Every provider of the node
                        // changes state before the queue is served once.
                        for p in &providers {
                            self.health.resume(now, p);
                        }
                        let updates: Vec<(ProviderId, Option<Generation>, bool)> = providers
                            .iter()
                            .map(|p| {
                                (
                                    p.clone(),
                                    Some(generation),
                                    self.eligible(p, Some(generation)),
                                )
                            })
                            .collect();
                        self.admission.set_states(now, &updates);
                        let parked = self.parked.remove(&(node.clone(), generation));
                        self.outputs.push_back(DispatchOutput::NodeReady {
                            node: node.clone(),
                            generation,
                        });
                        if let Some(runs) = parked {
                            self.outputs.push_back(DispatchOutput::ParkedRuns {
                                node,
                                generation,
                                runs,
                            });
                        }
                    }
                }
            }
            while let Some(event) = self.admission.poll_event() {
                progressed = true;
                let (request_id, event) = match event {
                    AdmissionEvent::Leased(lease) => {
                        (lease.request_id, RequestEvent::Leased(lease))
                    }
                    AdmissionEvent::QueueExpired { request_id } => {
                        (request_id, RequestEvent::QueueExpired)
                    }
                    AdmissionEvent::LeaseFenced(lease) => {
                        (lease.request_id, RequestEvent::LeaseFenced(lease))
                    }
                };
                self.outputs
                    .push_back(DispatchOutput::ToRequest { request_id, event });
            }
            while let Some(ticket) = self.health.poll_probe(now) {
                progressed = true;
                let Some(spec) = self.admission.provider(&ticket.provider_id) else {
                    continue;
                };
                let node = spec.node.clone();
                let generation = self.registry.dispatchable_generation(&node);
                self.outputs.push_back(DispatchOutput::ProbeDue {
                    ticket,
                    node,
                    generation,
                });
            }
            while let Some(event) = self.health.poll_event() {
                progressed = true;
                let provider = event.provider_id.clone();
                self.outputs.push_back(DispatchOutput::Health(event));
                self.refresh_eligibility(now, &provider);
            }
            // Every health state change, including `ok -> stale` by time,
            // which has no lifecycle event (R-HT-5).
            while let Some(provider) = self.health.poll_state_change() {
                progressed = true;
                self.refresh_eligibility(now, &provider);
            }
            if !progressed {
                break;
            }
        }
    }
}

/// The health tracker's result for the one CAPABILITIES entry about a
/// probed provider (R-HT-1). When the node's probe got no verdict
/// (`unknown`: its bound passed, the transport failed, the answer was
/// unreadable) nothing changes (R-CAP-1): an `ok` provider stays `ok` until
/// its `stale_after` passes without a verdict, and its runs' failures still
/// count (R-FAIL-3).
fn refresh_result(entry: &iop_wire::TargetHealth) -> ProbeResult {
    use iop_wire::HealthFailureCode;
    match entry.status {
        ProviderHealth::Available => ProbeResult::Success,
        ProviderHealth::Unavailable => ProbeResult::Failure(
            entry
                .failure_code
                .unwrap_or(HealthFailureCode::ProviderRejected),
        ),
        ProviderHealth::Unknown => {
            ProbeResult::NoVerdict(entry.failure_code.unwrap_or(HealthFailureCode::Timeout))
        }
    }
}

#[cfg(test)]
mod tests;
