//! The request driver: one task per client Chat Completions / Responses /
//! Ollama request. It owns the request's [`StreamGate`] (R-GATE-1) and
//! carries out what the gate and the hub decide: admit, pre-send fence,
//! open the node stream, relay events, apply the terminal, close the old
//! transport and re-admit, commit, fail. It decides nothing itself.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use iop_core::edge::admission::{AdmitRejection, DispatchRequest, Lease, RequestId};
use iop_core::edge::gate::{
    AdmissionFailure, AttemptEvent, AttemptFrame, GateBudget, GateFailure, GateInput, GateOutput,
    StreamGate,
};
use iop_core::ids::ProviderId;
use iop_transport::clock::Clock;
use iop_transport::framed::{FramedError, FramedRecv, FramedSend, open_framed};
use iop_wire::{
    ChatMessage, DataRequest, ExecutionFailure, FailureCode, GenerationParams, Header,
    ProviderTunnelFrame, ProviderTunnelRequest, RunApi, RunEvent, RunEventKind, RunRequest,
    StreamErrorCode, ToolDefinition,
};
use tokio::sync::mpsc;

use crate::config::ProviderMode;
use crate::hub::{AdmitAnswer, HubHandle, PreSendAnswer, RequestEvent};

/// What the request asks a provider to do.
#[derive(Debug, Clone)]
pub struct Work {
    /// The model clients asked for.
    pub model: String,
    /// Chat or generate.
    pub api: RunApi,
    /// Conversation.
    pub messages: Vec<ChatMessage>,
    /// Tools.
    pub tools: Vec<ToolDefinition>,
    /// Parameters.
    pub params: GenerationParams,
    /// The raw client request, for tunnel-mode providers that speak the
    /// same API (`None`: this API cannot be tunnelled).
    pub tunnel: Option<TunnelBody>,
    /// Route class for metrics (`chat`, `responses`, `ollama_chat`, ...).
    pub route: &'static str,
    /// The principal of the API key (bound into credential leases).
    pub principal: String,
}

/// The raw client request to relay to a tunnel-mode provider.
#[derive(Debug, Clone)]
pub struct TunnelBody {
    /// Which provider API the raw request speaks: only a provider of that
    /// API can take it as a tunnel.
    pub api: TunnelApi,
    /// Path, e.g. `/v1/chat/completions`.
    pub path: String,
    /// Headers to pass on (content type, accept).
    pub headers: Vec<Header>,
    /// Body bytes.
    pub body: Vec<u8>,
}

/// The provider API of a raw client request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TunnelApi {
    /// OpenAI (`/v1/...`): `openai` and `mock` adapters.
    OpenAi,
    /// Ollama (`/api/...`): `ollama` adapters.
    Ollama,
}

impl TunnelApi {
    /// Can a provider of `adapter` take this raw request?
    pub fn spoken_by(self, adapter: iop_wire::AdapterKind) -> bool {
        use iop_wire::AdapterKind as A;
        matches!(
            (self, adapter),
            (TunnelApi::OpenAi, A::OpenAi | A::Mock) | (TunnelApi::Ollama, A::Ollama)
        )
    }
}

/// What the HTTP response receives, in order.
#[derive(Debug)]
pub enum Delivery {
    /// Send the response head now (R-GATE-2: first content arrived). For a
    /// tunnel the provider's status and headers ride along.
    Commit {
        /// `Some` for a tunnelled response.
        tunnel_head: Option<(u16, Vec<Header>)>,
    },
    /// A normalized event.
    Event(RunEventKind),
    /// Tunnelled body bytes.
    Body(Vec<u8>),
    /// Normal end.
    Finish,
    /// The one error terminal (R-GATE-3): before commit as an HTTP error,
    /// after commit in the stream.
    Fail {
        /// Why.
        kind: GateFailure,
        /// After commit?
        in_stream: bool,
    },
}

/// Everything a driver needs from the Edge.
#[derive(Clone)]
pub struct DriverContext {
    /// The hub.
    pub hub: HubHandle,
    /// Clock.
    pub clock: Clock,
    /// Request ids.
    pub next_request_id: Arc<AtomicU64>,
    /// Budget per request.
    pub max_attempts: u32,
    /// Total time per request.
    pub request_budget: Duration,
    /// Provider id -> transport mode.
    pub modes: Arc<std::collections::HashMap<ProviderId, ProviderMode>>,
    /// Observations for metrics.
    pub observe: Arc<dyn Fn(DriverObservation) + Send + Sync>,
    /// Managed credentials (R-CRED-1).
    pub creds: Arc<crate::cred::Credentials>,
    /// Provider id -> managed credential profile.
    pub profiles: Arc<std::collections::HashMap<ProviderId, String>>,
}

/// What the driver reports for metrics and logs (closed values only).
#[derive(Debug, Clone, Copy)]
pub enum DriverObservation {
    /// A recovery eligibility decision.
    Eligibility(&'static str),
    /// A recovery result.
    Result(&'static str),
    /// A re-admission happened.
    Readmitted,
    /// Time to first content, by route class.
    Ttft(&'static str, Duration),
}

/// Start a driver for one request; deliveries arrive on the returned
/// receiver. Dropping the receiver is a client disconnect (R-GATE-4).
pub fn spawn(ctx: DriverContext, pool: Vec<ProviderId>, work: Work) -> mpsc::Receiver<Delivery> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let request_id = ctx.next_request_id.fetch_add(1, Ordering::Relaxed);
        let mut driver = Driver {
            budget: GateBudget::new(ctx.max_attempts, ctx.request_budget)
                .unwrap_or_else(|_| GateBudget::new(1, Duration::from_secs(600)).expect("valid")),
            ctx,
            request_id,
            pool,
            work,
            out: tx,
            held: VecDeque::new(),
            committed: false,
            started_at: tokio::time::Instant::now(),
        };
        driver.run().await;
    });
    rx
}

struct Driver {
    ctx: DriverContext,
    budget: GateBudget,
    request_id: RequestId,
    pool: Vec<ProviderId>,
    work: Work,
    out: mpsc::Sender<Delivery>,
    /// Deliveries held until commit.
    held: VecDeque<Delivery>,
    committed: bool,
    started_at: tokio::time::Instant,
}

/// One attempt's open node stream.
struct Attempt {
    lease: Lease,
    send: FramedSend,
    recv: FramedRecv,
    tunnel: bool,
}

enum Step {
    /// Keep going with the current attempt.
    Continue,
    /// The attempt is over; what next is in the gate's outputs.
    AttemptOver,
}

impl Driver {
    async fn run(&mut self) {
        let clock = self.ctx.clock;
        let client = self.out.clone();
        let mut gate = StreamGate::new(clock.now(), self.budget);
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let mut hints: (Option<ProviderId>, bool) = (None, false);
        'attempts: loop {
            // Admission (first attempt with zero hints, R-SEL-1).
            let request = DispatchRequest {
                request_id: self.request_id,
                pool: self.pool.clone(),
                avoid_provider_id: hints.0.clone(),
                allow_avoided_fallback: hints.1,
                stall_timeout_ms: None,
            };
            let Ok(answer) = self.ctx.hub.admit(request, events_tx.clone()).await else {
                return;
            };
            let mut lease = match answer {
                AdmitAnswer::Leased(lease) => Some(lease),
                AdmitAnswer::Queued => None,
                AdmitAnswer::Rejected(r) => {
                    let failure = match r {
                        AdmitRejection::QueueFull => AdmissionFailure::QueueFull,
                        AdmitRejection::NoRoute | AdmitRejection::DuplicateRequest => {
                            AdmissionFailure::NoEligibleProvider
                        }
                    };
                    let _ = gate
                        .handle_input(self.ctx.clock.now(), GateInput::AdmissionFailed(failure));
                    self.carry_out(&mut gate, None).await;
                    return;
                }
            };
            // Wait for a lease that passes the pre-send fence (R-GEN-4).
            let attempt = loop {
                let current = match lease.take() {
                    Some(l) => l,
                    None => {
                        let event = tokio::select! {
                            ev = events.recv() => ev,
                            () = self.ctx.clock.sleep_until(gate.poll_timeout()) => {
                                gate.handle_timeout(self.ctx.clock.now());
                                self.ctx.hub.cancel(self.request_id);
                                self.carry_out(&mut gate, None).await;
                                return;
                            }
                            () = self.out.closed() => {
                                let _ = gate.handle_input(self.ctx.clock.now(), GateInput::ClientDisconnected);
                                self.ctx.hub.cancel(self.request_id);
                                return;
                            }
                        };
                        match event {
                            Some(RequestEvent::Leased(l)) => l,
                            Some(RequestEvent::QueueExpired) | None => {
                                let _ = gate.handle_input(
                                    self.ctx.clock.now(),
                                    GateInput::AdmissionFailed(AdmissionFailure::QueueTimeout),
                                );
                                self.carry_out(&mut gate, None).await;
                                return;
                            }
                            // While waiting here the request is queued (or
                            // being re-resolved by the pre-send fence), so a
                            // fence can only be about a lease this attempt
                            // already gave up: ignore it rather than admit
                            // the request a second time.
                            Some(RequestEvent::LeaseFenced(_)) => continue,
                        }
                    }
                };
                match self.ctx.hub.pre_send(current.lease_id).await {
                    Ok(PreSendAnswer::Send(lease, link, recipient)) => {
                        match self.open(&lease, &link.conn, recipient.as_ref()).await {
                            Ok(a) => break a,
                            Err(_) => {
                                // The connection died under us: its fence will
                                // release the lease; ask again.
                                self.ctx.hub.cancel(self.request_id);
                                continue 'attempts;
                            }
                        }
                    }
                    Ok(PreSendAnswer::Refenced) => continue,
                    Ok(PreSendAnswer::Gone) => continue 'attempts,
                    Err(_) => return,
                }
            };
            let _ = gate.handle_input(
                self.ctx.clock.now(),
                GateInput::Dispatched {
                    provider_id: attempt.lease.provider_id.clone(),
                },
            );
            let Some(attempt_id) = gate.current_attempt() else {
                return;
            };
            let mut attempt = attempt;
            // Relay the attempt.
            loop {
                let deadline = gate.poll_timeout();
                let step = tokio::select! {
                    step = self.relay_one(&mut attempt, &mut gate, attempt_id) => step,
                    () = clock.sleep_until(deadline) => {
                        gate.handle_timeout(clock.now());
                        Step::AttemptOver
                    }
                    () = client.closed() => {
                        let _ = gate.handle_input(clock.now(), GateInput::ClientDisconnected);
                        Step::AttemptOver
                    }
                    Some(ev) = events.recv() => match ev {
                        RequestEvent::LeaseFenced(l) if l.lease_id == attempt.lease.lease_id => {
                            // R-GEN-3: the generation is gone; one transport terminal.
                            let _ = gate.handle_input(clock.now(), GateInput::Attempt {
                                attempt: attempt_id,
                                event: AttemptEvent::TransportLost,
                            });
                            Step::AttemptOver
                        }
                        _ => Step::Continue,
                    },
                };
                match self.carry_out(&mut gate, Some(&mut attempt)).await {
                    Next::Readmit(avoid, allow) => {
                        hints = (Some(avoid), allow);
                        self.ctx.observe.as_ref()(DriverObservation::Readmitted);
                        continue 'attempts;
                    }
                    Next::Done => return,
                    Next::Continue => {
                        if matches!(step, Step::AttemptOver) {
                            // The gate always ends or re-admits after an
                            // attempt ends; never read a finished stream.
                            debug_assert!(gate.end().is_some());
                            self.ctx.hub.cancel(self.request_id);
                            return;
                        }
                    }
                }
            }
        }
    }

    async fn open(
        &self,
        lease: &Lease,
        conn: &quinn::Connection,
        recipient: Option<&x25519_dalek::PublicKey>,
    ) -> Result<Attempt, FramedError> {
        // R-CRED-1: a fresh lease per attempt, sealed after the pre-send
        // fence. Without one the Node refuses the managed target (fail
        // closed there: `credential_rejected`, no provider call).
        let credential_lease = self
            .ctx
            .profiles
            .get(&lease.provider_id)
            .and_then(|profile| {
                match self.ctx.creds.seal(
                    profile,
                    lease,
                    recipient,
                    &self.work.principal,
                    &self.work.model,
                ) {
                    Ok(bytes) => Some(bytes),
                    Err(why) => {
                        tracing::warn!(
                            event = "edge_credential_lease_unavailable",
                            provider = %lease.provider_id,
                            reason = ?why
                        );
                        None
                    }
                }
            });
        let (mut send, recv) = open_framed(conn).await?;
        // A tunnel only to a tunnel-mode provider that speaks the client's
        // API; anything else is a normalized run.
        let tunnel = self.ctx.modes.get(&lease.provider_id) == Some(&ProviderMode::Tunnel)
            && self
                .work
                .tunnel
                .as_ref()
                .is_some_and(|t| t.api.spoken_by(lease.adapter));
        let request = match (&self.work.tunnel, tunnel) {
            (Some(t), true) => DataRequest::Tunnel(ProviderTunnelRequest {
                run_id: lease.run_id,
                session_id: format!("r{}", self.request_id),
                adapter: lease.adapter,
                target: lease.target.clone(),
                method: "POST".into(),
                path: t.path.clone(),
                headers: t.headers.clone(),
                body: t.body.clone(),
                response_stall_timeout_ms: lease.stall_timeout_ms,
                deadline_ms: 0,
                credential_lease: credential_lease.clone(),
            }),
            _ => DataRequest::Run(RunRequest {
                run_id: lease.run_id,
                session_id: format!("r{}", self.request_id),
                adapter: lease.adapter,
                target: lease.target.clone(),
                model: self.work.model.clone(),
                api: self.work.api,
                messages: self.work.messages.clone(),
                tools: self.work.tools.clone(),
                params: self.work.params.clone(),
                response_stall_timeout_ms: lease.stall_timeout_ms,
                deadline_ms: 0,
                credential_lease: credential_lease.clone(),
            }),
        };
        send.send(&request).await?;
        let _ = send.finish();
        Ok(Attempt {
            lease: lease.clone(),
            send,
            recv,
            tunnel,
        })
    }

    /// Read one frame of the attempt and feed the gate.
    async fn relay_one(
        &mut self,
        attempt: &mut Attempt,
        gate: &mut StreamGate,
        attempt_id: iop_core::edge::gate::AttemptId,
    ) -> Step {
        let clock = self.ctx.clock;
        // Which frame is content (and so commits) is core's rule
        // (R-GATE-2); this only relays the frame.
        let event = if attempt.tunnel {
            match attempt.recv.recv::<ProviderTunnelFrame>().await {
                Ok(Some(ProviderTunnelFrame::End)) => self.terminal(attempt, None).await,
                Ok(Some(ProviderTunnelFrame::Failure(f))) => self.terminal(attempt, Some(f)).await,
                Ok(Some(frame)) => {
                    let class = AttemptFrame::from_tunnel_frame(&frame);
                    match frame {
                        ProviderTunnelFrame::Head { status, headers } => {
                            self.hold(Delivery::Commit {
                                tunnel_head: Some((status, headers)),
                            });
                        }
                        ProviderTunnelFrame::Body(bytes) => {
                            self.deliver_or_hold(Delivery::Body(bytes)).await;
                        }
                        ProviderTunnelFrame::End | ProviderTunnelFrame::Failure(_) => {}
                    }
                    match class {
                        AttemptFrame::Event(event) => event,
                        AttemptFrame::NoEvent | AttemptFrame::Terminal => return Step::Continue,
                    }
                }
                Ok(None) | Err(_) => self.broken(attempt).await,
            }
        } else {
            match attempt.recv.recv::<RunEvent>().await {
                Ok(Some(RunEvent { kind, .. })) => match kind {
                    RunEventKind::Completed { .. } => {
                        self.hold_or_deliver_terminal(kind);
                        self.terminal(attempt, None).await
                    }
                    RunEventKind::Failed(f) => self.terminal(attempt, Some(f)).await,
                    kind => {
                        let class = AttemptFrame::from_run_event(&kind);
                        match &kind {
                            // A start is the gate's alone; an empty delta is
                            // nothing to relay.
                            RunEventKind::Started { .. } => {}
                            RunEventKind::TextDelta(t) if t.is_empty() => {}
                            _ => self.deliver_or_hold(Delivery::Event(kind)).await,
                        }
                        match class {
                            AttemptFrame::Event(event) => event,
                            AttemptFrame::NoEvent | AttemptFrame::Terminal => {
                                return Step::Continue;
                            }
                        }
                    }
                },
                Ok(None) | Err(_) => self.broken(attempt).await,
            }
        };
        let _ = gate.handle_input(
            clock.now(),
            GateInput::Attempt {
                attempt: attempt_id,
                event: event.clone(),
            },
        );
        match event {
            AttemptEvent::Completed
            | AttemptEvent::Stalled(_)
            | AttemptEvent::Failed { .. }
            | AttemptEvent::TransportLost => Step::AttemptOver,
            _ => Step::Continue,
        }
    }

    /// Apply the attempt's terminal through the hub (R-LEASE-1) and turn the
    /// verdict into the gate's attempt event.
    async fn terminal(
        &mut self,
        attempt: &Attempt,
        failure: Option<ExecutionFailure>,
    ) -> AttemptEvent {
        let code = failure.as_ref().map(|f| f.code);
        let verdict = self
            .ctx
            .hub
            .terminal(
                attempt.lease.lease_id,
                attempt.lease.node.clone(),
                attempt.lease.generation,
                failure,
            )
            .await;
        match verdict {
            Ok(verdict) => verdict.attempt_event(code),
            // The hub is gone: so is the attempt's transport.
            Err(_) => AttemptEvent::TransportLost,
        }
    }

    /// The node stream broke without a terminal.
    async fn broken(&mut self, _attempt: &Attempt) -> AttemptEvent {
        // Release the lease if the fence has not already (exactly once either
        // way) and cancel the node run.
        self.ctx.hub.cancel(self.request_id);
        AttemptEvent::TransportLost
    }

    fn hold(&mut self, d: Delivery) {
        self.held.push_back(d);
    }

    fn hold_or_deliver_terminal(&mut self, kind: RunEventKind) {
        // The Completed event carries final usage; it is delivered before
        // Finish whatever the commit state.
        self.held.push_back(Delivery::Event(kind));
    }

    async fn deliver_or_hold(&mut self, d: Delivery) {
        if self.committed {
            let _ = self.out.send(d).await;
        } else {
            self.held.push_back(d);
        }
    }

    /// Carry out the gate's outputs.
    async fn carry_out(&mut self, gate: &mut StreamGate, attempt: Option<&mut Attempt>) -> Next {
        let mut attempt = attempt;
        let mut next = Next::Continue;
        while let Some(ev) = gate.poll_event() {
            let obs = match ev {
                iop_core::edge::gate::GateEvent::Eligibility(e) => {
                    DriverObservation::Eligibility(e.as_str())
                }
                iop_core::edge::gate::GateEvent::Result(r) => DriverObservation::Result(r.as_str()),
            };
            self.ctx.observe.as_ref()(obs);
        }
        while let Some(out) = gate.poll_output() {
            match out {
                GateOutput::Commit => {
                    self.committed = true;
                    self.ctx.observe.as_ref()(DriverObservation::Ttft(
                        self.work.route,
                        self.started_at.elapsed(),
                    ));
                    // The head first (a tunnel's own head if it has one).
                    let head_at = self
                        .held
                        .iter()
                        .position(|d| matches!(d, Delivery::Commit { .. }));
                    let head = head_at
                        .and_then(|i| self.held.remove(i))
                        .unwrap_or(Delivery::Commit { tunnel_head: None });
                    let _ = self.out.send(head).await;
                    while let Some(d) = self.held.pop_front() {
                        let _ = self.out.send(d).await;
                    }
                }
                GateOutput::CloseTransport { .. } => {
                    // R-GATE-2: the old transport is closed before re-admission.
                    if let Some(a) = attempt.as_deref_mut() {
                        let _ = a.send.reset(StreamErrorCode::Canceled);
                        let _ = a.recv.stop(StreamErrorCode::Canceled);
                    }
                    self.held.clear();
                }
                GateOutput::Readmit {
                    avoid_provider_id,
                    allow_avoided_fallback,
                } => next = Next::Readmit(avoid_provider_id, allow_avoided_fallback),
                GateOutput::CancelRun { .. } => {
                    if let Some(a) = attempt.as_deref_mut() {
                        let _ = a.send.reset(StreamErrorCode::Canceled);
                        let _ = a.recv.stop(StreamErrorCode::Canceled);
                    }
                    // R-GATE-4: cancel the node run and release the lease.
                    self.ctx.hub.cancel(self.request_id);
                    next = Next::Done;
                }
                GateOutput::Finish => {
                    if !self.committed {
                        self.committed = true;
                        let _ = self.out.send(Delivery::Commit { tunnel_head: None }).await;
                    }
                    while let Some(d) = self.held.pop_front() {
                        if !matches!(d, Delivery::Commit { .. }) {
                            let _ = self.out.send(d).await;
                        }
                    }
                    let _ = self.out.send(Delivery::Finish).await;
                    next = Next::Done;
                }
                GateOutput::FailBeforeCommit { kind } => {
                    self.held.clear();
                    let _ = self
                        .out
                        .send(Delivery::Fail {
                            kind,
                            in_stream: false,
                        })
                        .await;
                    next = Next::Done;
                }
                GateOutput::FailInStream { kind } => {
                    let _ = self
                        .out
                        .send(Delivery::Fail {
                            kind,
                            in_stream: true,
                        })
                        .await;
                    next = Next::Done;
                }
            }
        }
        next
    }
}

enum Next {
    Continue,
    Readmit(ProviderId, bool),
    Done,
}

/// A failure code for a run that failed for a reason the gate names.
pub fn failure_code(kind: GateFailure) -> Option<FailureCode> {
    match kind {
        GateFailure::Attempt(code) => Some(code),
        _ => None,
    }
}
