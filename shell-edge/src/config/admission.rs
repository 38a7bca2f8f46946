//! `[admission]`: the wait queue for capacity and each request's budget of
//! attempts and time (R-GATE-2).

use std::time::Duration;

use iop_core::edge::gate::{GateBudget, GateBudgetError};
use iop_transport::settings::{ConfigError, field_err};
use serde::Deserialize;

/// `[admission]`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdmissionSection {
    /// Requests that may wait for capacity.
    pub queue_capacity: usize,
    /// How long one may wait.
    pub queue_timeout_ms: u64,
    /// Attempts per client request (first + re-admissions).
    pub max_attempts: u32,
    /// Total time budget per client request across attempts.
    pub request_budget_ms: u64,
    /// R-CONT-1: whether a committed answer whose provider fails for good
    /// continues on another provider of its pool, for routes that do not
    /// say (`[[routes]] continuation`). Off by default: the continued part
    /// comes from another model instance.
    pub continuation: bool,
}

impl AdmissionSection {
    /// The per-request budget of attempts and total time, as core's
    /// [`GateBudget`] (bounded by
    /// [`iop_core::edge::gate::MAX_ATTEMPTS_LIMIT`]).
    pub fn gate_budget(&self) -> Result<GateBudget, GateBudgetError> {
        GateBudget::new(
            self.max_attempts,
            Duration::from_millis(self.request_budget_ms),
        )
    }

    /// The first field that is wrong, if any.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.queue_capacity == 0 {
            return Err(field_err("admission.queue_capacity", "must be > 0"));
        }
        if self.queue_timeout_ms == 0 {
            return Err(field_err("admission.queue_timeout_ms", "must be > 0"));
        }
        // The request budget is core's (R-GATE-2): validate it with core's
        // own constructor so the driver can never be handed one it refuses.
        if let Err(e) = self.gate_budget() {
            let field = match e {
                GateBudgetError::MaxAttemptsOutOfRange(_) => "admission.max_attempts",
                GateBudgetError::ZeroTotal => "admission.request_budget_ms",
            };
            return Err(field_err(field, e.to_string()));
        }
        Ok(())
    }
}

impl Default for AdmissionSection {
    fn default() -> Self {
        Self {
            queue_capacity: 256,
            queue_timeout_ms: 30_000,
            max_attempts: 2,
            request_budget_ms: 600_000,
            continuation: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::fixture::{field_of, parse};

    #[test]
    fn request_budget_is_validated_against_cores_limits() {
        let limit = iop_core::edge::gate::MAX_ATTEMPTS_LIMIT;
        let c = parse(&format!("[admission]\nmax_attempts = {limit}\n")).unwrap();
        assert_eq!(c.admission.gate_budget().unwrap().max_attempts(), limit);
        for bad in [0, limit + 1, 10] {
            let e = parse(&format!("[admission]\nmax_attempts = {bad}\n")).unwrap_err();
            assert_eq!(
                field_of(e),
                "admission.max_attempts",
                "max_attempts = {bad}"
            );
        }
        let e = parse("[admission]\nrequest_budget_ms = 0\n").unwrap_err();
        assert_eq!(field_of(e), "admission.request_budget_ms");
    }
}
