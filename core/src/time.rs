//! The core's own clock types.
//!
//! The core never reads a clock (SPEC §2). Every input carries `now` as an
//! [`Instant`]: microseconds since an arbitrary origin the driver chooses,
//! so a test, the simulator or a trace replay can construct any moment.
//! Durations are [`std::time::Duration`], a plain value type.

use std::ops::{Add, AddAssign, Sub};
use std::time::Duration;

/// A monotonic moment, in microseconds since an origin chosen by the driver.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct Instant(u64);

impl Instant {
    /// The origin.
    pub const ZERO: Instant = Instant(0);
    /// The latest representable moment; used as "never".
    pub const MAX: Instant = Instant(u64::MAX);

    /// The moment `micros` microseconds after the origin.
    pub const fn from_micros(micros: u64) -> Self {
        Instant(micros)
    }

    /// The moment `millis` milliseconds after the origin.
    pub const fn from_millis(millis: u64) -> Self {
        Instant(millis.saturating_mul(1000))
    }

    /// Microseconds since the origin.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// Milliseconds since the origin (truncated).
    pub const fn as_millis(self) -> u64 {
        self.0 / 1000
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }

    /// `self + d`, saturating at [`Instant::MAX`].
    pub fn saturating_add(self, d: Duration) -> Instant {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Instant(self.0.saturating_add(micros))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        self.saturating_add(d)
    }
}

impl AddAssign<Duration> for Instant {
    fn add_assign(&mut self, d: Duration) {
        *self = self.saturating_add(d);
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, earlier: Instant) -> Duration {
        self.saturating_duration_since(earlier)
    }
}

/// Milliseconds of a duration, saturating.
pub fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The earliest of two optional deadlines.
pub fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_add_and_subtract_saturating() {
        let t = Instant::from_millis(5);
        assert_eq!((t + Duration::from_millis(2)).as_millis(), 7);
        assert_eq!(t - Instant::from_millis(9), Duration::ZERO);
        assert_eq!(Instant::MAX + Duration::from_secs(1), Instant::MAX);
        assert_eq!(earliest(Some(t), None), Some(t));
        assert_eq!(earliest(Some(t), Some(Instant::ZERO)), Some(Instant::ZERO));
    }
}
