//! The shell's clock: the one place wall time becomes a core `Instant`.

use std::pin::Pin;
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

/// A timer kept across the turns of a task's `select!` loop.
///
/// Each turn [`Timer::set`] aims it at the loop's next deadline and re-arms
/// it only when that moved; [`Timer::fired`] is the branch. A fresh
/// `sleep_until` each turn enters the runtime's timer wheel when first
/// polled and leaves it when the turn drops it, on every turn of the loop,
/// whether or not the deadline changed.
#[derive(Debug)]
pub struct Timer {
    at: Option<tokio::time::Instant>,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl Default for Timer {
    fn default() -> Self {
        Self::new()
    }
}

impl Timer {
    /// A timer aimed nowhere: it never fires until [`Timer::set`]. Made
    /// inside a runtime.
    pub fn new() -> Self {
        Self {
            at: None,
            // Not in the timer wheel until polled, and not polled unaimed.
            sleep: Box::pin(tokio::time::sleep_until(tokio::time::Instant::now())),
        }
    }

    /// Aim at `at`, or nowhere for `None`; the same deadline again is free.
    pub fn set(&mut self, at: Option<tokio::time::Instant>) {
        if at == self.at {
            return;
        }
        if let Some(at) = at {
            self.sleep.as_mut().reset(at);
        }
        self.at = at;
    }

    /// The deadline the timer is aimed at.
    pub fn deadline(&self) -> Option<tokio::time::Instant> {
        self.at
    }

    /// Ready once the deadline has passed (at once, every poll, until
    /// [`Timer::set`] moves it); never while aimed nowhere.
    pub async fn fired(&mut self) {
        match self.at {
            Some(_) => self.sleep.as_mut().await,
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Polled once without waiting: whether the timer has fired.
    async fn has_fired(timer: &mut Timer) -> bool {
        tokio::select! {
            biased;
            () = timer.fired() => true,
            () = std::future::ready(()) => false,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_timer_fires_at_its_deadline_and_follows_a_moved_one() {
        let mut timer = Timer::new();
        // Aimed nowhere it never fires, however long the wait.
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(!has_fired(&mut timer).await);

        let start = tokio::time::Instant::now();
        timer.set(Some(start + Duration::from_millis(10)));
        assert!(!has_fired(&mut timer).await);
        tokio::time::advance(Duration::from_millis(9)).await;
        assert!(!has_fired(&mut timer).await);
        // Moved later before it fired: the old deadline passes unheard.
        timer.set(Some(start + Duration::from_millis(20)));
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(!has_fired(&mut timer).await);
        // The same deadline again changes nothing.
        timer.set(Some(start + Duration::from_millis(20)));
        tokio::time::advance(Duration::from_millis(9)).await;
        assert!(has_fired(&mut timer).await);
        assert_eq!(timer.deadline(), Some(start + Duration::from_millis(20)));
        // Still past its deadline: it stays fired until moved.
        assert!(has_fired(&mut timer).await);
        // Moved earlier than now: fires at once.
        timer.set(Some(start + Duration::from_millis(5)));
        assert!(has_fired(&mut timer).await);
        // Aimed nowhere again: a passed deadline is forgotten.
        timer.set(None);
        assert!(!has_fired(&mut timer).await);
        assert_eq!(timer.deadline(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_timer_wakes_its_waiting_task() {
        let mut timer = Timer::new();
        timer.set(Some(tokio::time::Instant::now() + Duration::from_secs(5)));
        let before = tokio::time::Instant::now();
        // With time paused, the runtime advances to the timer's deadline.
        timer.fired().await;
        assert_eq!(before.elapsed(), Duration::from_secs(5));
    }
}
