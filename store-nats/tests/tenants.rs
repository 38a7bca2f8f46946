//! Tenants' shared state on a real nats-server (SPEC §9): the
//! store-agnostic tenant suite, two Edges (two connections) sharing
//! claims, usage and keys, an outage, and the journal's gauges per key
//! and principal seen from another Edge (R-TEN-1).

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use iop_core::journal::{CreateOutcome, JournalLimits};
use iop_core::tenant::{Held, Meter, Subject};
use iop_store::conformance::tenant as suite;
use iop_store::{JournalStore, TenantStore, TenantStoreError};
use iop_store_nats::NatsStore;
use support::{NatsServer, options, record, until};

/// Small: the server reserves each stream's and bucket's bytes from its
/// disk, and every behaviour of the suite has its own deployment.
const LIMITS: JournalLimits = JournalLimits {
    retention_ms: 60_000,
    max_bytes: 1024 * 1024,
    max_record_bytes: 64 * 1024,
};

async fn connect(server: &NatsServer, name: &str) -> NatsStore {
    NatsStore::connect(options(&server.url(), name, LIMITS))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

async fn tenants(store: &NatsStore) -> Arc<dyn TenantStore> {
    store
        .tenant_store()
        .await
        .unwrap_or_else(|e| panic!("tenant store: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_tenant_store_conforms() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let next = AtomicUsize::new(0);
    let server = &server;
    suite::run_all(|| {
        let name = format!("t{}", next.fetch_add(1, Ordering::Relaxed));
        async move { tenants(&connect(server, &name).await).await }
    })
    .await;
}

/// R-TEN-3, R-TEN-4: two Edges on one server, each with its own
/// connection, never claim past a limit between them and see each
/// other's claims, usage and keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edges_share_claims_usage_and_keys() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let a = connect(&server, "shared").await;
    let b = connect(&server, "shared").await;
    suite::stores_share_claims_usage_and_keys(tenants(&a).await, tenants(&b).await).await;
}

/// One store's tenant state is one object, made once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_store_of_a_connection_is_made_once() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let store = connect(&server, "once").await;
    let first = tenants(&store).await;
    let second = tenants(&store).await;
    assert!(Arc::ptr_eq(&first, &second));
}

/// While the server is down every operation fails unavailable at once
/// (no waiting for the answer's timeout, which is longer here; only a
/// call already under way when the server died waits for it); the same
/// store works again once it is back, and kept what it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_an_outage_tenant_operations_fail_at_once_and_work_again_after() {
    let Some(mut server) = NatsServer::start() else {
        return;
    };
    let mut o = options(&server.url(), "outage", LIMITS);
    o.request_timeout = Duration::from_secs(10);
    let store = NatsStore::connect(o).await.unwrap();
    let t = tenants(&store).await;
    let counter = suite::counter(Subject::Key("k".into()), Meter::Spend, 0);
    assert_eq!(t.claim(counter.clone(), 10, 100).await, Ok(10));
    server.kill();
    until("the outage to be seen", || async {
        matches!(
            t.claim(counter.clone(), 1, 100).await,
            Err(TenantStoreError::Unavailable(_))
        )
    })
    .await;
    let started = std::time::Instant::now();
    let key = suite::key_record(&iop_core::tenant::keys::key_id(1), "p", "n");
    for outcome in [
        t.claimed(counter.clone()).await.err(),
        t.put_key(key, 0).await.err(),
        t.keys().await.err(),
        t.sweep(0).await.err(),
        t.add_usage(Vec::new()).await.err().map(|e| e.error),
    ] {
        assert!(
            matches!(outcome, Some(TenantStoreError::Unavailable(_))),
            "{outcome:?}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(5), "at once");
    server.restart();
    until("the store to work again", || async {
        t.claim(counter.clone(), 1, 100).await.is_ok()
    })
    .await;
    // A claim under way when the server died may have been written.
    let claimed = t.claimed(counter).await.unwrap();
    assert!(claimed >= 11, "the spend survived: {claimed}");
}

/// R-TEN-1: what a key and its principal hold in the journal counts
/// every Edge's records: another Edge's directory sees a background
/// record's bytes and its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_sees_what_another_edges_records_hold() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let a = connect(&server, "held").await;
    let b = connect(&server, "held").await;
    let mut new = record("r1", b"{}");
    new.background = true;
    let meta = match a.create(new).await {
        Ok(CreateOutcome::Create(meta)) => meta,
        other => panic!("{other:?}"),
    };
    let key = Subject::Key(meta.key_id.clone());
    let principal = Subject::Principal(meta.principal.clone());
    let holding = Held {
        journal_bytes: meta.stored_bytes,
        background: 1,
    };
    assert_eq!(a.held(&key), holding, "its own write at once");
    until("the other Edge to see it", || async {
        b.held(&principal) == holding
    })
    .await;
    let done = a
        .finish(
            "r1".into(),
            1,
            iop_core::journal::Terminal {
                status: iop_core::journal::RecordStatus::Completed,
                reason: None,
                message: None,
                at_unix_ms: 5,
            },
        )
        .await
        .unwrap();
    until("the other Edge to see it end", || async {
        b.held(&key).background == 0
    })
    .await;
    assert_eq!(b.held(&key).journal_bytes, done.stored_bytes);
    b.delete("r1".into()).await.unwrap();
    until("the first Edge to see it gone", || async {
        a.held(&principal) == Held::default()
    })
    .await;
}
