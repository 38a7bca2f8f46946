//! Durable responses at the Edge (SPEC §6): the store, the runs this Edge
//! writes, following a record, and the restart scan.
//!
//! A durable request's run is not tied to its client: its driver
//! ([`crate::driver::spawn_durable`]) writes every delivery to the
//! response's journal through the request machine (publish after durable,
//! R-JRN-1, decided in `iop_core::edge::durable`), and **every reader
//! follows the journal** with a [`Follower`]: the client that sent the
//! request, a client that resumes it (`starting_after`, `Last-Event-ID`),
//! a retry with the same `Idempotency-Key`. So what any client sees is
//! durable, and a resumed stream is the same stream (R-JRN-2): the API's
//! encoder renders the record's events from the first one and the reader
//! skips what it already has.
//!
//! Nothing here decides a journal rule: numbering, fencing, the one
//! terminal, retention and idempotency are `iop_core::journal`'s, applied by
//! the store ([`iop_store::JournalStore`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iop_core::edge::dispatch::ParkedOffer;
use iop_core::edge::durable::{JournalAck, JournalWrite, decode_delivery, decode_entry};
use iop_core::edge::request::Delivery;
use iop_core::journal::{
    CreateOutcome, JournalError, NewRecord, RecordMeta, RecordStatus, Terminal,
};
use iop_store::{EmbeddedStore, JournalStore, MemoryStore, Progress};
use iop_wire::ChatMessage;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use crate::config::{JournalSection, JournalStoreKind};
use crate::metrics::EdgeMetrics;

/// Events read from the store at a time by a follower.
const FOLLOW_BATCH: usize = 256;

/// The closed reason of a record ended at start because the Edge that ran
/// it is gone (R-TAKE-1).
pub const EDGE_RESTART_REASON: &str = "edge_restart";

/// What a durable record keeps of its request: enough to render its
/// answer again (the API's own encoder over the stored events), to list
/// its input and to continue its conversation (`previous_response_id`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredRequest {
    /// The seed of the answer's ids ([`crate::api::ids`]).
    pub id_seed: u64,
    /// When the request was admitted, Unix milliseconds (the answer's
    /// `created` times come from it, so every rendering is the same).
    pub created_unix_ms: u64,
    /// `store` as decided (sent, or the Edge's default).
    pub store: bool,
    /// `background: true` was sent.
    pub background: bool,
    /// The request body as sent.
    pub body: Vec<u8>,
    /// The conversation before this request's own input, without
    /// instructions, when it continues a stored response
    /// (`previous_response_id`).
    pub history: Option<Vec<ChatMessage>>,
}

impl StoredRequest {
    /// The bytes kept in the record.
    pub fn encode(&self) -> Vec<u8> {
        // Plain data: postcard cannot fail on it short of running out of
        // memory.
        let mut out = vec![STORED_REQUEST_FORMAT];
        out.extend(postcard::to_allocvec(self).unwrap_or_default());
        out
    }

    /// Read them back; `None` for bytes this build does not understand.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        match bytes.split_first() {
            Some((&STORED_REQUEST_FORMAT, rest)) => postcard::from_bytes(rest).ok(),
            _ => None,
        }
    }
}

/// The format byte in front of a [`StoredRequest`].
const STORED_REQUEST_FORMAT: u8 = 1;

/// Why a durable response could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The store's file could not be opened or created.
    #[error("journal store {path}: {message}")]
    Store {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        message: String,
    },
}

/// The Edge's durable responses: the store and the runs this process
/// writes.
pub struct Durable {
    store: Arc<dyn JournalStore>,
    metrics: Option<Arc<EdgeMetrics>>,
    responses_store_default: bool,
    park_grace_ms: u64,
    /// The runs this Edge writes, by response id.
    live: Mutex<HashMap<String, mpsc::Sender<LiveCommand>>>,
}

/// What reaches a run this Edge writes.
#[derive(Debug)]
pub enum LiveCommand {
    /// Cancel it.
    Cancel,
    /// Its node reported its run parked (R-PARK-2).
    Parked(iop_core::edge::dispatch::ParkedOffer),
}

impl Durable {
    /// Open the store `section` names; `state_dir` holds its default file.
    pub fn open(
        section: &JournalSection,
        state_dir: &std::path::Path,
        metrics: Arc<EdgeMetrics>,
    ) -> Result<Self, OpenError> {
        let limits = section.limits();
        let store: Arc<dyn JournalStore> = match section.store {
            JournalStoreKind::Memory => Arc::new(MemoryStore::new(limits)),
            JournalStoreKind::Embedded => {
                let path = section.file(state_dir);
                let store = EmbeddedStore::open(&path, limits).map_err(|e| OpenError::Store {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
                Arc::new(store)
            }
        };
        let mut durable = Self::with_store(store, section.responses_store_default);
        durable.metrics = Some(metrics);
        durable.park_grace_ms = section.park_grace_ms;
        durable.publish_stats();
        Ok(durable)
    }

    /// Durable responses on `store`.
    pub fn with_store(store: Arc<dyn JournalStore>, responses_store_default: bool) -> Self {
        Durable {
            store,
            metrics: None,
            responses_store_default,
            park_grace_ms: iop_wire::DEFAULT_PARK_GRACE_MS,
            live: Mutex::new(HashMap::new()),
        }
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn JournalStore> {
        &self.store
    }

    /// How long a durable run may stay parked on its node (R-PARK-1).
    pub fn park_grace_ms(&self) -> u64 {
        self.park_grace_ms
    }

    /// Whether a Responses request without `store` is stored.
    pub fn responses_store_default(&self) -> bool {
        self.responses_store_default
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, mpsc::Sender<LiveCommand>>> {
        // The map's entries are inserted and removed whole: a panic while
        // holding the lock leaves it consistent.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Register the run of `response_id` as written by this Edge: its
    /// cancel receiver, and a guard that unregisters it when the run ends.
    pub fn register(self: &Arc<Self>, response_id: &str) -> (LiveRun, mpsc::Receiver<LiveCommand>) {
        let (tx, rx) = mpsc::channel(8);
        self.live().insert(response_id.to_owned(), tx);
        (
            LiveRun {
                durable: self.clone(),
                response_id: response_id.to_owned(),
            },
            rx,
        )
    }

    /// Ask the run of `response_id` to cancel; false if this Edge does not
    /// run it.
    pub fn cancel(&self, response_id: &str) -> bool {
        match self.live().get(response_id) {
            Some(tx) => {
                // A full channel already carries a cancel.
                let _ = tx.try_send(LiveCommand::Cancel);
                true
            }
            None => false,
        }
    }

    /// Whether this Edge runs `response_id` now.
    pub fn is_live(&self, response_id: &str) -> bool {
        self.live().contains_key(response_id)
    }

    /// Count one store operation and publish the store's size.
    fn observe<T>(
        &self,
        op: &'static str,
        started: std::time::Instant,
        result: &Result<T, JournalError>,
    ) {
        if let Some(metrics) = &self.metrics {
            metrics.journal_write(op, result.as_ref().map(|_| ()), started.elapsed());
        }
        self.publish_stats();
    }

    fn publish_stats(&self) {
        if let Some(metrics) = &self.metrics {
            let stats = self.store.stats();
            let gauges = &metrics.gauges;
            gauges
                .journal_records
                .store(stats.records, std::sync::atomic::Ordering::Relaxed);
            gauges
                .journal_bytes
                .store(stats.used_bytes, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Create a record (or find the one its idempotency key names).
    pub async fn create(&self, record: NewRecord) -> Result<CreateOutcome, JournalError> {
        let started = std::time::Instant::now();
        let result = self.store.create(record).await;
        self.observe("create", started, &result);
        result
    }

    /// Carry out one journal write of a run (a [`JournalWrite`] from its
    /// request machine): the store's answer, for
    /// [`iop_core::edge::request::RequestInput::Journaled`].
    pub async fn write(self: Arc<Self>, write: JournalWrite) -> JournalAck {
        let started = std::time::Instant::now();
        match write {
            JournalWrite::Append {
                response_id,
                epoch,
                events,
            } => {
                let result = self.store.append(response_id, epoch, events).await;
                self.observe("append", started, &result);
                match result {
                    Ok(_) => JournalAck::Appended,
                    Err(e) => JournalAck::Refused(e),
                }
            }
            JournalWrite::Finish {
                response_id,
                epoch,
                mut terminal,
            } => {
                // Core reads no clock: the terminal is stamped here.
                terminal.at_unix_ms = iop_transport::clock::unix_ms();
                let result = self.store.finish(response_id, epoch, terminal).await;
                self.observe("finish", started, &result);
                match result {
                    Ok(_) => JournalAck::Finished,
                    Err(e) => JournalAck::Refused(e),
                }
            }
        }
    }

    /// R-TAKE-1, at start: every record without a terminal was being
    /// written by an Edge that is gone (this one, before it restarted).
    /// Each is taken over (its epoch raised first, R-JRN-3, so a write
    /// still on its way from the old owner is refused) and ended
    /// `incomplete` with its durable prefix, so every reader gets a
    /// terminal. Returns how many were ended.
    pub async fn end_orphans(&self) -> Result<usize, JournalError> {
        let unfinished = self.store.unfinished().await?;
        self.end_unadopted(unfinished).await
    }

    /// End `candidates` that are still unfinished and that no run of this
    /// Edge writes (none adopted them), `incomplete` (R-TAKE-1).
    async fn end_unadopted(&self, candidates: Vec<RecordMeta>) -> Result<usize, JournalError> {
        let mut ended = 0;
        for candidate in candidates {
            if self.is_live(&candidate.id) {
                continue;
            }
            let Some((meta, _)) = self.store.get(candidate.id.clone(), 0).await? else {
                continue;
            };
            if meta.terminal.is_some() {
                continue;
            }
            match self.end_incomplete(&meta, EDGE_RESTART_REASON).await {
                Ok(()) => ended += 1,
                // Another writer got there first: it owns the record.
                Err(JournalError::Fenced { .. } | JournalError::Terminated) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(ended)
    }

    async fn end_incomplete(&self, meta: &RecordMeta, reason: &str) -> Result<(), JournalError> {
        self.end_as(meta, RecordStatus::Incomplete, reason).await
    }

    /// Take a record over and end it (`status`, `reason`) with its durable
    /// prefix: its epoch is raised first (R-JRN-3), so whatever still
    /// writes it is fenced from then on.
    pub async fn end_as(
        &self,
        meta: &RecordMeta,
        status: RecordStatus,
        reason: &str,
    ) -> Result<(), JournalError> {
        let started = std::time::Instant::now();
        let raised = self.store.raise_epoch(meta.id.clone(), meta.epoch).await;
        self.observe("raise_epoch", started, &raised);
        let terminal = Terminal {
            status,
            reason: Some(reason.to_owned()),
            message: None,
            at_unix_ms: iop_transport::clock::unix_ms(),
        };
        let started = std::time::Instant::now();
        let finished = self
            .store
            .finish(meta.id.clone(), raised?.epoch, terminal)
            .await;
        self.observe("finish", started, &finished);
        finished.map(|_| ())
    }

    /// R-TAKE-1 at start: the records a former run of this Edge left
    /// unfinished wait `window` for their nodes to report their parked runs
    /// (R-PARK-2); those nobody adopted by then end `incomplete`.
    pub async fn spawn_orphan_ending(
        self: &Arc<Self>,
        window: Duration,
    ) -> Result<tokio::task::JoinHandle<()>, JournalError> {
        let orphans = self.store.unfinished().await?;
        let durable = self.clone();
        Ok(tokio::spawn(async move {
            if orphans.is_empty() {
                return;
            }
            tracing::info!(
                event = "edge_journal_orphans_waiting",
                records = orphans.len(),
                window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX)
            );
            tokio::time::sleep(window).await;
            match durable.end_unadopted(orphans).await {
                Ok(0) => {}
                Ok(n) => tracing::warn!(
                    event = "edge_journal_orphans_ended",
                    records = n,
                    reason = EDGE_RESTART_REASON
                ),
                Err(e) => tracing::warn!(event = "edge_journal_orphans_failed", error = %e),
            }
        }))
    }

    /// Carry the parked runs nodes report (R-PARK-2) to the runs that wait
    /// for them, or take their records over (R-TAKE-1), for as long as the
    /// Edge runs. A run nobody takes has its held capacity let go.
    pub fn spawn_adoptions(
        self: &Arc<Self>,
        mut parked: mpsc::UnboundedReceiver<Vec<ParkedOffer>>,
        ctx: crate::driver::DriverContext,
    ) -> tokio::task::JoinHandle<()> {
        let durable = self.clone();
        tokio::spawn(async move {
            while let Some(runs) = parked.recv().await {
                for offer in runs {
                    let key = offer.run.key;
                    if let Err(why) = durable.offer(&ctx, offer).await {
                        tracing::info!(event = "edge_parked_run_not_adopted", reason = why);
                        ctx.hub.release_parked(key);
                    }
                }
            }
        })
    }

    /// Offer one parked run: to the run of this Edge that waits for it, or
    /// take its record over.
    async fn offer(
        self: &Arc<Self>,
        ctx: &crate::driver::DriverContext,
        offer: ParkedOffer,
    ) -> Result<(), &'static str> {
        let live = self.live().get(&offer.run.response_id).cloned();
        if let Some(tx) = live {
            // Its driver adopts it, or lets it go if it no longer waits.
            return tx
                .send(LiveCommand::Parked(offer))
                .await
                .map_err(|_| "run_gone");
        }
        let id = offer.run.response_id.clone();
        let (meta, _) = self
            .store
            .get(id.clone(), 0)
            .await
            .map_err(|_| "store_error")?
            .ok_or("unknown_response")?;
        if meta.terminal.is_some() {
            return Err("response_ended");
        }
        // R-PARK-2: resume after the last frame of this run the journal
        // holds; a record whose last event came from another run is not
        // this run's any more.
        // Only a run whose frames the journal already holds is taken over,
        // and only from the node that ran it: a report cannot name someone
        // else's response into it (the provider is the reporting node's).
        if meta.last_seq == 0 {
            return Err("nothing_journaled");
        }
        let last = self
            .store
            .events(id.clone(), meta.last_seq - 1, 1)
            .await
            .map_err(|_| "store_error")?;
        let source = last
            .first()
            .and_then(|e| decode_entry(&e.payload))
            .and_then(|e| e.source)
            .ok_or("no_frame_source")?;
        if source.key != offer.run.key || source.provider_id != offer.provider_id {
            return Err("another_run");
        }
        let resume_after_frame = source.frame;
        // R-JRN-3: win the record's epoch before writing anything; a lost
        // race means another writer has it.
        let started = std::time::Instant::now();
        let raised = self.store.raise_epoch(id.clone(), meta.epoch).await;
        self.observe("raise_epoch", started, &raised);
        let raised = raised.map_err(|_| "epoch_lost")?;
        tracing::info!(
            event = "edge_response_taken_over",
            response = %id,
            epoch = raised.epoch,
            resume_after_frame
        );
        let work = crate::driver::Work {
            model: meta.model.clone(),
            api: iop_wire::RunApi::Chat,
            messages: Vec::new(),
            tools: Vec::new(),
            params: iop_wire::GenerationParams::default(),
            tunnel: None,
            route: meta.api.as_str(),
            principal: meta.principal.clone(),
            trace_context: None,
            // An adopted run is not continued elsewhere after a restart.
            continuation: false,
        };
        let (live, commands) = self.register(&id);
        crate::driver::spawn_takeover(
            ctx.clone(),
            work,
            crate::driver::DurableRun {
                spec: iop_core::edge::durable::JournalSpec {
                    response_id: id,
                    epoch: raised.epoch,
                    batch_until_terminal: false,
                },
                durable: self.clone(),
                commands,
                live,
                park_grace_ms: self.park_grace_ms,
            },
            crate::driver::Takeover {
                offer,
                last_seq: meta.last_seq,
                resume_after_frame,
            },
        );
        Ok(())
    }

    /// Remove expired records every `interval`, for as long as the Edge
    /// runs.
    pub fn spawn_sweeper(self: &Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        let durable = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match durable.store.sweep(iop_transport::clock::unix_ms()).await {
                    Ok(0) => {}
                    Ok(n) => {
                        durable.publish_stats();
                        tracing::info!(event = "edge_journal_swept", records = n);
                    }
                    Err(e) => tracing::warn!(event = "edge_journal_sweep_failed", error = %e),
                }
            }
        })
    }
}

/// A run this Edge writes; dropping it (the run's driver ended, however)
/// unregisters it.
pub struct LiveRun {
    durable: Arc<Durable>,
    response_id: String,
}

impl Drop for LiveRun {
    fn drop(&mut self) {
        self.durable.live().remove(&self.response_id);
    }
}

/// What a follower reads next.
#[derive(Debug, Clone, PartialEq)]
pub enum Followed {
    /// The record's next event.
    Event(Delivery),
    /// The record's terminal: nothing follows.
    Ended(Terminal),
}

/// Reads one record's events in order, then follows its live tail: the
/// only way a client sees a durable response, so it sees only what is
/// durable (R-JRN-1).
pub struct Follower {
    store: Arc<dyn JournalStore>,
    id: String,
    /// The last event taken.
    after: u64,
    progress: watch::Receiver<Progress>,
    ready: VecDeque<Delivery>,
    ended: bool,
}

impl Follower {
    /// Follow `id` from its first event.
    pub async fn open(store: Arc<dyn JournalStore>, id: &str) -> Result<Self, JournalError> {
        let progress = store.watch(id.to_owned()).await?;
        Ok(Follower {
            store,
            id: id.to_owned(),
            after: 0,
            progress,
            ready: VecDeque::new(),
            ended: false,
        })
    }

    /// Events taken so far.
    pub fn taken(&self) -> u64 {
        self.after - self.ready.len() as u64
    }

    /// An event already read, if any (no I/O).
    pub fn ready(&mut self) -> Option<Followed> {
        self.ready.pop_front().map(Followed::Event)
    }

    /// The next event or the terminal, waiting for it if need be;
    /// `Ok(None)` after the terminal. Cancel-safe: dropping the future
    /// loses nothing.
    pub async fn next(&mut self) -> Result<Option<Followed>, JournalError> {
        self.read(true).await
    }

    /// The next event or the terminal if it is durable now; `Ok(None)`
    /// when the reader is at the live tail (or after the terminal).
    pub async fn next_now(&mut self) -> Result<Option<Followed>, JournalError> {
        self.read(false).await
    }

    async fn read(&mut self, wait: bool) -> Result<Option<Followed>, JournalError> {
        loop {
            if let Some(delivery) = self.ready.pop_front() {
                return Ok(Some(Followed::Event(delivery)));
            }
            if self.ended {
                return Ok(None);
            }
            // Read the progress before the events: an append that lands in
            // between changes it again, so no wake-up is missed.
            let progress = *self.progress.borrow_and_update();
            if progress.last_seq > self.after {
                let events = self
                    .store
                    .events(self.id.clone(), self.after, FOLLOW_BATCH)
                    .await?;
                for event in events {
                    if event.seq != self.after + 1 {
                        // The store broke R-JRN-2; render nothing past it.
                        return Err(JournalError::Store(format!(
                            "event {} after {}",
                            event.seq, self.after
                        )));
                    }
                    self.after = event.seq;
                    match decode_delivery(&event.payload) {
                        Some(delivery) => self.ready.push_back(delivery),
                        None => {
                            return Err(JournalError::Store(format!(
                                "event {} is unreadable",
                                event.seq
                            )));
                        }
                    }
                }
                continue;
            }
            if progress.ended {
                let terminal = self
                    .store
                    .get(self.id.clone(), 0)
                    .await?
                    .and_then(|(meta, _)| meta.terminal)
                    .ok_or(JournalError::NotFound)?;
                self.ended = true;
                return Ok(Some(Followed::Ended(terminal)));
            }
            if !wait {
                return Ok(None);
            }
            if self.progress.changed().await.is_err() {
                // The store dropped the record (deleted) while we waited.
                return Err(JournalError::NotFound);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use iop_core::journal::{JournalApi, JournalEvent, JournalLimits, NewRecord, fingerprint};
    use iop_wire::RunEventKind;

    use super::*;

    fn stored() -> StoredRequest {
        StoredRequest {
            id_seed: 7,
            created_unix_ms: 1_700_000_000_000,
            store: true,
            background: false,
            body: br#"{"model":"m","input":"hi"}"#.to_vec(),
            history: None,
        }
    }

    fn memory() -> Arc<dyn JournalStore> {
        Arc::new(MemoryStore::new(JournalLimits::default()))
    }

    async fn create(store: &Arc<dyn JournalStore>, id: &str) -> RecordMeta {
        let new = NewRecord {
            id: id.into(),
            principal: "p".into(),
            api: JournalApi::Responses,
            model: "m".into(),
            fingerprint: fingerprint("responses", b"{}"),
            idempotency_key: None,
            background: false,
            request: stored().encode(),
            created_unix_ms: 1,
        };
        match store.create(new).await.unwrap() {
            iop_store::CreateOutcome::Create(meta) => meta,
            other => panic!("{other:?}"),
        }
    }

    fn text(s: &str) -> Delivery {
        Delivery::Event(RunEventKind::TextDelta(s.into()))
    }

    fn event(seq: u64, d: &Delivery) -> JournalEvent {
        JournalEvent {
            seq,
            payload: iop_core::edge::durable::encode_delivery(d),
        }
    }

    #[test]
    fn a_stored_request_reads_back_and_foreign_bytes_do_not() {
        let s = stored();
        assert_eq!(StoredRequest::decode(&s.encode()), Some(s));
        assert_eq!(StoredRequest::decode(b""), None);
        assert_eq!(StoredRequest::decode(&[9, 1, 2]), None, "unknown format");
    }

    #[tokio::test]
    async fn a_follower_reads_the_prefix_then_the_live_tail_then_the_terminal_r_jrn_1() {
        let store = memory();
        create(&store, "r").await;
        store
            .append("r".into(), 1, vec![event(1, &text("a"))])
            .await
            .unwrap();
        let mut f = Follower::open(store.clone(), "r").await.unwrap();
        assert_eq!(f.next().await.unwrap(), Some(Followed::Event(text("a"))));
        assert_eq!(f.next_now().await.unwrap(), None, "at the live tail");
        let writer = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .append("r".into(), 1, vec![event(2, &text("b"))])
                    .await
                    .unwrap();
                let t = Terminal {
                    status: RecordStatus::Completed,
                    reason: None,
                    message: None,
                    at_unix_ms: 5,
                };
                store.finish("r".into(), 1, t).await.unwrap();
            })
        };
        assert_eq!(f.next().await.unwrap(), Some(Followed::Event(text("b"))));
        let Some(Followed::Ended(t)) = f.next().await.unwrap() else {
            panic!("the terminal");
        };
        assert_eq!(t.status, RecordStatus::Completed);
        assert_eq!(f.next().await.unwrap(), None);
        assert_eq!(f.taken(), 2);
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn a_follower_of_a_deleted_record_ends_with_not_found() {
        let store = memory();
        create(&store, "r").await;
        let mut f = Follower::open(store.clone(), "r").await.unwrap();
        let waiting = tokio::spawn(async move { f.next().await });
        tokio::task::yield_now().await;
        store.delete("r".into()).await.unwrap();
        assert_eq!(waiting.await.unwrap(), Err(JournalError::NotFound));
    }

    #[tokio::test]
    async fn r_take_1_orphans_are_taken_over_then_ended_incomplete_and_fenced() {
        let store = memory();
        let meta = create(&store, "r").await;
        store
            .append("r".into(), meta.epoch, vec![event(1, &text("a"))])
            .await
            .unwrap();
        let durable = Durable::with_store(store.clone(), true);
        assert_eq!(durable.end_orphans().await.unwrap(), 1);
        let (after, _) = store.get("r".into(), 0).await.unwrap().unwrap();
        assert_eq!(after.epoch, meta.epoch + 1, "raised before the terminal");
        let t = after.terminal.clone().unwrap();
        assert_eq!(
            (t.status, t.reason.as_deref()),
            (RecordStatus::Incomplete, Some(EDGE_RESTART_REASON))
        );
        assert_eq!(after.last_seq, 1, "the durable prefix stays");
        // The old owner's late append is refused (R-JRN-3).
        assert!(matches!(
            store
                .append("r".into(), meta.epoch, vec![event(2, &text("late"))])
                .await,
            Err(JournalError::Fenced { .. })
        ));
        assert_eq!(durable.end_orphans().await.unwrap(), 0, "nothing left");
    }

    #[tokio::test]
    async fn cancel_reaches_only_a_run_this_edge_writes() {
        let durable = Arc::new(Durable::with_store(memory(), true));
        assert!(!durable.cancel("r"));
        let (live, mut cancel) = durable.register("r");
        assert!(durable.is_live("r"));
        assert!(durable.cancel("r"));
        assert!(matches!(cancel.recv().await, Some(LiveCommand::Cancel)));
        drop(live);
        assert!(!durable.is_live("r"), "unregistered when the run ends");
        assert!(!durable.cancel("r"));
    }
}
