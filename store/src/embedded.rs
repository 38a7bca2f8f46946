//! The embedded store: durable responses in one local file, on
//! [redb](https://docs.rs/redb).
//!
//! # Why redb
//!
//! redb is pure Rust (no C toolchain, no server), keeps everything in one
//! file, and is ACID: a write transaction's copy-on-write B-trees become
//! visible by flipping a checksummed commit slot, and a commit with
//! `Durability::Immediate` returns only after `fsync`. A crash at any
//! point leaves the last committed transaction: on the next open redb
//! verifies the checksums and rebuilds its allocator state (time grows with
//! the file's size), and nothing half-written is ever read.
//!
//! # The file
//!
//! | table | key | value |
//! | --- | --- | --- |
//! | `records` | response id | postcard [`RecordMeta`] |
//! | `requests` | response id | the stored request bytes |
//! | `events` | (response id, seq) | the event's payload |
//! | `idempotency_keys` | hashed key (32 bytes) | response id |
//! | `expiry` | (expires_unix_ms, response id) | () |
//! | `meta` | `format_version`, `used_bytes` | u64 |
//! | `tenant_*` | tenants' counters, usage rows and keys ([`EmbeddedStore::tenant_store`]) | |
//!
//! A record's events sort by number under its id, so `events(id, after,
//! max)` is one range scan (R-JRN-2). `expiry` lists finished records by
//! when they expire, so a sweep reads only what is due; running records are
//! never in it (R-JRN-5). `used_bytes` is the journal's byte count (the
//! sum of every record's `stored_bytes`), written in the same transaction
//! as the records it counts. A file whose `format_version` this build does
//! not know is refused at open ([`OpenError::UnknownFormat`]); one of an
//! earlier format (records without their owner, or without their API
//! key) is upgraded at open. The file is created with mode 0600 on Unix
//! (it holds prompts and answers).
//!
//! What each API key and principal holds (R-TEN-1's journal-bytes and
//! background quotas, [`JournalStore::held`]) is counted from every
//! record at open, then moved by each batch once it is durable.
//!
//! # Group commit (R-JRN-1)
//!
//! One dedicated thread (not a tokio worker: a sync blocks it) owns every
//! write. Callers put their operation into a bounded queue
//! ([`GroupCommit`](iop_core::journal::GroupCommit); a full queue refuses
//! at once with [`JournalError::Store`], R-LIM-4) and await a oneshot
//! answer. The writer takes everything waiting, up to a bounded batch, and:
//!
//! 1. opens **one** write transaction;
//! 2. runs each operation through the journal's rules against the
//!    transaction's current state (so the batch's earlier operations
//!    count): a refused operation writes nothing and does not disturb the
//!    others;
//! 3. commits with one fsync (no commit when nothing was written);
//! 4. tells the watchers ([`JournalStore::watch`]), so a delta can be
//!    published only once it is durable;
//! 5. answers every operation; if the commit failed, every operation of the
//!    batch gets [`JournalError::Store`] and the watchers learn nothing.
//!
//! While a batch syncs, new operations queue and go together in the next:
//! many appends, of one response or many, share one sync.
//!
//! An operation is queued when its method is called, not when its future
//! is first polled (dropping the future does not withdraw it), so
//! operations from one caller reach the file in the order they were
//! called.
//!
//! # Crash semantics
//!
//! An operation answered `Ok` is on disk: after a crash (a killed process,
//! a lost machine) the file opens with it. One answered
//! [`JournalError::Store`] may or may not be (a failed fsync leaves the
//! disk's state unknown); the journal's rules make a retry safe, since a
//! repeated append is refused as out of order and a repeated create is
//! answered by its idempotency key. After a failed commit the engine
//! refuses further writes until the file is reopened. A batch is atomic:
//! all of it or none of it is in the file, and every invariant
//! [`EmbeddedStore::verify`] checks holds at every commit.
//!
//! Reads (`get`, `events`, `unfinished`, `watch`'s first value) run in
//! read transactions on tokio's blocking pool, never on a task that serves
//! requests (R-LIM-4); they see the last committed batch.

use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use iop_core::journal::{
    CreateOutcome, EdgeLease, JournalError, JournalEvent, JournalLimits, JournalLimitsError,
    NewRecord, RecordMeta, StoredLease, Terminal,
};
use redb::{Database, ReadableDatabase, StorageBackend};
use tokio::sync::watch;

use crate::{
    BoxFuture, Held, JournalStore, LeaseTable, Progress, StoreStats, StoredRecord, Subject,
    TenantStore,
};

mod ops;
mod tables;
mod tenant;
mod writer;

use ops::{Answer, Reply, Request};
pub use tables::VerifyReport;
use tables::{Fault, Format};
use writer::{QueueBounds, Shared};

/// Records one sweep transaction removes at most; a sweep of more runs as
/// several transactions.
pub const SWEEP_BATCH_RECORDS: usize = 1024;

/// How the embedded store runs: the bounds of its writer (R-LIM-4) and its
/// page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddedOptions {
    /// Operations waiting for the writer at most; one more is refused.
    pub max_queued_ops: usize,
    /// Operations in one transaction (one sync) at most.
    pub max_batch_ops: usize,
    /// Payload bytes in one transaction at most, past its first operation.
    pub max_batch_bytes: usize,
    /// Operations of one principal waiting at most: one principal's burst
    /// leaves the rest of the queue to the others (R-TEN-1).
    pub max_queued_ops_per_principal: usize,
    /// redb's page cache, in bytes.
    pub cache_bytes: usize,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions {
            max_queued_ops: 4096,
            max_batch_ops: 512,
            max_batch_bytes: 8 * 1024 * 1024,
            max_queued_ops_per_principal: 1024,
            cache_bytes: 64 * 1024 * 1024,
        }
    }
}

/// Why the store's file could not be opened. Each names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The journal's limits are invalid.
    #[error("journal limits for {path}: {source}")]
    Limits {
        /// The file.
        path: PathBuf,
        /// Which limit.
        source: JournalLimitsError,
    },
    /// Its directory could not be created.
    #[error("cannot create the directory of {path}: {source}")]
    CreateDir {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
    /// The file could not be opened or created.
    #[error("cannot open {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
    /// Another process (or another store in this one) has it open.
    #[error("{path} is already open")]
    AlreadyOpen {
        /// The file.
        path: PathBuf,
    },
    /// The file is not a redb database, or is damaged beyond its recovery.
    #[error("{path} is not a readable journal file: {detail}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What the engine said.
        detail: String,
    },
    /// A redb database, but not a journal.
    #[error("{path} is a database but not a journal")]
    NotAJournal {
        /// The file.
        path: PathBuf,
    },
    /// A journal of a format this build does not read.
    #[error("{path} has journal format {found}; this build reads format {supported}")]
    UnknownFormat {
        /// The file.
        path: PathBuf,
        /// The file's format version.
        found: u64,
        /// The version this build reads and writes.
        supported: u64,
    },
    /// The writer thread could not be started.
    #[error("cannot start the journal writer for {path}: {source}")]
    Writer {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: io::Error,
    },
}

/// The embedded [`JournalStore`]: one redb file, one writer thread, group
/// commit. See the [module docs](self).
pub struct EmbeddedStore {
    db: Arc<Database>,
    shared: Arc<Shared>,
    writer: Option<JoinHandle<()>>,
    /// The ownership lease of the one Edge that opens the file, kept in
    /// its process (see [`LeaseTable`]).
    leases: LeaseTable,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("stats", &self.shared.stats())
            .finish_non_exhaustive()
    }
}

impl EmbeddedStore {
    /// Open (or create) the store at `path`, with default
    /// [`EmbeddedOptions`]. Creates missing parent directories.
    pub fn open(path: &Path, limits: JournalLimits) -> Result<Self, OpenError> {
        Self::open_with(path, limits, EmbeddedOptions::default())
    }

    /// Open (or create) the store at `path`.
    pub fn open_with(
        path: &Path,
        limits: JournalLimits,
        options: EmbeddedOptions,
    ) -> Result<Self, OpenError> {
        let backend = redb::backends::FileBackend::new(create_file(path)?)
            .map_err(|e| database_error(path, e))?;
        Self::open_backend(path, backend, limits, options)
    }

    /// Open on any redb backend; `path` names it in errors.
    fn open_backend(
        path: &Path,
        backend: impl StorageBackend,
        limits: JournalLimits,
        options: EmbeddedOptions,
    ) -> Result<Self, OpenError> {
        limits.validate().map_err(|source| OpenError::Limits {
            path: path.to_owned(),
            source,
        })?;
        // The engine reads an untrusted file here, on the caller's thread:
        // an assertion it trips on a damaged file is that file's error, not
        // the process's end. (Later reads and writes run on other threads,
        // where a panic fails the one operation.)
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let db = Database::builder()
                .set_cache_size(options.cache_bytes)
                .create_with_backend(backend)
                .map_err(|e| database_error(path, e))?;
            let corrupt = |f: Fault| OpenError::Corrupt {
                path: path.to_owned(),
                detail: f.to_string(),
            };
            let txn = db.begin_write().map_err(|e| corrupt(e.into()))?;
            let (format, used_bytes, _) = tables::init(&txn).map_err(corrupt)?;
            let mut scan = None;
            if matches!(format, Format::Current) {
                // Every record read once: the gauges, the running records'
                // write shares, and a quarantine for what does not decode
                // (R-JRN-6).
                scan = Some(tables::scan_records(&txn, used_bytes).map_err(corrupt)?);
                txn.commit().map_err(|e| corrupt(e.into()))?;
            }
            Ok((db, format, scan))
        }))
        .unwrap_or_else(|panic| {
            let detail = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "the engine panicked".into());
            Err(OpenError::Corrupt {
                path: path.to_owned(),
                detail,
            })
        });
        let (db, format, scan) = opened?;
        let scan = match (format, scan) {
            (Format::Current, Some(scan)) => scan,
            (Format::Current, None) => {
                return Err(OpenError::Corrupt {
                    path: path.to_owned(),
                    detail: "the records were not read".into(),
                });
            }
            (Format::Unknown(found), _) => {
                return Err(OpenError::UnknownFormat {
                    path: path.to_owned(),
                    found,
                    supported: tables::FORMAT_VERSION,
                });
            }
            (Format::Foreign, _) => {
                return Err(OpenError::NotAJournal {
                    path: path.to_owned(),
                });
            }
        };
        let db = Arc::new(db);
        let shared = Arc::new(Shared::new(
            QueueBounds {
                max_queued_ops: options.max_queued_ops,
                max_batch_ops: options.max_batch_ops,
                max_batch_bytes: options.max_batch_bytes,
                max_queued_per_principal: options.max_queued_ops_per_principal,
            },
            scan,
        ));
        let writer = std::thread::Builder::new()
            .name("iop-journal-writer".into())
            .spawn({
                let db = db.clone();
                let shared = shared.clone();
                move || writer::run(db, shared, limits)
            })
            .map_err(|source| OpenError::Writer {
                path: path.to_owned(),
                source,
            })?;
        Ok(EmbeddedStore {
            db,
            shared,
            writer: Some(writer),
            leases: LeaseTable::default(),
        })
    }

    /// Tenants' state (counters, usage rows, runtime keys; SPEC §9) in
    /// this file's tenant tables: durable across a restart, written through
    /// this store's one writer and group commit (see [`tenant`]'s docs).
    /// Every handle is a view of the same state that never keeps the file
    /// open itself: once this store is dropped (the file closed) its
    /// operations fail with
    /// [`TenantStoreError::Unavailable`](crate::TenantStoreError::Unavailable).
    pub fn tenant_store(&self) -> Arc<dyn TenantStore> {
        Arc::new(tenant::EmbeddedTenantStore {
            db: Arc::downgrade(&self.db),
            shared: self.shared.clone(),
        })
    }

    /// Check the whole file against the journal's invariants (a full scan:
    /// for tests, tools and after a crash, not for the request path).
    pub async fn verify(&self) -> Result<VerifyReport, JournalError> {
        self.read(tables::verify).await
    }

    /// Run `f` in a read transaction on the blocking pool.
    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&redb::ReadTransaction) -> Result<T, Fault> + Send + 'static,
    ) -> Result<T, JournalError> {
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || {
            let txn = db.begin_read().map_err(Fault::from)?;
            f(&txn)
        })
        .await
        .map_err(|e| JournalError::Store(format!("journal read task: {e}")))?
        .map_err(JournalError::from)
    }

    /// Submit a write now; the future waits for its batch to be durable.
    fn write(&self, request: Request) -> impl Future<Output = Answer> + Send + 'static {
        let rx = self.shared.submit(request);
        async move {
            rx?.await
                .map_err(|_| JournalError::Store("the journal writer has stopped".into()))?
        }
    }
}

/// Closing the store: the writer finishes and answers what is queued, then
/// the file is closed. Blocks the dropping thread for that long (at most
/// the queued batches' commits).
impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        self.shared.close();
        if let Some(writer) = self.writer.take() {
            // The writer finishes what is queued; a panic there already
            // failed its callers.
            let _ = writer.join();
        }
    }
}

/// Create the file (mode 0600 on Unix) and its directory.
fn create_file(path: &Path) -> Result<std::fs::File, OpenError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| OpenError::CreateDir {
            path: path.to_owned(),
            source,
        })?;
    }
    let mut options = OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path).map_err(|source| OpenError::File {
        path: path.to_owned(),
        source,
    })
}

fn database_error(path: &Path, e: redb::DatabaseError) -> OpenError {
    match e {
        redb::DatabaseError::DatabaseAlreadyOpen => OpenError::AlreadyOpen {
            path: path.to_owned(),
        },
        other => OpenError::Corrupt {
            path: path.to_owned(),
            detail: other.to_string(),
        },
    }
}

fn wrong_reply(reply: Reply) -> JournalError {
    JournalError::Store(format!(
        "the journal writer answered out of kind: {reply:?}"
    ))
}

impl JournalStore for EmbeddedStore {
    fn create(&self, record: NewRecord) -> BoxFuture<'_, Result<CreateOutcome, JournalError>> {
        let answer = self.write(Request::Create(record));
        Box::pin(async move {
            match answer.await? {
                Reply::Create(result) => result,
                other => Err(wrong_reply(other)),
            }
        })
    }

    fn append(
        &self,
        id: String,
        epoch: u64,
        events: Vec<JournalEvent>,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        meta_reply(self.write(Request::Append { id, epoch, events }))
    }

    fn finish(
        &self,
        id: String,
        epoch: u64,
        terminal: Terminal,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        meta_reply(self.write(Request::Finish {
            id,
            epoch,
            terminal,
        }))
    }

    fn raise_epoch(
        &self,
        id: String,
        expected: u64,
        owner: String,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        meta_reply(self.write(Request::RaiseEpoch {
            id,
            expected,
            owner,
        }))
    }

    fn get(
        &self,
        id: String,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<Option<StoredRecord>, JournalError>> {
        Box::pin(self.read(move |txn| tables::read::get(txn, &id, now_unix_ms)))
    }

    fn events(
        &self,
        id: String,
        after: u64,
        max: usize,
    ) -> BoxFuture<'_, Result<Vec<JournalEvent>, JournalError>> {
        Box::pin(async move {
            self.read(move |txn| tables::read::events(txn, &id, after, max))
                .await?
        })
    }

    fn delete(&self, id: String) -> BoxFuture<'_, Result<(), JournalError>> {
        let answer = self.write(Request::Delete { id });
        Box::pin(async move {
            match answer.await? {
                Reply::Deleted(result) => result,
                other => Err(wrong_reply(other)),
            }
        })
    }

    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>> {
        Box::pin(self.read(tables::read::unfinished))
    }

    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, JournalError>> {
        Box::pin(async move {
            // Bounded transactions: a large sweep does not hold the writer
            // (and every append behind it) for long.
            let mut total = 0;
            loop {
                let answer = self
                    .write(Request::Sweep {
                        now_unix_ms,
                        max_records: SWEEP_BATCH_RECORDS,
                    })
                    .await?;
                match answer {
                    Reply::Swept { removed, more } => {
                        total += removed;
                        if !more {
                            return Ok(total);
                        }
                    }
                    other => return Err(wrong_reply(other)),
                }
            }
        })
    }

    fn watch(&self, id: String) -> BoxFuture<'_, Result<watch::Receiver<Progress>, JournalError>> {
        let db = self.db.clone();
        let shared = self.shared.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || -> Result<_, JournalError> {
                // Read while holding the watchers' lock: the writer tells
                // watchers after each commit under the same lock, so a
                // commit is either in what we read or in a later notice.
                let mut watchers = shared.watchers();
                if let Some(tx) = watchers.get(&id) {
                    return Ok(tx.subscribe());
                }
                let txn = db.begin_read().map_err(Fault::from)?;
                let meta = tables::read::meta(&txn, &id)?.ok_or(JournalError::NotFound)?;
                let (tx, rx) = watch::channel(tables::progress(&meta));
                shared.add_watcher(&mut watchers, id, tx);
                Ok(rx)
            })
            .await
            .map_err(|e| JournalError::Store(format!("journal read task: {e}")))?
        })
    }

    fn stats(&self) -> StoreStats {
        self.shared.stats()
    }

    fn needs_reopen(&self) -> bool {
        self.shared.needs_reopen()
    }

    fn put_lease(
        &self,
        lease: EdgeLease,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, JournalError>> {
        let result = self.leases.put(lease, expected);
        Box::pin(async move { result })
    }

    fn lease(&self, edge_id: String) -> BoxFuture<'_, Result<Option<StoredLease>, JournalError>> {
        let found = self.leases.get(&edge_id);
        Box::pin(async move { Ok(found) })
    }

    fn leases(&self) -> BoxFuture<'_, Result<Vec<StoredLease>, JournalError>> {
        let all = self.leases.all();
        Box::pin(async move { Ok(all) })
    }

    fn held(&self, subject: &Subject) -> Held {
        self.shared.held(subject)
    }
}

fn meta_reply(
    answer: impl Future<Output = Answer> + Send + 'static,
) -> BoxFuture<'static, Result<RecordMeta, JournalError>> {
    Box::pin(async move {
        match answer.await? {
            Reply::Meta(result) => result,
            other => Err(wrong_reply(other)),
        }
    })
}

#[cfg(test)]
mod tests;
