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

/// Counts the bytes this test process has allocated and not freed.
struct Counting;

static LIVE_BYTES: std::sync::atomic::AtomicIsize = std::sync::atomic::AtomicIsize::new(0);

// A counting wrapper around the system allocator: the one way to see what
// a structure holds, without what was allocated and freed meanwhile.
#[allow(unsafe_code)]
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: the caller's layout, passed on unchanged.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes allocated and not freed.
fn live_bytes() -> i64 {
    LIVE_BYTES.load(std::sync::atomic::Ordering::Relaxed) as i64
}

/// What a store's directory costs per finished record it loads: 20,000
/// finished responses written, then a second store connects and loads
/// them; the bytes it holds once loaded (counted by the allocator) over
/// the record count. Prints the number (docs/benchmarks.md); asserts only
/// that every record loaded.
/// `cargo test -p iop-store-nats --test throughput -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: 20,000 records, about a minute"]
async fn directory_memory_per_finished_record() {
    const RECORDS: usize = 20_000;
    let Some(server) = support::NatsServer::start() else {
        return;
    };
    let mut o = support::options(&server.url(), "memory", LIMITS);
    o.stream_max_bytes = 1 << 30;
    o.bucket_max_bytes = 512 << 20;
    o.stream_reserve_bytes = 64 << 20;
    o.bucket_reserve_bytes = 64 << 20;
    let writer = Arc::new(NatsStore::connect(o.clone()).await.unwrap());
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (writer, next) = (writer.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= RECORDS {
                    return;
                }
                let id = format!("resp_{i:016x}");
                let mut record = support::record(&id, &[b'x'; 600]);
                record.principal = "team-a".into();
                record.key_id = "team-a-key-1".into();
                record.model = "llama-3.1-70b-instruct".into();
                record.idempotency_key = Some([7; 32]).filter(|_| i % 2 == 0).map(|mut k| {
                    k[..8].copy_from_slice(&(i as u64).to_be_bytes());
                    k
                });
                writer.create(record).await.unwrap();
                let terminal = iop_core::journal::Terminal {
                    status: iop_core::journal::RecordStatus::Failed,
                    reason: Some("provider_error_http_429".into()),
                    message: Some(
                        "Rate limit reached for requests; please retry after 20s.".repeat(3),
                    ),
                    at_unix_ms: 1,
                };
                writer.finish(id, 1, terminal).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let before = live_bytes();
    let reader = NatsStore::connect(o).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let after = live_bytes();
    assert_eq!(reader.stats().records, RECORDS as u64);
    let held = (after - before).max(0) as f64;
    println!(
        "directory: {RECORDS} finished records loaded, {:.1} MiB held, {:.0} bytes a record",
        held / (1024.0 * 1024.0),
        held / RECORDS as f64
    );
}
