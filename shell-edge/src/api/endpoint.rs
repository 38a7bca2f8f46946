//! The per-API half of a run endpoint.
//!
//! `POST /v1/chat/completions`, `/v1/responses`, `/api/chat` and
//! `/api/generate` share one pipeline in the Edge's HTTP layer: authenticate, read
//! and parse the body, route the model, dispatch the run, relay a tunnelled
//! answer as it is, and otherwise answer with a stream or with one object.
//! A [`RunEndpoint`] holds everything that differs between them:
//!
//! | | parse | error body | stream ([`AnswerStream`]) | one object ([`WholeAnswer`]) |
//! | --- | --- | --- | --- | --- |
//! | [`ChatCompletions`] | [`chat::parse_chat_request`] | OpenAI | SSE `data:` chunks, then `data: [DONE]`; keep-alive comments | [`chat::ChatAccumulator`] |
//! | [`Responses`] | [`responses::parse_responses_request`] | OpenAI | SSE `event:` + `data:`; keep-alive comments | [`responses::ResponsesAccumulator`] |
//! | [`Ollama`] | [`ollama::parse_ollama_chat`], [`ollama::parse_ollama_generate`] | Ollama | NDJSON lines | [`ollama::OllamaAccumulator`] |
//! | [`Messages`] | [`messages::parse_messages_request`] | Anthropic | SSE `event:` + `data:`; `ping` keep-alives | [`messages::MessagesAccumulator`] |

use std::convert::Infallible;

use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use iop_core::edge::request::TunnelApi;
use iop_core::journal::JournalApi;
use iop_wire::{RunApi, RunEventKind};
use serde_json::Value;

use super::error::{ApiError, OllamaError};
use super::{NormalizedRun, chat, embeddings, framing, ids, messages, ollama, responses};

/// The OpenAI-shaped answers of `/v1/chat/completions` and
/// `/v1/completions`: SSE `data:` chunks with ids and keep-alive comments,
/// ended by `data: [DONE]`; a whole answer is the accumulator's object.
macro_rules! openai_answer {
    ($stream:ty, $whole:ty) => {
        impl AnswerStream for $stream {
            const KEEP_ALIVE: Option<&'static [u8]> = Some(framing::SSE_KEEP_ALIVE);
            const SSE_IDS: bool = true;

            fn event(&mut self, event: &RunEventKind, _now_unix_ms: u64, out: &mut Vec<u8>) {
                self.push(event, out);
            }

            fn closing(&mut self, out: &mut Vec<u8>) {
                framing::sse_event(out, None, |out| out.extend_from_slice(b"[DONE]"));
            }

            fn failure(&mut self, err: &ApiError, out: &mut Vec<u8>) {
                self.fail(err, out);
            }

            fn response(chunks: BoxStream<'static, Bytes>) -> Response {
                streamed_response("text/event-stream", true, chunks)
            }
        }

        impl WholeAnswer for $whole {
            fn event(&mut self, event: &RunEventKind) {
                self.push(event);
            }

            fn answer(&self, _now_unix_ms: u64) -> Result<AnswerJson, ApiError> {
                AnswerJson::of(&self.finish()?)
            }
        }
    };
}

/// What one run API adds to the shared pipeline.
pub trait RunEndpoint: Send + Sync + 'static {
    /// Whether the API also takes its key in an `x-api-key` header (the
    /// Anthropic API's), besides `Authorization: Bearer`.
    const X_API_KEY: bool = false;
    /// Request headers a tunnel-mode provider gets as the client sent them
    /// (the API's own version and feature headers; never a credential).
    const TUNNELLED_HEADERS: &'static [&'static str] = &[];
    /// Request fields only this API's answer uses.
    type Options: Send + 'static;
    /// The streamed answer.
    type Stream: AnswerStream;
    /// The non-streaming answer.
    type Whole: WholeAnswer;

    /// The route label of the request's metrics and its run.
    fn route(&self) -> &'static str;
    /// The provider API and path a tunnel-mode provider takes the raw body on.
    fn tunnel(&self) -> (TunnelApi, &'static str);
    /// The request body as a run and this API's options.
    fn parse(&self, body: &[u8]) -> Result<(NormalizedRun, Self::Options), ApiError>;
    /// What the request's headers add to its parsed run (the Messages
    /// API's beta features); a malformed one is the 400 to answer.
    fn read_headers(
        &self,
        _headers: &axum::http::HeaderMap,
        _run: &mut NormalizedRun,
    ) -> Result<(), ApiError> {
        Ok(())
    }
    /// An error answered instead of the run's answer, in this API's shape.
    fn error_response(&self, err: ApiError) -> Response;
    /// The answer to a request that needs no run, if this is one (Ollama's
    /// load-only request); `now_unix_ms` is the admission time.
    fn answer_without_run(
        &self,
        _run: &NormalizedRun,
        _options: &Self::Options,
        _now_unix_ms: u64,
    ) -> Option<Value> {
        None
    }
    /// The encoder of a streamed answer.
    fn stream(&self, start: AnswerStart, options: Self::Options) -> Self::Stream;
    /// The accumulator of a non-streaming answer.
    fn whole(&self, start: AnswerStart, options: Self::Options) -> Self::Whole;
    /// The journal's name of this API (durable responses, SPEC §6).
    fn journal_api(&self) -> JournalApi;
    /// The `id` that [`Self::stream`] and [`Self::whole`] give an answer
    /// started with `seed`: a durable response is stored under it.
    fn object_id(&self, seed: u64) -> String {
        format!("run_{seed:016x}")
    }
    /// What the request asks to be kept (`store`, `background`), with
    /// `store_default` the Edge's default for this API where it has one.
    fn keep(&self, _options: &Self::Options, _store_default: bool) -> Keep {
        Keep::default()
    }
    /// Mark the options with what is kept, so the answer echoes it.
    fn mark_kept(&self, _options: &mut Self::Options, _keep: Keep) {}
    /// The stored response this request continues (`previous_response_id`).
    fn previous_response(&self, _options: &Self::Options) -> Option<String> {
        None
    }
    /// How many leading messages of the parsed run are this request's
    /// instructions (they are not carried into a continued conversation).
    fn instruction_messages(&self, _options: &Self::Options) -> usize {
        0
    }
}

/// What a request asks the Edge to keep of its answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Keep {
    /// Store it to fetch later (a durable response).
    pub store: bool,
    /// Run it without a waiting client; answer at once.
    pub background: bool,
}

/// What an answer is labelled with, from the pipeline.
#[derive(Debug)]
pub struct AnswerStart {
    /// The model the client asked for.
    pub model: String,
    /// Seed of the answer's id (see [`ids`]).
    pub id_seed: u64,
    /// When the request was admitted (Ollama durations count from here).
    pub admitted_unix_ms: u64,
    /// When the run committed, in Unix seconds (OpenAI `created` times).
    pub committed_unix: u64,
}

/// Encodes a run's events as one API's streamed answer, writing whole
/// frames (SSE events, NDJSON lines) into the body bytes due at one moment
/// (see [`framing`]).
pub trait AnswerStream: Send + 'static {
    /// The keep-alive sent after `edge.sse_keep_alive_ms` of
    /// silence, if this API's stream has one.
    const KEEP_ALIVE: Option<&'static [u8]> = None;
    /// Append the frames due before the first event.
    fn opening(&mut self, _out: &mut Vec<u8>) {}
    /// Append the frames for one run event at `now_unix_ms`.
    fn event(&mut self, event: &RunEventKind, now_unix_ms: u64, out: &mut Vec<u8>);
    /// Append the frames after the run finished normally.
    fn closing(&mut self, _out: &mut Vec<u8>) {}
    /// Append the frames ending the stream with `err` (R-GATE-3).
    fn failure(&mut self, err: &ApiError, out: &mut Vec<u8>);
    /// Append the frames ending the stream of a durable response that
    /// ended without its answer (`reason`: `edge_restart`, `cancelled`).
    fn interrupted(&mut self, reason: &str, out: &mut Vec<u8>) {
        self.failure(&ApiError::response_interrupted(reason), out);
    }
    /// Whether this API's stream is SSE: a durable stream then numbers its
    /// events with `id:` lines (0, 1, 2, ... in the order written, the
    /// same for every rendering of the record), so a client can resume
    /// after the last one it has (`Last-Event-ID`, `starting_after`).
    const SSE_IDS: bool = false;
    /// The response whose body is `chunks`, each the frames that became due
    /// together.
    fn response(chunks: BoxStream<'static, Bytes>) -> Response;
}

/// Folds a run's events into one API's non-streaming answer.
pub trait WholeAnswer: Send + 'static {
    /// Fold one event in.
    fn event(&mut self, event: &RunEventKind);
    /// The answer at `now_unix_ms`, or the error the run ended with.
    fn answer(&self, now_unix_ms: u64) -> Result<AnswerJson, ApiError>;
    /// The answer of a durable response that ended without one (`reason`:
    /// `edge_restart`, `cancelled`): by default the error saying so; an API
    /// whose objects have a status shows what there is.
    fn interrupted(&self, reason: &str) -> Result<AnswerJson, ApiError> {
        Err(ApiError::response_interrupted(reason))
    }
}

/// The bytes an answer's JSON buffer starts with.
const ANSWER_JSON_CAPACITY: usize = 512;

/// A whole answer's JSON body, serialized once from a [`Value`] or from
/// a typed object (which builds no map on the way).
#[derive(Debug)]
pub struct AnswerJson(Vec<u8>);

impl AnswerJson {
    /// `object`'s JSON. An object of string-keyed maps always serializes;
    /// any other is an internal error, never a panic.
    pub fn of(object: &impl serde::Serialize) -> Result<Self, ApiError> {
        // Room for a short answer's object, so it is written without
        // growing the buffer again and again.
        let mut out = Vec::with_capacity(ANSWER_JSON_CAPACITY);
        serde_json::to_writer(&mut out, object).map_err(|_| ApiError::internal())?;
        Ok(AnswerJson(out))
    }

    /// The body's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl From<Value> for AnswerJson {
    fn from(value: Value) -> Self {
        // A `Value`'s maps have string keys: writing it to a vector cannot fail.
        AnswerJson(value.to_string().into_bytes())
    }
}

impl IntoResponse for AnswerJson {
    /// `200` with the JSON, as `axum::Json` answers.
    fn into_response(self) -> Response {
        (
            [(
                header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            )],
            self.0,
        )
            .into_response()
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Copy)]
pub struct ChatCompletions;

/// Chat Completions options: `stream_options.include_usage` and `store`.
#[derive(Debug, Clone, Copy)]
pub struct ChatOptions {
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `store`.
    pub store: bool,
}

impl RunEndpoint for ChatCompletions {
    type Options = ChatOptions;
    type Stream = chat::ChatStream;
    type Whole = chat::ChatAccumulator;

    fn route(&self) -> &'static str {
        "chat"
    }

    fn tunnel(&self) -> (TunnelApi, &'static str) {
        (TunnelApi::OpenAi, "/v1/chat/completions")
    }

    fn parse(&self, body: &[u8]) -> Result<(NormalizedRun, ChatOptions), ApiError> {
        chat::parse_chat_request(body).map(|r| {
            (
                r.run,
                ChatOptions {
                    include_usage: r.include_usage,
                    store: r.store,
                },
            )
        })
    }

    fn error_response(&self, err: ApiError) -> Response {
        err.into_response()
    }

    fn stream(&self, start: AnswerStart, options: ChatOptions) -> chat::ChatStream {
        let id = ids::chat_completion_id(start.id_seed);
        chat::ChatStream::new(id, start.model, start.committed_unix)
            .with_usage_chunk(options.include_usage)
    }

    fn whole(&self, start: AnswerStart, _options: ChatOptions) -> chat::ChatAccumulator {
        let id = ids::chat_completion_id(start.id_seed);
        chat::ChatAccumulator::new(id, start.model, start.committed_unix)
    }

    fn journal_api(&self) -> JournalApi {
        JournalApi::ChatCompletions
    }

    fn object_id(&self, seed: u64) -> String {
        ids::chat_completion_id(seed)
    }

    fn keep(&self, options: &ChatOptions, _store_default: bool) -> Keep {
        Keep {
            store: options.store,
            background: false,
        }
    }
}

openai_answer!(chat::ChatStream, chat::ChatAccumulator);

/// `POST /v1/responses`.
#[derive(Debug, Clone, Copy)]
pub struct Responses;

impl RunEndpoint for Responses {
    type Options = responses::ResponseEcho;
    type Stream = responses::ResponsesStream;
    type Whole = responses::ResponsesAccumulator;

    fn route(&self) -> &'static str {
        "responses"
    }

    fn tunnel(&self) -> (TunnelApi, &'static str) {
        (TunnelApi::OpenAi, "/v1/responses")
    }

    /// The options are the request fields the `response` object echoes.
    fn parse(&self, body: &[u8]) -> Result<(NormalizedRun, responses::ResponseEcho), ApiError> {
        responses::parse_responses_request(body).map(|r| (r.run, r.echo))
    }

    fn error_response(&self, err: ApiError) -> Response {
        err.into_response()
    }

    fn stream(&self, start: AnswerStart, echo: responses::ResponseEcho) -> Self::Stream {
        let id = ids::response_id(start.id_seed);
        responses::ResponsesStream::new(id, start.model, start.committed_unix).with_echo(echo)
    }

    fn whole(&self, start: AnswerStart, echo: responses::ResponseEcho) -> Self::Whole {
        let id = ids::response_id(start.id_seed);
        responses::ResponsesAccumulator::new(id, start.model, start.committed_unix).with_echo(echo)
    }

    fn journal_api(&self) -> JournalApi {
        JournalApi::Responses
    }

    fn object_id(&self, seed: u64) -> String {
        ids::response_id(seed)
    }

    /// `store` defaults to the Edge's setting (OpenAI's default is
    /// `true`); a background response is always stored.
    fn keep(&self, echo: &responses::ResponseEcho, store_default: bool) -> Keep {
        Keep {
            store: echo.store_requested.unwrap_or(store_default) || echo.background,
            background: echo.background,
        }
    }

    fn mark_kept(&self, echo: &mut responses::ResponseEcho, keep: Keep) {
        echo.store = keep.store;
        echo.background = keep.background;
    }

    fn previous_response(&self, echo: &responses::ResponseEcho) -> Option<String> {
        echo.previous_response_id.clone()
    }

    fn instruction_messages(&self, echo: &responses::ResponseEcho) -> usize {
        usize::from(echo.instructions.is_some())
    }
}

impl AnswerStream for responses::ResponsesStream {
    const KEEP_ALIVE: Option<&'static [u8]> = Some(framing::SSE_KEEP_ALIVE);
    const SSE_IDS: bool = true;

    fn opening(&mut self, out: &mut Vec<u8>) {
        self.start(out);
    }

    fn event(&mut self, event: &RunEventKind, _now_unix_ms: u64, out: &mut Vec<u8>) {
        self.push(event, out);
    }

    fn failure(&mut self, err: &ApiError, out: &mut Vec<u8>) {
        self.fail(err, out);
    }

    /// `response.incomplete`, its `status` `incomplete` or `cancelled`.
    fn interrupted(&mut self, reason: &str, out: &mut Vec<u8>) {
        self.end_interrupted(reason, out);
    }

    fn response(chunks: BoxStream<'static, Bytes>) -> Response {
        streamed_response("text/event-stream", true, chunks)
    }
}

impl WholeAnswer for responses::ResponsesAccumulator {
    fn event(&mut self, event: &RunEventKind) {
        self.push(event);
    }

    fn answer(&self, _now_unix_ms: u64) -> Result<AnswerJson, ApiError> {
        self.finish().map(AnswerJson::from)
    }

    fn interrupted(&self, reason: &str) -> Result<AnswerJson, ApiError> {
        Ok(self.interrupted_snapshot(reason).into())
    }
}

/// `POST /api/chat` ([`RunApi::Chat`]) or `POST /api/generate`
/// ([`RunApi::Generate`]).
#[derive(Debug, Clone, Copy)]
pub struct Ollama(pub RunApi);

impl RunEndpoint for Ollama {
    /// Whether the request only asks to load the model.
    type Options = bool;
    type Stream = ollama::OllamaStream;
    type Whole = ollama::OllamaAccumulator;

    fn route(&self) -> &'static str {
        match self.0 {
            RunApi::Chat => "ollama_chat",
            _ => "ollama_generate",
        }
    }

    fn tunnel(&self) -> (TunnelApi, &'static str) {
        match self.0 {
            RunApi::Chat => (TunnelApi::Ollama, "/api/chat"),
            _ => (TunnelApi::Ollama, "/api/generate"),
        }
    }

    /// The options say whether the request only asks to load the model.
    fn parse(&self, body: &[u8]) -> Result<(NormalizedRun, bool), ApiError> {
        let request = match self.0 {
            RunApi::Chat => ollama::parse_ollama_chat(body)?,
            _ => ollama::parse_ollama_generate(body)?,
        };
        let load_only = request.is_load_only();
        Ok((request.run, load_only))
    }

    fn error_response(&self, err: ApiError) -> Response {
        OllamaError(err).into_response()
    }

    fn answer_without_run(
        &self,
        run: &NormalizedRun,
        load_only: &bool,
        now_unix_ms: u64,
    ) -> Option<Value> {
        load_only.then(|| ollama::load_response_json(&run.model, run.api, now_unix_ms))
    }

    fn stream(&self, start: AnswerStart, _load_only: bool) -> ollama::OllamaStream {
        ollama::OllamaStream::new(start.model, self.0, start.admitted_unix_ms)
    }

    fn whole(&self, start: AnswerStart, _load_only: bool) -> ollama::OllamaAccumulator {
        ollama::OllamaAccumulator::new(start.model, self.0, start.admitted_unix_ms)
    }

    fn journal_api(&self) -> JournalApi {
        match self.0 {
            RunApi::Chat => JournalApi::OllamaChat,
            _ => JournalApi::OllamaGenerate,
        }
    }
}

impl AnswerStream for ollama::OllamaStream {
    fn event(&mut self, event: &RunEventKind, now_unix_ms: u64, out: &mut Vec<u8>) {
        self.push(event, now_unix_ms, out);
    }

    fn failure(&mut self, err: &ApiError, out: &mut Vec<u8>) {
        self.fail(err, out);
    }

    fn response(chunks: BoxStream<'static, Bytes>) -> Response {
        streamed_response("application/x-ndjson", false, chunks)
    }
}

impl WholeAnswer for ollama::OllamaAccumulator {
    fn event(&mut self, event: &RunEventKind) {
        self.push(event);
    }

    fn answer(&self, now_unix_ms: u64) -> Result<AnswerJson, ApiError> {
        self.finish(now_unix_ms).map(AnswerJson::from)
    }
}

/// `POST /v1/embeddings`: answered whole, never streamed.
#[derive(Debug, Clone, Copy)]
pub struct Embeddings;

impl RunEndpoint for Embeddings {
    /// Whether the vectors are answered base64-encoded.
    type Options = bool;
    // An embeddings run never streams; the type only completes the trait.
    type Stream = chat::ChatStream;
    type Whole = embeddings::EmbeddingsAccumulator;

    fn route(&self) -> &'static str {
        "embeddings"
    }

    fn tunnel(&self) -> (TunnelApi, &'static str) {
        (TunnelApi::OpenAi, "/v1/embeddings")
    }

    fn parse(&self, body: &[u8]) -> Result<(NormalizedRun, bool), ApiError> {
        embeddings::parse_embeddings_request(body)
    }

    fn error_response(&self, err: ApiError) -> Response {
        err.into_response()
    }

    fn stream(&self, start: AnswerStart, _base64: bool) -> chat::ChatStream {
        chat::ChatStream::new(ids::chat_completion_id(start.id_seed), start.model, 0)
    }

    fn whole(&self, start: AnswerStart, base64: bool) -> embeddings::EmbeddingsAccumulator {
        embeddings::EmbeddingsAccumulator::new(start.model, base64)
    }

    fn journal_api(&self) -> JournalApi {
        JournalApi::Embeddings
    }
}

impl WholeAnswer for embeddings::EmbeddingsAccumulator {
    fn event(&mut self, event: &RunEventKind) {
        self.push(event);
    }

    fn answer(&self, _now_unix_ms: u64) -> Result<AnswerJson, ApiError> {
        self.finish().map(AnswerJson::from)
    }
}

/// `POST /api/embed` (Ollama): answered whole.
#[derive(Debug, Clone, Copy)]
pub struct OllamaEmbed;

/// Ollama's embed answer: the accumulator and when the request was admitted.
#[derive(Debug)]
pub struct OllamaEmbedAnswer {
    inner: embeddings::EmbeddingsAccumulator,
    admitted_unix_ms: u64,
}

impl RunEndpoint for OllamaEmbed {
    type Options = ();
    // An embeddings run never streams; the type only completes the trait.
    type Stream = ollama::OllamaStream;
    type Whole = OllamaEmbedAnswer;

    fn route(&self) -> &'static str {
        "ollama_embed"
    }

    fn tunnel(&self) -> (TunnelApi, &'static str) {
        (TunnelApi::Ollama, "/api/embed")
    }

    fn parse(&self, body: &[u8]) -> Result<(NormalizedRun, ()), ApiError> {
        embeddings::parse_ollama_embed(body).map(|run| (run, ()))
    }

    fn error_response(&self, err: ApiError) -> Response {
        OllamaError(err).into_response()
    }

    fn stream(&self, start: AnswerStart, _: ()) -> ollama::OllamaStream {
        ollama::OllamaStream::new(start.model, RunApi::Generate, start.admitted_unix_ms)
    }

    fn whole(&self, start: AnswerStart, _: ()) -> OllamaEmbedAnswer {
        OllamaEmbedAnswer {
            inner: embeddings::EmbeddingsAccumulator::new(start.model, false),
            admitted_unix_ms: start.admitted_unix_ms,
        }
    }

    fn journal_api(&self) -> JournalApi {
        JournalApi::OllamaEmbed
    }
}

impl WholeAnswer for OllamaEmbedAnswer {
    fn event(&mut self, event: &RunEventKind) {
        self.inner.push(event);
    }

    fn answer(&self, now_unix_ms: u64) -> Result<AnswerJson, ApiError> {
        let total_ns = now_unix_ms
            .saturating_sub(self.admitted_unix_ms)
            .saturating_mul(1_000_000);
        self.inner.finish_ollama(total_ns).map(AnswerJson::from)
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Copy)]
pub struct Completions;

impl RunEndpoint for Completions {
    /// `stream_options.include_usage`.
    type Options = bool;
    type Stream = embeddings::CompletionStream;
    type Whole = embeddings::CompletionAccumulator;

    fn route(&self) -> &'static str {
        "completions"
    }

    fn tunnel(&self) -> (TunnelApi, &'static str) {
        (TunnelApi::OpenAi, "/v1/completions")
    }

    fn parse(&self, body: &[u8]) -> Result<(NormalizedRun, bool), ApiError> {
        embeddings::parse_completion_request(body).map(|r| (r.run, r.include_usage))
    }

    fn error_response(&self, err: ApiError) -> Response {
        err.into_response()
    }

    fn stream(&self, start: AnswerStart, include_usage: bool) -> embeddings::CompletionStream {
        embeddings::CompletionStream::new(
            embeddings::completion_id(start.id_seed),
            start.model,
            start.committed_unix,
            include_usage,
        )
    }

    fn whole(&self, start: AnswerStart, _include_usage: bool) -> embeddings::CompletionAccumulator {
        embeddings::CompletionAccumulator::new(
            embeddings::completion_id(start.id_seed),
            start.model,
            start.committed_unix,
        )
    }

    fn journal_api(&self) -> JournalApi {
        JournalApi::Completions
    }

    fn object_id(&self, seed: u64) -> String {
        embeddings::completion_id(seed)
    }
}

openai_answer!(
    embeddings::CompletionStream,
    embeddings::CompletionAccumulator
);

/// `POST /v1/messages` (the Anthropic Messages API).
#[derive(Debug, Clone, Copy)]
pub struct Messages;

impl RunEndpoint for Messages {
    const X_API_KEY: bool = true;
    /// A Messages provider reads the API version and the beta features
    /// the client asked for.
    const TUNNELLED_HEADERS: &'static [&'static str] = &["anthropic-version", "anthropic-beta"];
    /// The request's `stop_sequences` (the answer names the one it
    /// stopped at).
    type Options = Vec<String>;
    type Stream = messages::MessagesStream;
    type Whole = messages::MessagesAccumulator;

    fn route(&self) -> &'static str {
        "messages"
    }

    /// A tunnel-mode provider gets the body on its own `/v1/messages`: an
    /// `anthropic` one, or an OpenAI-compatible server that answers it too
    /// (vLLM, llama.cpp's server).
    fn tunnel(&self) -> (TunnelApi, &'static str) {
        (TunnelApi::Messages, "/v1/messages")
    }

    fn parse(&self, body: &[u8]) -> Result<(NormalizedRun, Vec<String>), ApiError> {
        messages::parse_messages_request(body).map(|run| {
            let stops = run.params.stop.clone();
            (run, stops)
        })
    }

    /// `anthropic-beta`: the features a normalized run's Messages
    /// provider gets (a tunnel-mode provider gets the header as sent).
    fn read_headers(
        &self,
        headers: &axum::http::HeaderMap,
        run: &mut NormalizedRun,
    ) -> Result<(), ApiError> {
        run.params.betas = messages::parse_betas(headers)?;
        Ok(())
    }

    fn error_response(&self, err: ApiError) -> Response {
        messages::MessagesError(err).into_response()
    }

    fn stream(&self, start: AnswerStart, stops: Vec<String>) -> messages::MessagesStream {
        messages::MessagesStream::new(messages::message_id(start.id_seed), start.model)
            .with_stop_sequences(stops)
    }

    fn whole(&self, start: AnswerStart, stops: Vec<String>) -> messages::MessagesAccumulator {
        messages::MessagesAccumulator::new(messages::message_id(start.id_seed), start.model)
            .with_stop_sequences(stops)
    }

    fn journal_api(&self) -> JournalApi {
        JournalApi::Messages
    }

    fn object_id(&self, seed: u64) -> String {
        messages::message_id(seed)
    }
}

impl AnswerStream for messages::MessagesStream {
    const KEEP_ALIVE: Option<&'static [u8]> = Some(messages::PING);
    const SSE_IDS: bool = true;

    // No opening: `message_start` goes with the first run event, to carry
    // the usage a provider reports before its answer.

    fn event(&mut self, event: &RunEventKind, _now_unix_ms: u64, out: &mut Vec<u8>) {
        self.push(event, out);
    }

    fn failure(&mut self, err: &ApiError, out: &mut Vec<u8>) {
        self.fail(err, out);
    }

    fn response(chunks: BoxStream<'static, Bytes>) -> Response {
        streamed_response("text/event-stream", true, chunks)
    }
}

impl WholeAnswer for messages::MessagesAccumulator {
    fn event(&mut self, event: &RunEventKind) {
        self.push(event);
    }

    fn answer(&self, _now_unix_ms: u64) -> Result<AnswerJson, ApiError> {
        self.finish().map(AnswerJson::from)
    }
}

/// A streamed answer: `content_type`, for SSE also `cache-control:
/// no-cache` (the headers axum's `Sse` response had), and `chunks` as the
/// body.
fn streamed_response(
    content_type: &'static str,
    no_cache: bool,
    chunks: BoxStream<'static, Bytes>,
) -> Response {
    let mut builder = Response::builder().header(header::CONTENT_TYPE, content_type);
    if no_cache {
        builder = builder.header(header::CACHE_CONTROL, "no-cache");
    }
    builder
        .body(Body::from_stream(chunks.map(Ok::<_, Infallible>)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[cfg(test)]
mod tests {
    use axum::response::sse::{Event, KeepAlive, Sse};

    use super::*;

    #[tokio::test]
    async fn sse_answers_have_the_head_of_an_axum_sse_response() {
        let axum_sse = Sse::new(futures::stream::empty::<Result<Event, Infallible>>())
            .keep_alive(KeepAlive::default())
            .into_response();
        for ours in [
            chat::ChatStream::response(futures::stream::empty().boxed()),
            responses::ResponsesStream::response(futures::stream::empty().boxed()),
        ] {
            assert_eq!(ours.status(), axum_sse.status());
            assert_eq!(ours.headers(), axum_sse.headers());
        }
    }

    #[test]
    fn ndjson_answers_are_typed_as_ndjson() {
        let ours = ollama::OllamaStream::response(futures::stream::empty().boxed());
        assert_eq!(ours.status(), StatusCode::OK);
        assert_eq!(
            ours.headers().get(header::CONTENT_TYPE).unwrap(),
            "application/x-ndjson"
        );
        assert_eq!(ours.headers().len(), 1);
    }
}
