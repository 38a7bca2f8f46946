//! Loading a process's configuration, the one way `iop-edge` and
//! `iop-node` load theirs (SPEC §10: an invalid configuration refuses to
//! start and names the field): the TOML file, the environment's
//! `PREFIX__SECTION__FIELD` variables laid over it ([`crate::environment`]),
//! the checks of the sections every process has ([`SharedSections`]), then
//! the configuration's own validation. Each configuration says only what
//! its file is, its prefix, where its shared sections are and how the rest
//! is validated ([`ConfigFile`]).

use std::path::Path;

use serde::de::DeserializeOwned;

use crate::environment::{Environment, deserialize_overlaid};
use crate::runtime::RuntimeSection;
use crate::settings::{ConfigError, HeartbeatSection, QuicSection, TlsFiles, config_text};
use crate::telemetry::OtlpSection;
use crate::traces::OtlpTracesSection;

/// The sections both processes' files have, borrowed from a file for the
/// checks they share.
#[derive(Debug)]
pub struct SharedSections<'a> {
    /// `[tls]`: its relative paths resolve against the file's directory.
    pub tls: &'a mut TlsFiles,
    /// `[heartbeat]`.
    pub heartbeat: &'a HeartbeatSection,
    /// `[runtime]`.
    pub runtime: &'a RuntimeSection,
    /// `[quic]`.
    pub quic: &'a QuicSection,
    /// `[otlp]`, if set.
    pub otlp: &'a mut Option<OtlpSection>,
    /// `[otlp_traces]`, if set.
    pub otlp_traces: &'a mut Option<OtlpTracesSection>,
}

impl SharedSections<'_> {
    /// Check each section (the first wrong field is the error) and resolve
    /// the certificate paths against `base`.
    pub fn validate(self, base: &Path) -> Result<(), ConfigError> {
        self.heartbeat.validate("heartbeat")?;
        self.runtime.validate("runtime")?;
        self.quic.validate("quic")?;
        if let Some(traces) = self.otlp_traces {
            traces.validate("otlp_traces")?;
        }
        if let Some(otlp) = self.otlp {
            otlp.validate("otlp")?;
        }
        self.tls.resolve(base);
        Ok(())
    }
}

/// A process's configuration, loaded from a TOML file with the
/// environment laid over it.
pub trait ConfigFile: Sized {
    /// The file as written.
    type File: DeserializeOwned;

    /// The prefix of the environment variables that set its fields
    /// (`IOP_EDGE`: `IOP_EDGE__EDGE__MAX_CONNECTIONS=8192` sets `[edge]
    /// max_connections`).
    const ENV_PREFIX: &'static str;

    /// The sections of `file` every process's configuration has.
    fn shared(file: &mut Self::File) -> SharedSections<'_>;

    /// Validate the rest of `file`, its shared sections checked: relative
    /// paths resolve against `base`, the secrets its `*_env` fields name
    /// come from `env`.
    fn validate(file: Self::File, base: &Path, env: &Environment) -> Result<Self, ConfigError>;

    /// `[runtime]`: the async runtime the process runs on.
    fn runtime(&self) -> &RuntimeSection;

    /// Load and validate a file with the process environment: its
    /// variables laid over the file, and the secrets its `*_env` fields
    /// name. Relative paths resolve against the file's directory.
    fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_in(Some(path), &Environment::from_process())
    }

    /// Load and validate the file at `path` with `env`; without a file the
    /// environment gives the whole configuration and relative paths resolve
    /// against the working directory.
    fn load_in(path: Option<&Path>, env: &Environment) -> Result<Self, ConfigError> {
        let (text, base) = config_text(path)?;
        Self::parse_in(&text, &base, env)
    }

    /// Parse and validate TOML text with the process environment.
    fn parse(text: &str, base: &Path) -> Result<Self, ConfigError> {
        Self::parse_in(text, base, &Environment::from_process())
    }

    /// Parse and validate TOML text with `env`'s variables laid over it
    /// and its secrets. An error about a value a variable set names the
    /// variable.
    fn parse_in(text: &str, base: &Path, env: &Environment) -> Result<Self, ConfigError> {
        let (mut file, sources) = deserialize_overlaid::<Self::File>(text, env, Self::ENV_PREFIX)?;
        Self::shared(&mut file)
            .validate(base)
            .and_then(|()| Self::validate(file, base, env))
            .map_err(|e| sources.annotate(e))
    }
}

/// Why `run` could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration does not load.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The runtime its `[runtime]` asks for could not be built.
    #[error("starting the tokio runtime")]
    Runtime(#[source] std::io::Error),
}

/// What `run` starts from: the configuration at `path` (without one, the
/// environment's alone) with the process environment, and the runtime its
/// `[runtime]` asks for.
pub fn load_to_run<C: ConfigFile>(
    path: Option<&Path>,
) -> Result<(C, tokio::runtime::Runtime), StartError> {
    let config = C::load_in(path, &Environment::from_process())?;
    let runtime = config.runtime().build().map_err(StartError::Runtime)?;
    Ok((config, runtime))
}
