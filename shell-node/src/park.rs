//! Durable runs on the node: they outlive their Edge connection (SPEC §6,
//! R-PARK-1, R-PARK-2).
//!
//! A run whose request carries a [`ParkSpec`] is not bound to its link: it
//! runs in a task of its own, registered in the node's [`ParkingLot`] under
//! its [`RunKey`]. While it is attached to a connection it works as any run
//! (the link's watchdog sees every output, R-WD-1) and also keeps each
//! frame until the Edge acknowledges it durable. When its connection is
//! lost it parks: the provider call goes on and its frames are kept, for
//! the park grace. The next registration reports it; an Edge that adopts
//! it ([`AdoptRequest`]) gets the frames after the last one its journal
//! holds, then the live rest. Every rule (numbering, the byte bound, the
//! grace, one connection at a time) is `iop_core::node::park`'s; this task
//! carries it out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use futures::stream::BoxStream;
use iop_core::node::capacity::ParkedRuns;
use iop_core::node::park::{ParkOutput, ParkState, RunPark, effective_park_grace};
use iop_core::node::watchdog::{
    Emission, ProviderEvent, ProviderOutcome, RunKind, RunTerminal, effective_stall_timeout,
};
use iop_transport::clock::Clock;
use iop_transport::framed::{FramedError, FramedRecv, FramedSend};
use iop_wire::{
    AdoptRequest, ExecutionFailure, FailureCode, ParkSpec, ParkedRun, RunEvent, RunEventKind,
    RunKey, RunRequest, RunStreamFrame, StreamErrorCode,
};
use tokio::sync::mpsc;

use crate::link::{LinkMsg, LinkShared, LinkTx, RunControl};

/// What the node holds of one durable run for other tasks: how to reach
/// it, and what a registration reports of it.
struct ParkEntry {
    control: mpsc::UnboundedSender<RunControl>,
    report: ParkedRun,
    state: ParkState,
}

/// A durable run in the [`ParkingLot`]: its [`RunKey`] and its response.
/// The key alone is not enough on a node connected to several Edges: two
/// Edges started in the same millisecond hand out the same generations
/// (R-MULTI-1), so their run keys can coincide; a response id cannot.
type LotKey = (RunKey, String);

/// The node's durable runs, by [`RunKey`] and response.
pub struct ParkingLot {
    runs: Mutex<HashMap<LotKey, ParkEntry>>,
    /// Bumped each time a run parks: every live connection then reports
    /// the parked runs to its Edge (R-PARK-2, R-MULTI-1).
    parked_changed: tokio::sync::watch::Sender<u64>,
}

impl Default for ParkingLot {
    fn default() -> Self {
        Self {
            runs: Mutex::default(),
            parked_changed: tokio::sync::watch::channel(0).0,
        }
    }
}

impl ParkingLot {
    fn runs(&self) -> std::sync::MutexGuard<'_, HashMap<LotKey, ParkEntry>> {
        // Entries are inserted, updated and removed whole.
        self.runs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The durable runs a registration reports (R-PARK-2): every one that
    /// is not over. A run still attached to a connection that is going
    /// away is reported too; an adoption detaches it first.
    pub fn reports(&self) -> Vec<ParkedRun> {
        let mut reports: Vec<ParkedRun> = self
            .runs()
            .values()
            .filter(|e| e.state != ParkState::Over)
            .map(|e| e.report.clone())
            .collect();
        reports.sort_by_key(|r| r.key);
        reports.truncate(iop_wire::MAX_PARKED_RUNS);
        reports
    }

    /// The runs parked now (without a connection), as a live connection
    /// reports them (R-PARK-2, R-MULTI-1).
    pub fn parked_reports(&self) -> Vec<ParkedRun> {
        let mut reports: Vec<ParkedRun> = self
            .runs()
            .values()
            .filter(|e| matches!(e.state, ParkState::Parked { .. }))
            .map(|e| e.report.clone())
            .collect();
        reports.sort_by_key(|r| r.key);
        reports.truncate(iop_wire::MAX_PARKED_RUNS);
        reports
    }

    /// Told each time a run parks.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.parked_changed.subscribe()
    }

    /// Durable runs without a connection now, in all and on
    /// `adapter`/`target`: they still hold provider capacity (the node's
    /// run limit counts them).
    pub fn parked_runs(&self, adapter: iop_wire::AdapterKind, target: &str) -> ParkedRuns {
        let runs = self.runs();
        let parked = runs
            .values()
            .filter(|e| matches!(e.state, ParkState::Parked { .. }));
        let mut counts = ParkedRuns::default();
        for e in parked {
            counts.total += 1;
            if e.report.adapter == adapter && e.report.target == target {
                counts.on_target += 1;
            }
        }
        counts
    }

    /// Hand an adoption to the run it names; false if there is none.
    pub fn adopt(&self, key: RunKey, response_id: &str, attach: Attach) -> bool {
        match self.runs().get(&(key, response_id.to_owned())) {
            Some(entry) => entry
                .control
                .send(RunControl::Attach(Box::new(attach)))
                .is_ok(),
            None => false,
        }
    }

    fn insert(&self, key: LotKey, entry: ParkEntry) {
        self.runs().insert(key, entry);
    }

    fn update(&self, key: &LotKey, park: &RunPark<RunEventKind>) {
        let mut runs = self.runs();
        if let Some(entry) = runs.get_mut(key) {
            let summary = park.summary();
            let was_parked = matches!(entry.state, ParkState::Parked { .. });
            entry.state = park.state();
            if !was_parked && matches!(entry.state, ParkState::Parked { .. }) {
                self.parked_changed.send_modify(|n| *n = n.wrapping_add(1));
            }
            entry.report.first_kept_frame = summary.first_kept;
            entry.report.last_frame = summary.last;
            entry.report.ended = summary.ended;
        }
    }

    fn remove(&self, key: &LotKey) {
        self.runs().remove(key);
    }
}

/// A connection taking a parked run over.
pub struct Attach {
    /// The stream the run's frames go to from now on.
    pub send: FramedSend,
    /// Its other half (acknowledgements, a reset).
    pub recv: FramedRecv,
    /// The connection's link.
    pub link: LinkTx,
    /// The connection (to tell whether it is still up).
    pub conn: quinn::Connection,
    /// What the Edge asked.
    pub request: AdoptRequest,
}

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
    /// The Edge reset or stopped the stream: the run is canceled.
    Canceled,
    /// The connection is gone (or the stream ended without a cancel).
    Lost,
}

async fn read_edge(recv: &mut FramedRecv, metrics: &crate::metrics::NodeMetrics) -> EdgeSaid {
    match recv.recv::<RunStreamFrame>().await {
        Ok(Some(RunStreamFrame::Ack { through_frame })) => EdgeSaid::Ack(through_frame),
        // The Edge's side ended without canceling: its request is over
        // there (or the Edge is going away): keep the run for another.
        Ok(None) => EdgeSaid::Lost,
        Err(FramedError::ResetByPeer { .. } | FramedError::StoppedByPeer { .. }) => {
            EdgeSaid::Canceled
        }
        Err(FramedError::ConnectionLost { .. }) => EdgeSaid::Lost,
        Err(e) => {
            metrics.wire_error(&e);
            EdgeSaid::Canceled
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

/// Bytes a frame is counted as against the park bound.
fn frame_bytes(kind: &RunEventKind) -> usize {
    let payload = match kind {
        RunEventKind::TextDelta(t) | RunEventKind::ReasoningDelta(t) => t.len(),
        RunEventKind::ToolCallDelta(d) => {
            d.arguments_delta.len()
                + d.id.as_ref().map_or(0, String::len)
                + d.name.as_ref().map_or(0, String::len)
        }
        RunEventKind::Embedding(e) => e.values.len() * 4,
        _ => 0,
    };
    payload + 64
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
    let span = crate::run::run_span(&shared, "normalized", req.trace_context);
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
    let run_span = crate::run::RunSpan(span);
    let (control_tx, mut control) = mpsc::unbounded_channel();
    let deadline = (req.deadline_ms > 0).then(|| Duration::from_millis(req.deadline_ms));
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
                    adopt(&mut attached, *attach, &mut park, &clock, &control_tx, stall_timeout, adapter_kind, &target).await;
                }
                None => break,
            },
            said = next_said(&mut attached, metrics) => match said {
                EdgeSaid::Ack(through) => park.acked(through),
                EdgeSaid::Canceled => {
                    // The Edge canceled the response: the run ends here.
                    if let Some(a) = attached.take() {
                        a.link.tell(LinkMsg::Canceled { run_id: a.run_id }).await;
                    }
                    drop(provider.take());
                    park.cancelled();
                    break;
                }
                EdgeSaid::Lost => detach(&mut attached, &mut park, &clock).await,
            },
            item = next_item(&mut provider), if park.wants_provider() => {
                let Some(kind) = item else {
                    // The provider stream ended without a terminal.
                    provider = None;
                    let failure = ExecutionFailure::new(FailureCode::MalformedResponse);
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
    run_span: &crate::run::RunSpan,
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

/// Take an adoption (R-PARK-2): refused unless the run is parked and holds
/// the frames after the Edge's resume point; accepted, the run joins the
/// new connection's watchdog and replays those frames.
#[allow(clippy::too_many_arguments)]
async fn adopt(
    attached: &mut Option<Attached>,
    attach: Attach,
    park: &mut RunPark<RunEventKind>,
    clock: &Clock,
    control: &mpsc::UnboundedSender<RunControl>,
    stall_timeout: Duration,
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
    let replay = match park.adopt(request.resume_after_frame) {
        Ok(replay) => replay,
        Err(why) => {
            tracing::warn!(event = "node_adoption_refused", reason = %why);
            let _ = send.reset(StreamErrorCode::Canceled);
            return;
        }
    };
    let stall = effective_stall_timeout(request.response_stall_timeout_ms).unwrap_or(stall_timeout);
    let deadline = (request.deadline_ms > 0).then(|| Duration::from_millis(request.deadline_ms));
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
        // The new connection would not take it: stay parked.
        let _ = send.reset(StreamErrorCode::Canceled);
        park.detached(clock.now());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: RunKey, response_id: &str, state: ParkState) -> ParkEntry {
        ParkEntry {
            control: mpsc::unbounded_channel().0,
            report: ParkedRun {
                key,
                response_id: response_id.to_owned(),
                adapter: iop_wire::AdapterKind::Mock,
                target: "m".into(),
                first_kept_frame: 1,
                last_frame: 0,
                ended: false,
            },
            state,
        }
    }

    /// R-MULTI-1, R-PARK-2: two Edges started in the same millisecond hand
    /// a node the same generation, so runs they started can share a run
    /// key; the lot keeps both apart by their responses, reports both, and
    /// counts both as holding their provider.
    #[test]
    fn runs_of_two_edges_with_one_key_are_kept_apart_by_their_responses() {
        let lot = ParkingLot::default();
        let key = RunKey {
            generation: 1_796_180_068_867,
            run_id: 1,
        };
        let parked = ParkState::Parked {
            until: iop_core::time::Instant::from_millis(1_000),
        };
        lot.insert((key, "resp_a".into()), entry(key, "resp_a", parked));
        lot.insert((key, "resp_b".into()), entry(key, "resp_b", parked));
        let reports = lot.parked_reports();
        let ids: Vec<&str> = reports.iter().map(|r| r.response_id.as_str()).collect();
        assert_eq!(ids.len(), 2, "{ids:?}");
        assert!(ids.contains(&"resp_a") && ids.contains(&"resp_b"));
        assert_eq!(
            lot.parked_runs(iop_wire::AdapterKind::Mock, "m"),
            ParkedRuns {
                total: 2,
                on_target: 2
            }
        );
        lot.remove(&(key, "resp_a".into()));
        let left: Vec<String> = lot
            .parked_reports()
            .into_iter()
            .map(|r| r.response_id)
            .collect();
        assert_eq!(left, ["resp_b"]);
    }
}
