//! `[health]`: how often providers are probed and when a failing or
//! silent one stops being chosen (R-HT-3).

use std::time::Duration;

use iop_transport::settings::{ConfigError, field_err};
use serde::Deserialize;

/// `[health]`: the provider health tracker (R-HT-3).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthSection {
    /// Regular capability refresh cadence.
    pub refresh_interval_ms: u64,
    /// First recovery backoff of a failing provider.
    pub backoff_base_ms: u64,
    /// Backoff cap during a long outage.
    pub backoff_cap_ms: u64,
    /// An `ok` older than this without a fresh success becomes `stale`.
    pub stale_after_ms: u64,
    /// Bound of one CAPABILITIES probe.
    pub probe_timeout_ms: u64,
}

impl HealthSection {
    /// The core's tracker settings.
    pub fn to_core(&self) -> iop_core::edge::health::HealthConfig {
        iop_core::edge::health::HealthConfig {
            refresh_interval: Duration::from_millis(self.refresh_interval_ms),
            backoff_base: Duration::from_millis(self.backoff_base_ms),
            backoff_cap: Duration::from_millis(self.backoff_cap_ms),
            stale_after: Duration::from_millis(self.stale_after_ms),
            probe_timeout: Duration::from_millis(self.probe_timeout_ms),
        }
    }

    /// The first field that is wrong, if any.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        // The rules are core's (`HealthConfig::validate_deployment`); the
        // error is given the field's name here.
        if let Err(e) = self.to_core().validate_deployment() {
            use iop_core::edge::health::HealthTrackerError as E;
            return Err(match e {
                E::ZeroDuration(name) => field_err(format!("health.{name}_ms"), "must be > 0"),
                E::BackoffBaseAboveCap => {
                    field_err("health.backoff_cap_ms", "must be >= health.backoff_base_ms")
                }
                E::StaleBeforeNextProbe => field_err(
                    "health.stale_after_ms",
                    "must be > health.refresh_interval_ms + health.probe_timeout_ms",
                ),
                other => field_err("health", other.to_string()),
            });
        }
        Ok(())
    }
}

impl Default for HealthSection {
    fn default() -> Self {
        let d = iop_core::edge::health::HealthConfig::default();
        Self {
            refresh_interval_ms: d.refresh_interval.as_millis() as u64,
            backoff_base_ms: d.backoff_base.as_millis() as u64,
            backoff_cap_ms: d.backoff_cap.as_millis() as u64,
            stale_after_ms: d.stale_after.as_millis() as u64,
            probe_timeout_ms: d.probe_timeout.as_millis() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::fixture::{field_of, parse};

    #[test]
    fn stale_after_must_exceed_refresh_interval_plus_probe_timeout() {
        let health = |stale: u64| {
            parse(&format!(
                "[health]\nrefresh_interval_ms = 1000\nprobe_timeout_ms = 500\nstale_after_ms = {stale}\n"
            ))
        };
        assert_eq!(field_of(health(1500).unwrap_err()), "health.stale_after_ms");
        assert_eq!(field_of(health(900).unwrap_err()), "health.stale_after_ms");
        assert_eq!(health(1501).unwrap().health.stale_after_ms, 1501);
    }
}
