//! What run handlers and their connection's link share: the connection's
//! core machine behind a lock ([`LinkHandle`]), and the link's orders to
//! one handler ([`RunControl`]).
//!
//! A run handler asks the connection's [`NodeLink`] itself, under the
//! handle's `Mutex`, held for one synchronous call into core and the
//! carrying out of what it caused, never across an `.await`: a run's start
//! (admission against the node's count, R-MULTI-1, then the watchdog),
//! its lease (R-CRED-2), the offer of its provider outputs (R-WD-1,
//! R-WD-6) and what it tells the connection (a cancel, the end of its
//! call, that it left). The answer is the call's return value. Only what
//! needs the connection's own task (a control frame to write, a probe to
//! start, the connection's end) waits for it, and wakes it.
//!
//! What the machine's outputs do beyond the connection (the node's one run
//! count, its parked runs, its lease identity, its counters) the handle
//! reaches through [`NodeSide`], which the node's shared state implements:
//! this module names no other module of the node, so the link task, the
//! run handlers, the durable runs and the shared state (which holds the
//! durable runs, whose orders carry a handle) each depend on it and none on
//! another's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use iop_core::Instant;
use iop_core::cred::{Recipient, RunLease, Secret};
use iop_core::ids::RunId;
use iop_core::node::link::{LinkEnd, NodeLinkInput, NodeLinkOutput, RunStart};
use iop_core::node::watchdog::{Emission, ProviderEvent, RunKind, RunTerminal};
use iop_trace::DrivenNodeLink;
use iop_transport::clock::Clock;
use iop_transport::framed::{FramedRecv, FramedSend};
use iop_wire::{
    AdapterKind, AdoptRequest, CloseCode, FailureCode, ManagedTarget, NodeControl, ProviderHealth,
    RunKey, TransportStatusReport,
};
use tokio::sync::{Notify, mpsc};

/// What a connection's machine needs of the node beyond the connection,
/// for carrying out its decisions (the decisions stay the machine's and
/// core's): the node's one run count over every connection (R-MULTI-1,
/// with the durable runs parked outside every connection, R-PARK-1), its
/// parked runs, its lease identity (R-CRED-1), its Edge slots and its
/// counters. Implemented by the node's shared state.
pub trait NodeSide: Send + Sync {
    /// Admit a run on `adapter`/`target` against the node's count (an
    /// adopted run already holds its place); `Err`: the code to refuse it
    /// with.
    fn admit(&self, adapter: AdapterKind, target: &str, adopted: bool) -> Result<(), FailureCode>;
    /// A run admitted on `adapter`/`target` left the count.
    fn finish(&self, adapter: AdapterKind, target: &str);
    /// End the durable run of `key` writing `response_id` if it is parked
    /// (R-PARK-1); false if there is none.
    fn cancel_parked(&self, key: RunKey, response_id: &str) -> bool;
    /// Who leases are sealed to (`None`: no managed credentials).
    fn recipient(&self) -> Option<Recipient<'_>>;
    /// A lease was refused for `reason` (R-CRED-3).
    fn credential_rejected(&self, reason: &'static str);
    /// `outputs` late provider outputs were fenced (R-WD-6).
    fn fenced(&self, outputs: u64);
    /// Late provider outputs fenced so far, every connection.
    fn fenced_late_outputs(&self) -> u64;
    /// The connection to the Edge of slot `edge` completed readiness under
    /// `generation`; returns that Edge's address.
    fn edge_ready(&self, edge: usize, generation: u64) -> &str;
    /// The Edge's current managed targets.
    fn set_managed(&self, managed: &[ManagedTarget]);
    /// A stall was observed (R-WD-2, R-WD-5).
    fn stall_observed(
        &self,
        kind: RunKind,
        health: ProviderHealth,
        retryable: bool,
        elapsed_ms: u64,
    );
}

/// What the link tells one run handler.
pub enum RunControl {
    /// Stop the provider call now (stall claimed, canceled, disconnected).
    CancelProvider,
    /// Write this terminal and end (the watchdog's decision).
    Terminal(RunTerminal),
    /// A connection adopts this parked durable run (R-PARK-2).
    Attach(Box<Attach>),
    /// An Edge can use this parked run no more (R-PARK-1).
    CancelParked,
}

impl std::fmt::Debug for RunControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunControl::CancelProvider => f.write_str("CancelProvider"),
            RunControl::Terminal(t) => f.debug_tuple("Terminal").field(t).finish(),
            RunControl::CancelParked => f.write_str("CancelParked"),
            RunControl::Attach(a) => f
                .debug_struct("Attach")
                .field("run_id", &a.request.run_id)
                .field("key", &a.request.key)
                .finish_non_exhaustive(),
        }
    }
}

/// A connection taking a parked run over.
pub struct Attach {
    /// The stream the run's frames go to from now on.
    pub send: FramedSend,
    /// Its other half (acknowledgements, a reset).
    pub recv: FramedRecv,
    /// The connection's link.
    pub link: LinkHandle,
    /// The connection (to tell whether it is still up).
    pub conn: quinn::Connection,
    /// What the Edge asked.
    pub request: AdoptRequest,
}

/// A run's start, as its handler asks it.
pub struct StartAsk {
    /// The run.
    pub run_id: RunId,
    /// Normalized or tunnel.
    pub kind: RunKind,
    /// Wire stall timeout (already validated).
    pub stall_timeout: std::time::Duration,
    /// Hard deadline, if any.
    pub deadline: Option<std::time::Duration>,
    /// Adapter of its target.
    pub adapter: AdapterKind,
    /// Its target.
    pub target: String,
    /// The request carries a sealed credential lease.
    pub carries_lease: bool,
    /// A parked run being adopted: it already holds its capacity.
    pub adopted: bool,
    /// Where the link's orders to the handler go.
    pub control: mpsc::UnboundedSender<RunControl>,
}

/// A run attached to this connection: where its handler listens.
struct RunSlot {
    control: mpsc::UnboundedSender<RunControl>,
    adapter: AdapterKind,
    target: String,
}

/// A probe of a stalled run's exact target (R-WD-5), for the link task
/// to start.
pub(crate) struct ProbeAsk {
    pub(crate) run_id: RunId,
    pub(crate) adapter: AdapterKind,
    pub(crate) target: String,
}

/// What the machine's outputs left for the link task: it writes the
/// frames, starts the probes and ends the connection.
#[derive(Default)]
pub(crate) struct ForLink {
    pub(crate) frames: Vec<NodeControl>,
    pub(crate) probes: Vec<ProbeAsk>,
    pub(crate) end: Option<LinkEnd>,
}

impl ForLink {
    pub(crate) fn is_empty(&self) -> bool {
        self.frames.is_empty() && self.probes.is_empty() && self.end.is_none()
    }
}

/// The connection's machine and what its outputs hold, under the lock.
pub(crate) struct LinkState {
    pub(crate) machine: DrivenNodeLink,
    runs: HashMap<RunId, RunSlot>,
    for_link: ForLink,
    /// The moment the link task's timer is armed for (`None`: none).
    armed: Option<Instant>,
    /// Readiness completed on this connection.
    pub(crate) was_ready: bool,
    /// The link task ended: every question is answered "gone".
    closed: bool,
}

struct Inner {
    state: Mutex<LinkState>,
    /// The link task has work: frames, probes, an end, an earlier timer.
    wake: Notify,
    shared: Arc<dyn NodeSide>,
    edge: usize,
    clock: Clock,
    /// The node's run limit, for the status command.
    max_runs: u32,
}

/// One connection's machine as its link task and its run handlers share
/// it (see the module docs).
#[derive(Clone)]
pub struct LinkHandle(Arc<Inner>);

impl LinkHandle {
    /// A connection's machine, for the link of Edge slot `edge`.
    pub(crate) fn new(
        machine: DrivenNodeLink,
        shared: Arc<dyn NodeSide>,
        edge: usize,
        clock: Clock,
        max_runs: u32,
    ) -> Self {
        Self(Arc::new(Inner {
            state: Mutex::new(LinkState {
                machine,
                runs: HashMap::new(),
                for_link: ForLink::default(),
                armed: None,
                was_ready: false,
                closed: false,
            }),
            wake: Notify::new(),
            shared,
            edge,
            clock,
            max_runs,
        }))
    }

    /// The state, for one synchronous call (never held across an await).
    pub(crate) fn lock(&self) -> MutexGuard<'_, LinkState> {
        // Every change is one call on the machine and its carrying out.
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The clock the connection's machine runs on.
    pub(crate) fn now(&self) -> Instant {
        self.0.clock.now()
    }

    /// Wait until a run handler leaves work for the link task.
    pub(crate) async fn woken(&self) {
        self.0.wake.notified().await;
    }

    /// Feed the link task's input and carry out what it caused; what is
    /// left for the task waits in [`LinkHandle::for_link`].
    pub(crate) fn input(&self, input: NodeLinkInput) {
        let now = self.now();
        let mut state = self.lock();
        state.machine.handle_input(now, input);
        state.carry_out(now, &self.0);
    }

    /// Fire the machine's timer (the link task), likewise.
    pub(crate) fn handle_timeout(&self) {
        let now = self.now();
        let mut state = self.lock();
        state.machine.handle_timeout(now);
        state.carry_out(now, &self.0);
    }

    /// What is left for the link task, and arm its timer: the moment it
    /// sleeps until.
    pub(crate) fn for_link(&self) -> (ForLink, Option<Instant>) {
        let now = self.now();
        let mut state = self.lock();
        // What the machine queued at its creation (the registration).
        state.carry_out(now, &self.0);
        let wake = state.machine.poll_timeout();
        state.armed = wake;
        (std::mem::take(&mut state.for_link), wake)
    }

    /// The link task ended (R-DISC-1): the machine hears the connection is
    /// gone, runs still attached give back their places, and every later
    /// question is answered "gone". Returns the replay cache for the Edge's
    /// next connection.
    pub(crate) fn close(&self) -> iop_core::cred::ReplayCache {
        let now = self.now();
        let mut state = self.lock();
        state.machine.handle_input(now, NodeLinkInput::Disconnected);
        state.carry_out(now, &self.0);
        state.for_link = ForLink::default();
        state.closed = true;
        for slot in state.runs.values() {
            self.0.shared.finish(slot.adapter, &slot.target);
        }
        state.runs.clear();
        state.machine.machine_mut().take_replay()
    }

    /// A handler's call: run `call` on the state under the lock, carry out
    /// what it caused, and wake the link task if anything is left for it
    /// (or its timer must fire earlier). `None`: the link is gone.
    fn call<T>(&self, call: impl FnOnce(&mut LinkState, Instant, &Inner) -> T) -> Option<T> {
        let now = self.now();
        let wake = {
            let mut state = self.lock();
            if state.closed {
                return None;
            }
            let answer = call(&mut state, now, &self.0);
            state.carry_out(now, &self.0);
            let earlier = match (state.machine.poll_timeout(), state.armed) {
                (Some(due), Some(armed)) => due < armed,
                (Some(_), None) => true,
                (None, _) => false,
            };
            let wake = earlier || !state.for_link.is_empty();
            (answer, wake)
        };
        let (answer, wake) = wake;
        if wake {
            self.0.wake.notify_one();
        }
        Some(answer)
    }

    /// Start a run on this connection: admitted against the node's one run
    /// count (R-MULTI-1; an adopted run already holds its place), then
    /// watched by the connection's machine. `Ok`: call the provider; `Err`:
    /// the code to refuse it with. `None`: the link is gone.
    pub fn start(&self, ask: StartAsk) -> Option<Result<(), FailureCode>> {
        self.call(|state, now, inner| {
            let shared = &inner.shared;
            shared.admit(ask.adapter, &ask.target, ask.adopted)?;
            let started = state.machine.start_run(
                now,
                RunStart {
                    run_id: ask.run_id,
                    kind: ask.kind,
                    stall_timeout: ask.stall_timeout,
                    deadline: ask.deadline.map(|d| now + d),
                    adapter: ask.adapter,
                    target: ask.target.clone(),
                    carries_lease: ask.carries_lease,
                },
            );
            match started {
                Ok(()) => {
                    state.runs.insert(
                        ask.run_id,
                        RunSlot {
                            control: ask.control,
                            adapter: ask.adapter,
                            target: ask.target,
                        },
                    );
                }
                Err(code) => {
                    shared.finish(ask.adapter, &ask.target);
                    tracing::warn!(event = "node_run_refused", code = code.as_str());
                }
            }
            started
        })
    }

    /// Open one run's lease (R-CRED-2, R-CRED-3): the machine decides; a
    /// refusal is counted and logged here. The secret is never recorded.
    pub fn open_lease(&self, run: RunLease<'_>) -> Option<Result<Option<Secret>, &'static str>> {
        self.call(|state, _, inner| {
            let shared = &inner.shared;
            let opened = state.machine.machine_mut().open_lease(
                shared.recipient(),
                run,
                iop_transport::clock::unix_ms(),
            );
            if let Err(reason) = &opened {
                shared.credential_rejected(reason);
                tracing::warn!(
                    event = "node_credential_rejected",
                    generation = state.machine.machine().generation().unwrap_or(0),
                    reason = *reason
                );
            }
            opened
        })
    }

    /// Offer one batch of a run's provider outputs (R-WD-1, R-WD-6): what
    /// to do with each; fenced ones are counted.
    pub fn offer(&self, run_id: RunId, events: Vec<ProviderEvent>) -> Option<Vec<Emission>> {
        self.call(|state, now, inner| {
            let emissions = state.machine.offer(now, run_id, events);
            let fenced = emissions.iter().filter(|e| **e == Emission::Fenced).count();
            if fenced > 0 {
                inner.shared.fenced(fenced as u64);
            }
            emissions
        })
    }

    /// Tell the connection's machine what happened to a run (a cancel, the
    /// end of its call, that it left); nothing to wait for.
    pub fn tell(&self, input: NodeLinkInput) {
        let _ = self.call(|state, now, _| state.machine.handle_input(now, input));
    }

    /// The next observation number for a CAPABILITIES answer (R-SEQ-1).
    pub fn take_observation_seq(&self) -> Option<u64> {
        self.call(|state, now, _| state.machine.take_observation_seq(now))
    }

    /// The answer to a `TransportStatus` command.
    pub fn status(&self) -> Option<TransportStatusReport> {
        self.call(|state, now, inner| {
            let machine = state.machine.machine();
            TransportStatusReport {
                generation: machine.generation().unwrap_or(0),
                connected_for_ms: iop_core::time::duration_ms(now - machine.connected_at()),
                active_runs: state.runs.len() as u32,
                max_concurrent_runs: inner.max_runs,
                heartbeats_sent: machine.heartbeat().pings_sent(),
                last_heartbeat_rtt_ms: machine
                    .heartbeat()
                    .last_rtt()
                    .map(iop_core::time::duration_ms),
                fenced_late_outputs: inner.shared.fenced_late_outputs(),
                next_health_observation_seq: machine.watchdog().next_observation_seq().unwrap_or(0),
            }
        })
    }
}

impl LinkState {
    /// Carry out the machine's outputs that need no await; leave frames,
    /// probes and the end for the link task.
    fn carry_out(&mut self, now: Instant, inner: &Inner) {
        let shared = &inner.shared;
        while let Some(out) = self.machine.poll_output(now) {
            match out {
                NodeLinkOutput::CancelParked(c) => {
                    let found = shared.cancel_parked(c.key, &c.response_id);
                    tracing::info!(
                        event = "node_parked_run_released",
                        run_id = c.key.run_id,
                        found
                    );
                }
                NodeLinkOutput::Send(frame) => self.for_link.frames.push(frame),
                NodeLinkOutput::Ready { generation } => {
                    self.was_ready = true;
                    let address = shared.edge_ready(inner.edge, generation);
                    tracing::info!(event = "node_ready", edge = %address, generation);
                }
                NodeLinkOutput::Managed(managed) => shared.set_managed(&managed),
                NodeLinkOutput::SigningKeyRefused => {
                    tracing::warn!(event = "node_lease_signing_key_refused");
                }
                NodeLinkOutput::End(end) => {
                    if end == LinkEnd::Closed(CloseCode::HeartbeatTimeout) {
                        tracing::warn!(
                            event = "node_heartbeat_timeout",
                            generation = self.machine.machine().generation().unwrap_or(0)
                        );
                    }
                    self.for_link.end.get_or_insert(end);
                }
                NodeLinkOutput::CancelProvider { run_id } => {
                    if let Some(slot) = self.runs.get(&run_id) {
                        let _ = slot.control.send(RunControl::CancelProvider);
                    }
                }
                NodeLinkOutput::StartProbe {
                    run_id,
                    adapter,
                    target,
                } => self.for_link.probes.push(ProbeAsk {
                    run_id,
                    adapter,
                    target,
                }),
                NodeLinkOutput::StallObserved {
                    kind,
                    elapsed_ms,
                    health,
                    retryable,
                    ..
                } => {
                    shared.stall_observed(kind, health, retryable, elapsed_ms);
                    tracing::warn!(
                        event = "node_response_stall_observation",
                        kind = kind.as_str(),
                        elapsed_ms,
                        provider_health = health.as_str(),
                        liveness_classification = health.liveness_classification().as_str(),
                        retryable
                    );
                }
                NodeLinkOutput::RunEnded {
                    run_id,
                    adapter,
                    target,
                    terminal,
                    forwarded,
                } => {
                    shared.finish(adapter, &target);
                    if let Some(slot) = self.runs.remove(&run_id)
                        && !forwarded
                    {
                        let _ = slot.control.send(RunControl::Terminal(terminal));
                    }
                }
                NodeLinkOutput::RunDetached {
                    run_id,
                    adapter,
                    target,
                } => {
                    shared.finish(adapter, &target);
                    self.runs.remove(&run_id);
                }
            }
        }
    }
}
