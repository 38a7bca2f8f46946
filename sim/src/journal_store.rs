//! The simulated journal store of durable responses: the disk of the
//! simulated Edge.
//!
//! Records and their events live in memory and survive Edge crashes (the
//! store is the disk, the Edge's writer is process memory). Every operation
//! is decided by the journal's rules in `iop_core::journal`
//! (`check_create`, `check_append`, `check_finish`, `check_raise_epoch`);
//! the store only reads and writes, as every real store does.
//!
//! ## Group commit and virtual time
//!
//! Writes queue in the core's [`GroupCommit`] (R-JRN-1: many writes, one
//! sync; bounded, R-LIM-4). When no sync runs and something waits, the
//! world takes the next batch ([`SimJournal::begin_sync`]) and schedules
//! its end after a seeded sync latency; at that moment the whole batch is
//! applied, op by op against the state the earlier ops left
//! ([`SimJournal::complete_sync`]), and becomes durable. The answers travel
//! back to their writers after a seeded delay. So several requests' writes
//! are answered by one simulated sync, and an op refused by the rules does
//! not stop the others of its batch.
//!
//! ## Crash points
//!
//! When the Edge process dies ([`SimJournal::crash`]) its writer dies
//! with it. A batch whose sync was running either completed just before the
//! crash (durable, never acknowledged) or not (lost), as the seed says; the
//! ops still queued are lost. Ops already applied whose answers were on
//! their way are durable but unacknowledged. The world may replay a lost
//! write later as a *zombie* ([`SimJournal::apply_now`]): the write of a
//! dead owner that reaches a shared store late, with its old epoch, so
//! writer-epoch fencing (R-JRN-3) has something to refuse.

use std::collections::{BTreeMap, BTreeSet};

use iop_core::edge::admission::RequestId;
use iop_core::journal::{
    CreateOutcome, EdgeLease, GroupCommit, JournalError, JournalEvent, JournalLimits, NewRecord,
    RecordMeta, StoredLease, Terminal, Ticket, check_append, check_create, check_finish,
    check_put_lease, check_raise_epoch,
};
use serde::Serialize;

/// The most writes waiting for a sync (R-LIM-4); a write past it is
/// refused with [`JournalError::Store`].
pub const MAX_QUEUED_WRITES: usize = 4096;

/// The most writes one sync takes.
pub const MAX_BATCH_WRITES: usize = 256;

/// The most payload bytes one sync takes past its first write.
pub const MAX_BATCH_BYTES: usize = 4 * 1024 * 1024;

/// The owner every simulated record names: the simulated world has one
/// Edge, whatever its incarnation.
pub const SIM_EDGE: &str = "sim-edge";

/// Who wrote: the owner an epoch stands for (R-JRN-3).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Writer {
    /// A client request of one Edge incarnation: its shell created the
    /// record, its request machine writes it.
    Request {
        /// The Edge incarnation.
        incarnation: u64,
        /// The request.
        request_id: RequestId,
    },
    /// The custody of one Edge incarnation (core's
    /// `iop_core::edge::custody::Custody`): the raises and terminals of its
    /// takeovers (R-TAKE-1, R-PARK-2). An epoch it wins it hands to the
    /// request it starts for the record, or writes the terminal under.
    Custody {
        /// The Edge incarnation.
        incarnation: u64,
    },
}

impl Writer {
    /// The Edge incarnation the writer belongs to.
    pub fn incarnation(&self) -> u64 {
        match self {
            Writer::Request { incarnation, .. } | Writer::Custody { incarnation } => *incarnation,
        }
    }
}

/// One store operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum JournalOp {
    /// Create a record (epoch 1).
    Create(NewRecord),
    /// Append numbered events under `epoch`.
    Append {
        /// The record.
        id: String,
        /// The writer epoch.
        epoch: u64,
        /// The events.
        events: Vec<JournalEvent>,
    },
    /// Write the one terminal under `epoch`.
    Finish {
        /// The record.
        id: String,
        /// The writer epoch.
        epoch: u64,
        /// The terminal.
        terminal: Terminal,
    },
    /// Compare-and-set the epoch from `expected` to `expected + 1`,
    /// `owner` its owner from then on.
    RaiseEpoch {
        /// The record.
        id: String,
        /// The epoch the writer read.
        expected: u64,
        /// The `edge_id` of the Edge that raises.
        owner: String,
    },
}

impl JournalOp {
    /// The record the op is about.
    pub fn record_id(&self) -> &str {
        match self {
            JournalOp::Create(new) => &new.id,
            JournalOp::Append { id, .. }
            | JournalOp::Finish { id, .. }
            | JournalOp::RaiseEpoch { id, .. } => id,
        }
    }

    /// The op's kind.
    pub fn op_kind(&self) -> OpKind {
        match self {
            JournalOp::Create(_) => OpKind::Create,
            JournalOp::Append { .. } => OpKind::Append,
            JournalOp::Finish { .. } => OpKind::Finish,
            JournalOp::RaiseEpoch { .. } => OpKind::RaiseEpoch,
        }
    }

    /// The stable name of the op's kind.
    pub fn kind(&self) -> &'static str {
        self.op_kind().as_str()
    }

    fn bytes(&self) -> usize {
        match self {
            JournalOp::Create(new) => new.request.len(),
            JournalOp::Append { events, .. } => events.iter().map(|e| e.payload.len()).sum(),
            JournalOp::Finish { .. } | JournalOp::RaiseEpoch { .. } => 0,
        }
    }
}

/// The kind of a [`JournalOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum OpKind {
    /// [`JournalOp::Create`].
    Create,
    /// [`JournalOp::Append`].
    Append,
    /// [`JournalOp::Finish`].
    Finish,
    /// [`JournalOp::RaiseEpoch`].
    RaiseEpoch,
}

impl OpKind {
    /// The stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::Create => "create",
            OpKind::Append => "append",
            OpKind::Finish => "finish",
            OpKind::RaiseEpoch => "raise_epoch",
        }
    }
}

/// What the store answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpResult {
    /// A create's outcome.
    Created(CreateOutcome),
    /// The record after an accepted append, terminal or raise.
    Written(RecordMeta),
    /// The rules (or the store) refused the op.
    Refused(JournalError),
}

impl OpResult {
    /// Whether the op changed the store.
    pub fn accepted(&self) -> bool {
        matches!(
            self,
            OpResult::Created(CreateOutcome::Create(_)) | OpResult::Written(_)
        )
    }
}

/// A write waiting for its sync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingWrite {
    /// Who wrote.
    pub writer: Writer,
    /// What.
    pub op: JournalOp,
}

/// One decision of the store, in the order they were made (what the
/// invariant checker reads).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Who wrote.
    pub writer: Writer,
    /// What.
    pub op: JournalOp,
    /// The answer.
    pub result: OpResult,
    /// Whether it reached the store as a zombie (a dead owner's late write).
    pub zombie: bool,
}

/// One record as stored.
#[derive(Debug, Clone)]
pub struct StoredRecord {
    /// Its metadata.
    pub meta: RecordMeta,
    /// Its events, in order.
    pub events: Vec<JournalEvent>,
}

/// What [`SimJournal::crash`] did to the writes in flight.
#[derive(Debug, Default)]
pub struct CrashOutcome {
    /// Writes of the running sync that became durable at the crash without
    /// an answer.
    pub durable_unacked: usize,
    /// The records those writes touched (followers on other Edges read
    /// the shared store: they see them).
    pub touched: Vec<String>,
    /// Writes that never became durable (the world may replay some as
    /// zombies).
    pub lost: Vec<PendingWrite>,
}

/// Counters of the store.
#[derive(Debug, Clone, Copy, Default)]
pub struct JournalStats {
    /// Syncs completed.
    pub syncs: u64,
    /// Ops applied (accepted or refused), zombies included.
    pub ops: u64,
    /// Ops that shared their sync with another op.
    pub batched_ops: u64,
}

/// The simulated store (see the module docs).
#[derive(Debug)]
pub struct SimJournal {
    limits: JournalLimits,
    records: BTreeMap<String, StoredRecord>,
    used_bytes: u64,
    unfinished: BTreeSet<String>,
    /// Each Edge's writer (process memory): its group commit queue and
    /// running sync, by Edge slot.
    writers: Vec<EdgeWriter>,
    next_ticket: u64,
    decisions: Vec<Decision>,
    stats: JournalStats,
    /// Every Edge's ownership lease (R-TAKE-1, R-MULTI-1), by `edge_id`.
    leases: BTreeMap<String, StoredLease>,
    /// The store's last lease revision (each write makes a greater one).
    lease_revision: u64,
    /// Raises accepted since the last [`SimJournal::take_raises`].
    raises: Vec<Raise>,
    /// The record each idempotency key names (R-IDEM-1).
    keys: BTreeMap<[u8; 32], String>,
}

/// A raise the store accepted: who owned the record before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Raise {
    /// The record.
    pub id: String,
    /// Its owner before the raise.
    pub from: String,
    /// Its owner after.
    pub to: String,
    /// Whether a dead writer's late write made it.
    pub zombie: bool,
}

/// One Edge's writer: it dies with its process.
#[derive(Debug)]
struct EdgeWriter {
    queue: GroupCommit<PendingWrite>,
    running: Option<Vec<(Ticket, PendingWrite)>>,
    /// Bumped at every crash: a sync end of a dead writer is ignored.
    generation: u64,
}

impl EdgeWriter {
    fn new() -> Self {
        EdgeWriter {
            queue: new_queue(),
            running: None,
            generation: 0,
        }
    }
}

impl SimJournal {
    /// An empty store with these limits, written by `edges` Edges.
    pub fn new(limits: JournalLimits, edges: usize) -> Self {
        Self {
            limits,
            records: BTreeMap::new(),
            used_bytes: 0,
            unfinished: BTreeSet::new(),
            writers: (0..edges.max(1)).map(|_| EdgeWriter::new()).collect(),
            next_ticket: 1,
            decisions: Vec::new(),
            stats: JournalStats::default(),
            leases: BTreeMap::new(),
            lease_revision: 0,
            raises: Vec::new(),
            keys: BTreeMap::new(),
        }
    }

    /// Queue a write of Edge `edge` for its next sync. A full queue
    /// refuses it at once (R-LIM-4).
    pub fn submit(&mut self, edge: usize, write: PendingWrite) -> Result<Ticket, JournalError> {
        let ticket = Ticket(self.next_ticket);
        self.next_ticket += 1;
        let bytes = write.op.bytes();
        self.writers[edge]
            .queue
            .submit(ticket, write, bytes)
            .map(|()| ticket)
            .map_err(|full| JournalError::Store(full.to_string()))
    }

    /// Start Edge `edge`'s next sync if none runs and writes wait: the
    /// writer generation the sync belongs to (pass it to
    /// [`SimJournal::complete_sync`]).
    pub fn begin_sync(&mut self, edge: usize) -> Option<u64> {
        let w = &mut self.writers[edge];
        if w.running.is_some() {
            return None;
        }
        let batch = w.queue.poll_batch()?;
        w.running = Some(batch);
        Some(w.generation)
    }

    /// The running sync of Edge `edge`'s `generation` ended: apply its
    /// batch, in order, at `now_unix_ms`; each write with its answer.
    pub fn complete_sync(
        &mut self,
        edge: usize,
        generation: u64,
        now_unix_ms: u64,
    ) -> Vec<(PendingWrite, OpResult)> {
        let w = &mut self.writers[edge];
        if generation != w.generation {
            return Vec::new();
        }
        let Some(batch) = w.running.take() else {
            return Vec::new();
        };
        w.queue.synced();
        self.stats.syncs += 1;
        if batch.len() > 1 {
            self.stats.batched_ops += batch.len() as u64;
        }
        batch
            .into_iter()
            .map(|(_, write)| {
                let result = self.apply(&write, now_unix_ms, false);
                (write, result)
            })
            .collect()
    }

    /// The running sync of `generation` failed (an I/O error): none of its
    /// writes is applied, each is answered `Store(..)`.
    pub fn fail_sync(&mut self, edge: usize, generation: u64) -> Vec<(PendingWrite, OpResult)> {
        let w = &mut self.writers[edge];
        if generation != w.generation {
            return Vec::new();
        }
        let Some(batch) = w.running.take() else {
            return Vec::new();
        };
        w.queue.synced();
        batch
            .into_iter()
            .map(|(_, write)| {
                let result = OpResult::Refused(JournalError::Store("sync failed".into()));
                self.decisions.push(Decision {
                    writer: write.writer.clone(),
                    op: write.op.clone(),
                    result: result.clone(),
                    zombie: false,
                });
                (write, result)
            })
            .collect()
    }

    /// Apply one write in its own transaction, now (a zombie: a dead
    /// owner's write arriving late). Nobody gets the answer.
    pub fn apply_now(&mut self, write: &PendingWrite, now_unix_ms: u64) -> OpResult {
        self.apply(write, now_unix_ms, true)
    }

    /// Edge `edge`'s process died: its writer with it (see the module
    /// docs). `sync_completed` says whether the running sync, if any,
    /// finished before the crash.
    pub fn crash(&mut self, edge: usize, sync_completed: bool, now_unix_ms: u64) -> CrashOutcome {
        let mut outcome = CrashOutcome::default();
        if let Some(batch) = self.writers[edge].running.take() {
            if sync_completed {
                outcome.durable_unacked = batch.len();
                self.stats.syncs += 1;
                for (_, write) in batch {
                    self.apply(&write, now_unix_ms, false);
                    outcome.touched.push(write.op.record_id().to_owned());
                }
            } else {
                outcome.lost.extend(batch.into_iter().map(|(_, w)| w));
            }
        }
        let w = &mut self.writers[edge];
        w.queue.synced();
        while let Some(batch) = w.queue.poll_batch() {
            outcome.lost.extend(batch.into_iter().map(|(_, w)| w));
            w.queue.synced();
        }
        w.queue = new_queue();
        w.generation += 1;
        outcome
    }

    /// The writes of Edge `edge`'s running sync of writer `generation`, in
    /// order (none when no sync of that generation runs).
    pub fn running_writes(
        &self,
        edge: usize,
        generation: u64,
    ) -> impl Iterator<Item = &PendingWrite> {
        let w = &self.writers[edge];
        w.running
            .iter()
            .filter(move |_| w.generation == generation)
            .flatten()
            .map(|(_, write)| write)
    }

    /// Whether a sync of Edge `edge` runs or its writes wait.
    pub fn is_busy_at(&self, edge: usize) -> bool {
        let w = &self.writers[edge];
        w.running.is_some() || w.queue.queued() > 0
    }

    /// Whether any Edge's sync runs or writes wait.
    pub fn is_busy(&self) -> bool {
        (0..self.writers.len()).any(|e| self.is_busy_at(e))
    }

    /// Write `lease` if the stored lease of its Edge is still at revision
    /// `expected` (0: none; `check_put_lease`): the new revision.
    pub fn put_lease(&mut self, lease: EdgeLease, expected: u64) -> Result<u64, JournalError> {
        check_put_lease(self.leases.get(&lease.edge_id), expected)?;
        self.lease_revision += 1;
        let revision = self.lease_revision;
        self.leases
            .insert(lease.edge_id.clone(), StoredLease { revision, lease });
        Ok(revision)
    }

    /// Every Edge's lease, by `edge_id`.
    pub fn leases(&self) -> Vec<StoredLease> {
        self.leases.values().cloned().collect()
    }

    /// One Edge's lease, if it has one.
    pub fn lease(&self, edge_id: &str) -> Option<StoredLease> {
        self.leases.get(edge_id).cloned()
    }

    /// The record `id`, if stored.
    pub fn record(&self, id: &str) -> Option<&StoredRecord> {
        self.records.get(id)
    }

    /// Every record without a terminal (the R-TAKE-1 scan), in id order.
    pub fn unfinished(&self) -> Vec<RecordMeta> {
        self.unfinished
            .iter()
            .filter_map(|id| self.records.get(id))
            .map(|r| r.meta.clone())
            .collect()
    }

    /// How many records have no terminal.
    pub fn unfinished_count(&self) -> usize {
        self.unfinished.len()
    }

    /// Bytes held, as the journal's rules count them.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Whether decisions were made since the last [`SimJournal::take_decisions`].
    pub fn has_decisions(&self) -> bool {
        !self.decisions.is_empty()
    }

    /// The decisions made since the last call, in order.
    pub fn take_decisions(&mut self) -> Vec<Decision> {
        std::mem::take(&mut self.decisions)
    }

    /// The raises accepted since the last call, in order.
    pub fn take_raises(&mut self) -> Vec<Raise> {
        std::mem::take(&mut self.raises)
    }

    /// Counters.
    pub fn stats(&self) -> JournalStats {
        self.stats
    }

    /// Run one write through the journal's rules and store what they
    /// accept.
    fn apply(&mut self, write: &PendingWrite, now_unix_ms: u64, zombie: bool) -> OpResult {
        self.stats.ops += 1;
        let result = match &write.op {
            JournalOp::Create(new) => self.create(new, now_unix_ms),
            JournalOp::Append { id, epoch, events } => {
                match self.decide(id, |limits, meta| {
                    check_append(limits, meta, *epoch, events)
                }) {
                    Ok(next) => {
                        if let Some(r) = self.records.get_mut(id) {
                            r.events.extend(events.iter().cloned());
                        }
                        self.put(next)
                    }
                    Err(e) => OpResult::Refused(e),
                }
            }
            JournalOp::Finish {
                id,
                epoch,
                terminal,
            } => match self.decide(id, |limits, meta| {
                check_finish(limits, meta, *epoch, terminal)
            }) {
                Ok(next) => self.put(next),
                Err(e) => OpResult::Refused(e),
            },
            JournalOp::RaiseEpoch {
                id,
                expected,
                owner,
            } => match self.decide(id, |_, meta| check_raise_epoch(meta, *expected, owner)) {
                Ok(next) => {
                    let from = self
                        .records
                        .get(id)
                        .map(|r| r.meta.owner.clone())
                        .unwrap_or_default();
                    self.raises.push(Raise {
                        id: id.clone(),
                        from,
                        to: owner.clone(),
                        zombie,
                    });
                    self.put(next)
                }
                Err(e) => OpResult::Refused(e),
            },
        };
        self.decisions.push(Decision {
            writer: write.writer.clone(),
            op: write.op.clone(),
            result: result.clone(),
            zombie,
        });
        result
    }

    fn decide(
        &self,
        id: &str,
        rule: impl FnOnce(&JournalLimits, &RecordMeta) -> Result<RecordMeta, JournalError>,
    ) -> Result<RecordMeta, JournalError> {
        let meta = &self.records.get(id).ok_or(JournalError::NotFound)?.meta;
        rule(&self.limits, meta)
    }

    fn create(&mut self, new: &NewRecord, now_unix_ms: u64) -> OpResult {
        let same_id = self.records.get(&new.id).map(|r| &r.meta);
        let same_key = new
            .idempotency_key
            .and_then(|k| self.keys.get(&k))
            .and_then(|id| self.records.get(id))
            .map(|r| &r.meta);
        match check_create(
            now_unix_ms,
            &self.limits,
            self.used_bytes,
            same_id,
            same_key,
            new,
        ) {
            Ok(CreateOutcome::Create(meta)) => {
                if let Some(old) = self.records.remove(&new.id) {
                    // An expired record under the same id gives way.
                    self.used_bytes -= old.meta.stored_bytes;
                    self.unfinished.remove(&new.id);
                }
                // The key names the new record from now on. The record it
                // named (superseded or expired) is kept, unlike in a real
                // store, which deletes it: the checker still reads it, and
                // nothing else does.
                if let Some(key) = new.idempotency_key {
                    self.keys.insert(key, new.id.clone());
                }
                self.used_bytes += meta.stored_bytes;
                self.unfinished.insert(new.id.clone());
                self.records.insert(
                    new.id.clone(),
                    StoredRecord {
                        meta: meta.clone(),
                        events: Vec::new(),
                    },
                );
                OpResult::Created(CreateOutcome::Create(meta))
            }
            Ok(existing @ CreateOutcome::Existing(_)) => OpResult::Created(existing),
            Err(e) => OpResult::Refused(e),
        }
    }

    /// Store `meta` (its record exists) and keep the byte count and the
    /// unfinished index.
    fn put(&mut self, meta: RecordMeta) -> OpResult {
        let Some(r) = self.records.get_mut(&meta.id) else {
            return OpResult::Refused(JournalError::NotFound);
        };
        self.used_bytes = self.used_bytes - r.meta.stored_bytes + meta.stored_bytes;
        if meta.terminal.is_some() {
            self.unfinished.remove(&meta.id);
        } else {
            self.unfinished.insert(meta.id.clone());
        }
        r.meta = meta.clone();
        OpResult::Written(meta)
    }
}

fn new_queue() -> GroupCommit<PendingWrite> {
    GroupCommit::new(MAX_QUEUED_WRITES, MAX_BATCH_WRITES, MAX_BATCH_BYTES)
}

#[cfg(test)]
mod tests {
    use iop_core::journal::{JournalApi, RecordStatus};

    use super::*;

    fn writer() -> Writer {
        Writer::Request {
            incarnation: 0,
            request_id: 1,
        }
    }

    fn new_record(id: &str) -> NewRecord {
        NewRecord {
            id: id.into(),
            principal: "sim".into(),
            api: JournalApi::ChatCompletions,
            model: "sim".into(),
            fingerprint: [0; 32],
            idempotency_key: None,
            background: false,
            request: vec![],
            created_unix_ms: 0,
            owner: SIM_EDGE.into(),
            key_id: "sim".into(),
        }
    }

    fn append(id: &str, epoch: u64, seq: u64) -> JournalOp {
        JournalOp::Append {
            id: id.into(),
            epoch,
            events: vec![JournalEvent {
                seq,
                payload: vec![1],
            }],
        }
    }

    fn sync(store: &mut SimJournal, writes: Vec<JournalOp>) -> Vec<OpResult> {
        for op in writes {
            assert!(
                store
                    .submit(
                        0,
                        PendingWrite {
                            writer: writer(),
                            op
                        }
                    )
                    .is_ok()
            );
        }
        let generation = store.begin_sync(0).expect("a batch");
        store
            .complete_sync(0, generation, 0)
            .into_iter()
            .map(|(_, r)| r)
            .collect()
    }

    #[test]
    fn one_sync_answers_every_write_of_its_batch_and_a_refusal_stops_none() {
        let mut store = SimJournal::new(JournalLimits::default(), 1);
        let results = sync(
            &mut store,
            vec![
                JournalOp::Create(new_record("a")),
                append("a", 1, 1),
                append("a", 1, 5),
                append("a", 1, 2),
            ],
        );
        assert!(results[0].accepted() && results[1].accepted() && results[3].accepted());
        assert!(matches!(
            results[2],
            OpResult::Refused(JournalError::OutOfOrder { .. })
        ));
        assert_eq!(store.stats().syncs, 1);
        assert_eq!(store.record("a").map(|r| r.events.len()), Some(2));
        assert_eq!(store.unfinished_count(), 1);
        let held = store.record("a").map(|r| r.meta.stored_bytes);
        assert_eq!(
            Some(store.used_bytes()),
            held,
            "R-JRN-5: bytes as the rules count"
        );
    }

    #[test]
    fn a_crash_loses_the_queue_and_the_unfinished_sync_unless_it_completed() {
        for completed in [false, true] {
            let mut store = SimJournal::new(JournalLimits::default(), 1);
            sync(&mut store, vec![JournalOp::Create(new_record("a"))]);
            for seq in [1, 2] {
                let op = append("a", 1, seq);
                assert!(
                    store
                        .submit(
                            0,
                            PendingWrite {
                                writer: writer(),
                                op
                            }
                        )
                        .is_ok()
                );
                if seq == 1 {
                    assert!(store.begin_sync(0).is_some());
                }
            }
            let outcome = store.crash(0, completed, 0);
            assert_eq!(outcome.durable_unacked, usize::from(completed));
            assert_eq!(outcome.lost.len(), if completed { 1 } else { 2 });
            let last = store.record("a").map(|r| r.meta.last_seq);
            assert_eq!(last, Some(u64::from(completed)));
            assert!(!store.is_busy());
        }
    }

    #[test]
    fn a_zombie_of_the_old_epoch_is_fenced_after_a_raise() {
        let mut store = SimJournal::new(JournalLimits::default(), 1);
        sync(&mut store, vec![JournalOp::Create(new_record("a"))]);
        let raise = JournalOp::RaiseEpoch {
            id: "a".into(),
            expected: 1,
            owner: SIM_EDGE.into(),
        };
        assert!(sync(&mut store, vec![raise])[0].accepted());
        let zombie = PendingWrite {
            writer: writer(),
            op: append("a", 1, 1),
        };
        assert!(matches!(
            store.apply_now(&zombie, 0),
            OpResult::Refused(JournalError::Fenced {
                current: 2,
                writer: 1
            })
        ));
        let finish = JournalOp::Finish {
            id: "a".into(),
            epoch: 2,
            terminal: Terminal {
                status: RecordStatus::Incomplete,
                reason: Some("edge_restart".into()),
                message: None,
                at_unix_ms: 0,
            },
        };
        assert!(sync(&mut store, vec![finish])[0].accepted());
        assert_eq!(store.unfinished_count(), 0);
        assert_eq!(store.take_decisions().len(), 4);
    }
}
