//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic
//! Messages API as a normalized run, one concern per file:
//!
//! * [`request`]: [`parse_messages_request`] turns a body into a
//!   [`NormalizedRun`]: `system` (a string or text blocks) becomes the first
//!   message; each message's blocks become the run's messages (`text`,
//!   `image` by base64 or URL, `document` with a text source, `tool_use` as
//!   the assistant's tool calls, each `tool_result` as one tool message
//!   before the rest of its user turn); `tools`, `tool_choice`,
//!   `stop_sequences`, `max_tokens` (required), `temperature`, `top_p`,
//!   `top_k`, `metadata.user_id` and `thinking` (as a reasoning effort)
//!   become the run's parameters. What the run cannot carry (a PDF
//!   document, an image in a tool result, a server tool) is a 400 naming
//!   the field; an unknown top-level field is a 400, as Anthropic answers
//!   it. Earlier turns' `thinking` blocks are left out, as Anthropic leaves
//!   them out of the context.
//! * [`stream`]: [`MessagesStream`] writes Anthropic's event sequence:
//!   `message_start`, then per content block `content_block_start`,
//!   `content_block_delta` (`text_delta`, `thinking_delta`,
//!   `input_json_delta`) and `content_block_stop`, then `message_delta`
//!   (`stop_reason`, usage) and `message_stop`; `ping` after the start and
//!   as the keep-alive; an `error` event ends a failed stream.
//! * [`response`]: [`MessagesAccumulator`] folds a run into one `message`
//!   object; the `stop_reason` and `usage` both answers carry.
//! * [`error`]: [`MessagesError`] answers an [`ApiError`] in Anthropic's
//!   shape and status codes.
//!
//! Usage is the provider's: the final `message_delta` and the whole answer
//! carry its `input_tokens` and `output_tokens`, or `null` when it reported
//! none, and its `cache_creation_input_tokens` and
//! `cache_read_input_tokens` when it reported them (`null` when not: never
//! invented); `input_tokens` counts the prompt's tokens outside the cache,
//! as Anthropic counts them. `message_start` goes out with the run's first
//! event: a provider's usage reported before its answer (a Messages
//! provider's prompt and cache counts) is in it; before any provider count
//! it carries zeros, which the SDKs replace with the `message_delta`
//! totals.
//!
//! `stop_reason`: `end_turn` (a natural stop), `max_tokens`, `tool_use`
//! (the model called tools, whatever finish reason its provider gave with
//! them), `refusal` (content filter), `stop_sequence` (a provider that says
//! a stop sequence matched: an `anthropic` provider, or vLLM's
//! `stop_reason`); `stop_sequence` names the request's sequence when it gave
//! exactly one. The OpenAI API of other servers and Ollama's do not say,
//! so a matched stop sequence reads `end_turn` there.

mod error;
mod request;
mod response;
mod stream;

pub use error::{MessagesError, error_json, error_status_and_type};
pub use request::{parse_count_tokens_request, parse_messages_request};
pub use response::{MessagesAccumulator, stop_reason};
pub use stream::MessagesStream;

#[cfg(test)]
use super::NormalizedRun;
#[cfg(test)]
use super::error::ApiError;
use super::ids;

/// The top-level fields of a `POST /v1/messages` body; any other is a 400.
pub const MESSAGES_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "system",
    "stream",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "tools",
    "tool_choice",
    "thinking",
    "service_tier",
];

/// The top-level fields of a `POST /v1/messages/count_tokens` body.
pub const COUNT_TOKENS_FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
];

/// Most stop sequences one request may give.
pub const MAX_STOP_SEQUENCES: usize = 16;

/// The image media types Anthropic accepts.
pub const IMAGE_MEDIA_TYPES: &[&str] = &["image/jpeg", "image/png", "image/gif", "image/webp"];

/// The smallest `thinking.budget_tokens` (Anthropic's).
pub const MIN_THINKING_BUDGET_TOKENS: u32 = 1_024;

/// `thinking.budget_tokens` below this is the reasoning effort `low`.
pub const MEDIUM_THINKING_BUDGET_TOKENS: u32 = 4_096;

/// `thinking.budget_tokens` from this on is the reasoning effort `high`.
pub const HIGH_THINKING_BUDGET_TOKENS: u32 = 16_384;

/// The longest tool name (Anthropic's).
pub const MAX_TOOL_NAME_CHARS: usize = 128;

/// The keep-alive sent after a silence: Anthropic's `ping` event.
pub const PING: &[u8] = b"event: ping\ndata: {\"type\":\"ping\"}\n\n";

/// `msg_<16 hex>`: a Messages API message id.
pub fn message_id(seed: u64) -> String {
    ids::message_id(seed)
}

#[cfg(test)]
mod tests;
