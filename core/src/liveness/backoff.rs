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

#[cfg(test)]
mod tests {
    use super::*;
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
}
