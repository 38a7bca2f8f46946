//! The invariants of durable responses (SPEC §6), checked against the
//! simulated store and what the clients saw.
//!
//! The checker keeps its own model of every record, built only from the
//! writes the store accepted (in the order it decided them) and the spec:
//! a record starts at epoch 1 with no event; an accepted raise moves the
//! epoch by exactly one and makes its writer the epoch's owner; an accepted
//! append adds the next numbers; an accepted terminal ends it. It never
//! asks the core why; it compares.
//!
//! | rule | checked |
//! | --- | --- |
//! | R-JRN-2 | every accepted append continues the record's numbering; the stored events are 1..n without gap or duplicate and agree with the model |
//! | R-JRN-3 | no append or terminal is accepted from an epoch that is not the record's current one at that moment, nor from a writer that does not own that epoch (a takeover that did not raise first shares the dead owner's epoch); an accepted raise moves the stored epoch by exactly one |
//! | R-JRN-4 | at most one terminal is accepted and no event after it; a writer whose terminal was accepted writes nothing more to that record; a client receives one terminal |
//! | R-JRN-1 | every event a client receives (the first client or a resumer) is durable in the store when it is received, with the same payload; a terminal is durable and the record's |
//! | R-JRN-2 (clients) | a client receives the events one by one from 1, without gap or repeat, across resumes (`starting_after` the last it saw), and by its terminal it has all of them |
//! | R-JRN-3 (one owner per epoch) | the writer model above: an append or terminal is accepted only from the writer that created the record or won its last raise, so no two writers (a live request, the custody, an adopter, a dead owner's zombie) ever have writes accepted under one (response, epoch); the Edge's custody may hand an epoch it won, once, to the one request it starts on the record (an adopter, a continuation), never one it does not hold |
//! | R-PARK-2 (provider once) | the provider is called at most once per durable response once anything of it is durable: a provider call for a response whose record already holds events is a violation, but for an attempt that continues the answer so far on a route that opted in (R-CONT-1) |
//! | R-PARK-2 (output once) | every token of a provider call's output is journaled exactly once and in order: each call's tokens are numbered (`tok1`, `tok2`, ...) and each journaled event names the run it came from; an accepted append whose token is not past that run's last is output published twice (an adoption that replayed frames the journal already held), one that skips a token lost output (a replay that resumed too late) |
//! | R-TAKE-1 (a journaled end) | once a record's journal holds the answer's end (a run's `Completed`: its writer journaled it, then may have died before the record's terminal), the record ends as that end says (the terminal its client would have been told, never `incomplete`), whoever writes the terminal; nothing is appended after it and its provider is called no more |
//! | R-IDEM-1 | a record is created under an idempotency key only if every record the key named before is superseded (ended `failed` or `incomplete` with no event); a create answered with an existing record is answered with the last record the key named, and never a superseded one (clients that lost their stream before any event POST again with their key) |
//! | R-PARK-2 (refused only for a reason) | a parked run a custody lets go as refused is refused for a reason true of its record in the store: `response_ended` only if it has its terminal, `no_frame_source`/`another_run` only if it holds events; a record that holds nothing yet is its run's to adopt (its Edge died before the first event) |
//! | R-PARK-2 (one adopter) | a node accepts an adoption of a parked run only while it is on no connection, and under one epoch of its record only one Edge's adoption is accepted (with several Edges: two Edges never both adopt one parked run) |
//! | liveness | a durable request that ended left its record ended; every record without a terminal at an Edge start ends within B_takeover unless the Edge dies again first |

use std::collections::{BTreeMap, BTreeSet};

use iop_core::Instant;
use iop_core::edge::durable::TakeoverRefusal;
use iop_core::journal::{CreateOutcome, JournalError, RecordStatus};

use std::time::Duration;

use super::Checker;
use crate::journal_store::{Decision, JournalOp, OpResult, SimJournal, Writer};

/// The rule a durable request's orphaned record is reported under (a
/// known core issue, see [`super::KNOWN_CORE_ISSUES`]).
pub const JOURNAL_ORPHAN: &str = "journal-orphan";

/// The run a journaled token came from (provider, generation, run id),
/// if the event names one.
type TokenRun = Option<(String, u64, u64)>;

/// What the checker knows of one record.
#[derive(Debug, Clone)]
struct RecordModel {
    /// The current epoch.
    epoch: u64,
    /// Who holds it (created the record or won the last raise).
    owner: Writer,
    /// Events accepted.
    events: u64,
    /// The writer whose terminal was accepted.
    ended_by: Option<Writer>,
    /// Stored events already compared with the model.
    verified: u64,
    /// The store refused a live writer of this record (the request then
    /// ends its client outside the journal): the kind of the last write
    /// refused.
    refused: Option<&'static str>,
    /// The last provider token journaled, per run the tokens came from
    /// (R-PARK-2: output once; a continuation is a new call, R-CONT-1).
    last_token: BTreeMap<TokenRun, u64>,
    /// The answer's end an accepted append journaled, as the status its
    /// client is told (R-TAKE-1: the record ends so).
    end: Option<RecordStatus>,
    /// The status of its accepted terminal.
    ended_as: Option<RecordStatus>,
    /// A live request writing it was fenced (another writer raised its
    /// epoch while it lived).
    fenced: bool,
}

impl RecordModel {
    /// Whether its idempotency key no longer names it (R-IDEM-1): it ended
    /// failed or incomplete with nothing journaled, so nothing of it was
    /// ever published and a retry with its key runs afresh.
    fn superseded(&self) -> bool {
        self.events == 0
            && matches!(
                self.ended_as,
                Some(RecordStatus::Failed | RecordStatus::Incomplete)
            )
    }
}

/// What one durable client has received, across resumes.
#[derive(Debug, Clone, Copy, Default)]
struct ClientModel {
    /// Events received (the last event number seen).
    received: u64,
    /// The terminal was received.
    ended: bool,
}

/// The journal part of the checker.
#[derive(Debug, Default)]
pub(super) struct JournalModel {
    records: BTreeMap<String, RecordModel>,
    clients: BTreeMap<String, ClientModel>,
    /// Records that must have ended by a moment (R-TAKE-1 liveness).
    deadlines: BTreeSet<(Instant, String)>,
    /// How much later a takeover may end a record for each of its writes
    /// the store refused with an I/O error (it tries again).
    retry_allowance: Duration,
    /// Records whose route continues answers (R-CONT-1).
    continuing_routes: BTreeSet<String>,
    /// The Edge whose adoption of a parked run each (record, epoch) saw
    /// accepted (R-PARK-2: at most one).
    adoptions: BTreeMap<(String, u64), String>,
    /// The records created under each idempotency key, oldest first
    /// (R-IDEM-1).
    keys: BTreeMap<[u8; 32], Vec<String>>,
}

/// The status a client's terminal delivery stands for (SPEC §6: completed,
/// cancelled, failed).
pub fn delivered_status(delivery: &iop_core::edge::request::Delivery) -> Option<RecordStatus> {
    use iop_core::edge::gate::GateFailure;
    use iop_core::edge::request::Delivery;
    match delivery {
        Delivery::Finish => Some(RecordStatus::Completed),
        Delivery::Fail {
            kind: GateFailure::Attempt(iop_wire::FailureCode::Canceled),
            ..
        } => Some(RecordStatus::Cancelled),
        Delivery::Fail { .. } => Some(RecordStatus::Failed),
        _ => None,
    }
}

/// The answer's end a journal event holds, as the status its client is
/// told: a run's `Completed` (the event after which a live request writes
/// the `completed` terminal) or a terminal delivery; `None` for any other
/// event.
pub fn journaled_end(payload: &[u8]) -> Option<RecordStatus> {
    use iop_core::edge::request::Delivery;
    match iop_core::edge::durable::decode_delivery(payload)? {
        Delivery::Event(iop_wire::RunEventKind::Completed { .. }) => Some(RecordStatus::Completed),
        other => delivered_status(&other),
    }
}

impl Checker {
    /// A writer submitted `op` (R-JRN-4: nothing after its own accepted
    /// terminal).
    pub fn journal_submitted(&mut self, writer: &Writer, op: &JournalOp) {
        let id = op.record_id();
        if let Some(r) = self.journal.records.get(id)
            && r.ended_by.as_ref() == Some(writer)
        {
            let detail = format!(
                "{writer:?} wrote {} to {id} after its terminal was accepted",
                op.kind()
            );
            self.fail("R-JRN-4", detail);
        }
    }

    /// After every step: the store's decisions since the last step, in
    /// order, then the state of every record they touched.
    pub fn check_journal(&mut self, store: &mut SimJournal) {
        if store.has_decisions() {
            let decisions = store.take_decisions();
            let mut touched = BTreeSet::new();
            for d in decisions {
                touched.insert(d.op.record_id().to_owned());
                self.journal_decision(d);
            }
            for id in touched {
                self.journal_record_state(store, &id);
            }
        }
        self.journal_deadlines(store);
    }

    fn journal_decision(&mut self, d: Decision) {
        let id = d.op.record_id().to_owned();
        let zombie = if d.zombie { " (zombie)" } else { "" };
        match (&d.op, &d.result) {
            (JournalOp::Create(_), OpResult::Created(CreateOutcome::Create(_))) => {
                let model = RecordModel {
                    epoch: 1,
                    owner: d.writer,
                    events: 0,
                    ended_by: None,
                    verified: 0,
                    refused: None,
                    last_token: BTreeMap::new(),
                    end: None,
                    ended_as: None,
                    fenced: false,
                };
                if self.journal.records.insert(id.clone(), model).is_some() {
                    self.fail("R-JRN-2", format!("record {id} created twice"));
                }
                if let JournalOp::Create(new) = &d.op
                    && let Some(key) = new.idempotency_key
                {
                    self.idempotent_created(key, &id);
                }
            }
            (JournalOp::Create(new), OpResult::Created(CreateOutcome::Existing(meta))) => {
                if let Some(key) = new.idempotency_key {
                    self.idempotent_existing(key, &id, &meta.id);
                }
            }
            (JournalOp::Create(_), _) => {}
            (_, OpResult::Refused(e)) => {
                if !d.zombie
                    && matches!(d.writer, Writer::Request { .. })
                    && matches!(e, JournalError::Fenced { .. })
                    && let Some(r) = self.journal.records.get_mut(&id)
                {
                    r.fenced = true;
                }
                if !d.zombie
                    && matches!(d.writer, Writer::Request { .. })
                    && !matches!(e, JournalError::Fenced { .. })
                    && let Some(r) = self.journal.records.get_mut(&id)
                {
                    r.refused = Some(d.op.kind());
                }
                if matches!(d.writer, Writer::Custody { .. }) && matches!(e, JournalError::Store(_))
                {
                    self.journal_extend_deadline(&id);
                }
            }
            (op, OpResult::Written(_) | OpResult::Created(_)) => {
                let Some(r) = self.journal.records.get_mut(&id) else {
                    let detail = format!("{} accepted for {id}, never created", op.kind());
                    self.fail("R-JRN-2", detail);
                    return;
                };
                let mut failure: Option<(&'static str, String)> = None;
                match op {
                    JournalOp::RaiseEpoch { expected, .. } => {
                        if *expected != r.epoch {
                            failure = Some((
                                "R-JRN-3",
                                format!(
                                    "raise of {id} from epoch {expected} accepted while its epoch is {}{zombie}",
                                    r.epoch
                                ),
                            ));
                        }
                        r.epoch += 1;
                        r.owner = d.writer;
                    }
                    JournalOp::Append { epoch, events, .. } => {
                        failure = writer_fault(r, &d.writer, *epoch, &id, "an event", zombie);
                        if let Some(end) = r.end
                            && failure.is_none()
                        {
                            failure = Some((
                                "R-TAKE-1",
                                format!(
                                    "{id} accepted an event of {:?} after the answer's end ({}) its journal holds: a whole answer run or continued again{zombie}",
                                    d.writer,
                                    end.as_str()
                                ),
                            ));
                        }
                        for event in events {
                            r.end = r.end.or_else(|| journaled_end(&event.payload));
                        }
                        for (i, event) in events.iter().enumerate() {
                            let expected = r.events + 1 + i as u64;
                            if event.seq != expected && failure.is_none() {
                                failure = Some((
                                    "R-JRN-2",
                                    format!(
                                        "{id} accepted event {} where {expected} was next",
                                        event.seq
                                    ),
                                ));
                            }
                        }
                        r.events += events.len() as u64;
                        for event in events {
                            let Some((run, token)) = journaled_token(&event.payload) else {
                                continue;
                            };
                            let last = r.last_token.entry(run.clone()).or_default();
                            if token <= *last && failure.is_none() {
                                failure = Some((
                                    "R-PARK-2",
                                    format!(
                                        "{id} accepted provider token {token} of run {run:?} as event {} after token {} was journaled: output published twice{zombie}",
                                        event.seq, *last
                                    ),
                                ));
                            } else if token > *last + 1 && failure.is_none() {
                                failure = Some((
                                    "R-PARK-2",
                                    format!(
                                        "{id} accepted provider token {token} of run {run:?} as event {} after token {}: the output between them was lost{zombie}",
                                        event.seq, *last
                                    ),
                                ));
                            }
                            *last = (*last).max(token);
                        }
                    }
                    JournalOp::Finish {
                        epoch, terminal, ..
                    } => {
                        failure = writer_fault(r, &d.writer, *epoch, &id, "a terminal", zombie);
                        if let Some(end) = r.end
                            && terminal.status != end
                            && failure.is_none()
                        {
                            failure = Some((
                                "R-TAKE-1",
                                format!(
                                    "{id} ended {} ({:?}) by {:?}, but its journal holds the answer's end: {}{zombie}",
                                    terminal.status.as_str(),
                                    terminal.reason,
                                    d.writer,
                                    end.as_str()
                                ),
                            ));
                        }
                        r.ended_by = Some(d.writer);
                        r.ended_as = Some(terminal.status);
                    }
                    JournalOp::Create(_) => {}
                }
                if let Some((rule, detail)) = failure {
                    self.fail(rule, detail);
                }
            }
        }
    }

    /// A new record `id` was created under idempotency key `key`: every
    /// record the key named before must be superseded (R-IDEM-1: one
    /// response per key; only one that failed before anything of it was
    /// journaled gives the key up, so a retry never runs an answer again
    /// that was, or could still be, published).
    fn idempotent_created(&mut self, key: [u8; 32], id: &str) {
        let earlier = self.journal.keys.entry(key).or_default();
        let live: Vec<String> = earlier
            .iter()
            .filter(|e| {
                self.journal
                    .records
                    .get(e.as_str())
                    .is_none_or(|r| !r.superseded())
            })
            .cloned()
            .collect();
        earlier.push(id.to_owned());
        for e in live {
            let (events, ended) = self
                .journal
                .records
                .get(&e)
                .map_or((0, None), |r| (r.events, r.ended_as));
            let detail = format!(
                "{id} was created under the idempotency key of {e}, which holds {events} events and ended {ended:?}: the request would run twice"
            );
            self.fail("R-IDEM-1", detail);
        }
    }

    /// A create of `id` under idempotency key `key` was answered with the
    /// existing record `existing`: it must be the last record the key
    /// named, and not superseded (R-IDEM-1).
    fn idempotent_existing(&mut self, key: [u8; 32], id: &str, existing: &str) {
        let last = self.journal.keys.get(&key).and_then(|ids| ids.last());
        let detail = match last {
            Some(last) if last != existing => format!(
                "the create of {id} was answered with {existing}, but its idempotency key names {last}"
            ),
            None => format!(
                "the create of {id} was answered with {existing}, but no record was created under its idempotency key"
            ),
            Some(_)
                if self
                    .journal
                    .records
                    .get(existing)
                    .is_some_and(RecordModel::superseded) =>
            {
                format!(
                    "the create of {id} was answered with {existing}, which failed before any event: its key should run the request afresh"
                )
            }
            Some(_) => return,
        };
        self.fail("R-IDEM-1", detail);
    }

    /// Compare a record's stored state with the model.
    fn journal_record_state(&mut self, store: &SimJournal, id: &str) {
        let Some(model) = self.journal.records.get_mut(id) else {
            return;
        };
        let Some(stored) = store.record(id) else {
            self.fail("R-JRN-2", format!("record {id} vanished"));
            return;
        };
        let meta = &stored.meta;
        let mut failure: Option<(&'static str, String)> = None;
        if meta.epoch != model.epoch {
            failure = Some((
                "R-JRN-3",
                format!(
                    "{id} is stored at epoch {}, its accepted raises make it {}",
                    meta.epoch, model.epoch
                ),
            ));
        } else if meta.last_seq != model.events || stored.events.len() as u64 != meta.last_seq {
            failure = Some((
                "R-JRN-2",
                format!(
                    "{id} stores {} events (last_seq {}), {} were accepted",
                    stored.events.len(),
                    meta.last_seq,
                    model.events
                ),
            ));
        } else if meta.terminal.is_some() != model.ended_by.is_some() {
            failure = Some((
                "R-JRN-4",
                format!(
                    "{id} stored terminal {:?}, accepted terminal {}",
                    meta.terminal.as_ref().map(|t| t.status),
                    model.ended_by.is_some()
                ),
            ));
        } else {
            let from = model.verified;
            for (i, event) in stored.events.iter().enumerate().skip(from as usize) {
                if event.seq != i as u64 + 1 {
                    failure = Some((
                        "R-JRN-2",
                        format!("{id} stores event {} at position {}", event.seq, i + 1),
                    ));
                    break;
                }
            }
            model.verified = meta.last_seq;
        }
        if let Some((rule, detail)) = failure {
            self.fail(rule, detail);
        }
    }

    // ---- Clients ---------------------------------------------------------

    /// The first client of a durable request is connected: it has seen
    /// nothing yet.
    pub fn durable_client_opened(&mut self, id: &str) {
        self.journal
            .clients
            .insert(id.to_owned(), ClientModel::default());
    }

    /// The client of record `id` received an event: the next one it has
    /// not seen (`seq`, when the store says which, for a resumer; the
    /// first client's are numbered by arrival).
    pub fn durable_client_event(
        &mut self,
        store: &SimJournal,
        id: &str,
        seq: Option<u64>,
        payload: &[u8],
    ) {
        let Some(c) = self.journal.clients.get_mut(id) else {
            self.fail(
                "R-JRN-1",
                format!("an event of {id} reached an unknown client"),
            );
            return;
        };
        let next = c.received + 1;
        let seq = seq.unwrap_or(next);
        if c.ended {
            self.fail(
                "R-JRN-4",
                format!("event {seq} of {id} reached its client after its terminal"),
            );
            return;
        }
        c.received = seq;
        if seq != next {
            let detail = format!("the client of {id} received event {seq} where {next} was next");
            self.fail("R-JRN-2", detail);
            return;
        }
        // The store holds durable events only.
        let durable = store.record(id).and_then(|r| {
            let index = usize::try_from(seq.checked_sub(1)?).ok()?;
            r.events.get(index)
        });
        match durable {
            None => {
                let last = store.record(id).map_or(0, |r| r.meta.last_seq);
                let detail = format!(
                    "the client of {id} received event {seq} while the journal holds {last} durable"
                );
                self.fail("R-JRN-1", detail);
            }
            // The same delivery (the stored event also names the node frame
            // it came from, R-PARK-2).
            Some(e)
                if iop_core::edge::durable::decode_delivery(&e.payload)
                    != iop_core::edge::durable::decode_delivery(payload) =>
            {
                let detail =
                    format!("the client of {id} received an event {seq} that is not the journal's");
                self.fail("R-JRN-1", detail);
            }
            Some(_) => {}
        }
    }

    /// The client of record `id` received its terminal, standing for
    /// `status`.
    pub fn durable_client_terminal(&mut self, store: &SimJournal, id: &str, status: RecordStatus) {
        let refused = self
            .journal
            .records
            .get(id)
            .is_some_and(|r| r.refused.is_some());
        let Some(c) = self.journal.clients.get_mut(id) else {
            self.fail(
                "R-JRN-1",
                format!("the terminal of {id} reached an unknown client"),
            );
            return;
        };
        if std::mem::replace(&mut c.ended, true) {
            self.fail(
                "R-JRN-4",
                format!("a second terminal of {id} reached its client"),
            );
            return;
        }
        let received = c.received;
        if refused {
            // The store refused its writer: the client's one terminal comes
            // from outside the journal (the request's error).
            return;
        }
        let Some(stored) = store.record(id) else {
            self.fail(
                "R-JRN-1",
                format!("the client of {id} got a terminal of no record"),
            );
            return;
        };
        let meta = &stored.meta;
        match &meta.terminal {
            None => {
                let detail = format!(
                    "the client of {id} received a terminal ({}) that is not durable",
                    status.as_str()
                );
                self.fail("R-JRN-1", detail);
            }
            Some(t) if t.status != status => {
                let detail = format!(
                    "the client of {id} received {} where the journal says {}",
                    status.as_str(),
                    t.status.as_str()
                );
                self.fail("R-JRN-1", detail);
            }
            Some(_) if received != meta.last_seq => {
                let detail = format!(
                    "the client of {id} ended with {received} of its {} events",
                    meta.last_seq
                );
                self.fail("R-JRN-2", detail);
            }
            Some(_) => {}
        }
    }

    // ---- Liveness --------------------------------------------------------

    /// Who holds the current epoch of record `id` (created it or won its
    /// last raise), in the checker's model.
    pub fn journal_owner(&self, id: &str) -> Option<&Writer> {
        self.journal.records.get(id).map(|r| &r.owner)
    }

    /// Whether a live request writing record `id` was fenced by another
    /// writer's raise.
    pub fn journal_fenced(&self, id: &str) -> bool {
        self.journal.records.get(id).is_some_and(|r| r.fenced)
    }

    /// A durable request's machine ended: its record has its terminal.
    /// Returns whether it was left open.
    pub fn durable_request_ended(&mut self, store: &SimJournal, id: &str) -> bool {
        if store.record(id).is_some_and(|r| r.meta.terminal.is_some()) {
            return false;
        }
        if let Some(kind) = self.journal.records.get(id).and_then(|r| r.refused) {
            let detail = format!(
                "the request of {id} ended after the store refused its {kind} and left its record without a terminal (nothing takes it over before the next Edge start)"
            );
            self.fail(JOURNAL_ORPHAN, detail);
        } else {
            let detail =
                format!("the request of {id} ended and left its record without a terminal");
            self.fail("liveness-journal", detail);
        }
        true
    }

    /// A takeover tries again after a write the store refused with an I/O
    /// error: allow it one more try (see [`Checker::set_journal_retry_allowance`]).
    pub fn set_journal_retry_allowance(&mut self, allowance: Duration) {
        self.journal.retry_allowance = allowance;
    }

    fn journal_extend_deadline(&mut self, id: &str) {
        let allowance = self.journal.retry_allowance;
        let extended: Vec<(Instant, String)> = self
            .journal
            .deadlines
            .iter()
            .filter(|(_, r)| r == id)
            .cloned()
            .collect();
        for (deadline, record) in extended {
            self.journal.deadlines.remove(&(deadline, record.clone()));
            self.journal
                .deadlines
                .insert((deadline + allowance, record));
        }
    }

    /// The route of durable response `id` continues answers (R-CONT-1),
    /// or not.
    pub fn durable_route(&mut self, id: &str, continues: bool) {
        if continues {
            self.journal.continuing_routes.insert(id.to_owned());
        }
    }

    /// The Edge's custody (`from`) hands the epoch `epoch` of `id` it won
    /// to the request `to` it starts on the record (an adopter, a
    /// continuation): only an epoch it holds, and only once.
    pub fn journal_epoch_handed(&mut self, id: &str, epoch: u64, from: &Writer, to: Writer) {
        let Some(r) = self.journal.records.get_mut(id) else {
            self.fail("R-JRN-3", format!("an epoch of {id} handed, never created"));
            return;
        };
        if r.epoch != epoch {
            // Another writer raised since (a dead owner's late raise): the
            // request's writes will be fenced.
            return;
        }
        if r.owner != *from {
            let detail = format!(
                "{from:?} handed epoch {epoch} of {id} to {to:?}, but {:?} holds it",
                r.owner
            );
            self.fail("R-JRN-3", detail);
            return;
        }
        r.owner = to;
    }

    /// A node starts the provider call of a run of durable response `id`
    /// (R-PARK-2: the provider is called once; before anything of the
    /// response is durable an attempt may still fail over, after it the
    /// run is adopted, never called again), `continues`: the attempt
    /// continues the answer so far (R-CONT-1), which a route that opted in
    /// may do. `run`: the call's run key (generation, run id), numbered by
    /// the Edge that sent it: with several Edges a continuation on another
    /// Edge may get the key an earlier call of the record had on the first
    /// one, so its tokens count from 1 again (R-PARK-2, output once).
    pub fn durable_provider_called(
        &mut self,
        store: &SimJournal,
        id: &str,
        continues: bool,
        run: (u64, u64),
    ) {
        if let Some(r) = self.journal.records.get_mut(id) {
            r.last_token
                .retain(|k, _| k.as_ref().is_none_or(|(_, g, n)| (*g, *n) != run));
        }
        let events = store.record(id).map_or(0, |r| r.events.len());
        if let Some(end) = self.journal.records.get(id).and_then(|r| r.end) {
            let detail = format!(
                "the provider was called again for {id}, whose journal holds the answer's end ({})",
                end.as_str()
            );
            self.fail("R-TAKE-1", detail);
            return;
        }
        if continues && !self.journal.continuing_routes.contains(id) {
            let detail =
                format!("an attempt of {id} continued an answer on a route that does not continue");
            self.fail("R-CONT-1", detail);
            return;
        }
        if events > 0 && !continues {
            let detail = format!(
                "the provider was called again for {id}, whose journal already holds {events} events"
            );
            self.fail("R-PARK-2", detail);
        }
    }

    /// An Edge incarnation started: each of `unfinished` must end by
    /// `deadline` unless the Edge dies again first (R-TAKE-1).
    pub fn journal_edge_started(&mut self, unfinished: &[String], deadline: Instant) {
        for id in unfinished {
            self.journal.deadlines.insert((deadline, id.clone()));
        }
    }

    /// The journal store is down until `until` (R-JRN-6): nothing is
    /// taken over meanwhile, and a failed scan starts every lease clock
    /// again, so each deadline is at least `bound` past the outage's end.
    pub fn journal_outage(&mut self, until: Instant, bound: std::time::Duration) {
        let later = until + bound;
        self.journal.deadlines = std::mem::take(&mut self.journal.deadlines)
            .into_iter()
            .map(|(deadline, id)| (deadline.max(later), id))
            .collect();
    }

    /// A node accepted `edge`'s adoption of the parked run of `record`,
    /// whose stored epoch is `epoch` (R-PARK-2): the node hands a parked
    /// run to at most one connection (`attached`: the connection the run
    /// was still on), and under one epoch of its record at most one Edge
    /// adopts it (only the Edge that won that epoch may; a second Edge
    /// would run the same provider call for a record it does not hold).
    pub fn parked_run_adopted(&mut self, record: &str, epoch: u64, edge: &str, attached: bool) {
        if attached {
            let detail = format!(
                "a node handed the parked run of {record} to {edge} while it was on another connection"
            );
            self.fail("R-PARK-2", detail);
            return;
        }
        let first = self
            .journal
            .adoptions
            .entry((record.to_owned(), epoch))
            .or_insert_with(|| edge.to_owned());
        if first != edge {
            let detail = format!(
                "the parked run of {record} was adopted by {first} and by {edge} under epoch {epoch}"
            );
            self.fail("R-PARK-2", detail);
        }
    }

    /// An Edge's custody let a parked run of `record` go, refused for
    /// `why` (R-PARK-2, R-TAKE-1): a refusal must be true of the record
    /// as the store holds it. Ended: it has its terminal; the run cannot
    /// be named into it: it holds events (the answer so far has a
    /// source). A record that holds nothing yet has no answer but the
    /// run's, so letting the run go loses it (the record ends
    /// `incomplete`, its idempotency key freed: a retry calls a provider
    /// again, R-IDEM-1). The store's record only grows, so what the
    /// custody read before is no more than what it holds now.
    pub fn parked_run_refused(&mut self, store: &SimJournal, record: &str, why: TakeoverRefusal) {
        let Some(stored) = store.record(record) else {
            let detail =
                format!("a parked run of {record}, not in the store, was refused ({why:?})");
            return self.fail("R-PARK-2", detail);
        };
        let meta = &stored.meta;
        let true_of_it = match why {
            TakeoverRefusal::Ended => meta.terminal.is_some(),
            TakeoverRefusal::NoFrameSource | TakeoverRefusal::AnotherRun => meta.last_seq > 0,
        };
        if !true_of_it {
            let detail = format!(
                "a parked run of {record} was let go as {} though its record holds {} events and {}",
                why.as_str(),
                meta.last_seq,
                if meta.terminal.is_some() {
                    "its terminal"
                } else {
                    "no terminal"
                },
            );
            self.fail("R-PARK-2", detail);
        }
    }

    /// The Edge process died: the next start sets the deadlines again.
    pub fn journal_edge_lost(&mut self) {
        self.journal.deadlines.clear();
    }

    fn journal_deadlines(&mut self, store: &SimJournal) {
        while let Some((deadline, _)) = self.journal.deadlines.first() {
            if *deadline >= self.now {
                return;
            }
            let Some((deadline, id)) = self.journal.deadlines.pop_first() else {
                return;
            };
            if store.record(&id).is_some_and(|r| r.meta.terminal.is_none()) {
                let detail = format!(
                    "{id} still has no terminal {}us past its takeover deadline",
                    (self.now - deadline).as_micros()
                );
                self.fail("liveness-journal", detail);
                return;
            }
        }
    }
}

/// R-JRN-3 and R-JRN-4 for an accepted append or terminal of `writer` at
/// `epoch`.
fn writer_fault(
    r: &RecordModel,
    writer: &Writer,
    epoch: u64,
    id: &str,
    what: &str,
    zombie: &str,
) -> Option<(&'static str, String)> {
    if r.ended_by.is_some() {
        return Some((
            "R-JRN-4",
            format!("{id} accepted {what} after its terminal{zombie}"),
        ));
    }
    if epoch != r.epoch {
        return Some((
            "R-JRN-3",
            format!(
                "{id} accepted {what} from epoch {epoch} while its epoch is {}{zombie}",
                r.epoch
            ),
        ));
    }
    if *writer != r.owner {
        return Some((
            "R-JRN-3",
            format!(
                "{id} accepted {what} of {writer:?} under epoch {epoch}, which {:?} holds{zombie}",
                r.owner
            ),
        ));
    }
    None
}

/// The provider token a journaled event carries (`tok{k}`), if it is
/// text, with the run it came from (provider, generation, run id).
fn journaled_token(payload: &[u8]) -> Option<(TokenRun, u64)> {
    use iop_core::edge::request::Delivery;
    let entry = iop_core::edge::durable::decode_entry(payload)?;
    let run = entry
        .source
        .map(|s| (s.provider_id.to_string(), s.key.generation, s.key.run_id));
    match entry.delivery {
        Delivery::Event(iop_wire::RunEventKind::TextDelta(text)) => {
            Some((run, text.strip_prefix("tok")?.parse().ok()?))
        }
        _ => None,
    }
}
