//! # The built-in deterministic provider (`mock`)
//!
//! A scripted LLM server for tests, demos and failure drills. It answers
//! deterministically — the text is `tok0 tok1 tok2 ...` — and can be told to
//! be slow, stall, hang, fail with an HTTP status, send garbage, or cut the
//! connection, at an exact token.
//!
//! It runs two ways with the same [`MockScript`] engine:
//!
//! * **in process**: the Node's adapter of kind `mock` runs the
//!   script directly (no HTTP) and yields the same run events and tunnel
//!   frames an `openai` adapter yields against the HTTP mock;
//! * **over HTTP** ([`serve`], [`MockServer`], `iop-node mock-provider`):
//!   OpenAI-compatible `POST /v1/chat/completions` (stream and not, tool
//!   calls, usage with `stream_options.include_usage`), `POST /v1/responses`
//!   (stream and not: `response.created`, `response.output_text.delta`,
//!   `response.completed`), `GET /v1/models`; Ollama-compatible
//!   `POST /api/chat`, `POST /api/generate` (NDJSON), `GET /api/tags`;
//!   Anthropic's Messages API, `POST /v1/messages` (stream and not, tool
//!   use, thinking, `stop_sequences` honoured with `stop_reason`
//!   `stop_sequence`; the key in `x-api-key`); and
//!   `GET /mock/stats` -> `{"requests":N,"probes":M,"in_flight":K,"disconnects":D,...}`
//!   ([`MockStats`]: also the images and documents the calls carried and
//!   the calls with an `anthropic-beta` header, so a test sees what
//!   reached the provider), `POST /mock/reset` (zeroes the counters).
//!
//! As the OpenAI API does, a chat call whose tool message has content
//! parts other than text is refused (HTTP 400). A streamed chat call with
//! `stream_options.continuous_usage_stats` (vLLM's) gets the usage so far
//! on every chunk, the prompt's from the first one on.
//!
//! Served with [`MockApis::MessagesOnly`] (`iop-node mock-provider
//! --messages-only`) it answers only the Messages API and `GET /v1/models`
//! (in Anthropic's shape), as Anthropic's own server does: a Messages-only
//! upstream for the `anthropic` adapter.
//!
//! `requests` counts provider calls (chat, generate, responses, messages) — also those
//! refused with 401 — and never probes (`/v1/models`, `/api/tags`) or stats.
//! `in_flight` counts provider calls being answered; `disconnects` counts
//! those the client abandoned before their answer ended.
//!
//! ## Per-request overrides through the model name
//!
//! The model `mock` (or any name not starting with `mock:`) runs the
//! server's defaults. `mock:` followed by comma-separated `key=value` pairs
//! overrides fields of the defaults for that request only:
//!
//! | key | field | value |
//! | --- | --- | --- |
//! | `tokens` | [`MockScript::tokens`] | text tokens to produce (<= 100000) |
//! | `tps` | [`MockScript::tokens_per_second`] | tokens per second, `0` = as fast as possible |
//! | `prefill_ms` | [`MockScript::prefill_ms`] | delay before the first token (<= 600000) |
//! | `stall_after` | [`MockScript::stall_after`] | hang forever after N tokens |
//! | `resume_after_ms` | [`MockScript::resume_after_ms`] | with `stall_after`: resume after this pause instead of hanging |
//! | `hang_headers` | [`MockScript::hang_before_headers`] | `1`/`true`: never send response headers |
//! | `error` | [`MockScript::http_error`] | answer with this HTTP status (400-599) |
//! | `malformed_after` | [`MockScript::malformed_after`] | send one unparseable chunk after N tokens |
//! | `close_after` | [`MockScript::abrupt_close_after`] | cut the connection without a terminal after N tokens |
//! | `tool_call` | [`MockScript::tool_call`] | `1`/`true`: answer with one tool call |
//! | `usage` | [`MockScript::stream_usage`] | `0`/`false`: streams carry no usage, as llama-cpp-python's |
//! | `cache_read` | [`MockScript::cache_read_tokens`] | report N prompt tokens read from a prompt cache |
//! | `cache_write` | [`MockScript::cache_write_tokens`] | report N prompt tokens written to a prompt cache |
//!
//! Example: `mock:stall_after=3,prefill_ms=200,tokens=5,tps=50`. An unknown
//! key or a bad value is refused with HTTP 400 (in process too).
//! `N` counts tokens already produced: `stall_after=0` hangs before the
//! first token, `stall_after=5` with `tokens=5` hangs before the terminal.
//! A malformed chunk does not end the answer: a correct client must fail on
//! it rather than skip it.
//!
//! Usage is `(ceil(prompt chars / 4), tokens produced)`. A script with
//! cache counts reports them as parts of the prompt's tokens (at most all
//! of them): OpenAI's `usage.prompt_tokens_details.cached_tokens` and
//! `cache_write_tokens`, the Messages API's `cache_read_input_tokens` and
//! `cache_creation_input_tokens` (with `input_tokens` the rest). Without
//! them the OpenAI answers carry no cache counts and the Messages answers
//! zeros, as Anthropic's API reports them.
//!
//! Beyond text, for the normalized request surface: `POST /v1/embeddings`
//! and `POST /api/embed` (and an in-process embeddings run) answers each input with a
//! deterministic [`MOCK_EMBEDDING_DIMENSIONS`]-value vector
//! ([`mock_embedding`]) and a prompt token count; a run asking for a
//! `response_format` answers the JSON object `{"answer": "<the tokens>"}`;
//! a run asking for `logprobs` gets one log probability ([`MOCK_LOGPROB`])
//! per token; a run with a `reasoning_effort` other than `none` reasons
//! first ([`MOCK_REASONING`]; the HTTP server as `reasoning_content`). A request's
//! `max_tokens` (`num_predict`, `max_output_tokens`) below `tokens` truncates
//! the answer with finish reason `length`.

use iop_wire::Usage;

mod cli;
mod messages;
mod script;
mod server;

pub use cli::{MockArgs, run_cli};
pub(crate) use script::continued_tokens;
pub use script::{MOCK_TOOL_CALL_ID, MockPrompt, MockStep, play, token_text};
pub use server::{
    FreshCall, FreshCalls, MockApis, MockServer, MockServerError, MockStats, ServeOptions, serve,
    serve_with,
};
pub(crate) use server::{MockState, router};

/// Values in a mock embedding vector.
pub const MOCK_EMBEDDING_DIMENSIONS: usize = 8;

/// The log probability the mock gives every token.
pub const MOCK_LOGPROB: f32 = -0.25;

/// The reasoning the mock streams before its answer when asked to reason.
pub const MOCK_REASONING: &str = "mock reasoning";

/// A deterministic, unit-length embedding of `text`: equal texts embed
/// equally, different texts (almost always) differently.
pub fn mock_embedding(text: &str) -> Vec<f32> {
    let mut values = [0f32; MOCK_EMBEDDING_DIMENSIONS];
    for (i, byte) in text.bytes().enumerate() {
        values[i % MOCK_EMBEDDING_DIMENSIONS] += f32::from(byte) / 255.0;
    }
    values[MOCK_EMBEDDING_DIMENSIONS - 1] += 1.0;
    let norm = values.iter().map(|v| v * v).sum::<f32>().sqrt();
    values.iter().map(|v| v / norm).collect()
}

/// The model name a mock reports when none is configured.
pub const DEFAULT_MODEL: &str = "mock";

/// The most tokens one answer may be scripted to produce.
pub const MAX_MOCK_TOKENS: u32 = 400_000;

/// The longest scripted prefill.
pub const MAX_MOCK_PREFILL_MS: u64 = 600_000;

/// The fastest scripted pace.
pub const MAX_MOCK_TOKENS_PER_SECOND: f64 = 1_000_000.0;

/// What the mock's health probe endpoints answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ProbeHealth {
    /// 200 with the model list.
    #[default]
    Ok,
    /// 503.
    Unhealthy,
    /// Never answer (until the client gives up).
    Hang,
}

impl ProbeHealth {
    /// The stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeHealth::Ok => "ok",
            ProbeHealth::Unhealthy => "unhealthy",
            ProbeHealth::Hang => "hang",
        }
    }
}

/// A mock's behaviour: the server's defaults, or one request's after
/// model-name overrides.
#[derive(Clone, PartialEq)]
pub struct MockScript {
    /// Pace of tokens; `0` = as fast as possible.
    pub tokens_per_second: f64,
    /// Delay before the first token.
    pub prefill_ms: u64,
    /// How many text tokens to produce.
    pub tokens: u32,
    /// Stop producing after N tokens and hang forever.
    pub stall_after: Option<u32>,
    /// With `stall_after`: pause this long, then carry on (a slow, not dead,
    /// provider) instead of hanging forever.
    pub resume_after_ms: Option<u64>,
    /// Never send response headers.
    pub hang_before_headers: bool,
    /// Answer with this HTTP error status.
    pub http_error: Option<u16>,
    /// Emit one unparseable chunk after N tokens.
    pub malformed_after: Option<u32>,
    /// Close the connection without a terminal after N tokens.
    pub abrupt_close_after: Option<u32>,
    /// Answer with one tool call instead of text.
    pub tool_call: bool,
    /// Report usage in streamed answers when asked
    /// (`stream_options.include_usage`). False plays a server whose streams
    /// never carry usage (llama-cpp-python's); whole answers always do.
    pub stream_usage: bool,
    /// Report this many prompt tokens as read from a prompt cache.
    pub cache_read_tokens: Option<u32>,
    /// Report this many prompt tokens as written to a prompt cache.
    pub cache_write_tokens: Option<u32>,
    /// What the probe endpoints answer.
    pub health: ProbeHealth,
    /// Require `Authorization: Bearer <key>` (never logged).
    pub require_key: Option<String>,
}

impl std::fmt::Debug for MockScript {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockScript")
            .field("tokens_per_second", &self.tokens_per_second)
            .field("prefill_ms", &self.prefill_ms)
            .field("tokens", &self.tokens)
            .field("stall_after", &self.stall_after)
            .field("resume_after_ms", &self.resume_after_ms)
            .field("hang_before_headers", &self.hang_before_headers)
            .field("http_error", &self.http_error)
            .field("malformed_after", &self.malformed_after)
            .field("abrupt_close_after", &self.abrupt_close_after)
            .field("tool_call", &self.tool_call)
            .field("stream_usage", &self.stream_usage)
            .field("cache_read_tokens", &self.cache_read_tokens)
            .field("cache_write_tokens", &self.cache_write_tokens)
            .field("health", &self.health)
            .field(
                "require_key",
                &self.require_key.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl Default for MockScript {
    /// Eight tokens as fast as possible, healthy, no faults.
    fn default() -> Self {
        Self {
            tokens_per_second: 0.0,
            prefill_ms: 0,
            tokens: 8,
            stall_after: None,
            resume_after_ms: None,
            hang_before_headers: false,
            http_error: None,
            malformed_after: None,
            abrupt_close_after: None,
            tool_call: false,
            stream_usage: true,
            cache_read_tokens: None,
            cache_write_tokens: None,
            health: ProbeHealth::Ok,
            require_key: None,
        }
    }
}

/// Why a script or a model-name override was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScriptError {
    /// An override key the mock does not know.
    #[error("unknown mock override `{0}`")]
    UnknownKey(String),
    /// An override without `=`.
    #[error("mock override `{0}` is not key=value")]
    NotKeyValue(String),
    /// A value out of range or of the wrong type.
    #[error("bad value for mock field `{0}`")]
    BadValue(&'static str),
}

/// The longest override key echoed back in an error.
const MAX_ECHOED_KEY: usize = 32;

impl MockScript {
    /// Check every field is in range.
    pub fn validate(&self) -> Result<(), ScriptError> {
        let tps = self.tokens_per_second;
        if !tps.is_finite() || !(0.0..=MAX_MOCK_TOKENS_PER_SECOND).contains(&tps) {
            return Err(ScriptError::BadValue("tps"));
        }
        if self.prefill_ms > MAX_MOCK_PREFILL_MS {
            return Err(ScriptError::BadValue("prefill_ms"));
        }
        if self.tokens > MAX_MOCK_TOKENS {
            return Err(ScriptError::BadValue("tokens"));
        }
        if let Some(status) = self.http_error
            && !(400..=599).contains(&status)
        {
            return Err(ScriptError::BadValue("error"));
        }
        Ok(())
    }

    /// The usage of an answer of `completion_tokens` to a prompt of
    /// `prompt_tokens`, with the script's cache counts (read first, each at
    /// most what is left of the prompt).
    pub fn usage(&self, prompt_tokens: u64, completion_tokens: u64) -> Usage {
        let read = self
            .cache_read_tokens
            .map(|n| u64::from(n).min(prompt_tokens));
        let write = self
            .cache_write_tokens
            .map(|n| u64::from(n).min(prompt_tokens - read.unwrap_or(0)));
        Usage {
            prompt_tokens,
            completion_tokens,
            cache_read_tokens: read,
            cache_write_tokens: write,
        }
    }

    /// The script for one request naming `model` (see the module docs).
    pub fn for_model(&self, model: &str) -> Result<MockScript, ScriptError> {
        let Some(overrides) = model.strip_prefix("mock:") else {
            return Ok(self.clone());
        };
        let mut script = self.clone();
        for pair in overrides.split(',') {
            let Some((key, value)) = pair.split_once('=') else {
                return Err(ScriptError::NotKeyValue(echo(pair)));
            };
            let value = value.trim();
            match key.trim() {
                "tokens" => script.tokens = parse(value, "tokens")?,
                "tps" => script.tokens_per_second = parse(value, "tps")?,
                "prefill_ms" => script.prefill_ms = parse(value, "prefill_ms")?,
                "stall_after" => script.stall_after = Some(parse(value, "stall_after")?),
                "resume_after_ms" => {
                    script.resume_after_ms = Some(parse(value, "resume_after_ms")?);
                }
                "hang_headers" => script.hang_before_headers = flag(value, "hang_headers")?,
                "error" => script.http_error = Some(parse(value, "error")?),
                "malformed_after" => {
                    script.malformed_after = Some(parse(value, "malformed_after")?);
                }
                "close_after" => script.abrupt_close_after = Some(parse(value, "close_after")?),
                "tool_call" => script.tool_call = flag(value, "tool_call")?,
                "usage" => script.stream_usage = flag(value, "usage")?,
                "cache_read" => script.cache_read_tokens = Some(parse(value, "cache_read")?),
                "cache_write" => script.cache_write_tokens = Some(parse(value, "cache_write")?),
                other => return Err(ScriptError::UnknownKey(echo(other))),
            }
        }
        script.validate()?;
        Ok(script)
    }
}

fn echo(s: &str) -> String {
    s.chars().take(MAX_ECHOED_KEY).collect()
}

fn parse<T: std::str::FromStr>(value: &str, field: &'static str) -> Result<T, ScriptError> {
    value.parse().map_err(|_| ScriptError::BadValue(field))
}

fn flag(value: &str, field: &'static str) -> Result<bool, ScriptError> {
    match value {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        _ => Err(ScriptError::BadValue(field)),
    }
}

#[cfg(test)]
mod tests;
