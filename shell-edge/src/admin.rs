//! The admin API of tenants (SPEC §9): runtime API keys (R-TEN-4) and
//! usage (R-TEN-5). Every route needs an admin key of the config file.
//!
//! * `POST /admin/keys`: create a key; the answer shows its secret, once.
//! * `GET /admin/keys`, `GET /admin/keys/{id}`: list and read (never a
//!   secret; the config file's keys are listed with `source: "config"`).
//! * `PATCH /admin/keys/{id}`: change its name, models, limits or expiry.
//! * `POST /admin/keys/{id}/revoke`, `POST /admin/keys/{id}/rotate`.
//! * `GET /admin/usage?from=YYYY-MM-DD&to=YYYY-MM-DD&principal=&key=`.
//!
//! Keys live in the deployment's store ([`iop_store::TenantStore`]), every
//! change a compare-and-set on the key's revision; every Edge reads them
//! within `[tenants] key_sync_ms`, this one at once. Every change is an
//! audit event (`target: audit`) naming the admin key's id, the key's id
//! and what changed, never a secret.

use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use iop_core::tenant::keys::{
    KeyChange, KeyFieldError, KeyRecord, KeyUpdate, SECRET_PREFIX, change_key, key_id, key_id_ok,
    new_key,
};
use iop_core::tenant::usage::{UsageQuery, UsageTotals, day_of, format_day, parse_day};
use iop_core::tenant::{DAY_MS, Limits, Period};
use iop_store::TenantStoreError;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::ApiError;
use crate::app_state::{AppState, authenticate_admin};
use crate::config::{ApiKey, LimitsEntry};

/// The largest admin request body.
const MAX_ADMIN_BODY: usize = 64 * 1024;

/// How long a store operation of the admin API may take.
const STORE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Compare-and-set rounds before a change gives up with 409.
const CAS_ROUNDS: usize = 4;

/// The most days one usage read spans.
const MAX_USAGE_DAYS: u64 = 400;

/// The most rows one usage read returns.
const MAX_USAGE_ROWS: usize = 10_000;

/// The admin routes.
pub fn routes() -> axum::Router<AppState> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/admin/keys", post(create_key).get(list_keys))
        .route("/admin/keys/{id}", get(get_key).patch(update_key))
        .route("/admin/keys/{id}/revoke", post(revoke_key))
        .route("/admin/keys/{id}/rotate", post(rotate_key))
        .route("/admin/usage", get(usage))
}

/// A key's fields as an admin sends them (create: `principal` required;
/// update: every field optional, `expires_at: null` clears the expiry).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFields {
    #[serde(default)]
    principal: Option<String>,
    #[serde(default, deserialize_with = "present")]
    name: Option<Option<String>>,
    #[serde(default)]
    models: Option<Vec<String>>,
    #[serde(default)]
    limits: Option<LimitsEntry>,
    /// Unix seconds.
    #[serde(default, deserialize_with = "present")]
    expires_at: Option<Option<u64>>,
}

/// A field that is present: `Some(value)`, `Some(None)` for `null`.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

async fn read_fields(body: Body) -> Result<KeyFields, ApiError> {
    let bytes = axum::body::to_bytes(body, MAX_ADMIN_BODY)
        .await
        .map_err(|_| ApiError::body_too_large(MAX_ADMIN_BODY))?;
    if bytes.is_empty() {
        return Ok(KeyFields::default());
    }
    serde_json::from_slice(&bytes).map_err(|e| ApiError::from_json_error(&e))
}

fn store_error(e: &TenantStoreError) -> ApiError {
    match e {
        TenantStoreError::Conflict { .. } => ApiError::admin_conflict(
            "The key was changed by another request at the same time; read it and try again.",
        ),
        TenantStoreError::Unavailable(_) => ApiError::tenant_store_unavailable(),
    }
}

async fn bounded<T>(
    f: impl std::future::Future<Output = Result<T, TenantStoreError>>,
) -> Result<T, TenantStoreError> {
    tokio::time::timeout(STORE_TIMEOUT, f)
        .await
        .unwrap_or_else(|_| Err(TenantStoreError::Unavailable("timed out".into())))
}

/// A new secret: `sk-iop-` and 48 random hex digits (192 bits).
fn new_secret() -> String {
    let bytes: [u8; 24] = rand::random();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{SECRET_PREFIX}{hex}")
}

fn limits_json(l: &Limits) -> Value {
    json!({
        "requests_per_minute": l.requests_per_minute,
        "tokens_per_minute": l.tokens_per_minute,
        "concurrent_requests": l.concurrent_requests,
        "budget_micros": l.budget.map(|b| b.limit_micros),
        "budget_period": l.budget.map(|b| match b.period {
            Period::Day => "day",
            Period::Month => "month",
            Period::Total => "total",
        }),
        "journal_bytes": l.journal_bytes,
        "background_responses": l.background_responses,
        "per_model": l.per_model.iter().map(|(model, m)| {
            (model.clone(), json!({
                "requests_per_minute": m.requests_per_minute,
                "tokens_per_minute": m.tokens_per_minute,
                "concurrent_requests": m.concurrent_requests,
            }))
        }).collect::<serde_json::Map<_, _>>(),
    })
}

fn record_json(r: &KeyRecord, revision: u64) -> Value {
    let now = iop_transport::clock::unix_ms();
    json!({
        "object": "api_key",
        "id": r.id,
        "source": "runtime",
        "principal": r.principal,
        "name": r.name,
        "models": r.models,
        "limits": limits_json(&r.limits),
        "created_at": r.created_unix_ms / 1_000,
        "updated_at": r.updated_unix_ms / 1_000,
        "expires_at": r.expires_unix_ms.map(|ms| ms / 1_000),
        "revoked_at": r.revoked_unix_ms.map(|ms| ms / 1_000),
        "status": match r.usable(now) {
            Ok(()) => "active",
            Err(iop_core::tenant::keys::KeyUnusable::Revoked) => "revoked",
            Err(iop_core::tenant::keys::KeyUnusable::Expired) => "expired",
        },
        "revision": revision,
    })
}

fn config_key_json(k: &ApiKey) -> Value {
    json!({
        "object": "api_key",
        "id": k.id,
        "source": "config",
        "principal": k.principal,
        "models": k.models,
        "limits": limits_json(&k.limits),
        "admin": k.admin,
        "status": "active",
    })
}

/// The admin's fields as core's key update (R-LIM-5: every string is
/// bounded by core's check before it is stored).
fn update_of(fields: &KeyFields) -> Result<KeyUpdate, ApiError> {
    let limits = match &fields.limits {
        Some(limits) => Some(limits.to_core("limits").map_err(|e| match e {
            iop_transport::settings::ConfigError::Field { field, message } => {
                ApiError::invalid_value(&field, &message)
            }
            other => ApiError::invalid_value("limits", &other.to_string()),
        })?),
        None => None,
    };
    Ok(KeyUpdate {
        principal: fields.principal.clone(),
        name: fields.name.clone(),
        models: fields.models.clone(),
        limits,
        expires_unix_ms: fields
            .expires_at
            .map(|at| at.map(|s| s.saturating_mul(1_000))),
    })
}

fn field_error(e: KeyFieldError) -> ApiError {
    ApiError::invalid_value(&e.field, e.reason)
}

fn admin(state: &AppState, headers: &HeaderMap) -> Result<std::sync::Arc<ApiKey>, ApiError> {
    authenticate_admin(state, headers)
}

/// The id in a path, checked for shape before it reaches the store
/// (R-LIM-5).
fn path_id(id: &str) -> Result<&str, ApiError> {
    if key_id_ok(id) {
        Ok(id)
    } else {
        Err(ApiError::not_found("API key"))
    }
}

async fn create_key(State(state): State<AppState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let result = async {
        let admin = admin(&state, &parts.headers)?;
        let fields = read_fields(body).await?;
        if fields.principal.is_none() {
            return Err(ApiError::missing_parameter("principal"));
        }
        let now = iop_transport::clock::unix_ms();
        let secret = new_secret();
        let record = new_key(
            key_id(rand::random()),
            crate::keyring::digest_hex(&secret),
            &update_of(&fields)?,
            state.keys().records().len(),
            state.config().tenants.max_keys,
            now,
        )
        .map_err(field_error)?;
        let revision = bounded(state.tenancy().store().put_key(record.clone(), 0))
            .await
            .map_err(|e| store_error(&e))?;
        tracing::info!(
            target: "audit",
            event = "admin_key_created",
            admin_key = %admin.id,
            key = %record.id,
            principal = %record.principal,
            models = ?record.models,
            limits = ?record.limits,
            expires_unix_ms = ?record.expires_unix_ms,
        );
        let _ = state.keys().sync().await;
        let mut body = record_json(&record, revision);
        body["secret"] = json!(secret);
        Ok::<_, ApiError>((StatusCode::CREATED, axum::Json(body)).into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

async fn list_keys(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = admin(&state, &headers) {
        return e.into_response();
    }
    let mut stored = match bounded(state.tenancy().store().keys()).await {
        Ok(stored) => stored,
        Err(e) => return store_error(&e).into_response(),
    };
    stored.sort_by(|a, b| a.0.id.cmp(&b.0.id));
    let mut data: Vec<Value> = state.keys().config_keys().map(config_key_json).collect();
    data.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    data.extend(stored.iter().map(|(r, rev)| record_json(r, *rev)));
    axum::Json(json!({ "object": "list", "data": data })).into_response()
}

async fn get_key(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        admin(&state, &headers)?;
        if let Some(k) = state.keys().config_keys().find(|k| k.id == id) {
            return Ok(axum::Json(config_key_json(k)).into_response());
        }
        let id = path_id(&id)?;
        match bounded(state.tenancy().store().key(id.to_owned())).await {
            Ok(Some((record, revision))) => {
                Ok(axum::Json(record_json(&record, revision)).into_response())
            }
            Ok(None) => Err(ApiError::not_found("API key")),
            Err(e) => Err(store_error(&e)),
        }
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// What a change does to a stored key.
enum Change {
    Update(Box<KeyFields>),
    Revoke,
    Rotate,
}

impl Change {
    fn event(&self) -> &'static str {
        match self {
            Change::Update(_) => "admin_key_updated",
            Change::Revoke => "admin_key_revoked",
            Change::Rotate => "admin_key_rotated",
        }
    }
}

/// Read, change and compare-and-set a stored key, at most [`CAS_ROUNDS`]
/// times; the answer shows the new secret of a rotation, once.
async fn change_stored_key(
    state: &AppState,
    headers: &HeaderMap,
    id: &str,
    change: Change,
) -> Response {
    let result = async {
        let admin = admin(state, headers)?;
        if state.keys().is_config_key(id) {
            return Err(ApiError::invalid_value(
                "id",
                "a config file key is changed in the config file",
            ));
        }
        let id = path_id(id)?;
        let store = state.tenancy().store();
        for _ in 0..CAS_ROUNDS {
            let Some((mut record, revision)) = bounded(store.key(id.to_owned()))
                .await
                .map_err(|e| store_error(&e))?
            else {
                return Err(ApiError::not_found("API key"));
            };
            let now = iop_transport::clock::unix_ms();
            let mut secret = None;
            let core_change = match &change {
                Change::Update(fields) => KeyChange::Update(update_of(fields)?),
                Change::Revoke => KeyChange::Revoke,
                Change::Rotate => {
                    let new = new_secret();
                    let digest = crate::keyring::digest_hex(&new);
                    secret = Some(new);
                    KeyChange::Rotate {
                        secret_sha256: digest,
                    }
                }
            };
            change_key(&mut record, &core_change, now).map_err(field_error)?;
            match bounded(store.put_key(record.clone(), revision)).await {
                Ok(revision) => {
                    tracing::info!(
                        target: "audit",
                        event = change.event(),
                        admin_key = %admin.id,
                        key = %record.id,
                        principal = %record.principal,
                        models = ?record.models,
                        limits = ?record.limits,
                        expires_unix_ms = ?record.expires_unix_ms,
                    );
                    let _ = state.keys().sync().await;
                    let mut body = record_json(&record, revision);
                    if let Some(secret) = secret {
                        body["secret"] = json!(secret);
                    }
                    return Ok(axum::Json(body).into_response());
                }
                Err(TenantStoreError::Conflict { .. }) => continue,
                Err(e) => return Err(store_error(&e)),
            }
        }
        Err(store_error(&TenantStoreError::Conflict { current: 0 }))
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

async fn update_key(
    State(state): State<AppState>,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    match read_fields(body).await {
        Ok(fields) => {
            change_stored_key(
                &state,
                &parts.headers,
                &id,
                Change::Update(Box::new(fields)),
            )
            .await
        }
        Err(e) => match admin(&state, &parts.headers) {
            Ok(_) => e.into_response(),
            Err(auth) => auth.into_response(),
        },
    }
}

async fn revoke_key(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    change_stored_key(&state, &headers, &id, Change::Revoke).await
}

async fn rotate_key(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    change_stored_key(&state, &headers, &id, Change::Rotate).await
}

/// `GET /admin/usage` query.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UsageParams {
    /// First day, `YYYY-MM-DD` (default: 30 days before `to`).
    from: Option<String>,
    /// Last day, `YYYY-MM-DD` (default: today, UTC).
    to: Option<String>,
    principal: Option<String>,
    key: Option<String>,
}

async fn usage(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: Result<Query<UsageParams>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let result = async {
        admin(&state, &headers)?;
        let Query(params) = query
            .map_err(|_| ApiError::invalid_value("query", "expected from, to, principal, key"))?;
        let day = |name: &str, text: &Option<String>, default: u64| match text {
            None => Ok(default),
            Some(t) => {
                parse_day(t).ok_or_else(|| ApiError::invalid_value(name, "expected YYYY-MM-DD"))
            }
        };
        let to = day("to", &params.to, day_of(iop_transport::clock::unix_ms()))?;
        let from = day("from", &params.from, to.saturating_sub(30 * DAY_MS))?;
        if from > to || (to - from) / DAY_MS >= MAX_USAGE_DAYS {
            return Err(ApiError::invalid_value(
                "from",
                "must be on or before `to`, at most 400 days apart",
            ));
        }
        if params
            .principal
            .as_deref()
            .is_some_and(|p| !iop_core::tenant::keys::principal_ok(p))
        {
            return Err(ApiError::invalid_value("principal", "not a principal name"));
        }
        if params.key.as_deref().is_some_and(|k| k.len() > 128) {
            return Err(ApiError::invalid_value("key", "not a key id"));
        }
        let query = UsageQuery {
            from_day_unix_ms: from,
            to_day_unix_ms: to,
            principal: params.principal,
            key: params.key,
            max_rows: MAX_USAGE_ROWS + 1,
        };
        let mut rows = bounded(state.tenancy().store().usage(query))
            .await
            .map_err(|e| store_error(&e))?;
        let truncated = rows.len() > MAX_USAGE_ROWS;
        rows.truncate(MAX_USAGE_ROWS);
        let mut total = UsageTotals::default();
        for (_, t) in &rows {
            total.add(t);
        }
        let data: Vec<Value> = rows
            .iter()
            .map(|(k, t)| {
                let mut row = crate::tenancy::usage_row_json(k, t);
                row["date"] = json!(format_day(k.day_unix_ms));
                row
            })
            .collect();
        Ok::<_, ApiError>(
            axum::Json(json!({
                "object": "list",
                "from": format_day(from),
                "to": format_day(to),
                "data": data,
                "total": crate::tenancy::totals_json(&total),
                "truncated": truncated,
            }))
            .into_response(),
        )
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}
