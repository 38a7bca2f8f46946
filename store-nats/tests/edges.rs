//! Several Edges on one NATS server (R-MULTI-1): live following, takeover
//! races, a server killed with SIGKILL, a full store (R-JRN-5), and an
//! incompatible existing stream.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use iop_core::journal::{
    CreateOutcome, JournalError, JournalEvent, JournalLimits, RecordStatus, Terminal,
};
use iop_store::{JournalStore, Progress};
use iop_store_nats::{ConnectError, NatsStore};
use support::{NatsServer, WAIT, options, record, until};

const LIMITS: JournalLimits = JournalLimits {
    retention_ms: 60_000,
    max_bytes: 64 * 1024 * 1024,
    max_record_bytes: 1024 * 1024,
};

fn event(seq: u64) -> JournalEvent {
    JournalEvent {
        seq,
        payload: format!("delta {seq}").into_bytes(),
    }
}

fn done(at: u64) -> Terminal {
    Terminal {
        status: RecordStatus::Completed,
        reason: None,
        message: None,
        at_unix_ms: at,
    }
}

async fn connect(server: &NatsServer, name: &str, limits: JournalLimits) -> NatsStore {
    NatsStore::connect(options(&server.url(), name, limits))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

async fn create(store: &NatsStore, id: &str, request: &[u8]) {
    match store.create(record(id, request)).await {
        Ok(CreateOutcome::Create(_)) => {}
        other => panic!("create {id}: {other:?}"),
    }
}

/// One Edge writes a response; another, on the same server, follows it
/// live through its own watch and reads every event, then the terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_edge_follows_a_response_live_as_the_first_writes_it() {
    const LAST: u64 = 60;
    let Some(server) = NatsServer::start() else {
        return;
    };
    let writer = connect(&server, "live", LIMITS).await;
    let reader = Arc::new(connect(&server, "live", LIMITS).await);
    create(&writer, "r1", b"{\"input\":\"hi\"}").await;
    writer.append("r1".into(), 1, vec![event(1)]).await.unwrap();

    let mut progress = reader.watch("r1".into()).await.unwrap();
    let first = *progress.borrow_and_update();
    assert!(first.last_seq <= 1 && !first.ended, "{first:?}");
    let follower = {
        let reader = reader.clone();
        tokio::spawn(async move {
            let mut seen: Vec<JournalEvent> = Vec::new();
            loop {
                let now = *progress.borrow_and_update();
                let after = seen.last().map_or(0, |e| e.seq);
                if now.last_seq > after {
                    let more = reader.events("r1".into(), after, 1000).await.unwrap();
                    assert!(
                        more.len() as u64 >= now.last_seq - after,
                        "a watched append is readable"
                    );
                    seen.extend(more);
                }
                if now.ended && seen.len() as u64 == now.last_seq {
                    return seen;
                }
                tokio::time::timeout(WAIT, progress.changed())
                    .await
                    .expect("the watch moves")
                    .expect("the record stays");
            }
        })
    };
    for seq in 2..=LAST {
        writer
            .append("r1".into(), 1, vec![event(seq)])
            .await
            .unwrap();
    }
    writer.finish("r1".into(), 1, done(5)).await.unwrap();
    let seen = tokio::time::timeout(WAIT, follower)
        .await
        .expect("the follower ends")
        .expect("the follower");
    assert_eq!(seen, (1..=LAST).map(event).collect::<Vec<_>>());

    // The reader's Edge knows the record as the writer left it.
    let (meta, request) = reader.get("r1".into(), 0).await.unwrap().unwrap();
    assert_eq!(
        (meta.last_seq, meta.status()),
        (LAST, RecordStatus::Completed)
    );
    assert_eq!(request, b"{\"input\":\"hi\"}");
    until("the reader's directory to count the record", || async {
        reader.stats().records == 1 && reader.stats().used_bytes == meta.stored_bytes
    })
    .await;
    // A watch from the reader's Edge on the finished record starts at its end.
    let late = reader.watch("r1".into()).await.unwrap();
    assert_eq!(
        *late.borrow(),
        Progress {
            last_seq: LAST,
            ended: true
        }
    );
    // Deleted on one Edge, the other's followers end.
    let mut follower = reader.watch("r1".into()).await.unwrap();
    writer.delete("r1".into()).await.unwrap();
    tokio::time::timeout(WAIT, async { while follower.changed().await.is_ok() {} })
        .await
        .expect("the follower ends with the record");
    assert_eq!(reader.get("r1".into(), 0).await, Ok(None));
}

/// Two Edges race to take a record over (R-JRN-3, R-TAKE-1): each round,
/// exactly one raises the epoch, and the loser is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_race_between_edges_has_exactly_one_winner() {
    const PER_EDGE: usize = 4;
    let Some(server) = NatsServer::start() else {
        return;
    };
    let a = Arc::new(connect(&server, "race", LIMITS).await);
    let b = Arc::new(connect(&server, "race", LIMITS).await);
    create(&a, "r1", b"{}").await;
    a.append("r1".into(), 1, vec![event(1)]).await.unwrap();
    for expected in 1..=6u64 {
        let mut racers = Vec::new();
        for store in [&a, &b] {
            for _ in 0..PER_EDGE {
                let store = store.clone();
                racers.push(tokio::spawn(async move {
                    store
                        .raise_epoch("r1".into(), expected, "taker".into())
                        .await
                }));
            }
        }
        let mut winners = 0;
        for racer in racers {
            match racer.await.unwrap() {
                Ok(meta) => {
                    assert_eq!(meta.epoch, expected + 1);
                    winners += 1;
                }
                Err(e) => assert_eq!(
                    e,
                    JournalError::Fenced {
                        current: expected + 1,
                        writer: expected
                    }
                ),
            }
        }
        assert_eq!(winners, 1, "round {expected}");
    }
    // The last winner's epoch writes; the first owner's does not.
    assert!(matches!(
        a.append("r1".into(), 1, vec![event(2)]).await,
        Err(JournalError::Fenced { current: 7, .. })
    ));
    b.append("r1".into(), 7, vec![event(2)]).await.unwrap();
    assert_eq!(
        a.events("r1".into(), 0, 10).await.unwrap(),
        vec![event(1), event(2)]
    );
}

/// SIGKILL the server while writers append, start it again on the same
/// store directory: every append that was acknowledged is there, the
/// numbering has no gap, and the writers carry on after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_append_loses_no_acknowledged_event() {
    const RECORDS: usize = 4;
    const EVENTS: u64 = 150;
    let Some(mut server) = NatsServer::start() else {
        return;
    };
    let mut o = options(&server.url(), "crash", LIMITS);
    o.request_timeout = Duration::from_secs(2);
    let store = Arc::new(NatsStore::connect(o).await.unwrap());
    let (acked_tx, mut acked_rx) = tokio::sync::mpsc::unbounded_channel::<(usize, u64)>();
    for r in 0..RECORDS {
        create(&store, &format!("r{r}"), b"{}").await;
    }
    let mut writers = Vec::new();
    for r in 0..RECORDS {
        let store = store.clone();
        let acked = acked_tx.clone();
        writers.push(tokio::spawn(async move {
            let id = format!("r{r}");
            let mut next = 1;
            let mut failures = 0u32;
            while next <= EVENTS {
                match store.append(id.clone(), 1, vec![event(next)]).await {
                    Ok(meta) => {
                        assert_eq!(meta.last_seq, next);
                        let _ = acked.send((r, next));
                        next += 1;
                    }
                    // The ack was lost but the append committed.
                    Err(JournalError::OutOfOrder { expected, got }) if expected == got + 1 => {
                        next += 1;
                    }
                    Err(e) => {
                        failures += 1;
                        assert!(failures < 2000, "{id}: the store never came back: {e}");
                        // Pace the retries while the server is down.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            failures
        }));
    }
    drop(acked_tx);
    // Kill once every writer has some acknowledged events.
    let mut acked: BTreeMap<usize, u64> = BTreeMap::new();
    while acked.len() < RECORDS || acked.values().any(|&n| n < 20) {
        let (r, seq) = tokio::time::timeout(WAIT, acked_rx.recv())
            .await
            .expect("appends are acknowledged")
            .expect("writers run");
        acked.insert(r, seq);
    }
    server.kill();
    // Whatever was acknowledged before the kill is all that is known now.
    while let Ok((r, seq)) = acked_rx.try_recv() {
        acked.insert(r, seq);
    }
    let before_restart = acked.clone();
    // The kill came while the writers were writing.
    assert!(
        before_restart.values().any(|&n| n < EVENTS),
        "{before_restart:?}"
    );
    server.restart();
    for w in writers {
        // How many appends failed is up to timing: a writer with no append
        // in flight at the kill reconnects without seeing an error.
        tokio::time::timeout(Duration::from_secs(120), w)
            .await
            .expect("the writers finish after the restart")
            .expect("writer");
    }
    // A fresh Edge reads everything back.
    let fresh = connect(&server, "crash", LIMITS).await;
    for (r, last_acked) in before_restart {
        let id = format!("r{r}");
        let (meta, _) = fresh.get(id.clone(), 0).await.unwrap().unwrap();
        assert_eq!(meta.last_seq, EVENTS, "{id}");
        assert!(meta.last_seq >= last_acked);
        let events = fresh.events(id.clone(), 0, usize::MAX).await.unwrap();
        assert_eq!(events, (1..=EVENTS).map(event).collect::<Vec<_>>(), "{id}");
        fresh.finish(id, 1, done(9)).await.unwrap();
    }
    assert!(fresh.unfinished().await.unwrap().is_empty());
}

/// R-JRN-5 on the server's limits: creates stop while the stream still
/// has its reserve, so the records already accepted grow to their
/// terminal; past the stream's own limit a write is `Full`, never a
/// generic failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_stream_refuses_creates_and_accepted_records_still_finish() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let mut o = options(&server.url(), "full", LIMITS);
    o.stream_max_bytes = 300_000;
    o.stream_reserve_bytes = 150_000;
    let store = NatsStore::connect(o).await.unwrap();
    let request = vec![b'q'; 20_000];
    let mut accepted = Vec::new();
    let refused = loop {
        let id = format!("r{}", accepted.len());
        match store.create(record(&id, &request)).await {
            Ok(CreateOutcome::Create(_)) => accepted.push(id),
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        }
        assert!(accepted.len() < 50, "the reserve never refused a create");
    };
    assert_eq!(refused, JournalError::Full);
    assert!(
        !accepted.is_empty() && accepted.len() <= 8,
        "{}",
        accepted.len()
    );
    // The journal's own bound was far: only the stream's room refused.
    assert!(store.stats().used_bytes < LIMITS.max_bytes / 10);
    for id in &accepted {
        for seq in 1..=3 {
            let big = JournalEvent {
                seq,
                payload: vec![b'x'; 5_000],
            };
            store.append(id.clone(), 1, vec![big]).await.unwrap();
        }
        store.finish(id.clone(), 1, done(2)).await.unwrap();
    }
    assert_eq!(
        store.create(record("late", b"{}")).await,
        Err(JournalError::Full)
    );
    // Deleting makes room again.
    for id in &accepted {
        store.delete(id.clone()).await.unwrap();
    }
    create(&store, "late", b"{}").await;

    // With no reserve, the stream's limit itself is met, as `Full`.
    let mut o = options(&server.url(), "hard", LIMITS);
    o.stream_max_bytes = 100_000;
    o.stream_reserve_bytes = 1_000;
    let store = NatsStore::connect(o).await.unwrap();
    create(&store, "r", b"{}").await;
    let mut seq = 1;
    let refused = loop {
        let big = JournalEvent {
            seq,
            payload: vec![b'x'; 10_000],
        };
        match store.append("r".into(), 1, vec![big]).await {
            Ok(_) => seq += 1,
            Err(e) => break e,
        }
        assert!(seq < 50, "the stream's limit never refused an append");
    };
    assert_eq!(refused, JournalError::Full);
    // The refused append left nothing; the record still ends.
    let events = store.events("r".into(), 0, usize::MAX).await.unwrap();
    assert_eq!(events.len() as u64, seq - 1);
    store.finish("r".into(), 1, done(3)).await.unwrap();
}

/// An existing stream whose configuration the store cannot use is named
/// with the field that differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incompatible_existing_stream_is_refused_naming_the_field() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    drop(connect(&server, "compat", LIMITS).await);
    let mut o = options(&server.url(), "compat", LIMITS);
    o.stream_max_bytes += 1;
    match NatsStore::connect(o).await {
        Err(ConnectError::Incompatible { what, field, .. }) => {
            assert_eq!((what.as_str(), field), ("stream J_compat", "max_bytes"));
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("connected to an incompatible stream"),
    }
    let mut o = options(&server.url(), "compat", LIMITS);
    o.bucket_max_bytes += 1;
    match NatsStore::connect(o).await {
        Err(ConnectError::Incompatible { what, field, .. }) => {
            assert_eq!((what.as_str(), field), ("bucket j_compat", "max_bytes"));
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("connected to an incompatible bucket"),
    }
    // The same options connect again.
    drop(connect(&server, "compat", LIMITS).await);
}

/// A server that cannot reserve a stream's or bucket's `max_bytes`
/// (JetStream reserves each against its `max_file_store` when it is made)
/// is named with the option to lower, not reported as unreachable; with
/// the option lowered the store opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_room_for_the_limits_names_the_option_to_lower() {
    const MIB: u64 = 1 << 20;
    // The stream's 256 MiB fit, the bucket's 128 MiB more do not.
    let Some(server) = NatsServer::start_with_file_store(300 * MIB, &[]) else {
        return;
    };
    let expect_reserve =
        |result: Result<_, ConnectError>, want_what: &str, want_field: &str| match result {
            Err(ConnectError::Reserve {
                what,
                max_bytes,
                field,
                detail,
            }) => {
                assert_eq!(what, want_what, "{detail}");
                assert!(field.contains(want_field), "{field}");
                assert!(max_bytes > 0);
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("{want_what} made beyond the server's storage"),
        };
    let o = options(&server.url(), "small", LIMITS);
    expect_reserve(
        NatsStore::connect(o.clone()).await.map(drop),
        "bucket j_small",
        "bucket_max_bytes",
    );
    let err = NatsStore::connect(o.clone())
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("max_file_store"), "{err}");
    let mut o = o;
    o.bucket_max_bytes = 16 * MIB;
    o.bucket_reserve_bytes = 8 * MIB;
    o.tenant_bucket_max_bytes = 256 * MIB;
    let store = NatsStore::connect(o.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The tenants' four buckets of 256 MiB do not fit either.
    expect_reserve(
        store.tenant_store().await.map(drop),
        "bucket j_small_rates",
        "tenant_bucket_max_bytes",
    );
    drop(store);
    o.tenant_bucket_max_bytes = 4 * MIB;
    let store = NatsStore::connect(o)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store.tenant_store().await.unwrap_or_else(|e| panic!("{e}"));
}

/// A server that wants a user and password: the right ones connect, wrong
/// ones are a connect error, not a panic or a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_sent_and_wrong_ones_refused() {
    let Some(server) = NatsServer::start_with(&["--user", "edge", "--pass", "s3cret"]) else {
        return;
    };
    let mut o = options(&server.url(), "auth", LIMITS);
    o.auth = iop_store_nats::NatsAuth::UserPassword {
        user: "edge".into(),
        password: "s3cret".into(),
    };
    let store = NatsStore::connect(o.clone()).await.unwrap();
    create(&store, "r1", b"{}").await;
    o.auth = iop_store_nats::NatsAuth::UserPassword {
        user: "edge".into(),
        password: "wrong".into(),
    };
    assert!(matches!(
        NatsStore::connect(o.clone()).await,
        Err(ConnectError::Connect { .. })
    ));
    o.auth = iop_store_nats::NatsAuth::CredentialsFile("/nonexistent/edge.creds".into());
    assert!(matches!(
        NatsStore::connect(o).await,
        Err(ConnectError::Credentials { .. })
    ));
}

/// R-IDEM-1 across Edges: many creates with one idempotency key, on two
/// Edges at once, make one response; every other gets that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_with_one_key_on_two_edges_make_one_response() {
    const PER_EDGE: usize = 8;
    let Some(server) = NatsServer::start() else {
        return;
    };
    let a = Arc::new(connect(&server, "idem", LIMITS).await);
    let b = Arc::new(connect(&server, "idem", LIMITS).await);
    let mut tasks = Vec::new();
    for (e, store) in [&a, &b].into_iter().enumerate() {
        for i in 0..PER_EDGE {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let mut r = record(&format!("r{e}-{i}"), b"{\"same\":true}");
                r.idempotency_key = Some(iop_core::journal::idempotency_hash("p", "order-42"));
                store.create(r).await
            }));
        }
    }
    let mut created = Vec::new();
    let mut existing = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(CreateOutcome::Create(m)) => created.push(m.id),
            Ok(CreateOutcome::Existing(m)) => existing.push(m.id),
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(created.len(), 1, "{created:?}");
    assert!(existing.iter().all(|id| *id == created[0]), "{existing:?}");
    // Only the one response is stored, on either Edge.
    until("both Edges to count one record", || async {
        a.stats().records == 1 && b.stats().records == 1
    })
    .await;
    for (e, store) in [&a, &b].into_iter().enumerate() {
        for i in 0..PER_EDGE {
            let id = format!("r{e}-{i}");
            let found = store.get(id.clone(), 0).await.unwrap().is_some();
            assert_eq!(found, id == created[0], "{id}");
        }
    }
}

fn lease(edge: &str, incarnation: u64) -> iop_core::journal::EdgeLease {
    iop_core::journal::EdgeLease {
        edge_id: edge.into(),
        incarnation,
        ttl_ms: 15_000,
        renewed_unix_ms: 1,
    }
}

/// R-TAKE-1: an Edge's ownership lease is a bucket key every Edge reads:
/// each renewal is a new revision, another Edge sees it at once (a read
/// from the stream's leader), and a writer that did not read the current
/// revision is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ownership_leases_are_shared_and_renewed_by_compare_and_set() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let a = connect(&server, "lease", LIMITS).await;
    let b = connect(&server, "lease", LIMITS).await;
    let first = a.put_lease(lease("edge-a", 1), 0).await.unwrap();
    let seen = b
        .lease("edge-a".into())
        .await
        .unwrap()
        .expect("b reads a's lease");
    assert_eq!((seen.revision, seen.lease.incarnation), (first, 1));
    let renewed = a.put_lease(lease("edge-a", 1), first).await.unwrap();
    assert!(renewed > first);
    assert_eq!(
        b.lease("edge-a".into()).await.unwrap().map(|l| l.revision),
        Some(renewed),
        "a renewal is seen by the other Edge's next read"
    );
    // A second process with the same id that read the old revision.
    assert_eq!(
        b.put_lease(lease("edge-a", 2), first).await,
        Err(JournalError::Fenced {
            current: renewed,
            writer: first
        })
    );
    b.put_lease(lease("edge-b", 5), 0).await.unwrap();
    until("each Edge to list both leases", || async {
        let mut ids: Vec<String> = match a.leases().await {
            Ok(all) => all.into_iter().map(|l| l.lease.edge_id).collect(),
            Err(_) => return false,
        };
        ids.sort();
        ids == ["edge-a", "edge-b"]
    })
    .await;
    assert_eq!(b.lease("edge-c".into()).await, Ok(None));
}

/// A store outage: while the server is down every operation fails at
/// once with a store error (no waiting for the answer's timeout, which
/// is far longer here), and once it is back the same store works again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_an_outage_operations_fail_at_once_and_work_again_after() {
    let Some(mut server) = NatsServer::start() else {
        return;
    };
    let mut o = options(&server.url(), "outage", LIMITS);
    o.request_timeout = Duration::from_secs(120);
    let store = NatsStore::connect(o).await.unwrap();
    create(&store, "r1", b"{}").await;
    server.kill();
    until("the outage to be seen", || async {
        matches!(
            store.create(record("r2", b"{}")).await,
            Err(JournalError::Store(_))
        )
    })
    .await;
    for outcome in [
        store.append("r1".into(), 1, vec![event(1)]).await.err(),
        store.get("r1".into(), 0).await.err(),
        store.put_lease(lease("edge-a", 1), 0).await.err(),
        store.leases().await.err(),
    ] {
        assert!(
            matches!(outcome, Some(JournalError::Store(_))),
            "{outcome:?}"
        );
    }
    server.restart();
    until("the store to work again", || async {
        store.append("r1".into(), 1, vec![event(1)]).await.is_ok()
    })
    .await;
    assert_eq!(
        store.events("r1".into(), 0, 10).await.unwrap(),
        vec![event(1)]
    );
}

/// R-JRN-6: a record whose value in the bucket does not decode is
/// quarantined: a store connecting loads the bucket all the same, counts
/// it, leaves it out of its scans and reads, and serves every other
/// record; one already connected does the same when the watch delivers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_does_not_decode_is_quarantined_and_the_rest_is_served() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let writer = connect(&server, "damaged", LIMITS).await;
    for id in ["good", "damaged", "late"] {
        create(&writer, id, b"{}").await;
        writer.append(id.into(), 1, vec![event(1)]).await.unwrap();
    }
    let raw = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(raw);
    js.publish(
        "$KV.j_damaged.rec.damaged",
        bytes::Bytes::from_static(&[0xff; 7]),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let store = connect(&server, "damaged", LIMITS).await;
    assert_eq!(store.stats().quarantined, 1);
    assert_eq!(store.stats().records, 2);
    let mut unfinished: Vec<String> = store
        .unfinished()
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.id)
        .collect();
    unfinished.sort();
    assert_eq!(unfinished, ["good", "late"]);
    assert_eq!(store.get("damaged".into(), 0).await, Ok(None));
    assert_eq!(
        store.events("damaged".into(), 0, 10).await,
        Err(JournalError::NotFound)
    );
    assert!(store.get("good".into(), 0).await.unwrap().is_some());
    store
        .append("good".into(), 1, vec![event(2)])
        .await
        .unwrap();
    // The writer, connected before, learns it from its watch.
    until("the watch to quarantine it", || async {
        writer.stats().quarantined == 1
    })
    .await;
    // Damaged at once, as the watch delivers it to a connected store.
    js.publish(
        "$KV.j_damaged.rec.late",
        bytes::Bytes::from_static(&[0xfe; 3]),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    until("a second quarantine", || async {
        store.stats().quarantined == 2
    })
    .await;
    assert_eq!(store.unfinished().await.unwrap().len(), 1);
}

/// R-JRN-6: a quarantined record is not kept for good: once it has stayed
/// unchanged and unreadable for a retention since a sweep first saw it
/// (a record kept that long would have expired), a sweep removes it with
/// its messages, and its id can be used again. One written again
/// meanwhile (a newer build's record, say) starts its wait again; every
/// other record stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_record_is_swept_a_retention_after_a_sweep_first_saw_it() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let store = connect(&server, "qsweep", LIMITS).await;
    for id in ["good", "damaged"] {
        create(&store, id, b"{}").await;
        store.append(id.into(), 1, vec![event(1)]).await.unwrap();
    }
    let raw = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(raw);
    let damage = |byte: u8| {
        let js = js.clone();
        async move {
            js.publish(
                "$KV.j_qsweep.rec.damaged",
                bytes::Bytes::from(vec![byte; 5]),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
    };
    damage(0xff).await;
    until("the watch to quarantine it", || async {
        store.stats().quarantined == 1
    })
    .await;
    let t0 = 1_900_000_000_000;
    let retention = LIMITS.retention_ms;
    assert_eq!(store.sweep(t0).await.unwrap(), 0, "first seen");
    assert_eq!(store.sweep(t0 + retention - 1).await.unwrap(), 0);
    // Written again, still unreadable: its wait starts again.
    damage(0xfe).await;
    assert_eq!(store.sweep(t0 + retention).await.unwrap(), 0, "changed");
    assert_eq!(
        store.sweep(t0 + 2 * retention - 1).await.unwrap(),
        0,
        "a retention has not passed since it changed"
    );
    assert_eq!(store.stats().quarantined, 1);
    assert_eq!(store.sweep(t0 + 3 * retention).await.unwrap(), 1);
    assert_eq!(store.stats().quarantined, 0);
    assert_eq!(store.get("damaged".into(), 0).await, Ok(None));
    // The id is free again, its old messages gone; the rest stays.
    create(&store, "damaged", b"{}").await;
    assert_eq!(store.events("damaged".into(), 0, 10).await, Ok(vec![]));
    assert!(store.get("good".into(), 0).await.unwrap().is_some());
    assert_eq!(
        store.events("good".into(), 0, 10).await.unwrap(),
        vec![event(1)]
    );
}

/// A server that verifies its clients' certificates (mutual TLS): the
/// store connects with `tls_client_cert`, and is refused without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_opens_a_server_that_verifies_its_clients() {
    let certs = tempfile::tempdir().unwrap();
    let pki = iop_transport::pki::generate_dev_pki(certs.path(), &["journal-client"], &[])
        .expect("a dev PKI");
    let (server_cert, server_key, ca) = (
        pki.edge_cert.display().to_string(),
        pki.edge_key.display().to_string(),
        pki.ca_cert.display().to_string(),
    );
    let Some(server) = NatsServer::start_with(&[
        "--tls",
        "--tlscert",
        &server_cert,
        "--tlskey",
        &server_key,
        "--tlscacert",
        &ca,
        "--tlsverify",
    ]) else {
        return;
    };
    let url = server.url().replace("nats://127.0.0.1", "tls://localhost");
    let mut o = options(&url, "mtls", LIMITS);
    o.tls_ca_file = Some(pki.ca_cert.clone());
    o.connect_timeout = Duration::from_secs(5);
    assert!(
        NatsStore::connect(o.clone()).await.is_err(),
        "refused without a client certificate"
    );
    let client = pki.node("journal-client").unwrap();
    o.tls_client_cert = Some((client.cert.clone(), client.key.clone()));
    let store = NatsStore::connect(o).await.expect("connects with one");
    create(&store, "r1", b"{}").await;
    store.append("r1".into(), 1, vec![event(1)]).await.unwrap();
}
