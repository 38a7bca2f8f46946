//! The shell's clock: the one place wall time becomes a core `Instant`.

use std::time::Duration;

use iop_core::Instant;

/// Maps tokio's monotonic clock onto core instants (micros since start).
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: tokio::time::Instant,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self {
            origin: tokio::time::Instant::now(),
        }
    }

    /// The current core instant.
    pub fn now(&self) -> Instant {
        let micros = self.origin.elapsed().as_micros();
        Instant::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
    }

    /// The tokio instant of a core instant (for `sleep_until`).
    pub fn to_tokio(&self, at: Instant) -> tokio::time::Instant {
        self.origin + Duration::from_micros(at.as_micros().min(u64::MAX / 2))
    }

    /// Sleep until `at`, or forever for `None`.
    pub async fn sleep_until(&self, at: Option<Instant>) {
        match at {
            Some(at) => tokio::time::sleep_until(self.to_tokio(at)).await,
            None => std::future::pending().await,
        }
    }
}

/// Milliseconds since the Unix epoch (for status output and generation floors).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
