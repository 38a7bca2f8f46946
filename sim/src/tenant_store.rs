//! The simulated shared store of tenants' counters (SPEC §9, R-TEN-3): the
//! store every Edge of a world claims its allowances from, as
//! `iop_store::TenantStore` does for `iop-edge` (its memory store's
//! semantics: one counter per (subject, meter, window), each claim decided
//! by core's [`check_claim`]), in the world's virtual time.
//!
//! A claim is two hops, as a NATS key-value bucket serves it: read the
//! counter and its revision, then write [`check_claim`]'s total by
//! compare-and-set on that revision. A write that lost the race (another
//! Edge's claim landed in between) reads again, at most
//! [`MAX_CLAIM_TRIES`] times before the claim fails. The world gives each
//! hop a seeded latency and, while faults are on, fails operations
//! (nothing written), loses the answer of a written claim (the Edge takes
//! the store as failed: that allowance is lost, never granted twice) and
//! takes the store down for a while.
//!
//! A stopping Edge's give-back (R-TEN-3) is one compare-and-set on the
//! counter as stored, decided by core's [`check_give_back`]: the counter
//! records the holders whose give-back it took, so one sent again frees
//! nothing more.

use std::collections::{BTreeMap, BTreeSet};

use iop_core::Instant;
use iop_core::tenant::slots::{SlotAsk, SlotBook};
use iop_core::tenant::{ClaimedCounter, CounterKey, GiveBackOutcome, check_claim, check_give_back};

/// Reads and compare-and-sets one claim may take before it fails (the
/// stores retry a lost race a bounded number of times).
pub const MAX_CLAIM_TRIES: u32 = 8;

/// One counter as the store keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Counter {
    /// Claimed by the Edges so far, net of what was given back.
    claimed: u64,
    /// The holders whose give-back it took.
    gave_back: BTreeSet<String>,
    /// The tightest limit a claim named (the check's bound).
    limit: u64,
    /// Its revision (0: never written).
    revision: u64,
}

/// The store's counters.
#[derive(Debug, Default)]
pub struct SimTenantStore {
    counters: BTreeMap<CounterKey, Counter>,
    /// Concurrency gauges (R-TEN-1): who holds how many slots, and the
    /// tightest limit an ask named.
    slots: BTreeMap<CounterKey, (SlotBook, u64)>,
    /// The last revision given out (revisions only grow).
    revision: u64,
    /// Down (every operation fails) until then.
    down_until: Option<Instant>,
    /// Claims written.
    pub writes: u64,
    /// What give-backs freed, over every counter.
    pub given_back: u64,
    /// Compare-and-sets that lost their race.
    pub conflicts: u64,
}

impl SimTenantStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the store answers at `now`.
    pub fn is_up(&self, now: Instant) -> bool {
        self.down_until.is_none_or(|until| now >= until)
    }

    /// Take the store down until `until` (an outage).
    pub fn down_until(&mut self, until: Instant) {
        self.down_until = Some(self.down_until.map_or(until, |u| u.max(until)));
    }

    /// The store answers again at once (the faults stopped).
    pub fn heal(&mut self) {
        self.down_until = None;
    }

    /// Read `counter`: (claimed, revision).
    pub fn read(&self, counter: &CounterKey) -> (u64, u64) {
        self.counters
            .get(counter)
            .map_or((0, 0), |c| (c.claimed, c.revision))
    }

    /// Write a claim of `amount` of `counter` (limit `limit`) decided on
    /// `claimed` as read at `revision`: the amount granted, or `None` when
    /// the counter changed since (the caller reads again).
    pub fn compare_and_claim(
        &mut self,
        counter: &CounterKey,
        revision: u64,
        claimed: u64,
        amount: u64,
        limit: u64,
    ) -> Option<u64> {
        let stored = self.counters.get(counter).cloned().unwrap_or_default();
        if stored.revision != revision {
            self.conflicts += 1;
            return None;
        }
        let (total, granted) = check_claim(claimed, amount, limit);
        self.revision += 1;
        self.writes += 1;
        self.counters.insert(
            counter.clone(),
            Counter {
                claimed: total,
                gave_back: stored.gave_back,
                limit: if stored.limit == 0 {
                    limit
                } else {
                    stored.limit.min(limit)
                },
                revision: self.revision,
            },
        );
        Some(granted)
    }

    /// `holder`'s give-back of `amount` of `counter` at `now_unix_ms`, as
    /// core's [`check_give_back`] decides on the counter as stored (one
    /// compare-and-set: the total and its record of who gave back are one
    /// value): what it came to.
    pub fn give_back(
        &mut self,
        counter: &CounterKey,
        holder: &str,
        amount: u64,
        now_unix_ms: u64,
    ) -> GiveBackOutcome {
        let stored = self.counters.get(counter).cloned().unwrap_or_default();
        let (written, outcome) = check_give_back(
            &ClaimedCounter {
                claimed: stored.claimed,
                gave_back: stored.gave_back.clone(),
            },
            counter,
            holder,
            amount,
            now_unix_ms,
        );
        if let Some(written) = written {
            self.revision += 1;
            self.writes += 1;
            self.given_back += outcome_freed(outcome);
            self.counters.insert(
                counter.clone(),
                Counter {
                    claimed: written.claimed,
                    gave_back: written.gave_back,
                    limit: stored.limit,
                    revision: self.revision,
                },
            );
        }
        outcome
    }

    /// Set `ask.holder`'s holding of `ask.counter`'s slots (limit
    /// `ask.limit`) to `ask.want` at `ask.now_unix_ms`, as core's
    /// [`SlotBook::hold`] decides (one compare-and-set: the gauge's record
    /// is one key): what it holds now.
    pub fn hold_slots(&mut self, ask: &SlotAsk) -> u64 {
        let (book, tightest) = self.slots.entry(ask.counter.clone()).or_default();
        *tightest = if *tightest == 0 {
            ask.limit
        } else {
            (*tightest).min(ask.limit)
        };
        self.writes += 1;
        book.hold_ask(ask)
    }

    /// R-TEN-3: no gauge's live slots exceed its limit at `now_unix_ms`.
    pub fn slots_over_limit(&self, now_unix_ms: u64) -> Option<(&CounterKey, u64, u64)> {
        self.slots
            .iter()
            .map(|(k, (book, limit))| (k, book.total(now_unix_ms), *limit))
            .find(|(_, held, limit)| held > limit)
    }

    /// R-TEN-3: no counter is claimed past its limit. The first counter
    /// that is, if any: (counter, claimed, limit).
    pub fn over_limit(&self) -> Option<(&CounterKey, u64, u64)> {
        self.counters
            .iter()
            .find(|(_, c)| c.claimed > c.limit)
            .map(|(k, c)| (k, c.claimed, c.limit))
    }
}

/// What a give-back freed.
fn outcome_freed(outcome: GiveBackOutcome) -> u64 {
    match outcome {
        GiveBackOutcome::Freed(n) => n,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use iop_core::tenant::{Meter, Subject};

    use super::*;

    fn counter() -> CounterKey {
        CounterKey {
            subject: Subject::Principal("p".into()),
            meter: Meter::Spend,
            window_unix_ms: 0,
        }
    }

    #[test]
    fn a_claim_that_lost_its_race_is_not_written_and_none_passes_the_limit() {
        let mut store = SimTenantStore::new();
        let c = counter();
        let (claimed_a, rev_a) = store.read(&c);
        let (claimed_b, rev_b) = store.read(&c);
        assert_eq!(
            store.compare_and_claim(&c, rev_a, claimed_a, 70, 100),
            Some(70)
        );
        // B read before A wrote: it must read again.
        assert_eq!(store.compare_and_claim(&c, rev_b, claimed_b, 70, 100), None);
        let (claimed, rev) = store.read(&c);
        assert_eq!(store.compare_and_claim(&c, rev, claimed, 70, 100), Some(30));
        assert_eq!(store.read(&c).0, 100);
        assert!(store.over_limit().is_none());
        assert_eq!(store.conflicts, 1);
    }

    #[test]
    fn r_ten_3_a_give_back_sent_twice_frees_once_and_a_claim_read_before_it_reads_again() {
        let mut store = SimTenantStore::new();
        let c = counter();
        let (claimed, rev) = store.read(&c);
        assert_eq!(store.compare_and_claim(&c, rev, claimed, 70, 100), Some(70));
        let (claimed_b, rev_b) = store.read(&c);
        assert_eq!(
            store.give_back(&c, "edge-a", 50, 0),
            GiveBackOutcome::Freed(50)
        );
        assert_eq!(
            store.give_back(&c, "edge-a", 50, 0),
            GiveBackOutcome::AlreadyGivenBack
        );
        assert_eq!(store.read(&c).0, 20);
        assert_eq!(
            store.compare_and_claim(&c, rev_b, claimed_b, 80, 100),
            None,
            "read before the give-back: read again"
        );
        let (claimed, rev) = store.read(&c);
        assert_eq!(store.compare_and_claim(&c, rev, claimed, 90, 100), Some(80));
        assert_eq!(
            store.give_back(&c, "edge-a", 50, 0),
            GiveBackOutcome::AlreadyGivenBack,
            "the record survives a claim"
        );
        assert_eq!(store.read(&c).0, 100);
        assert!(store.over_limit().is_none());
        assert_eq!(store.given_back, 50);
    }
}
