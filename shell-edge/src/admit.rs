//! Admitting a run request: authenticate the caller, read the body under
//! its budget (R-LIM-2), parse it with the endpoint's API, and route its
//! model to the providers that can honour the whole request.

use std::sync::Arc;

use axum::extract::Request;
use iop_core::ids::ProviderId;
use iop_core::tenant::Subject;
use iop_wire::AdapterKind;

use crate::api::endpoint::RunEndpoint;
use crate::api::{ApiError, NormalizedRun, surface};
use crate::app_state::{AppState, authenticate, authenticate_x_api_key};
use crate::config::{ApiKey, ProviderMode};
use crate::request_body::{BodyError, BodyPermit};
use crate::tenancy::TenantHold;

/// What an admitted run request brings: the caller's key, the raw body (for
/// a tunnel), the parsed run with its API's options, and the model's pool.
pub(crate) struct Admitted<O> {
    pub(crate) key: Arc<ApiKey>,
    pub(crate) body: bytes::Bytes,
    /// The body's share of the budget, held while the request lives.
    pub(crate) body_permit: BodyPermit,
    pub(crate) run: NormalizedRun,
    pub(crate) options: O,
    pub(crate) pool: Vec<ProviderId>,
    /// The model the providers are asked for (a renamed model's
    /// discovered name, `[discovered_models.rename]`).
    pub(crate) provider_model: String,
    /// For a renamed model with tunnel-mode providers in its pool: the body
    /// they get, naming `provider_model`.
    pub(crate) renamed_body: Option<bytes::Bytes>,
    /// Its hold on its tenant's limits and budgets (R-TEN-1, R-TEN-2):
    /// settled when the last holder (its driver) lets go.
    pub(crate) tenant: Option<Arc<TenantHold>>,
}

/// Authenticate, read and parse a run request and route its model; any
/// failure is the response to send.
pub(crate) async fn admit<E: RunEndpoint>(
    state: &AppState,
    request: Request,
    endpoint: &E,
    idempotent: bool,
) -> Result<Admitted<E::Options>, ApiError> {
    let (parts, body) = request.into_parts();
    let key = if E::X_API_KEY {
        authenticate_x_api_key(state, &parts.headers)?
    } else {
        authenticate(state, &parts.headers)?
    };
    let mut held = state
        .bodies()
        .read(&key.principal, &parts.headers, body)
        .await
        .map_err(BodyError::to_api_error)?;
    let (mut run, options) = endpoint.parse(&held.bytes)?;
    endpoint.read_headers(&parts.headers, &mut run)?;
    let pool = pool_for(state, &key, &run)?;
    // R-TEN-1, R-TEN-2: within the key's and its principal's limits and
    // budgets, before any provider call (the prompt's bound is core's
    // `prompt_tokens_max` of the body); a durable request is held to the
    // journal quotas.
    let keep = endpoint.keep(&options, state.durable().responses_store_default());
    let durable = keep.store || keep.background || idempotent;
    let tenant = state
        .tenancy()
        .admit(&crate::tenancy::TenantAsk {
            key_id: &key.id,
            key_limits: &key.limits,
            principal: &key.principal,
            principal_limits: &state.config().principal_limits(&key.principal),
            model: &run.model,
            price: state.config().price_for(&run.model),
            body_bytes: held.bytes.len() as u64,
            max_output: iop_core::tenant::output_tokens_asked(run.api, run.params.max_tokens),
            durable,
            background: keep.background,
            // What the key and its principal hold in the journal now (every
            // Edge's records, as the store's own view counts them).
            held: if durable {
                let journal = state.durable().store();
                (
                    journal.held(&Subject::Key(key.id.clone())),
                    journal.held(&Subject::Principal(key.principal.clone())),
                )
            } else {
                Default::default()
            },
        })
        .await
        .map(Arc::new)?;
    // R-TEN-2: an answer is held to the output its reservation counted.
    let output_cap = tenant.output_cap();
    if let Some(cap) = output_cap {
        run.params.max_tokens = Some(u32::try_from(cap).unwrap_or(u32::MAX));
    }
    let provider_model = state.config().model_names.provider_model(&run.model);
    let renamed = provider_model != run.model;
    // Rewritten while the body's decoded share is still held (R-LIM-2).
    let renamed_body = if (renamed || output_cap.is_some())
        && pool.iter().any(|id| {
            state
                .config()
                .provider(id)
                .is_some_and(|p| p.mode == ProviderMode::Tunnel)
        }) {
        Some(tunnel_body(
            &held.bytes,
            renamed.then_some(provider_model),
            output_cap.map(|cap| (endpoint.tunnel().1, cap)),
        )?)
    } else {
        None
    };
    let provider_model = provider_model.to_owned();
    // The decoded tree is gone; the body and the run remain.
    held.permit
        .shrink_to(iop_core::edge::limits::kept_bytes(held.bytes.len()));
    Ok(Admitted {
        key,
        body: held.bytes,
        body_permit: held.permit,
        run,
        options,
        pool,
        provider_model,
        renamed_body,
        tenant: Some(tenant),
    })
}

/// The pool for `run`'s model, if the key may use it: the providers that
/// can honour the whole request. When the model has providers but none of
/// them can, the answer is the 400 naming the parameter
/// ([`surface::provider_refusal`]).
fn pool_for(
    state: &AppState,
    key: &ApiKey,
    run: &NormalizedRun,
) -> Result<Vec<ProviderId>, ApiError> {
    let model = run.model.as_str();
    let routed = routed_pool(state, model);
    let pool = match &routed {
        Some(pool) if key.allows(model) => pool.as_slice(),
        // A model the key may not use is indistinguishable from one that
        // does not exist.
        _ => return Err(ApiError::model_not_found(model)),
    };
    capable_pool(state, pool, run)
}

/// The providers of a stored request's model that can honour its run
/// (a takeover that continues its answer, R-TAKE-1, R-CONT-1): its key
/// was checked when it was created. Empty when none is routed or able.
pub(crate) fn pool_for_record(state: &AppState, run: &NormalizedRun) -> Vec<ProviderId> {
    routed_pool(state, &run.model)
        .and_then(|pool| capable_pool(state, &pool, run).ok())
        .unwrap_or_default()
}

/// The providers of `pool` that can honour the whole of `run`; when none
/// can, the 400 naming the parameter.
fn capable_pool(
    state: &AppState,
    pool: &[ProviderId],
    run: &NormalizedRun,
) -> Result<Vec<ProviderId>, ApiError> {
    let mut refusal = None;
    let capable: Vec<ProviderId> = pool
        .iter()
        .filter(|id| {
            let Some(provider) = state.config().provider(id) else {
                return false;
            };
            match provider_refusal(provider.mode, provider.spec.adapter, run) {
                None => true,
                Some(err) => {
                    refusal.get_or_insert(err);
                    false
                }
            }
        })
        .cloned()
        .collect();
    match refusal {
        Some(err) if capable.is_empty() => Err(err),
        _ => Ok(capable),
    }
}

/// Why a provider in `mode` of `adapter` kind cannot run `run`, as the 400
/// naming the parameter; `None` when it can. A tunnel-mode provider takes
/// the client's body as it is, so it can do whatever its server can; a
/// normalized one can do what the API surface says its adapter can
/// ([`surface::provider_refusal`]).
fn provider_refusal(
    mode: ProviderMode,
    adapter: AdapterKind,
    run: &NormalizedRun,
) -> Option<ApiError> {
    match mode {
        ProviderMode::Tunnel => None,
        ProviderMode::Normalized => surface::provider_refusal(adapter, run),
    }
}

/// The providers serving `model`: an exact `[[routes]]` entry (a pin), else
/// the discovering providers that reported the model under its discovered
/// name (`crate::catalog`: hidden names are not routed, a renamed model by
/// its new name only), else the longest prefix route.
pub(crate) fn routed_pool(state: &AppState, model: &str) -> Option<Vec<ProviderId>> {
    if let Some(pool) = state.config().exact_route(model) {
        return Some(pool.to_vec());
    }
    let discovered: Vec<ProviderId> = match state.config().model_names.discovered_name(model) {
        Some(name) => state
            .hub()
            .catalog()
            .pool_for(name)
            .into_iter()
            .filter(|id| {
                state
                    .config()
                    .provider(id)
                    .is_some_and(|p| p.discover_models)
            })
            .collect(),
        None => Vec::new(),
    };
    if !discovered.is_empty() {
        return Some(discovered);
    }
    state.config().route(model).map(<[ProviderId]>::to_vec)
}

/// `body` (a JSON object, already parsed once) as a tunnel-mode provider
/// gets it: with its `model` replaced by `model`, and with the most output
/// tokens `cap` allows in the field the API at the tunnel's path reads
/// (R-TEN-2: the client sent none).
fn tunnel_body(
    body: &[u8],
    model: Option<&str>,
    cap: Option<(&str, u64)>,
) -> Result<bytes::Bytes, ApiError> {
    use serde_json::Value;
    let mut value: Value = serde_json::from_slice(body).map_err(|_| ApiError::internal())?;
    let Some(object) = value.as_object_mut() else {
        return Err(ApiError::internal());
    };
    if let Some(model) = model {
        object.insert("model".into(), Value::from(model));
    }
    if let Some((path, cap)) = cap {
        match path {
            "/v1/responses" => {
                object.insert("max_output_tokens".into(), Value::from(cap));
            }
            "/api/chat" | "/api/generate" => {
                let options = object
                    .entry("options")
                    .or_insert_with(|| Value::Object(Default::default()));
                if let Some(options) = options.as_object_mut() {
                    options.insert("num_predict".into(), Value::from(cap));
                }
            }
            "/v1/chat/completions" | "/v1/completions" | "/v1/messages" => {
                object.insert("max_tokens".into(), Value::from(cap));
            }
            _ => {}
        }
    }
    serde_json::to_vec(&value)
        .map(bytes::Bytes::from)
        .map_err(|_| ApiError::internal())
}

#[cfg(test)]
mod tests {
    use iop_wire::RunApi;

    use super::*;

    #[test]
    fn several_choices_need_a_tunnel_mode_provider() {
        let many = NormalizedRun {
            model: "m".into(),
            stream: false,
            api: RunApi::Chat,
            messages: Vec::new(),
            tools: Vec::new(),
            params: Default::default(),
            choices: 2,
        };
        for adapter in AdapterKind::ALL {
            let err = provider_refusal(ProviderMode::Normalized, *adapter, &many).unwrap();
            assert_eq!(err.param.as_deref(), Some("n"));
            assert!(provider_refusal(ProviderMode::Tunnel, *adapter, &many).is_none());
        }
    }
}
