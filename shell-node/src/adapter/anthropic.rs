//! The `anthropic` adapter: Anthropic's Messages API (`POST /v1/messages`),
//! at Anthropic (the key, a managed credential lease's included, goes in
//! `x-api-key`, with `anthropic-version`) or any Messages-compatible server.
//! Runs are streamed Messages calls, or one non-streamed call where core
//! says so ([`AnswerCall::for_run`]: a client that takes the answer whole);
//! the probe is `GET /v1/models`.
//!
//! A run becomes a Messages request ([`request_json`]): the system turns
//! are `system`; tool results are `tool_result` blocks of user turns; an
//! assistant's tool calls are `tool_use` blocks; images are `image`
//! blocks (base64 from a `data:` URL, else by URL) and PDFs `document`
//! blocks, in a user turn before its text and in a tool result after
//! it; the client's beta features are the call's `anthropic-beta`; `stop` is
//! `stop_sequences`; a reasoning effort is a `thinking` budget; `top_k`
//! and the end user (`user`, as `metadata.user_id`) pass through; a
//! message's or tool's prompt-cache breakpoint is `cache_control` on its
//! last block (the system prompt then a block of its own). The
//! Messages API requires `max_tokens`: a run without one asks for
//! [`DEFAULT_MAX_TOKENS`].
//!
//! The answer's events become run events ([`EventState`]): `text_delta`
//! text, `thinking_delta` reasoning, each `tool_use` block one tool call
//! (`input_json_delta` its arguments; streamed blocks that repeat the last
//! call's id go on with that call, as LiteLLM's proxy splits one call from
//! llama-cpp-python into a block per piece), `message_delta` the usage and the
//! stop reason (`end_turn`, `stop_sequence`, `max_tokens`, `tool_use`,
//! `refusal`), `message_stop` the end; an `error` event is the provider's
//! failure, with its message. The prompt's count is the Messages API's
//! `input_tokens` plus the cache's `cache_creation_input_tokens` and
//! `cache_read_input_tokens` (every prompt token, as the other APIs count
//! them); the two cache counts ride along as the run usage's cache parts
//! when the provider reports them.

use std::collections::HashMap;

use futures::StreamExt;
use futures::stream::BoxStream;
use iop_core::node::provider::{AnswerCall, AnswerCallFacts};
use iop_core::provider_usage::{PromptCounting, ReportedCounts, UsageReport};
use iop_wire::{
    CacheControl, ChatMessage, Document, DocumentSource, ExecutionFailure, FinishReason, Role,
    RunApi, RunEventKind, RunRequest, ToolCallDelta, Usage,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::client::ProviderResponse;
use super::sse::{EventTooLarge, SseDecoder};
use super::{
    HttpTarget, ProbeVerdict, ProviderCallError, failed_run, http_run, probe_http, whole_answer_run,
};

/// The `max_tokens` of a run that gives none (the Messages API requires
/// one).
pub const DEFAULT_MAX_TOKENS: u32 = 4096;

/// The `anthropic-version` sent when the call carries none.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// The header naming the beta features a call asks for.
pub const BETA_HEADER: &str = "anthropic-beta";

/// The smallest `thinking.budget_tokens` the Messages API takes.
pub const MIN_THINKING_BUDGET_TOKENS: u32 = 1_024;

/// The `thinking` budget of the reasoning effort `medium`.
pub const MEDIUM_THINKING_BUDGET_TOKENS: u32 = 4_096;

/// The `thinking` budget of the reasoning effort `high` (and above).
pub const HIGH_THINKING_BUDGET_TOKENS: u32 = 16_384;

/// A run as a Messages call: streamed, or one non-streamed call.
pub(super) fn run(
    target: HttpTarget,
    mut req: RunRequest,
    auth: Option<String>,
) -> BoxStream<'static, RunEventKind> {
    if !target.cache_control {
        without_cache_breakpoints(&mut req);
    }
    if req.api == RunApi::Embeddings {
        return failed_run(ProviderCallError::InvalidRequest(
            "the Messages API has no embeddings",
        ));
    }
    let whole = AnswerCall::for_run(AnswerCallFacts {
        whole_answer: req.params.whole_answer,
        durable: req.park.is_some(),
        // A Messages stream ends with its usage.
        stream_usage: true,
        whole_calls: target.whole_calls,
    }) == AnswerCall::Whole;
    let body = match request_json(&req, !whole) {
        Ok(body) => body.to_string().into_bytes(),
        Err(e) => return failed_run(e),
    };
    let mut request = target.run_request("/v1/messages", body);
    if !req.params.betas.is_empty() {
        // The client's beta features (its `anthropic-beta`), as it named
        // them.
        request = request.header(
            http::header::HeaderName::from_static(BETA_HEADER),
            &req.params.betas.join(","),
        );
    }
    if whole {
        return http_run(target, request, auth, req.session_id, decode_whole);
    }
    request = request.header(http::header::ACCEPT, "text/event-stream");
    http_run(target, request, auth, req.session_id, decode)
}

/// `req` without its prompt-cache breakpoints (`[[providers]]
/// cache_control = false`): its system prompt a string again, its turns
/// as they are without one.
fn without_cache_breakpoints(req: &mut RunRequest) {
    for m in &mut req.messages {
        m.cache_control = None;
    }
    for t in &mut req.tools {
        t.cache_control = None;
    }
}

/// `GET /v1/models` -> `{data: [{id}]}` (Anthropic's model list, and the
/// OpenAI shape Messages-compatible servers answer).
pub(super) async fn probe(target: &HttpTarget) -> ProbeVerdict {
    probe_http(target, "/v1/models", super::openai::parse_models).await
}

/// The Messages request a run stands for (streamed or not). A chat's
/// messages are its turns; a generate or completion run is one user turn
/// (its system turns the `system`). Fill-in-the-middle (`suffix`) has no
/// Messages form.
pub fn request_json(req: &RunRequest, stream: bool) -> Result<Value, ProviderCallError> {
    if req.params.suffix.is_some() {
        return Err(ProviderCallError::InvalidRequest(
            "the Messages API has no fill-in-the-middle",
        ));
    }
    let p = &req.params;
    let mut body = Map::new();
    body.insert("model".into(), json!(req.model));
    let (system, system_cache, messages) = match req.api {
        RunApi::Chat => {
            let system: Vec<&ChatMessage> = req
                .messages
                .iter()
                .filter(|m| m.role == Role::System)
                .collect();
            let text: Vec<&str> = system.iter().map(|m| m.content.as_str()).collect();
            let turns = req
                .messages
                .iter()
                .filter(|m| m.role != Role::System)
                .map(message_json)
                .collect::<Result<Vec<_>, _>>()?;
            let cache = system.last().and_then(|m| m.cache_control);
            (text.join("\n"), cache, turns)
        }
        RunApi::Generate | RunApi::Completion | RunApi::Embeddings => {
            let (system, prompt) = super::openai::generate_prompt(&req.messages);
            (
                system.unwrap_or_default(),
                None,
                vec![json!({"role": "user", "content": prompt})],
            )
        }
    };
    match system_cache {
        // A breakpoint needs a block to carry it.
        Some(cache) => {
            let block = cached(json!({"type": "text", "text": system}), Some(cache));
            body.insert("system".into(), json!([block]));
        }
        None if !system.is_empty() => {
            body.insert("system".into(), json!(system));
        }
        None => {}
    }
    body.insert("messages".into(), Value::Array(messages));
    let mut max_tokens = p.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if let Some(effort) = p.reasoning_effort.as_deref().filter(|e| *e != "none") {
        let budget = match effort {
            "minimal" | "low" => MIN_THINKING_BUDGET_TOKENS,
            "medium" => MEDIUM_THINKING_BUDGET_TOKENS,
            _ => HIGH_THINKING_BUDGET_TOKENS,
        };
        // The budget is part of `max_tokens`, which must exceed it.
        max_tokens = max_tokens.max(budget.saturating_add(1));
        body.insert(
            "thinking".into(),
            json!({"type": "enabled", "budget_tokens": budget}),
        );
    }
    body.insert("max_tokens".into(), json!(max_tokens));
    if stream {
        body.insert("stream".into(), json!(true));
    }
    if !p.stop.is_empty() {
        body.insert("stop_sequences".into(), json!(p.stop));
    }
    if let Some(t) = p.temperature {
        body.insert("temperature".into(), json!(t));
    }
    if let Some(t) = p.top_p {
        body.insert("top_p".into(), json!(t));
    }
    if req.api == RunApi::Chat && !req.tools.is_empty() {
        let tools = req
            .tools
            .iter()
            .map(|t| {
                let schema = match t.parameters_json.as_deref() {
                    Some(s) => serde_json::from_str::<Value>(s).map_err(|_| {
                        ProviderCallError::InvalidRequest("tool parameters are not JSON")
                    })?,
                    None => json!({"type": "object"}),
                };
                let mut tool = json!({"name": t.name, "input_schema": schema});
                if let Some(d) = &t.description {
                    tool["description"] = json!(d);
                }
                Ok(cached(tool, t.cache_control))
            })
            .collect::<Result<Vec<_>, ProviderCallError>>()?;
        body.insert("tools".into(), Value::Array(tools));
        if let Some(choice) = tool_choice_json(p.tool_choice_json.as_deref(), p.parallel_tool_calls)
        {
            body.insert("tool_choice".into(), choice);
        }
    }
    let extra: Map<String, Value> = match p.extra_json.as_deref() {
        None => Map::new(),
        Some(extra) => match serde_json::from_str(extra) {
            Ok(Value::Object(extra)) => extra,
            _ => {
                return Err(ProviderCallError::InvalidRequest(
                    "pass-through fields are not a JSON object",
                ));
            }
        },
    };
    for (key, value) in extra {
        match key.as_str() {
            "top_k" => {
                body.insert(key, value);
            }
            "user" => {
                body.insert("metadata".into(), json!({"user_id": value}));
            }
            // The Edge lets only answer-neutral fields through besides
            // these (surface::provider_refusal): the Messages API has none
            // of them.
            _ => {}
        }
    }
    Ok(Value::Object(body))
}

/// `tool_choice` from the run's (OpenAI's) vocabulary: `auto`,
/// `required` (`any`), `none`, one function (`tool`); with
/// `parallel_tool_calls` as `disable_parallel_tool_use`.
fn tool_choice_json(choice: Option<&str>, parallel: Option<bool>) -> Option<Value> {
    let mut rendered = match choice {
        None => json!({"type": "auto"}),
        Some(choice) => {
            let choice: Value =
                serde_json::from_str(choice).unwrap_or_else(|_| Value::String(choice.to_owned()));
            match choice.as_str() {
                Some("required") => json!({"type": "any"}),
                Some("none") => json!({"type": "none"}),
                Some(_) => json!({"type": "auto"}),
                None => json!({"type": "tool", "name": choice["function"]["name"]}),
            }
        }
    };
    match parallel {
        Some(parallel) => rendered["disable_parallel_tool_use"] = json!(!parallel),
        None if choice.is_none() => return None,
        None => {}
    }
    Some(rendered)
}

/// `block` with a prompt-cache breakpoint (`cache_control`), if any.
fn cached(mut block: Value, cache: Option<CacheControl>) -> Value {
    if let Some(cache) = cache {
        let mut control = json!({"type": "ephemeral"});
        if let Some(ttl) = cache.ttl {
            control["ttl"] = json!(ttl.as_str());
        }
        block["cache_control"] = control;
    }
    block
}

/// One run message (not a system one) as a Messages turn; its cache
/// breakpoint on its last block.
fn message_json(m: &ChatMessage) -> Result<Value, ProviderCallError> {
    let mut turn = turn_json(m)?;
    if let Some(cache) = m.cache_control {
        let role = turn["role"].clone();
        let mut blocks = match turn["content"].take() {
            Value::Array(blocks) => blocks,
            text => vec![json!({"type": "text", "text": text})],
        };
        if let Some(last) = blocks.pop() {
            blocks.push(cached(last, Some(cache)));
        }
        turn = json!({"role": role, "content": blocks});
    }
    Ok(turn)
}

/// One run message as a Messages turn, before its breakpoint.
fn turn_json(m: &ChatMessage) -> Result<Value, ProviderCallError> {
    Ok(match m.role {
        Role::Tool => {
            // Text alone is a string; with images or documents, blocks.
            let content = if m.images.is_empty() && m.documents.is_empty() {
                json!(m.content)
            } else {
                let mut blocks = Vec::with_capacity(1 + m.images.len() + m.documents.len());
                if !m.content.is_empty() {
                    blocks.push(json!({"type": "text", "text": m.content}));
                }
                blocks.extend(attachment_blocks(m));
                Value::Array(blocks)
            };
            json!({"role": "user", "content": [{
                "type": "tool_result",
                "tool_use_id": m.tool_call_id.as_deref().unwrap_or_default(),
                "content": content,
            }]})
        }
        Role::Assistant if !m.tool_calls.is_empty() => {
            let mut blocks = Vec::with_capacity(m.tool_calls.len() + 1);
            if !m.content.is_empty() {
                blocks.push(json!({"type": "text", "text": m.content}));
            }
            for call in &m.tool_calls {
                let input = match call.arguments.trim() {
                    "" => json!({}),
                    args => serde_json::from_str::<Value>(args)
                        .ok()
                        .filter(Value::is_object)
                        .ok_or(ProviderCallError::InvalidRequest(
                            "tool call arguments are not a JSON object",
                        ))?,
                };
                blocks.push(
                    json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input}),
                );
            }
            json!({"role": "assistant", "content": blocks})
        }
        Role::Assistant => json!({"role": "assistant", "content": m.content}),
        Role::User | Role::System if !m.images.is_empty() || !m.documents.is_empty() => {
            // Images and documents before the text, as Anthropic advises.
            let mut blocks: Vec<Value> = attachment_blocks(m).collect();
            if !m.content.is_empty() {
                blocks.push(json!({"type": "text", "text": m.content}));
            }
            json!({"role": "user", "content": blocks})
        }
        Role::User | Role::System => json!({"role": "user", "content": m.content}),
    })
}

/// A message's images, then its documents, as Messages blocks.
fn attachment_blocks(m: &ChatMessage) -> impl Iterator<Item = Value> + '_ {
    m.images
        .iter()
        .map(|url| image_json(url))
        .chain(m.documents.iter().map(document_json))
}

/// A PDF as a document block: its base64 data or its URL, with its title
/// and context.
fn document_json(document: &Document) -> Value {
    let source = match &document.source {
        DocumentSource::PdfBase64(data) => json!({
            "type": "base64",
            "media_type": DocumentSource::PDF_MEDIA_TYPE,
            "data": data,
        }),
        DocumentSource::PdfUrl(url) => json!({"type": "url", "url": url}),
    };
    let mut block = json!({"type": "document", "source": source});
    if let Some(title) = &document.title {
        block["title"] = json!(title);
    }
    if let Some(context) = &document.context {
        block["context"] = json!(context);
    }
    block
}

/// An image URL as an image block: a `data:` URL's base64, else the URL.
fn image_json(url: &str) -> Value {
    let source = match url
        .strip_prefix("data:")
        .and_then(|rest| rest.split_once(";base64,"))
    {
        Some((media_type, data)) => {
            json!({"type": "base64", "media_type": media_type, "data": data})
        }
        None => json!({"type": "url", "url": url}),
    };
    json!({"type": "image", "source": source})
}

/// The finish reason of a Messages `stop_reason`.
pub(crate) fn finish_reason(stop_reason: &str) -> FinishReason {
    match stop_reason {
        "max_tokens" | "model_context_window_exceeded" => FinishReason::Length,
        "stop_sequence" => FinishReason::StopSequence,
        "tool_use" => FinishReason::ToolCalls,
        "refusal" => FinishReason::ContentFilter,
        // `end_turn`, `pause_turn` and any newer reason.
        _ => FinishReason::Stop,
    }
}

/// The run events of a successful Messages stream.
fn decode(response: ProviderResponse) -> BoxStream<'static, RunEventKind> {
    Box::pin(async_stream::stream! {
        let mut bytes = response.bytes_stream();
        let mut sse = SseDecoder::default();
        let mut state = EventState::default();
        let mut events = Vec::new();
        loop {
            loop {
                let data = match sse.next_data() {
                    Ok(Some(data)) => Ok(data),
                    Ok(None) => break,
                    Err(too_large) => Err(too_large),
                };
                let end = state.feed(data, &mut events);
                for event in events.drain(..) {
                    yield event;
                }
                if let Some(end) = end {
                    // After `message_stop` only the body's framing is left;
                    // a failure closes the connection.
                    if !matches!(end, RunEventKind::Failed(_)) {
                        bytes.finish();
                    }
                    yield end;
                    return;
                }
            }
            match bytes.next().await {
                Some(Ok(chunk)) => sse.push(&chunk),
                Some(Err(e)) => {
                    yield RunEventKind::Failed(super::error::from_http(e, true).failure());
                    return;
                }
                // Without `message_stop` the answer did not end.
                None => {
                    yield RunEventKind::Failed(ProviderCallError::Truncated.failure());
                    return;
                }
            }
        }
    })
}

/// The run events of one non-streamed Messages answer.
fn decode_whole(response: ProviderResponse) -> BoxStream<'static, RunEventKind> {
    whole_answer_run(response, whole_answer)
}

/// The run events of a whole Messages answer `body`, and its terminal.
fn whole_answer(body: &[u8]) -> Result<(Vec<RunEventKind>, RunEventKind), ProviderCallError> {
    let mut state = EventState::default();
    let mut events = Vec::new();
    state.on_whole(body, &mut events)?;
    Ok((events, state.completed()))
}

/// The run events a Messages stream whose events carry `data` stands
/// for, its terminal last: what a streamed call yields after `Started`
/// (a stream without `message_stop` is truncated). For checking the
/// translation (the Edge's Messages answers read back as the runs they
/// render).
pub fn stream_events<'a>(data: impl IntoIterator<Item = &'a [u8]>) -> Vec<RunEventKind> {
    let mut state = EventState::default();
    let mut events = Vec::new();
    for data in data {
        if let Some(end) = state.feed(Ok(data), &mut events) {
            events.push(end);
            return events;
        }
    }
    events.push(RunEventKind::Failed(ProviderCallError::Truncated.failure()));
    events
}

/// The run events a whole Messages answer `body` stands for, its terminal
/// last: what a non-streamed call yields after `Started`.
pub fn whole_events(body: &[u8]) -> Vec<RunEventKind> {
    match whole_answer(body) {
        Ok((mut events, terminal)) => {
            events.push(terminal);
            events
        }
        Err(e) => vec![RunEventKind::Failed(e.failure())],
    }
}

/// Why decoding stopped: a typed call failure, or the provider's own
/// `error` event with its message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Failure {
    Call(ProviderCallError),
    /// An `error` event: the provider's message, if it gave one.
    Reported(Option<String>),
}

impl Failure {
    fn failure(&self) -> ExecutionFailure {
        match self {
            Failure::Call(e) => e.failure(),
            Failure::Reported(message) => {
                let mut failure = ProviderCallError::Reported.failure();
                failure.provider_message = message.as_deref().and_then(iop_wire::provider_message);
                failure
            }
        }
    }
}

impl From<ProviderCallError> for Failure {
    fn from(e: ProviderCallError) -> Self {
        Failure::Call(e)
    }
}

/// The most content blocks one answer may open (each tool call is one).
pub const MAX_CONTENT_BLOCKS: usize = 1024;

/// What a Messages answer said so far.
#[derive(Debug, Default)]
struct EventState {
    /// A stream's content block index -> tool call index, for its
    /// `tool_use` blocks (at most [`MAX_CONTENT_BLOCKS`]).
    tool_blocks: HashMap<u64, u32>,
    /// Tool calls so far: the next one's index.
    tool_calls: u32,
    /// The last tool call a stream started. A server may split one call
    /// into several `tool_use` blocks of the call's id, each with a piece
    /// of its input (LiteLLM's proxy does, in front of llama-cpp-python,
    /// whose chunks all repeat the call's id): they are that one call, as
    /// ids name calls.
    last_tool: Option<StreamedCall>,
    blocks_seen: usize,
    /// The answer's counts (the prompt's from `message_start`; a
    /// `message_delta` may update each count: its counts are cumulative,
    /// the ones it leaves out keep their value).
    counts: ReportedCounts,
    finish: Option<FinishReason>,
    done: bool,
}

/// A streamed tool call: its id, its current block and its call index.
#[derive(Debug)]
struct StreamedCall {
    id: String,
    block: u64,
    call: u32,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StreamEvent {
    MessageStart {
        message: MessageHead,
    },
    ContentBlockStart {
        index: u64,
        content_block: Block,
    },
    ContentBlockDelta {
        index: u64,
        delta: BlockDelta,
    },
    ContentBlockStop {},
    MessageDelta {
        #[serde(default)]
        delta: MessageDeltaBody,
        #[serde(default)]
        usage: Option<UsageReport>,
    },
    MessageStop {},
    Ping {},
    Error {
        #[serde(default)]
        error: Option<ErrorBody>,
    },
    #[serde(other)]
    Unknown,
}

#[derive(Deserialize)]
struct MessageHead {
    #[serde(default)]
    usage: Option<UsageReport>,
}

#[derive(Deserialize, Default)]
struct MessageDeltaBody {
    #[serde(default)]
    stop_reason: Option<String>,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    message: Option<String>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        #[serde(default)]
        text: String,
    },
    Thinking {
        #[serde(default)]
        thinking: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Option<Value>,
    },
    /// `redacted_thinking`, server tool blocks, anything newer: nothing a
    /// run carries.
    #[serde(other)]
    Other,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BlockDelta {
    TextDelta {
        text: String,
    },
    ThinkingDelta {
        thinking: String,
    },
    InputJsonDelta {
        partial_json: String,
    },
    /// `signature_delta`, `citations_delta`, anything newer.
    #[serde(other)]
    Other,
}

/// A whole (non-streamed) Messages answer.
#[derive(Deserialize)]
struct WholeMessage {
    #[serde(default)]
    content: Vec<Block>,
    #[serde(default)]
    stop_reason: Option<String>,
    #[serde(default)]
    usage: Option<UsageReport>,
}

impl EventState {
    /// Take one SSE event's data (or an event over the bound): its
    /// non-terminal run events into `out`, and the terminal once the
    /// answer ended (its `message_stop`, an `error` event, a malformed
    /// event; then nothing of that event's is in `out`).
    fn feed(
        &mut self,
        data: Result<&[u8], EventTooLarge>,
        out: &mut Vec<RunEventKind>,
    ) -> Option<RunEventKind> {
        let before = out.len();
        let decoded = match data {
            Ok(data) => self.on_event(data, out),
            Err(EventTooLarge) => Err(Failure::Call(ProviderCallError::Malformed)),
        };
        if let Err(e) = decoded {
            out.truncate(before);
            return Some(RunEventKind::Failed(e.failure()));
        }
        self.done.then(|| self.completed())
    }

    /// Decode one SSE event's data into non-terminal run events.
    fn on_event(&mut self, data: &[u8], out: &mut Vec<RunEventKind>) -> Result<(), Failure> {
        let event: StreamEvent =
            serde_json::from_slice(data).map_err(|_| ProviderCallError::Malformed)?;
        match event {
            StreamEvent::MessageStart { message } => {
                if let Some(usage) = message.usage {
                    self.usage(&usage, out);
                }
            }
            StreamEvent::ContentBlockStart {
                index,
                content_block,
            } => self.block(Some(index), content_block, out)?,
            StreamEvent::ContentBlockDelta { index, delta } => match delta {
                BlockDelta::TextDelta { text } if !text.is_empty() => {
                    out.push(RunEventKind::TextDelta(text));
                }
                BlockDelta::ThinkingDelta { thinking } if !thinking.is_empty() => {
                    out.push(RunEventKind::ReasoningDelta(thinking));
                }
                BlockDelta::InputJsonDelta { partial_json } if !partial_json.is_empty() => {
                    let call = *self
                        .tool_blocks
                        .get(&index)
                        .ok_or(ProviderCallError::Malformed)?;
                    out.push(RunEventKind::ToolCallDelta(ToolCallDelta {
                        index: call,
                        id: None,
                        name: None,
                        arguments_delta: partial_json,
                    }));
                }
                _ => {}
            },
            StreamEvent::MessageDelta { delta, usage } => {
                if let Some(reason) = delta.stop_reason {
                    self.finish = Some(finish_reason(&reason));
                }
                if let Some(usage) = usage {
                    self.usage(&usage, out);
                }
            }
            StreamEvent::MessageStop {} => self.done = true,
            StreamEvent::Error { error } => {
                return Err(Failure::Reported(error.and_then(|e| e.message)));
            }
            StreamEvent::ContentBlockStop {} | StreamEvent::Ping {} | StreamEvent::Unknown => {}
        }
        Ok(())
    }

    /// Decode one whole answer into non-terminal run events.
    fn on_whole(
        &mut self,
        body: &[u8],
        out: &mut Vec<RunEventKind>,
    ) -> Result<(), ProviderCallError> {
        let message: WholeMessage =
            serde_json::from_slice(body).map_err(|_| ProviderCallError::Malformed)?;
        for block in message.content {
            self.block(None, block, out)?;
        }
        self.finish = message.stop_reason.as_deref().map(finish_reason);
        if let Some(usage) = message.usage {
            self.counts.take(&usage, true);
        }
        self.done = true;
        Ok(())
    }

    /// A content block's start (streamed, at `index`) or a whole answer's
    /// block: its text, reasoning or tool call.
    fn block(
        &mut self,
        index: Option<u64>,
        block: Block,
        out: &mut Vec<RunEventKind>,
    ) -> Result<(), ProviderCallError> {
        if let (Some(index), Block::ToolUse { id, .. }) = (index, &block)
            && let Some(last) = self.last_tool.as_mut()
            && last.id == *id
        {
            // The same call again in a block of its own: its input goes
            // on in this block. The last block stopped, so only this one
            // is kept (no growth however many blocks a call takes).
            self.tool_blocks.remove(&last.block);
            self.tool_blocks.insert(index, last.call);
            last.block = index;
            return Ok(());
        }
        self.blocks_seen += 1;
        if self.blocks_seen > MAX_CONTENT_BLOCKS {
            return Err(ProviderCallError::Malformed);
        }
        match block {
            Block::Text { text } if !text.is_empty() => out.push(RunEventKind::TextDelta(text)),
            Block::Thinking { thinking } if !thinking.is_empty() => {
                out.push(RunEventKind::ReasoningDelta(thinking));
            }
            Block::ToolUse { id, name, input } => {
                let call = self.tool_calls;
                self.tool_calls += 1;
                // A whole answer's blocks have no index: nothing refers to
                // them later.
                if let Some(index) = index {
                    self.tool_blocks.insert(index, call);
                    self.last_tool = Some(StreamedCall {
                        id: id.clone(),
                        block: index,
                        call,
                    });
                }
                // A stream starts a call with `{}` and sends its input as
                // deltas; a whole answer has the input here.
                let arguments_delta = match input {
                    Some(Value::Object(map)) if map.is_empty() && index.is_some() => String::new(),
                    Some(input) => input.to_string(),
                    None => String::new(),
                };
                out.push(RunEventKind::ToolCallDelta(ToolCallDelta {
                    index: call,
                    id: Some(id),
                    name: Some(name),
                    arguments_delta,
                }));
            }
            Block::Text { .. } | Block::Thinking { .. } | Block::Other => {}
        }
        Ok(())
    }

    /// A usage report: the prompt's tokens once known, the output's as
    /// they grow; a run event once both are known.
    fn usage(&mut self, usage: &UsageReport, out: &mut Vec<RunEventKind>) {
        self.counts.take(usage, true);
        if let Some(usage) = self.run_usage() {
            out.push(RunEventKind::Usage(usage));
        }
    }

    fn run_usage(&self) -> Option<Usage> {
        self.counts.usage(PromptCounting::Parts)
    }

    fn completed(&self) -> RunEventKind {
        let fallback = if self.tool_calls == 0 {
            FinishReason::Stop
        } else {
            FinishReason::ToolCalls
        };
        RunEventKind::Completed {
            finish_reason: self.finish.unwrap_or(fallback),
            usage: self.run_usage(),
        }
    }
}

#[cfg(test)]
mod tests;
