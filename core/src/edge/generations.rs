//! Generations durable before use, without a disk sync on the task that
//! serves every registration (R-GEN-1 across restarts, R-LIM-4).
//!
//! R-GEN-1 needs every generation handed out to be below the floor of the
//! Edge's next start, so the high-water mark must be durable before a
//! generation is used. Syncing the mark on every registration would put a
//! disk sync on the hub's task. Instead the Edge keeps a *reservation*:
//! a mark persisted ahead of the generations handed out. A generation at
//! or below the durable mark may be used at once; when less than half of
//! [`RESERVE_AHEAD`] is left, the shell persists a new mark off the task
//! ([`GenerationReserve::poll_save`]) and reports it
//! ([`GenerationReserve::saved`]). A generation past the durable mark (the
//! save failed, or registrations outran it) is refused: the registration
//! is rejected and the node retries, never dispatched to on a generation
//! that a restart could hand out again.
//!
//! At start, before serving, the shell persists [`initial_mark`] for the
//! floor it read; the next start's floor is at least that mark, so it is
//! greater than every generation this run can hand out.

use crate::edge::registry::GENERATION_LIMIT;
use crate::ids::Generation;

/// How far ahead of the generations handed out the persisted mark runs.
pub const RESERVE_AHEAD: u64 = 4096;

/// The range of the random offset a new Edge process adds to its floor.
pub const START_OFFSET_RANGE: u64 = 1 << 20;

/// The generation floor of a new Edge process: `floor` (the larger of the
/// persisted mark and the wall clock in milliseconds) plus a random offset
/// under [`START_OFFSET_RANGE`] drawn from `random`. Two Edges started in
/// the same millisecond would otherwise hand a node the same generations,
/// and their runs the same keys (R-MULTI-1); the floor only grows, so
/// R-GEN-1 holds across restarts.
pub fn start_floor(floor: Generation, random: u64) -> Generation {
    floor
        .saturating_add(random % START_OFFSET_RANGE)
        .min(GENERATION_LIMIT)
}

/// A persisted generation mark that leaves no generation to hand out
/// (R-GEN-1 forbids wrapping): the Edge refuses to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("generation high-water mark {mark} is not below the limit {GENERATION_LIMIT}")]
pub struct MarkAtLimit {
    /// The mark read.
    pub mark: Generation,
}

/// The floor a new Edge process starts from, before [`start_floor`]'s
/// offset: the larger of the persisted mark (`0` when there is none) and
/// the wall clock in milliseconds, so generations keep increasing across
/// restarts even if the mark is lost (as long as the clock does not jump
/// back), and across clock jumps while the mark survives (R-GEN-1 across
/// restarts). A mark at or past [`GENERATION_LIMIT`] refuses the start.
pub fn restart_floor(persisted: Generation, unix_ms: u64) -> Result<Generation, MarkAtLimit> {
    if persisted >= GENERATION_LIMIT {
        return Err(MarkAtLimit { mark: persisted });
    }
    Ok(persisted.max(unix_ms))
}

/// The first mark to persist at start, for the generation `floor` read
/// from the store and the clock.
pub fn initial_mark(floor: Generation) -> Generation {
    floor.saturating_add(RESERVE_AHEAD).min(GENERATION_LIMIT)
}

/// The durable reservation of generations (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerationReserve {
    /// Every generation at or below it may be used.
    durable: Generation,
    /// A save of this mark is in flight.
    pending: Option<Generation>,
}

impl GenerationReserve {
    /// A reservation whose mark `durable` is already persisted.
    pub fn new(durable: Generation) -> Self {
        Self {
            durable,
            pending: None,
        }
    }

    /// A reservation for a registry that needs none (no store: tests, the
    /// simulator): every generation is covered.
    pub fn unbounded() -> Self {
        Self::new(GENERATION_LIMIT)
    }

    /// The persisted mark.
    pub fn durable(&self) -> Generation {
        self.durable
    }

    /// Whether `generation` may be used: a restart cannot hand it out again.
    pub fn covers(&self, generation: Generation) -> bool {
        generation <= self.durable
    }

    /// After generations up to `high_water` were handed out: the mark to
    /// persist now, if a save is due (less than half the reserve left, or
    /// `high_water` already past the mark) and none is in flight.
    pub fn poll_save(&mut self, high_water: Generation) -> Option<Generation> {
        if self.pending.is_some() || self.durable >= GENERATION_LIMIT {
            return None;
        }
        let left = self.durable.saturating_sub(high_water);
        if left > RESERVE_AHEAD / 2 {
            return None;
        }
        let mark = high_water
            .saturating_add(RESERVE_AHEAD)
            .min(GENERATION_LIMIT);
        self.pending = Some(mark);
        Some(mark)
    }

    /// The save of `mark` is durable.
    pub fn saved(&mut self, mark: Generation) {
        if self.pending == Some(mark) {
            self.pending = None;
        }
        self.durable = self.durable.max(mark);
    }

    /// The save of `mark` failed: the next [`GenerationReserve::poll_save`]
    /// tries again.
    pub fn save_failed(&mut self, mark: Generation) {
        if self.pending == Some(mark) {
            self.pending = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r_gen_1_generations_up_to_the_durable_mark_are_used_without_a_save() {
        let floor = 1_000;
        let mut r = GenerationReserve::new(initial_mark(floor));
        for g in floor + 1..floor + RESERVE_AHEAD / 2 {
            assert!(r.covers(g));
            assert_eq!(r.poll_save(g), None, "no save while half is left");
        }
    }

    #[test]
    fn r_gen_1_a_save_runs_ahead_and_only_one_at_a_time() {
        let floor = 1_000;
        let mut r = GenerationReserve::new(initial_mark(floor));
        let high = floor + RESERVE_AHEAD / 2;
        let mark = r.poll_save(high).expect("half the reserve used");
        assert_eq!(mark, high + RESERVE_AHEAD);
        assert_eq!(r.poll_save(high + 1), None, "one save in flight");
        r.saved(mark);
        assert_eq!(r.durable(), mark);
        assert!(r.covers(mark) && !r.covers(mark + 1));
    }

    #[test]
    fn r_gen_1_a_generation_past_the_durable_mark_is_not_used_and_a_failed_save_is_retried() {
        let mut r = GenerationReserve::new(initial_mark(0));
        let past = RESERVE_AHEAD + 1;
        assert!(!r.covers(past), "a restart could hand it out again");
        let mark = r.poll_save(past).expect("due");
        r.save_failed(mark);
        assert!(!r.covers(past));
        let again = r.poll_save(past).expect("retried after a failure");
        r.saved(again);
        assert!(r.covers(past));
    }

    #[test]
    fn the_mark_never_passes_the_generation_limit() {
        assert_eq!(initial_mark(GENERATION_LIMIT - 1), GENERATION_LIMIT);
        let mut r = GenerationReserve::new(GENERATION_LIMIT);
        assert_eq!(r.poll_save(GENERATION_LIMIT - 1), None);
        assert!(GenerationReserve::unbounded().covers(GENERATION_LIMIT));
    }

    #[test]
    fn r_multi_1_two_edges_started_in_one_millisecond_start_apart_and_never_below_the_floor() {
        let floor = 1_796_180_068_867;
        let a = start_floor(floor, 17);
        let b = start_floor(floor, 900_001);
        assert_ne!(a, b);
        for random in [0, 1, START_OFFSET_RANGE - 1, START_OFFSET_RANGE, u64::MAX] {
            let start = start_floor(floor, random);
            assert!(start >= floor && start < floor + START_OFFSET_RANGE);
        }
        assert_eq!(
            start_floor(GENERATION_LIMIT - 1, u64::MAX),
            GENERATION_LIMIT
        );
    }

    #[test]
    fn r_gen_1_a_late_save_of_another_mark_leaves_the_pending_save_pending() {
        let floor = 1_000;
        let mut r = GenerationReserve::new(initial_mark(floor));
        let high = floor + RESERVE_AHEAD / 2;
        let mark = r.poll_save(high).expect("due");
        r.saved(floor);
        assert_eq!(
            r.poll_save(high),
            None,
            "the save of {mark} is still in flight"
        );
        r.save_failed(floor);
        assert_eq!(
            r.poll_save(high),
            None,
            "a failure of another mark changes nothing"
        );
        r.saved(mark);
        assert_eq!(r.durable(), mark);
    }

    #[test]
    fn a_late_save_of_an_older_mark_never_lowers_it() {
        let mut r = GenerationReserve::new(10_000);
        r.saved(9_000);
        assert_eq!(r.durable(), 10_000);
    }

    #[test]
    fn r_gen_1_a_restart_starts_from_the_larger_of_the_mark_and_the_clock() {
        assert_eq!(restart_floor(0, 5), Ok(5));
        assert_eq!(restart_floor(1_000, 5), Ok(1_000));
        assert_eq!(restart_floor(1_000, 2_000), Ok(2_000));
        assert_eq!(
            restart_floor(GENERATION_LIMIT - 1, 5),
            Ok(GENERATION_LIMIT - 1)
        );
        for mark in [GENERATION_LIMIT, u64::MAX] {
            assert_eq!(restart_floor(mark, 5), Err(MarkAtLimit { mark }));
        }
        assert!(
            MarkAtLimit { mark: u64::MAX }
                .to_string()
                .contains("generation")
        );
    }
}
