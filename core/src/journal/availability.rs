//! Whether the Edge's journal store can take durable requests now, and
//! when to try opening it again (R-JRN-6: a store outage degrades, never
//! stops).
//!
//! An Edge serves from its first moment: ephemeral requests need no
//! store. Its journal store (the embedded file, or NATS) is opened in the
//! background by the shell, as this machine says:
//!
//! 1. At start the store is [`StoreState::Connecting`]: an
//!    [`AvailabilityOutput::Open`] is due at once.
//! 2. The shell tries: opens the file or connects, takes this Edge's
//!    ownership lease (R-TAKE-1, R-TAKE-2) and reads the records it must
//!    watch over, then answers [`AvailabilityInput::Opened`] or
//!    [`AvailabilityInput::OpenFailed`]. A failure waits a bounded,
//!    jittered, doubling delay ([`REOPEN_BACKOFF`]) before the next
//!    attempt; attempts never stop.
//! 3. Once [`StoreState::Up`], durable requests are served. A store that
//!    fails in a way only reopening mends (its engine refuses every write
//!    after an I/O error) is reported [`AvailabilityInput::Broken`]: the
//!    machine asks the shell to [`AvailabilityOutput::Close`] it, then to
//!    open it again after the backoff ([`StoreState::Reopening`]).
//! 4. A store that refuses this Edge for good (another process renews its
//!    `edge_id`'s lease, R-TAKE-2) is [`StoreState::Refused`]: no attempt
//!    follows.
//!
//! Until it is up, [`Availability::durable_refusal`] answers why a
//! durable request is refused (503 `response_store_unavailable`, typed as
//! [`JournalError::Unavailable`](super::JournalError::Unavailable)); an
//! ephemeral request never asks.

use std::collections::VecDeque;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::liveness::backoff::{Backoff, BackoffConfig};
use crate::rng::SplitMix64;
use crate::time::Instant;

/// The delay between attempts to open the store: from a quarter second,
/// doubling, at most 5 s (jittered down to half), so a store that comes
/// back is used again within seconds.
pub const REOPEN_BACKOFF: BackoffConfig = BackoffConfig {
    initial: Duration::from_millis(250),
    max: Duration::from_secs(5),
};

/// Where the journal store stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreState {
    /// Never opened since the Edge started: being opened, or waiting to
    /// try again.
    Connecting,
    /// Open, this Edge's lease held: durable requests are served.
    Up,
    /// Was up; failed in a way only reopening mends: closed, being
    /// opened again.
    Reopening,
    /// The store refuses this Edge for good (its `edge_id` is another
    /// process's, R-TAKE-2); durable requests stay refused.
    Refused,
}

impl StoreState {
    /// Every state, in declaration order.
    pub const ALL: [StoreState; 4] = [
        StoreState::Connecting,
        StoreState::Up,
        StoreState::Reopening,
        StoreState::Refused,
    ];

    /// The stable lower-case name (a closed label value).
    pub fn as_str(self) -> &'static str {
        match self {
            StoreState::Connecting => "connecting",
            StoreState::Up => "up",
            StoreState::Reopening => "reopening",
            StoreState::Refused => "refused",
        }
    }
}

/// Why an attempt to open the store failed (a closed code; the shell logs
/// the detail).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpenFailure {
    /// The server could not be reached, or the file not opened (I/O).
    Unreachable,
    /// Not answered within its bound.
    Timeout,
    /// The embedded file is held by another process (or by this one's
    /// previous handle, still closing).
    Busy,
    /// The embedded file is not a readable journal.
    Damaged,
    /// The store exists with a layout this Edge cannot use (a stream
    /// configured otherwise, a file of an unknown format), or the server
    /// cannot make one as configured (its storage cannot be reserved).
    Incompatible,
    /// This Edge's ownership lease or its first takeover scan failed.
    Lease,
}

impl OpenFailure {
    /// The stable lower-case name (a closed label value).
    pub fn as_str(self) -> &'static str {
        match self {
            OpenFailure::Unreachable => "unreachable",
            OpenFailure::Timeout => "timeout",
            OpenFailure::Busy => "busy",
            OpenFailure::Damaged => "damaged",
            OpenFailure::Incompatible => "incompatible",
            OpenFailure::Lease => "lease",
        }
    }
}

/// What happens to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AvailabilityInput {
    /// The attempt in flight succeeded: the store answers, this Edge's
    /// lease is held and its first takeover scan read.
    Opened,
    /// The attempt in flight failed.
    OpenFailed(OpenFailure),
    /// The open store failed in a way only reopening mends (its engine
    /// refuses every write after an I/O error, its writer stopped).
    Broken,
    /// The store refuses this Edge for good (R-TAKE-2).
    Refused,
}

/// What the shell carries out, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AvailabilityOutput {
    /// Try to open the store now (attempts counted from 1 since the last
    /// time it was up); answer with [`AvailabilityInput::Opened`] or
    /// [`AvailabilityInput::OpenFailed`].
    Open {
        /// The attempt's number.
        attempt: u32,
    },
    /// Drop the open store (every handle the shell keeps) before it is
    /// opened again: an embedded file is opened by one handle at a time.
    Close,
    /// The state changed: log it, count it, show it.
    Changed {
        /// From.
        from: StoreState,
        /// To.
        to: StoreState,
    },
}

/// Why a durable request is refused now: the store is not up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unavailable {
    /// Where the store stands.
    pub state: StoreState,
    /// Why the last attempt failed, if one did.
    pub last_failure: Option<OpenFailure>,
}

/// The journal store's availability (see the module docs).
#[derive(Debug, Clone)]
pub struct Availability {
    state: StoreState,
    since: Instant,
    /// The next attempt, when none is in flight and one is due.
    next_attempt_at: Option<Instant>,
    in_flight: bool,
    attempts: u32,
    last_failure: Option<OpenFailure>,
    backoff: Backoff,
    rng: SplitMix64,
    outputs: VecDeque<AvailabilityOutput>,
}

/// What `/status` shows of the store's availability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AvailabilityView {
    /// Where the store stands.
    pub state: StoreState,
    /// Since when, on the machine's clock.
    pub since: Instant,
    /// Attempts since the store was last up (the one in flight counted).
    pub attempts: u32,
    /// Why the last attempt failed.
    pub last_failure: Option<OpenFailure>,
    /// When the next attempt is due, if one waits.
    pub next_attempt_at: Option<Instant>,
}

impl Availability {
    /// A store not opened yet, its first attempt due at `now`; `seed`
    /// draws the backoff's jitter.
    pub fn new(now: Instant, seed: u64) -> Self {
        Availability {
            state: StoreState::Connecting,
            since: now,
            next_attempt_at: Some(now),
            in_flight: false,
            attempts: 0,
            last_failure: None,
            backoff: Backoff::new(REOPEN_BACKOFF),
            rng: SplitMix64::new(seed),
            outputs: VecDeque::new(),
        }
    }

    /// Where the store stands.
    pub fn state(&self) -> StoreState {
        self.state
    }

    /// Why a durable request must be refused now (R-JRN-6); `None` once
    /// the store is up. The synchronous question every durable request
    /// asks.
    pub fn durable_refusal(&self) -> Option<Unavailable> {
        (self.state != StoreState::Up).then_some(Unavailable {
            state: self.state,
            last_failure: self.last_failure,
        })
    }

    /// What `/status` shows.
    pub fn view(&self) -> AvailabilityView {
        AvailabilityView {
            state: self.state,
            since: self.since,
            attempts: self.attempts,
            last_failure: self.last_failure,
            next_attempt_at: self.next_attempt_at,
        }
    }

    /// Feed one input at `now`; drain [`Self::poll_output`] after.
    pub fn handle_input(&mut self, now: Instant, input: AvailabilityInput) {
        match input {
            AvailabilityInput::Opened => {
                if !self.in_flight {
                    return;
                }
                self.in_flight = false;
                self.next_attempt_at = None;
                self.attempts = 0;
                self.last_failure = None;
                self.backoff.reset();
                self.enter(now, StoreState::Up);
            }
            AvailabilityInput::OpenFailed(why) => {
                if !self.in_flight {
                    return;
                }
                self.in_flight = false;
                self.last_failure = Some(why);
                self.schedule(now);
            }
            AvailabilityInput::Broken => {
                if self.state != StoreState::Up {
                    return;
                }
                self.outputs.push_back(AvailabilityOutput::Close);
                self.enter(now, StoreState::Reopening);
                self.schedule(now);
            }
            AvailabilityInput::Refused => {
                if self.state == StoreState::Up {
                    self.outputs.push_back(AvailabilityOutput::Close);
                }
                self.in_flight = false;
                self.next_attempt_at = None;
                self.enter(now, StoreState::Refused);
            }
        }
    }

    /// The next output, in order, until `None`.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<AvailabilityOutput> {
        self.outputs.pop_front()
    }

    /// When the next attempt is due, if one waits.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_attempt_at
    }

    /// Start the attempt that is due at `now`, if any.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.next_attempt_at {
            Some(at) if now >= at && !self.in_flight => {
                self.next_attempt_at = None;
                self.in_flight = true;
                self.attempts = self.attempts.saturating_add(1);
                self.outputs.push_back(AvailabilityOutput::Open {
                    attempt: self.attempts,
                });
            }
            _ => {}
        }
    }

    fn schedule(&mut self, now: Instant) {
        let delay = self.backoff.next_delay(&mut self.rng);
        self.next_attempt_at = Some(now.saturating_add(delay));
    }

    fn enter(&mut self, now: Instant, to: StoreState) {
        if self.state == to {
            return;
        }
        let from = std::mem::replace(&mut self.state, to);
        self.since = now;
        self.outputs
            .push_back(AvailabilityOutput::Changed { from, to });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(a: &mut Availability) -> Vec<AvailabilityOutput> {
        std::iter::from_fn(|| a.poll_output()).collect()
    }

    /// Step to the next due attempt; its number.
    fn next_attempt(a: &mut Availability) -> (Instant, u32) {
        let at = a.poll_timeout().expect("an attempt is due");
        a.handle_timeout(at);
        match drain(a).as_slice() {
            [AvailabilityOutput::Open { attempt }] => (at, *attempt),
            other => panic!("expected one open, got {other:?}"),
        }
    }

    #[test]
    fn r_jrn_6_durable_is_refused_until_the_first_open_succeeds_and_attempts_never_stop() {
        let t0 = Instant::from_millis(1_000);
        let mut a = Availability::new(t0, 7);
        assert_eq!(
            a.poll_timeout(),
            Some(t0),
            "the first attempt is due at once"
        );
        let refusal = a.durable_refusal().expect("refused while connecting");
        assert_eq!(refusal.state, StoreState::Connecting);
        let mut now = t0;
        for n in 1..=20 {
            let (at, attempt) = next_attempt(&mut a);
            assert_eq!(attempt, n);
            assert!(at >= now);
            assert_eq!(a.poll_timeout(), None, "one attempt at a time");
            now = at + Duration::from_millis(10);
            a.handle_input(now, AvailabilityInput::OpenFailed(OpenFailure::Unreachable));
            assert!(drain(&mut a).is_empty(), "still connecting: no change");
            let next = a.poll_timeout().expect("another attempt");
            // Bounded backoff: never more than its cap.
            assert!(next - now <= REOPEN_BACKOFF.max, "{:?}", next - now);
            assert_eq!(
                a.durable_refusal().map(|u| u.last_failure),
                Some(Some(OpenFailure::Unreachable))
            );
        }
        let (at, _) = next_attempt(&mut a);
        a.handle_input(at, AvailabilityInput::Opened);
        assert_eq!(
            drain(&mut a),
            vec![AvailabilityOutput::Changed {
                from: StoreState::Connecting,
                to: StoreState::Up
            }]
        );
        assert_eq!(
            a.durable_refusal(),
            None,
            "durable served without a restart"
        );
        assert_eq!(a.poll_timeout(), None);
        assert_eq!(a.view().attempts, 0);
    }

    #[test]
    fn r_jrn_6_the_backoff_doubles_from_a_quarter_second_to_at_most_five() {
        let mut a = Availability::new(Instant::ZERO, 1);
        let mut delays = Vec::new();
        for _ in 0..10 {
            let (at, _) = next_attempt(&mut a);
            a.handle_input(at, AvailabilityInput::OpenFailed(OpenFailure::Timeout));
            delays.push(a.poll_timeout().unwrap() - at);
        }
        // Equal jitter: each delay within [ceiling / 2, ceiling].
        let mut ceiling = REOPEN_BACKOFF.initial;
        for d in &delays {
            assert!(*d >= ceiling / 2 && *d <= ceiling, "{d:?} vs {ceiling:?}");
            ceiling = (ceiling * 2).min(REOPEN_BACKOFF.max);
        }
        assert!(delays[9] >= REOPEN_BACKOFF.max / 2);
    }

    #[test]
    fn r_jrn_6_a_broken_store_is_closed_then_reopened_after_the_backoff() {
        let mut a = Availability::new(Instant::ZERO, 3);
        let (at, _) = next_attempt(&mut a);
        a.handle_input(at, AvailabilityInput::Opened);
        drain(&mut a);
        let broke = Instant::from_millis(60_000);
        a.handle_input(broke, AvailabilityInput::Broken);
        assert_eq!(
            drain(&mut a),
            vec![
                AvailabilityOutput::Close,
                AvailabilityOutput::Changed {
                    from: StoreState::Up,
                    to: StoreState::Reopening
                }
            ]
        );
        assert_eq!(
            a.durable_refusal().map(|u| u.state),
            Some(StoreState::Reopening)
        );
        // Reported broken again (by every failing operation): one close.
        a.handle_input(broke, AvailabilityInput::Broken);
        assert!(drain(&mut a).is_empty());
        let due = a.poll_timeout().unwrap();
        assert!(due > broke && due - broke <= REOPEN_BACKOFF.initial);
        a.handle_timeout(Instant::from_micros(due.as_micros() - 1));
        assert!(drain(&mut a).is_empty(), "nothing before it is due");
        let (at, attempt) = next_attempt(&mut a);
        assert_eq!(attempt, 1);
        a.handle_input(at, AvailabilityInput::OpenFailed(OpenFailure::Busy));
        let (at, attempt) = next_attempt(&mut a);
        assert_eq!(attempt, 2);
        a.handle_input(at, AvailabilityInput::Opened);
        assert_eq!(
            drain(&mut a),
            vec![AvailabilityOutput::Changed {
                from: StoreState::Reopening,
                to: StoreState::Up
            }]
        );
        assert_eq!(a.durable_refusal(), None);
    }

    #[test]
    fn r_jrn_6_a_store_that_refuses_this_edge_is_never_tried_again() {
        let mut a = Availability::new(Instant::ZERO, 3);
        let (at, _) = next_attempt(&mut a);
        a.handle_input(at, AvailabilityInput::Refused);
        assert_eq!(
            drain(&mut a),
            vec![AvailabilityOutput::Changed {
                from: StoreState::Connecting,
                to: StoreState::Refused
            }]
        );
        assert_eq!(a.poll_timeout(), None);
        a.handle_timeout(Instant::MAX);
        assert!(drain(&mut a).is_empty());
        assert_eq!(
            a.durable_refusal().map(|u| u.state),
            Some(StoreState::Refused)
        );
        // A late answer to nothing changes nothing.
        a.handle_input(at, AvailabilityInput::Opened);
        assert_eq!(a.state(), StoreState::Refused);
    }

    #[test]
    fn answers_without_an_attempt_in_flight_are_ignored() {
        let mut a = Availability::new(Instant::ZERO, 3);
        a.handle_input(Instant::ZERO, AvailabilityInput::Opened);
        a.handle_input(
            Instant::ZERO,
            AvailabilityInput::OpenFailed(OpenFailure::Damaged),
        );
        assert_eq!(a.state(), StoreState::Connecting);
        assert_eq!(a.poll_timeout(), Some(Instant::ZERO));
        // Broken means nothing while nothing is open.
        a.handle_input(Instant::ZERO, AvailabilityInput::Broken);
        assert!(drain(&mut a).is_empty());
    }
}
