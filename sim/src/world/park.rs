//! Durable runs that outlive their connection (SPEC §6: R-PARK-1,
//! R-PARK-2, R-TAKE-1), at the Edge.
//!
//! The node's side is its runs' core machine (`node_run.rs`: park, detach,
//! adoption, replay and expiry are `iop_core::node::run::NodeRun`'s). The
//! Edge carries the dispatcher's `ParkedRuns` to the adoption task
//! (`Durable::offer` in `iop-edge`): a live request waiting for its parked
//! run gets `RequestInput::ParkedRun`, and every durable request hears a
//! registration's `KeptRuns` (`Durable::tell_kept`); any other run is offered to the
//! Edge's custody (the core's `Custody`, see `custody.rs`), which adopts it
//! for a new request after winning its record's epoch, or lets it go. The
//! custody's scan also leaves each record unfinished at an Edge start for
//! its node to report, for the park window, before it takes it over
//! (R-TAKE-1).
//!
//! Every rule is the core's; this module carries inputs and outputs.

use std::sync::Arc;

use iop_core::edge::dispatch::{KeptRuns, ParkedOffer};
use iop_core::edge::request::RequestPhase;
use iop_core::ids::RunId;

use super::World;
use crate::net::ConnId;

impl World {
    // ---- The Edge --------------------------------------------------------------

    /// The node stream of `run_id` on `conn` was reset by the node.
    pub(super) fn edge_run_reset(&mut self, conn: ConnId, run_id: RunId) {
        let Some(edge) = &mut self.edges[self.cur] else {
            return;
        };
        let Some(c) = edge.conns.get_mut(&conn) else {
            return;
        };
        let Some(rid) = c.runs.remove(&run_id) else {
            return;
        };
        let Some(r) = edge.requests.get_mut(&rid) else {
            return;
        };
        if r.running != Some((conn, run_id)) {
            return;
        }
        r.running = None;
        self.request_input(rid, iop_core::edge::request::RequestInput::StreamEnded);
    }

    /// The parked runs a node reported reach the adoption task: each goes
    /// to the request waiting for it, or to the custody (`Durable::offer`).
    pub(super) fn parked_offers(&mut self, incarnation: u64, offers: Vec<ParkedOffer>) {
        for offer in offers {
            if self.edges[self.cur].as_ref().map(|e| e.incarnation) != Some(incarnation) {
                return;
            }
            self.offer_parked(incarnation, offer);
        }
    }

    /// The runs a registering node keeps reach every durable request of
    /// the Edge (`Durable::tell_kept`); the request decides.
    pub(super) fn kept_runs(&mut self, incarnation: u64, kept: &Arc<KeptRuns>) {
        let Some(edge) = &self.edges[self.cur] else {
            return;
        };
        if edge.incarnation != incarnation {
            return;
        }
        let durable: Vec<_> = edge
            .requests
            .iter()
            .filter(|(_, r)| r.durable.is_some())
            .map(|(rid, _)| *rid)
            .collect();
        let parked = |world: &Self, rid| {
            world.edges[world.cur]
                .as_ref()
                .and_then(|e| e.requests.get(&rid))
                .is_some_and(|r| r.machine.machine().phase() == RequestPhase::Parked)
        };
        for rid in durable {
            let was_parked = parked(self, rid);
            self.request_input(
                rid,
                iop_core::edge::request::RequestInput::KeptRuns(kept.clone()),
            );
            if was_parked && !parked(self, rid) {
                self.stats.parks_ended_not_kept += 1;
            }
        }
    }

    fn offer_parked(&mut self, incarnation: u64, offer: ParkedOffer) {
        let key = offer.run.key;
        let record = offer.run.response_id.as_str();
        let Some(edge) = &self.edges[self.cur] else {
            return;
        };
        let waiting = edge
            .requests
            .iter()
            .find(|(_, r)| {
                r.durable.as_deref() == Some(record) && r.machine.machine().awaits_parked(key)
            })
            .map(|(rid, _)| *rid);
        match waiting {
            // Its driver adopts it.
            Some(rid) => {
                self.request_input(rid, iop_core::edge::request::RequestInput::ParkedRun(offer));
            }
            // Taken over by adoption, or let go: the custody decides.
            None => self.custody_offer(incarnation, offer),
        }
    }
}
