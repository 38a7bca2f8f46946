//! The behaviours every [`JournalStore`] shows, whatever its engine: the
//! journal's rules (R-JRN-1..5, R-IDEM-1) as seen through the trait.
//!
//! Store-agnostic: each behaviour gets a fresh store from the caller's
//! factory, made with the [`JournalLimits`] the behaviour names, and only
//! uses the trait. A store's tests run them all:
//!
//! ```ignore
//! #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
//! async fn my_store_conforms() {
//!     iop_store::conformance::run_all(|limits| async move { MyStore::new(limits) }).await;
//! }
//! ```
//!
//! A behaviour panics (an assertion) when the store breaks a rule; its name
//! is printed to stderr before it runs.

use std::future::Future;
use std::sync::Arc;

use iop_core::journal::{
    CreateOutcome, EVENT_OVERHEAD_BYTES, EdgeLease, JournalApi, JournalError, JournalEvent,
    JournalLimits, NewRecord, RECORD_OVERHEAD_BYTES, RecordMeta, RecordStatus, Terminal,
    fingerprint, idempotency_hash,
};

use crate::{BoxFuture, Held, JournalStore, Progress, Subject};

pub mod tenant;

/// One behaviour: its name, the limits its store is made with, and the
/// check.
pub struct Behaviour {
    /// The behaviour, as a sentence in snake case.
    pub name: &'static str,
    /// The limits to make its store with.
    pub limits: JournalLimits,
    /// Run it against a fresh store.
    pub run: fn(Arc<dyn JournalStore>) -> BoxFuture<'static, ()>,
}

/// The limits most behaviours use: one-second retention, 64 KiB records,
/// 1 MiB in all.
pub const LIMITS: JournalLimits = JournalLimits {
    retention_ms: 1000,
    max_bytes: 1024 * 1024,
    max_record_bytes: 64 * 1024,
};

/// The limits of [`full_store_refuses_new_records_but_accepted_ones_finish`].
pub const SMALL_STORE_LIMITS: JournalLimits = JournalLimits {
    retention_ms: 1000,
    max_bytes: 100_000,
    max_record_bytes: 64 * 1024,
};

/// Every behaviour.
pub fn behaviours() -> Vec<Behaviour> {
    macro_rules! behaviour {
        ($name:ident) => {
            behaviour!($name, LIMITS)
        };
        ($name:ident, $limits:expr) => {
            Behaviour {
                name: stringify!($name),
                limits: $limits,
                run: |store| Box::pin($name(store)),
            }
        };
    }
    vec![
        behaviour!(create_is_idempotent_per_principal_and_key),
        behaviour!(a_record_that_failed_before_any_event_gives_its_key_up),
        behaviour!(an_expired_record_gives_its_key_and_id_up),
        behaviour!(appends_are_numbered_without_gap_or_duplicate),
        behaviour!(a_fenced_writer_appends_nothing_not_even_a_terminal),
        behaviour!(a_record_gets_exactly_one_terminal),
        behaviour!(raise_epoch_has_exactly_one_winner_under_concurrency),
        behaviour!(refused_operations_do_not_disturb_concurrent_ones),
        behaviour!(events_are_read_by_range_after_and_max),
        behaviour!(watch_sees_every_durable_append_and_the_terminal),
        behaviour!(
            full_store_refuses_new_records_but_accepted_ones_finish,
            SMALL_STORE_LIMITS
        ),
        behaviour!(a_record_is_bounded_in_bytes),
        behaviour!(sweep_removes_only_expired_finished_records),
        behaviour!(delete_removes_the_record_its_events_request_and_key),
        behaviour!(unfinished_lists_exactly_the_running_records),
        behaviour!(a_record_names_its_owner_and_the_winner_of_its_epoch),
        behaviour!(a_lease_is_written_only_over_the_revision_its_writer_read),
        behaviour!(held_gauges_follow_every_record_of_a_key_and_its_principal),
    ]
}

/// Run every behaviour, each on a fresh store from `make`.
pub async fn run_all<S, F, Fut>(mut make: F)
where
    S: JournalStore,
    F: FnMut(JournalLimits) -> Fut,
    Fut: Future<Output = S>,
{
    for behaviour in behaviours() {
        eprintln!("conformance: {}", behaviour.name);
        let store: Arc<dyn JournalStore> = Arc::new(make(behaviour.limits).await);
        (behaviour.run)(store).await;
    }
}

const PRINCIPAL: &str = "principal-a";

/// The API key id of [`new_record`]'s records.
pub const KEY_ID: &str = "key-a";

/// A new record `id` with request `body`, under `key` if given, created at
/// `at` (Unix ms).
pub fn new_record(id: &str, key: Option<&str>, body: &[u8], at: u64) -> NewRecord {
    NewRecord {
        id: id.into(),
        principal: PRINCIPAL.into(),
        api: JournalApi::Responses,
        model: "model-a".into(),
        fingerprint: fingerprint("/v1/responses", body),
        idempotency_key: key.map(|k| idempotency_hash(PRINCIPAL, k)),
        background: false,
        request: body.to_vec(),
        created_unix_ms: at,
        owner: "edge-a".into(),
        key_id: KEY_ID.into(),
    }
}

/// Event `seq` with a payload that names it.
pub fn event(seq: u64) -> JournalEvent {
    JournalEvent {
        seq,
        payload: format!("delta {seq}").into_bytes(),
    }
}

fn events(seqs: impl IntoIterator<Item = u64>) -> Vec<JournalEvent> {
    seqs.into_iter().map(event).collect()
}

/// A terminal of `status` at `at`.
pub fn terminal(status: RecordStatus, at: u64) -> Terminal {
    Terminal {
        status,
        reason: None,
        message: None,
        at_unix_ms: at,
    }
}

#[track_caller]
fn created(outcome: Result<CreateOutcome, JournalError>) -> RecordMeta {
    match outcome {
        Ok(CreateOutcome::Create(meta)) => meta,
        other => panic!("expected a new record, got {other:?}"),
    }
}

async fn create(store: &dyn JournalStore, record: NewRecord) -> RecordMeta {
    created(store.create(record).await)
}

async fn stored_bytes(store: &dyn JournalStore, ids: &[&str]) -> u64 {
    let mut sum = 0;
    for id in ids {
        let (meta, _) = store
            .get((*id).into(), 0)
            .await
            .expect("get")
            .expect("record present");
        sum += meta.stored_bytes;
    }
    sum
}

async fn seqs(store: &dyn JournalStore, id: &str) -> Vec<u64> {
    store
        .events(id.into(), 0, usize::MAX)
        .await
        .expect("events")
        .iter()
        .map(|e| e.seq)
        .collect()
}

/// R-IDEM-1: a key names one response per principal; a repeat with the
/// same request gets it, one with another request a conflict.
pub async fn create_is_idempotent_per_principal_and_key(store: Arc<dyn JournalStore>) {
    let s = &*store;
    let r1 = create(s, new_record("r1", Some("k"), b"{}", 10)).await;
    assert_eq!(
        (
            r1.epoch,
            r1.last_seq,
            r1.terminal.clone(),
            r1.expires_unix_ms
        ),
        (1, 0, None, u64::MAX)
    );
    assert_eq!(r1.stored_bytes, 2 + RECORD_OVERHEAD_BYTES);
    let (got, request) = s.get("r1".into(), 10).await.unwrap().unwrap();
    assert_eq!((got, request), (r1.clone(), b"{}".to_vec()));

    // Same key, same request: the first response, nothing new.
    assert_eq!(
        s.create(new_record("r2", Some("k"), b"{}", 11)).await,
        Ok(CreateOutcome::Existing(r1.clone()))
    );
    assert_eq!(s.get("r2".into(), 11).await, Ok(None));
    // Same key, another request or another API: a conflict.
    assert_eq!(
        s.create(new_record("r3", Some("k"), b"{\"x\":1}", 12))
            .await,
        Err(JournalError::IdempotencyConflict)
    );
    let mut other_api = new_record("r3", Some("k"), b"{}", 12);
    other_api.api = JournalApi::ChatCompletions;
    assert_eq!(
        s.create(other_api).await,
        Err(JournalError::IdempotencyConflict)
    );
    assert_eq!(s.get("r3".into(), 12).await, Ok(None));
    // The same key string from another principal is another key.
    let mut theirs = new_record("r4", None, b"{}", 13);
    theirs.principal = "principal-b".into();
    theirs.idempotency_key = Some(idempotency_hash("principal-b", "k"));
    create(s, theirs).await;
    // Ids are unique.
    assert_eq!(
        s.create(new_record("r1", None, b"{}", 14)).await,
        Err(JournalError::DuplicateId)
    );
    // Without a key every create is new.
    create(s, new_record("r5", None, b"{}", 15)).await;
    create(s, new_record("r6", None, b"{}", 15)).await;
    // A finished record still answers its key within retention.
    s.append("r1".into(), 1, events(1..=2)).await.unwrap();
    let done = s
        .finish("r1".into(), 1, terminal(RecordStatus::Completed, 20))
        .await
        .unwrap();
    assert_eq!(
        s.create(new_record("r7", Some("k"), b"{}", 21)).await,
        Ok(CreateOutcome::Existing(done))
    );
    let stats = s.stats();
    assert_eq!(stats.records, 4);
    assert_eq!(
        stats.used_bytes,
        stored_bytes(s, &["r1", "r4", "r5", "r6"]).await
    );
}

/// R-IDEM-1: a record that failed before any event published nothing, so
/// a retry under its key runs afresh and replaces it.
pub async fn a_record_that_failed_before_any_event_gives_its_key_up(store: Arc<dyn JournalStore>) {
    let s = &*store;
    create(s, new_record("r1", Some("k"), b"{}", 10)).await;
    s.finish("r1".into(), 1, terminal(RecordStatus::Failed, 11))
        .await
        .unwrap();
    let r2 = create(s, new_record("r2", Some("k"), b"{}", 12)).await;
    assert_eq!(s.get("r1".into(), 12).await, Ok(None));
    assert_eq!(
        s.events("r1".into(), 0, 10).await,
        Err(JournalError::NotFound)
    );
    assert_eq!(
        s.create(new_record("r3", Some("k"), b"{}", 13)).await,
        Ok(CreateOutcome::Existing(r2.clone()))
    );
    assert_eq!(s.stats().records, 1);
    assert_eq!(s.stats().used_bytes, r2.stored_bytes);

    // One that failed after publishing an event still holds its key.
    create(s, new_record("r4", Some("k2"), b"{}", 20)).await;
    s.append("r4".into(), 1, events([1])).await.unwrap();
    let failed = s
        .finish("r4".into(), 1, terminal(RecordStatus::Failed, 21))
        .await
        .unwrap();
    assert_eq!(
        s.create(new_record("r5", Some("k2"), b"{}", 22)).await,
        Ok(CreateOutcome::Existing(failed))
    );
}

/// R-JRN-5, R-IDEM-1: past its retention a finished record is gone for
/// `get`, and its key and id name something new.
pub async fn an_expired_record_gives_its_key_and_id_up(store: Arc<dyn JournalStore>) {
    let s = &*store;
    let retention = LIMITS.retention_ms;
    create(s, new_record("r1", Some("k"), b"{}", 0)).await;
    s.append("r1".into(), 1, events(1..=3)).await.unwrap();
    let done = s
        .finish("r1".into(), 1, terminal(RecordStatus::Completed, 100))
        .await
        .unwrap();
    assert_eq!(done.expires_unix_ms, 100 + retention);
    assert!(s.get("r1".into(), 99 + retention).await.unwrap().is_some());
    assert_eq!(s.get("r1".into(), 100 + retention).await, Ok(None));
    assert_eq!(
        s.create(new_record("r2", Some("k"), b"{}", 99 + retention))
            .await,
        Ok(CreateOutcome::Existing(done))
    );
    let r2 = create(s, new_record("r2", Some("k"), b"{}", 100 + retention)).await;
    // The expired record was removed, not only hidden.
    assert_eq!(s.get("r1".into(), 0).await, Ok(None));
    assert_eq!(s.stats().records, 1);
    assert_eq!(s.stats().used_bytes, r2.stored_bytes);

    // An expired id may be created again, empty.
    create(s, new_record("r3", None, b"{}", 0)).await;
    s.append("r3".into(), 1, events([1])).await.unwrap();
    s.finish("r3".into(), 1, terminal(RecordStatus::Completed, 100))
        .await
        .unwrap();
    assert_eq!(
        s.create(new_record("r3", None, b"{}", 99 + retention))
            .await,
        Err(JournalError::DuplicateId)
    );
    let again = create(s, new_record("r3", None, b"{}", 100 + retention)).await;
    assert_eq!((again.last_seq, again.terminal), (0, None));
    assert_eq!(seqs(s, "r3").await, Vec::<u64>::new());
    assert_eq!(s.stats().used_bytes, stored_bytes(s, &["r2", "r3"]).await);
}

/// R-JRN-2: events continue the record's numbering; anything else is
/// refused whole.
pub async fn appends_are_numbered_without_gap_or_duplicate(store: Arc<dyn JournalStore>) {
    let s = &*store;
    create(s, new_record("r1", None, b"{}", 0)).await;
    let meta = s.append("r1".into(), 1, events(1..=2)).await.unwrap();
    assert_eq!(meta.last_seq, 2);
    assert_eq!(
        meta.stored_bytes,
        2 + RECORD_OVERHEAD_BYTES
            + events(1..=2)
                .iter()
                .map(|e| e.payload.len() as u64 + EVENT_OVERHEAD_BYTES)
                .sum::<u64>()
    );
    assert_eq!(
        s.append("r1".into(), 1, events([4])).await,
        Err(JournalError::OutOfOrder {
            expected: 3,
            got: 4
        })
    );
    assert_eq!(
        s.append("r1".into(), 1, events([2])).await,
        Err(JournalError::OutOfOrder {
            expected: 3,
            got: 2
        })
    );
    // A batch with a gap inside is refused whole: event 3 is not kept.
    assert_eq!(
        s.append("r1".into(), 1, events([3, 5])).await,
        Err(JournalError::OutOfOrder {
            expected: 4,
            got: 5
        })
    );
    assert_eq!(seqs(s, "r1").await, vec![1, 2]);
    let meta = s.append("r1".into(), 1, events(3..=5)).await.unwrap();
    assert_eq!(meta.last_seq, 5);
    assert_eq!(seqs(s, "r1").await, vec![1, 2, 3, 4, 5]);
    assert_eq!(s.events("r1".into(), 0, 10).await.unwrap(), events(1..=5));
    // An empty append changes nothing.
    assert_eq!(s.append("r1".into(), 1, Vec::new()).await, Ok(meta.clone()));
    assert_eq!(
        s.append("nope".into(), 1, events([1])).await,
        Err(JournalError::NotFound)
    );
    assert_eq!(s.stats().used_bytes, meta.stored_bytes);
}

/// R-JRN-3: once a takeover raised the epoch, the former owner can append
/// nothing, not even a terminal.
pub async fn a_fenced_writer_appends_nothing_not_even_a_terminal(store: Arc<dyn JournalStore>) {
    let s = &*store;
    create(s, new_record("r1", None, b"{}", 0)).await;
    s.append("r1".into(), 1, events([1])).await.unwrap();
    assert_eq!(
        s.append("r1".into(), 2, events([2])).await,
        Err(JournalError::Fenced {
            current: 1,
            writer: 2
        })
    );
    let raised = s.raise_epoch("r1".into(), 1, "taker".into()).await.unwrap();
    assert_eq!((raised.epoch, raised.last_seq), (2, 1));
    assert_eq!(raised.owner, "taker", "the winner owns it (R-TAKE-1)");
    let fenced = Err(JournalError::Fenced {
        current: 2,
        writer: 1,
    });
    assert_eq!(s.append("r1".into(), 1, events([2])).await, fenced);
    assert_eq!(
        s.finish("r1".into(), 1, terminal(RecordStatus::Completed, 5))
            .await,
        fenced
    );
    assert_eq!(s.raise_epoch("r1".into(), 1, "taker".into()).await, fenced);
    // The new owner continues the numbering.
    assert_eq!(
        s.append("r1".into(), 2, events([2]))
            .await
            .unwrap()
            .last_seq,
        2
    );
    let done = s
        .finish("r1".into(), 2, terminal(RecordStatus::Incomplete, 6))
        .await
        .unwrap();
    assert_eq!(done.status(), RecordStatus::Incomplete);
    assert_eq!(seqs(s, "r1").await, vec![1, 2]);
    assert_eq!(
        s.raise_epoch("nope".into(), 1, "taker".into()).await,
        Err(JournalError::NotFound)
    );
}

/// R-JRN-4: one terminal, and nothing after it.
pub async fn a_record_gets_exactly_one_terminal(store: Arc<dyn JournalStore>) {
    let s = &*store;
    create(s, new_record("r1", None, b"{}", 0)).await;
    s.append("r1".into(), 1, events(1..=2)).await.unwrap();
    let done = s
        .finish("r1".into(), 1, terminal(RecordStatus::Completed, 50))
        .await
        .unwrap();
    assert_eq!(done.status(), RecordStatus::Completed);
    assert_eq!(done.expires_unix_ms, 50 + LIMITS.retention_ms);
    assert_eq!(
        s.finish("r1".into(), 1, terminal(RecordStatus::Failed, 51))
            .await,
        Err(JournalError::Terminated)
    );
    assert_eq!(
        s.append("r1".into(), 1, events([3])).await,
        Err(JournalError::Terminated)
    );
    assert_eq!(
        s.raise_epoch("r1".into(), 1, "taker".into()).await,
        Err(JournalError::Terminated)
    );
    assert_eq!(seqs(s, "r1").await, vec![1, 2]);
    assert_eq!(s.get("r1".into(), 0).await.unwrap().unwrap().0, done);
    // A terminal that says "in progress" still ends the record.
    create(s, new_record("r2", None, b"{}", 0)).await;
    let ended = s
        .finish("r2".into(), 1, terminal(RecordStatus::InProgress, 60))
        .await
        .unwrap();
    assert_eq!(ended.status(), RecordStatus::Failed);
    assert_eq!(
        s.finish("nope".into(), 1, terminal(RecordStatus::Completed, 0))
            .await,
        Err(JournalError::NotFound)
    );
}

/// R-JRN-3, R-TAKE-1: many takeovers race for one epoch; exactly one wins
/// each round.
pub async fn raise_epoch_has_exactly_one_winner_under_concurrency(store: Arc<dyn JournalStore>) {
    const RACERS: usize = 16;
    create(&*store, new_record("r1", None, b"{}", 0)).await;
    for expected in 1..=3u64 {
        let mut racers = Vec::new();
        for _ in 0..RACERS {
            let store = store.clone();
            racers.push(tokio::spawn(async move {
                store
                    .raise_epoch("r1".into(), expected, "taker".into())
                    .await
            }));
        }
        let mut winners = 0;
        for racer in racers {
            match racer.await.expect("racer") {
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
    let (meta, _) = store.get("r1".into(), 0).await.unwrap().unwrap();
    assert_eq!(meta.epoch, 4);
}

/// Operations refused by the rules do not take accepted ones down with
/// them, however they are grouped (R-JRN-1's batches).
pub async fn refused_operations_do_not_disturb_concurrent_ones(store: Arc<dyn JournalStore>) {
    const RECORDS: usize = 8;
    for i in 0..RECORDS {
        create(&*store, new_record(&format!("r{i}"), None, b"{}", 0)).await;
    }
    let mut tasks = Vec::new();
    for i in 0..RECORDS {
        let id = format!("r{i}");
        let ops: [(u64, Vec<JournalEvent>, bool); 3] = [
            (1, events([1]), true),
            (9, events([1]), false),
            (1, events([7]), false),
        ];
        for (epoch, evs, ok) in ops {
            let store = store.clone();
            let id = id.clone();
            tasks.push(tokio::spawn(async move {
                (ok, store.append(id, epoch, evs).await)
            }));
        }
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            (
                false,
                store.append(format!("missing{i}"), 1, events([1])).await,
            )
        }));
    }
    for task in tasks {
        let (ok, result) = task.await.expect("task");
        assert_eq!(ok, result.is_ok(), "{result:?}");
    }
    for i in 0..RECORDS {
        assert_eq!(seqs(&*store, &format!("r{i}")).await, vec![1]);
    }
}

/// R-JRN-2: a reader resumes after event N and gets N+1, ... in order.
pub async fn events_are_read_by_range_after_and_max(store: Arc<dyn JournalStore>) {
    let s = &*store;
    create(s, new_record("r1", None, b"{}", 0)).await;
    create(s, new_record("r10", None, b"{}", 0)).await;
    for seq in 1..=10 {
        s.append("r1".into(), 1, events([seq])).await.unwrap();
    }
    // A neighbour whose id shares a prefix stays out of r1's range.
    s.append("r10".into(), 1, events(1..=3)).await.unwrap();
    assert_eq!(s.events("r1".into(), 0, 100).await.unwrap(), events(1..=10));
    assert_eq!(s.events("r1".into(), 3, 4).await.unwrap(), events(4..=7));
    assert_eq!(s.events("r1".into(), 9, 4).await.unwrap(), events([10]));
    assert_eq!(s.events("r1".into(), 10, 4).await, Ok(Vec::new()));
    assert_eq!(s.events("r1".into(), u64::MAX, 4).await, Ok(Vec::new()));
    assert_eq!(s.events("r1".into(), 0, 0).await, Ok(Vec::new()));
    assert_eq!(s.events("r10".into(), 1, 100).await.unwrap(), events(2..=3));
    assert_eq!(
        s.events("r".into(), 0, 100).await,
        Err(JournalError::NotFound)
    );
    create(s, new_record("empty", None, b"{}", 0)).await;
    assert_eq!(s.events("empty".into(), 0, 100).await, Ok(Vec::new()));
}

/// R-JRN-1: a watcher learns of an append only once it is durable (its
/// events are readable), of every append by the time it returns, and of
/// the terminal.
pub async fn watch_sees_every_durable_append_and_the_terminal(store: Arc<dyn JournalStore>) {
    const LAST: u64 = 40;
    assert!(matches!(
        store.watch("nope".into()).await,
        Err(JournalError::NotFound)
    ));
    create(&*store, new_record("r1", None, b"{}", 0)).await;
    store.append("r1".into(), 1, events(1..=2)).await.unwrap();
    let mut follower = store.watch("r1".into()).await.unwrap();
    assert_eq!(
        *follower.borrow_and_update(),
        Progress {
            last_seq: 2,
            ended: false
        }
    );
    let reader = store.clone();
    let follow = tokio::spawn(async move {
        let mut seen = Vec::new();
        while follower.changed().await.is_ok() {
            let progress = *follower.borrow_and_update();
            // Visible means durable: the events are there to read.
            let durable = reader
                .events("r1".into(), 0, usize::MAX)
                .await
                .expect("events")
                .len() as u64;
            assert!(durable >= progress.last_seq, "{progress:?} before durable");
            seen.push(progress);
            if progress.ended {
                break;
            }
        }
        seen
    });
    let probe = store.watch("r1".into()).await.unwrap();
    for seq in 3..=LAST {
        store.append("r1".into(), 1, events([seq])).await.unwrap();
        assert_eq!(probe.borrow().last_seq, seq);
    }
    store
        .finish("r1".into(), 1, terminal(RecordStatus::Completed, 9))
        .await
        .unwrap();
    assert_eq!(
        *probe.borrow(),
        Progress {
            last_seq: LAST,
            ended: true
        }
    );
    let seen = follow.await.expect("follower");
    assert!(seen.windows(2).all(|w| w[0].last_seq <= w[1].last_seq));
    assert_eq!(
        seen.last(),
        Some(&Progress {
            last_seq: LAST,
            ended: true
        })
    );
    // Watching a finished record starts at its end.
    let late = store.watch("r1".into()).await.unwrap();
    assert_eq!(
        *late.borrow(),
        Progress {
            last_seq: LAST,
            ended: true
        }
    );
}

/// R-JRN-5: a full store refuses new records, never the records it
/// accepted: they still grow to their terminal.
pub async fn full_store_refuses_new_records_but_accepted_ones_finish(store: Arc<dyn JournalStore>) {
    let s = &*store;
    let max = SMALL_STORE_LIMITS.max_bytes;
    create(s, new_record("r1", None, &[b'a'; 60_000], 0)).await;
    create(s, new_record("r2", None, &[b'b'; 30_000], 0)).await;
    assert_eq!(
        s.create(new_record("r3", None, &[b'c'; 10_000], 0)).await,
        Err(JournalError::Full)
    );
    assert_eq!(s.get("r3".into(), 0).await, Ok(None));
    let big = |seq, n| JournalEvent {
        seq,
        payload: vec![b'x'; n],
    };
    s.append("r1".into(), 1, vec![big(1, 5000)]).await.unwrap();
    s.append("r2".into(), 1, vec![big(1, 4000)]).await.unwrap();
    s.append("r2".into(), 1, vec![big(2, 4500)]).await.unwrap();
    assert!(
        s.stats().used_bytes > max,
        "accepted records grew past the bound"
    );
    s.finish("r1".into(), 1, terminal(RecordStatus::Completed, 1))
        .await
        .unwrap();
    s.finish("r2".into(), 1, terminal(RecordStatus::Completed, 1))
        .await
        .unwrap();
    assert_eq!(
        s.create(new_record("r4", None, b"", 2)).await,
        Err(JournalError::Full)
    );
    assert_eq!(s.stats().used_bytes, stored_bytes(s, &["r1", "r2"]).await);
    s.delete("r2".into()).await.unwrap();
    create(s, new_record("r4", None, b"", 3)).await;
    assert_eq!(s.stats().used_bytes, stored_bytes(s, &["r1", "r4"]).await);
}

/// R-JRN-5: one record holds at most `max_record_bytes`; an append past it
/// is refused whole and the record can still end.
pub async fn a_record_is_bounded_in_bytes(store: Arc<dyn JournalStore>) {
    let s = &*store;
    let max = LIMITS.max_record_bytes;
    let room = (max - RECORD_OVERHEAD_BYTES) as usize;
    assert_eq!(
        s.create(new_record("big", None, &vec![b'a'; room + 1], 0))
            .await,
        Err(JournalError::RecordTooLarge)
    );
    let exact = create(s, new_record("exact", None, &vec![b'a'; room], 0)).await;
    assert_eq!(exact.stored_bytes, max);

    let r1 = create(s, new_record("r1", None, b"{}", 0)).await;
    let used = s.stats().used_bytes;
    let payload = |seq, n| JournalEvent {
        seq,
        payload: vec![b'x'; n],
    };
    assert_eq!(
        s.append("r1".into(), 1, vec![payload(1, max as usize)])
            .await,
        Err(JournalError::RecordTooLarge)
    );
    // Many events that only together pass the bound: none is kept.
    let half = (max / 2) as usize;
    assert_eq!(
        s.append("r1".into(), 1, vec![payload(1, half), payload(2, half)])
            .await,
        Err(JournalError::RecordTooLarge)
    );
    assert_eq!(s.get("r1".into(), 0).await.unwrap().unwrap().0, r1);
    assert_eq!(seqs(s, "r1").await, Vec::<u64>::new());
    assert_eq!(s.stats().used_bytes, used);
    s.append("r1".into(), 1, vec![payload(1, half)])
        .await
        .unwrap();
    s.finish("r1".into(), 1, terminal(RecordStatus::Failed, 1))
        .await
        .unwrap();
}

/// R-JRN-5: a sweep removes finished records past their retention, with
/// their events, request and key, and never a running record.
pub async fn sweep_removes_only_expired_finished_records(store: Arc<dyn JournalStore>) {
    let s = &*store;
    let retention = LIMITS.retention_ms;
    create(s, new_record("running", None, b"{}", 0)).await;
    s.append("running".into(), 1, events(1..=2)).await.unwrap();
    create(s, new_record("early", Some("k"), b"{}", 0)).await;
    s.append("early".into(), 1, events(1..=2)).await.unwrap();
    s.finish("early".into(), 1, terminal(RecordStatus::Completed, 100))
        .await
        .unwrap();
    create(s, new_record("late", None, b"{}", 0)).await;
    s.finish("late".into(), 1, terminal(RecordStatus::Cancelled, 500))
        .await
        .unwrap();

    assert_eq!(s.sweep(99 + retention).await, Ok(0));
    assert_eq!(s.stats().records, 3);
    assert_eq!(s.sweep(100 + retention).await, Ok(1));
    assert_eq!(s.get("early".into(), 0).await, Ok(None));
    assert_eq!(
        s.events("early".into(), 0, 10).await,
        Err(JournalError::NotFound)
    );
    // Its key is free.
    create(s, new_record("again", Some("k"), b"{}", 100 + retention)).await;
    // The end of time still leaves running records.
    assert_eq!(s.sweep(u64::MAX).await, Ok(1));
    assert_eq!(s.sweep(u64::MAX).await, Ok(0));
    assert!(s.get("running".into(), u64::MAX).await.unwrap().is_some());
    assert_eq!(seqs(s, "running").await, vec![1, 2]);
    assert_eq!(s.stats().records, 2);
    assert_eq!(
        s.stats().used_bytes,
        stored_bytes(s, &["running", "again"]).await
    );
}

/// A deleted record is gone whole: its events, request and key, and its
/// watchers see it end.
pub async fn delete_removes_the_record_its_events_request_and_key(store: Arc<dyn JournalStore>) {
    let s = &*store;
    create(s, new_record("r1", Some("k"), b"{}", 0)).await;
    s.append("r1".into(), 1, events(1..=3)).await.unwrap();
    let mut watcher = s.watch("r1".into()).await.unwrap();
    watcher.borrow_and_update();
    let keep = create(s, new_record("r2", None, b"{}", 0)).await;
    s.delete("r1".into()).await.unwrap();
    assert_eq!(s.get("r1".into(), 0).await, Ok(None));
    assert_eq!(
        s.events("r1".into(), 0, 10).await,
        Err(JournalError::NotFound)
    );
    assert!(
        watcher.has_changed().is_err(),
        "the watcher's sender is dropped"
    );
    assert_eq!(s.delete("r1".into()).await, Err(JournalError::NotFound));
    assert_eq!(
        s.append("r1".into(), 1, events([4])).await,
        Err(JournalError::NotFound)
    );
    // The key names nothing now; the id is free.
    create(s, new_record("r3", Some("k"), b"{\"other\":1}", 1)).await;
    let fresh = create(s, new_record("r1", None, b"{}", 1)).await;
    assert_eq!(fresh.last_seq, 0);
    assert_eq!(seqs(s, "r1").await, Vec::<u64>::new());
    assert_eq!(s.stats().records, 3);
    assert_eq!(
        s.stats().used_bytes,
        keep.stored_bytes + stored_bytes(s, &["r1", "r3"]).await
    );
}

/// R-TAKE-1: the scan at start finds every record without a terminal.
pub async fn unfinished_lists_exactly_the_running_records(store: Arc<dyn JournalStore>) {
    let s = &*store;
    assert_eq!(s.unfinished().await, Ok(Vec::new()));
    for id in ["a", "b", "c", "d"] {
        create(s, new_record(id, None, b"{}", 0)).await;
    }
    s.append("b".into(), 1, events(1..=2)).await.unwrap();
    s.raise_epoch("c".into(), 1, "taker".into()).await.unwrap();
    s.finish("d".into(), 1, terminal(RecordStatus::Completed, 1))
        .await
        .unwrap();
    let mut running = s.unfinished().await.unwrap();
    running.sort_by(|x, y| x.id.cmp(&y.id));
    let ids: Vec<&str> = running.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, ["a", "b", "c"]);
    assert_eq!(running[1].last_seq, 2);
    assert_eq!(running[2].epoch, 2);
}

/// R-TAKE-1: a record names the Edge that created it, then the Edge that
/// won its epoch; the owner survives every later write and is listed by
/// the takeover scans.
pub async fn a_record_names_its_owner_and_the_winner_of_its_epoch(store: Arc<dyn JournalStore>) {
    let s = &*store;
    let meta = create(s, new_record("r1", None, b"{}", 0)).await;
    assert_eq!(meta.owner, "edge-a");
    let appended = s.append("r1".into(), 1, events([1])).await.unwrap();
    assert_eq!(appended.owner, "edge-a");
    let raised = s
        .raise_epoch("r1".into(), 1, "edge-b".into())
        .await
        .unwrap();
    assert_eq!(raised.owner, "edge-b");
    let (stored, _) = s.get("r1".into(), 0).await.unwrap().unwrap();
    assert_eq!((stored.owner.as_str(), stored.epoch), ("edge-b", 2));
    let hint = s.unfinished_hint().await.unwrap();
    assert!(
        hint.iter().any(|m| m.id == "r1"),
        "the scan's candidates include it: {hint:?}"
    );
    let listed = s.unfinished().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].owner, "edge-b");
    // A lost race changes nobody's ownership.
    assert!(
        s.raise_epoch("r1".into(), 1, "edge-c".into())
            .await
            .is_err()
    );
    let done = s
        .finish("r1".into(), 2, terminal(RecordStatus::Incomplete, 3))
        .await
        .unwrap();
    assert_eq!(done.owner, "edge-b");
}

fn lease(edge: &str, incarnation: u64) -> EdgeLease {
    EdgeLease {
        edge_id: edge.into(),
        incarnation,
        ttl_ms: 15_000,
        renewed_unix_ms: 1,
    }
}

/// R-TAKE-1: an Edge's lease is replaced only over the revision its writer
/// read, every write makes a greater revision, and reads are of the
/// stored value.
pub async fn a_lease_is_written_only_over_the_revision_its_writer_read(
    store: Arc<dyn JournalStore>,
) {
    let s = &*store;
    assert_eq!(s.lease("edge-a".into()).await, Ok(None));
    assert_eq!(s.leases().await, Ok(Vec::new()));
    let first = s.put_lease(lease("edge-a", 1), 0).await.unwrap();
    assert!(first > 0);
    assert!(
        matches!(
            s.put_lease(lease("edge-a", 2), 0).await,
            Err(JournalError::Fenced { current, writer: 0 }) if current == first
        ),
        "a second writer that read no lease is refused"
    );
    let second = s.put_lease(lease("edge-a", 1), first).await.unwrap();
    assert!(second > first, "{second} after {first}");
    let other = s.put_lease(lease("edge-b", 9), 0).await.unwrap();
    let read = s.lease("edge-a".into()).await.unwrap().unwrap();
    assert_eq!((read.revision, read.lease.incarnation), (second, 1));
    let mut all = s.leases().await.unwrap();
    all.sort_by(|x, y| x.lease.edge_id.cmp(&y.lease.edge_id));
    let ids: Vec<(&str, u64)> = all
        .iter()
        .map(|l| (l.lease.edge_id.as_str(), l.revision))
        .collect();
    assert_eq!(ids, [("edge-a", second), ("edge-b", other)]);
    assert!(
        s.put_lease(lease("edge-a", 1), first).await.is_err(),
        "an old revision is refused"
    );
}

fn held(store: &dyn JournalStore, subject: Subject) -> (u64, u64) {
    let Held {
        journal_bytes,
        background,
    } = store.held(&subject);
    (journal_bytes, background)
}

fn key(id: &str) -> Subject {
    Subject::Key(id.into())
}

fn principal(name: &str) -> Subject {
    Subject::Principal(name.into())
}

/// R-TEN-1: what a key and its principal hold in the journal, as the
/// store's own view counts it at once: a record's bytes from its create,
/// growing with its appends, one background response until its terminal,
/// and nothing once it is deleted or swept. Another principal's records
/// never count.
pub async fn held_gauges_follow_every_record_of_a_key_and_its_principal(
    store: Arc<dyn JournalStore>,
) {
    let s = &*store;
    assert_eq!(held(s, key(KEY_ID)), (0, 0));
    let mut bg = new_record("bg", None, b"{}", 0);
    bg.background = true;
    let bg = create(s, bg).await;
    assert_eq!(held(s, key(KEY_ID)), (bg.stored_bytes, 1));
    assert_eq!(held(s, principal(PRINCIPAL)), (bg.stored_bytes, 1));
    let mut other_key = new_record("fg", None, b"{\"x\":1}", 0);
    other_key.key_id = "key-b".into();
    let fg = create(s, other_key).await;
    let mut stranger = new_record("stranger", None, b"{}", 0);
    stranger.principal = "principal-b".into();
    stranger.key_id = "key-c".into();
    stranger.background = true;
    let stranger = create(s, stranger).await;
    assert_eq!(held(s, key("key-b")), (fg.stored_bytes, 0));
    assert_eq!(
        held(s, principal(PRINCIPAL)),
        (bg.stored_bytes + fg.stored_bytes, 1)
    );
    assert_eq!(
        held(s, principal("principal-b")),
        (stranger.stored_bytes, 1)
    );

    let grown = s.append("bg".into(), 1, events(1..=3)).await.unwrap();
    assert!(grown.stored_bytes > bg.stored_bytes);
    assert_eq!(held(s, key(KEY_ID)), (grown.stored_bytes, 1));
    let ended = s
        .finish("bg".into(), 1, terminal(RecordStatus::Completed, 10))
        .await
        .unwrap();
    assert_eq!(
        held(s, key(KEY_ID)),
        (ended.stored_bytes, 0),
        "a terminal ends the background response, its bytes stay"
    );
    assert_eq!(
        held(s, principal(PRINCIPAL)),
        (ended.stored_bytes + fg.stored_bytes, 0)
    );

    s.delete("fg".into()).await.unwrap();
    assert_eq!(held(s, key("key-b")), (0, 0));
    assert_eq!(held(s, principal(PRINCIPAL)), (ended.stored_bytes, 0));
    assert_eq!(s.sweep(10 + LIMITS.retention_ms).await, Ok(1));
    assert_eq!(held(s, key(KEY_ID)), (0, 0));
    assert_eq!(held(s, principal(PRINCIPAL)), (0, 0));
    assert_eq!(
        held(s, principal("principal-b")),
        (stranger.stored_bytes, 1),
        "another principal's record is untouched"
    );
}
