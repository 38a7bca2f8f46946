//! The mock over HTTP: OpenAI- and Ollama-compatible endpoints rendering the
//! script engine's steps, with request, probe, in-flight and disconnect
//! counters observable in process ([`MockServer`]) and at `GET /mock/stats`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use iop_wire::FinishReason;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::Notify;

use super::script::{MockPrompt, MockStep, continued_tokens, play};
use super::{DEFAULT_MODEL, MockScript, ProbeHealth, ScriptError};

const CREATED_AT: &str = "1970-01-01T00:00:00Z";
const DEFAULT_TOOL: &str = "mock_tool";

/// A snapshot of a mock's counters (also the `GET /mock/stats` body).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MockStats {
    /// Provider calls received (chat, generate, responses), 401s included.
    pub requests: u64,
    /// Health probes received (`/v1/models`, `/api/tags`).
    pub probes: u64,
    /// Provider calls being answered now.
    pub in_flight: u64,
    /// The most provider calls answered at once since the start (or the
    /// last reset).
    pub max_in_flight: u64,
    /// Provider calls the client abandoned before their answer ended.
    pub disconnects: u64,
    /// Provider calls that continue a partial answer (the conversation's
    /// final message is the assistant's, R-CONT-1); counted in `requests`
    /// too.
    #[serde(default)]
    pub continued: u64,
    /// Streamed chat calls the client abandoned before any text was sent
    /// (a gateway may send such a call again elsewhere, R-FAIL-1); counted
    /// in `disconnects` too.
    #[serde(default)]
    pub abandoned_before_text: u64,
    /// Images received in provider calls (OpenAI `image_url` parts,
    /// Messages `image` blocks, those in tool results included).
    #[serde(default)]
    pub images: u64,
    /// Documents received in provider calls (OpenAI `file` parts,
    /// Messages `document` blocks, those in tool results included).
    #[serde(default)]
    pub documents: u64,
    /// Provider calls that carried an `anthropic-beta` header.
    #[serde(default)]
    pub anthropic_beta: u64,
    /// TCP connections accepted (a client that keeps its connections
    /// makes few).
    #[serde(default)]
    pub connections: u64,
}

/// Shared counters; every change wakes [`MockCounters::changed`] waiters.
#[derive(Debug, Default)]
pub(crate) struct MockCounters {
    requests: AtomicU64,
    probes: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    disconnects: AtomicU64,
    continued: AtomicU64,
    abandoned_before_text: AtomicU64,
    images: AtomicU64,
    documents: AtomicU64,
    anthropic_beta: AtomicU64,
    connections: AtomicU64,
    /// Fresh chat calls (not continuations) per prompt, the last user
    /// message's text; at most [`PROMPTS_TRACKED`] prompts.
    fresh: Mutex<HashMap<String, FreshCalls>>,
    changed: Notify,
}

/// How many prompts [`MockServer::fresh_calls`] keeps apart (a bound on
/// the mock's memory; later prompts are not tracked).
const PROMPTS_TRACKED: usize = 16_384;

/// How many calls of one prompt [`FreshCalls::log`] keeps.
const STARTS_TRACKED: usize = 64;

/// Fresh chat calls (the prompt from scratch, not a continuation) of one
/// prompt, and how many of them the client cut before their answer ended
/// (with or without text out): a gateway may send a prompt fresh again only
/// after a fresh call of it failed (R-FAIL-1).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FreshCalls {
    /// Calls received.
    pub calls: u64,
    /// Calls abandoned by the client before their answer ended.
    pub cut: u64,
    /// The first 64 calls, in the order received (a test tells from them
    /// which faults came between two calls).
    pub log: Vec<FreshCall>,
}

/// One fresh call of a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreshCall {
    /// When it was received.
    pub at: std::time::Instant,
    /// Whether the client abandoned it before its answer ended.
    pub cut: bool,
}

impl MockCounters {
    fn bump(&self, counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    pub(crate) fn snapshot(&self) -> MockStats {
        MockStats {
            requests: self.requests.load(Ordering::SeqCst),
            probes: self.probes.load(Ordering::SeqCst),
            in_flight: self.in_flight.load(Ordering::SeqCst),
            max_in_flight: self.max_in_flight.load(Ordering::SeqCst),
            disconnects: self.disconnects.load(Ordering::SeqCst),
            continued: self.continued.load(Ordering::SeqCst),
            abandoned_before_text: self.abandoned_before_text.load(Ordering::SeqCst),
            images: self.images.load(Ordering::SeqCst),
            documents: self.documents.load(Ordering::SeqCst),
            anthropic_beta: self.anthropic_beta.load(Ordering::SeqCst),
            connections: self.connections.load(Ordering::SeqCst),
        }
    }

    fn reset(&self) {
        // `in_flight` is a gauge, not a count: it stays.
        self.requests.store(0, Ordering::SeqCst);
        self.probes.store(0, Ordering::SeqCst);
        self.disconnects.store(0, Ordering::SeqCst);
        self.continued.store(0, Ordering::SeqCst);
        self.fresh
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.abandoned_before_text.store(0, Ordering::SeqCst);
        self.images.store(0, Ordering::SeqCst);
        self.documents.store(0, Ordering::SeqCst);
        self.anthropic_beta.store(0, Ordering::SeqCst);
        self.connections.store(0, Ordering::SeqCst);
        self.max_in_flight
            .store(self.in_flight.load(Ordering::SeqCst), Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    async fn wait_for(&self, cond: impl Fn(&MockStats) -> bool) -> MockStats {
        loop {
            let mut notified = pin!(self.changed.notified());
            // Registered before the check, so no change is missed.
            notified.as_mut().enable();
            let stats = self.snapshot();
            if cond(&stats) {
                return stats;
            }
            notified.await;
        }
    }
}

/// Counts one provider call in flight; dropped before [`InFlight::finish`]
/// means the client went away.
pub(super) struct InFlight {
    counters: Arc<MockCounters>,
    finished: bool,
    /// `Some(sent)`: whether text went out is tracked for this call.
    text: Option<bool>,
    /// The prompt of a fresh chat call, tracked in [`FreshCalls`], and
    /// its place in the prompt's log (when it is kept there).
    prompt: Option<(String, Option<usize>)>,
}

impl InFlight {
    fn new(counters: &Arc<MockCounters>) -> Self {
        let now = counters.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        counters.max_in_flight.fetch_max(now, Ordering::SeqCst);
        counters.changed.notify_waiters();
        Self {
            counters: counters.clone(),
            finished: false,
            text: None,
            prompt: None,
        }
    }

    /// A fresh chat call of `prompt`: counted in [`FreshCalls`].
    pub(super) fn fresh(&mut self, prompt: &str) {
        let mut fresh = self
            .counters
            .fresh
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if fresh.len() >= PROMPTS_TRACKED && !fresh.contains_key(prompt) {
            return;
        }
        let calls = fresh.entry(prompt.to_owned()).or_default();
        calls.calls += 1;
        let place = (calls.log.len() < STARTS_TRACKED).then(|| {
            calls.log.push(FreshCall {
                at: std::time::Instant::now(),
                cut: false,
            });
            calls.log.len() - 1
        });
        self.prompt = Some((prompt.to_owned(), place));
    }

    pub(super) fn finish(&mut self) {
        self.finished = true;
    }

    /// Track whether this call sends text before it is abandoned.
    pub(super) fn track_text(&mut self) {
        self.text.get_or_insert(false);
    }

    /// Text went out.
    pub(super) fn text_sent(&mut self) {
        if self.text.is_some() {
            self.text = Some(true);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.counters.in_flight.fetch_sub(1, Ordering::SeqCst);
        if self.finished {
            self.counters.changed.notify_waiters();
        } else {
            if self.text == Some(false) {
                self.counters
                    .abandoned_before_text
                    .fetch_add(1, Ordering::SeqCst);
            }
            if let Some((prompt, place)) = &self.prompt
                && let Some(calls) = self
                    .counters
                    .fresh
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_mut(prompt)
            {
                calls.cut += 1;
                if let Some(call) = place.and_then(|i| calls.log.get_mut(i)) {
                    call.cut = true;
                }
            }
            self.counters.bump(&self.counters.disconnects);
        }
    }
}

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct MockState {
    defaults: Arc<MockScript>,
    pub(crate) counters: Arc<MockCounters>,
}

impl MockState {
    pub(crate) fn new(defaults: MockScript) -> Self {
        Self {
            defaults: Arc::new(defaults),
            counters: Arc::default(),
        }
    }
}

/// Which APIs a mock serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MockApis {
    /// Every API: OpenAI's, Ollama's and Anthropic's Messages API.
    #[default]
    All,
    /// Only Anthropic's Messages API (`POST /v1/messages`, `GET
    /// /v1/models` in Anthropic's shape, the key in `x-api-key`), as
    /// Anthropic's own server: any other call is a 404.
    MessagesOnly,
}

/// The mock's routes, for every API.
pub(crate) fn router(state: MockState) -> Router {
    router_for(state, MockApis::All)
}

/// The mock's routes for `apis`.
pub(crate) fn router_for(state: MockState, apis: MockApis) -> Router {
    let counters = Router::new()
        .route("/mock/stats", get(stats))
        .route("/mock/reset", post(reset));
    if apis == MockApis::MessagesOnly {
        return counters
            .route("/v1/messages", post(super::messages::messages))
            .route("/v1/models", get(anthropic_models))
            .with_state(state);
    }
    counters
        .route("/v1/messages", post(super::messages::messages))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(openai_models))
        .route("/v1/embeddings", post(embeddings))
        .route("/api/embed", post(ollama_embed))
        .route("/api/chat", post(ollama_chat))
        .route("/api/generate", post(ollama_generate))
        .route("/api/tags", get(ollama_tags))
        .with_state(state)
}

/// `POST /v1/embeddings`: one [`super::mock_embedding`] per input, floats.
async fn embeddings(body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return (axum::http::StatusCode::BAD_REQUEST, "invalid JSON").into_response();
    };
    let inputs: Vec<String> = match &request["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .filter_map(|i| i.as_str().map(str::to_owned))
            .collect(),
        _ => return (axum::http::StatusCode::BAD_REQUEST, "input").into_response(),
    };
    let chars: usize = inputs.iter().map(|i| i.chars().count()).sum();
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            json!({"object": "embedding", "index": index, "embedding": super::mock_embedding(input)})
        })
        .collect();
    axum::Json(json!({
        "object": "list",
        "data": data,
        "model": request["model"],
        "usage": {"prompt_tokens": chars.div_ceil(4), "total_tokens": chars.div_ceil(4)},
    }))
    .into_response()
}

/// `POST /api/embed`: Ollama's shape of [`embeddings`].
async fn ollama_embed(body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return (axum::http::StatusCode::BAD_REQUEST, "invalid JSON").into_response();
    };
    let inputs: Vec<String> = match &request["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .filter_map(|i| i.as_str().map(str::to_owned))
            .collect(),
        _ => return (axum::http::StatusCode::BAD_REQUEST, "input").into_response(),
    };
    let chars: usize = inputs.iter().map(|i| i.chars().count()).sum();
    let embeddings: Vec<Vec<f32>> = inputs.iter().map(|i| super::mock_embedding(i)).collect();
    axum::Json(json!({
        "model": request["model"],
        "embeddings": embeddings,
        "prompt_eval_count": chars.div_ceil(4),
    }))
    .into_response()
}

/// Why the mock server could not start.
#[derive(Debug, thiserror::Error)]
pub enum MockServerError {
    /// The listener failed.
    #[error("mock listener: {0}")]
    Io(#[from] std::io::Error),
    /// The default script is out of range.
    #[error(transparent)]
    Script(#[from] ScriptError),
}

/// A running HTTP mock. Dropping it stops accepting connections.
#[derive(Debug)]
pub struct MockServer {
    addr: SocketAddr,
    counters: Arc<MockCounters>,
    task: tokio::task::JoinHandle<()>,
}

/// How [`serve_with`] sets up the connections it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeOptions {
    /// Set `TCP_NODELAY` on every accepted connection (the default). Off,
    /// Nagle's algorithm stays on, as it does by default in many real
    /// servers (axum's `serve`, cpp-httplib and so llama.cpp's server): a
    /// small write waits until the previous one is ACKed, which the
    /// client may delay (~40 ms on Linux).
    pub nodelay: bool,
    /// The APIs it serves (default: every one).
    pub apis: MockApis,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            nodelay: true,
            apis: MockApis::All,
        }
    }
}

/// Serve the mock on `listener` with `defaults` until the handle is dropped,
/// with `TCP_NODELAY` on every accepted connection.
pub async fn serve(
    listener: TcpListener,
    defaults: MockScript,
) -> Result<MockServer, MockServerError> {
    serve_with(listener, defaults, ServeOptions::default()).await
}

/// [`serve`] with `options`.
pub async fn serve_with(
    listener: TcpListener,
    defaults: MockScript,
    options: ServeOptions,
) -> Result<MockServer, MockServerError> {
    defaults.validate()?;
    let addr = listener.local_addr()?;
    let state = MockState::new(defaults);
    let counters = state.counters.clone();
    let app = router_for(state, options.apis);
    let nodelay = options.nodelay;
    let accepted = counters.clone();
    let task = tokio::spawn(async move {
        // Responses go out in several writes (SSE events, tunnel frames):
        // without TCP_NODELAY, Nagle holds each small write for the
        // client's delayed ACK (~40 ms). Set either way, so that off means
        // off whatever the listener passes on.
        let listener = axum::serve::ListenerExt::tap_io(listener, move |tcp| {
            let _ = tcp.set_nodelay(nodelay);
            accepted.bump(&accepted.connections);
        });
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(event = "mock_server_stopped", error = %e);
        }
    });
    Ok(MockServer {
        addr,
        counters,
        task,
    })
}

impl MockServer {
    /// Serve on an ephemeral loopback port (tests).
    pub async fn start(defaults: MockScript) -> Result<MockServer, MockServerError> {
        serve(TcpListener::bind("127.0.0.1:0").await?, defaults).await
    }

    /// Serve only Anthropic's Messages API ([`MockApis::MessagesOnly`]) on
    /// an ephemeral loopback port (tests).
    pub async fn start_messages_only(defaults: MockScript) -> Result<MockServer, MockServerError> {
        let options = ServeOptions {
            apis: MockApis::MessagesOnly,
            ..ServeOptions::default()
        };
        serve_with(TcpListener::bind("127.0.0.1:0").await?, defaults, options).await
    }

    /// The listen address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Provider calls received (not probes, not stats).
    pub fn requests(&self) -> u64 {
        self.stats().requests
    }

    /// Health probes received.
    pub fn probes(&self) -> u64 {
        self.stats().probes
    }

    /// Provider calls being answered now.
    pub fn in_flight(&self) -> u64 {
        self.stats().in_flight
    }

    /// The most provider calls answered at once.
    pub fn max_in_flight(&self) -> u64 {
        self.stats().max_in_flight
    }

    /// Provider calls the client abandoned.
    pub fn disconnects(&self) -> u64 {
        self.stats().disconnects
    }

    /// All counters at once.
    pub fn stats(&self) -> MockStats {
        self.counters.snapshot()
    }

    /// Fresh chat calls per prompt (the last user message's text), for
    /// counting which prompts a gateway sent from scratch more than once.
    pub fn fresh_calls(&self) -> HashMap<String, FreshCalls> {
        self.counters
            .fresh
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Zero `requests`, `probes` and `disconnects`; `max_in_flight` starts
    /// again from the calls in flight now.
    pub fn reset_counts(&self) {
        self.counters.reset();
    }

    /// Wait (unbounded: wrap it in a timeout) until the counters satisfy `cond`.
    pub async fn wait_for(&self, cond: impl Fn(&MockStats) -> bool) -> MockStats {
        self.counters.wait_for(cond).await
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Error bodies in each API's own format.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Dialect {
    OpenAi,
    Ollama,
    /// Anthropic's Messages API: its error shape, the key in `x-api-key`.
    Anthropic,
}

fn error_response(dialect: Dialect, status: u16, message: &str) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match dialect {
        Dialect::OpenAi => {
            let kind = if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            };
            json!({"error": {"message": message, "type": kind, "code": null}})
        }
        Dialect::Ollama => json!({"error": message}),
        Dialect::Anthropic => {
            let kind = match status.as_u16() {
                401 => "authentication_error",
                404 => "not_found_error",
                429 => "rate_limit_error",
                529 => "overloaded_error",
                400..=499 => "invalid_request_error",
                _ => "api_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": message}})
        }
    };
    (status, axum::Json(body)).into_response()
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

/// 401 unless the call brings the required key (`x-api-key` in the
/// Messages API, a bearer token elsewhere).
fn key_refusal(script: &MockScript, headers: &HeaderMap, dialect: Dialect) -> Option<Response> {
    let key = script.require_key.as_deref()?;
    let sent = match dialect {
        Dialect::Anthropic => headers.get("x-api-key").and_then(|v| v.to_str().ok()),
        Dialect::OpenAi | Dialect::Ollama => bearer(headers),
    };
    (sent != Some(key)).then(|| error_response(dialect, 401, "invalid api key"))
}

/// The checks before any answer: key, header hang, scripted error.
async fn gate(script: &MockScript, headers: &HeaderMap, dialect: Dialect) -> Option<Response> {
    if let Some(refusal) = key_refusal(script, headers, dialect) {
        return Some(refusal);
    }
    if script.hang_before_headers {
        futures::future::pending::<()>().await;
    }
    script
        .http_error
        .map(|status| error_response(dialect, status, "scripted mock error"))
}

/// Start one provider call: count it, parse it, run the gate.
pub(super) async fn begin(
    state: &MockState,
    headers: &HeaderMap,
    body: &[u8],
    dialect: Dialect,
) -> Result<(InFlight, Value, MockScript), Response> {
    state.counters.bump(&state.counters.requests);
    let mut guard = InFlight::new(&state.counters);
    let refuse = |guard: &mut InFlight, resp: Response| {
        guard.finish();
        resp
    };
    let Ok(request) = serde_json::from_slice::<Value>(body) else {
        return Err(refuse(
            &mut guard,
            error_response(dialect, 400, "invalid JSON body"),
        ));
    };
    let (images, documents) = attachments(&request["messages"]);
    let counters = &state.counters;
    counters.images.fetch_add(images, Ordering::SeqCst);
    counters.documents.fetch_add(documents, Ordering::SeqCst);
    if headers.contains_key("anthropic-beta") {
        counters.anthropic_beta.fetch_add(1, Ordering::SeqCst);
    }
    if dialect == Dialect::OpenAi
        && let Some(at) = tool_message_with_parts(&request["messages"])
    {
        // As the OpenAI API answers it.
        return Err(refuse(
            &mut guard,
            error_response(
                dialect,
                400,
                &format!("messages[{at}]: a tool message's content parts must be text"),
            ),
        ));
    }
    let model = request["model"].as_str().unwrap_or(DEFAULT_MODEL);
    let script = match state.defaults.for_model(model) {
        Ok(s) => s,
        Err(e) => {
            return Err(refuse(
                &mut guard,
                error_response(dialect, 400, &e.to_string()),
            ));
        }
    };
    if let Some(resp) = gate(&script, headers, dialect).await {
        return Err(refuse(&mut guard, resp));
    }
    Ok((guard, request, script))
}

/// The images and documents `messages` carry (either API's shape), those
/// inside Messages `tool_result` blocks included.
fn attachments(messages: &Value) -> (u64, u64) {
    fn walk(content: &Value, counts: &mut (u64, u64)) {
        for part in content.as_array().into_iter().flatten() {
            match part["type"].as_str() {
                Some("image" | "image_url") => counts.0 += 1,
                Some("document" | "file") => counts.1 += 1,
                Some("tool_result") => walk(&part["content"], counts),
                _ => {}
            }
        }
    }
    let mut counts = (0, 0);
    for m in messages.as_array().into_iter().flatten() {
        walk(&m["content"], &mut counts);
    }
    counts
}

/// The index of the first OpenAI tool message whose content has a part
/// other than text (the OpenAI API refuses it).
fn tool_message_with_parts(messages: &Value) -> Option<usize> {
    messages.as_array()?.iter().position(|m| {
        m["role"] == "tool"
            && m["content"]
                .as_array()
                .is_some_and(|parts| parts.iter().any(|p| p["type"] != "text"))
    })
}

fn model_of(request: &Value) -> String {
    request["model"]
        .as_str()
        .unwrap_or(DEFAULT_MODEL)
        .to_owned()
}

/// Characters of a content value: a string or an array of `{text}` parts.
pub(super) fn content_chars(content: &Value) -> usize {
    match content {
        Value::String(s) => s.chars().count(),
        Value::Array(parts) => parts
            .iter()
            .map(|p| p["text"].as_str().map_or(0, |t| t.chars().count()))
            .sum(),
        _ => 0,
    }
}

/// The text of the conversation's final message when it is the
/// assistant's (a partial answer to continue, R-CONT-1).
fn final_assistant(messages: &Value) -> Option<&str> {
    let last = messages.as_array()?.last()?;
    if last["role"] == "assistant" {
        last["content"].as_str()
    } else {
        None
    }
}

/// The text of the conversation's last message when it is the user's.
fn final_user(messages: &Value) -> Option<&str> {
    let last = messages.as_array()?.last()?;
    if last["role"] == "user" {
        last["content"].as_str()
    } else {
        None
    }
}

fn messages_chars(messages: &Value) -> usize {
    messages.as_array().map_or(0, |ms| {
        ms.iter().map(|m| content_chars(&m["content"])).sum()
    })
}

pub(super) fn max_tokens(value: &Value) -> Option<u32> {
    // Ollama's -1/-2 mean "no limit".
    value.as_i64().and_then(|n| u32::try_from(n).ok())
}

/// The tool to call, when the script answers with a tool call.
pub(super) fn tool_name(script: &MockScript, tools: &Value) -> Option<String> {
    script.tool_call.then(|| {
        let first = &tools[0];
        first["function"]["name"]
            .as_str()
            .or_else(|| first["name"].as_str())
            .unwrap_or(DEFAULT_TOOL)
            .to_owned()
    })
}

pub(super) fn streaming(
    content_type: &'static str,
    body: impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
) -> Response {
    let mut resp = Body::from_stream(body).into_response();
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// A body that cuts the connection at once (after the headers).
pub(super) fn abrupt() -> Response {
    streaming(
        "application/json",
        futures::stream::once(async { Err(std::io::Error::other("scripted abrupt close")) }),
    )
}

/// Garbage with a 200 status (non-streaming malformed answers).
fn malformed_json() -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        "{\"id\":\"mock\",\"choices\":[",
    )
        .into_response()
}

/// Everything a non-streaming answer needs, collected from the steps.
#[derive(Default)]
struct Collected {
    text: String,
    tool: Option<(String, String, String)>,
    malformed: bool,
    finish: Option<(FinishReason, iop_wire::Usage)>,
}

/// Collect the steps; `None` when the script cuts the connection.
async fn collect(mut steps: BoxStream<'static, MockStep>) -> Option<Collected> {
    let mut c = Collected::default();
    while let Some(step) = steps.next().await {
        match step {
            MockStep::Text(t) => c.text.push_str(&t),
            MockStep::ToolCallStart { id, name } => c.tool = Some((id, name, String::new())),
            MockStep::ToolCallArgs(a) => {
                if let Some(tool) = &mut c.tool {
                    tool.2.push_str(&a);
                }
            }
            MockStep::Malformed => c.malformed = true,
            MockStep::AbruptClose => return None,
            MockStep::Finish {
                finish_reason,
                usage,
            } => c.finish = Some((finish_reason, usage)),
        }
    }
    Some(c)
}

// The mock writes SSE bytes itself, on purpose: as a fault-injecting test
// double it must be able to emit malformed frames and cut streams mid-event,
// which no SSE library will do.
fn sse_data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

pub(super) fn sse_event(name: &str, v: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {v}\n\n"))
}

fn ndjson(v: &Value) -> Bytes {
    Bytes::from(format!("{v}\n"))
}

// ---- OpenAI Chat Completions ----

fn chat_chunk(model: &str, delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": "chatcmpl-mock",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    })
}

/// OpenAI's `usage`, with `prompt_tokens_details` when the script reports
/// cache counts.
fn openai_usage(u: &iop_wire::Usage) -> Value {
    let mut usage = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    });
    if let Some(read) = u.cache_read_tokens {
        usage["prompt_tokens_details"]["cached_tokens"] = json!(read);
    }
    if let Some(write) = u.cache_write_tokens {
        usage["prompt_tokens_details"]["cache_write_tokens"] = json!(write);
    }
    usage
}

async fn chat_completions(
    State(state): State<MockState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (mut guard, request, script) = match begin(&state, &headers, &body, Dialect::OpenAi).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let model = model_of(&request);
    if final_assistant(&request["messages"]).is_some() {
        state.counters.bump(&state.counters.continued);
    } else if let Some(prompt) = final_user(&request["messages"]) {
        guard.fresh(prompt);
    }
    let prompt = MockPrompt {
        prompt_chars: messages_chars(&request["messages"]),
        max_tokens: max_tokens(&request["max_completion_tokens"])
            .or_else(|| max_tokens(&request["max_tokens"])),
        tool_name: tool_name(&script, &request["tools"]),
        continue_from: continued_tokens(final_assistant(&request["messages"])),
    };
    // Like a reasoning model behind vLLM or llama.cpp: `reasoning_content`
    // before the answer when a reasoning effort other than `none` is asked.
    let reasons = request["reasoning_effort"]
        .as_str()
        .is_some_and(|e| e != "none");
    let steps = play(&script, prompt);
    if request["stream"].as_bool() != Some(true) {
        let Some(c) = collect(steps).await else {
            guard.finish();
            return abrupt();
        };
        guard.finish();
        if c.malformed {
            return malformed_json();
        }
        let (finish, usage) = c
            .finish
            .unwrap_or((FinishReason::Stop, iop_wire::Usage::default()));
        let mut message = match &c.tool {
            Some((id, name, args)) => json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{"id": id, "type": "function", "function": {"name": name, "arguments": args}}],
            }),
            None => json!({"role": "assistant", "content": c.text}),
        };
        if reasons {
            message["reasoning_content"] = json!(super::MOCK_REASONING);
        }
        return axum::Json(json!({
            "id": "chatcmpl-mock",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish.as_str()}],
            "usage": openai_usage(&usage),
        }))
        .into_response();
    }
    let include_usage = request["stream_options"]["include_usage"].as_bool() == Some(true);
    // vLLM's `continuous_usage_stats`: every chunk carries the usage so far,
    // the prompt's from the first one on.
    let continuous = include_usage
        && script.stream_usage
        && request["stream_options"]["continuous_usage_stats"].as_bool() == Some(true);
    let prompt_usage = script.usage(messages_chars(&request["messages"]).div_ceil(4) as u64, 0);
    guard.track_text();
    let body = async_stream::stream! {
        let mut steps = steps;
        let mut role_sent = false;
        let mut produced = 0u64;
        let chunk = |delta: Value, produced: u64| {
            let mut chunk = chat_chunk(&model, delta, None);
            if continuous {
                let usage = iop_wire::Usage { completion_tokens: produced, ..prompt_usage };
                chunk["usage"] = openai_usage(&usage);
            }
            sse_data(&chunk)
        };
        while let Some(step) = steps.next().await {
            if !role_sent {
                role_sent = true;
                yield Ok(chunk(json!({"role": "assistant", "content": ""}), produced));
                if reasons {
                    let delta = json!({"reasoning_content": super::MOCK_REASONING});
                    yield Ok(chunk(delta, produced));
                }
            }
            match step {
                MockStep::Text(t) => {
                    produced += 1;
                    yield Ok(chunk(json!({"content": t}), produced));
                    guard.text_sent();
                }
                MockStep::ToolCallStart { id, name } => {
                    let delta = json!({"tool_calls": [{"index": 0, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]});
                    yield Ok(chunk(delta, produced));
                }
                MockStep::ToolCallArgs(a) => {
                    let delta = json!({"tool_calls": [{"index": 0, "function": {"arguments": a}}]});
                    yield Ok(chunk(delta, produced));
                }
                MockStep::Malformed => yield Ok(Bytes::from_static(b"data: {\"choices\":[{\"delta\":\n\n")),
                MockStep::AbruptClose => {
                    guard.finish();
                    // Pending once so hyper flushes what was yielded before
                    // the cut (it drops buffered bytes on a body error).
                    tokio::task::yield_now().await;
                    yield Err(std::io::Error::other("scripted abrupt close"));
                    return;
                }
                MockStep::Finish { finish_reason, usage } => {
                    yield Ok(sse_data(&chat_chunk(&model, json!({}), Some(finish_reason.as_str()))));
                    if include_usage && script.stream_usage {
                        yield Ok(sse_data(&json!({
                            "id": "chatcmpl-mock",
                            "object": "chat.completion.chunk",
                            "created": 0,
                            "model": model,
                            "choices": [],
                            "usage": openai_usage(&usage),
                        })));
                    }
                    yield Ok(Bytes::from_static(b"data: [DONE]\n\n"));
                }
            }
        }
        guard.finish();
    };
    streaming("text/event-stream", body)
}

// ---- OpenAI Responses ----

fn responses_prompt_chars(request: &Value) -> usize {
    let input = match &request["input"] {
        Value::String(s) => s.chars().count(),
        Value::Array(items) => items.iter().map(|i| content_chars(&i["content"])).sum(),
        _ => 0,
    };
    input + content_chars(&request["instructions"])
}

fn response_object(
    model: &str,
    status: &str,
    output: Value,
    usage: Option<&iop_wire::Usage>,
) -> Value {
    let mut r = json!({
        "id": "resp_mock",
        "object": "response",
        "created_at": 0,
        "status": status,
        "model": model,
        "output": output,
    });
    if let Some(u) = usage {
        r["usage"] = json!({
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        });
    }
    if status == "incomplete" {
        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
    }
    r
}

fn response_output(c: &Collected) -> Value {
    match &c.tool {
        Some((id, name, args)) => json!([{
            "type": "function_call", "id": "fc_mock", "call_id": id,
            "name": name, "arguments": args, "status": "completed",
        }]),
        None => json!([{
            "type": "message", "id": "msg_mock", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": c.text, "annotations": []}],
        }]),
    }
}

fn response_status(finish: FinishReason) -> &'static str {
    if finish == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

async fn responses(State(state): State<MockState>, headers: HeaderMap, body: Bytes) -> Response {
    let (mut guard, request, script) = match begin(&state, &headers, &body, Dialect::OpenAi).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let model = model_of(&request);
    let prompt = MockPrompt {
        prompt_chars: responses_prompt_chars(&request),
        max_tokens: max_tokens(&request["max_output_tokens"]),
        tool_name: tool_name(&script, &request["tools"]),
        continue_from: 0,
    };
    let steps = play(&script, prompt);
    if request["stream"].as_bool() != Some(true) {
        let Some(c) = collect(steps).await else {
            guard.finish();
            return abrupt();
        };
        guard.finish();
        if c.malformed {
            return malformed_json();
        }
        let (finish, usage) = c
            .finish
            .unwrap_or((FinishReason::Stop, iop_wire::Usage::default()));
        return axum::Json(response_object(
            &model,
            response_status(finish),
            response_output(&c),
            Some(&usage),
        ))
        .into_response();
    }
    let body = async_stream::stream! {
        yield Ok(sse_event("response.created", &json!({
            "type": "response.created",
            "response": response_object(&model, "in_progress", json!([]), None),
        })));
        let mut steps = steps;
        let mut c = Collected::default();
        while let Some(step) = steps.next().await {
            match step {
                MockStep::Text(t) => {
                    yield Ok(sse_event("response.output_text.delta", &json!({
                        "type": "response.output_text.delta", "item_id": "msg_mock",
                        "output_index": 0, "content_index": 0, "delta": t,
                    })));
                    c.text.push_str(&t);
                }
                MockStep::ToolCallStart { id, name } => {
                    yield Ok(sse_event("response.output_item.added", &json!({
                        "type": "response.output_item.added", "output_index": 0,
                        "item": {"type": "function_call", "id": "fc_mock", "call_id": id,
                                 "name": name, "arguments": "", "status": "in_progress"},
                    })));
                    c.tool = Some((id, name, String::new()));
                }
                MockStep::ToolCallArgs(a) => {
                    yield Ok(sse_event("response.function_call_arguments.delta", &json!({
                        "type": "response.function_call_arguments.delta", "item_id": "fc_mock",
                        "output_index": 0, "delta": a,
                    })));
                    if let Some(tool) = &mut c.tool {
                        tool.2.push_str(&a);
                    }
                }
                MockStep::Malformed => yield Ok(Bytes::from_static(b"event: response.output_text.delta\ndata: {\"delta\":\n\n")),
                MockStep::AbruptClose => {
                    guard.finish();
                    // Pending once so hyper flushes what was yielded before
                    // the cut (it drops buffered bytes on a body error).
                    tokio::task::yield_now().await;
                    yield Err(std::io::Error::other("scripted abrupt close"));
                    return;
                }
                MockStep::Finish { finish_reason, usage } => {
                    yield Ok(sse_event("response.completed", &json!({
                        "type": "response.completed",
                        "response": response_object(&model, response_status(finish_reason), response_output(&c), Some(&usage)),
                    })));
                }
            }
        }
        guard.finish();
    };
    streaming("text/event-stream", body)
}

// ---- Ollama ----

fn ollama_final(model: &str, key: &str, finish: FinishReason, usage: &iop_wire::Usage) -> Value {
    let mut v = json!({
        "model": model,
        "created_at": CREATED_AT,
        "done": true,
        "done_reason": if finish == FinishReason::Length { "length" } else { "stop" },
        "total_duration": 0,
        "load_duration": 0,
        "prompt_eval_count": usage.prompt_tokens,
        "eval_count": usage.completion_tokens,
    });
    if key == "message" {
        v["message"] = json!({"role": "assistant", "content": ""});
    } else {
        v["response"] = json!("");
        v["context"] = json!([]);
    }
    v
}

fn ollama_tool_calls(tool: &(String, String, String)) -> Value {
    // Ollama sends arguments as an object.
    let args =
        serde_json::from_str::<Value>(&tool.2).unwrap_or_else(|_| Value::String(tool.2.clone()));
    json!([{"function": {"name": tool.1, "arguments": args}}])
}

fn ollama_text(model: &str, key: &str, text: &str) -> Value {
    if key == "message" {
        json!({"model": model, "created_at": CREATED_AT, "message": {"role": "assistant", "content": text}, "done": false})
    } else {
        json!({"model": model, "created_at": CREATED_AT, "response": text, "done": false})
    }
}

/// `/api/chat` (`key = "message"`) and `/api/generate` (`key = "response"`).
async fn ollama_call(
    state: MockState,
    headers: HeaderMap,
    body: Bytes,
    key: &'static str,
) -> Response {
    let (mut guard, request, script) = match begin(&state, &headers, &body, Dialect::Ollama).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let model = model_of(&request);
    let chat = key == "message";
    let prompt = MockPrompt {
        prompt_chars: if chat {
            messages_chars(&request["messages"])
        } else {
            content_chars(&request["prompt"]) + content_chars(&request["system"])
        },
        max_tokens: max_tokens(&request["options"]["num_predict"]),
        // Ollama's generate has no tools.
        tool_name: if chat {
            tool_name(&script, &request["tools"])
        } else {
            None
        },
        continue_from: if chat {
            continued_tokens(final_assistant(&request["messages"]))
        } else {
            0
        },
    };
    let steps = play(&script, prompt);
    if request["stream"].as_bool() == Some(false) {
        let Some(c) = collect(steps).await else {
            guard.finish();
            return abrupt();
        };
        guard.finish();
        if c.malformed {
            return malformed_json();
        }
        let (finish, usage) = c
            .finish
            .unwrap_or((FinishReason::Stop, iop_wire::Usage::default()));
        let mut v = ollama_final(&model, key, finish, &usage);
        if chat {
            v["message"]["content"] = json!(c.text);
            if let Some(tool) = &c.tool {
                v["message"]["tool_calls"] = ollama_tool_calls(tool);
            }
        } else {
            v["response"] = json!(c.text);
        }
        return axum::Json(v).into_response();
    }
    let body = async_stream::stream! {
        let mut steps = steps;
        let mut tool: Option<(String, String, String)> = None;
        while let Some(step) = steps.next().await {
            match step {
                MockStep::Text(t) => yield Ok(ndjson(&ollama_text(&model, key, &t))),
                MockStep::ToolCallStart { id, name } => tool = Some((id, name, String::new())),
                MockStep::ToolCallArgs(a) => {
                    if let Some(tool) = &mut tool {
                        tool.2.push_str(&a);
                    }
                }
                MockStep::Malformed => yield Ok(Bytes::from_static(b"{\"message\":{\"content\":\n")),
                MockStep::AbruptClose => {
                    guard.finish();
                    // Pending once so hyper flushes what was yielded before
                    // the cut (it drops buffered bytes on a body error).
                    tokio::task::yield_now().await;
                    yield Err(std::io::Error::other("scripted abrupt close"));
                    return;
                }
                MockStep::Finish { finish_reason, usage } => {
                    if let Some(tool) = &tool {
                        let mut v = ollama_text(&model, key, "");
                        v["message"]["tool_calls"] = ollama_tool_calls(tool);
                        yield Ok(ndjson(&v));
                    }
                    yield Ok(ndjson(&ollama_final(&model, key, finish_reason, &usage)));
                }
            }
        }
        guard.finish();
    };
    streaming("application/x-ndjson", body)
}

async fn ollama_chat(State(state): State<MockState>, headers: HeaderMap, body: Bytes) -> Response {
    ollama_call(state, headers, body, "message").await
}

async fn ollama_generate(
    State(state): State<MockState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    ollama_call(state, headers, body, "response").await
}

// ---- Probes and stats ----

async fn probe_gate(state: &MockState, headers: &HeaderMap, dialect: Dialect) -> Option<Response> {
    state.counters.bump(&state.counters.probes);
    let script = &state.defaults;
    if let Some(refusal) = key_refusal(script, headers, dialect) {
        return Some(refusal);
    }
    match script.health {
        ProbeHealth::Ok => None,
        ProbeHealth::Unhealthy => Some(error_response(dialect, 503, "scripted unhealthy")),
        ProbeHealth::Hang => futures::future::pending().await,
    }
}

async fn openai_models(State(state): State<MockState>, headers: HeaderMap) -> Response {
    if let Some(resp) = probe_gate(&state, &headers, Dialect::OpenAi).await {
        return resp;
    }
    axum::Json(json!({
        "object": "list",
        "data": [{"id": DEFAULT_MODEL, "object": "model", "created": 0, "owned_by": "iop-mock"}],
    }))
    .into_response()
}

/// `GET /v1/models` of a Messages-only mock: Anthropic's model list.
async fn anthropic_models(State(state): State<MockState>, headers: HeaderMap) -> Response {
    if let Some(resp) = probe_gate(&state, &headers, Dialect::Anthropic).await {
        return resp;
    }
    axum::Json(json!({
        "data": [{"type": "model", "id": DEFAULT_MODEL, "display_name": "Mock", "created_at": CREATED_AT}],
        "has_more": false,
        "first_id": DEFAULT_MODEL,
        "last_id": DEFAULT_MODEL,
    }))
    .into_response()
}

async fn ollama_tags(State(state): State<MockState>, headers: HeaderMap) -> Response {
    if let Some(resp) = probe_gate(&state, &headers, Dialect::Ollama).await {
        return resp;
    }
    axum::Json(json!({
        "models": [{
            "name": DEFAULT_MODEL, "model": DEFAULT_MODEL, "modified_at": CREATED_AT,
            "size": 0, "digest": "", "details": {},
        }],
    }))
    .into_response()
}

async fn stats(State(state): State<MockState>) -> axum::Json<MockStats> {
    axum::Json(state.counters.snapshot())
}

async fn reset(State(state): State<MockState>) -> StatusCode {
    state.counters.reset();
    StatusCode::NO_CONTENT
}
