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
    /// A configuration variable (`IOP_EDGE__...`) cannot be applied: its
    /// name is malformed or its path runs through a value of another kind
    /// ([`crate::environment`]).
    #[error("invalid environment variable `{var}`: {message}")]
    Environment {
        /// The variable's name.
        var: String,
        /// What is wrong.
        message: String,
    },
}

/// The text of the config file at `path` and the directory its relative
/// paths resolve against. Without a file the text is empty (the
/// environment gives the whole configuration, [`crate::environment`]) and
/// relative paths resolve against the working directory.
pub fn config_text(path: Option<&Path>) -> Result<(String, PathBuf), ConfigError> {
    match path {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_owned(),
                source,
            })?;
            let base = path.parent().unwrap_or(Path::new(".")).to_owned();
            Ok((text, base))
        }
        None => Ok((
            String::new(),
            std::env::current_dir().unwrap_or_else(|_| PathBuf::from(".")),
        )),
    }
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

/// `[quic]`: quinn's transport settings that may change a request's
/// latency (both binaries; docs/operations.md). The defaults are quinn's;
/// each alternative is measured against them in docs/benchmarks.md
/// ("quinn's transport settings").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuicSection {
    /// Ask the peer (the ACK frequency extension) to acknowledge once more
    /// than this many ack-eliciting packets arrived unacknowledged (0:
    /// every one at once). Unset: the peer's defaults (1).
    pub ack_eliciting_threshold: Option<u32>,
    /// Ask the peer to delay an acknowledgement at most this long, ms (1 to
    /// 25). Unset: its own (25).
    pub max_ack_delay_ms: Option<u64>,
    /// Generic segmentation offload on sends where the system has it.
    pub segmentation_offload: bool,
    /// `cubic` (the default), `new_reno` or `bbr`.
    pub congestion: String,
    /// The congestion window before any acknowledgement, bytes (2,400 to
    /// 64 MiB). Unset: the controller's default.
    pub initial_window: Option<u64>,
}

impl Default for QuicSection {
    fn default() -> Self {
        let d = crate::QuicTuning::default();
        Self {
            ack_eliciting_threshold: None,
            max_ack_delay_ms: None,
            segmentation_offload: d.segmentation_offload,
            congestion: d.congestion.as_str().to_owned(),
            initial_window: d.initial_window,
        }
    }
}

impl QuicSection {
    /// `base` with this section's settings.
    ///
    /// An unknown congestion controller is left as `base`'s: call
    /// [`QuicSection::validate`] first.
    pub fn apply(&self, base: crate::QuicTuning) -> crate::QuicTuning {
        let ack_frequency = match (self.ack_eliciting_threshold, self.max_ack_delay_ms) {
            (None, None) => None,
            (threshold, delay) => Some(crate::endpoint::AckFrequency {
                // quinn's own threshold when only the delay is set.
                eliciting_threshold: threshold.unwrap_or(1),
                max_ack_delay: delay.map(Duration::from_millis),
            }),
        };
        crate::QuicTuning {
            ack_frequency,
            segmentation_offload: self.segmentation_offload,
            congestion: crate::endpoint::Congestion::from_name(&self.congestion)
                .unwrap_or(base.congestion),
            initial_window: self.initial_window,
            ..base
        }
    }

    /// Validate, naming `section.field`.
    pub fn validate(&self, section: &str) -> Result<(), ConfigError> {
        if crate::endpoint::Congestion::from_name(&self.congestion).is_none() {
            return Err(field_err(
                format!("{section}.congestion"),
                "must be one of cubic, new_reno, bbr",
            ));
        }
        match self.apply(crate::QuicTuning::default()).transport_config() {
            Ok(_) => Ok(()),
            Err(crate::TransportError::InvalidTuning { field, reason }) => {
                let field = match field {
                    "max_ack_delay" => "max_ack_delay_ms",
                    other => other,
                };
                Err(field_err(format!("{section}.{field}"), reason))
            }
            Err(other) => Err(field_err(section, other.to_string())),
        }
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

/// Which commented settings of an example config [`uncomment_example`]
/// turns on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExampleLines {
    /// `# name = value` lines: the defaults.
    Defaults,
    /// The defaults and the `#: ...` lines: the optional settings and
    /// sections.
    All,
}

/// An example config (`iop-edge config example`) with its commented
/// settings turned on, so tests can load each form with the real loader:
/// turning the defaults on must not change the configuration, and turning
/// everything on must still load. A `# name = value` line inside an
/// optional section (after a `#: [header]` and before the next header)
/// would land in the wrong table, so it is refused: such lines are
/// written `#: name = value`.
pub fn uncomment_example(text: &str, lines: ExampleLines) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut in_optional_section = false;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') {
            in_optional_section = false;
        }
        let kept = if let Some(rest) = line.strip_prefix("#: ") {
            if rest.trim_start().starts_with('[') {
                in_optional_section = true;
            }
            match lines {
                ExampleLines::All => rest,
                ExampleLines::Defaults => line,
            }
        } else if let Some(rest) = line.strip_prefix("# ").filter(|r| is_setting(r)) {
            if in_optional_section {
                return Err(format!(
                    "line {}: `{line}` is a default inside an optional section: write it `#: {rest}`",
                    n + 1
                ));
            }
            rest
        } else {
            line
        };
        out.push_str(kept);
        out.push('\n');
    }
    Ok(out)
}

/// `name = value`, `name` in lower snake case.
fn is_setting(text: &str) -> bool {
    text.split_once(" = ").is_some_and(|(name, _)| {
        !name.is_empty()
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quic_section_defaults_are_quinns_and_bad_values_name_the_field() {
        let d = QuicSection::default();
        let base = crate::QuicTuning::for_loss_detection(Duration::from_millis(5_000));
        assert_eq!(d.apply(base), base, "an empty [quic] changes nothing");
        assert!(d.validate("quic").is_ok());
        let set = QuicSection {
            ack_eliciting_threshold: Some(0),
            max_ack_delay_ms: Some(1),
            segmentation_offload: false,
            congestion: "bbr".into(),
            initial_window: Some(1_000_000),
        };
        assert!(set.validate("quic").is_ok());
        let t = set.apply(base);
        assert_eq!(
            t.ack_frequency,
            Some(crate::endpoint::AckFrequency {
                eliciting_threshold: 0,
                max_ack_delay: Some(Duration::from_millis(1)),
            })
        );
        assert!(!t.segmentation_offload);
        assert_eq!(t.congestion, crate::endpoint::Congestion::Bbr);
        assert_eq!(t.idle_timeout, base.idle_timeout, "R-FAIL-2's bound kept");
        let only_delay = QuicSection {
            max_ack_delay_ms: Some(5),
            ..QuicSection::default()
        };
        assert_eq!(
            only_delay
                .apply(base)
                .ack_frequency
                .map(|a| a.eliciting_threshold),
            Some(1),
            "quinn's threshold when only the delay is asked for"
        );
        let field = |s: QuicSection| match s.validate("quic") {
            Err(ConfigError::Field { field, .. }) => field,
            other => panic!("expected a field error, got {other:?}"),
        };
        for (bad, name) in [
            (
                QuicSection {
                    congestion: "vegas".into(),
                    ..QuicSection::default()
                },
                "quic.congestion",
            ),
            (
                QuicSection {
                    ack_eliciting_threshold: Some(1_001),
                    ..QuicSection::default()
                },
                "quic.ack_eliciting_threshold",
            ),
            (
                QuicSection {
                    max_ack_delay_ms: Some(0),
                    ..QuicSection::default()
                },
                "quic.max_ack_delay_ms",
            ),
            (
                QuicSection {
                    max_ack_delay_ms: Some(26),
                    ..QuicSection::default()
                },
                "quic.max_ack_delay_ms",
            ),
            (
                QuicSection {
                    initial_window: Some(100),
                    ..QuicSection::default()
                },
                "quic.initial_window",
            ),
        ] {
            assert_eq!(field(bad), name);
        }
    }

    #[test]
    fn example_lines_turn_on_defaults_then_optional_settings() {
        let text =
            "[a]\n# x = 1\n# Prose, not a setting.\n#: y = 2\n#: [b]\n#: z = 3\n[c]\n# w = 4\n";
        assert_eq!(
            uncomment_example(text, ExampleLines::Defaults).unwrap(),
            "[a]\nx = 1\n# Prose, not a setting.\n#: y = 2\n#: [b]\n#: z = 3\n[c]\nw = 4\n"
        );
        assert_eq!(
            uncomment_example(text, ExampleLines::All).unwrap(),
            "[a]\nx = 1\n# Prose, not a setting.\ny = 2\n[b]\nz = 3\n[c]\nw = 4\n"
        );
        let e = uncomment_example("#: [b]\n# z = 3\n", ExampleLines::Defaults).unwrap_err();
        assert!(e.contains("line 2"), "{e}");
    }
}
