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
    /// The trace context the Node's spans join (the request's span).
    pub trace_context: Option<iop_wire::TraceContext>,
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
        // The configuration is validated against core's limits at load
        // (`admission.max_attempts`, `admission.request_budget_ms`), so this
        // cannot fail; if it ever does the request fails loudly rather than
        // run on a budget nobody configured.
        let budget = match GateBudget::new(ctx.max_attempts, ctx.request_budget) {
            Ok(budget) => budget,
            Err(e) => {
                debug_assert!(false, "unvalidated request budget: {e}");
                tracing::error!(event = "edge_request_budget_invalid", error = %e);
                let _ = tx
                    .send(Delivery::Fail {
                        kind: GateFailure::Attempt(FailureCode::Internal),
                        in_stream: false,
                    })
                    .await;
                return;
            }
        };
        let mut driver = Driver {
            budget,
            ctx,
            request_id,
            pool,
            work,
            out: tx,
            held: VecDeque::new(),
            held_bytes: 0,
            committed: false,
            started_at: tokio::time::Instant::now(),
        };
        driver.run().await;
    });
    rx
}

/// The most deliveries held before commit (R-GATE-2 holds everything that
/// is not content). A node that keeps sending non-content frames past this
/// fails its attempt instead of growing the buffer.
pub const MAX_HELD_DELIVERIES: usize = 256;

/// The most bytes (approximately: bodies, header names and values) held
/// before commit; see [`MAX_HELD_DELIVERIES`].
pub const MAX_HELD_BYTES: usize = 1024 * 1024;

/// The pre-commit buffer is full: the attempt's node broke the bound.
#[derive(Debug, Clone, Copy)]
struct HeldOverflow;

struct Driver {
    ctx: DriverContext,
    budget: GateBudget,
    request_id: RequestId,
    pool: Vec<ProviderId>,
    work: Work,
    out: mpsc::Sender<Delivery>,
    /// Deliveries held until commit, bounded by [`MAX_HELD_DELIVERIES`] and
    /// [`MAX_HELD_BYTES`].
    held: VecDeque<Delivery>,
    /// Approximate bytes in `held`.
    held_bytes: usize,
    committed: bool,
    started_at: tokio::time::Instant,
}

impl Drop for Driver {
    /// However the request ended, its place in the hub goes with it: the
    /// waiter entry, a queue entry or a lease still held (an ignored terminal
    /// keeps its lease until released, R-LEASE-2). Cancelling an already
    /// finished request changes nothing.
    fn drop(&mut self) {
        self.ctx.hub.cancel(self.request_id);
    }
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
            // Every pass is bounded by the request's budget and ends on a
            // client disconnect, however it got here (R-GATE-1, R-GATE-4).
            gate.handle_timeout(clock.now());
            if gate.end().is_none() && client.is_closed() {
                let _ = gate.handle_input(clock.now(), GateInput::ClientDisconnected);
            }
            if gate.end().is_some() {
                self.carry_out(&mut gate, None).await;
                return;
            }
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
                        // The attempt counts from here: opening the stream and
                        // sending the request are part of it, so a failure
                        // there is an attempt event the gate's budget governs
                        // (R-GATE-1), never a silent re-admission.
                        let _ = gate.handle_input(
                            clock.now(),
                            GateInput::Dispatched {
                                provider_id: lease.provider_id.clone(),
                            },
                        );
                        let Some(attempt_id) = gate.current_attempt() else {
                            return;
                        };
                        let deadline = gate.poll_timeout();
                        let opened = tokio::select! {
                            opened = self.open(&lease, &link.conn, recipient.as_ref()) => opened,
                            () = clock.sleep_until(deadline) => {
                                gate.handle_timeout(clock.now());
                                self.carry_out(&mut gate, None).await;
                                return;
                            }
                            () = client.closed() => {
                                let _ = gate.handle_input(clock.now(), GateInput::ClientDisconnected);
                                self.carry_out(&mut gate, None).await;
                                return;
                            }
                        };
                        match opened {
                            Ok(a) => break (a, attempt_id),
                            Err(e) => {
                                tracing::warn!(
                                    event = "edge_attempt_send_failed",
                                    provider = %lease.provider_id,
                                    error = %e
                                );
                                // Release the lease (the node never got the
                                // run, or gets a cancel for it) and end the
                                // attempt with its event.
                                self.ctx.hub.cancel(self.request_id);
                                let _ = gate.handle_input(
                                    clock.now(),
                                    GateInput::Attempt {
                                        attempt: attempt_id,
                                        event: send_failure_event(&e),
                                    },
                                );
                                self.carry_out(&mut gate, None).await;
                                return;
                            }
                        }
                    }
                    Ok(PreSendAnswer::Refenced) => continue,
                    Ok(PreSendAnswer::Gone) => {
                        // Its connection is gone: let go of whatever the
                        // request still holds, then admit it again (bounded
                        // by the budget check at the top of the loop).
                        self.ctx.hub.cancel(self.request_id);
                        continue 'attempts;
                    }
                    Err(_) => return,
                }
            };
            let (mut attempt, attempt_id) = attempt;
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
                trace_context: self.work.trace_context,
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
                trace_context: self.work.trace_context,
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
                    let content = class == AttemptFrame::Event(AttemptEvent::Content);
                    match frame {
                        ProviderTunnelFrame::Head { status, headers } => {
                            if self
                                .hold(Delivery::Commit {
                                    tunnel_head: Some((status, headers)),
                                })
                                .is_err()
                            {
                                return self.overflowed(gate, attempt_id);
                            }
                        }
                        ProviderTunnelFrame::Body(bytes) => {
                            if self
                                .deliver_or_hold(Delivery::Body(bytes), content)
                                .await
                                .is_err()
                            {
                                return self.overflowed(gate, attempt_id);
                            }
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
                        let content = class == AttemptFrame::Event(AttemptEvent::Content);
                        match &kind {
                            // A start is the gate's alone; an empty delta is
                            // nothing to relay.
                            RunEventKind::Started { .. } => {}
                            RunEventKind::TextDelta(t) if t.is_empty() => {}
                            _ => {
                                if self
                                    .deliver_or_hold(Delivery::Event(kind), content)
                                    .await
                                    .is_err()
                                {
                                    return self.overflowed(gate, attempt_id);
                                }
                            }
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

    /// The node sent more than the pre-commit buffer holds: the attempt fails
    /// (its lease is released and its run canceled when the request ends).
    fn overflowed(
        &mut self,
        gate: &mut StreamGate,
        attempt_id: iop_core::edge::gate::AttemptId,
    ) -> Step {
        tracing::warn!(
            event = "edge_attempt_held_overflow",
            held = self.held.len(),
            held_bytes = self.held_bytes
        );
        self.ctx.hub.cancel(self.request_id);
        let _ = gate.handle_input(
            self.ctx.clock.now(),
            GateInput::Attempt {
                attempt: attempt_id,
                event: AttemptEvent::Failed {
                    code: FailureCode::MalformedResponse,
                },
            },
        );
        Step::AttemptOver
    }

    /// The node stream broke without a terminal.
    async fn broken(&mut self, _attempt: &Attempt) -> AttemptEvent {
        // Release the lease if the fence has not already (exactly once either
        // way) and cancel the node run.
        self.ctx.hub.cancel(self.request_id);
        AttemptEvent::TransportLost
    }

    /// Hold `d` until commit, within [`MAX_HELD_DELIVERIES`] and
    /// [`MAX_HELD_BYTES`].
    fn hold(&mut self, d: Delivery) -> Result<(), HeldOverflow> {
        let bytes = delivery_bytes(&d);
        if self.held.len() >= MAX_HELD_DELIVERIES
            || self.held_bytes.saturating_add(bytes) > MAX_HELD_BYTES
        {
            return Err(HeldOverflow);
        }
        self.held_bytes += bytes;
        self.held.push_back(d);
        Ok(())
    }

    /// Forget everything held (after a flush, a re-admission or a failure).
    fn clear_held(&mut self) {
        self.held.clear();
        self.held_bytes = 0;
    }

    fn hold_or_deliver_terminal(&mut self, kind: RunEventKind) {
        // The Completed event carries final usage; it is delivered before
        // Finish whatever the commit state. It ends the attempt, so it is
        // held at most once past the bound.
        self.held.push_back(Delivery::Event(kind));
    }

    /// Forward `d` after commit, hold it before. `content` is core's
    /// classification of the frame it came from ([`AttemptFrame`]).
    async fn deliver_or_hold(&mut self, d: Delivery, content: bool) -> Result<(), HeldOverflow> {
        if self.committed {
            let _ = self.out.send(d).await;
            Ok(())
        } else if content {
            // Content: the gate commits on it right away (R-GATE-2), so it
            // never stays held and is not counted against the bound.
            self.held.push_back(d);
            Ok(())
        } else {
            self.hold(d)
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
                    self.held_bytes = 0;
                }
                GateOutput::CloseTransport { .. } => {
                    // R-GATE-2: the old transport is closed before re-admission.
                    if let Some(a) = attempt.as_deref_mut() {
                        let _ = a.send.reset(StreamErrorCode::Canceled);
                        let _ = a.recv.stop(StreamErrorCode::Canceled);
                    }
                    self.clear_held();
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
                    self.held_bytes = 0;
                    let _ = self.out.send(Delivery::Finish).await;
                    next = Next::Done;
                }
                GateOutput::FailBeforeCommit { kind } => {
                    self.clear_held();
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

/// The gate's event for an attempt whose node stream could not be opened or
/// whose request could not be sent: a request the wire cannot carry is the
/// client's (it can never be sent); anything else lost the transport.
fn send_failure_event(error: &FramedError) -> AttemptEvent {
    match error {
        FramedError::Encode(_) => AttemptEvent::Failed {
            code: FailureCode::InvalidRequest,
        },
        _ => AttemptEvent::TransportLost,
    }
}

/// Approximate size of a held delivery for [`MAX_HELD_BYTES`].
fn delivery_bytes(d: &Delivery) -> usize {
    const ITEM_OVERHEAD: usize = 16;
    ITEM_OVERHEAD
        + match d {
            Delivery::Commit {
                tunnel_head: Some((_, headers)),
            } => headers
                .iter()
                .map(|(name, value)| name.len().saturating_add(value.len()))
                .fold(0usize, usize::saturating_add),
            Delivery::Body(bytes) => bytes.len(),
            Delivery::Event(_)
            | Delivery::Commit { tunnel_head: None }
            | Delivery::Finish
            | Delivery::Fail { .. } => 0,
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
