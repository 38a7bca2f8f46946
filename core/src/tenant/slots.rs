//! Requests in flight across Edges (R-TEN-1, R-TEN-3): the shared gauge
//! of a subject's concurrency limit, as the store keeps it.
//!
//! Each Edge process holds *slots* of a subject's limit, leased from one
//! record in the store, the [`SlotBook`]: per holder (an Edge process),
//! how many slots it holds and until when. An Edge admits a request into a
//! slot it holds (plus one chunk on credit while its ask is on its way, as
//! for the windowed counters), asks for more when its spare runs low and
//! gives back what it holds beyond one chunk of spare. Every ask sets the
//! holder's whole holding ([`SlotBook::hold`]: idempotent, so an answer
//! lost on its way leaks nothing) and renews its lease; a holder that does
//! not renew within its lease (a dead or cut-off Edge) no longer counts,
//! so a dead Edge's slots come back once its lease lapses.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::CounterKey;

/// The most holders one gauge keeps: an ask of a new holder beyond it is
/// granted nothing (bounded per subject, R-LIM-5).
pub const MAX_SLOT_HOLDERS: usize = 256;

/// The longest holder id a gauge keeps, bytes.
pub const MAX_SLOT_HOLDER_BYTES: usize = 128;

/// One holder's slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotHold {
    /// Slots held.
    pub held: u64,
    /// Until when (Unix ms), unless renewed.
    pub expires_unix_ms: u64,
}

/// A subject's concurrency gauge in the store: who holds how many of its
/// slots.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotBook {
    /// Per holder (an Edge process's id).
    pub holders: BTreeMap<String, SlotHold>,
}

impl SlotBook {
    /// Decide `holder`'s ask to hold `want` slots of a gauge whose limit is
    /// `limit`, at `now_unix_ms` (R-TEN-3; every store applies it inside
    /// its compare-and-set): holders whose lease lapsed are dropped; asking
    /// for no more than it holds, the holder keeps `want` (giving the rest
    /// back); asking for more, it gets what the others leave of the limit,
    /// never less than it held. Its lease runs `lease_ms` from now. Returns
    /// what it holds now (0: it is no longer a holder).
    pub fn hold(
        &mut self,
        holder: &str,
        want: u64,
        limit: u64,
        now_unix_ms: u64,
        lease_ms: u64,
    ) -> u64 {
        self.holders
            .retain(|_, h| h.expires_unix_ms > now_unix_ms && h.held > 0);
        let current = self.holders.get(holder).map_or(0, |h| h.held);
        let others: u64 = self
            .holders
            .iter()
            .filter(|(id, _)| id.as_str() != holder)
            .map(|(_, h)| h.held)
            .sum();
        let held = if want <= current {
            want
        } else {
            want.min(limit.saturating_sub(others).max(current))
        };
        let new_holder = !self.holders.contains_key(holder);
        if held == 0
            || (new_holder
                && (self.holders.len() >= MAX_SLOT_HOLDERS || holder.len() > MAX_SLOT_HOLDER_BYTES))
        {
            self.holders.remove(holder);
            return 0;
        }
        self.holders.insert(
            holder.to_owned(),
            SlotHold {
                held,
                expires_unix_ms: now_unix_ms.saturating_add(lease_ms),
            },
        );
        held
    }

    /// Slots held by live holders at `now_unix_ms`.
    pub fn total(&self, now_unix_ms: u64) -> u64 {
        self.holders
            .values()
            .filter(|h| h.expires_unix_ms > now_unix_ms)
            .map(|h| h.held)
            .sum()
    }

    /// Whether nobody holds a slot at `now_unix_ms` (the store may forget
    /// the gauge).
    pub fn is_empty(&self, now_unix_ms: u64) -> bool {
        self.total(now_unix_ms) == 0
    }

    /// Decide `ask` on this gauge: [`Self::hold`] with its terms.
    pub fn hold_ask(&mut self, ask: &SlotAsk) -> u64 {
        self.hold(
            &ask.holder,
            ask.want,
            ask.limit,
            ask.now_unix_ms,
            ask.lease_ms,
        )
    }
}

/// An Edge process's ask to hold slots of a concurrency gauge, as a store
/// takes it (R-TEN-1, R-TEN-3): [`SlotBook::hold`] decides it on the gauge
/// as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotAsk {
    /// The gauge (meter `Slots`, window 0).
    pub counter: CounterKey,
    /// The Edge process's id.
    pub holder: String,
    /// The holding asked for (0: give every slot back).
    pub want: u64,
    /// The gauge's limit.
    pub limit: u64,
    /// The asker's wall clock, Unix ms.
    pub now_unix_ms: u64,
    /// The lease, from `now_unix_ms`.
    pub lease_ms: u64,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn r_ten_3_a_gauge_grants_within_its_limit_gives_back_and_forgets_lapsed_holders() {
        let mut book = SlotBook::default();
        assert_eq!(book.hold("a", 3, 4, 1_000, 10_000), 3);
        assert_eq!(book.hold("b", 3, 4, 1_000, 10_000), 1, "what a leaves");
        assert_eq!(
            book.hold("b", 3, 4, 1_000, 10_000),
            1,
            "asked again: the same"
        );
        assert_eq!(book.hold("a", 1, 4, 2_000, 10_000), 1, "given back");
        assert_eq!(book.hold("b", 3, 4, 2_000, 10_000), 3);
        assert_eq!(book.total(2_000), 4);
        // a stops renewing: its slot comes back when its lease lapses.
        assert_eq!(book.hold("b", 4, 4, 11_999, 10_000), 3, "a still holds 1");
        assert_eq!(book.hold("b", 4, 4, 12_000, 10_000), 4, "a lapsed");
        assert!(!book.holders.contains_key("a"));
        assert_eq!(book.hold("b", 0, 4, 12_000, 10_000), 0);
        assert!(book.is_empty(12_000) && book.holders.is_empty());
        // A lower limit never takes back what a holder holds.
        assert_eq!(book.hold("c", 4, 4, 0, 10_000), 4);
        assert_eq!(book.hold("c", 5, 2, 0, 10_000), 4);
    }

    proptest! {
        /// R-TEN-3: whatever the holders ask, in any order, the live slots
        /// never exceed the limit (unless one holder kept what it held
        /// under a limit since lowered, which asks here never do).
        #[test]
        fn r_ten_3_live_slots_never_exceed_the_limit(
            asks in proptest::collection::vec((0usize..5, 0u64..8, 0u64..30_000), 1..200),
        ) {
            let mut book = SlotBook::default();
            let mut now = 0;
            for (holder, want, step) in asks {
                now += step / 10;
                book.hold(&format!("edge-{holder}"), want, 6, now, 10_000);
                prop_assert!(book.total(now) <= 6);
            }
        }
    }
}
