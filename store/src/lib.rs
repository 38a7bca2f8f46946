//! # iop-store: where durable responses live
//!
//! One trait, [`JournalStore`], and its stores. Every store runs the
//! journal's rules of [`iop_core::journal`] inside its own transactions;
//! none decides anything itself, so the rules (R-JRN-1..5, R-IDEM-1) hold
//! the same whichever store runs.
//!
//! * [`EmbeddedStore`] ([`embedded`]): one local file on redb, group-committed with one
//!   fsync per batch (R-JRN-1); survives a crash or a restart. The store of
//!   a single Edge.
//! * [`MemoryStore`]: in process memory; for tests and the simulator (not
//!   durable across a restart).
//!
//! Every store also keeps the Edges' ownership leases
//! ([`JournalStore::put_lease`], R-TAKE-1): a store shared by many Edges
//! (NATS JetStream, `iop-store-nats`) in its own storage; the embedded and
//! in-memory stores, each opened by one process only, in that process
//! ([`LeaseTable`]).
//!
//! Every store counts what each API key and each principal holds in the
//! journal ([`JournalStore::held`], R-TEN-1's quotas) in [`HeldGauges`]
//! kept with its records.
//!
//! Tenants' shared state (counters, usage, runtime keys; SPEC §9) is the
//! other trait here, [`TenantStore`] ([`tenant`]): in memory
//! ([`MemoryTenantStore`]), in the embedded store's file
//! ([`EmbeddedStore::tenant_store`]), and on NATS (`iop-store-nats`).
//!
//! With the `conformance` feature, `iop_store::conformance` is the suite of
//! behaviours every store must show, whatever its engine: each store's
//! tests run it.

#![deny(missing_docs)]

use std::future::Future;
use std::pin::Pin;

pub use iop_core::journal::{
    CreateOutcome, EdgeLease, JournalError, JournalEvent, JournalLimits, NewRecord, RecordMeta,
    StoredLease, Terminal,
};

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
pub mod embedded;
mod held;
mod lease;
pub mod legacy;
mod memory;
pub mod tenant;

pub use embedded::{EmbeddedOptions, EmbeddedStore, OpenError, SWEEP_BATCH_RECORDS, VerifyReport};
pub use held::{HeldGauges, Holding};
pub use iop_core::tenant::{Held, Subject};
pub use lease::LeaseTable;
pub use memory::MemoryStore;
pub use tenant::{MemoryTenantStore, TenantStore, TenantStoreError, UsageWriteError};

/// A boxed future, so the trait can be used as `dyn JournalStore`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How far a record is: the last durable event and whether it has its
/// terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The last durable event's number (0: none).
    pub last_seq: u64,
    /// The terminal is durable.
    pub ended: bool,
}

/// Counters of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Records held.
    pub records: u64,
    /// Bytes held (as counted by the journal's rules).
    pub used_bytes: u64,
    /// Syncs (transactions made durable).
    pub syncs: u64,
    /// Operations written.
    pub ops: u64,
    /// Records set aside because they do not decode (R-JRN-6): never
    /// served, never fatal to the store or to other records.
    pub quarantined: u64,
}

/// A record as [`JournalStore::get`] returns it: its metadata and its
/// stored request bytes.
pub type StoredRecord = (RecordMeta, Vec<u8>);

/// One store of durable responses; every method is one transaction,
/// durable when it returns `Ok` (R-JRN-1).
pub trait JournalStore: Send + Sync + 'static {
    /// Create `record` (epoch 1), or return the live record its
    /// idempotency key names with the same fingerprint
    /// ([`CreateOutcome::Existing`]). `record.created_unix_ms` is "now" for
    /// expiry.
    fn create(&self, record: NewRecord) -> BoxFuture<'_, Result<CreateOutcome, JournalError>>;
    /// Append numbered events under `epoch`.
    fn append(
        &self,
        id: String,
        epoch: u64,
        events: Vec<JournalEvent>,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>>;
    /// Write the one terminal under `epoch`.
    fn finish(
        &self,
        id: String,
        epoch: u64,
        terminal: Terminal,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>>;
    /// Compare-and-set the epoch from `expected` to `expected + 1`; `owner`
    /// (the winning Edge's id) becomes the record's owner.
    fn raise_epoch(
        &self,
        id: String,
        expected: u64,
        owner: String,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>>;
    /// The record and its stored request bytes; `None` if absent or
    /// expired.
    fn get(
        &self,
        id: String,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<Option<StoredRecord>, JournalError>>;
    /// Events with `seq > after`, in order, at most `max`.
    fn events(
        &self,
        id: String,
        after: u64,
        max: usize,
    ) -> BoxFuture<'_, Result<Vec<JournalEvent>, JournalError>>;
    /// Remove a record, its events and its idempotency key.
    fn delete(&self, id: String) -> BoxFuture<'_, Result<(), JournalError>>;
    /// Every record without a terminal, as stored (the R-TAKE-1 scan at
    /// start).
    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>>;
    /// The records without a terminal as this store knows them now,
    /// without a round trip when it keeps such a view (a shared store's
    /// local directory may lag a moment behind other Edges' writes): the
    /// candidates of the periodic takeover scan, each read again before it
    /// is acted on. By default [`Self::unfinished`].
    fn unfinished_hint(&self) -> BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>> {
        self.unfinished()
    }
    /// Remove expired records; how many.
    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, JournalError>>;
    /// Follow a record's progress: the value changes after every durable
    /// append and at the terminal; the first value is the stored progress.
    fn watch(
        &self,
        id: String,
    ) -> BoxFuture<'_, Result<tokio::sync::watch::Receiver<Progress>, JournalError>>;
    /// Counters.
    fn stats(&self) -> StoreStats;
    /// The store can run nothing more until it is opened again (an
    /// embedded engine refuses every write after an I/O error, or its
    /// writer stopped): its owner closes it and opens it again (R-JRN-6,
    /// [`iop_core::journal::availability`]). A store that mends itself
    /// (a NATS client reconnects) never says so.
    fn needs_reopen(&self) -> bool {
        false
    }
    /// Write `lease`, an Edge's ownership lease (R-TAKE-1), if the stored
    /// lease of its `edge_id` is still at revision `expected` (0: none):
    /// the new revision, greater than every earlier one. Refused with
    /// [`JournalError::Fenced`] (`current`: the stored revision) when it is
    /// not ([`check_put_lease`](iop_core::journal::check_put_lease)).
    fn put_lease(
        &self,
        lease: EdgeLease,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, JournalError>>;
    /// The lease of `edge_id` as stored now (a fresh read, never a cached
    /// value: a takeover decides on it).
    fn lease(&self, edge_id: String) -> BoxFuture<'_, Result<Option<StoredLease>, JournalError>>;
    /// Every lease the store holds, read fresh.
    fn leases(&self) -> BoxFuture<'_, Result<Vec<StoredLease>, JournalError>>;
    /// What `subject` (a key id or a principal) holds in the journal now,
    /// as this store's own view counts it: the bytes of its records and its
    /// background records without a terminal (R-TEN-1). Answered at once
    /// from gauges kept with every record change, never a round trip; a
    /// shared store's view counts every Edge's records, a moment behind
    /// their writes.
    fn held(&self, subject: &Subject) -> Held;
}
