//! The client-facing HTTP APIs as pure conversions (no I/O).
//!
//! The Edge's HTTP handlers read a body, call a `parse_*` function here to get
//! a [`NormalizedRun`] (model, messages, tools, [`iop_wire::GenerationParams`]),
//! hand it to the core as a run, and turn the run's [`iop_wire::RunEventKind`]s
//! back into the client's format with an encoder (streaming) or an
//! accumulator (non-streaming) from this module. Errors of every kind become
//! one [`ApiError`], rendered in the OpenAI or Ollama error format.
//!
//! | endpoint | parse | stream | non-stream |
//! | --- | --- | --- | --- |
//! | `POST /v1/chat/completions` | [`chat::parse_chat_request`] | [`chat::ChatStream`] (SSE `data:` events) | [`chat::ChatAccumulator`] |
//! | `POST /v1/responses` | [`responses::parse_responses_request`] | [`responses::ResponsesStream`] (SSE `event:` + `data:`) | [`responses::ResponsesAccumulator`] |
//! | `POST /api/chat`, `POST /api/generate` | [`ollama::parse_ollama_chat`], [`ollama::parse_ollama_generate`] | [`ollama::OllamaStream`] (NDJSON lines) | [`ollama::OllamaAccumulator`] |
//! | `POST /v1/messages` (Anthropic) | [`messages::parse_messages_request`] | [`messages::MessagesStream`] (SSE `event:` + `data:`) | [`messages::MessagesAccumulator`] |
//! | `GET /v1/models` | | | [`models::models_list_json`] |
//! | `GET /api/tags` | | | [`ollama::tags_json`] |
//!
//! [`endpoint`] binds each run API's parse, encoder and accumulator to the
//! one HTTP pipeline all run endpoints share; the encoders write whole SSE
//! events or NDJSON lines into the response body ([`framing`]).
//!
//! Time and randomness are inputs: encoders take `created` timestamps and
//! ids from the caller ([`ids`] formats a caller-supplied `u64`).

#[cfg(test)]
mod arbitrary_body;
pub mod chat;
pub mod embeddings;
pub mod endpoint;
pub mod error;
pub mod framing;
pub mod ids;
pub mod messages;
pub mod models;
pub mod ollama;
mod request_object;
pub mod responses;
pub mod surface;
mod transcript;

pub use error::{ApiError, ErrorKind, OllamaError};

use iop_wire::{ChatMessage, GenerationParams, RunApi, ToolDefinition};

/// A run as every run API parses it: what the core is to run, and whether
/// the client wants the answer streamed. Each API's request type carries
/// one, plus the options only its own answer needs.
#[derive(Debug, Clone, PartialEq)]
pub struct NormalizedRun {
    /// The requested model (non-empty).
    pub model: String,
    /// Answer with a stream (SSE or NDJSON) instead of one object.
    pub stream: bool,
    /// A conversation ([`RunApi::Chat`]) or a plain completion
    /// ([`RunApi::Generate`], Ollama's `/api/generate`).
    pub api: RunApi,
    /// The conversation, roles normalized.
    pub messages: Vec<ChatMessage>,
    /// Function tools the model may call.
    pub tools: Vec<ToolDefinition>,
    /// Sampling and length parameters, and the rest of the request surface
    /// (response format, log probabilities, pass-through fields).
    pub params: GenerationParams,
    /// How many choices the client asked for (`n`); a normalized run
    /// relays one, so more needs a tunnel-mode provider
    /// ([`surface::provider_refusal`]).
    pub choices: u32,
}
