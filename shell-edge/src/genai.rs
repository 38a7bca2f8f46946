//! The OpenTelemetry GenAI semantic conventions as iop speaks them
//! (development status; names as of semconv 1.41): attribute and metric
//! names, the operation of each route, and the closed labels of one
//! operation's metrics. [`crate::observe`] sets them on the request span;
//! [`crate::metrics`] records the GenAI client metrics.
//!
//! The prompt cache's counts, when the provider reported them, are the
//! span's `gen_ai.usage.cache_read.input_tokens` and
//! `gen_ai.usage.cache_creation.input_tokens` (parts of
//! `gen_ai.usage.input_tokens`, as the conventions say). The token usage
//! histogram's `gen_ai.token.type` has the conventions' two values,
//! `input` and `output`; the cache counts have their own counters, as the
//! newer GenAI token metrics name them
//! (`gen_ai.client.inference.usage.cache_read.input_tokens` and
//! `gen_ai.client.inference.usage.cache_write.input_tokens`, with
//! `gen_ai.token.modality` `unknown`: providers do not split them by
//! modality), added to only when the provider reported the count.

/// The operation (`chat`, `text_completion`, `embeddings`).
pub const OPERATION_NAME: &str = "gen_ai.operation.name";
/// The provider's API flavour: the adapter (`openai`, `anthropic`, ...).
pub const PROVIDER_NAME: &str = "gen_ai.provider.name";
/// The model asked for (its configured route).
pub const REQUEST_MODEL: &str = "gen_ai.request.model";
/// The model that answered (its configured route).
pub const RESPONSE_MODEL: &str = "gen_ai.response.model";
/// Input tokens the answer reported.
pub const USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
/// Output tokens the answer reported.
pub const USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
/// Of the input tokens, those the provider read from its prompt cache.
pub const USAGE_CACHE_READ_INPUT_TOKENS: &str = "gen_ai.usage.cache_read.input_tokens";
/// Of the input tokens, those the provider wrote to its prompt cache.
pub const USAGE_CACHE_CREATION_INPUT_TOKENS: &str = "gen_ai.usage.cache_creation.input_tokens";
/// Why generation finished (one per choice).
pub const RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
/// The GenAI server: the Node that reached the provider.
pub const SERVER_ADDRESS: &str = "server.address";
/// `input` or `output` (token usage metric).
pub const TOKEN_TYPE: &str = "gen_ai.token.type";
/// The closed class of a failed operation.
pub const ERROR_TYPE: &str = "error.type";
/// Histogram of tokens per operation and token type.
pub const CLIENT_TOKEN_USAGE: &str = "gen_ai.client.token.usage";
/// Counter of input tokens read from a provider's prompt cache.
pub const CLIENT_USAGE_CACHE_READ_INPUT_TOKENS: &str =
    "gen_ai.client.inference.usage.cache_read.input_tokens";
/// Counter of input tokens written to a provider's prompt cache.
pub const CLIENT_USAGE_CACHE_WRITE_INPUT_TOKENS: &str =
    "gen_ai.client.inference.usage.cache_write.input_tokens";
/// The modality of counted tokens (the cache counters' label).
pub const TOKEN_MODALITY: &str = "gen_ai.token.modality";
/// The modality of tokens a provider does not break down by modality.
pub const MODALITY_UNKNOWN: &str = "unknown";
/// Histogram of operation durations, seconds.
pub const CLIENT_OPERATION_DURATION: &str = "gen_ai.client.operation.duration";
/// Histogram of the time to a streamed answer's first chunk, seconds.
pub const CLIENT_TIME_TO_FIRST_CHUNK: &str = "gen_ai.client.operation.time_to_first_chunk";
/// The operation of an embeddings request.
pub const OPERATION_EMBEDDINGS: &str = "embeddings";

/// The GenAI operation of a route class: `chat`, `text_completion` or
/// `embeddings`.
pub fn operation_name(route: &str) -> &'static str {
    match route {
        "completions" | "ollama_generate" => "text_completion",
        "embeddings" | "ollama_embed" => OPERATION_EMBEDDINGS,
        _ => "chat",
    }
}

/// The labels of one GenAI operation's metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenAiLabels {
    /// [`operation_name`] of its route.
    pub operation: &'static str,
    /// The adapter of its last attempt's provider.
    pub provider_name: &'static str,
    /// Its configured route model ([`crate::metrics::EdgeMetrics::route_model`]).
    pub model: String,
    /// Its closed failure class, if it failed.
    pub error_type: Option<&'static str>,
}
