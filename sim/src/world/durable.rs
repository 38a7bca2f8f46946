//! Durable responses in the world (SPEC §6): the Edge's journal traffic,
//! the restart takeover, crash points, zombies, and clients that leave,
//! resume and cancel.
//!
//! * A seeded share of client requests is durable. The Edge creates the
//!   record first (a store write like any other); once it is durable the
//!   request's core machine starts with `journal: Some(..)` and every
//!   `RequestOutput::Journal` it emits goes to the simulated store
//!   ([`crate::journal_store`]); the answer comes back as
//!   `RequestInput::Journaled` after the store's sync and the way back.
//! * A client of a durable request may leave: the request goes on (the
//!   machine ignores `ClientDisconnected`). It, or a client that lost its
//!   Edge, may resume: it reads the events after the last one it saw from
//!   the store, then follows the record, receiving each event once it is
//!   durable, then the terminal. Some clients cancel (`RequestInput::Cancel`).
//! * At each Edge start every record without a terminal is taken over
//!   (R-TAKE-1) by the Edge's custody, the core's machine (see
//!   `custody.rs`): this module only routes the store's answers to it.
//! * An Edge crash is a crash point of the store (see
//!   [`crate::journal_store`]); lost writes may come back as zombies,
//!   while the Edge is down or shortly after its next start.
//! * The end's crash point (R-TAKE-1, R-JRN-3): where the seed says, an
//!   Edge dies between the durable write of a record's end (the append
//!   holding its run's `Completed`) and the write of its terminal, so a
//!   takeover finds an answer whole in the journal with no terminal.

use std::collections::BTreeSet;
use std::time::Duration;

use iop_core::edge::admission::RequestId;
use iop_core::edge::durable::{JournalAck, JournalSpec, JournalWrite, encode_delivery};
use iop_core::edge::gate::GateBudget;
use iop_core::edge::request::{Delivery, RequestInput, RequestSpec};
use iop_core::ids::ProviderId;
use iop_core::journal::{
    CreateOutcome, JournalApi, JournalError, NewRecord, RecordStatus, fingerprint, idempotency_hash,
};

use super::{EdgeRequest, Event, World};
use crate::config::PPM;
use crate::invariants::journal::{delivered_status, journaled_end};
use crate::journal_store::{JournalOp, OpKind, OpResult, PendingWrite, Writer};
use crate::trace::RequestBegin;

/// The Unix time of virtual time zero, milliseconds (what the driver
/// stamps on terminals and records).
const UNIX_EPOCH_OFFSET_MS: u64 = 1_800_000_000_000;

/// The most times one client resumes.
const MAX_RESUMES: u32 = 3;

/// A durable request waiting for its record to be created.
#[derive(Debug)]
pub(super) struct PendingCreate {
    pub(super) record: String,
    pub(super) pool: Vec<ProviderId>,
    pub(super) budget: GateBudget,
    /// The client left before it learnt the response id.
    pub(super) client_left: bool,
    /// Its client's `Idempotency-Key`.
    pub(super) key: String,
    /// A client's request sent again with its key (R-IDEM-1): the record
    /// that client followed until now.
    pub(super) retry_of: Option<String>,
}

/// Where the client of a durable response is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ClientState {
    /// On the request's own stream.
    Attached {
        incarnation: u64,
        request_id: RequestId,
    },
    /// Gone (it left, or its Edge died); it may resume.
    Away,
    /// Resumed on this incarnation and following the record.
    Following { incarnation: u64 },
    /// It received the terminal, or gave up.
    Done,
}

/// The client of one durable response, as the client knows itself.
#[derive(Debug)]
pub(super) struct DurableClient {
    pub(super) state: ClientState,
    /// The last event number it saw.
    pub(super) received: u64,
    pub(super) resumes_left: u32,
    /// Its `Idempotency-Key` (every durable client sends one): a client
    /// that lost its stream before any event never learnt the response
    /// id, so it sends its request again with this key (R-IDEM-1).
    pub(super) key: String,
    /// Its request's pool (the same request again).
    pub(super) pool: Vec<ProviderId>,
    /// It already put a retry off once (a client's backoff).
    pub(super) backed_off: bool,
}

impl World {
    /// Virtual time as the Unix milliseconds a driver would stamp.
    pub(super) fn unix_ms(&self) -> u64 {
        UNIX_EPOCH_OFFSET_MS + self.now.as_micros() / 1000
    }

    // ---- The store's traffic ----------------------------------------------

    /// A writer's op goes to the store's queue.
    pub(super) fn journal_submit(&mut self, writer: Writer, op: JournalOp) {
        self.checkers[0].journal_submitted(&writer, &op);
        self.recorder
            .world_line(&("journal_submit", &writer, op.kind(), op.record_id()));
        let record = op.record_id().to_owned();
        let kind = op.op_kind();
        match self.journal.submit(
            self.cur,
            PendingWrite {
                writer: writer.clone(),
                op,
            },
        ) {
            Ok(_) => self.pump_journal(),
            Err(refused) => self.answer_later(writer, record, kind, OpResult::Refused(refused)),
        }
    }

    /// Start the next sync if the store is free and writes wait.
    fn pump_journal(&mut self) {
        if let Some(generation) = self.journal.begin_sync(self.cur) {
            let p = self.cfg.journal;
            let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
            let latency = Duration::from_micros(self.rng.range(us(p.sync_min), us(p.sync_max)));
            self.schedule(
                self.now + latency,
                Event::JournalSync {
                    edge: self.cur,
                    generation,
                },
            );
        }
    }

    fn answer_later(&mut self, writer: Writer, record: String, kind: OpKind, result: OpResult) {
        let ack_us = u64::try_from(self.cfg.journal.ack_max.as_micros()).unwrap_or(0);
        let at = self.now + Duration::from_micros(self.rng.range(0, ack_us));
        self.schedule(
            at,
            Event::JournalAnswer {
                writer,
                record,
                kind,
                result: Box::new(result),
            },
        );
    }

    /// A sync ended: its writes are durable; their answers travel back.
    /// Or the Edge dies at this crash point, or at the end's.
    pub(super) fn journal_sync_done(&mut self, generation: u64) {
        let now_unix = self.unix_ms();
        if self.faults_on() && self.armed_terminal_in_sync(generation) {
            // The end's crash point, once its request wrote the terminal:
            // the sync that would make it durable never completes.
            self.stats.end_crash_points += 1;
            self.crash_edge(Some(false));
            return;
        }
        if self.faults_on()
            && self.edges[self.cur].is_some()
            && self.rng.chance(self.cfg.journal.crash_point_ppm)
        {
            self.stats.crash_points += 1;
            if self.rng.chance(PPM / 2) {
                self.crash_after_sync(generation, now_unix);
            } else {
                // Before the sync completed: the batch is lost.
                self.crash_edge(Some(false));
            }
            return;
        }
        // The end's crash point (R-TAKE-1, R-JRN-3): this sync makes a
        // record's end durable; the Edge dies before its terminal is
        // written. It draws from its own stream: where it does not fire,
        // the world runs as without it.
        if self.cfg.journal.end_crash_ppm > 0 && self.faults_on() && self.edges[self.cur].is_some()
        {
            let ends = self.ends_in_sync(generation);
            if !ends.is_empty() && self.end_crash_rng.chance(self.cfg.journal.end_crash_ppm) {
                if self.end_crash_rng.chance(PPM / 2) {
                    self.stats.end_crash_points += 1;
                    self.crash_after_sync(generation, now_unix);
                    return;
                }
                // Or once its request wrote the terminal, before that
                // write is durable (above, at its sync).
                if let Some(edge) = &mut self.edges[self.cur] {
                    edge.end_crash_armed.extend(ends);
                }
            }
        }
        let answers = if self.journal_down()
            || self.faults_on() && self.rng.chance(self.cfg.journal.sync_failure_ppm)
        {
            self.stats.sync_failures += 1;
            self.journal.fail_sync(self.cur, generation)
        } else {
            self.journal.complete_sync(self.cur, generation, now_unix)
        };
        let mut touched = BTreeSet::new();
        for (write, result) in answers {
            self.stats.journal_writes += 1;
            self.recorder.world_line(&(
                "journal_applied",
                &write.writer,
                write.op.kind(),
                write.op.record_id(),
                result.accepted(),
            ));
            touched.insert(write.op.record_id().to_owned());
            if let JournalOp::Finish { id, terminal, .. } = &write.op
                && result.accepted()
            {
                if let Some(edge) = &mut self.edges[self.cur] {
                    edge.end_crash_armed.remove(id);
                }
                if matches!(write.writer, Writer::Custody { .. })
                    && terminal.status != RecordStatus::Incomplete
                {
                    self.stats.journaled_ends_taken += 1;
                }
            }
            let kind = write.op.op_kind();
            let record = write.op.record_id().to_owned();
            self.answer_later(write.writer, record, kind, result);
        }
        self.pump_journal();
        self.notify_followers(&touched);
    }

    /// The Edge dies after the running sync completed, before its answers
    /// go out: durable, never acknowledged (no writer is told, no follower
    /// on this Edge either). A follower on another Edge reads the shared
    /// store: it sees what became durable.
    fn crash_after_sync(&mut self, generation: u64, now_unix: u64) {
        let applied = self.journal.complete_sync(self.cur, generation, now_unix);
        self.stats.journal_unacked += applied.len() as u64;
        let touched: BTreeSet<String> = applied
            .iter()
            .map(|(w, _)| w.op.record_id().to_owned())
            .collect();
        self.crash_edge(None);
        self.notify_followers(&touched);
    }

    /// The records whose end (the answer's last journal event) an append
    /// of the running sync carries.
    fn ends_in_sync(&self, generation: u64) -> BTreeSet<String> {
        self.journal
            .running_writes(self.cur, generation)
            .filter_map(|w| match &w.op {
                JournalOp::Append { id, events, .. }
                    if events.iter().any(|e| journaled_end(&e.payload).is_some()) =>
                {
                    Some(id.clone())
                }
                _ => None,
            })
            .collect()
    }

    /// Whether the running sync carries a request's terminal of a record
    /// armed at the end's crash point.
    fn armed_terminal_in_sync(&self, generation: u64) -> bool {
        let Some(edge) = &self.edges[self.cur] else {
            return false;
        };
        !edge.end_crash_armed.is_empty()
            && self.journal.running_writes(self.cur, generation).any(|w| {
                matches!(
                    (&w.writer, &w.op),
                    (Writer::Request { .. }, JournalOp::Finish { id, .. })
                        if edge.end_crash_armed.contains(id)
                )
            })
    }

    /// The store's answer reached its writer (if the writer's process is
    /// still the one that asked).
    pub(super) fn journal_answer(
        &mut self,
        writer: Writer,
        record: String,
        kind: OpKind,
        result: OpResult,
    ) {
        if self.edges[self.cur].as_ref().map(|e| e.incarnation) != Some(writer.incarnation()) {
            // Durable but unacknowledged: the process that asked is gone.
            return;
        }
        match (writer, kind) {
            (Writer::Request { request_id, .. }, OpKind::Create) => {
                self.record_created(request_id, result);
            }
            (Writer::Request { request_id, .. }, _) => {
                let ack = match (kind, result) {
                    (_, OpResult::Refused(e)) => JournalAck::Refused(e),
                    (OpKind::Finish, _) => JournalAck::Finished,
                    _ => JournalAck::Appended,
                };
                self.request_input(request_id, RequestInput::Journaled(ack));
            }
            (Writer::Custody { incarnation }, kind) => {
                self.custody_answer(incarnation, record, kind, result);
            }
        }
    }

    /// A request's journal write (`RequestOutput::Journal`).
    pub(super) fn request_journal_write(
        &mut self,
        incarnation: u64,
        request_id: RequestId,
        write: JournalWrite,
    ) {
        let op = match write {
            JournalWrite::Append {
                response_id,
                epoch,
                events,
            } => JournalOp::Append {
                id: response_id,
                epoch,
                events,
            },
            JournalWrite::Finish {
                response_id,
                epoch,
                mut terminal,
            } => {
                // The driver stamps the wall-clock time (core reads none).
                terminal.at_unix_ms = self.unix_ms();
                JournalOp::Finish {
                    id: response_id,
                    epoch,
                    terminal,
                }
            }
        };
        self.journal_submit(
            Writer::Request {
                incarnation,
                request_id,
            },
            op,
        );
    }

    /// A zombie write reaches the store: a dead owner's, late.
    pub(super) fn journal_zombie(&mut self, write: PendingWrite) {
        let now_unix = self.unix_ms();
        let open = self
            .journal
            .record(write.op.record_id())
            .is_some_and(|r| r.meta.terminal.is_none());
        let result = self.journal.apply_now(&write, now_unix);
        self.stats.zombies += 1;
        if result.accepted() {
            self.stats.zombies_accepted += 1;
        } else if matches!(result, OpResult::Refused(JournalError::Fenced { .. })) {
            self.stats.zombies_fenced += 1;
            if open {
                // Only the epoch stood between it and the record.
                self.stats.zombies_fenced_open += 1;
            }
        }
        self.recorder.world_line(&(
            "journal_zombie",
            &write.writer,
            write.op.kind(),
            write.op.record_id(),
            result.accepted(),
        ));
        let touched = BTreeSet::from([write.op.record_id().to_owned()]);
        self.notify_followers(&touched);
    }

    /// The Edge process died: the store's crash point, zombies, and the
    /// durable clients it served. `next_start` is when it comes back.
    pub(super) fn journal_crash(
        &mut self,
        incarnation: u64,
        next_start: iop_core::Instant,
        sync_completed: Option<bool>,
    ) {
        self.checkers[0].journal_edge_lost();
        if self.edges.len() > 1 {
            self.journal_owner_lost();
        }
        // Writes that became durable at the crash, unanswered: followers on
        // other Edges read the shared store and see them.
        let mut touched = BTreeSet::new();
        if self.journal.is_busy() {
            let survives = match sync_completed {
                Some(completed) => completed,
                None => self.rng.chance(self.cfg.journal.sync_survives_ppm),
            };
            let now_unix = self.unix_ms();
            let outcome = self.journal.crash(self.cur, survives, now_unix);
            self.stats.journal_unacked += outcome.durable_unacked as u64;
            touched.extend(outcome.touched.iter().cloned());
            self.stats.journal_lost += outcome.lost.len() as u64;
            let p = self.cfg.journal;
            for write in outcome.lost {
                // A create never comes back: the record it would make has
                // no owner that could know it (see docs/simulation.md).
                if matches!(write.op, JournalOp::Create(_)) || !self.rng.chance(p.zombie_ppm) {
                    continue;
                }
                let at = if self.rng.chance(p.zombie_late_ppm) {
                    let late_us = u64::try_from(p.zombie_late_max.as_micros()).unwrap_or(0);
                    next_start + Duration::from_micros(self.rng.range(0, late_us))
                } else {
                    let down_us = (next_start - self.now).as_micros() as u64;
                    self.now + Duration::from_micros(self.rng.range(0, down_us))
                };
                self.schedule(at, Event::Zombie(Box::new(write)));
            }
        }
        // The records this Edge leaves with their end journaled and no
        // terminal: a takeover must end them as the journal says (R-TAKE-1).
        let me = self.edge_id(self.cur);
        let open_ends = self
            .journal
            .unfinished()
            .into_iter()
            .filter(|m| m.owner == me)
            .filter(|m| {
                self.journal
                    .record(&m.id)
                    .and_then(|r| r.events.last())
                    .is_some_and(|e| journaled_end(&e.payload).is_some())
            })
            .count();
        self.stats.journaled_ends_open += open_ends as u64;
        let gone: Vec<String> = self
            .durable_clients
            .iter()
            .filter(|(_, c)| match c.state {
                ClientState::Attached { incarnation: i, .. }
                | ClientState::Following { incarnation: i } => i == incarnation,
                ClientState::Away | ClientState::Done => false,
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            self.client_away(&id);
        }
        self.notify_followers(&touched);
    }

    // ---- Durable requests -----------------------------------------------------

    /// A durable client request arrives: create its record first. A
    /// client's request sent again names its key and the record it
    /// followed (`retry`); a new client's key is its first record's id.
    pub(super) fn durable_arrival(
        &mut self,
        request_id: RequestId,
        pool: Vec<ProviderId>,
        budget: GateBudget,
        retry: Option<(String, String)>,
    ) {
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let incarnation = edge.incarnation;
        let record = format!("resp-{incarnation}-{request_id}");
        let (key, retry_of) = match retry {
            Some((key, of)) => (key, Some(of)),
            None => (format!("key-{record}"), None),
        };
        // Its route: the pool, and whether it continues answers (R-CONT-1).
        let continues = self.rng.chance(self.cfg.journal.continue_ppm);
        self.routes.insert(
            record.clone(),
            super::custody::Route {
                pool: pool.clone(),
                continues,
            },
        );
        self.checkers[0].durable_route(&record, continues);
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        edge.pending_creates.insert(
            request_id,
            PendingCreate {
                record: record.clone(),
                pool,
                budget,
                client_left: false,
                key: key.clone(),
                retry_of,
            },
        );
        // R-TEN-2: what a takeover of the record is charged by (its key,
        // model and stored request), as the shell reads it from the record.
        self.tenant_record(request_id, &record);
        if self.edges[self.cur]
            .as_ref()
            .is_some_and(|e| e.custody.refuses_durable())
        {
            // R-TEN-2, R-JRN-6: records left open wait for room in the
            // custody: refused (503) before the store is asked, as the
            // shell's `Durable::create` does.
            self.record_created(request_id, OpResult::Refused(JournalError::Backlog));
            return;
        }
        let new = NewRecord {
            id: record.clone(),
            principal: "sim".into(),
            api: JournalApi::ChatCompletions,
            model: "sim".into(),
            // The same request body each time its client sends it.
            fingerprint: fingerprint("/v1/chat/completions", key.as_bytes()),
            idempotency_key: Some(idempotency_hash("sim", &key)),
            background: false,
            request: Vec::new(),
            created_unix_ms: self.unix_ms(),
            owner: self.edge_id(self.cur),
            key_id: "sim".into(),
        };
        self.journal_submit(
            Writer::Request {
                incarnation,
                request_id,
            },
            JournalOp::Create(new),
        );
    }

    /// The record of a durable request is durable (or was refused): start
    /// its request machine.
    fn record_created(&mut self, request_id: RequestId, result: OpResult) {
        let park_grace = self.cfg.journal.park_grace;
        let flush = self.cfg.durable_flush_bound();
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let Some(pending) = edge.pending_creates.remove(&request_id) else {
            return;
        };
        let incarnation = edge.incarnation;
        let continuation = super::custody::continues(&self.routes, &pending.record);
        if let (OpResult::Created(CreateOutcome::Existing(meta)), Some(of)) =
            (&result, &pending.retry_of)
        {
            // R-IDEM-1: the key names a live response: the client follows
            // it from its first event, and nothing runs again.
            self.stats.idempotent_existing += 1;
            self.tenant_release_unstarted(request_id);
            self.client_follows(of, meta.id.clone(), incarnation);
            return;
        }
        if !matches!(result, OpResult::Created(CreateOutcome::Create(_))) {
            // R-JRN-5: a full store refuses new durable requests (503);
            // so does an Edge whose custody is behind (R-TEN-2).
            let why = match result {
                OpResult::Refused(JournalError::Backlog) => {
                    self.stats.durable_backlog_refused += 1;
                    "journal_backlog"
                }
                _ => "journal_refused",
            };
            self.stats.failed += 1;
            *self.stats.failures.entry(why.into()).or_default() += 1;
            // It called no provider: its tenant's hold is released.
            self.tenant_release_unstarted(request_id);
            if let Some(of) = &pending.retry_of
                && let Some(client) = self.durable_clients.get_mut(of)
            {
                client.state = ClientState::Done;
            }
            return;
        }
        let record = pending.record.clone();
        let pool_of_client = pending.pool.clone();
        let client_left = pending.client_left;
        let machine = self.new_request(
            RequestSpec {
                request_id,
                pool: pending.pool.clone(),
                budget: pending.budget,
                tunnel_api: None,
                tunnel_providers: Vec::new(),
                journal: Some(JournalSpec {
                    response_id: pending.record.clone(),
                    epoch: 1,
                    batch_until_terminal: false,
                }),
                // Runs park on their node in worlds that say so (R-PARK-1);
                // 0: a lost connection after commit ends the request.
                park_grace_ms: super::duration_ms(park_grace),
                continuation,
                prompt_tokens: self.tenant_prompt_tokens(request_id),
            },
            RequestBegin::New,
        );
        self.core_bugs.plant_request(machine.machine());
        let deadline = machine.machine().gate().deadline() + flush;
        let attached = !client_left;
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        edge.requests.insert(
            request_id,
            EdgeRequest {
                machine,
                running: None,
                admitted_with: None,
                durable: Some(record.clone()),
                client_attached: attached,
            },
        );
        self.stats.requests += 1;
        self.stats.durable_requests += 1;
        self.checkers[self.cur].request_opened((incarnation, request_id), deadline);
        self.checkers[0].durable_client_opened(&record);
        // A client's request sent again: it follows this record now.
        let (resumes_left, backed_off) = match &pending.retry_of {
            Some(of) => {
                self.stats.idempotent_fresh += 1;
                self.durable_clients
                    .remove(of)
                    .map_or((MAX_RESUMES, true), |c| (c.resumes_left, c.backed_off))
            }
            None => (MAX_RESUMES, false),
        };
        let state = if attached {
            ClientState::Attached {
                incarnation,
                request_id,
            }
        } else {
            ClientState::Done
        };
        self.durable_clients.insert(
            record,
            DurableClient {
                state,
                received: 0,
                resumes_left,
                key: pending.key,
                pool: pool_of_client,
                backed_off,
            },
        );
        self.drive_request(request_id);
    }

    /// A delivery of a durable request for its first client: checked
    /// against the journal (R-JRN-1, R-JRN-2). `false` if the client is
    /// gone and the delivery goes nowhere.
    pub(super) fn durable_delivery(&mut self, record: &str, delivery: &Delivery) -> bool {
        let Some(client) = self.durable_clients.get_mut(record) else {
            return false;
        };
        if !matches!(client.state, ClientState::Attached { .. }) {
            return false;
        }
        match delivery {
            Delivery::Event(_) | Delivery::Body(_) => {
                client.received += 1;
                let seq = client.received;
                let payload = encode_delivery(delivery);
                self.checkers[0].durable_client_event(&self.journal, record, Some(seq), &payload);
            }
            Delivery::Finish | Delivery::Fail { .. } => {
                client.state = ClientState::Done;
                if let Some(status) = delivered_status(delivery) {
                    self.checkers[0].durable_client_terminal(&self.journal, record, status);
                }
            }
            Delivery::Commit { .. } => {}
        }
        true
    }

    /// The client of a durable request leaves: the request goes on.
    /// Returns whether the request was durable.
    pub(super) fn durable_leave(&mut self, request_id: RequestId) -> bool {
        let Some(edge) = &mut self.edges[self.cur] else {
            return false;
        };
        if let Some(pending) = edge.pending_creates.get_mut(&request_id) {
            pending.client_left = true;
            return true;
        }
        let Some(r) = edge.requests.get_mut(&request_id) else {
            return false;
        };
        let Some(record) = r.durable.clone() else {
            return false;
        };
        let attached = self
            .durable_clients
            .get(&record)
            .is_some_and(|c| matches!(c.state, ClientState::Attached { .. }));
        // A client that already has its terminal (one from outside the
        // journal, after a refused write) is done, not away.
        if r.client_attached && attached {
            r.client_attached = false;
            self.stats.durable_left += 1;
            self.client_away(&record);
        }
        true
    }

    /// A durable request was fenced: another Edge took its record over
    /// (R-JRN-3). Its attached client reads on from the record, as every
    /// reader of a durable response does (it follows the journal, not
    /// the request): what it sees next is the new owner's (R-JRN-1).
    pub(super) fn durable_record_taken(&mut self, request_id: RequestId) {
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let incarnation = edge.incarnation;
        let Some(r) = edge.requests.get_mut(&request_id) else {
            return;
        };
        let Some(record) = r.durable.clone() else {
            return;
        };
        let attached = self.durable_clients.get(&record).is_some_and(|c| {
            c.state
                == ClientState::Attached {
                    incarnation,
                    request_id,
                }
        });
        if !(r.client_attached && attached) {
            return;
        }
        // The request's own stream ends without a terminal; its client
        // follows the record on this Edge.
        r.client_attached = false;
        self.stats.records_taken += 1;
        if let Some(c) = self.durable_clients.get_mut(&record) {
            c.state = ClientState::Following { incarnation };
        }
        self.recorder.world_line(&("record taken", &record));
        self.follow(&record);
    }

    /// A durable client cancels its response (`POST .../cancel`).
    pub(super) fn client_cancel(&mut self, incarnation: u64, request_id: RequestId) {
        if self.edges[self.cur].as_ref().map(|e| e.incarnation) != Some(incarnation) {
            return;
        }
        self.stats.durable_cancels += 1;
        self.request_input(request_id, RequestInput::Cancel);
    }

    /// A durable request's machine ended; `left_open`: without its
    /// record's terminal, the store having refused it too often
    /// (`Request::record_left_open`).
    pub(super) fn durable_request_ended(&mut self, record: &str, writer: &Writer, left_open: bool) {
        // A request fenced by a newer epoch (R-JRN-3) leaves the record to
        // that epoch's owner when the owner lives: two Edges' custodies
        // may both take a dead incarnation's record over, and the one
        // whose raise came second fences the first one's adopter.
        let owner_alive = self.checkers[0]
            .journal_owner(record)
            .filter(|owner| *owner != writer)
            .is_some_and(|owner| {
                self.slot_of(owner.incarnation())
                    .and_then(|slot| self.edges[slot].as_ref())
                    .is_some_and(|e| e.incarnation == owner.incarnation())
            });
        if owner_alive {
            return;
        }
        if self.checkers[0].journal_fenced(record) {
            // Another writer raised its epoch (a peer that saw its lease
            // expire, a dead custody's late raise): that writer ends it,
            // or a takeover does once its Edge is seen dead.
            let deadline = self.journal_up_at() + self.owner_lost_bound();
            self.checkers[0].journal_edge_started(&[record.to_owned()], deadline);
            return;
        }
        if left_open && let Writer::Request { incarnation, .. } = writer {
            // R-JRN-4: its Edge's custody ends it, at once (no run parks:
            // the request closed it), within the takeover's bound (a
            // write the store fails extends it).
            self.stats.records_left_open += 1;
            self.recorder.world_line(&("left open", record));
            // In an outage, from its end and the custody's pause; behind
            // the takeovers its custody runs already, one bound for each
            // round of them.
            let ahead = self
                .slot_of(*incarnation)
                .and_then(|slot| self.edges[slot].as_ref())
                .map_or(0, |e| e.custody.takeovers_ahead());
            let rounds = 1 + ahead / self.cfg.journal.custody_tasks.max(1);
            let deadline = self.journal_up_at()
                + self.cfg.takeover_bound() * u32::try_from(rounds).unwrap_or(u32::MAX);
            self.checkers[0].journal_edge_started(&[record.to_owned()], deadline);
            self.custody_input(
                *incarnation,
                iop_core::edge::custody::CustodyInput::RunLeftOpen(record.to_owned()),
            );
            return;
        }
        if self.checkers[0].durable_request_ended(&self.journal, record) {
            self.orphans.insert(record.to_owned());
        }
    }

    /// Whether every record without a terminal was left open by its
    /// request (a known core issue the drain does not wait for).
    pub(super) fn only_orphans_open(&self) -> bool {
        let open = self.journal.unfinished_count();
        open == 0
            || (open <= self.orphans.len()
                && self
                    .journal
                    .unfinished()
                    .iter()
                    .all(|m| self.orphans.contains(&m.id)))
    }

    // ---- Clients away, resuming, following --------------------------------------

    /// The client of `record` lost its stream: it may resume later.
    fn client_away(&mut self, record: &str) {
        let resume_ppm = self.cfg.journal.resume_ppm;
        let delay_max_ms = super::duration_ms(self.cfg.journal.resume_delay_max);
        let Some(client) = self.durable_clients.get_mut(record) else {
            return;
        };
        client.state = ClientState::Away;
        if client.resumes_left == 0 || !self.rng.chance(resume_ppm) {
            client.state = ClientState::Done;
            return;
        }
        client.resumes_left -= 1;
        let at = self.now + self.rng.millis(1, delay_max_ms.max(1));
        self.schedule(
            at,
            Event::ClientResume {
                record: record.to_owned(),
            },
        );
    }

    /// The client of `record` resumes after the last event it saw: the
    /// durable events it misses, then the live tail.
    pub(super) fn client_resume(&mut self, record: String) {
        let Some(client) = self.durable_clients.get(&record) else {
            return;
        };
        if client.state != ClientState::Away {
            return;
        }
        if client.received == 0 {
            // It never learnt the response id (that comes with the first
            // event): it sends its request again with its key. Half the
            // clients back off first, once, for up to twice the request
            // budget and the park window: a retry that comes after the
            // response ended (R-IDEM-1 decides on its end).
            if !client.backed_off && self.rng.chance(PPM / 2) {
                let longest = self.cfg.request_budget * 2 + self.cfg.park_window();
                let at = self.now + self.rng.millis(1, super::duration_ms(longest).max(1));
                if let Some(c) = self.durable_clients.get_mut(&record) {
                    c.backed_off = true;
                }
                self.schedule(at, Event::ClientResume { record });
                return;
            }
            return self.client_retry(record);
        }
        // Durable clients resume on any live Edge (SPEC §8).
        self.cur = self.client_edge();
        let Some(incarnation) = self.edges[self.cur].as_ref().map(|e| e.incarnation) else {
            // Connection refused: try again later.
            let at = self.now + self.rng.millis(10, 100);
            self.schedule(at, Event::ClientResume { record });
            return;
        };
        if self.journal.record(&record).is_none() {
            // Its record never became durable: nothing to resume.
            if let Some(c) = self.durable_clients.get_mut(&record) {
                c.state = ClientState::Done;
            }
            return;
        }
        self.stats.resumes += 1;
        if let Some(c) = self.durable_clients.get_mut(&record) {
            c.state = ClientState::Following { incarnation };
        }
        self.recorder.world_line(&("resume", &record));
        self.follow(&record);
        // Some resumed clients leave again.
        let following = self
            .durable_clients
            .get(&record)
            .is_some_and(|c| matches!(c.state, ClientState::Following { .. }));
        if following && self.rng.chance(PPM / 4) {
            let at = self.now + self.rng.millis(1, 500);
            self.schedule(
                at,
                Event::FollowerLeave {
                    record,
                    incarnation,
                },
            );
        }
    }

    /// The Edge died while the record of `pending` was being created: its
    /// client (unless it left) lost its stream before any event. A client
    /// sending its request again already is one; a new one becomes one.
    pub(super) fn creating_client_lost(&mut self, pending: PendingCreate) {
        if pending.client_left {
            return;
        }
        let of = pending.retry_of.unwrap_or_else(|| pending.record.clone());
        self.durable_clients
            .entry(of.clone())
            .or_insert_with(|| DurableClient {
                state: ClientState::Away,
                received: 0,
                resumes_left: MAX_RESUMES,
                key: pending.key,
                pool: pending.pool,
                backed_off: false,
            });
        self.client_away(&of);
    }

    /// The client of `record` sends its request again with its
    /// `Idempotency-Key`, to any live Edge (R-IDEM-1): the store answers
    /// with the response the key names, or, when that one failed before
    /// any event, creates a new one that runs afresh.
    fn client_retry(&mut self, record: String) {
        self.cur = self.client_edge();
        let Ok(budget) = GateBudget::new(self.cfg.max_attempts, self.cfg.request_budget) else {
            return;
        };
        let Some(edge) = &mut self.edges[self.cur] else {
            // Connection refused: try again later.
            let at = self.now + self.rng.millis(10, 100);
            self.schedule(at, Event::ClientResume { record });
            return;
        };
        let rid = edge.next_request_id;
        edge.next_request_id += 1;
        let Some(client) = self.durable_clients.get(&record) else {
            return;
        };
        let (key, pool) = (client.key.clone(), client.pool.clone());
        self.recorder.world_line(&("retry", &record, rid));
        if !self.tenant_admit(rid) {
            // Refused (429): it gives up.
            if let Some(c) = self.durable_clients.get_mut(&record) {
                c.state = ClientState::Done;
            }
            return;
        }
        self.stats.idempotent_retries += 1;
        self.durable_arrival(rid, pool, budget, Some((key, record)));
    }

    /// The client that followed `of` follows `record`, the response its
    /// key names, from its first event (R-IDEM-1).
    fn client_follows(&mut self, of: &str, record: String, incarnation: u64) {
        let Some(mut client) = self.durable_clients.remove(of) else {
            return;
        };
        client.state = ClientState::Following { incarnation };
        client.received = 0;
        self.durable_clients.insert(record.clone(), client);
        self.checkers[0].durable_client_opened(&record);
        self.follow(&record);
    }

    /// A resumed client leaves again.
    pub(super) fn follower_leave(&mut self, record: String, incarnation: u64) {
        if self
            .durable_clients
            .get(&record)
            .is_some_and(|c| c.state == ClientState::Following { incarnation })
        {
            self.client_away(&record);
        }
    }

    /// Every follower of a touched record receives what became durable.
    fn notify_followers(&mut self, touched: &BTreeSet<String>) {
        for record in touched {
            if self
                .durable_clients
                .get(record)
                .is_some_and(|c| matches!(c.state, ClientState::Following { .. }))
            {
                self.follow(record);
            }
        }
    }

    /// Deliver to the follower of `record` the durable events after the
    /// last one it saw, then the terminal if there is one.
    fn follow(&mut self, record: &str) {
        let Some(client) = self.durable_clients.get_mut(record) else {
            return;
        };
        let Some(stored) = self.journal.record(record) else {
            return;
        };
        let after = usize::try_from(client.received).unwrap_or(usize::MAX);
        for event in stored.events.iter().skip(after) {
            client.received = event.seq;
            self.stats.resumed_events += 1;
            self.checkers[0].durable_client_event(
                &self.journal,
                record,
                Some(event.seq),
                &event.payload,
            );
        }
        if let Some(terminal) = &stored.meta.terminal {
            client.state = ClientState::Done;
            self.checkers[0].durable_client_terminal(&self.journal, record, terminal.status);
        }
    }

    /// The first record a durable client still follows, with what the
    /// store holds of it (for a liveness failure's message).
    pub(super) fn waiting_follower(&self) -> Option<String> {
        let (record, client) = self.durable_clients.iter().find(|(record, c)| {
            matches!(c.state, ClientState::Following { .. }) && !self.orphans.contains(*record)
        })?;
        Some(match self.journal.record(record) {
            Some(stored) => format!(
                "{record} (seen {}, stored {}, terminal {:?})",
                client.received,
                stored.meta.last_seq,
                stored.meta.terminal.as_ref().map(|t| t.status)
            ),
            None => format!("{record} (seen {}, not in the store)", client.received),
        })
    }

    /// Whether no durable client is still following a record (but one its
    /// request left open, which never ends).
    pub(super) fn followers_done(&self) -> bool {
        !self.durable_clients.iter().any(|(record, c)| {
            matches!(c.state, ClientState::Following { .. }) && !self.orphans.contains(record)
        })
    }

    // ---- Takeover (R-TAKE-1) -------------------------------------------------

    /// An Edge incarnation started: every record without a terminal must
    /// end within its bound unless the Edge dies again first (the checker's
    /// deadline; the custody takes them over).
    ///
    /// Past the custody's part (B_takeover), a record may be handed to a
    /// request that writes it: where runs park, one that adopts its run
    /// (after the park window); where its route continues, one that
    /// continues its answer (R-CONT-1). That request has its budget and
    /// its terminal to write.
    pub(super) fn journal_edge_started(&mut self) {
        let window = self.cfg.park_window();
        let handed = self.cfg.request_budget + self.cfg.durable_flush_bound();
        let mut by_deadline: std::collections::BTreeMap<iop_core::Instant, Vec<String>> =
            std::collections::BTreeMap::new();
        let me = self.edge_id(self.cur);
        let several = self.edges.len() > 1;
        for meta in self.journal.unfinished() {
            if several && meta.owner != me {
                // A peer's: its owner's death sets its deadline.
                continue;
            }
            let mut bound = window + self.cfg.takeover_bound() + self.custody_rounds();
            if !window.is_zero() || self.route_continues(&meta.id) {
                bound += handed;
            }
            by_deadline
                .entry(self.journal_up_at() + bound)
                .or_default()
                .push(meta.id);
        }
        for (deadline, ids) in by_deadline {
            self.checkers[0].journal_edge_started(&ids, deadline);
        }
    }

    /// How long after its owner's death a record without a terminal may
    /// stay so: the owner's lease TTL and three scans (its lease seen
    /// expired), the park window, the takeover's bound and the budget of
    /// a request handed the record.
    pub(super) fn owner_lost_bound(&self) -> Duration {
        let ttl = Duration::from_millis(iop_core::journal::MIN_LEASE_TTL_MS);
        ttl * 4
            + self.cfg.park_window()
            + self.cfg.takeover_bound()
            + self.custody_rounds()
            + self.cfg.request_budget
            + self.cfg.durable_flush_bound()
    }

    /// How much longer than one takeover's bound the last of the records
    /// without a terminal may wait in a custody that runs fewer takeovers
    /// at once than there are such records: a takeover's bound and a
    /// scan's pause (at most 1 s) for each further round.
    fn custody_rounds(&self) -> Duration {
        let open = self.journal.unfinished().len();
        let tasks = self.cfg.journal.custody_tasks.max(1);
        let rounds = u32::try_from(open.div_ceil(tasks).saturating_sub(1)).unwrap_or(u32::MAX);
        (self.cfg.takeover_bound() + Duration::from_secs(1)) * rounds
    }

    /// An Edge of several died (R-TAKE-1): every record it owns without
    /// a terminal ends within its lease TTL and three scans (its lease
    /// seen expired), the park window and the takeover's bound, and the
    /// budget of a request handed the record, unless an Edge dies again
    /// first. Its own restart may take them first.
    fn journal_owner_lost(&mut self) {
        let me = self.edge_id(self.cur);
        let bound = self.owner_lost_bound();
        let ids: Vec<String> = self
            .journal
            .unfinished()
            .into_iter()
            .filter(|m| m.owner == me)
            .map(|m| m.id)
            .collect();
        let deadline = self.journal_up_at() + bound;
        self.checkers[0].journal_edge_started(&ids, deadline);
    }
}
