//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic
//! Messages API as a normalized run, one concern per file:
//!
//! * [`request`]: [`parse_messages_request`] turns a body into a
//!   [`NormalizedRun`]: `system` (a string or text blocks) becomes the first
//!   message; each message's blocks become the run's messages (`text`,
//!   `image` by base64 or URL, `document` with a text source as text and
//!   a PDF (base64 or URL) as the message's document, `tool_use` as the
//!   assistant's tool calls, each `tool_result` as one tool message with
//!   its text, images and documents before the rest of its user turn);
//!   `tools`, `tool_choice`, `stop_sequences`, `max_tokens` (required),
//!   `temperature`, `top_p`, `top_k`, `metadata.user_id` and `thinking`
//!   (as a reasoning effort) become the run's parameters; the
//!   `anthropic-beta` header's features ([`parse_betas`]) go to Messages
//!   providers. What the run cannot carry (a file id, citations, a server
//!   tool) is a 400 naming the field; an unknown top-level field is a 400,
//!   as Anthropic answers it. Earlier turns' `thinking` blocks are left
//!   out, as Anthropic leaves them out of the context. Images and PDFs are
//!   bounded per request
//!   ([`MAX_IMAGES_PER_REQUEST`](super::surface::MAX_IMAGES_PER_REQUEST),
//!   [`MAX_DOCUMENTS_PER_REQUEST`]) and in bytes with the body; a provider
//!   that cannot take one is not chosen (`surface::provider_refusal`: an
//!   OpenAI-compatible provider takes a PDF as a `file` part of data, not
//!   by URL; Ollama takes none).
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
//! event: a provider's usage reported before its answer is in it (a
//! Messages provider's prompt and cache counts; an OpenAI-compatible
//! server's first chunk's when the Node asks it for usage on every chunk,
//! `[[providers]] continuous_usage`, as vLLM gives it). Otherwise (an
//! OpenAI-compatible stream says its usage only at its end) it carries
//! zero tokens and `null` cache counts, and the final `message_delta`
//! carries the totals, `input_tokens` and the cache counts included, as
//! Anthropic's does: the SDKs' accumulated message takes them from there.
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
pub use request::{parse_betas, parse_count_tokens_request, parse_messages_request};
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

/// The request header naming the Messages API beta features a client
/// asks for.
pub const BETA_HEADER: &str = "anthropic-beta";

/// Most beta features one request may name in `anthropic-beta`.
pub const MAX_BETAS: usize = 16;

/// The longest beta feature name.
pub const MAX_BETA_NAME_BYTES: usize = 128;

/// Most PDF documents one request may attach, over all its messages and
/// tool results (their bytes are bounded with the body's, R-LIM-2).
pub const MAX_DOCUMENTS_PER_REQUEST: usize = 16;

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
