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
//! With the `conformance` feature, `iop_store::conformance` is the suite of
//! behaviours every store must show, whatever its engine: each store's
//! tests run it.

#![deny(missing_docs)]

use std::future::Future;
use std::pin::Pin;

pub use iop_core::journal::{
    CreateOutcome, JournalError, JournalEvent, JournalLimits, NewRecord, RecordMeta, Terminal,
};

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
pub mod embedded;
mod memory;

pub use embedded::{EmbeddedOptions, EmbeddedStore, OpenError, SWEEP_BATCH_RECORDS, VerifyReport};
pub use memory::MemoryStore;

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
    /// Compare-and-set the epoch from `expected` to `expected + 1`.
    fn raise_epoch(
        &self,
        id: String,
        expected: u64,
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
    /// Every record without a terminal (the R-TAKE-1 scan at start).
    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>>;
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
}
