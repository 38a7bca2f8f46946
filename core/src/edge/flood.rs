//! What one node connection may send that costs the Edge work without an
//! answer (R-LIM-4): past its budget the connection is a flood, closed with
//! `protocol_error` and counted, so a peer cannot fill the hub's queue.
//!
//! * Frames of another (stale) generation: a node racing its own reconnect
//!   sends a handful; [`MAX_STALE_FRAMES_PER_CONNECTION`] over the
//!   connection's life.
//! * Parked-run reports on a live connection (R-PARK-2, R-MULTI-1): a node
//!   sends one when runs park because another Edge's connection was lost;
//!   [`PARKED_REPORTS_PER_WINDOW`] per [`PARKED_REPORT_WINDOW`], naming
//!   at most [`PARKED_RUNS_PER_WINDOW`] runs in all (each run named costs
//!   the Edge a hold and a store read: a node that names thousands in every
//!   report, within the report budget, kept the hub busy for every other
//!   node and client).

use std::time::Duration;

use crate::time::Instant;

/// Stale-generation frames one connection may send in its life.
pub const MAX_STALE_FRAMES_PER_CONNECTION: u32 = 64;

/// Parked-run reports one connection may send per [`PARKED_REPORT_WINDOW`].
pub const PARKED_REPORTS_PER_WINDOW: u32 = 32;

/// Runs one connection's parked-run reports may name per
/// [`PARKED_REPORT_WINDOW`]: one registration's worth
/// ([`iop_wire::MAX_PARKED_RUNS`]); a node parks at most the runs it was
/// running.
pub const PARKED_RUNS_PER_WINDOW: u32 = iop_wire::MAX_PARKED_RUNS as u32;

/// The window of [`PARKED_REPORTS_PER_WINDOW`].
pub const PARKED_REPORT_WINDOW: Duration = Duration::from_secs(10);

/// How long a node waits after runs park before it reports them on a live
/// connection, gathering the runs that park meanwhile into one report:
/// its pace stays well within [`PARKED_REPORTS_PER_WINDOW`].
pub const PARKED_REPORT_DELAY: Duration = Duration::from_millis(500);

/// Which budget a connection overran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Flood {
    /// Frames of another generation.
    StaleFrames,
    /// Parked-run reports.
    ParkedReports,
}

impl Flood {
    /// The stable lower-case name (a closed log and metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Flood::StaleFrames => "stale_frames",
            Flood::ParkedReports => "parked_reports",
        }
    }
}

/// One connection's budgets (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameBudget {
    stale: u32,
    parked_since: Instant,
    parked: u32,
    parked_runs: u32,
}

impl FrameBudget {
    /// The budgets of a connection ready at `now`.
    pub fn new(now: Instant) -> Self {
        Self {
            stale: 0,
            parked_since: now,
            parked: 0,
            parked_runs: 0,
        }
    }

    /// One more frame of a stale generation.
    pub fn stale_frame(&mut self) -> Result<(), Flood> {
        self.stale = self.stale.saturating_add(1);
        if self.stale > MAX_STALE_FRAMES_PER_CONNECTION {
            return Err(Flood::StaleFrames);
        }
        Ok(())
    }

    /// The runs a registration names as parked: they count in the first
    /// window's run budget (the wire bounds them to one window's worth).
    pub fn registered_parked(&mut self, runs: usize) {
        self.parked_runs = self
            .parked_runs
            .saturating_add(u32::try_from(runs).unwrap_or(u32::MAX));
    }

    /// One more parked-run report at `now`, naming `runs` runs.
    pub fn parked_report(&mut self, now: Instant, runs: usize) -> Result<(), Flood> {
        if now.saturating_duration_since(self.parked_since) >= PARKED_REPORT_WINDOW {
            self.parked_since = now;
            self.parked = 0;
            self.parked_runs = 0;
        }
        self.parked = self.parked.saturating_add(1);
        self.parked_runs = self
            .parked_runs
            .saturating_add(u32::try_from(runs).unwrap_or(u32::MAX));
        if self.parked > PARKED_REPORTS_PER_WINDOW || self.parked_runs > PARKED_RUNS_PER_WINDOW {
            return Err(Flood::ParkedReports);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r_lim_4_stale_frames_are_a_flood_past_the_bound_of_the_connection() {
        let mut b = FrameBudget::new(Instant::ZERO);
        for _ in 0..MAX_STALE_FRAMES_PER_CONNECTION {
            assert_eq!(b.stale_frame(), Ok(()));
        }
        assert_eq!(b.stale_frame(), Err(Flood::StaleFrames));
    }

    #[test]
    fn r_lim_4_parked_reports_are_budgeted_per_window() {
        let t0 = Instant::from_millis(1_000);
        let mut b = FrameBudget::new(t0);
        for _ in 0..PARKED_REPORTS_PER_WINDOW {
            assert_eq!(b.parked_report(t0, 1), Ok(()));
        }
        assert_eq!(b.parked_report(t0, 1), Err(Flood::ParkedReports));
        // A node that reports at a steady pace never runs out.
        let mut b = FrameBudget::new(t0);
        let step = PARKED_REPORT_WINDOW / PARKED_REPORTS_PER_WINDOW;
        let mut now = t0;
        for _ in 0..10 * PARKED_REPORTS_PER_WINDOW {
            assert_eq!(b.parked_report(now, 1), Ok(()));
            now = now.saturating_add(step);
        }
        assert_eq!(Flood::ParkedReports.as_str(), "parked_reports");
    }

    #[test]
    fn r_lim_4_the_runs_reports_name_are_budgeted_per_window() {
        let t0 = Instant::from_millis(1_000);
        let mut b = FrameBudget::new(t0);
        let most = PARKED_RUNS_PER_WINDOW as usize;
        assert_eq!(
            b.parked_report(t0, most),
            Ok(()),
            "one registration's worth"
        );
        assert_eq!(b.parked_report(t0, 1), Err(Flood::ParkedReports));
        // The next window has its own.
        let later = t0.saturating_add(PARKED_REPORT_WINDOW);
        assert_eq!(b.parked_report(later, most), Ok(()));
        // A registration's runs count in the first window.
        let mut b = FrameBudget::new(t0);
        b.registered_parked(most);
        assert_eq!(b.parked_report(t0, 1), Err(Flood::ParkedReports));
    }

    #[test]
    fn a_node_reporting_at_its_own_pace_stays_within_the_edges_budget() {
        let most = PARKED_REPORT_WINDOW.as_millis() / PARKED_REPORT_DELAY.as_millis() + 1;
        assert!(most < u128::from(PARKED_REPORTS_PER_WINDOW), "{most}");
    }
}
