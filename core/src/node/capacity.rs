//! The node's one run limit, across every Edge it is connected to (SPEC §8
//! R-MULTI-1, R-PARK-1).
//!
//! A node connected to several Edges is dispatched to by each of them, and
//! each Edge only knows its own leases. So the node admits every run
//! against one count for the whole process: `[node] max_concurrent_runs`
//! runs in all, and at most a target's own `max_concurrent_runs` on each
//! provider target that sets one. A run past either is refused with
//! `node_overloaded`, which is retryable (R-FAIL-1): the Edge re-admits the
//! request to another provider of its pool. A parked durable run still
//! holds its provider call (R-PARK-1), so it still counts; its adoption by
//! another connection does not count it twice.
//!
//! Sans-IO: the node's connection tasks share one [`NodeCapacity`] and
//! report each run's start, adoption and end. It is not a
//! [`Machine`](crate::Machine): every answer is synchronous (may this run
//! start?), it has no timer and nothing to output, and every connection's
//! task asks it under one lock.

use iop_wire::{AdapterKind, FailureCode};

/// One provider target's count.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TargetCount {
    adapter: AdapterKind,
    target: String,
    /// Its own limit, if it sets one.
    cap: Option<usize>,
    /// Runs attached to a connection now.
    running: usize,
}

/// What holds provider capacity besides the runs attached to a connection:
/// the parked durable runs (R-PARK-1), in all and on the target at hand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParkedRuns {
    /// Parked runs in all.
    pub total: usize,
    /// Parked runs on the target being admitted.
    pub on_target: usize,
}

/// The node's run count, over every connection (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCapacity {
    max_runs: usize,
    running: usize,
    targets: Vec<TargetCount>,
}

impl NodeCapacity {
    /// A node that runs at most `max_runs` at once (at least one).
    pub fn new(max_runs: usize) -> Self {
        Self {
            max_runs: max_runs.max(1),
            running: 0,
            targets: Vec::new(),
        }
    }

    /// Limit `adapter`/`target` to `cap` concurrent runs (at least one),
    /// whichever Edge dispatches them.
    #[must_use]
    pub fn with_target_cap(mut self, adapter: AdapterKind, target: &str, cap: usize) -> Self {
        let cap = Some(cap.max(1));
        match self.target_mut(adapter, target) {
            Some(t) => t.cap = cap,
            None => self.targets.push(TargetCount {
                adapter,
                target: target.to_owned(),
                cap,
                running: 0,
            }),
        }
        self
    }

    fn target_mut(&mut self, adapter: AdapterKind, target: &str) -> Option<&mut TargetCount> {
        self.targets
            .iter_mut()
            .find(|t| t.adapter == adapter && t.target == target)
    }

    fn count(&mut self, adapter: AdapterKind, target: &str) -> &mut TargetCount {
        let at = match self
            .targets
            .iter()
            .position(|t| t.adapter == adapter && t.target == target)
        {
            Some(at) => at,
            None => {
                self.targets.push(TargetCount {
                    adapter,
                    target: target.to_owned(),
                    cap: None,
                    running: 0,
                });
                self.targets.len() - 1
            }
        };
        &mut self.targets[at]
    }

    /// Admit a new run on `adapter`/`target`, with `parked` runs holding
    /// capacity too: `node_overloaded` when the node or the target is full.
    pub fn start(
        &mut self,
        adapter: AdapterKind,
        target: &str,
        parked: ParkedRuns,
    ) -> Result<(), FailureCode> {
        if self.running + parked.total >= self.max_runs {
            return Err(FailureCode::NodeOverloaded);
        }
        if let Some(t) = self.target_mut(adapter, target)
            && let Some(cap) = t.cap
            && t.running + parked.on_target >= cap
        {
            return Err(FailureCode::NodeOverloaded);
        }
        self.running += 1;
        self.count(adapter, target).running += 1;
        Ok(())
    }

    /// A parked run is adopted by a connection (R-PARK-2): it held its
    /// capacity while parked and now holds it attached; never refused.
    pub fn adopt(&mut self, adapter: AdapterKind, target: &str) {
        self.running += 1;
        self.count(adapter, target).running += 1;
    }

    /// A run started or adopted on `adapter`/`target` left its connection
    /// (ended, or parked: then [`ParkedRuns`] counts it).
    pub fn finish(&mut self, adapter: AdapterKind, target: &str) {
        self.running = self.running.saturating_sub(1);
        if let Some(t) = self.target_mut(adapter, target) {
            t.running = t.running.saturating_sub(1);
        }
        // A target without a cap is forgotten once idle.
        self.targets.retain(|t| t.cap.is_some() || t.running > 0);
    }

    /// Runs attached to a connection now, in all.
    pub fn running(&self) -> usize {
        self.running
    }

    /// Runs attached now on `adapter`/`target`.
    pub fn running_on(&self, adapter: AdapterKind, target: &str) -> usize {
        self.targets
            .iter()
            .find(|t| t.adapter == adapter && t.target == target)
            .map_or(0, |t| t.running)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: ParkedRuns = ParkedRuns {
        total: 0,
        on_target: 0,
    };

    #[test]
    fn r_multi_1_the_node_limit_holds_over_every_connection() {
        let mut c = NodeCapacity::new(2);
        assert_eq!(c.start(AdapterKind::OpenAi, "a", NONE), Ok(()));
        assert_eq!(c.start(AdapterKind::OpenAi, "b", NONE), Ok(()));
        assert_eq!(
            c.start(AdapterKind::OpenAi, "a", NONE),
            Err(FailureCode::NodeOverloaded)
        );
        c.finish(AdapterKind::OpenAi, "b");
        assert_eq!(c.start(AdapterKind::OpenAi, "a", NONE), Ok(()));
        assert_eq!(c.running(), 2);
        assert_eq!(c.running_on(AdapterKind::OpenAi, "a"), 2);
    }

    #[test]
    fn r_multi_1_a_target_cap_bounds_that_target_only() {
        let mut c = NodeCapacity::new(10).with_target_cap(AdapterKind::OpenAi, "small", 1);
        assert_eq!(c.start(AdapterKind::OpenAi, "small", NONE), Ok(()));
        assert_eq!(
            c.start(AdapterKind::OpenAi, "small", NONE),
            Err(FailureCode::NodeOverloaded),
            "a second run on a target of one"
        );
        // Another target, and the same name under another adapter, are not
        // held back.
        assert_eq!(c.start(AdapterKind::OpenAi, "big", NONE), Ok(()));
        assert_eq!(c.start(AdapterKind::Ollama, "small", NONE), Ok(()));
        c.finish(AdapterKind::OpenAi, "small");
        assert_eq!(c.start(AdapterKind::OpenAi, "small", NONE), Ok(()));
    }

    #[test]
    fn r_park_1_parked_runs_hold_capacity_and_their_adoption_is_not_counted_twice() {
        let mut c = NodeCapacity::new(2).with_target_cap(AdapterKind::Mock, "m", 2);
        assert_eq!(c.start(AdapterKind::Mock, "m", NONE), Ok(()));
        // The run parks: it leaves its connection and is counted parked.
        c.finish(AdapterKind::Mock, "m");
        let one_parked = ParkedRuns {
            total: 1,
            on_target: 1,
        };
        assert_eq!(c.start(AdapterKind::Mock, "m", one_parked), Ok(()));
        assert_eq!(
            c.start(AdapterKind::Mock, "m", one_parked),
            Err(FailureCode::NodeOverloaded),
            "the parked run still holds its provider call"
        );
        // At the limit, its adoption is never refused.
        c.adopt(AdapterKind::Mock, "m");
        assert_eq!(c.running(), 2);
        assert_eq!(
            c.start(AdapterKind::Mock, "m", NONE),
            Err(FailureCode::NodeOverloaded)
        );
    }

    #[test]
    fn the_overload_is_retryable_so_the_edge_re_admits_elsewhere() {
        assert!(crate::retry::class_may_fail_over(
            FailureCode::NodeOverloaded,
            None
        ));
    }

    #[test]
    fn an_adoption_counts_on_its_own_target_and_targets_are_told_apart() {
        let mut c = NodeCapacity::new(10);
        c.start(AdapterKind::OpenAi, "a", NONE).unwrap();
        c.start(AdapterKind::OpenAi, "a", NONE).unwrap();
        c.adopt(AdapterKind::OpenAi, "b");
        assert_eq!(c.running(), 3);
        assert_eq!(c.running_on(AdapterKind::OpenAi, "a"), 2);
        assert_eq!(c.running_on(AdapterKind::OpenAi, "b"), 1);
        assert_eq!(c.running_on(AdapterKind::Ollama, "a"), 0);
        assert_eq!(c.running_on(AdapterKind::Ollama, "b"), 0);
        c.adopt(AdapterKind::OpenAi, "b");
        assert_eq!(c.running_on(AdapterKind::OpenAi, "b"), 2);
    }

    #[test]
    fn finish_without_start_never_underflows() {
        let mut c = NodeCapacity::new(1);
        c.finish(AdapterKind::Mock, "x");
        assert_eq!(c.running(), 0);
        assert_eq!(c.start(AdapterKind::Mock, "x", NONE), Ok(()));
    }
}
