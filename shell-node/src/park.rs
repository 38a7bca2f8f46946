//! Durable runs on the node: they outlive their Edge connection (SPEC §6,
//! R-PARK-1, R-PARK-2).
//!
//! A run whose request carries a [`ParkSpec`] is not bound to its link: it
//! runs in a task of its own, registered in the node's [`ParkingLot`](crate::parking::ParkingLot) under
//! its [`RunKey`]. While it is attached to a connection it works as any run
//! (the link's watchdog sees every output, R-WD-1) and also keeps each
//! frame until the Edge acknowledges it durable. When its connection is
//! lost it parks: the provider call goes on and its frames are kept, for
//! the park grace. The next registration reports it; an Edge that adopts
//! it ([`AdoptRequest`](iop_wire::AdoptRequest)) gets the frames after the last one its journal
//! holds, then the live rest. Every rule (numbering, the byte bound and
//! what a frame counts against it, the grace, which end of the Edge's side
//! parks or cancels, one connection at a time, the adoption's terms) is
//! `iop_core::node::park`'s; this task carries it out.

use std::sync::Arc;

use futures::StreamExt as _;
use futures::stream::BoxStream;
use iop_core::node::park::{
    EdgeSignal, EdgeVerdict, ParkOutput, ParkState, RunPark, adoption_stall_timeout,
    effective_park_grace, frame_bytes,
};
use iop_core::node::provider::ProviderCallError;
use iop_core::node::watchdog::{
    Emission, ProviderEvent, ProviderOutcome, RunKind, RunTerminal, effective_deadline,
    effective_stall_timeout,
};
use iop_transport::clock::Clock;
use iop_transport::framed::{FramedError, FramedRecv, FramedSend};
use iop_wire::{
    ExecutionFailure, FailureCode, ParkSpec, ParkedRun, RunEvent, RunEventKind, RunKey, RunRequest,
    RunStreamFrame, StreamErrorCode,
};
use tokio::sync::mpsc;

use crate::control::{Attach, LinkMsg, LinkTx, RunControl};
use crate::parking::ParkEntry;
use crate::state::LinkShared;

/// The stream of a durable run's current connection.
struct Attached {
    send: FramedSend,
    recv: FramedRecv,
    link: LinkTx,
    conn: quinn::Connection,
    run_id: u64,
}

/// What the Edge's side of the stream said.
enum EdgeSaid {
    Ack(u64),
    /// The side ended; the core decides whether that parks or cancels.
    Ended(EdgeSignal),
}

/// Read the Edge's side; a transport error is only classified here.
async fn read_edge(recv: &mut FramedRecv, metrics: &crate::metrics::NodeMetrics) -> EdgeSaid {
    match recv.recv::<RunStreamFrame>().await {
        Ok(Some(RunStreamFrame::Ack { through_frame })) => EdgeSaid::Ack(through_frame),
        Ok(None) => EdgeSaid::Ended(EdgeSignal::Finished),
        Err(FramedError::ResetByPeer { .. }) => EdgeSaid::Ended(EdgeSignal::Reset),
        Err(FramedError::StoppedByPeer { .. }) => EdgeSaid::Ended(EdgeSignal::Stopped),
        Err(FramedError::ConnectionLost { .. }) => EdgeSaid::Ended(EdgeSignal::ConnectionLost),
        Err(e) => {
            metrics.wire_error(&e);
            EdgeSaid::Ended(EdgeSignal::Broken)
        }
    }
}

/// Wait for the Edge's side, forever when there is no stream.
async fn next_said(
    attached: &mut Option<Attached>,
    metrics: &crate::metrics::NodeMetrics,
) -> EdgeSaid {
    match attached {
        Some(a) => read_edge(&mut a.recv, metrics).await,
        None => std::future::pending().await,
    }
}

async fn next_item(
    provider: &mut Option<BoxStream<'static, RunEventKind>>,
) -> Option<RunEventKind> {
    match provider {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

/// Run one durable run to its end: started on `send`/`recv` by `link`,
/// then wherever it is adopted. Runs in a task of its own (not the link's),
/// so losing the connection does not cancel it.
#[allow(clippy::too_many_arguments)]
pub async fn run_durable(
    send: FramedSend,
    recv: FramedRecv,
    link: LinkTx,
    conn: quinn::Connection,
    shared: Arc<LinkShared>,
    mut req: RunRequest,
    park_spec: ParkSpec,
    generation: u64,
) {
    let clock = Clock::new();
    let key = RunKey {
        generation,
        run_id: req.run_id,
    };
    let mut attached = Some(Attached {
        send,
        recv,
        link: link.clone(),
        conn,
        run_id: req.run_id,
    });
    let span = shared.metrics.run_span("normalized", req.trace_context);
    let fail_start = |attached: &mut Option<Attached>, failure: ExecutionFailure| {
        let a = attached.take();
        async move {
            if let Some(mut a) = a {
                let event = RunEvent {
                    run_id: a.run_id,
                    kind: RunEventKind::Failed(failure),
                };
                let _ = a.send.send(&event).await;
                let _ = a.send.finish();
            }
        }
    };
    // Validated before any adapter is called (R-WD, SPEC §3).
    let stall_timeout = match effective_stall_timeout(req.response_stall_timeout_ms) {
        Ok(d) => d,
        Err(e) => return fail_start(&mut attached, e.failure()).await,
    };
    let Some(adapter) = shared.adapter(req.adapter, &req.target).cloned() else {
        span.fail(FailureCode::UnknownTarget.as_str());
        return fail_start(
            &mut attached,
            ExecutionFailure::new(FailureCode::UnknownTarget),
        )
        .await;
    };
    let (adapter_kind, target) = (adapter.kind(), adapter.target().to_owned());
    span.set("iop.adapter", adapter_kind.as_str());
    span.set_configured("iop.target", &target);
    let mut record =
        crate::metrics::RunRecord::new(&shared.metrics, adapter_kind, &target, "normalized");
    let run_span = crate::metrics::RunSpan(span);
    let (control_tx, mut control) = mpsc::unbounded_channel();
    let deadline = effective_deadline(req.deadline_ms);
    let admitted = link
        .ask(|reply| LinkMsg::Start {
            run_id: req.run_id,
            kind: RunKind::Normalized,
            stall_timeout,
            deadline,
            adapter: adapter_kind,
            target: target.clone(),
            carries_lease: req.credential_lease.is_some(),
            adopted: false,
            control: control_tx.clone(),
            reply,
        })
        .await;
    match admitted {
        Some(Ok(())) => {}
        Some(Err(code)) => {
            record.finish(Some(code));
            run_span.end(&record);
            let mut failure = ExecutionFailure::new(code);
            failure.retryable = iop_core::retry::class_may_fail_over(code, None);
            return fail_start(&mut attached, failure).await;
        }
        None => return,
    }
    // R-CRED-2: the lease is opened after admission, right before the call.
    let opened = link
        .ask(|reply| LinkMsg::OpenLease {
            run_id: req.run_id,
            adapter: adapter_kind,
            target: target.clone(),
            route: Some(req.model.clone()),
            lease: req.credential_lease.take(),
            reply,
        })
        .await;
    let auth = match opened {
        Some(Ok(None)) => None,
        Some(Ok(Some(secret))) => match std::str::from_utf8(secret.expose_secret()) {
            Ok(text) => Some(text.to_owned()),
            Err(_) => {
                return refuse_credential(&mut attached, &link, req.run_id, &mut record, &run_span)
                    .await;
            }
        },
        Some(Err(_)) => {
            return refuse_credential(&mut attached, &link, req.run_id, &mut record, &run_span)
                .await;
        }
        None => return,
    };

    let grace = effective_park_grace(park_spec.grace_ms);
    let mut park: RunPark<RunEventKind> = RunPark::new(grace, shared.park_buffer_bytes);
    let lot_key = (key, park_spec.response_id.clone());
    shared.parking.insert(
        lot_key.clone(),
        ParkEntry {
            control: control_tx.clone(),
            report: ParkedRun {
                key,
                response_id: park_spec.response_id.clone(),
                adapter: adapter_kind,
                target: target.clone(),
                first_kept_frame: 1,
                last_frame: 0,
                ended: false,
            },
            state: ParkState::Attached,
        },
    );
    record.provider_call(&run_span.0);
    let mut provider = Some(adapter.run(req, auth));
    let metrics = &shared.metrics;

    loop {
        let parked_until = park.poll_timeout();
        tokio::select! {
            biased;
            ctrl = control.recv() => match ctrl {
                Some(RunControl::CancelProvider) => {
                    // R-WD-2: the watchdog's stall claim stops the call.
                    if provider.take().is_some() {
                        record.call_canceled();
                        if let Some(a) = &attached {
                            a.link.tell(LinkMsg::ProviderReturned { run_id: a.run_id }).await;
                        }
                    }
                }
                Some(RunControl::Terminal(RunTerminal::Failed(failure))) => {
                    // The watchdog's terminal is the run's last frame.
                    drop(provider.take());
                    record.finish(Some(failure.code));
                    let kind = RunEventKind::Failed(failure);
                    let bytes = frame_bytes(&kind);
                    park.produced(kind.clone(), bytes, true);
                    send_frame(&mut attached, kind, &mut park, &clock).await;
                }
                Some(RunControl::Terminal(RunTerminal::Completed)) => {}
                Some(RunControl::Attach(attach)) => {
                    adopt(&mut attached, *attach, &mut park, &clock, &control_tx, adapter_kind, &target).await;
                }
                None => break,
            },
            said = next_said(&mut attached, metrics) => match said {
                EdgeSaid::Ack(through) => park.acked(through),
                EdgeSaid::Ended(signal) => match signal.verdict() {
                    EdgeVerdict::Cancel => {
                        // The Edge canceled the response: the run ends here.
                        if let Some(a) = attached.take() {
                            a.link.tell(LinkMsg::Canceled { run_id: a.run_id }).await;
                        }
                        drop(provider.take());
                        park.cancelled();
                        break;
                    }
                    // R-DISC-1: kept for another connection (R-PARK-1).
                    EdgeVerdict::Park => detach(&mut attached, &mut park, &clock).await,
                },
            },
            item = next_item(&mut provider), if park.wants_provider() => {
                let Some(kind) = item else {
                    // The provider stream ended without a terminal (R-WD-6).
                    provider = None;
                    let failure = ProviderCallError::missing_terminal();
                    record.finish(Some(failure.code));
                    let kind = RunEventKind::Failed(failure);
                    let bytes = frame_bytes(&kind);
                    park.produced(kind.clone(), bytes, true);
                    send_frame(&mut attached, kind, &mut park, &clock).await;
                    continue;
                };
                let terminal = kind.is_terminal();
                // Attached, the link's watchdog sees every output and may
                // fence it (R-WD-6); parked, no watchdog runs (the grace
                // bounds the run instead).
                if let Some(a) = &attached {
                    let event = ProviderEvent::from_run_event(&kind);
                    let run_id = a.run_id;
                    match a.link.ask(|reply| LinkMsg::Event { run_id, event, reply }).await {
                        Some(Emission::Fenced) => continue,
                        Some(Emission::Forward) => {}
                        // The link is gone: the connection is lost.
                        None => detach(&mut attached, &mut park, &clock).await,
                    }
                }
                let mut kind = kind;
                if let RunEventKind::Failed(failure) = &mut kind {
                    *failure = iop_core::node::watchdog::sanitize_provider_failure(failure.clone());
                }
                record.forwarded(content_bytes(&kind), usage(&kind));
                if terminal {
                    record.finish(match &kind {
                        RunEventKind::Failed(f) => Some(f.code),
                        _ => None,
                    });
                    provider = None;
                }
                let bytes = frame_bytes(&kind);
                park.produced(kind.clone(), bytes, terminal);
                send_frame(&mut attached, kind, &mut park, &clock).await;
            },
            () = clock.sleep_until(parked_until), if parked_until.is_some() => {
                park.handle_timeout(clock.now());
            },
        }
        shared.parking.update(&lot_key, &park);
        let mut over = false;
        while let Some(out) = park.poll_output() {
            match out {
                ParkOutput::Expired => {
                    // R-PARK-1: no Edge took it within the grace.
                    tracing::warn!(event = "node_parked_run_expired", run_id = key.run_id);
                    drop(provider.take());
                    shared
                        .disconnect_cancels
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    over = true;
                }
                ParkOutput::Done => over = true,
            }
        }
        if over || park.state() == ParkState::Over {
            break;
        }
    }
    if let Some(mut a) = attached.take() {
        let _ = a.send.finish();
        a.link.tell(LinkMsg::Finished { run_id: a.run_id }).await;
    }
    shared.parking.remove(&lot_key);
    run_span.end(&record);
}

async fn refuse_credential(
    attached: &mut Option<Attached>,
    link: &LinkTx,
    run_id: u64,
    record: &mut crate::metrics::RunRecord<'_>,
    run_span: &crate::metrics::RunSpan,
) {
    record.finish(Some(FailureCode::CredentialRejected));
    let failure = ExecutionFailure::new(FailureCode::CredentialRejected);
    let event = ProviderEvent::Returned(ProviderOutcome::Failed(failure.clone()));
    if let Some(Emission::Forward) = link
        .ask(|reply| LinkMsg::Event {
            run_id,
            event,
            reply,
        })
        .await
        && let Some(mut a) = attached.take()
    {
        let frame = RunEvent {
            run_id,
            kind: RunEventKind::Failed(failure),
        };
        let _ = a.send.send(&frame).await;
        let _ = a.send.finish();
    }
    link.tell(LinkMsg::Finished { run_id }).await;
    run_span.end(record);
}

/// Send a frame just produced to the attached stream; a send that fails
/// detaches the run (it is kept, R-PARK-1).
async fn send_frame(
    attached: &mut Option<Attached>,
    kind: RunEventKind,
    park: &mut RunPark<RunEventKind>,
    clock: &Clock,
) {
    let Some(a) = attached.as_mut() else {
        return;
    };
    let frame = RunEvent {
        run_id: a.run_id,
        kind,
    };
    if a.send.send(&frame).await.is_err() {
        detach(attached, park, clock).await;
    }
}

/// The connection is lost: park the run (R-PARK-1).
async fn detach(attached: &mut Option<Attached>, park: &mut RunPark<RunEventKind>, clock: &Clock) {
    if let Some(a) = attached.take() {
        a.link.tell(LinkMsg::Finished { run_id: a.run_id }).await;
    }
    park.detached(clock.now());
}

/// Take an adoption (R-PARK-2): refused unless its stall timeout is one a
/// fresh run may have and the run is parked and holds the frames after the
/// Edge's resume point; accepted, the run joins the new connection's
/// watchdog and replays those frames.
async fn adopt(
    attached: &mut Option<Attached>,
    attach: Attach,
    park: &mut RunPark<RunEventKind>,
    clock: &Clock,
    control: &mpsc::UnboundedSender<RunControl>,
    adapter: iop_wire::AdapterKind,
    target: &str,
) {
    // A connection that is going away no longer holds the run.
    if attached
        .as_ref()
        .is_some_and(|a| a.conn.close_reason().is_some())
    {
        detach(attached, park, clock).await;
    }
    let Attach {
        mut send,
        recv,
        link,
        conn,
        request,
    } = attach;
    let accepted = adoption_stall_timeout(request.response_stall_timeout_ms)
        .and_then(|stall| Ok((stall, park.adopt(clock.now(), request.resume_after_frame)?)));
    let (stall, replay) = match accepted {
        Ok(accepted) => accepted,
        Err(why) => {
            tracing::warn!(event = "node_adoption_refused", reason = %why);
            let _ = send.reset(StreamErrorCode::Canceled);
            return;
        }
    };
    let deadline = effective_deadline(request.deadline_ms);
    let admitted = link
        .ask(|reply| LinkMsg::Start {
            run_id: request.run_id,
            kind: RunKind::Normalized,
            stall_timeout: stall,
            deadline,
            adapter,
            target: target.to_owned(),
            carries_lease: false,
            adopted: true,
            control: control.clone(),
            reply,
        })
        .await;
    if !matches!(admitted, Some(Ok(()))) {
        // The new connection would not take it: parked again, within the
        // grace it had (R-PARK-1).
        let _ = send.reset(StreamErrorCode::Canceled);
        park.adoption_aborted(clock.now());
        return;
    }
    tracing::info!(
        event = "node_parked_run_adopted",
        run_id = request.run_id,
        resume_after = request.resume_after_frame,
        replayed = replay.len()
    );
    let run_id = request.run_id;
    *attached = Some(Attached {
        send,
        recv,
        link,
        conn,
        run_id,
    });
    for (_, kind) in replay {
        let Some(a) = attached.as_mut() else {
            return;
        };
        // The old connection's health evidence does not travel (core).
        let kind = iop_core::node::park::replayed(kind);
        if a.send.send(&RunEvent { run_id, kind }).await.is_err() {
            detach(attached, park, clock).await;
            return;
        }
    }
}

fn content_bytes(kind: &RunEventKind) -> u64 {
    match kind {
        RunEventKind::TextDelta(t) => t.len() as u64,
        RunEventKind::ToolCallDelta(d) => d.arguments_delta.len().max(1) as u64,
        _ => 0,
    }
}

fn usage(kind: &RunEventKind) -> Option<iop_wire::Usage> {
    match kind {
        RunEventKind::Usage(u) => Some(*u),
        RunEventKind::Completed { usage, .. } => *usage,
        _ => None,
    }
}
