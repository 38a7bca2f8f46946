//! Crash safety of the embedded store with a real process (R-JRN-1,
//! R-JRN-2, R-JRN-4, R-JRN-5).
//!
//! The test re-runs its own binary as a child that opens a store file and
//! appends to several responses as fast as it can, printing each
//! acknowledged append. The parent kills it with SIGKILL once it has read a
//! number of acknowledgements, several times, and after each kill opens the
//! file and checks that everything acknowledged is there and every
//! invariant holds. Bounded by counts, never by timing.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use iop_core::journal::{
    JournalApi, JournalError, JournalEvent, JournalLimits, NewRecord, RecordMeta, RecordStatus,
    Terminal, fingerprint,
};
use iop_store::{EmbeddedStore, JournalStore};

/// Set (to the store's path) in the child's environment.
const CHILD_ENV: &str = "IOP_STORE_CRASH_CHILD";
/// Which round the child runs (its new records' ids carry it).
const ROUND_ENV: &str = "IOP_STORE_CRASH_ROUND";
const CHILD_TEST: &str = "crash_child_appends_until_killed";

const ROUNDS: usize = 8;
/// Acknowledged appends the parent reads before it kills the child.
const ACKS_BEFORE_KILL: usize = 1000;
const WORKERS: usize = 4;
/// Events a response gets before its terminal.
const EVENTS_PER_RECORD: u64 = 40;
/// The child stops by itself after this many events (a parent that died
/// leaves no writer behind for long).
const CHILD_MAX_EVENTS: u64 = 200_000;

const LIMITS: JournalLimits = JournalLimits {
    retention_ms: 60 * 60 * 1000,
    max_bytes: 1 << 30,
    max_record_bytes: 1 << 20,
};

fn payload(id: &str, seq: u64) -> Vec<u8> {
    format!("{id}/{seq}").into_bytes()
}

fn new_record(id: &str) -> NewRecord {
    NewRecord {
        id: id.into(),
        principal: "crash".into(),
        api: JournalApi::Responses,
        model: "m".into(),
        fingerprint: fingerprint("/v1/responses", id.as_bytes()),
        idempotency_key: None,
        background: false,
        request: id.as_bytes().to_vec(),
        created_unix_ms: 0,
        owner: "edge".into(),
        key_id: "key".into(),
    }
}

/// One line to the parent, flushed: printed means acknowledged. A parent
/// that stopped reading ends the child.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
        std::process::exit(1);
    }
}

#[test]
#[ignore = "the child process of embedded_store_keeps_every_acknowledged_append_across_sigkill"]
fn crash_child_appends_until_killed() {
    let Some(path) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let round: usize = std::env::var(ROUND_ENV)
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(child(PathBuf::from(path), round));
}

async fn child(path: PathBuf, round: usize) {
    let store = Arc::new(EmbeddedStore::open(&path, LIMITS).unwrap());
    say("\n@start");
    // Take over what a killed predecessor left running (R-TAKE-1).
    let inherited = store.unfinished().await.unwrap();
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..WORKERS {
        let mine: Vec<RecordMeta> = inherited.iter().skip(w).step_by(WORKERS).cloned().collect();
        workers.spawn(worker(store.clone(), round, w, mine));
    }
    while let Some(done) = workers.join_next().await {
        done.unwrap();
    }
}

async fn worker(store: Arc<EmbeddedStore>, round: usize, w: usize, inherited: Vec<RecordMeta>) {
    let mut budget = CHILD_MAX_EVENTS / WORKERS as u64;
    let mut queue = VecDeque::new();
    for meta in inherited {
        let taken = store
            .raise_epoch(meta.id.clone(), meta.epoch, "taker".into())
            .await
            .unwrap();
        say(&format!("@take {} {}", taken.id, taken.epoch));
        queue.push_back((taken.id, taken.epoch, taken.last_seq + 1));
    }
    let mut n = 0;
    loop {
        let (id, epoch, mut next) = match queue.pop_front() {
            Some(inherited) => inherited,
            None => {
                let id = format!("c{round}-w{w}-{n}");
                n += 1;
                store.create(new_record(&id)).await.unwrap();
                say(&format!("@new {id}"));
                (id, 1, 1)
            }
        };
        while next <= EVENTS_PER_RECORD {
            let count = (1 + next % 3).min(EVENTS_PER_RECORD + 1 - next);
            let events = (next..next + count)
                .map(|seq| JournalEvent {
                    seq,
                    payload: payload(&id, seq),
                })
                .collect();
            let meta = store.append(id.clone(), epoch, events).await.unwrap();
            say(&format!("@ack {id} {}", meta.last_seq));
            next = meta.last_seq + 1;
            budget = budget.saturating_sub(count);
            if budget == 0 {
                return;
            }
        }
        let terminal = Terminal {
            status: RecordStatus::Completed,
            reason: None,
            message: None,
            at_unix_ms: 1,
        };
        let done = store.finish(id.clone(), epoch, terminal).await.unwrap();
        say(&format!("@end {id} {}", done.last_seq));
        // R-JRN-4: nothing after the terminal.
        let after = JournalEvent {
            seq: next,
            payload: payload(&id, next),
        };
        match store.append(id.clone(), epoch, vec![after]).await {
            Err(JournalError::Terminated) => {}
            other => say(&format!("@bad {id} appended after its terminal: {other:?}")),
        }
    }
}

/// What the parent has read from its children.
#[derive(Default)]
struct Acknowledged {
    /// The highest acknowledged event per record.
    events: HashMap<String, u64>,
    /// Records whose terminal was acknowledged, with their last event.
    ended: HashMap<String, u64>,
    bad: Vec<String>,
    takeovers: usize,
}

impl Acknowledged {
    /// Take one line; true if it acknowledged an append.
    fn read(&mut self, line: &str) -> bool {
        let Some(at) = line.find('@') else {
            return false;
        };
        let mut words = line[at..].split_whitespace();
        let kind = words.next().unwrap_or_default();
        let id = words.next().unwrap_or_default().to_owned();
        let number: u64 = words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
        match kind {
            "@ack" => {
                let seq = self.events.entry(id).or_default();
                assert!(number > *seq, "acknowledgements go up: {line}");
                *seq = number;
                return true;
            }
            "@end" => {
                self.ended.insert(id, number);
            }
            "@take" => self.takeovers += 1,
            "@bad" => self.bad.push(line.to_owned()),
            _ => {}
        }
        false
    }
}

#[test]
fn embedded_store_keeps_every_acknowledged_append_across_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.redb");
    let exe = std::env::current_exe().unwrap();
    let mut acked = Acknowledged::default();
    for round in 0..ROUNDS {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                CHILD_TEST,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
                "-q",
            ])
            .env(CHILD_ENV, &path)
            .env(ROUND_ENV, round.to_string())
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut acks = 0;
        while acks < ACKS_BEFORE_KILL {
            match lines.next() {
                Some(Ok(line)) => acks += usize::from(acked.read(&line)),
                _ => break,
            }
        }
        // SIGKILL: no destructor, no flush, no clean shutdown.
        child.kill().unwrap();
        child.wait().unwrap();
        // What it printed before it died was acknowledged too.
        for line in lines.map_while(Result::ok) {
            acked.read(&line);
        }
        assert_eq!(
            acks, ACKS_BEFORE_KILL,
            "round {round}: the child ended after {acks} acknowledgements"
        );
        check_after_crash(&path, &acked, round);
    }
    assert!(acked.bad.is_empty(), "{:#?}", acked.bad);
    assert!(acked.ended.len() >= ROUNDS, "records ran to their terminal");
    eprintln!(
        "{ROUNDS} kills: {} records acknowledged, {} ended, {} taken over",
        acked.events.len(),
        acked.ended.len(),
        acked.takeovers
    );
}

/// Open the file a killed writer left and check it.
fn check_after_crash(path: &Path, acked: &Acknowledged, round: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = match EmbeddedStore::open(path, LIMITS) {
            Ok(store) => store,
            Err(e) => panic!("round {round}: the file does not open after SIGKILL: {e}"),
        };
        // Every record's events are exactly 1..=last_seq (none past a
        // terminal), used_bytes is the sum over records, keys and index
        // agree.
        let report = store.verify().await.unwrap();
        assert!(
            report.problems.is_empty(),
            "round {round}: {:#?}",
            report.problems
        );
        assert_eq!(report.used_bytes, store.stats().used_bytes);
        for (id, &seq) in &acked.events {
            let Some((meta, _)) = store.get(id.clone(), 0).await.unwrap() else {
                panic!("round {round}: {id} was acknowledged and is gone");
            };
            assert!(
                meta.last_seq >= seq,
                "round {round}: {id} acknowledged up to {seq}, holds {}",
                meta.last_seq
            );
            let events = store.events(id.clone(), 0, usize::MAX).await.unwrap();
            assert_eq!(events.len() as u64, meta.last_seq);
            for (i, event) in events.iter().enumerate() {
                assert_eq!(event.seq, i as u64 + 1);
                assert_eq!(event.payload, payload(id, event.seq), "{id} {}", event.seq);
            }
        }
        for (id, &last) in &acked.ended {
            let (meta, _) = store.get(id.clone(), 0).await.unwrap().unwrap();
            assert!(
                meta.terminal.is_some(),
                "round {round}: {id} lost its terminal"
            );
            assert_eq!(
                meta.last_seq, last,
                "round {round}: {id} grew past its terminal"
            );
        }
        let unfinished = store.unfinished().await.unwrap();
        assert!(unfinished.iter().all(|m| !acked.ended.contains_key(&m.id)));
    });
}
