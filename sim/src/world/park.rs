//! Durable runs that outlive their connection (SPEC §6: R-PARK-1,
//! R-PARK-2, R-TAKE-1), on both sides of the world.
//!
//! * **The node** keeps one core [`RunPark`] per durable run (a run whose
//!   request carries a `ParkSpec`), as `iop-node`'s durable run task does:
//!   every frame the run produces is numbered for the run's life and kept
//!   until the Edge acknowledges it durable; the kept bytes are bounded (a
//!   full buffer puts off the provider's next output). While the run is
//!   attached its connection's watchdog sees every output; when the
//!   connection ends the run *parks* instead of being canceled: its
//!   provider call goes on, for the park grace, after which it expires.
//!   The next registration reports it (`RegisterRequest::parked`); an
//!   adoption (`DataRequest::Adopt`) is decided by [`RunPark::adopt`]: the
//!   run replays the frames after the Edge's resume point on the new
//!   connection and goes on live, or the stream is reset. A node crash
//!   ends its durable runs, parked or not.
//! * **The Edge** carries the dispatcher's `ParkedRuns` to the adoption
//!   task (`Durable::offer` in `iop-edge`): a live request waiting for its
//!   parked run gets `RequestInput::ParkedRun`; any other run is offered to
//!   the Edge's custody (the core's `Custody`, see `custody.rs`), which
//!   adopts it for a new request after winning its record's epoch, or lets
//!   it go. The custody's scan also leaves each record unfinished at an
//!   Edge start for its node to report, for the park window, before it
//!   takes it over (R-TAKE-1).
//!
//! Every rule is the core's; this module carries inputs and outputs.

use std::time::Duration;

use iop_core::edge::dispatch::ParkedOffer;
use iop_core::ids::RunId;
use iop_core::node::link::{NodeLinkInput, NodeLinkOutput};
use iop_core::node::park::{ParkOutput, ParkState, RunPark};
use iop_core::node::watchdog::{
    Emission, ProviderEvent, ProviderOutcome, sanitize_provider_failure,
};
use iop_wire::{
    AdapterKind, AdoptRequest, FinishReason, ParkSpec, ParkedRun, RunEvent, RunEventKind, RunKey,
    Usage,
};

use super::{Call, CallStage, Event, SimNode, World, nconn};
use crate::net::{ConnId, Dir, Payload, StreamKey};
use crate::provider::CallPlan;

/// One durable run on its node.
#[derive(Debug)]
pub(super) struct NodeDurableRun {
    /// The response it writes (what the node reports).
    response_id: String,
    /// Its provider's target.
    target: String,
    /// Its provider call.
    pub(super) call: Call,
    /// Its frames and attachment (the core's).
    park: RunPark<RunEventKind>,
    /// The connection and run id it is attached to, if any.
    attached: Option<(ConnId, RunId)>,
}

impl NodeDurableRun {
    /// The connection it is attached to, if any.
    pub(super) fn attached_conn(&self) -> Option<ConnId> {
        self.attached.map(|(conn, _)| conn)
    }
}

/// The durable run attached to `conn` as `run_id`, if any.
pub(super) fn attached_key(node: &SimNode, conn: ConnId, run_id: RunId) -> Option<RunKey> {
    node.durable
        .iter()
        .find(|(_, r)| r.attached == Some((conn, run_id)))
        .map(|(k, _)| *k)
}

impl World {
    // ---- The node ------------------------------------------------------------

    /// The node's durable runs a registration reports (R-PARK-2): every one
    /// that is not over.
    pub(super) fn parked_reports(&self, node: usize) -> Vec<ParkedRun> {
        let runs: Vec<(ParkState, ParkedRun)> = self.nodes[node]
            .durable
            .iter()
            .map(|(key, r)| {
                let summary = r.park.summary();
                let run = ParkedRun {
                    key: *key,
                    response_id: r.response_id.clone(),
                    adapter: AdapterKind::Mock,
                    target: r.target.clone(),
                    first_kept_frame: summary.first_kept,
                    last_frame: summary.last,
                    ended: summary.ended,
                };
                (r.park.state(), run)
            })
            .collect();
        iop_core::node::park::select_reports(
            iop_core::node::park::ReportScope::Registration,
            runs.iter().map(|(state, run)| (*state, run)),
        )
    }

    /// A run with a `ParkSpec` starts: it is attached to `conn` (its
    /// watchdog already watches it) and keeps its frames.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_durable(
        &mut self,
        node: usize,
        conn: ConnId,
        target: &str,
        spec: ParkSpec,
        provider: usize,
        plan: CallPlan,
        generation: u64,
        run_id: RunId,
    ) {
        let key = RunKey { generation, run_id };
        let grace = iop_core::node::park::effective_park_grace(spec.grace_ms);
        let process = self.nodes[node].process;
        self.nodes[node].durable.insert(
            key,
            NodeDurableRun {
                response_id: spec.response_id,
                target: target.to_owned(),
                call: Call {
                    provider,
                    plan,
                    stage: CallStage::NotStarted,
                    canceled: false,
                    returned: false,
                },
                park: RunPark::new(grace, self.cfg.journal.park_kept_bytes),
                attached: Some((conn, run_id)),
            },
        );
        self.schedule(
            self.now + plan.start_delay,
            Event::DurableStep { node, process, key },
        );
    }

    fn durable_run(
        &mut self,
        node: usize,
        process: u64,
        key: RunKey,
    ) -> Option<&mut NodeDurableRun> {
        let n = &mut self.nodes[node];
        if n.process != process || !n.up {
            return None;
        }
        n.durable.get_mut(&key)
    }

    /// The provider call of a durable run takes its next step.
    pub(super) fn durable_step(&mut self, node: usize, process: u64, key: RunKey) {
        let now = self.now;
        let again = Event::DurableStep { node, process, key };
        let Some(run) = self.durable_run(node, process, key) else {
            return;
        };
        if run.call.canceled || run.call.returned {
            return;
        }
        let provider = run.call.provider;
        let frozen_until = self.frozen_until[provider];
        if frozen_until > now {
            self.schedule(frozen_until, again);
            return;
        }
        let Some(run) = self.durable_run(node, process, key) else {
            return;
        };
        if !run.park.wants_provider() {
            // R-PARK-1: a full buffer puts the provider off; acks (or the
            // run's end) make room. Nothing is dropped.
            let gap = run.call.plan.token_gap.max(Duration::from_millis(1));
            self.stats.park_paused += 1;
            self.schedule(now + gap, again);
            return;
        }
        let Some((event, next)) = run.call.advance() else {
            return;
        };
        let token = run.call.token();
        if super::is_http_5xx(&event) {
            self.stats.provider_5xx += 1;
        }
        if let Some(after) = next {
            self.schedule(now + after, again);
        }
        self.durable_provider_event(node, key, event, token);
    }

    /// A provider output of a durable run: through its connection's
    /// watchdog while attached (R-WD-1), straight into its frames while
    /// parked (no watchdog runs; the grace bounds it).
    fn durable_provider_event(
        &mut self,
        node: usize,
        key: RunKey,
        event: ProviderEvent,
        token: u32,
    ) {
        let Some(run) = self.nodes[node].durable.get(&key) else {
            return;
        };
        let wire = match &event {
            ProviderEvent::Neutral => Some(RunEventKind::Started {
                session_id: format!("s{}", key.run_id),
            }),
            ProviderEvent::Progress(_) => Some(RunEventKind::TextDelta(format!("tok{token}"))),
            ProviderEvent::Returned(_) => None,
        };
        let attached = run.attached.filter(|(conn, _)| {
            self.nodes[node]
                .link
                .iter()
                .any(|l| matches!(l, super::Link::Connected(nc) if nc.conn == *conn))
        });
        match attached {
            Some((conn, run_id)) => {
                let returned = matches!(event, ProviderEvent::Returned(_));
                let Some(emission) = self.offer_provider_event(node, run_id, event) else {
                    return;
                };
                if returned {
                    self.checkers[self.cur].provider_returned(conn, run_id);
                }
                match emission {
                    Emission::Forward => {
                        if let Some(kind) = wire {
                            self.durable_produce(node, key, kind, false);
                        }
                    }
                    Emission::Fenced => self.stats.fenced_outputs += 1,
                }
                self.drain_node_link(node);
            }
            None => {
                // Parked: the provider's end is the run's last frame.
                let (kind, terminal) = match event {
                    ProviderEvent::Returned(ProviderOutcome::Completed) => (
                        Some(RunEventKind::Completed {
                            finish_reason: FinishReason::Stop,
                            usage: Some(Usage {
                                prompt_tokens: 1,
                                completion_tokens: 1,
                            }),
                        }),
                        true,
                    ),
                    ProviderEvent::Returned(ProviderOutcome::Failed(f)) => (
                        Some(RunEventKind::Failed(sanitize_provider_failure(f))),
                        true,
                    ),
                    _ => (wire, false),
                };
                if let Some(kind) = kind {
                    self.durable_produce(node, key, kind, terminal);
                }
            }
        }
    }

    /// The run produced `kind`: kept (numbered for the run's life) and sent
    /// if attached. Nothing comes after its terminal frame.
    pub(super) fn durable_produce(
        &mut self,
        node: usize,
        key: RunKey,
        kind: RunEventKind,
        terminal: bool,
    ) {
        let Some(run) = self.nodes[node].durable.get_mut(&key) else {
            return;
        };
        if run.park.summary().ended || run.park.state() == ParkState::Over {
            return;
        }
        let bytes = iop_core::node::park::frame_bytes(&kind);
        run.park.produced(kind.clone(), bytes, terminal);
        if terminal {
            run.call.returned = true;
        }
        if let Some((conn, run_id)) = run.attached {
            self.transmit(
                conn,
                Dir::NodeToEdge,
                StreamKey::Run(run_id),
                Payload::RunEvent(RunEvent { run_id, kind }),
            );
        }
    }

    /// The watchdog canceled a durable run's provider call: the run stops
    /// reading it at once (`iop-node`'s durable run task drops the call on
    /// `CancelProvider`, which its control channel delivers before any
    /// further provider output), and the cancel reaches the provider after
    /// its latency. Output the provider still makes meanwhile is never
    /// read: were it kept, a run that parks before the cancel lands would
    /// keep output after the frames the claim fenced (R-PARK-2: output
    /// lost between them).
    pub(super) fn durable_cancel_later(&mut self, node: usize, key: RunKey) {
        let process = self.nodes[node].process;
        let Some(run) = self.nodes[node].durable.get_mut(&key) else {
            return;
        };
        run.call.stage = CallStage::Idle;
        let at = self.now + run.call.plan.cancel_latency;
        self.schedule(at, Event::DurableCancel { node, process, key });
    }

    pub(super) fn durable_cancel(&mut self, node: usize, process: u64, key: RunKey) {
        let now = self.now;
        let Some(run) = self.durable_run(node, process, key) else {
            return;
        };
        if run.call.canceled || run.call.returned {
            return;
        }
        run.call.canceled = true;
        run.call.stage = CallStage::Idle;
        if let Some(after) = run.call.plan.return_after_cancel {
            self.schedule(now + after, Event::DurableReturn { node, process, key });
        }
    }

    /// A canceled durable call returns: its watchdog (if it is attached)
    /// joins it (R-WD-4).
    pub(super) fn durable_return(&mut self, node: usize, process: u64, key: RunKey) {
        let now = self.now;
        let Some(run) = self.durable_run(node, process, key) else {
            return;
        };
        if run.call.returned {
            return;
        }
        run.call.returned = true;
        let Some((conn, run_id)) = run.attached else {
            return;
        };
        let Some(nc) = nconn(&mut self.nodes, node, self.cur).filter(|nc| nc.conn == conn) else {
            return;
        };
        // The durable run task reports its dropped call, as `iop-node`'s
        // does.
        nc.link
            .handle_input(now, NodeLinkInput::ProviderDropped { run_id });
        self.checkers[self.cur].provider_returned(conn, run_id);
        self.drain_node_link(node);
    }

    /// The node's connection `conn` ended: its durable runs park for their
    /// grace (R-PARK-1) instead of being canceled.
    pub(super) fn detach_durable(&mut self, node: usize, conn: ConnId) {
        let now = self.now;
        let process = self.nodes[node].process;
        let mut parked = Vec::new();
        for (key, run) in &mut self.nodes[node].durable {
            if run.attached.is_some_and(|(c, _)| c == conn) {
                run.attached = None;
                run.park.detached(now);
                if let Some(until) = run.park.poll_timeout() {
                    parked.push((*key, until));
                }
            }
        }
        for (key, until) in parked {
            self.stats.runs_parked += 1;
            self.schedule(until, Event::ParkExpire { node, process, key });
        }
    }

    /// A parked run's grace may have ended.
    pub(super) fn park_expire(&mut self, node: usize, process: u64, key: RunKey) {
        let now = self.now;
        let Some(run) = self.durable_run(node, process, key) else {
            return;
        };
        run.park.handle_timeout(now);
        self.durable_outputs(node, key);
    }

    /// Carry out what a run's park machine says.
    fn durable_outputs(&mut self, node: usize, key: RunKey) {
        let Some(run) = self.nodes[node].durable.get_mut(&key) else {
            return;
        };
        let mut over = false;
        while let Some(out) = run.park.poll_output() {
            match out {
                // R-PARK-1: no Edge took it within the grace; its provider
                // call is canceled.
                ParkOutput::Expired => {
                    self.stats.park_expired += 1;
                    over = true;
                }
                ParkOutput::Done => over = true,
            }
        }
        if over || run.park.state() == ParkState::Over {
            self.nodes[node].durable.remove(&key);
        }
    }

    /// The Edge acknowledged a durable run's frames (R-PARK-1).
    pub(super) fn node_run_ack(&mut self, node: usize, conn: ConnId, run_id: RunId, through: u64) {
        let Some(key) = attached_key(&self.nodes[node], conn, run_id) else {
            return;
        };
        if let Some(run) = self.nodes[node].durable.get_mut(&key) {
            run.park.acked(through);
        }
        self.durable_outputs(node, key);
    }

    /// The Edge canceled the run on `conn`: a durable one ends here.
    pub(super) fn durable_canceled(&mut self, node: usize, conn: ConnId, run_id: RunId) {
        if let Some(key) = attached_key(&self.nodes[node], conn, run_id)
            && let Some(mut run) = self.nodes[node].durable.remove(&key)
        {
            run.park.cancelled();
        }
    }

    /// An Edge asks to adopt a parked run on `conn` (R-PARK-2): the run's
    /// park machine decides; accepted, the run joins this connection's
    /// watchdog and replays the frames after the resume point.
    pub(super) fn node_adopt(&mut self, node: usize, conn: ConnId, request: AdoptRequest) {
        let now = self.now;
        let run_id = request.run_id;
        let key = request.key;
        let reset = |world: &mut World| {
            world.stats.adoptions_refused += 1;
            world.transmit(
                conn,
                Dir::NodeToEdge,
                StreamKey::Run(run_id),
                Payload::RunReset { run_id },
            );
        };
        let Some(run) = self.nodes[node]
            .durable
            .get_mut(&key)
            .filter(|r| r.response_id == request.response_id)
        else {
            return reset(self);
        };
        // An adoption follows a fresh run's stall rule, checked before the
        // park is touched (as `iop-node` does): an invalid one refuses it.
        let Ok(stall) =
            iop_core::node::park::adoption_stall_timeout(request.response_stall_timeout_ms)
        else {
            return reset(self);
        };
        let replay = match run.park.adopt(now, request.resume_after_frame) {
            Ok(replay) => replay,
            Err(_) => {
                self.durable_outputs(node, key);
                return reset(self);
            }
        };
        let deadline = iop_core::node::watchdog::effective_deadline(request.deadline_ms)
            .map(|d| now.saturating_add(d));
        let ended = run.park.summary().ended;
        let target = run.target.clone();
        let Some(nc) = nconn(&mut self.nodes, node, self.cur) else {
            return;
        };
        nc.link.handle_input(
            now,
            NodeLinkInput::StartRun(super::sim_run_start(run_id, stall, deadline, target)),
        );
        if !matches!(
            self.node_link_answer(node),
            Some(NodeLinkOutput::RunAdmitted { .. })
        ) {
            // The new connection would not take it: it stays parked.
            if let Some(run) = self.nodes[node].durable.get_mut(&key) {
                run.park.adoption_aborted(now);
                if let Some(until) = run.park.poll_timeout() {
                    let process = self.nodes[node].process;
                    self.schedule(until, Event::ParkExpire { node, process, key });
                }
            }
            return reset(self);
        }
        self.stats.node_adoptions += 1;
        let epoch = self
            .journal
            .record(&request.response_id)
            .map_or(0, |r| r.meta.epoch);
        let edge_id = self.edge_id(self.cur);
        let mut attached = false;
        if let Some(run) = self.nodes[node].durable.get_mut(&key) {
            attached = run.attached.is_some();
            run.attached = Some((conn, run_id));
        }
        self.checkers[0].parked_run_adopted(&request.response_id, epoch, &edge_id, attached);
        let verbatim = self.bugs.contains(&super::Bug::ReplayStaleEvidence);
        for (_, kind) in replay {
            // The old connection's health evidence does not travel: the
            // core's rule, as `iop-node` applies it (the
            // `replay-stale-evidence` world bug replays it verbatim to show
            // what that did).
            let kind = if verbatim {
                kind
            } else {
                iop_core::node::park::replayed(kind)
            };
            self.transmit(
                conn,
                Dir::NodeToEdge,
                StreamKey::Run(run_id),
                Payload::RunEvent(RunEvent { run_id, kind }),
            );
        }
        if ended {
            // Its provider call is over: the watchdog has nothing to
            // watch (its terminal is the one already produced).
            let _ = self.offer_provider_event(
                node,
                run_id,
                ProviderEvent::Returned(ProviderOutcome::Completed),
            );
            self.drain_node_link(node);
        }
        self.durable_outputs(node, key);
    }

    // ---- The Edge --------------------------------------------------------------

    /// The node stream of `run_id` on `conn` was reset by the node.
    pub(super) fn edge_run_reset(&mut self, conn: ConnId, run_id: RunId) {
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let Some(c) = edge.conns.get_mut(&conn) else {
            return;
        };
        let Some(rid) = c.runs.remove(&run_id) else {
            return;
        };
        let Some(r) = edge.requests.get_mut(&rid) else {
            return;
        };
        if r.running != Some((conn, run_id)) {
            return;
        }
        r.running = None;
        self.request_input(rid, iop_core::edge::request::RequestInput::StreamEnded);
    }

    /// The parked runs a node reported reach the adoption task: each goes
    /// to the request waiting for it, or to the custody (`Durable::offer`).
    pub(super) fn parked_offers(&mut self, incarnation: u64, offers: Vec<ParkedOffer>) {
        for offer in offers {
            if self.edges[self.cur].as_ref().map(|e| e.incarnation) != Some(incarnation) {
                return;
            }
            self.offer_parked(incarnation, offer);
        }
    }

    fn offer_parked(&mut self, incarnation: u64, offer: ParkedOffer) {
        let key = offer.run.key;
        let record = offer.run.response_id.as_str();
        let Some(edge) = &self.edges[self.cur] else {
            return;
        };
        let waiting = edge
            .requests
            .iter()
            .find(|(_, r)| r.durable.as_deref() == Some(record) && r.machine.awaits_parked(key))
            .map(|(rid, _)| *rid);
        match waiting {
            // Its driver adopts it.
            Some(rid) => {
                self.request_input(rid, iop_core::edge::request::RequestInput::ParkedRun(offer));
            }
            // Taken over by adoption, or let go: the custody decides.
            None => self.custody_offer(incarnation, offer),
        }
    }
}
