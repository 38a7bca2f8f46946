//! Limits per model (R-TEN-1): a key or a principal may hold rates for a
//! named model besides its whole limits, and the checks every limit passes
//! before it is used (one rule for the config file, the admin API and a
//! stored key).
//!
//! A per-model limit is counted as its own subject
//! ([`Subject::KeyModel`](super::Subject::KeyModel),
//! [`Subject::PrincipalModel`](super::Subject::PrincipalModel)), so one
//! model's use never changes another model's admission beyond what both
//! take of the key's and the principal's whole limits.

use serde::{Deserialize, Serialize};

use super::Limits;

/// The most models one key's or one principal's limits name: the counters
/// a subject may have are bounded.
pub const MAX_MODEL_LIMITS: usize = 16;

/// The longest model name a per-model limit may carry, in bytes.
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// The rates of one model for a key or a principal; `None`: no limit of
/// that kind for the model (its whole limits still apply).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelLimits {
    /// Requests of the model admitted per minute.
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
    /// Input + output tokens of the model per minute (settled from the
    /// provider's usage).
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Requests of the model in flight at once (on this Edge).
    #[serde(default)]
    pub concurrent_requests: Option<u64>,
}

impl ModelLimits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.requests_per_minute.is_some()
            || self.tokens_per_minute.is_some()
            || self.concurrent_requests.is_some()
    }
}

/// A limit that is not valid: its field (relative to the limits, e.g.
/// `per_model.gpt-4o.requests_per_minute`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {reason}")]
pub struct LimitsError {
    /// The field, as the config file and the admin API name it.
    pub field: String,
    /// Why.
    pub reason: &'static str,
}

/// Whether `model` may name a per-model limit: 1 to
/// [`MAX_MODEL_NAME_BYTES`] bytes, no control character.
pub fn model_name_ok(model: &str) -> bool {
    !model.is_empty() && model.len() <= MAX_MODEL_NAME_BYTES && !model.chars().any(char::is_control)
}

const AT_LEAST_ONE: &str = "must be at least 1 (leave it out for no limit)";

impl Limits {
    /// The rates of `model`, if these limits name it.
    pub fn for_model(&self, model: &str) -> Option<&ModelLimits> {
        self.per_model.get(model)
    }

    /// Check every limit (R-LIM-5: bounded before it is used or stored):
    /// none is 0, at most [`MAX_MODEL_LIMITS`] models, each name valid.
    pub fn check(&self) -> Result<(), LimitsError> {
        let err = |field: String, reason| Err(LimitsError { field, reason });
        for (name, value) in [
            ("requests_per_minute", self.requests_per_minute),
            ("tokens_per_minute", self.tokens_per_minute),
            ("concurrent_requests", self.concurrent_requests),
            ("budget_micros", self.budget.map(|b| b.limit_micros)),
            ("journal_bytes", self.journal_bytes),
            ("background_responses", self.background_responses),
        ] {
            if value == Some(0) {
                return err(name.to_owned(), AT_LEAST_ONE);
            }
        }
        if self.per_model.len() > MAX_MODEL_LIMITS {
            return err("per_model".to_owned(), "names more than 16 models");
        }
        for (model, limits) in &self.per_model {
            if !model_name_ok(model) {
                return err(
                    "per_model".to_owned(),
                    "a model's name must be 1-256 bytes, no control characters",
                );
            }
            for (name, value) in [
                ("requests_per_minute", limits.requests_per_minute),
                ("tokens_per_minute", limits.tokens_per_minute),
                ("concurrent_requests", limits.concurrent_requests),
            ] {
                if value == Some(0) {
                    return err(format!("per_model.{model}.{name}"), AT_LEAST_ONE);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_models(n: usize) -> Limits {
        Limits {
            per_model: (0..n)
                .map(|i| {
                    (
                        format!("m{i}"),
                        ModelLimits {
                            requests_per_minute: Some(1),
                            ..ModelLimits::default()
                        },
                    )
                })
                .collect(),
            ..Limits::default()
        }
    }

    #[test]
    fn r_ten_1_per_model_limits_are_bounded_and_errors_name_the_field() {
        assert_eq!(with_models(MAX_MODEL_LIMITS).check(), Ok(()));
        assert_eq!(
            with_models(MAX_MODEL_LIMITS + 1).check().unwrap_err().field,
            "per_model"
        );
        let mut l = with_models(1);
        l.per_model.get_mut("m0").unwrap().tokens_per_minute = Some(0);
        assert_eq!(
            l.check().unwrap_err().to_string(),
            "per_model.m0.tokens_per_minute must be at least 1 (leave it out for no limit)"
        );
        for bad in [
            String::new(),
            "m".repeat(MAX_MODEL_NAME_BYTES + 1),
            "a\nb".into(),
        ] {
            let mut l = Limits::default();
            l.per_model.insert(bad.clone(), ModelLimits::default());
            assert_eq!(l.check().unwrap_err().field, "per_model", "{bad:?}");
        }
        let zero = Limits {
            concurrent_requests: Some(0),
            ..Limits::default()
        };
        assert_eq!(zero.check().unwrap_err().field, "concurrent_requests");
        assert!(!with_models(0).any());
        assert!(with_models(1).any());
    }
}
