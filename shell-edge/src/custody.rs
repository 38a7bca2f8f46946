//! The Edge's custody task: it drives [`iop_core::edge::custody::Custody`]
//! (R-TAKE-1, R-PARK-2, R-CONT-1, R-MULTI-1), which decides every
//! takeover: which record is an orphan, when its park window ends, which
//! write follows which answer, what a fenced or failed write does. This
//! task only runs the store operations it asks for, feeds their answers
//! back, brings it the parked runs nodes report, and starts the request
//! drivers it names: one that adopts a parked run
//! ([`crate::driver::spawn_takeover`]) or one that continues an orphan's
//! answer on its pool ([`crate::driver::spawn_continuation`]).
//!
//! A parked run whose request still runs on this Edge goes to that
//! request's driver, not to the custody: its driver adopts it.
//!
//! Between the durable store ([`crate::durable`]) and the request drivers
//! ([`crate::driver`]), which neither depends on the other for it. What a
//! stored request runs as (its pool and work, for a continuation) comes
//! from the HTTP side as a [`RecordRun`], so this module does not import
//! it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::hub::NodeReport;
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use iop_core::edge::custody::{
    Custody, CustodyEvent, CustodyInput, CustodyOutput, StoreAnswer, StoreOp,
};
use iop_core::edge::dispatch::ParkedOffer;
use iop_core::edge::durable::ResumedAnswer;
use iop_core::ids::{NodeId, ProviderId};
use iop_core::journal::{JournalError, RecordMeta};
use iop_trace::{CustodyConfigRec, Driven, MachineKind, Tap, TraceFiles};
use iop_transport::clock::Clock;
use iop_wire::RunKey;
use tokio::sync::mpsc;

use crate::driver::{DriverContext, DurableRun, Takeover, Work};
use crate::durable::{Durable, LiveCommand, StoredRequest};
use crate::store_reads::{ReadSlots, TakeoverReadSlot};

/// Store operations of the custody in flight at once; the rest queue. As
/// many as the takeovers' share of store reads (R-LIM-6), so a read always
/// finds its place.
const MAX_STORE_OPS_IN_FLIGHT: usize = iop_core::edge::store_reads::TAKEOVER_READS_IN_FLIGHT;

/// Events read from the store at a time for a continuation's prefix.
const EVENTS_BATCH: usize = 256;

/// What a stored request runs as when its answer is continued or its
/// adopted run may be (R-CONT-1): the providers of its pool and its work,
/// parsed again from the stored body, its conversation read back from the
/// store (R-LIM-6: a continued conversation is stored link by link).
/// `None`: it cannot run again (an API that does not continue, a body this
/// build does not read, a conversation that cannot be rebuilt).
pub type RecordRun = Arc<
    dyn Fn(RecordMeta, StoredRequest) -> BoxFuture<'static, Option<(Vec<ProviderId>, Work)>>
        + Send
        + Sync,
>;

/// What the custody starts.
pub enum Start {
    /// A request that adopts a parked run (R-PARK-2).
    Adopt {
        /// The node's report.
        offer: ParkedOffer,
        /// The record, its epoch won by this Edge.
        meta: RecordMeta,
        /// The run's frame the journal's last event came from.
        resume_after_frame: u64,
        /// The answer so far, when a lost adoption may be continued on
        /// `pool`.
        resumed: Option<ResumedAnswer>,
        /// Where a lost adoption continues (the run's provider alone when
        /// it may not be).
        pool: Vec<ProviderId>,
        /// Its work: the stored request's when it was read (its tenant's
        /// terms, R-TEN-2), else one that only adopts.
        work: Work,
    },
    /// A request that continues an orphan's answer on its pool
    /// (R-TAKE-1, R-CONT-1).
    Continue {
        /// The record, its epoch won by this Edge.
        meta: RecordMeta,
        /// What its journal holds.
        resumed: ResumedAnswer,
        /// Its pool.
        pool: Vec<ProviderId>,
        /// Its work.
        work: Work,
    },
    /// Charge an answer the custody ended `incomplete` without running it
    /// what its journal holds (R-TEN-2): to the record's key and
    /// principal, its prompt estimated from `work` (the stored request's,
    /// when it was read).
    Charge {
        /// The record, ended at the epoch this Edge won.
        meta: RecordMeta,
        /// What its journal holds.
        used: iop_core::edge::durable::JournaledUse,
        /// The stored request's work, if it was read.
        work: Option<Work>,
    },
    /// Let a reported parked run go (its held capacity with it): the
    /// reporting node and the run.
    Release(NodeId, RunKey),
    /// Tell the run's node to end it: no Edge can use it (R-PARK-1).
    CancelParked(ParkedOffer),
}

/// The custody task's state (see the module docs).
pub struct CustodyTask {
    durable: Arc<Durable>,
    custody: Driven<Custody>,
    clock: Clock,
    record_run: RecordRun,
    /// The Edge's store readers: a takeover's reads take places of their
    /// own share (R-LIM-6).
    reads: ReadSlots,
    /// What each record read ran as, until the custody starts it or lets
    /// it go.
    runs: HashMap<String, (Vec<ProviderId>, Work)>,
    /// The first scan's records, read before the Edge served anything.
    first: Option<Vec<RecordMeta>>,
    queued: VecDeque<StoreOp>,
    in_flight: FuturesUnordered<BoxFuture<'static, Answered>>,
}

/// A store answer and, for a record read, what its request runs as.
struct Answered {
    answer: StoreAnswer,
    run: Option<(String, (Vec<ProviderId>, Work))>,
}

impl CustodyTask {
    /// The custody of `durable`'s Edge, set up by `config`; `first`: the
    /// unfinished records read at start (the start fails without them);
    /// its store reads counted in `reads`' takeover share.
    pub fn new(
        durable: Arc<Durable>,
        config: iop_core::edge::custody::CustodyConfig,
        first: Vec<RecordMeta>,
        record_run: RecordRun,
        reads: ReadSlots,
        traces: &TraceFiles,
    ) -> Self {
        let clock = Clock::new();
        let config = CustodyConfigRec {
            config,
            created_us: clock.now().as_micros(),
        };
        let tap = traces
            .tap(MachineKind::EdgeCustody, || &config)
            .unwrap_or_else(|e| {
                tracing::error!(event = "edge_trace_open_failed", machine = "edge-custody", error = %e);
                Tap::off()
            });
        CustodyTask {
            custody: Driven::new(config.build(), tap),
            durable,
            clock,
            record_run,
            reads,
            runs: HashMap::new(),
            first: Some(first),
            queued: VecDeque::new(),
            in_flight: FuturesUnordered::new(),
        }
    }

    /// Run for as long as the Edge does: parked runs arrive on `parked`,
    /// records runs of this Edge left without their terminal from the
    /// durable state ([`Durable::left_open_runs`]); each run to start goes
    /// to `start`.
    pub async fn run(
        mut self,
        mut parked: mpsc::UnboundedReceiver<NodeReport>,
        mut start: impl FnMut(Start),
    ) {
        let mut parked_open = true;
        let mut left_open = self.durable.left_open_runs();
        loop {
            self.drain(&mut start);
            let timer = self.custody.poll_timeout();
            tokio::select! {
                Some(answered) = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    if let Some((id, run)) = answered.run {
                        self.runs.insert(id, run);
                    }
                    self.custody
                        .handle_input(self.clock.now(), CustodyInput::Store(answered.answer));
                }
                report = parked.recv(), if parked_open => match report {
                    Some(NodeReport::Offers(offers)) => {
                        for offer in offers {
                            self.offer(offer, &mut start).await;
                        }
                    }
                    Some(NodeReport::Kept(kept)) => self.durable.tell_kept(&kept),
                    None => parked_open = false,
                },
                id = recv_left_open(&mut left_open) => match id {
                    // R-JRN-4: ended here, at once.
                    Some(id) => self
                        .custody
                        .handle_input(self.clock.now(), CustodyInput::RunLeftOpen(id)),
                    None => left_open = None,
                },
                () = self.clock.sleep_until(timer) => {
                    self.custody.handle_timeout(self.clock.now());
                }
            }
        }
    }

    /// Run the custody until it has nothing more to do now and no store
    /// operation is in flight (tests: one scan, one takeover).
    pub async fn settle(&mut self, mut start: impl FnMut(Start)) {
        loop {
            self.drain(&mut start);
            let Some(answered) = self.in_flight.next().await else {
                return;
            };
            if let Some((id, run)) = answered.run {
                self.runs.insert(id, run);
            }
            self.custody
                .handle_input(self.clock.now(), CustodyInput::Store(answered.answer));
        }
    }

    /// Fire the custody's timer as of now (tests).
    pub fn fire(&mut self) {
        self.custody.handle_timeout(self.clock.now());
    }

    /// A parked run a node reported: to the run of this Edge that waits
    /// for it, or to the custody.
    async fn offer(&mut self, offer: ParkedOffer, start: &mut impl FnMut(Start)) {
        let live = self
            .durable
            .live()
            .get(&offer.run.response_id)
            .map(|h| h.commands.clone());
        if let Some(tx) = live {
            // Its driver adopts it, or lets it go if it no longer waits.
            let (node, key) = (offer.node.clone(), offer.run.key);
            if tx.send(LiveCommand::Parked(offer)).await.is_err() {
                tracing::info!(event = "edge_parked_run_not_adopted", reason = "run_gone");
                start(Start::Release(node, key));
            }
            return;
        }
        self.custody
            .handle_input(self.clock.now(), CustodyInput::Offer(offer));
    }

    /// Carry out the custody's outputs.
    fn drain(&mut self, start: &mut impl FnMut(Start)) {
        while let Some(out) = self.custody.poll_output(self.clock.now()) {
            match out {
                CustodyOutput::Store(op) => self.queued.push_back(op),
                CustodyOutput::Adopt {
                    offer,
                    meta,
                    resume_after_frame,
                    resumed,
                } => {
                    let run = self.runs.remove(&meta.id);
                    tracing::info!(
                        event = "edge_response_taken_over",
                        response = %iop_core::edge::client_ids::log_tag(&meta.id),
                        epoch = meta.epoch,
                        resume_after_frame
                    );
                    let (resumed, pool, work) = match (resumed, run) {
                        (Some(resumed), Some((pool, work))) if work.continuation => {
                            (Some(resumed), pool, work)
                        }
                        // The answer so far is charged if the adopted run
                        // is lost (R-TEN-2); on a route that does not
                        // continue answers, only the run's provider.
                        (Some(resumed), Some((_, work))) => {
                            (Some(resumed), vec![offer.provider_id.clone()], work)
                        }
                        (_, run) => {
                            // Without the answer so far, a lost adoption
                            // is not continued.
                            let mut work = run.map_or_else(|| adoption_work(&meta), |(_, w)| w);
                            work.continuation = false;
                            (None, vec![offer.provider_id.clone()], work)
                        }
                    };
                    start(Start::Adopt {
                        offer,
                        meta,
                        resume_after_frame,
                        resumed,
                        pool,
                        work,
                    });
                }
                CustodyOutput::Continue { meta, resumed } => {
                    let Some((pool, work)) = self.runs.remove(&meta.id) else {
                        // Its run was read with the record; without it the
                        // record waits for a later scan (it is this Edge's
                        // now, an orphan again).
                        tracing::warn!(event = "edge_response_not_continued", response = %iop_core::edge::client_ids::log_tag(&meta.id));
                        continue;
                    };
                    tracing::info!(
                        event = "edge_response_continued",
                        response = %iop_core::edge::client_ids::log_tag(&meta.id),
                        epoch = meta.epoch,
                        last_seq = resumed.last_seq
                    );
                    start(Start::Continue {
                        meta,
                        resumed,
                        pool,
                        work,
                    });
                }
                CustodyOutput::Release {
                    node,
                    key,
                    response_id,
                    reason,
                } => {
                    tracing::info!(
                        event = "edge_parked_run_not_adopted",
                        response = %iop_core::edge::client_ids::log_tag(&response_id),
                        node = %node,
                        reason = reason.as_str()
                    );
                    start(Start::Release(node, key));
                }
                CustodyOutput::CancelParked(offer) => start(Start::CancelParked(offer)),
                CustodyOutput::Charge { meta, used } => {
                    let work = self.runs.remove(&meta.id).map(|(_, work)| work);
                    start(Start::Charge { meta, used, work });
                }
                CustodyOutput::Event(event) => log(&event),
            }
        }
        let custody = self.custody.machine();
        self.runs.retain(|id, _| custody.is_taking(id));
        // R-TEN-2, R-JRN-6: no new durable request while records left open
        // wait for room here.
        let backlog = custody.refuses_durable();
        if self.durable.set_custody_backlog(backlog) {
            if backlog {
                tracing::warn!(
                    event = "edge_durable_backlog",
                    waiting = custody.left_open_waiting(),
                    "responses a store outage cut wait to be ended: new durable requests \
                     get 503 until they are"
                );
            } else {
                tracing::info!(event = "edge_durable_backlog_cleared");
            }
        }
        self.durable
            .publish_scan(self.custody.machine().scan(), self.clock.now());
        while self.in_flight.len() < MAX_STORE_OPS_IN_FLIGHT {
            let Some(op) = self.queued.front() else {
                break;
            };
            // R-LIM-6: a read (a scan, a record and the conversation it
            // continues, its events) holds a place of the takeovers' share
            // until it is done; none free, it waits for one to end.
            let place = if op.reads() {
                match self.reads.begin_takeover() {
                    Some(place) => Some(place),
                    None => break,
                }
            } else {
                None
            };
            let Some(op) = self.queued.pop_front() else {
                break;
            };
            let answered = self.execute(op, place);
            self.in_flight.push(answered);
        }
    }

    /// Run one store operation; its answer is the custody's input.
    fn execute(
        &mut self,
        op: StoreOp,
        place: Option<TakeoverReadSlot>,
    ) -> BoxFuture<'static, Answered> {
        let durable = self.durable.clone();
        let store = durable.store().clone();
        if let (StoreOp::Unfinished { .. }, Some(first)) = (&op, self.first.take()) {
            let records = first
                .into_iter()
                .map(|m| {
                    let live = durable.is_live(&m.id);
                    (m, live)
                })
                .collect();
            return Box::pin(async move {
                Answered {
                    answer: StoreAnswer::Unfinished(Ok(records)),
                    run: None,
                }
            });
        }
        let record_run = self.record_run.clone();
        Box::pin(async move {
            // Given back when the operation is done.
            let _place = place;
            let plain = |answer| Answered { answer, run: None };
            match op {
                StoreOp::Unfinished { hint } => {
                    let read = if hint {
                        store.unfinished_hint().await
                    } else {
                        store.unfinished().await
                    };
                    durable.noted(&read);
                    if let Err(e) = &read {
                        tracing::warn!(event = "edge_journal_scan_failed", error = %e);
                    }
                    let records = read.map(|records| {
                        records
                            .into_iter()
                            .map(|m| {
                                let live = durable.is_live(&m.id);
                                (m, live)
                            })
                            .collect()
                    });
                    plain(StoreAnswer::Unfinished(records))
                }
                StoreOp::Leases => {
                    let read = store.leases().await;
                    durable.noted(&read);
                    plain(StoreAnswer::Leases(read))
                }
                StoreOp::Lease { edge_id } => {
                    let result = store.lease(edge_id.clone()).await;
                    durable.noted(&result);
                    plain(StoreAnswer::Lease { edge_id, result })
                }
                StoreOp::Record { id } => {
                    let read = store.get(id.clone(), 0).await;
                    durable.noted(&read);
                    let live_here = durable.is_live(&id);
                    let (result, run) = match read {
                        Ok(Some((meta, request))) => {
                            let run = match StoredRequest::decode(&request) {
                                Some(stored) => record_run(meta.clone(), stored).await,
                                None => None,
                            };
                            (Ok(Some(meta)), run)
                        }
                        Ok(None) => (Ok(None), None),
                        Err(e) => (Err(e), None),
                    };
                    let continuable = run
                        .as_ref()
                        .is_some_and(|(pool, work)| work.continuation && !pool.is_empty());
                    Answered {
                        answer: StoreAnswer::Record {
                            id: id.clone(),
                            result,
                            live_here,
                            continuable,
                        },
                        run: run.map(|run| (id, run)),
                    }
                }
                StoreOp::Event { id, seq } => {
                    let read = store.events(id.clone(), seq.saturating_sub(1), 1).await;
                    durable.noted(&read);
                    let result = read
                        .map(|events| events.into_iter().find(|e| e.seq == seq).map(|e| e.payload));
                    plain(StoreAnswer::Event { id, result })
                }
                StoreOp::Events { id } => {
                    let result = read_events(&durable, &id).await;
                    plain(StoreAnswer::Events { id, result })
                }
                StoreOp::RaiseEpoch { id, expected } => {
                    let started = std::time::Instant::now();
                    let result = store
                        .raise_epoch(id.clone(), expected, durable.edge_id().to_owned())
                        .await;
                    durable.observe("raise_epoch", started, &result);
                    plain(StoreAnswer::Raised { id, result })
                }
                StoreOp::Finish {
                    id,
                    epoch,
                    mut terminal,
                } => {
                    terminal.at_unix_ms = iop_transport::clock::unix_ms();
                    let started = std::time::Instant::now();
                    let result = store.finish(id.clone(), epoch, terminal).await;
                    durable.observe("finish", started, &result);
                    plain(StoreAnswer::Finished {
                        id,
                        result: result.map(|_| ()),
                    })
                }
            }
        })
    }
}

/// Every event of record `id`, in order (bounded by the store's
/// per-record bytes).
async fn read_events(
    durable: &Durable,
    id: &str,
) -> Result<Vec<iop_core::journal::JournalEvent>, JournalError> {
    let mut events = Vec::new();
    loop {
        let after = events
            .last()
            .map_or(0, |e: &iop_core::journal::JournalEvent| e.seq);
        let batch = durable
            .store()
            .events(id.to_owned(), after, EVENTS_BATCH)
            .await;
        durable.noted(&batch);
        let batch = batch?;
        let full = batch.len() == EVENTS_BATCH;
        events.extend(batch);
        if !full {
            return Ok(events);
        }
    }
}

fn log(event: &CustodyEvent) {
    match event {
        CustodyEvent::OrphansWaiting(records) => {
            tracing::info!(event = "edge_journal_orphans_waiting", records);
        }
        CustodyEvent::ScanFailed(error) => {
            tracing::warn!(event = "edge_journal_scan_failed", error = %error);
        }
        CustodyEvent::Ended {
            id,
            reason,
            not_continued,
        } => {
            tracing::warn!(
                event = "edge_journal_orphan_ended",
                response = %iop_core::edge::client_ids::log_tag(id),
                reason,
                not_continued = not_continued.map(|n| n.as_str())
            );
        }
        CustodyEvent::Retried { id, error } => {
            tracing::info!(event = "edge_journal_takeover_retried", response = %iop_core::edge::client_ids::log_tag(id), error = error.as_str());
        }
        CustodyEvent::GaveUp { id } => {
            tracing::warn!(event = "edge_journal_takeover_given_up", response = %iop_core::edge::client_ids::log_tag(id));
        }
    }
}

/// Start what the custody names: a request driver, or a release.
pub fn start_run(ctx: &DriverContext, durable: &Arc<Durable>, start: Start) {
    match start {
        Start::Release(node, key) => ctx.hub.release_parked(node, key),
        Start::CancelParked(offer) => ctx.hub.cancel_parked(offer),
        // Charged by the caller, which holds the tenants (R-TEN-2).
        Start::Charge { .. } => {}
        Start::Adopt {
            offer,
            meta,
            resume_after_frame,
            resumed,
            pool,
            work,
        } => {
            let run = durable_run(durable, &meta);
            crate::driver::spawn_takeover(
                ctx.clone(),
                pool,
                work,
                run,
                Takeover {
                    offer,
                    last_seq: meta.last_seq,
                    resume_after_frame,
                    resumed,
                },
            );
        }
        Start::Continue {
            meta,
            resumed,
            pool,
            work,
        } => {
            let run = durable_run(durable, &meta);
            crate::driver::spawn_continuation(ctx.clone(), pool, work, run, resumed);
        }
    }
}

/// The work of an adoption whose stored request was not read: it only
/// adopts (no prompt to send again, so a lost adoption is not continued).
fn adoption_work(meta: &RecordMeta) -> Work {
    Work {
        model: meta.model.clone(),
        api: iop_wire::RunApi::Chat,
        messages: Vec::new(),
        tools: Vec::new(),
        params: iop_wire::GenerationParams::default(),
        tunnel: None,
        route: meta.api.as_str(),
        principal: meta.principal.clone(),
        trace_context: None,
        continuation: false,
        tenant: None,
        view: None,
    }
}

/// The durable run of a record this Edge took over.
fn durable_run(durable: &Arc<Durable>, meta: &RecordMeta) -> DurableRun {
    let (live, commands) = durable.register(&meta.id);
    DurableRun {
        spec: iop_core::edge::durable::JournalSpec {
            response_id: meta.id.clone(),
            epoch: meta.epoch,
            batch_until_terminal: false,
        },
        durable: durable.clone(),
        commands,
        live,
        park_grace_ms: durable.park_grace_ms(),
    }
}

/// The next record left open, or never once there is no receiver.
async fn recv_left_open(rx: &mut Option<mpsc::UnboundedReceiver<String>>) -> Option<String> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use iop_core::edge::durable::{FrameSource, encode_entry};
    use iop_core::edge::request::Delivery;
    use iop_core::journal::{
        JournalApi, JournalEvent, JournalLimits, NewRecord, RecordStatus, fingerprint,
    };
    use iop_store::{JournalStore, MemoryStore};
    use iop_wire::RunEventKind;

    use super::*;

    const WINDOW: Duration = Duration::from_secs(10);

    fn memory() -> Arc<dyn JournalStore> {
        Arc::new(MemoryStore::new(JournalLimits::default()))
    }

    async fn create(store: &Arc<dyn JournalStore>, id: &str, texts: &[&str]) -> RecordMeta {
        let stored = StoredRequest {
            id_seed: 7,
            created_unix_ms: 1_700_000_000_000,
            store: true,
            background: false,
            body: br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
            history: None,
            previous: None,
            history_unreadable: false,
        };
        let new = NewRecord {
            request: stored.encode(),
            ..new_record(id)
        };
        let meta = match store.create(new).await.unwrap() {
            iop_store::CreateOutcome::Create(meta) => meta,
            other => panic!("{other:?}"),
        };
        let events: Vec<JournalEvent> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| JournalEvent {
                seq: i as u64 + 1,
                payload: encode_entry(
                    &Delivery::Event(RunEventKind::TextDelta((*t).into())),
                    Some(FrameSource {
                        key: RunKey {
                            generation: 1,
                            run_id: 1,
                        },
                        frame: i as u64 + 1,
                        provider_id: ProviderId::from("p1"),
                    }),
                ),
            })
            .collect();
        if !events.is_empty() {
            store.append(id.into(), meta.epoch, events).await.unwrap();
        }
        store.get(id.into(), 0).await.unwrap().unwrap().0
    }

    /// What a stored request runs as: a pool of one, continuation as given.
    fn record_run(continuation: bool) -> RecordRun {
        Arc::new(move |meta: RecordMeta, _stored: StoredRequest| {
            Box::pin(std::future::ready(Some((
                vec![ProviderId::from("p1")],
                Work {
                    model: meta.model.clone(),
                    api: iop_wire::RunApi::Chat,
                    messages: Vec::new(),
                    tools: Vec::new(),
                    params: iop_wire::GenerationParams::default(),
                    tunnel: None,
                    route: "chat",
                    principal: meta.principal.clone(),
                    trace_context: None,
                    continuation,
                    tenant: None,
                    view: None,
                },
            ))))
        })
    }

    async fn task(
        durable: &Arc<Durable>,
        continuation: bool,
    ) -> (CustodyTask, Arc<Mutex<Vec<Start>>>) {
        task_of(durable, continuation, iop_core::edge::custody::MAX_TASKS).await
    }

    /// [`task`] with a custody of `max_tasks` takeovers at once.
    async fn task_of(
        durable: &Arc<Durable>,
        continuation: bool,
        max_tasks: usize,
    ) -> (CustodyTask, Arc<Mutex<Vec<Start>>>) {
        let first = durable.store().unfinished().await.unwrap();
        let mut config = durable.custody_config(WINDOW, Duration::from_secs(1));
        config.max_tasks = max_tasks;
        let task = CustodyTask::new(
            durable.clone(),
            config,
            first,
            record_run(continuation),
            ReadSlots::new(
                iop_core::edge::store_reads::ReadLimits::default(),
                crate::metrics::EdgeMetrics::new(
                    iop_transport::telemetry::MetricsPipeline::prometheus_only("iop-edge"),
                ),
            ),
            &TraceFiles::off(),
        );
        (task, Arc::new(Mutex::new(Vec::new())))
    }

    fn recorder(started: &Arc<Mutex<Vec<Start>>>) -> impl FnMut(Start) + use<> {
        let started = started.clone();
        move |s| started.lock().unwrap().push(s)
    }

    async fn step(task: &mut CustodyTask, started: &Arc<Mutex<Vec<Start>>>, after: Duration) {
        tokio::time::advance(after).await;
        task.fire();
        task.settle(recorder(started)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn r_take_1_a_restarted_edges_record_waits_the_park_window_then_ends_incomplete() {
        let store = memory();
        let meta = create(&store, "r", &["a"]).await;
        let durable = Arc::new(Durable::with_store(store.clone(), true));
        let (mut task, started) = task(&durable, false).await;
        step(&mut task, &started, Duration::ZERO).await;
        assert_eq!(
            durable.status().orphans_waiting,
            1,
            "its node may report it"
        );
        step(&mut task, &started, WINDOW - Duration::from_millis(1)).await;
        assert!(
            store
                .get("r".into(), 0)
                .await
                .unwrap()
                .unwrap()
                .0
                .terminal
                .is_none()
        );
        step(&mut task, &started, Duration::from_millis(100)).await;
        let (after, _) = store.get("r".into(), 0).await.unwrap().unwrap();
        assert_eq!(after.epoch, meta.epoch + 1, "raised before the terminal");
        let t = after.terminal.unwrap();
        assert_eq!(
            (t.status, t.reason.as_deref()),
            (RecordStatus::Incomplete, Some("edge_restart"))
        );
        assert_eq!(after.last_seq, 1, "the durable prefix stays");
        // Nothing runs; the answer is charged what its journal holds
        // (R-TEN-2): its text "a", once, on its record's key.
        let started = std::mem::take(&mut *started.lock().unwrap());
        let [
            Start::Charge {
                meta: charged,
                used,
                ..
            },
        ] = &started[..]
        else {
            panic!("one charge, nothing run");
        };
        assert_eq!(charged.id, "r");
        assert_eq!((used.usage, used.text_tokens), (None, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn r_take_1_a_record_run_here_is_never_ended() {
        let store = memory();
        create(&store, "r", &["a"]).await;
        let durable = Arc::new(Durable::with_store(store.clone(), true));
        let (_live, _commands) = durable.register("r");
        let (mut task, started) = task(&durable, true).await;
        for _ in 0..3 {
            step(&mut task, &started, WINDOW * 2).await;
        }
        let (after, _) = store.get("r".into(), 0).await.unwrap().unwrap();
        assert!(after.terminal.is_none());
        assert_eq!(after.epoch, 1);
        assert!(started.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn r_cont_1_an_orphan_whose_route_continues_is_handed_to_a_continuation() {
        let store = memory();
        let meta = create(&store, "r", &["Hel", "lo"]).await;
        let durable = Arc::new(Durable::with_store(store.clone(), true));
        let (mut task, started) = task(&durable, true).await;
        step(&mut task, &started, Duration::ZERO).await;
        step(&mut task, &started, WINDOW + Duration::from_millis(100)).await;
        let started = std::mem::take(&mut *started.lock().unwrap());
        let [
            Start::Continue {
                meta: raised,
                resumed,
                pool,
                work,
            },
        ] = &started[..]
        else {
            panic!("one continuation expected");
        };
        assert_eq!(raised.epoch, meta.epoch + 1, "the epoch is won first");
        assert_eq!(resumed.text, "Hello");
        assert_eq!(resumed.last_seq, 2);
        assert_eq!(pool, &vec![ProviderId::from("p1")]);
        assert!(work.continuation);
        let (after, _) = store.get("r".into(), 0).await.unwrap().unwrap();
        assert!(after.terminal.is_none(), "its continuation ends it");
    }

    #[tokio::test(start_paused = true)]
    async fn r_take_1_an_orphan_without_text_ends_incomplete_even_on_a_continuing_route() {
        let store = memory();
        create(&store, "r", &[]).await;
        let durable = Arc::new(Durable::with_store(store.clone(), true));
        let (mut task, started) = task(&durable, true).await;
        step(&mut task, &started, Duration::ZERO).await;
        step(&mut task, &started, WINDOW + Duration::from_millis(100)).await;
        assert!(
            started.lock().unwrap().is_empty(),
            "never the prompt from scratch"
        );
        let (after, _) = store.get("r".into(), 0).await.unwrap().unwrap();
        assert_eq!(after.status(), RecordStatus::Incomplete);
    }

    /// R-TEN-2, R-JRN-6: while records its requests left open wait for
    /// room in the custody, the Edge refuses new durable requests (503
    /// `response_store_unavailable`), and admits them again once the
    /// custody has ended them, each `failed`, charged nothing.
    #[tokio::test(start_paused = true)]
    async fn durable_requests_are_refused_while_records_left_open_wait_for_the_custody() {
        let store = memory();
        let durable = Arc::new(Durable::with_store(store.clone(), true));
        let (mut task, started) = task_of(&durable, false, 1).await;
        step(&mut task, &started, Duration::ZERO).await;
        for id in ["r1", "r2", "r3"] {
            create(&store, id, &["a"]).await;
            // As the run loop hands the custody each record a run left
            // open.
            let now = task.clock.now();
            task.custody
                .handle_input(now, CustodyInput::RunLeftOpen(id.into()));
        }
        task.drain(&mut recorder(&started));
        let refused = durable.create(new_record("r4")).await;
        assert_eq!(refused, Err(JournalError::Backlog));
        assert!(durable.status().durable_backlog, "/status says so");
        assert!(store.get("r4".into(), 0).await.unwrap().is_none());
        task.settle(recorder(&started)).await;
        for id in ["r1", "r2", "r3"] {
            let (meta, _) = store.get(id.into(), 0).await.unwrap().unwrap();
            let t = meta.terminal.expect("ended by the custody");
            assert_eq!(
                (t.status, t.reason.as_deref()),
                (RecordStatus::Failed, Some("journal_unavailable"))
            );
        }
        assert!(
            started.lock().unwrap().is_empty(),
            "nothing charged, nothing run"
        );
        assert!(!durable.status().durable_backlog);
        assert!(matches!(
            durable.create(new_record("r4")).await,
            Ok(iop_store::CreateOutcome::Create(_))
        ));
    }

    /// A record of this Edge's as the tests create it (no stored request).
    fn new_record(id: &str) -> NewRecord {
        NewRecord {
            id: id.into(),
            principal: "p".into(),
            api: JournalApi::ChatCompletions,
            model: "m".into(),
            fingerprint: fingerprint("chat", b"{}"),
            idempotency_key: None,
            background: false,
            request: Vec::new(),
            created_unix_ms: 1,
            owner: crate::config::DEFAULT_EDGE_ID.into(),
            key_id: "k".into(),
        }
    }
}
