//! The Edge's side of one node connection: one machine from the node's
//! first frame to the connection's end.
//!
//! It owns everything the connection decides:
//!
//! * **the handshake**: the first frame must be `Register`; the dispatcher
//!   answers it (asked with [`EdgeLinkOutput::Register`]); the node then
//!   reports `Ready` for that generation, which the dispatcher accepts or
//!   refuses as superseded (R-GEN-2); a handshake that does not complete in
//!   time ends the connection;
//! * **which generation it carries**: once the dispatcher handed one out,
//!   every way the connection ends reports it ([`EdgeLinkOutput::End`]), so
//!   the generation is fenced (R-GEN-3); a frame naming another generation
//!   is counted with the dispatcher as a late message;
//! * **liveness** (R-HB-1, R-HB-2): its [`Heartbeat`], from readiness; pings
//!   during the handshake are answered;
//! * **the node's frame budgets** (R-LIM-4): stale-generation frames per
//!   connection and parked-run reports per window ([`FrameBudget`]); a node
//!   past one is disconnected with `protocol_error`;
//! * **what the hub sends the node**: cancels and config refreshes, once the
//!   connection is ready.
//!
//! Driven like every machine of this crate: [`EdgeLink::handle_input`],
//! [`EdgeLink::poll_output`], [`EdgeLink::poll_timeout`],
//! [`EdgeLink::handle_timeout`].

use std::collections::VecDeque;
use std::time::Duration;

use iop_wire::{
    CloseCode, ConfigSnapshot, EdgeControl, NodeControl, NodeReadyResponse, PROTOCOL_VERSION,
    ParkedRun, RegisterRequest, RegisterResponse,
};
use serde::{Deserialize, Serialize};

use super::flood::{Flood, FrameBudget};
use super::registry::Rejection;
use crate::ids::{Generation, RunId};
use crate::liveness::heartbeat::{Heartbeat, HeartbeatConfig, HeartbeatInput, HeartbeatOutput};
use crate::time::Instant;

/// One node connection's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EdgeLinkConfig {
    /// Heartbeat profile (R-HB-1).
    pub heartbeat: HeartbeatConfig,
    /// Registration and readiness must complete within this (`None`: no
    /// bound).
    pub handshake_timeout: Option<Duration>,
}

/// Something that happened to the connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgeLinkInput {
    /// A control frame from the node.
    Control(NodeControl),
    /// The dispatcher's answer to [`EdgeLinkOutput::Register`].
    Registered(Result<(Generation, ConfigSnapshot), Rejection>),
    /// The dispatcher's answer to [`EdgeLinkOutput::Ready`].
    ReadyAnswer {
        /// Whether the generation became ready (not superseded).
        accepted: bool,
    },
    /// The hub cancels a run on this node (ignored before readiness).
    Cancel(RunId),
    /// Tell the node a parked run of it is of no use (R-PARK-1).
    CancelParked(iop_wire::CancelParked),
    /// The hub pushes a config refresh (ignored before readiness).
    Refresh(ConfigSnapshot),
    /// The hub closes the connection with this code.
    Close(CloseCode),
    /// The connection or its control stream is gone, with this code.
    Lost(CloseCode),
    /// The node ended its control stream: a normal end once live, a
    /// protocol error before (the handshake was not done).
    StreamEnded,
}

/// Work for the driver, drained with [`EdgeLink::poll_output`] in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgeLinkOutput {
    /// Write this frame on the control stream.
    Send(EdgeControl),
    /// Ask the dispatcher to register the node; answer with
    /// [`EdgeLinkInput::Registered`].
    Register(RegisterRequest),
    /// Ask the dispatcher whether this generation becomes ready; answer
    /// with [`EdgeLinkInput::ReadyAnswer`].
    Ready(Generation),
    /// Readiness completed: the connection carries this generation.
    Connected(Generation),
    /// A frame named another generation of the node: count it with the
    /// dispatcher (R-GEN-3).
    LateMessage(Generation),
    /// The node reports runs parked since it registered (R-PARK-2).
    Parked {
        /// This connection's generation.
        generation: Generation,
        /// The runs.
        runs: Vec<ParkedRun>,
    },
    /// The node overran a budget (R-LIM-4); the connection ends next.
    Flooded(Flood),
    /// The heartbeat found the node silent (R-HB-2); the connection ends
    /// next.
    HeartbeatTimedOut,
    /// Close the connection with `code`; nothing more happens on it. A
    /// generation it was given ends with it (report it to the dispatcher,
    /// R-GEN-3). After a refused registration, let the refusal reach the
    /// node before the close.
    End {
        /// The close code.
        code: CloseCode,
        /// The generation the dispatcher gave the connection, if any.
        generation: Option<Generation>,
    },
}

/// Where the connection stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the node's `Register`.
    Opening,
    /// `Register` handed to the dispatcher; waiting for its answer.
    Registering,
    /// Registered; waiting for the node's `Ready` for this generation.
    Registered(Generation),
    /// `Ready` handed to the dispatcher; waiting for its answer.
    Readying(Generation),
    /// Carrying this generation.
    Live(Generation),
    /// Ended.
    Over,
}

/// The Edge's side of one node connection (see the module docs).
#[derive(Debug)]
pub struct EdgeLink {
    config: EdgeLinkConfig,
    phase: Phase,
    handshake_deadline: Option<Instant>,
    heartbeat: Option<Heartbeat>,
    budget: FrameBudget,
    out: VecDeque<EdgeLinkOutput>,
}

impl EdgeLink {
    /// A connection established at `now`.
    pub fn new(now: Instant, config: EdgeLinkConfig) -> Self {
        Self {
            config,
            phase: Phase::Opening,
            handshake_deadline: config.handshake_timeout.map(|t| now + t),
            heartbeat: None,
            budget: FrameBudget::new(now),
            out: VecDeque::new(),
        }
    }

    /// Feed one input at `now`; drain [`EdgeLink::poll_output`] after.
    pub fn handle_input(&mut self, now: Instant, input: EdgeLinkInput) {
        if self.phase == Phase::Over {
            return;
        }
        match input {
            EdgeLinkInput::Control(frame) => self.on_frame(now, frame),
            EdgeLinkInput::Registered(answer) => {
                if self.phase != Phase::Registering {
                    return;
                }
                match answer {
                    Ok((generation, config)) => {
                        self.phase = Phase::Registered(generation);
                        self.send(EdgeControl::Registered(RegisterResponse::Accepted {
                            generation,
                            config,
                        }));
                    }
                    Err(rejection) => {
                        self.send(EdgeControl::Registered(RegisterResponse::Rejected {
                            reason: rejection.reason,
                            message: rejection.message,
                            edge_protocol_version: PROTOCOL_VERSION,
                        }));
                        self.end(CloseCode::RegistrationRejected);
                    }
                }
            }
            EdgeLinkInput::ReadyAnswer { accepted } => {
                let Phase::Readying(generation) = self.phase else {
                    return;
                };
                self.send(EdgeControl::ReadyAck(NodeReadyResponse {
                    generation,
                    accepted,
                }));
                if accepted {
                    self.phase = Phase::Live(generation);
                    self.handshake_deadline = None;
                    self.heartbeat = Some(Heartbeat::new(now, self.config.heartbeat));
                    self.out.push_back(EdgeLinkOutput::Connected(generation));
                } else {
                    // Superseded while registering.
                    self.end(CloseCode::Superseded);
                }
            }
            EdgeLinkInput::Cancel(run_id) => {
                if self.is_live() {
                    self.send(EdgeControl::Cancel(iop_wire::Cancel { run_id }));
                }
            }
            EdgeLinkInput::CancelParked(c) => {
                if self.is_live() {
                    self.send(EdgeControl::CancelParked(c));
                }
            }
            EdgeLinkInput::Refresh(snapshot) => {
                if self.is_live() {
                    self.send(EdgeControl::ConfigRefresh(snapshot));
                }
            }
            EdgeLinkInput::Close(code) | EdgeLinkInput::Lost(code) => self.end(code),
            EdgeLinkInput::StreamEnded => {
                let code = if self.is_live() {
                    CloseCode::Normal
                } else {
                    CloseCode::ProtocolError
                };
                self.end(code);
            }
        }
        self.drain_heartbeat();
    }

    /// Fire what is due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.phase == Phase::Over {
            return;
        }
        if self.handshake_deadline.is_some_and(|d| now >= d) {
            self.end(CloseCode::ProtocolError);
            return;
        }
        if let Some(hb) = self.heartbeat.as_mut() {
            hb.handle_timeout(now);
        }
        self.drain_heartbeat();
    }

    /// The earliest moment [`EdgeLink::handle_timeout`] is due.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.phase == Phase::Over {
            return None;
        }
        crate::time::earliest(
            self.handshake_deadline,
            self.heartbeat.as_ref().and_then(Heartbeat::poll_timeout),
        )
    }

    /// The next output to carry out.
    pub fn poll_output(&mut self) -> Option<EdgeLinkOutput> {
        self.out.pop_front()
    }

    /// The generation the dispatcher gave this connection, once registered
    /// (and still after it ended).
    pub fn generation(&self) -> Option<Generation> {
        match self.phase {
            Phase::Registered(g) | Phase::Readying(g) | Phase::Live(g) => Some(g),
            Phase::Opening | Phase::Registering | Phase::Over => None,
        }
    }

    /// Whether readiness completed and the connection is not over.
    pub fn is_live(&self) -> bool {
        matches!(self.phase, Phase::Live(_))
    }

    /// Whether the connection ended.
    pub fn is_over(&self) -> bool {
        self.phase == Phase::Over
    }

    /// The heartbeat, once live (read access).
    pub fn heartbeat(&self) -> Option<&Heartbeat> {
        self.heartbeat.as_ref()
    }

    fn send(&mut self, frame: EdgeControl) {
        self.out.push_back(EdgeLinkOutput::Send(frame));
    }

    fn end(&mut self, code: CloseCode) {
        if self.phase == Phase::Over {
            return;
        }
        let generation = self.generation();
        self.phase = Phase::Over;
        self.handshake_deadline = None;
        self.heartbeat = None;
        self.out.push_back(EdgeLinkOutput::End { code, generation });
    }

    /// A frame naming `generation`, which is not this connection's: a late
    /// message of another generation, within the connection's budget.
    fn stale(&mut self, generation: Generation) {
        match self.budget.stale_frame() {
            Ok(()) => self.out.push_back(EdgeLinkOutput::LateMessage(generation)),
            Err(flood) => self.flooded(flood),
        }
    }

    fn flooded(&mut self, flood: Flood) {
        self.out.push_back(EdgeLinkOutput::Flooded(flood));
        self.end(CloseCode::ProtocolError);
    }

    fn on_frame(&mut self, now: Instant, frame: NodeControl) {
        match (self.phase, frame) {
            (Phase::Opening, NodeControl::Register(request)) => {
                self.budget.registered_parked(request.parked.len());
                self.phase = Phase::Registering;
                self.out.push_back(EdgeLinkOutput::Register(request));
            }
            // The first frame must be `Register`.
            (Phase::Opening, _) => self.end(CloseCode::ProtocolError),
            // One registration per connection.
            (_, NodeControl::Register(_)) => self.end(CloseCode::ProtocolError),
            (_, NodeControl::Closing { code }) => self.end(code),
            (Phase::Registered(generation), NodeControl::Ready(ready))
                if ready.generation == generation =>
            {
                self.phase = Phase::Readying(generation);
                self.out.push_back(EdgeLinkOutput::Ready(generation));
            }
            (Phase::Readying(generation) | Phase::Live(generation), NodeControl::Ready(ready))
                if ready.generation == generation => {}
            (_, NodeControl::Ready(ready)) => self.stale(ready.generation),
            (Phase::Live(generation), NodeControl::ConfigApplied { generation: g })
                if g != generation =>
            {
                self.stale(g);
            }
            (Phase::Live(generation), NodeControl::Parked { runs }) => {
                match self.budget.parked_report(now, runs.len()) {
                    Ok(()) => self
                        .out
                        .push_back(EdgeLinkOutput::Parked { generation, runs }),
                    Err(flood) => self.flooded(flood),
                }
            }
            (Phase::Live(_), NodeControl::Ping(hb)) => {
                if let Some(heartbeat) = self.heartbeat.as_mut() {
                    heartbeat.handle_input(now, HeartbeatInput::Ping { seq: hb.seq });
                }
            }
            (Phase::Live(_), NodeControl::Pong(hb)) => {
                if let Some(heartbeat) = self.heartbeat.as_mut() {
                    heartbeat.handle_input(now, HeartbeatInput::Pong { seq: hb.seq });
                }
            }
            // Before readiness a ping is answered without a heartbeat of
            // our own.
            (_, NodeControl::Ping(hb)) => self.send(EdgeControl::Pong(hb)),
            (_, NodeControl::Pong(_) | NodeControl::ConfigApplied { .. })
            | (_, NodeControl::Parked { .. }) => {}
        }
    }

    fn drain_heartbeat(&mut self) {
        let Some(heartbeat) = self.heartbeat.as_mut() else {
            return;
        };
        let mut timed_out = false;
        while let Some(out) = heartbeat.poll_output() {
            match out {
                HeartbeatOutput::SendPing(seq) => self.out.push_back(EdgeLinkOutput::Send(
                    EdgeControl::Ping(iop_wire::Heartbeat { seq }),
                )),
                HeartbeatOutput::SendPong(seq) => self.out.push_back(EdgeLinkOutput::Send(
                    EdgeControl::Pong(iop_wire::Heartbeat { seq }),
                )),
                HeartbeatOutput::TimedOut => timed_out = true,
            }
        }
        if timed_out {
            self.out.push_back(EdgeLinkOutput::HeartbeatTimedOut);
            self.end(CloseCode::HeartbeatTimeout);
        }
    }
}

#[cfg(test)]
mod tests;
