//! The Node supervisor's reconnect schedule: capped, jittered exponential
//! backoff (R-HB-2), with jitter drawn from an injected RNG.

use std::time::Duration;

use crate::rng::RandomSource;

/// Backoff bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffConfig {
    /// Delay ceiling of the first retry.
    pub initial: Duration,
    /// Cap: no delay ever exceeds it.
    pub max: Duration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(30),
        }
    }
}

/// Exponential backoff with "equal jitter": the n-th delay is uniformly
/// drawn from `[c/2, c]` where `c = min(max, initial * 2^n)`. Half the window
/// spreads reconnecting nodes apart; the other half guarantees progress.
#[derive(Debug, Clone)]
pub struct Backoff {
    config: BackoffConfig,
    attempt: u32,
}

impl Backoff {
    /// A fresh schedule.
    pub fn new(config: BackoffConfig) -> Self {
        Self { config, attempt: 0 }
    }

    /// Failed attempts since the last reset.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The ceiling of the next delay, before jitter.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32.checked_shl(self.attempt.min(31)).unwrap_or(u32::MAX);
        self.config
            .initial
            .checked_mul(factor)
            .unwrap_or(self.config.max)
            .min(self.config.max)
    }

    /// The delay before the next attempt; advances the schedule.
    pub fn next_delay(&mut self, rng: &mut impl RandomSource) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let ceiling_us = u64::try_from(ceiling.as_micros()).unwrap_or(u64::MAX);
        let half = ceiling_us / 2;
        Duration::from_micros(half + rng.below_inclusive(ceiling_us - half))
    }

    /// A connection succeeded (registered and ready): start over.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// How a node backs off after the Edge closed its connection as
/// `superseded`: another process with the same node certificate connected
/// (R-LIM-4). Reconnecting at once would supersede that one in turn, and
/// the two would take turns forever; so the loser waits long, and longer
/// each time it loses again.
pub const SUPERSEDED_BACKOFF: BackoffConfig = BackoffConfig {
    initial: Duration::from_secs(30),
    max: Duration::from_secs(15 * 60),
};

/// A connection that lasted this long ends a run of supersessions: the
/// other process is gone (restarted or stopped), this one is the node.
pub const SUPERSEDED_RESET_AFTER: Duration = Duration::from_secs(10 * 60);

/// The node's supersession count (see [`SUPERSEDED_BACKOFF`]).
#[derive(Debug, Clone)]
pub struct Supersession {
    backoff: Backoff,
}

impl Default for Supersession {
    fn default() -> Self {
        Self {
            backoff: Backoff::new(SUPERSEDED_BACKOFF),
        }
    }
}

impl Supersession {
    /// A connection that lasted `lasted` ended as `superseded`: the delay
    /// before dialing again (jittered, doubling up to the cap).
    pub fn superseded(&mut self, lasted: Duration, rng: &mut impl RandomSource) -> Duration {
        if lasted >= SUPERSEDED_RESET_AFTER {
            self.backoff.reset();
        }
        self.backoff.next_delay(rng)
    }

    /// A connection that lasted `lasted` ended for another reason.
    pub fn ended(&mut self, lasted: Duration) {
        if lasted >= SUPERSEDED_RESET_AFTER {
            self.backoff.reset();
        }
    }

    /// Supersessions in a row so far.
    pub fn count(&self) -> u32 {
        self.backoff.attempt()
    }
}

/// How one connection attempt ended, as the reconnect schedule sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptEnd {
    /// No connection: the dial failed or timed out.
    NoConnection,
    /// The Edge closed it as `superseded` (another process with this
    /// node's certificate connected).
    Superseded,
    /// The connection closed; `was_ready`: it had completed readiness.
    Closed {
        /// Whether it completed readiness.
        was_ready: bool,
    },
    /// It failed otherwise: rejected at registration, a broken handshake
    /// or a transport error.
    Failed,
}

impl AttemptEnd {
    /// Whether the attempt counts as failed: it never got a connection
    /// the Edge closed (a superseded one was closed).
    pub fn failed(self) -> bool {
        matches!(self, AttemptEnd::NoConnection | AttemptEnd::Failed)
    }
}

/// The Node supervisor's schedule for one Edge (R-HB-2): capped, jittered
/// backoff, started over by a connection that completed readiness, and
/// the long [`Supersession`] wait after `superseded`. Not a
/// [`Machine`](crate::Machine): the supervisor asks it for one delay when
/// an attempt ends and sleeps that long; nothing else happens to it.
#[derive(Debug, Clone)]
pub struct Reconnect {
    backoff: Backoff,
    supersession: Supersession,
}

impl Reconnect {
    /// A fresh schedule.
    pub fn new(config: BackoffConfig) -> Self {
        Reconnect {
            backoff: Backoff::new(config),
            supersession: Supersession::default(),
        }
    }

    /// An attempt that lasted `lasted` (from connection to its end; zero
    /// without one) ended as `end`: the delay before the next.
    pub fn after(
        &mut self,
        end: AttemptEnd,
        lasted: Duration,
        rng: &mut impl RandomSource,
    ) -> Duration {
        match end {
            AttemptEnd::Superseded => return self.supersession.superseded(lasted, rng),
            AttemptEnd::Closed { was_ready } => {
                self.supersession.ended(lasted);
                if was_ready {
                    self.backoff.reset();
                }
            }
            AttemptEnd::NoConnection | AttemptEnd::Failed => {}
        }
        self.backoff.next_delay(rng)
    }

    /// Supersessions in a row so far.
    pub fn superseded_in_a_row(&self) -> u32 {
        self.supersession.count()
    }

    /// Failed attempts since the last ready connection.
    pub fn attempt(&self) -> u32 {
        self.backoff.attempt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_superseded_node_waits_long_and_longer_each_time_until_it_holds_a_connection() {
        let mut rng = SplitMix64::new(1);
        let mut s = Supersession::default();
        let short = Duration::from_secs(1);
        let first = s.superseded(short, &mut rng);
        assert!(first >= Duration::from_secs(15) && first <= Duration::from_secs(30));
        let ceilings: Vec<Duration> = (0..8).map(|_| s.superseded(short, &mut rng)).collect();
        assert!(ceilings.iter().all(|d| *d <= SUPERSEDED_BACKOFF.max));
        assert!(
            *ceilings.last().unwrap() >= SUPERSEDED_BACKOFF.max / 2,
            "{ceilings:?}"
        );
        // Another kind of end does not forget it; a long connection does.
        s.ended(short);
        assert_eq!(s.count(), 9);
        s.ended(SUPERSEDED_RESET_AFTER);
        assert_eq!(s.count(), 0);
        let again = s.superseded(short, &mut rng);
        assert!(again <= Duration::from_secs(30));
    }
    use crate::rng::SplitMix64;
    use proptest::prelude::*;

    #[test]
    fn delays_double_until_the_cap_and_reset_starts_over() {
        let mut b = Backoff::new(BackoffConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(1000),
        });
        let ceilings: Vec<u64> = (0..6)
            .map(|_| {
                let c = b.ceiling().as_millis() as u64;
                b.attempt += 1;
                c
            })
            .collect();
        assert_eq!(ceilings, vec![100, 200, 400, 800, 1000, 1000]);
        b.reset();
        assert_eq!(b.ceiling(), Duration::from_millis(100));
    }

    #[test]
    fn jitter_comes_from_the_injected_rng_and_is_reproducible() {
        let cfg = BackoffConfig::default();
        let run = |seed| {
            let mut rng = SplitMix64::new(seed);
            let mut b = Backoff::new(cfg);
            (0..10).map(|_| b.next_delay(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn the_jitter_spans_the_whole_upper_half_of_the_window() {
        let mut rng = SplitMix64::new(3);
        let cfg = BackoffConfig {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(10),
        };
        let delays: Vec<Duration> = (0..200)
            .map(|_| Backoff::new(cfg).next_delay(&mut rng))
            .collect();
        let (lo, hi) = (delays.iter().min().unwrap(), delays.iter().max().unwrap());
        assert!(
            *lo >= Duration::from_secs(5) && *lo < Duration::from_secs(6),
            "{lo:?}"
        );
        assert!(
            *hi <= Duration::from_secs(10) && *hi > Duration::from_secs(9),
            "{hi:?}"
        );
    }

    #[test]
    fn the_supersession_schedule_is_the_documented_one() {
        // docs/operations.md, `iop_node_superseded_total`: 30 s, doubling
        // up to 15 min; a connection of 10 min starts the count over.
        assert_eq!(SUPERSEDED_BACKOFF.initial, Duration::from_secs(30));
        assert_eq!(SUPERSEDED_BACKOFF.max, Duration::from_secs(900));
        assert_eq!(SUPERSEDED_RESET_AFTER, Duration::from_secs(600));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

        /// Every delay lies in [ceiling/2, ceiling] and never exceeds the cap,
        /// however long the outage.
        #[test]
        fn delay_is_jittered_within_half_window_and_capped(
            seed in any::<u64>(),
            initial_ms in 1u64..5_000,
            max_ms in 1u64..120_000,
            attempts in 1usize..80,
        ) {
            let cfg = BackoffConfig {
                initial: Duration::from_millis(initial_ms),
                max: Duration::from_millis(max_ms),
            };
            let mut rng = SplitMix64::new(seed);
            let mut b = Backoff::new(cfg);
            for _ in 0..attempts {
                let ceiling = b.ceiling();
                let d = b.next_delay(&mut rng);
                prop_assert!(d <= ceiling);
                prop_assert!(d <= cfg.max);
                prop_assert!(d.as_micros() >= ceiling.as_micros() / 2);
            }
        }
    }

    #[test]
    fn a_ready_connection_starts_the_backoff_over_and_superseded_waits_long_r_hb_2() {
        let mut rng = SplitMix64::new(5);
        let config = BackoffConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(10),
        };
        let mut r = Reconnect::new(config);
        let short = Duration::from_millis(10);
        let grown: Vec<Duration> = (0..4)
            .map(|_| r.after(AttemptEnd::NoConnection, Duration::ZERO, &mut rng))
            .collect();
        assert!(grown[3] >= Duration::from_millis(400), "{grown:?}");
        let failed = r.after(AttemptEnd::Failed, short, &mut rng);
        assert!(
            failed >= Duration::from_millis(800),
            "keeps growing: {failed:?}"
        );
        let unready = r.after(AttemptEnd::Closed { was_ready: false }, short, &mut rng);
        assert!(
            unready >= Duration::from_millis(1600),
            "not ready: no reset"
        );
        let ready = r.after(AttemptEnd::Closed { was_ready: true }, short, &mut rng);
        assert!(
            ready <= Duration::from_millis(100),
            "ready: over: {ready:?}"
        );
        let superseded = r.after(AttemptEnd::Superseded, short, &mut rng);
        assert!(
            superseded >= SUPERSEDED_BACKOFF.initial / 2,
            "{superseded:?}"
        );
        assert_eq!(r.superseded_in_a_row(), 1);
        r.after(
            AttemptEnd::Closed { was_ready: true },
            SUPERSEDED_RESET_AFTER,
            &mut rng,
        );
        assert_eq!(r.superseded_in_a_row(), 0, "a long connection ends the run");
        assert!(AttemptEnd::Failed.failed() && AttemptEnd::NoConnection.failed());
        assert!(!AttemptEnd::Superseded.failed());
        assert!(!AttemptEnd::Closed { was_ready: false }.failed());
    }
}
