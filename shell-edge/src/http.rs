//! The client-facing HTTP server: the OpenAI API (`/v1/chat/completions`,
//! `/v1/responses`, `/v1/models`), the Ollama API (`/api/chat`,
//! `/api/generate`, `/api/tags`) and the operator surface (`/status`,
//! `/healthz`).
//!
//! Handlers authenticate, parse and validate, then hand the request to a
//! [`crate::driver`] task and turn its deliveries into the API's own wire
//! format. Every error is the API's own error JSON. The four run endpoints
//! are one pipeline, `run_endpoint`, told apart only by their
//! [`RunEndpoint`] (see [`crate::api::endpoint`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use iop_core::edge::whole_answer::WholeAnswerBudget;
use iop_core::ids::ProviderId;
use iop_wire::{AdapterKind, RunApi};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::api::endpoint::{
    AnswerStart, AnswerStream, ChatCompletions, Completions, Embeddings, Ollama, OllamaEmbed,
    Responses, RunEndpoint, WholeAnswer,
};
use crate::api::{ApiError, NormalizedRun, OllamaError, framing, models, ollama, surface};
use crate::config::{ApiKey, EdgeConfig, ProviderMode};
use crate::driver::{
    self, Delivery, DriverContext, DriverObservation, TunnelApi, TunnelBody, Work,
};
use crate::hub::HubHandle;
use crate::metrics::EdgeMetrics;
use crate::request_body::{BodyBudget, BodyError, BodyPermit, CLIENT_CLOSED_CODE};

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
    /// R-LIM-2: every request body is read under this budget.
    bodies: BodyBudget,
    /// Durable responses (SPEC §6).
    durable: Arc<crate::durable::Durable>,
}

impl AppState {
    /// State for `config`, dispatching through `hub`.
    pub fn new(
        config: Arc<EdgeConfig>,
        hub: HubHandle,
        clock: iop_transport::clock::Clock,
        metrics: Arc<EdgeMetrics>,
        creds: Arc<crate::cred::Credentials>,
        durable: Arc<crate::durable::Durable>,
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
                budget: config.admission.gate_budget(),
                client_write_timeout: Duration::from_millis(config.edge.client_write_timeout_ms),
                metrics: metrics.clone(),
                modes: Arc::new(modes),
                observe,
            },
            keys: Arc::new(keys),
            bodies: BodyBudget::new(
                config.edge.request_memory_bytes,
                config.edge.request_memory_per_key(),
                config.edge.max_body_bytes,
                Duration::from_millis(config.edge.body_read_timeout_ms),
            ),
            hub,
            ids: Arc::new(AtomicU64::new(1)),
            config,
            metrics,
            durable,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EdgeConfig {
        &self.config
    }

    /// Durable responses.
    pub fn durable(&self) -> &Arc<crate::durable::Durable> {
        &self.durable
    }

    /// What a request's driver needs.
    pub fn driver_context(&self) -> &DriverContext {
        &self.ctx
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
        .route(
            "/v1/chat/completions/{id}",
            get(crate::stored::retrieve_chat_completion)
                .delete(crate::stored::delete_chat_completion),
        )
        .route("/v1/responses", post(create_response))
        .route(
            "/v1/responses/{id}",
            get(crate::stored::retrieve_response).delete(crate::stored::delete_response),
        )
        .route(
            "/v1/responses/{id}/cancel",
            post(crate::stored::cancel_response),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(crate::stored::input_items),
        )
        .route("/v1/models", get(list_models))
        .route("/api/chat", post(ollama_chat))
        .route("/api/generate", post(ollama_generate))
        .route("/api/tags", get(ollama_tags))
        .route("/v1/embeddings", post(create_embeddings))
        .route("/v1/completions", post(create_completion))
        .route("/api/embed", post(ollama_embed))
        .route("/api/show", post(ollama_show))
        .route("/api/ps", get(ollama_ps))
        .route("/healthz", get(|| async { "ok" }))
        .route("/status", get(status))
        .route("/metrics", get(metrics_text))
        .route(
            "/admin/credentials/{profile}/revoke",
            post(revoke_credential),
        )
        .fallback(|| async { ApiError::not_found("route").into_response() })
        .with_state(state)
}

pub(crate) fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<ApiKey, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or_else(ApiError::missing_api_key)?;
    let value = value.to_str().map_err(|_| ApiError::invalid_api_key())?;
    let token = bearer_token(value).ok_or_else(ApiError::invalid_api_key)?;
    state
        .keys
        .get(&digest(token))
        .cloned()
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
    let mut refusal = None;
    let capable: Vec<ProviderId> = pool
        .iter()
        .filter(|id| {
            let Some(provider) = state.config.provider(id) else {
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
fn routed_pool(state: &AppState, model: &str) -> Option<Vec<ProviderId>> {
    if let Some(pool) = state.config.exact_route(model) {
        return Some(pool.to_vec());
    }
    let discovered: Vec<ProviderId> = match state.config.model_names.discovered_name(model) {
        Some(name) => state
            .hub
            .catalog()
            .pool_for(name)
            .into_iter()
            .filter(|id| state.config.provider(id).is_some_and(|p| p.discover_models))
            .collect(),
        None => Vec::new(),
    };
    if !discovered.is_empty() {
        return Some(discovered);
    }
    state.config.route(model).map(<[ProviderId]>::to_vec)
}

/// How a tunnelled body is framed, for the one error it may carry.
#[derive(Debug, Clone, Copy)]
enum TunnelFraming {
    /// `text/event-stream`: an SSE `data:` event.
    Sse,
    /// `application/x-ndjson` (Ollama): one JSON line.
    Ndjson,
    /// Anything else: the body is cut off.
    Opaque,
}

/// Wait for the driver's first delivery: the commit or the one error.
async fn first(
    rx: &mut mpsc::Receiver<Delivery>,
) -> Result<Option<(u16, Vec<iop_wire::Header>)>, ApiError> {
    match rx.recv().await {
        Some(Delivery::Commit { tunnel_head }) => Ok(tunnel_head),
        Some(Delivery::Fail { kind, .. }) => Err(ApiError::from_gate_failure(kind)),
        Some(other) => {
            tracing::error!(event = "edge_driver_protocol_bug", delivery = ?other);
            Err(ApiError::internal())
        }
        None => Err(ApiError::internal()),
    }
}

/// `body` (a JSON object, already parsed once) with its `model` replaced.
fn body_naming_model(body: &[u8], model: &str) -> Result<bytes::Bytes, ApiError> {
    let mut value: serde_json::Value =
        serde_json::from_slice(body).map_err(|_| ApiError::internal())?;
    let Some(object) = value.as_object_mut() else {
        return Err(ApiError::internal());
    };
    object.insert("model".into(), serde_json::Value::from(model));
    serde_json::to_vec(&value)
        .map(bytes::Bytes::from)
        .map_err(|_| ApiError::internal())
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

/// What an admitted run request brings: the caller's key, the raw body (for
/// a tunnel), the parsed run with its API's options, and the model's pool.
pub(crate) struct Admitted<O> {
    pub(crate) key: ApiKey,
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
}

/// Authenticate, read and parse a run request and route its model; any
/// failure is the response to send.
async fn admit<E: RunEndpoint>(
    state: &AppState,
    request: Request,
    endpoint: &E,
) -> Result<Admitted<E::Options>, ApiError> {
    let (parts, body) = request.into_parts();
    let key = authenticate(state, &parts.headers)?;
    let mut held = state
        .bodies
        .read(&key.principal, &parts.headers, body)
        .await
        .map_err(BodyError::to_api_error)?;
    let (run, options) = endpoint.parse(&held.bytes)?;
    let pool = pool_for(state, &key, &run)?;
    let provider_model = state.config.model_names.provider_model(&run.model);
    // Rewritten while the body's decoded share is still held (R-LIM-2).
    let renamed_body = if provider_model != run.model
        && pool.iter().any(|id| {
            state
                .config
                .provider(id)
                .is_some_and(|p| p.mode == ProviderMode::Tunnel)
        }) {
        Some(body_naming_model(&held.bytes, provider_model)?)
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
    })
}

async fn chat_completions(State(state): State<AppState>, request: Request) -> Response {
    run_endpoint(state, request, ChatCompletions).await
}

async fn create_response(State(state): State<AppState>, request: Request) -> Response {
    run_endpoint(state, request, Responses).await
}

async fn ollama_chat(State(state): State<AppState>, request: Request) -> Response {
    run_endpoint(state, request, Ollama(RunApi::Chat)).await
}

async fn ollama_generate(State(state): State<AppState>, request: Request) -> Response {
    run_endpoint(state, request, Ollama(RunApi::Generate)).await
}

async fn create_embeddings(State(state): State<AppState>, request: Request) -> Response {
    run_endpoint(state, request, Embeddings).await
}

async fn create_completion(State(state): State<AppState>, request: Request) -> Response {
    run_endpoint(state, request, Completions).await
}

async fn ollama_embed(State(state): State<AppState>, request: Request) -> Response {
    run_endpoint(state, request, OllamaEmbed).await
}

/// `POST /api/show`: what the Edge knows of a routable model (its
/// providers' kinds); 404 for a model the key cannot use.
async fn ollama_show(State(state): State<AppState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let answer = async {
        let key = authenticate(&state, &parts.headers)?;
        // Through the body budget like every request body (R-LIM-2).
        let held = state
            .bodies
            .read(&key.principal, &parts.headers, body)
            .await
            .map_err(BodyError::to_api_error)?;
        let model = ollama::parse_show_request(&held.bytes)?;
        let pool = match routed_pool(&state, &model) {
            Some(pool) if key.allows(&model) => pool,
            _ => return Err(ApiError::model_not_found(&model)),
        };
        let adapters: Vec<iop_wire::AdapterKind> = pool
            .iter()
            .filter_map(|id| state.config.provider(id))
            .map(|p| p.spec.adapter)
            .collect();
        Ok(ollama::show_json(&model, &adapters))
    }
    .await;
    match answer {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => OllamaError(e).into_response(),
    }
}

/// `GET /api/ps`: the models routable now for the caller's key.
async fn ollama_ps(State(state): State<AppState>, headers: HeaderMap) -> Response {
    match listed_models(&state, &headers) {
        Ok(names) => axum::Json(ollama::ps_json(&names)).into_response(),
        Err(e) => OllamaError(e).into_response(),
    }
}

/// The one pipeline of every run endpoint; `endpoint` is what differs
/// between the APIs (see [`crate::api::endpoint`]).
async fn run_endpoint<E: RunEndpoint>(state: AppState, request: Request, endpoint: E) -> Response {
    let route = endpoint.route();
    let mut record = RequestRecord::new(&state, route, request.headers());
    // An error instead of an answer: recorded, then in the API's own shape.
    let refuse = |mut record: RequestRecord, err: ApiError| {
        record.error(&err);
        endpoint.error_response(err)
    };
    let idempotency = match crate::stored::idempotency_key(request.headers()) {
        Ok(key) => key,
        Err(e) => return refuse(record, e),
    };
    let mut admitted = match admit(&state, request, &endpoint).await {
        Ok(admitted) => admitted,
        Err(e) => return refuse(record, e),
    };
    // A continued conversation: the stored response's messages go between
    // this request's instructions and its input.
    let mut history = None;
    if let Some(previous) = endpoint.previous_response(&admitted.options) {
        match crate::stored::history(&state, &admitted.key, &previous).await {
            Ok(messages) => {
                crate::stored::continue_conversation(
                    &mut admitted.run.messages,
                    endpoint.instruction_messages(&admitted.options),
                    &messages,
                );
                history = Some(messages);
            }
            Err(e) => return refuse(record, e),
        }
    }
    // SPEC §6: kept (`store`, `background`) or idempotent requests are
    // durable.
    let keep = endpoint.keep(&admitted.options, state.durable.responses_store_default());
    if keep.store || keep.background || idempotency.is_some() {
        return crate::stored::run_durable(
            &state,
            endpoint,
            admitted,
            keep,
            history,
            idempotency,
            record,
        )
        .await;
    }
    let (run, options) = (admitted.run, admitted.options);
    // The body and what was parsed from it live as long as the request.
    record.body_permit = Some(admitted.body_permit);
    let admitted_unix_ms = iop_transport::clock::unix_ms();
    if let Some(answer) = endpoint.answer_without_run(&run, &options, admitted_unix_ms) {
        record.set("ok");
        return axum::Json(answer).into_response();
    }
    let (tunnel_api, tunnel_path) = endpoint.tunnel();
    let tunnelled = admitted.renamed_body.as_ref().unwrap_or(&admitted.body);
    let work = Work {
        model: admitted.provider_model,
        api: run.api,
        messages: run.messages,
        tools: run.tools,
        params: run.params,
        tunnel: Some(tunnel_body(tunnel_api, tunnel_path, tunnelled)),
        route,
        principal: admitted.key.principal,
        trace_context: record.span.context(),
        continuation: iop_core::edge::request::continuation_allowed(
            run.api,
            state.config.continuation_for(&run.model),
        ),
    };
    let mut rx = driver::spawn(state.ctx.clone(), admitted.pool, work);
    let first = first(&mut rx).await;
    if first.is_ok() {
        record.span.event("committed", &[]);
    }
    match first {
        Err(e) => return refuse(record, e),
        // A tunnel-mode provider answered in its own format.
        Ok(Some((status, headers))) => return tunnel_response(status, headers, rx, record),
        Ok(None) => {}
    }
    let start = AnswerStart {
        model: run.model,
        id_seed: state.next_id(),
        admitted_unix_ms,
        committed_unix: unix_now(),
    };
    if run.stream {
        E::Stream::response(answer_body(rx, record, endpoint.stream(start, options)))
    } else {
        match whole_answer(
            &mut rx,
            endpoint.whole(start, options),
            MAX_WHOLE_ANSWER_BYTES,
        )
        .await
        {
            Ok(v) => {
                record.set("ok");
                axum::Json(v).into_response()
            }
            Err(e) => refuse(record, e),
        }
    }
}

/// Most deliveries, already waiting when a body chunk is written, that go
/// into that one chunk.
pub const MAX_DELIVERIES_PER_CHUNK: usize = 64;

/// A body chunk stops taking waiting deliveries once it has this many bytes.
pub const MAX_CHUNK_BYTES: usize = 64 * 1024;

/// The smallest buffer a body chunk starts with; later chunks start with
/// the previous one's size, so a chunk is written without growing.
const MIN_CHUNK_CAPACITY: usize = 512;

/// A streamed answer being written: the run's deliveries in, body chunks out.
struct AnswerBody<S> {
    rx: mpsc::Receiver<Delivery>,
    encoder: S,
    record: RequestRecord,
    /// Frames due and not yet handed to the body.
    pending: Vec<u8>,
    /// The run ended; nothing follows `pending`.
    done: bool,
    /// When a silent SSE stream gets its keep-alive comment.
    keep_alive_at: tokio::time::Instant,
}

impl<S: AnswerStream> AnswerBody<S> {
    /// Encode one delivery into `pending`.
    fn take(&mut self, delivery: Delivery) {
        match delivery {
            Delivery::Event(ev) => {
                self.encoder
                    .event(&ev, iop_transport::clock::unix_ms(), &mut self.pending);
            }
            Delivery::Finish => {
                self.record.set("ok");
                self.encoder.closing(&mut self.pending);
                self.done = true;
            }
            Delivery::Fail { kind, .. } => {
                let err = ApiError::from_gate_failure(kind);
                self.record.error(&err);
                self.encoder.failure(&err, &mut self.pending);
                self.done = true;
            }
            _ => {}
        }
    }

    /// The next body chunk: every frame due from the next delivery and from
    /// the deliveries already waiting behind it (bounded), or a keep-alive
    /// comment; `None` once the run ended.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if self.done {
                return None;
            }
            let delivery = match S::KEEP_ALIVE {
                None => self.rx.recv().await,
                Some(comment) => {
                    match tokio::time::timeout_at(self.keep_alive_at, self.rx.recv()).await {
                        Ok(delivery) => delivery,
                        Err(_) => {
                            // From now, as axum's keep-alive: a body not
                            // polled for a while gets one comment, not a
                            // burst of them.
                            self.keep_alive_at =
                                tokio::time::Instant::now() + framing::SSE_KEEP_ALIVE_INTERVAL;
                            return Some(Bytes::from_static(comment));
                        }
                    }
                }
            };
            self.take(delivery?);
            // Deliveries already queued go out in the same chunk: nothing
            // waits for them, and the body is written once instead of once
            // per delivery.
            let mut taken = 1;
            while !self.done
                && taken < MAX_DELIVERIES_PER_CHUNK
                && self.pending.len() < MAX_CHUNK_BYTES
            {
                let Ok(delivery) = self.rx.try_recv() else {
                    break;
                };
                self.take(delivery);
                taken += 1;
            }
            if self.pending.is_empty() {
                continue;
            }
            self.keep_alive_at = tokio::time::Instant::now() + framing::SSE_KEEP_ALIVE_INTERVAL;
            let capacity = self
                .pending
                .len()
                .clamp(MIN_CHUNK_CAPACITY, MAX_CHUNK_BYTES);
            let chunk = std::mem::replace(&mut self.pending, Vec::with_capacity(capacity));
            self.record.relayed_bytes += chunk.len() as u64;
            return Some(Bytes::from(chunk));
        }
    }
}

/// The body of a streamed answer until the run's terminal: the opening
/// frames go with the first delivery's.
fn answer_body<S: AnswerStream>(
    rx: mpsc::Receiver<Delivery>,
    record: RequestRecord,
    mut encoder: S,
) -> BoxStream<'static, Bytes> {
    let mut pending = Vec::with_capacity(MIN_CHUNK_CAPACITY);
    encoder.opening(&mut pending);
    let body = AnswerBody {
        rx,
        encoder,
        record,
        pending,
        done: false,
        keep_alive_at: tokio::time::Instant::now() + framing::SSE_KEEP_ALIVE_INTERVAL,
    };
    futures::stream::unfold(body, |mut body| async move {
        let chunk = body.next_chunk().await?;
        Some((chunk, body))
    })
    .boxed()
}

pub(crate) use iop_core::edge::whole_answer::MAX_WHOLE_ANSWER_BYTES;

/// Fold a non-streaming answer until the run ends: its JSON, or the error
/// to answer. Past `max_bytes` of text and tool calls the run is abandoned
/// (dropping the receiver cancels it).
async fn whole_answer<W: WholeAnswer>(
    rx: &mut mpsc::Receiver<Delivery>,
    mut whole: W,
    max_bytes: usize,
) -> Result<serde_json::Value, ApiError> {
    let mut budget = WholeAnswerBudget::new(max_bytes);
    while let Some(d) = rx.recv().await {
        match d {
            Delivery::Event(ev) => {
                budget
                    .add(&ev)
                    .map_err(|e| ApiError::answer_too_large(e.limit_bytes))?;
                whole.event(&ev)
            }
            Delivery::Finish => return whole.answer(iop_transport::clock::unix_ms()),
            Delivery::Fail { kind, .. } => return Err(ApiError::from_gate_failure(kind)),
            _ => {}
        }
    }
    Err(ApiError::internal())
}

async fn list_models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    match listed_models(&state, &headers) {
        Ok(names) => axum::Json(models::models_list_json(&names, unix_now())).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn ollama_tags(State(state): State<AppState>, headers: HeaderMap) -> Response {
    match listed_models(&state, &headers) {
        Ok(names) => axum::Json(ollama::tags_json(&names)).into_response(),
        Err(e) => OllamaError(e).into_response(),
    }
}

/// The models the caller's key may use, in listing order: the configured
/// routes, then the models discovering providers report now.
fn listed_models(state: &AppState, headers: &HeaderMap) -> Result<Vec<String>, ApiError> {
    let key = authenticate(state, headers)?;
    let mut names: Vec<String> = state
        .config
        .listed_models()
        .filter(|m| key.allows(m))
        .map(str::to_owned)
        .collect();
    for discovered in state.hub.catalog().listed() {
        let Some(model) = state.config.model_names.client_name(&discovered) else {
            continue;
        };
        if !names.iter().any(|n| n == model)
            && key.allows(model)
            && routed_pool(state, model).is_some_and(|pool| !pool.is_empty())
        {
            names.push(model.to_owned());
        }
    }
    Ok(names)
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
pub(crate) struct RequestRecord {
    metrics: Arc<EdgeMetrics>,
    route: &'static str,
    started: std::time::Instant,
    outcome: &'static str,
    /// The request body's share of the budget (R-LIM-2).
    pub(crate) body_permit: Option<BodyPermit>,
    /// The request's span (`edge.request`), ended with the record.
    pub(crate) span: iop_transport::traces::TraceSpan,
    /// Response body bytes streamed to the client.
    pub(crate) relayed_bytes: u64,
}

impl RequestRecord {
    pub(crate) fn new(state: &AppState, route: &'static str, headers: &HeaderMap) -> Self {
        Self {
            metrics: state.metrics.clone(),
            route,
            started: std::time::Instant::now(),
            outcome: "client_disconnected",
            body_permit: None,
            span: crate::observe::start_request(&state.metrics, route, headers),
            relayed_bytes: 0,
        }
    }

    pub(crate) fn set(&mut self, outcome: &'static str) {
        self.outcome = outcome;
    }

    pub(crate) fn error(&mut self, err: &ApiError) {
        self.outcome = outcome_of(err);
    }
}

impl Drop for RequestRecord {
    fn drop(&mut self) {
        self.metrics
            .request(self.route, self.outcome, self.started.elapsed());
        self.metrics.relayed(self.route, self.relayed_bytes);
        crate::observe::finish_request(&self.span, self.outcome, self.relayed_bytes);
    }
}

/// The closed outcome class of an error.
fn outcome_of(err: &ApiError) -> &'static str {
    if err.code == Some(CLIENT_CLOSED_CODE) {
        // The client went away mid-body: not a bad request (R-LIM-2).
        return "client_disconnected";
    }
    match err.status {
        400 | 408 | 413 | 422 => "invalid_request",
        401 | 403 => "unauthorized",
        404 => "not_found",
        429 => "rate_limited",
        502 => "provider_error",
        503 => "unavailable",
        504 => "timeout",
        _ => "internal",
    }
}

/// The caller's key, if it is an admin key.
fn authenticate_admin(state: &AppState, headers: &HeaderMap) -> Result<ApiKey, ApiError> {
    let key = authenticate(state, headers)?;
    if !key.admin {
        return Err(ApiError::permission_denied());
    }
    Ok(key)
}

async fn status(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = authenticate_admin(&state, &headers) {
        return e.into_response();
    }
    match state.hub.snapshot().await {
        Ok(snap) => axum::Json(crate::status::status_json(
            &state.config,
            &snap,
            &state.durable.status(),
        ))
        .into_response(),
        Err(_) => ApiError::internal().into_response(),
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
    let key = match authenticate_admin(&state, &headers) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    match state.ctx.creds.revoke(&profile) {
        Ok(true) => {}
        Ok(false) => return ApiError::not_found("credential profile").into_response(),
        Err(e) => {
            // Inactive in this process already; the record for the next
            // start is missing: the operator must know.
            tracing::error!(event = "edge_credential_revocation_not_persisted", profile = %profile, error = %e);
            state.hub.refresh_credentials();
            return ApiError::internal().into_response();
        }
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
    // After commit a failure must not look like a complete answer
    // (R-GATE-3): an event stream gets one in-stream error event in its own
    // format, any other body is cut off (the client sees an incomplete
    // message, never a clean end).
    let content_type = headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        .map(|(_, value)| value.to_ascii_lowercase())
        .unwrap_or_default();
    let framing = if content_type.starts_with("text/event-stream") {
        TunnelFraming::Sse
    } else if content_type.starts_with("application/x-ndjson") {
        TunnelFraming::Ndjson
    } else {
        TunnelFraming::Opaque
    };
    let body = futures::stream::unfold(Some((rx, record)), move |state| async move {
        let (mut rx, mut record) = state?;
        loop {
            let err = match rx.recv().await {
                Some(Delivery::Body(bytes)) => {
                    record.relayed_bytes += bytes.len() as u64;
                    return Some((Ok(bytes::Bytes::from(bytes)), Some((rx, record))));
                }
                Some(Delivery::Finish) => {
                    record.set("ok");
                    return None;
                }
                Some(Delivery::Fail { kind, .. }) => ApiError::from_gate_failure(kind),
                Some(_) => continue,
                // The driver ended without a terminal.
                None => ApiError::internal(),
            };
            record.error(&err);
            let item = match framing {
                TunnelFraming::Sse => Ok(bytes::Bytes::from(format!(
                    "\n\ndata: {}\n\n",
                    err.to_json()
                ))),
                TunnelFraming::Ndjson => {
                    Ok(bytes::Bytes::from(format!("\n{}\n", err.to_ollama_json())))
                }
                TunnelFraming::Opaque => Err(std::io::Error::other(
                    "provider response failed after commit",
                )),
            };
            return Some((item, None));
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

#[cfg(test)]
mod tests {
    use iop_transport::telemetry::MetricsPipeline;
    use iop_wire::{FinishReason, RunApi, RunEventKind};

    use super::*;
    use crate::api::chat::ChatStream;
    use crate::api::framing::parse_sse;
    use crate::api::ollama::OllamaStream;

    fn record() -> RequestRecord {
        RequestRecord {
            metrics: EdgeMetrics::new(MetricsPipeline::prometheus_only("iop-edge")),
            route: "chat",
            started: std::time::Instant::now(),
            outcome: "client_disconnected",
            body_permit: None,
            span: iop_transport::traces::TraceSpan::none(),
            relayed_bytes: 0,
        }
    }

    fn text(s: &str) -> Delivery {
        Delivery::Event(RunEventKind::TextDelta(s.into()))
    }

    #[tokio::test]
    async fn deliveries_already_waiting_share_one_body_chunk_up_to_the_bound() {
        let (tx, rx) = mpsc::channel(2 * MAX_DELIVERIES_PER_CHUNK);
        for _ in 0..MAX_DELIVERIES_PER_CHUNK + 3 {
            tx.send(text("x")).await.unwrap();
        }
        let mut body = answer_body(rx, record(), ChatStream::new("c", "m", 1));
        let first = body.next().await.unwrap();
        // The role chunk, then one chunk per delivery taken.
        assert_eq!(parse_sse(&first).len(), 1 + MAX_DELIVERIES_PER_CHUNK);
        tx.send(Delivery::Event(RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: None,
        }))
        .await
        .unwrap();
        tx.send(Delivery::Finish).await.unwrap();
        let rest = body.next().await.unwrap();
        let rest = parse_sse(&rest);
        assert_eq!(rest.len(), 3 + 1 + 1, "3 texts, the finish chunk, [DONE]");
        assert_eq!(rest.last().unwrap().1, "[DONE]");
        assert!(body.next().await.is_none());
    }

    #[tokio::test]
    async fn a_chunk_stops_taking_waiting_deliveries_past_its_byte_bound() {
        let (tx, rx) = mpsc::channel(8);
        let big = "y".repeat(MAX_CHUNK_BYTES / 2);
        for _ in 0..3 {
            tx.send(text(&big)).await.unwrap();
        }
        let mut body = answer_body(rx, record(), ChatStream::new("c", "m", 1));
        let first = body.next().await.unwrap();
        assert!(first.len() > MAX_CHUNK_BYTES);
        assert_eq!(
            parse_sse(&first).len(),
            1 + 2,
            "the role chunk and two texts"
        );
        assert_eq!(parse_sse(&body.next().await.unwrap()).len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_sse_stream_gets_a_keep_alive_comment_each_interval() {
        let (tx, rx) = mpsc::channel(8);
        let start = tokio::time::Instant::now();
        let mut body = answer_body(rx, record(), ChatStream::new("c", "m", 1));
        assert_eq!(&body.next().await.unwrap()[..], framing::SSE_KEEP_ALIVE);
        assert_eq!(start.elapsed(), framing::SSE_KEEP_ALIVE_INTERVAL);
        tx.send(text("x")).await.unwrap();
        assert_eq!(parse_sse(&body.next().await.unwrap()).len(), 2);
        // The interval counts from the last chunk sent.
        tokio::time::advance(framing::SSE_KEEP_ALIVE_INTERVAL / 2).await;
        tx.send(text("y")).await.unwrap();
        assert_eq!(parse_sse(&body.next().await.unwrap()).len(), 1);
        let sent = tokio::time::Instant::now();
        assert_eq!(&body.next().await.unwrap()[..], framing::SSE_KEEP_ALIVE);
        assert_eq!(sent.elapsed(), framing::SSE_KEEP_ALIVE_INTERVAL);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_polled_late_gets_one_keep_alive_comment_not_a_burst() {
        let (_tx, rx) = mpsc::channel::<Delivery>(8);
        let mut body = answer_body(rx, record(), ChatStream::new("c", "m", 1));
        // The client reads nothing for four intervals.
        tokio::time::advance(4 * framing::SSE_KEEP_ALIVE_INTERVAL).await;
        assert_eq!(&body.next().await.unwrap()[..], framing::SSE_KEEP_ALIVE);
        let sent = tokio::time::Instant::now();
        assert_eq!(&body.next().await.unwrap()[..], framing::SSE_KEEP_ALIVE);
        assert_eq!(sent.elapsed(), framing::SSE_KEEP_ALIVE_INTERVAL);
    }

    #[tokio::test(start_paused = true)]
    async fn an_ndjson_stream_has_no_keep_alive() {
        let (_tx, rx) = mpsc::channel(8);
        let mut body = answer_body(rx, record(), OllamaStream::new("m", RunApi::Chat, 0));
        let silent = tokio::time::timeout(10 * framing::SSE_KEEP_ALIVE_INTERVAL, body.next()).await;
        assert!(silent.is_err(), "nothing is sent on a silent NDJSON stream");
    }

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

    #[test]
    fn a_bearer_token_is_read_with_any_scheme_case_and_trimmed() {
        for value in ["Bearer k1", "bearer k1", "BEARER  k1 ", " Bearer k1\t"] {
            assert_eq!(bearer_token(value), Some("k1"), "{value:?}");
        }
        for value in ["Basic k1", "Bearer", "Bearer   ", "Bearerk1", "k1"] {
            assert_eq!(bearer_token(value), None, "{value:?}");
        }
    }

    #[tokio::test]
    async fn a_whole_answer_past_its_bound_is_refused_not_accumulated() {
        // R-LIM-3: a non-streaming answer's text and tool arguments are
        // bounded before the Edge builds it in memory.
        use crate::api::endpoint::{AnswerStart, ChatCompletions, ChatOptions, RunEndpoint as _};
        let start = || AnswerStart {
            model: "m".into(),
            id_seed: 1,
            admitted_unix_ms: 0,
            committed_unix: 0,
        };
        let (tx, mut rx) = mpsc::channel(8);
        tx.send(text("12345")).await.unwrap();
        tx.send(text("678")).await.unwrap();
        let err = whole_answer(
            &mut rx,
            ChatCompletions.whole(
                start(),
                ChatOptions {
                    include_usage: false,
                    store: false,
                },
            ),
            7,
        )
        .await
        .unwrap_err();
        assert_eq!((err.status, err.code), (502, Some("response_too_large")));
        let (tx, mut rx) = mpsc::channel(8);
        tx.send(text("1234567")).await.unwrap();
        tx.send(Delivery::Event(RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: None,
        }))
        .await
        .unwrap();
        tx.send(Delivery::Finish).await.unwrap();
        let answer = whole_answer(
            &mut rx,
            ChatCompletions.whole(
                start(),
                ChatOptions {
                    include_usage: false,
                    store: false,
                },
            ),
            7,
        )
        .await
        .unwrap();
        assert_eq!(answer["choices"][0]["message"]["content"], "1234567");
    }

    #[tokio::test]
    async fn events_that_write_nothing_send_no_chunk_and_a_closed_channel_ends_the_body() {
        let (tx, rx) = mpsc::channel(8);
        tx.send(Delivery::Event(RunEventKind::Started {
            session_id: "s".into(),
        }))
        .await
        .unwrap();
        drop(tx);
        let mut body = answer_body(rx, record(), OllamaStream::new("m", RunApi::Chat, 0));
        assert!(body.next().await.is_none());
    }
}
