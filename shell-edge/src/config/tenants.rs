//! `[tenants]`, `[[principals]]`, `[[prices]]` and each key's `limits`:
//! the limits and budgets of tenants (SPEC §9, R-TEN-1, R-TEN-2). The
//! rules that apply them are `iop_core::tenant`'s.

use std::collections::BTreeMap;

use iop_core::tenant::{Budget, Limits, ModelLimits, Period, Price, TenantsConfig};
use iop_transport::settings::{ConfigError, field_err, valid_name};
use serde::Deserialize;

/// The limits of a key (`[[api_keys]] limits = { ... }`) or a principal
/// (`[[principals]]`). Absent: no limit of that kind.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsEntry {
    /// Requests admitted per minute.
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
    /// Input + output tokens per minute.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Requests in flight at once.
    #[serde(default)]
    pub concurrent_requests: Option<u64>,
    /// Spend per `budget_period`, in micro-units of the price table's
    /// currency.
    #[serde(default)]
    pub budget_micros: Option<u64>,
    /// `day`, `month` (30 days) or `total` (the default).
    #[serde(default)]
    pub budget_period: Option<Period>,
    /// Bytes the durable responses may hold in the journal (new durable
    /// requests get 429 `insufficient_quota` at it).
    #[serde(default)]
    pub journal_bytes: Option<u64>,
    /// Background responses not yet ended.
    #[serde(default)]
    pub background_responses: Option<u64>,
    /// Rates of one model each, by the model's name as clients send it
    /// (R-TEN-1; at most 16): `per_model = { "gpt-4o" = {
    /// requests_per_minute = 10 } }`.
    #[serde(default)]
    pub per_model: BTreeMap<String, ModelLimitsEntry>,
}

/// The rates of one model (`limits.per_model.<model>`). Absent: no limit
/// of that kind for the model (the whole limits still apply).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelLimitsEntry {
    /// Requests of the model admitted per minute.
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
    /// Input + output tokens of the model per minute.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Requests of the model in flight at once.
    #[serde(default)]
    pub concurrent_requests: Option<u64>,
}

impl LimitsEntry {
    /// The core's limits, checked by core's rule ([`Limits::check`]);
    /// `field` names this entry in errors.
    pub(crate) fn to_core(&self, field: &str) -> Result<Limits, ConfigError> {
        if self.budget_period.is_some() && self.budget_micros.is_none() {
            return Err(field_err(
                format!("{field}.budget_period"),
                "needs budget_micros",
            ));
        }
        let limits = Limits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            concurrent_requests: self.concurrent_requests,
            budget: self.budget_micros.map(|limit_micros| Budget {
                limit_micros,
                period: self.budget_period.unwrap_or(Period::Total),
            }),
            journal_bytes: self.journal_bytes,
            background_responses: self.background_responses,
            per_model: self
                .per_model
                .iter()
                .map(|(model, l)| {
                    (
                        model.clone(),
                        ModelLimits {
                            requests_per_minute: l.requests_per_minute,
                            tokens_per_minute: l.tokens_per_minute,
                            concurrent_requests: l.concurrent_requests,
                        },
                    )
                })
                .collect(),
        };
        limits
            .check()
            .map_err(|e| field_err(format!("{field}.{}", e.field), e.reason))?;
        Ok(limits)
    }
}

/// One `[[principals]]` entry: the limits of every key of a principal
/// together.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrincipalEntry {
    /// The principal, as `[[api_keys]] principal` names it.
    pub name: String,
    /// Its limits.
    #[serde(default)]
    pub limits: LimitsEntry,
}

/// One `[[prices]]` entry: a model's price per million tokens, in
/// micro-units (R-TEN-2).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceEntry {
    /// The model as clients name it (a trailing `*` matches a prefix).
    pub model: String,
    /// Input tokens.
    pub input_per_mtok: u64,
    /// Input tokens served from the provider's cache (default: the input
    /// price).
    #[serde(default)]
    pub cached_input_per_mtok: Option<u64>,
    /// Input tokens written to the provider's cache (default: the input
    /// price; Anthropic charges them at 1.25 times it).
    #[serde(default)]
    pub cache_write_per_mtok: Option<u64>,
    /// Output tokens.
    pub output_per_mtok: u64,
}

/// `[tenants]`: how limits are counted.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantsSection {
    /// The share of a limit an Edge claims from the shared counters at a
    /// time (R-TEN-3): a window's use stays within limit + Edges x chunk.
    #[serde(default = "default_chunk_fraction")]
    pub chunk_fraction: f64,
    /// With the shared store unreachable, the share of each rate limit an
    /// Edge admits alone (budgets fail closed).
    #[serde(default = "default_local_share")]
    pub local_share: f64,
    /// The output tokens a request that names no maximum reserves.
    #[serde(default = "default_max_output_tokens")]
    pub default_max_output_tokens: u64,
    /// How often the runtime keys are read from the store (R-TEN-4): a
    /// key created, changed or revoked on any Edge is honoured by this
    /// one within it.
    #[serde(default = "default_key_sync_ms")]
    pub key_sync_ms: u64,
    /// How often settled usage is written to the store (R-TEN-5).
    #[serde(default = "default_usage_flush_ms")]
    pub usage_flush_ms: u64,
    /// The most runtime keys the admin API creates (revoked ones count).
    #[serde(default = "default_max_keys")]
    pub max_keys: usize,
    /// How long the concurrency slots an Edge holds in the store stay its
    /// own without being renewed (R-TEN-1; renewed every third of it): a
    /// dead Edge's slots come back within it.
    #[serde(default = "default_slot_lease_ms")]
    pub slot_lease_ms: u64,
}

fn default_slot_lease_ms() -> u64 {
    iop_core::tenant::DEFAULT_SLOT_LEASE_MS
}

fn default_key_sync_ms() -> u64 {
    2_000
}

fn default_usage_flush_ms() -> u64 {
    1_000
}

fn default_max_keys() -> usize {
    10_000
}

fn default_chunk_fraction() -> f64 {
    0.1
}

fn default_local_share() -> f64 {
    1.0
}

fn default_max_output_tokens() -> u64 {
    4_096
}

impl Default for TenantsSection {
    fn default() -> Self {
        TenantsSection {
            chunk_fraction: default_chunk_fraction(),
            local_share: default_local_share(),
            default_max_output_tokens: default_max_output_tokens(),
            key_sync_ms: default_key_sync_ms(),
            usage_flush_ms: default_usage_flush_ms(),
            max_keys: default_max_keys(),
            slot_lease_ms: default_slot_lease_ms(),
        }
    }
}

impl TenantsSection {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !(self.chunk_fraction > 0.0 && self.chunk_fraction <= 1.0) {
            return Err(field_err("tenants.chunk_fraction", "must be in (0, 1]"));
        }
        if !(self.local_share > 0.0 && self.local_share <= 1.0) {
            return Err(field_err("tenants.local_share", "must be in (0, 1]"));
        }
        for (field, value, min, max) in [
            ("tenants.key_sync_ms", self.key_sync_ms, 50, 600_000),
            ("tenants.usage_flush_ms", self.usage_flush_ms, 50, 600_000),
            ("tenants.slot_lease_ms", self.slot_lease_ms, 1_000, 600_000),
        ] {
            if !(min..=max).contains(&value) {
                return Err(field_err(field, format!("must be in {min}..={max}")));
            }
        }
        if !(1..=1_000_000).contains(&self.max_keys) {
            return Err(field_err("tenants.max_keys", "must be in 1..=1000000"));
        }
        if self.default_max_output_tokens == 0 {
            return Err(field_err(
                "tenants.default_max_output_tokens",
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// The core's setup.
    pub fn to_core(&self) -> TenantsConfig {
        TenantsConfig {
            chunk_fraction: self.chunk_fraction,
            local_share: self.local_share,
            slot_lease_ms: self.slot_lease_ms,
        }
    }
}

/// `[[principals]]` validated: each principal once, a valid name.
pub(super) fn validate_principals(
    entries: &[PrincipalEntry],
) -> Result<Vec<(String, Limits)>, ConfigError> {
    let mut out: Vec<(String, Limits)> = Vec::new();
    for (i, p) in entries.iter().enumerate() {
        let field = format!("principals[{i}]");
        if !valid_name(&p.name) {
            return Err(field_err(
                format!("{field}.name"),
                "must be 1-128 chars of [A-Za-z0-9._-]",
            ));
        }
        if out.iter().any(|(n, _)| n == &p.name) {
            return Err(field_err(format!("{field}.name"), "listed twice"));
        }
        out.push((
            p.name.clone(),
            p.limits.to_core(&format!("{field}.limits"))?,
        ));
    }
    Ok(out)
}

/// `[[prices]]` validated.
pub(super) fn validate_prices(entries: &[PriceEntry]) -> Result<Vec<(String, Price)>, ConfigError> {
    let mut out: Vec<(String, Price)> = Vec::new();
    for (i, p) in entries.iter().enumerate() {
        if p.model.is_empty() {
            return Err(field_err(format!("prices[{i}].model"), "must not be empty"));
        }
        if out.iter().any(|(m, _)| m == &p.model) {
            return Err(field_err(format!("prices[{i}].model"), "listed twice"));
        }
        out.push((
            p.model.clone(),
            Price {
                input_per_mtok: p.input_per_mtok,
                cached_input_per_mtok: p.cached_input_per_mtok.unwrap_or(p.input_per_mtok),
                cache_write_per_mtok: p.cache_write_per_mtok.unwrap_or(p.input_per_mtok),
                output_per_mtok: p.output_per_mtok,
            },
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::fixture::{field_of, parse};

    #[test]
    fn limits_prices_and_principals_are_read_and_a_zero_limit_names_its_field() {
        let config = parse(
            "\n[[principals]]\nname = \"team-a\"\nlimits = { requests_per_minute = 60, budget_micros = 30000000, budget_period = \"day\" }\n\
             [[prices]]\nmodel = \"m*\"\ninput_per_mtok = 1000000\noutput_per_mtok = 2000000\n",
        )
        .unwrap();
        let (name, limits) = &config.principals[0];
        assert_eq!(name, "team-a");
        assert_eq!(limits.requests_per_minute, Some(60));
        assert_eq!(limits.budget.map(|b| b.limit_micros), Some(30_000_000));
        assert_eq!(
            config.price_for("model-x").map(|p| p.output_per_mtok),
            Some(2_000_000)
        );
        assert_eq!(config.price_for("other"), None);
        let err = parse("\n[[principals]]\nname = \"p\"\nlimits = { tokens_per_minute = 0 }\n")
            .unwrap_err();
        assert_eq!(field_of(err), "principals[0].limits.tokens_per_minute");
    }

    #[test]
    fn r_ten_1_limits_per_model_are_read_bounded_and_named_in_errors() {
        let config = parse(
            "\n[[principals]]\nname = \"team-a\"\nlimits = { requests_per_minute = 60, per_model = { \"gpt-4o\" = { requests_per_minute = 10, tokens_per_minute = 2000 }, \"llama3:8b\" = { concurrent_requests = 2 } } }\n",
        )
        .unwrap();
        let limits = &config.principals[0].1;
        assert_eq!(limits.per_model.len(), 2);
        let gpt = limits.for_model("gpt-4o").unwrap();
        assert_eq!(
            (
                gpt.requests_per_minute,
                gpt.tokens_per_minute,
                gpt.concurrent_requests
            ),
            (Some(10), Some(2000), None)
        );
        assert_eq!(
            limits.for_model("llama3:8b").unwrap().concurrent_requests,
            Some(2)
        );
        let err = parse(
            "\n[[principals]]\nname = \"p\"\nlimits = { per_model = { \"m\" = { requests_per_minute = 0 } } }\n",
        )
        .unwrap_err();
        assert_eq!(
            field_of(err),
            "principals[0].limits.per_model.m.requests_per_minute"
        );
        let many: Vec<String> = (0..=iop_core::tenant::MAX_MODEL_LIMITS)
            .map(|i| format!("\"m{i}\" = {{ requests_per_minute = 1 }}"))
            .collect();
        let err = parse(&format!(
            "\n[[principals]]\nname = \"p\"\nlimits = {{ per_model = {{ {} }} }}\n",
            many.join(", ")
        ))
        .unwrap_err();
        assert_eq!(field_of(err), "principals[0].limits.per_model");
        assert!(
            parse("\n[[principals]]\nname = \"p\"\nlimits = { per_model = { \"m\" = { budget_micros = 1 } } }\n")
                .is_err(),
            "a model has rates only"
        );
    }
}
