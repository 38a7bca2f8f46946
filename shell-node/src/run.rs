//! One task per data stream: a normalized run, a raw tunnel or a command.
//!
//! A handler never decides liveness: every provider output is classified
//! and offered to the link's watchdog, and only what the watchdog forwards
//! reaches the Edge (R-WD-1, R-WD-6). The watchdog's own terminals (stall,
//! deadline, cancel) arrive on the handler's control channel; its
//! `CancelProvider` drops the provider call at once (R-WD-2).

use std::sync::Arc;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use iop_core::node::probe::capabilities_probe;
use iop_core::node::provider::ProviderCallError;
use iop_core::node::watchdog::{
    Emission, ProviderEvent, RunKind, RunTerminal, effective_deadline, effective_stall_timeout,
};
use iop_transport::framed::{FramedError, FramedRecv, FramedSend};
use iop_transport::traces::{Kind, TraceSpan};
use iop_wire::{
    CapabilitiesReport, Command, CommandKind, CommandResult, CommandResultBody, DataRequest,
    ExecutionFailure, FailureCode, ProviderTunnelFrame, RunEvent, RunEventKind, StreamErrorCode,
    TargetHealth, Usage,
};
use serde::Serialize;
use tokio::sync::mpsc;

use crate::control::{LinkMsg, LinkTx, RunControl};
use crate::metrics::RunSpan;
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
    match request {
        DataRequest::Run(mut req) if req.park.is_some() => {
            // A durable run outlives this connection (R-PARK-1): it runs in
            // a task of its own, not in the link's.
            if let Some(park) = req.park.take() {
                tokio::spawn(crate::park::run_durable(
                    send, recv, link, conn, shared, req, park, generation,
                ));
            }
        }
        DataRequest::Adopt(request) => {
            let key = request.key;
            let response_id = request.response_id.clone();
            let attach = crate::control::Attach {
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
        DataRequest::Run(req) => {
            let span = shared.metrics.run_span("normalized", req.trace_context);
            let run_id = req.run_id;
            let stall = req.response_stall_timeout_ms;
            let deadline = effective_deadline(req.deadline_ms);
            let adapter = shared.adapter(req.adapter, &req.target).cloned();
            let sink = RunSink { run_id };
            let mut req = req;
            let credential = Credential {
                lease: req.credential_lease.take(),
                route: Some(req.model.clone()),
            };
            execute(
                &mut send,
                recv,
                &link,
                &shared.metrics,
                run_id,
                RunKind::Normalized,
                stall,
                deadline,
                adapter.map(|a| (a.kind(), a.target().to_owned(), a)),
                credential,
                move |a, auth| a.run(req, auth),
                sink,
                span,
            )
            .await;
        }
        DataRequest::Tunnel(req) => {
            let span = shared.metrics.run_span("tunnel", req.trace_context);
            let run_id = req.run_id;
            let stall = req.response_stall_timeout_ms;
            let deadline = effective_deadline(req.deadline_ms);
            let adapter = shared.adapter(req.adapter, &req.target).cloned();
            let mut req = req;
            let credential = Credential {
                lease: req.credential_lease.take(),
                route: None,
            };
            execute(
                &mut send,
                recv,
                &link,
                &shared.metrics,
                run_id,
                RunKind::Tunnel,
                stall,
                deadline,
                adapter.map(|a| (a.kind(), a.target().to_owned(), a)),
                credential,
                move |a, auth| a.tunnel(req, auth),
                TunnelSink,
                span,
            )
            .await;
        }
        DataRequest::Command(cmd) => command(&mut send, cmd, &link, &shared).await,
    }
}

/// A run's sealed credential lease and what the node can bind it to.
struct Credential {
    lease: Option<Vec<u8>>,
    route: Option<String>,
}

/// How a stream's frames are shaped: run events or tunnel frames.
trait Sink {
    type Item: Send + 'static;
    type Frame: Serialize;
    fn event(item: &Self::Item) -> ProviderEvent;
    fn frame(&self, item: Self::Item) -> Self::Frame;
    fn failure(&self, failure: ExecutionFailure) -> Self::Frame;
    fn is_terminal(item: &Self::Item) -> bool;
    /// Content bytes relayed by `item` (text, tool-call arguments, body).
    fn content_bytes(item: &Self::Item) -> u64;
    /// Usage `item` reports.
    fn usage(item: &Self::Item) -> Option<Usage>;
    /// The failure code of a terminal `item` (`None`: success or not
    /// terminal).
    fn failure_code(item: &Self::Item) -> Option<FailureCode>;
    /// The failure a terminal `item` carries, to be sanitized by core.
    fn failure_mut(item: &mut Self::Item) -> Option<&mut ExecutionFailure>;
}

struct RunSink {
    run_id: u64,
}

impl Sink for RunSink {
    type Item = RunEventKind;
    type Frame = RunEvent;
    fn event(item: &RunEventKind) -> ProviderEvent {
        ProviderEvent::from_run_event(item)
    }
    fn frame(&self, kind: RunEventKind) -> RunEvent {
        RunEvent {
            run_id: self.run_id,
            kind,
        }
    }
    fn failure(&self, failure: ExecutionFailure) -> RunEvent {
        self.frame(RunEventKind::Failed(failure))
    }
    fn is_terminal(item: &RunEventKind) -> bool {
        item.is_terminal()
    }
    fn content_bytes(item: &RunEventKind) -> u64 {
        match item {
            RunEventKind::TextDelta(t) => t.len() as u64,
            RunEventKind::ToolCallDelta(d) => d.arguments_delta.len().max(1) as u64,
            _ => 0,
        }
    }
    fn usage(item: &RunEventKind) -> Option<Usage> {
        match item {
            RunEventKind::Usage(u) => Some(*u),
            RunEventKind::Completed { usage, .. } => *usage,
            _ => None,
        }
    }
    fn failure_code(item: &RunEventKind) -> Option<FailureCode> {
        match item {
            RunEventKind::Failed(f) => Some(f.code),
            _ => None,
        }
    }
    fn failure_mut(item: &mut RunEventKind) -> Option<&mut ExecutionFailure> {
        match item {
            RunEventKind::Failed(f) => Some(f),
            _ => None,
        }
    }
}

struct TunnelSink;

impl Sink for TunnelSink {
    type Item = ProviderTunnelFrame;
    type Frame = ProviderTunnelFrame;
    fn event(item: &ProviderTunnelFrame) -> ProviderEvent {
        ProviderEvent::from_tunnel_frame(item)
    }
    fn frame(&self, item: ProviderTunnelFrame) -> ProviderTunnelFrame {
        item
    }
    fn failure(&self, failure: ExecutionFailure) -> ProviderTunnelFrame {
        ProviderTunnelFrame::Failure(failure)
    }
    fn is_terminal(item: &ProviderTunnelFrame) -> bool {
        item.is_terminal()
    }
    fn content_bytes(item: &ProviderTunnelFrame) -> u64 {
        match item {
            ProviderTunnelFrame::Body(b) => b.len() as u64,
            _ => 0,
        }
    }
    fn usage(_: &ProviderTunnelFrame) -> Option<Usage> {
        // A tunnel relays the provider's bytes unparsed.
        None
    }
    fn failure_code(item: &ProviderTunnelFrame) -> Option<FailureCode> {
        match item {
            ProviderTunnelFrame::Failure(f) => Some(f.code),
            _ => None,
        }
    }
    fn failure_mut(item: &mut ProviderTunnelFrame) -> Option<&mut ExecutionFailure> {
        match item {
            ProviderTunnelFrame::Failure(f) => Some(f),
            _ => None,
        }
    }
}

async fn write_terminal<S: Sink>(send: &mut FramedSend, sink: &S, failure: ExecutionFailure) {
    let _ = send.send(&sink.failure(failure)).await;
    let _ = send.finish();
}

#[allow(clippy::too_many_arguments)]
async fn execute<S, F>(
    send: &mut FramedSend,
    mut recv: FramedRecv,
    link: &LinkTx,
    metrics: &crate::metrics::NodeMetrics,
    run_id: u64,
    kind: RunKind,
    stall_timeout_ms: u64,
    deadline: Option<Duration>,
    adapter: Option<(iop_wire::AdapterKind, String, crate::adapter::Adapter)>,
    credential: Credential,
    start: F,
    sink: S,
    span: TraceSpan,
) where
    S: Sink,
    F: FnOnce(&crate::adapter::Adapter, Option<String>) -> BoxStream<'static, S::Item>,
{
    // Validated before any adapter is called (R-WD, SPEC §3).
    let stall_timeout = match effective_stall_timeout(stall_timeout_ms) {
        Ok(d) => d,
        Err(e) => return write_terminal(send, &sink, e.failure()).await,
    };
    let Some((adapter_kind, target, adapter)) = adapter else {
        span.fail(FailureCode::UnknownTarget.as_str());
        return write_terminal(
            send,
            &sink,
            ExecutionFailure::new(FailureCode::UnknownTarget),
        )
        .await;
    };
    span.set("iop.adapter", adapter_kind.as_str());
    span.set_configured("iop.target", &target);
    let kind_label = match kind {
        RunKind::Normalized => "normalized",
        RunKind::Tunnel => "tunnel",
    };
    let mut record = crate::metrics::RunRecord::new(metrics, adapter_kind, &target, kind_label);
    let run = RunSpan(span);
    let (control_tx, mut control) = mpsc::unbounded_channel();
    let admitted = link
        .ask(|reply| LinkMsg::Start {
            run_id,
            kind,
            stall_timeout,
            deadline,
            adapter: adapter_kind,
            target: target.clone(),
            carries_lease: credential.lease.is_some(),
            adopted: false,
            control: control_tx,
            reply,
        })
        .await;
    match admitted {
        Some(Ok(())) => {}
        // Past the concurrent-run limit: no provider is called, so another
        // provider may take the request (R-FAIL-1).
        Some(Err(code)) => {
            record.finish(Some(code));
            run.end(&record);
            let mut failure = ExecutionFailure::new(code);
            failure.retryable = iop_core::retry::class_may_fail_over(code, None);
            return write_terminal(send, &sink, failure).await;
        }
        None => return,
    }

    // R-CRED-2: the lease is opened only now, after capacity admission and
    // right before the provider call; R-CRED-3: any refusal ends the run
    // with `credential_rejected`, no provider call, no fallback credential.
    let opened = link
        .ask(|reply| LinkMsg::OpenLease {
            run_id,
            adapter: adapter_kind,
            target,
            route: credential.route,
            lease: credential.lease,
            reply,
        })
        .await;
    let auth: Result<Option<String>, ()> = match opened {
        Some(Ok(None)) => Ok(None),
        // Only this one call sees it; `secret` is wiped when dropped here.
        Some(Ok(Some(secret))) => std::str::from_utf8(secret.expose_secret())
            .map(|text| Some(text.to_owned()))
            .map_err(|_| ()),
        Some(Err(_)) => Err(()),
        None => return,
    };
    let auth = match auth {
        Ok(auth) => auth,
        Err(()) => {
            record.finish(Some(FailureCode::CredentialRejected));
            let failure = ExecutionFailure::new(FailureCode::CredentialRejected);
            let event = ProviderEvent::Returned(iop_core::node::watchdog::ProviderOutcome::Failed(
                failure.clone(),
            ));
            if let Some(Emission::Forward) =
                offer::<S>(link, run_id, &sink.failure(failure.clone()), event).await
            {
                write_terminal(send, &sink, failure).await;
            }
            link.tell(LinkMsg::Finished { run_id }).await;
            run.end(&record);
            return;
        }
    };
    record.provider_call(&run.0);
    let mut provider = Some(start(&adapter, auth));
    loop {
        tokio::select! {
            biased;
            ctrl = control.recv() => match ctrl {
                Some(RunControl::CancelProvider) => {
                    // R-WD-2: the claim cancels the provider call. Dropping
                    // the stream drops the in-flight request, which closes
                    // the provider connection, so a hung call stops holding
                    // the provider's slot while the stall joins. The call
                    // has then ended, within the close grace (R-WD-4).
                    if provider.take().is_some() {
                        record.call_canceled();
                        link.tell(LinkMsg::ProviderReturned { run_id }).await;
                    }
                }
                Some(RunControl::Terminal(RunTerminal::Failed(failure))) => {
                    drop(provider.take());
                    record.finish(Some(failure.code));
                    write_terminal(send, &sink, failure).await;
                    break;
                }
                Some(RunControl::Terminal(RunTerminal::Completed)) | None => break,
                // Only a durable run is adopted.
                Some(RunControl::Attach(_)) => {}
            },
            // The Edge stopped reading or reset: the run is canceled.
            _ = recv_reset(&mut recv, metrics) => {
                drop(provider.take());
                link.tell(LinkMsg::Canceled { run_id }).await;
                let _ = send.reset(StreamErrorCode::Canceled);
                break;
            },
            item = next_item(&mut provider) => {
                let Some(item) = item else {
                    // The provider stream ended without a terminal (R-WD-6).
                    provider = None;
                    let failure = ProviderCallError::missing_terminal();
                    let Some(emission) = offer::<S>(link, run_id, &sink.failure(failure.clone()), ProviderEvent::Returned(
                        iop_core::node::watchdog::ProviderOutcome::Failed(failure.clone()),
                    )).await else { break };
                    if emission == Emission::Forward {
                        record.finish(Some(failure.code));
                        write_terminal(send, &sink, failure).await;
                        break;
                    }
                    continue;
                };
                // Every output the provider already produced goes to the
                // watchdog in one message, not one round trip each.
                let mut items = vec![item];
                if !S::is_terminal(&items[0]) {
                    while items.len() < MAX_READY_BATCH {
                        match provider.as_mut().and_then(|p| p.next().now_or_never()) {
                            Some(Some(item)) => {
                                let terminal = S::is_terminal(&item);
                                items.push(item);
                                if terminal {
                                    break;
                                }
                            }
                            // Ended: the next turn of the loop reports it.
                            Some(None) => {
                                provider = Some(Box::pin(futures::stream::empty()));
                                break;
                            }
                            None => break,
                        }
                    }
                }
                let events = items.iter().map(S::event).collect();
                // Output the watchdog fences (it raced the claim, R-WD-6) is
                // counted by the link and dropped here.
                let Some(emissions) = link.ask(|reply| LinkMsg::Events { run_id, events, reply }).await else {
                    break;
                };
                match forward_ready(send, &sink, &mut record, items, emissions).await {
                    Forwarded::More => {}
                    Forwarded::Terminal => break,
                    Forwarded::StreamGone => {
                        drop(provider.take());
                        link.tell(LinkMsg::Canceled { run_id }).await;
                        break;
                    }
                }
            }
        }
    }
    link.tell(LinkMsg::Finished { run_id }).await;
    run.end(&record);
}

/// The most outputs of one run offered to the watchdog in one message.
const MAX_READY_BATCH: usize = 64;

/// What writing a run's ready outputs came to.
enum Forwarded {
    /// Written; the run goes on.
    More,
    /// Its terminal was written.
    Terminal,
    /// The Edge's stream is gone: the caller cancels the provider call.
    StreamGone,
}

/// Write the outputs the watchdog let through, in order, in one stream
/// write (`send_all`) rather than one per output.
async fn forward_ready<S: Sink>(
    send: &mut FramedSend,
    sink: &S,
    record: &mut crate::metrics::RunRecord<'_>,
    items: Vec<S::Item>,
    emissions: Vec<Emission>,
) -> Forwarded {
    let mut frames = Vec::with_capacity(items.len());
    let mut terminal = false;
    for (mut item, emission) in items.into_iter().zip(emissions) {
        if emission == Emission::Fenced {
            continue;
        }
        terminal = S::is_terminal(&item);
        record.forwarded(S::content_bytes(&item), S::usage(&item));
        if terminal {
            record.finish(S::failure_code(&item));
        }
        // The provider's failure as core says the node forwards it: no
        // evidence it did not observe, retryable by class (R-WD-8,
        // R-FAIL-1).
        if let Some(failure) = S::failure_mut(&mut item) {
            *failure = iop_core::node::watchdog::sanitize_provider_failure(failure.clone());
        }
        frames.push(sink.frame(item));
        if terminal {
            break;
        }
    }
    if !frames.is_empty() && send.send_all(&frames).await.is_err() {
        return Forwarded::StreamGone;
    }
    if terminal {
        let _ = send.finish();
        return Forwarded::Terminal;
    }
    Forwarded::More
}

async fn offer<S: Sink>(
    link: &LinkTx,
    run_id: u64,
    _frame: &S::Frame,
    event: ProviderEvent,
) -> Option<Emission> {
    link.ask(|reply| LinkMsg::Event {
        run_id,
        event,
        reply,
    })
    .await
}

async fn next_item<T>(provider: &mut Option<BoxStream<'static, T>>) -> Option<T> {
    match provider {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

/// Resolves when the Edge resets our request stream or stops our response
/// stream: either means the run was canceled. A bad frame after the request
/// is counted (SPEC §5) and ends the run the same way.
async fn recv_reset(recv: &mut FramedRecv, metrics: &crate::metrics::NodeMetrics) {
    loop {
        match recv.recv::<DataRequest>().await {
            // Nothing more is expected after the request; a clean end of the
            // request half is normal, keep waiting for a reset.
            Ok(None) => return std::future::pending().await,
            Ok(Some(_)) => continue,
            Err(e) => {
                metrics.wire_error(&e);
                return;
            }
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
