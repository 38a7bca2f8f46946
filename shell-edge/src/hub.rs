//! The hub: the Edge's dispatch core, its timer task, and the calls into
//! it.
//!
//! The dispatcher and what carries out its outputs (the links of the node
//! connections, the request drivers' queues) sit behind one `std` mutex,
//! held for one synchronous call (feed one input, drain every output) and
//! never across an `.await`. A request driver calls it directly
//! ([`HubHandle::request`]: its own news come back as the call's answer,
//! as quinn-proto and str0m answer a synchronous question from the method,
//! with no hop to another task on a request's path); the connection tasks
//! and HTTP handlers send their messages to the hub task through
//! [`HubHandle`], which feeds them under the same lock with the current
//! time, and sleeps until the dispatcher's next timeout (woken when a
//! direct call brings it closer). Whoever holds the lock drains the
//! dispatcher's outputs into the tasks that must act on them; the
//! dispatcher itself takes no lock.

use std::collections::{BTreeMap, HashMap};

use iop_core::edge::admission::{PreSend, RequestId};
use iop_core::edge::dispatch::{
    CapabilityVerdict, DispatchConfig, DispatchInput, DispatchOutput, KeptRuns, ParkedOffer,
    ProbeAnswer, RequestCommand, RequestEvent,
};
use iop_core::edge::health::ProbeTicket;
use iop_core::edge::registry::{RejectCause, Rejection};
use iop_core::ids::{Generation, NodeId};
use iop_trace::{DispatchConfigRec, DrivenDispatcher, MachineKind, Tap, TraceWriter};
use iop_wire::{CapabilitiesReport, CloseCode, ConfigSnapshot, RegisterRequest};
use iop_wire::{
    Command, CommandKind, CommandResult, CommandResultBody, DataRequest, HealthFailureCode,
};
use tokio::sync::{Notify, mpsc, oneshot};

use crate::generation_store::GenerationStore;
use crate::metrics::EdgeMetrics;
use iop_core::edge::overlay::{EvidenceOutcome, RecoveryOutcome};
use iop_transport::clock::Clock;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

/// What nodes report about their durable runs (R-PARK-2), for the task
/// that hands them to this Edge's requests and its custody.
#[derive(Debug)]
pub enum NodeReport {
    /// Parked runs to adopt.
    Offers(Vec<ParkedOffer>),
    /// The runs a registering node keeps, and so the ones it lost.
    Kept(Arc<KeptRuns>),
}

impl NodeReport {
    /// The offers a report carries (none for [`NodeReport::Kept`]).
    pub fn into_offers(self) -> Vec<ParkedOffer> {
        match self {
            NodeReport::Offers(offers) => offers,
            NodeReport::Kept(_) => Vec::new(),
        }
    }
}

/// What a connection task is told to do.
#[derive(Debug)]
pub enum LinkCommand {
    /// Close the connection with this code.
    Close(CloseCode),
    /// Send a Cancel for this run on the control stream.
    Cancel(u64),
    /// Tell the node a parked run of it is of no use (R-PARK-1).
    CancelParked(iop_wire::CancelParked),
    /// Push this config (new credential profile states) to the node.
    Refresh(Box<ConfigSnapshot>),
}

/// A live node connection, as the hub and request handlers see it.
#[derive(Debug, Clone)]
pub struct LinkHandle {
    /// The QUIC connection (data streams are opened on it directly).
    pub conn: quinn::Connection,
    /// The connection task's command queue.
    pub commands: mpsc::UnboundedSender<LinkCommand>,
}

/// What the hub carries to a request driver: the dispatcher's news about
/// its request and, with a pre-send fence's `Send`, the connection to send
/// on (`None`: its link task already reported its end).
#[derive(Debug)]
pub struct RequestNews {
    /// The dispatcher's event, for the request machine.
    pub event: RequestEvent,
    /// With `PreSend(Send)`: the lease's connection and the node's lease
    /// recipient key, if it registered a valid one (without it the node
    /// gets no managed credentials).
    pub link: Option<(LinkHandle, Option<x25519_dalek::PublicKey>)>,
}

/// A snapshot of the hub's state for `/status` and metrics.
#[derive(Debug, Clone, Default)]
pub struct HubSnapshot {
    /// Per node: (id, current generation, ready, last generation).
    pub nodes: Vec<(NodeId, Option<Generation>, bool, Generation)>,
    /// Per provider capacity.
    pub providers: Vec<iop_core::edge::admission::ProviderCapacityView>,
    /// Requests waiting.
    pub queue_depth: usize,
    /// Leases held.
    pub leases_in_use: usize,
    /// Messages ignored because their generation was fenced.
    pub fenced_messages: u64,
    /// Generations fenced.
    pub fences: u64,
    /// Connections ended, by close reason.
    pub closes_by_reason: BTreeMap<&'static str, u64>,
    /// Per-provider health (R-HT-1), times as Unix milliseconds.
    pub health: Vec<ProviderHealthView>,
    /// Requests whose events the hub still routes (queued or leased, or
    /// about to be told their lease was fenced); 0 once every request ended.
    pub waiters: usize,
    /// Node connections the hub holds a link to (registered, not fenced).
    pub links: usize,
    /// Per node (the same order as `nodes`): its connection as an operator
    /// sees it.
    pub connections: Vec<NodeConnectionStatus>,
    /// Providers whose online generation the runtime overlay lowered
    /// (R-OVL-2).
    pub overlay_lowered: Vec<iop_core::ids::ProviderId>,
}

/// One node's connection for the status surface: generation, age, the
/// QUIC path's loss, and how its last connection ended.
#[derive(Debug, Clone)]
pub struct NodeConnectionStatus {
    /// The node.
    pub node: NodeId,
    /// Its current generation, if connected.
    pub generation: Option<Generation>,
    /// Whether that generation completed readiness.
    pub ready: bool,
    /// When it connected, Unix ms.
    pub connected_since_unix_ms: Option<u64>,
    /// The latest generation it ever had.
    pub last_generation: Generation,
    /// The connection's smoothed round-trip time, ms.
    pub rtt_ms: Option<u64>,
    /// Packets sent on the connection.
    pub sent_packets: Option<u64>,
    /// Packets the connection declared lost.
    pub lost_packets: Option<u64>,
    /// How its last connection ended (closed reason) and when, Unix ms.
    pub last_close: Option<(&'static str, u64)>,
}

/// The most nodes whose last close the hub remembers (a node that never
/// connects again keeps its entry; past the bound new ones are not kept).
pub const MAX_REMEMBERED_CLOSES: usize = 4_096;

/// One provider's health for the status surface (R-HT-6: no secrets, no
/// payloads, no error text).
#[derive(Debug, Clone)]
pub struct ProviderHealthView {
    /// Provider.
    pub provider_id: iop_core::ids::ProviderId,
    /// `unknown | ok | unavailable | stale`.
    pub state: &'static str,
    /// Last successful probe.
    pub last_success_at_ms: Option<u64>,
    /// Failures since the last success.
    pub consecutive_failures: u32,
    /// Sanitized failure class.
    pub failure_code: Option<&'static str>,
    /// Earliest recovery probe.
    pub next_retry_at_ms: Option<u64>,
    /// Probes that ended without a verdict (R-CAP-1).
    pub no_verdicts_total: u64,
}

struct Registering {
    link: LinkHandle,
    recipient: Option<x25519_dalek::PublicKey>,
    reply: oneshot::Sender<Result<(Generation, ConfigSnapshot), Rejection>>,
}

struct Peer {
    recipient: Option<x25519_dalek::PublicKey>,
    snapshot: ConfigSnapshot,
}

enum HubMsg {
    Register {
        node: NodeId,
        request: RegisterRequest,
        link: LinkHandle,
        reply: oneshot::Sender<Result<(Generation, ConfigSnapshot), Rejection>>,
    },
    Ready {
        node: NodeId,
        generation: Generation,
        reply: oneshot::Sender<bool>,
    },
    LinkClosed {
        node: NodeId,
        generation: Generation,
        reason: CloseCode,
    },
    LateMessage {
        node: NodeId,
        generation: Generation,
    },
    Link {
        node: NodeId,
        reply: oneshot::Sender<Option<(Generation, LinkHandle)>>,
    },
    Snapshot {
        reply: oneshot::Sender<HubSnapshot>,
    },
    Shutdown,
    RefreshCredentials,
    ReleaseParked {
        node: NodeId,
        key: iop_wire::RunKey,
    },
    CancelParked(ParkedOffer),
    ParkedSink(mpsc::UnboundedSender<NodeReport>),
    Parked {
        node: NodeId,
        generation: Generation,
        runs: Vec<iop_wire::ParkedRun>,
    },
    ProbeAnswer {
        ticket: ProbeTicket,
        answer: Result<(NodeId, Generation, CapabilitiesReport), HealthFailureCode>,
    },
    /// A save of the generation mark `mark` ended (off the hub's task).
    GenerationsSaved {
        mark: Generation,
        saved: Result<(), String>,
    },
}

/// The hub stopped (the process is shutting down).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the edge hub has stopped")]
pub struct HubGone;

/// A cheap, cloneable handle to the hub.
#[derive(Clone)]
pub struct HubHandle {
    tx: mpsc::UnboundedSender<HubMsg>,
    catalog: Arc<crate::catalog::ModelCatalog>,
    shared: Arc<Shared>,
}

/// The hub's state and the hub task's timer wake-up, shared by every
/// handle.
struct Shared {
    /// The dispatcher and what carries out its outputs; held for one
    /// synchronous call, never across an `.await`.
    hub: Mutex<Hub>,
    /// Tells the hub task the dispatcher's next timeout moved earlier than
    /// the one it sleeps until.
    timer: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Hub> {
        // A panic in a call leaves the state as the call left it; the hub
        // goes on rather than take every request down with it.
        self.hub
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// After a direct call: wake the hub task if the dispatcher's next
    /// timeout is now earlier than the one it sleeps until.
    fn rearm(&self, hub: &Hub) {
        let next = hub.dispatcher.poll_timeout();
        if next.is_some_and(|at| hub.sleeping_until.is_none_or(|until| at < until)) {
            self.timer.notify_one();
        }
    }
}

impl HubHandle {
    /// The models providers reported (model discovery, `crate::catalog`).
    pub fn catalog(&self) -> &crate::catalog::ModelCatalog {
        &self.catalog
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> HubMsg) -> Result<T, HubGone> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).map_err(|_| HubGone)?;
        rx.await.map_err(|_| HubGone)
    }

    /// Register a node connection.
    pub async fn register(
        &self,
        node: NodeId,
        request: RegisterRequest,
        link: LinkHandle,
    ) -> Result<Result<(Generation, ConfigSnapshot), Rejection>, HubGone> {
        self.ask(|reply| HubMsg::Register {
            node,
            request,
            link,
            reply,
        })
        .await
    }

    /// Readiness of a generation.
    pub async fn ready(&self, node: NodeId, generation: Generation) -> Result<bool, HubGone> {
        self.ask(|reply| HubMsg::Ready {
            node,
            generation,
            reply,
        })
        .await
    }

    /// A connection ended.
    pub fn link_closed(&self, node: NodeId, generation: Generation, reason: CloseCode) {
        let _ = self.tx.send(HubMsg::LinkClosed {
            node,
            generation,
            reason,
        });
    }

    /// A message attributed to `generation` arrived; counted if fenced.
    pub fn late_message(&self, node: NodeId, generation: Generation) {
        let _ = self.tx.send(HubMsg::LateMessage { node, generation });
    }

    /// Route the dispatcher's news about `request_id` that no call of its
    /// own answers (a queued request's lease, a fence, ...) to `events`
    /// until [`Self::detach`]. After the hub stopped, `events` is dropped
    /// (its receiver sees the end).
    pub fn attach(&self, request_id: RequestId, events: mpsc::UnboundedSender<RequestNews>) {
        let mut hub = self.shared.lock();
        if !hub.stopped {
            hub.waiters.insert(request_id, events);
        }
    }

    /// Carry a request machine's command to the dispatcher, under the
    /// hub's lock, and carry out what it caused. The dispatcher's news
    /// about the same request come back as the answer, in order: first
    /// those already queued on `queued` (the request's `events`, which are
    /// only sent under the same lock), then the ones this command caused
    /// (its lease, its pre-send answer, its terminal's verdict); news
    /// about other requests go to their queues. Nothing comes back once
    /// the hub stopped.
    pub fn request(
        &self,
        command: RequestCommand,
        queued: &mut mpsc::UnboundedReceiver<RequestNews>,
    ) -> Vec<RequestNews> {
        let request_id = command.request_id();
        let mut hub = self.shared.lock();
        let mut answer = Vec::new();
        if hub.stopped {
            return answer;
        }
        while let Ok(news) = queued.try_recv() {
            answer.push(news);
        }
        let now = hub.clock.now();
        hub.dispatcher
            .handle_input(now, DispatchInput::Request(command));
        hub.drain(Some((request_id, &mut answer)));
        hub.publish_request_gauges();
        self.shared.rearm(&hub);
        answer
    }

    /// The request's driver is gone: let go of whatever the request still
    /// holds (a queue entry, a lease; its node run is canceled) and stop
    /// routing its news. Harmless after the request ended.
    pub fn detach(&self, request_id: RequestId) {
        let mut hub = self.shared.lock();
        if hub.stopped {
            return;
        }
        let now = hub.clock.now();
        hub.dispatcher.handle_input(
            now,
            DispatchInput::Request(RequestCommand::Cancel { request_id }),
        );
        hub.waiters.remove(&request_id);
        hub.drain(None);
        hub.publish_request_gauges();
        self.shared.rearm(&hub);
    }

    /// The current ready link of a node.
    pub async fn link(&self, node: NodeId) -> Result<Option<(Generation, LinkHandle)>, HubGone> {
        self.ask(|reply| HubMsg::Link { node, reply }).await
    }

    /// Parked runs nodes report, and the runs each registration says its
    /// node keeps (R-PARK-2), go to the returned receiver from now on;
    /// without one, reported runs are let go at once.
    pub fn parked_runs(&self) -> mpsc::UnboundedReceiver<NodeReport> {
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = self.tx.send(HubMsg::ParkedSink(tx));
        rx
    }

    /// A ready connection reports runs that parked since it registered.
    pub fn parked(&self, node: NodeId, generation: Generation, runs: Vec<iop_wire::ParkedRun>) {
        let _ = self.tx.send(HubMsg::Parked {
            node,
            generation,
            runs,
        });
    }

    /// No request adopts parked run `key`: let its held capacity go.
    pub fn release_parked(&self, node: NodeId, key: iop_wire::RunKey) {
        let _ = self.tx.send(HubMsg::ReleaseParked { node, key });
    }

    /// Tell the node of a parked run no Edge can use to end it now
    /// (R-PARK-1).
    pub fn cancel_parked(&self, offer: ParkedOffer) {
        let _ = self.tx.send(HubMsg::CancelParked(offer));
    }

    /// The credential profiles changed: push them to every connected node.
    pub fn refresh_credentials(&self) {
        let _ = self.tx.send(HubMsg::RefreshCredentials);
    }

    /// Stop the hub: every link handle it holds is dropped.
    pub fn shutdown(&self) {
        let _ = self.tx.send(HubMsg::Shutdown);
    }

    /// A state snapshot.
    pub async fn snapshot(&self) -> Result<HubSnapshot, HubGone> {
        self.ask(|reply| HubMsg::Snapshot { reply }).await
    }
}

struct Hub {
    tx: mpsc::UnboundedSender<HubMsg>,
    /// Where the probes and the generation saves the dispatcher asks for
    /// run (whichever task holds the lock when it asks).
    runtime: tokio::runtime::Handle,
    /// The dispatcher's timeout the hub task sleeps until (set under the
    /// lock before it sleeps).
    sleeping_until: Option<iop_core::Instant>,
    /// The hub task stopped: nothing is fed or routed any more.
    stopped: bool,
    unix_origin_ms: u64,
    probe_bound: std::time::Duration,
    clock: Clock,
    dispatcher: DrivenDispatcher,
    store: Option<GenerationStore>,
    /// Generations durable before use (R-GEN-1), saved off this task.
    links: HashMap<(NodeId, Generation), LinkHandle>,
    /// Per connection: the recipient key (if valid) and the snapshot it got.
    peers: HashMap<(NodeId, Generation), Peer>,
    creds: Arc<crate::cred::Credentials>,
    /// Per node: its targets with a managed credential.
    managed: HashMap<NodeId, Vec<iop_wire::ManagedTarget>>,
    /// Request drivers by request, from attach to detach.
    waiters: BTreeMap<RequestId, mpsc::UnboundedSender<RequestNews>>,
    /// The registration being answered (its answer is an output).
    registering: Option<Registering>,
    /// The readiness being answered.
    readying: Option<oneshot::Sender<bool>>,
    closes_by_reason: BTreeMap<&'static str, u64>,
    /// Per node: how its last connection ended, and when (Unix ms);
    /// bounded by [`MAX_REMEMBERED_CLOSES`].
    last_close: BTreeMap<NodeId, (&'static str, u64)>,
    metrics: Arc<EdgeMetrics>,
    catalog: Arc<crate::catalog::ModelCatalog>,
    /// Where parked runs nodes report go to be adopted (R-PARK-2).
    parked: Option<mpsc::UnboundedSender<NodeReport>>,
}

/// Start the hub task. With `trace`, every dispatcher input and output is
/// recorded there (iop-trace format, machine `edge-dispatch`).
pub fn spawn(
    config: DispatchConfig,
    store: Option<GenerationStore>,
    clock: Clock,
    metrics: Arc<EdgeMetrics>,
    trace: Option<Box<dyn std::io::Write + Send>>,
    creds: Arc<crate::cred::Credentials>,
    managed: HashMap<NodeId, Vec<iop_wire::ManagedTarget>>,
) -> Result<(HubHandle, tokio::task::JoinHandle<()>), iop_core::edge::health::HealthTrackerError> {
    let now = clock.now();
    let tap = match trace {
        Some(out) => {
            let rec = DispatchConfigRec::new(&config, now);
            Tap::to(TraceWriter::new(out, MachineKind::EdgeDispatch, &rec))
        }
        None => Tap::off(),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let probe_bound = config.health.probe_timeout;
    let catalog = Arc::new(crate::catalog::ModelCatalog::new(
        config.providers.iter().map(|p| p.id.clone()).collect(),
    ));
    let hub = Hub {
        catalog: catalog.clone(),
        tx: tx.clone(),
        runtime: tokio::runtime::Handle::current(),
        sleeping_until: None,
        stopped: false,
        unix_origin_ms: iop_transport::clock::unix_ms().saturating_sub(clock.now().as_millis()),
        probe_bound,
        clock,
        dispatcher: DrivenDispatcher::new_dispatcher(now, config, tap)?,
        store,
        links: HashMap::new(),
        peers: HashMap::new(),
        creds,
        managed,
        waiters: BTreeMap::new(),
        registering: None,
        readying: None,
        closes_by_reason: BTreeMap::new(),
        last_close: BTreeMap::new(),
        metrics,
        parked: None,
    };
    let shared = Arc::new(Shared {
        hub: Mutex::new(hub),
        timer: Notify::new(),
    });
    let task = tokio::spawn(run(shared.clone(), clock, rx));
    Ok((
        HubHandle {
            tx,
            catalog,
            shared,
        },
        task,
    ))
}

/// The hub task: feed the messages of connection tasks and handlers, fire
/// the dispatcher's timer, each under the lock.
async fn run(shared: Arc<Shared>, clock: Clock, mut rx: mpsc::UnboundedReceiver<HubMsg>) {
    let metrics = shared.lock().metrics.clone();
    loop {
        let deadline = {
            let mut hub = shared.lock();
            hub.sleeping_until = hub.dispatcher.poll_timeout();
            hub.sleeping_until
        };
        tokio::select! {
            msg = rx.recv() => match msg {
                Some(HubMsg::Shutdown) | None => break,
                Some(msg) => {
                    let mut hub = shared.lock();
                    hub.handle(msg);
                    hub.drain(None);
                    hub.publish_gauges();
                }
            },
            () = clock.sleep_until(deadline) => {
                let mut hub = shared.lock();
                let now = hub.clock.now();
                hub.dispatcher.handle_timeout(now);
                hub.drain(None);
                hub.publish_gauges();
            }
            // A direct call brought the timeout closer: sleep again.
            () = shared.timer.notified() => {}
        }
        metrics
            .gauges
            .hub_backlog
            .store(rx.len() as u64, Ordering::Relaxed);
    }
    // Every link handle and request queue goes: request drivers see the
    // end of their news and stop (the process is shutting down).
    let mut hub = shared.lock();
    hub.stopped = true;
    hub.waiters.clear();
    hub.links.clear();
    hub.peers.clear();
    hub.registering = None;
    hub.readying = None;
    hub.parked = None;
}

impl Hub {
    fn publish_gauges(&self) {
        self.publish_request_gauges();
        let g = &self.metrics.gauges;
        let registry = self.dispatcher.machine().registry();
        g.nodes_connected
            .store(registry.connected_nodes() as u64, Ordering::Relaxed);
    }

    /// The gauges a request's command can move.
    fn publish_request_gauges(&self) {
        let g = &self.metrics.gauges;
        let admission = self.dispatcher.machine().admission();
        let registry = self.dispatcher.machine().registry();
        g.queue_depth
            .store(admission.queue_depth() as u64, Ordering::Relaxed);
        g.leases_in_use
            .store(admission.leases_in_use() as u64, Ordering::Relaxed);
        g.fenced_late_messages
            .store(registry.fenced_messages(), Ordering::Relaxed);
    }

    fn handle(&mut self, msg: HubMsg) {
        let now = self.clock.now();
        match msg {
            HubMsg::Register {
                node,
                request,
                link,
                reply,
            } => {
                let recipient = request.recipient_public_key.and_then(|bytes| {
                    match iop_core::cred::keys::recipient_public_key_from_bytes(&bytes) {
                        Ok(key) => Some(key),
                        Err(e) => {
                            tracing::warn!(event = "edge_recipient_key_refused", node = %node, error = %e);
                            None
                        }
                    }
                });
                self.registering = Some(Registering {
                    link,
                    recipient,
                    reply,
                });
                self.dispatcher
                    .handle_input(now, DispatchInput::Register { node, request });
            }
            HubMsg::Ready {
                node,
                generation,
                reply,
            } => {
                self.readying = Some(reply);
                self.dispatcher
                    .handle_input(now, DispatchInput::Ready { node, generation });
            }
            HubMsg::LinkClosed {
                node,
                generation,
                reason,
            } => {
                self.links.remove(&(node.clone(), generation));
                self.peers.remove(&(node.clone(), generation));
                self.dispatcher.handle_input(
                    now,
                    DispatchInput::ConnectionClosed {
                        node,
                        generation,
                        reason,
                    },
                );
            }
            HubMsg::LateMessage { node, generation } => {
                self.dispatcher
                    .handle_input(now, DispatchInput::Message { node, generation });
            }
            HubMsg::ParkedSink(tx) => self.parked = Some(tx),
            HubMsg::Parked {
                node,
                generation,
                runs,
            } => {
                self.dispatcher.handle_input(
                    now,
                    DispatchInput::Parked {
                        node,
                        generation,
                        runs,
                    },
                );
            }
            HubMsg::ReleaseParked { node, key } => {
                self.dispatcher
                    .handle_input(now, DispatchInput::ReleaseParked { node, key });
            }
            HubMsg::CancelParked(offer) => {
                let dispatcher = self.dispatcher.machine();
                let node = dispatcher
                    .admission()
                    .providers()
                    .find(|p| p.id == offer.provider_id)
                    .map(|p| p.node.clone());
                let link = node.and_then(|node| {
                    let g = dispatcher.registry().dispatchable_generation(&node)?;
                    self.links.get(&(node, g))
                });
                if let Some(link) = link {
                    let _ = link
                        .commands
                        .send(LinkCommand::CancelParked(iop_wire::CancelParked {
                            key: offer.run.key,
                            response_id: offer.run.response_id,
                        }));
                }
            }
            HubMsg::Link { node, reply } => {
                let link = self
                    .dispatcher
                    .machine()
                    .registry()
                    .dispatchable_generation(&node)
                    .and_then(|g| self.links.get(&(node, g)).map(|l| (g, l.clone())));
                let _ = reply.send(link);
            }
            HubMsg::Snapshot { reply } => {
                let _ = reply.send(self.snapshot());
            }
            HubMsg::GenerationsSaved { mark, saved } => {
                if let Err(error) = &saved {
                    tracing::error!(event = "generation_store_failed", error = %error);
                }
                self.dispatcher.handle_input(
                    self.clock.now(),
                    DispatchInput::GenerationMarkSaved {
                        mark,
                        saved: saved.is_ok(),
                    },
                );
            }
            HubMsg::Shutdown => {}
            HubMsg::RefreshCredentials => {
                let states = self.creds.states();
                tracing::info!(
                    event = "edge_credentials_refreshed",
                    profiles = states.len()
                );
                for (key, peer) in &mut self.peers {
                    peer.snapshot.credential_profiles = states.clone();
                    if let Some(link) = self.links.get(key) {
                        let _ = link
                            .commands
                            .send(LinkCommand::Refresh(Box::new(peer.snapshot.clone())));
                    }
                }
            }
            HubMsg::ProbeAnswer { ticket, answer } => {
                if let Ok((_, _, report)) = &answer {
                    self.catalog.observe(&ticket.provider_id, report);
                }
                let answer = match answer {
                    Ok((node, generation, report)) => ProbeAnswer::Report {
                        node,
                        generation,
                        report,
                    },
                    Err(code) => ProbeAnswer::Failure(code),
                };
                // R-CAP-1: a probe's report may recover a lowered provider;
                // each recovery is observed once, from the outputs.
                self.dispatcher
                    .handle_input(now, DispatchInput::ProbeAnswer { ticket, answer });
            }
        }
    }

    /// Count and log an overlay recovery (closed labels).
    fn observe_capability(&self, v: &CapabilityVerdict) {
        if v.recovery == RecoveryOutcome::Recovered {
            self.metrics.health_transition("recovered");
            tracing::info!(
                event = "edge_provider_health_observation",
                provider = %v.provider_id,
                health = v.health.as_str(),
                outcome = v.recovery.as_str()
            );
        }
    }

    /// A registration's answer: complete the peer's entry and reply.
    fn registered(
        &mut self,
        node: NodeId,
        result: Result<(Generation, ConfigSnapshot), Rejection>,
    ) {
        let Some(Registering {
            link,
            recipient,
            reply,
        }) = self.registering.take()
        else {
            return;
        };
        let result = match result {
            Ok((generation, mut snapshot)) => {
                snapshot.credential_profiles = self.creds.states();
                snapshot.lease_signing_key = Some(self.creds.verifying_key());
                snapshot.managed_targets = self.managed.get(&node).cloned().unwrap_or_default();
                self.peers.insert(
                    (node.clone(), generation),
                    Peer {
                        recipient,
                        snapshot: snapshot.clone(),
                    },
                );
                self.links.insert((node, generation), link);
                Ok((generation, snapshot))
            }
            Err(rejection) => {
                if rejection.cause == RejectCause::GenerationNotDurable {
                    tracing::error!(event = "generation_not_durable", node = %node);
                }
                Err(rejection)
            }
        };
        let _ = reply.send(result);
    }

    /// Persist the generation mark the dispatcher asked for off this task
    /// (`iop_core::edge::generations`, R-GEN-1): its fsync never holds up a
    /// registration or a request (R-LIM-4).
    fn save_generation_mark(&mut self, mark: Generation) {
        let Some(store) = &self.store else {
            // The dispatcher asks only when started with a mark, which only
            // a store gives; answer so its reservation is not left pending.
            self.dispatcher.handle_input(
                self.clock.now(),
                DispatchInput::GenerationMarkSaved { mark, saved: false },
            );
            return;
        };
        let (store, tx) = (store.clone(), self.tx.clone());
        self.runtime.spawn_blocking(move || {
            let saved = store.save(mark).map_err(|e| e.to_string());
            let _ = tx.send(HubMsg::GenerationsSaved { mark, saved });
        });
    }

    /// Carry the dispatcher's news to the request's driver: into `own`
    /// when it is the calling request's (the call's answer), else to its
    /// queue.
    fn news_for_request(
        &self,
        request_id: RequestId,
        event: RequestEvent,
        own: &mut Option<(RequestId, &mut Vec<RequestNews>)>,
    ) {
        let Some(waiter) = self.waiters.get(&request_id) else {
            return;
        };
        let link = match &event {
            RequestEvent::PreSend(PreSend::Send(lease)) => {
                let key = (lease.node.clone(), lease.generation);
                // No link: the link task has not yet reported its end, the
                // connection is gone; the request machine decides.
                self.links.get(&key).map(|link| {
                    let recipient = self.peers.get(&key).and_then(|p| p.recipient);
                    (link.clone(), recipient)
                })
            }
            _ => None,
        };
        let news = RequestNews { event, link };
        match own {
            Some((own_id, answer)) if *own_id == request_id => answer.push(news),
            _ => {
                let _ = waiter.send(news);
            }
        }
    }

    /// Carry out every output of the dispatcher; news about the calling
    /// request (`own`) go into its answer.
    fn drain(&mut self, mut own: Option<(RequestId, &mut Vec<RequestNews>)>) {
        // Connections fenced in this batch; their link and peer entries go
        // once every output (a close order among them) was carried out.
        let mut fenced = Vec::new();
        // One synchronous drain under the lock: one moment, one reading.
        let now = self.clock.now();
        while let Some(out) = self.dispatcher.poll_output(now) {
            match out {
                DispatchOutput::CloseConnection {
                    node,
                    generation,
                    code,
                } => {
                    if let Some(link) = self.links.get(&(node, generation)) {
                        let _ = link.commands.send(LinkCommand::Close(code));
                    }
                }
                DispatchOutput::Fenced {
                    node,
                    generation,
                    reason,
                } => {
                    fenced.push((node.clone(), generation));
                    *self.closes_by_reason.entry(reason.as_str()).or_default() += 1;
                    let at = iop_transport::clock::unix_ms();
                    if self.last_close.len() < MAX_REMEMBERED_CLOSES
                        || self.last_close.contains_key(&node)
                    {
                        self.last_close.insert(node.clone(), (reason.as_str(), at));
                    }
                    self.metrics.fence(reason.as_str());
                    tracing::info!(
                        event = "edge_generation_fenced",
                        node = %node,
                        generation,
                        reason = reason.as_str()
                    );
                }
                DispatchOutput::NodeReady { node, generation } => {
                    tracing::info!(event = "edge_node_ready", node = %node, generation);
                }
                DispatchOutput::Registered { node, result } => self.registered(node, result),
                DispatchOutput::SaveGenerationMark { mark } => self.save_generation_mark(mark),
                DispatchOutput::ReadyAnswer { accepted, .. } => {
                    if let Some(reply) = self.readying.take() {
                        let _ = reply.send(accepted);
                    }
                }
                DispatchOutput::ToRequest { request_id, event } => {
                    self.news_for_request(request_id, event, &mut own);
                }
                DispatchOutput::CancelRun {
                    node,
                    generation,
                    run_id,
                } => {
                    if let Some(link) = self.links.get(&(node, generation)) {
                        let _ = link.commands.send(LinkCommand::Cancel(run_id));
                    }
                }
                DispatchOutput::StallEvidence {
                    provider_id,
                    health,
                    outcome,
                } => {
                    // R-OVL-1/2 observation: closed labels only.
                    self.metrics
                        .health_evidence(health.as_str(), outcome.as_str());
                    tracing::info!(
                        event = "edge_provider_health_observation",
                        provider = %provider_id,
                        health = health.as_str(),
                        outcome = outcome.as_str(),
                        recovery_handoff = "confirmed"
                    );
                    if outcome == EvidenceOutcome::Lowered {
                        self.metrics.health_transition("lowered");
                    }
                }
                DispatchOutput::Capability(verdict) => self.observe_capability(&verdict),
                DispatchOutput::ProbeDue {
                    ticket,
                    node,
                    generation,
                } => self.probe(ticket, node, generation),
                DispatchOutput::ParkedRuns {
                    node,
                    generation,
                    runs,
                } => {
                    tracing::info!(
                        event = "edge_parked_runs_reported",
                        node = %node,
                        generation,
                        runs = runs.len()
                    );
                    let unclaimed = match &self.parked {
                        Some(tx) => tx
                            .send(NodeReport::Offers(runs))
                            .map_or_else(|e| e.0.into_offers(), |()| Vec::new()),
                        None => runs,
                    };
                    for offer in unclaimed {
                        self.dispatcher.handle_input(
                            now,
                            DispatchInput::ReleaseParked {
                                node: offer.node,
                                key: offer.run.key,
                            },
                        );
                    }
                }
                // Every durable request of this Edge hears it; the one
                // whose run the node no longer has stops waiting for it.
                DispatchOutput::KeptRuns(kept) => {
                    if let Some(tx) = &self.parked {
                        let _ = tx.send(NodeReport::Kept(kept));
                    }
                }
                DispatchOutput::Health(event) => {
                    tracing::warn!(
                        event = "edge_provider_health_lifecycle",
                        provider = %event.provider_id,
                        lifecycle = event.lifecycle.as_str(),
                        failure_code = event.failure_code.map(|c| c.as_str()),
                        consecutive_failures = event.consecutive_failures
                    );
                }
            }
        }
        // R-GEN-3: a fenced generation is never dispatched to again, so
        // nothing of it stays behind (a connection that never reports its
        // end leaks nothing either).
        for key in fenced {
            self.links.remove(&key);
            self.peers.remove(&key);
        }
    }

    /// Run one CAPABILITIES probe on the node's link, bounded, and feed the
    /// answer back as an input.
    fn probe(&self, ticket: ProbeTicket, node: NodeId, generation: Option<Generation>) {
        let link = generation.and_then(|g| self.links.get(&(node.clone(), g)).cloned());
        let tx = self.tx.clone();
        let bound = self.probe_bound;
        // Probe exactly this provider's target (R-HT-3: a failing provider
        // is probed only on its own schedule, never as a side effect).
        let target = self
            .dispatcher
            .machine()
            .admission()
            .provider(&ticket.provider_id)
            .map(|p| iop_wire::ProbeTarget {
                adapter: p.adapter,
                target: p.target.clone(),
            });
        let (Some(generation), Some(link)) = (generation, link) else {
            let _ = tx.send(HubMsg::ProbeAnswer {
                ticket,
                answer: Err(HealthFailureCode::TransportFailed),
            });
            return;
        };
        self.runtime.spawn(async move {
            let ask = async {
                let (mut send, mut recv) = iop_transport::open_framed(&link.conn)
                    .await
                    .map_err(|_| HealthFailureCode::TransportFailed)?;
                send.send(&DataRequest::Command(Command {
                    command_id: 0,
                    session_id: String::new(),
                    kind: CommandKind::Capabilities { target },
                }))
                .await
                .map_err(|_| HealthFailureCode::TransportFailed)?;
                let _ = send.finish();
                match recv.recv::<CommandResult>().await {
                    Ok(Some(CommandResult {
                        body: CommandResultBody::Capabilities(report),
                        ..
                    })) => Ok(report),
                    Ok(_) => Err(HealthFailureCode::MalformedResponse),
                    Err(_) => Err(HealthFailureCode::TransportFailed),
                }
            };
            let answer = match tokio::time::timeout(bound, ask).await {
                Ok(Ok(report)) => Ok((node, generation, report)),
                Ok(Err(code)) => Err(code),
                Err(_) => Err(HealthFailureCode::Timeout),
            };
            let _ = tx.send(HubMsg::ProbeAnswer { ticket, answer });
        });
    }

    fn snapshot(&self) -> HubSnapshot {
        let registry = self.dispatcher.machine().registry();
        let admission = self.dispatcher.machine().admission();
        let mut nodes: Vec<NodeId> = admission.providers().map(|p| p.node.clone()).collect();
        nodes.extend(self.links.keys().map(|(n, _)| n.clone()));
        nodes.sort();
        nodes.dedup();
        let connections: Vec<NodeConnectionStatus> = nodes
            .iter()
            .map(|n| {
                let v = registry.view(n);
                let conn = v
                    .generation
                    .and_then(|g| self.links.get(&(n.clone(), g)))
                    .map(|link| (link.conn.rtt(), link.conn.stats().path));
                NodeConnectionStatus {
                    node: n.clone(),
                    generation: v.generation,
                    ready: v.ready,
                    connected_since_unix_ms: v.connected_since.map(|t| self.unix_ms(t)),
                    last_generation: v.last_generation,
                    rtt_ms: conn
                        .as_ref()
                        .map(|(rtt, _)| u64::try_from(rtt.as_millis()).unwrap_or(u64::MAX)),
                    sent_packets: conn.as_ref().map(|(_, path)| path.sent_packets),
                    lost_packets: conn.as_ref().map(|(_, path)| path.lost_packets),
                    last_close: self.last_close.get(n).copied(),
                }
            })
            .collect();
        let overlay = self.dispatcher.machine().overlay();
        let overlay_lowered = admission
            .capacity_view()
            .into_iter()
            .filter(|c| {
                c.online
                    .is_some_and(|g| overlay.is_lowered(&c.provider_id, g))
            })
            .map(|c| c.provider_id)
            .collect();
        HubSnapshot {
            nodes: connections
                .iter()
                .map(|c| (c.node.clone(), c.generation, c.ready, c.last_generation))
                .collect(),
            connections,
            overlay_lowered,
            providers: admission.capacity_view(),
            queue_depth: admission.queue_depth(),
            leases_in_use: admission.leases_in_use(),
            fenced_messages: registry.fenced_messages(),
            fences: registry.fences(),
            closes_by_reason: self.closes_by_reason.clone(),
            waiters: self.waiters.len(),
            links: self.links.len(),
            health: self
                .dispatcher
                .machine()
                .health()
                .snapshot()
                .into_iter()
                .map(|h| ProviderHealthView {
                    state: h.state.as_str(),
                    last_success_at_ms: h.last_success_at.map(|t| self.unix_ms(t)),
                    consecutive_failures: h.consecutive_failures,
                    failure_code: h.failure_code.map(|c| c.as_str()),
                    next_retry_at_ms: h.next_retry_at.map(|t| self.unix_ms(t)),
                    no_verdicts_total: h.no_verdicts_total,
                    provider_id: h.provider_id,
                })
                .collect(),
        }
    }

    fn unix_ms(&self, at: iop_core::Instant) -> u64 {
        self.unix_origin_ms + at.as_millis()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use iop_core::edge::admission::{AdmissionConfig, DispatchRequest, ProviderSpec};
    use iop_core::ids::ProviderId;

    use super::*;

    const QUEUE_TIMEOUT: Duration = Duration::from_millis(500);

    fn start() -> (HubHandle, tokio::task::JoinHandle<()>, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("temp dir");
        let creds = Arc::new(crate::cred::Credentials::open(dir.path(), &[]).expect("creds"));
        let config = DispatchConfig {
            admission: AdmissionConfig {
                queue_capacity: 4,
                queue_timeout: QUEUE_TIMEOUT,
            },
            providers: vec![ProviderSpec {
                id: ProviderId::from("p1"),
                node: NodeId::from("a"),
                adapter: iop_wire::AdapterKind::Mock,
                target: "t".into(),
                capacity: 1,
                stall_timeout_ms: 2000,
            }],
            generation_floor: 0,
            generation_mark: None,
            known_nodes: None,
            health: Default::default(),
            capacity_from_node: Default::default(),
            parked_hold_ms: 0,
        };
        let metrics = EdgeMetrics::new(iop_transport::telemetry::MetricsPipeline::prometheus_only(
            "iop-edge",
        ));
        let (hub, task) = spawn(
            config,
            None,
            Clock::new(),
            metrics,
            None,
            creds,
            HashMap::new(),
        )
        .expect("hub");
        (hub, task, dir)
    }

    fn admit(id: RequestId) -> RequestCommand {
        RequestCommand::Admit(DispatchRequest::new(id, vec![ProviderId::from("p1")]))
    }

    fn events(news: &[RequestNews]) -> Vec<&RequestEvent> {
        news.iter().map(|n| &n.event).collect()
    }

    /// A request's command is answered by the call itself, with no hop to
    /// the hub task; news no call of its own caused (here its queue wait's
    /// expiry, fired by the hub task's timer, which the call moved closer)
    /// come through its queue, and a later call hands any still queued
    /// back first, in the order the dispatcher said them. Detaching lets
    /// go of the request (R-LEASE-1); after shutdown nothing is routed.
    #[tokio::test(start_paused = true)]
    async fn a_request_hears_its_answers_from_its_calls_and_the_rest_in_order() {
        let (hub, task, _dir) = start();
        let (tx, mut rx) = mpsc::unbounded_channel();
        hub.attach(1, tx);
        // No node is connected: the first admission waits.
        let answer = hub.request(admit(1), &mut rx);
        assert_eq!(events(&answer), [&RequestEvent::Queued]);
        assert!(rx.try_recv().is_err(), "the answer is not queued as well");
        // The hub task slept with no timeout before the call; it wakes for
        // the queue's expiry.
        let expired = tokio::time::timeout(QUEUE_TIMEOUT * 4, rx.recv())
            .await
            .expect("the hub's timer fired")
            .expect("news");
        assert_eq!(expired.event, RequestEvent::QueueExpired);
        // A second wait expires while the request makes no call ...
        let answer = hub.request(admit(1), &mut rx);
        assert_eq!(events(&answer), [&RequestEvent::Queued]);
        tokio::time::sleep(QUEUE_TIMEOUT * 2).await;
        // ... and comes back, first, with the next call's answer.
        let answer = hub.request(admit(1), &mut rx);
        assert_eq!(
            events(&answer),
            [&RequestEvent::QueueExpired, &RequestEvent::Queued]
        );
        let snapshot = hub.snapshot().await.expect("snapshot");
        assert_eq!((snapshot.queue_depth, snapshot.waiters), (1, 1));
        hub.detach(1);
        let snapshot = hub.snapshot().await.expect("snapshot");
        assert_eq!((snapshot.queue_depth, snapshot.waiters), (0, 0));
        hub.shutdown();
        task.await.expect("hub task");
        let (tx, mut rx) = mpsc::unbounded_channel();
        hub.attach(2, tx);
        assert!(rx.recv().await.is_none(), "a stopped hub routes nothing");
        assert!(hub.request(admit(2), &mut rx).is_empty());
    }
}
