//! The client-facing HTTP server: the OpenAI API (`/v1/chat/completions`,
//! `/v1/responses`, `/v1/models`), the Anthropic Messages API
//! (`/v1/messages`, `/v1/messages/count_tokens`), the Ollama API
//! (`/api/chat`, `/api/generate`, `/api/tags`) and the operator surface
//! (`/status`, `/healthz`, `/metrics`, the console at `/console`).
//!
//! Handlers authenticate, parse and validate, then hand the request to a
//! [`crate::driver`] (a non-streamed answer's driven on the connection's own
//! task, a streamed one's on a task of its own) and turn its deliveries into the API's own wire
//! format. Every error is the API's own error JSON. The four run endpoints
//! are one pipeline, `run_endpoint`, told apart only by their
//! [`RunEndpoint`] (see [`crate::api::endpoint`]).

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use iop_core::edge::whole_answer::WholeAnswerBudget;
use iop_wire::RunApi;
use std::sync::Arc;
use tokio::sync::mpsc;

use crate::admit::{admit, routed_pool};
use crate::answer_body::answer_body;
use crate::api::endpoint::{
    AnswerJson, AnswerStart, AnswerStream, ChatCompletions, Completions, Embeddings, Messages,
    Ollama, OllamaEmbed, Responses, RunEndpoint, WholeAnswer,
};
use crate::api::{ApiError, OllamaError, messages, models, ollama};
use crate::app_state::{AppState, authenticate, authenticate_admin, authenticate_x_api_key};
use crate::driver::{self, Delivery, TunnelApi, TunnelBody, Work};
use crate::in_flight::RequestView;
use crate::request_body::BodyError;
use crate::request_record::RequestRecord;

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
        .route("/v1/messages", post(create_message))
        .route("/v1/messages/count_tokens", post(count_message_tokens))
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
        .merge(crate::admin::routes())
        .merge(crate::console::routes())
        .fallback(|| async { ApiError::not_found("route").into_response() })
        .with_state(state)
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

/// A request's deliveries: from its driver's own task (a streamed answer),
/// or from its driver driven right here, on the client connection's task
/// (a non-streamed answer: no task hand-off on its way, issue 42).
enum Deliveries {
    /// A spawned driver's.
    Task(mpsc::Receiver<Delivery>),
    /// An inline driver's (dropped, the driver goes on alone and hears
    /// the client's disconnect, R-GATE-4).
    Inline(driver::InlineRun),
}

impl Deliveries {
    async fn recv(&mut self) -> Option<Delivery> {
        match self {
            Deliveries::Task(rx) => rx.recv().await,
            Deliveries::Inline(run) => run.recv().await,
        }
    }

    /// The rest of the deliveries on a receiver, an inline driver going on
    /// on a task of its own (a body the client reads at its own pace).
    fn into_receiver(self) -> mpsc::Receiver<Delivery> {
        match self {
            Deliveries::Task(rx) => rx,
            Deliveries::Inline(run) => run.detach(),
        }
    }
}

/// Wait for the driver's first delivery: the commit or the one error.
async fn first(rx: &mut Deliveries) -> Result<Option<(u16, Vec<iop_wire::Header>)>, ApiError> {
    match rx.recv().await {
        Some(Delivery::Commit { tunnel_head }) => Ok(tunnel_head),
        Some(Delivery::Fail { kind, provider, .. }) => {
            Err(ApiError::from_gate_failure_with(kind, provider.as_ref()))
        }
        Some(other) => {
            tracing::error!(event = "edge_driver_protocol_bug", delivery = ?other);
            Err(ApiError::internal())
        }
        None => Err(ApiError::internal()),
    }
}

fn tunnel_body(
    api: TunnelApi,
    path: &str,
    body: &[u8],
    passed: Vec<iop_wire::Header>,
) -> TunnelBody {
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    headers.extend(passed);
    TunnelBody {
        api,
        path: path.to_owned(),
        headers,
        body: body.to_vec(),
    }
}

/// The headers of `names` the client sent, for a tunnel-mode provider
/// ([`RunEndpoint::TUNNELLED_HEADERS`]): visible ASCII values of at most
/// [`iop_wire::MAX_HEADER_BYTES`], the first of each name.
fn tunnelled_headers(headers: &axum::http::HeaderMap, names: &[&str]) -> Vec<iop_wire::Header> {
    names
        .iter()
        .filter_map(|name| {
            let value = headers.get(*name)?.to_str().ok()?;
            (name.len() + value.len() <= iop_wire::MAX_HEADER_BYTES)
                .then(|| ((*name).to_owned(), value.to_owned()))
        })
        .collect()
}

fn unix_now() -> u64 {
    iop_transport::clock::unix_ms() / 1000
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

async fn create_message(State(state): State<AppState>, request: Request) -> Response {
    run_endpoint(state, request, Messages).await
}

/// `POST /v1/messages/count_tokens`: the prompt's estimated tokens
/// (`iop_core::edge::prompt_estimate`), for a model the key may use; no
/// provider is called.
async fn count_message_tokens(State(state): State<AppState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let answer = async {
        let key = authenticate_x_api_key(&state, &parts.headers)?;
        // Through the body budget like every request body (R-LIM-2).
        let held = state
            .bodies()
            .read(&key.principal, &parts.headers, body)
            .await
            .map_err(BodyError::to_api_error)?;
        let run = messages::parse_count_tokens_request(&held.bytes)?;
        if !key.allows(&run.model) || routed_pool(&state, &run.model).is_none() {
            return Err(ApiError::model_not_found(&run.model));
        }
        let tokens = iop_core::edge::prompt_estimate::prompt_tokens(&run.messages, &run.tools);
        Ok(serde_json::json!({ "input_tokens": tokens }))
    }
    .await;
    match answer {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => messages::MessagesError(e).into_response(),
    }
}

/// `POST /api/show`: what the Edge knows of a routable model (its
/// providers' kinds); 404 for a model the key cannot use.
async fn ollama_show(State(state): State<AppState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let answer = async {
        let key = authenticate(&state, &parts.headers)?;
        // Through the body budget like every request body (R-LIM-2).
        let held = state
            .bodies()
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
            .filter_map(|id| state.config().provider(id))
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
/// between the APIs (see [`crate::api::endpoint`]). An admitted request's
/// answer carries its tenant's `x-ratelimit-*` headers (R-TEN-1); every
/// answer carries its `Server-Timing` ([`crate::server_timing`]).
async fn run_endpoint<E: RunEndpoint>(state: AppState, request: Request, endpoint: E) -> Response {
    let started = std::time::Instant::now();
    let mut rate = None;
    let mut view = None;
    let mut response = run_admitted(state, request, endpoint, &mut rate, &mut view).await;
    if let Some(rate) = rate {
        crate::tenancy::RateHeaders::apply(&rate, response.headers_mut());
    }
    crate::server_timing::apply(started, view.as_deref(), response.headers_mut());
    response
}

async fn run_admitted<E: RunEndpoint>(
    state: AppState,
    request: Request,
    endpoint: E,
    rate: &mut Option<crate::tenancy::RateHeaders>,
    view: &mut Option<Arc<RequestView>>,
) -> Response {
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
    // A repeated durable request resumes its stream after this event (an
    // id that is not one replays the whole stream).
    let resume_after = crate::stored::last_event_id(request.headers())
        .ok()
        .flatten();
    let passed = tunnelled_headers(request.headers(), E::TUNNELLED_HEADERS);
    let mut admitted = match admit(&state, request, &endpoint, idempotency.is_some()).await {
        Ok(admitted) => admitted,
        Err(e) => return refuse(record, e),
    };
    *rate = admitted.tenant.as_ref().map(|t| t.headers);
    let run_view = RequestView::since(
        route,
        &admitted.run.model,
        admitted.run.stream,
        record.started(),
    );
    record.view = Some(run_view.clone());
    *view = Some(run_view.clone());
    // A continued conversation: the stored response's messages go between
    // this request's instructions and its input (a durable request stores
    // only its own body and the id it continues, R-LIM-6).
    // Boxed, as the durable path below: their futures are large, and inline
    // they would be part of every request's future, which is moved
    // several times on its way to its task (issue 42).
    if let Some(previous) = endpoint.previous_response(&admitted.options) {
        match Box::pin(crate::stored::history(&state, &admitted.key, &previous)).await {
            Ok(messages) => crate::stored::continue_conversation(
                &mut admitted.run.messages,
                endpoint.instruction_messages(&admitted.options),
                messages,
            ),
            Err(e) => return refuse(record, e),
        }
    }
    // SPEC §6: kept (`store`, `background`) or idempotent requests are
    // durable.
    let keep = endpoint.keep(&admitted.options, state.durable().responses_store_default());
    if keep.store || keep.background || idempotency.is_some() {
        return Box::pin(crate::stored::run_durable(
            &state,
            endpoint,
            admitted,
            keep,
            idempotency,
            resume_after,
            record,
            run_view,
        ))
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
        tunnel: Some(tunnel_body(tunnel_api, tunnel_path, tunnelled, passed)),
        route,
        principal: admitted.key.principal.clone(),
        trace_context: record.span.context(),
        continuation: iop_core::edge::request::continuation_allowed(
            run.api,
            state.config().continuation_for(&run.model),
        ),
        tenant: admitted.tenant,
        view: Some(run_view),
    };
    // A non-streamed answer's driver runs on this task (issue 42); a
    // streamed one's on its own, so its timers and its write timeout
    // (R-LIM-4) never wait for the client's reads.
    let ctx = state.driver_context().clone();
    let mut rx = if run.stream {
        Deliveries::Task(driver::spawn(ctx, admitted.pool, work))
    } else {
        Deliveries::Inline(driver::inline(ctx, admitted.pool, work))
    };
    let first = first(&mut rx).await;
    if first.is_ok() {
        record.span.event("committed", &[]);
    }
    match first {
        Err(e) => return refuse(record, e),
        // A tunnel-mode provider answered in its own format.
        Ok(Some((status, headers))) => {
            return tunnel_response(status, headers, rx, record).await;
        }
        Ok(None) => {}
    }
    let start = AnswerStart {
        model: run.model,
        id_seed: state.next_id(),
        admitted_unix_ms,
        committed_unix: unix_now(),
    };
    if run.stream {
        E::Stream::response(answer_body(
            rx.into_receiver(),
            endpoint.stream(start, options),
            None,
            state.driver_context().sse_keep_alive,
            record,
        ))
    } else {
        match whole_answer(
            &mut rx,
            endpoint.whole(start, options),
            MAX_WHOLE_ANSWER_BYTES,
        )
        .await
        {
            Ok(answer) => {
                record.set("ok");
                answer.into_response()
            }
            Err(e) => refuse(record, e),
        }
    }
}

pub(crate) use iop_core::edge::whole_answer::MAX_WHOLE_ANSWER_BYTES;

/// Fold a non-streaming answer until the run ends: its JSON, or the error
/// to answer. Past `max_bytes` of text and tool calls the run is abandoned
/// (dropping the receiver cancels it).
async fn whole_answer<W: WholeAnswer>(
    rx: &mut Deliveries,
    mut whole: W,
    max_bytes: usize,
) -> Result<AnswerJson, ApiError> {
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
            Delivery::Fail { kind, provider, .. } => {
                return Err(ApiError::from_gate_failure_with(kind, provider.as_ref()));
            }
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
        .config()
        .listed_models()
        .filter(|m| key.allows(m))
        .map(str::to_owned)
        .collect();
    for discovered in state.hub().catalog().listed() {
        let Some(model) = state.config().model_names.client_name(&discovered) else {
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

/// `/metrics` on the client listener: absent when `[edge]
/// metrics_listen` serves it elsewhere, an admin key's when
/// `metrics_require_admin`.
async fn metrics_text(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if state.config().edge.metrics_listen.is_some() {
        return ApiError::not_found("route").into_response();
    }
    metrics_answer(&state, &headers)
}

/// The router of `[edge] metrics_listen`: `/metrics` alone.
pub fn metrics_router(state: AppState) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(
                |State(state): State<AppState>, headers: HeaderMap| async move {
                    metrics_answer(&state, &headers)
                },
            ),
        )
        .fallback(|| async { ApiError::not_found("route").into_response() })
        .with_state(state)
}

fn metrics_answer(state: &AppState, headers: &HeaderMap) -> Response {
    if state.config().edge.metrics_require_admin
        && let Err(e) = authenticate_admin(state, headers)
    {
        return e.into_response();
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics().render(),
    )
        .into_response()
}

async fn status(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = authenticate_admin(&state, &headers) {
        return e.into_response();
    }
    match crate::status::gather(&state).await {
        Ok(doc) => axum::Json(doc).into_response(),
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
    match state.driver_context().creds.revoke(&profile) {
        Ok(true) => {}
        Ok(false) => return ApiError::not_found("credential profile").into_response(),
        Err(e) => {
            // Inactive in this process already; the record for the next
            // start is missing: the operator must know.
            tracing::error!(event = "edge_credential_revocation_not_persisted", profile = %profile, error = %e);
            state.hub().refresh_credentials();
            return ApiError::internal().into_response();
        }
    }
    tracing::warn!(event = "edge_credential_revoked", profile = %profile, by = %key.principal);
    state.hub().refresh_credentials();
    axum::Json(serde_json::json!({ "profile": profile, "active": false })).into_response()
}

// A tunnelled answer of an inline driver up to this many bytes is
// collected on the client's task and sent whole; past it, the driver goes
// on on a task of its own and the rest is streamed (R-LIM-3).
use iop_core::edge::whole_answer::MAX_COLLECTED_TUNNEL_BYTES;

/// A tunnelled response: the provider's status and headers, then its body.
async fn tunnel_response(
    status: u16,
    headers: Vec<iop_wire::Header>,
    deliveries: Deliveries,
    mut record: RequestRecord,
) -> Response {
    // An inline driver's answer (non-streamed) is taken here while it is
    // small: sent whole when it ends, no task started for it.
    let mut collected = std::collections::VecDeque::new();
    let rx = match deliveries {
        Deliveries::Inline(mut run) => {
            let mut bytes = 0;
            while bytes <= MAX_COLLECTED_TUNNEL_BYTES {
                match run.recv().await {
                    Some(Delivery::Body(body)) => {
                        bytes += body.len();
                        collected.push_back(Delivery::Body(body));
                    }
                    Some(Delivery::Finish) => {
                        let mut whole = Vec::with_capacity(bytes);
                        for d in collected {
                            if let Delivery::Body(body) = d {
                                whole.extend_from_slice(&body);
                            }
                        }
                        record.relayed_bytes += whole.len() as u64;
                        record.set("ok");
                        return tunnel_head(status, headers)
                            .body(Body::from(whole))
                            .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response());
                    }
                    // After commit: framed below like any failure.
                    Some(fail @ Delivery::Fail { .. }) => {
                        collected.push_back(fail);
                        break;
                    }
                    None => break,
                    Some(_) => {}
                }
            }
            run.detach()
        }
        Deliveries::Task(rx) => rx,
    };
    tunnel_stream_response(status, headers, collected, rx, record)
}

/// The head of a tunnelled response: the provider's status and headers
/// (less the framing ones, which are this connection's).
fn tunnel_head(status: u16, headers: Vec<iop_wire::Header>) -> axum::http::response::Builder {
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
}

/// A tunnelled response whose body is streamed: `collected` first, then
/// what `rx` brings.
fn tunnel_stream_response(
    status: u16,
    headers: Vec<iop_wire::Header>,
    collected: std::collections::VecDeque<Delivery>,
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
    let body = futures::stream::unfold(Some((collected, rx, record)), move |state| async move {
        let (mut collected, mut rx, mut record) = state?;
        loop {
            let next = match collected.pop_front() {
                Some(delivery) => Some(delivery),
                None => rx.recv().await,
            };
            let err = match next {
                Some(Delivery::Body(bytes)) => {
                    let chunk = with_waiting_bodies(bytes, &mut collected, &mut rx);
                    record.relayed_bytes += chunk.len() as u64;
                    return Some((Ok(bytes::Bytes::from(chunk)), Some((collected, rx, record))));
                }
                Some(Delivery::Finish) => {
                    record.set("ok");
                    return None;
                }
                Some(Delivery::Fail { kind, provider, .. }) => {
                    ApiError::from_gate_failure_with(kind, provider.as_ref())
                }
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
    tunnel_head(status, headers)
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
}

/// `first` and the body pieces already waiting behind it, in one body
/// chunk (bounded as a normalized answer's chunk): the client's connection
/// is written once for them, not once per provider read. A waiting
/// terminal stays first in `collected` for the next turn.
fn with_waiting_bodies(
    first: Vec<u8>,
    collected: &mut std::collections::VecDeque<Delivery>,
    rx: &mut mpsc::Receiver<Delivery>,
) -> Vec<u8> {
    use crate::answer_body::{MAX_CHUNK_BYTES, MAX_DELIVERIES_PER_CHUNK};
    let mut chunk = first;
    let mut taken = 1;
    while taken < MAX_DELIVERIES_PER_CHUNK && chunk.len() < MAX_CHUNK_BYTES {
        let waiting = match collected.pop_front() {
            Some(delivery) => delivery,
            None => match rx.try_recv() {
                Ok(delivery) => delivery,
                Err(_) => break,
            },
        };
        match waiting {
            Delivery::Body(more) => {
                chunk.extend_from_slice(&more);
                taken += 1;
            }
            other => {
                collected.push_front(other);
                break;
            }
        }
    }
    chunk
}

#[cfg(test)]
mod tests {
    use iop_wire::{FinishReason, RunEventKind};

    use super::*;

    fn text(s: &str) -> Delivery {
        Delivery::Event(RunEventKind::TextDelta(s.into()))
    }

    /// The size of the future `f` returns, without calling it.
    fn future_size<Args, F: Returns<Args>>(_: &F) -> usize {
        std::mem::size_of::<F::Fut>()
    }

    trait Returns<Args> {
        type Fut;
    }

    impl<A, B, Fut, F: Fn(A, B) -> Fut> Returns<(A, B)> for F {
        type Fut = Fut;
    }

    impl<A, B, C, D, G, H, I, J, Fut, F> Returns<(A, B, C, D, G, H, I, J)> for F
    where
        F: Fn(A, B, C, D, G, H, I, J) -> Fut,
    {
        type Fut = Fut;
    }

    /// Issue 42: every request's future is moved on its way to its task,
    /// so the durable path, which an ephemeral request never enters, is
    /// boxed rather than inlined into it: the handler's future stays
    /// smaller than the durable path's alone.
    #[test]
    fn a_run_handlers_future_does_not_carry_the_durable_path() {
        let durable = future_size::<
            (
                &'static AppState,
                ChatCompletions,
                crate::admit::Admitted<<ChatCompletions as RunEndpoint>::Options>,
                crate::api::endpoint::Keep,
                Option<String>,
                Option<u64>,
                RequestRecord,
                Arc<RequestView>,
            ),
            _,
        >(&crate::stored::run_durable::<ChatCompletions>);
        let handler = future_size::<(State<AppState>, Request), _>(&chat_completions);
        assert!(
            handler < durable,
            "chat_completions' future is {handler} bytes, the durable path's {durable}"
        );
    }

    #[test]
    fn waiting_tunnel_bodies_go_out_in_one_bounded_chunk() {
        use crate::answer_body::{MAX_CHUNK_BYTES, MAX_DELIVERIES_PER_CHUNK};
        use std::collections::VecDeque;
        let (tx, mut rx) = mpsc::channel(256);
        for piece in [&b"b"[..], b"c"] {
            tx.try_send(Delivery::Body(piece.to_vec())).unwrap();
        }
        tx.try_send(Delivery::Finish).unwrap();
        tx.try_send(Delivery::Body(b"after".to_vec())).unwrap();
        let mut collected = VecDeque::from([Delivery::Body(b"0".to_vec())]);
        let chunk = with_waiting_bodies(b"a".to_vec(), &mut collected, &mut rx);
        assert_eq!(chunk, b"a0bc");
        // The terminal waits for the next turn, first; nothing after it
        // was taken.
        assert!(matches!(collected.pop_front(), Some(Delivery::Finish)));
        assert!(collected.is_empty());
        assert!(matches!(rx.try_recv(), Ok(Delivery::Body(b)) if b == b"after"));

        // At most MAX_DELIVERIES_PER_CHUNK pieces a chunk ...
        for _ in 0..MAX_DELIVERIES_PER_CHUNK + 5 {
            tx.try_send(Delivery::Body(b"x".to_vec())).unwrap();
        }
        let chunk = with_waiting_bodies(b"x".to_vec(), &mut collected, &mut rx);
        assert_eq!(chunk.len(), MAX_DELIVERIES_PER_CHUNK);
        // ... and none taken once it holds MAX_CHUNK_BYTES.
        while rx.try_recv().is_ok() {}
        let big = vec![7u8; MAX_CHUNK_BYTES / 2 + 1];
        tx.try_send(Delivery::Body(big.clone())).unwrap();
        tx.try_send(Delivery::Body(big.clone())).unwrap();
        let chunk = with_waiting_bodies(big.clone(), &mut collected, &mut rx);
        assert_eq!(chunk.len(), 2 * big.len());
        assert!(rx.try_recv().is_ok(), "the third piece waits");
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
        let (tx, rx) = mpsc::channel(8);
        let mut rx = Deliveries::Task(rx);
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
        let (tx, rx) = mpsc::channel(8);
        let mut rx = Deliveries::Task(rx);
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
        let answer: serde_json::Value = serde_json::from_slice(answer.as_bytes()).unwrap();
        assert_eq!(answer["choices"][0]["message"]["content"], "1234567");
    }
}
