//! The state every HTTP handler shares, and who the caller is: the
//! configuration, the API keys (compared only through their digests), what
//! a request's driver needs, the body budget and the durable store.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::http::{HeaderMap, header};

use crate::api::ApiError;
use crate::config::{ApiKey, EdgeConfig};
use crate::cred::Credentials;
use crate::driver::{DriverContext, DriverObservation};
use crate::durable::Durable;
use crate::hub::HubHandle;
use crate::metrics::EdgeMetrics;
use crate::request_body::BodyBudget;

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    config: Arc<EdgeConfig>,
    /// The config file's and the runtime keys (compared only through
    /// their digests, R-TEN-4).
    keys: Arc<crate::keyring::KeyRing>,
    ctx: DriverContext,
    hub: HubHandle,
    metrics: Arc<EdgeMetrics>,
    /// R-LIM-2: every request body is read under this budget.
    bodies: BodyBudget,
    /// Durable responses (SPEC §6).
    durable: Arc<Durable>,
    /// R-LIM-6: the readers of the journal in flight, per principal and
    /// key.
    reads: crate::store_reads::ReadSlots,
    /// Tenants' limits and budgets (SPEC §9).
    tenancy: Arc<crate::tenancy::Tenancy>,
    /// The console's sessions and live streams.
    console: Arc<crate::console_sessions::ConsoleSessions>,
}

impl AppState {
    /// State for `config`, dispatching through `hub`.
    pub fn new(
        config: Arc<EdgeConfig>,
        hub: HubHandle,
        clock: iop_transport::clock::Clock,
        metrics: Arc<EdgeMetrics>,
        creds: Arc<Credentials>,
        durable: Arc<Durable>,
        traces: Arc<iop_trace::TraceFiles>,
    ) -> Self {
        let m = metrics.clone();
        let observe: Arc<dyn Fn(DriverObservation) + Send + Sync> = Arc::new(move |o| match o {
            DriverObservation::Eligibility(e) => {
                m.recovery_eligibility(e);
                tracing::info!(
                    event = "edge_liveness_recovery_observation",
                    eligibility = e
                );
            }
            DriverObservation::Result(r) => {
                m.recovery_result(r);
                tracing::info!(event = "edge_liveness_recovery_observation", result = r);
            }
            DriverObservation::Readmitted => {}
            DriverObservation::Ttft(route, d) => m.ttft(route, d),
        });
        let tenant_store = durable.tenant_store().clone();
        let keys = Arc::new(crate::keyring::KeyRing::new(
            &config.api_keys,
            tenant_store.clone(),
        ));
        let modes = config
            .providers
            .iter()
            .map(|p| (p.spec.id.clone(), p.mode))
            .collect();
        let profiles = config
            .providers
            .iter()
            .filter_map(|p| Some((p.spec.id.clone(), p.credential.clone()?)))
            .collect();
        Self {
            ctx: DriverContext {
                creds,
                profiles: Arc::new(profiles),
                hub: hub.clone(),
                clock,
                next_request_id: Arc::new(AtomicU64::new(1)),
                budget: config.admission.gate_budget(),
                client_write_timeout: Duration::from_millis(config.edge.client_write_timeout_ms),
                sse_keep_alive: Duration::from_millis(config.edge.sse_keep_alive_ms),
                metrics: metrics.clone(),
                modes: Arc::new(modes),
                observe,
                in_flight: crate::in_flight::InFlight::new(),
                traces: traces.clone(),
            },
            keys,
            bodies: BodyBudget::new(
                config.edge.request_memory_bytes,
                config.edge.request_memory_per_key(),
                config.edge.max_body_bytes,
                Duration::from_millis(config.edge.body_read_timeout_ms),
            ),
            hub,
            tenancy: Arc::new(crate::tenancy::Tenancy::new(
                config.tenants.to_core(),
                clock,
                config.tenants.default_max_output_tokens,
                tenant_store,
                &traces,
            )),
            reads: crate::store_reads::ReadSlots::new(
                config.journal.read_limits(),
                metrics.clone(),
            ),
            config,
            metrics,
            durable,
            console: crate::console_sessions::ConsoleSessions::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EdgeConfig {
        &self.config
    }

    /// Durable responses.
    pub fn durable(&self) -> &Arc<Durable> {
        &self.durable
    }

    /// The API keys.
    pub fn keys(&self) -> &Arc<crate::keyring::KeyRing> {
        &self.keys
    }

    /// Tenants' limits and budgets.
    pub fn tenancy(&self) -> &Arc<crate::tenancy::Tenancy> {
        &self.tenancy
    }

    /// What a request's driver needs.
    pub fn driver_context(&self) -> &DriverContext {
        &self.ctx
    }

    /// The console's sessions and live streams.
    pub fn console(&self) -> &Arc<crate::console_sessions::ConsoleSessions> {
        &self.console
    }

    /// The requests in flight.
    pub fn in_flight(&self) -> &Arc<crate::in_flight::InFlight> {
        &self.ctx.in_flight
    }

    /// The Node connections.
    pub fn hub(&self) -> &HubHandle {
        &self.hub
    }

    /// The Edge's metrics.
    pub fn metrics(&self) -> &Arc<EdgeMetrics> {
        &self.metrics
    }

    /// The readers of the journal in flight (R-LIM-6).
    pub fn reads(&self) -> &crate::store_reads::ReadSlots {
        &self.reads
    }

    /// The budget every request body is read under (R-LIM-2).
    pub fn bodies(&self) -> &BodyBudget {
        &self.bodies
    }

    /// A fresh id seed for a live answer's ids: random (R-LIM-5, the ids
    /// of two answers say nothing of how many came between them).
    pub(crate) fn next_id(&self) -> u64 {
        rand::random()
    }
}

/// The caller's key, from its `Authorization: Bearer` header.
pub(crate) fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<Arc<ApiKey>, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or_else(ApiError::missing_api_key)?;
    let value = value.to_str().map_err(|_| ApiError::invalid_api_key())?;
    let token = bearer_token(value).ok_or_else(ApiError::invalid_api_key)?;
    state
        .keys
        .lookup(token)
        .ok_or_else(ApiError::invalid_api_key)
}

/// The caller's key from `Authorization: Bearer` or, when it sent none,
/// from `x-api-key` (how the Anthropic API's clients send it).
pub(crate) fn authenticate_x_api_key(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Arc<ApiKey>, ApiError> {
    if headers.contains_key(header::AUTHORIZATION) {
        return authenticate(state, headers);
    }
    let value = headers
        .get("x-api-key")
        .ok_or_else(ApiError::missing_api_key)?;
    let token = value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(ApiError::invalid_api_key)?;
    state
        .keys
        .lookup(token)
        .ok_or_else(ApiError::invalid_api_key)
}

/// The key in an `Authorization` value: the scheme `Bearer` in any case
/// (RFC 9110 schemes are case-insensitive), then the key trimmed of
/// surrounding whitespace, as configured keys are.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, rest) = value.trim_start().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    Some(rest.trim()).filter(|t| !t.is_empty())
}

/// The key `token` is, if it is an admin key (the console's sign-in).
pub(crate) fn admin_key(state: &AppState, token: &str) -> Result<Arc<ApiKey>, ApiError> {
    let token = token.trim();
    if token.is_empty() {
        return Err(ApiError::missing_api_key());
    }
    let key = state
        .keys
        .lookup(token)
        .ok_or_else(ApiError::invalid_api_key)?;
    if !key.admin {
        return Err(ApiError::permission_denied());
    }
    Ok(key)
}

/// The caller's key, if it is an admin key.
pub(crate) fn authenticate_admin(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Arc<ApiKey>, ApiError> {
    let key = authenticate(state, headers)?;
    if !key.admin {
        return Err(ApiError::permission_denied());
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bearer_token_is_read_with_any_scheme_case_and_trimmed() {
        for value in ["Bearer k1", "bearer k1", "BEARER  k1 ", " Bearer k1\t"] {
            assert_eq!(bearer_token(value), Some("k1"), "{value:?}");
        }
        for value in ["Basic k1", "Bearer", "Bearer   ", "Bearerk1", "k1"] {
            assert_eq!(bearer_token(value), None, "{value:?}");
        }
    }
}
