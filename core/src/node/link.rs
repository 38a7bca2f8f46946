//! The Node's side of one connection to an Edge: one machine from
//! registration to the connection's end.
//!
//! It owns everything one connection decides:
//!
//! * **the handshake**: `Register`, then `Ready` for the generation the Edge
//!   accepted, then the Edge's `ReadyAck`; a refusal or a handshake that
//!   does not complete in time ends the connection;
//! * **liveness** (R-HB-1, R-HB-2): its [`Heartbeat`], from the first frame;
//! * **the stall watchdog** with the connection's observation sequence
//!   (R-WD-1..8, R-SEQ-1), and which runs are attached to this connection;
//! * **one writer of each run's terminal** (R-WD-3, R-WD-6): a run ends
//!   exactly once, in [`NodeLinkOutput::RunEnded`], which says whether the
//!   handler already forwarded the provider's own terminal or must write the
//!   watchdog's (a stall, a deadline, a cancel);
//! * **the Edge's pushed credential state** and the opening of each run's
//!   lease (R-CRED-2, R-CRED-3), in [`NodeLeases`];
//! * **the end** (R-DISC-1): when the connection is gone every run attached
//!   to it leaves it.
//!
//! What the node shares over all its connections (the run limit,
//! [`super::capacity::NodeCapacity`]; the parked durable runs) is the
//! driver's to consult before it starts a run here; this machine tells it
//! when each run stops holding its place ([`NodeLinkOutput::RunEnded`],
//! [`NodeLinkOutput::RunDetached`]).
//!
//! Driven like every machine of this crate: [`NodeLink::handle_input`],
//! [`NodeLink::poll_output`], [`NodeLink::poll_timeout`],
//! [`NodeLink::handle_timeout`]. A run handler's synchronous questions are
//! answered directly, by the call's return value, as quinn-proto and str0m
//! do (what else they cause still goes through [`NodeLink::poll_output`]):
//! [`NodeLink::start_run`], [`NodeLink::offer`] and
//! [`NodeLink::take_observation_seq`] (each also a [`NodeLinkQuery`], so a
//! trace records it with its [`NodeLinkAnswer`] and a replay asks it
//! again), and [`NodeLink::open_lease`], which is not recorded: its answer
//! is a secret.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use iop_wire::{
    AdapterKind, CloseCode, EdgeControl, FailureCode, ManagedTarget, NodeControl, NodeReadyRequest,
    ProviderHealth, RegisterRequest, RegisterResponse, RejectReason,
};
use serde::{Deserialize, Serialize};

use super::session::ObservationSequence;
use super::watchdog::{
    CancelReason, Emission, ProbeOutcome, ProviderEvent, ProviderOutcome, RunKind, RunTerminal,
    Watchdog, WatchdogConfig, WatchdogOutput,
};
use crate::cred::{LeaseRefusal, NodeLeases, Recipient, ReplayCache, RunLease, Secret};
use crate::ids::{Generation, RunId};
use crate::liveness::heartbeat::{Heartbeat, HeartbeatConfig, HeartbeatInput, HeartbeatOutput};
use crate::time::Instant;

/// One connection's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLinkConfig {
    /// Heartbeat profile (R-HB-1).
    pub heartbeat: HeartbeatConfig,
    /// Stall watchdog settings.
    pub watchdog: WatchdogConfig,
    /// Registration and readiness must complete within this (`None`: only
    /// the heartbeat bounds them).
    pub handshake_timeout: Option<Duration>,
}

/// A run handler asks to be watched on this connection
/// ([`NodeLink::start_run`]). The driver has already admitted it against the
/// node's run limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunStart {
    /// The run or tunnel.
    pub run_id: RunId,
    /// Normalized run or tunnel.
    pub kind: RunKind,
    /// Its effective stall timeout.
    pub stall_timeout: Duration,
    /// Its hard deadline, if any.
    pub deadline: Option<Instant>,
    /// Its provider's kind.
    pub adapter: AdapterKind,
    /// Its provider target.
    pub target: String,
    /// Whether its request brought a sealed credential lease.
    pub carries_lease: bool,
}

/// Something that happened to this connection or one of its runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeLinkInput {
    /// A control frame from the Edge.
    Control(EdgeControl),
    /// The handler dropped a provider call the watchdog canceled: the call
    /// is over (R-WD-4 times it).
    ProviderDropped {
        /// The run.
        run_id: RunId,
    },
    /// The Edge reset the run's stream, or the handler could no longer
    /// write to it: the run is canceled.
    RunCanceled {
        /// The run.
        run_id: RunId,
    },
    /// The handler left this connection without a terminal to write here
    /// (its stream broke, or a durable run parks, R-PARK-1): the run is no
    /// longer watched, and nothing of that reaches the handler.
    RunLeft {
        /// The run.
        run_id: RunId,
    },
    /// The verdict of a probe started by `StartProbe`.
    ProbeDone {
        /// The run.
        run_id: RunId,
        /// The verdict.
        outcome: ProbeOutcome,
    },
    /// The connection is gone (R-DISC-1): every attached run leaves it.
    Disconnected,
}

/// Why the connection ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkEnd {
    /// Closed with this code: the Edge's `Closing`, a heartbeat timeout, or
    /// a protocol violation.
    Closed(CloseCode),
    /// The Edge refused the registration or its readiness.
    Rejected {
        /// Closed reason.
        reason: RejectReason,
        /// Detail.
        message: String,
    },
    /// Registration and readiness did not complete in time.
    HandshakeTimedOut,
}

impl LinkEnd {
    /// The code the node closes the connection with.
    pub fn close_code(&self) -> CloseCode {
        match self {
            LinkEnd::Closed(code) => *code,
            LinkEnd::Rejected { .. } => CloseCode::RegistrationRejected,
            LinkEnd::HandshakeTimedOut => CloseCode::ProtocolError,
        }
    }
}

/// Work for the driver, drained with [`NodeLink::poll_output`] in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeLinkOutput {
    /// Write this frame on the control stream.
    Send(NodeControl),
    /// Readiness completed: the connection carries runs from now on.
    Ready {
        /// This connection's generation.
        generation: Generation,
    },
    /// The Edge pushed which targets' credentials it manages (at
    /// registration and at every refresh).
    Managed(Vec<ManagedTarget>),
    /// The pushed lease signing key does not parse: every lease is refused
    /// until the next snapshot (log it).
    SigningKeyRefused,
    /// Close the connection; nothing more happens on it.
    End(LinkEnd),
    /// Stop the run's provider call now, and report `ProviderDropped`
    /// (R-WD-2, R-WD-4).
    CancelProvider {
        /// The run.
        run_id: RunId,
    },
    /// Probe the run's exact target, bounded by the watchdog's probe bound,
    /// and report `ProbeDone` (R-WD-5).
    StartProbe {
        /// The run.
        run_id: RunId,
        /// Its provider's kind.
        adapter: AdapterKind,
        /// Its provider target.
        target: String,
    },
    /// A stall terminal follows: record its metrics and log (closed values
    /// only; `run_id` is for correlation).
    StallObserved {
        /// The run.
        run_id: RunId,
        /// Normalized run or tunnel.
        kind: RunKind,
        /// Time since the last progress at the claim.
        elapsed_ms: u64,
        /// The probe's evidence.
        health: ProviderHealth,
        /// Whether the call returned within the close grace (R-WD-4).
        retryable: bool,
    },
    /// The Edge can use this parked run no more (its response ended or is
    /// gone): cancel it if it is still parked (R-PARK-1).
    CancelParked(iop_wire::CancelParked),
    /// The run's one terminal (R-WD-3, R-WD-6): it no longer holds its
    /// place. If `forwarded`, the handler already wrote the provider's own
    /// terminal; otherwise it writes `terminal` and stops its provider call.
    RunEnded {
        /// The run.
        run_id: RunId,
        /// Its provider's kind.
        adapter: AdapterKind,
        /// Its provider target.
        target: String,
        /// How it ended.
        terminal: RunTerminal,
        /// Whether the handler already forwarded the provider's terminal.
        forwarded: bool,
    },
    /// The run left this connection without a terminal here (`RunLeft`, or
    /// the connection is gone): it no longer holds its place here.
    RunDetached {
        /// The run.
        run_id: RunId,
        /// Its provider's kind.
        adapter: AdapterKind,
        /// Its provider target.
        target: String,
    },
}

/// A question a run handler asks the connection and waits for: answered
/// by the call's return value ([`NodeLink::answer`], or the typed
/// [`NodeLink::start_run`], [`NodeLink::offer`],
/// [`NodeLink::take_observation_seq`]), never queued as an output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeLinkQuery {
    /// Watch a run.
    StartRun(RunStart),
    /// Provider outputs of a run, in order: what to do with each.
    Offer {
        /// The run.
        run_id: RunId,
        /// Its outputs, classified.
        events: Vec<ProviderEvent>,
    },
    /// Take the next observation sequence number for a CAPABILITIES answer
    /// (R-SEQ-1).
    TakeObservationSeq,
}

/// The answer to a [`NodeLinkQuery`], of the same kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeLinkAnswer {
    /// `StartRun`: watched (call the provider), or refused with this code
    /// (no provider is called; the driver gives back the place it admitted
    /// the run to).
    Started(Result<(), FailureCode>),
    /// `Offer`: one per output, in order (R-WD-6).
    Emissions(Vec<Emission>),
    /// `TakeObservationSeq`: the number.
    ObservationSeq(u64),
}

/// Where the connection stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// `Register` sent; waiting for the Edge's answer.
    Registering,
    /// `Ready` sent for this generation; waiting for the `ReadyAck`.
    Readying(Generation),
    /// Carrying runs.
    Ready(Generation),
    /// Over (ended, or the connection is gone).
    Over,
}

/// A run attached to this connection.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Attached {
    adapter: AdapterKind,
    target: String,
    /// The handler forwarded the provider's own terminal.
    forwarded: bool,
}

/// The Node's side of one connection (see the module docs).
#[derive(Debug)]
pub struct NodeLink {
    phase: Phase,
    handshake_deadline: Option<Instant>,
    connected_at: Instant,
    heartbeat: Heartbeat,
    watchdog: Watchdog,
    runs: BTreeMap<RunId, Attached>,
    leases: NodeLeases,
    /// The connection is gone: the watchdog's terminals have no writer.
    disconnected: bool,
    fenced: u64,
    out: VecDeque<NodeLinkOutput>,
}

impl NodeLink {
    /// A connection established at `now`: it sends `register` first.
    /// `replay` is the Edge's lease replay cache from its earlier
    /// connections.
    pub fn new(
        now: Instant,
        config: NodeLinkConfig,
        register: RegisterRequest,
        replay: ReplayCache,
    ) -> Self {
        let mut link = Self {
            phase: Phase::Registering,
            handshake_deadline: config.handshake_timeout.map(|t| now + t),
            connected_at: now,
            heartbeat: Heartbeat::new(now, config.heartbeat),
            watchdog: Watchdog::new(config.watchdog, Some(ObservationSequence::new())),
            runs: BTreeMap::new(),
            leases: NodeLeases::new(replay),
            disconnected: false,
            fenced: 0,
            out: VecDeque::new(),
        };
        link.out
            .push_back(NodeLinkOutput::Send(NodeControl::Register(register)));
        link
    }

    /// Feed one input at `now`; drain [`NodeLink::poll_output`] after.
    pub fn handle_input(&mut self, now: Instant, input: NodeLinkInput) {
        match input {
            NodeLinkInput::Control(msg) => self.on_control(now, msg),
            NodeLinkInput::ProviderDropped { run_id } => {
                // Only a run still joining its stall needs the timing
                // (R-WD-4); after its terminal there is nothing to record.
                if self.runs.contains_key(&run_id) {
                    let _ = self.watchdog.provider_event(
                        now,
                        run_id,
                        ProviderEvent::Returned(ProviderOutcome::Completed),
                    );
                }
            }
            NodeLinkInput::RunCanceled { run_id } => {
                self.watchdog.cancel(now, run_id, CancelReason::Client);
            }
            NodeLinkInput::RunLeft { run_id } => {
                // Detached first: the watchdog's cancel terminal then has no
                // writer, so nothing of it reaches the handler (a parked
                // run's call must go on).
                if let Some(run) = self.runs.remove(&run_id) {
                    self.out.push_back(NodeLinkOutput::RunDetached {
                        run_id,
                        adapter: run.adapter,
                        target: run.target,
                    });
                }
                self.watchdog.cancel(now, run_id, CancelReason::Client);
            }
            NodeLinkInput::ProbeDone { run_id, outcome } => {
                self.watchdog.probe_result(now, run_id, outcome);
            }
            NodeLinkInput::Disconnected => {
                // R-DISC-1: every run bound to the connection ends with it.
                self.disconnected = true;
                self.phase = Phase::Over;
                self.handshake_deadline = None;
                self.watchdog.cancel_all(now, CancelReason::Disconnect);
            }
        }
        self.drain(now);
    }

    /// Fire what is due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.phase == Phase::Over {
            self.watchdog.handle_timeout(now);
            self.drain(now);
            return;
        }
        if self.handshake_deadline.is_some_and(|d| now >= d) {
            self.end(LinkEnd::HandshakeTimedOut);
        } else {
            self.heartbeat.handle_timeout(now);
        }
        self.watchdog.handle_timeout(now);
        self.drain(now);
    }

    /// The earliest moment this connection needs [`NodeLink::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        let watchdog = self.watchdog.poll_timeout();
        if self.phase == Phase::Over {
            return watchdog;
        }
        let own = crate::time::earliest(self.heartbeat.poll_timeout(), self.handshake_deadline);
        crate::time::earliest(own, watchdog)
    }

    /// The next output to carry out.
    pub fn poll_output(&mut self) -> Option<NodeLinkOutput> {
        self.out.pop_front()
    }

    /// Answer a run handler's question at `now` (see [`NodeLinkQuery`]);
    /// drain [`NodeLink::poll_output`] after, for what else it caused.
    pub fn answer(&mut self, now: Instant, query: NodeLinkQuery) -> NodeLinkAnswer {
        match query {
            NodeLinkQuery::StartRun(start) => NodeLinkAnswer::Started(self.start_run(now, start)),
            NodeLinkQuery::Offer { run_id, events } => {
                NodeLinkAnswer::Emissions(self.offer(now, run_id, events))
            }
            NodeLinkQuery::TakeObservationSeq => {
                NodeLinkAnswer::ObservationSeq(self.take_observation_seq())
            }
        }
    }

    /// Watch a run on this connection: `Ok` to call its provider, or the
    /// code to refuse it with. A reused run id is refused (with a lease, as
    /// a replay, R-CRED-3), and so is every run once the connection is over.
    pub fn start_run(&mut self, now: Instant, start: RunStart) -> Result<(), FailureCode> {
        let admitted = self.watch(now, start);
        self.drain(now);
        admitted
    }

    /// Offer a run's provider outputs, in order, to the watchdog: what to
    /// do with each (R-WD-1, R-WD-6: fenced output is dropped and
    /// counted). A terminal among them ends the run
    /// ([`NodeLinkOutput::RunEnded`], forwarded).
    pub fn offer(
        &mut self,
        now: Instant,
        run_id: RunId,
        events: Vec<ProviderEvent>,
    ) -> Vec<Emission> {
        let emissions = events
            .into_iter()
            .map(|event| self.provider_event(now, run_id, event))
            .collect();
        self.drain(now);
        emissions
    }

    /// Take the next observation sequence number for a CAPABILITIES answer
    /// (R-SEQ-1): after every earlier stall terminal's.
    pub fn take_observation_seq(&mut self) -> u64 {
        self.watchdog.take_observation_seq().unwrap_or(0)
    }

    /// Open `run`'s lease (R-CRED-2, R-CRED-3); see [`NodeLeases::open`].
    /// A query, not an input: a secret is never queued or recorded.
    pub fn open_lease(
        &mut self,
        recipient: Option<Recipient<'_>>,
        run: RunLease<'_>,
        now_unix_ms: u64,
    ) -> Result<Option<Secret>, LeaseRefusal> {
        let generation = self.generation().unwrap_or(0);
        self.leases.open(recipient, generation, run, now_unix_ms)
    }

    /// The generation the Edge gave this connection, once registered.
    pub fn generation(&self) -> Option<Generation> {
        match self.phase {
            Phase::Readying(g) | Phase::Ready(g) => Some(g),
            Phase::Registering | Phase::Over => None,
        }
    }

    /// Whether readiness completed and the connection is not over.
    pub fn is_ready(&self) -> bool {
        matches!(self.phase, Phase::Ready(_))
    }

    /// When the connection was established.
    pub fn connected_at(&self) -> Instant {
        self.connected_at
    }

    /// Runs attached to this connection.
    pub fn attached_runs(&self) -> usize {
        self.runs.len()
    }

    /// Whether `run_id` is attached to this connection.
    pub fn is_attached(&self, run_id: RunId) -> bool {
        self.runs.contains_key(&run_id)
    }

    /// Provider outputs dropped as fenced (R-WD-6).
    pub fn fenced_outputs(&self) -> u64 {
        self.fenced
    }

    /// The heartbeat (read access: pings sent, last round trip).
    pub fn heartbeat(&self) -> &Heartbeat {
        &self.heartbeat
    }

    /// The watchdog (read access: active runs, the next sequence number).
    pub fn watchdog(&self) -> &Watchdog {
        &self.watchdog
    }

    /// The targets whose credential the Edge manages, as last pushed.
    pub fn managed(&self) -> &[ManagedTarget] {
        self.leases.managed()
    }

    /// Take the lease replay cache, for the Edge's next connection.
    pub fn take_replay(&mut self) -> ReplayCache {
        self.leases.take_replay()
    }

    fn end(&mut self, end: LinkEnd) {
        if self.phase == Phase::Over {
            return;
        }
        self.phase = Phase::Over;
        self.handshake_deadline = None;
        self.out.push_back(NodeLinkOutput::End(end));
    }

    fn on_control(&mut self, now: Instant, msg: EdgeControl) {
        if self.phase == Phase::Over {
            return;
        }
        match msg {
            EdgeControl::Ping(hb) => self
                .heartbeat
                .handle_input(now, HeartbeatInput::Ping { seq: hb.seq }),
            EdgeControl::Pong(hb) => self
                .heartbeat
                .handle_input(now, HeartbeatInput::Pong { seq: hb.seq }),
            EdgeControl::Registered(RegisterResponse::Accepted { generation, config })
                if self.phase == Phase::Registering =>
            {
                self.phase = Phase::Readying(generation);
                self.apply_config(&config);
                self.out
                    .push_back(NodeLinkOutput::Send(NodeControl::Ready(NodeReadyRequest {
                        generation,
                    })));
            }
            EdgeControl::Registered(RegisterResponse::Rejected {
                reason, message, ..
            }) if self.phase == Phase::Registering => {
                self.end(LinkEnd::Rejected { reason, message });
            }
            // One registration per connection: a second answer changes
            // nothing.
            EdgeControl::Registered(_) => {}
            EdgeControl::ReadyAck(ack) => match self.phase {
                Phase::Readying(generation) if ack.generation != generation => {
                    self.end(LinkEnd::Closed(CloseCode::ProtocolError));
                }
                Phase::Readying(generation) if ack.accepted => {
                    self.phase = Phase::Ready(generation);
                    self.handshake_deadline = None;
                    self.out.push_back(NodeLinkOutput::Ready { generation });
                }
                Phase::Readying(_) => self.end(LinkEnd::Rejected {
                    reason: RejectReason::InvalidRegistration,
                    message: "readiness refused: generation superseded".into(),
                }),
                Phase::Registering | Phase::Ready(_) | Phase::Over => {}
            },
            EdgeControl::Cancel(c) => self.watchdog.cancel(now, c.run_id, CancelReason::Client),
            EdgeControl::ConfigRefresh(snapshot) => {
                if let Phase::Ready(generation) = self.phase {
                    self.apply_config(&snapshot);
                    self.out
                        .push_back(NodeLinkOutput::Send(NodeControl::ConfigApplied {
                            generation,
                        }));
                }
            }
            EdgeControl::Closing { code } => self.end(LinkEnd::Closed(code)),
            // The node's parked runs are not this connection's: its driver
            // hands it to the run (R-PARK-1).
            EdgeControl::CancelParked(c) => self.out.push_back(NodeLinkOutput::CancelParked(c)),
        }
    }

    fn apply_config(&mut self, snapshot: &iop_wire::ConfigSnapshot) {
        if self.leases.apply(snapshot).is_err() {
            self.out.push_back(NodeLinkOutput::SigningKeyRefused);
        }
        self.out
            .push_back(NodeLinkOutput::Managed(snapshot.managed_targets.clone()));
    }

    fn watch(&mut self, now: Instant, start: RunStart) -> Result<(), FailureCode> {
        let RunStart {
            run_id,
            kind,
            stall_timeout,
            deadline,
            adapter,
            target,
            carries_lease,
        } = start;
        if self.phase == Phase::Over {
            return Err(FailureCode::TransportClosed);
        }
        self.watchdog
            .start(now, run_id, kind, stall_timeout, deadline)
            // A reused run id with a lease is a replay (R-CRED-3).
            .map_err(|e| e.failure_code(carries_lease))?;
        self.runs.insert(
            run_id,
            Attached {
                adapter,
                target,
                forwarded: false,
            },
        );
        Ok(())
    }

    /// Offer one provider output to the watchdog (R-WD-6: fenced output is
    /// dropped and counted).
    fn provider_event(&mut self, now: Instant, run_id: RunId, event: ProviderEvent) -> Emission {
        let returned = matches!(event, ProviderEvent::Returned(_));
        let emission = self.watchdog.provider_event(now, run_id, event);
        match emission {
            Emission::Forward if returned => {
                if let Some(run) = self.runs.get_mut(&run_id) {
                    run.forwarded = true;
                }
            }
            Emission::Forward => {}
            Emission::Fenced => self.fenced += 1,
        }
        emission
    }

    /// Move the heartbeat's and the watchdog's outputs into the queue.
    fn drain(&mut self, now: Instant) {
        while let Some(out) = self.heartbeat.poll_output() {
            if self.phase == Phase::Over {
                continue;
            }
            match out {
                HeartbeatOutput::SendPing(seq) => self.out.push_back(NodeLinkOutput::Send(
                    NodeControl::Ping(iop_wire::Heartbeat { seq }),
                )),
                HeartbeatOutput::SendPong(seq) => self.out.push_back(NodeLinkOutput::Send(
                    NodeControl::Pong(iop_wire::Heartbeat { seq }),
                )),
                HeartbeatOutput::TimedOut => {
                    self.end(LinkEnd::Closed(CloseCode::HeartbeatTimeout));
                }
            }
        }
        while let Some(out) = self.watchdog.poll_output() {
            match out {
                // Only an attached run is canceled or probed. Once the
                // connection is gone its handlers are aborted: the cancels
                // of `Disconnected` go to nobody, and no stall is claimed
                // after it (every run ended at once).
                WatchdogOutput::CancelProvider { run_id } => {
                    if self.runs.contains_key(&run_id) && !self.disconnected {
                        self.out
                            .push_back(NodeLinkOutput::CancelProvider { run_id });
                    }
                }
                WatchdogOutput::StartProbe { run_id } => match self.runs.get(&run_id) {
                    Some(run) => {
                        self.out.push_back(NodeLinkOutput::StartProbe {
                            run_id,
                            adapter: run.adapter,
                            target: run.target.clone(),
                        });
                    }
                    // Nothing to probe: no verdict (R-WD-5).
                    _ => self
                        .watchdog
                        .probe_result(now, run_id, ProbeOutcome::Failed),
                },
                WatchdogOutput::Terminal { run_id, terminal } => {
                    let Some(run) = self.runs.remove(&run_id) else {
                        continue;
                    };
                    if self.disconnected {
                        self.out.push_back(NodeLinkOutput::RunDetached {
                            run_id,
                            adapter: run.adapter,
                            target: run.target,
                        });
                    } else {
                        self.out.push_back(NodeLinkOutput::RunEnded {
                            run_id,
                            adapter: run.adapter,
                            target: run.target,
                            terminal,
                            forwarded: run.forwarded,
                        });
                    }
                }
                WatchdogOutput::StallObserved {
                    run_id,
                    kind,
                    elapsed_ms,
                    health,
                    retryable,
                    ..
                } => self.out.push_back(NodeLinkOutput::StallObserved {
                    run_id,
                    kind,
                    elapsed_ms,
                    health,
                    retryable,
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests;
