//! Heartbeat liveness (R-HB-1, R-HB-2), the same machine on both sides.
//!
//! Each side pings its peer every `interval` on the control stream and
//! expects the matching pong within `wait`. Only one ping is outstanding at a
//! time, so a peer that stops answering is declared dead at most
//! `interval + wait` after its last answer. Heartbeats ride the control
//! stream only: data streams (a long prefill, a back-pressured tunnel) never
//! delay them and never count as liveness.

use std::collections::VecDeque;
use std::time::Duration;

use crate::time::Instant;

/// The heartbeat profile (R-HB-1). Defaults: 30 s interval, 45 s wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeartbeatConfig {
    /// Time between pings.
    pub interval: Duration,
    /// How long to wait for the pong before declaring the peer dead.
    pub wait: Duration,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(30),
            wait: Duration::from_secs(45),
        }
    }
}

/// Why a [`HeartbeatConfig`] is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeartbeatConfigError {
    /// The interval must be positive.
    #[error("heartbeat interval must be greater than zero")]
    ZeroInterval,
    /// The wait must be positive.
    #[error("heartbeat wait must be greater than zero")]
    ZeroWait,
}

impl HeartbeatConfig {
    /// Check the profile.
    pub fn validate(&self) -> Result<(), HeartbeatConfigError> {
        if self.interval.is_zero() {
            return Err(HeartbeatConfigError::ZeroInterval);
        }
        if self.wait.is_zero() {
            return Err(HeartbeatConfigError::ZeroWait);
        }
        Ok(())
    }
}

/// What the peer sent on the control stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeartbeatInput {
    /// The peer pinged: answer it.
    Ping {
        /// Its sequence.
        seq: u64,
    },
    /// The peer answered a ping. A pong for anything but the outstanding
    /// ping (a duplicate, a stale or an invented sequence) is ignored.
    Pong {
        /// Its sequence.
        seq: u64,
    },
}

/// What the driver must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeartbeatOutput {
    /// Send a ping with this sequence on the control stream.
    SendPing(u64),
    /// Answer the peer's ping.
    SendPong(u64),
    /// No pong within the wait: close the connection with
    /// `heartbeat_timeout` (R-HB-2). Emitted once.
    TimedOut,
}

/// Heartbeat state of one connection.
#[derive(Debug)]
pub struct Heartbeat {
    config: HeartbeatConfig,
    next_ping_at: Instant,
    next_seq: u64,
    /// The ping we are waiting for: (seq, sent at).
    outstanding: Option<(u64, Instant)>,
    last_rtt: Option<Duration>,
    pings_sent: u64,
    timed_out: bool,
    outputs: VecDeque<HeartbeatOutput>,
}

impl Heartbeat {
    /// A heartbeat for a connection established at `now`; the first ping
    /// goes out one interval later.
    pub fn new(now: Instant, config: HeartbeatConfig) -> Self {
        Self {
            config,
            next_ping_at: now + config.interval,
            next_seq: 1,
            outstanding: None,
            last_rtt: None,
            pings_sent: 0,
            timed_out: false,
            outputs: VecDeque::new(),
        }
    }

    /// The profile in use.
    pub fn config(&self) -> HeartbeatConfig {
        self.config
    }

    /// Feed what the peer sent; drain [`Self::poll_output`] after.
    pub fn handle_input(&mut self, now: Instant, input: HeartbeatInput) {
        match input {
            HeartbeatInput::Ping { seq } => self.handle_ping(now, seq),
            HeartbeatInput::Pong { seq } => self.handle_pong(now, seq),
        }
    }

    /// The peer pinged us: answer it.
    fn handle_ping(&mut self, _now: Instant, seq: u64) {
        if !self.timed_out {
            self.outputs.push_back(HeartbeatOutput::SendPong(seq));
        }
    }

    /// The peer answered a ping. A pong for anything but the outstanding
    /// ping (a duplicate, a stale or an invented sequence) is ignored.
    fn handle_pong(&mut self, now: Instant, seq: u64) {
        if let Some((want, sent_at)) = self.outstanding
            && seq == want
        {
            self.last_rtt = Some(now - sent_at);
            self.outstanding = None;
        }
    }

    /// Fire due timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.timed_out {
            return;
        }
        if let Some((_, sent_at)) = self.outstanding {
            if now >= sent_at + self.config.wait {
                self.timed_out = true;
                self.outputs.push_back(HeartbeatOutput::TimedOut);
            }
            return;
        }
        if now >= self.next_ping_at {
            let seq = self.next_seq;
            self.next_seq += 1;
            self.outstanding = Some((seq, now));
            self.pings_sent += 1;
            self.next_ping_at = now + self.config.interval;
            self.outputs.push_back(HeartbeatOutput::SendPing(seq));
        }
    }

    /// When to call [`Self::handle_timeout`] next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.timed_out {
            return None;
        }
        match self.outstanding {
            Some((_, sent_at)) => Some(sent_at + self.config.wait),
            None => Some(self.next_ping_at),
        }
    }

    /// Next output, until `None`.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<HeartbeatOutput> {
        self.outputs.pop_front()
    }

    /// True once [`HeartbeatOutput::TimedOut`] was emitted.
    pub fn is_timed_out(&self) -> bool {
        self.timed_out
    }

    /// Round trip of the latest answered ping.
    pub fn last_rtt(&self) -> Option<Duration> {
        self.last_rtt
    }

    /// Pings sent so far.
    pub fn pings_sent(&self) -> u64 {
        self.pings_sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Instant {
        Instant::from_millis(v)
    }

    fn drain(hb: &mut Heartbeat) -> Vec<HeartbeatOutput> {
        std::iter::from_fn(|| hb.poll_output()).collect()
    }

    #[test]
    fn default_profile_is_30s_interval_45s_wait() {
        let c = HeartbeatConfig::default();
        assert_eq!(c.interval, Duration::from_secs(30));
        assert_eq!(c.wait, Duration::from_secs(45));
        assert!(c.validate().is_ok());
        let zero = HeartbeatConfig {
            interval: Duration::ZERO,
            ..c
        };
        assert_eq!(zero.validate(), Err(HeartbeatConfigError::ZeroInterval));
    }

    #[test]
    fn pings_every_interval_while_pongs_arrive() {
        let cfg = HeartbeatConfig {
            interval: Duration::from_millis(200),
            wait: Duration::from_millis(300),
        };
        let mut hb = Heartbeat::new(ms(0), cfg);
        assert_eq!(hb.poll_timeout(), Some(ms(200)));
        hb.handle_timeout(ms(199));
        assert!(drain(&mut hb).is_empty(), "nothing fires early");
        for round in 1..=5u64 {
            let t = ms(200 * round);
            hb.handle_timeout(t);
            assert_eq!(drain(&mut hb), vec![HeartbeatOutput::SendPing(round)]);
            hb.handle_pong(t + Duration::from_millis(10), round);
        }
        assert!(!hb.is_timed_out());
        assert_eq!(hb.last_rtt(), Some(Duration::from_millis(10)));
        assert_eq!(hb.pings_sent(), 5);
    }

    #[test]
    fn a_heartbeat_reports_the_profile_it_runs() {
        let cfg = HeartbeatConfig {
            interval: Duration::from_millis(200),
            wait: Duration::from_millis(700),
        };
        assert_ne!(cfg, HeartbeatConfig::default());
        assert_eq!(Heartbeat::new(ms(0), cfg).config(), cfg);
    }

    #[test]
    fn no_pong_within_wait_times_out_once_within_interval_plus_wait() {
        let cfg = HeartbeatConfig::default();
        let mut hb = Heartbeat::new(ms(0), cfg);
        // The peer's last answer was at connection start; it is silent from now.
        hb.handle_timeout(ms(30_000));
        assert_eq!(drain(&mut hb), vec![HeartbeatOutput::SendPing(1)]);
        assert_eq!(hb.poll_timeout(), Some(ms(75_000)));
        assert!(!hb.is_timed_out());
        hb.handle_timeout(ms(74_999));
        assert!(drain(&mut hb).is_empty());
        hb.handle_timeout(ms(75_000));
        assert_eq!(drain(&mut hb), vec![HeartbeatOutput::TimedOut]);
        hb.handle_timeout(ms(200_000));
        assert!(hb.is_timed_out());

        assert!(drain(&mut hb).is_empty(), "timed out only once");
        assert_eq!(hb.poll_timeout(), None);
    }

    #[test]
    fn stale_or_duplicate_pong_does_not_count_as_an_answer() {
        let cfg = HeartbeatConfig {
            interval: Duration::from_millis(100),
            wait: Duration::from_millis(100),
        };
        let mut hb = Heartbeat::new(ms(0), cfg);
        hb.handle_timeout(ms(100));
        assert_eq!(drain(&mut hb), vec![HeartbeatOutput::SendPing(1)]);
        hb.handle_pong(ms(120), 1);
        hb.handle_timeout(ms(220));
        assert_eq!(drain(&mut hb), vec![HeartbeatOutput::SendPing(2)]);
        hb.handle_pong(ms(230), 1); // duplicate of the old answer
        hb.handle_pong(ms(231), 99); // invented
        hb.handle_timeout(ms(320));
        assert_eq!(drain(&mut hb), vec![HeartbeatOutput::TimedOut]);
    }

    #[test]
    fn peer_pings_are_answered_with_the_same_sequence() {
        let mut hb = Heartbeat::new(ms(0), HeartbeatConfig::default());
        hb.handle_ping(ms(5), 42);
        assert_eq!(drain(&mut hb), vec![HeartbeatOutput::SendPong(42)]);
    }
}
