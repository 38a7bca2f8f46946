//! Injected randomness.
//!
//! The core never touches a global RNG (SPEC §2). Anything random (backoff
//! jitter, nonces) draws from a [`RandomSource`] the driver passes in. Shells
//! pass an OS-seeded generator; the simulator and tests pass [`SplitMix64`]
//! with a seed, so a run is reproducible.

/// A source of random `u64`s, injected by the driver.
pub trait RandomSource {
    /// The next uniformly distributed `u64`.
    fn next_u64(&mut self) -> u64;

    /// A value uniformly distributed in `0..=max` (slight modulo bias is fine
    /// for jitter; never use this for key material).
    fn below_inclusive(&mut self, max: u64) -> u64 {
        if max == u64::MAX {
            return self.next_u64();
        }
        self.next_u64() % (max + 1)
    }
}

/// SplitMix64: a tiny, fast, seedable generator for simulation and tests.
/// Not cryptographic.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose sequence is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }
}

impl RandomSource for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

impl<R: RandomSource + ?Sized> RandomSource for &mut R {
    fn next_u64(&mut self) -> u64 {
        (**self).next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence() {
        let mut a = SplitMix64::new(42);
        let mut b = SplitMix64::new(42);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert!(a.below_inclusive(10) <= 10);
    }
}
