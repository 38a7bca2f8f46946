//! One task per connection to the Edge. It owns that connection's core
//! state (heartbeat, stall watchdog with its observation sequence) and runs
//! one `select!` over control frames, the next core timeout, incoming data
//! streams and messages from the run handlers, draining core outputs into
//! I/O after every input.
//!
//! When the connection ends, every run and tunnel handler bound to it is
//! canceled (R-DISC-1): they live in this task's `JoinSet`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use iop_core::ids::{Generation, RunId};
use iop_core::liveness::heartbeat::{Heartbeat, HeartbeatOutput};
use iop_core::node::probe::ProbeEvidence;
use iop_core::node::watchdog::{
    CancelReason, Emission, ProbeOutcome, ProviderEvent, WatchdogOutput,
};
use iop_trace::{MachineKind, Tap, TraceWriter, TracedWatchdog, WatchdogConfigRec};
use iop_transport::clock::Clock;
use iop_transport::close_connection;
use iop_transport::framed::{FramedError, FramedRecv, FramedSend, framed_for_side, open_framed};
use iop_wire::{
    AdapterKind, CloseCode, ConfigSnapshot, EdgeControl, NodeControl, NodeReadyRequest,
    OfferedProvider, PROTOCOL_VERSION, RegisterRequest, RegisterResponse, RejectReason,
    TransportStatusReport,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::config::NodeConfig;
use crate::control::{LinkMsg, LinkTx, RunControl};
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

struct RunSlot {
    control: mpsc::UnboundedSender<RunControl>,
    adapter: AdapterKind,
    target: String,
    /// The handler wrote its own terminal (a forwarded provider terminal).
    self_terminated: bool,
}

/// Bound of messages in flight from handlers to the link.
const LINK_QUEUE: usize = 1024;

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
    let handshake = tokio::time::timeout(
        config.connect_timeout,
        handshake(&mut send, &mut recv, &config, &shared),
    );
    let Ok(handshake) = handshake.await else {
        close_connection(&conn, CloseCode::ProtocolError);
        return LinkEnd::HandshakeTimeout;
    };
    let (generation, snapshot) = match handshake {
        Ok(Ok(g)) => g,
        Ok(Err((reason, message))) => {
            close_connection(&conn, CloseCode::RegistrationRejected);
            return LinkEnd::Rejected { reason, message };
        }
        Err(e) => {
            shared.metrics.wire_error(&e);
            close_connection(&conn, CloseCode::ProtocolError);
            return LinkEnd::Failed(e);
        }
    };
    slot.generation.store(generation, Ordering::Relaxed);
    slot.ready.store(true, Ordering::Relaxed);
    tracing::info!(event = "node_ready", edge = %slot.address, generation);

    // The watchdog (with its observation sequence) is this connection's own
    // (R-SEQ-1); with --record-trace its inputs and outputs are recorded.
    let config_rec = WatchdogConfigRec::new(&config.watchdog, true);
    let tap = match shared.trace_file(generation) {
        Some(out) => Tap::to(TraceWriter::new(
            out,
            MachineKind::NodeWatchdog,
            &config_rec,
        )),
        None => Tap::off(),
    };
    let mut link = Link {
        clock,
        generation,
        connected_at: clock.now(),
        heartbeat: Heartbeat::new(clock.now(), config.heartbeat),
        watchdog: TracedWatchdog::new(config_rec, tap),
        runs: HashMap::new(),
        max_runs: config.node.max_concurrent_runs as usize,
        shared: shared.clone(),
        probes: JoinSet::new(),
        creds: LinkCreds::default(),
        replay: slot.take_replay(),
    };
    link.creds.apply(&snapshot);
    shared.set_managed(&snapshot.managed_targets);
    let (link_tx, mut link_rx) = mpsc::channel(LINK_QUEUE);
    let link_tx = LinkTx(link_tx);
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
        let wake =
            iop_core::time::earliest(link.heartbeat.poll_timeout(), link.watchdog.poll_timeout());
        let is_paused = *paused.borrow();
        tokio::select! {
            frame = recv.recv::<EdgeControl>(), if !is_paused => match frame {
                Ok(Some(msg)) => {
                    if let Some(code) = link.on_control(msg, &mut send).await {
                        break LinkEnd::Closed { was_ready: true, code };
                    }
                }
                Ok(None) => break LinkEnd::Closed { was_ready: true, code: CloseCode::Normal },
                Err(FramedError::ConnectionLost { close_code, .. }) => {
                    break LinkEnd::Closed { was_ready: true, code: close_code.unwrap_or(CloseCode::Normal) };
                }
                Err(e) => {
                    shared.metrics.wire_error(&e);
                    tracing::warn!(event = "node_control_stream_error", error = %e);
                    break LinkEnd::Closed { was_ready: true, code: CloseCode::ProtocolError };
                }
            },
            () = clock.sleep_until(wake), if !is_paused => {
                let now = clock.now();
                link.heartbeat.handle_timeout(now);
                link.watchdog.handle_timeout(now);
            },
            _ = paused.changed() => {},
            stream = conn.accept_bi() => match stream {
                Ok((s, r)) => {
                    let (s, r) = framed_for_side(conn.side(), s, r);
                    handlers.spawn(run::serve_stream(
                        s,
                        r,
                        link_tx.clone(),
                        shared.clone(),
                        conn.clone(),
                        generation,
                    ));
                }
                Err(e) => {
                    break LinkEnd::Closed {
                        was_ready: true,
                        code: iop_transport::close_code_of(&e).unwrap_or(CloseCode::Normal),
                    };
                }
            },
            Some(msg) = link_rx.recv() => link.on_link_msg(msg),
            Ok(()) = parked.changed(), if report_due.is_none() => {
                report_due = Some(
                    tokio::time::Instant::now() + iop_core::edge::flood::PARKED_REPORT_DELAY,
                );
            },
            () = tokio::time::sleep_until(report_due.unwrap_or_else(tokio::time::Instant::now)), if report_due.is_some() => {
                report_due = None;
                let runs = shared.parking.parked_reports();
                if !runs.is_empty() && send.send(&NodeControl::Parked { runs }).await.is_err() {
                    break LinkEnd::Closed { was_ready: true, code: CloseCode::Normal };
                }
            },
            Some(done) = link.probes.join_next(), if !link.probes.is_empty() => {
                if let Ok((run_id, outcome)) = done {
                    link.watchdog.probe_result(clock.now(), run_id, outcome);
                }
            },
            Some(_) = handlers.join_next(), if !handlers.is_empty() => {},
            _ = shutdown.changed() => {
                let _ = send.send(&NodeControl::Closing { code: CloseCode::Shutdown }).await;
                close_connection(&conn, CloseCode::Shutdown);
                break LinkEnd::Shutdown;
            },
        }
        if let Some(code) = link.drain(&mut send).await {
            break LinkEnd::Closed {
                was_ready: true,
                code,
            };
        }
    };

    // R-DISC-1: every handler bound to this connection is canceled.
    let canceled = handlers.len() as u64;
    shared
        .disconnect_cancels
        .fetch_add(canceled, Ordering::Relaxed);
    handlers.abort_all();
    link.probes.abort_all();
    link.watchdog
        .cancel_all(clock.now(), CancelReason::Disconnect);
    slot.ready.store(false, Ordering::Relaxed);
    slot.generation.store(0, Ordering::Relaxed);
    // Hand the replay cache to this Edge's next connection.
    slot.return_replay(std::mem::take(&mut link.replay));
    if let LinkEnd::Closed { code, .. } = &end {
        close_connection(&conn, *code);
    }
    end
}

async fn handshake(
    send: &mut FramedSend,
    recv: &mut FramedRecv,
    config: &NodeConfig,
    shared: &LinkShared,
) -> Result<Result<(Generation, ConfigSnapshot), (RejectReason, String)>, FramedError> {
    let request = RegisterRequest {
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
        // R-PARK-2: the durable runs an Edge may adopt.
        parked: shared.parking.reports(),
    };
    send.send(&NodeControl::Register(request)).await?;
    let (generation, snapshot) = loop {
        match recv.recv::<EdgeControl>().await? {
            Some(EdgeControl::Registered(RegisterResponse::Accepted { generation, config })) => {
                break (generation, config);
            }
            Some(EdgeControl::Registered(RegisterResponse::Rejected {
                reason, message, ..
            })) => return Ok(Err((reason, message))),
            Some(_) => continue,
            None => {
                return Err(FramedError::LocalMisuse {
                    what: "control stream ended before registration",
                });
            }
        }
    };
    send.send(&NodeControl::Ready(NodeReadyRequest { generation }))
        .await?;
    loop {
        match recv.recv::<EdgeControl>().await? {
            Some(EdgeControl::ReadyAck(ack)) if ack.generation == generation => {
                if ack.accepted {
                    return Ok(Ok((generation, snapshot)));
                }
                return Ok(Err((
                    RejectReason::InvalidRegistration,
                    "readiness refused: generation superseded".into(),
                )));
            }
            Some(EdgeControl::Ping(hb)) => send.send(&NodeControl::Pong(hb)).await?,
            Some(_) => continue,
            None => {
                return Err(FramedError::LocalMisuse {
                    what: "control stream ended before readiness",
                });
            }
        }
    }
}

struct Link {
    clock: Clock,
    generation: Generation,
    connected_at: iop_core::Instant,
    heartbeat: Heartbeat,
    watchdog: TracedWatchdog,
    runs: HashMap<RunId, RunSlot>,
    max_runs: usize,
    shared: Arc<LinkShared>,
    probes: JoinSet<(RunId, ProbeOutcome)>,
    creds: LinkCreds,
    replay: iop_core::cred::ReplayCache,
}

impl Drop for Link {
    /// Runs still attached when the connection ends leave it: their count
    /// goes (a durable one that parks is counted parked instead).
    fn drop(&mut self) {
        let mut capacity = self.shared.capacity();
        for slot in self.runs.values() {
            capacity.finish(slot.adapter, &slot.target);
        }
    }
}

/// The Edge's pushed credential configuration, as of the latest snapshot.
#[derive(Default)]
struct LinkCreds {
    signing_key: Option<ed25519_dalek::VerifyingKey>,
    /// Profile -> (current revision, active).
    profiles: HashMap<String, (u64, bool)>,
    managed: Vec<iop_wire::ManagedTarget>,
}

impl LinkCreds {
    fn apply(&mut self, snapshot: &ConfigSnapshot) {
        self.signing_key = snapshot.lease_signing_key.and_then(|bytes| {
            match iop_core::cred::keys::verifying_key_from_bytes(&bytes) {
                Ok(key) => Some(key),
                Err(e) => {
                    tracing::warn!(event = "node_lease_signing_key_refused", error = %e);
                    None
                }
            }
        });
        self.profiles = snapshot
            .credential_profiles
            .iter()
            .map(|p| (p.profile.clone(), (p.revision, p.active)))
            .collect();
        self.managed = snapshot.managed_targets.clone();
    }

    fn profile_of(&self, adapter: AdapterKind, target: &str) -> Option<&str> {
        self.managed
            .iter()
            .find(|m| m.adapter == adapter && m.target == target)
            .map(|m| m.profile.as_str())
    }
}

impl Link {
    /// Offer one provider output of `run_id` to the watchdog: forward it,
    /// or drop it as fenced (R-WD-6, counted).
    fn provider_event(
        &mut self,
        now: iop_core::Instant,
        run_id: RunId,
        event: ProviderEvent,
    ) -> Emission {
        let returned = matches!(event, ProviderEvent::Returned(_));
        let emission = self.watchdog.provider_event(now, run_id, event);
        if emission == Emission::Forward
            && returned
            && let Some(slot) = self.runs.get_mut(&run_id)
        {
            slot.self_terminated = true;
        }
        if emission == Emission::Fenced {
            self.shared
                .fenced_late_outputs
                .fetch_add(1, Ordering::Relaxed);
        }
        emission
    }

    /// Open one run's lease (R-CRED-2/3). Every check is `open_lease`'s.
    fn open_lease(
        &mut self,
        run_id: RunId,
        adapter: AdapterKind,
        target: &str,
        route: Option<&str>,
        lease: Option<&[u8]>,
    ) -> Result<Option<iop_core::cred::Secret>, &'static str> {
        let profile = self.creds.profile_of(adapter, target);
        let (lease, profile) = match (lease, profile) {
            (None, None) => return Ok(None),
            (None, Some(_)) => return Err("missing_lease"),
            // A lease for a target this node was not told is managed: the
            // expected profile is none, so the binding check refuses it.
            (Some(lease), profile) => (lease, profile.unwrap_or("")),
        };
        let Some(identity) = self.shared.identity.as_ref() else {
            return Err("no_recipient_key");
        };
        let Some(signing_key) = self.creds.signing_key.as_ref() else {
            return Err("no_signing_key");
        };
        let expected = iop_core::cred::ExpectedBinding {
            node: &identity.node_id,
            generation: self.generation,
            slot: run_id,
            target,
            profile,
            route,
            principal: None,
        };
        let profiles = &self.creds.profiles;
        iop_core::cred::open_lease(
            lease,
            &expected,
            signing_key,
            &identity.recipient,
            iop_transport::clock::unix_ms(),
            iop_core::cred::DEFAULT_SKEW_TOLERANCE_MS,
            &mut self.replay,
            &|p: &str| profiles.get(p).copied(),
        )
        .map(Some)
        .map_err(|rejected| rejection_label(rejected.reason))
    }

    /// Handle one control frame; `Some(code)` ends the connection.
    async fn on_control(&mut self, msg: EdgeControl, send: &mut FramedSend) -> Option<CloseCode> {
        let now = self.clock.now();
        match msg {
            EdgeControl::Ping(hb) => self.heartbeat.handle_ping(now, hb.seq),
            EdgeControl::Pong(hb) => self.heartbeat.handle_pong(now, hb.seq),
            EdgeControl::Cancel(c) => self.watchdog.cancel(now, c.run_id, CancelReason::Client),
            EdgeControl::ConfigRefresh(snapshot) => {
                self.creds.apply(&snapshot);
                self.shared.set_managed(&snapshot.managed_targets);
                let applied = NodeControl::ConfigApplied {
                    generation: self.generation,
                };
                if send.send(&applied).await.is_err() {
                    return Some(CloseCode::Normal);
                }
            }
            EdgeControl::Closing { code } => return Some(code),
            EdgeControl::Registered(_) | EdgeControl::ReadyAck(_) => {}
        }
        None
    }

    fn on_link_msg(&mut self, msg: LinkMsg) {
        let now = self.clock.now();
        match msg {
            LinkMsg::Start {
                run_id,
                kind,
                stall_timeout,
                deadline,
                adapter,
                target,
                carries_lease,
                adopted,
                control,
                reply,
            } => {
                // One count over every Edge connection; parked durable runs
                // still hold their provider (R-PARK-1, R-MULTI-1).
                if adopted {
                    self.shared.capacity().adopt(adapter, &target);
                } else {
                    let parked = self.shared.parking.parked_runs(adapter, &target);
                    let admitted = self.shared.capacity().start(adapter, &target, parked);
                    if let Err(code) = admitted {
                        let _ = reply.send(Err(code));
                        return;
                    }
                }
                let deadline = deadline.map(|d| now + d);
                match self
                    .watchdog
                    .start(now, run_id, kind, stall_timeout, deadline)
                {
                    Ok(()) => {
                        self.runs.insert(
                            run_id,
                            RunSlot {
                                control,
                                adapter,
                                target,
                                self_terminated: false,
                            },
                        );
                        let _ = reply.send(Ok(()));
                    }
                    Err(e) => {
                        self.shared.capacity().finish(adapter, &target);
                        tracing::warn!(event = "node_run_refused", error = %e);
                        // A reused run id with a lease is a replay (R-CRED-3).
                        let _ = reply.send(Err(e.failure_code(carries_lease)));
                    }
                }
            }
            LinkMsg::Event {
                run_id,
                event,
                reply,
            } => {
                let _ = reply.send(self.provider_event(now, run_id, event));
            }
            LinkMsg::Events {
                run_id,
                events,
                reply,
            } => {
                let emissions = events
                    .into_iter()
                    .map(|event| self.provider_event(now, run_id, event))
                    .collect();
                let _ = reply.send(emissions);
            }
            LinkMsg::ProviderReturned { run_id } => {
                // Only a run still joining its stall needs the timing
                // (R-WD-4); after its terminal there is nothing to record.
                if self.runs.contains_key(&run_id) {
                    let _ = self.watchdog.provider_event(
                        now,
                        run_id,
                        ProviderEvent::Returned(
                            iop_core::node::watchdog::ProviderOutcome::Completed,
                        ),
                    );
                }
            }
            LinkMsg::Finished { run_id } => {
                // The handler left this connection: it ended without a
                // terminal (its stream broke), or it is a durable run that
                // parks (R-PARK-1). The watchdog forgets it, and nothing of
                // that goes to the handler: a parked run's provider call
                // must go on, not be canceled by its old link.
                if let Some(slot) = self.runs.remove(&run_id) {
                    self.shared.capacity().finish(slot.adapter, &slot.target);
                    self.watchdog.cancel(now, run_id, CancelReason::Client);
                }
            }
            LinkMsg::Canceled { run_id } => {
                self.watchdog.cancel(now, run_id, CancelReason::Client);
            }
            LinkMsg::ProbeDone { run_id, outcome } => {
                self.watchdog.probe_result(now, run_id, outcome);
            }
            LinkMsg::Status { reply } => {
                let _ = reply.send(TransportStatusReport {
                    generation: self.generation,
                    connected_for_ms: iop_core::time::duration_ms(now - self.connected_at),
                    active_runs: self.runs.len() as u32,
                    max_concurrent_runs: self.max_runs as u32,
                    heartbeats_sent: self.heartbeat.pings_sent(),
                    last_heartbeat_rtt_ms: self
                        .heartbeat
                        .last_rtt()
                        .map(iop_core::time::duration_ms),
                    fenced_late_outputs: self.shared.fenced_late_outputs.load(Ordering::Relaxed),
                    next_health_observation_seq: self
                        .watchdog
                        .inner()
                        .next_observation_seq()
                        .unwrap_or(0),
                });
            }
            LinkMsg::OpenLease {
                run_id,
                adapter,
                target,
                route,
                lease,
                reply,
            } => {
                let opened =
                    self.open_lease(run_id, adapter, &target, route.as_deref(), lease.as_deref());
                if let Err(reason) = &opened {
                    self.shared
                        .credential_rejections
                        .fetch_add(1, Ordering::Relaxed);
                    self.shared.metrics.credential_rejected(reason);
                    tracing::warn!(
                        event = "node_credential_rejected",
                        generation = self.generation,
                        reason = *reason
                    );
                }
                let _ = reply.send(opened);
            }
            LinkMsg::TakeObservationSeq { reply } => {
                let _ = reply.send(self.watchdog.take_observation_seq(now).unwrap_or(0));
            }
        }
    }

    /// Carry out core outputs; `Some(code)` ends the connection.
    async fn drain(&mut self, send: &mut FramedSend) -> Option<CloseCode> {
        while let Some(out) = self.heartbeat.poll_output() {
            let frame = match out {
                HeartbeatOutput::SendPing(seq) => NodeControl::Ping(iop_wire::Heartbeat { seq }),
                HeartbeatOutput::SendPong(seq) => NodeControl::Pong(iop_wire::Heartbeat { seq }),
                HeartbeatOutput::TimedOut => {
                    tracing::warn!(
                        event = "node_heartbeat_timeout",
                        generation = self.generation
                    );
                    return Some(CloseCode::HeartbeatTimeout);
                }
            };
            if send.send(&frame).await.is_err() {
                return Some(CloseCode::Normal);
            }
        }
        while let Some(out) = self.watchdog.poll_output(self.clock.now()) {
            match out {
                WatchdogOutput::CancelProvider { run_id } => {
                    if let Some(slot) = self.runs.get(&run_id) {
                        let _ = slot.control.send(RunControl::CancelProvider);
                    }
                }
                WatchdogOutput::StartProbe { run_id } => {
                    let adapter = self
                        .runs
                        .get(&run_id)
                        .and_then(|slot| self.shared.adapter(slot.adapter, &slot.target).cloned());
                    let bound = self.shared.probe_bound;
                    let shared = self.shared.clone();
                    self.probes.spawn(async move {
                        // The probe is bounded like the watchdog's own
                        // probe bound; either way a timeout is no verdict
                        // (R-WD-5).
                        let outcome = match adapter {
                            Some(a) => {
                                // The same `node.probe` span as a
                                // CAPABILITIES probe, marked as a stall's.
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
                WatchdogOutput::Terminal { run_id, terminal } => {
                    if let Some(slot) = self.runs.remove(&run_id) {
                        self.shared.capacity().finish(slot.adapter, &slot.target);
                        if !slot.self_terminated {
                            let _ = slot.control.send(RunControl::Terminal(terminal));
                        }
                    }
                }
                WatchdogOutput::StallObserved {
                    kind,
                    elapsed_ms,
                    health,
                    retryable,
                    ..
                } => {
                    self.shared.stalls.fetch_add(1, Ordering::Relaxed);
                    self.shared.metrics.stall(
                        kind.as_str(),
                        health.as_str(),
                        retryable,
                        elapsed_ms,
                    );
                    tracing::warn!(
                        event = "node_response_stall_observation",
                        kind = kind.as_str(),
                        elapsed_ms,
                        provider_health = health.as_str(),
                        liveness_classification = health.liveness_classification().as_str(),
                        retryable
                    );
                }
            }
        }
        None
    }
}

/// A closed label for a refused lease; a binding mismatch names its field.
pub fn rejection_label(reason: iop_core::cred::RejectionReason) -> &'static str {
    use iop_core::cred::{BindingField as F, RejectionReason as R};
    match reason {
        R::BindingMismatch { field } => match field {
            F::Node => "binding_mismatch_node",
            F::Generation => "binding_mismatch_generation",
            F::Slot => "binding_mismatch_slot",
            F::Target => "binding_mismatch_target",
            F::Profile => "binding_mismatch_profile",
            F::Route => "binding_mismatch_route",
            F::Principal => "binding_mismatch_principal",
        },
        other => other.as_str(),
    }
}
