//! The client-facing HTTP server: the OpenAI API (`/v1/chat/completions`,
//! `/v1/responses`, `/v1/models`), the Ollama API (`/api/chat`,
//! `/api/generate`, `/api/tags`) and the operator surface (`/status`,
//! `/healthz`).
//!
//! Handlers authenticate, parse and validate, then hand the request to a
//! [`crate::driver`] task and turn its deliveries into the API's own wire
//! format. Every error is the API's own error JSON.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::Stream;
use iop_core::edge::gate::{AdmissionFailure, GateFailure};
use iop_core::ids::ProviderId;
use iop_wire::RunApi;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::api::error::ApiError;
use crate::api::{chat, models, ollama, responses};
use crate::config::{ApiKey, EdgeConfig};
use crate::driver::{
    self, Delivery, DriverContext, DriverObservation, TunnelApi, TunnelBody, Work,
};
use crate::hub::HubHandle;
use crate::metrics::EdgeMetrics;

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    config: Arc<EdgeConfig>,
    /// SHA-256 of each key -> the key's entry (the key itself is compared
    /// only through its digest).
    keys: Arc<HashMap<[u8; 32], ApiKey>>,
    ctx: DriverContext,
    hub: HubHandle,
    ids: Arc<AtomicU64>,
    metrics: Arc<EdgeMetrics>,
}

impl AppState {
    /// State for `config`, dispatching through `hub`.
    pub fn new(
        config: Arc<EdgeConfig>,
        hub: HubHandle,
        clock: iop_transport::clock::Clock,
        metrics: Arc<EdgeMetrics>,
        creds: Arc<crate::cred::Credentials>,
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
        let keys = config
            .api_keys
            .iter()
            .map(|k| (digest(&k.key), k.clone()))
            .collect();
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
                max_attempts: config.admission.max_attempts,
                request_budget: Duration::from_millis(config.admission.request_budget_ms),
                modes: Arc::new(modes),
                observe,
            },
            keys: Arc::new(keys),
            hub,
            ids: Arc::new(AtomicU64::new(1)),
            config,
            metrics,
        }
    }

    fn next_id(&self) -> u64 {
        // Unique per process; mixed so ids do not reveal request counts.
        let n = self.ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5851_F42D_4C95_7F2D
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(create_response))
        .route("/v1/models", get(list_models))
        .route("/api/chat", post(ollama_chat))
        .route("/api/generate", post(ollama_generate))
        .route("/api/tags", get(ollama_tags))
        .route("/healthz", get(|| async { "ok" }))
        .route("/status", get(status))
        .route("/metrics", get(metrics_text))
        .route(
            "/admin/credentials/{profile}/revoke",
            post(revoke_credential),
        )
        .fallback(|| async { error_response(&ApiError::not_found("route")) })
        .with_state(state)
}

/// The API's error as a response (with `Retry-After` when set).
pub fn error_response(err: &ApiError) -> Response {
    json_error(err, err.to_json())
}

fn ollama_error_response(err: &ApiError) -> Response {
    json_error(err, err.to_ollama_json())
}

fn json_error(err: &ApiError, body: serde_json::Value) -> Response {
    let status = StatusCode::from_u16(err.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (status, axum::Json(body)).into_response();
    if let Some(secs) = err.retry_after_secs
        && let Ok(v) = HeaderValue::from_str(&secs.to_string())
    {
        resp.headers_mut().insert(header::RETRY_AFTER, v);
    }
    resp
}

fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<ApiKey, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or_else(ApiError::missing_api_key)?;
    let value = value.to_str().map_err(|_| ApiError::invalid_api_key())?;
    let token = value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .ok_or_else(ApiError::invalid_api_key)?
        .trim();
    state
        .keys
        .get(&digest(token))
        .cloned()
        .ok_or_else(ApiError::invalid_api_key)
}

async fn read_body(state: &AppState, body: Body) -> Result<bytes::Bytes, ApiError> {
    let limit = state.config.edge.max_body_bytes;
    axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| ApiError::body_too_large(limit))
}

/// The pool for `model`, if the key may use it.
fn pool_for(state: &AppState, key: &ApiKey, model: &str) -> Result<Vec<ProviderId>, ApiError> {
    match state.config.route(model) {
        Some(pool) if key.allows(model) => Ok(pool.to_vec()),
        // A model the key may not use is indistinguishable from one that
        // does not exist.
        _ => Err(ApiError::model_not_found(model)),
    }
}

/// The error a gate failure becomes.
pub fn gate_error(kind: GateFailure) -> ApiError {
    match kind {
        GateFailure::Admission(AdmissionFailure::QueueFull) => ApiError::queue_full(1),
        GateFailure::Admission(AdmissionFailure::NoEligibleProvider) => ApiError::no_provider(),
        GateFailure::Admission(AdmissionFailure::QueueTimeout) => ApiError::queue_timeout(),
        GateFailure::BudgetExpired => ApiError::budget_expired(),
        GateFailure::Attempt(code) => ApiError::from_failure(code),
    }
}

/// Wait for the driver's first delivery: the commit or the one error.
async fn first(
    rx: &mut mpsc::Receiver<Delivery>,
) -> Result<Option<(u16, Vec<iop_wire::Header>)>, ApiError> {
    match rx.recv().await {
        Some(Delivery::Commit { tunnel_head }) => Ok(tunnel_head),
        Some(Delivery::Fail { kind, .. }) => Err(gate_error(kind)),
        Some(other) => {
            tracing::error!(event = "edge_driver_protocol_bug", delivery = ?other);
            Err(ApiError::internal())
        }
        None => Err(ApiError::internal()),
    }
}

fn tunnel_body(api: TunnelApi, path: &str, body: &[u8]) -> TunnelBody {
    TunnelBody {
        api,
        path: path.to_owned(),
        headers: vec![("content-type".into(), "application/json".into())],
        body: body.to_vec(),
    }
}

fn unix_now() -> u64 {
    iop_transport::clock::unix_ms() / 1000
}

/// Authenticate, read and parse a request body; any failure is the
/// response to send.
async fn admit_body<T>(
    state: &AppState,
    request: Request,
    record: &mut RequestRecord,
    parse: impl FnOnce(&[u8]) -> Result<T, ApiError>,
) -> Result<(ApiKey, bytes::Bytes, T), ApiError> {
    let (parts, body) = request.into_parts();
    let result = async {
        let key = authenticate(state, &parts.headers)?;
        let body = read_body(state, body).await?;
        let parsed = parse(&body)?;
        Ok((key, body, parsed))
    }
    .await;
    if let Err(e) = &result {
        record.error(e);
    }
    result
}

async fn chat_completions(State(state): State<AppState>, request: Request) -> Response {
    let mut record = RequestRecord::new(&state, "chat");
    let (key, body, req) =
        match admit_body(&state, request, &mut record, chat::parse_chat_request).await {
            Ok(x) => x,
            Err(e) => return error_response(&e),
        };
    let pool = match pool_for(&state, &key, &req.model) {
        Ok(p) => p,
        Err(e) => {
            record.error(&e);
            return error_response(&e);
        }
    };
    let work = Work {
        model: req.model.clone(),
        api: RunApi::Chat,
        messages: req.messages.clone(),
        tools: req.tools.clone(),
        params: req.params.clone(),
        tunnel: Some(tunnel_body(
            TunnelApi::OpenAi,
            "/v1/chat/completions",
            &body,
        )),
        route: "chat",
        principal: key.principal.clone(),
    };
    let mut rx = driver::spawn(state.ctx.clone(), pool, work);
    let head = match first(&mut rx).await {
        Ok(h) => h,
        Err(e) => {
            record.error(&e);
            return error_response(&e);
        }
    };
    if let Some((status, headers)) = head {
        return tunnel_response(status, headers, rx, record);
    }
    let id = crate::api::ids::chat_completion_id(state.next_id());
    let created = unix_now();
    if req.stream {
        let mut enc = chat::ChatStream::new(id, req.model.clone(), created)
            .with_usage_chunk(req.include_usage);
        let stream = sse_stream(rx, record, move |d, record| match d {
            Delivery::Event(ev) => enc.push(&ev).into_iter().map(data_event).collect(),
            Delivery::Finish => {
                record.set("ok");
                vec![Event::default().data("[DONE]")]
            }
            Delivery::Fail { kind, .. } => {
                let err = gate_error(kind);
                record.error(&err);
                enc.fail(&err).into_iter().map(data_event).collect()
            }
            _ => Vec::new(),
        });
        Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response()
    } else {
        let mut acc = chat::ChatAccumulator::new(id, req.model.clone(), created);
        let result = collect_events(&mut rx, &mut record)
            .await
            .and_then(|events| {
                events.iter().for_each(|ev| acc.push(ev));
                acc.finish()
            });
        json_or_error(&mut record, result)
    }
}

/// Drain a non-streaming request: its events, or the error to answer.
async fn collect_events(
    rx: &mut mpsc::Receiver<Delivery>,
    record: &mut RequestRecord,
) -> Result<Vec<iop_wire::RunEventKind>, ApiError> {
    let mut events = Vec::new();
    while let Some(d) = rx.recv().await {
        match d {
            Delivery::Event(ev) => events.push(ev),
            Delivery::Finish => return Ok(events),
            Delivery::Fail { kind, .. } => {
                let e = gate_error(kind);
                record.error(&e);
                return Err(e);
            }
            _ => {}
        }
    }
    Err(ApiError::internal())
}

/// The final JSON of a non-streaming request, or its error.
fn json_or_error(
    record: &mut RequestRecord,
    result: Result<serde_json::Value, ApiError>,
) -> Response {
    match result {
        Ok(v) => {
            record.set("ok");
            axum::Json(v).into_response()
        }
        Err(e) => {
            record.error(&e);
            error_response(&e)
        }
    }
}

async fn create_response(State(state): State<AppState>, request: Request) -> Response {
    let mut record = RequestRecord::new(&state, "responses");
    let (key, body, req) = match admit_body(
        &state,
        request,
        &mut record,
        responses::parse_responses_request,
    )
    .await
    {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    let pool = match pool_for(&state, &key, &req.model) {
        Ok(p) => p,
        Err(e) => {
            record.error(&e);
            return error_response(&e);
        }
    };
    let work = Work {
        model: req.model.clone(),
        api: RunApi::Chat,
        messages: req.messages.clone(),
        tools: req.tools.clone(),
        params: req.params.clone(),
        tunnel: Some(tunnel_body(TunnelApi::OpenAi, "/v1/responses", &body)),
        route: "responses",
        principal: key.principal.clone(),
    };
    let mut rx = driver::spawn(state.ctx.clone(), pool, work);
    let head = match first(&mut rx).await {
        Ok(h) => h,
        Err(e) => {
            record.error(&e);
            return error_response(&e);
        }
    };
    if let Some((status, headers)) = head {
        return tunnel_response(status, headers, rx, record);
    }
    let id = crate::api::ids::response_id(state.next_id());
    let created = unix_now();
    if req.stream {
        let mut enc = responses::ResponsesStream::new(id, req.model.clone(), created)
            .with_echo(req.echo.clone());
        let mut opening: Vec<Event> = enc.start().into_iter().map(named_event).collect();
        let stream = sse_stream(rx, record, move |d, record| {
            let mut out = std::mem::take(&mut opening);
            match d {
                Delivery::Event(ev) => out.extend(enc.push(&ev).into_iter().map(named_event)),
                Delivery::Finish => record.set("ok"),
                Delivery::Fail { kind, .. } => {
                    let err = gate_error(kind);
                    record.error(&err);
                    out.extend(enc.fail(&err).into_iter().map(named_event));
                }
                _ => {}
            }
            out
        });
        Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response()
    } else {
        let mut acc = responses::ResponsesAccumulator::new(id, req.model.clone(), created)
            .with_echo(req.echo.clone());
        let result = collect_events(&mut rx, &mut record)
            .await
            .and_then(|events| {
                events.iter().for_each(|ev| acc.push(ev));
                acc.finish()
            });
        json_or_error(&mut record, result)
    }
}

async fn list_models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let key = match authenticate(&state, &headers) {
        Ok(k) => k,
        Err(e) => return error_response(&e),
    };
    let names: Vec<String> = state
        .config
        .listed_models()
        .filter(|m| key.allows(m))
        .map(str::to_owned)
        .collect();
    axum::Json(models::models_list_json(&names, unix_now())).into_response()
}

async fn ollama_chat(State(state): State<AppState>, request: Request) -> Response {
    ollama_run(state, request, RunApi::Chat).await
}

async fn ollama_generate(State(state): State<AppState>, request: Request) -> Response {
    ollama_run(state, request, RunApi::Generate).await
}

async fn ollama_run(state: AppState, request: Request, api: RunApi) -> Response {
    let route = match api {
        RunApi::Chat => "ollama_chat",
        RunApi::Generate => "ollama_generate",
    };
    let mut record = RequestRecord::new(&state, route);
    let parse = match api {
        RunApi::Chat => ollama::parse_ollama_chat,
        RunApi::Generate => ollama::parse_ollama_generate,
    };
    let (key, body, req) = match admit_body(&state, request, &mut record, parse).await {
        Ok(x) => x,
        Err(e) => return ollama_error_response(&e),
    };
    let pool = match pool_for(&state, &key, &req.model) {
        Ok(p) => p,
        Err(e) => {
            record.error(&e);
            return ollama_error_response(&e);
        }
    };
    let started = iop_transport::clock::unix_ms();
    if req.is_load_only() {
        record.set("ok");
        return axum::Json(ollama::load_response_json(&req.model, api, started)).into_response();
    }
    let work = Work {
        model: req.model.clone(),
        api,
        messages: req.messages.clone(),
        tools: req.tools.clone(),
        params: req.params.clone(),
        tunnel: Some(tunnel_body(
            TunnelApi::Ollama,
            match api {
                RunApi::Chat => "/api/chat",
                RunApi::Generate => "/api/generate",
            },
            &body,
        )),
        route,
        principal: key.principal.clone(),
    };
    let mut rx = driver::spawn(state.ctx.clone(), pool, work);
    match first(&mut rx).await {
        Err(e) => {
            record.error(&e);
            return ollama_error_response(&e);
        }
        // A tunnel-mode Ollama provider answered in its own format.
        Ok(Some((status, headers))) => return tunnel_response(status, headers, rx, record),
        Ok(None) => {}
    }
    if req.stream {
        let enc = ollama::OllamaStream::new(req.model.clone(), api, started);
        let lines = futures::stream::unfold(
            (rx, enc, record, false),
            |(mut rx, mut enc, mut record, done)| async move {
                if done {
                    return None;
                }
                loop {
                    let d = rx.recv().await?;
                    let (values, end) = match d {
                        Delivery::Event(ev) => {
                            (enc.push(&ev, iop_transport::clock::unix_ms()), false)
                        }
                        Delivery::Finish => {
                            record.set("ok");
                            (Vec::new(), true)
                        }
                        Delivery::Fail { kind, .. } => {
                            let err = gate_error(kind);
                            record.error(&err);
                            (enc.fail(&err), true)
                        }
                        _ => continue,
                    };
                    let mut text = String::new();
                    for v in values {
                        text.push_str(&v.to_string());
                        text.push('\n');
                    }
                    return Some((
                        Ok::<_, Infallible>(bytes::Bytes::from(text)),
                        (rx, enc, record, end),
                    ));
                }
            },
        );
        Response::builder()
            .header(header::CONTENT_TYPE, "application/x-ndjson")
            .body(Body::from_stream(lines))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
    } else {
        let mut acc = ollama::OllamaAccumulator::new(req.model.clone(), api, started);
        while let Some(d) = rx.recv().await {
            match d {
                Delivery::Event(ev) => acc.push(&ev),
                Delivery::Finish => {
                    return match acc.finish(iop_transport::clock::unix_ms()) {
                        Ok(v) => {
                            record.set("ok");
                            axum::Json(v).into_response()
                        }
                        Err(e) => {
                            record.error(&e);
                            ollama_error_response(&e)
                        }
                    };
                }
                Delivery::Fail { kind, .. } => {
                    let e = gate_error(kind);
                    record.error(&e);
                    return ollama_error_response(&e);
                }
                _ => {}
            }
        }
        ollama_error_response(&ApiError::internal())
    }
}

async fn ollama_tags(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let key = match authenticate(&state, &headers) {
        Ok(k) => k,
        Err(e) => return ollama_error_response(&e),
    };
    let names: Vec<String> = state
        .config
        .listed_models()
        .filter(|m| key.allows(m))
        .map(str::to_owned)
        .collect();
    axum::Json(ollama::tags_json(&names)).into_response()
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

/// Records one client request's outcome in the metrics when dropped; a
/// request dropped before an outcome was set was abandoned by its client.
struct RequestRecord {
    metrics: Arc<EdgeMetrics>,
    route: &'static str,
    started: std::time::Instant,
    outcome: &'static str,
}

impl RequestRecord {
    fn new(state: &AppState, route: &'static str) -> Self {
        Self {
            metrics: state.metrics.clone(),
            route,
            started: std::time::Instant::now(),
            outcome: "client_disconnected",
        }
    }

    fn set(&mut self, outcome: &'static str) {
        self.outcome = outcome;
    }

    fn error(&mut self, err: &ApiError) {
        self.outcome = outcome_of(err);
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        self.metrics
            .request(self.route, self.outcome, self.started.elapsed());
    }
}

/// The closed outcome class of an error.
fn outcome_of(err: &ApiError) -> &'static str {
    match err.status {
        400 | 413 | 422 => "invalid_request",
        401 | 403 => "unauthorized",
        404 => "not_found",
        429 => "rate_limited",
        502 => "provider_error",
        503 => "unavailable",
        504 => "timeout",
        _ => "internal",
    }
}

async fn status(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let key = match authenticate(&state, &headers) {
        Ok(k) => k,
        Err(e) => return error_response(&e),
    };
    if !key.admin {
        return error_response(&ApiError::permission_denied());
    }
    match state.hub.snapshot().await {
        Ok(snap) => axum::Json(crate::status::status_json(&state.config, &snap)).into_response(),
        Err(_) => error_response(&ApiError::internal()),
    }
}

/// `POST /admin/credentials/{profile}/revoke` (admin key): mark the profile
/// inactive and push the new states to every connected Node; from then on
/// every lease of it fails closed (R-CRED-3).
async fn revoke_credential(
    State(state): State<AppState>,
    axum::extract::Path(profile): axum::extract::Path<String>,
    headers: HeaderMap,
) -> Response {
    let key = match authenticate(&state, &headers) {
        Ok(k) => k,
        Err(e) => return error_response(&e),
    };
    if !key.admin {
        return error_response(&ApiError::permission_denied());
    }
    if !state.ctx.creds.revoke(&profile) {
        return error_response(&ApiError::not_found("credential profile"));
    }
    tracing::warn!(event = "edge_credential_revoked", profile = %profile, by = %key.principal);
    state.hub.refresh_credentials();
    axum::Json(serde_json::json!({ "profile": profile, "active": false })).into_response()
}

/// A tunnelled response: the provider's status and headers, then its body.
fn tunnel_response(
    status: u16,
    headers: Vec<iop_wire::Header>,
    rx: mpsc::Receiver<Delivery>,
    record: RequestRecord,
) -> Response {
    let body = futures::stream::unfold((rx, record), |(mut rx, mut record)| async move {
        loop {
            match rx.recv().await? {
                Delivery::Body(bytes) => {
                    return Some((Ok::<_, Infallible>(bytes::Bytes::from(bytes)), (rx, record)));
                }
                Delivery::Finish => {
                    record.set("ok");
                    return None;
                }
                Delivery::Fail { kind, .. } => {
                    record.error(&gate_error(kind));
                    return None;
                }
                _ => continue,
            }
        }
    });
    let mut builder =
        Response::builder().status(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY));
    for (name, value) in headers {
        let lower = name.to_ascii_lowercase();
        if matches!(
            lower.as_str(),
            "content-length" | "transfer-encoding" | "connection" | "keep-alive"
        ) {
            continue;
        }
        builder = builder.header(name, value);
    }
    builder
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
}

fn data_event(json: serde_json::Value) -> Event {
    Event::default().data(json.to_string())
}

fn named_event(ev: responses::ResponsesEvent) -> Event {
    Event::default().event(ev.event).data(ev.data.to_string())
}

/// Turn driver deliveries into SSE events until the stream ends.
fn sse_stream<F>(
    rx: mpsc::Receiver<Delivery>,
    record: RequestRecord,
    f: F,
) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnMut(Delivery, &mut RequestRecord) -> Vec<Event> + Send + 'static,
{
    futures::stream::unfold(
        (rx, f, record, false),
        |(mut rx, mut f, mut record, done)| async move {
            if done {
                return None;
            }
            let d = rx.recv().await?;
            let end = matches!(d, Delivery::Finish | Delivery::Fail { .. });
            let events = f(d, &mut record);
            Some((
                futures::stream::iter(events.into_iter().map(Ok)),
                (rx, f, record, end),
            ))
        },
    )
    .flatten()
}

use futures::StreamExt as _;
