//! Appends per second against a local nats-server, for 1 and 64
//! concurrent writers (each its own response). It prints the numbers and
//! asserts only that every append landed: timings are the machine's.

mod support;

use std::sync::Arc;
use std::time::Instant;

use iop_core::journal::{CreateOutcome, JournalEvent, JournalLimits};
use iop_store::JournalStore;
use iop_store_nats::NatsStore;

const LIMITS: JournalLimits = JournalLimits {
    retention_ms: 60_000,
    max_bytes: 256 * 1024 * 1024,
    max_record_bytes: 16 * 1024 * 1024,
};

async fn run(store: Arc<NatsStore>, writers: usize, appends: u64, events_per_append: u64) -> f64 {
    for w in 0..writers {
        let record = support::record(&format!("w{writers}-{events_per_append}-{w}"), b"{}");
        assert!(matches!(
            store.create(record).await,
            Ok(CreateOutcome::Create(_))
        ));
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("w{writers}-{events_per_append}-{w}");
            let mut seq = 1;
            for _ in 0..appends {
                let batch: Vec<JournalEvent> = (0..events_per_append)
                    .map(|i| JournalEvent {
                        seq: seq + i,
                        payload: vec![b'x'; 64],
                    })
                    .collect();
                seq += events_per_append;
                store.append(id.clone(), 1, batch).await.expect("append");
            }
        }));
    }
    for t in tasks {
        t.await.expect("writer");
    }
    let elapsed = started.elapsed().as_secs_f64();
    for w in 0..writers {
        let id = format!("w{writers}-{events_per_append}-{w}");
        let n = store.events(id, 0, usize::MAX).await.expect("events").len() as u64;
        assert_eq!(n, appends * events_per_append);
    }
    (writers as u64 * appends) as f64 / elapsed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_per_second_for_1_and_64_writers() {
    let Some(server) = support::NatsServer::start() else {
        return;
    };
    let store = Arc::new(
        NatsStore::connect(support::options(&server.url(), "bench", LIMITS))
            .await
            .expect("connect"),
    );
    let one = run(store.clone(), 1, 1000, 1).await;
    let many = run(store.clone(), 64, 50, 1).await;
    let batched = run(store.clone(), 64, 50, 16).await;
    println!(
        "nats journal appends/s: 1 writer {one:.0}; 64 writers {many:.0}; 64 writers x 16 events/append {batched:.0} ({:.0} events/s)",
        batched * 16.0
    );
}
