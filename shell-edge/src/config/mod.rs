//! The Edge's TOML configuration, validated at load. Every error names the
//! field that is wrong.
//!
//! One file per section: [`EdgeFile`] and [`EdgeConfig`] here (loading, and
//! the checks that span sections), then `[edge]`, `[admission]`,
//! `[health]`, `[[providers]]`, `[[routes]]` with `[discovered_models]`,
//! `[[api_keys]]` with `[[credentials]]` (the secrets) and `[journal]`.
//! `[tls]`, `[heartbeat]`, `[quic]`, `[otlp]`, `[otlp_traces]` and
//! `[runtime]` are the transport's sections, shared with the Node.

mod admission;
mod edge;
mod example;
#[cfg(test)]
mod fixture;
mod health;
mod journal;
mod providers;
mod routes;
mod secrets;
mod tenants;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use iop_core::edge::admission::AdmissionConfig;
use iop_core::ids::{NodeId, ProviderId};
use iop_core::liveness::heartbeat::HeartbeatConfig;
pub use iop_transport::config_file::{ConfigFile, SharedSections};
use iop_transport::environment::{Environment, deserialize_overlaid};
use iop_transport::runtime::RuntimeSection;
use iop_transport::settings::{
    ConfigError, HeartbeatSection, QuicSection, TlsFiles, config_text, field_err, valid_name,
};
use iop_transport::telemetry::OtlpSection;
use serde::Deserialize;

pub use admission::AdmissionSection;
pub use edge::{
    DEFAULT_EDGE_ID, EdgeSection, MAX_BODY_BYTES_LIMIT, MAX_CONNECTIONS_LIMIT,
    MAX_H2_CONCURRENT_STREAMS_LIMIT, MAX_NODE_CONNECTIONS_LIMIT, MAX_REQUEST_MEMORY_BYTES_LIMIT,
    WIRE_HEADROOM_BYTES,
};
pub use example::EXAMPLE;
pub use health::HealthSection;
pub use journal::{JournalSection, JournalStoreKind, NatsSection};
pub use providers::{Provider, ProviderEntry, ProviderMode};
pub use routes::{DiscoveredModelsSection, RouteEntry};
pub use secrets::{ApiKey, ApiKeyEntry, CredentialEntry, CredentialProfile};
pub use tenants::{LimitsEntry, PriceEntry, PrincipalEntry, TenantsSection};

use crate::catalog::model_matches;
use providers::validate_providers;
use routes::{Routes, validate_routes};
use secrets::{parse_api_keys, parse_credentials};

/// The raw file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeFile {
    /// `[edge]`.
    pub edge: EdgeSection,
    /// `[tls]`.
    pub tls: TlsFiles,
    /// `[heartbeat]`.
    #[serde(default)]
    pub heartbeat: HeartbeatSection,
    /// `[admission]`.
    #[serde(default)]
    pub admission: AdmissionSection,
    /// `[health]`.
    #[serde(default)]
    pub health: HealthSection,
    /// `[[providers]]`.
    #[serde(default)]
    pub providers: Vec<ProviderEntry>,
    /// `[[routes]]`.
    #[serde(default)]
    pub routes: Vec<RouteEntry>,
    /// `[[api_keys]]`.
    #[serde(default)]
    pub api_keys: Vec<ApiKeyEntry>,
    /// `[discovered_models]`: hide or rename models providers report.
    #[serde(default)]
    pub discovered_models: DiscoveredModelsSection,
    /// `[[credentials]]`.
    #[serde(default)]
    pub credentials: Vec<CredentialEntry>,
    /// `[otlp]`: optional OTLP metrics export.
    #[serde(default)]
    pub otlp: Option<OtlpSection>,
    /// `[otlp_traces]`: optional OTLP span export.
    #[serde(default)]
    pub otlp_traces: Option<iop_transport::traces::OtlpTracesSection>,
    /// `[journal]`: where durable responses are kept (SPEC §6).
    #[serde(default)]
    pub journal: JournalSection,
    /// `[tenants]`: how limits are counted (SPEC §9).
    #[serde(default)]
    pub tenants: TenantsSection,
    /// `[[principals]]`: limits of every key of a principal together.
    #[serde(default)]
    pub principals: Vec<PrincipalEntry>,
    /// `[[prices]]`: the price of each model (R-TEN-2).
    #[serde(default)]
    pub prices: Vec<PriceEntry>,
    /// `[runtime]`: the async runtime the process runs on.
    #[serde(default)]
    pub runtime: RuntimeSection,
    /// `[quic]`: quinn's transport settings.
    #[serde(default)]
    pub quic: QuicSection,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    /// `[edge]`.
    pub edge: EdgeSection,
    /// `[tls]`.
    pub tls: TlsFiles,
    /// Heartbeat profile.
    pub heartbeat: HeartbeatConfig,
    /// QUIC settings from `[heartbeat] loss_detect_ms` (R-FAIL-2) and
    /// `[quic]`.
    pub quic_tuning: iop_transport::QuicTuning,
    /// Admission.
    pub admission: AdmissionSection,
    /// Health tracker.
    pub health: HealthSection,
    /// Providers.
    pub providers: Vec<Provider>,
    /// Routes: model -> provider pool.
    pub routes: Vec<(String, Vec<ProviderId>)>,
    /// Routes that say whether they continue answers (R-CONT-1).
    pub continuation_routes: Vec<(String, bool)>,
    /// `[discovered_models]`: hidden and renamed models.
    pub model_names: crate::catalog::ModelNames,
    /// API keys.
    pub api_keys: Vec<ApiKey>,
    /// Managed credential profiles.
    pub credentials: Vec<CredentialProfile>,
    /// OTLP metrics export (`None`: off).
    pub otlp: Option<OtlpSection>,
    /// OTLP span export (`None`: off).
    pub otlp_traces: Option<iop_transport::traces::OtlpTracesSection>,
    /// Durable responses.
    pub journal: JournalSection,
    /// How tenants' limits are counted.
    pub tenants: TenantsSection,
    /// Each principal's limits.
    pub principals: Vec<(String, iop_core::tenant::Limits)>,
    /// Model pattern -> price.
    pub prices: Vec<(String, iop_core::tenant::Price)>,
    /// The async runtime the process runs on.
    pub runtime: RuntimeSection,
}

/// The prefix of the environment variables that set config fields:
/// `IOP_EDGE__EDGE__MAX_CONNECTIONS=8192` sets `[edge] max_connections`
/// (the rule: [`iop_transport::environment`]).
pub const ENV_PREFIX: &str = "IOP_EDGE";

/// Loaded as [`iop_transport::config_file::ConfigFile`] says: the file,
/// the `IOP_EDGE__*` variables laid over it, then [`EdgeConfig`]'s own checks.
impl ConfigFile for EdgeConfig {
    type File = EdgeFile;
    const ENV_PREFIX: &'static str = ENV_PREFIX;

    fn shared(file: &mut EdgeFile) -> SharedSections<'_> {
        SharedSections {
            tls: &mut file.tls,
            heartbeat: &file.heartbeat,
            runtime: &file.runtime,
            quic: &file.quic,
            otlp: &mut file.otlp,
            otlp_traces: &mut file.otlp_traces,
        }
    }

    fn validate(file: EdgeFile, base: &Path, env: &Environment) -> Result<Self, ConfigError> {
        Self::validated(file, base, env)
    }

    fn runtime(&self) -> &RuntimeSection {
        &self.runtime
    }
}

impl EdgeConfig {
    fn validated(mut file: EdgeFile, base: &Path, env: &Environment) -> Result<Self, ConfigError> {
        file.journal.validate(base, env)?;
        match &file.edge.edge_id {
            Some(id) if !valid_name(id) => {
                return Err(field_err(
                    "edge.edge_id",
                    "must be 1-128 chars of [A-Za-z0-9._-]",
                ));
            }
            None if file.journal.store.is_shared() => {
                return Err(field_err(
                    "edge.edge_id",
                    "required with journal.store = \"nats\": each Edge sharing the store needs \
                     its own id",
                ));
            }
            _ => {}
        }
        if file.edge.state_dir.is_relative() {
            file.edge.state_dir = base.join(&file.edge.state_dir);
        }
        file.admission.validate()?;
        file.edge.validate_limits()?;

        let credentials = parse_credentials(&file.credentials, base, env)?;
        let providers = validate_providers(&file.providers, &credentials)?;
        let Routes {
            pools: routes,
            continuation: continuation_routes,
        } = validate_routes(&file.routes, &providers)?;
        let model_names = file.discovered_models.validate()?;
        let api_keys = parse_api_keys(&file.api_keys, base, env)?;
        file.tenants.validate()?;
        let principals = tenants::validate_principals(&file.principals)?;
        let prices = tenants::validate_prices(&file.prices)?;
        let health = file.health;
        health.validate()?;
        Ok(Self {
            heartbeat: file.heartbeat.to_core(),
            quic_tuning: file.quic.apply(file.heartbeat.quic_tuning()),
            admission: file.admission,
            health,
            edge: file.edge,
            tls: file.tls,
            providers,
            routes,
            continuation_routes,
            model_names,
            api_keys,
            credentials,
            otlp: file.otlp,
            otlp_traces: file.otlp_traces,
            journal: file.journal,
            tenants: file.tenants,
            principals,
            prices,
            runtime: file.runtime,
        })
    }

    /// The limits of `principal` (none when it has no `[[principals]]`
    /// entry).
    pub fn principal_limits(&self, principal: &str) -> iop_core::tenant::Limits {
        self.principals
            .iter()
            .find(|(n, _)| n == principal)
            .map(|(_, l)| l.clone())
            .unwrap_or_default()
    }

    /// The price of `model`: an exact `[[prices]]` entry, else the longest
    /// matching pattern.
    pub fn price_for(&self, model: &str) -> Option<iop_core::tenant::Price> {
        if let Some((_, p)) = self.prices.iter().find(|(m, _)| m == model) {
            return Some(*p);
        }
        self.prices
            .iter()
            .filter(|(m, _)| model_matches(m, model))
            .max_by_key(|(m, _)| m.len())
            .map(|(_, p)| *p)
    }

    /// Re-read only the `[[credentials]]` section of the configuration
    /// (the file at `path` and `env`): secrets, revisions, disabled flags,
    /// for a reload (SIGHUP).
    pub fn load_credentials(
        path: Option<&Path>,
        env: &Environment,
    ) -> Result<Vec<CredentialProfile>, ConfigError> {
        let (text, base) = config_text(path)?;
        let (file, sources) = deserialize_overlaid::<EdgeFile>(&text, env, ENV_PREFIX)?;
        parse_credentials(&file.credentials, &base, env).map_err(|e| sources.annotate(e))
    }

    /// The core's health tracker settings.
    pub fn health_config(&self) -> iop_core::edge::health::HealthConfig {
        self.health.to_core()
    }

    /// The core's admission bounds.
    pub fn admission_config(&self) -> AdmissionConfig {
        AdmissionConfig {
            queue_capacity: self.admission.queue_capacity,
            queue_timeout: Duration::from_millis(self.admission.queue_timeout_ms),
        }
    }

    /// Providers without a configured `capacity`: their node's reported
    /// limit for the target becomes their capacity.
    pub fn capacity_from_node(&self) -> BTreeSet<ProviderId> {
        self.providers
            .iter()
            .filter(|p| p.capacity_from_node)
            .map(|p| p.spec.id.clone())
            .collect()
    }

    /// Node ids named by providers.
    pub fn known_nodes(&self) -> BTreeSet<NodeId> {
        self.providers.iter().map(|p| p.spec.node.clone()).collect()
    }

    /// The provider pool serving `model`: an exact route, else the longest
    /// prefix route (`model = "llama3*"`).
    pub fn route(&self, model: &str) -> Option<&[ProviderId]> {
        if let Some((_, pool)) = self.routes.iter().find(|(m, _)| m == model) {
            return Some(pool);
        }
        self.routes
            .iter()
            .filter(|(m, _)| m.ends_with('*') && model_matches(m, model))
            .max_by_key(|(m, _)| m.len())
            .map(|(_, pool)| pool.as_slice())
    }

    /// Whether answers of `model` continue on another provider when theirs
    /// fails after commit (R-CONT-1): its route's setting (exact, else the
    /// longest matching pattern), else `[admission] continuation`.
    pub fn continuation_for(&self, model: &str) -> bool {
        if let Some((_, c)) = self.continuation_routes.iter().find(|(m, _)| m == model) {
            return *c;
        }
        self.continuation_routes
            .iter()
            .filter(|(m, _)| m.ends_with('*') && model_matches(m, model))
            .max_by_key(|(m, _)| m.len())
            .map_or(self.admission.continuation, |(_, c)| *c)
    }

    /// The pool of an exact `[[routes]]` entry for `model` (a pin: it wins
    /// over discovered models).
    pub fn exact_route(&self, model: &str) -> Option<&[ProviderId]> {
        self.routes
            .iter()
            .find(|(m, _)| m == model)
            .map(|(_, pool)| pool.as_slice())
    }

    /// Model names to list (exact routes only, not prefix patterns).
    pub fn listed_models(&self) -> impl Iterator<Item = &str> {
        self.routes
            .iter()
            .map(|(m, _)| m.as_str())
            .filter(|m| !m.ends_with('*'))
    }

    /// A provider by id.
    pub fn provider(&self, id: &ProviderId) -> Option<&Provider> {
        self.providers.iter().find(|p| &p.spec.id == id)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::fixture::{BASE, field_of, parse};

    #[test]
    fn runtime_worker_threads_default_to_one_per_cpu_and_are_bounded() {
        use iop_transport::runtime::{MAX_WORKER_THREADS, RuntimeFlavor};
        assert_eq!(parse("").unwrap().runtime.flavor(), RuntimeFlavor::PerCpu);
        let one = parse("[runtime]\nworker_threads = 1\n").unwrap();
        assert_eq!(one.runtime.flavor(), RuntimeFlavor::CurrentThread);
        let too_many = format!("[runtime]\nworker_threads = {}\n", MAX_WORKER_THREADS + 1);
        assert_eq!(
            field_of(parse(&too_many).unwrap_err()),
            "runtime.worker_threads"
        );
    }

    #[test]
    fn quic_settings_reach_the_tuning_and_bad_values_name_the_field() {
        use iop_transport::{AckFrequency, Congestion};
        let d = parse("").unwrap();
        assert_eq!(d.quic_tuning.ack_frequency, None);
        assert!(d.quic_tuning.segmentation_offload);
        assert_eq!(d.quic_tuning.congestion, Congestion::Cubic);
        let c = parse(
            "[quic]\nack_eliciting_threshold = 0\nsegmentation_offload = false\n\
             congestion = \"bbr\"\ninitial_window = 64000\n",
        )
        .unwrap();
        assert_eq!(
            c.quic_tuning.ack_frequency,
            Some(AckFrequency {
                eliciting_threshold: 0,
                max_ack_delay: None
            })
        );
        assert!(!c.quic_tuning.segmentation_offload);
        assert_eq!(c.quic_tuning.congestion, Congestion::Bbr);
        assert_eq!(c.quic_tuning.initial_window, Some(64_000));
        // R-FAIL-2's bound still comes from [heartbeat].
        assert_eq!(c.quic_tuning.idle_timeout, d.quic_tuning.idle_timeout);
        for (bad, field) in [
            ("congestion = \"reno\"", "quic.congestion"),
            ("max_ack_delay_ms = 0", "quic.max_ack_delay_ms"),
            (
                "ack_eliciting_threshold = 5000",
                "quic.ack_eliciting_threshold",
            ),
            ("initial_window = 1", "quic.initial_window"),
        ] {
            assert_eq!(
                field_of(parse(&format!("[quic]\n{bad}\n")).unwrap_err()),
                field
            );
        }
    }

    #[test]
    fn defaults_are_production_values() {
        let c = parse("").unwrap();
        assert_eq!(c.heartbeat, HeartbeatConfig::default());
        assert_eq!(c.tls.ca, Path::new("/etc/iop/ca.pem"));
        assert_eq!(c.admission.queue_capacity, 256);
        assert!(c.otlp.is_none(), "OTLP export is off unless configured");
        let c = parse("[otlp]\nendpoint = 'http://collector:4318'\n").unwrap();
        let otlp = c.otlp.unwrap();
        assert_eq!(otlp.endpoint, "http://collector:4318/v1/metrics");
        assert_eq!((otlp.interval_ms, otlp.timeout_ms), (15_000, 5_000));
    }

    #[test]
    fn errors_name_the_bad_field() {
        let e = parse("[heartbeat]\ninterval_ms = 0\n").unwrap_err();
        assert_eq!(field_of(e), "heartbeat.interval_ms");
        let e = parse("[[providers]]\nid='a'\nnode='n'\nadapter='nope'\ntarget='t'\n").unwrap_err();
        assert_eq!(field_of(e), "providers[0].adapter");
        let e = parse(
            "[[providers]]\nid='a'\nnode='n'\nadapter='mock'\ntarget='t'\nstall_timeout_ms=5\n",
        )
        .unwrap_err();
        assert_eq!(field_of(e), "providers[0].stall_timeout_ms");
        let e = parse("[[routes]]\nmodel='m'\nproviders=['ghost']\n").unwrap_err();
        assert_eq!(field_of(e), "routes[0].providers[0]");
        for bad in ["0", "99999999999"] {
            let text = BASE.replace(
                "state_dir = \"state\"",
                &format!("state_dir = \"state\"\nmax_connections = {bad}"),
            );
            let e = EdgeConfig::parse(&text, Path::new("/etc/iop")).unwrap_err();
            assert_eq!(field_of(e), "edge.max_connections");
        }
        let e = parse("[otlp]\nendpoint = 'collector:4318'\n").unwrap_err();
        assert_eq!(field_of(e), "otlp.endpoint");
        let e = parse("[otlp]\nendpoint = 'http://c:4318'\ninterval_ms = 1\n").unwrap_err();
        assert_eq!(field_of(e), "otlp.interval_ms");
    }

    fn env(pairs: &[(&str, &str)]) -> Environment {
        Environment::from_pairs(pairs.iter().copied())
    }

    #[test]
    fn every_field_can_come_from_the_environment_without_a_file() {
        let c = EdgeConfig::load_in(
            None,
            &env(&[
                ("IOP_EDGE__EDGE__STATE_DIR", "/var/lib/iop-edge"),
                ("IOP_EDGE__EDGE__HTTP_LISTEN", "0.0.0.0:8080"),
                ("IOP_EDGE__EDGE__MAX_CONNECTIONS", "8192"),
                ("IOP_EDGE__EDGE__EDGE_ID", "7"),
                ("IOP_EDGE__TLS__CA", "/run/secrets/ca.pem"),
                ("IOP_EDGE__TLS__CERT", "/run/secrets/edge.pem"),
                ("IOP_EDGE__TLS__KEY", "/run/secrets/edge.key"),
                ("IOP_EDGE__PROVIDERS__0__ID", "gpu-1-vllm"),
                ("IOP_EDGE__PROVIDERS__0__NODE", "gpu-1"),
                ("IOP_EDGE__PROVIDERS__0__ADAPTER", "openai"),
                ("IOP_EDGE__PROVIDERS__0__TARGET", "vllm"),
                ("IOP_EDGE__PROVIDERS__0__MODELS", "[\"llama-3.1-8b\"]"),
                ("IOP_EDGE__PROVIDERS__0__CAPACITY", "8"),
                ("IOP_EDGE__API_KEYS__0__PRINCIPAL", "team-a"),
                ("IOP_EDGE__API_KEYS__0__KEY_ENV", "IOP_KEY_TEAM_A"),
                ("IOP_KEY_TEAM_A", "sk-team-a-0123456789abcdef"),
                ("IOP_EDGE__TENANTS__CHUNK_FRACTION", "0.25"),
            ]),
        )
        .unwrap();
        assert_eq!(c.edge.http_listen.to_string(), "0.0.0.0:8080");
        assert_eq!(c.edge.max_connections, 8192);
        assert_eq!(
            c.edge.edge_id(),
            "7",
            "a number is text where text is taken"
        );
        assert_eq!(c.tls.key, Path::new("/run/secrets/edge.key"));
        assert_eq!(c.providers[0].spec.capacity, 8);
        assert!(c.route("llama-3.1-8b").is_some());
        assert_eq!(c.api_keys[0].key, "sk-team-a-0123456789abcdef");
        assert_eq!(c.tenants.chunk_fraction, 0.25);
    }

    #[test]
    fn the_environment_wins_over_the_file_and_its_errors_name_the_variable() {
        let text = format!("{BASE}[admission]\nqueue_capacity = 10\n");
        let base = Path::new("/etc/iop");
        let c = EdgeConfig::parse_in(
            &text,
            base,
            &env(&[("IOP_EDGE__ADMISSION__QUEUE_CAPACITY", "20")]),
        )
        .unwrap();
        assert_eq!(c.admission.queue_capacity, 20);
        for (var, value, field) in [
            // A check of the loader after deserializing.
            (
                "IOP_EDGE__EDGE__MAX_CONNECTIONS",
                "0",
                "edge.max_connections",
            ),
            // A value of the wrong type.
            (
                "IOP_EDGE__ADMISSION__QUEUE_CAPACITY",
                "lots",
                "admission.queue_capacity",
            ),
            // A field that does not exist.
            (
                "IOP_EDGE__ADMISSION__QUEUE_SIZE",
                "3",
                "admission.queue_size",
            ),
            // A secret's variable that is not set.
            (
                "IOP_EDGE__API_KEYS__0__KEY_ENV",
                "IOP_UNSET_KEY",
                "api_keys[0].key_env",
            ),
        ] {
            let mut pairs = vec![(var, value)];
            if var.contains("API_KEYS") {
                pairs.push(("IOP_EDGE__API_KEYS__0__PRINCIPAL", "p"));
            }
            match EdgeConfig::parse_in(&text, base, &env(&pairs)).unwrap_err() {
                ConfigError::Field { field: f, message } => {
                    assert_eq!(f, field, "{var}");
                    assert!(message.contains(var), "{var}: {message}");
                }
                other => panic!("{var}: {other}"),
            }
        }
        // An error about a field the file set does not blame a variable.
        let e = parse("[admission]\nqueue_capacity = 0\n").unwrap_err();
        assert!(!e.to_string().contains("IOP_EDGE__"), "{e}");
    }

    #[test]
    fn credentials_reload_with_the_same_environment() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("edge.toml");
        std::fs::write(
            &path,
            format!("{BASE}[[credentials]]\nprofile = \"p\"\nsecret_env = \"IOP_P\"\n"),
        )
        .unwrap();
        let profiles = EdgeConfig::load_credentials(
            Some(&path),
            &env(&[
                ("IOP_P", "secret-1"),
                ("IOP_EDGE__CREDENTIALS__0__REVISION", "4"),
            ]),
        )
        .unwrap();
        assert_eq!(profiles[0].revision, 4);
        assert_eq!(profiles[0].secret.as_slice(), b"secret-1");
    }

    #[test]
    fn unknown_fields_are_refused_with_their_name() {
        let e = parse("[admission]\nqueue_size = 3\n").unwrap_err();
        assert!(e.to_string().contains("queue_size"), "{e}");
    }
}
