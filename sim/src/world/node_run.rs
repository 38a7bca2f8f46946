//! The node's runs (SPEC §3, §6: R-WD-1..6, R-PARK-1, R-PARK-2), as
//! `iop-node`'s run tasks drive them: one core
//! [`NodeRun`](iop_core::node::run::NodeRun) per run, ephemeral or
//! durable, and its simulated provider call ([`Call`]).
//!
//! Every rule is the machine's: the start order (stall timeout, admission
//! by the connection's machine, lease, call), a refusal's failure, what
//! the watchdog lets through, a missing terminal, park, detach, adoption,
//! replay and expiry. This module carries its outputs out on the simulated
//! network, the connection's machine and the provider call, and feeds back
//! what happened, as `shell-node/src/run.rs` does on real streams; what
//! only the world has is the provider's timing (its [`CallPlan`]: a
//! cancel lands after its latency and the call returns after it, or
//! never, which R-WD-4 times) and the invariant checkers' hooks. The
//! simulated providers need no credential, so a lease always opens.
//!
//! A durable run outlives its connection, not its process: it is named by
//! a serial of its node, not by its connection's run id.

use std::time::Duration;

use iop_core::ids::RunId;
use iop_core::node::link::{NodeLinkInput, RunStart};
use iop_core::node::park::{EdgeSignal, ParkState, ReportScope, select_reports};
use iop_core::node::run::{
    Adoption, LinkAsk, NodeRun, NodeRunInput, NodeRunOutput, ParkTerms, RunSpec,
};
use iop_core::node::watchdog::{
    ProviderEvent, ProviderOutcome, RunKind, RunTerminal, effective_stall_timeout,
};
use iop_wire::{
    AdapterKind, AdoptRequest, FailureCode, FinishReason, ParkedRun, RunEvent, RunEventKind,
    RunKey, RunRequest, Usage,
};

use super::{Call, CallStage, Event, Link, World, nconn};
use crate::net::{ConnId, Dir, Payload, StreamKey};
use crate::provider::CallPlan;
use crate::trace::{Driven, MachineKind, NodeRunConfigRec};

/// One run on its node.
#[derive(Debug)]
pub(super) struct SimRun {
    /// Its rules.
    machine: Driven<NodeRun<RunEventKind>>,
    /// Its provider call, once made.
    call: Option<Call>,
    /// The provider its target names.
    provider: usize,
    /// Its provider's target.
    target: String,
    /// Its request's stall timeout (for the provider's plan).
    stall_timeout_ms: u64,
    /// The connection it is attached to.
    conn: Option<ConnId>,
    /// The connection and run id of an adoption in progress.
    adopting: Option<(ConnId, RunId)>,
    /// A durable run's key and response (what a registration reports).
    durable: Option<(RunKey, String)>,
    /// The park timer armed for it.
    timer: Option<iop_core::Instant>,
    /// A run held to a tenant's limits (SPEC §9) reports its real usage:
    /// its prompt's tokens (a byte of its messages each) and the tokens
    /// it emitted; others report one of each.
    prompt_tokens: Option<u64>,
}

impl SimRun {
    /// The connection it is attached to, if any.
    pub(super) fn conn(&self) -> Option<ConnId> {
        self.conn
    }

    /// Whether it is durable.
    pub(super) fn is_durable(&self) -> bool {
        self.durable.is_some()
    }

    /// Its provider's index, once called.
    pub(super) fn provider(&self) -> Option<usize> {
        self.call.as_ref().map(|c| c.provider)
    }
}

/// A provider output as `iop-node`'s mock adapter writes it.
fn frame_of(event: ProviderEvent, run_id: RunId, token: u32, usage: Usage) -> RunEventKind {
    match event {
        ProviderEvent::Neutral => RunEventKind::Started {
            session_id: format!("s{run_id}"),
        },
        ProviderEvent::Progress(_) => RunEventKind::TextDelta(format!("tok{token}")),
        ProviderEvent::Returned(ProviderOutcome::Completed) => RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage),
        },
        ProviderEvent::Returned(ProviderOutcome::Failed(f)) => RunEventKind::Failed(f),
    }
}

impl World {
    /// A run's request arrived on the node's connection at the current
    /// Edge slot.
    pub(super) fn node_start_run(&mut self, node: usize, request: RunRequest) {
        let Some(nc) = nconn(&mut self.nodes, node, self.cur) else {
            return;
        };
        let conn = nc.conn;
        let generation = nc.link.machine().generation().unwrap_or(0);
        let provider = self
            .providers
            .iter()
            .position(|p| p.target == request.target)
            .unwrap_or(0);
        let park = request.park.as_ref().map(|p| ParkTerms {
            grace_ms: p.grace_ms,
            max_kept_bytes: self.cfg.journal.park_kept_bytes,
        });
        let config = NodeRunConfigRec {
            spec: RunSpec {
                run_id: request.run_id,
                kind: RunKind::Normalized,
                stall_timeout_ms: request.response_stall_timeout_ms,
                deadline_ms: request.deadline_ms,
                target_known: true,
                carries_lease: request.credential_lease.is_some(),
                park,
            },
        };
        let tap = self.recorder.tap(MachineKind::NodeRun, &config);
        let machine = Driven::new(NodeRun::new(config.spec), tap);
        let n = &mut self.nodes[node];
        let serial = n.next_run;
        n.next_run += 1;
        n.runs.insert(
            serial,
            SimRun {
                machine,
                call: None,
                provider,
                target: request.target.clone(),
                stall_timeout_ms: request.response_stall_timeout_ms,
                conn: Some(conn),
                adopting: None,
                durable: request.park.map(|p| {
                    (
                        RunKey {
                            generation,
                            run_id: request.run_id,
                        },
                        p.response_id,
                    )
                }),
                timer: None,
                prompt_tokens: request.params.max_tokens.map(|_| {
                    request
                        .messages
                        .iter()
                        .map(|m| m.content.len() as u64)
                        .sum()
                }),
            },
        );
        self.drain_run(node, serial);
    }

    /// The run attached to `conn` as `run_id`, if any.
    pub(super) fn attached_run(&self, node: usize, conn: ConnId, run_id: RunId) -> Option<u64> {
        self.nodes[node]
            .runs
            .iter()
            .find(|(_, r)| r.conn == Some(conn) && r.machine.machine().run_id() == run_id)
            .map(|(serial, _)| *serial)
    }

    /// Feed one input to a run and carry out what it says.
    pub(super) fn run_input(
        &mut self,
        node: usize,
        serial: u64,
        input: NodeRunInput<RunEventKind>,
    ) {
        let now = self.now;
        let Some(run) = self.nodes[node].runs.get_mut(&serial) else {
            return;
        };
        run.machine.handle_input(now, input);
        self.drain_run(node, serial);
    }

    /// Carry out a run's outputs, feeding back the answers, then arm its
    /// timer.
    fn drain_run(&mut self, node: usize, serial: u64) {
        let now = self.now;
        loop {
            let Some(run) = self.nodes[node].runs.get_mut(&serial) else {
                return;
            };
            let Some(out) = run.machine.poll_output(now) else {
                break;
            };
            let fed = self.run_output(node, serial, out);
            if let Some(input) = fed
                && let Some(run) = self.nodes[node].runs.get_mut(&serial)
            {
                run.machine.handle_input(now, input);
            }
        }
        let process = self.nodes[node].process;
        if let Some(run) = self.nodes[node].runs.get_mut(&serial) {
            let due = run.machine.poll_timeout();
            if due.is_some() && due != run.timer {
                run.timer = due;
                if let Some(at) = due {
                    self.schedule(
                        at,
                        Event::RunTimer {
                            node,
                            process,
                            run: serial,
                        },
                    );
                }
            }
        }
    }

    fn run_output(
        &mut self,
        node: usize,
        serial: u64,
        out: NodeRunOutput<RunEventKind>,
    ) -> Option<NodeRunInput<RunEventKind>> {
        let now = self.now;
        let process = self.nodes[node].process;
        let run = self.nodes[node].runs.get_mut(&serial)?;
        let run_id = run.machine.machine().run_id();
        let conn = run.conn;
        match out {
            NodeRunOutput::Link(ask) => return self.run_ask(node, serial, ask),
            NodeRunOutput::CallProvider => self.call_provider(node, serial),
            NodeRunOutput::StopProvider { report } => {
                let durable = run.durable.is_some();
                let call = run.call.as_mut()?;
                // The run stops reading the call at once (`iop-node` drops
                // it).
                call.stage = CallStage::Idle;
                if !report {
                    call.canceled = true;
                    call.returned = true;
                } else if durable {
                    // The cancel reaches the provider after its latency, and
                    // the call returns after it, or never (R-WD-4).
                    let at = now + call.plan.cancel_latency;
                    self.schedule(
                        at,
                        Event::RunCancel {
                            node,
                            process,
                            run: serial,
                        },
                    );
                } else {
                    // A run that is not durable heard the cancel after its
                    // latency (see `run_cancel_provider`): it lands now.
                    self.cancel_landed(node, serial);
                }
            }
            NodeRunOutput::Send { frames, finish } => {
                let conn = conn?;
                for kind in frames {
                    self.transmit(
                        conn,
                        Dir::NodeToEdge,
                        StreamKey::Run(run_id),
                        Payload::RunEvent(RunEvent { run_id, kind }),
                    );
                }
                if finish {
                    self.net.stream_done(conn, StreamKey::Run(run_id));
                }
            }
            NodeRunOutput::Replay(frames) => {
                let conn = conn?;
                for kind in frames {
                    self.transmit(
                        conn,
                        Dir::NodeToEdge,
                        StreamKey::Run(run_id),
                        Payload::RunEvent(RunEvent { run_id, kind }),
                    );
                }
            }
            NodeRunOutput::FinishStream => {
                if let Some(conn) = conn {
                    self.net.stream_done(conn, StreamKey::Run(run_id));
                }
            }
            NodeRunOutput::ResetStream(_) => {
                if let Some(conn) = conn {
                    self.transmit(
                        conn,
                        Dir::NodeToEdge,
                        StreamKey::Run(run_id),
                        Payload::RunReset { run_id },
                    );
                }
            }
            NodeRunOutput::Attach => {
                let (conn, _) = run.adopting.take()?;
                run.conn = Some(conn);
                let response = run.durable.as_ref().map(|(_, r)| r.clone())?;
                self.stats.node_adoptions += 1;
                let epoch = self.journal.record(&response).map_or(0, |r| r.meta.epoch);
                let edge_id = self.edge_id(self.cur);
                self.checkers[0].parked_run_adopted(&response, epoch, &edge_id, false);
            }
            NodeRunOutput::RefuseAdoption(_) => {
                let (conn, adopting_run) = run.adopting.take()?;
                self.stats.adoptions_refused += 1;
                self.transmit(
                    conn,
                    Dir::NodeToEdge,
                    StreamKey::Run(adopting_run),
                    Payload::RunReset {
                        run_id: adopting_run,
                    },
                );
            }
            NodeRunOutput::Ended(_) => {}
            NodeRunOutput::Parked => {
                run.conn = None;
                self.stats.runs_parked += 1;
            }
            NodeRunOutput::Expired => self.stats.park_expired += 1,
            NodeRunOutput::Done => {
                self.nodes[node].runs.remove(&serial);
            }
        }
        None
    }

    /// Carry one ask to the connection's machine, as `iop-node`'s run task
    /// does: the call (its answer, if it has one, is the return value),
    /// then the connection's outputs it caused; the answer is the run's
    /// next input.
    fn run_ask(
        &mut self,
        node: usize,
        serial: u64,
        ask: LinkAsk,
    ) -> Option<NodeRunInput<RunEventKind>> {
        let now = self.now;
        let run = self.nodes[node].runs.get(&serial)?;
        let conn = match &ask {
            LinkAsk::Start { adopted: true, .. } => run.adopting.map(|(c, _)| c),
            _ => run.conn,
        };
        let target = run.target.clone();
        let Some(slot) = conn.and_then(|c| self.link_slot(node, c)) else {
            return Some(NodeRunInput::LinkGone);
        };
        let saved = std::mem::replace(&mut self.cur, slot);
        let answer = self.run_ask_at(node, conn?, ask, target, now);
        self.cur = saved;
        answer
    }

    fn run_ask_at(
        &mut self,
        node: usize,
        conn: ConnId,
        ask: LinkAsk,
        target: String,
        now: iop_core::Instant,
    ) -> Option<NodeRunInput<RunEventKind>> {
        let nc = nconn(&mut self.nodes, node, self.cur)?;
        let answer = match ask {
            LinkAsk::Start {
                run_id,
                kind,
                stall_timeout,
                deadline,
                carries_lease,
                ..
            } => {
                let started = nc.link.start_run(
                    now,
                    RunStart {
                        run_id,
                        kind,
                        stall_timeout,
                        deadline: deadline.map(|d| now.saturating_add(d)),
                        adapter: AdapterKind::Mock,
                        target,
                        carries_lease,
                    },
                );
                Some(NodeRunInput::Admitted(started))
            }
            // The simulated providers need no credential.
            LinkAsk::OpenLease { .. } => Some(NodeRunInput::LeaseOpened(true)),
            LinkAsk::Offer { run_id, events } => {
                let returned = events
                    .iter()
                    .any(|e| matches!(e, ProviderEvent::Returned(_)));
                let emissions = nc.link.offer(now, run_id, events);
                self.stats.fenced_outputs += emissions
                    .iter()
                    .filter(|e| **e == iop_core::node::watchdog::Emission::Fenced)
                    .count() as u64;
                if returned {
                    self.checkers[self.cur].provider_returned(conn, run_id);
                }
                Some(NodeRunInput::Emissions(emissions))
            }
            LinkAsk::ProviderDropped { run_id } => {
                nc.link
                    .handle_input(now, NodeLinkInput::ProviderDropped { run_id });
                self.checkers[self.cur].provider_returned(conn, run_id);
                None
            }
            LinkAsk::Canceled { run_id } => {
                nc.link
                    .handle_input(now, NodeLinkInput::RunCanceled { run_id });
                None
            }
            LinkAsk::Left { run_id } => {
                nc.link.handle_input(now, NodeLinkInput::RunLeft { run_id });
                None
            }
        };
        self.drain_node_link(node);
        answer
    }

    /// The Edge slot whose connection of `node` is `conn`, if it is live.
    fn link_slot(&self, node: usize, conn: ConnId) -> Option<usize> {
        self.nodes[node]
            .link
            .iter()
            .position(|l| matches!(l, Link::Connected(nc) if nc.conn == conn))
    }

    /// The run calls its provider: the checkers hear of it and the call's
    /// plan is drawn.
    fn call_provider(&mut self, node: usize, serial: u64) {
        let now = self.now;
        let faults = self.faults_on();
        let double = self.bugs.contains(&super::Bug::DoubleProviderCall);
        let process = self.nodes[node].process;
        let Some(run) = self.nodes[node].runs.get(&serial) else {
            return;
        };
        let (provider, stall_ms, run_id) = (
            run.provider,
            run.stall_timeout_ms,
            run.machine.machine().run_id(),
        );
        let Some(conn) = run.conn else {
            return;
        };
        let generation = nconn(&mut self.nodes, node, self.cur)
            .and_then(|nc| nc.link.machine().generation())
            .unwrap_or(0);
        self.checkers[self.cur].provider_called(conn, run_id);
        if double {
            self.checkers[self.cur].provider_called(conn, run_id);
        }
        if let Some((record, continues)) = self.run_records.remove(&(conn, run_id)) {
            // R-PARK-2: one provider call per durable response (R-CONT-1:
            // but an attempt that continues the answer so far).
            self.checkers[0].durable_provider_called(
                &self.journal,
                &record,
                continues,
                (generation, run_id),
            );
        }
        self.stats.provider_calls += 1;
        let stall = effective_stall_timeout(stall_ms).unwrap_or(Duration::from_secs(1));
        let plan = if faults {
            CallPlan::faulty(
                &mut self.rng,
                &self.cfg.provider,
                stall,
                self.cfg.close_grace,
            )
        } else {
            CallPlan::healthy(&mut self.rng, stall, self.cfg.close_grace)
        };
        if let Some(run) = self.nodes[node].runs.get_mut(&serial) {
            run.call = Some(Call {
                provider,
                plan,
                stage: CallStage::NotStarted,
                canceled: false,
                returned: false,
            });
        }
        self.schedule(
            now + plan.start_delay,
            Event::RunStep {
                node,
                process,
                run: serial,
            },
        );
    }

    fn run_of(&mut self, node: usize, process: u64, serial: u64) -> Option<&mut SimRun> {
        let n = &mut self.nodes[node];
        if n.process != process || !n.up {
            return None;
        }
        n.runs.get_mut(&serial)
    }

    /// The run's provider call takes its next step.
    pub(super) fn run_step(&mut self, node: usize, process: u64, serial: u64) {
        let now = self.now;
        let again = Event::RunStep {
            node,
            process,
            run: serial,
        };
        let Some(run) = self.run_of(node, process, serial) else {
            return;
        };
        let Some(call) = run.call.as_ref() else {
            return;
        };
        if call.canceled || call.returned || call.stage == CallStage::Idle {
            return;
        }
        let provider = call.provider;
        let gap = call.plan.token_gap.max(Duration::from_millis(1));
        if !run.machine.machine().is_calling() {
            return;
        }
        let frozen_until = self.frozen_until[provider];
        if frozen_until > now {
            // Frozen: nothing comes out until the freeze ends.
            self.schedule(frozen_until, again);
            return;
        }
        let Some(run) = self.run_of(node, process, serial) else {
            return;
        };
        if run.machine.machine().read_batch() == 0 {
            // R-PARK-1: a full buffer puts the provider off; acks (or the
            // run's end) make room. Nothing is dropped.
            self.stats.park_paused += 1;
            self.schedule(now + gap, again);
            return;
        }
        let run_id = run.machine.machine().run_id();
        let prompt_tokens = run.prompt_tokens;
        let Some(call) = run.call.as_mut() else {
            return;
        };
        let Some((event, next)) = call.advance() else {
            return;
        };
        let token = call.token();
        let usage = match prompt_tokens {
            Some(prompt) => Usage::tokens(prompt, u64::from(call.plan.tokens)),
            None => Usage::tokens(1, 1),
        };
        let returned = matches!(event, ProviderEvent::Returned(_));
        if returned {
            call.returned = true;
        }
        if super::is_http_5xx(&event) {
            self.stats.provider_5xx += 1;
        }
        if let Some(after) = next {
            self.schedule(now + after, again);
        }
        let frame = frame_of(event, run_id, token, usage);
        self.run_input(node, serial, NodeRunInput::Provider(vec![frame]));
        self.drain_node_link(node);
    }

    /// A cancel reaches the run's provider (R-WD-2). A run that is not
    /// durable hears the watchdog's cancel only now: its provider was read
    /// meanwhile, and the watchdog fenced what it produced (R-WD-6).
    pub(super) fn run_cancel(&mut self, node: usize, process: u64, serial: u64) {
        let Some(run) = self.run_of(node, process, serial) else {
            return;
        };
        if run.durable.is_none() && run.machine.machine().is_calling() {
            self.run_input(node, serial, NodeRunInput::CancelProvider);
            return;
        }
        self.cancel_landed(node, serial);
    }

    /// The cancel reached the provider: its call returns after the plan's
    /// delay, or never.
    fn cancel_landed(&mut self, node: usize, serial: u64) {
        let now = self.now;
        let process = self.nodes[node].process;
        let Some(call) = self.nodes[node]
            .runs
            .get_mut(&serial)
            .and_then(|r| r.call.as_mut())
        else {
            return;
        };
        if call.canceled || call.returned {
            return;
        }
        call.canceled = true;
        call.stage = CallStage::Idle;
        if let Some(after) = call.plan.return_after_cancel {
            self.schedule(
                now + after,
                Event::RunReturn {
                    node,
                    process,
                    run: serial,
                },
            );
        }
    }

    /// A canceled call returns: the run reports it (R-WD-4).
    pub(super) fn run_return(&mut self, node: usize, process: u64, serial: u64) {
        let Some(run) = self.run_of(node, process, serial) else {
            return;
        };
        let Some(call) = run.call.as_mut() else {
            return;
        };
        if call.returned {
            return;
        }
        call.returned = true;
        self.run_input(node, serial, NodeRunInput::ProviderStopped);
        self.drain_node_link(node);
    }

    /// A run's park timer (R-PARK-1).
    pub(super) fn run_timer(&mut self, node: usize, process: u64, serial: u64) {
        let now = self.now;
        let Some(run) = self.run_of(node, process, serial) else {
            return;
        };
        run.timer = None;
        run.machine.handle_timeout(now);
        self.drain_run(node, serial);
    }

    /// The connection's machine ended a run (R-WD-3, R-WD-6): the checkers
    /// hear its one terminal.
    pub(super) fn link_ended_run(&mut self, conn: ConnId, run_id: RunId, terminal: &RunTerminal) {
        self.checkers[self.cur].node_terminal(conn, run_id, terminal);
        if let RunTerminal::Failed(f) = terminal
            && f.code == FailureCode::ResponseStalled
        {
            self.stats.stalls += 1;
            self.checkers[self.cur].observation_seq(conn, f.health_observation_seq);
            self.checkers[self.cur].stall_seq_issued(conn, f.health_observation_seq);
        }
    }

    /// The connection's machine ended run `run_id` on `conn` without the
    /// provider's own terminal: the run writes the machine's.
    pub(super) fn run_ended_by_link(
        &mut self,
        node: usize,
        conn: ConnId,
        run_id: RunId,
        terminal: RunTerminal,
    ) {
        if let Some(serial) = self.attached_run(node, conn, run_id) {
            self.run_hears_later(node, serial, NodeRunInput::Terminal(terminal), None);
        }
    }

    /// Feed `input` to a run: a durable run hears it at once; any other,
    /// while its provider call is being read, after the call's cancel
    /// latency (the control channel's hop) or `lag` (the Edge's reset
    /// still on its way behind the `Cancel` frame), reading its provider
    /// meanwhile.
    /// A provider output offered then raced the connection machine's end
    /// of the run, and the watchdog fences it (R-WD-6).
    fn run_hears_later(
        &mut self,
        node: usize,
        serial: u64,
        input: NodeRunInput<RunEventKind>,
        lag: Option<Duration>,
    ) {
        let process = self.nodes[node].process;
        let Some(run) = self.nodes[node].runs.get(&serial) else {
            return;
        };
        let hop = match (&run.durable, &run.call) {
            (None, Some(call)) if !call.returned && !call.canceled => {
                Some(lag.unwrap_or(call.plan.cancel_latency))
            }
            _ => None,
        };
        match hop {
            Some(hop) => self.schedule(
                self.now + hop,
                Event::RunHears {
                    node,
                    process,
                    run: serial,
                    input: Box::new(input),
                },
            ),
            None => self.run_input(node, serial, input),
        }
    }

    /// What a run that is not durable hears late (see
    /// [`Self::run_hears_later`]).
    pub(super) fn run_hears(
        &mut self,
        node: usize,
        process: u64,
        serial: u64,
        input: NodeRunInput<RunEventKind>,
    ) {
        if self.run_of(node, process, serial).is_none() {
            return;
        }
        self.run_input(node, serial, input);
        self.drain_node_link(node);
    }

    /// The connection's machine stops run `run_id`'s provider call (R-WD-2).
    /// A durable run stops reading it at once (its control channel
    /// delivers the cancel before any further provider output: were output
    /// kept after the claim, a run that parks before the cancel lands
    /// would keep output after the frames the claim fenced, R-PARK-2);
    /// any other run hears it after the cancel's latency, reading the
    /// provider meanwhile, which is the race R-WD-6 fences.
    pub(super) fn run_cancel_provider(&mut self, node: usize, conn: ConnId, run_id: RunId) {
        let Some(serial) = self.attached_run(node, conn, run_id) else {
            return;
        };
        let process = self.nodes[node].process;
        let Some(run) = self.nodes[node].runs.get(&serial) else {
            return;
        };
        if run.durable.is_some() {
            self.run_input(node, serial, NodeRunInput::CancelProvider);
            return;
        }
        let Some(latency) = run.call.as_ref().map(|c| c.plan.cancel_latency) else {
            return;
        };
        self.schedule(
            self.now + latency,
            Event::RunCancel {
                node,
                process,
                run: serial,
            },
        );
    }

    /// The node's connection `conn` ended: each run on it hears so (a
    /// durable one parks, R-PARK-1; any other ends, R-DISC-1).
    pub(super) fn runs_lose(&mut self, node: usize, conn: ConnId) {
        let serials: Vec<u64> = self.nodes[node]
            .runs
            .iter()
            .filter(|(_, r)| r.conn == Some(conn) || r.adopting.is_some_and(|(c, _)| c == conn))
            .map(|(s, _)| *s)
            .collect();
        for serial in serials {
            self.run_input(node, serial, NodeRunInput::LinkGone);
        }
    }

    /// An Edge can use a parked run no more (R-PARK-1): its machine
    /// decides whether it ends.
    pub(super) fn run_cancel_parked(&mut self, node: usize, c: &iop_wire::CancelParked) {
        let found = self.nodes[node]
            .runs
            .iter()
            .find(|(_, r)| {
                r.durable
                    .as_ref()
                    .is_some_and(|(k, resp)| *k == c.key && *resp == c.response_id)
            })
            .map(|(s, _)| *s);
        if let Some(serial) = found {
            self.stats.parked_released += 1;
            self.run_input(node, serial, NodeRunInput::CancelParked);
        }
    }

    /// The Edge acknowledged a durable run's frames (R-PARK-1).
    pub(super) fn node_run_ack(&mut self, node: usize, conn: ConnId, run_id: RunId, through: u64) {
        if let Some(serial) = self.attached_run(node, conn, run_id) {
            self.run_input(node, serial, NodeRunInput::Acked(through));
        }
    }

    /// The Edge reset run `run_id`'s stream on `conn` (the world carries a
    /// reset as the `Cancel` control frame).
    pub(super) fn run_reset_by_edge(&mut self, node: usize, conn: ConnId, run_id: RunId) {
        if let Some(serial) = self.attached_run(node, conn, run_id) {
            // The reset travels on the run's own stream, apart from the
            // `Cancel` frame: it arrives up to a one-way delay later.
            let lag = self.net.delay(&mut self.rng, node);
            self.run_hears_later(
                node,
                serial,
                NodeRunInput::EdgeEnded(EdgeSignal::Reset),
                Some(lag),
            );
        }
    }

    /// An Edge asks to adopt a parked run on `conn` (R-PARK-2): the run's
    /// machine decides.
    pub(super) fn node_adopt(&mut self, node: usize, conn: ConnId, request: AdoptRequest) {
        let found = self.nodes[node]
            .runs
            .iter()
            .find(|(_, r)| {
                r.durable
                    .as_ref()
                    .is_some_and(|(k, resp)| *k == request.key && *resp == request.response_id)
            })
            .map(|(s, _)| *s);
        let Some(serial) = found.filter(|s| {
            self.nodes[node]
                .runs
                .get(s)
                .is_some_and(|r| r.adopting.is_none())
        }) else {
            self.stats.adoptions_refused += 1;
            self.transmit(
                conn,
                Dir::NodeToEdge,
                StreamKey::Run(request.run_id),
                Payload::RunReset {
                    run_id: request.run_id,
                },
            );
            return;
        };
        if let Some(run) = self.nodes[node].runs.get_mut(&serial) {
            run.adopting = Some((conn, request.run_id));
        }
        self.run_input(
            node,
            serial,
            NodeRunInput::Adopt(Adoption {
                run_id: request.run_id,
                resume_after_frame: request.resume_after_frame,
                stall_timeout_ms: request.response_stall_timeout_ms,
                deadline_ms: request.deadline_ms,
                attached_closing: false,
            }),
        );
        self.drain_node_link(node);
    }

    /// The node's durable runs a registration reports (R-PARK-2).
    pub(super) fn parked_reports(&self, node: usize) -> Vec<ParkedRun> {
        let runs: Vec<(ParkState, ParkedRun)> = self.nodes[node]
            .runs
            .values()
            .filter_map(|r| {
                let (key, response_id) = r.durable.as_ref()?;
                let summary = r.machine.machine().park_summary()?;
                let state = r.machine.machine().park_state()?;
                Some((
                    state,
                    ParkedRun {
                        key: *key,
                        response_id: response_id.clone(),
                        adapter: AdapterKind::Mock,
                        target: r.target.clone(),
                        first_kept_frame: summary.first_kept,
                        last_frame: summary.last,
                        ended: summary.ended,
                    },
                ))
            })
            .collect();
        select_reports(
            ReportScope::Registration,
            runs.iter().map(|(state, run)| (*state, run)),
        )
    }
}
