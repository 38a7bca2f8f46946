//! The connection-scoped transport Session's health observation sequence
//! (R-SEQ-1).
//!
//! Every finalized health observation a Node makes on one connection (a
//! normalized run's stall terminal, a tunnel's stall terminal, a
//! `Capabilities` answer) carries `health_observation_seq`, drawn from the
//! one [`ObservationSequence`] of that connection. The Edge applies
//! `unavailable` evidence only when its sequence is strictly newer than the
//! last one it applied (R-OVL-2, R-CAP-1), so the values must be unique and
//! strictly increasing across every kind of observation on the connection.
//!
//! A new connection starts a new sequence at 0: its first finalized
//! observation is 1. A path with no bound connection has no sequence and
//! omits the key.

/// The monotonic health observation sequence of one connection (R-SEQ-1).
///
/// Owned by the connection's Session; normalized runs, tunnels and
/// `Capabilities` answers all take from the same value, so concurrent
/// observations get unique, increasing values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObservationSequence {
    /// The last value handed out; 0 before the first observation.
    last_taken: u64,
}

impl ObservationSequence {
    /// The sequence of a new connection: nothing taken yet, the next value is 1.
    pub const fn new() -> Self {
        Self { last_taken: 0 }
    }

    /// Take the value for an observation being finalized now.
    ///
    /// The first call returns 1; every later call returns a strictly greater
    /// value. (It saturates at `u64::MAX`, which 2^64 observations on one
    /// connection never reach.)
    #[must_use = "a taken sequence value belongs on the observation being finalized"]
    pub fn take(&mut self) -> u64 {
        self.last_taken = self.last_taken.saturating_add(1);
        self.last_taken
    }

    /// The value the next [`take`](Self::take) will return, without
    /// consuming it (`TransportStatusReport::next_health_observation_seq`).
    pub const fn peek_next(&self) -> u64 {
        self.last_taken.saturating_add(1)
    }

    /// The last value handed out, `None` before the first observation.
    pub const fn last_taken(&self) -> Option<u64> {
        match self.last_taken {
            0 => None,
            n => Some(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_connection_starts_at_zero_and_first_observation_is_one() {
        let mut seq = ObservationSequence::new();
        assert_eq!(seq.last_taken(), None);
        assert_eq!(seq.peek_next(), 1);
        assert_eq!(seq.take(), 1);
        assert_eq!(seq.last_taken(), Some(1));
        assert_eq!(ObservationSequence::default(), ObservationSequence::new());
    }

    #[test]
    fn peek_next_does_not_consume() {
        let mut seq = ObservationSequence::new();
        assert_eq!(seq.peek_next(), 1);
        assert_eq!(seq.peek_next(), 1);
        assert_eq!(seq.take(), 1);
        assert_eq!(seq.peek_next(), 2);
        assert_eq!(seq.take(), 2);
    }

    #[test]
    fn taken_values_are_unique_and_strictly_increasing() {
        let mut seq = ObservationSequence::new();
        let mut previous = 0;
        for _ in 0..1000 {
            let next = seq.peek_next();
            let taken = seq.take();
            assert_eq!(taken, next);
            assert!(taken > previous);
            previous = taken;
        }
        assert_eq!(previous, 1000);
    }

    #[test]
    fn a_new_connection_restarts_the_sequence() {
        let mut old = ObservationSequence::new();
        for _ in 0..5 {
            let _ = old.take();
        }
        let mut new = ObservationSequence::new();
        assert_eq!(new.take(), 1);
        assert_eq!(old.take(), 6);
    }
}
