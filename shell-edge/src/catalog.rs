//! Model discovery: the models each provider serves, as its Node last
//! reported them.
//!
//! Every health probe of a provider is a `CAPABILITIES` command whose answer
//! lists the models the target serves (`GET /v1/models` for `openai`,
//! `GET /api/tags` for `ollama`, the configured list for `mock`). The hub
//! records each answer here ([`ModelCatalog::observe`]); the HTTP layer routes
//! a model no `[[routes]]` entry names to the providers that reported it
//! ([`ModelCatalog::pool_for`]) and lists those models in `/v1/models` and
//! `/api/tags` ([`ModelCatalog::listed`]). An answer that the target is
//! unavailable empties its list (what is listed is what is routable now);
//! a probe without a verdict keeps the last list.
//!
//! The operator keeps control: an exact `[[routes]]` entry wins over
//! discovery (pin), `discover_models = false` on a provider keeps its
//! models out, `[discovered_models] hide` keeps matching names out,
//! `[discovered_models.rename]` gives a model the name clients use
//! ([`ModelNames`]), and each API key's `models` still restricts what it
//! may use (by the name clients use). Lists are bounded ([`MAX_MODELS_PER_PROVIDER`],
//! [`MAX_MODEL_NAME_BYTES`]): a Node cannot grow the Edge's memory without
//! bound.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::RwLock;

use iop_core::ids::ProviderId;
use iop_wire::{CapabilitiesReport, ProviderHealth};

/// Does `pattern` (an exact name, `*`, or a `prefix*`) match `model`?
pub fn model_matches(pattern: &str, model: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => model.starts_with(prefix),
        None => pattern == model,
    }
}

/// Most models kept per provider; further names in one report are dropped.
pub const MAX_MODELS_PER_PROVIDER: usize = 1024;

/// Longest model name kept; longer names are dropped.
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// The discovered models of every discovering provider.
#[derive(Debug, Default)]
pub struct ModelCatalog {
    /// Providers that take part, in configuration (preference) order.
    order: Vec<ProviderId>,
    models: RwLock<BTreeMap<ProviderId, BTreeSet<String>>>,
}

impl ModelCatalog {
    /// A catalog for the providers in `discovering`, in preference order;
    /// reports about other providers are ignored.
    pub fn new(discovering: Vec<ProviderId>) -> Self {
        Self {
            order: discovering,
            models: RwLock::new(BTreeMap::new()),
        }
    }

    /// Record a probe answer about `provider`: its models when the target
    /// answered available, none when it answered unavailable. A probe with
    /// no verdict (`unknown`: a timeout, a busy server) changes nothing:
    /// whether the provider may take work is the health tracker's call, and
    /// a model that exists is not made to vanish by one slow probe.
    pub fn observe(&self, provider: &ProviderId, report: &CapabilitiesReport) {
        if !self.order.contains(provider)
            || report
                .targets
                .iter()
                .all(|t| t.status == ProviderHealth::Unknown)
        {
            return;
        }
        let mut models = BTreeSet::new();
        for target in &report.targets {
            if target.status != ProviderHealth::Available {
                continue;
            }
            for name in &target.models {
                if models.len() == MAX_MODELS_PER_PROVIDER {
                    break;
                }
                if !name.is_empty() && name.len() <= MAX_MODEL_NAME_BYTES {
                    models.insert(name.clone());
                }
            }
        }
        let mut all = self.models.write().unwrap_or_else(|e| e.into_inner());
        all.insert(provider.clone(), models);
    }

    /// The providers that reported `model`, in preference order.
    pub fn pool_for(&self, model: &str) -> Vec<ProviderId> {
        let all = self.models.read().unwrap_or_else(|e| e.into_inner());
        self.order
            .iter()
            .filter(|p| all.get(*p).is_some_and(|m| m.contains(model)))
            .cloned()
            .collect()
    }

    /// Every discovered model, sorted.
    pub fn listed(&self) -> BTreeSet<String> {
        let all = self.models.read().unwrap_or_else(|e| e.into_inner());
        all.values().flatten().cloned().collect()
    }
}

/// How discovered model names become the names clients use
/// (`[discovered_models]`): some are hidden, some renamed.
///
/// A rename is one name for both directions: clients ask for and see the
/// new name, the providers are asked for the old one, on every route (a
/// pinned or prefix route of the new name too). The old name is no longer
/// routed by discovery; an exact `[[routes]]` entry may still name it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelNames {
    /// Patterns (exact, or a prefix ending in `*`) of discovered names
    /// neither listed nor routed by discovery.
    hide: Vec<String>,
    /// Discovered name -> the name clients use.
    rename: BTreeMap<String, String>,
}

impl ModelNames {
    /// Names with these hide patterns and renames (validated by the
    /// configuration).
    pub fn new(hide: Vec<String>, rename: BTreeMap<String, String>) -> Self {
        Self { hide, rename }
    }

    /// The name clients use for discovered model `discovered`; `None`
    /// when it is hidden.
    pub fn client_name<'a>(&'a self, discovered: &'a str) -> Option<&'a str> {
        if self.hide.iter().any(|p| model_matches(p, discovered)) {
            return None;
        }
        Some(
            self.rename
                .get(discovered)
                .map_or(discovered, String::as_str),
        )
    }

    /// The discovered name a client's `model` routes to through discovery:
    /// a renamed model's old name; `None` for an old name (renamed away)
    /// or a hidden one.
    pub fn discovered_name<'a>(&'a self, model: &'a str) -> Option<&'a str> {
        let discovered = self.provider_model(model);
        if discovered == model && self.rename.contains_key(model) {
            return None;
        }
        (self.client_name(discovered) == Some(model)).then_some(discovered)
    }

    /// The name a provider is asked for when a client asks for `model`.
    pub fn provider_model<'a>(&'a self, model: &'a str) -> &'a str {
        self.rename
            .iter()
            .find(|(_, to)| *to == model)
            .map_or(model, |(from, _)| from.as_str())
    }
}

#[cfg(test)]
mod tests {
    use iop_wire::{AdapterKind, TargetHealth};

    use super::*;

    fn report(status: ProviderHealth, models: &[&str]) -> CapabilitiesReport {
        CapabilitiesReport {
            targets: vec![TargetHealth {
                adapter: AdapterKind::OpenAi,
                target: "t".into(),
                status,
                failure_code: None,
                models: models.iter().map(|m| (*m).to_owned()).collect(),
            }],
            health_observation_seq: 1,
        }
    }

    #[test]
    fn reported_models_route_to_their_providers_in_preference_order() {
        let (a, b) = (ProviderId::new("a"), ProviderId::new("b"));
        let catalog = ModelCatalog::new(vec![a.clone(), b.clone()]);
        catalog.observe(&b, &report(ProviderHealth::Available, &["llama3", "qwen"]));
        catalog.observe(&a, &report(ProviderHealth::Available, &["llama3"]));
        assert_eq!(catalog.pool_for("llama3"), vec![a.clone(), b.clone()]);
        assert_eq!(catalog.pool_for("qwen"), vec![b.clone()]);
        assert!(catalog.pool_for("other").is_empty());
        assert_eq!(
            catalog.listed().into_iter().collect::<Vec<_>>(),
            vec!["llama3".to_owned(), "qwen".to_owned()]
        );
    }

    #[test]
    fn an_unavailable_answer_empties_the_list_and_outsiders_are_ignored() {
        let a = ProviderId::new("a");
        let catalog = ModelCatalog::new(vec![a.clone()]);
        catalog.observe(&a, &report(ProviderHealth::Available, &["m"]));
        catalog.observe(&a, &report(ProviderHealth::Unknown, &[]));
        assert_eq!(
            catalog.pool_for("m"),
            vec![a.clone()],
            "no verdict changes nothing"
        );
        catalog.observe(&a, &report(ProviderHealth::Unavailable, &["m"]));
        assert!(catalog.pool_for("m").is_empty());
        catalog.observe(
            &ProviderId::new("x"),
            &report(ProviderHealth::Available, &["m"]),
        );
        assert!(catalog.listed().is_empty());
    }

    #[test]
    fn hidden_names_are_gone_and_renamed_ones_answer_to_their_new_name() {
        let names = ModelNames::new(
            vec!["embed*".into(), "secret".into()],
            BTreeMap::from([("llama3.2:1b".to_owned(), "fast".to_owned())]),
        );
        assert_eq!(names.client_name("embed-small"), None);
        assert_eq!(names.client_name("secret"), None);
        assert_eq!(names.client_name("secret-2"), Some("secret-2"));
        assert_eq!(names.client_name("llama3.2:1b"), Some("fast"));
        assert_eq!(names.discovered_name("fast"), Some("llama3.2:1b"));
        assert_eq!(names.discovered_name("llama3.2:1b"), None, "renamed away");
        assert_eq!(names.discovered_name("embed-small"), None, "hidden");
        assert_eq!(names.discovered_name("qwen"), Some("qwen"));
        assert_eq!(names.provider_model("fast"), "llama3.2:1b");
        assert_eq!(names.provider_model("qwen"), "qwen");
        // A hidden old name cannot be reached under its new name either.
        let hidden = ModelNames::new(
            vec!["llama*".into()],
            BTreeMap::from([("llama3".to_owned(), "fast".to_owned())]),
        );
        assert_eq!(hidden.discovered_name("fast"), None);
        assert_eq!(ModelNames::default().discovered_name("m"), Some("m"));
    }

    #[test]
    fn lists_are_bounded() {
        let a = ProviderId::new("a");
        let catalog = ModelCatalog::new(vec![a.clone()]);
        let long = "x".repeat(MAX_MODEL_NAME_BYTES + 1);
        let names: Vec<String> = (0..MAX_MODELS_PER_PROVIDER + 10)
            .map(|i| format!("m{i}"))
            .collect();
        let mut refs: Vec<&str> = names.iter().map(String::as_str).collect();
        refs.push(&long);
        catalog.observe(&a, &report(ProviderHealth::Available, &refs));
        assert_eq!(catalog.listed().len(), MAX_MODELS_PER_PROVIDER);
        assert!(!catalog.listed().contains(&long));
    }
}
