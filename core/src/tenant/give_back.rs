//! Giving back the unused rest of a window's chunks, exactly once
//! (R-TEN-2, R-TEN-3).
//!
//! A windowed counter (requests or tokens per minute, spend per budget
//! period) is one total of what every Edge claimed ([`check_claim`]
//! decides each claim). An Edge that stops gracefully gives back what it
//! claimed and did not use, so the other Edges may claim it before the
//! window ends. A give-back is a decrement of that total, so it must be
//! applied at most once: one sent again after its answer was lost (or
//! timed out) would free the allowance twice and let the Edges claim past
//! the limit. The counter as stored ([`ClaimedCounter`]) therefore records
//! the holders (Edge processes) that gave back, and [`check_give_back`]
//! decides inside the same compare-and-set as the decrement: a holder
//! recorded gives back nothing more. The record is bounded
//! ([`MAX_GIVE_BACKS`]); past it a give-back is refused and the allowance
//! stays claimed, which errs on the side of refusing.
//!
//! [`check_claim`]: super::check_claim

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::slots::MAX_SLOT_HOLDER_BYTES;
use super::{CounterKey, DAY_MS, MINUTE_MS, Meter};

/// The most holders one windowed counter records as having given back
/// (bounded per counter, R-LIM-5): a give-back of another holder is
/// refused ([`GiveBackOutcome::Full`]).
pub const MAX_GIVE_BACKS: usize = 64;

/// The longest holder id a counter records, bytes (a longer one's
/// give-back is refused).
pub const MAX_GIVE_BACK_HOLDER_BYTES: usize = MAX_SLOT_HOLDER_BYTES;

/// A windowed counter as a store keeps it (R-TEN-3): what the Edges
/// claimed of the window's allowance, and which holders gave back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimedCounter {
    /// Claimed so far, net of what was given back.
    pub claimed: u64,
    /// The holders (Edge processes) whose give-back was applied (at most
    /// [`MAX_GIVE_BACKS`]).
    pub gave_back: BTreeSet<String>,
}

/// What a give-back came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GiveBackOutcome {
    /// Applied now: this much was freed (less than asked only when the
    /// counter held less; 0 when it held nothing).
    Freed(u64),
    /// This holder's give-back was applied before (this one is a retry):
    /// nothing more is freed.
    AlreadyGivenBack,
    /// The counter records [`MAX_GIVE_BACKS`] holders already (or the
    /// holder's id is too long): refused, the allowance stays claimed.
    Full,
    /// The counter's window is over (or nothing was asked): nothing to do.
    WindowOver,
}

impl GiveBackOutcome {
    /// The stable lower-case name (logs).
    pub fn as_str(self) -> &'static str {
        match self {
            GiveBackOutcome::Freed(_) => "freed",
            GiveBackOutcome::AlreadyGivenBack => "already_given_back",
            GiveBackOutcome::Full => "full",
            GiveBackOutcome::WindowOver => "window_over",
        }
    }
}

/// Whether `counter`'s window is surely over at `now_unix_ms`: a minute's
/// once the minute ended, a budget period's once the longest period (30
/// days) from its start ended; a budget in total, or a concurrency gauge,
/// never. (A day's budget is taken as over only then: a give-back to a
/// past day's counter frees what nobody claims from any more.)
pub fn window_over(counter: &CounterKey, now_unix_ms: u64) -> bool {
    match counter.meter {
        Meter::Requests | Meter::Tokens | Meter::JournalBytes | Meter::Background => {
            counter.window_unix_ms.saturating_add(MINUTE_MS) <= now_unix_ms
        }
        Meter::Spend => {
            counter.window_unix_ms != 0
                && counter.window_unix_ms.saturating_add(30 * DAY_MS) <= now_unix_ms
        }
        Meter::Slots => false,
    }
}

/// Decide `holder`'s give-back of `amount` of `key`, stored as `stored`,
/// at `now_unix_ms` (R-TEN-2, R-TEN-3; every store applies it inside the
/// compare-and-set of the counter): the counter to write (`None`: write
/// nothing) and the outcome.
///
/// * The window is over, or `amount` is 0: nothing ([`GiveBackOutcome::WindowOver`]).
/// * `holder` gave back before: nothing ([`GiveBackOutcome::AlreadyGivenBack`]),
///   so a retried give-back frees once.
/// * [`MAX_GIVE_BACKS`] holders recorded, or an id longer than
///   [`MAX_GIVE_BACK_HOLDER_BYTES`]: refused ([`GiveBackOutcome::Full`]).
/// * Otherwise the total goes down by `amount`, never below zero, and
///   `holder` is recorded, even when nothing was left to free (a retry
///   after a claim of another Edge must not free that claim).
pub fn check_give_back(
    stored: &ClaimedCounter,
    key: &CounterKey,
    holder: &str,
    amount: u64,
    now_unix_ms: u64,
) -> (Option<ClaimedCounter>, GiveBackOutcome) {
    if amount == 0 || window_over(key, now_unix_ms) {
        return (None, GiveBackOutcome::WindowOver);
    }
    if stored.gave_back.contains(holder) {
        return (None, GiveBackOutcome::AlreadyGivenBack);
    }
    if stored.gave_back.len() >= MAX_GIVE_BACKS || holder.len() > MAX_GIVE_BACK_HOLDER_BYTES {
        return (None, GiveBackOutcome::Full);
    }
    let claimed = stored.claimed.saturating_sub(amount);
    let freed = stored.claimed - claimed;
    let mut gave_back = stored.gave_back.clone();
    gave_back.insert(holder.to_owned());
    (
        Some(ClaimedCounter { claimed, gave_back }),
        GiveBackOutcome::Freed(freed),
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::super::{Subject, check_claim};
    use super::*;

    const T0: u64 = 1_800_000_000_000 - 1_800_000_000_000 % MINUTE_MS;

    fn spend() -> CounterKey {
        CounterKey {
            subject: Subject::Principal("p".into()),
            meter: Meter::Spend,
            window_unix_ms: T0 - T0 % (30 * DAY_MS),
        }
    }

    fn give(c: &mut ClaimedCounter, holder: &str, amount: u64) -> GiveBackOutcome {
        let (written, outcome) = check_give_back(c, &spend(), holder, amount, T0);
        if let Some(written) = written {
            *c = written;
        }
        outcome
    }

    #[test]
    fn r_ten_3_a_retried_give_back_frees_once() {
        let mut c = ClaimedCounter {
            claimed: 100,
            ..ClaimedCounter::default()
        };
        assert_eq!(give(&mut c, "a", 30), GiveBackOutcome::Freed(30));
        assert_eq!(c.claimed, 70);
        // The answer was lost: sent again, it frees nothing more.
        assert_eq!(give(&mut c, "a", 30), GiveBackOutcome::AlreadyGivenBack);
        assert_eq!(c.claimed, 70);
        // Another holder's is its own.
        assert_eq!(give(&mut c, "b", 10), GiveBackOutcome::Freed(10));
        assert_eq!(c.claimed, 60);
    }

    #[test]
    fn r_ten_3_a_give_back_never_goes_below_zero_and_is_recorded_even_then() {
        let mut c = ClaimedCounter {
            claimed: 5,
            ..ClaimedCounter::default()
        };
        assert_eq!(give(&mut c, "a", 30), GiveBackOutcome::Freed(5));
        assert_eq!(c.claimed, 0);
        // Nothing held at all (the counter was lost): recorded still, so
        // a retry after another Edge's claim frees none of that claim.
        let mut empty = ClaimedCounter::default();
        assert_eq!(give(&mut empty, "a", 30), GiveBackOutcome::Freed(0));
        let (total, granted) = check_claim(empty.claimed, 40, 100);
        empty.claimed = total;
        assert_eq!(granted, 40);
        assert_eq!(give(&mut empty, "a", 30), GiveBackOutcome::AlreadyGivenBack);
        assert_eq!(empty.claimed, 40);
    }

    #[test]
    fn r_ten_3_give_backs_past_the_bound_are_refused_and_stay_claimed() {
        let mut c = ClaimedCounter {
            claimed: 1_000,
            ..ClaimedCounter::default()
        };
        for i in 0..MAX_GIVE_BACKS {
            assert_eq!(give(&mut c, &format!("h{i}"), 1), GiveBackOutcome::Freed(1));
        }
        let before = c.clone();
        assert_eq!(give(&mut c, "one-more", 1), GiveBackOutcome::Full);
        assert_eq!(c, before, "nothing written");
        let long = "x".repeat(MAX_GIVE_BACK_HOLDER_BYTES + 1);
        let mut d = ClaimedCounter {
            claimed: 10,
            ..ClaimedCounter::default()
        };
        assert_eq!(give(&mut d, &long, 1), GiveBackOutcome::Full);
        assert_eq!(d.claimed, 10);
    }

    #[test]
    fn r_ten_3_a_give_back_to_a_window_that_is_over_is_a_no_op() {
        let minute = CounterKey {
            subject: Subject::Key("k".into()),
            meter: Meter::Requests,
            window_unix_ms: T0,
        };
        let c = ClaimedCounter {
            claimed: 10,
            ..ClaimedCounter::default()
        };
        let live = check_give_back(&c, &minute, "a", 4, T0 + MINUTE_MS - 1);
        assert_eq!(live.1, GiveBackOutcome::Freed(4));
        assert_eq!(
            check_give_back(&c, &minute, "a", 4, T0 + MINUTE_MS),
            (None, GiveBackOutcome::WindowOver)
        );
        let month = spend();
        assert!(!window_over(&month, month.window_unix_ms + 30 * DAY_MS - 1));
        assert!(window_over(&month, month.window_unix_ms + 30 * DAY_MS));
        let total = CounterKey {
            window_unix_ms: 0,
            ..spend()
        };
        assert!(
            !window_over(&total, u64::MAX),
            "a budget in total never ends"
        );
        assert_eq!(
            check_give_back(&c, &minute, "a", 0, T0),
            (None, GiveBackOutcome::WindowOver),
            "nothing asked, nothing written"
        );
    }

    /// One step of holders sharing a counter.
    #[derive(Debug, Clone)]
    enum Op {
        /// Holder `h` claims `amount`.
        Claim { h: usize, amount: u64 },
        /// Holder `h` gives back `frac`/4 of what it holds unused (as an
        /// Edge does once, at its stop), sent `times` times (retries).
        GiveBack { h: usize, frac: u64, times: u32 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0..6usize, 1..40u64).prop_map(|(h, amount)| Op::Claim { h, amount }),
            1 => (0..6usize, 0..=4u64, 1..4u32).prop_map(|(h, frac, times)| Op::GiveBack { h, frac, times }),
        ]
    }

    proptest! {
        /// R-TEN-2, R-TEN-3: whatever the claims and give-backs, and
        /// however often each give-back is sent again, the claimed total
        /// never drops below what the holders that did not give back
        /// claimed (nor below each giver's claims net of its one
        /// give-back), and never passes the limit.
        #[test]
        fn r_ten_3_retried_give_backs_never_free_what_others_claimed(
            ops in prop::collection::vec(op(), 1..80),
            limit in 1..300u64,
        ) {
            let mut c = ClaimedCounter::default();
            // Per holder: granted, given back (once).
            let mut granted: BTreeMap<usize, u64> = BTreeMap::new();
            let mut given: BTreeMap<usize, u64> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Claim { h, amount } => {
                        let (total, got) = check_claim(c.claimed, amount, limit);
                        c.claimed = total;
                        *granted.entry(h).or_default() += got;
                    }
                    Op::GiveBack { h, frac, times } => {
                        let held = granted.get(&h).copied().unwrap_or(0);
                        let amount = held * frac / 4;
                        for _ in 0..times {
                            let (written, outcome) =
                                check_give_back(&c, &spend(), &format!("h{h}"), amount, T0);
                            if let Some(written) = written {
                                c = written;
                            }
                            if let GiveBackOutcome::Freed(n) = outcome {
                                prop_assert!(n <= amount);
                                prop_assert!(!given.contains_key(&h), "freed twice");
                                given.insert(h, n);
                            }
                        }
                    }
                }
                prop_assert!(c.claimed <= limit);
                let kept: u64 = granted
                    .iter()
                    .filter(|(h, _)| !given.contains_key(h))
                    .map(|(_, g)| *g)
                    .sum();
                prop_assert!(c.claimed >= kept, "{} < {kept}", c.claimed);
                let net: u64 = granted
                    .iter()
                    .map(|(h, g)| g.saturating_sub(given.get(h).copied().unwrap_or(0)))
                    .sum();
                prop_assert!(c.claimed >= net, "{} < {net}", c.claimed);
            }
        }
    }
}
