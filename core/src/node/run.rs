//! One run on the node, from its request to its end: a normalized run, a
//! raw tunnel, or a durable run that outlives its connection (SPEC §3, §6).
//!
//! [`NodeRun`] holds every decision a run's handler would otherwise make
//! itself, so the node's run task and the simulator drive the same rules:
//!
//! * **the start order** (SPEC §3, R-CRED-2): the stall timeout is checked
//!   before anything else, then the target must be known, then the
//!   connection's machine admits the run (the run limit, the watchdog),
//!   then the credential lease is opened, and only then is the provider
//!   called;
//! * **a refusal's whole failure**: a run refused for capacity answers
//!   with the failure a refusal means, retryable by its class (R-FAIL-1),
//!   so the Edge may try another provider; a lease refused ends the run
//!   `credential_rejected`, offered to the watchdog first (R-CRED-3);
//! * **the watchdog's verdicts** (R-WD-1..6): every provider output is
//!   offered to the connection's watchdog and only what it lets through is
//!   written; its cancel stops the provider call, its terminal is the
//!   run's last frame; a provider stream that ends without a terminal ends
//!   the run with the missing-terminal failure (R-WD-6), offered like any
//!   other output; a provider failure goes on as core sanitizes it
//!   (R-WD-8);
//! * **the Edge's side of the stream**: for a run that is not durable a
//!   reset, a stop, a broken stream or a failed write cancels it; for a
//!   durable run [`EdgeSignal::verdict`] decides between parking and
//!   cancelling (R-DISC-1);
//! * **park, detach, adopt and replay** (R-PARK-1, R-PARK-2): a durable
//!   run keeps its frames in a [`RunPark`] until acknowledged, parks when
//!   its connection goes, is adopted by another connection after that
//!   connection's machine admits it, and replays the frames after the
//!   adopter's resume point as [`replayed`] says. A run adopted after its
//!   provider call ended has nothing for the new watchdog to watch: its
//!   end is reported there at once.
//!
//! The machine never touches a stream or a provider. It asks the
//! connection's machine ([`NodeLink`](super::link::NodeLink)) through
//! [`NodeRunOutput::Link`]; the three asks that need an answer
//! ([`LinkAsk::Start`], [`LinkAsk::OpenLease`], [`LinkAsk::Offer`]) are
//! answered by the driver with the next input ([`NodeRunInput::Admitted`],
//! [`NodeRunInput::LeaseOpened`], [`NodeRunInput::Emissions`]), or by
//! [`NodeRunInput::LinkGone`] when the connection's machine is gone. The
//! lease's secret never passes through here: the driver opens it and says
//! only whether it opened.
//!
//! Frames are any [`RunFrame`]: a normalized run's [`RunEventKind`]s or a
//! tunnel's [`ProviderTunnelFrame`]s.

use std::collections::VecDeque;
use std::time::Duration;

use iop_wire::{
    ExecutionFailure, FailureCode, ProviderTunnelFrame, RunEventKind, StreamErrorCode, Usage,
};

use super::park::{
    AdoptRefusal, EdgeSignal, EdgeVerdict, ParkOutput, ParkState, ParkSummary, RunPark,
    adoption_stall_timeout, effective_park_grace, frame_bytes, replayed,
};
use super::provider::ProviderCallError;
use super::watchdog::{
    Emission, ProviderEvent, ProviderOutcome, RunKind, RunTerminal, effective_deadline,
    effective_stall_timeout, sanitize_provider_failure,
};
use crate::ids::RunId;
use crate::time::Instant;

/// The most provider outputs of a run that is not durable offered to the
/// watchdog in one ask (outputs that were ready together).
pub const MAX_READY_BATCH: usize = 64;

/// What a run writes: the rules' view of a frame.
pub trait RunFrame: Clone {
    /// How the watchdog classifies it (R-WD-1).
    fn event(&self) -> ProviderEvent;
    /// Whether it is the run's last.
    fn is_terminal(&self) -> bool;
    /// The terminal frame of `failure`.
    fn from_failure(failure: ExecutionFailure) -> Self;
    /// The failure a terminal frame carries.
    fn failure_mut(&mut self) -> Option<&mut ExecutionFailure>;
    /// Content bytes it relays (text, tool-call arguments, body), for
    /// metrics.
    fn content_bytes(&self) -> u64;
    /// Usage it reports.
    fn usage(&self) -> Option<Usage>;
    /// The bytes it counts against a durable run's kept-bytes bound.
    fn park_bytes(&self) -> usize;
    /// Itself as an adopting connection receives it again (R-PARK-2).
    fn replayed(self) -> Self;
}

impl RunFrame for RunEventKind {
    fn event(&self) -> ProviderEvent {
        ProviderEvent::from_run_event(self)
    }
    fn is_terminal(&self) -> bool {
        RunEventKind::is_terminal(self)
    }
    fn from_failure(failure: ExecutionFailure) -> Self {
        RunEventKind::Failed(failure)
    }
    fn failure_mut(&mut self) -> Option<&mut ExecutionFailure> {
        match self {
            RunEventKind::Failed(f) => Some(f),
            _ => None,
        }
    }
    fn content_bytes(&self) -> u64 {
        match self {
            RunEventKind::TextDelta(t) => t.len() as u64,
            RunEventKind::ToolCallDelta(d) => d.arguments_delta.len().max(1) as u64,
            _ => 0,
        }
    }
    fn usage(&self) -> Option<Usage> {
        match self {
            RunEventKind::Usage(u) => Some(*u),
            RunEventKind::Completed { usage, .. } => *usage,
            _ => None,
        }
    }
    fn park_bytes(&self) -> usize {
        frame_bytes(self)
    }
    fn replayed(self) -> Self {
        #[cfg(feature = "planted-bugs")]
        if crate::planted::in_thread(crate::planted::PlantedBug::ReplayStaleEvidence) {
            return self;
        }
        replayed(self)
    }
}

impl RunFrame for ProviderTunnelFrame {
    fn event(&self) -> ProviderEvent {
        ProviderEvent::from_tunnel_frame(self)
    }
    fn is_terminal(&self) -> bool {
        ProviderTunnelFrame::is_terminal(self)
    }
    fn from_failure(failure: ExecutionFailure) -> Self {
        ProviderTunnelFrame::Failure(failure)
    }
    fn failure_mut(&mut self) -> Option<&mut ExecutionFailure> {
        match self {
            ProviderTunnelFrame::Failure(f) => Some(f),
            _ => None,
        }
    }
    fn content_bytes(&self) -> u64 {
        match self {
            ProviderTunnelFrame::Body(b) => b.len() as u64,
            _ => 0,
        }
    }
    fn usage(&self) -> Option<Usage> {
        // A tunnel relays the provider's bytes unparsed.
        None
    }
    fn park_bytes(&self) -> usize {
        let payload = match self {
            ProviderTunnelFrame::Body(b) => b.len(),
            _ => 0,
        };
        payload + super::park::FRAME_OVERHEAD_BYTES
    }
    fn replayed(self) -> Self {
        self
    }
}

/// What a durable run keeps (R-PARK-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ParkTerms {
    /// The request's `grace_ms` (0: the default).
    pub grace_ms: u64,
    /// The bound of the frames it keeps, in [`RunFrame::park_bytes`].
    pub max_kept_bytes: usize,
}

/// A run as its request asks for it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunSpec {
    /// Its run id on the connection it starts on.
    pub run_id: RunId,
    /// Normalized run or tunnel.
    pub kind: RunKind,
    /// The request's `response_stall_timeout_ms` (0: the default).
    pub stall_timeout_ms: u64,
    /// The request's `deadline_ms` (0: none).
    pub deadline_ms: u64,
    /// Whether the node has the adapter and target it names.
    pub target_known: bool,
    /// Whether the request brought a sealed credential lease.
    pub carries_lease: bool,
    /// Set for a durable run (its request carried a `ParkSpec`).
    pub park: Option<ParkTerms>,
}

/// An Edge asks to adopt the run on one of its connections (R-PARK-2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Adoption {
    /// The run's id on the adopting connection.
    pub run_id: RunId,
    /// The last frame the adopter's journal holds.
    pub resume_after_frame: u64,
    /// The adopter's `response_stall_timeout_ms`.
    pub stall_timeout_ms: u64,
    /// The adopter's `deadline_ms`.
    pub deadline_ms: u64,
    /// The connection the run is attached to, if any, is closing: it no
    /// longer holds the run.
    pub attached_closing: bool,
}

/// What the run asks of the connection's machine it is attached to (or,
/// for [`LinkAsk::Start`] of an adoption, of the adopting one).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkAsk {
    /// Watch this run: answer [`NodeRunInput::Admitted`].
    Start {
        /// The run.
        run_id: RunId,
        /// Normalized run or tunnel.
        kind: RunKind,
        /// Its effective stall timeout.
        stall_timeout: Duration,
        /// Its deadline from now, if any.
        deadline: Option<Duration>,
        /// Whether its request brought a sealed lease.
        carries_lease: bool,
        /// A parked run being adopted: it already holds its provider
        /// capacity.
        adopted: bool,
    },
    /// Open the run's credential lease (R-CRED-2): answer
    /// [`NodeRunInput::LeaseOpened`].
    OpenLease {
        /// The run.
        run_id: RunId,
    },
    /// What to do with these provider outputs (R-WD-6): answer
    /// [`NodeRunInput::Emissions`], one per event.
    Offer {
        /// The run.
        run_id: RunId,
        /// The outputs, classified, in order.
        events: Vec<ProviderEvent>,
    },
    /// The provider call the watchdog canceled is over (R-WD-4).
    ProviderDropped {
        /// The run.
        run_id: RunId,
    },
    /// The Edge canceled the run.
    Canceled {
        /// The run.
        run_id: RunId,
    },
    /// The run leaves the connection (ended, or parked).
    Left {
        /// The run.
        run_id: RunId,
    },
}

/// Something that happened to the run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeRunInput<F> {
    /// The answer to [`LinkAsk::Start`]: watched, or refused with a code.
    Admitted(Result<(), FailureCode>),
    /// The answer to [`LinkAsk::OpenLease`]: the lease opened (or the
    /// target needs none), or it was refused (R-CRED-3).
    LeaseOpened(bool),
    /// The answer to [`LinkAsk::Offer`].
    Emissions(Vec<Emission>),
    /// The connection's machine is gone: an ask goes unanswered.
    LinkGone,
    /// Outputs the provider produced, in order (at most
    /// [`NodeRun::read_batch`]).
    Provider(Vec<F>),
    /// The provider's stream ended after its last output.
    ProviderEnded,
    /// A call stopped with [`NodeRunOutput::StopProvider`] `{ report: true }`
    /// is over.
    ProviderStopped,
    /// The watchdog stops the provider call (R-WD-2).
    CancelProvider,
    /// The watchdog's terminal: the run's last frame (R-WD-3).
    Terminal(RunTerminal),
    /// The Edge acknowledged frames through this one as durable.
    Acked(u64),
    /// The Edge's side of the stream ended so.
    EdgeEnded(EdgeSignal),
    /// A write to the run's stream failed.
    WriteFailed,
    /// An Edge asks to adopt the run (a durable run only).
    Adopt(Adoption),
    /// An Edge can use the run no more (its response ended or is gone):
    /// a parked run ends now; a run on a connection goes on (its Edge
    /// cancels it on its stream).
    CancelParked,
}

/// What the driver does.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeRunOutput<F> {
    /// Ask the connection's machine.
    Link(LinkAsk),
    /// Call the provider now (with the lease's secret, if any).
    CallProvider,
    /// Stop reading the provider and drop its call now. With `report`,
    /// feed [`NodeRunInput::ProviderStopped`] when the call is over.
    StopProvider {
        /// The watchdog canceled it and waits to hear it ended (R-WD-4).
        report: bool,
    },
    /// Write these frames on the run's stream, in order; then, if
    /// `finish`, finish the stream.
    Send {
        /// The frames.
        frames: Vec<F>,
        /// Finish the stream after them.
        finish: bool,
    },
    /// Write these frames again, in order, on the stream an adoption just
    /// attached (not counted as forwarded again).
    Replay(Vec<F>),
    /// Finish the run's stream.
    FinishStream,
    /// Reset the run's stream with this code.
    ResetStream(StreamErrorCode),
    /// The adopting stream becomes the run's stream.
    Attach,
    /// Reset the adopting stream: the adoption is refused.
    RefuseAdoption(AdoptionRefused),
    /// How the run ended, for its metrics (`None`: completed). Once.
    Ended(Option<FailureCode>),
    /// The run parked (R-PARK-1): the node's other connections report it.
    Parked,
    /// A parked run's grace ended without an adoption (R-PARK-1).
    Expired,
    /// The run is over: nothing more comes of it.
    Done,
}

/// Why an adoption was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdoptionRefused {
    /// The park's terms (R-PARK-2).
    #[error(transparent)]
    Park(#[from] AdoptRefusal),
    /// The run is not durable.
    #[error("the run is not durable")]
    NotDurable,
    /// The adopting connection's machine refused it.
    #[error("the adopting connection refused the run ({0:?})")]
    Connection(Option<FailureCode>),
}

/// Where the run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the connection's admission.
    Admitting,
    /// Waiting for the lease.
    OpeningLease,
    /// Its provider was called.
    Running,
    /// Over.
    Over,
}

/// What an outstanding offer was for.
#[derive(Debug)]
enum Offered<F> {
    /// Provider outputs.
    Outputs(Vec<F>),
    /// The missing-terminal failure (R-WD-6).
    MissingTerminal(ExecutionFailure),
    /// The lease's refusal (R-CRED-3).
    LeaseRefused(ExecutionFailure),
    /// The end of a call already over, told to an adopter's watchdog.
    AdoptedEnd,
}

/// An adoption waiting for its connection's admission.
#[derive(Debug)]
struct PendingAdoption<F> {
    run_id: RunId,
    replay: Vec<(u64, F)>,
}

/// One run's rules (see the module docs).
#[derive(Debug)]
pub struct NodeRun<F> {
    kind: RunKind,
    /// Its id on the connection it is attached to (or was last).
    run_id: RunId,
    phase: Phase,
    /// On a connection (a run that is not durable is, until it is over).
    attached: bool,
    /// Its provider call is being read.
    provider_live: bool,
    /// A durable run's output was fenced (R-WD-6): its provider is not
    /// read again, so no frame it keeps follows a gap (R-PARK-2).
    fenced: bool,
    /// Its metrics' end was reported.
    ended: bool,
    /// Durable: its frames and attachment.
    park: Option<RunPark<F>>,
    offered: Option<Offered<F>>,
    adopting: Option<PendingAdoption<F>>,
    outputs: VecDeque<NodeRunOutput<F>>,
}

impl<F: RunFrame> NodeRun<F> {
    /// A run whose request just arrived: what to do first is queued.
    pub fn new(spec: RunSpec) -> Self {
        let mut run = NodeRun {
            kind: spec.kind,
            run_id: spec.run_id,
            phase: Phase::Admitting,
            attached: true,
            provider_live: false,
            fenced: false,
            ended: false,
            park: spec
                .park
                .map(|t| RunPark::new(effective_park_grace(t.grace_ms), t.max_kept_bytes)),
            offered: None,
            adopting: None,
            outputs: VecDeque::new(),
        };
        // Checked before any adapter is called (SPEC §3).
        let stall_timeout = match effective_stall_timeout(spec.stall_timeout_ms) {
            Ok(stall) => stall,
            Err(e) => {
                run.refuse(e.failure(), false);
                return run;
            }
        };
        if !spec.target_known {
            run.refuse(ExecutionFailure::new(FailureCode::UnknownTarget), true);
            return run;
        }
        run.outputs.push_back(NodeRunOutput::Link(LinkAsk::Start {
            run_id: spec.run_id,
            kind: spec.kind,
            stall_timeout,
            deadline: effective_deadline(spec.deadline_ms),
            carries_lease: spec.carries_lease,
            adopted: false,
        }));
        run
    }

    /// Its id on the connection it is attached to (or was last).
    pub fn run_id(&self) -> RunId {
        self.run_id
    }

    /// Normalized run or tunnel.
    pub fn kind(&self) -> RunKind {
        self.kind
    }

    /// Whether it is durable.
    pub fn is_durable(&self) -> bool {
        self.park.is_some()
    }

    /// Whether it is on a connection.
    pub fn is_attached(&self) -> bool {
        self.attached
    }

    /// Whether it is over (its driver may forget it once its outputs are
    /// drained).
    pub fn is_over(&self) -> bool {
        self.phase == Phase::Over
    }

    /// A durable run's place (R-PARK-1), `None` for any other run.
    pub fn park_state(&self) -> Option<ParkState> {
        self.park.as_ref().map(RunPark::state)
    }

    /// What a registration reports of a durable run.
    pub fn park_summary(&self) -> Option<ParkSummary> {
        self.park.as_ref().map(RunPark::summary)
    }

    /// Whether its provider call is being read (called, not stopped, not
    /// over): [`Self::read_batch`] is 0 while it is only held back.
    pub fn is_calling(&self) -> bool {
        self.phase == Phase::Running && self.provider_live && !self.fenced
    }

    /// How many provider outputs the driver may read now (0: none). A
    /// durable run reads one at a time, so its kept frames never pass
    /// their bound by more than one frame (R-PARK-1, R-LIM-4).
    pub fn read_batch(&self) -> usize {
        if !self.is_calling() || self.offered.is_some() {
            return 0;
        }
        match &self.park {
            None => MAX_READY_BATCH,
            Some(park) if park.wants_provider() => 1,
            Some(_) => 0,
        }
    }

    /// Feed one input at `now`; drain [`Self::poll_output`] after.
    pub fn handle_input(&mut self, now: Instant, input: NodeRunInput<F>) {
        if self.phase == Phase::Over {
            return;
        }
        match input {
            NodeRunInput::Admitted(answer) => self.admitted(now, answer),
            NodeRunInput::LeaseOpened(opened) => self.lease_opened(opened),
            NodeRunInput::Emissions(emissions) => self.emissions(emissions),
            NodeRunInput::LinkGone => self.link_gone(now),
            NodeRunInput::Provider(frames) => self.provider_outputs(frames),
            NodeRunInput::ProviderEnded => self.provider_ended(),
            NodeRunInput::ProviderStopped => {
                if self.attached {
                    self.link(LinkAsk::ProviderDropped {
                        run_id: self.run_id,
                    });
                }
            }
            NodeRunInput::CancelProvider => {
                // R-WD-2: the claim cancels the provider call; it is over
                // when the driver says so (R-WD-4 times it).
                if self.provider_live {
                    self.provider_live = false;
                    self.outputs
                        .push_back(NodeRunOutput::StopProvider { report: true });
                }
            }
            NodeRunInput::Terminal(RunTerminal::Failed(failure)) => {
                self.stop_provider();
                self.write_terminal(F::from_failure(failure));
            }
            // The provider's own end, already forwarded.
            NodeRunInput::Terminal(RunTerminal::Completed) => {}
            NodeRunInput::Acked(through) => {
                if let Some(park) = &mut self.park {
                    park.acked(through);
                }
            }
            NodeRunInput::EdgeEnded(signal) => self.edge_ended(now, signal),
            NodeRunInput::WriteFailed => self.lost_stream(now),
            NodeRunInput::Adopt(adoption) => self.adopt(now, adoption),
            NodeRunInput::CancelParked => {
                if self.park.is_some() && !self.attached && self.adopting.is_none() {
                    self.stop_provider();
                    if let Some(park) = &mut self.park {
                        park.cancelled();
                    }
                    self.over();
                }
            }
        }
        self.park_outputs();
    }

    /// The next output to carry out, in order, until `None`.
    pub fn poll_output(&mut self) -> Option<NodeRunOutput<F>> {
        self.outputs.pop_front()
    }

    /// When a parked run's grace ends.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.phase == Phase::Over {
            return None;
        }
        self.park.as_ref().and_then(RunPark::poll_timeout)
    }

    /// Fire what is due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.phase == Phase::Over {
            return;
        }
        if let Some(park) = &mut self.park {
            park.handle_timeout(now);
        }
        self.park_outputs();
    }

    fn link(&mut self, ask: LinkAsk) {
        self.outputs.push_back(NodeRunOutput::Link(ask));
    }

    fn report_end(&mut self, code: Option<FailureCode>) {
        if !self.ended {
            self.ended = true;
            self.outputs.push_back(NodeRunOutput::Ended(code));
        }
    }

    fn stop_provider(&mut self) {
        if self.provider_live {
            self.provider_live = false;
            self.outputs
                .push_back(NodeRunOutput::StopProvider { report: false });
        }
    }

    fn over(&mut self) {
        self.phase = Phase::Over;
        self.offered = None;
        if self.adopting.take().is_some() {
            self.outputs
                .push_back(NodeRunOutput::RefuseAdoption(AdoptionRefused::Park(
                    AdoptRefusal::Over,
                )));
        }
        self.outputs.push_back(NodeRunOutput::Done);
    }

    /// Ended before its provider was called: its terminal, then its end.
    /// `counted`: the run's metrics saw it start.
    fn refuse(&mut self, failure: ExecutionFailure, counted: bool) {
        if counted {
            self.report_end(Some(failure.code));
        } else {
            self.ended = true;
        }
        self.outputs.push_back(NodeRunOutput::Send {
            frames: vec![F::from_failure(failure)],
            finish: true,
        });
        self.attached = false;
        self.over();
    }

    fn admitted(&mut self, now: Instant, answer: Result<(), FailureCode>) {
        if let Some(adoption) = self.adopting.take() {
            return self.adoption_admitted(now, adoption, answer);
        }
        if self.phase != Phase::Admitting {
            return;
        }
        match answer {
            Ok(()) => {
                self.phase = Phase::OpeningLease;
                self.link(LinkAsk::OpenLease {
                    run_id: self.run_id,
                });
            }
            // Past the run limit: no provider is called, so another
            // provider may take the request (R-FAIL-1).
            Err(code) => {
                let mut failure = ExecutionFailure::new(code);
                failure.retryable = crate::retry::class_may_fail_over(code, None);
                self.refuse(failure, true);
            }
        }
    }

    fn lease_opened(&mut self, opened: bool) {
        if self.phase != Phase::OpeningLease {
            return;
        }
        if opened {
            self.phase = Phase::Running;
            self.provider_live = true;
            self.outputs.push_back(NodeRunOutput::CallProvider);
            return;
        }
        // R-CRED-3: no provider call, no fallback credential; the
        // watchdog hears the failure first, as any terminal.
        let failure = ExecutionFailure::new(FailureCode::CredentialRejected);
        self.report_end(Some(failure.code));
        self.offer(
            vec![ProviderEvent::Returned(ProviderOutcome::Failed(
                failure.clone(),
            ))],
            Offered::LeaseRefused(failure),
        );
    }

    fn offer(&mut self, events: Vec<ProviderEvent>, what: Offered<F>) {
        self.offered = Some(what);
        self.link(LinkAsk::Offer {
            run_id: self.run_id,
            events,
        });
    }

    fn provider_outputs(&mut self, frames: Vec<F>) {
        if self.phase != Phase::Running || frames.is_empty() {
            return;
        }
        if self.attached {
            let events = frames.iter().map(RunFrame::event).collect();
            self.offer(events, Offered::Outputs(frames));
        } else {
            // Parked: no watchdog runs (the grace bounds the run).
            let emissions = vec![Emission::Forward; frames.len()];
            self.forward(frames, emissions);
        }
    }

    fn provider_ended(&mut self) {
        if self.phase != Phase::Running || !self.provider_live {
            return;
        }
        self.provider_live = false;
        let failure = ProviderCallError::missing_terminal();
        if self.attached {
            self.offer(
                vec![ProviderEvent::Returned(ProviderOutcome::Failed(
                    failure.clone(),
                ))],
                Offered::MissingTerminal(failure),
            );
        } else {
            self.write_terminal(F::from_failure(failure));
        }
    }

    fn emissions(&mut self, emissions: Vec<Emission>) {
        let Some(offered) = self.offered.take() else {
            return;
        };
        match offered {
            Offered::Outputs(frames) => self.forward(frames, emissions),
            Offered::MissingTerminal(failure) => {
                // Fenced: the watchdog's own terminal comes instead.
                if emissions.first() == Some(&Emission::Forward) {
                    self.write_terminal(F::from_failure(failure));
                }
            }
            Offered::LeaseRefused(failure) => {
                if emissions.first() == Some(&Emission::Forward) {
                    self.outputs.push_back(NodeRunOutput::Send {
                        frames: vec![F::from_failure(failure)],
                        finish: true,
                    });
                }
                self.leave();
                self.over();
            }
            Offered::AdoptedEnd => {}
        }
    }

    /// Write what the watchdog let through, in order; a terminal among
    /// them is the run's last frame.
    fn forward(&mut self, frames: Vec<F>, emissions: Vec<Emission>) {
        if self.park.as_ref().is_some_and(|p| p.summary().ended) {
            // Nothing comes after a run's terminal frame.
            return;
        }
        let mut out = Vec::with_capacity(frames.len());
        let mut terminal = false;
        for (mut frame, emission) in frames.into_iter().zip(emissions) {
            if emission == Emission::Fenced {
                // A durable run whose output was fenced keeps nothing after
                // it: were it to park and read on, the frames it kept
                // would follow a gap (R-PARK-2). Its terminal is the
                // watchdog's, or an adopter's.
                if self.park.is_some() {
                    self.fenced = true;
                }
                continue;
            }
            // The provider's failure as core says the node forwards it
            // (R-WD-8, R-FAIL-1).
            if let Some(failure) = frame.failure_mut() {
                *failure = sanitize_provider_failure(failure.clone());
            }
            terminal = frame.is_terminal();
            if let Some(park) = &mut self.park {
                let bytes = frame.park_bytes();
                park.produced(frame.clone(), bytes, terminal);
            }
            out.push(frame);
            if terminal {
                break;
            }
        }
        if terminal {
            self.provider_live = false;
            let code = out.last_mut().and_then(|f| f.failure_mut().map(|f| f.code));
            self.report_end(code);
        }
        if out.is_empty() {
            return;
        }
        self.send(out, terminal);
    }

    /// The run's one terminal, made here (the watchdog's, a missing
    /// terminal): written, and kept if the run is durable.
    fn write_terminal(&mut self, mut frame: F) {
        if let Some(park) = &mut self.park {
            if park.summary().ended || park.state() == ParkState::Over {
                // Nothing comes after a run's terminal frame.
                return;
            }
            let bytes = frame.park_bytes();
            park.produced(frame.clone(), bytes, true);
        }
        let code = frame.failure_mut().map(|f| f.code);
        self.report_end(code);
        self.send(vec![frame], true);
    }

    /// Send frames on the attached stream. A run that is not durable is
    /// over after its terminal; a durable one waits for the terminal's
    /// acknowledgement (its park says when).
    fn send(&mut self, frames: Vec<F>, terminal: bool) {
        if !self.attached {
            return;
        }
        if self.park.is_some() {
            self.outputs.push_back(NodeRunOutput::Send {
                frames,
                finish: false,
            });
            return;
        }
        self.outputs.push_back(NodeRunOutput::Send {
            frames,
            finish: terminal,
        });
        if terminal {
            self.leave();
            self.over();
        }
    }

    fn leave(&mut self) {
        if self.attached {
            self.attached = false;
            self.link(LinkAsk::Left {
                run_id: self.run_id,
            });
        }
    }

    /// The Edge canceled the run.
    fn canceled(&mut self) {
        self.stop_provider();
        if self.attached {
            self.link(LinkAsk::Canceled {
                run_id: self.run_id,
            });
        }
        if let Some(park) = &mut self.park {
            park.cancelled();
        } else {
            self.outputs
                .push_back(NodeRunOutput::ResetStream(StreamErrorCode::Canceled));
            self.leave();
        }
        self.attached = false;
        self.over();
    }

    fn edge_ended(&mut self, now: Instant, signal: EdgeSignal) {
        if !self.attached {
            return;
        }
        match (&self.park, signal) {
            // A clean end of the request half is normal for a run that is
            // not durable: only a reset, a stop or a broken stream cancels.
            (None, EdgeSignal::Finished) => {}
            (None, _) => self.canceled(),
            (Some(_), signal) => match signal.verdict() {
                EdgeVerdict::Cancel => self.canceled(),
                // R-DISC-1: kept for another connection (R-PARK-1).
                EdgeVerdict::Park => self.detach(now),
            },
        }
    }

    /// The stream broke under a write.
    fn lost_stream(&mut self, now: Instant) {
        if self.park.is_some() {
            self.detach(now);
        } else if self.attached {
            self.canceled();
        }
    }

    fn link_gone(&mut self, now: Instant) {
        let offered = self.offered.take();
        if let Some(adoption) = self.adopting.take() {
            // The adopting connection is gone before it admitted the run:
            // parked again, within the grace it had (R-PARK-1).
            drop(adoption);
            if let Some(park) = &mut self.park {
                park.adoption_aborted(now);
            }
            self.outputs
                .push_back(NodeRunOutput::RefuseAdoption(AdoptionRefused::Connection(
                    None,
                )));
            return;
        }
        self.attached = false;
        if self.park.is_none() || self.phase != Phase::Running {
            // The run cannot go on without its connection (a durable run
            // parks only once its provider was called).
            self.stop_provider();
            self.over();
            return;
        }
        if let Some(park) = &mut self.park {
            park.detached(now);
        }
        self.outputs.push_back(NodeRunOutput::Parked);
        // What was offered goes on without a watchdog (parked).
        match offered {
            Some(Offered::Outputs(frames)) => {
                let emissions = vec![Emission::Forward; frames.len()];
                self.forward(frames, emissions);
            }
            Some(Offered::MissingTerminal(failure)) => {
                self.write_terminal(F::from_failure(failure));
            }
            Some(Offered::LeaseRefused(_) | Offered::AdoptedEnd) | None => {}
        }
    }

    /// The connection is lost: a durable run parks (R-PARK-1).
    fn detach(&mut self, now: Instant) {
        if !self.attached {
            return;
        }
        self.leave();
        if let Some(park) = &mut self.park {
            park.detached(now);
            self.outputs.push_back(NodeRunOutput::Parked);
        }
    }

    fn adopt(&mut self, now: Instant, adoption: Adoption) {
        if self.park.is_none() || self.phase != Phase::Running || self.adopting.is_some() {
            let why = if self.park.is_none() {
                AdoptionRefused::NotDurable
            } else {
                AdoptionRefused::Park(AdoptRefusal::Attached)
            };
            self.outputs.push_back(NodeRunOutput::RefuseAdoption(why));
            return;
        }
        // A connection that is going away no longer holds the run.
        if self.attached && adoption.attached_closing {
            self.detach(now);
        }
        let Some(park) = &mut self.park else {
            return;
        };
        let accepted = adoption_stall_timeout(adoption.stall_timeout_ms)
            .and_then(|stall| Ok((stall, park.adopt(now, adoption.resume_after_frame)?)));
        let (stall, replay) = match accepted {
            Ok(accepted) => accepted,
            Err(why) => {
                self.outputs
                    .push_back(NodeRunOutput::RefuseAdoption(AdoptionRefused::Park(why)));
                return;
            }
        };
        self.adopting = Some(PendingAdoption {
            run_id: adoption.run_id,
            replay,
        });
        self.link(LinkAsk::Start {
            run_id: adoption.run_id,
            kind: self.kind,
            stall_timeout: stall,
            deadline: effective_deadline(adoption.deadline_ms),
            carries_lease: false,
            adopted: true,
        });
    }

    fn adoption_admitted(
        &mut self,
        now: Instant,
        adoption: PendingAdoption<F>,
        answer: Result<(), FailureCode>,
    ) {
        let Some(park) = &mut self.park else {
            return;
        };
        if let Err(code) = answer {
            // The new connection would not take it: parked again, within
            // the grace it had (R-PARK-1).
            park.adoption_aborted(now);
            self.outputs
                .push_back(NodeRunOutput::RefuseAdoption(AdoptionRefused::Connection(
                    Some(code),
                )));
            return;
        }
        let ended = park.summary().ended;
        self.attached = true;
        self.run_id = adoption.run_id;
        self.outputs.push_back(NodeRunOutput::Attach);
        let frames: Vec<F> = adoption
            .replay
            .into_iter()
            .map(|(_, f)| f.replayed())
            .collect();
        if !frames.is_empty() {
            self.outputs.push_back(NodeRunOutput::Replay(frames));
        }
        if ended {
            // Its provider call is over: the new watchdog has nothing to
            // watch (the run's terminal is the one already produced).
            self.offer(
                vec![ProviderEvent::Returned(ProviderOutcome::Completed)],
                Offered::AdoptedEnd,
            );
        }
    }

    /// Carry out what the park machine said.
    fn park_outputs(&mut self) {
        let mut outs = Vec::new();
        if let Some(park) = &mut self.park {
            while let Some(out) = park.poll_output() {
                outs.push(out);
            }
        }
        for out in outs {
            if self.phase == Phase::Over {
                break;
            }
            match out {
                ParkOutput::Expired => {
                    // R-PARK-1: no Edge took it within the grace.
                    self.stop_provider();
                    self.outputs.push_back(NodeRunOutput::Expired);
                    self.over();
                }
                ParkOutput::Done => {
                    if self.attached {
                        self.outputs.push_back(NodeRunOutput::FinishStream);
                    }
                    self.leave();
                    self.over();
                }
            }
        }
    }
}

impl<F: RunFrame> crate::machine::Machine for NodeRun<F> {
    type Input = NodeRunInput<F>;
    type Output = NodeRunOutput<F>;
    fn handle_input(&mut self, now: Instant, input: NodeRunInput<F>) {
        NodeRun::handle_input(self, now, input);
    }
    fn poll_output(&mut self) -> Option<NodeRunOutput<F>> {
        NodeRun::poll_output(self)
    }
    fn poll_timeout(&self) -> Option<Instant> {
        NodeRun::poll_timeout(self)
    }
    fn handle_timeout(&mut self, now: Instant) {
        NodeRun::handle_timeout(self, now);
    }
}

#[cfg(test)]
mod tests {
    use iop_wire::FinishReason;

    use super::*;

    type Run = NodeRun<RunEventKind>;
    type Out = NodeRunOutput<RunEventKind>;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn spec(park: Option<ParkTerms>) -> RunSpec {
        RunSpec {
            run_id: 7,
            kind: RunKind::Normalized,
            stall_timeout_ms: 0,
            deadline_ms: 0,
            target_known: true,
            carries_lease: false,
            park,
        }
    }

    fn durable() -> RunSpec {
        spec(Some(ParkTerms {
            grace_ms: 1_000,
            max_kept_bytes: 1 << 20,
        }))
    }

    fn drain(run: &mut Run) -> Vec<Out> {
        std::iter::from_fn(|| run.poll_output()).collect()
    }

    fn text(t: &str) -> RunEventKind {
        RunEventKind::TextDelta(t.into())
    }

    fn completed() -> RunEventKind {
        RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: None,
        }
    }

    /// Admitted, lease opened, provider called.
    fn running(spec: RunSpec) -> Run {
        let mut run = Run::new(spec);
        assert!(matches!(
            drain(&mut run)[..],
            [Out::Link(LinkAsk::Start { adopted: false, .. })]
        ));
        run.handle_input(at(0), NodeRunInput::Admitted(Ok(())));
        assert_eq!(
            drain(&mut run),
            [Out::Link(LinkAsk::OpenLease { run_id: 7 })]
        );
        run.handle_input(at(0), NodeRunInput::LeaseOpened(true));
        assert_eq!(drain(&mut run), [Out::CallProvider]);
        run
    }

    /// SPEC §3: an invalid stall timeout is answered before anything else;
    /// nothing is asked of the connection.
    #[test]
    fn an_invalid_stall_timeout_ends_the_run_before_admission() {
        let mut run = Run::new(RunSpec {
            stall_timeout_ms: 1,
            ..spec(None)
        });
        let outs = drain(&mut run);
        assert!(
            matches!(&outs[..], [Out::Send { frames, finish: true }, Out::Done]
                if matches!(&frames[..], [RunEventKind::Failed(f)] if f.code == FailureCode::InvalidRequest)),
            "{outs:?}"
        );
        assert!(run.is_over());
    }

    #[test]
    fn an_unknown_target_is_answered_without_a_provider_call() {
        let mut run = Run::new(RunSpec {
            target_known: false,
            ..spec(None)
        });
        let outs = drain(&mut run);
        assert!(
            matches!(
                &outs[..],
                [
                    Out::Ended(Some(FailureCode::UnknownTarget)),
                    Out::Send { finish: true, .. },
                    Out::Done
                ]
            ),
            "{outs:?}"
        );
    }

    /// R-FAIL-1: a run refused for capacity never called a provider, so its
    /// failure is retryable by its class, the same in every driver.
    #[test]
    fn a_refused_run_answers_a_retryable_failure() {
        let mut run = Run::new(spec(None));
        drain(&mut run);
        run.handle_input(
            at(0),
            NodeRunInput::Admitted(Err(FailureCode::NodeOverloaded)),
        );
        let outs = drain(&mut run);
        match &outs[..] {
            [
                Out::Ended(Some(FailureCode::NodeOverloaded)),
                Out::Send {
                    frames,
                    finish: true,
                },
                Out::Done,
            ] => match &frames[..] {
                [RunEventKind::Failed(f)] => assert!(f.retryable, "{f:?}"),
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        }
    }

    /// R-CRED-3: a refused lease ends the run `credential_rejected`, no
    /// provider call; the watchdog hears it first and the run leaves.
    #[test]
    fn a_refused_lease_is_offered_then_written() {
        let mut run = Run::new(spec(None));
        drain(&mut run);
        run.handle_input(at(0), NodeRunInput::Admitted(Ok(())));
        drain(&mut run);
        run.handle_input(at(0), NodeRunInput::LeaseOpened(false));
        let outs = drain(&mut run);
        assert!(
            matches!(
                &outs[..],
                [
                    Out::Ended(Some(FailureCode::CredentialRejected)),
                    Out::Link(LinkAsk::Offer { .. })
                ]
            ),
            "{outs:?}"
        );
        run.handle_input(at(0), NodeRunInput::Emissions(vec![Emission::Forward]));
        let outs = drain(&mut run);
        assert!(
            matches!(
                &outs[..],
                [
                    Out::Send { finish: true, .. },
                    Out::Link(LinkAsk::Left { run_id: 7 }),
                    Out::Done
                ]
            ),
            "{outs:?}"
        );
        assert!(!outs.contains(&Out::CallProvider));
    }

    /// R-WD-6: only what the watchdog lets through is written; the
    /// provider's terminal ends the run.
    #[test]
    fn outputs_go_through_the_watchdog_and_the_terminal_ends_the_run() {
        let mut run = running(spec(None));
        assert_eq!(run.read_batch(), MAX_READY_BATCH);
        run.handle_input(at(1), NodeRunInput::Provider(vec![text("a"), text("b")]));
        let outs = drain(&mut run);
        assert!(
            matches!(&outs[..], [Out::Link(LinkAsk::Offer { events, .. })] if events.len() == 2)
        );
        assert_eq!(run.read_batch(), 0, "no read while an offer is out");
        run.handle_input(
            at(1),
            NodeRunInput::Emissions(vec![Emission::Fenced, Emission::Forward]),
        );
        assert_eq!(
            drain(&mut run),
            [Out::Send {
                frames: vec![text("b")],
                finish: false
            }]
        );
        run.handle_input(at(2), NodeRunInput::Provider(vec![completed()]));
        drain(&mut run);
        run.handle_input(at(2), NodeRunInput::Emissions(vec![Emission::Forward]));
        assert_eq!(
            drain(&mut run),
            [
                Out::Ended(None),
                Out::Send {
                    frames: vec![completed()],
                    finish: true
                },
                Out::Link(LinkAsk::Left { run_id: 7 }),
                Out::Done
            ]
        );
    }

    /// R-WD-6: a provider stream that ends without a terminal ends the run
    /// with the missing-terminal failure, offered to the watchdog first.
    #[test]
    fn a_provider_end_without_terminal_is_a_failure() {
        let mut run = running(spec(None));
        run.handle_input(at(1), NodeRunInput::ProviderEnded);
        let outs = drain(&mut run);
        assert!(
            matches!(&outs[..], [Out::Link(LinkAsk::Offer { events, .. })] if matches!(events[..], [ProviderEvent::Returned(ProviderOutcome::Failed(_))]))
        );
        run.handle_input(at(1), NodeRunInput::Emissions(vec![Emission::Forward]));
        let outs = drain(&mut run);
        assert!(
            matches!(
                &outs[..],
                [
                    Out::Ended(Some(_)),
                    Out::Send { finish: true, .. },
                    Out::Link(LinkAsk::Left { .. }),
                    Out::Done
                ]
            ),
            "{outs:?}"
        );
    }

    /// R-WD-2, R-WD-4: the watchdog's cancel stops the call; its end is
    /// reported; the watchdog's terminal is the last frame.
    #[test]
    fn the_watchdogs_cancel_and_terminal() {
        let mut run = running(spec(None));
        run.handle_input(at(5), NodeRunInput::CancelProvider);
        assert_eq!(drain(&mut run), [Out::StopProvider { report: true }]);
        assert_eq!(run.read_batch(), 0);
        run.handle_input(at(6), NodeRunInput::ProviderStopped);
        assert_eq!(
            drain(&mut run),
            [Out::Link(LinkAsk::ProviderDropped { run_id: 7 })]
        );
        let stall = ExecutionFailure::new(FailureCode::ResponseStalled);
        run.handle_input(
            at(7),
            NodeRunInput::Terminal(RunTerminal::Failed(stall.clone())),
        );
        assert_eq!(
            drain(&mut run),
            [
                Out::Ended(Some(FailureCode::ResponseStalled)),
                Out::Send {
                    frames: vec![RunEventKind::Failed(stall)],
                    finish: true
                },
                Out::Link(LinkAsk::Left { run_id: 7 }),
                Out::Done
            ]
        );
    }

    /// A run that is not durable is canceled by a reset, never by a clean
    /// end of the Edge's request half.
    #[test]
    fn an_edge_reset_cancels_a_run_a_clean_end_does_not() {
        let mut run = running(spec(None));
        run.handle_input(at(1), NodeRunInput::EdgeEnded(EdgeSignal::Finished));
        assert_eq!(drain(&mut run), []);
        run.handle_input(at(1), NodeRunInput::EdgeEnded(EdgeSignal::Reset));
        assert_eq!(
            drain(&mut run),
            [
                Out::StopProvider { report: false },
                Out::Link(LinkAsk::Canceled { run_id: 7 }),
                Out::ResetStream(StreamErrorCode::Canceled),
                Out::Link(LinkAsk::Left { run_id: 7 }),
                Out::Done
            ]
        );
    }

    /// R-PARK-1, R-PARK-2: a durable run parks on a lost connection, keeps
    /// producing without a watchdog, is adopted after its adopter's
    /// connection admits it, replays the frames after the resume point,
    /// and is over when its terminal is acknowledged.
    #[test]
    fn a_durable_run_parks_is_adopted_and_replays() {
        let mut run = running(durable());
        assert_eq!(run.read_batch(), 1);
        run.handle_input(at(1), NodeRunInput::Provider(vec![text("a")]));
        drain(&mut run);
        run.handle_input(at(1), NodeRunInput::Emissions(vec![Emission::Forward]));
        assert_eq!(
            drain(&mut run),
            [Out::Send {
                frames: vec![text("a")],
                finish: false
            }]
        );
        run.handle_input(at(2), NodeRunInput::EdgeEnded(EdgeSignal::ConnectionLost));
        assert_eq!(
            drain(&mut run),
            [Out::Link(LinkAsk::Left { run_id: 7 }), Out::Parked]
        );
        assert_eq!(run.poll_timeout(), Some(at(1_002)));
        run.handle_input(at(3), NodeRunInput::Provider(vec![text("b")]));
        assert_eq!(drain(&mut run), [], "parked: kept, not offered or sent");
        run.handle_input(at(4), NodeRunInput::Provider(vec![completed()]));
        assert_eq!(drain(&mut run), [Out::Ended(None)]);
        assert_eq!(run.read_batch(), 0);
        run.handle_input(
            at(5),
            NodeRunInput::Adopt(Adoption {
                run_id: 9,
                resume_after_frame: 1,
                stall_timeout_ms: 0,
                deadline_ms: 0,
                attached_closing: false,
            }),
        );
        assert!(matches!(
            &drain(&mut run)[..],
            [Out::Link(LinkAsk::Start {
                run_id: 9,
                adopted: true,
                ..
            })]
        ));
        run.handle_input(at(5), NodeRunInput::Admitted(Ok(())));
        let outs = drain(&mut run);
        assert_eq!(outs[0], Out::Attach);
        assert_eq!(outs[1], Out::Replay(vec![text("b"), completed()]));
        // The call is over: the new watchdog hears so at once.
        assert!(
            matches!(&outs[2], Out::Link(LinkAsk::Offer { run_id: 9, events }) if events[..] == [ProviderEvent::Returned(ProviderOutcome::Completed)])
        );
        run.handle_input(at(5), NodeRunInput::Emissions(vec![Emission::Forward]));
        // A stall terminal of the new watchdog does not follow a terminal.
        run.handle_input(
            at(6),
            NodeRunInput::Terminal(RunTerminal::Failed(ExecutionFailure::new(
                FailureCode::ResponseStalled,
            ))),
        );
        assert_eq!(drain(&mut run), []);
        run.handle_input(at(7), NodeRunInput::Acked(3));
        assert_eq!(
            drain(&mut run),
            [
                Out::FinishStream,
                Out::Link(LinkAsk::Left { run_id: 9 }),
                Out::Done
            ]
        );
    }

    /// R-PARK-1: an adoption the adopting connection refuses leaves the run
    /// parked within the grace it had; an unadopted run expires.
    #[test]
    fn a_refused_adoption_keeps_the_grace_and_the_run_expires() {
        let mut run = running(durable());
        run.handle_input(at(10), NodeRunInput::EdgeEnded(EdgeSignal::Finished));
        drain(&mut run);
        let adoption = Adoption {
            run_id: 9,
            resume_after_frame: 0,
            stall_timeout_ms: 0,
            deadline_ms: 0,
            attached_closing: false,
        };
        run.handle_input(at(500), NodeRunInput::Adopt(adoption));
        drain(&mut run);
        run.handle_input(
            at(500),
            NodeRunInput::Admitted(Err(FailureCode::NodeOverloaded)),
        );
        assert_eq!(
            drain(&mut run),
            [Out::RefuseAdoption(AdoptionRefused::Connection(Some(
                FailureCode::NodeOverloaded
            )))]
        );
        assert_eq!(run.poll_timeout(), Some(at(1_010)));
        run.handle_timeout(at(1_010));
        assert_eq!(
            drain(&mut run),
            [Out::StopProvider { report: false }, Out::Expired, Out::Done]
        );
    }

    /// R-DISC-1: the Edge's reset cancels a durable run; an adoption of an
    /// attached run is refused (R-PARK-2).
    #[test]
    fn a_durable_run_is_attached_once_and_canceled_by_a_reset() {
        let mut run = running(durable());
        run.handle_input(
            at(1),
            NodeRunInput::Adopt(Adoption {
                run_id: 9,
                resume_after_frame: 0,
                stall_timeout_ms: 0,
                deadline_ms: 0,
                attached_closing: false,
            }),
        );
        assert_eq!(
            drain(&mut run),
            [Out::RefuseAdoption(AdoptionRefused::Park(
                AdoptRefusal::Attached
            ))]
        );
        run.handle_input(at(2), NodeRunInput::EdgeEnded(EdgeSignal::Reset));
        assert_eq!(
            drain(&mut run),
            [
                Out::StopProvider { report: false },
                Out::Link(LinkAsk::Canceled { run_id: 7 }),
                Out::Done
            ]
        );
    }

    /// R-PARK-1: a parked run an Edge can use no more ends at once; one on
    /// a connection does not.
    #[test]
    fn a_parked_run_no_edge_can_use_ends_at_once() {
        let mut run = running(durable());
        run.handle_input(at(1), NodeRunInput::CancelParked);
        assert_eq!(drain(&mut run), [], "attached: its stream carries cancels");
        run.handle_input(at(2), NodeRunInput::EdgeEnded(EdgeSignal::ConnectionLost));
        drain(&mut run);
        run.handle_input(at(3), NodeRunInput::CancelParked);
        assert_eq!(
            drain(&mut run),
            [Out::StopProvider { report: false }, Out::Done]
        );
        assert!(run.is_over());
    }

    /// A durable run whose connection's machine goes away mid-offer parks
    /// and keeps what it offered (R-PARK-1: nothing is dropped).
    #[test]
    fn a_durable_run_keeps_an_offer_when_its_link_goes() {
        let mut run = running(durable());
        run.handle_input(at(1), NodeRunInput::Provider(vec![text("a")]));
        drain(&mut run);
        run.handle_input(at(1), NodeRunInput::LinkGone);
        assert_eq!(drain(&mut run), [Out::Parked]);
        assert_eq!(run.park_summary().map(|s| s.last), Some(1));
    }
}
