use std::path::Path;

use iop_core::journal::NewRecord;
use iop_core::tenant::usage::UsageKey;

use super::*;
use crate::conformance::tenant as suite;
use crate::conformance::{LIMITS, event, new_record};
use crate::{EmbeddedStore, JournalStore, Subject};

fn open(path: &Path) -> EmbeddedStore {
    match EmbeddedStore::open(path, LIMITS) {
        Ok(store) => store,
        Err(e) => panic!("open: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedded_tenant_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let mut stores = Vec::new();
    let mut n = 0;
    suite::run_all(|| {
        n += 1;
        let store = open(&dir.path().join(format!("tenants-{n}.redb")));
        let tenants = store.tenant_store();
        stores.push(store);
        async move { tenants }
    })
    .await;
}

/// R-TEN-2: a budget's spend, the usage rows and the keys survive a
/// restart of the Edge (the file opened again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_usage_and_keys_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    {
        let store = open(&path);
        suite::write_before_reopen(store.tenant_store()).await;
    }
    let store = open(&path);
    suite::check_after_reopen(store.tenant_store()).await;
}

/// Tenants' writes share the journal's writer: claims and appends
/// waiting together go in one batch, one sync (R-JRN-1's group commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_appends_waiting_together_share_one_sync() {
    const WRITERS: usize = 16;
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir.path().join("journal.redb"));
    let tenants = store.tenant_store();
    for i in 0..WRITERS {
        store
            .create(new_record(&format!("r{i}"), None, b"{}", 0))
            .await
            .unwrap();
    }
    let counter = suite::counter(
        Subject::Key("k".into()),
        iop_core::tenant::Meter::Requests,
        0,
    );
    let before = store.stats();
    // The writer blocks after its next commit until this is dropped: all
    // the rest waits for one more batch.
    let held = store.shared.watchers();
    let mut appends = Vec::new();
    let mut claims = Vec::new();
    for i in 0..WRITERS {
        appends.push(store.append(format!("r{i}"), 1, vec![event(1)]));
        claims.push(tenants.claim(counter.clone(), 1, 100));
    }
    drop(held);
    for a in appends {
        a.await.unwrap();
    }
    for c in claims {
        assert_eq!(c.await, Ok(1));
    }
    let after = store.stats();
    assert_eq!(after.ops - before.ops, 2 * WRITERS as u64);
    assert!(after.syncs - before.syncs <= 2, "{before:?} -> {after:?}");
    assert_eq!(tenants.claimed(counter).await, Ok(WRITERS as u64));
}

/// After the store was dropped its tenant handle answers unavailable,
/// never hangs, and does not keep the file from being opened again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_store_outliving_its_store_answers_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir.path().join("journal.redb"));
    let tenants = store.tenant_store();
    drop(store);
    let counter = suite::counter(
        Subject::Key("k".into()),
        iop_core::tenant::Meter::Requests,
        0,
    );
    assert!(matches!(
        tenants.claim(counter.clone(), 1, 10).await,
        Err(TenantStoreError::Unavailable(_))
    ));
    let row = UsageKey {
        day_unix_ms: 0,
        principal: "p".into(),
        key: "k".into(),
        model: "m".into(),
    };
    let failed = tenants
        .add_usage(vec![(row, UsageTotals::default())])
        .await
        .unwrap_err();
    assert_eq!(failed.unwritten.len(), 1, "the rows come back");
    assert!(matches!(
        tenants.claimed(counter).await,
        Err(TenantStoreError::Unavailable(_))
    ));
    // The handle does not keep the file open: it opens again.
    let store = open(&dir.path().join("journal.redb"));
    assert!(store.tenant_store().keys().await.is_ok());
}

/// A sweep of more than one operation's worth runs as several, and
/// forgets usage rows past retention (the embedded store sweeps them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_sweep_forgets_every_expired_counter_and_usage_row() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir.path().join("journal.redb"));
    let tenants = store.tenant_store();
    let n = SWEEP_BATCH as u64 + 10;
    for i in 0..n {
        let c = suite::counter(
            Subject::Key(format!("k{i}")),
            iop_core::tenant::Meter::Tokens,
            0,
        );
        assert_eq!(tenants.claim(c, 1, 10).await, Ok(1));
    }
    let rows = (0..n)
        .map(|i| {
            (
                UsageKey {
                    day_unix_ms: i * DAY_MS,
                    principal: "p".into(),
                    key: "k".into(),
                    model: "m".into(),
                },
                UsageTotals::default(),
            )
        })
        .collect();
    tenants.add_usage(rows).await.unwrap();
    let retention = USAGE_RETENTION_DAYS * DAY_MS;
    // Every counter is over; the rows of days 0..=10 are past retention.
    let now = 10 * DAY_MS + retention;
    assert_eq!(tenants.sweep(now).await, Ok(n as usize + 11));
    let left = tenants
        .usage(UsageQuery {
            from_day_unix_ms: 0,
            to_day_unix_ms: u64::MAX,
            principal: None,
            key: None,
            max_rows: usize::MAX,
        })
        .await
        .unwrap();
    assert_eq!(left.len() as u64, n - 11);
    assert_eq!(left[0].0.day_unix_ms, 11 * DAY_MS);
    assert_eq!(tenants.sweep(now).await, Ok(0));
}

/// R-TEN-1: the gauges are counted again from the records at open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_gauges_are_counted_again_at_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    let record = |id: &str| NewRecord {
        background: true,
        ..new_record(id, None, b"{}", 0)
    };
    let held = {
        let store = open(&path);
        store.create(record("r1")).await.unwrap();
        store.create(record("r2")).await.unwrap();
        store.append("r2".into(), 1, vec![event(1)]).await.unwrap();
        store.held(&Subject::Key(crate::conformance::KEY_ID.into()))
    };
    assert_eq!(held.background, 2);
    let store = open(&path);
    assert_eq!(
        store.held(&Subject::Key(crate::conformance::KEY_ID.into())),
        held
    );
}

/// A key with limits per model (R-TEN-1): the record of `key_record` with
/// 3 requests per minute of `gpt-4o`.
fn key_with_model_limits(id: &str) -> KeyRecord {
    let mut record = suite::key_record(id, "team-a", "ci");
    record.limits.per_model.insert(
        "gpt-4o".into(),
        iop_core::tenant::ModelLimits {
            requests_per_minute: Some(3),
            ..Default::default()
        },
    );
    record
}

/// R-TEN-4: a key record an earlier build stored (bare postcard, before
/// limits per model) is read by this build with no limits per model; a
/// record without them is still stored that way (an earlier build reads
/// it), one with them in format 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_an_earlier_build_stored_is_read_with_no_limits_per_model() {
    use iop_core::tenant::key_format::KeyRecordV1;
    use iop_core::tenant::keys::key_id;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    let old = suite::key_record(&key_id(3), "team-a", "ci");
    // Written as an earlier build wrote it, straight into its table.
    drop(open(&path));
    {
        let db = Database::open(&path).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let bytes = postcard::to_allocvec(&KeyRecordV1::of(&old)).unwrap();
            let mut keys = txn.open_table(KEYS).unwrap();
            keys.insert(old.id.as_str(), (5u64, bytes.as_slice()))
                .unwrap();
        }
        txn.commit().unwrap();
    }
    let store = open(&path);
    let tenants = store.tenant_store();
    assert_eq!(
        tenants.key(old.id.clone()).await,
        Ok(Some((old.clone(), 5)))
    );
    // Changed by this build: limits per model, stored in format 2.
    let new = key_with_model_limits(&old.id);
    let revision = tenants.put_key(new.clone(), 5).await.unwrap();
    assert_eq!(
        tenants.key(old.id.clone()).await,
        Ok(Some((new.clone(), revision)))
    );
    assert_eq!(tenants.keys().await, Ok(vec![(new.clone(), revision)]));
    drop(tenants);
    drop(store);
    let db = Database::open(&path).unwrap();
    let txn = db.begin_read().unwrap();
    let keys = txn.open_table(KEYS).unwrap();
    let value = keys.get(old.id.as_str()).unwrap().unwrap();
    assert_eq!(&value.value().1[..2], &[0, 2]);
}

#[test]
fn key_values_are_bare_in_format_1_and_marked_in_format_2() {
    use iop_core::tenant::keys::key_id;
    let plain = suite::key_record(&key_id(1), "team-a", "ci");
    let bytes = encode_key(&plain);
    assert_eq!(
        bytes[0] as usize,
        plain.id.len(),
        "bare: the id's length first"
    );
    assert_eq!(decode_key(&bytes).unwrap(), plain);
    let limited = key_with_model_limits(&key_id(2));
    let bytes = encode_key(&limited);
    assert_eq!(&bytes[..2], &[KEY_FORMAT_MARK, 2]);
    assert_eq!(decode_key(&bytes).unwrap(), limited);
    assert!(matches!(
        decode_key(&[KEY_FORMAT_MARK, 9, 1]),
        Err(Fault::Corrupt(_))
    ));
}
