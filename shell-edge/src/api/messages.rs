//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic
//! Messages API as a normalized run.
//!
//! * [`parse_messages_request`] turns a body into a [`NormalizedRun`]:
//!   `system` (a string or text blocks) becomes the first message; each
//!   message's blocks become the run's messages (`text`, `image` by base64
//!   or URL, `document` with a text source, `tool_use` as the assistant's
//!   tool calls, each `tool_result` as one tool message before the rest of
//!   its user turn); `tools`, `tool_choice`, `stop_sequences`,
//!   `max_tokens` (required), `temperature`, `top_p`, `top_k`,
//!   `metadata.user_id` and `thinking` (as a reasoning effort) become the
//!   run's parameters. What the run cannot carry (a PDF document, an image
//!   in a tool result, a server tool) is a 400 naming the field; an unknown
//!   top-level field is a 400, as Anthropic answers it. Earlier turns'
//!   `thinking` blocks are left out, as Anthropic leaves them out of the
//!   context.
//! * [`MessagesStream`] writes Anthropic's event sequence: `message_start`,
//!   then per content block `content_block_start`, `content_block_delta`
//!   (`text_delta`, `thinking_delta`, `input_json_delta`) and
//!   `content_block_stop`, then `message_delta` (`stop_reason`, usage) and
//!   `message_stop`; `ping` after the start and as the keep-alive; an
//!   `error` event ends a failed stream.
//! * [`MessagesAccumulator`] folds a run into one `message` object.
//! * [`MessagesError`] answers an [`ApiError`] in Anthropic's shape and
//!   status codes.
//!
//! Usage is the provider's: the final `message_delta` and the whole answer
//! carry its `input_tokens` and `output_tokens`, or `null` when it reported
//! none. `message_start` comes before any provider count and carries
//! zeros, which the SDKs replace with the `message_delta` totals.
//!
//! `stop_reason`: `end_turn` (a natural stop), `max_tokens`, `tool_use`
//! (the model called tools, whatever finish reason its provider gave with
//! them), `refusal` (content filter). `stop_sequence` needs a provider that
//! says which sequence matched; the OpenAI and Ollama APIs behind the
//! Edge's adapters do not, so a matched stop sequence reads `end_turn`.

use std::collections::BTreeMap;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use iop_wire::{
    ChatMessage, FailureCode, FinishReason, GenerationParams, Role, RunApi, RunEventKind, ToolCall,
    ToolCallDelta, ToolDefinition, Usage,
};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::NormalizedRun;
use super::chat::{MAX_TOOLS, parse_model};
use super::error::{ApiError, ErrorKind};
use super::framing;
use super::ids;
use super::request_object::{RequestObject, element, parse_body, type_name};
use super::surface::MAX_IMAGES_PER_REQUEST;
use super::transcript::{MAX_TOOL_CALLS_PER_RUN, Transcript};

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

/// Which of the two bodies is parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    /// `POST /v1/messages`.
    Create,
    /// `POST /v1/messages/count_tokens`.
    CountTokens,
}

/// Parse a `POST /v1/messages` body.
pub fn parse_messages_request(body: &[u8]) -> Result<NormalizedRun, ApiError> {
    parse(body, Body::Create)
}

/// Parse a `POST /v1/messages/count_tokens` body: the conversation and
/// tools of a `POST /v1/messages` body, without `max_tokens` or sampling.
pub fn parse_count_tokens_request(body: &[u8]) -> Result<NormalizedRun, ApiError> {
    parse(body, Body::CountTokens)
}

fn parse(body: &[u8], kind: Body) -> Result<NormalizedRun, ApiError> {
    let value = parse_body(body)?;
    let root = RequestObject::root(&value)?;
    let known = match kind {
        Body::Create => MESSAGES_FIELDS,
        Body::CountTokens => COUNT_TOKENS_FIELDS,
    };
    if let Some((key, _)) = root
        .entries()
        .find(|(key, value)| !value.is_null() && !known.contains(&key.as_str()))
    {
        return Err(ApiError::unknown_field(key));
    }
    let model = parse_model(&root)?;
    let max_tokens = match kind {
        Body::Create => Some(
            root.u32_at_least("max_tokens", 1)?
                .ok_or_else(|| ApiError::missing_parameter("max_tokens"))?,
        ),
        Body::CountTokens => None,
    };
    let stream = root.bool("stream")?.unwrap_or(false);

    let mut messages = Vec::new();
    if let Some(system) = root.get("system") {
        let text = system_text(system)?;
        if !text.is_empty() {
            messages.push(message(Role::System, text));
        }
    }
    let Some(raw_messages) = root.array("messages")? else {
        return Err(ApiError::missing_parameter("messages"));
    };
    if raw_messages.is_empty() {
        return Err(ApiError::invalid_value(
            "messages",
            "must contain at least one message.",
        ));
    }
    let mut images_left = MAX_IMAGES_PER_REQUEST;
    for (i, raw) in raw_messages.iter().enumerate() {
        let last = i + 1 == raw_messages.len();
        parse_message(
            raw,
            element("messages", i),
            last,
            &mut images_left,
            &mut messages,
        )?;
    }

    let tools = parse_tools(&root)?;
    let (tool_choice_json, parallel_tool_calls) = parse_tool_choice(&root)?;
    let reasoning_effort = parse_thinking(&root, max_tokens)?;
    let mut extra = Map::new();
    if kind == Body::Create {
        if let Some(top_k) = root.u32_at_least("top_k", 0)? {
            extra.insert("top_k".into(), json!(top_k));
        }
        if let Some(metadata) = root.object("metadata")? {
            if let Some((key, _)) = metadata
                .entries()
                .find(|(key, value)| !value.is_null() && key.as_str() != "user_id")
            {
                return Err(ApiError::unknown_field(&metadata.param(key)));
            }
            if let Some(user) = metadata.string("user_id")? {
                // OpenAI's end-user field: answer-neutral, passed through.
                extra.insert("user".into(), json!(user));
            }
        }
        // Answer-neutral; the gateway has one tier.
        root.string("service_tier")?;
    }
    let params = GenerationParams {
        temperature: root.number_in("temperature", 0.0, 1.0)?,
        top_p: root.number_in("top_p", 0.0, 1.0)?,
        max_tokens,
        stop: parse_stop_sequences(&root)?,
        tool_choice_json,
        reasoning_effort,
        parallel_tool_calls,
        extra_json: (!extra.is_empty()).then(|| Value::Object(extra).to_string()),
        whole_answer: !stream,
        ..GenerationParams::default()
    };
    Ok(NormalizedRun {
        model,
        stream,
        api: RunApi::Chat,
        messages,
        tools,
        params,
        choices: 1,
    })
}

fn message(role: Role, content: String) -> ChatMessage {
    ChatMessage {
        role,
        content,
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
        images: Vec::new(),
    }
}

/// `system`: a string, or an array of text blocks joined by newlines.
fn system_text(system: &Value) -> Result<String, ApiError> {
    match system {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (i, block) in blocks.iter().enumerate() {
                let block = RequestObject::at(block, element("system", i))?;
                if block.required_string("type")? != "text" {
                    return Err(ApiError::invalid_value(
                        &block.param("type"),
                        "system blocks must be text blocks.",
                    ));
                }
                texts.push(block.required_string("text")?.to_owned());
            }
            Ok(texts.join("\n"))
        }
        other => Err(ApiError::invalid_type(
            "system",
            &format!(
                "a string or an array of text blocks, not {}",
                type_name(other)
            ),
        )),
    }
}

/// One message: its blocks as run messages appended to `out` (each
/// `tool_result` as a tool message, then the rest of the turn).
fn parse_message(
    value: &Value,
    path: String,
    last: bool,
    images_left: &mut usize,
    out: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let obj = RequestObject::at(value, path)?;
    let role = match obj.non_empty_string("role")? {
        "user" => Role::User,
        "assistant" => Role::Assistant,
        _ => {
            return Err(ApiError::invalid_value(
                &obj.param("role"),
                "must be 'user' or 'assistant'.",
            ));
        }
    };
    let content_param = obj.param("content");
    // Anthropic: every message has content but a final assistant one.
    let empty = || {
        ApiError::invalid_value(
            &content_param,
            "all messages must have non-empty content except for the optional final assistant message.",
        )
    };
    let blocks = match obj.get("content") {
        None => return Err(ApiError::missing_parameter(&content_param)),
        Some(Value::String(text)) => {
            if text.is_empty() {
                if role == Role::Assistant && last {
                    return Ok(());
                }
                return Err(empty());
            }
            out.push(message(role, text.clone()));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        Some(other) => {
            return Err(ApiError::invalid_type(
                &content_param,
                &format!(
                    "a string or an array of content blocks, not {}",
                    type_name(other)
                ),
            ));
        }
    };
    if blocks.is_empty() && !(role == Role::Assistant && last) {
        return Err(empty());
    }
    let mut texts = Vec::new();
    let mut turn = message(role, String::new());
    let mut produced = false;
    for (i, block) in blocks.iter().enumerate() {
        let block = RequestObject::at(block, element(&content_param, i))?;
        let kind = block.required_string("type")?;
        match (kind, role) {
            ("text", _) => texts.push(block.required_string("text")?.to_owned()),
            ("image", Role::User) => {
                turn.images.push(parse_image(&block, images_left)?);
            }
            ("document", Role::User) => texts.push(parse_document(&block)?),
            ("tool_result", Role::User) => {
                out.push(parse_tool_result(&block)?);
                produced = true;
            }
            ("tool_use", Role::Assistant) => turn.tool_calls.push(parse_tool_use(&block)?),
            // An earlier turn's reasoning is not part of the context.
            ("thinking" | "redacted_thinking", Role::Assistant) => {}
            ("image" | "document" | "tool_result", _) => {
                return Err(ApiError::invalid_value(
                    &block.param("type"),
                    &format!("'{kind}' blocks belong in user messages."),
                ));
            }
            ("tool_use" | "thinking" | "redacted_thinking", _) => {
                return Err(ApiError::invalid_value(
                    &block.param("type"),
                    &format!("'{kind}' blocks belong in assistant messages."),
                ));
            }
            _ => {
                return Err(ApiError::unsupported_parameter(
                    &block.param("type"),
                    "Supported content blocks are text, image, document (text), tool_use, tool_result and thinking.",
                ));
            }
        }
    }
    turn.content = texts.join("\n");
    if !turn.content.is_empty() || !turn.images.is_empty() || !turn.tool_calls.is_empty() {
        out.push(turn);
    } else if !produced && !blocks.is_empty() && role == Role::User {
        return Err(empty());
    }
    Ok(())
}

/// An image block: `source` `{type: base64, media_type, data}` as a
/// `data:` URL, or `{type: url, url}`.
fn parse_image(block: &RequestObject<'_>, images_left: &mut usize) -> Result<String, ApiError> {
    let Some(source) = block.object("source")? else {
        return Err(ApiError::missing_parameter(&block.param("source")));
    };
    let url = match source.required_string("type")? {
        "base64" => {
            let media_type = source.required_string("media_type")?;
            if !IMAGE_MEDIA_TYPES.contains(&media_type) {
                return Err(ApiError::invalid_value(
                    &source.param("media_type"),
                    &format!("must be one of {}.", IMAGE_MEDIA_TYPES.join(", ")),
                ));
            }
            let data = source.non_empty_string("data")?;
            if !data
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
            {
                return Err(ApiError::invalid_value(
                    &source.param("data"),
                    "must be base64-encoded image data.",
                ));
            }
            format!("data:{media_type};base64,{data}")
        }
        "url" => {
            let url = source.non_empty_string("url")?;
            if !url.starts_with("https://") && !url.starts_with("http://") {
                return Err(ApiError::invalid_value(
                    &source.param("url"),
                    "must be an http(s) URL.",
                ));
            }
            url.to_owned()
        }
        _ => {
            return Err(ApiError::unsupported_parameter(
                &source.param("type"),
                "Image sources are 'base64' or 'url' (files are not supported).",
            ));
        }
    };
    if *images_left == 0 {
        return Err(ApiError::invalid_value(
            &block.param("source"),
            &format!("a request may attach at most {MAX_IMAGES_PER_REQUEST} images."),
        ));
    }
    *images_left -= 1;
    Ok(url)
}

/// A document block the run can carry: its text (a `text` source, or a
/// `content` source of text blocks), after its `title` and `context`.
fn parse_document(block: &RequestObject<'_>) -> Result<String, ApiError> {
    let Some(source) = block.object("source")? else {
        return Err(ApiError::missing_parameter(&block.param("source")));
    };
    let text = match source.required_string("type")? {
        "text" => source.required_string("data")?.to_owned(),
        "content" => match source.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(blocks)) => {
                let path = source.param("content");
                let mut texts = Vec::with_capacity(blocks.len());
                for (i, b) in blocks.iter().enumerate() {
                    let b = RequestObject::at(b, element(&path, i))?;
                    if b.required_string("type")? != "text" {
                        return Err(ApiError::unsupported_parameter(
                            &b.param("type"),
                            "A document's content blocks must be text.",
                        ));
                    }
                    texts.push(b.required_string("text")?.to_owned());
                }
                texts.join("\n")
            }
            Some(_) => {
                return Err(ApiError::invalid_type(
                    &source.param("content"),
                    "a string or an array of text blocks",
                ));
            }
            None => return Err(ApiError::missing_parameter(&source.param("content"))),
        },
        "base64" | "url" | "file" => {
            return Err(ApiError::unsupported_parameter(
                &source.param("type"),
                "PDF and file documents are not supported by this gateway; send the document's text (a 'text' source).",
            ));
        }
        _ => {
            return Err(ApiError::invalid_value(
                &source.param("type"),
                "must be 'text', 'content', 'base64' or 'url'.",
            ));
        }
    };
    let mut parts = Vec::with_capacity(3);
    for key in ["title", "context"] {
        if let Some(s) = block.string(key)?.filter(|s| !s.is_empty()) {
            parts.push(s.to_owned());
        }
    }
    parts.push(text);
    Ok(parts.join("\n"))
}

/// A `tool_use` block of an assistant turn: one tool call.
fn parse_tool_use(block: &RequestObject<'_>) -> Result<ToolCall, ApiError> {
    let id = block.non_empty_string("id")?.to_owned();
    let name = block.non_empty_string("name")?.to_owned();
    let arguments = match block.get("input") {
        Some(input @ Value::Object(_)) => input.to_string(),
        Some(_) => return Err(ApiError::invalid_type(&block.param("input"), "an object")),
        None => return Err(ApiError::missing_parameter(&block.param("input"))),
    };
    Ok(ToolCall {
        id,
        name,
        arguments,
    })
}

/// A `tool_result` block: a tool message answering `tool_use_id`. An
/// error result (`is_error`) says so before its content.
fn parse_tool_result(block: &RequestObject<'_>) -> Result<ChatMessage, ApiError> {
    let id = block.non_empty_string("tool_use_id")?.to_owned();
    let mut content = match block.get("content") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            let path = block.param("content");
            let mut texts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let b = RequestObject::at(b, element(&path, i))?;
                match b.required_string("type")? {
                    "text" => texts.push(b.required_string("text")?.to_owned()),
                    "document" => texts.push(parse_document(&b)?),
                    _ => {
                        return Err(ApiError::unsupported_parameter(
                            &b.param("type"),
                            "A tool result carries text (and text documents) only in this gateway.",
                        ));
                    }
                }
            }
            texts.join("\n")
        }
        Some(other) => {
            return Err(ApiError::invalid_type(
                &block.param("content"),
                &format!(
                    "a string or an array of content blocks, not {}",
                    type_name(other)
                ),
            ));
        }
    };
    if block.bool("is_error")? == Some(true) {
        content.insert_str(0, "Error: ");
    }
    let mut tool = message(Role::Tool, content);
    tool.tool_call_id = Some(id);
    Ok(tool)
}

/// `tools`: client tools `{name, description?, input_schema}`.
fn parse_tools(root: &RequestObject<'_>) -> Result<Vec<ToolDefinition>, ApiError> {
    let Some(items) = root.array("tools")? else {
        return Ok(Vec::new());
    };
    if items.len() > MAX_TOOLS {
        return Err(ApiError::invalid_value(
            "tools",
            &format!("must contain at most {MAX_TOOLS} tools."),
        ));
    }
    let mut tools = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let tool = RequestObject::at(item, element("tools", i))?;
        if let Some(kind) = tool.string("type")?
            && kind != "custom"
        {
            return Err(ApiError::unsupported_parameter(
                &tool.param("type"),
                "Only client tools (with an input_schema) are supported; server tools run at Anthropic.",
            ));
        }
        let name = tool.non_empty_string("name")?;
        if name.chars().count() > MAX_TOOL_NAME_CHARS
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(ApiError::invalid_value(
                &tool.param("name"),
                &format!(
                    "must be 1 to {MAX_TOOL_NAME_CHARS} characters of a-z, A-Z, 0-9, '_' and '-'."
                ),
            ));
        }
        let parameters_json = match tool.get("input_schema") {
            Some(schema @ Value::Object(_)) => schema.to_string(),
            Some(_) => {
                return Err(ApiError::invalid_type(
                    &tool.param("input_schema"),
                    "a JSON Schema object",
                ));
            }
            None => return Err(ApiError::missing_parameter(&tool.param("input_schema"))),
        };
        tools.push(ToolDefinition {
            name: name.to_owned(),
            description: tool.string("description")?.map(str::to_owned),
            parameters_json: Some(parameters_json),
        });
    }
    Ok(tools)
}

/// `tool_choice` in the run's (OpenAI's) vocabulary: `auto`, `any`
/// (`required`), `tool` (that function), `none`; and
/// `disable_parallel_tool_use` as `parallel_tool_calls`.
fn parse_tool_choice(root: &RequestObject<'_>) -> Result<(Option<String>, Option<bool>), ApiError> {
    let Some(choice) = root.object("tool_choice")? else {
        return Ok((None, None));
    };
    let json = match choice.required_string("type")? {
        "auto" => json!("auto"),
        "any" => json!("required"),
        "none" => json!("none"),
        "tool" => {
            json!({"type": "function", "function": {"name": choice.non_empty_string("name")?}})
        }
        _ => {
            return Err(ApiError::invalid_value(
                &choice.param("type"),
                "must be 'auto', 'any', 'tool' or 'none'.",
            ));
        }
    };
    let parallel = choice
        .bool("disable_parallel_tool_use")?
        .map(|disable| !disable);
    Ok((Some(json.to_string()), parallel))
}

/// `thinking`: `{type: enabled, budget_tokens}` as a reasoning effort
/// (below [`MEDIUM_THINKING_BUDGET_TOKENS`] `low`, below
/// [`HIGH_THINKING_BUDGET_TOKENS`] `medium`, else `high`); `disabled` asks
/// for none (the provider's default, as without the field).
fn parse_thinking(
    root: &RequestObject<'_>,
    max_tokens: Option<u32>,
) -> Result<Option<String>, ApiError> {
    let Some(thinking) = root.object("thinking")? else {
        return Ok(None);
    };
    match thinking.required_string("type")? {
        "disabled" => Ok(None),
        "enabled" => {
            let budget = thinking
                .u32_at_least("budget_tokens", MIN_THINKING_BUDGET_TOKENS)?
                .ok_or_else(|| ApiError::missing_parameter(&thinking.param("budget_tokens")))?;
            if max_tokens.is_some_and(|max| budget >= max) {
                return Err(ApiError::invalid_value(
                    &thinking.param("budget_tokens"),
                    "must be less than max_tokens.",
                ));
            }
            let effort = if budget < MEDIUM_THINKING_BUDGET_TOKENS {
                "low"
            } else if budget < HIGH_THINKING_BUDGET_TOKENS {
                "medium"
            } else {
                "high"
            };
            Ok(Some(effort.to_owned()))
        }
        _ => Err(ApiError::invalid_value(
            &thinking.param("type"),
            "must be 'enabled' or 'disabled'.",
        )),
    }
}

/// `stop_sequences`: at most [`MAX_STOP_SEQUENCES`] non-empty strings.
fn parse_stop_sequences(root: &RequestObject<'_>) -> Result<Vec<String>, ApiError> {
    let Some(items) = root.array("stop_sequences")? else {
        return Ok(Vec::new());
    };
    if items.len() > MAX_STOP_SEQUENCES {
        return Err(ApiError::invalid_value(
            "stop_sequences",
            &format!("must contain at most {MAX_STOP_SEQUENCES} sequences."),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(s) if !s.is_empty() => Ok(s.clone()),
            Value::String(_) => Err(ApiError::invalid_value(
                &element("stop_sequences", i),
                "must not be empty.",
            )),
            _ => Err(ApiError::invalid_type(
                &element("stop_sequences", i),
                "a string",
            )),
        })
        .collect()
}

/// Anthropic's `stop_reason` for a run that ended with `finish_reason`,
/// having called tools or not.
pub fn stop_reason(finish_reason: FinishReason, called_tools: bool) -> &'static str {
    match finish_reason {
        FinishReason::Length => "max_tokens",
        FinishReason::ContentFilter => "refusal",
        FinishReason::ToolCalls => "tool_use",
        FinishReason::Stop if called_tools => "tool_use",
        FinishReason::Stop => "end_turn",
    }
}

/// The `usage` object: the provider's counts, or `null`s when it reported
/// none (never invented).
fn usage_json(usage: Option<Usage>) -> Value {
    match usage {
        Some(u) => json!({"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens}),
        None => json!({"input_tokens": null, "output_tokens": null}),
    }
}

/// The status and Anthropic error `type` of `err`: 400
/// `invalid_request_error`, 401 `authentication_error`, 403
/// `permission_error`, 404 `not_found_error`, 413 `request_too_large`,
/// 429 `rate_limit_error`, 529 `overloaded_error` (the Edge or its
/// providers over capacity or unavailable, the 503s of the other APIs),
/// 504 `timeout_error`, other 5xx `api_error`.
pub fn error_status_and_type(err: &ApiError) -> (u16, &'static str) {
    match (err.status, err.kind) {
        (413, _) => (413, "request_too_large"),
        (_, ErrorKind::Authentication) => (401, "authentication_error"),
        (_, ErrorKind::Permission) => (403, "permission_error"),
        (404, _) => (404, "not_found_error"),
        (_, ErrorKind::RateLimit) => (429, "rate_limit_error"),
        (_, ErrorKind::ServiceUnavailable) => (529, "overloaded_error"),
        (_, ErrorKind::Timeout) => (504, "timeout_error"),
        (status @ 400..=499, _) => (status, "invalid_request_error"),
        (status @ 500..=599, _) => (status, "api_error"),
        _ => (500, "api_error"),
    }
}

/// The Anthropic error body: `{"type":"error","error":{"type","message"}}`.
pub fn error_json(err: &ApiError) -> Value {
    let (_, kind) = error_status_and_type(err);
    json!({"type": "error", "error": {"type": kind, "message": err.message}})
}

/// An [`ApiError`] answered in Anthropic's shape and status codes, with
/// `retry-after` where the error has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagesError(pub ApiError);

impl IntoResponse for MessagesError {
    fn into_response(self) -> Response {
        let (status, _) = error_status_and_type(&self.0);
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(error_json(&self.0))).into_response();
        if let Some(secs) = self.0.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// The content block a stream has open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenBlock {
    Text,
    Thinking,
    /// The tool call of this index.
    Tool(u32),
}

/// One `content_block_start`'s block.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StartBlock<'a> {
    Text {
        text: &'static str,
    },
    Thinking {
        thinking: &'static str,
        signature: &'static str,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: Map<String, Value>,
    },
}

/// One `content_block_delta`'s delta.
#[derive(Serialize)]
#[serde(tag = "type")]
enum BlockDelta<'a> {
    #[serde(rename = "text_delta")]
    Text { text: &'a str },
    #[serde(rename = "thinking_delta")]
    Thinking { thinking: &'a str },
    #[serde(rename = "input_json_delta")]
    InputJson { partial_json: &'a str },
}

/// The events of a Messages stream.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StreamEvent<'a> {
    MessageStart {
        message: Value,
    },
    ContentBlockStart {
        index: u32,
        content_block: StartBlock<'a>,
    },
    ContentBlockDelta {
        index: u32,
        delta: BlockDelta<'a>,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: Value,
        usage: Value,
    },
    MessageStop,
    Ping,
}

impl StreamEvent<'_> {
    fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
            StreamEvent::Ping => "ping",
        }
    }

    fn write(&self, out: &mut Vec<u8>) {
        framing::sse_json(out, Some(self.name()), self);
    }
}

/// Encodes run events as Anthropic's Messages stream.
///
/// Content blocks follow the run's events: a run of text deltas is one
/// `text` block, of reasoning deltas one `thinking` block, each tool call
/// one `tool_use` block; a block closes when another kind begins. A
/// fragment of a tool call whose block was closed by another block cannot
/// be sent any more (Anthropic's blocks do not interleave) and is left
/// out; the OpenAI-compatible servers behind the adapters stream each call
/// whole before the next.
#[derive(Debug, Clone)]
pub struct MessagesStream {
    id: String,
    model: String,
    open: Option<(OpenBlock, u32)>,
    next_index: u32,
    /// Tool call indexes whose blocks were started (bounded by
    /// [`MAX_TOOL_CALLS_PER_RUN`]).
    tool_blocks: BTreeMap<u32, u32>,
    usage: Option<Usage>,
    finished: bool,
}

impl MessagesStream {
    /// A stream for message `id` (see [`message_id`]) of `model`.
    pub fn new(id: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            model: model.into(),
            open: None,
            next_index: 0,
            tool_blocks: BTreeMap::new(),
            usage: None,
            finished: false,
        }
    }

    /// True once a terminal was encoded.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// `message_start` (with an empty message) and a `ping`.
    pub fn start(&mut self, out: &mut Vec<u8>) {
        let message = json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            // Before any provider count; the `message_delta` has the totals.
            "usage": {"input_tokens": 0, "output_tokens": 0},
        });
        StreamEvent::MessageStart { message }.write(out);
        StreamEvent::Ping.write(out);
    }

    /// Append the events for one run event.
    pub fn push(&mut self, event: &RunEventKind, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        match event {
            RunEventKind::TextDelta(text) if !text.is_empty() => {
                let index = self.ensure_open(OpenBlock::Text, None, out);
                StreamEvent::ContentBlockDelta {
                    index,
                    delta: BlockDelta::Text { text },
                }
                .write(out);
            }
            RunEventKind::ReasoningDelta(text) if !text.is_empty() => {
                let index = self.ensure_open(OpenBlock::Thinking, None, out);
                StreamEvent::ContentBlockDelta {
                    index,
                    delta: BlockDelta::Thinking { thinking: text },
                }
                .write(out);
            }
            RunEventKind::ToolCallDelta(delta) => self.tool_call_delta(delta, out),
            RunEventKind::Usage(usage) => self.usage = Some(*usage),
            RunEventKind::Completed {
                finish_reason,
                usage,
            } => {
                if usage.is_some() {
                    self.usage = *usage;
                }
                self.close(out);
                let reason = stop_reason(*finish_reason, !self.tool_blocks.is_empty());
                StreamEvent::MessageDelta {
                    delta: json!({"stop_reason": reason, "stop_sequence": null}),
                    usage: usage_json(self.usage),
                }
                .write(out);
                StreamEvent::MessageStop.write(out);
                self.finished = true;
            }
            RunEventKind::Failed(failure) => {
                self.fail(&ApiError::from_execution_failure(failure), out);
            }
            RunEventKind::TextDelta(_)
            | RunEventKind::ReasoningDelta(_)
            | RunEventKind::Started { .. }
            | RunEventKind::Logprobs(_)
            | RunEventKind::Embedding(_) => {}
        }
    }

    /// End the stream with Anthropic's `error` event (R-GATE-3).
    pub fn fail(&mut self, err: &ApiError, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        self.finished = true;
        framing::sse_json(out, Some("error"), &error_json(err));
    }

    fn tool_call_delta(&mut self, delta: &ToolCallDelta, out: &mut Vec<u8>) {
        let index = match self.open {
            Some((OpenBlock::Tool(call), index)) if call == delta.index => index,
            _ => {
                if self.tool_blocks.contains_key(&delta.index)
                    || self.tool_blocks.len() >= MAX_TOOL_CALLS_PER_RUN
                {
                    return;
                }
                let id = delta
                    .id
                    .clone()
                    .unwrap_or_else(|| ids::derived_id("call_", &self.id, delta.index));
                let name = delta.name.as_deref().unwrap_or_default();
                let index =
                    self.ensure_open(OpenBlock::Tool(delta.index), Some((id.as_str(), name)), out);
                self.tool_blocks.insert(delta.index, index);
                index
            }
        };
        if !delta.arguments_delta.is_empty() {
            StreamEvent::ContentBlockDelta {
                index,
                delta: BlockDelta::InputJson {
                    partial_json: &delta.arguments_delta,
                },
            }
            .write(out);
        }
    }

    /// The index of the open block of `kind`, starting it (and closing
    /// another) if needed; `tool` is a tool block's id and name.
    fn ensure_open(
        &mut self,
        kind: OpenBlock,
        tool: Option<(&str, &str)>,
        out: &mut Vec<u8>,
    ) -> u32 {
        if let Some((open, index)) = self.open
            && open == kind
        {
            return index;
        }
        self.close(out);
        let index = self.next_index;
        self.next_index += 1;
        let content_block = match (kind, tool) {
            (OpenBlock::Text, _) => StartBlock::Text { text: "" },
            (OpenBlock::Thinking, _) => StartBlock::Thinking {
                thinking: "",
                signature: "",
            },
            (OpenBlock::Tool(_), tool) => {
                let (id, name) = tool.unwrap_or_default();
                StartBlock::ToolUse {
                    id,
                    name,
                    input: Map::new(),
                }
            }
        };
        StreamEvent::ContentBlockStart {
            index,
            content_block,
        }
        .write(out);
        self.open = Some((kind, index));
        index
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        if let Some((_, index)) = self.open.take() {
            StreamEvent::ContentBlockStop { index }.write(out);
        }
    }
}

/// Folds run events into one Anthropic `message` object.
#[derive(Debug, Clone)]
pub struct MessagesAccumulator {
    id: String,
    model: String,
    transcript: Transcript,
}

impl MessagesAccumulator {
    /// An accumulator for message `id` of `model`.
    pub fn new(id: impl Into<String>, model: impl Into<String>) -> Self {
        let id = id.into();
        Self {
            transcript: Transcript::new(id.clone()),
            id,
            model: model.into(),
        }
    }

    /// Fold one event in; events after the terminal are ignored.
    pub fn push(&mut self, event: &RunEventKind) {
        self.transcript.push(event);
    }

    /// The `message` object, or the error the run ended with. Tool
    /// arguments that are not a JSON object cannot be a `tool_use` block's
    /// `input`: the answer is then the provider's malformed response.
    pub fn finish(&self) -> Result<Value, ApiError> {
        let finish_reason = self.transcript.finish_reason()?;
        let tool_calls = self.transcript.tool_calls();
        let mut content = Vec::new();
        if !self.transcript.reasoning().is_empty() {
            content.push(json!({
                "type": "thinking",
                "thinking": self.transcript.reasoning(),
                "signature": "",
            }));
        }
        let text = self.transcript.text();
        if !text.is_empty() || (tool_calls.is_empty() && content.is_empty()) {
            content.push(json!({"type": "text", "text": text}));
        }
        for call in tool_calls.calls() {
            let input = match call.arguments.trim() {
                "" => Value::Object(Map::new()),
                args => match serde_json::from_str::<Value>(args) {
                    Ok(input @ Value::Object(_)) => input,
                    _ => return Err(ApiError::from_failure(FailureCode::MalformedResponse)),
                },
            };
            content.push(
                json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input}),
            );
        }
        Ok(json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(finish_reason, !tool_calls.is_empty()),
            "stop_sequence": null,
            "usage": usage_json(self.transcript.usage()),
        }))
    }
}

/// The Anthropic request a run stands for: the inverse of
/// [`parse_messages_request`] for every run it can produce (a provider
/// adapter speaking the Messages API renders a run with it).
pub fn request_json(run: &NormalizedRun) -> Value {
    let mut body = Map::new();
    body.insert("model".into(), json!(run.model));
    let mut messages = run.messages.as_slice();
    if let Some((first, rest)) = messages.split_first()
        && first.role == Role::System
    {
        body.insert("system".into(), json!(first.content));
        messages = rest;
    }
    let rendered: Vec<Value> = messages.iter().map(message_json).collect();
    body.insert("messages".into(), Value::Array(rendered));
    let p = &run.params;
    if let Some(max) = p.max_tokens {
        body.insert("max_tokens".into(), json!(max));
    }
    if run.stream {
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
    let extra: Map<String, Value> = p
        .extra_json
        .as_deref()
        .and_then(|e| serde_json::from_str(e).ok())
        .unwrap_or_default();
    if let Some(top_k) = extra.get("top_k") {
        body.insert("top_k".into(), top_k.clone());
    }
    if let Some(user) = extra.get("user") {
        body.insert("metadata".into(), json!({"user_id": user}));
    }
    if !run.tools.is_empty() {
        let tools: Vec<Value> = run
            .tools
            .iter()
            .map(|t| {
                let schema = t
                    .parameters_json
                    .as_deref()
                    .and_then(|s| serde_json::from_str::<Value>(s).ok())
                    .unwrap_or_else(|| json!({"type": "object"}));
                let mut tool = json!({"name": t.name, "input_schema": schema});
                if let Some(d) = &t.description {
                    tool["description"] = json!(d);
                }
                tool
            })
            .collect();
        body.insert("tools".into(), Value::Array(tools));
    }
    if let Some(choice) = p.tool_choice_json.as_deref() {
        let choice: Value = serde_json::from_str(choice).unwrap_or(Value::Null);
        let mut rendered = match choice.as_str() {
            Some("required") => json!({"type": "any"}),
            Some("none") => json!({"type": "none"}),
            Some(_) => json!({"type": "auto"}),
            None => json!({"type": "tool", "name": choice["function"]["name"]}),
        };
        if let Some(parallel) = p.parallel_tool_calls {
            rendered["disable_parallel_tool_use"] = json!(!parallel);
        }
        body.insert("tool_choice".into(), rendered);
    }
    if let Some(effort) = p.reasoning_effort.as_deref() {
        let budget = match effort {
            "low" | "minimal" => MIN_THINKING_BUDGET_TOKENS,
            "medium" => MEDIUM_THINKING_BUDGET_TOKENS,
            _ => HIGH_THINKING_BUDGET_TOKENS,
        };
        body.insert(
            "thinking".into(),
            json!({"type": "enabled", "budget_tokens": budget}),
        );
    }
    Value::Object(body)
}

/// One run message as an Anthropic message.
fn message_json(m: &ChatMessage) -> Value {
    match m.role {
        Role::Tool => json!({"role": "user", "content": [{
            "type": "tool_result",
            "tool_use_id": m.tool_call_id.as_deref().unwrap_or_default(),
            "content": m.content,
        }]}),
        Role::Assistant if !m.tool_calls.is_empty() => {
            let mut blocks = Vec::new();
            if !m.content.is_empty() {
                blocks.push(json!({"type": "text", "text": m.content}));
            }
            for call in &m.tool_calls {
                let input = serde_json::from_str::<Value>(&call.arguments)
                    .ok()
                    .filter(Value::is_object)
                    .unwrap_or_else(|| json!({}));
                blocks.push(
                    json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input}),
                );
            }
            json!({"role": "assistant", "content": blocks})
        }
        Role::User if !m.images.is_empty() => {
            let mut blocks: Vec<Value> = m.images.iter().map(|url| image_json(url)).collect();
            if !m.content.is_empty() {
                blocks.push(json!({"type": "text", "text": m.content}));
            }
            json!({"role": "user", "content": blocks})
        }
        Role::Assistant => json!({"role": "assistant", "content": m.content}),
        // A system message after the first has no place of its own.
        Role::User | Role::System => json!({"role": "user", "content": m.content}),
    }
}

/// An image URL as an Anthropic image block.
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

#[cfg(test)]
mod tests;
