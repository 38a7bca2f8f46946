//! Configuration pieces both shells share: certificate paths, the
//! heartbeat profile, and errors that name the offending field.

use std::path::{Path, PathBuf};
use std::time::Duration;

use iop_core::liveness::heartbeat::HeartbeatConfig;
use serde::Deserialize;

/// A configuration error naming the offending field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The TOML did not parse or did not match the schema.
    #[error("invalid config: {0}")]
    Parse(String),
    /// A field has an unacceptable value.
    #[error("invalid config field `{field}`: {message}")]
    Field {
        /// Dotted path of the field, e.g. `providers[2].capacity`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

/// A [`ConfigError::Field`].
pub fn field_err(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.into(),
        message: message.into(),
    }
}

/// Certificate files.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// Deployment CA certificate (PEM).
    pub ca: PathBuf,
    /// This endpoint's certificate chain (PEM).
    pub cert: PathBuf,
    /// This endpoint's private key (PEM).
    pub key: PathBuf,
}

/// Heartbeat profile (R-HB-1).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HeartbeatSection {
    /// Ping interval.
    pub interval_ms: u64,
    /// Pong wait.
    pub wait_ms: u64,
    /// A connection whose peer stops acknowledging at the transport level
    /// is lost after this (R-FAIL-2): QUIC keep-alives every quarter of it,
    /// and the idle timeout at it. Independent of the application
    /// heartbeat; a slow provider or a back-pressured stream never trips
    /// it, because the peer's QUIC stack still acknowledges.
    pub loss_detect_ms: u64,
}

/// Default of `[heartbeat] loss_detect_ms` (R-FAIL-2).
pub const DEFAULT_LOSS_DETECT_MS: u64 = 5_000;

/// Smallest accepted `loss_detect_ms`: a keep-alive and its
/// acknowledgement must fit several times into it.
pub const MIN_LOSS_DETECT_MS: u64 = 200;

/// Largest accepted `loss_detect_ms`.
pub const MAX_LOSS_DETECT_MS: u64 = 600_000;

impl Default for HeartbeatSection {
    fn default() -> Self {
        let d = HeartbeatConfig::default();
        Self {
            interval_ms: d.interval.as_millis() as u64,
            wait_ms: d.wait.as_millis() as u64,
            loss_detect_ms: DEFAULT_LOSS_DETECT_MS,
        }
    }
}

impl HeartbeatSection {
    /// As the core's profile.
    pub fn to_core(self) -> HeartbeatConfig {
        HeartbeatConfig {
            interval: Duration::from_millis(self.interval_ms),
            wait: Duration::from_millis(self.wait_ms),
        }
    }

    /// Validate, naming `section.field`.
    pub fn validate(&self, section: &str) -> Result<(), ConfigError> {
        if self.interval_ms == 0 {
            return Err(field_err(format!("{section}.interval_ms"), "must be > 0"));
        }
        if self.wait_ms == 0 {
            return Err(field_err(format!("{section}.wait_ms"), "must be > 0"));
        }
        if !(MIN_LOSS_DETECT_MS..=MAX_LOSS_DETECT_MS).contains(&self.loss_detect_ms) {
            return Err(field_err(
                format!("{section}.loss_detect_ms"),
                format!("must be between {MIN_LOSS_DETECT_MS} and {MAX_LOSS_DETECT_MS}"),
            ));
        }
        Ok(())
    }

    /// The QUIC settings that detect a lost peer within `loss_detect_ms`
    /// (R-FAIL-2).
    pub fn quic_tuning(&self) -> crate::QuicTuning {
        crate::QuicTuning::for_loss_detection(Duration::from_millis(self.loss_detect_ms))
    }
}

impl TlsFiles {
    /// Resolve relative paths against `base` (the config file's directory).
    pub fn resolve(&mut self, base: &Path) {
        for p in [&mut self.ca, &mut self.cert, &mut self.key] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
    }
}

/// Identifiers that may appear in certificates, configs and status output:
/// 1-128 characters of `[A-Za-z0-9._-]`.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}
