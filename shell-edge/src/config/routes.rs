//! `[[routes]]` and `[discovered_models]`: which providers serve a model
//! name, configured or reported by the providers (model discovery,
//! [`crate::catalog`]).

use std::collections::{BTreeMap, BTreeSet};

use iop_core::ids::ProviderId;
use iop_transport::settings::{ConfigError, field_err};
use serde::Deserialize;

use super::providers::Provider;

/// One `[[routes]]` entry: a model name to a provider pool.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteEntry {
    /// Model name clients ask for.
    pub model: String,
    /// Provider ids, in preference order.
    pub providers: Vec<String>,
    /// R-CONT-1: continue a committed answer on another provider of the
    /// pool when its own fails for good (default: `[admission]
    /// continuation`).
    #[serde(default)]
    pub continuation: Option<bool>,
}

/// `[discovered_models]`: what clients see of the models providers report
/// (model discovery, [`crate::catalog`]).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveredModelsSection {
    /// Discovered names (exact, or a prefix ending in `*`) neither listed
    /// nor routed by discovery.
    #[serde(default)]
    pub hide: Vec<String>,
    /// Discovered name = the name clients use for it; providers are still
    /// asked for the discovered name.
    #[serde(default)]
    pub rename: BTreeMap<String, String>,
}

/// The validated routes of a file.
pub(super) struct Routes {
    /// Model (or `prefix*`) -> provider pool: the `[[routes]]` entries,
    /// then each provider's own models as implicit routes.
    pub(super) pools: Vec<(String, Vec<ProviderId>)>,
    /// The routes that say whether they continue answers (R-CONT-1).
    pub(super) continuation: Vec<(String, bool)>,
}

/// The validated routes, or the first field that is wrong.
pub(super) fn validate_routes(
    entries: &[RouteEntry],
    providers: &[Provider],
) -> Result<Routes, ConfigError> {
    let ids: BTreeSet<&str> = providers.iter().map(|p| p.spec.id.as_str()).collect();
    let mut routes = Vec::new();
    let mut continuation_routes = Vec::new();
    let mut models = BTreeSet::new();
    for (i, r) in entries.iter().enumerate() {
        if r.model.is_empty() {
            return Err(field_err(format!("routes[{i}].model"), "must not be empty"));
        }
        if !models.insert(r.model.clone()) {
            return Err(field_err(
                format!("routes[{i}].model"),
                format!("duplicate route for model `{}`", r.model),
            ));
        }
        if r.providers.is_empty() {
            return Err(field_err(
                format!("routes[{i}].providers"),
                "must not be empty",
            ));
        }
        for (j, id) in r.providers.iter().enumerate() {
            if !ids.contains(id.as_str()) {
                return Err(field_err(
                    format!("routes[{i}].providers[{j}]"),
                    format!("unknown provider `{id}`"),
                ));
            }
        }
        routes.push((
            r.model.clone(),
            r.providers.iter().map(ProviderId::new).collect::<Vec<_>>(),
        ));
        if let Some(continuation) = r.continuation {
            continuation_routes.push((r.model.clone(), continuation));
        }
    }
    // Providers' own model lists become implicit routes.
    for p in providers {
        for m in &p.models {
            if models.contains(m) {
                continue;
            }
            match routes.iter_mut().find(|(model, _)| model == m) {
                Some((_, pool)) => pool.push(p.spec.id.clone()),
                None => routes.push((m.clone(), vec![p.spec.id.clone()])),
            }
        }
    }
    Ok(Routes {
        pools: routes,
        continuation: continuation_routes,
    })
}

impl DiscoveredModelsSection {
    /// The names, or the first field that is wrong.
    pub(super) fn validate(&self) -> Result<crate::catalog::ModelNames, ConfigError> {
        for (i, pattern) in self.hide.iter().enumerate() {
            let field = format!("discovered_models.hide[{i}]");
            if pattern.is_empty() || pattern == "*" {
                return Err(field_err(
                    field,
                    "must name models (exact, or a prefix ending in `*`), not be empty or `*`",
                ));
            }
            if pattern.trim_end_matches('*').contains('*') {
                return Err(field_err(field, "`*` may only end a pattern"));
            }
        }
        let mut targets = BTreeSet::new();
        for (from, to) in &self.rename {
            let field = format!("discovered_models.rename.{from:?}");
            if from.is_empty() || from.contains('*') || to.is_empty() || to.contains('*') {
                return Err(field_err(
                    field,
                    "both names must be non-empty and without `*`",
                ));
            }
            if from == to {
                return Err(field_err(field, "renames a model to its own name"));
            }
            if !targets.insert(to.as_str()) {
                return Err(field_err(
                    field,
                    format!("`{to}` is already the new name of another model"),
                ));
            }
            if self.rename.contains_key(to) {
                return Err(field_err(
                    field,
                    format!("`{to}` is itself renamed; renames do not chain"),
                ));
            }
        }
        Ok(crate::catalog::ModelNames::new(
            self.hide.clone(),
            self.rename.clone(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use iop_core::ids::ProviderId;

    use crate::config::fixture::{field_of, parse};

    #[test]
    fn provider_models_become_routes() {
        let c = parse(
            "[[providers]]\nid='a'\nnode='n'\nadapter='mock'\ntarget='t'\nmodels=['m1']\n\
             [[providers]]\nid='b'\nnode='n2'\nadapter='mock'\ntarget='t'\nmodels=['m1']\n",
        )
        .unwrap();
        assert_eq!(
            c.route("m1").unwrap(),
            &[ProviderId::from("a"), ProviderId::from("b")]
        );
        assert!(c.route("m2").is_none());
    }

    #[test]
    fn discovered_model_names_are_validated_by_field() {
        let ok = parse(
            "[discovered_models]\nhide = ['embed*', 'x']\n\
             [discovered_models.rename]\n'llama3.2:1b' = 'fast'\n",
        )
        .unwrap();
        assert_eq!(ok.model_names.provider_model("fast"), "llama3.2:1b");
        assert_eq!(ok.model_names.client_name("embed-1"), None);
        for (extra, field) in [
            (
                "[discovered_models]\nhide = ['*']\n",
                "discovered_models.hide[0]",
            ),
            (
                "[discovered_models]\nhide = ['a', '']\n",
                "discovered_models.hide[1]",
            ),
            (
                "[discovered_models]\nhide = ['*a']\n",
                "discovered_models.hide[0]",
            ),
            (
                "[discovered_models.rename]\na = 'a'\n",
                "discovered_models.rename.\"a\"",
            ),
            (
                "[discovered_models.rename]\na = 'c'\nb = 'c'\n",
                "discovered_models.rename.\"b\"",
            ),
            (
                "[discovered_models.rename]\na = 'b'\nb = 'c'\n",
                "discovered_models.rename.\"a\"",
            ),
            (
                "[discovered_models.rename]\n'a*' = 'b'\n",
                "discovered_models.rename.\"a*\"",
            ),
        ] {
            assert_eq!(field_of(parse(extra).unwrap_err()), field, "{extra}");
        }
    }

    #[test]
    fn prefix_routes_match_after_exact_ones() {
        let c = parse(
            "[[providers]]\nid='a'\nnode='n'\nadapter='mock'\ntarget='t'\n\
             [[providers]]\nid='b'\nnode='n'\nadapter='mock'\ntarget='u'\n\
             [[routes]]\nmodel='llama*'\nproviders=['a']\n\
             [[routes]]\nmodel='llama3'\nproviders=['b']\n",
        )
        .unwrap();
        assert_eq!(c.route("llama3").unwrap(), &[ProviderId::from("b")]);
        assert_eq!(c.route("llama3.1").unwrap(), &[ProviderId::from("a")]);
        assert!(c.route("mistral").is_none());
        assert_eq!(c.listed_models().collect::<Vec<_>>(), vec!["llama3"]);
    }
}
