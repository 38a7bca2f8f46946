//! One task per data stream: a normalized run, a raw tunnel, a durable run
//! or a command.
//!
//! Every run's rules are `iop_core::node::run::NodeRun`'s: the start order
//! (stall timeout, target, admission, lease, call), a refusal's whole
//! failure, the watchdog's verdicts (every provider output is offered to
//! the link's watchdog and only what it lets through reaches the Edge,
//! R-WD-1, R-WD-6), a missing terminal, and for a durable run its park,
//! detach, adoption and replay (R-PARK-1, R-PARK-2). This task carries its
//! outputs out on the stream, the provider call and the link, and feeds
//! back what happened. A durable run outlives its connection: it runs in a
//! task of its own, registered in the node's
//! [`ParkingLot`](crate::parking::ParkingLot) so a later connection can
//! adopt it.

use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use iop_core::node::park::EdgeSignal;
use iop_core::node::probe::capabilities_probe;
use iop_core::node::run::{
    Adoption, LinkAsk, NodeRun, NodeRunInput, NodeRunOutput, ParkTerms, RunFrame, RunSpec,
};
use iop_core::node::watchdog::RunKind;
use iop_trace::{Driven, MachineKind, NodeRunConfigRec, Tap};
use iop_transport::clock::Clock;
use iop_transport::framed::{FramedError, FramedRecv, FramedSend};
use iop_transport::traces::{Kind, TraceSpan};
use iop_wire::{
    AdapterKind, CapabilitiesReport, Command, CommandKind, CommandResult, CommandResultBody,
    DataRequest, ExecutionFailure, FailureCode, ParkedRun, ProviderTunnelFrame, RunEvent,
    RunEventKind, RunKey, RunStreamFrame, StreamErrorCode, TargetHealth,
};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::control::{Attach, LinkMsg, LinkTx, RunControl};
use crate::metrics::{RunRecord, RunSpan};
use crate::parking::{LotKey, ParkEntry};
use crate::state::LinkShared;

/// Serve one data stream opened by the Edge.
pub async fn serve_stream(
    mut send: FramedSend,
    mut recv: FramedRecv,
    link: LinkTx,
    shared: Arc<LinkShared>,
    conn: quinn::Connection,
    generation: u64,
) {
    let request = match recv.recv::<DataRequest>().await {
        Ok(Some(r)) => r,
        Ok(None) => return,
        Err(e) => {
            // SPEC §5: a bad frame closes the stream with its code and is
            // counted; anything else (a reset, a lost connection) just ends.
            shared.metrics.wire_error(&e);
            let code = match &e {
                FramedError::PeerProtocol { code, .. } => {
                    tracing::warn!(event = "node_data_stream_refused", code = code.as_str());
                    *code
                }
                _ => {
                    tracing::debug!(event = "node_data_stream_ended", error = %e);
                    StreamErrorCode::Canceled
                }
            };
            let _ = send.reset(code);
            return;
        }
    };
    let attached = Attached {
        send,
        recv,
        link,
        conn,
        run_id: 0,
        edge_done: false,
    };
    match request {
        DataRequest::Run(mut req) => {
            let park = req.park.take();
            let span = shared.metrics.run_span("normalized", req.trace_context);
            let adapter = shared.adapter(req.adapter, &req.target).cloned();
            let durable = park.as_ref().map(|p| {
                (
                    (
                        RunKey {
                            generation,
                            run_id: req.run_id,
                        },
                        p.response_id.clone(),
                    ),
                    ParkTerms {
                        grace_ms: p.grace_ms,
                        max_kept_bytes: shared.park_buffer_bytes,
                    },
                )
            });
            let task = RunTask {
                spec: RunSpec {
                    run_id: req.run_id,
                    kind: RunKind::Normalized,
                    stall_timeout_ms: req.response_stall_timeout_ms,
                    deadline_ms: req.deadline_ms,
                    target_known: adapter.is_some(),
                    carries_lease: req.credential_lease.is_some(),
                    park: durable.as_ref().map(|(_, terms)| *terms),
                },
                lease: req.credential_lease.take(),
                route: Some(req.model.clone()),
                adapter,
                lot_key: durable.map(|(key, _)| key),
                span,
            };
            let run = task.run(
                Arc::clone(&shared),
                attached,
                move |a: &crate::adapter::Adapter, auth| a.run(req, auth),
            );
            if run.durable {
                // A durable run outlives this connection (R-PARK-1): it
                // runs in a task of its own, not in the link's.
                tokio::spawn(run.fut);
            } else {
                run.fut.await;
            }
        }
        DataRequest::Adopt(request) => {
            let key = request.key;
            let response_id = request.response_id.clone();
            let Attached {
                send,
                recv,
                link,
                conn,
                ..
            } = attached;
            let attach = Attach {
                send,
                recv,
                link,
                conn,
                request,
            };
            if !shared.parking.adopt(key, &response_id, attach) {
                // No such run (expired, over, never here): the Edge sees
                // the stream end without a frame.
                tracing::info!(event = "node_adoption_unknown_run", run_id = key.run_id);
            }
        }
        DataRequest::Tunnel(mut req) => {
            let span = shared.metrics.run_span("tunnel", req.trace_context);
            let adapter = shared.adapter(req.adapter, &req.target).cloned();
            let task = RunTask {
                spec: RunSpec {
                    run_id: req.run_id,
                    kind: RunKind::Tunnel,
                    stall_timeout_ms: req.response_stall_timeout_ms,
                    deadline_ms: req.deadline_ms,
                    target_known: adapter.is_some(),
                    carries_lease: req.credential_lease.is_some(),
                    park: None,
                },
                lease: req.credential_lease.take(),
                route: None,
                adapter,
                lot_key: None,
                span,
            };
            task.run(
                Arc::clone(&shared),
                attached,
                move |a: &crate::adapter::Adapter, auth| a.tunnel(req, auth),
            )
            .fut
            .await;
        }
        DataRequest::Command(cmd) => {
            let Attached { mut send, link, .. } = attached;
            command(&mut send, cmd, &link, &shared).await;
        }
    }
}

/// A run's task, ready to be awaited or spawned.
struct Started {
    durable: bool,
    fut: futures::future::BoxFuture<'static, ()>,
}

/// A frame type as it goes on the wire.
trait WireFrame: RunFrame + Serialize + Send + Sync + 'static {
    /// The frame written on the stream.
    type Wire: Serialize + Send + Sync;
    /// `self` as run `run_id` writes it.
    fn wire(self, run_id: u64) -> Self::Wire;
}

impl WireFrame for RunEventKind {
    type Wire = RunEvent;
    fn wire(self, run_id: u64) -> RunEvent {
        RunEvent { run_id, kind: self }
    }
}

impl WireFrame for ProviderTunnelFrame {
    type Wire = ProviderTunnelFrame;
    fn wire(self, _: u64) -> ProviderTunnelFrame {
        self
    }
}

/// The stream a run is on, and its connection.
struct Attached {
    send: FramedSend,
    recv: FramedRecv,
    link: LinkTx,
    conn: quinn::Connection,
    /// The run's id on this connection.
    run_id: u64,
    /// The Edge's side ended: nothing more is read from it.
    edge_done: bool,
}

/// What the Edge's side of a stream said.
enum EdgeSaid {
    Ack(u64),
    /// The side ended; the core decides what that means for the run.
    Ended(EdgeSignal),
}

/// Wait for the Edge's side, forever when there is no stream or it ended.
/// A transport error is only classified here.
async fn next_said(
    attached: &mut Option<Attached>,
    metrics: &crate::metrics::NodeMetrics,
) -> EdgeSaid {
    let Some(a) = attached.as_mut().filter(|a| !a.edge_done) else {
        return std::future::pending().await;
    };
    let said = match a.recv.recv::<RunStreamFrame>().await {
        Ok(Some(RunStreamFrame::Ack { through_frame })) => return EdgeSaid::Ack(through_frame),
        Ok(None) => EdgeSignal::Finished,
        Err(FramedError::ResetByPeer { .. }) => EdgeSignal::Reset,
        Err(FramedError::StoppedByPeer { .. }) => EdgeSignal::Stopped,
        Err(FramedError::ConnectionLost { .. }) => EdgeSignal::ConnectionLost,
        Err(e) => {
            metrics.wire_error(&e);
            EdgeSignal::Broken
        }
    };
    a.edge_done = true;
    EdgeSaid::Ended(said)
}

async fn next_item<T>(provider: &mut Option<BoxStream<'static, T>>) -> Option<T> {
    match provider {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

/// One run as its request describes it, before it starts.
struct RunTask {
    spec: RunSpec,
    lease: Option<Vec<u8>>,
    route: Option<String>,
    adapter: Option<crate::adapter::Adapter>,
    /// A durable run's place in the parking lot.
    lot_key: Option<LotKey>,
    span: TraceSpan,
}

impl RunTask {
    fn run<F, S>(self, shared: Arc<LinkShared>, attached: Attached, start: S) -> Started
    where
        F: WireFrame,
        S: FnOnce(&crate::adapter::Adapter, Option<String>) -> BoxStream<'static, F>
            + Send
            + 'static,
    {
        let durable = self.lot_key.is_some();
        Started {
            durable,
            fut: Box::pin(drive(self, shared, attached, start)),
        }
    }
}

/// Drive one run's [`NodeRun`] to its end.
async fn drive<F, S>(task: RunTask, shared: Arc<LinkShared>, attached: Attached, start: S)
where
    F: WireFrame,
    S: FnOnce(&crate::adapter::Adapter, Option<String>) -> BoxStream<'static, F> + Send + 'static,
{
    let RunTask {
        spec,
        mut lease,
        route,
        adapter,
        lot_key,
        span,
    } = task;
    let clock = Clock::new();
    let kind = spec.kind;
    let config = NodeRunConfigRec { spec };
    let tap = shared
        .traces
        .tap(MachineKind::NodeRun, || &config)
        .unwrap_or_else(|e| {
            tracing::error!(event = "node_trace_open_failed", machine = "node-run", error = %e);
            Tap::off()
        });
    let mut machine: Driven<NodeRun<F>> = Driven::new(NodeRun::new(config.spec), tap);
    let mut attached = Some(Attached {
        run_id: machine.machine().run_id(),
        ..attached
    });
    let mut adopting: Option<Attach> = None;
    let (control_tx, mut control) = mpsc::unbounded_channel();
    // A run that is not durable gives its one sender to the link, so its
    // control channel closing says the link is gone; a durable run keeps
    // one for the adoptions the parking lot hands it.
    let durable = lot_key.is_some();
    let mut control_tx = Some(control_tx);
    let mut record = adapter.as_ref().map(|a| {
        span.set("iop.adapter", a.kind().as_str());
        span.set_configured("iop.target", a.target());
        RunRecord::new(&shared.metrics, a.kind(), a.target(), kind.as_str())
    });
    if adapter.is_none() {
        span.fail(FailureCode::UnknownTarget.as_str());
    }
    let run_span = RunSpan(span);
    let mut start = Some(start);
    let mut auth: Option<String> = None;
    let mut provider: Option<BoxStream<'static, F>> = None;
    let mut registered = false;

    'run: loop {
        while let Some(out) = machine.poll_output(clock.now()) {
            let fed = match out {
                NodeRunOutput::Link(ask) => {
                    let link = match (&ask, &adopting, &attached) {
                        (LinkAsk::Start { adopted: true, .. }, Some(a), _) => Some(a.link.clone()),
                        (_, _, Some(a)) => Some(a.link.clone()),
                        _ => None,
                    };
                    let left = matches!(ask, LinkAsk::Left { .. });
                    let control = if durable {
                        control_tx.clone()
                    } else {
                        control_tx.take()
                    };
                    let fed = match link {
                        Some(link) => {
                            ask_link(
                                &link,
                                ask,
                                adapter.as_ref(),
                                &route,
                                &mut lease,
                                &mut auth,
                                control,
                            )
                            .await
                        }
                        None => None,
                    };
                    if left {
                        // The run is no longer on that stream.
                        attached = None;
                    }
                    fed
                }
                NodeRunOutput::CallProvider => {
                    let (Some(adapter), Some(start)) = (&adapter, start.take()) else {
                        continue;
                    };
                    if let (Some(key), Some(control)) = (&lot_key, &control_tx) {
                        register(&shared, key, adapter, control.clone());
                        registered = true;
                    }
                    if let Some(record) = &mut record {
                        record.provider_call(&run_span.0);
                    }
                    provider = Some(start(adapter, auth.take()));
                    None
                }
                NodeRunOutput::StopProvider { report } => {
                    // Dropping the stream drops the in-flight request, which
                    // closes the provider connection: the call has ended
                    // (R-WD-2, R-WD-4).
                    provider = None;
                    if report {
                        if let Some(record) = &mut record {
                            record.call_canceled();
                        }
                        Some(NodeRunInput::ProviderStopped)
                    } else {
                        None
                    }
                }
                NodeRunOutput::Send { frames, finish } => {
                    if let Some(record) = &mut record {
                        for frame in &frames {
                            record.forwarded(frame.content_bytes(), frame.usage());
                        }
                    }
                    write(&mut attached, frames, finish).await
                }
                NodeRunOutput::Replay(frames) => write(&mut attached, frames, false).await,
                NodeRunOutput::FinishStream => {
                    if let Some(a) = &mut attached {
                        let _ = a.send.finish();
                    }
                    None
                }
                NodeRunOutput::ResetStream(code) => {
                    if let Some(a) = &mut attached {
                        let _ = a.send.reset(code);
                    }
                    None
                }
                NodeRunOutput::Attach => {
                    if let Some(a) = adopting.take() {
                        tracing::info!(
                            event = "node_parked_run_adopted",
                            run_id = a.request.run_id,
                            resume_after = a.request.resume_after_frame,
                        );
                        attached = Some(Attached {
                            send: a.send,
                            recv: a.recv,
                            link: a.link,
                            conn: a.conn,
                            run_id: machine.machine().run_id(),
                            edge_done: false,
                        });
                    }
                    None
                }
                NodeRunOutput::RefuseAdoption(why) => {
                    tracing::warn!(event = "node_adoption_refused", reason = %why);
                    if let Some(mut a) = adopting.take() {
                        let _ = a.send.reset(StreamErrorCode::Canceled);
                    }
                    None
                }
                NodeRunOutput::Ended(code) => {
                    if let Some(record) = &mut record {
                        record.finish(code);
                    }
                    None
                }
                NodeRunOutput::Parked => {
                    tracing::info!(
                        event = "node_run_parked",
                        run_id = machine.machine().run_id()
                    );
                    None
                }
                NodeRunOutput::Expired => {
                    // R-PARK-1: no Edge took it within the grace.
                    tracing::warn!(
                        event = "node_parked_run_expired",
                        run_id = machine.machine().run_id()
                    );
                    shared
                        .disconnect_cancels
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    None
                }
                NodeRunOutput::Done => break 'run,
            };
            if let Some(input) = fed {
                machine.handle_input(clock.now(), input);
            }
        }
        if machine.machine().is_over() {
            break;
        }
        if let (Some(key), true) = (&lot_key, registered)
            && let (Some(state), Some(summary)) = (
                machine.machine().park_state(),
                machine.machine().park_summary(),
            )
        {
            shared.parking.update(key, state, summary);
        }
        let batch = machine.machine().read_batch();
        let parked_until = machine.poll_timeout();
        let input = tokio::select! {
            biased;
            ctrl = control.recv() => match ctrl {
                Some(RunControl::CancelProvider) => NodeRunInput::CancelProvider,
                Some(RunControl::Terminal(terminal)) => NodeRunInput::Terminal(terminal),
                Some(RunControl::CancelParked) => NodeRunInput::CancelParked,
                Some(RunControl::Attach(attach)) => {
                    if let Some(mut older) = adopting.replace(*attach) {
                        // One adoption at a time.
                        let _ = older.send.reset(StreamErrorCode::Canceled);
                    }
                    let a = adopting.as_ref().map(|a| &a.request);
                    let Some(request) = a else { continue };
                    NodeRunInput::Adopt(Adoption {
                        run_id: request.run_id,
                        resume_after_frame: request.resume_after_frame,
                        stall_timeout_ms: request.response_stall_timeout_ms,
                        deadline_ms: request.deadline_ms,
                        attached_closing: attached
                            .as_ref()
                            .is_some_and(|a| a.conn.close_reason().is_some()),
                    })
                }
                // The link dropped the run's control: the link is gone.
                None => NodeRunInput::LinkGone,
            },
            said = next_said(&mut attached, &shared.metrics) => match said {
                EdgeSaid::Ack(through) => NodeRunInput::Acked(through),
                EdgeSaid::Ended(signal) => NodeRunInput::EdgeEnded(signal),
            },
            item = next_item(&mut provider), if batch > 0 => match item {
                // The provider stream ended without a terminal (R-WD-6).
                None => NodeRunInput::ProviderEnded,
                Some(item) => {
                    // Every output the provider already produced goes to
                    // the watchdog in one ask, not one round trip each.
                    let mut items = vec![item];
                    if !items[0].is_terminal() {
                        while items.len() < batch {
                            match provider.as_mut().and_then(|p| p.next().now_or_never()) {
                                Some(Some(item)) => {
                                    let terminal = item.is_terminal();
                                    items.push(item);
                                    if terminal {
                                        break;
                                    }
                                }
                                // Ended: the next turn reports it.
                                Some(None) => {
                                    provider = Some(Box::pin(futures::stream::empty()));
                                    break;
                                }
                                None => break,
                            }
                        }
                    }
                    NodeRunInput::Provider(items)
                }
            },
            () = clock.sleep_until(parked_until), if parked_until.is_some() => {
                machine.handle_timeout(clock.now());
                continue;
            },
        };
        machine.handle_input(clock.now(), input);
    }
    drop(provider);
    if let Some(mut a) = adopting.take() {
        let _ = a.send.reset(StreamErrorCode::Canceled);
    }
    if let (Some(key), true) = (&lot_key, registered) {
        shared.parking.remove(key);
    }
    if let Some(record) = &record {
        run_span.end(record);
    }
}

/// Enter a durable run in the parking lot (R-PARK-1, R-PARK-2).
fn register(
    shared: &LinkShared,
    key: &LotKey,
    adapter: &crate::adapter::Adapter,
    control: mpsc::UnboundedSender<RunControl>,
) {
    shared.parking.insert(
        key.clone(),
        ParkEntry {
            control,
            report: ParkedRun {
                key: key.0,
                response_id: key.1.clone(),
                adapter: adapter.kind(),
                target: adapter.target().to_owned(),
                first_kept_frame: 1,
                last_frame: 0,
                ended: false,
            },
            state: iop_core::node::park::ParkState::Attached,
        },
    );
}

/// Write frames on the run's stream (then finish it if asked): `None`, or
/// the write's failure as the machine's input.
async fn write<F: WireFrame>(
    attached: &mut Option<Attached>,
    frames: Vec<F>,
    finish: bool,
) -> Option<NodeRunInput<F>> {
    let a = attached.as_mut()?;
    let run_id = a.run_id;
    let wire: Vec<F::Wire> = frames.into_iter().map(|f| f.wire(run_id)).collect();
    let written = match &wire[..] {
        [one] => a.send.send(one).await,
        _ => a.send.send_all(&wire).await,
    };
    if written.is_err() {
        return Some(NodeRunInput::WriteFailed);
    }
    if finish {
        let _ = a.send.finish();
    }
    None
}

/// Carry one ask to the link: the answer as the machine's input (`None`:
/// nothing to answer).
async fn ask_link<F>(
    link: &LinkTx,
    ask: LinkAsk,
    adapter: Option<&crate::adapter::Adapter>,
    route: &Option<String>,
    lease: &mut Option<Vec<u8>>,
    auth: &mut Option<String>,
    control: Option<mpsc::UnboundedSender<RunControl>>,
) -> Option<NodeRunInput<F>> {
    let (adapter_kind, target) = adapter
        .map(|a| (a.kind(), a.target().to_owned()))
        .unwrap_or((AdapterKind::Mock, String::new()));
    let gone = Some(NodeRunInput::LinkGone);
    match ask {
        LinkAsk::Start {
            run_id,
            kind,
            stall_timeout,
            deadline,
            carries_lease,
            adopted,
        } => {
            let Some(control) = control else {
                return gone;
            };
            match link
                .ask(|reply| LinkMsg::Start {
                    run_id,
                    kind,
                    stall_timeout,
                    deadline,
                    adapter: adapter_kind,
                    target,
                    carries_lease,
                    adopted,
                    control,
                    reply,
                })
                .await
            {
                Some(answer) => Some(NodeRunInput::Admitted(answer)),
                None => gone,
            }
        }
        // R-CRED-2: the lease is opened only now, after admission and
        // right before the provider call; the secret stays here.
        LinkAsk::OpenLease { run_id } => {
            let opened = link
                .ask(|reply| LinkMsg::OpenLease {
                    run_id,
                    adapter: adapter_kind,
                    target,
                    route: route.clone(),
                    lease: lease.take(),
                    reply,
                })
                .await;
            let ok = match opened {
                Some(Ok(None)) => true,
                // Only this one call sees it; `secret` is wiped when dropped.
                Some(Ok(Some(secret))) => match std::str::from_utf8(secret.expose_secret()) {
                    Ok(text) => {
                        *auth = Some(text.to_owned());
                        true
                    }
                    Err(_) => false,
                },
                Some(Err(_)) => false,
                None => return gone,
            };
            Some(NodeRunInput::LeaseOpened(ok))
        }
        LinkAsk::Offer { run_id, events } => {
            match link
                .ask(|reply| LinkMsg::Events {
                    run_id,
                    events,
                    reply,
                })
                .await
            {
                Some(emissions) => Some(NodeRunInput::Emissions(emissions)),
                None => gone,
            }
        }
        LinkAsk::ProviderDropped { run_id } => {
            link.tell(LinkMsg::ProviderReturned { run_id }).await;
            None
        }
        LinkAsk::Canceled { run_id } => {
            link.tell(LinkMsg::Canceled { run_id }).await;
            None
        }
        LinkAsk::Left { run_id } => {
            link.tell(LinkMsg::Finished { run_id }).await;
            None
        }
    }
}

async fn command(send: &mut FramedSend, cmd: Command, link: &LinkTx, shared: &LinkShared) {
    let body = match cmd.kind {
        CommandKind::TransportStatus => match link.ask(|reply| LinkMsg::Status { reply }).await {
            Some(report) => CommandResultBody::TransportStatus(report),
            None => return,
        },
        CommandKind::Capabilities { target } => {
            // The same bounded exact-target probe as the stall path (R-CAP-1).
            let bound = shared.probe_bound;
            let chosen = shared
                .adapters
                .iter()
                .filter(|a| capabilities_probe(target.as_ref(), a.kind(), a.target()));
            let probes = chosen.map(|a| async move {
                let span = shared
                    .metrics
                    .tracer()
                    .start("node.probe", Kind::Internal, None);
                span.set("iop.adapter", a.kind().as_str());
                span.set_configured("iop.target", a.target());
                span.set("iop.reason", "capabilities");
                let verdict = shared.probe_verdict(a.kind(), a.target(), a.probe(bound).await);
                shared.metrics.probe(a.kind(), a.target(), verdict.health);
                span.set("iop.status", verdict.health.as_str());
                match verdict.failure {
                    Some(code) => span.fail(code.as_str()),
                    None => span.ok(),
                }
                TargetHealth {
                    adapter: a.kind(),
                    target: a.target().to_owned(),
                    status: verdict.health,
                    failure_code: verdict.failure,
                    models: verdict.models,
                }
            });
            let targets = futures::future::join_all(probes).await;
            // The observation sequence is taken after the probes finished,
            // so it orders this answer after every earlier stall terminal
            // (R-SEQ-1, `capabilities_probe`).
            let Some(seq) = link
                .ask(|reply| LinkMsg::TakeObservationSeq { reply })
                .await
            else {
                return;
            };
            CommandResultBody::Capabilities(CapabilitiesReport {
                targets,
                health_observation_seq: seq,
            })
        }
        CommandKind::OllamaApi(call) => {
            let adapter = shared
                .adapters
                .iter()
                .find(|a| a.kind() == iop_wire::AdapterKind::Ollama && a.target() == call.target)
                .cloned();
            let Some(adapter) = adapter else {
                let result = CommandResult {
                    command_id: cmd.command_id,
                    session_id: cmd.session_id,
                    body: CommandResultBody::Failed(ExecutionFailure::new(
                        FailureCode::UnknownTarget,
                    )),
                };
                let _ = send.send(&result).await;
                let _ = send.finish();
                return;
            };
            let mut frames = adapter.ollama_api(call);
            while let Some(frame) = frames.next().await {
                let terminal = frame.is_terminal();
                let result = CommandResult {
                    command_id: cmd.command_id,
                    session_id: cmd.session_id.clone(),
                    body: CommandResultBody::OllamaApi(frame),
                };
                if send.send(&result).await.is_err() || terminal {
                    break;
                }
            }
            let _ = send.finish();
            return;
        }
    };
    let result = CommandResult {
        command_id: cmd.command_id,
        session_id: cmd.session_id,
        body,
    };
    let _ = send.send(&result).await;
    let _ = send.finish();
}
