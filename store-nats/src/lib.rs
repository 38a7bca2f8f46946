//! # iop-store-nats: the journal on NATS JetStream, shared by many Edges
//!
//! [`NatsStore`] is an [`iop_store::JournalStore`] whose records live on a
//! NATS server (or cluster), so several Edges share durable responses,
//! idempotency keys and writer epochs (SPEC §8, R-MULTI-1): a client may
//! resume on any Edge, and any Edge may take over another's response.
//! Every decision comes from [`iop_core::journal`]'s `check_*` functions;
//! the store reads, writes and commits, and decides nothing itself.
//!
//! ## Layout
//!
//! * A **key-value bucket** (`iop_journal`, stream `KV_iop_journal`,
//!   history 1) holds one value per record under `rec.<id>`: the journal's
//!   [`RecordMeta`] (epoch, last event number, terminal, bytes) and where
//!   its request and events are in the stream, including the stream
//!   sequence of its last committed append message. Idempotency keys are
//!   entries `key.<hash>` naming a response id (the key is only ever
//!   stored hashed with its principal, R-IDEM-1). Each Edge's ownership
//!   lease (R-TAKE-1) is an entry `lease.<edge id>`; the record names its
//!   owner (the Edge that created it or last won its epoch). Values start
//!   with a format byte: records are format 3 (with their owner and their
//!   API key); format 2 (before keys) is still read, as of no key
//!   ([`NO_KEY_ID`](iop_core::journal::NO_KEY_ID)), and format 1 (before
//!   owners) as owned by [`NO_OWNER`](iop_core::journal::NO_OWNER) too.
//!   (An Edge of an earlier build cannot read format 3: upgrade every
//!   Edge of a deployment together.)
//! * A **stream** (`IOP_JOURNAL`) holds, per response, its request on
//!   `<prefix>.req.<id>` and its events on `<prefix>.ev.<id>`: one message
//!   per append, carrying every event of the append (more messages only
//!   when an append is larger than the server's message size).
//!
//! Ids are escaped into one subject token (`[A-Za-z0-9_-]` kept, any other
//! byte `=HH`), so no id can reach another's subjects.
//!
//! ## The commit point
//!
//! The record's value in the bucket is the commit point of every
//! operation. An operation reads the record with its revision, decides
//! with `check_create`/`check_append`/`check_finish`/`check_raise_epoch`,
//! writes what it needs to the stream, then writes the new value with a
//! compare-and-set on the revision it read (the bucket's expected last
//! subject sequence). If another write came in between, the set fails:
//! the operation reads again and decides again (at most 64 rounds).
//! Nothing is visible before that set succeeds, and the set succeeds only
//! for a decision made on the record as it stands — which is how the
//! epoch fence (R-JRN-3), dense numbering (R-JRN-2) and the one terminal
//! (R-JRN-4) hold across Edges: a takeover's raised epoch is a write, so
//! a former owner's set after it fails, and its decision on the new value
//! is `Fenced`. To save a round trip a writer may first decide on the
//! value this store last saw (its own last write, or the bucket watch's);
//! a stale one fails the set, or makes the rules refuse, and then it is
//! read and decided again before any answer.
//!
//! ## Appends, and the orphans of a lost commit
//!
//! An append publishes its message to the response's subject with
//! *expected last subject sequence* = the record's last committed message
//! (0 before the first), waits for the ack, then commits the record with
//! that message's sequence as its new end. Group commit (R-JRN-1): all
//! the events of an append are one message and one ack, and the record's
//! set is one more; appends of different responses run concurrently on
//! one connection. (An append larger than a message is split, each part
//! expecting the previous one, so nothing can land between them.) The
//! record is set only after the ack, and an acknowledged message is
//! written by the server (SIGKILL of the server loses none); for power
//! loss, run the stream and bucket with 3 replicas (acked by a quorum).
//!
//! The message also carries the record revision its writer decided on. If
//! the writer's set then loses (a takeover raised the epoch between its
//! read and its set), or never comes (its Edge died, or the server did
//! before the set), the message is an **orphan**:
//!
//! * *Never visible.* Readers read a record's events only up to the last
//!   committed message its value names, and a writer commits only once
//!   the orphans between that end and its own message are deleted. So the
//!   messages of a record up to its end are exactly its committed appends,
//!   in order: a fenced writer can make no event visible, nor a terminal
//!   (the record's value alone).
//! * *Cleared by the next writer.* The next append's publish is refused
//!   while an orphan is the subject's last message. That writer looks at
//!   it: decided on a revision older than its own, it can never commit
//!   (its set expects a revision the record has left); decided on the
//!   same revision, its writer has not committed (in flight or gone), and
//!   the record is written again unchanged, a set like any commit, after
//!   which it can never commit either; decided on a newer one, this
//!   writer's read is stale and it reads again. It then publishes after
//!   the orphan, deletes the orphans before its own message (all of one
//!   record's before its first append at once), and commits. (It never
//!   deletes the subject's last message while others stay: a 2.9 server
//!   then loses the subject's last sequence.)
//!
//! A request is published before its record is created; the record names
//! its parts' sequences, and the first is the record's *incarnation* (an
//! id reused after expiry is a new incarnation; events are read only from
//! after it). Removing a record (delete, sweep, an expired record giving
//! its key or id way) writes its delete marker (the commit), frees its key
//! and purges its messages up to the sequences it named (an orphan after
//! them stays until the id is used again).
//!
//! ## Idempotency keys
//!
//! A create writes its record first, then claims its key with a
//! compare-and-set (on revision 0 for a key never written). So a
//! key entry always names a record that was written, and one naming a
//! missing record, or a record that does not carry that key, is stale and
//! free. A create that loses its key to a concurrent one removes its own
//! record and answers with the winner (`Existing` or a conflict), so a key
//! names at most one response (R-IDEM-1). A key's record that expired or
//! failed before any event ([`superseded`](iop_core::journal::superseded))
//! gives way, as in the in-memory store.
//!
//! ## Watching, and the directory
//!
//! Each store follows the whole bucket with one ordered consumer (its
//! *directory*): the latest value and revision of every record, ordered by
//! revision. [`watch`](iop_store::JournalStore::watch) is a follower of
//! that: its value changes in the call that commits a local write (a
//! watcher has seen an append when `append` returns) and when the bucket
//! watch delivers another Edge's write; it ends when the record is deleted
//! or its id reused. One consumer per Edge, however many clients follow.
//! The directory also gives `used_bytes` (the sum of the records' journal
//! bytes, for `check_create`), what each API key and principal holds
//! ([`held`](iop_store::JournalStore::held), R-TEN-1), `stats`, the
//! candidates of `sweep`, of the
//! restart scan and of the periodic takeover scan
//! ([`unfinished_hint`](iop_store::JournalStore::unfinished_hint)), each
//! read again before it is acted on.
//!
//! ## Bounds (R-JRN-5)
//!
//! The journal's bound is core's: `check_create` refuses a new record once
//! the records (as every Edge's directory counts them) hold `max_bytes`,
//! and running records may still grow to their terminal. (Edges deciding
//! at the same moment each count without the other's new record: the
//! bound may be passed by the creates in flight at once.) Underneath, the
//! stream and the bucket have `max_bytes` limits with discard `new`: the
//! hard stop, which a write meets as [`JournalError::Full`]. So that an
//! accepted record never meets it, a create is also refused once the
//! stream has less than `stream_reserve_bytes` free (or the bucket less
//! than `bucket_reserve_bytes`), from their sizes asked at most every
//! `usage_refresh` and grown by this store's own creates in between. Size
//! the reserve for the growth of the records running at once (their count
//! times their bytes still to come, plus message overhead). Running
//! records never expire and nothing evicts them; `sweep` removes finished
//! records past their retention, then purges delete markers older than
//! `marker_grace`.
//!
//! ## Ownership leases
//!
//! [`put_lease`](iop_store::JournalStore::put_lease) writes an Edge's
//! lease with a compare-and-set on the revision its writer last read, so
//! each renewal is a new bucket revision and a second writer of one
//! `edge_id` is refused (`Fenced`). [`lease`](iop_store::JournalStore::lease)
//! and [`leases`](iop_store::JournalStore::leases) read from the bucket
//! stream's leader, never a replica that may lag: a takeover decides on
//! them (its rule, in `iop_core::journal::LeaseView`, waits for a lease's
//! revision to stand still for its TTL; the bucket keeps no TTL of its
//! own). The directory knows every lease key, so `leases` is one leader
//! read per Edge.
//!
//! ## Tenants
//!
//! [`NatsStore::tenant_store`] keeps tenants' shared state (claimed
//! counters, usage rows, runtime keys) in four more buckets on the same
//! connection: see [`tenant`].
//!
//! ## Failures
//!
//! A limit answer is [`JournalError::Full`]; any other server error, and
//! a write whose ack did not come (its outcome unknown: a later read
//! shows it), is [`JournalError::Store`]. The connection reconnects by
//! itself; while it is down every operation fails at once with
//! [`JournalError::Store`] (the client's connection state is asked first),
//! so durable requests are refused without waiting for a timeout, and may
//! be retried.

#![deny(missing_docs)]

// The test harness of `tests/` names the crate, as integration tests do.
#[cfg(test)]
extern crate self as iop_store_nats;

use std::sync::{Arc, Mutex};

use iop_core::journal::{
    CreateOutcome, EdgeLease, JournalError, JournalEvent, NewRecord, RecordMeta, StoredLease,
    Terminal,
};
use iop_store::{
    BoxFuture, Held, JournalStore, Progress, StoreStats, StoredRecord, Subject, TenantStore,
};
use tokio::sync::watch;

mod directory;
mod error;
mod follow;
mod layout;
mod options;
mod setup;
mod store;
mod tenant;
#[cfg(test)]
mod tests;

pub use error::ConnectError;
pub use options::{MIN_MESSAGE_BYTES, NatsAuth, NatsOptions};
pub use tenant::{MAX_CAS_ATTEMPTS, RATE_COUNTER_MAX_AGE};

use store::Inner;

/// The journal on NATS JetStream (see the crate docs).
pub struct NatsStore {
    inner: Arc<Inner>,
    follower: tokio::task::JoinHandle<()>,
    /// Tenants' state on this connection, made at its first use.
    tenants: tokio::sync::OnceCell<Arc<tenant::NatsTenantStore>>,
}

impl Drop for NatsStore {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

impl NatsStore {
    /// Connect, create the stream and the bucket if missing (or check the
    /// existing ones), load the bucket's records and start following it.
    pub async fn connect(options: NatsOptions) -> Result<NatsStore, ConnectError> {
        options.validate()?;
        let client = setup::client(&options).await?;
        let js = async_nats::jetstream::ContextBuilder::new()
            .timeout(options.request_timeout)
            .build(client.clone());
        let names = layout::Names::new(&options.bucket, &options.subject_prefix);
        let events = setup::events_stream(&js, &options, &names).await?;
        let kv = setup::bucket_stream(&js, &options).await?;
        let directory = Arc::new(Mutex::new(directory::Directory::default()));
        let follower = follow::start(
            kv.clone(),
            client.clone(),
            follow::Watch {
                filter_subject: format!("{}>", names.kv_prefix),
                description: "iop journal directory",
            },
            Arc::new(follow::DirectoryFollower {
                dir: directory.clone(),
                names: names.clone(),
            }),
            options.connect_timeout,
        )
        .await?;
        let max_message_bytes = setup::max_message_bytes(&options, &client);
        Ok(NatsStore {
            inner: Arc::new(Inner::new(
                client,
                js,
                events,
                kv,
                names,
                options,
                max_message_bytes,
                directory,
            )),
            follower,
            tenants: tokio::sync::OnceCell::new(),
        })
    }

    /// Tenants' shared state (counters, usage rows, runtime keys; SPEC
    /// §9) on this store's connection, in key-value buckets named after
    /// its bucket (see [`tenant`]'s docs): made (or checked) and its keys
    /// loaded at the first call, the same store at every later one.
    /// Fails as [`connect`](Self::connect) does when the buckets cannot be
    /// made or the keys not loaded within `connect_timeout`.
    pub async fn tenant_store(&self) -> Result<Arc<dyn TenantStore>, ConnectError> {
        let store = self
            .tenants
            .get_or_try_init(|| async {
                let inner = &self.inner;
                tenant::NatsTenantStore::open(inner.client.clone(), inner.js.clone(), &inner.opts)
                    .await
                    .map(Arc::new)
            })
            .await?;
        Ok(store.clone())
    }
}

impl JournalStore for NatsStore {
    fn create(&self, record: NewRecord) -> BoxFuture<'_, Result<CreateOutcome, JournalError>> {
        Box::pin(async move { self.inner.create(record).await })
    }

    fn append(
        &self,
        id: String,
        epoch: u64,
        events: Vec<JournalEvent>,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        Box::pin(async move { self.inner.append(&id, epoch, events).await })
    }

    fn finish(
        &self,
        id: String,
        epoch: u64,
        terminal: Terminal,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        Box::pin(async move { self.inner.finish(&id, epoch, terminal).await })
    }

    fn raise_epoch(
        &self,
        id: String,
        expected: u64,
        owner: String,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        Box::pin(async move { self.inner.raise_epoch(&id, expected, &owner).await })
    }

    fn get(
        &self,
        id: String,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<Option<StoredRecord>, JournalError>> {
        Box::pin(async move { self.inner.get(&id, now_unix_ms).await })
    }

    fn events(
        &self,
        id: String,
        after: u64,
        max: usize,
    ) -> BoxFuture<'_, Result<Vec<JournalEvent>, JournalError>> {
        Box::pin(async move { self.inner.events(&id, after, max).await })
    }

    fn delete(&self, id: String) -> BoxFuture<'_, Result<(), JournalError>> {
        Box::pin(async move { self.inner.delete(&id).await })
    }

    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>> {
        Box::pin(async move { self.inner.unfinished().await })
    }

    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, JournalError>> {
        Box::pin(async move { self.inner.sweep(now_unix_ms).await })
    }

    fn watch(&self, id: String) -> BoxFuture<'_, Result<watch::Receiver<Progress>, JournalError>> {
        Box::pin(async move { self.inner.watch(&id).await })
    }

    fn unfinished_hint(&self) -> BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>> {
        let hint = self.inner.unfinished_hint();
        Box::pin(async move { hint })
    }

    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }

    fn put_lease(
        &self,
        lease: EdgeLease,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, JournalError>> {
        Box::pin(async move { self.inner.put_lease(lease, expected).await })
    }

    fn lease(&self, edge_id: String) -> BoxFuture<'_, Result<Option<StoredLease>, JournalError>> {
        Box::pin(async move { self.inner.lease(&edge_id).await })
    }

    fn leases(&self) -> BoxFuture<'_, Result<Vec<StoredLease>, JournalError>> {
        Box::pin(async move { self.inner.leases().await })
    }

    fn held(&self, subject: &Subject) -> Held {
        self.inner.held(subject)
    }
}
