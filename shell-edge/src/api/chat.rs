//! `POST /v1/chat/completions`: request parsing, SSE chunk encoding and the
//! non-streaming `chat.completion` object.
//!
//! * [`parse_chat_request`] turns a body into a normalized [`ChatRequest`].
//!   Unknown top-level fields are accepted and ignored (SDKs send extra
//!   ones); a known field of the wrong type or out of range is a 400 naming
//!   the parameter; a known field whose meaning we cannot honour (`n > 1`,
//!   image content, `response_format`) is a 400 `unsupported_parameter`.
//! * [`ChatStream`] turns run events into `chat.completion.chunk` SSE events
//!   written into the response body; the handler adds the final
//!   `data: [DONE]`.
//! * [`ChatAccumulator`] folds run events into one `chat.completion`.

use std::collections::BTreeSet;

use iop_wire::{
    ChatMessage, FinishReason, GenerationParams, Role, RunApi, RunEventKind, TokenLogprob,
    ToolCall, ToolCallDelta, ToolDefinition, Usage,
};
use serde::Serialize;
use serde_json::{Value, json};

use super::NormalizedRun;
use super::error::ApiError;
use super::framing;
use super::ids;
use super::request_object::{RequestObject, element, parse_body, type_name};
use super::surface::{
    CHAT_PARTS, parse_content, parse_logprobs, parse_reasoning_effort, parse_response_format,
    pass_through_fields,
};
use super::transcript::Transcript;

/// Most tools one request may declare (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// Most stop sequences one request may give (OpenAI's limit).
pub const MAX_STOP_SEQUENCES: usize = 4;

/// Longest accepted model name, in characters.
pub const MAX_MODEL_NAME_CHARS: usize = 256;

pub use super::transcript::MAX_TOOL_CALLS_PER_RUN;

/// The Chat Completions fields the Edge interprets; every other top-level
/// field passes through to the provider ([`pass_through_fields`]).
pub const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "n",
    "response_format",
    "logprobs",
    "top_logprobs",
    "functions",
    "function_call",
    "audio",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "reasoning_effort",
    "parallel_tool_calls",
];

/// A parsed Chat Completions request, ready to become a normalized run.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The run (`developer` messages become system ones; `stream: true`
    /// answers with SSE chunks).
    pub run: NormalizedRun,
    /// `stream_options.include_usage`: send a final usage chunk.
    pub include_usage: bool,
    /// `store`: keep the completion to fetch it later (and resume its
    /// stream).
    pub store: bool,
}

/// Parse a `POST /v1/chat/completions` body.
pub fn parse_chat_request(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let value = parse_body(body)?;
    let root = RequestObject::root(&value)?;

    let model = parse_model(&root)?;
    let stream = root.bool("stream")?.unwrap_or(false);
    let include_usage = match root.object("stream_options")? {
        Some(options) => options.bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    let store = root.bool("store")?.unwrap_or(false);
    super::surface::parse_metadata(&root)?;

    let Some(raw_messages) = root.array("messages")? else {
        return Err(ApiError::missing_parameter("messages"));
    };
    if raw_messages.is_empty() {
        return Err(ApiError::invalid_value(
            "messages",
            "must contain at least one message.",
        ));
    }
    let mut images_left = super::surface::MAX_IMAGES_PER_REQUEST;
    let messages = raw_messages
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(m, element("messages", i), &mut images_left))
        .collect::<Result<Vec<_>, _>>()?;

    let tools = parse_function_tools(&root, "tools")?;

    let choices = root.u32_at_least("n", 1)?.unwrap_or(1);
    let response_format_json = parse_response_format(&root, "response_format")?;
    let (logprobs, top_logprobs) = parse_logprobs(&root, "logprobs")?;
    root.reject("functions", "Use 'tools' instead.")?;
    root.reject("function_call", "Use 'tool_choice' instead.")?;
    root.reject("audio", "Audio output is not supported.")?;

    let max_tokens = match root.u32_at_least("max_completion_tokens", 1)? {
        Some(n) => Some(n),
        None => root.u32_at_least("max_tokens", 1)?,
    };
    let params = GenerationParams {
        temperature: root.number_in("temperature", 0.0, 2.0)?,
        top_p: root.number_in("top_p", 0.0, 1.0)?,
        max_tokens,
        stop: parse_stop(&root, "stop", MAX_STOP_SEQUENCES)?,
        seed: root.i64("seed")?,
        presence_penalty: root.number_in("presence_penalty", -2.0, 2.0)?,
        frequency_penalty: root.number_in("frequency_penalty", -2.0, 2.0)?,
        tool_choice_json: parse_chat_tool_choice(&root)?,
        response_format_json,
        logprobs,
        top_logprobs,
        reasoning_effort: parse_reasoning_effort(&root, "reasoning_effort")?,
        parallel_tool_calls: root.bool("parallel_tool_calls")?,
        suffix: None,
        extra_json: pass_through_fields(&root, CHAT_FIELDS)?,
        whole_answer: !stream,
        betas: Vec::new(),
    };

    Ok(ChatRequest {
        run: NormalizedRun {
            model,
            stream,
            api: RunApi::Chat,
            messages,
            tools,
            params,
            choices,
        },
        include_usage,
        store,
    })
}

/// The required, non-empty, bounded `model` field.
pub(crate) fn parse_model(root: &RequestObject<'_>) -> Result<String, ApiError> {
    let model = root.non_empty_string("model")?;
    if model.chars().count() > MAX_MODEL_NAME_CHARS {
        return Err(ApiError::invalid_value(
            &root.param("model"),
            &format!("must be at most {MAX_MODEL_NAME_CHARS} characters."),
        ));
    }
    Ok(model.to_owned())
}

/// `stop`: a string or an array of at most `max` strings.
pub(crate) fn parse_stop(
    obj: &RequestObject<'_>,
    key: &str,
    max: usize,
) -> Result<Vec<String>, ApiError> {
    let param = obj.param(key);
    match obj.get(key) {
        None => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => {
            if items.len() > max {
                return Err(ApiError::invalid_value(
                    &param,
                    &format!("must contain at most {max} sequences."),
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(ApiError::invalid_type(&element(&param, i), "a string")),
                })
                .collect()
        }
        Some(_) => Err(ApiError::invalid_type(
            &param,
            "a string or an array of strings",
        )),
    }
}

/// Text of `content`: a string, or an array of text parts joined by newlines.
///
/// Non-text parts (images, audio, files) are refused as unsupported, naming
/// `path`, rather than silently dropped.
pub(crate) fn parse_text_content(
    content: &Value,
    path: &str,
    text_part_types: &[&str],
) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                let part = RequestObject::at(part, element(path, i))?;
                let kind = part.required_string("type")?;
                if text_part_types.contains(&kind) {
                    texts.push(part.required_string("text")?.to_owned());
                } else if kind == "refusal" {
                    texts.push(part.required_string("refusal")?.to_owned());
                } else {
                    return Err(ApiError::unsupported_parameter(
                        path,
                        "Only text content is supported.",
                    ));
                }
            }
            Ok(texts.join("\n"))
        }
        other => Err(ApiError::invalid_type(
            path,
            &format!(
                "a string or an array of content parts, not {}",
                type_name(other)
            ),
        )),
    }
}

fn parse_message(
    value: &Value,
    path: String,
    images_left: &mut usize,
) -> Result<ChatMessage, ApiError> {
    let obj = RequestObject::at(value, path)?;
    let role = match obj.non_empty_string("role")? {
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        "function" => {
            return Err(ApiError::unsupported_parameter(
                &obj.param("role"),
                "The 'function' role is not supported; use 'tool'.",
            ));
        }
        _ => {
            return Err(ApiError::invalid_value(
                &obj.param("role"),
                "must be one of 'system', 'developer', 'user', 'assistant' or 'tool'.",
            ));
        }
    };
    let (content, images) = match obj.get("content") {
        Some(content) => {
            let parsed = parse_content(content, &obj.param("content"), CHAT_PARTS, images_left)?;
            (Some(parsed.text), parsed.images)
        }
        None => (None, Vec::new()),
    };
    let name = obj.string("name")?.map(str::to_owned);

    let mut tool_calls = Vec::new();
    if let Some(calls) = obj.array("tool_calls")? {
        if role != Role::Assistant {
            return Err(ApiError::invalid_value(
                &obj.param("tool_calls"),
                "only assistant messages may carry tool calls.",
            ));
        }
        let calls_path = obj.param("tool_calls");
        for (i, call) in calls.iter().enumerate() {
            tool_calls.push(parse_tool_call(call, element(&calls_path, i))?);
        }
    }
    obj.reject("function_call", "Use 'tool_calls' instead.")?;

    let tool_call_id = obj.string("tool_call_id")?.map(str::to_owned);
    if role == Role::Tool && tool_call_id.is_none() {
        return Err(ApiError::missing_parameter(&obj.param("tool_call_id")));
    }

    let content = match content {
        Some(content) => content,
        None if role == Role::Assistant && !tool_calls.is_empty() => String::new(),
        None if role == Role::Assistant && obj.has("refusal") => {
            obj.required_string("refusal")?.to_owned()
        }
        None => return Err(ApiError::missing_parameter(&obj.param("content"))),
    };

    Ok(ChatMessage {
        role,
        content,
        tool_calls,
        tool_call_id: if role == Role::Tool {
            tool_call_id
        } else {
            None
        },
        name,
        images,
        cache_control: None,
        documents: Vec::new(),
    })
}

fn parse_tool_call(value: &Value, path: String) -> Result<ToolCall, ApiError> {
    let obj = RequestObject::at(value, path)?;
    if let Some(kind) = obj.string("type")?
        && kind != "function"
    {
        return Err(ApiError::unsupported_parameter(
            &obj.param("type"),
            "Only 'function' tool calls are supported.",
        ));
    }
    let id = obj.non_empty_string("id")?.to_owned();
    let Some(function) = obj.object("function")? else {
        return Err(ApiError::missing_parameter(&obj.param("function")));
    };
    Ok(ToolCall {
        id,
        name: function.non_empty_string("name")?.to_owned(),
        arguments: function.required_string("arguments")?.to_owned(),
    })
}

/// The `tools` array in the Chat / Ollama shape:
/// `[{"type":"function","function":{"name","description","parameters"}}]`.
pub(crate) fn parse_function_tools(
    root: &RequestObject<'_>,
    key: &str,
) -> Result<Vec<ToolDefinition>, ApiError> {
    let Some(items) = root.array(key)? else {
        return Ok(Vec::new());
    };
    let path = root.param(key);
    if items.len() > MAX_TOOLS {
        return Err(ApiError::invalid_value(
            &path,
            &format!("must contain at most {MAX_TOOLS} tools."),
        ));
    }
    let mut tools = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let tool = RequestObject::at(item, element(&path, i))?;
        if tool.required_string("type")? != "function" {
            return Err(ApiError::unsupported_parameter(
                &tool.param("type"),
                "Only 'function' tools are supported.",
            ));
        }
        let Some(function) = tool.object("function")? else {
            return Err(ApiError::missing_parameter(&tool.param("function")));
        };
        tools.push(parse_function_definition(&function)?);
    }
    Ok(tools)
}

/// `{name, description, parameters}` of one function tool.
pub(crate) fn parse_function_definition(
    function: &RequestObject<'_>,
) -> Result<ToolDefinition, ApiError> {
    let name = function.non_empty_string("name")?.to_owned();
    let description = function.string("description")?.map(str::to_owned);
    let parameters_json = match function.get("parameters") {
        None => None,
        Some(schema @ Value::Object(_)) => Some(schema.to_string()),
        Some(_) => {
            return Err(ApiError::invalid_type(
                &function.param("parameters"),
                "a JSON Schema object",
            ));
        }
    };
    function.bool("strict")?;
    Ok(ToolDefinition {
        name,
        description,
        parameters_json,
        cache_control: None,
    })
}

/// `tool_choice`: `"none" | "auto" | "required"` or
/// `{"type":"function","function":{"name"}}`, kept JSON-encoded.
fn parse_chat_tool_choice(root: &RequestObject<'_>) -> Result<Option<String>, ApiError> {
    let Some(choice) = root.get("tool_choice") else {
        return Ok(None);
    };
    match choice {
        Value::String(mode) => check_tool_choice_mode(mode, "tool_choice")?,
        Value::Object(_) => {
            let obj = RequestObject::at(choice, "tool_choice".to_owned())?;
            if obj.required_string("type")? != "function" {
                return Err(ApiError::unsupported_parameter(
                    &obj.param("type"),
                    "Only 'function' tool choices are supported.",
                ));
            }
            let Some(function) = obj.object("function")? else {
                return Err(ApiError::missing_parameter(&obj.param("function")));
            };
            function.non_empty_string("name")?;
        }
        _ => {
            return Err(ApiError::invalid_type(
                "tool_choice",
                "a string or an object",
            ));
        }
    }
    Ok(Some(choice.to_string()))
}

/// A string `tool_choice` must be `none`, `auto` or `required`.
pub(crate) fn check_tool_choice_mode(mode: &str, param: &str) -> Result<(), ApiError> {
    match mode {
        "none" | "auto" | "required" => Ok(()),
        _ => Err(ApiError::invalid_value(
            param,
            "must be 'none', 'auto', 'required' or a function choice.",
        )),
    }
}

/// A choice's `logprobs` object: `{"content": [{token, logprob, bytes,
/// top_logprobs}]}`.
pub(crate) fn logprobs_json(entries: &[TokenLogprob]) -> Value {
    let entry = |token: &str, logprob: f32| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = entry(&e.token, e.logprob);
            v["top_logprobs"] = e.top.iter().map(|(t, lp)| entry(t, *lp)).collect();
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The OpenAI `usage` object ([`UsageFields`]).
pub(crate) fn usage_json(usage: Usage) -> Value {
    serde_json::to_value(UsageFields::from(usage)).unwrap_or_default()
}

/// An in-stream error after commit (R-GATE-3): `{"error":{...}}` as the SSE
/// `data:` payload. The OpenAI SDKs raise an API error when they see it.
pub fn error_payload(err: &ApiError) -> Value {
    err.to_json()
}

/// Encodes run events as `chat.completion.chunk` SSE events.
///
/// Sequence: one role chunk (`delta: {role:"assistant", content:""}`) before
/// the first content, tool call or finish; text and tool-call delta chunks;
/// one finish chunk carrying `finish_reason`; then, only with
/// [`ChatStream::with_usage_chunk`], a usage chunk with `choices: []`. A
/// failure yields one [`error_payload`] instead. After a terminal every
/// further event yields nothing. The handler appends `data: [DONE]` after a
/// successful finish.
///
/// Each chunk is written straight into the response body: the choice is a
/// typed struct borrowing the event's text, and the fields every chunk
/// repeats (`created`, `id`, `model`, `object`, `system_fingerprint`) are
/// serialized once per stream. Keys appear in the order the JSON object
/// model of `serde_json` (a sorted map) always gave them.
#[derive(Debug, Clone)]
pub struct ChatStream {
    id: String,
    /// `,"created":…,"id":…,"model":…,"object":…,"system_fingerprint":null`:
    /// every chunk's fields after `choices`, serialized once.
    fixed_fields: Vec<u8>,
    include_usage: bool,
    role_sent: bool,
    finished: bool,
    tool_call_indexes: BTreeSet<u32>,
    usage: Option<Usage>,
}

/// The one choice of a chunk (keys in sorted order, as every chunk had them).
#[derive(Serialize)]
struct ChunkChoice<'a> {
    delta: ChunkDelta<'a>,
    finish_reason: Option<&'static str>,
    index: u32,
    logprobs: Option<Value>,
}

/// A chunk's `delta`: `{}`, the role, text or one tool-call fragment.
#[derive(Serialize, Default)]
struct ChunkDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[ToolCallFragment<'a>; 1]>,
}

/// One `delta.tool_calls` entry: the first fragment of a call carries its
/// id, type and name; later ones only `index` and `function.arguments`.
#[derive(Serialize)]
struct ToolCallFragment<'a> {
    function: FunctionFragment<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    index: u32,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
}

#[derive(Serialize)]
struct FunctionFragment<'a> {
    arguments: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

/// The OpenAI `usage` object: `prompt_tokens_details` only when the
/// provider reported a prompt cache count, each count only when reported
/// (never invented). Keys in order, as `json!` writes them.
#[derive(Debug, Serialize)]
struct UsageFields {
    completion_tokens: u64,
    prompt_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens_details: Option<PromptTokensDetails>,
    total_tokens: u64,
}

/// OpenAI's `usage.prompt_tokens_details`: the prompt cache's share.
#[derive(Debug, Serialize)]
struct PromptTokensDetails {
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_write_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cached_tokens: Option<u64>,
}

impl From<Usage> for UsageFields {
    fn from(usage: Usage) -> Self {
        Self {
            completion_tokens: usage.completion_tokens,
            prompt_tokens: usage.prompt_tokens,
            prompt_tokens_details: usage.reports_cache().then_some(PromptTokensDetails {
                cache_write_tokens: usage.cache_write_tokens,
                cached_tokens: usage.cache_read_tokens,
            }),
            total_tokens: usage.prompt_tokens.saturating_add(usage.completion_tokens),
        }
    }
}

impl ChatStream {
    /// A stream for completion `id` (see [`ids::chat_completion_id`]) of `model`.
    pub fn new(id: impl Into<String>, model: impl Into<String>, created_unix: u64) -> Self {
        let id = id.into();
        let model = model.into();
        let mut fixed_fields = Vec::with_capacity(128 + id.len() + model.len());
        fixed_fields.extend_from_slice(b",\"created\":");
        framing::write_json(&mut fixed_fields, &created_unix);
        fixed_fields.extend_from_slice(b",\"id\":");
        framing::write_json(&mut fixed_fields, &id);
        fixed_fields.extend_from_slice(b",\"model\":");
        framing::write_json(&mut fixed_fields, &model);
        fixed_fields.extend_from_slice(
            b",\"object\":\"chat.completion.chunk\",\"system_fingerprint\":null",
        );
        Self {
            id,
            fixed_fields,
            include_usage: false,
            role_sent: false,
            finished: false,
            tool_call_indexes: BTreeSet::new(),
            usage: None,
        }
    }

    /// Whether to send the final usage chunk (`stream_options.include_usage`).
    #[must_use]
    pub fn with_usage_chunk(mut self, include_usage: bool) -> Self {
        self.include_usage = include_usage;
        self
    }

    /// The completion id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// True once a terminal event was encoded.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Append the SSE events for one run event to `out`, in order (possibly
    /// none).
    pub fn push(&mut self, event: &RunEventKind, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        match event {
            RunEventKind::Started { .. } => {}
            RunEventKind::Usage(usage) => self.usage = Some(*usage),
            RunEventKind::TextDelta(text) => {
                self.ensure_role(out);
                if !text.is_empty() {
                    let delta = ChunkDelta {
                        content: Some(text),
                        ..ChunkDelta::default()
                    };
                    self.chunk(out, delta, None);
                }
            }
            RunEventKind::ToolCallDelta(delta) => self.tool_call_delta(delta, out),
            RunEventKind::ReasoningDelta(text) => {
                self.ensure_role(out);
                if !text.is_empty() {
                    let delta = ChunkDelta {
                        reasoning_content: Some(text),
                        ..ChunkDelta::default()
                    };
                    self.chunk(out, delta, None);
                }
            }
            RunEventKind::Logprobs(entries) => {
                self.ensure_role(out);
                self.chunk_with(
                    out,
                    ChunkDelta::default(),
                    None,
                    Some(logprobs_json(entries)),
                );
            }
            // Not a chat answer: nothing to encode.
            RunEventKind::Embedding(_) => {}
            RunEventKind::Completed {
                finish_reason,
                usage,
            } => {
                self.ensure_role(out);
                self.chunk(out, ChunkDelta::default(), Some(*finish_reason));
                if self.include_usage {
                    // The provider's usage, or `null` when it reported none.
                    self.usage_chunk(out, usage.or(self.usage));
                }
                self.finished = true;
            }
            RunEventKind::Failed(failure) => {
                let err = ApiError::from_execution_failure(failure);
                framing::sse_json(out, None, &error_payload(&err));
                self.finished = true;
            }
        }
    }

    /// Encode an error as the stream's terminal (e.g. budget expiry after commit).
    pub fn fail(&mut self, err: &ApiError, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        self.finished = true;
        framing::sse_json(out, None, &error_payload(err));
    }

    fn ensure_role(&mut self, out: &mut Vec<u8>) {
        if !self.role_sent {
            self.role_sent = true;
            let delta = ChunkDelta {
                content: Some(""),
                role: Some("assistant"),
                ..ChunkDelta::default()
            };
            self.chunk(out, delta, None);
        }
    }

    fn tool_call_delta(&mut self, delta: &ToolCallDelta, out: &mut Vec<u8>) {
        let first = !self.tool_call_indexes.contains(&delta.index);
        if first {
            if self.tool_call_indexes.len() >= MAX_TOOL_CALLS_PER_RUN {
                return;
            }
            self.tool_call_indexes.insert(delta.index);
        } else if delta.arguments_delta.is_empty() {
            return;
        }
        self.ensure_role(out);
        let derived_id;
        let fragment = if first {
            let id = match &delta.id {
                Some(id) => id.as_str(),
                None => {
                    derived_id = ids::derived_id("call_", &self.id, delta.index);
                    derived_id.as_str()
                }
            };
            ToolCallFragment {
                function: FunctionFragment {
                    arguments: &delta.arguments_delta,
                    name: Some(delta.name.as_deref().unwrap_or_default()),
                },
                id: Some(id),
                index: delta.index,
                kind: Some("function"),
            }
        } else {
            ToolCallFragment {
                function: FunctionFragment {
                    arguments: &delta.arguments_delta,
                    name: None,
                },
                id: None,
                index: delta.index,
                kind: None,
            }
        };
        let delta = ChunkDelta {
            tool_calls: Some([fragment]),
            ..ChunkDelta::default()
        };
        self.chunk(out, delta, None);
    }

    fn chunk(&self, out: &mut Vec<u8>, delta: ChunkDelta<'_>, finish: Option<FinishReason>) {
        self.chunk_with(out, delta, finish, None);
    }

    fn chunk_with(
        &self,
        out: &mut Vec<u8>,
        delta: ChunkDelta<'_>,
        finish: Option<FinishReason>,
        logprobs: Option<Value>,
    ) {
        let choice = ChunkChoice {
            delta,
            finish_reason: finish.map(FinishReason::openai_str),
            index: 0,
            logprobs,
        };
        framing::sse_event(out, None, |out| {
            out.extend_from_slice(b"{\"choices\":[");
            framing::write_json(out, &choice);
            out.push(b']');
            out.extend_from_slice(&self.fixed_fields);
            if self.include_usage {
                // With include_usage OpenAI sends `usage: null` on every other chunk.
                out.extend_from_slice(b",\"usage\":null");
            }
            out.push(b'}');
        });
    }

    fn usage_chunk(&self, out: &mut Vec<u8>, usage: Option<Usage>) {
        framing::sse_event(out, None, |out| {
            out.extend_from_slice(b"{\"choices\":[]");
            out.extend_from_slice(&self.fixed_fields);
            out.extend_from_slice(b",\"usage\":");
            framing::write_json(out, &usage.map(UsageFields::from));
            out.push(b'}');
        });
    }
}

/// Folds run events into the non-streaming `chat.completion` object.
#[derive(Debug, Clone)]
pub struct ChatAccumulator {
    id: String,
    model: String,
    created_unix: u64,
    transcript: Transcript,
}

impl ChatAccumulator {
    /// An accumulator for completion `id` of `model`.
    pub fn new(id: impl Into<String>, model: impl Into<String>, created_unix: u64) -> Self {
        let id = id.into();
        Self {
            transcript: Transcript::new(id.clone()),
            id,
            model: model.into(),
            created_unix,
        }
    }

    /// Fold one event in; events after the terminal are ignored.
    pub fn push(&mut self, event: &RunEventKind) {
        self.transcript.push(event);
    }

    /// True once a terminal event was folded in.
    pub fn is_finished(&self) -> bool {
        self.transcript.is_finished()
    }

    /// The `chat.completion` object, or the error the run ended with.
    pub fn finish(&self) -> Result<ChatCompletion<'_>, ApiError> {
        let finish_reason = self.transcript.finish_reason()?;
        Ok(self.completion(Some(finish_reason.openai_str())))
    }

    /// The `chat.completion` object as it stands: a stored completion
    /// fetched before it finished, or one that ended without its answer,
    /// has `finish_reason` `null`.
    pub fn snapshot(&self) -> Result<Value, ApiError> {
        let reason = self
            .transcript
            .finish_reason()
            .ok()
            .map(FinishReason::openai_str);
        serde_json::to_value(self.completion(reason)).map_err(|_| ApiError::internal())
    }

    fn completion<'a>(&'a self, finish_reason: Option<&'a str>) -> ChatCompletion<'a> {
        let text = self.transcript.text();
        let tool_calls = self.transcript.tool_calls();
        let logprobs = self.transcript.logprobs();
        ChatCompletion {
            choices: [CompletionChoice {
                finish_reason,
                index: 0,
                logprobs: (!logprobs.is_empty()).then(|| logprobs_json(logprobs)),
                message: CompletionMessage {
                    content: (!text.is_empty() || tool_calls.is_empty()).then_some(text),
                    reasoning_content: self.transcript.reasoning(),
                    refusal: (),
                    role: "assistant",
                    tool_calls: tool_calls
                        .calls()
                        .map(|call| CompletionToolCall {
                            function: CompletionFunction {
                                arguments: &call.arguments,
                                name: &call.name,
                            },
                            id: &call.id,
                            kind: "function",
                        })
                        .collect(),
                },
            }],
            created: self.created_unix,
            id: &self.id,
            model: &self.model,
            object: "chat.completion",
            system_fingerprint: (),
            // The provider's usage, or `null` when it reported none.
            usage: self.transcript.usage().map(UsageFields::from),
        }
    }
}

/// The non-streaming `chat.completion` object, written without building
/// a map: the fields of each object in the order a JSON map of them
/// writes its keys (sorted), so the bytes are those of the same object
/// built as a [`Value`].
#[derive(Debug, Serialize)]
pub struct ChatCompletion<'a> {
    choices: [CompletionChoice<'a>; 1],
    created: u64,
    id: &'a str,
    model: &'a str,
    object: &'static str,
    system_fingerprint: (),
    usage: Option<UsageFields>,
}

/// The completion's one choice.
#[derive(Debug, Serialize)]
struct CompletionChoice<'a> {
    finish_reason: Option<&'a str>,
    index: u32,
    logprobs: Option<Value>,
    message: CompletionMessage<'a>,
}

/// The assistant's message: `content` `null` when it only calls tools;
/// `reasoning_content` and `tool_calls` only when there are some.
#[derive(Debug, Serialize)]
struct CompletionMessage<'a> {
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "str::is_empty")]
    reasoning_content: &'a str,
    refusal: (),
    role: &'static str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<CompletionToolCall<'a>>,
}

/// One tool call of the message.
#[derive(Debug, Serialize)]
struct CompletionToolCall<'a> {
    function: CompletionFunction<'a>,
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// A tool call's function and its JSON-encoded arguments.
#[derive(Debug, Serialize)]
struct CompletionFunction<'a> {
    arguments: &'a str,
    name: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::arbitrary_body::{arbitrary_json, replace_nth_value};
    use iop_wire::{ExecutionFailure, FailureCode};
    use proptest::prelude::*;

    fn parse(body: Value) -> Result<ChatRequest, ApiError> {
        parse_chat_request(body.to_string().as_bytes())
    }

    fn param_of(body: Value) -> String {
        let err = parse(body).expect_err("must be rejected");
        assert_eq!(err.status, 400, "{err:?}");
        err.param.unwrap_or_default()
    }

    fn minimal() -> Value {
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    }

    fn with(field: &str, value: Value) -> Value {
        let mut body = minimal();
        body[field] = value;
        body
    }

    /// A body as the OpenAI Python SDK sends it with streaming, tools and usage.
    fn sdk_body() -> Value {
        json!({
            "messages": [
                {"role": "developer", "content": "You are terse."},
                {"role": "system", "content": [{"type": "text", "text": "Be nice."}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "Weather in"},
                    {"type": "text", "text": "Paris?"}
                ], "name": "alice"},
                {"role": "assistant", "content": null, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}
                }]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\":21}"}
            ],
            "model": "llama3",
            "max_completion_tokens": 256,
            "metadata": {"k": "v"},
            "parallel_tool_calls": true,
            "seed": 42,
            "stop": ["\n\n", "END"],
            "store": false,
            "stream": true,
            "stream_options": {"include_usage": true},
            "temperature": 0.7,
            "tool_choice": "auto",
            "tools": [{
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Get the weather",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string"},
                            "units": {"type": "string", "enum": ["c", "f"]},
                            "days": {"type": "array", "items": {"type": "object",
                                "properties": {"d": {"type": "integer"}}}}
                        },
                        "required": ["city"],
                        "additionalProperties": false
                    },
                    "strict": true
                }
            }],
            "top_p": 0.9,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "user": "u-1",
            "n": 1
        })
    }

    #[test]
    fn sdk_body_with_tools_usage_and_max_completion_tokens_parses() {
        let req = parse(sdk_body()).unwrap();
        assert_eq!(req.run.model, "llama3");
        assert!(req.run.stream);
        assert!(req.include_usage);
        assert_eq!(req.run.messages.len(), 5);
        assert_eq!(req.run.messages[0].role, Role::System);
        assert_eq!(req.run.messages[1].content, "Be nice.");
        assert_eq!(req.run.messages[2].content, "Weather in\nParis?");
        assert_eq!(req.run.messages[2].name.as_deref(), Some("alice"));
        assert_eq!(req.run.messages[3].role, Role::Assistant);
        assert_eq!(req.run.messages[3].content, "");
        assert_eq!(
            req.run.messages[3].tool_calls,
            vec![ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into()
            }]
        );
        assert_eq!(req.run.messages[4].role, Role::Tool);
        assert_eq!(req.run.messages[4].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(req.run.tools.len(), 1);
        assert_eq!(req.run.tools[0].name, "get_weather");
        let schema: Value =
            serde_json::from_str(req.run.tools[0].parameters_json.as_deref().unwrap()).unwrap();
        assert_eq!(
            schema["properties"]["days"]["items"]["properties"]["d"]["type"],
            "integer"
        );
        assert_eq!(req.run.params.max_tokens, Some(256));
        assert_eq!(req.run.params.temperature, Some(0.7));
        assert_eq!(req.run.params.top_p, Some(0.9));
        assert_eq!(req.run.params.seed, Some(42));
        assert_eq!(
            req.run.params.stop,
            vec!["\n\n".to_owned(), "END".to_owned()]
        );
        assert_eq!(req.run.params.presence_penalty, Some(0.5));
        assert_eq!(req.run.params.frequency_penalty, Some(-0.5));
        assert_eq!(req.run.params.tool_choice_json.as_deref(), Some("\"auto\""));
    }

    #[test]
    fn body_captured_from_the_openai_python_sdk_parses() {
        // `client.chat.completions.create(..., stream=True,
        //  stream_options={"include_usage": True}, tools=..., max_completion_tokens=5,
        //  tool_choice="auto")`, byte for byte.
        let body = br#"{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "stream_options": {"include_usage": true}, "tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "strict": true}}]}"#;
        let req = parse_chat_request(body).unwrap();
        assert!(req.run.stream && req.include_usage);
        assert_eq!(req.run.params.max_tokens, Some(5));
        assert_eq!(req.run.tools[0].description.as_deref(), Some("w"));
    }

    #[test]
    fn minimal_body_defaults() {
        let req = parse(minimal()).unwrap();
        assert!(!req.run.stream);
        assert!(!req.include_usage);
        assert!(req.run.tools.is_empty());
        assert_eq!(
            req.run.params,
            GenerationParams {
                whole_answer: true,
                ..GenerationParams::default()
            }
        );
    }

    #[test]
    fn the_request_surface_is_carried_not_dropped() {
        let mut body = minimal();
        body["messages"] = json!([{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}]}]);
        body["response_format"] = json!({"type": "json_object"});
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(2);
        body["reasoning_effort"] = json!("low");
        body["parallel_tool_calls"] = json!(false);
        body["top_k"] = json!(20);
        body["repeat_penalty"] = json!(1.1);
        let req = parse(body).unwrap();
        let message = &req.run.messages[0];
        assert_eq!(message.content, "what is this?");
        assert_eq!(message.images.len(), 2);
        let p = &req.run.params;
        assert_eq!(
            p.response_format_json.as_deref(),
            Some(r#"{"type":"json_object"}"#)
        );
        assert!(p.logprobs);
        assert_eq!(p.top_logprobs, Some(2));
        assert_eq!(p.reasoning_effort.as_deref(), Some("low"));
        assert_eq!(p.parallel_tool_calls, Some(false));
        let extra: Value = serde_json::from_str(p.extra_json.as_deref().unwrap()).unwrap();
        assert_eq!(extra, json!({"top_k": 20, "repeat_penalty": 1.1}));
        assert_eq!(param_of(with("top_logprobs", json!(3))), "top_logprobs");
        assert_eq!(
            param_of(with("reasoning_effort", json!("max"))),
            "reasoning_effort"
        );
    }

    #[test]
    fn reasoning_and_logprobs_are_streamed_and_accumulated() {
        use iop_wire::TokenLogprob;
        let events = [
            RunEventKind::ReasoningDelta("think".into()),
            RunEventKind::TextDelta("a".into()),
            RunEventKind::Logprobs(vec![TokenLogprob {
                token: "a".into(),
                logprob: -0.5,
                top: vec![("a".into(), -0.5)],
            }]),
            RunEventKind::Completed {
                finish_reason: FinishReason::Stop,
                usage: None,
            },
        ];
        let mut stream = ChatStream::new("c", "m", 1).with_usage_chunk(true);
        let mut out = Vec::new();
        for e in &events {
            stream.push(e, &mut out);
        }
        let text = String::from_utf8(out).unwrap();
        let chunks: Vec<Value> = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(
            chunks[1]["choices"][0]["delta"]["reasoning_content"],
            "think"
        );
        assert_eq!(
            chunks[3]["choices"][0]["logprobs"]["content"][0]["logprob"],
            -0.5
        );
        // The usage chunk says the provider reported none.
        assert!(chunks.last().unwrap()["usage"].is_null());
        assert!(chunks.last().unwrap().get("usage").is_some());

        let mut acc = ChatAccumulator::new("c", "m", 1);
        for e in &events {
            acc.push(e);
        }
        let v = finished(&acc);
        assert_eq!(v["choices"][0]["message"]["reasoning_content"], "think");
        assert_eq!(v["choices"][0]["logprobs"]["content"][0]["token"], "a");
        assert!(v["usage"].is_null());
    }

    #[test]
    fn unknown_top_level_fields_are_ignored_and_nulls_are_absent() {
        let mut body = minimal();
        body["some_future_field"] = json!({"x": 1});
        body["temperature"] = Value::Null;
        body["tools"] = Value::Null;
        let req = parse(body).unwrap();
        assert_eq!(req.run.params.temperature, None);
    }

    #[test]
    fn max_tokens_is_read_when_max_completion_tokens_is_absent() {
        let req = parse(with("max_tokens", json!(7))).unwrap();
        assert_eq!(req.run.params.max_tokens, Some(7));
        let req = parse(with("stop", json!("x"))).unwrap();
        assert_eq!(req.run.params.stop, vec!["x".to_owned()]);
    }

    #[test]
    fn function_tool_choice_is_kept_as_json() {
        let req = parse(with(
            "tool_choice",
            json!({"type": "function", "function": {"name": "f"}}),
        ))
        .unwrap();
        let choice: Value =
            serde_json::from_str(&req.run.params.tool_choice_json.unwrap()).unwrap();
        assert_eq!(choice["function"]["name"], "f");
    }

    #[test]
    fn malformed_json_is_a_400_without_param() {
        let err = parse_chat_request(b"{\"model\": ").unwrap_err();
        assert_eq!(err.status, 400);
        assert_eq!(err.code, Some("invalid_json"));
        let err = parse_chat_request(b"[1,2]").unwrap_err();
        assert_eq!(err.code, Some("invalid_json"));
    }

    #[test]
    fn every_bad_field_names_its_parameter() {
        let cases: Vec<(Value, &str)> = vec![
            (
                json!({"messages": [{"role": "user", "content": "x"}]}),
                "model",
            ),
            (with("model", json!("")), "model"),
            (with("model", json!(3)), "model"),
            (
                with("model", json!("m".repeat(MAX_MODEL_NAME_CHARS + 1))),
                "model",
            ),
            (json!({"model": "m"}), "messages"),
            (with("messages", json!([])), "messages"),
            (with("messages", json!("hi")), "messages"),
            (with("messages", json!([3])), "messages[0]"),
            (
                with("messages", json!([{"content": "x"}])),
                "messages[0].role",
            ),
            (
                with("messages", json!([{"role": "bot", "content": "x"}])),
                "messages[0].role",
            ),
            (
                with("messages", json!([{"role": "function", "content": "x"}])),
                "messages[0].role",
            ),
            (
                with("messages", json!([{"role": "user"}])),
                "messages[0].content",
            ),
            (
                with("messages", json!([{"role": "user", "content": 5}])),
                "messages[0].content",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": "a"}, {"role": "user", "content": [
                    {"type": "input_audio", "input_audio": {}}]}]),
                ),
                "messages[1].content",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "ftp://x"}}]}]),
                ),
                "messages[0].content[0].image_url",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "text"}]}]),
                ),
                "messages[0].content[0].text",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": "x", "name": 1}]),
                ),
                "messages[0].name",
            ),
            (
                with("messages", json!([{"role": "tool", "content": "x"}])),
                "messages[0].tool_call_id",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": "x", "tool_calls": []}]),
                ),
                "messages[0].tool_calls",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "assistant", "tool_calls": [{"type": "function",
                    "function": {"name": "f", "arguments": "{}"}}]}]),
                ),
                "messages[0].tool_calls[0].id",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "assistant", "tool_calls": [{"id": "c",
                    "function": {"arguments": "{}"}}]}]),
                ),
                "messages[0].tool_calls[0].function.name",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "assistant", "tool_calls": [{"id": "c",
                    "function": {"name": "f", "arguments": {}}}]}]),
                ),
                "messages[0].tool_calls[0].function.arguments",
            ),
            (
                with("messages", json!([{"role": "assistant"}])),
                "messages[0].content",
            ),
            (with("stream", json!("yes")), "stream"),
            (with("stream_options", json!(true)), "stream_options"),
            (
                with("stream_options", json!({"include_usage": 1})),
                "stream_options.include_usage",
            ),
            (with("temperature", json!(2.5)), "temperature"),
            (with("temperature", json!(-0.1)), "temperature"),
            (with("temperature", json!("hot")), "temperature"),
            (with("top_p", json!(1.5)), "top_p"),
            (with("max_tokens", json!(0)), "max_tokens"),
            (with("max_tokens", json!(-1)), "max_tokens"),
            (with("max_tokens", json!(1.5)), "max_tokens"),
            (
                with("max_completion_tokens", json!(0)),
                "max_completion_tokens",
            ),
            (with("stop", json!(["a", "b", "c", "d", "e"])), "stop"),
            (with("stop", json!(5)), "stop"),
            (with("stop", json!(["a", 5])), "stop[1]"),
            (with("seed", json!("1")), "seed"),
            (with("seed", json!(u64::MAX)), "seed"),
            (with("presence_penalty", json!(3)), "presence_penalty"),
            (with("frequency_penalty", json!(-3)), "frequency_penalty"),
            (with("n", json!(0)), "n"),
            (with("n", json!("1")), "n"),
            (with("tools", json!({})), "tools"),
            (
                with("tools", json!([{"type": "web_search"}])),
                "tools[0].type",
            ),
            (
                with("tools", json!([{"type": "function"}])),
                "tools[0].function",
            ),
            (
                with("tools", json!([{"type": "function", "function": {}}])),
                "tools[0].function.name",
            ),
            (
                with(
                    "tools",
                    json!([{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
                ),
                "tools[0].function.parameters",
            ),
            (
                with(
                    "tools",
                    json!(
                        (0..=MAX_TOOLS)
                            .map(|i| json!({"type": "function",
                    "function": {"name": format!("f{i}")}}))
                            .collect::<Vec<_>>()
                    ),
                ),
                "tools",
            ),
            (with("tool_choice", json!("sometimes")), "tool_choice"),
            (with("tool_choice", json!(1)), "tool_choice"),
            (
                with("tool_choice", json!({"type": "function"})),
                "tool_choice.function",
            ),
            (
                with("response_format", json!({"type": "yaml"})),
                "response_format.type",
            ),
            (with("logprobs", json!(1)), "logprobs"),
            (with("top_logprobs", json!(2)), "top_logprobs"),
            (with("top_logprobs", json!(21)), "top_logprobs"),
            (with("functions", json!([])), "functions"),
        ];
        for (body, expected) in cases {
            assert_eq!(param_of(body.clone()), expected, "body: {body}");
        }
    }

    #[test]
    fn limits_accept_values_at_the_bound() {
        let tools: Vec<Value> = (0..MAX_TOOLS)
            .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
            .collect();
        assert_eq!(
            parse(with("tools", json!(tools))).unwrap().run.tools.len(),
            MAX_TOOLS
        );
        let stops: Vec<String> = (0..MAX_STOP_SEQUENCES).map(|i| i.to_string()).collect();
        assert_eq!(
            parse(with("stop", json!(stops)))
                .unwrap()
                .run
                .params
                .stop
                .len(),
            MAX_STOP_SEQUENCES
        );
        let name = "m".repeat(MAX_MODEL_NAME_CHARS);
        assert_eq!(
            parse(with("model", json!(name))).unwrap().run.model.len(),
            MAX_MODEL_NAME_CHARS
        );
        let req = parse(with("max_tokens", json!(u32::MAX))).unwrap();
        assert_eq!(req.run.params.max_tokens, Some(u32::MAX));
        assert!(parse(with("max_tokens", json!(u64::from(u32::MAX) + 1))).is_err());
        let req = parse(with("temperature", json!(2))).unwrap();
        assert_eq!(req.run.params.temperature, Some(2.0));
        assert!(parse(with("temperature", json!(0))).is_ok());
    }

    #[test]
    fn n_is_parsed_and_left_to_the_providers_capabilities() {
        assert_eq!(parse(with("n", json!(3))).unwrap().run.choices, 3);
        assert_eq!(parse(minimal()).unwrap().run.choices, 1);
        assert_eq!(param_of(with("n", json!(0))), "n");
    }

    fn text(s: &str) -> RunEventKind {
        RunEventKind::TextDelta(s.into())
    }

    fn tool_delta(index: u32, id: Option<&str>, name: Option<&str>, args: &str) -> RunEventKind {
        RunEventKind::ToolCallDelta(ToolCallDelta {
            index,
            id: id.map(Into::into),
            name: name.map(Into::into),
            arguments_delta: args.into(),
        })
    }

    fn completed(reason: FinishReason, usage: Option<Usage>) -> RunEventKind {
        RunEventKind::Completed {
            finish_reason: reason,
            usage,
        }
    }

    fn usage(p: u64, c: u64) -> Usage {
        Usage::tokens(p, c)
    }

    /// The finished completion as a JSON value.
    fn finished(acc: &ChatAccumulator) -> Value {
        serde_json::to_value(acc.finish().unwrap()).unwrap()
    }

    #[test]
    fn the_typed_completion_writes_the_bytes_of_the_same_object_as_a_map() {
        use iop_wire::TokenLogprob;
        let mut cached = usage(40, 3);
        cached.cache_read_tokens = Some(32);
        let rich = [
            RunEventKind::ReasoningDelta("think \"hard\"".into()),
            text("héllo"),
            RunEventKind::Logprobs(vec![TokenLogprob {
                token: "h".into(),
                logprob: -0.25,
                top: vec![("h".into(), -0.25), ("x".into(), -2.0)],
            }]),
            tool_delta(0, Some("call_a"), Some("f"), "{\"x\":1}"),
            completed(FinishReason::ToolCalls, Some(cached)),
        ];
        let tool_only = [
            tool_delta(0, Some("call_b"), Some("g"), "{}"),
            completed(FinishReason::ToolCalls, None),
        ];
        // The object around a choice, as a map writes it.
        let object = |choice: Value, usage: Value| {
            json!({
                "choices": [choice],
                "created": 7,
                "id": "chatcmpl-t",
                "model": "m",
                "object": "chat.completion",
                "system_fingerprint": null,
                "usage": usage
            })
        };
        let expected = [
            object(
                json!({
                    "finish_reason": "tool_calls",
                    "index": 0,
                    "logprobs": {"content": [{
                        "token": "h", "logprob": -0.25, "bytes": [104],
                        "top_logprobs": [
                            {"token": "h", "logprob": -0.25, "bytes": [104]},
                            {"token": "x", "logprob": -2.0, "bytes": [120]}
                        ]
                    }], "refusal": null},
                    "message": {
                        "content": "héllo",
                        "reasoning_content": "think \"hard\"",
                        "refusal": null,
                        "role": "assistant",
                        "tool_calls": [{
                            "function": {"arguments": "{\"x\":1}", "name": "f"},
                            "id": "call_a",
                            "type": "function"
                        }]
                    }
                }),
                json!({
                    "completion_tokens": 3, "prompt_tokens": 40,
                    "prompt_tokens_details": {"cached_tokens": 32},
                    "total_tokens": 43
                }),
            ),
            object(
                json!({
                    "finish_reason": "tool_calls",
                    "index": 0,
                    "logprobs": null,
                    "message": {
                        "content": null,
                        "refusal": null,
                        "role": "assistant",
                        "tool_calls": [{
                            "function": {"arguments": "{}", "name": "g"},
                            "id": "call_b",
                            "type": "function"
                        }]
                    }
                }),
                Value::Null,
            ),
        ];
        for (events, expected) in [&rich[..], &tool_only[..]].into_iter().zip(expected) {
            let mut acc = ChatAccumulator::new("chatcmpl-t", "m", 7);
            for e in events {
                acc.push(e);
            }
            let typed = acc.finish().unwrap();
            assert_eq!(serde_json::to_value(&typed).unwrap(), expected);
            // Byte for byte what the object built as a map writes (its
            // keys sorted), as the answer was before it was typed.
            assert_eq!(serde_json::to_string(&typed).unwrap(), expected.to_string());
            // A stored completion fetched reads the same object.
            assert_eq!(acc.snapshot().unwrap(), expected);
        }
        // A stored completion a stop sequence ended says `stop` when
        // fetched, as when it was answered (OpenAI has no other name).
        let mut acc = ChatAccumulator::new("chatcmpl-s", "m", 7);
        acc.push(&text("a"));
        acc.push(&completed(FinishReason::StopSequence, None));
        assert_eq!(finished(&acc)["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            acc.snapshot().unwrap()["choices"][0]["finish_reason"],
            "stop"
        );
    }

    fn run(stream: &mut ChatStream, events: &[RunEventKind]) -> Vec<Value> {
        let mut out = Vec::new();
        for e in events {
            stream.push(e, &mut out);
        }
        framing::sse_json_payloads(&out)
    }

    fn fail(stream: &mut ChatStream, err: &ApiError) -> Vec<Value> {
        let mut out = Vec::new();
        stream.fail(err, &mut out);
        framing::sse_json_payloads(&out)
    }

    #[test]
    fn cached_prompt_tokens_are_prompt_tokens_details_only_when_reported() {
        let cached = Usage {
            cache_read_tokens: Some(24),
            ..usage(30, 2)
        };
        let mut stream = ChatStream::new("c", "m", 1).with_usage_chunk(true);
        let chunks = run(
            &mut stream,
            &[text("hi"), completed(FinishReason::Stop, Some(cached))],
        );
        let expected = json!({"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32,
                              "prompt_tokens_details": {"cached_tokens": 24}});
        assert_eq!(chunks.last().unwrap()["usage"], expected);
        let mut acc = ChatAccumulator::new("c", "m", 1);
        acc.push(&text("hi"));
        acc.push(&completed(FinishReason::Stop, Some(cached)));
        assert_eq!(finished(&acc)["usage"], expected);
        // A write count too (a Messages provider's cache_creation_input_tokens).
        let written = Usage {
            cache_write_tokens: Some(6),
            ..cached
        };
        assert_eq!(
            usage_json(written)["prompt_tokens_details"],
            json!({"cached_tokens": 24, "cache_write_tokens": 6})
        );
        // None reported: no details, not zeros.
        let v = usage_json(usage(30, 2));
        assert_eq!(
            v,
            json!({"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32})
        );
    }

    #[test]
    fn text_stream_is_role_deltas_finish_then_usage_chunk() {
        let mut stream = ChatStream::new("chatcmpl-1", "m", 1_700_000_000).with_usage_chunk(true);
        let chunks = run(
            &mut stream,
            &[
                RunEventKind::Started {
                    session_id: "s".into(),
                },
                text("Hel"),
                text("lo"),
                completed(FinishReason::Stop, Some(usage(3, 2))),
            ],
        );
        assert_eq!(chunks.len(), 5);
        for chunk in &chunks {
            assert_eq!(chunk["id"], "chatcmpl-1");
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["created"], 1_700_000_000);
            assert_eq!(chunk["model"], "m");
        }
        assert_eq!(
            chunks[0]["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(chunks[0]["choices"][0]["index"], 0);
        assert!(chunks[0]["choices"][0]["finish_reason"].is_null());
        assert!(chunks[0]["usage"].is_null());
        assert_eq!(chunks[1]["choices"][0]["delta"], json!({"content": "Hel"}));
        assert_eq!(chunks[2]["choices"][0]["delta"], json!({"content": "lo"}));
        assert_eq!(chunks[3]["choices"][0]["delta"], json!({}));
        assert_eq!(chunks[3]["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunks[4]["choices"], json!([]));
        assert_eq!(
            chunks[4]["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
        );
        assert!(stream.is_finished());
        assert!(run(&mut stream, &[text("late")]).is_empty());
    }

    #[test]
    fn without_include_usage_there_is_no_usage_chunk_or_field() {
        let mut stream = ChatStream::new("c", "m", 1);
        let chunks = run(
            &mut stream,
            &[text("x"), completed(FinishReason::Length, None)],
        );
        assert_eq!(chunks.len(), 3);
        assert!(chunks.iter().all(|c| c.get("usage").is_none()));
        assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    }

    #[test]
    fn usage_chunk_falls_back_to_the_last_usage_event() {
        let mut stream = ChatStream::new("c", "m", 1).with_usage_chunk(true);
        let chunks = run(
            &mut stream,
            &[
                RunEventKind::Usage(usage(10, 1)),
                completed(FinishReason::Stop, None),
            ],
        );
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[2]["usage"]["total_tokens"], 11);
    }

    #[test]
    fn tool_call_deltas_carry_index_id_type_and_function() {
        let mut stream = ChatStream::new("chatcmpl-7", "m", 1);
        let chunks = run(
            &mut stream,
            &[
                tool_delta(0, Some("call_a"), Some("get_weather"), ""),
                tool_delta(0, None, None, "{\"city\":"),
                tool_delta(0, None, None, "\"Paris\"}"),
                tool_delta(1, None, Some("get_time"), "{}"),
                tool_delta(1, None, None, ""),
                completed(FinishReason::ToolCalls, None),
            ],
        );
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(
            chunks[1]["choices"][0]["delta"]["tool_calls"],
            json!([{"index": 0, "id": "call_a", "type": "function",
                    "function": {"name": "get_weather", "arguments": ""}}])
        );
        assert_eq!(
            chunks[2]["choices"][0]["delta"]["tool_calls"],
            json!([{"index": 0, "function": {"arguments": "{\"city\":"}}])
        );
        assert_eq!(
            chunks[3]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"],
            "\"Paris\"}"
        );
        let second = &chunks[4]["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(second["index"], 1);
        assert_eq!(second["id"], "call_70001");
        assert_eq!(second["function"]["name"], "get_time");
        assert_eq!(chunks.len(), 6, "empty continuation fragments are skipped");
        assert_eq!(chunks[5]["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn failure_after_commit_is_one_error_payload() {
        let mut stream = ChatStream::new("c", "m", 1);
        let mut chunks = run(&mut stream, &[text("partial")]);
        chunks.extend(run(
            &mut stream,
            &[RunEventKind::Failed(ExecutionFailure::new(
                FailureCode::ResponseStalled,
            ))],
        ));
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[2]["error"]["code"], "response_stalled");
        assert_eq!(chunks[2]["error"]["type"], "timeout_error");
        assert!(run(&mut stream, &[completed(FinishReason::Stop, None)]).is_empty());
        assert!(fail(&mut stream, &ApiError::budget_expired()).is_empty());
    }

    /// `payloads` as the SSE events the client reads.
    fn sse(payloads: &[&str]) -> String {
        payloads.iter().map(|p| format!("data: {p}\n\n")).collect()
    }

    // The exact bytes of a stream, as the JSON object model of serde_json
    // wrote them before chunks were typed: keys sorted, compact, strings
    // escaped the same way. A client must see these bytes unchanged.
    #[test]
    fn a_stream_with_usage_writes_these_exact_bytes() {
        let mut stream =
            ChatStream::new("chatcmpl-7", "m\"1", 1_700_000_000).with_usage_chunk(true);
        let mut out = Vec::new();
        for event in [
            RunEventKind::Started {
                session_id: "s".into(),
            },
            text("Hé\n\"x\""),
            tool_delta(0, Some("call_a"), Some("get"), ""),
            tool_delta(0, None, None, "{\"a\":1}"),
            tool_delta(1, None, Some("t"), "{}"),
            RunEventKind::Usage(usage(3, 2)),
            completed(FinishReason::ToolCalls, None),
        ] {
            stream.push(&event, &mut out);
        }
        let fixed = r#""created":1700000000,"id":"chatcmpl-7","model":"m\"1","object":"chat.completion.chunk","system_fingerprint":null"#;
        let chunk = |choice: &str| format!(r#"{{"choices":[{choice}],{fixed},"usage":null}}"#);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            sse(&[
                &chunk(
                    r#"{"delta":{"content":"","role":"assistant"},"finish_reason":null,"index":0,"logprobs":null}"#
                ),
                &chunk(
                    r#"{"delta":{"content":"Hé\n\"x\""},"finish_reason":null,"index":0,"logprobs":null}"#
                ),
                &chunk(
                    r#"{"delta":{"tool_calls":[{"function":{"arguments":"","name":"get"},"id":"call_a","index":0,"type":"function"}]},"finish_reason":null,"index":0,"logprobs":null}"#
                ),
                &chunk(
                    r#"{"delta":{"tool_calls":[{"function":{"arguments":"{\"a\":1}"},"index":0}]},"finish_reason":null,"index":0,"logprobs":null}"#
                ),
                &chunk(
                    r#"{"delta":{"tool_calls":[{"function":{"arguments":"{}","name":"t"},"id":"call_70001","index":1,"type":"function"}]},"finish_reason":null,"index":0,"logprobs":null}"#
                ),
                &chunk(r#"{"delta":{},"finish_reason":"tool_calls","index":0,"logprobs":null}"#),
                &format!(
                    r#"{{"choices":[],{fixed},"usage":{{"completion_tokens":2,"prompt_tokens":3,"total_tokens":5}}}}"#
                ),
            ])
        );
    }

    #[test]
    fn a_failing_stream_without_usage_writes_these_exact_bytes() {
        let mut stream = ChatStream::new("c", "m", 5);
        let mut out = Vec::new();
        stream.push(&text("x"), &mut out);
        stream.push(
            &RunEventKind::Failed(ExecutionFailure::new(FailureCode::ResponseStalled)),
            &mut out,
        );
        let fixed = r#""created":5,"id":"c","model":"m","object":"chat.completion.chunk","system_fingerprint":null"#;
        assert_eq!(
            String::from_utf8(out).unwrap(),
            sse(&[
                &format!(
                    r#"{{"choices":[{{"delta":{{"content":"","role":"assistant"}},"finish_reason":null,"index":0,"logprobs":null}}],{fixed}}}"#
                ),
                &format!(
                    r#"{{"choices":[{{"delta":{{"content":"x"}},"finish_reason":null,"index":0,"logprobs":null}}],{fixed}}}"#
                ),
                r#"{"error":{"code":"response_stalled","message":"The provider stopped producing output (response stalled).","param":null,"type":"timeout_error"}}"#,
            ])
        );
    }

    #[test]
    fn tool_call_indexes_are_bounded() {
        let mut stream = ChatStream::new("c", "m", 1);
        let events: Vec<_> = (0..(MAX_TOOL_CALLS_PER_RUN as u32 + 10))
            .map(|i| tool_delta(i, None, Some("f"), "{}"))
            .collect();
        let chunks = run(&mut stream, &events);
        assert_eq!(chunks.len(), MAX_TOOL_CALLS_PER_RUN + 1);
    }

    #[test]
    fn accumulator_builds_completion_with_content_and_usage() {
        let mut acc = ChatAccumulator::new("chatcmpl-2", "m", 5);
        for e in [
            text("Hello"),
            text(" world"),
            RunEventKind::Usage(usage(1, 1)),
            completed(FinishReason::Stop, Some(usage(4, 2))),
            text("ignored"),
        ] {
            acc.push(&e);
        }
        assert!(acc.is_finished());
        let v = finished(&acc);
        assert_eq!(v["id"], "chatcmpl-2");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["created"], 5);
        assert_eq!(v["model"], "m");
        assert_eq!(v["choices"][0]["index"], 0);
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["message"]["content"], "Hello world");
        assert!(v["choices"][0]["message"].get("tool_calls").is_none());
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6})
        );
    }

    #[test]
    fn accumulator_assembles_tool_calls_from_deltas() {
        let mut acc = ChatAccumulator::new("chatcmpl-3", "m", 5);
        for e in [
            tool_delta(1, Some("call_b"), Some("second"), "{\"y\""),
            tool_delta(0, Some("call_a"), Some("first"), "{\"x\":"),
            tool_delta(0, None, None, "1}"),
            tool_delta(1, None, None, ":2}"),
            completed(FinishReason::ToolCalls, None),
        ] {
            acc.push(&e);
        }
        let v = finished(&acc);
        let message = &v["choices"][0]["message"];
        assert!(message["content"].is_null());
        assert_eq!(
            message["tool_calls"],
            json!([
                {"id": "call_a", "type": "function", "function": {"name": "first", "arguments": "{\"x\":1}"}},
                {"id": "call_b", "type": "function", "function": {"name": "second", "arguments": "{\"y\":2}"}}
            ])
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        // No usage reported is none, never zeros.
        assert!(v["usage"].is_null());
    }

    #[test]
    fn accumulator_reports_failures_and_missing_terminals() {
        let mut acc = ChatAccumulator::new("c", "m", 1);
        assert_eq!(acc.finish().unwrap_err().code, Some("transport_closed"));
        acc.push(&RunEventKind::Failed(ExecutionFailure::new(
            FailureCode::NodeOverloaded,
        )));
        let err = acc.finish().unwrap_err();
        assert_eq!(err.status, 503);
        assert_eq!(err.code, Some("node_overloaded"));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_parser(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_chat_request(&body);
        }

        #[test]
        fn arbitrary_json_never_panics_and_errors_name_a_bounded_param(
            body in arbitrary_json(4)
        ) {
            match parse_chat_request(body.to_string().as_bytes()) {
                Ok(req) => prop_assert!(!req.run.model.is_empty() && !req.run.messages.is_empty()),
                Err(err) => prop_assert!((400..500).contains(&err.status)),
            }
        }

        #[test]
        fn mutated_sdk_bodies_never_panic(path in 0usize..40, replacement in arbitrary_json(2)) {
            let mut body = sdk_body();
            replace_nth_value(&mut body, path, replacement);
            let _ = parse_chat_request(body.to_string().as_bytes());
        }
    }
}
