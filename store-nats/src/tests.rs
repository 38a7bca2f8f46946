//! Tests that need the store's insides: a writer paused between its
//! publish and its commit (the zombie of a takeover race).

use std::sync::Mutex;

use tokio::sync::oneshot;

/// A pause armed by a test.
pub(crate) struct Pause {
    /// Told when the writer reached the pause.
    pub(crate) reached: oneshot::Sender<()>,
    /// Waited for before the writer goes on.
    pub(crate) resume: oneshot::Receiver<()>,
}

/// Points where a test can hold a writer.
#[derive(Default)]
pub(crate) struct Hooks {
    /// An append that published its events, before its record commit.
    pub(crate) before_commit: Mutex<Option<Pause>>,
}

impl Hooks {
    pub(crate) async fn before_commit(&self) {
        let pause = self
            .before_commit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(p) = pause {
            let _ = p.reached.send(());
            let _ = p.resume.await;
        }
    }
}

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;

use async_nats::jetstream::stream::DirectGetErrorKind;
use iop_core::journal::{
    CreateOutcome, JournalError, JournalEvent, JournalLimits, RecordStatus, Terminal,
};
use iop_store::JournalStore;

use crate::NatsStore;
use crate::layout::token;
use support::{NatsServer, WAIT, options};

const LIMITS: JournalLimits = JournalLimits {
    retention_ms: 60_000,
    max_bytes: 64 * 1024 * 1024,
    max_record_bytes: 1024 * 1024,
};

fn event(seq: u64, who: &str) -> JournalEvent {
    JournalEvent {
        seq,
        payload: format!("{who} {seq}").into_bytes(),
    }
}

fn events(seqs: std::ops::RangeInclusive<u64>) -> Vec<JournalEvent> {
    seqs.map(|s| event(s, "owner")).collect()
}

async fn edge(server: &NatsServer) -> Arc<NatsStore> {
    Arc::new(
        NatsStore::connect(options(&server.url(), "zombie", LIMITS))
            .await
            .unwrap_or_else(|e| panic!("connect: {e}")),
    )
}

async fn create(store: &NatsStore, id: &str) {
    let record = support::record(id, b"{}");
    assert!(matches!(
        store.create(record).await,
        Ok(CreateOutcome::Create(_))
    ));
}

/// Hold `store`'s next append between its publish and its commit.
fn hold(store: &NatsStore) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
    let (reached, reached_rx) = oneshot::channel();
    let (resume_tx, resume) = oneshot::channel();
    *store
        .inner
        .hooks
        .before_commit
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(Pause { reached, resume });
    (reached_rx, resume_tx)
}

/// The stream sequences of the messages on a response's events subject.
async fn messages(store: &NatsStore, id: &str) -> Vec<u64> {
    let subject = store.inner.names.events_subject(&token(id));
    let mut seqs = Vec::new();
    let mut from = 1;
    loop {
        match store
            .inner
            .events
            .direct_get_next_for_subject(&subject, Some(from))
            .await
        {
            Ok(m) => {
                seqs.push(m.sequence);
                from = m.sequence + 1;
            }
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => return seqs,
            Err(e) => panic!("reading {subject}: {e}"),
        }
    }
}

async fn read(store: &NatsStore, id: &str) -> Vec<JournalEvent> {
    store.events(id.into(), 0, usize::MAX).await.unwrap()
}

/// R-JRN-3: a zombie writer publishes its append, a takeover raises the
/// epoch before the zombie commits. Its event is on the stream but never
/// read, the new owner appends after it (the orphan removed), and the
/// zombie's commit is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_append_racing_a_takeover_never_shows_and_the_new_owner_appends_after_it() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let zombie = edge(&server).await;
    let owner = edge(&server).await;
    create(&zombie, "r1").await;
    zombie.append("r1".into(), 1, events(1..=3)).await.unwrap();

    let (reached, resume) = hold(&zombie);
    let z = {
        let zombie = zombie.clone();
        tokio::spawn(async move {
            zombie
                .append("r1".into(), 1, vec![event(4, "zombie")])
                .await
        })
    };
    tokio::time::timeout(WAIT, reached)
        .await
        .expect("the zombie publishes")
        .expect("hook");
    assert_eq!(
        messages(&owner, "r1").await.len(),
        2,
        "the zombie's append is on the stream"
    );
    owner
        .raise_epoch("r1".into(), 1, "taker".into())
        .await
        .unwrap();
    for store in [&owner, &zombie] {
        assert_eq!(
            read(store, "r1").await,
            events(1..=3),
            "the orphan is never read"
        );
    }
    owner.append("r1".into(), 2, events(4..=4)).await.unwrap();
    let _ = resume.send(());
    assert_eq!(
        z.await.unwrap(),
        Err(JournalError::Fenced {
            current: 2,
            writer: 1
        })
    );
    for store in [&owner, &zombie] {
        assert_eq!(read(store, "r1").await, events(1..=4));
    }
    assert_eq!(
        messages(&owner, "r1").await.len(),
        2,
        "the orphan was removed"
    );
    let terminal = Terminal {
        status: RecordStatus::Completed,
        reason: None,
        message: None,
        at_unix_ms: 3,
    };
    assert!(matches!(
        zombie.finish("r1".into(), 1, terminal.clone()).await,
        Err(JournalError::Fenced { .. })
    ));
    owner.finish("r1".into(), 2, terminal).await.unwrap();

    // The zombie goes on before the new owner appends: its commit is
    // fenced, its orphan stays unread until the owner's append removes it.
    create(&zombie, "r2").await;
    zombie.append("r2".into(), 1, events(1..=2)).await.unwrap();
    let (reached, resume) = hold(&zombie);
    let z = {
        let zombie = zombie.clone();
        tokio::spawn(async move {
            zombie
                .append("r2".into(), 1, vec![event(3, "zombie")])
                .await
        })
    };
    tokio::time::timeout(WAIT, reached).await.unwrap().unwrap();
    owner
        .raise_epoch("r2".into(), 1, "taker".into())
        .await
        .unwrap();
    let _ = resume.send(());
    assert!(matches!(
        z.await.unwrap(),
        Err(JournalError::Fenced { current: 2, .. })
    ));
    assert_eq!(messages(&owner, "r2").await.len(), 2);
    assert_eq!(read(&owner, "r2").await, events(1..=2));
    owner.append("r2".into(), 2, events(3..=4)).await.unwrap();
    assert_eq!(read(&zombie, "r2").await, events(1..=4));
    assert_eq!(messages(&owner, "r2").await.len(), 2);
}

/// A writer that dies between its publish and its commit leaves a message
/// decided on the record as it still stands: the next append fences it
/// (rewrites the record) and goes after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_died_before_its_commit_does_not_block_the_next_append() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let store = edge(&server).await;
    create(&store, "r1").await;
    store.append("r1".into(), 1, events(1..=1)).await.unwrap();
    let (reached, _resume) = hold(&store);
    let dying = {
        let store = store.clone();
        tokio::spawn(async move { store.append("r1".into(), 1, vec![event(2, "lost")]).await })
    };
    tokio::time::timeout(WAIT, reached).await.unwrap().unwrap();
    dying.abort();
    let _ = dying.await;
    assert_eq!(read(&store, "r1").await, events(1..=1));
    // A fresh Edge (nothing cached) and the same one both go on.
    let other = edge(&server).await;
    other.append("r1".into(), 1, events(2..=2)).await.unwrap();
    store.append("r1".into(), 1, events(3..=3)).await.unwrap();
    assert_eq!(read(&store, "r1").await, events(1..=3));
    assert_eq!(messages(&store, "r1").await.len(), 3);
}

/// A writer that died between its publish and its commit, on a record no
/// later writer appends to (its terminal written by another, R-JRN-3),
/// leaves an orphan after the record's end: removing the record purges it
/// too, so orphans do not creep the stream toward full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_records_orphaned_appends_are_purged_with_it() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    let store = edge(&server).await;
    create(&store, "r1").await;
    store.append("r1".into(), 1, events(1..=2)).await.unwrap();
    let (reached, _resume) = hold(&store);
    let dying = {
        let store = store.clone();
        tokio::spawn(async move { store.append("r1".into(), 1, vec![event(3, "lost")]).await })
    };
    tokio::time::timeout(WAIT, reached).await.unwrap().unwrap();
    dying.abort();
    let _ = dying.await;
    // Taken over and ended by another writer: nobody appends again.
    let other = edge(&server).await;
    other
        .raise_epoch("r1".into(), 1, "taker".into())
        .await
        .unwrap();
    let terminal = Terminal {
        status: RecordStatus::Incomplete,
        reason: Some("edge_lost".into()),
        message: None,
        at_unix_ms: 5,
    };
    other.finish("r1".into(), 2, terminal).await.unwrap();
    assert_eq!(
        messages(&store, "r1").await.len(),
        2,
        "one append, one orphan"
    );
    assert_eq!(read(&store, "r1").await, events(1..=2));
    other.delete("r1".into()).await.unwrap();
    assert!(
        messages(&store, "r1").await.is_empty(),
        "the orphan went with its record"
    );
    assert_eq!(
        other
            .inner
            .orphans_purged
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "the orphan (its committed append went with the record as before)"
    );
}
