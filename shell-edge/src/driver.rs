//! The request driver: one per client Chat Completions / Responses /
//! Ollama request, on a task of its own ([`spawn`]: a streamed or durable
//! answer) or on the client connection's task ([`inline`]: a non-streamed
//! answer, no task hand-off between the two). It drives the request's core machine
//! ([`iop_core::edge::request::Request`], which owns the gate, the attempts,
//! the hold buffer and every decision about the request) and carries out
//! what it says: carry commands to the dispatcher (a direct call under the
//! hub's lock, whose answer is the dispatcher's news about this request),
//! open the node stream and send the request, read frames, reset the
//! stream, deliver to the client. One `select!` over the news no call of
//! its own answers (a queued request's lease, a fence), the open in
//! flight, the node stream, the machine's timer and the client; it decides
//! nothing itself.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt as _;
use iop_core::edge::admission::{Lease, RequestId};
use iop_core::edge::durable::{JournalAck, JournalSpec};
use iop_core::edge::gate::{GateBudget, GateBudgetError, GateEvent};
use iop_core::edge::request::{
    AdoptSpec, NodeFrame, OpenFailure, Request, RequestInput, RequestObservation, RequestOutput,
    RequestSpec,
};
use iop_core::ids::ProviderId;
use iop_trace::{Driven, MachineKind, RequestBegin, RequestConfigRec, Tap};
use iop_transport::clock::Clock;
use iop_transport::framed::{FramedError, FramedRecv, FramedSend, open_framed};
use iop_wire::{
    AdoptRequest, ChatMessage, DataRequest, FailureCode, GenerationParams, Header,
    ProviderTunnelFrame, ProviderTunnelRequest, RunApi, RunEvent, RunRequest, RunStreamFrame,
    StreamErrorCode, ToolDefinition,
};
use tokio::sync::mpsc;

pub use iop_core::edge::request::{Delivery, TunnelApi};

use crate::config::ProviderMode;
use crate::hub::{HubHandle, LinkHandle, RequestNews};
use crate::in_flight::{InFlight, InFlightEntry, RequestView};

/// What the request asks a provider to do.
#[derive(Debug, Clone)]
pub struct Work {
    /// The model the provider is asked for: the one clients asked for, or
    /// a renamed model's discovered name (`[discovered_models.rename]`).
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
    /// R-CONT-1: the route continues a committed answer on another
    /// provider when its own fails for good.
    pub continuation: bool,
    /// The request's hold on its tenant's limits (R-TEN-2): the usage its
    /// answer reports is recorded there; dropped with the driver, it
    /// settles.
    pub tenant: Option<Arc<crate::tenancy::TenantHold>>,
    /// What the operator and the request's record see of it; `None`: the
    /// driver makes its own (a run no client waits on).
    pub view: Option<Arc<RequestView>>,
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

/// Everything a driver needs from the Edge.
#[derive(Clone)]
pub struct DriverContext {
    /// The hub.
    pub hub: HubHandle,
    /// Clock.
    pub clock: Clock,
    /// Request ids.
    pub next_request_id: Arc<AtomicU64>,
    /// Attempts and total time per request (validated at config load).
    pub budget: Result<GateBudget, GateBudgetError>,
    /// How long one delivery may wait for a client that stopped reading
    /// before the request counts as abandoned (R-LIM-4: a slow reader pins
    /// no lease).
    pub client_write_timeout: Duration,
    /// Longest silence on an SSE answer before a keep-alive comment.
    pub sse_keep_alive: Duration,
    /// Provider id -> transport mode.
    pub modes: Arc<std::collections::HashMap<ProviderId, ProviderMode>>,
    /// Observations for metrics.
    pub observe: Arc<dyn Fn(DriverObservation) + Send + Sync>,
    /// Managed credentials (R-CRED-1).
    pub creds: Arc<crate::cred::Credentials>,
    /// Provider id -> managed credential profile.
    pub profiles: Arc<std::collections::HashMap<ProviderId, String>>,
    /// Per-attempt metrics and spans ([`crate::observe`]).
    pub metrics: Arc<crate::metrics::EdgeMetrics>,
    /// The requests in flight (`/status`, the console).
    pub in_flight: Arc<InFlight>,
    /// Which machines are recorded (`--trace-machine edge-request`).
    pub traces: Arc<iop_trace::TraceFiles>,
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

/// How many deliveries wait for a client before the driver waits for it.
const CLIENT_QUEUE: usize = 64;

/// Start a driver for one request on a task of its own; deliveries arrive
/// on the returned receiver. Dropping the receiver is a client disconnect
/// (R-GATE-4).
pub fn spawn(ctx: DriverContext, pool: Vec<ProviderId>, work: Work) -> mpsc::Receiver<Delivery> {
    let (tx, rx) = mpsc::channel(CLIENT_QUEUE);
    start(ctx, pool, work, Some(tx), None, RequestBegin::New);
    rx
}

/// A driver for one request that runs on the task that reads its
/// deliveries (the client connection's): no task is started for it and no
/// delivery wakes another task. The same driver as [`spawn`]'s, polled by
/// [`InlineRun::recv`] instead of by a task of its own.
pub fn inline(ctx: DriverContext, pool: Vec<ProviderId>, work: Work) -> InlineRun {
    let (tx, rx) = mpsc::channel(CLIENT_QUEUE);
    InlineRun {
        rx: Some(rx),
        run: Some(Box::pin(driven(
            ctx,
            pool,
            work,
            Some(tx),
            None,
            RequestBegin::New,
        ))),
    }
}

/// A request's driver driven by whoever reads its deliveries.
///
/// Dropped before its driver ended (the client went away, or its answer
/// was refused), the driver goes on on a task of its own with its
/// deliveries' receiver gone, exactly as a spawned driver whose client
/// left: the request machine hears the disconnect and ends the request
/// (R-GATE-4: the attempt's stream reset, its lease released; the
/// tenant's hold settles when the driver ends, R-TEN-2).
pub struct InlineRun {
    /// `None` only once handed over (drop, [`InlineRun::detach`]).
    rx: Option<mpsc::Receiver<Delivery>>,
    /// `None` once the driver ended.
    run: Option<DriverFuture>,
}

type DriverFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

impl InlineRun {
    /// The next delivery, driving the request until there is one; `None`
    /// once the driver ended and every delivery was taken.
    pub async fn recv(&mut self) -> Option<Delivery> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    fn poll_recv(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Delivery>> {
        use std::task::Poll;
        let Some(rx) = self.rx.as_mut() else {
            return Poll::Ready(None);
        };
        loop {
            // `try_recv` registers no waker: a delivery the driver makes
            // below wakes nothing, it is read right after.
            if let Ok(delivery) = rx.try_recv() {
                return Poll::Ready(Some(delivery));
            }
            let Some(run) = self.run.as_mut() else {
                return Poll::Ready(None);
            };
            if run.as_mut().poll(cx).is_ready() {
                self.run = None;
                continue;
            }
            return match rx.try_recv() {
                Ok(delivery) => Poll::Ready(Some(delivery)),
                Err(_) => Poll::Pending,
            };
        }
    }

    /// Whether the driver ended (its deliveries may still wait).
    pub fn ended(&self) -> bool {
        self.run.is_none()
    }

    /// The rest of the run on a task of its own, its deliveries on the
    /// returned receiver (an answer streamed to a client that may read
    /// slowly: the driver's timers and its write timeout, R-LIM-4, must not
    /// wait for the client's reads).
    pub fn detach(mut self) -> mpsc::Receiver<Delivery> {
        if let Some(run) = self.run.take() {
            tokio::spawn(run);
        }
        self.rx.take().unwrap_or_else(|| mpsc::channel(1).1)
    }
}

impl Drop for InlineRun {
    fn drop(&mut self) {
        // Receiver first: the driver's next step is the client's
        // disconnect (R-GATE-4).
        drop(self.rx.take());
        if let Some(run) = self.run.take() {
            // Outside a runtime (it is shutting down) the driver is
            // dropped: its place in the hub goes with it (`Detach`).
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(run);
            }
        }
    }
}

/// What a durable request's driver writes to (SPEC §6).
pub struct DurableRun {
    /// The record and the writer epoch.
    pub spec: JournalSpec,
    /// The Edge's durable responses (the store the record lives in).
    pub durable: Arc<crate::durable::Durable>,
    /// Cancels the run (`POST .../cancel`, `DELETE`) and brings it the
    /// report of its parked run (R-PARK-2).
    pub commands: crate::durable::LiveCommands,
    /// Held while the run goes on.
    pub live: crate::durable::LiveRun,
    /// How long its run may stay parked on its node (R-PARK-1).
    pub park_grace_ms: u64,
}

/// Where an adopting driver takes a parked run over (R-TAKE-1).
pub struct Takeover {
    /// The node's report.
    pub offer: iop_core::edge::dispatch::ParkedOffer,
    /// Events durable in the record.
    pub last_seq: u64,
    /// The run's frame the last of them came from.
    pub resume_after_frame: u64,
    /// The answer so far, when a lost adoption may be continued on the
    /// pool (R-CONT-1).
    pub resumed: Option<iop_core::edge::durable::ResumedAnswer>,
}

/// Start the driver of a durable request: its deliveries go to the
/// response's journal only (R-JRN-1); clients follow the journal
/// ([`crate::durable::Follower`]), so the run goes on without them and
/// ends only with its terminal or a cancel.
pub fn spawn_durable(ctx: DriverContext, pool: Vec<ProviderId>, mut work: Work, run: DurableRun) {
    // The request machine never tunnels a durable answer (it is the
    // Edge's, numbered and replayable): drop the raw body it will not use.
    work.tunnel = None;
    start(ctx, pool, work, None, Some(run), RequestBegin::New);
}

/// Start a driver that takes over a record whose run is parked on a node
/// (R-TAKE-1, R-PARK-2): it adopts the run and writes the rest of the
/// record; it never starts the prompt again. `pool` is where a lost
/// adoption continues (R-CONT-1, with `takeover.resumed`).
pub fn spawn_takeover(
    ctx: DriverContext,
    pool: Vec<ProviderId>,
    mut work: Work,
    run: DurableRun,
    takeover: Takeover,
) {
    work.tunnel = None;
    let begin = RequestBegin::Adopting {
        offer: takeover.offer,
        last_seq: takeover.last_seq,
        resume_after_frame: takeover.resume_after_frame,
        resumed: takeover.resumed,
    };
    start(ctx, pool, work, None, Some(run), begin);
}

/// Start a driver that takes over a record whose run is gone and
/// continues its answer on `pool` (R-TAKE-1, R-CONT-1): the provider gets
/// the conversation and the answer so far, never the prompt alone.
pub fn spawn_continuation(
    ctx: DriverContext,
    pool: Vec<ProviderId>,
    mut work: Work,
    run: DurableRun,
    resumed: iop_core::edge::durable::ResumedAnswer,
) {
    work.tunnel = None;
    start(
        ctx,
        pool,
        work,
        None,
        Some(run),
        RequestBegin::Continuing { resumed },
    );
}

fn start(
    ctx: DriverContext,
    pool: Vec<ProviderId>,
    work: Work,
    out: Option<mpsc::Sender<Delivery>>,
    durable: Option<DurableRun>,
    begin: RequestBegin,
) {
    tokio::spawn(driven(ctx, pool, work, out, durable, begin));
}

/// One request's driver from its start to its end, on whichever task polls
/// it ([`start`]'s own, or the client's with [`inline`]).
fn driven(
    ctx: DriverContext,
    pool: Vec<ProviderId>,
    work: Work,
    out: Option<mpsc::Sender<Delivery>>,
    durable: Option<DurableRun>,
    begin: RequestBegin,
) -> impl Future<Output = ()> + Send + 'static {
    let tx = out;
    async move {
        let request_id = ctx.next_request_id.fetch_add(1, Ordering::Relaxed);
        // The configuration is validated against core's limits at load
        // (`admission.max_attempts`, `admission.request_budget_ms`), so this
        // cannot fail; if it ever does the request fails loudly rather than
        // run on a budget nobody configured.
        let budget = match ctx.budget {
            Ok(budget) => budget,
            Err(e) => {
                debug_assert!(false, "unvalidated request budget: {e}");
                tracing::error!(event = "edge_request_budget_invalid", error = %e);
                if let Some(tx) = tx {
                    let _ = tx
                        .send(Delivery::Fail {
                            kind: iop_core::edge::gate::GateFailure::Attempt(FailureCode::Internal),
                            in_stream: false,
                            provider: None,
                        })
                        .await;
                }
                return;
            }
        };
        let tunnel_providers = pool
            .iter()
            .filter(|p| ctx.modes.get(*p) == Some(&ProviderMode::Tunnel))
            .cloned()
            .collect();
        let spec = RequestSpec {
            request_id,
            pool,
            budget,
            tunnel_api: work.tunnel.as_ref().map(|t| t.api),
            tunnel_providers,
            journal: durable.as_ref().map(|d| d.spec.clone()),
            park_grace_ms: durable.as_ref().map_or(0, |d| d.park_grace_ms),
            continuation: work.continuation,
            // R-TEN-2: what a cut attempt's prompt is charged.
            prompt_tokens: work
                .tenant
                .as_ref()
                .map_or(0, |tenant| tenant.prompt_tokens()),
        };
        let (events_tx, events) = mpsc::unbounded_channel();
        ctx.hub.attach(request_id, events_tx);
        let view = work
            .view
            .clone()
            .unwrap_or_else(|| RequestView::new(work.route, &work.model, false));
        if let Some(run) = &durable {
            view.set_response_id(&run.spec.response_id);
        }
        let in_flight = ctx.in_flight.enter(view);
        let config = RequestConfigRec::new(spec, begin, ctx.clock.now());
        let tap = ctx
            .traces
            .tap(MachineKind::EdgeRequest, || &config)
            .unwrap_or_else(|e| {
                tracing::error!(event = "edge_trace_open_failed", machine = "edge-request", error = %e);
                Tap::off()
            });
        let machine = Driven::new(config.into_request(), tap);
        let mut driver = Driver {
            detach: Detach {
                hub: ctx.hub.clone(),
                request_id,
            },
            ctx,
            work,
            out: tx,
            events,
            machine,
            link: None,
            opening: None,
            stream: None,
            started_at: tokio::time::Instant::now(),
            wait: None,
            attempt: None,
            journal_write: None,
            admission_told: false,
            commands: None,
            cancel: None,
            journal: None,
            in_flight,
            shown: None,
        };
        if let Some(run) = durable {
            driver.commands = Some(run.commands.commands);
            driver.cancel = Some(run.commands.cancel);
            driver.journal = Some(DriverJournal {
                response_id: run.spec.response_id.clone(),
                park_grace_ms: run.park_grace_ms,
                durable: run.durable,
                live: run.live,
            });
        }
        driver.run().await;
        // Its answer is all delivered (or journaled): one GenAI operation.
        crate::observe::genai_operation(&driver.ctx.metrics, driver.in_flight.view());
    }
}

type JournalFuture = Pin<Box<dyn Future<Output = JournalAck> + Send>>;

/// A durable request's journal and its registration as a live run.
struct DriverJournal {
    durable: Arc<crate::durable::Durable>,
    /// The record (what the node reports if the run parks).
    response_id: String,
    park_grace_ms: u64,
    live: crate::durable::LiveRun,
}

/// However the request ended (even if its task died), its place in the hub
/// goes with it: the waiter entry, a queue entry or a lease still held.
struct Detach {
    hub: HubHandle,
    request_id: RequestId,
}

impl Drop for Detach {
    fn drop(&mut self) {
        self.hub.detach(self.request_id);
    }
}

/// The most frames the driver takes without its `select!`, when they have
/// already arrived: a burst of a fast stream, not the whole stream.
const MAX_READY_FRAMES_IN_A_ROW: u32 = 64;

type OpenFuture = Pin<Box<dyn Future<Output = Result<NodeStream, FramedError>> + Send>>;

/// One attempt's open node stream.
struct NodeStream {
    send: FramedSend,
    recv: FramedRecv,
    tunnel: bool,
}

struct Driver {
    ctx: DriverContext,
    work: Work,
    /// The client's deliveries; `None` for a durable request (its readers
    /// follow the journal).
    out: Option<mpsc::Sender<Delivery>>,
    events: mpsc::UnboundedReceiver<RequestNews>,
    machine: Driven<Request>,
    /// The connection of the lease that last passed the pre-send fence.
    link: Option<(LinkHandle, Option<x25519_dalek::PublicKey>)>,
    /// The attempt's stream being opened and its request sent.
    opening: Option<OpenFuture>,
    /// The attempt's open stream.
    stream: Option<NodeStream>,
    started_at: tokio::time::Instant,
    detach: Detach,
    /// The wait for a lease in progress (`edge.queue_wait`).
    wait: Option<crate::observe::QueueWait>,
    /// The attempt in flight (`edge.attempt`, its tokens and outcome).
    attempt: Option<crate::observe::AttemptObservation>,
    /// A durable request's journal.
    journal: Option<DriverJournal>,
    /// Its write in flight (one at a time, as the request machine asks).
    journal_write: Option<JournalFuture>,
    /// Whether its first admission answer was passed on.
    admission_told: bool,
    /// Cancels a durable request, or brings its parked run's report.
    commands: Option<mpsc::Receiver<crate::durable::LiveCommand>>,
    /// A durable run's cancel (`POST .../cancel`, `DELETE`).
    cancel: Option<tokio::sync::watch::Receiver<bool>>,
    /// Its place among the requests in flight, and its view.
    in_flight: InFlightEntry,
    /// The (phase, attempts, committed) its view shows.
    shown: Option<(iop_core::edge::request::RequestPhase, u32, bool)>,
}

impl Driver {
    /// A durable run's first admission answer, for a background request
    /// that is answered only once admission took or refused its run.
    fn tell_admission(&mut self, event: &iop_core::edge::dispatch::RequestEvent) {
        use iop_core::edge::dispatch::RequestEvent;
        if self.admission_told {
            return;
        }
        let taken = match event {
            RequestEvent::Leased(_) | RequestEvent::Queued => true,
            RequestEvent::Rejected(_) => false,
            _ => return,
        };
        self.admission_told = true;
        if let Some(journal) = &self.journal {
            journal
                .durable
                .admission_answered(&journal.response_id, taken);
        }
    }

    async fn run(&mut self) {
        let clock = self.ctx.clock;
        // Frames taken in a row without the `select!` below.
        let mut ready_in_a_row = 0;
        loop {
            self.carry_out().await;
            self.show_progress();
            if self.machine.machine().is_ended() {
                // R-TEN-2: what no usage report covers (a cut attempt's
                // prompt and text) is charged by its estimate, with what
                // the answer reported.
                let machine = self.machine.machine();
                // A usage report no delivery carried: a tunnelled
                // answer's, read from the provider's bytes, or a durable
                // answer's the store refused to journal.
                let relayed = machine.relayed_usage();
                if let Some(usage) = relayed {
                    self.in_flight
                        .view()
                        .delivered(&iop_wire::RunEventKind::Usage(usage));
                }
                if let Some(tenant) = &self.work.tenant {
                    if let Some(usage) = &relayed {
                        tenant.record(usage);
                    }
                    if machine.answer_charged_elsewhere() {
                        tenant.forget_reported();
                    }
                    tenant.record_unmetered(machine.unmetered());
                }
                // R-JRN-4: a record whose terminal the store refused too
                // often goes to the custody when the run is unregistered.
                if machine.record_left_open()
                    && let Some(journal) = &mut self.journal
                {
                    tracing::warn!(
                        event = "edge_durable_record_left_open",
                        response_id = %journal.response_id,
                        "the store refused the record's terminal; the custody ends it"
                    );
                    journal.live.leave_open();
                }
                return;
            }
            let deadline = self.machine.poll_timeout();
            // A frame that has already arrived goes straight to the
            // machine: no `select!` (its timer and wakers) per frame of a
            // burst. Bounded, so the client, the hub and the timer are
            // still heard between bursts; the same input, in the same
            // order, as the `select!` would give.
            let now = clock.now();
            if ready_in_a_row < MAX_READY_FRAMES_IN_A_ROW
                && deadline.is_none_or(|at| now < at)
                && let Some(frame) = self.ready_frame()
            {
                ready_in_a_row += 1;
                let input = self.frame_input(frame);
                self.machine.handle_input(now, input);
                continue;
            }
            ready_in_a_row = 0;
            let input = tokio::select! {
                news = self.events.recv() => match news {
                    Some(news) => self.news_input(news),
                    // The hub stopped: the process is shutting down. A
                    // durable answer left unfinished is another Edge's to
                    // take over and charge: its reservation stays counted
                    // (R-TEN-2).
                    None => {
                        if self.journal.is_some()
                            && let Some(tenant) = &self.work.tenant
                        {
                            tenant.leave_to_takeover();
                        }
                        return;
                    }
                },
                opened = async {
                    match self.opening.as_mut() {
                        Some(open) => open.await,
                        None => std::future::pending().await,
                    }
                } => {
                    self.opening = None;
                    match opened {
                        Ok(stream) => {
                            self.stream = Some(stream);
                            RequestInput::Opened
                        }
                        Err(e) => {
                            tracing::warn!(event = "edge_attempt_send_failed", error = %e);
                            RequestInput::OpenFailed(open_failure(&e))
                        }
                    }
                },
                ack = async {
                    match self.journal_write.as_mut() {
                        Some(write) => write.await,
                        None => std::future::pending().await,
                    }
                } => {
                    self.journal_write = None;
                    RequestInput::Journaled(ack)
                },
                command = async {
                    match self.commands.as_mut() {
                        Some(commands) => commands.recv().await,
                        None => std::future::pending().await,
                    }
                } => match command {
                    Some(crate::durable::LiveCommand::Parked(offer)) => {
                        if !self.machine.machine().awaits_parked(offer.run.key) {
                            // Not this request's wait: let its capacity go.
                            self.ctx.hub.release_parked(offer.node, offer.run.key);
                            continue;
                        }
                        RequestInput::ParkedRun(offer)
                    }
                    Some(crate::durable::LiveCommand::Kept(kept)) => RequestInput::KeptRuns(kept),
                    None => {
                        // No report reaches it any more.
                        self.commands = None;
                        continue;
                    }
                },
                canceled = async {
                    match self.cancel.as_mut() {
                        Some(cancel) => cancel.wait_for(|c| *c).await.is_ok(),
                        None => std::future::pending().await,
                    }
                } => {
                    // Heard once: a cancel is one input.
                    self.cancel = None;
                    if !canceled {
                        // Nothing can cancel it any more; it runs to its end.
                        continue;
                    }
                    RequestInput::Cancel
                },
                // A durable response whose journal falls behind stops
                // reading its node stream (R-JRN-1, R-LIM-4).
                frame = async {
                    match self.stream.as_mut() {
                        Some(stream) => read_frame(stream).await,
                        None => std::future::pending().await,
                    }
                }, if self.machine.machine().wants_frames() => self.frame_input(frame),
                () = clock.sleep_until(deadline) => {
                    self.machine.handle_timeout(clock.now());
                    continue;
                }
                () = async {
                    match self.out.as_ref() {
                        Some(out) => out.closed().await,
                        None => std::future::pending().await,
                    }
                } => RequestInput::ClientDisconnected,
            };
            self.machine.handle_input(clock.now(), input);
        }
    }

    /// The machine's input for the dispatcher's news about the request,
    /// keeping a pre-send answer's connection for the open.
    fn news_input(&mut self, news: RequestNews) -> RequestInput {
        let RequestNews { event, link } = news;
        if link.is_some() {
            self.link = link;
        }
        self.tell_admission(&event);
        RequestInput::Dispatch(event)
    }

    /// Show the machine's phase in the request's view, when it changed.
    fn show_progress(&mut self) {
        let gate = self.machine.machine().gate();
        let now = (
            self.machine.machine().phase(),
            gate.attempts(),
            gate.is_committed(),
        );
        if self.shown != Some(now) {
            self.shown = Some(now);
            self.in_flight.view().set_phase(now.0, now.1, now.2);
        }
    }

    /// The attempt's next frame if it has already arrived (`Some(None)`:
    /// its stream ended), and the machine takes frames now.
    fn ready_frame(&mut self) -> Option<Option<NodeFrame>> {
        if !self.machine.machine().wants_frames() {
            return None;
        }
        let stream = self.stream.as_mut()?;
        // `recv` is cancel-safe: a frame not yet whole stays buffered.
        read_frame(stream).now_or_never()
    }

    /// The machine's input for a frame read from the attempt's stream
    /// (`None`: the stream ended), counted for the attempt's metrics.
    fn frame_input(&mut self, frame: Option<NodeFrame>) -> RequestInput {
        let Some(frame) = frame else {
            self.stream = None;
            return RequestInput::StreamEnded;
        };
        if let Some(attempt) = self.attempt.as_mut() {
            match &frame {
                NodeFrame::Run(kind) => attempt.event(kind),
                NodeFrame::Tunnel(ProviderTunnelFrame::Body(b)) if !b.is_empty() => {
                    attempt.relayed_body();
                }
                NodeFrame::Tunnel(_) => {}
            }
        }
        RequestInput::Frame(frame)
    }

    /// Carry out the machine's outputs, in order.
    async fn carry_out(&mut self) {
        // The outputs drained with no await between them are one moment:
        // one clock reading for them, read again after an await.
        let mut now = self.ctx.clock.now();
        while let Some(out) = self.machine.poll_output(now) {
            match out {
                RequestOutput::Journal(write) => match self.journal.as_ref() {
                    Some(journal) => {
                        debug_assert!(self.journal_write.is_none(), "one journal write at a time");
                        self.journal_write = Some(Box::pin(journal.durable.clone().write(write)));
                    }
                    None => {
                        // Only a durable request journals; a machine that
                        // asks otherwise is told the write failed, so it
                        // publishes nothing unjournaled.
                        tracing::error!(event = "edge_driver_protocol_bug", output = "journal");
                        self.machine.handle_input(
                            now,
                            RequestInput::Journaled(JournalAck::Refused(
                                iop_core::journal::JournalError::Store("not durable".into()),
                            )),
                        );
                    }
                },
                RequestOutput::Dispatch(command) => {
                    // The dispatcher answers at once (R-GEN-4's pre-send
                    // fence, R-LEASE-1's terminal verdict, ...): its news
                    // about this request go straight to the machine, in
                    // order, behind any already queued for it.
                    for news in self.ctx.hub.request(command, &mut self.events) {
                        let input = self.news_input(news);
                        self.machine.handle_input(now, input);
                    }
                }
                RequestOutput::Open {
                    lease,
                    tunnel,
                    deadline_ms,
                    adopt,
                    continuation,
                } => self.open(lease, tunnel, deadline_ms, adopt, continuation),
                RequestOutput::AckFrames { through_frame } => {
                    // R-PARK-1: the node may drop what the journal holds.
                    if let Some(stream) = self.stream.as_mut() {
                        let _ = stream
                            .send
                            .send(&RunStreamFrame::Ack { through_frame })
                            .await;
                        now = self.ctx.clock.now();
                    }
                }
                RequestOutput::CloseAttempt => {
                    // The node cancels the run on the reset (R-GATE-2,
                    // R-GATE-4); an open in flight is dropped.
                    self.opening = None;
                    if let Some(mut stream) = self.stream.take() {
                        let _ = stream.send.reset(StreamErrorCode::Canceled);
                        let _ = stream.recv.stop(StreamErrorCode::Canceled);
                    }
                }
                RequestOutput::Deliver(delivery) => {
                    self.deliver(delivery).await;
                    now = self.ctx.clock.now();
                }
                RequestOutput::Observe(observation) => self.observe(observation),
                RequestOutput::ReserveAttempt {
                    extra_input_tokens_max,
                    ..
                } => {
                    // R-TEN-2: the tenant's machine answers at once; a
                    // request no tenant holds (a takeover's) has nothing to
                    // reserve against.
                    let reserved = match &self.work.tenant {
                        Some(tenant) => tenant.reserve_attempt(extra_input_tokens_max),
                        None => Ok(()),
                    };
                    let input = match reserved {
                        Ok(()) => RequestInput::AttemptReserved,
                        Err(refusal) => RequestInput::AttemptRefused(refusal),
                    };
                    self.machine.handle_input(now, input);
                }
            }
        }
    }

    /// Send one delivery; a client that does not take it within the write
    /// timeout is gone (R-LIM-4).
    async fn deliver(&mut self, delivery: Delivery) {
        // R-TEN-2: the usage the answer reports (summed over its attempts
        // by the request machine) is what the request settles with.
        match &delivery {
            Delivery::Event(event) => self.in_flight.view().delivered(event),
            Delivery::Fail { kind, .. } => self.in_flight.view().failed(*kind),
            _ => {}
        }
        if let Some(tenant) = &self.work.tenant {
            match &delivery {
                Delivery::Event(iop_wire::RunEventKind::Usage(usage))
                | Delivery::Event(iop_wire::RunEventKind::Completed {
                    usage: Some(usage), ..
                }) => tenant.record(usage),
                _ => {}
            }
        }
        // A durable response's readers follow its journal instead.
        let Some(out) = self.out.as_ref() else {
            return;
        };
        // Room in the client's queue: no timer to set.
        let delivery = match out.try_send(delivery) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.machine
                    .handle_input(self.ctx.clock.now(), RequestInput::ClientDisconnected);
                return;
            }
            Err(mpsc::error::TrySendError::Full(delivery)) => delivery,
        };
        let sent = tokio::time::timeout(self.ctx.client_write_timeout, out.send(delivery));
        match sent.await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                self.machine
                    .handle_input(self.ctx.clock.now(), RequestInput::ClientDisconnected);
            }
            Err(_) => {
                tracing::warn!(event = "edge_client_write_timeout");
                self.machine
                    .handle_input(self.ctx.clock.now(), RequestInput::ClientDisconnected);
            }
        }
    }

    fn observe(&mut self, observation: RequestObservation) {
        use crate::observe::{AttemptObservation, QueueWait};
        let route = self.work.route;
        let view = self.in_flight.view().clone();
        let obs = match observation {
            RequestObservation::Admitting => {
                view.queue_started();
                self.wait = Some(QueueWait::start(
                    &self.ctx.metrics,
                    self.work.trace_context,
                    route,
                ));
                return;
            }
            RequestObservation::Leased { provider_id } => {
                view.queue_ended();
                if let Some(wait) = self.wait.take() {
                    wait.granted(&provider_id);
                }
                return;
            }
            RequestObservation::AdmissionFailed(failure) => {
                view.queue_ended();
                if let Some(wait) = self.wait.take() {
                    wait.failed(failure.as_str());
                }
                return;
            }
            RequestObservation::AttemptStarted {
                provider_id,
                attempt,
            } => {
                view.attempt_started(&provider_id, attempt);
                self.attempt = Some(AttemptObservation::start(
                    &self.ctx.metrics,
                    self.work.trace_context,
                    route,
                    &self.work.model,
                    &provider_id,
                    attempt,
                ));
                return;
            }
            RequestObservation::AttemptEnded { failure } => {
                view.attempt_ended(failure);
                if let Some(attempt) = self.attempt.take() {
                    attempt.finish(failure);
                }
                return;
            }
            RequestObservation::Parked => {
                tracing::info!(event = "edge_durable_run_parked", route);
                return;
            }
            RequestObservation::Adopted => {
                tracing::info!(event = "edge_durable_run_adopted", route);
                return;
            }
            RequestObservation::RunNotKept => {
                tracing::info!(event = "edge_durable_run_gone_from_node", route);
                return;
            }
            RequestObservation::RecordTaken => {
                // R-JRN-3: another Edge raised the record's epoch; its
                // readers (they follow the journal) read on under it.
                let response_id = self.journal.as_ref().map(|j| j.response_id.as_str());
                tracing::warn!(
                    event = "edge_durable_record_taken",
                    route,
                    response_id = response_id.unwrap_or_default()
                );
                return;
            }
            RequestObservation::Ended { attempts } => {
                self.ctx.metrics.attempts_per_request(route, attempts);
                return;
            }
            RequestObservation::Gate(GateEvent::Eligibility(e)) => {
                DriverObservation::Eligibility(e.as_str())
            }
            RequestObservation::Gate(GateEvent::Result(r)) => DriverObservation::Result(r.as_str()),
            RequestObservation::Readmitted => DriverObservation::Readmitted,
            RequestObservation::Committed => {
                view.committed();
                DriverObservation::Ttft(self.work.route, self.started_at.elapsed())
            }
        };
        self.ctx.observe.as_ref()(obs);
    }

    /// Start opening the attempt's node stream and sending its request.
    fn open(
        &mut self,
        lease: Lease,
        tunnel: bool,
        deadline_ms: u64,
        adopt: Option<AdoptSpec>,
        continuation: Option<String>,
    ) {
        let Some((link, recipient)) = self.link.take() else {
            self.machine.handle_input(
                self.ctx.clock.now(),
                RequestInput::OpenFailed(OpenFailure::NoConnection),
            );
            return;
        };
        let request = match adopt {
            // R-PARK-2: continue the parked run after the journal's last
            // frame of it.
            Some(adopt) => DataRequest::Adopt(AdoptRequest {
                run_id: lease.run_id,
                key: adopt.key,
                response_id: self
                    .journal
                    .as_ref()
                    .map(|j| j.response_id.clone())
                    .unwrap_or_default(),
                resume_after_frame: adopt.resume_after_frame,
                response_stall_timeout_ms: lease.stall_timeout_ms,
                deadline_ms,
            }),
            None => self.request_for(
                &lease,
                tunnel,
                deadline_ms,
                recipient.as_ref(),
                continuation,
            ),
        };
        // A durable run's stream stays open both ways: its acks go on it.
        let acks = self.journal.is_some() && !tunnel;
        let conn = link.conn;
        self.opening = Some(Box::pin(async move {
            let (mut send, recv) = open_framed(&conn).await?;
            send.send(&request).await?;
            if !acks {
                let _ = send.finish();
            }
            Ok(NodeStream { send, recv, tunnel })
        }));
    }

    /// The wire request of an attempt: a tunnel of the raw request or a
    /// normalized run, with a credential lease sealed for it (R-CRED-1).
    fn request_for(
        &self,
        lease: &Lease,
        tunnel: bool,
        deadline_ms: u64,
        recipient: Option<&x25519_dalek::PublicKey>,
        continuation: Option<String>,
    ) -> DataRequest {
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
        let session_id = format!("r{}", self.detach.request_id);
        // The Node's spans are children of this attempt's span.
        let trace_context = self
            .attempt
            .as_ref()
            .and_then(|a| a.context())
            .or(self.work.trace_context);
        match (&self.work.tunnel, tunnel) {
            (Some(t), true) => DataRequest::Tunnel(ProviderTunnelRequest {
                run_id: lease.run_id,
                session_id,
                adapter: lease.adapter,
                target: lease.target.clone(),
                method: "POST".into(),
                path: t.path.clone(),
                headers: t.headers.clone(),
                body: t.body.clone(),
                response_stall_timeout_ms: lease.stall_timeout_ms,
                deadline_ms,
                credential_lease,
                trace_context,
            }),
            _ => DataRequest::Run(RunRequest {
                run_id: lease.run_id,
                session_id,
                adapter: lease.adapter,
                target: lease.target.clone(),
                model: self.work.model.clone(),
                api: self.work.api,
                messages: iop_core::edge::request::continued_messages(
                    &self.work.messages,
                    continuation.as_deref(),
                ),
                tools: self.work.tools.clone(),
                params: self.work.params.clone(),
                response_stall_timeout_ms: lease.stall_timeout_ms,
                deadline_ms,
                credential_lease,
                trace_context,
                // A durable run outlives its connection (R-PARK-1).
                park: self.journal.as_ref().map(|j| iop_wire::ParkSpec {
                    response_id: j.response_id.clone(),
                    grace_ms: j.park_grace_ms,
                }),
                continue_final: continuation.is_some(),
            }),
        }
    }
}

/// Read the attempt's next frame; `None` when the stream ended without one
/// or broke.
async fn read_frame(stream: &mut NodeStream) -> Option<NodeFrame> {
    if stream.tunnel {
        match stream.recv.recv::<ProviderTunnelFrame>().await {
            Ok(Some(frame)) => Some(NodeFrame::Tunnel(frame)),
            Ok(None) | Err(_) => None,
        }
    } else {
        match stream.recv.recv::<RunEvent>().await {
            Ok(Some(RunEvent { kind, .. })) => Some(NodeFrame::Run(kind)),
            Ok(None) | Err(_) => None,
        }
    }
}

/// A failure to open the node stream or send the request: one the wire
/// cannot carry is the client's (it can never be sent); anything else lost
/// the transport.
fn open_failure(error: &FramedError) -> OpenFailure {
    match error {
        FramedError::Encode(_) => OpenFailure::Unencodable,
        _ => OpenFailure::Transport,
    }
}

/// A failure code for a run that failed for a reason the gate names.
pub fn failure_code(kind: iop_core::edge::gate::GateFailure) -> Option<FailureCode> {
    match kind {
        iop_core::edge::gate::GateFailure::Attempt(code) => Some(code),
        _ => None,
    }
}
