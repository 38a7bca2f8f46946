//! Planted bugs (feature `planted-bugs`, test-only): known bugs compiled into
//! the real state machines and switched on at run time, so the simulator and
//! the fuzzers can prove that their invariants catch them ("proving the
//! invariants bite", after TigerBeetle's VOPR).
//!
//! Nothing here changes behaviour unless a test switches a bug on: every hook
//! is `if planted.has(bug) { .. }` on a set that starts empty. Building the
//! workspace's tests turns the feature on for every crate that links
//! `iop-core` (cargo unifies features), which is harmless for that reason.
//!
//! The set is switched through a shared reference
//! ([`crate::edge::dispatch::Dispatcher::plant`],
//! [`crate::node::watchdog::Watchdog::plant`]) because the simulator reaches
//! its machines through recording wrappers that hand out read access only.
//! It is an atomic bit set, read with relaxed ordering: no lock, no clock,
//! and each machine still has one owner.

use std::sync::atomic::{AtomicU8, Ordering};

/// A known bug a test can plant in a core machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PlantedBug {
    /// R-LEASE-2: the fence gives each fenced lease's capacity back twice
    /// (`Admission::fence`).
    DoubleRelease,
    /// R-GEN-3: a fenced generation of a connected node counts as current,
    /// so its late terminals and CAPABILITIES answers are processed
    /// (`Registry::is_current`).
    AcceptStaleGeneration,
    /// R-OVL-2: stall evidence lowers (or is recorded) without the freshness
    /// check (`Overlay::apply_stall_evidence`).
    LowerOnStaleEvidence,
    /// R-WD-6: a provider call that returns after its run's terminal emits a
    /// second terminal instead of being fenced (`Watchdog::provider_returned`).
    SecondTerminal,
    /// R-GEN-2: a node's providers come online when it registers, before its
    /// generation completed readiness (`Dispatcher::register`).
    DispatchBeforeReady,
    /// R-GEN-4: the pre-send fence is skipped: `Admission::pre_send` answers
    /// `Send` without re-checking the lease, also for a lease its
    /// generation's fence already released.
    SkipPreSendFence,
}

impl PlantedBug {
    /// Every planted bug.
    pub const ALL: [PlantedBug; 6] = [
        PlantedBug::DoubleRelease,
        PlantedBug::AcceptStaleGeneration,
        PlantedBug::LowerOnStaleEvidence,
        PlantedBug::SecondTerminal,
        PlantedBug::DispatchBeforeReady,
        PlantedBug::SkipPreSendFence,
    ];

    /// The stable name (command line, reports).
    pub fn as_str(self) -> &'static str {
        match self {
            PlantedBug::DoubleRelease => "double-release",
            PlantedBug::AcceptStaleGeneration => "accept-stale-generation",
            PlantedBug::LowerOnStaleEvidence => "lower-on-stale-evidence",
            PlantedBug::SecondTerminal => "second-terminal",
            PlantedBug::DispatchBeforeReady => "dispatch-before-ready",
            PlantedBug::SkipPreSendFence => "skip-pre-send-fence",
        }
    }

    /// Parse a name from [`PlantedBug::as_str`].
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.as_str() == name)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// The bugs planted in one machine; empty unless a test switches one on.
#[derive(Debug, Default)]
pub struct Planted(AtomicU8);

impl Planted {
    /// Switch `bug` on.
    pub fn plant(&self, bug: PlantedBug) {
        self.0.fetch_or(bug.bit(), Ordering::Relaxed);
    }

    /// Is `bug` switched on?
    pub fn has(&self, bug: PlantedBug) -> bool {
        self.0.load(Ordering::Relaxed) & bug.bit() != 0
    }

    /// Is any bug switched on? (Assertions that a planted bug breaks on
    /// purpose are skipped, so the invariants, not a panic, report it.)
    pub fn any(&self) -> bool {
        self.0.load(Ordering::Relaxed) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bits_are_distinct() {
        let planted = Planted::default();
        assert!(!planted.any());
        for bug in PlantedBug::ALL {
            assert_eq!(PlantedBug::parse(bug.as_str()), Some(bug));
            assert!(!planted.has(bug));
        }
        planted.plant(PlantedBug::SecondTerminal);
        assert!(planted.any());
        for bug in PlantedBug::ALL {
            assert_eq!(planted.has(bug), bug == PlantedBug::SecondTerminal);
        }
    }
}
