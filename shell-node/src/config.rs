//! The Node's TOML configuration, validated at load. Every error names the
//! field that is wrong. Every field can also come from an `IOP_NODE__*`
//! environment variable ([`ENV_PREFIX`]); [`EXAMPLE`] is the commented
//! example `iop-node config example` prints.

mod example;

pub use example::EXAMPLE;

use std::path::{Path, PathBuf};
use std::time::Duration;

use iop_core::liveness::backoff::BackoffConfig;
use iop_core::liveness::heartbeat::HeartbeatConfig;
use iop_core::node::watchdog::WatchdogConfig;
pub use iop_transport::config_file::{ConfigFile, SharedSections};
use iop_transport::environment::{Environment, read_secret};
use iop_transport::runtime::RuntimeSection;
use iop_transport::settings::{ConfigError, HeartbeatSection, TlsFiles, field_err, valid_name};
use iop_transport::telemetry::OtlpSection;
use iop_wire::AdapterKind;
use serde::Deserialize;

/// `[node]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// The Edge's QUIC address, `host:port` (one Edge; or `edges`).
    #[serde(default)]
    pub edge: Option<String>,
    /// Every Edge's QUIC address, `host:port` each (many Edges, SPEC §8
    /// R-MULTI-1): the node keeps one connection to each, with its own
    /// generation, heartbeat and readiness.
    #[serde(default)]
    pub edges: Vec<String>,
    /// The name the Edges' certificates are checked against.
    #[serde(default = "default_server_name")]
    pub edge_server_name: String,
    /// Where the node keeps its recipient key.
    pub state_dir: PathBuf,
    /// Concurrent runs and tunnels over every Edge connection (parked
    /// durable runs included); past it the node answers `node_overloaded`.
    #[serde(default = "default_max_runs")]
    pub max_concurrent_runs: u32,
    /// Optional Prometheus listen address.
    #[serde(default)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Bytes of output one durable run keeps until its Edge acknowledges
    /// them durable (and while it is parked without a connection,
    /// R-PARK-1); past it the run stops reading from its provider.
    #[serde(default = "default_park_buffer_bytes")]
    pub park_buffer_bytes: usize,
}

fn default_park_buffer_bytes() -> usize {
    iop_core::node::park::DEFAULT_MAX_KEPT_BYTES
}

/// Edges one node connects to at most.
pub const MAX_EDGES: usize = 16;

fn default_server_name() -> String {
    "localhost".into()
}
fn default_max_runs() -> u32 {
    64
}

/// `[reconnect]`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReconnectSection {
    /// First retry ceiling.
    pub initial_ms: u64,
    /// Cap.
    pub max_ms: u64,
    /// Bound of one connection attempt (QUIC handshake).
    pub connect_timeout_ms: u64,
}

impl Default for ReconnectSection {
    fn default() -> Self {
        let d = BackoffConfig::default();
        Self {
            initial_ms: d.initial.as_millis() as u64,
            max_ms: d.max.as_millis() as u64,
            connect_timeout_ms: 10_000,
        }
    }
}

/// `[watchdog]`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WatchdogSection {
    /// How long a canceled provider call may take to return (R-WD-2).
    pub close_grace_ms: u64,
    /// Bound of the exact-target health probe (R-WD-2).
    pub probe_bound_ms: u64,
}

impl Default for WatchdogSection {
    fn default() -> Self {
        let d = WatchdogConfig::default();
        Self {
            close_grace_ms: d.close_grace.as_millis() as u64,
            probe_bound_ms: d.probe_bound.as_millis() as u64,
        }
    }
}

/// One `[[providers]]` entry: a provider server this node can reach.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderEntry {
    /// `openai`, `ollama`, `anthropic` or `mock`.
    pub adapter: String,
    /// The target name the Edge config refers to.
    pub target: String,
    /// Base URL of the provider server (not for `mock`).
    #[serde(default)]
    pub base_url: Option<String>,
    /// Models it serves (informational; sent at registration).
    #[serde(default)]
    pub models: Vec<String>,
    /// Environment variable with a static API key (unmanaged credentials).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// File holding a static API key (its first line; mode 0600), instead
    /// of `api_key_env`.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// Concurrent runs this provider takes, whichever Edges dispatch to it
    /// (none: only `[node] max_concurrent_runs` bounds it); past it the
    /// node answers `node_overloaded` and the Edge re-admits the request.
    #[serde(default)]
    pub max_concurrent_runs: Option<u32>,
    /// Whether the provider's streams report usage when asked with
    /// `stream_options.include_usage` (default true). Set it to false for a
    /// server that never does (llama-cpp-python's): a client that takes its
    /// answer whole is then served by a non-streamed call, whose usage is the
    /// provider's own; a streamed answer reports no usage (`null`).
    #[serde(default)]
    pub stream_usage: Option<bool>,
    /// Whether to ask the provider's streams for the usage so far on every
    /// chunk (vLLM's `stream_options.continuous_usage_stats`; default
    /// false: other servers refuse or ignore it). The prompt's tokens are
    /// then known from the first chunk on, so a Messages client's
    /// `message_start` carries them as Anthropic's does.
    #[serde(default)]
    pub continuous_usage: Option<bool>,
    /// Whether a client that takes its answer whole (`stream: false`) is
    /// answered from one non-streamed provider call (default true), as it
    /// would call the provider itself: one read instead of one per token.
    /// The stall timeout then bounds the whole generation of such requests,
    /// as in tunnel mode. False streams from the provider for every run, so
    /// every token resets the stall timer. A durable run streams (its
    /// journal keeps the prefix as it is generated). Both give way to
    /// `stream_usage = false`: such a target's whole answers are always
    /// whole calls, the only place its usage is (core's
    /// `AnswerCall::for_run`).
    #[serde(default)]
    pub whole_calls: Option<bool>,
    /// How the provider takes a JSON Schema for structured output:
    /// `json_schema` (the OpenAI form, default; vLLM, llama.cpp's own
    /// server) or `json_object_schema` (`{"type":"json_object","schema":..}`,
    /// llama-cpp-python's form).
    #[serde(default)]
    pub structured_output: Option<String>,
    /// Whether a Messages provider (`adapter = "anthropic"`) receives the
    /// client's prompt-cache breakpoints as `cache_control` (default true).
    /// False leaves them out, for a Messages server that passes content
    /// blocks on to a backend that takes none (LiteLLM's proxy in front of
    /// llama-cpp-python: a system prompt of blocks is an HTTP 500 there).
    #[serde(default)]
    pub cache_control: Option<bool>,
}

/// The raw file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeFile {
    /// `[node]`.
    pub node: NodeSection,
    /// `[tls]`.
    pub tls: TlsFiles,
    /// `[heartbeat]`.
    #[serde(default)]
    pub heartbeat: HeartbeatSection,
    /// `[reconnect]`.
    #[serde(default)]
    pub reconnect: ReconnectSection,
    /// `[watchdog]`.
    #[serde(default)]
    pub watchdog: WatchdogSection,
    /// `[[providers]]`.
    #[serde(default)]
    pub providers: Vec<ProviderEntry>,
    /// `[otlp]`: optional OTLP metrics export.
    #[serde(default)]
    pub otlp: Option<OtlpSection>,
    /// `[otlp_traces]`: optional OTLP span export.
    #[serde(default)]
    pub otlp_traces: Option<iop_transport::traces::OtlpTracesSection>,
    /// `[runtime]`: the async runtime the process runs on.
    #[serde(default)]
    pub runtime: RuntimeSection,
    /// `[quic]`: quinn's transport settings.
    #[serde(default)]
    pub quic: iop_transport::settings::QuicSection,
}

/// A validated provider.
#[derive(Clone)]
pub struct ProviderTarget {
    /// Adapter kind.
    pub adapter: AdapterKind,
    /// Target name.
    pub target: String,
    /// Base URL (`None` for the built-in mock).
    pub base_url: Option<String>,
    /// Models.
    pub models: Vec<String>,
    /// Static API key (never logged).
    pub api_key: Option<String>,
    /// The provider's streams carry usage (default true); see
    /// `[[providers]] stream_usage`.
    pub stream_usage: bool,
    /// Streams are asked for the usage so far on every chunk (default
    /// false); see `[[providers]] continuous_usage`.
    pub continuous_usage: bool,
    /// Whole answers of ephemeral runs come from non-streamed calls
    /// (default true); see `[[providers]] whole_calls`.
    pub whole_calls: bool,
    /// The provider takes a JSON Schema as `{"type":"json_object","schema":..}`
    /// (`[[providers]] structured_output = "json_object_schema"`).
    pub json_object_schema: bool,
    /// Its own run limit over every Edge connection, if it sets one.
    pub max_concurrent_runs: Option<u32>,
    /// A Messages provider receives prompt-cache breakpoints (default
    /// true); see `[[providers]] cache_control`.
    pub cache_control: bool,
}

impl std::fmt::Debug for ProviderTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderTarget")
            .field("adapter", &self.adapter)
            .field("target", &self.target)
            .field("base_url", &self.base_url)
            .field("models", &self.models)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// `[node]`.
    pub node: NodeSection,
    /// The Edges to connect to (`[node] edge` or `[node] edges`), each
    /// `host:port`, at least one.
    pub edges: Vec<String>,
    /// `[tls]`.
    pub tls: TlsFiles,
    /// Heartbeat profile.
    pub heartbeat: HeartbeatConfig,
    /// QUIC settings from `[heartbeat] loss_detect_ms` (R-FAIL-2) and
    /// `[quic]`.
    pub quic_tuning: iop_transport::QuicTuning,
    /// Reconnect backoff.
    pub reconnect: BackoffConfig,
    /// Bound of one connection attempt.
    pub connect_timeout: Duration,
    /// Watchdog bounds.
    pub watchdog: WatchdogConfig,
    /// Providers.
    pub providers: Vec<ProviderTarget>,
    /// OTLP metrics export (`None`: off).
    pub otlp: Option<OtlpSection>,
    /// OTLP span export (`None`: off).
    pub otlp_traces: Option<iop_transport::traces::OtlpTracesSection>,
    /// The async runtime the process runs on.
    pub runtime: RuntimeSection,
}

/// The prefix of the environment variables that set config fields:
/// `IOP_NODE__NODE__MAX_CONCURRENT_RUNS=128` sets `[node]
/// max_concurrent_runs` (the rule: [`iop_transport::environment`]).
pub const ENV_PREFIX: &str = "IOP_NODE";

/// Loaded as [`iop_transport::config_file::ConfigFile`] says: the file,
/// the `IOP_NODE__*` variables laid over it, then [`NodeConfig`]'s own checks.
impl ConfigFile for NodeConfig {
    type File = NodeFile;
    const ENV_PREFIX: &'static str = ENV_PREFIX;

    fn shared(file: &mut NodeFile) -> SharedSections<'_> {
        SharedSections {
            tls: &mut file.tls,
            heartbeat: &file.heartbeat,
            runtime: &file.runtime,
            quic: &file.quic,
            otlp: &mut file.otlp,
            otlp_traces: &mut file.otlp_traces,
        }
    }

    fn validate(file: NodeFile, base: &Path, env: &Environment) -> Result<Self, ConfigError> {
        Self::validated(file, base, env)
    }

    fn runtime(&self) -> &RuntimeSection {
        &self.runtime
    }
}

impl NodeConfig {
    fn validated(mut file: NodeFile, base: &Path, env: &Environment) -> Result<Self, ConfigError> {
        if file.node.state_dir.is_relative() {
            file.node.state_dir = base.join(&file.node.state_dir);
        }
        let edges = match (file.node.edge.take(), std::mem::take(&mut file.node.edges)) {
            (Some(_), edges) if !edges.is_empty() => {
                return Err(field_err(
                    "node.edges",
                    "give `edge` (one Edge) or `edges` (many), not both",
                ));
            }
            (Some(edge), _) => {
                if edge.is_empty() || !edge.contains(':') {
                    return Err(field_err("node.edge", "must be `host:port`"));
                }
                vec![edge]
            }
            (None, edges) if edges.is_empty() => {
                return Err(field_err(
                    "node.edge",
                    "required: the Edge's QUIC address `host:port` (or `edges` for many)",
                ));
            }
            (None, edges) => {
                if edges.len() > MAX_EDGES {
                    return Err(field_err(
                        "node.edges",
                        format!("at most {MAX_EDGES} Edges"),
                    ));
                }
                for (i, edge) in edges.iter().enumerate() {
                    if edge.is_empty() || !edge.contains(':') {
                        return Err(field_err(format!("node.edges[{i}]"), "must be `host:port`"));
                    }
                    if edges[..i].contains(edge) {
                        return Err(field_err(format!("node.edges[{i}]"), "listed twice"));
                    }
                }
                edges
            }
        };
        if !(64 * 1024..=1024 * 1024 * 1024).contains(&file.node.park_buffer_bytes) {
            return Err(field_err(
                "node.park_buffer_bytes",
                "must be between 65536 and 1073741824",
            ));
        }
        if file.node.max_concurrent_runs == 0 {
            return Err(field_err("node.max_concurrent_runs", "must be > 0"));
        }
        let r = file.reconnect;
        if r.initial_ms == 0 {
            return Err(field_err("reconnect.initial_ms", "must be > 0"));
        }
        if r.max_ms < r.initial_ms {
            return Err(field_err(
                "reconnect.max_ms",
                "must be >= reconnect.initial_ms",
            ));
        }
        // A zero bound would time every dial out before its handshake.
        if r.connect_timeout_ms == 0 {
            return Err(field_err("reconnect.connect_timeout_ms", "must be > 0"));
        }
        let w = file.watchdog;
        if w.close_grace_ms == 0 {
            return Err(field_err("watchdog.close_grace_ms", "must be > 0"));
        }
        if w.probe_bound_ms == 0 {
            return Err(field_err("watchdog.probe_bound_ms", "must be > 0"));
        }
        let mut providers: Vec<ProviderTarget> = Vec::new();
        for (i, p) in file.providers.iter().enumerate() {
            let f = |name: &str| format!("providers[{i}].{name}");
            let adapter = AdapterKind::parse(&p.adapter).ok_or_else(|| {
                field_err(
                    f("adapter"),
                    "must be one of `openai`, `ollama`, `anthropic`, `mock`",
                )
            })?;
            if !valid_name(&p.target) {
                return Err(field_err(
                    f("target"),
                    "must be 1-128 chars of [A-Za-z0-9._-]",
                ));
            }
            if providers
                .iter()
                .any(|q| q.adapter == adapter && q.target == p.target)
            {
                return Err(field_err(f("target"), "duplicate adapter/target"));
            }
            let base_url = match (adapter, &p.base_url) {
                (AdapterKind::Mock, None) => None,
                (AdapterKind::Mock, Some(_)) => {
                    return Err(field_err(
                        f("base_url"),
                        "the built-in mock takes no base_url",
                    ));
                }
                (_, None) => return Err(field_err(f("base_url"), "required for this adapter")),
                (_, Some(url)) => {
                    if !(url.starts_with("http://") || url.starts_with("https://")) {
                        return Err(field_err(
                            f("base_url"),
                            "must start with http:// or https://",
                        ));
                    }
                    Some(url.trim_end_matches('/').to_owned())
                }
            };
            if p.max_concurrent_runs == Some(0) {
                return Err(field_err(f("max_concurrent_runs"), "must be > 0"));
            }
            let api_key = match (&p.api_key_env, &p.api_key_file) {
                (None, None) => None,
                (var, file) => {
                    let (key, _) = read_secret(
                        env,
                        var.as_deref(),
                        file.as_deref(),
                        base,
                        ("api_key_env", "api_key_file"),
                        &f,
                    )?;
                    Some(key.to_string())
                }
            };
            providers.push(ProviderTarget {
                adapter,
                target: p.target.clone(),
                base_url,
                models: p.models.clone(),
                api_key,
                stream_usage: p.stream_usage.unwrap_or(true),
                continuous_usage: p.continuous_usage.unwrap_or(false),
                whole_calls: p.whole_calls.unwrap_or(true),
                json_object_schema: match p.structured_output.as_deref() {
                    None | Some("json_schema") => false,
                    Some("json_object_schema") => true,
                    Some(_) => {
                        return Err(field_err(
                            f("structured_output"),
                            "must be \"json_schema\" or \"json_object_schema\"",
                        ));
                    }
                },
                max_concurrent_runs: p.max_concurrent_runs,
                cache_control: p.cache_control.unwrap_or(true),
            });
        }
        Ok(Self {
            heartbeat: file.heartbeat.to_core(),
            quic_tuning: file.quic.apply(file.heartbeat.quic_tuning()),
            otlp: file.otlp,
            otlp_traces: file.otlp_traces,
            runtime: file.runtime,
            reconnect: BackoffConfig {
                initial: Duration::from_millis(r.initial_ms),
                max: Duration::from_millis(r.max_ms),
            },
            connect_timeout: Duration::from_millis(r.connect_timeout_ms),
            watchdog: WatchdogConfig {
                close_grace: Duration::from_millis(w.close_grace_ms),
                probe_bound: Duration::from_millis(w.probe_bound_ms),
                // Admission of the node caps runs first; the watchdog's own
                // bound sits just above it.
                max_active_runs: file.node.max_concurrent_runs as usize + 16,
            },
            node: file.node,
            edges,
            tls: file.tls,
            providers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
[node]
edge = "127.0.0.1:7443"
state_dir = "state"
[tls]
ca = "ca.pem"
cert = "node.pem"
key = "node.key"
"#;

    fn field_of(extra: &str) -> String {
        match NodeConfig::parse(&format!("{BASE}{extra}"), Path::new("/x")) {
            Err(ConfigError::Field { field, .. }) => field,
            other => panic!("expected a field error, got {other:?}"),
        }
    }

    #[test]
    fn quic_settings_reach_the_tuning_and_bad_values_name_the_field() {
        let c = NodeConfig::parse(
            &format!("{BASE}[quic]\nmax_ack_delay_ms = 2\nsegmentation_offload = false\n"),
            Path::new("/x"),
        )
        .unwrap();
        assert_eq!(
            c.quic_tuning.ack_frequency,
            Some(iop_transport::AckFrequency {
                eliciting_threshold: 1,
                max_ack_delay: Some(Duration::from_millis(2)),
            })
        );
        assert!(!c.quic_tuning.segmentation_offload);
        assert_eq!(field_of("[quic]\ncongestion = \"x\"\n"), "quic.congestion");
        assert_eq!(
            field_of("[quic]\nmax_ack_delay_ms = 30\n"),
            "quic.max_ack_delay_ms"
        );
        assert_eq!(
            field_of("[quic]\ninitial_window = 0\n"),
            "quic.initial_window"
        );
    }

    #[test]
    fn runtime_worker_threads_are_bounded_by_name() {
        use iop_transport::runtime::{MAX_WORKER_THREADS, RuntimeFlavor};
        let one = NodeConfig::parse(
            &format!("{BASE}[runtime]\nworker_threads = 1\n"),
            Path::new("/x"),
        );
        assert_eq!(one.unwrap().runtime.flavor(), RuntimeFlavor::CurrentThread);
        let too_many = format!("[runtime]\nworker_threads = {}\n", MAX_WORKER_THREADS + 1);
        assert_eq!(field_of(&too_many), "runtime.worker_threads");
    }

    #[test]
    fn defaults_parse() {
        let c = NodeConfig::parse(BASE, Path::new("/x")).unwrap();
        assert_eq!(c.heartbeat, HeartbeatConfig::default());
        assert_eq!(c.node.max_concurrent_runs, 64);
        assert_eq!(c.tls.cert, Path::new("/x/node.pem"));
    }

    fn edges_of(node: &str) -> Result<Vec<String>, String> {
        let text = BASE.replace("edge = \"127.0.0.1:7443\"\n", node);
        match NodeConfig::parse(&text, Path::new("/x")) {
            Ok(c) => Ok(c.edges),
            Err(ConfigError::Field { field, .. }) => Err(field),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn r_multi_1_one_edge_or_many() {
        assert_eq!(edges_of("edge = \"e:1\"\n"), Ok(vec!["e:1".to_owned()]));
        assert_eq!(
            edges_of("edges = [\"a:1\", \"b:1\"]\n"),
            Ok(vec!["a:1".to_owned(), "b:1".to_owned()])
        );
        assert_eq!(edges_of(""), Err("node.edge".to_owned()));
        assert_eq!(edges_of("edges = []\n"), Err("node.edge".to_owned()));
        assert_eq!(
            edges_of("edge = \"a:1\"\nedges = [\"b:1\"]\n"),
            Err("node.edges".to_owned())
        );
        assert_eq!(
            edges_of("edges = [\"a:1\", \"b\"]\n"),
            Err("node.edges[1]".to_owned())
        );
        assert_eq!(
            edges_of("edges = [\"a:1\", \"a:1\"]\n"),
            Err("node.edges[1]".to_owned())
        );
    }

    fn env(pairs: &[(&str, &str)]) -> Environment {
        Environment::from_pairs(pairs.iter().copied())
    }

    #[test]
    fn every_field_can_come_from_the_environment_without_a_file() {
        let c = NodeConfig::load_in(
            None,
            &env(&[
                (
                    "IOP_NODE__NODE__EDGES",
                    "[\"edge-1:7443\", \"edge-2:7443\"]",
                ),
                ("IOP_NODE__NODE__STATE_DIR", "/var/lib/iop-node"),
                ("IOP_NODE__NODE__METRICS_LISTEN", "0.0.0.0:9464"),
                ("IOP_NODE__NODE__MAX_CONCURRENT_RUNS", "128"),
                ("IOP_NODE__TLS__CA", "/run/secrets/ca.pem"),
                ("IOP_NODE__TLS__CERT", "/run/secrets/node.pem"),
                ("IOP_NODE__TLS__KEY", "/run/secrets/node.key"),
                ("IOP_NODE__PROVIDERS__0__ADAPTER", "openai"),
                ("IOP_NODE__PROVIDERS__0__TARGET", "vllm"),
                ("IOP_NODE__PROVIDERS__0__BASE_URL", "http://vllm:8000"),
                ("IOP_NODE__PROVIDERS__0__API_KEY_ENV", "IOP_VLLM_KEY"),
                ("IOP_NODE__PROVIDERS__1__ADAPTER", "mock"),
                ("IOP_NODE__PROVIDERS__1__TARGET", "mock"),
                ("IOP_VLLM_KEY", "sk-vllm"),
            ]),
        )
        .unwrap();
        assert_eq!(c.edges, ["edge-1:7443", "edge-2:7443"]);
        assert_eq!(c.node.max_concurrent_runs, 128);
        assert_eq!(c.providers.len(), 2);
        assert_eq!(c.providers[0].api_key.as_deref(), Some("sk-vllm"));
        assert_eq!(c.tls.key, Path::new("/run/secrets/node.key"));
    }

    #[test]
    fn the_environment_wins_over_the_file_and_its_errors_name_the_variable() {
        let c = NodeConfig::parse_in(
            BASE,
            Path::new("/x"),
            &env(&[("IOP_NODE__NODE__EDGE", "edge.example.com:7443")]),
        )
        .unwrap();
        assert_eq!(c.edges, ["edge.example.com:7443"]);
        for (var, value, field) in [
            (
                "IOP_NODE__RECONNECT__INITIAL_MS",
                "0",
                "reconnect.initial_ms",
            ),
            ("IOP_NODE__NODE__EDGE", "no-port", "node.edge"),
            (
                "IOP_NODE__WATCHDOG__PROBE_BOUND",
                "5",
                "watchdog.probe_bound",
            ),
            (
                "IOP_NODE__NODE__MAX_CONCURRENT_RUNS",
                "-1",
                "node.max_concurrent_runs",
            ),
        ] {
            match NodeConfig::parse_in(BASE, Path::new("/x"), &env(&[(var, value)])).unwrap_err() {
                ConfigError::Field { field: f, message } => {
                    assert_eq!(f, field, "{var}");
                    assert!(message.contains(var), "{var}: {message}");
                }
                other => panic!("{var}: {other}"),
            }
        }
    }

    #[test]
    fn a_provider_key_comes_from_a_variable_or_a_private_file() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("provider.key");
        std::fs::write(&key, "sk-from-file\n").unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let provider = |line: &str| {
            format!(
                "{BASE}[[providers]]\nadapter = 'openai'\ntarget = 'v'\nbase_url = 'http://p'\n{line}\n"
            )
        };
        let c = NodeConfig::parse_in(
            &provider("api_key_file = 'provider.key'"),
            dir.path(),
            &Environment::default(),
        )
        .unwrap();
        assert_eq!(c.providers[0].api_key.as_deref(), Some("sk-from-file"));
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = NodeConfig::parse_in(
            &provider("api_key_file = 'provider.key'"),
            dir.path(),
            &Environment::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        let e = NodeConfig::parse_in(
            &provider("api_key_file = 'provider.key'\napi_key_env = 'K'"),
            dir.path(),
            &Environment::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("exactly one"), "{e}");
        let e = NodeConfig::parse_in(
            &provider("api_key_env = 'IOP_UNSET'"),
            dir.path(),
            &Environment::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("providers[0].api_key_env"), "{e}");
    }

    #[test]
    fn errors_name_the_bad_field() {
        assert_eq!(
            field_of("[reconnect]\ninitial_ms = 0\n"),
            "reconnect.initial_ms"
        );
        assert_eq!(
            field_of("[reconnect]\nconnect_timeout_ms = 0\n"),
            "reconnect.connect_timeout_ms"
        );
        assert_eq!(
            field_of("[[providers]]\nadapter='openai'\ntarget='v'\n"),
            "providers[0].base_url"
        );
        assert_eq!(
            field_of("[[providers]]\nadapter='x'\ntarget='v'\n"),
            "providers[0].adapter"
        );
        assert_eq!(
            field_of("[watchdog]\nprobe_bound_ms = 0\n"),
            "watchdog.probe_bound_ms"
        );
        assert_eq!(field_of("[otlp]\nendpoint = 'udp://c'\n"), "otlp.endpoint");
        assert_eq!(
            field_of("[[providers]]\nadapter='mock'\ntarget='v'\nmax_concurrent_runs=0\n"),
            "providers[0].max_concurrent_runs"
        );
        assert_eq!(
            field_of("[otlp]\nendpoint = 'http://c'\ntimeout_ms = 0\n"),
            "otlp.timeout_ms"
        );
    }
}
