//! What the journal store costs one non-streamed durable response, per
//! write pattern: the store's operations a response makes, timed from its
//! `create` to its durable terminal, on the embedded store (a redb file on
//! the disk the Edge would use: the system's temporary directory, or
//! `IOP_BENCH_JOURNAL_DIR`) and on the memory store (no file, no fsync) as
//! the baseline of the same run.
//!
//! * `today`: what a non-streamed durable chat completion of 8 tokens does
//!   now (the scenario `durable` of `iop-bench suite` counts it: 2 appends
//!   per response): `create`, `append` of the first delta, `append` of the
//!   other 7, `finish`, each awaited before the next is sent, so four
//!   commits one after the other;
//! * `terminal_with_last_events`: the same, but the last append and the
//!   terminal go to the writer together (three commits);
//! * `one_commit`: create, every event and the terminal go to the writer
//!   together (one commit).
//!
//! The last two are not what the Edge does: they show what a change of the
//! write pattern would save, with the store as it is (the embedded store
//! queues an operation when it is called, so operations sent together
//! share a transaction and its fsync). Each pattern runs with 1 and with 8
//! responses at a time (group commit across responses). Prints a markdown
//! table. Run: `cargo bench -p iop-bench --bench journal`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use iop_core::edge::durable::encode_delivery;
use iop_core::edge::request::Delivery;
use iop_core::journal::{
    JournalApi, JournalEvent, JournalLimits, NewRecord, RecordStatus, Terminal, fingerprint,
    idempotency_hash,
};
use iop_store::{EmbeddedStore, JournalStore, MemoryStore};
use iop_wire::RunEventKind;

/// Responses timed per pattern and concurrency.
const RESPONSES: usize = 400;
/// Text deltas per response (the latency scenario's mock answers 8).
const TOKENS: u32 = 8;
/// Responses in flight at a time.
const CONCURRENCIES: [usize; 2] = [1, 8];
/// The bound of one response (a stuck store ends the bench, not hangs it).
const RESPONSE_BOUND: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pattern {
    Today,
    TerminalWithLastEvents,
    OneCommit,
}

impl Pattern {
    const ALL: [Pattern; 3] = [
        Pattern::Today,
        Pattern::TerminalWithLastEvents,
        Pattern::OneCommit,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Pattern::Today => "today (4 commits in sequence)",
            Pattern::TerminalWithLastEvents => "terminal_with_last_events (3)",
            Pattern::OneCommit => "one_commit (1)",
        }
    }
}

fn record(id: &str) -> NewRecord {
    let body = br#"{"model":"short","messages":[{"role":"user","content":"hello"}]}"#;
    NewRecord {
        id: id.to_owned(),
        principal: "bench".into(),
        api: JournalApi::ChatCompletions,
        model: "short".into(),
        fingerprint: fingerprint("chat", body),
        idempotency_key: Some(idempotency_hash("bench", id)),
        background: false,
        request: body.to_vec(),
        created_unix_ms: iop_transport::clock::unix_ms(),
        owner: "bench".into(),
        key_id: "bench".into(),
    }
}

fn events(from_seq: u64, tokens: std::ops::Range<u32>) -> Vec<JournalEvent> {
    tokens
        .enumerate()
        .map(|(k, i)| JournalEvent {
            seq: from_seq + k as u64,
            payload: encode_delivery(&Delivery::Event(RunEventKind::TextDelta(
                iop_node::mock::token_text(i),
            ))),
        })
        .collect()
}

fn completed() -> Terminal {
    Terminal {
        status: RecordStatus::Completed,
        reason: None,
        message: None,
        at_unix_ms: iop_transport::clock::unix_ms(),
    }
}

/// One response's operations in `pattern`; panics on a refusal (the bench
/// writes only valid sequences).
async fn respond(store: &dyn JournalStore, id: String, pattern: Pattern) {
    let epoch = 1;
    match pattern {
        Pattern::Today => {
            store.create(record(&id)).await.expect("create");
            store
                .append(id.clone(), epoch, events(1, 0..1))
                .await
                .expect("append");
            store
                .append(id.clone(), epoch, events(2, 1..TOKENS))
                .await
                .expect("append");
            store.finish(id, epoch, completed()).await.expect("finish");
        }
        Pattern::TerminalWithLastEvents => {
            store.create(record(&id)).await.expect("create");
            store
                .append(id.clone(), epoch, events(1, 0..1))
                .await
                .expect("append");
            let last = store.append(id.clone(), epoch, events(2, 1..TOKENS));
            let terminal = store.finish(id, epoch, completed());
            last.await.expect("append");
            terminal.await.expect("finish");
        }
        Pattern::OneCommit => {
            let created = store.create(record(&id));
            let appended = store.append(id.clone(), epoch, events(1, 0..TOKENS));
            let terminal = store.finish(id, epoch, completed());
            created.await.expect("create");
            appended.await.expect("append");
            terminal.await.expect("finish");
        }
    }
}

struct Row {
    store: &'static str,
    pattern: Pattern,
    concurrency: usize,
    commits_per_response: Option<f64>,
    /// Per-response latency, µs, sorted.
    latencies_us: Vec<u64>,
}

impl Row {
    fn quantile_ms(&self, q: f64) -> f64 {
        let n = self.latencies_us.len();
        if n == 0 {
            return f64::NAN;
        }
        let i = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
        self.latencies_us[i] as f64 / 1000.0
    }
}

async fn measure(
    name: &'static str,
    store: Arc<dyn JournalStore>,
    pattern: Pattern,
    concurrency: usize,
    run: &str,
) -> Row {
    let syncs_before = store.stats().syncs;
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..concurrency {
        let store = store.clone();
        let run = run.to_owned();
        tasks.spawn(async move {
            let mut out = Vec::with_capacity(RESPONSES / concurrency);
            for i in 0..RESPONSES / concurrency {
                let id = format!("chatcmpl-{run}-{worker}-{i}");
                let started = Instant::now();
                tokio::time::timeout(RESPONSE_BOUND, respond(store.as_ref(), id, pattern))
                    .await
                    .expect("a response within its bound");
                out.push(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
            }
            out
        });
    }
    let mut latencies_us = Vec::with_capacity(RESPONSES);
    while let Some(done) = tasks.join_next().await {
        latencies_us.extend(done.expect("a bench task"));
    }
    latencies_us.sort_unstable();
    let syncs = store.stats().syncs - syncs_before;
    Row {
        store: name,
        pattern,
        concurrency,
        commits_per_response: (name == "embedded")
            .then(|| syncs as f64 / latencies_us.len().max(1) as f64),
        latencies_us,
    }
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = match std::env::var_os("IOP_BENCH_JOURNAL_DIR") {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .expect("a directory for the journal file");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let rows = runtime.block_on(async {
        let embedded: Arc<dyn JournalStore> = Arc::new(
            EmbeddedStore::open(&dir.path().join("journal.redb"), JournalLimits::default())
                .expect("embedded store"),
        );
        let memory: Arc<dyn JournalStore> = Arc::new(MemoryStore::new(JournalLimits::default()));
        let mut rows = Vec::new();
        let mut run = 0u32;
        for concurrency in CONCURRENCIES {
            for pattern in Pattern::ALL {
                for (name, store) in [("embedded", &embedded), ("memory", &memory)] {
                    run += 1;
                    let row =
                        measure(name, store.clone(), pattern, concurrency, &run.to_string()).await;
                    eprintln!(
                        "{name} {} x{concurrency}: p50 {:.3} ms",
                        pattern.as_str(),
                        row.quantile_ms(0.5)
                    );
                    rows.push(row);
                }
            }
        }
        rows
    });
    println!(
        "| store | pattern | responses at a time | commits / response | p50 ms | p90 ms | p99 ms | p50 / today's |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for row in &rows {
        let today = rows
            .iter()
            .find(|r| {
                r.store == row.store
                    && r.concurrency == row.concurrency
                    && r.pattern == Pattern::Today
            })
            .map_or(f64::NAN, |r| r.quantile_ms(0.5));
        println!(
            "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.2} |",
            row.store,
            row.pattern.as_str(),
            row.concurrency,
            row.commits_per_response
                .map_or_else(|| "-".to_owned(), |c| format!("{c:.2}")),
            row.quantile_ms(0.5),
            row.quantile_ms(0.9),
            row.quantile_ms(0.99),
            row.quantile_ms(0.5) / today,
        );
    }
}
