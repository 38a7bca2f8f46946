//! The one writer of the file: group commit (R-JRN-1).
//!
//! Callers submit operations into a bounded queue ([`GroupCommit`], R-LIM-4)
//! and await a oneshot answer. One dedicated thread takes everything
//! waiting (a bounded batch), runs each operation through the journal's
//! rules inside **one** write transaction, commits it with one fsync, tells
//! the watchers, and only then answers every operation of the batch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use iop_core::journal::{GroupCommit, JournalError, JournalLimits, Ticket};
use redb::{Database, Durability};
use tokio::sync::{oneshot, watch};

use super::ops::{Answer, Notice, Reply, Request};
use super::tables::{Fault, WriteTables};
use crate::{Held, HeldGauges, Progress, StoreStats, Subject};

/// Bounds of the writer's queue and batches (R-LIM-4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct QueueBounds {
    pub(super) max_queued_ops: usize,
    pub(super) max_batch_ops: usize,
    pub(super) max_batch_bytes: usize,
    /// Operations of one principal waiting at most (R-TEN-1).
    pub(super) max_queued_per_principal: usize,
}

struct Queued {
    request: Request,
    answer: oneshot::Sender<Answer>,
}

struct QueueState {
    commit: GroupCommit<Queued>,
    next_ticket: u64,
    /// No more submissions: the store is closing or the writer stopped.
    closed: bool,
}

/// The least size of the watchers' map at which it is pruned.
const MIN_WATCHERS_PRUNE: usize = 1_024;

/// What the callers and the writer thread share.
pub(super) struct Shared {
    queue: Mutex<QueueState>,
    wake: Condvar,
    /// Senders of the records being watched; changed only by the writer
    /// (after a commit) and by `watch` (which reads the record while it
    /// holds this lock, so no commit's notice falls between its read and
    /// its subscription).
    watchers: Mutex<HashMap<String, watch::Sender<Progress>>>,
    /// When the watchers' map next drops the senders nobody follows any
    /// more (a finished record gets no later notice that would drop it).
    watchers_prune_at: AtomicUsize,
    /// What each key and principal holds (R-TEN-1): counted from every
    /// record at open, then moved by each durable batch's notices.
    held: Mutex<HeldGauges>,
    /// The write share (principal) of each running record: its writes
    /// queue within that share (R-TEN-1). Learned at open and from each
    /// durable batch; a record this map does not know writes in no share.
    shares: Mutex<HashMap<String, u64>>,
    /// A commit failed: the engine refuses every write until the file is
    /// opened again (R-JRN-6).
    broken: AtomicBool,
    quarantined: AtomicU64,
    records: AtomicU64,
    used_bytes: AtomicU64,
    syncs: AtomicU64,
    ops: AtomicU64,
    writer_alive: AtomicBool,
}

impl Shared {
    pub(super) fn new(bounds: QueueBounds, opened: super::tables::RecordScan) -> Self {
        let super::tables::RecordScan {
            held,
            shares,
            quarantined,
            used_bytes,
            records,
            ..
        } = opened;
        Shared {
            queue: Mutex::new(QueueState {
                commit: GroupCommit::new(
                    bounds.max_queued_ops,
                    bounds.max_batch_ops,
                    bounds.max_batch_bytes,
                )
                .with_share_bound(bounds.max_queued_per_principal),
                next_ticket: 0,
                closed: false,
            }),
            wake: Condvar::new(),
            watchers: Mutex::new(HashMap::new()),
            watchers_prune_at: AtomicUsize::new(MIN_WATCHERS_PRUNE),
            held: Mutex::new(held),
            shares: Mutex::new(shares),
            broken: AtomicBool::new(false),
            quarantined: AtomicU64::new(quarantined),
            records: AtomicU64::new(records),
            used_bytes: AtomicU64::new(used_bytes),
            syncs: AtomicU64::new(0),
            ops: AtomicU64::new(0),
            writer_alive: AtomicBool::new(true),
        }
    }

    fn queue(&self) -> MutexGuard<'_, QueueState> {
        // Every mutation under this lock is one queue call: a panic
        // elsewhere leaves it consistent.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn watchers(&self) -> MutexGuard<'_, HashMap<String, watch::Sender<Progress>>> {
        self.watchers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Add a watcher to `watchers` (the map under [`Self::watchers`]'s
    /// lock). Once the map has doubled since it was last pruned, the
    /// senders nobody follows are dropped first: a record that ended gets
    /// no later notice to drop its sender, so without this every followed
    /// record kept one until it expired (memory grew with retention, not
    /// with followers). Amortized O(1) per watch.
    pub(super) fn add_watcher(
        &self,
        watchers: &mut HashMap<String, watch::Sender<Progress>>,
        id: String,
        tx: watch::Sender<Progress>,
    ) {
        if watchers.len() >= self.watchers_prune_at.load(Ordering::Relaxed) {
            watchers.retain(|_, tx| tx.receiver_count() > 0);
            self.watchers_prune_at.store(
                (watchers.len() * 2).max(MIN_WATCHERS_PRUNE),
                Ordering::Relaxed,
            );
        }
        watchers.insert(id, tx);
    }

    fn shares(&self) -> MutexGuard<'_, HashMap<String, u64>> {
        // Single inserts and removes.
        self.shares.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The store can write nothing more until the file is opened again:
    /// a commit failed (the engine refuses every write after it), or the
    /// writer thread is gone.
    pub(super) fn needs_reopen(&self) -> bool {
        self.broken.load(Ordering::Acquire) || !self.writer_alive.load(Ordering::Acquire)
    }

    fn gauges(&self) -> MutexGuard<'_, HeldGauges> {
        // Each change is applied whole under the lock.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What `subject` holds, as of the last durable batch.
    pub(super) fn held(&self, subject: &Subject) -> Held {
        self.gauges().held(subject)
    }

    /// Queue `request`; the receiver answers once its batch is durable.
    /// A full queue refuses at once (R-LIM-4), and so does one whose
    /// principal's share is full (R-TEN-1): a transient refusal, which
    /// the caller may retry.
    pub(super) fn submit(
        &self,
        request: Request,
    ) -> Result<oneshot::Receiver<Answer>, JournalError> {
        let (tx, rx) = oneshot::channel();
        let bytes = request.bytes();
        let share = match &request {
            Request::Create(record) => Some(iop_core::journal::write_share(&record.principal)),
            other => other
                .record_id()
                .and_then(|id| self.shares().get(id).copied()),
        };
        let mut q = self.queue();
        if q.closed || !self.writer_alive.load(Ordering::Acquire) {
            return Err(JournalError::Store("the journal writer has stopped".into()));
        }
        let ticket = Ticket(q.next_ticket);
        q.next_ticket = q.next_ticket.wrapping_add(1);
        q.commit
            .submit_as(
                ticket,
                Queued {
                    request,
                    answer: tx,
                },
                bytes,
                share,
            )
            .map_err(|full| JournalError::Store(full.to_string()))?;
        drop(q);
        self.wake.notify_one();
        Ok(rx)
    }

    /// Stop taking submissions; the writer finishes what is queued, then
    /// exits.
    pub(super) fn close(&self) {
        self.queue().closed = true;
        self.wake.notify_all();
    }

    pub(super) fn stats(&self) -> StoreStats {
        StoreStats {
            records: self.records.load(Ordering::Acquire),
            used_bytes: self.used_bytes.load(Ordering::Acquire),
            syncs: self.syncs.load(Ordering::Acquire),
            ops: self.ops.load(Ordering::Acquire),
            quarantined: self.quarantined.load(Ordering::Acquire),
        }
    }

    /// The next batch, waiting for one; `None` once closed and drained.
    fn next_batch(&self) -> Option<Vec<(Ticket, Queued)>> {
        let mut q = self.queue();
        loop {
            if let Some(batch) = q.commit.poll_batch() {
                return Some(batch);
            }
            if q.closed {
                return None;
            }
            q = self.wake.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn batch_done(&self) {
        self.queue().commit.synced();
    }

    /// Apply the notices of a durable batch, in commit order.
    fn notify(&self, notices: Vec<Notice>) {
        if notices.is_empty() {
            return;
        }
        let mut watchers = self.watchers();
        let mut gauges = self.gauges();
        let mut shares = self.shares();
        for notice in notices {
            match notice {
                Notice::Share(id, Some(share)) => {
                    shares.insert(id, share);
                }
                Notice::Share(id, None) => {
                    shares.remove(&id);
                }
                Notice::Held { old, new } => gauges.change(old.as_ref(), new.as_ref()),
                Notice::Progress(id, progress) => {
                    if let Some(tx) = watchers.get(&id) {
                        tx.send_replace(progress);
                        // Nobody follows it any more: a later `watch`
                        // starts again from the stored record. Keeps the
                        // map to the records someone watches.
                        if tx.receiver_count() == 0 {
                            watchers.remove(&id);
                        }
                    }
                }
                Notice::Gone(id) => {
                    shares.remove(&id);
                    watchers.remove(&id);
                }
            }
        }
    }
}

/// Marks the writer gone however its thread ends (a panic included), so
/// submissions fail at once instead of waiting on a queue nobody drains;
/// what is still queued is dropped, and its callers get an error.
struct WriterExit<'a>(&'a Shared);

impl Drop for WriterExit<'_> {
    fn drop(&mut self) {
        self.0.writer_alive.store(false, Ordering::Release);
        let mut q = self.0.queue();
        q.closed = true;
        q.commit.synced();
        while let Some(batch) = q.commit.poll_batch() {
            q.commit.synced();
            drop(batch);
        }
    }
}

/// The writer thread's loop.
pub(super) fn run(db: Arc<Database>, shared: Arc<Shared>, limits: JournalLimits) {
    let _exit = WriterExit(&shared);
    while let Some(batch) = shared.next_batch() {
        write_batch(&db, &shared, &limits, batch);
        shared.batch_done();
    }
}

/// What one committed batch changed.
struct Committed {
    replies: Vec<Reply>,
    notices: Vec<Notice>,
    used_bytes: u64,
    records: u64,
    synced: bool,
}

fn write_batch(
    db: &Database,
    shared: &Shared,
    limits: &JournalLimits,
    batch: Vec<(Ticket, Queued)>,
) {
    let (requests, answers): (Vec<Request>, Vec<oneshot::Sender<Answer>>) = batch
        .into_iter()
        .map(|(_, q)| (q.request, q.answer))
        .unzip();
    match apply_and_commit(db, limits, requests) {
        Ok(done) => {
            if done.synced {
                shared.syncs.fetch_add(1, Ordering::AcqRel);
            }
            let accepted = done.replies.iter().filter(|r| r.accepted()).count() as u64;
            shared.ops.fetch_add(accepted, Ordering::AcqRel);
            shared.used_bytes.store(done.used_bytes, Ordering::Release);
            shared.records.store(done.records, Ordering::Release);
            // R-JRN-1: watchers (and so clients) learn of a change only
            // once it is durable.
            shared.notify(done.notices);
            for (tx, reply) in answers.into_iter().zip(done.replies) {
                // A caller that went away does not need its answer.
                let _ = tx.send(Ok(reply));
            }
        }
        Err(fault) => {
            tracing::error!(error = %fault, "journal batch not committed");
            if matches!(fault, Fault::Engine(_)) {
                // The engine refuses every write after a failed commit:
                // the file must be opened again (R-JRN-6).
                shared.broken.store(true, Ordering::Release);
            }
            let err = JournalError::from(fault);
            for tx in answers {
                let _ = tx.send(Err(err.clone()));
            }
        }
    }
}

/// Run every request of the batch in one transaction and commit it with
/// one sync (nothing to sync when no request changed anything). A request
/// the rules refuse writes nothing and does not disturb the others.
fn apply_and_commit(
    db: &Database,
    limits: &JournalLimits,
    requests: Vec<Request>,
) -> Result<Committed, Fault> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)?;
    let mut tables = WriteTables::open(&txn, *limits)?;
    let mut replies = Vec::with_capacity(requests.len());
    for request in requests {
        replies.push(tables.apply(request)?);
    }
    let summary = tables.close()?;
    if summary.dirty {
        txn.commit()?;
    } else {
        txn.abort()?;
    }
    Ok(Committed {
        replies,
        notices: summary.notices,
        used_bytes: summary.used_bytes,
        records: summary.records,
        synced: summary.dirty,
    })
}
