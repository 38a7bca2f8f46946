//! A Messages request as a normalized run ([`parse_messages_request`],
//! [`parse_count_tokens_request`]). The other direction, the Messages
//! request a run stands for, is the `anthropic` adapter's (the node's
//! `adapter::anthropic::request_json`), the one place a run is rendered
//! for a Messages server; the round trip through both is tested here.

use iop_wire::{
    CacheControl, CacheTtl, ChatMessage, Document, DocumentSource, GenerationParams, Role, RunApi,
    ToolCall, ToolDefinition,
};
use serde_json::{Map, Value, json};

use super::super::NormalizedRun;
use super::super::chat::{MAX_TOOLS, parse_model};
use super::super::error::ApiError;
use super::super::request_object::{RequestObject, element, parse_body, type_name};
use super::super::surface::MAX_IMAGES_PER_REQUEST;
use super::{
    BETA_HEADER, COUNT_TOKENS_FIELDS, HIGH_THINKING_BUDGET_TOKENS, IMAGE_MEDIA_TYPES,
    MAX_BETA_NAME_BYTES, MAX_BETAS, MAX_DOCUMENTS_PER_REQUEST, MAX_STOP_SEQUENCES,
    MAX_TOOL_NAME_CHARS, MEDIUM_THINKING_BUDGET_TOKENS, MESSAGES_FIELDS,
    MIN_THINKING_BUDGET_TOKENS,
};

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
        let (text, cache_control) = system_text(system)?;
        if !text.is_empty() {
            messages.push(ChatMessage {
                cache_control,
                ..message(Role::System, text)
            });
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
    let mut attachments = Attachments::default();
    for (i, raw) in raw_messages.iter().enumerate() {
        let last = i + 1 == raw_messages.len();
        parse_message(
            raw,
            element("messages", i),
            last,
            &mut attachments,
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

/// The beta features a Messages request names in its `anthropic-beta`
/// headers (comma-separated, several headers joined), each once, in the
/// order given: at most [`MAX_BETAS`] names of at most
/// [`MAX_BETA_NAME_BYTES`] bytes of `a-z`, `A-Z`, `0-9`, `.`, `_` and `-`
/// (R-LIM-5); anything else is a 400 naming the header.
pub fn parse_betas(headers: &axum::http::HeaderMap) -> Result<Vec<String>, ApiError> {
    let invalid = |detail: &str| ApiError::invalid_value(BETA_HEADER, detail);
    let mut betas: Vec<String> = Vec::new();
    for value in headers.get_all(BETA_HEADER) {
        let value = value
            .to_str()
            .map_err(|_| invalid("must be visible ASCII."))?;
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name.len() > MAX_BETA_NAME_BYTES
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            {
                return Err(invalid(&format!(
                    "beta names are 1 to {MAX_BETA_NAME_BYTES} characters of a-z, A-Z, 0-9, '.', '_' and '-', separated by commas."
                )));
            }
            if betas.iter().any(|b| b == name) {
                continue;
            }
            if betas.len() == MAX_BETAS {
                return Err(invalid(&format!(
                    "a request may name at most {MAX_BETAS} beta features."
                )));
            }
            betas.push(name.to_owned());
        }
    }
    Ok(betas)
}

pub(super) fn message(role: Role, content: String) -> ChatMessage {
    ChatMessage {
        role,
        content,
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
        images: Vec::new(),
        cache_control: None,
        documents: Vec::new(),
    }
}

/// What a request may still attach: images and documents are bounded per
/// request ([`MAX_IMAGES_PER_REQUEST`], [`MAX_DOCUMENTS_PER_REQUEST`]),
/// over all its messages and tool results; their bytes are the body's,
/// bounded with it (R-LIM-2).
#[derive(Debug)]
struct Attachments {
    images_left: usize,
    documents_left: usize,
}

impl Default for Attachments {
    fn default() -> Self {
        Self {
            images_left: MAX_IMAGES_PER_REQUEST,
            documents_left: MAX_DOCUMENTS_PER_REQUEST,
        }
    }
}

/// What a `document` block is to the run: text (a `text` or `content`
/// source) joins its message's text; a PDF is attached to the message.
#[derive(Debug)]
enum DocumentBlock {
    Text(String),
    Pdf(Document),
}

/// `system`: a string, or an array of text blocks joined by newlines;
/// with the last block's `cache_control` ([`parse_cache_control`]).
fn system_text(system: &Value) -> Result<(String, Option<CacheControl>), ApiError> {
    match system {
        Value::String(s) => Ok((s.clone(), None)),
        Value::Array(blocks) => {
            let mut texts = Vec::with_capacity(blocks.len());
            let mut cache_control = None;
            for (i, block) in blocks.iter().enumerate() {
                let block = RequestObject::at(block, element("system", i))?;
                if block.required_string("type")? != "text" {
                    return Err(ApiError::invalid_value(
                        &block.param("type"),
                        "system blocks must be text blocks.",
                    ));
                }
                texts.push(block.required_string("text")?.to_owned());
                cache_control = parse_cache_control(&block)?;
            }
            Ok((texts.join("\n"), cache_control))
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
    attachments: &mut Attachments,
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
        if matches!(
            (kind, role),
            ("text", _) | ("image" | "document", Role::User) | ("tool_use", Role::Assistant)
        ) {
            // The turn's own blocks: its breakpoint is its last one's.
            turn.cache_control = parse_cache_control(&block)?;
        }
        match (kind, role) {
            ("text", _) => texts.push(block.required_string("text")?.to_owned()),
            ("image", Role::User) => {
                turn.images.push(parse_image(&block, attachments)?);
            }
            ("document", Role::User) => match parse_document(&block, attachments)? {
                DocumentBlock::Text(text) => texts.push(text),
                DocumentBlock::Pdf(document) => turn.documents.push(document),
            },
            ("tool_result", Role::User) => {
                out.push(ChatMessage {
                    cache_control: parse_cache_control(&block)?,
                    ..parse_tool_result(&block, attachments)?
                });
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
                    "Supported content blocks are text, image, document, tool_use, tool_result and thinking.",
                ));
            }
        }
    }
    turn.content = texts.join("\n");
    if !turn.content.is_empty()
        || !turn.images.is_empty()
        || !turn.documents.is_empty()
        || !turn.tool_calls.is_empty()
    {
        out.push(turn);
    } else if !produced && !blocks.is_empty() && role == Role::User {
        return Err(empty());
    }
    Ok(())
}

/// A block's `cache_control` (`{type: "ephemeral", ttl?: "5m" | "1h"}`),
/// a prompt-cache breakpoint. The run carries one per message, at its end:
/// a turn's breakpoint is its last block's, a tool result's its own, the
/// system prompt's its last block's; one on an earlier block of a turn is
/// not carried (moved to the turn's end it would write the cache where no
/// later request reads it).
fn parse_cache_control(block: &RequestObject<'_>) -> Result<Option<CacheControl>, ApiError> {
    let Some(cache_control) = block.object("cache_control")? else {
        return Ok(None);
    };
    if cache_control.required_string("type")? != "ephemeral" {
        return Err(ApiError::invalid_value(
            &cache_control.param("type"),
            "must be 'ephemeral'.",
        ));
    }
    let ttl = match cache_control.string("ttl")? {
        None => None,
        Some(ttl) => Some(CacheTtl::parse(ttl).ok_or_else(|| {
            ApiError::invalid_value(&cache_control.param("ttl"), "must be '5m' or '1h'.")
        })?),
    };
    Ok(Some(CacheControl { ttl }))
}

/// An image block: `source` `{type: base64, media_type, data}` as a
/// `data:` URL, or `{type: url, url}`.
fn parse_image(
    block: &RequestObject<'_>,
    attachments: &mut Attachments,
) -> Result<String, ApiError> {
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
            let data = base64_data(&source, "image")?;
            format!("data:{media_type};base64,{data}")
        }
        "url" => http_url(&source)?,
        _ => {
            return Err(ApiError::unsupported_parameter(
                &source.param("type"),
                "Image sources are 'base64' or 'url' (files are not supported).",
            ));
        }
    };
    if attachments.images_left == 0 {
        return Err(ApiError::invalid_value(
            &block.param("source"),
            &format!("a request may attach at most {MAX_IMAGES_PER_REQUEST} images."),
        ));
    }
    attachments.images_left -= 1;
    Ok(url)
}

/// A source's `data`: non-empty base64 (the standard alphabet), of `what`.
fn base64_data<'a>(source: &RequestObject<'a>, what: &str) -> Result<&'a str, ApiError> {
    let data = source.non_empty_string("data")?;
    if !data
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
    {
        return Err(ApiError::invalid_value(
            &source.param("data"),
            &format!("must be base64-encoded {what} data."),
        ));
    }
    Ok(data)
}

/// A source's `url`: an `http(s)://` URL.
fn http_url(source: &RequestObject<'_>) -> Result<String, ApiError> {
    let url = source.non_empty_string("url")?;
    if !url.starts_with("https://") && !url.starts_with("http://") {
        return Err(ApiError::invalid_value(
            &source.param("url"),
            "must be an http(s) URL.",
        ));
    }
    Ok(url.to_owned())
}

/// A `document` block: text (a `text` source, or a `content` source of
/// text blocks) after its `title` and `context`; or a PDF (a `base64`
/// source of `application/pdf`, or a `url` source) attached with its
/// `title` and `context`. A file id (the Files API) belongs to an
/// account iop does not share: a 400. Citations cannot come back through
/// a run: asking for them is a 400 too.
fn parse_document(
    block: &RequestObject<'_>,
    attachments: &mut Attachments,
) -> Result<DocumentBlock, ApiError> {
    let Some(source) = block.object("source")? else {
        return Err(ApiError::missing_parameter(&block.param("source")));
    };
    if let Some(citations) = block.object("citations")?
        && citations.bool("enabled")? == Some(true)
    {
        return Err(ApiError::unsupported_parameter(
            &citations.param("enabled"),
            "Citations are not supported by this gateway.",
        ));
    }
    let title = block.string("title")?.filter(|s| !s.is_empty());
    let context = block.string("context")?.filter(|s| !s.is_empty());
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
        kind @ ("base64" | "url") => {
            let source = if kind == "base64" {
                let media_type = source.required_string("media_type")?;
                if media_type != DocumentSource::PDF_MEDIA_TYPE {
                    return Err(ApiError::invalid_value(
                        &source.param("media_type"),
                        &format!(
                            "must be '{}' (a text document is a 'text' source).",
                            DocumentSource::PDF_MEDIA_TYPE
                        ),
                    ));
                }
                DocumentSource::PdfBase64(base64_data(&source, "PDF")?.to_owned())
            } else {
                DocumentSource::PdfUrl(http_url(&source)?)
            };
            if attachments.documents_left == 0 {
                return Err(ApiError::invalid_value(
                    &block.param("source"),
                    &format!(
                        "a request may attach at most {MAX_DOCUMENTS_PER_REQUEST} PDF documents."
                    ),
                ));
            }
            attachments.documents_left -= 1;
            return Ok(DocumentBlock::Pdf(Document {
                source,
                title: title.map(str::to_owned),
                context: context.map(str::to_owned),
            }));
        }
        "file" => {
            return Err(ApiError::unsupported_parameter(
                &source.param("type"),
                "Documents by file id (the Files API) are not supported by this gateway; send the PDF as base64 or by URL, or the document's text.",
            ));
        }
        _ => {
            return Err(ApiError::invalid_value(
                &source.param("type"),
                "must be 'text', 'content', 'base64' or 'url'.",
            ));
        }
    };
    let mut parts: Vec<&str> = title.into_iter().chain(context).collect();
    parts.push(&text);
    Ok(DocumentBlock::Text(parts.join("\n")))
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

/// A `tool_result` block: a tool message answering `tool_use_id`, its
/// text, images and PDF documents (a text document joins its text). An
/// error result (`is_error`) says so before its content.
fn parse_tool_result(
    block: &RequestObject<'_>,
    attachments: &mut Attachments,
) -> Result<ChatMessage, ApiError> {
    let id = block.non_empty_string("tool_use_id")?.to_owned();
    let mut tool = message(Role::Tool, String::new());
    match block.get("content") {
        None => {}
        Some(Value::String(s)) => tool.content = s.clone(),
        Some(Value::Array(blocks)) => {
            let path = block.param("content");
            let mut texts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let b = RequestObject::at(b, element(&path, i))?;
                match b.required_string("type")? {
                    "text" => texts.push(b.required_string("text")?.to_owned()),
                    "image" => tool.images.push(parse_image(&b, attachments)?),
                    "document" => match parse_document(&b, attachments)? {
                        DocumentBlock::Text(text) => texts.push(text),
                        DocumentBlock::Pdf(document) => tool.documents.push(document),
                    },
                    _ => {
                        return Err(ApiError::unsupported_parameter(
                            &b.param("type"),
                            "A tool result carries text, images and documents only in this gateway.",
                        ));
                    }
                }
            }
            tool.content = texts.join("\n");
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
    }
    if block.bool("is_error")? == Some(true) {
        tool.content.insert_str(0, "Error: ");
    }
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
            cache_control: parse_cache_control(&tool)?,
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
