use std::io;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use iop_core::journal::{JournalApi, RecordStatus, fingerprint};
use proptest::prelude::*;
use redb::backends::FileBackend;
use redb::{BackendError, TableDefinition};

use super::*;
use crate::MemoryStore;
use crate::conformance::{self, LIMITS, event, new_record, terminal};

fn store_path(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

fn open(path: &Path) -> EmbeddedStore {
    match EmbeddedStore::open(path, LIMITS) {
        Ok(store) => store,
        Err(e) => panic!("open: {e}"),
    }
}

async fn assert_sound(store: &EmbeddedStore) -> VerifyReport {
    let report = store.verify().await.unwrap();
    assert!(report.problems.is_empty(), "{:#?}", report.problems);
    assert_eq!(report.used_bytes, store.stats().used_bytes);
    assert_eq!(report.records, store.stats().records);
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = 0;
    conformance::run_all(|limits| {
        n += 1;
        let path = store_path(&dir, &format!("conformance-{n}.redb"));
        async move {
            match EmbeddedStore::open(&path, limits) {
                Ok(store) => store,
                Err(e) => panic!("open: {e}"),
            }
        }
    })
    .await;
}

#[tokio::test]
async fn records_events_keys_and_bytes_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "journal.redb");
    let (running, done, stats) = {
        let store = open(&path);
        store
            .create(new_record("running", Some("k1"), b"{\"a\":1}", 10))
            .await
            .unwrap();
        store
            .append("running".into(), 1, (1..=5).map(event).collect())
            .await
            .unwrap();
        store
            .raise_epoch("running".into(), 1, "taker".into())
            .await
            .unwrap();
        store
            .create(new_record("done", Some("k2"), b"{}", 10))
            .await
            .unwrap();
        store
            .append("done".into(), 1, (1..=3).map(event).collect())
            .await
            .unwrap();
        let done = store
            .finish("done".into(), 1, terminal(RecordStatus::Completed, 20))
            .await
            .unwrap();
        store
            .create(new_record("gone", None, b"{}", 10))
            .await
            .unwrap();
        store.delete("gone".into()).await.unwrap();
        let stats = store.stats();
        assert_sound(&store).await;
        (
            store.get("running".into(), 0).await.unwrap().unwrap(),
            done,
            stats,
        )
    };
    let store = open(&path);
    assert_eq!(
        (store.stats().records, store.stats().used_bytes),
        (stats.records, stats.used_bytes)
    );
    assert_eq!(store.get("running".into(), 0).await.unwrap(), Some(running));
    assert_eq!(store.get("done".into(), 0).await.unwrap().unwrap().0, done);
    assert_eq!(store.get("gone".into(), 0).await, Ok(None));
    assert_eq!(
        store.events("running".into(), 0, 100).await.unwrap(),
        (1..=5).map(event).collect::<Vec<_>>()
    );
    assert_eq!(
        store.events("done".into(), 1, 100).await.unwrap(),
        (2..=3).map(event).collect::<Vec<_>>()
    );
    // Keys survive: a repeat gets the stored record.
    assert!(matches!(
        store.create(new_record("again", Some("k2"), b"{}", 30)).await,
        Ok(CreateOutcome::Existing(m)) if m.id == "done"
    ));
    // After a restart, exactly the running records are unfinished, and a
    // takeover continues them (R-TAKE-1).
    let unfinished = store.unfinished().await.unwrap();
    assert_eq!(
        unfinished.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        ["running"]
    );
    let taken = store
        .raise_epoch("running".into(), unfinished[0].epoch, "taker".into())
        .await
        .unwrap();
    assert_eq!(
        store
            .append("running".into(), taken.epoch, vec![event(6)])
            .await
            .unwrap()
            .last_seq,
        6
    );
    assert_sound(&store).await;
}

#[tokio::test]
async fn the_file_is_private_and_its_directory_is_created() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a").join("b").join("journal.redb");
    let _store = open(&path);
    assert!(path.is_file());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

#[tokio::test]
async fn a_second_open_of_the_same_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "journal.redb");
    let _store = open(&path);
    match EmbeddedStore::open(&path, LIMITS) {
        Err(OpenError::AlreadyOpen { path: p }) => assert_eq!(p, path),
        other => panic!("expected AlreadyOpen, got {other:?}"),
    }
}

#[test]
fn invalid_limits_are_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let limits = JournalLimits {
        max_record_bytes: 10,
        ..LIMITS
    };
    let err = EmbeddedStore::open(&store_path(&dir, "j.redb"), limits).unwrap_err();
    assert!(matches!(err, OpenError::Limits { .. }), "{err}");
}

#[test]
fn a_file_of_an_unknown_format_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "journal.redb");
    drop(open(&path));
    {
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(tables::META)
            .unwrap()
            .insert(tables::META_FORMAT_VERSION, 99)
            .unwrap();
        txn.commit().unwrap();
    }
    match EmbeddedStore::open(&path, LIMITS) {
        Err(e @ OpenError::UnknownFormat { found: 99, .. }) => {
            assert!(e.to_string().contains("journal.redb"), "{e}");
        }
        other => panic!("expected UnknownFormat, got {other:?}"),
    }
}

/// A file written before records named their owner (format 1) is
/// upgraded at open: every record reads back, owned by `NO_OWNER`, and
/// the file is format 2 from then on.
#[tokio::test]
async fn a_format_1_file_is_upgraded_at_open_with_unowned_records() {
    use redb::{ReadableDatabase, ReadableTable};
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "journal.redb");
    {
        let store = open(&path);
        store
            .create(new_record("running", Some("k"), b"{}", 0))
            .await
            .unwrap();
        store
            .append("running".into(), 1, vec![event(1)])
            .await
            .unwrap();
        store
            .create(new_record("done", None, b"{}", 0))
            .await
            .unwrap();
        store
            .finish("done".into(), 1, terminal(RecordStatus::Completed, 1))
            .await
            .unwrap();
    }
    // Rewrite it as an earlier build left it: records without an owner.
    {
        let db = redb::Database::create(&path).unwrap();
        let metas: Vec<RecordMeta> = {
            let txn = db.begin_read().unwrap();
            let table = txn.open_table(tables::RECORDS).unwrap();
            table
                .iter()
                .unwrap()
                .map(|e| {
                    let (id, bytes) = e.unwrap();
                    tables::decode_meta(id.value(), bytes.value()).unwrap()
                })
                .collect()
        };
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(tables::RECORDS).unwrap();
            for m in &metas {
                let old = crate::legacy::RecordMetaV1 {
                    id: m.id.clone(),
                    principal: m.principal.clone(),
                    api: m.api,
                    model: m.model.clone(),
                    fingerprint: m.fingerprint,
                    idempotency_key: m.idempotency_key,
                    background: m.background,
                    created_unix_ms: m.created_unix_ms,
                    epoch: m.epoch,
                    last_seq: m.last_seq,
                    terminal: m.terminal.clone(),
                    expires_unix_ms: m.expires_unix_ms,
                    stored_bytes: m.stored_bytes,
                };
                let bytes = postcard::to_allocvec(&old).unwrap();
                table.insert(m.id.as_str(), bytes.as_slice()).unwrap();
            }
            txn.open_table(tables::META)
                .unwrap()
                .insert(tables::META_FORMAT_VERSION, tables::FORMAT_VERSION_UNOWNED)
                .unwrap();
        }
        txn.commit().unwrap();
    }
    let store = open(&path);
    let unfinished = store.unfinished().await.unwrap();
    assert_eq!(unfinished.len(), 1);
    assert_eq!(
        (unfinished[0].id.as_str(), unfinished[0].owner.as_str()),
        ("running", iop_core::journal::NO_OWNER)
    );
    let (done, _) = store.get("done".into(), 0).await.unwrap().unwrap();
    assert_eq!(done.status(), RecordStatus::Completed);
    assert_sound(&store).await;
    let raised = store
        .raise_epoch("running".into(), 1, "edge-a".into())
        .await
        .unwrap();
    assert_eq!(raised.owner, "edge-a");
    drop(store);
    let db = redb::Database::create(&path).unwrap();
    let txn = db.begin_read().unwrap();
    let version = txn
        .open_table(tables::META)
        .unwrap()
        .get(tables::META_FORMAT_VERSION)
        .unwrap()
        .map(|v| v.value());
    assert_eq!(version, Some(tables::FORMAT_VERSION));
}

/// A file written before records named their API key (format 2) is
/// upgraded at open: every record reads back of no key (`NO_KEY_ID`), its
/// bytes count for its principal only, and the file is the current format
/// from then on.
#[tokio::test]
async fn a_format_2_file_is_upgraded_at_open_with_records_of_no_key() {
    use redb::{ReadableDatabase, ReadableTable};
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "journal.redb");
    let mut background = new_record("running", Some("k"), b"{}", 0);
    background.background = true;
    {
        let store = open(&path);
        store.create(background).await.unwrap();
        store
            .append("running".into(), 1, vec![event(1)])
            .await
            .unwrap();
    }
    {
        let db = redb::Database::create(&path).unwrap();
        let metas: Vec<RecordMeta> = {
            let txn = db.begin_read().unwrap();
            let table = txn.open_table(tables::RECORDS).unwrap();
            table
                .iter()
                .unwrap()
                .map(|e| {
                    let (id, bytes) = e.unwrap();
                    tables::decode_meta(id.value(), bytes.value()).unwrap()
                })
                .collect()
        };
        let txn = db.begin_write().unwrap();
        {
            let mut table = txn.open_table(tables::RECORDS).unwrap();
            for m in &metas {
                let old = crate::legacy::RecordMetaV2::from_current(m);
                let bytes = postcard::to_allocvec(&old).unwrap();
                table.insert(m.id.as_str(), bytes.as_slice()).unwrap();
            }
            txn.open_table(tables::META)
                .unwrap()
                .insert(tables::META_FORMAT_VERSION, tables::FORMAT_VERSION_KEYLESS)
                .unwrap();
        }
        txn.commit().unwrap();
    }
    let store = open(&path);
    let (meta, _) = store.get("running".into(), 0).await.unwrap().unwrap();
    assert_eq!(
        (meta.key_id.as_str(), meta.owner.as_str(), meta.last_seq),
        (iop_core::journal::NO_KEY_ID, "edge-a", 1)
    );
    assert_sound(&store).await;
    let principal = store.held(&crate::Subject::Principal(meta.principal.clone()));
    assert_eq!(
        (principal.journal_bytes, principal.background),
        (meta.stored_bytes, 1)
    );
    assert_eq!(
        store.held(&crate::Subject::Key(conformance::KEY_ID.into())),
        crate::Held::default()
    );
    drop(store);
    let db = redb::Database::create(&path).unwrap();
    let txn = db.begin_read().unwrap();
    let version = txn
        .open_table(tables::META)
        .unwrap()
        .get(tables::META_FORMAT_VERSION)
        .unwrap()
        .map(|v| v.value());
    assert_eq!(version, Some(tables::FORMAT_VERSION));
}

#[test]
fn another_programs_database_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "other.redb");
    {
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        let table: TableDefinition<'_, u64, u64> = TableDefinition::new("theirs");
        txn.open_table(table).unwrap().insert(1, 2).unwrap();
        txn.commit().unwrap();
    }
    assert!(matches!(
        EmbeddedStore::open(&path, LIMITS),
        Err(OpenError::NotAJournal { .. })
    ));
}

#[tokio::test]
async fn a_corrupt_file_is_an_error_never_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    // Not a database at all.
    let garbage = store_path(&dir, "garbage.redb");
    std::fs::write(&garbage, vec![0xa5; 64 * 1024]).unwrap();
    assert!(matches!(
        EmbeddedStore::open(&garbage, LIMITS),
        Err(OpenError::Corrupt { .. })
    ));
    // A journal with bytes flipped all over: whatever opens answers with
    // errors or data, never a panic.
    let path = store_path(&dir, "journal.redb");
    {
        let store = open(&path);
        for i in 0..20 {
            let id = format!("r{i}");
            store
                .create(new_record(&id, Some(&id), b"{}", 0))
                .await
                .unwrap();
            store
                .append(id, 1, (1..=20).map(event).collect())
                .await
                .unwrap();
        }
    }
    let clean = std::fs::read(&path).unwrap();
    for (round, stride) in [4093usize, 997, 64 * 1024 + 7, 409].into_iter().enumerate() {
        let mut bytes = clean.clone();
        let mut at = 512 + round * 31;
        while at < bytes.len() {
            bytes[at] ^= 0x5a;
            at += stride;
        }
        let damaged = store_path(&dir, &format!("damaged-{round}.redb"));
        std::fs::write(&damaged, &bytes).unwrap();
        if let Ok(store) = EmbeddedStore::open(&damaged, LIMITS) {
            let _ = store.get("r1".into(), 0).await;
            let _ = store.events("r2".into(), 0, 100).await;
            let _ = store.unfinished().await;
            let _ = store.verify().await;
            let _ = store.append("r3".into(), 1, vec![event(21)]).await;
            let _ = store.sweep(u64::MAX).await;
        }
    }
}

#[tokio::test]
async fn a_full_write_queue_refuses_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let options = EmbeddedOptions {
        max_queued_ops: 8,
        max_batch_ops: 4,
        ..EmbeddedOptions::default()
    };
    let store =
        EmbeddedStore::open_with(&store_path(&dir, "journal.redb"), LIMITS, options).unwrap();
    const N: usize = 8 + 4 + 1;
    for i in 0..N {
        store
            .create(new_record(&format!("r{i}"), None, b"{}", 0))
            .await
            .unwrap();
    }
    // Hold the writer after its next batch (it tells watchers under this
    // lock), so what is submitted meanwhile stays queued.
    let held = store.shared.watchers();
    let pending: Vec<_> = (0..N)
        .map(|i| store.append(format!("r{i}"), 1, vec![event(1)]))
        .collect();
    drop(held);
    let mut refused = 0;
    for result in futures_join(pending).await {
        match result {
            Ok(meta) => assert_eq!(meta.last_seq, 1),
            Err(JournalError::Store(msg)) => {
                assert!(msg.contains("queue is full"), "{msg}");
                refused += 1;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    // The writer took at most one batch (4) before it was held; the queue
    // holds 8: of 13, at least one was refused.
    assert!(refused >= 1);
    assert_sound(&store).await;
}

#[tokio::test]
async fn appends_waiting_on_a_sync_share_the_next_one() {
    const WRITERS: usize = 32;
    let dir = tempfile::tempdir().unwrap();
    let store = open(&store_path(&dir, "journal.redb"));
    for i in 0..WRITERS {
        store
            .create(new_record(&format!("r{i}"), None, b"{}", 0))
            .await
            .unwrap();
    }
    let before = store.stats();
    let held = store.shared.watchers();
    let pending: Vec<_> = (0..WRITERS)
        .map(|i| store.append(format!("r{i}"), 1, vec![event(1)]))
        .collect();
    drop(held);
    for result in futures_join(pending).await {
        assert_eq!(result.unwrap().last_seq, 1);
    }
    let after = store.stats();
    // R-JRN-1: one batch may have gone before the writer was held; every
    // other append waited and went in one more.
    assert_eq!(after.ops - before.ops, WRITERS as u64);
    assert!(after.syncs - before.syncs <= 2, "{before:?} -> {after:?}");
}

/// Await every future in order (they were all submitted already).
async fn futures_join<T>(futures: Vec<BoxFuture<'_, T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(futures.len());
    for f in futures {
        out.push(f.await);
    }
    out
}

/// A file backend whose writes and syncs fail on demand.
#[derive(Debug)]
struct FailingDisk {
    inner: FileBackend,
    failing: Arc<AtomicBool>,
}

impl FailingDisk {
    fn check(&self) -> Result<(), io::Error> {
        if self.failing.load(Ordering::SeqCst) {
            Err(io::Error::other("injected disk failure"))
        } else {
            Ok(())
        }
    }
}

impl StorageBackend for FailingDisk {
    fn len(&self) -> Result<u64, io::Error> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.check()?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), io::Error> {
        self.check()?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.check()?;
        self.inner.write(offset, data)
    }
    fn close(&self) -> Result<(), io::Error> {
        self.inner.close()
    }
    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.try_lock_range(start, end)
    }
    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.inner.try_lock_shared_range(start, end)
    }
    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_range(start, end)
    }
    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_shared_range(start, end)
    }
    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.unlock_range(start, end)
    }
    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.query_lock_range(start, end)
    }
}

#[tokio::test]
async fn a_failed_commit_fails_its_whole_batch_and_tells_no_watcher() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "journal.redb");
    let failing = Arc::new(AtomicBool::new(false));
    {
        let disk = FailingDisk {
            inner: FileBackend::new(create_file(&path).unwrap()).unwrap(),
            failing: failing.clone(),
        };
        let store =
            EmbeddedStore::open_backend(&path, disk, LIMITS, EmbeddedOptions::default()).unwrap();
        store
            .create(new_record("r1", None, b"{}", 0))
            .await
            .unwrap();
        store.append("r1".into(), 1, vec![event(1)]).await.unwrap();
        let watcher = store.watch("r1".into()).await.unwrap();
        let stats = store.stats();

        failing.store(true, Ordering::SeqCst);
        let pending = vec![
            store.append("r1".into(), 1, vec![event(2)]),
            store.finish("r1".into(), 1, terminal(RecordStatus::Completed, 1)),
        ];
        let create = store.create(new_record("r2", None, b"{}", 0));
        for result in futures_join(pending).await {
            assert!(matches!(result, Err(JournalError::Store(_))), "{result:?}");
        }
        assert!(matches!(create.await, Err(JournalError::Store(_))));
        // Nothing of the failed batch was published.
        assert_eq!(
            *watcher.borrow(),
            Progress {
                last_seq: 1,
                ended: false
            }
        );
        assert_eq!(store.stats().used_bytes, stats.used_bytes);
        assert_eq!(store.stats().syncs, stats.syncs);
        // The disk's state is unknown after a failed write: the engine
        // writes nothing more until the file is reopened.
        failing.store(false, Ordering::SeqCst);
        assert!(matches!(
            store.append("r1".into(), 1, vec![event(2)]).await,
            Err(JournalError::Store(_))
        ));
        failing.store(true, Ordering::SeqCst);
    }
    // What was acknowledged is there; what failed is not.
    let store = open(&path);
    let (meta, _) = store.get("r1".into(), 0).await.unwrap().unwrap();
    assert_eq!((meta.last_seq, meta.terminal), (1, None));
    assert_eq!(store.get("r2".into(), 0).await, Ok(None));
    assert_sound(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_of_many_transactions_removes_every_expired_record() {
    let n = SWEEP_BATCH_RECORDS + SWEEP_BATCH_RECORDS / 2;
    let dir = tempfile::tempdir().unwrap();
    // One principal writes them all at once: its share is the whole queue.
    let options = EmbeddedOptions {
        max_queued_ops_per_principal: EmbeddedOptions::default().max_queued_ops,
        ..EmbeddedOptions::default()
    };
    let store = Arc::new(
        EmbeddedStore::open_with(&store_path(&dir, "journal.redb"), LIMITS, options).unwrap(),
    );
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let store = store.clone();
        tasks.spawn(async move {
            let id = format!("r{i:05}");
            store.create(new_record(&id, None, b"{}", 0)).await?;
            store
                .finish(id, 1, terminal(RecordStatus::Completed, 1))
                .await
        });
    }
    store
        .create(new_record("running", None, b"{}", 0))
        .await
        .unwrap();
    while let Some(done) = tasks.join_next().await {
        done.unwrap().unwrap();
    }
    assert_eq!(store.stats().records, n as u64 + 1);
    assert_eq!(store.sweep(u64::MAX).await, Ok(n));
    assert_eq!(store.stats().records, 1);
    assert_sound(&store).await;
}

// --- The embedded store answers as the in-memory reference does. ---

const MODEL_LIMITS: JournalLimits = JournalLimits {
    retention_ms: 1000,
    max_bytes: 64 * 1024,
    max_record_bytes: 64 * 1024,
};

#[derive(Debug, Clone)]
enum ModelOp {
    Create {
        id: u8,
        key: Option<u8>,
        body: u8,
        big: bool,
        at: u64,
    },
    Append {
        id: u8,
        epoch_delta: i8,
        seq_delta: i8,
        count: u8,
        big: bool,
    },
    Finish {
        id: u8,
        epoch_delta: i8,
        status: u8,
        at: u64,
    },
    RaiseEpoch {
        id: u8,
        epoch_delta: i8,
    },
    Get {
        id: u8,
        now: u64,
    },
    Events {
        id: u8,
        after: u64,
        max: usize,
    },
    Delete {
        id: u8,
    },
    Unfinished,
    Sweep {
        now: u64,
    },
    Watch {
        id: u8,
    },
    Reopen,
}

fn delta() -> impl Strategy<Value = i8> {
    prop_oneof![6 => Just(0i8), 1 => Just(-1i8), 1 => Just(1i8)]
}

fn model_op() -> impl Strategy<Value = ModelOp> {
    let id = 0u8..4;
    let at = 0u64..2500;
    prop_oneof![
        5 => (id.clone(), proptest::option::of(0u8..2), 0u8..2, proptest::bool::weighted(0.15), at.clone())
            .prop_map(|(id, key, body, big, at)| ModelOp::Create { id, key, body, big, at }),
        10 => (id.clone(), delta(), delta(), 0u8..4, proptest::bool::weighted(0.25))
            .prop_map(|(id, epoch_delta, seq_delta, count, big)| ModelOp::Append { id, epoch_delta, seq_delta, count, big }),
        3 => (id.clone(), delta(), 0u8..5, at.clone())
            .prop_map(|(id, epoch_delta, status, at)| ModelOp::Finish { id, epoch_delta, status, at }),
        2 => (id.clone(), delta()).prop_map(|(id, epoch_delta)| ModelOp::RaiseEpoch { id, epoch_delta }),
        2 => (id.clone(), at.clone()).prop_map(|(id, now)| ModelOp::Get { id, now }),
        2 => (id.clone(), 0u64..6, 0usize..4).prop_map(|(id, after, max)| ModelOp::Events { id, after, max }),
        1 => id.clone().prop_map(|id| ModelOp::Delete { id }),
        1 => Just(ModelOp::Unfinished),
        1 => (0u64..4000).prop_map(|now| ModelOp::Sweep { now }),
        2 => id.prop_map(|id| ModelOp::Watch { id }),
        1 => Just(ModelOp::Reopen),
    ]
}

fn apply_delta(base: u64, delta: i8) -> u64 {
    base.saturating_add_signed(i64::from(delta))
}

/// The record's epoch and next sequence number in the reference store.
async fn position(memory: &MemoryStore, id: &str) -> (u64, u64) {
    // now = 0 never hides a record: expiry is at least the retention.
    match memory.get(id.into(), 0).await {
        Ok(Some((meta, _))) => (meta.epoch, meta.last_seq + 1),
        _ => (1, 1),
    }
}

/// Run `ops` on both stores; every answer, the counters and what watchers
/// see must agree.
async fn run_model(ops: Vec<ModelOp>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "model.redb");
    let memory = MemoryStore::new(MODEL_LIMITS);
    let mut embedded = Some(EmbeddedStore::open(&path, MODEL_LIMITS).unwrap());
    let mut watchers: Vec<(watch::Receiver<Progress>, watch::Receiver<Progress>)> = Vec::new();
    for op in ops {
        let Some(disk) = embedded.as_ref() else {
            unreachable!("reopened below")
        };
        let name = |id: u8| format!("r{id}");
        match op.clone() {
            ModelOp::Create {
                id,
                key,
                body,
                big,
                at,
            } => {
                let mut record = new_record(
                    &name(id),
                    key.map(|k| format!("k{k}")).as_deref(),
                    if body == 0 { b"{}" } else { b"{\"b\":1}" },
                    at,
                );
                if big {
                    record.request = vec![b'q'; 30_000];
                    record.fingerprint = fingerprint("/v1/responses", &record.request);
                }
                if id == 3 && body == 1 {
                    record.api = JournalApi::ChatCompletions;
                }
                prop_assert_eq!(
                    memory.create(record.clone()).await,
                    disk.create(record).await,
                    "{:?}",
                    op
                );
            }
            ModelOp::Append {
                id,
                epoch_delta,
                seq_delta,
                count,
                big,
            } => {
                let (epoch, next) = position(&memory, &name(id)).await;
                let first = apply_delta(next, seq_delta);
                let events: Vec<JournalEvent> = (first..first + u64::from(count))
                    .map(|seq| JournalEvent {
                        seq,
                        payload: if big {
                            vec![b'e'; 20_000]
                        } else {
                            format!("e{seq}").into_bytes()
                        },
                    })
                    .collect();
                let epoch = apply_delta(epoch, epoch_delta);
                prop_assert_eq!(
                    memory.append(name(id), epoch, events.clone()).await,
                    disk.append(name(id), epoch, events).await,
                    "{:?}",
                    op
                );
            }
            ModelOp::Finish {
                id,
                epoch_delta,
                status,
                at,
            } => {
                let (epoch, _) = position(&memory, &name(id)).await;
                let epoch = apply_delta(epoch, epoch_delta);
                let status = [
                    RecordStatus::Completed,
                    RecordStatus::Incomplete,
                    RecordStatus::Failed,
                    RecordStatus::Cancelled,
                    RecordStatus::InProgress,
                ][usize::from(status)];
                let t = terminal(status, at);
                prop_assert_eq!(
                    memory.finish(name(id), epoch, t.clone()).await,
                    disk.finish(name(id), epoch, t).await,
                    "{:?}",
                    op
                );
            }
            ModelOp::RaiseEpoch { id, epoch_delta } => {
                let (epoch, _) = position(&memory, &name(id)).await;
                let expected = apply_delta(epoch, epoch_delta);
                prop_assert_eq!(
                    memory.raise_epoch(name(id), expected, "taker".into()).await,
                    disk.raise_epoch(name(id), expected, "taker".into()).await,
                    "{:?}",
                    op
                );
            }
            ModelOp::Get { id, now } => {
                prop_assert_eq!(
                    memory.get(name(id), now).await,
                    disk.get(name(id), now).await,
                    "{:?}",
                    op
                );
            }
            ModelOp::Events { id, after, max } => {
                prop_assert_eq!(
                    memory.events(name(id), after, max).await,
                    disk.events(name(id), after, max).await,
                    "{:?}",
                    op
                );
            }
            ModelOp::Delete { id } => {
                prop_assert_eq!(
                    memory.delete(name(id)).await,
                    disk.delete(name(id)).await,
                    "{:?}",
                    op
                );
            }
            ModelOp::Unfinished => {
                let sorted = |r: Result<Vec<RecordMeta>, JournalError>| {
                    r.map(|mut v| {
                        v.sort_by(|a, b| a.id.cmp(&b.id));
                        v
                    })
                };
                prop_assert_eq!(
                    sorted(memory.unfinished().await),
                    sorted(disk.unfinished().await)
                );
            }
            ModelOp::Sweep { now } => {
                prop_assert_eq!(memory.sweep(now).await, disk.sweep(now).await, "{:?}", op);
            }
            ModelOp::Watch { id } => {
                match (memory.watch(name(id)).await, disk.watch(name(id)).await) {
                    (Ok(a), Ok(b)) => {
                        prop_assert_eq!(*a.borrow(), *b.borrow());
                        watchers.push((a, b));
                    }
                    (a, b) => prop_assert_eq!(a.err(), b.err()),
                }
            }
            ModelOp::Reopen => {
                // Close the file (the writer thread ends) before opening it again.
                drop(embedded.take());
                embedded = Some(EmbeddedStore::open(&path, MODEL_LIMITS).unwrap());
                // A restart ends every watch; the reference has none.
                watchers.clear();
            }
        }
        let Some(disk) = embedded.as_ref() else {
            unreachable!("open")
        };
        let (m, d) = (memory.stats(), disk.stats());
        prop_assert_eq!((m.records, m.used_bytes), (d.records, d.used_bytes));
        for (a, b) in &watchers {
            prop_assert_eq!(*a.borrow(), *b.borrow(), "after {:?}", op);
            prop_assert_eq!(a.has_changed().is_err(), b.has_changed().is_err());
        }
    }
    if let Some(disk) = &embedded {
        let report = disk.verify().await.unwrap();
        prop_assert!(report.problems.is_empty(), "{:?}", report.problems);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_embedded_store_answers_as_the_memory_store_does(
        ops in proptest::collection::vec(model_op(), 1..60)
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(run_model(ops))?;
    }
}

/// R-JRN-6: a file with one record that does not decode opens; that
/// record is quarantined (counted, its request, events and key gone, its
/// bytes uncounted) and every other record is served as before.
#[tokio::test]
async fn a_record_that_does_not_decode_is_quarantined_at_open_and_the_rest_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "journal.redb");
    {
        let store = open(&path);
        for id in ["good-1", "damaged", "good-2"] {
            store
                .create(new_record(id, Some(id), b"{}", 10))
                .await
                .unwrap();
            store
                .append(id.into(), 1, (1..=3).map(event).collect())
                .await
                .unwrap();
        }
        store
            .finish("good-2".into(), 1, terminal(RecordStatus::Completed, 20))
            .await
            .unwrap();
    }
    // Damage one record's bytes in place (as a bad write or a bit flip
    // inside a value would), through the engine so the file stays sound.
    {
        let db = redb::Database::create(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut records = txn.open_table(tables::RECORDS).unwrap();
            records.insert("damaged", [0xff_u8; 9].as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }
    let store = open(&path);
    let stats = store.stats();
    assert_eq!((stats.records, stats.quarantined), (2, 1));
    let report = assert_sound(&store).await;
    assert_eq!(report.quarantined, 1);
    assert_eq!(report.events, 6, "the damaged record's events went with it");
    // The rest is served: reads, the restart scan, writes.
    let (meta, request) = store.get("good-1".into(), 0).await.unwrap().unwrap();
    assert_eq!((meta.last_seq, request.as_slice()), (3, b"{}".as_slice()));
    assert_eq!(store.events("good-2".into(), 0, 10).await.unwrap().len(), 3);
    let unfinished = store.unfinished().await.unwrap();
    assert_eq!(
        unfinished.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        ["good-1"]
    );
    store
        .append("good-1".into(), 1, vec![event(4)])
        .await
        .unwrap();
    assert_eq!(store.get("damaged".into(), 0).await, Ok(None));
    // Its key is free: a new request with it runs afresh.
    assert!(matches!(
        store
            .create(new_record("again", Some("damaged"), b"{}", 30))
            .await,
        Ok(CreateOutcome::Create(_))
    ));
    drop(store);
    // A later open finds it still set aside, and nothing new.
    let store = open(&path);
    assert_eq!(store.stats().quarantined, 1);
    assert_sound(&store).await;
}

/// R-JRN-6: after a failed commit the engine refuses every write until
/// the file is opened again, and the store says so; a store opened again
/// on the same file writes.
#[tokio::test]
async fn a_store_whose_commit_failed_asks_to_be_reopened() {
    let dir = tempfile::tempdir().unwrap();
    let path = store_path(&dir, "journal.redb");
    let failing = Arc::new(AtomicBool::new(false));
    {
        let disk = FailingDisk {
            inner: FileBackend::new(create_file(&path).unwrap()).unwrap(),
            failing: failing.clone(),
        };
        let store =
            EmbeddedStore::open_backend(&path, disk, LIMITS, EmbeddedOptions::default()).unwrap();
        store
            .create(new_record("r1", None, b"{}", 0))
            .await
            .unwrap();
        assert!(!store.needs_reopen());
        failing.store(true, Ordering::SeqCst);
        assert!(store.append("r1".into(), 1, vec![event(1)]).await.is_err());
        assert!(store.needs_reopen(), "the engine is done until reopened");
        failing.store(false, Ordering::SeqCst);
        assert!(store.needs_reopen());
    }
    let store = open(&path);
    assert!(!store.needs_reopen());
    store.append("r1".into(), 1, vec![event(1)]).await.unwrap();
}

/// R-TEN-1: one principal's burst of writes fills only its share of the
/// writer's queue; another principal's write still finds room.
#[tokio::test]
async fn one_principals_burst_leaves_room_in_the_write_queue_for_another() {
    let dir = tempfile::tempdir().unwrap();
    let options = EmbeddedOptions {
        max_queued_ops: 16,
        max_batch_ops: 4,
        max_queued_ops_per_principal: 4,
        ..EmbeddedOptions::default()
    };
    let store =
        EmbeddedStore::open_with(&store_path(&dir, "journal.redb"), LIMITS, options).unwrap();
    const BURST: usize = 16;
    for i in 0..BURST {
        store
            .create(new_record(&format!("burst-{i}"), None, b"{}", 0))
            .await
            .unwrap();
    }
    let mut victim = new_record("victim", None, b"{}", 0);
    victim.principal = "principal-b".into();
    store.create(victim).await.unwrap();
    // Hold the writer after its next batch, so what is submitted
    // meanwhile stays queued.
    let held = store.shared.watchers();
    let burst: Vec<_> = (0..BURST)
        .map(|i| store.append(format!("burst-{i}"), 1, vec![event(1)]))
        .collect();
    let victims = vec![store.append("victim".into(), 1, vec![event(1)])];
    drop(held);
    let mut refused = 0;
    for result in futures_join(burst).await {
        match result {
            Ok(_) => {}
            Err(JournalError::Store(msg)) => {
                assert!(msg.contains("for this principal"), "{msg}");
                refused += 1;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    // One batch (4) may have gone to the writer before it was held; the
    // share holds 4 more: the rest of the burst was refused.
    assert!(refused >= BURST - 8, "{refused}");
    for result in futures_join(victims).await {
        assert_eq!(result.unwrap().last_seq, 1, "the other principal's write");
    }
    assert_sound(&store).await;
}

/// R-LIM-6: a record followed once and ended keeps no sender in the
/// watchers' map for the rest of its retention (the map is pruned of
/// senders nobody follows once it has doubled), while one still followed
/// keeps its own.
#[tokio::test]
async fn watchers_of_ended_records_are_dropped_and_followed_ones_kept() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&store_path(&dir, "journal.redb"));
    let name = |i: usize| format!("r{i}");
    const RECORDS: usize = 2_500;
    // In batches within one principal's share of the write queue.
    for batch in (0..RECORDS).collect::<Vec<_>>().chunks(500) {
        let creates = batch
            .iter()
            .map(|&i| store.create(new_record(&name(i), None, b"{}", 0)))
            .collect();
        for created in futures_join(creates).await {
            created.unwrap();
        }
    }
    let kept = store.watch(name(0)).await.unwrap();
    for i in 1..RECORDS {
        // Followed, then let go: the record gets no later notice.
        drop(store.watch(name(i)).await.unwrap());
    }
    let watchers = store.shared.watchers();
    assert!(
        watchers.len() <= 1_024,
        "{} senders kept for {RECORDS} records followed once",
        watchers.len()
    );
    assert!(
        watchers.contains_key(&name(0)),
        "a followed record keeps its sender"
    );
    drop(watchers);
    drop(kept);
}
