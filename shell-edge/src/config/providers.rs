//! `[[providers]]`: each provider a Node serves, as the Edge dispatches to
//! it.

use std::collections::BTreeSet;

use iop_core::edge::admission::ProviderSpec;
use iop_core::ids::{NodeId, ProviderId};
use iop_transport::settings::{ConfigError, field_err, valid_name};
use iop_wire::{AdapterKind, MAX_RESPONSE_STALL_TIMEOUT_MS, MIN_RESPONSE_STALL_TIMEOUT_MS};
use serde::Deserialize;

use super::secrets::CredentialProfile;

/// How a provider's OpenAI traffic travels to its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ProviderMode {
    /// Parsed into a RunRequest; the node's adapter speaks to the provider.
    #[default]
    Normalized,
    /// The client's HTTP request is relayed to the provider as is.
    Tunnel,
}

/// One `[[providers]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderEntry {
    /// Stable id.
    pub id: String,
    /// Node id (as in the node's certificate).
    pub node: String,
    /// `openai`, `ollama` or `mock`.
    pub adapter: String,
    /// Target on the node.
    pub target: String,
    /// Models served.
    #[serde(default)]
    pub models: Vec<String>,
    /// Concurrent requests. Without it: what the node reports for the
    /// target (its `[[providers]] max_concurrent_runs`), else 4.
    #[serde(default)]
    pub capacity: Option<u32>,
    /// Stall timeout; 0 = 300000 ms.
    #[serde(default)]
    pub stall_timeout_ms: u64,
    /// `normalized` or `tunnel`.
    #[serde(default)]
    pub mode: ProviderMode,
    /// Managed credential profile (sealed lease per dispatch).
    #[serde(default)]
    pub credential: Option<String>,
    /// Route the models the provider reports (model discovery) without a
    /// `[[routes]]` entry; default true.
    #[serde(default = "default_true")]
    pub discover_models: bool,
}

fn default_true() -> bool {
    true
}

fn default_capacity() -> u32 {
    4
}

/// A validated provider.
#[derive(Debug, Clone)]
pub struct Provider {
    /// Core view.
    pub spec: ProviderSpec,
    /// Models served.
    pub models: Vec<String>,
    /// Transport mode.
    pub mode: ProviderMode,
    /// Managed credential profile.
    pub credential: Option<String>,
    /// Its reported models are routed without a `[[routes]]` entry.
    pub discover_models: bool,
    /// No `capacity` configured: its node's reported limit for the target,
    /// if any, is its capacity.
    pub capacity_from_node: bool,
}

/// The validated providers, or the first field that is wrong. A provider's
/// `credential` names one of `credentials`.
pub(super) fn validate_providers(
    entries: &[ProviderEntry],
    credentials: &[CredentialProfile],
) -> Result<Vec<Provider>, ConfigError> {
    let mut ids = BTreeSet::new();
    let mut providers = Vec::new();
    for (i, p) in entries.iter().enumerate() {
        let f = |name: &str| format!("providers[{i}].{name}");
        if !valid_name(&p.id) {
            return Err(field_err(f("id"), "must be 1-128 chars of [A-Za-z0-9._-]"));
        }
        if !ids.insert(p.id.clone()) {
            return Err(field_err(
                f("id"),
                format!("duplicate provider id `{}`", p.id),
            ));
        }
        if !valid_name(&p.node) {
            return Err(field_err(
                f("node"),
                "must be 1-128 chars of [A-Za-z0-9._-]",
            ));
        }
        let adapter = AdapterKind::parse(&p.adapter).ok_or_else(|| {
            field_err(
                f("adapter"),
                "must be one of `openai`, `ollama`, `anthropic`, `mock`",
            )
        })?;
        if p.target.is_empty() {
            return Err(field_err(f("target"), "must not be empty"));
        }
        if p.capacity == Some(0) {
            return Err(field_err(f("capacity"), "must be > 0"));
        }
        if p.stall_timeout_ms != 0
            && !(MIN_RESPONSE_STALL_TIMEOUT_MS..=MAX_RESPONSE_STALL_TIMEOUT_MS)
                .contains(&p.stall_timeout_ms)
        {
            return Err(field_err(
                f("stall_timeout_ms"),
                format!(
                    "must be 0 (default 300000) or between {MIN_RESPONSE_STALL_TIMEOUT_MS} and {MAX_RESPONSE_STALL_TIMEOUT_MS}"
                ),
            ));
        }
        if let Some(profile) = &p.credential
            && !credentials.iter().any(|c| &c.profile == profile)
        {
            return Err(field_err(
                f("credential"),
                format!("unknown credential profile `{profile}`"),
            ));
        }
        providers.push(Provider {
            spec: ProviderSpec {
                id: ProviderId::new(&p.id),
                node: NodeId::new(&p.node),
                adapter,
                target: p.target.clone(),
                capacity: p.capacity.unwrap_or_else(default_capacity),
                stall_timeout_ms: p.stall_timeout_ms,
            },
            models: p.models.clone(),
            mode: p.mode,
            credential: p.credential.clone(),
            discover_models: p.discover_models,
            capacity_from_node: p.capacity.is_none(),
        });
    }
    Ok(providers)
}
