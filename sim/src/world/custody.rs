//! The Edge's custody of the durable records no request of it writes
//! (SPEC §6: R-TAKE-1, R-PARK-2, R-CONT-1), carried for the core's
//! [`Custody`]: one machine per Edge (here, per Edge incarnation, in its
//! [`super::EdgeProc`]), driven as the crate docs' driver loop says.
//!
//! * **Store operations**: a read is answered at once from the simulated
//!   store's state (what is durable); a write (`RaiseEpoch`, `Finish`) goes
//!   through the store's write path as [`Writer::Custody`] of the
//!   incarnation, with its syncs, crash points, failures and zombies, and
//!   its answer comes back when the store's answer reaches the Edge.
//! * **Offers**: a parked run a node reports that no request of this Edge
//!   waits for is offered to the custody.
//! * **Timer**: `poll_timeout` is a world event; `handle_timeout` fires it.
//! * **Outputs**: `Adopt` and `Continue` start a request on the record
//!   (`Request::adopting`, `Request::continuing`) that writes under the
//!   epoch the custody won (the checker is told of the handover);
//!   `Release` lets the parked run's held capacity go.
//!
//! Every decision is the core's; this module only carries.

use std::collections::BTreeMap;

use iop_core::Instant;
use iop_core::edge::admission::RequestId;
use iop_core::edge::custody::{
    Custody, CustodyConfig, CustodyEvent, CustodyInput, CustodyOutput, ReleaseReason, StoreAnswer,
    StoreOp,
};
use iop_core::edge::dispatch::{DispatchInput, ParkedOffer};
use iop_core::edge::durable::{JournalSpec, ResumedAnswer};
use iop_core::edge::gate::GateBudget;
use iop_core::edge::request::{Request, RequestSpec, continuation_allowed};
use iop_core::ids::ProviderId;
use iop_core::journal::{JournalError, RecordMeta};
use iop_wire::RunKey;

use super::{EdgeRequest, Event, World};
use crate::journal_store::{JournalOp, OpKind, OpResult, Writer};
use crate::record::Recorder;
use crate::trace::{CustodyConfigRec, Driven, MachineKind, RequestBegin};

/// Outputs one drive of a custody carries out at most (every read is
/// answered inside the drive, so it bounds reads too).
const MAX_OUTPUTS_PER_DRIVE: usize = 1 << 20;

/// The custody of one Edge and what its driver keeps beside it.
#[derive(Debug)]
pub(super) struct EdgeCustody {
    machine: Driven<Custody>,
    /// The wake-up scheduled for the machine's timeout, if one is.
    armed: Option<Instant>,
    /// Per record, the last event an adoption read first (before its
    /// raise), to count adoptions whose resume point moved.
    first_event_read: BTreeMap<String, u64>,
}

impl EdgeCustody {
    /// Takeovers in progress and records left open waiting for room.
    pub(super) fn takeovers_ahead(&self) -> usize {
        let custody = self.machine.machine();
        custody.tasks() + custody.left_open_waiting()
    }

    /// Whether its Edge refuses new durable requests now (records left
    /// open wait for room in the custody, R-TEN-2).
    pub(super) fn refuses_durable(&self) -> bool {
        self.machine.machine().refuses_durable()
    }

    /// The custody of Edge `edge_id` starting at `now`. With one Edge the
    /// simulated store is its alone (`sole`: its records are its own, as
    /// an embedded store's); with several it is shared and the custody
    /// follows every Edge's lease (R-TAKE-1, R-MULTI-1).
    pub(super) fn new(
        now: Instant,
        edge_id: &str,
        park_window: std::time::Duration,
        sole: bool,
        max_tasks: usize,
        recorder: &mut Recorder,
    ) -> Self {
        let config = CustodyConfig {
            edge_id: edge_id.to_owned(),
            park_window,
            lease_ttl: std::time::Duration::from_millis(iop_core::journal::MIN_LEASE_TTL_MS),
            sole,
            // A shared store is scanned (its leases read) three times per
            // TTL, as iop-edge's defaults do (15 s, 5 s): a view judges a
            // lease expired by the time since it first read its revision,
            // so reads rarer than the TTL call a renewing lease expired
            // between two of them (R-MULTI-1).
            scan_interval: if sole {
                std::time::Duration::from_secs(1)
            } else {
                std::time::Duration::from_millis(iop_core::journal::MIN_LEASE_TTL_MS / 3)
            },
            max_tasks,
        };
        let config = CustodyConfigRec {
            config,
            created_us: now.as_micros(),
        };
        let tap = recorder.tap(MachineKind::EdgeCustody, &config);
        EdgeCustody {
            machine: Driven::new(config.build(), tap),
            armed: None,
            first_event_read: BTreeMap::new(),
        }
    }
}

/// The route a durable request came in on: its pool and whether it
/// continues answers (R-CONT-1). Configuration, so it outlives the Edge
/// process.
#[derive(Debug, Clone)]
pub(super) struct Route {
    pub(super) pool: Vec<ProviderId>,
    pub(super) continues: bool,
}

/// Whether the route of record `id` continues answers (R-CONT-1: opted
/// in, and a chat API, the simulator's one).
pub(super) fn continues(routes: &BTreeMap<String, Route>, id: &str) -> bool {
    let opted_in = routes.get(id).is_some_and(|r| r.continues);
    continuation_allowed(iop_wire::RunApi::Chat, opted_in)
}

impl World {
    /// Whether the route of record `id` continues answers.
    pub(super) fn route_continues(&self, id: &str) -> bool {
        continues(&self.routes, id)
    }

    /// Offer a parked run no request of incarnation `incarnation` waits for
    /// to its custody.
    pub(super) fn custody_offer(&mut self, incarnation: u64, offer: ParkedOffer) {
        self.custody_input(incarnation, CustodyInput::Offer(offer));
    }

    /// Feed one input to the custody of `incarnation` and carry out what it
    /// caused.
    pub(super) fn custody_input(&mut self, incarnation: u64, input: CustodyInput) {
        let now = self.now;
        let Some(custody) = self.custody_of(incarnation) else {
            return;
        };
        custody.machine.handle_input(now, input);
        self.drive_custody(incarnation);
    }

    /// The custody's timer fired (or the Edge just started).
    pub(super) fn custody_wake(&mut self, incarnation: u64, at: Option<Instant>) {
        let now = self.now;
        let Some(custody) = self.custody_of(incarnation) else {
            return;
        };
        if at.is_some() && custody.armed == at {
            custody.armed = None;
        }
        custody.machine.fire_due(now);
        self.drive_custody(incarnation);
    }

    fn custody_of(&mut self, incarnation: u64) -> Option<&mut EdgeCustody> {
        self.edges[self.cur]
            .as_mut()
            .filter(|e| e.incarnation == incarnation)
            .map(|e| &mut e.custody)
    }

    /// Drain the custody's outputs, then arm its timer.
    fn drive_custody(&mut self, incarnation: u64) {
        for _ in 0..MAX_OUTPUTS_PER_DRIVE {
            let now = self.now;
            let Some(out) = self
                .custody_of(incarnation)
                .and_then(|c| c.machine.poll_output(now))
            else {
                break;
            };
            match out {
                CustodyOutput::Store(op) => self.custody_store(incarnation, op),
                CustodyOutput::Adopt {
                    offer,
                    meta,
                    resume_after_frame,
                    resumed,
                } => self.custody_adopt(incarnation, offer, meta, resume_after_frame, resumed),
                CustodyOutput::Continue { meta, resumed } => {
                    self.custody_continue(incarnation, meta, &resumed);
                }
                CustodyOutput::Release {
                    node,
                    key,
                    response_id,
                    reason,
                } => {
                    if let ReleaseReason::Refused(why) = reason {
                        self.checkers[0].parked_run_refused(&self.journal, &response_id, why);
                    }
                    self.release_parked(node, key);
                }
                CustodyOutput::CancelParked(offer) => self.cancel_parked(&offer),
                CustodyOutput::Charge { meta, used } => self.tenant_charge_ended(&meta, &used),
                CustodyOutput::Event(event) => self.custody_event(event),
            }
        }
        let Some(custody) = self.custody_of(incarnation) else {
            return;
        };
        let next = custody.machine.poll_timeout();
        if let Some(at) = next
            && custody.armed != Some(at)
        {
            custody.armed = Some(at);
            self.schedule(
                at,
                Event::CustodyTimeout {
                    incarnation,
                    at: Some(at),
                },
            );
        }
    }

    /// Carry out one store operation: a read at once, a write through the
    /// store's write path.
    fn custody_store(&mut self, incarnation: u64, op: StoreOp) {
        let now = self.now;
        let answer = match op {
            StoreOp::RaiseEpoch { id, expected } => {
                let owner = self.edge_id(self.cur);
                return self.journal_submit(
                    Writer::Custody { incarnation },
                    JournalOp::RaiseEpoch {
                        id,
                        expected,
                        owner,
                    },
                );
            }
            StoreOp::Finish {
                id,
                epoch,
                mut terminal,
            } => {
                // The driver stamps the wall-clock time (core reads none).
                terminal.at_unix_ms = self.unix_ms();
                return self.journal_submit(
                    Writer::Custody { incarnation },
                    JournalOp::Finish {
                        id,
                        epoch,
                        terminal,
                    },
                );
            }
            StoreOp::Unfinished { hint: _ } => StoreAnswer::Unfinished(Ok(self
                .journal
                .unfinished()
                .into_iter()
                .map(|meta| {
                    let live = self.record_live_here(&meta.id);
                    (meta, live)
                })
                .collect())),
            // One Edge is `sole` and never asks; several share the
            // store's leases.
            StoreOp::Leases => StoreAnswer::Leases(Ok(self.journal.leases())),
            StoreOp::Lease { edge_id } => StoreAnswer::Lease {
                result: Ok(self.journal.lease(&edge_id)),
                edge_id,
            },
            StoreOp::Record { id } => {
                if let Some(c) = self.custody_of(incarnation) {
                    c.first_event_read.remove(&id);
                }
                StoreAnswer::Record {
                    result: Ok(self.journal.record(&id).map(|r| r.meta.clone())),
                    live_here: self.record_live_here(&id),
                    continuable: self.route_continues(&id),
                    id,
                }
            }
            StoreOp::Event { id, seq } => {
                if let Some(c) = self.custody_of(incarnation) {
                    c.first_event_read.entry(id.clone()).or_insert(seq);
                }
                let payload = self.journal.record(&id).and_then(|r| {
                    let index = usize::try_from(seq.checked_sub(1)?).ok()?;
                    r.events.get(index).map(|e| e.payload.clone())
                });
                StoreAnswer::Event {
                    id,
                    result: Ok(payload),
                }
            }
            StoreOp::Events { id } => StoreAnswer::Events {
                result: Ok(self
                    .journal
                    .record(&id)
                    .map(|r| r.events.clone())
                    .unwrap_or_default()),
                id,
            },
        };
        // R-JRN-6: in an outage every read fails too.
        let answer = if self.journal_down() {
            failed_read(answer)
        } else {
            answer
        };
        if let Some(c) = self.custody_of(incarnation) {
            c.machine.handle_input(now, CustodyInput::Store(answer));
        }
    }

    /// The store's answer to a custody write reached its Edge.
    pub(super) fn custody_answer(
        &mut self,
        incarnation: u64,
        id: String,
        kind: OpKind,
        result: OpResult,
    ) {
        let answer = match kind {
            OpKind::RaiseEpoch => StoreAnswer::Raised {
                id,
                result: match result {
                    OpResult::Written(meta) => Ok(meta),
                    OpResult::Refused(e) => Err(e),
                    OpResult::Created(_) => Err(unexpected()),
                },
            },
            OpKind::Finish => StoreAnswer::Finished {
                id,
                result: match result {
                    OpResult::Written(_) => Ok(()),
                    OpResult::Refused(e) => Err(e),
                    OpResult::Created(_) => Err(unexpected()),
                },
            },
            // The custody writes nothing else.
            OpKind::Create | OpKind::Append => return,
        };
        self.custody_input(incarnation, CustodyInput::Store(answer));
    }

    fn custody_event(&mut self, event: CustodyEvent) {
        match event {
            CustodyEvent::Ended { id, reason, .. } => {
                self.stats.takeovers += 1;
                // A record its request left open is its request's to
                // charge (it settled it, R-TEN-2); the custody charges none.
                if reason != iop_core::journal::JOURNAL_UNAVAILABLE_REASON {
                    self.tenant_check_ended(&id);
                }
            }
            CustodyEvent::Retried { .. } => self.stats.takeover_retries += 1,
            CustodyEvent::GaveUp { .. } => self.stats.takeovers_given_up += 1,
            CustodyEvent::OrphansWaiting(_) | CustodyEvent::ScanFailed(_) => {}
        }
    }

    /// The spec of a request that writes `meta` at the epoch the custody
    /// won for it.
    fn custody_spec(
        &self,
        rid: RequestId,
        meta: &RecordMeta,
        fallback: &[ProviderId],
    ) -> Option<RequestSpec> {
        let budget = GateBudget::new(self.cfg.max_attempts, self.cfg.request_budget).ok()?;
        let route = self.routes.get(&meta.id);
        let pool = route.map_or_else(|| fallback.to_vec(), |r| r.pool.clone());
        Some(RequestSpec {
            request_id: rid,
            pool,
            budget,
            tunnel_api: None,
            tunnel_providers: Vec::new(),
            journal: Some(JournalSpec {
                response_id: meta.id.clone(),
                epoch: meta.epoch,
                batch_until_terminal: false,
            }),
            park_grace_ms: super::duration_ms(self.cfg.journal.park_grace),
            continuation: self.route_continues(&meta.id),
            prompt_tokens: self.tenant_record_prompt_tokens(&meta.id),
        })
    }

    /// `Adopt`: a request adopts the parked run (R-PARK-2, R-TAKE-1).
    fn custody_adopt(
        &mut self,
        incarnation: u64,
        offer: ParkedOffer,
        meta: RecordMeta,
        resume_after_frame: u64,
        resumed: Option<ResumedAnswer>,
    ) {
        let Some(rid) = self.next_request_id(incarnation) else {
            return;
        };
        let moved = self
            .custody_of(incarnation)
            .and_then(|c| c.first_event_read.remove(&meta.id))
            .is_some_and(|first| first != meta.last_seq);
        if moved {
            self.stats.adoption_reads_moved += 1;
        }
        let Some(spec) = self.custody_spec(rid, &meta, std::slice::from_ref(&offer.provider_id))
        else {
            return self.release_parked(offer.node, offer.run.key);
        };
        let machine = self.new_request(
            spec,
            RequestBegin::Adopting {
                offer,
                last_seq: meta.last_seq,
                resume_after_frame,
                resumed,
            },
        );
        self.stats.takeover_adoptions += 1;
        // R-TEN-2: held to the record's key, its adopted run reserved.
        self.tenant_take_over(rid, &meta, true);
        self.custody_hands_over(incarnation, rid, &meta, machine);
    }

    /// `Continue`: a request continues the orphan's answer on its pool
    /// (R-TAKE-1, R-CONT-1).
    fn custody_continue(&mut self, incarnation: u64, meta: RecordMeta, resumed: &ResumedAnswer) {
        let Some(rid) = self.next_request_id(incarnation) else {
            return;
        };
        let Some(spec) = self.custody_spec(rid, &meta, &[]) else {
            return;
        };
        let machine = self.new_request(
            spec,
            RequestBegin::Continuing {
                resumed: resumed.clone(),
            },
        );
        self.stats.takeover_continued += 1;
        // R-TEN-2: held to the record's key; each attempt reserves.
        self.tenant_take_over(rid, &meta, false);
        self.custody_hands_over(incarnation, rid, &meta, machine);
    }

    fn next_request_id(&mut self, incarnation: u64) -> Option<RequestId> {
        let edge = self.edges[self.cur]
            .as_mut()
            .filter(|e| e.incarnation == incarnation)?;
        let rid = edge.next_request_id;
        edge.next_request_id += 1;
        Some(rid)
    }

    /// The custody's epoch goes to the request it started; the request
    /// runs.
    fn custody_hands_over(
        &mut self,
        incarnation: u64,
        rid: RequestId,
        meta: &RecordMeta,
        machine: Driven<Request>,
    ) {
        self.checkers[0].journal_epoch_handed(
            &meta.id,
            meta.epoch,
            &Writer::Custody { incarnation },
            Writer::Request {
                incarnation,
                request_id: rid,
            },
        );
        self.core_bugs.plant_request(machine.machine());
        let deadline = machine.machine().gate().deadline() + self.cfg.durable_flush_bound();
        let Some(edge) = self.edges[self.cur]
            .as_mut()
            .filter(|e| e.incarnation == incarnation)
        else {
            return;
        };
        edge.requests.insert(
            rid,
            EdgeRequest {
                machine,
                running: None,
                admitted_with: None,
                durable: Some(meta.id.clone()),
                client_attached: false,
            },
        );
        self.checkers[self.cur].request_opened((incarnation, rid), deadline);
        self.drive_request(rid);
    }

    /// No request takes this parked run: let its held capacity go.
    pub(super) fn release_parked(&mut self, node: iop_core::ids::NodeId, key: RunKey) {
        self.stats.offers_released += 1;
        self.dispatch(DispatchInput::ReleaseParked { node, key });
    }

    /// Tell the node of a parked run no Edge can use to end it (R-PARK-1):
    /// on the Edge's connection of the run's node, as the hub does.
    fn cancel_parked(&mut self, offer: &iop_core::edge::dispatch::ParkedOffer) {
        let Some(node) = self
            .providers
            .iter()
            .find(|p| p.id == offer.provider_id)
            .map(|p| p.node.clone())
        else {
            return;
        };
        let node = self.node_index(&node);
        let Some(edge) = &self.edges[self.cur] else {
            return;
        };
        let conn = edge
            .conns
            .iter()
            .filter(|(_, c)| c.node == node && c.generation.is_some())
            .max_by_key(|(_, c)| c.generation)
            .map(|(conn, _)| *conn);
        if let Some(conn) = conn {
            self.transmit(
                conn,
                crate::net::Dir::EdgeToNode,
                crate::net::StreamKey::Control,
                crate::net::Payload::EdgeControl(iop_wire::EdgeControl::CancelParked(
                    iop_wire::CancelParked {
                        key: offer.run.key,
                        response_id: offer.run.response_id.clone(),
                    },
                )),
            );
        }
    }

    /// Whether a request of this Edge writes `record`: one whose machine
    /// runs, or one whose create the store took and whose answer is on
    /// its way back (its record is in the store, owned by this Edge, and
    /// its request starts once the answer arrives; a scan in between must
    /// not take it for an orphan).
    pub(super) fn record_live_here(&self, record: &str) -> bool {
        self.edges[self.cur].as_ref().is_some_and(|e| {
            e.requests
                .values()
                .any(|r| r.durable.as_deref() == Some(record))
                || e.pending_creates.values().any(|p| p.record == record)
        })
    }
}

/// A store answer of a kind the op does not have.
fn unexpected() -> JournalError {
    JournalError::Store("unexpected answer".into())
}

/// `answer` as the store answers a read in an outage: failed.
fn failed_read(answer: StoreAnswer) -> StoreAnswer {
    let down = || JournalError::Store("outage".into());
    match answer {
        StoreAnswer::Unfinished(_) => StoreAnswer::Unfinished(Err(down())),
        StoreAnswer::Leases(_) => StoreAnswer::Leases(Err(down())),
        StoreAnswer::Lease { edge_id, .. } => StoreAnswer::Lease {
            edge_id,
            result: Err(down()),
        },
        StoreAnswer::Record {
            id,
            live_here,
            continuable,
            ..
        } => StoreAnswer::Record {
            id,
            result: Err(down()),
            live_here,
            continuable,
        },
        StoreAnswer::Event { id, .. } => StoreAnswer::Event {
            id,
            result: Err(down()),
        },
        StoreAnswer::Events { id, .. } => StoreAnswer::Events {
            id,
            result: Err(down()),
        },
        other => other,
    }
}
