//! One task per connection to the Edge. The connection's rules are the core
//! [`NodeLink`](iop_core::node::link::NodeLink)'s (handshake, heartbeat, stall watchdog with its
//! observation sequence, each run's one terminal, lease opening). The
//! machine sits in the connection's [`LinkHandle`], which the run handlers
//! call directly under its lock (their start, lease, offers); this task
//! runs one `select!` over control frames, the machine's next timeout,
//! incoming data streams and the handlers' wake-ups, feeds each as an input
//! and carries out what needs it: control frames to write, probes to
//! start, the connection's end.
//!
//! When the connection ends, every run and tunnel handler bound to it is
//! canceled (R-DISC-1): they live in this task's `JoinSet`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use iop_core::ids::RunId;
use iop_core::node::link::{NodeLinkConfig, NodeLinkInput};
use iop_core::node::park::ReportScope;
use iop_core::node::probe::ProbeEvidence;
use iop_core::node::watchdog::ProbeOutcome;
use iop_trace::{DrivenNodeLink, NodeLinkConfigRec};
use iop_transport::clock::Clock;
use iop_transport::close_connection;
use iop_transport::framed::{FramedError, FramedSend, framed_for_side, open_framed};
use iop_wire::{
    CloseCode, EdgeControl, NodeControl, OfferedProvider, PROTOCOL_VERSION, RegisterRequest,
    RejectReason,
};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::NodeConfig;
use crate::control::{ForLink, LinkHandle, ProbeAsk};
use crate::run;
use crate::state::{LinkShared, NodeIdentity};

/// How a link ended.
#[derive(Debug)]
pub enum LinkEnd {
    /// The process is shutting down.
    Shutdown,
    /// The connection closed.
    Closed {
        /// Whether it had completed readiness (resets the backoff).
        was_ready: bool,
        /// Why.
        code: CloseCode,
    },
    /// The Edge refused the registration.
    Rejected {
        /// Closed reason.
        reason: RejectReason,
        /// Detail.
        message: String,
    },
    /// The handshake failed.
    Failed(FramedError),
    /// Registration and readiness did not complete in time.
    HandshakeTimeout,
}

/// Run one connection to the Edge of slot `edge` until it ends.
pub async fn run(
    conn: quinn::Connection,
    config: Arc<NodeConfig>,
    shared: Arc<LinkShared>,
    edge: usize,
    mut shutdown: watch::Receiver<bool>,
) -> LinkEnd {
    let slot = &shared.edges[edge];
    let clock = Clock::new();
    let (mut send, mut recv) = match open_framed(&conn).await {
        Ok(pair) => pair,
        Err(e) => return LinkEnd::Failed(e),
    };
    let now = clock.now();
    let link_config = NodeLinkConfig {
        heartbeat: config.heartbeat,
        watchdog: config.watchdog,
        handshake_timeout: Some(config.connect_timeout),
    };
    let register = register_request(&config, &shared);
    // With --record-trace the machine's inputs and outputs are recorded.
    let tap = shared.link_tap(|| NodeLinkConfigRec {
        config: link_config,
        created_us: now.as_micros(),
        register: register.clone(),
    });
    let machine = DrivenNodeLink::new_link(now, link_config, register, slot.take_replay(), tap);
    let handle = LinkHandle::new(
        machine,
        shared.clone(),
        edge,
        clock,
        config.node.max_concurrent_runs,
    );
    let mut link = Link {
        handle: handle.clone(),
        close_code: None,
        shared: shared.clone(),
        probes: JoinSet::new(),
    };
    let mut handlers = JoinSet::new();
    let mut paused = shared.pause_control.subscribe();
    // Runs that park from now on (their own connection, to another Edge,
    // lost) are reported here: this Edge may adopt them (R-PARK-2,
    // R-MULTI-1). Those parked before were in the registration.
    let mut parked = shared.parking.subscribe();
    parked.borrow_and_update();
    // A report waits a moment, gathering the runs that park meanwhile, so
    // the node's pace stays within the Edge's budget (R-LIM-4).
    let mut report_due: Option<tokio::time::Instant> = None;

    let end = loop {
        // What the machine left for this task (the registration first,
        // then whatever the last input or a run handler's call caused),
        // and the moment its timer is due.
        let (work, wake) = handle.for_link();
        if let Some(end) = link.carry_out(&mut send, work).await {
            break end;
        }
        let is_paused = *paused.borrow();
        let ready = handle.lock().was_ready;
        tokio::select! {
            frame = recv.recv::<EdgeControl>(), if !is_paused => match frame {
                Ok(Some(msg)) => link.input(NodeLinkInput::Control(msg)),
                Ok(None) if !ready => {
                    close_connection(&conn, CloseCode::ProtocolError);
                    break LinkEnd::Failed(FramedError::LocalMisuse {
                        what: "control stream ended before readiness",
                    });
                }
                Ok(None) => break link.closed(CloseCode::Normal),
                Err(FramedError::ConnectionLost { close_code, .. }) if ready => {
                    break link.closed(close_code.unwrap_or(CloseCode::Normal));
                }
                Err(e) => {
                    shared.metrics.wire_error(&e);
                    if !ready {
                        close_connection(&conn, CloseCode::ProtocolError);
                        break LinkEnd::Failed(e);
                    }
                    tracing::warn!(event = "node_control_stream_error", error = %e);
                    break link.closed(CloseCode::ProtocolError);
                }
            },
            () = clock.sleep_until(wake), if !is_paused => link.timeout(),
            // A run handler left work here, or moved the timer earlier.
            () = handle.woken() => {},
            _ = paused.changed() => {},
            stream = conn.accept_bi(), if ready => match stream {
                Ok((s, r)) => {
                    let (s, r) = framed_for_side(conn.side(), s, r);
                    let generation = handle.lock().machine.machine().generation().unwrap_or(0);
                    handlers.spawn(run::serve_stream(
                        s,
                        r,
                        handle.clone(),
                        shared.clone(),
                        conn.clone(),
                        generation,
                    ));
                }
                Err(e) => {
                    break link.closed(
                        iop_transport::close_code_of(&e).unwrap_or(CloseCode::Normal),
                    );
                }
            },
            Ok(()) = parked.changed(), if ready && report_due.is_none() => {
                report_due = Some(
                    tokio::time::Instant::now() + iop_core::edge::flood::PARKED_REPORT_DELAY,
                );
            },
            () = tokio::time::sleep_until(report_due.unwrap_or_else(tokio::time::Instant::now)), if report_due.is_some() => {
                report_due = None;
                let runs = shared.parking.reports(ReportScope::Live);
                if !runs.is_empty() && send.send(&NodeControl::Parked { runs }).await.is_err() {
                    break link.closed(CloseCode::Normal);
                }
            },
            Some(done) = link.probes.join_next(), if !link.probes.is_empty() => {
                if let Ok((run_id, outcome)) = done {
                    link.input(NodeLinkInput::ProbeDone { run_id, outcome });
                }
            },
            Some(_) = handlers.join_next(), if !handlers.is_empty() => {},
            _ = shutdown.changed() => {
                let _ = send.send(&NodeControl::Closing { code: CloseCode::Shutdown }).await;
                close_connection(&conn, CloseCode::Shutdown);
                break LinkEnd::Shutdown;
            },
        }
    };

    // R-DISC-1: every handler bound to this connection is canceled.
    let canceled = handlers.len() as u64;
    shared
        .disconnect_cancels
        .fetch_add(canceled, Ordering::Relaxed);
    handlers.abort_all();
    link.probes.abort_all();
    let replay = handle.close();
    slot.ready.store(false, Ordering::Relaxed);
    slot.generation.store(0, Ordering::Relaxed);
    match &end {
        LinkEnd::Closed { code, .. } => close_connection(&conn, *code),
        // The machine's end says how (`LinkEnd::close_code`).
        LinkEnd::Rejected { .. } | LinkEnd::HandshakeTimeout => {
            if let Some(code) = link.close_code {
                close_connection(&conn, code);
            }
        }
        LinkEnd::Shutdown | LinkEnd::Failed(_) => {}
    }
    // Hand the replay cache to this Edge's next connection.
    slot.return_replay(replay);
    end
}

/// What this node offers the Edge: its providers, its limit, its recipient
/// key and its parked durable runs (R-PARK-2).
fn register_request(config: &NodeConfig, shared: &LinkShared) -> RegisterRequest {
    RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        node_version: env!("CARGO_PKG_VERSION").to_owned(),
        providers: shared
            .adapters
            .iter()
            .map(|a| OfferedProvider {
                adapter: a.kind(),
                target: a.target().to_owned(),
                models: a.models().to_vec(),
                max_concurrent_runs: config
                    .providers
                    .iter()
                    .find(|p| p.adapter == a.kind() && p.target == a.target())
                    .and_then(|p| p.max_concurrent_runs),
            })
            .collect(),
        max_concurrent_runs: config.node.max_concurrent_runs,
        recipient_public_key: shared.identity.as_ref().map(NodeIdentity::public_key),
        parked: shared.parking.reports(ReportScope::Registration),
    }
}

struct Link {
    handle: LinkHandle,
    /// The close code of the machine's end (`LinkEnd::close_code`).
    close_code: Option<CloseCode>,
    shared: Arc<LinkShared>,
    probes: JoinSet<(RunId, ProbeOutcome)>,
}

impl Link {
    /// Feed an input; what it leaves for this task is carried out at the
    /// top of the loop.
    fn input(&mut self, input: NodeLinkInput) {
        self.handle.input(input);
    }

    fn timeout(&mut self) {
        self.handle.handle_timeout();
    }

    fn closed(&self, code: CloseCode) -> LinkEnd {
        LinkEnd::Closed {
            was_ready: self.handle.lock().was_ready,
            code,
        }
    }

    /// Carry out what the machine left for this task: write its frames,
    /// start its probes; `Some` ends the connection.
    async fn carry_out(&mut self, send: &mut FramedSend, work: ForLink) -> Option<LinkEnd> {
        let mut end = None;
        for frame in work.frames {
            if send.send(&frame).await.is_err() && end.is_none() {
                end = Some(self.closed(CloseCode::Normal));
            }
        }
        for probe in work.probes {
            self.start_probe(probe);
        }
        if let Some(link_end) = work.end {
            use iop_core::node::link::LinkEnd as Core;
            self.close_code = Some(link_end.close_code());
            end = Some(match link_end {
                Core::Closed(code) => self.closed(code),
                Core::Rejected { reason, message } => LinkEnd::Rejected { reason, message },
                Core::HandshakeTimedOut => LinkEnd::HandshakeTimeout,
            });
        }
        end
    }

    /// The exact-target probe of a stalled run, bounded like the watchdog's
    /// own probe bound; either way a timeout is no verdict (R-WD-5).
    fn start_probe(&mut self, probe: ProbeAsk) {
        let ProbeAsk {
            run_id,
            adapter,
            target,
        } = probe;
        let adapter = self.shared.adapter(adapter, &target).cloned();
        let bound = self.shared.probe_bound;
        let shared = self.shared.clone();
        self.probes.spawn(async move {
            let outcome = match adapter {
                Some(a) => {
                    // The same `node.probe` span as a CAPABILITIES probe,
                    // marked as a stall's.
                    let span = shared.metrics.tracer().start(
                        "node.probe",
                        iop_transport::traces::Kind::Internal,
                        None,
                    );
                    span.set("iop.adapter", a.kind().as_str());
                    span.set_configured("iop.target", a.target());
                    span.set("iop.reason", "stall");
                    let verdict = a.probe(bound).await;
                    let verdict = shared.probe_verdict(a.kind(), a.target(), verdict);
                    shared.metrics.probe(a.kind(), a.target(), verdict.health);
                    span.set("iop.status", verdict.health.as_str());
                    match verdict.failure {
                        Some(code) => span.fail(code.as_str()),
                        None => span.ok(),
                    }
                    ProbeEvidence::new(verdict.health, verdict.failure).outcome()
                }
                None => ProbeOutcome::Failed,
            };
            (run_id, outcome)
        });
    }
}
