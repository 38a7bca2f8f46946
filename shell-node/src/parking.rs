//! The node's durable runs as other tasks see them (SPEC §6, R-PARK-1,
//! R-PARK-2): how to reach each one and what a registration reports of it.
//! Each run's own task (module `park`) keeps its entry current; which runs
//! a report names and which hold capacity is `iop_core::node::park`'s.

use std::collections::HashMap;
use std::sync::Mutex;

use iop_core::node::capacity::ParkedRuns;
use iop_core::node::park::{ParkState, ParkSummary, ReportScope, parked_capacity, select_reports};
use iop_wire::{ParkedRun, RunKey};
use tokio::sync::mpsc;

use crate::control::{Attach, RunControl};

/// What the node holds of one durable run for other tasks: how to reach
/// it, and what a registration reports of it.
pub(crate) struct ParkEntry {
    pub(crate) control: mpsc::UnboundedSender<RunControl>,
    pub(crate) report: ParkedRun,
    pub(crate) state: ParkState,
}

/// A durable run in the [`ParkingLot`]: its [`RunKey`] and its response.
/// The key alone is not enough on a node connected to several Edges: two
/// Edges started in the same millisecond hand out the same generations
/// (R-MULTI-1), so their run keys can coincide; a response id cannot.
pub(crate) type LotKey = (RunKey, String);

/// The node's durable runs, by [`RunKey`] and response.
pub struct ParkingLot {
    runs: Mutex<HashMap<LotKey, ParkEntry>>,
    /// Bumped each time a run parks: every live connection then reports
    /// the parked runs to its Edge (R-PARK-2, R-MULTI-1).
    parked_changed: tokio::sync::watch::Sender<u64>,
}

impl Default for ParkingLot {
    fn default() -> Self {
        Self {
            runs: Mutex::default(),
            parked_changed: tokio::sync::watch::channel(0).0,
        }
    }
}

impl ParkingLot {
    fn runs(&self) -> std::sync::MutexGuard<'_, HashMap<LotKey, ParkEntry>> {
        // Entries are inserted, updated and removed whole.
        self.runs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The report `scope` makes of the node's durable runs (R-PARK-2,
    /// R-MULTI-1): [`ReportScope::Registration`] at registration,
    /// [`ReportScope::Live`] on a live connection when a run parks.
    pub fn reports(&self, scope: ReportScope) -> Vec<ParkedRun> {
        let runs = self.runs();
        select_reports(scope, runs.values().map(|e| (e.state, &e.report)))
    }

    /// Told each time a run parks.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.parked_changed.subscribe()
    }

    /// Durable runs that hold provider capacity outside every connection's
    /// count, in all and on `adapter`/`target` (the node's run limit counts
    /// them, R-PARK-1).
    pub fn parked_runs(&self, adapter: iop_wire::AdapterKind, target: &str) -> ParkedRuns {
        let runs = self.runs();
        parked_capacity(adapter, target, runs.values().map(|e| (e.state, &e.report)))
    }

    /// Hand an adoption to the run it names; false if there is none.
    pub fn adopt(&self, key: RunKey, response_id: &str, attach: Attach) -> bool {
        match self.runs().get(&(key, response_id.to_owned())) {
            Some(entry) => entry
                .control
                .send(RunControl::Attach(Box::new(attach)))
                .is_ok(),
            None => false,
        }
    }

    /// An Edge can use the run of `key` writing `response_id` no more: it
    /// ends if it is parked (R-PARK-1). False if there is none.
    pub fn cancel_parked(&self, key: RunKey, response_id: &str) -> bool {
        match self.runs().get(&(key, response_id.to_owned())) {
            Some(entry) => entry.control.send(RunControl::CancelParked).is_ok(),
            None => false,
        }
    }

    pub(crate) fn insert(&self, key: LotKey, entry: ParkEntry) {
        self.runs().insert(key, entry);
    }

    pub(crate) fn update(&self, key: &LotKey, state: ParkState, summary: ParkSummary) {
        let mut runs = self.runs();
        if let Some(entry) = runs.get_mut(key) {
            let was_parked = matches!(entry.state, ParkState::Parked { .. });
            entry.state = state;
            if !was_parked && matches!(entry.state, ParkState::Parked { .. }) {
                self.parked_changed.send_modify(|n| *n = n.wrapping_add(1));
            }
            entry.report.first_kept_frame = summary.first_kept;
            entry.report.last_frame = summary.last;
            entry.report.ended = summary.ended;
        }
    }

    pub(crate) fn remove(&self, key: &LotKey) {
        self.runs().remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: RunKey, response_id: &str, state: ParkState) -> ParkEntry {
        ParkEntry {
            control: mpsc::unbounded_channel().0,
            report: ParkedRun {
                key,
                response_id: response_id.to_owned(),
                adapter: iop_wire::AdapterKind::Mock,
                target: "m".into(),
                first_kept_frame: 1,
                last_frame: 0,
                ended: false,
            },
            state,
        }
    }

    /// R-MULTI-1, R-PARK-2: two Edges started in the same millisecond hand
    /// a node the same generation, so runs they started can share a run
    /// key; the lot keeps both apart by their responses, reports both, and
    /// counts both as holding their provider.
    #[test]
    fn runs_of_two_edges_with_one_key_are_kept_apart_by_their_responses() {
        let lot = ParkingLot::default();
        let key = RunKey {
            generation: 1_796_180_068_867,
            run_id: 1,
        };
        let parked = ParkState::Parked {
            until: iop_core::time::Instant::from_millis(1_000),
        };
        lot.insert((key, "resp_a".into()), entry(key, "resp_a", parked));
        lot.insert((key, "resp_b".into()), entry(key, "resp_b", parked));
        let reports = lot.reports(ReportScope::Live);
        let ids: Vec<&str> = reports.iter().map(|r| r.response_id.as_str()).collect();
        assert_eq!(ids.len(), 2, "{ids:?}");
        assert!(ids.contains(&"resp_a") && ids.contains(&"resp_b"));
        assert_eq!(
            lot.parked_runs(iop_wire::AdapterKind::Mock, "m"),
            ParkedRuns {
                total: 2,
                on_target: 2
            }
        );
        lot.remove(&(key, "resp_a".into()));
        let left: Vec<String> = lot
            .reports(ReportScope::Live)
            .into_iter()
            .map(|r| r.response_id)
            .collect();
        assert_eq!(left, ["resp_b"]);
    }
}
