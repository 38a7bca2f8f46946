//! Appends and syncs per second of the embedded store, for 1 and 64
//! concurrent writers (R-JRN-1: group commit turns many appends into one
//! sync).
//!
//! ```text
//! cargo run --release -p iop-store --example embedded_bench [-- DIR]
//! ```
//!
//! Each writer owns one response and appends one event (a 200-byte delta)
//! at a time, waiting for each to be durable, as the Edge does before it
//! publishes a delta. Bounded by counts; DIR (default: the system's
//! temporary directory) should be on the disk the store will use.

use std::sync::Arc;
use std::time::Instant;

use iop_core::journal::{JournalApi, JournalEvent, JournalLimits, NewRecord, fingerprint};
use iop_store::{EmbeddedStore, JournalStore};

const PAYLOAD_BYTES: usize = 200;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let base = std::env::args_os()
        .nth(1)
        .map_or_else(std::env::temp_dir, Into::into);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!("writers  appends  seconds  appends/s  syncs/s  appends/sync");
    for (writers, per_writer) in [(1usize, 5000u64), (64, 300)] {
        let dir = tempfile::tempdir_in(&base)?;
        let store = Arc::new(EmbeddedStore::open(
            &dir.path().join("bench.redb"),
            JournalLimits::default(),
        )?);
        rt.block_on(run(store, writers, per_writer))?;
    }
    Ok(())
}

async fn run(
    store: Arc<EmbeddedStore>,
    writers: usize,
    per_writer: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    for w in 0..writers {
        let id = format!("bench-{w}");
        store
            .create(NewRecord {
                id: id.clone(),
                principal: "bench".into(),
                api: JournalApi::Responses,
                model: "m".into(),
                fingerprint: fingerprint("/v1/responses", id.as_bytes()),
                idempotency_key: None,
                background: false,
                request: vec![b'r'; 512],
                created_unix_ms: 0,
                owner: "edge".into(),
                key_id: "key".into(),
            })
            .await?;
    }
    let before = store.stats();
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..writers {
        let store = store.clone();
        tasks.spawn(async move {
            let id = format!("bench-{w}");
            for seq in 1..=per_writer {
                let event = JournalEvent {
                    seq,
                    payload: vec![b'd'; PAYLOAD_BYTES],
                };
                store.append(id.clone(), 1, vec![event]).await?;
            }
            Ok::<_, iop_store::JournalError>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let seconds = started.elapsed().as_secs_f64();
    let after = store.stats();
    let appends = writers as u64 * per_writer;
    let syncs = after.syncs - before.syncs;
    println!(
        "{writers:>7}  {appends:>7}  {seconds:>7.2}  {:>9.0}  {:>7.0}  {:>12.1}",
        appends as f64 / seconds,
        syncs as f64 / seconds,
        appends as f64 / syncs.max(1) as f64,
    );
    Ok(())
}
