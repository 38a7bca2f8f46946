//! `POST /v1/responses`: request parsing, the streaming event sequence and the
//! non-streaming `response` object.
//!
//! * [`parse_responses_request`] turns a body into a normalized
//!   [`ResponsesRequest`]: `instructions` becomes a leading system message,
//!   `function_call` items become assistant tool calls and
//!   `function_call_output` items become tool messages.
//! * [`ResponsesStream`] writes the documented event sequence as SSE events
//!   (`event:` name plus `data:` JSON with the same `type` and an increasing
//!   `sequence_number`):
//!
//!   1. `response.created`, `response.in_progress`
//!   2. for reasoning the provider streams (`reasoning_content`, Ollama's
//!      `thinking`): `response.output_item.added` (reasoning),
//!      `response.content_part.added` (`reasoning_text`),
//!      `response.reasoning_text.delta`…
//!   3. for text: `response.output_item.added` (message),
//!      `response.content_part.added`, `response.output_text.delta`…
//!   4. for each tool call: `response.output_item.added` (function_call),
//!      `response.function_call_arguments.delta`…
//!   5. at the end, per item in output order: `response.reasoning_text.done`,
//!      `response.content_part.done`, `response.output_item.done`
//!      (reasoning); `response.output_text.done`,
//!      `response.content_part.done`, `response.output_item.done` (message);
//!      `response.function_call_arguments.done`, `response.output_item.done`
//!      (function call)
//!   6. `response.completed` (or `response.incomplete` when the token limit
//!      or a content filter ended generation), carrying `usage`
//!
//!   A failure ends the stream with `error` and then `response.failed`.
//! * [`ResponsesAccumulator`] builds the final `response` object.

use std::collections::BTreeMap;

use iop_core::edge::client_ids;
use iop_wire::{
    ChatMessage, FinishReason, GenerationParams, Role, RunApi, RunEventKind, ToolCall,
    ToolCallDelta, ToolDefinition, Usage,
};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::NormalizedRun;
use super::chat::{
    MAX_TOOL_CALLS_PER_RUN, MAX_TOOLS, check_tool_choice_mode, parse_function_definition,
    parse_model, parse_text_content,
};
use super::error::ApiError;
use super::framing;
use super::ids;
use super::request_object::{RequestObject, element, parse_body};
use super::surface::{
    PartTypes, json_schema_spec, parse_content, parse_logprobs, parse_reasoning_effort,
    pass_through_fields,
};
use super::transcript::RunOutcome;

/// Request fields a `response` object echoes back to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseEcho {
    /// `instructions` as sent.
    pub instructions: Option<String>,
    /// The `tools` array as sent (function tools only), or `[]`.
    pub tools: Value,
    /// `tool_choice` as sent, or `"auto"`.
    pub tool_choice: Value,
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `max_output_tokens`.
    pub max_output_tokens: Option<u32>,
    /// `parallel_tool_calls` (default true).
    pub parallel_tool_calls: bool,
    /// `metadata` as sent, or `{}`.
    pub metadata: Value,
    /// `store` as sent (`None`: the Edge's default decides).
    pub store_requested: Option<bool>,
    /// Whether the response is stored (decided by the Edge; echoed).
    pub store: bool,
    /// `background: true` was sent.
    pub background: bool,
    /// `previous_response_id` as sent.
    pub previous_response_id: Option<String>,
    /// `reasoning.effort` as sent.
    pub reasoning_effort: Option<String>,
}

impl Default for ResponseEcho {
    fn default() -> Self {
        Self {
            instructions: None,
            tools: json!([]),
            tool_choice: json!("auto"),
            temperature: None,
            top_p: None,
            max_output_tokens: None,
            parallel_tool_calls: true,
            metadata: json!({}),
            store_requested: None,
            store: false,
            background: false,
            previous_response_id: None,
            reasoning_effort: None,
        }
    }
}

/// A parsed Responses request, ready to become a normalized run.
#[derive(Debug, Clone, PartialEq)]
pub struct ResponsesRequest {
    /// The run (instructions first, as a system message; `tool_choice_json`
    /// in the Chat shape; `stream: true` answers with SSE events).
    pub run: NormalizedRun,
    /// Fields to echo in the `response` object.
    pub echo: ResponseEcho,
}

/// Parse a `POST /v1/responses` body.
pub fn parse_responses_request(body: &[u8]) -> Result<ResponsesRequest, ApiError> {
    let value = parse_body(body)?;
    let root = RequestObject::root(&value)?;

    let model = parse_model(&root)?;
    let stream = root.bool("stream")?.unwrap_or(false);

    let previous_response_id = root.string("previous_response_id")?.map(str::to_owned);
    // R-LIM-5: only an id this Edge could have issued is looked up.
    if previous_response_id
        .as_deref()
        .is_some_and(|id| client_ids::issued_id_seed(client_ids::RESPONSE_ID_PREFIX, id).is_none())
    {
        return Err(ApiError::invalid_value(
            "previous_response_id",
            "is not a response id ('resp_' and 16 hex digits).",
        ));
    }
    let store_requested = root.bool("store")?;
    let background = root.bool("background")?.unwrap_or(false);
    if background && store_requested == Some(false) {
        return Err(ApiError::invalid_value(
            "store",
            "must be true for a background response (it is fetched later).",
        ));
    }
    root.reject(
        "conversation",
        "This gateway does not store conversations; send the full conversation in 'input'.",
    )?;
    root.reject("prompt", "Prompt templates are not supported.")?;
    let response_format_json = parse_text_format(&root)?;
    let reasoning_effort = match root.object("reasoning")? {
        Some(reasoning) => parse_reasoning_effort(&reasoning, "effort")?,
        None => None,
    };

    let instructions = root.string("instructions")?.map(str::to_owned);
    let mut messages = Vec::new();
    if let Some(instructions) = &instructions {
        messages.push(text_message(Role::System, instructions.clone()));
    }
    match root.get("input") {
        None => return Err(ApiError::missing_parameter("input")),
        Some(Value::String(text)) => messages.push(text_message(Role::User, text.clone())),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(ApiError::invalid_value(
                    "input",
                    "must contain at least one item.",
                ));
            }
            let mut images_left = super::surface::MAX_IMAGES_PER_REQUEST;
            for (i, item) in items.iter().enumerate() {
                push_input_item(&mut messages, item, element("input", i), &mut images_left)?;
            }
        }
        Some(_) => {
            return Err(ApiError::invalid_type(
                "input",
                "a string or an array of input items",
            ));
        }
    }

    let (tools, tools_echo) = parse_response_tools(&root)?;
    let (tool_choice_json, tool_choice_echo) = parse_response_tool_choice(&root)?;

    let (_, top_logprobs) = parse_logprobs(&root, "")?;
    let params = GenerationParams {
        temperature: root.number_in("temperature", 0.0, 2.0)?,
        top_p: root.number_in("top_p", 0.0, 1.0)?,
        max_tokens: root.u32_at_least("max_output_tokens", 1)?,
        tool_choice_json,
        response_format_json,
        logprobs: top_logprobs.is_some(),
        top_logprobs,
        reasoning_effort,
        parallel_tool_calls: root.bool("parallel_tool_calls")?,
        extra_json: pass_through_fields(&root, RESPONSES_FIELDS)?,
        whole_answer: !stream,
        ..GenerationParams::default()
    };
    let echo = ResponseEcho {
        instructions,
        tools: tools_echo,
        tool_choice: tool_choice_echo,
        temperature: params.temperature,
        top_p: params.top_p,
        max_output_tokens: params.max_tokens,
        parallel_tool_calls: root.bool("parallel_tool_calls")?.unwrap_or(true),
        metadata: match super::surface::parse_metadata(&root)? {
            Some(_) => root.get("metadata").cloned().unwrap_or_else(|| json!({})),
            None => json!({}),
        },
        store_requested,
        store: false,
        background,
        previous_response_id,
        reasoning_effort: params.reasoning_effort.clone(),
    };

    Ok(ResponsesRequest {
        run: NormalizedRun {
            model,
            stream,
            api: RunApi::Chat,
            messages,
            tools,
            params,
            choices: 1,
        },
        echo,
    })
}

/// The input items of a Responses request body, as
/// `GET /v1/responses/{id}/input_items` lists them (oldest first): each as
/// sent, with `type`, `id` (derived from `response_id` where the client
/// gave none) and a message's string `content` as one text part.
pub fn input_items(body: &[u8], response_id: &str) -> Result<Vec<Value>, ApiError> {
    let root = parse_body(body)?;
    let items = match root.get("input") {
        Some(Value::String(text)) => vec![json!({
            "type": "message",
            "role": "user",
            "content": text,
        })],
        Some(Value::Array(items)) => items.clone(),
        _ => Vec::new(),
    };
    Ok(items
        .into_iter()
        .enumerate()
        .map(|(i, mut item)| {
            let Some(fields) = item.as_object_mut() else {
                return item;
            };
            if !fields.contains_key("type") && fields.contains_key("role") {
                fields.insert("type".into(), json!("message"));
            }
            let kind = fields.get("type").and_then(Value::as_str).unwrap_or("");
            let prefix = match kind {
                "message" => "msg_",
                "function_call" => "fc_",
                "function_call_output" => "fco_",
                _ => "item_",
            };
            if kind == "message" {
                let part = if fields.get("role").and_then(Value::as_str) == Some("assistant") {
                    "output_text"
                } else {
                    "input_text"
                };
                if let Some(Value::String(text)) = fields.get("content") {
                    let text = text.clone();
                    fields.insert("content".into(), json!([{ "type": part, "text": text }]));
                }
                fields.entry("status").or_insert(json!("completed"));
            }
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            fields
                .entry("id")
                .or_insert_with(|| json!(ids::derived_id(prefix, response_id, index)));
            item
        })
        .collect())
}

fn text_message(role: Role, content: String) -> ChatMessage {
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

/// The Responses fields the Edge interprets or that only mean something to
/// a Responses server; every other top-level field passes through to the
/// provider ([`pass_through_fields`]).
pub const RESPONSES_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "max_tool_calls",
    "temperature",
    "top_p",
    "top_logprobs",
    "text",
    "reasoning",
    "metadata",
    "store",
    "include",
    "truncation",
    "user",
    "service_tier",
    "background",
    "previous_response_id",
    "conversation",
    "prompt",
    "prompt_cache_key",
    "safety_identifier",
];

/// Responses input parts: `input_text`/`output_text`/`text`, and
/// `input_image` with `image_url` a URL string.
const RESPONSES_PARTS: PartTypes = PartTypes {
    text: &["input_text", "output_text", "text"],
    image: Some(("input_image", false)),
};

/// `text.format`: `text` (None), `json_object`, or `json_schema` with
/// `name`, `schema` and `strict` beside `type`; kept in the Chat shape.
fn parse_text_format(root: &RequestObject<'_>) -> Result<Option<String>, ApiError> {
    let Some(text) = root.object("text")? else {
        return Ok(None);
    };
    let Some(format) = text.object("format")? else {
        return Ok(None);
    };
    match format.required_string("type")? {
        "text" => Ok(None),
        "json_object" => Ok(Some(json!({"type": "json_object"}).to_string())),
        "json_schema" => {
            let spec = json_schema_spec(&format)?;
            Ok(Some(
                json!({"type": "json_schema", "json_schema": spec}).to_string(),
            ))
        }
        _ => Err(ApiError::invalid_value(
            &format.param("type"),
            "must be 'text', 'json_object' or 'json_schema'.",
        )),
    }
}

/// Fold one `input` item into the conversation.
fn push_input_item(
    messages: &mut Vec<ChatMessage>,
    item: &Value,
    path: String,
    images_left: &mut usize,
) -> Result<(), ApiError> {
    let obj = RequestObject::at(item, path)?;
    let kind = match obj.string("type")? {
        Some(kind) => kind,
        None if obj.has("role") => "message",
        None => return Err(ApiError::missing_parameter(&obj.param("type"))),
    };
    match kind {
        "message" => {
            let role = match obj.non_empty_string("role")? {
                "system" | "developer" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                _ => {
                    return Err(ApiError::invalid_value(
                        &obj.param("role"),
                        "must be one of 'system', 'developer', 'user' or 'assistant'.",
                    ));
                }
            };
            let Some(content) = obj.get("content") else {
                return Err(ApiError::missing_parameter(&obj.param("content")));
            };
            let content =
                parse_content(content, &obj.param("content"), RESPONSES_PARTS, images_left)?;
            let mut message = text_message(role, content.text);
            message.images = content.images;
            messages.push(message);
        }
        "function_call" => {
            let call = ToolCall {
                id: obj.non_empty_string("call_id")?.to_owned(),
                name: obj.non_empty_string("name")?.to_owned(),
                arguments: obj.required_string("arguments")?.to_owned(),
            };
            // Consecutive assistant output is one assistant turn.
            match messages.last_mut() {
                Some(last) if last.role == Role::Assistant => last.tool_calls.push(call),
                _ => {
                    let mut message = text_message(Role::Assistant, String::new());
                    message.tool_calls.push(call);
                    messages.push(message);
                }
            }
        }
        "function_call_output" => {
            let call_id = obj.non_empty_string("call_id")?.to_owned();
            let Some(output) = obj.get("output") else {
                return Err(ApiError::missing_parameter(&obj.param("output")));
            };
            let content = parse_text_content(output, &obj.param("output"), &["input_text"])?;
            // The tool's name, from the call it answers, helps adapters (Ollama) that key on it.
            let name = messages
                .iter()
                .rev()
                .flat_map(|m| m.tool_calls.iter())
                .find(|c| c.id == call_id)
                .map(|c| c.name.clone());
            messages.push(ChatMessage {
                role: Role::Tool,
                content,
                tool_calls: Vec::new(),
                tool_call_id: Some(call_id),
                name,
                images: Vec::new(),
                cache_control: None,
                documents: Vec::new(),
            });
        }
        // A reasoning item a client passes back (managing its own
        // context) is the model's earlier chain of thought: providers behind
        // the chat API take none, so it is accepted and left out.
        "reasoning" => {}
        "item_reference" => {
            return Err(ApiError::unsupported_parameter(
                &obj.param("type"),
                "Only 'message', 'reasoning', 'function_call' and 'function_call_output' input items are supported.",
            ));
        }
        _ => {
            return Err(ApiError::invalid_value(
                &obj.param("type"),
                "must be 'message', 'reasoning', 'function_call' or 'function_call_output'.",
            ));
        }
    }
    Ok(())
}

/// `tools`: `[{"type":"function","name","description","parameters","strict"}]`.
fn parse_response_tools(
    root: &RequestObject<'_>,
) -> Result<(Vec<ToolDefinition>, Value), ApiError> {
    let Some(items) = root.array("tools")? else {
        return Ok((Vec::new(), json!([])));
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
        if tool.required_string("type")? != "function" {
            return Err(ApiError::unsupported_parameter(
                &tool.param("type"),
                "Only 'function' tools are supported.",
            ));
        }
        tools.push(parse_function_definition(&tool)?);
    }
    Ok((tools, Value::Array(items.clone())))
}

/// `tool_choice`: a mode string or `{"type":"function","name"}`; normalized
/// to the Chat shape for the run, echoed as sent.
fn parse_response_tool_choice(
    root: &RequestObject<'_>,
) -> Result<(Option<String>, Value), ApiError> {
    let Some(choice) = root.get("tool_choice") else {
        return Ok((None, json!("auto")));
    };
    let normalized = match choice {
        Value::String(mode) => {
            check_tool_choice_mode(mode, "tool_choice")?;
            choice.clone()
        }
        Value::Object(_) => {
            let obj = RequestObject::at(choice, "tool_choice".to_owned())?;
            if obj.required_string("type")? != "function" {
                return Err(ApiError::unsupported_parameter(
                    &obj.param("type"),
                    "Only 'function' tool choices are supported.",
                ));
            }
            let name = obj.non_empty_string("name")?;
            json!({ "type": "function", "function": { "name": name } })
        }
        _ => {
            return Err(ApiError::invalid_type(
                "tool_choice",
                "a string or an object",
            ));
        }
    };
    Ok((Some(normalized.to_string()), choice.clone()))
}

/// The Responses `usage` object. Its details are required integers in the
/// API's schema: the provider's cache counts, zero where it reported none.
fn usage_json(usage: Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cache_read_tokens.unwrap_or(0),
            "cache_write_tokens": usage.cache_write_tokens.unwrap_or(0),
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": { "reasoning_tokens": 0 },
        "total_tokens": usage.prompt_tokens.saturating_add(usage.completion_tokens),
    })
}

/// One output item being built.
#[derive(Debug, Clone)]
enum OutputItem {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// How a text or tool-call fragment changed the output.
#[derive(Debug, Clone, Copy)]
struct ItemTouch {
    output_index: usize,
    opened: bool,
}

/// The `response` object under construction, shared by stream and accumulator.
#[derive(Debug, Clone)]
struct ResponseDraft {
    id: String,
    model: String,
    created_unix: u64,
    echo: ResponseEcho,
    items: Vec<OutputItem>,
    message_item: Option<usize>,
    reasoning_item: Option<usize>,
    call_items: BTreeMap<u32, usize>,
    usage: Option<Usage>,
}

impl ResponseDraft {
    fn new(id: String, model: String, created_unix: u64) -> Self {
        Self {
            id,
            model,
            created_unix,
            echo: ResponseEcho::default(),
            items: Vec::new(),
            message_item: None,
            reasoning_item: None,
            call_items: BTreeMap::new(),
            usage: None,
        }
    }

    fn next_item_id(&self, prefix: &str) -> String {
        let index = u32::try_from(self.items.len()).unwrap_or(u32::MAX);
        ids::derived_id(prefix, &self.id, index)
    }

    /// All text goes to one message item, opened at the first text.
    fn add_text(&mut self, text: &str) -> ItemTouch {
        self.append(text, false)
    }

    /// All reasoning goes to one reasoning item, opened at the first
    /// reasoning text.
    fn add_reasoning(&mut self, text: &str) -> ItemTouch {
        self.append(text, true)
    }

    /// Append `text` to the message (or reasoning) item, opening it first.
    fn append(&mut self, text: &str, reasoning: bool) -> ItemTouch {
        let open = if reasoning {
            self.reasoning_item
        } else {
            self.message_item
        };
        if let Some(index) = open {
            if let Some(
                OutputItem::Message { text: all, .. } | OutputItem::Reasoning { text: all, .. },
            ) = self.items.get_mut(index)
            {
                all.push_str(text);
            }
            return ItemTouch {
                output_index: index,
                opened: false,
            };
        }
        let index = self.items.len();
        let text = text.to_owned();
        if reasoning {
            let id = self.next_item_id("rs_");
            self.items.push(OutputItem::Reasoning { id, text });
            self.reasoning_item = Some(index);
        } else {
            let id = self.next_item_id("msg_");
            self.items.push(OutputItem::Message { id, text });
            self.message_item = Some(index);
        }
        ItemTouch {
            output_index: index,
            opened: true,
        }
    }

    /// One function-call item per call index, opened at its first fragment.
    fn add_tool_delta(&mut self, delta: &ToolCallDelta) -> Option<ItemTouch> {
        if let Some(&index) = self.call_items.get(&delta.index) {
            if let Some(OutputItem::FunctionCall {
                arguments, name, ..
            }) = self.items.get_mut(index)
            {
                arguments.push_str(&delta.arguments_delta);
                if name.is_empty()
                    && let Some(n) = &delta.name
                {
                    name.clone_from(n);
                }
            }
            return Some(ItemTouch {
                output_index: index,
                opened: false,
            });
        }
        if self.call_items.len() >= MAX_TOOL_CALLS_PER_RUN {
            return None;
        }
        let index = self.items.len();
        let call_id = delta
            .id
            .clone()
            .unwrap_or_else(|| self.next_item_id("call_"));
        self.items.push(OutputItem::FunctionCall {
            id: self.next_item_id("fc_"),
            call_id,
            name: delta.name.clone().unwrap_or_default(),
            arguments: delta.arguments_delta.clone(),
        });
        self.call_items.insert(delta.index, index);
        Some(ItemTouch {
            output_index: index,
            opened: true,
        })
    }

    fn item_id(&self, index: usize) -> &str {
        match self.items.get(index) {
            Some(
                OutputItem::Message { id, .. }
                | OutputItem::Reasoning { id, .. }
                | OutputItem::FunctionCall { id, .. },
            ) => id,
            None => "",
        }
    }

    fn output_text_part(text: &str) -> Value {
        json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
    }

    fn reasoning_text_part(text: &str) -> Value {
        json!({ "type": "reasoning_text", "text": text })
    }

    /// An item as JSON; `full` false gives the just-opened (empty) shape.
    fn item_json(&self, index: usize, status: &str, full: bool) -> Value {
        match self.items.get(index) {
            Some(OutputItem::Reasoning { id, text }) => json!({
                "id": id,
                "type": "reasoning",
                "status": status,
                "summary": [],
                "content": if full { json!([Self::reasoning_text_part(text)]) } else { json!([]) },
            }),
            Some(OutputItem::Message { id, text }) => json!({
                "id": id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": if full { json!([Self::output_text_part(text)]) } else { json!([]) },
            }),
            Some(OutputItem::FunctionCall {
                id,
                call_id,
                name,
                arguments,
            }) => json!({
                "id": id,
                "type": "function_call",
                "status": status,
                "call_id": call_id,
                "name": name,
                "arguments": if full { arguments.as_str() } else { "" },
            }),
            None => Value::Null,
        }
    }

    fn response_json(
        &self,
        status: &str,
        item_status: &str,
        error: Value,
        incomplete_details: Value,
        usage: Option<Usage>,
    ) -> Value {
        let output: Vec<Value> = (0..self.items.len())
            .map(|i| self.item_json(i, item_status, true))
            .collect();
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_unix,
            "status": status,
            "error": error,
            "incomplete_details": incomplete_details,
            "instructions": self.echo.instructions,
            "max_output_tokens": self.echo.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.echo.parallel_tool_calls,
            "previous_response_id": self.echo.previous_response_id,
            "reasoning": { "effort": self.echo.reasoning_effort, "summary": null },
            "store": self.echo.store,
            "background": self.echo.background,
            "temperature": self.echo.temperature,
            "text": { "format": { "type": "text" } },
            "tool_choice": self.echo.tool_choice,
            "tools": self.echo.tools,
            "top_p": self.echo.top_p,
            "truncation": "disabled",
            "usage": usage.map(usage_json),
            "user": null,
            "metadata": self.echo.metadata,
        })
    }

    /// Status, item status and `incomplete_details` for a finish reason.
    fn completion_status(finish_reason: FinishReason) -> (&'static str, &'static str, Value) {
        match finish_reason {
            FinishReason::Stop | FinishReason::StopSequence | FinishReason::ToolCalls => {
                ("completed", "completed", Value::Null)
            }
            FinishReason::Length => (
                "incomplete",
                "incomplete",
                json!({ "reason": "max_output_tokens" }),
            ),
            FinishReason::ContentFilter => (
                "incomplete",
                "incomplete",
                json!({ "reason": "content_filter" }),
            ),
        }
    }

    fn completed_json(&self, finish_reason: FinishReason) -> Value {
        let (status, item_status, incomplete) = Self::completion_status(finish_reason);
        self.response_json(status, item_status, Value::Null, incomplete, self.usage)
    }

    /// A durable response that ended without its answer.
    fn interrupted_json(&self, reason: &str) -> Value {
        let status = if reason == "cancelled" {
            "cancelled"
        } else {
            "incomplete"
        };
        self.response_json(
            status,
            "incomplete",
            Value::Null,
            json!({ "reason": reason }),
            self.usage,
        )
    }

    fn failed_json(&self, err: &ApiError) -> Value {
        self.response_json(
            "failed",
            "incomplete",
            response_error_json(err),
            Value::Null,
            self.usage,
        )
    }
}

/// The `response.error` object; its `code` is from the Responses vocabulary.
fn response_error_json(err: &ApiError) -> Value {
    let code = match err.status {
        429 => "rate_limit_exceeded",
        400 => "invalid_prompt",
        _ => "server_error",
    };
    json!({ "code": code, "message": err.message })
}

/// `response.output_text.delta`, typed: one per text chunk, so it is
/// written without a JSON tree (keys sorted, as `emit` writes them).
#[derive(Serialize)]
struct OutputTextDelta<'a> {
    content_index: u32,
    delta: &'a str,
    item_id: &'a str,
    logprobs: [(); 0],
    output_index: usize,
    sequence_number: u64,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// `response.reasoning_text.delta`, typed like [`OutputTextDelta`].
#[derive(Serialize)]
struct ReasoningTextDelta<'a> {
    content_index: u32,
    delta: &'a str,
    item_id: &'a str,
    output_index: usize,
    sequence_number: u64,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// `response.function_call_arguments.delta`, typed like [`OutputTextDelta`].
#[derive(Serialize)]
struct ArgumentsDelta<'a> {
    delta: &'a str,
    item_id: &'a str,
    output_index: usize,
    sequence_number: u64,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// Encodes run events as the Responses streaming event sequence (see the
/// module docs), as SSE events (`event:` name, then `data:` JSON with the
/// same `type` and a `sequence_number`). Every event's `sequence_number` is
/// one greater than the previous, starting at 0.
#[derive(Debug, Clone)]
pub struct ResponsesStream {
    draft: ResponseDraft,
    next_sequence_number: u64,
    started: bool,
    finished: bool,
}

impl ResponsesStream {
    /// A stream for response `id` (see [`ids::response_id`]) of `model`.
    pub fn new(id: impl Into<String>, model: impl Into<String>, created_unix: u64) -> Self {
        Self {
            draft: ResponseDraft::new(id.into(), model.into(), created_unix),
            next_sequence_number: 0,
            started: false,
            finished: false,
        }
    }

    /// Echo these request fields in the `response` objects.
    #[must_use]
    pub fn with_echo(mut self, echo: ResponseEcho) -> Self {
        self.draft.echo = echo;
        self
    }

    /// The response id.
    pub fn id(&self) -> &str {
        &self.draft.id
    }

    /// True once a terminal event was encoded.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Append `response.created` and `response.in_progress` to `out`, once;
    /// later calls append nothing.
    ///
    /// [`ResponsesStream::push`] calls this itself before its first output,
    /// so a handler that commits on first content need not call it.
    pub fn start(&mut self, out: &mut Vec<u8>) {
        self.ensure_started(out);
    }

    /// Append the SSE events for one run event to `out`, in order (possibly
    /// none).
    pub fn push(&mut self, event: &RunEventKind, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        match event {
            RunEventKind::Started { .. } => {}
            RunEventKind::Usage(usage) => self.draft.usage = Some(*usage),
            // A Responses answer carries neither token log probabilities nor
            // embeddings.
            RunEventKind::Logprobs(_) | RunEventKind::Embedding(_) => {}
            RunEventKind::ReasoningDelta(text) => {
                if text.is_empty() {
                    return;
                }
                self.ensure_started(out);
                let touch = self.draft.add_reasoning(text);
                if touch.opened {
                    self.open_item_with_part(out, touch, ResponseDraft::reasoning_text_part(""));
                }
                const KIND: &str = "response.reasoning_text.delta";
                let delta = ReasoningTextDelta {
                    content_index: 0,
                    delta: text,
                    item_id: self.draft.item_id(touch.output_index),
                    output_index: touch.output_index,
                    sequence_number: self.next_sequence_number,
                    kind: KIND,
                };
                framing::sse_json(out, Some(KIND), &delta);
                self.next_sequence_number += 1;
            }
            RunEventKind::TextDelta(text) => {
                if text.is_empty() {
                    return;
                }
                self.ensure_started(out);
                let touch = self.draft.add_text(text);
                if touch.opened {
                    self.open_item_with_part(out, touch, ResponseDraft::output_text_part(""));
                }
                const KIND: &str = "response.output_text.delta";
                let delta = OutputTextDelta {
                    content_index: 0,
                    delta: text,
                    item_id: self.draft.item_id(touch.output_index),
                    logprobs: [],
                    output_index: touch.output_index,
                    sequence_number: self.next_sequence_number,
                    kind: KIND,
                };
                framing::sse_json(out, Some(KIND), &delta);
                self.next_sequence_number += 1;
            }
            RunEventKind::ToolCallDelta(delta) => {
                self.ensure_started(out);
                let Some(touch) = self.draft.add_tool_delta(delta) else {
                    return;
                };
                if touch.opened {
                    let item = self
                        .draft
                        .item_json(touch.output_index, "in_progress", false);
                    self.emit(
                        out,
                        "response.output_item.added",
                        json!({ "output_index": touch.output_index, "item": item }),
                    );
                }
                if !delta.arguments_delta.is_empty() {
                    const KIND: &str = "response.function_call_arguments.delta";
                    let delta = ArgumentsDelta {
                        delta: &delta.arguments_delta,
                        item_id: self.draft.item_id(touch.output_index),
                        output_index: touch.output_index,
                        sequence_number: self.next_sequence_number,
                        kind: KIND,
                    };
                    framing::sse_json(out, Some(KIND), &delta);
                    self.next_sequence_number += 1;
                }
            }
            RunEventKind::Completed {
                finish_reason,
                usage,
            } => {
                if usage.is_some() {
                    self.draft.usage = *usage;
                }
                self.ensure_started(out);
                let (_, item_status, _) = ResponseDraft::completion_status(*finish_reason);
                for index in 0..self.draft.items.len() {
                    self.close_item(out, index, item_status);
                }
                let response = self.draft.completed_json(*finish_reason);
                let name = if response["status"] == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                self.emit(out, name, json!({ "response": response }));
                self.finished = true;
            }
            RunEventKind::Failed(failure) => {
                self.fail(&ApiError::from_execution_failure(failure), out);
            }
        }
    }

    /// Append `error` then `response.failed` to `out`, ending the stream
    /// (R-GATE-3).
    ///
    /// The `error` event carries the documented top-level `code`, `message`
    /// and `param`, plus the same fields under `error`, which makes the
    /// OpenAI SDKs raise an API error instead of yielding a plain event.
    pub fn fail(&mut self, err: &ApiError, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        self.ensure_started(out);
        self.emit(
            out,
            "error",
            json!({
                "code": err.code,
                "message": err.message,
                "param": err.param,
                "error": err.error_object(),
            }),
        );
        let response = self.draft.failed_json(err);
        self.emit(out, "response.failed", json!({ "response": response }));
        self.finished = true;
    }

    /// Append the end of a durable response that ended without its
    /// answer (`reason`: `edge_restart`, or `cancelled`): its items close
    /// `incomplete` and `response.incomplete` carries the response with
    /// `status` `incomplete` (or `cancelled`) and the reason.
    pub fn end_interrupted(&mut self, reason: &str, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        self.ensure_started(out);
        for index in 0..self.draft.items.len() {
            self.close_item(out, index, "incomplete");
        }
        let response = self.draft.interrupted_json(reason);
        self.emit(out, "response.incomplete", json!({ "response": response }));
        self.finished = true;
    }

    /// `response.output_item.added` for the item just opened, then
    /// `response.content_part.added` with its empty first `part`.
    fn open_item_with_part(&mut self, out: &mut Vec<u8>, touch: ItemTouch, part: Value) {
        let item = self
            .draft
            .item_json(touch.output_index, "in_progress", false);
        self.emit(
            out,
            "response.output_item.added",
            json!({ "output_index": touch.output_index, "item": item }),
        );
        let item_id = self.draft.item_id(touch.output_index);
        self.emit(
            out,
            "response.content_part.added",
            json!({
                "item_id": item_id,
                "output_index": touch.output_index,
                "content_index": 0,
                "part": part,
            }),
        );
    }

    fn ensure_started(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        let response =
            self.draft
                .response_json("in_progress", "in_progress", Value::Null, Value::Null, None);
        self.emit(
            out,
            "response.created",
            json!({ "response": response.clone() }),
        );
        self.emit(out, "response.in_progress", json!({ "response": response }));
    }

    fn close_item(&mut self, out: &mut Vec<u8>, index: usize, status: &str) {
        let item_id = self.draft.item_id(index).to_owned();
        match self.draft.items.get(index).cloned() {
            Some(OutputItem::Reasoning { text, .. }) => {
                self.emit(
                    out,
                    "response.reasoning_text.done",
                    json!({
                        "item_id": item_id,
                        "output_index": index,
                        "content_index": 0,
                        "text": text,
                    }),
                );
                self.emit(
                    out,
                    "response.content_part.done",
                    json!({
                        "item_id": item_id,
                        "output_index": index,
                        "content_index": 0,
                        "part": ResponseDraft::reasoning_text_part(&text),
                    }),
                );
            }
            Some(OutputItem::Message { text, .. }) => {
                self.emit(
                    out,
                    "response.output_text.done",
                    json!({
                        "item_id": item_id,
                        "output_index": index,
                        "content_index": 0,
                        "text": text,
                        "logprobs": [],
                    }),
                );
                self.emit(
                    out,
                    "response.content_part.done",
                    json!({
                        "item_id": item_id,
                        "output_index": index,
                        "content_index": 0,
                        "part": ResponseDraft::output_text_part(&text),
                    }),
                );
            }
            Some(OutputItem::FunctionCall {
                name, arguments, ..
            }) => {
                self.emit(
                    out,
                    "response.function_call_arguments.done",
                    json!({
                        "item_id": item_id,
                        "output_index": index,
                        "name": name,
                        "arguments": arguments,
                    }),
                );
            }
            None => return,
        }
        let item = self.draft.item_json(index, status, true);
        self.emit(
            out,
            "response.output_item.done",
            json!({ "output_index": index, "item": item }),
        );
    }

    /// Append one event built as a JSON object: `fields` plus `type` and
    /// `sequence_number` (for the events sent once or once per item).
    fn emit(&mut self, out: &mut Vec<u8>, event: &'static str, fields: Value) {
        let mut data = Map::new();
        data.insert("type".into(), json!(event));
        data.insert("sequence_number".into(), json!(self.next_sequence_number));
        if let Value::Object(fields) = fields {
            data.extend(fields);
        }
        self.next_sequence_number += 1;
        framing::sse_json(out, Some(event), &data);
    }
}

/// Folds run events into the non-streaming `response` object.
#[derive(Debug, Clone)]
pub struct ResponsesAccumulator {
    draft: ResponseDraft,
    outcome: RunOutcome,
}

impl ResponsesAccumulator {
    /// An accumulator for response `id` of `model`.
    pub fn new(id: impl Into<String>, model: impl Into<String>, created_unix: u64) -> Self {
        Self {
            draft: ResponseDraft::new(id.into(), model.into(), created_unix),
            outcome: RunOutcome::Running,
        }
    }

    /// Echo these request fields in the `response` object.
    #[must_use]
    pub fn with_echo(mut self, echo: ResponseEcho) -> Self {
        self.draft.echo = echo;
        self
    }

    /// Fold one event in; events after the terminal are ignored.
    pub fn push(&mut self, event: &RunEventKind) {
        if self.is_finished() {
            return;
        }
        match event {
            RunEventKind::Started { .. } => {}
            RunEventKind::TextDelta(text) => {
                if !text.is_empty() {
                    self.draft.add_text(text);
                }
            }
            RunEventKind::ToolCallDelta(delta) => {
                self.draft.add_tool_delta(delta);
            }
            RunEventKind::ReasoningDelta(text) => {
                if !text.is_empty() {
                    self.draft.add_reasoning(text);
                }
            }
            RunEventKind::Usage(usage) => self.draft.usage = Some(*usage),
            // A Responses answer carries neither token log probabilities nor
            // embeddings.
            RunEventKind::Logprobs(_) | RunEventKind::Embedding(_) => {}
            RunEventKind::Completed {
                finish_reason,
                usage,
            } => {
                if usage.is_some() {
                    self.draft.usage = *usage;
                }
                self.outcome = RunOutcome::Completed(*finish_reason);
            }
            RunEventKind::Failed(failure) => self.outcome = RunOutcome::Failed(failure.clone()),
        }
    }

    /// True once a terminal event was folded in.
    pub fn is_finished(&self) -> bool {
        self.outcome != RunOutcome::Running
    }

    /// The `response` object as it stands, with `status` given: a stored
    /// response fetched while it runs (`in_progress`), or one that ended
    /// without a terminal event of its own (`incomplete`, `cancelled`,
    /// `failed`), with `error` and `incomplete_details` as given.
    pub fn snapshot(&self, status: &str, error: Value, incomplete_details: Value) -> Value {
        let item_status = if status == "in_progress" {
            "in_progress"
        } else {
            "incomplete"
        };
        self.draft.response_json(
            status,
            item_status,
            error,
            incomplete_details,
            self.draft.usage,
        )
    }

    /// The `response` object of a durable response that ended without
    /// its answer (`reason`: `edge_restart`, `cancelled`).
    pub fn interrupted_snapshot(&self, reason: &str) -> Value {
        self.draft.interrupted_json(reason)
    }

    /// The output so far as one assistant message (its text and function
    /// calls, with the call ids the client saw): what a response that
    /// continues this one (`previous_response_id`) is given.
    pub fn assistant_message(&self) -> ChatMessage {
        let mut message = text_message(Role::Assistant, String::new());
        for item in &self.draft.items {
            match item {
                // The chat API takes no earlier reasoning back.
                OutputItem::Reasoning { .. } => {}
                OutputItem::Message { text, .. } => message.content.push_str(text),
                OutputItem::FunctionCall {
                    call_id,
                    name,
                    arguments,
                    ..
                } => message.tool_calls.push(ToolCall {
                    id: call_id.clone(),
                    name: name.clone(),
                    arguments: arguments.clone(),
                }),
            }
        }
        message
    }

    /// The `response` object of a stored response that failed with `err`.
    pub fn failed_snapshot(&self, err: &ApiError) -> Value {
        self.draft.failed_json(err)
    }

    /// The `response` object, or the error the run ended with.
    pub fn finish(&self) -> Result<Value, ApiError> {
        let finish_reason = self.outcome.finish_reason()?;
        Ok(self.draft.completed_json(finish_reason))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::arbitrary_body::{arbitrary_json, replace_nth_value};
    use iop_wire::{ExecutionFailure, FailureCode};
    use proptest::prelude::*;

    fn parse(body: Value) -> Result<ResponsesRequest, ApiError> {
        parse_responses_request(body.to_string().as_bytes())
    }

    fn with(field: &str, value: Value) -> Value {
        let mut body = json!({"model": "m", "input": "hi"});
        body[field] = value;
        body
    }

    fn sdk_body() -> Value {
        json!({
            "model": "llama3",
            "instructions": "Be terse.",
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                 "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
                {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "{\"temp\":21}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
                {"role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]}
            ],
            "tools": [{
                "type": "function", "name": "get_weather", "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": false},
                "strict": true
            }],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "temperature": 0.2,
            "top_p": 0.5,
            "max_output_tokens": 100,
            "stream": true,
            "store": false,
            "metadata": {"a": "b"},
            "parallel_tool_calls": false,
            "reasoning": {"effort": "low"},
            "text": {"format": {"type": "text"}}
        })
    }

    #[test]
    fn sdk_body_parses_into_a_normalized_conversation() {
        let req = parse(sdk_body()).unwrap();
        assert_eq!(req.run.model, "llama3");
        assert!(req.run.stream);
        let m = &req.run.messages;
        assert_eq!(m.len(), 6);
        assert_eq!(
            (m[0].role, m[0].content.as_str()),
            (Role::System, "Be terse.")
        );
        assert_eq!(
            (m[1].role, m[1].content.as_str()),
            (Role::User, "Weather in Paris?")
        );
        assert_eq!(m[2].role, Role::Assistant);
        assert_eq!(m[2].content, "Let me check.");
        assert_eq!(m[2].tool_calls.len(), 2);
        assert_eq!(m[2].tool_calls[0].id, "call_1");
        assert_eq!(m[2].tool_calls[1].name, "get_time");
        assert_eq!(m[3].role, Role::Tool);
        assert_eq!(m[3].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(m[3].name.as_deref(), Some("get_weather"));
        assert_eq!(m[4].content, "noon");
        assert_eq!(
            (m[5].role, m[5].content.as_str()),
            (Role::System, "Answer now.")
        );
        assert_eq!(req.run.tools.len(), 1);
        assert!(
            req.run.tools[0]
                .parameters_json
                .as_deref()
                .unwrap()
                .contains("city")
        );
        assert_eq!(req.run.params.max_tokens, Some(100));
        assert_eq!(req.run.params.temperature, Some(0.2));
        let choice: Value =
            serde_json::from_str(req.run.params.tool_choice_json.as_deref().unwrap()).unwrap();
        assert_eq!(
            choice,
            json!({"type": "function", "function": {"name": "get_weather"}})
        );
        assert_eq!(req.echo.instructions.as_deref(), Some("Be terse."));
        assert_eq!(req.echo.tool_choice["name"], "get_weather");
        assert!(!req.echo.parallel_tool_calls);
        assert_eq!(req.echo.metadata, json!({"a": "b"}));
    }

    #[test]
    fn body_captured_from_the_openai_python_sdk_parses() {
        // `client.responses.create(model="m", input=[...], tools=[...], stream=True)`.
        let body = br#"{"model": "m", "stream": true, "input": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": true}]}"#;
        let req = parse_responses_request(body).unwrap();
        assert!(req.run.stream);
        assert_eq!(req.run.messages[0].content, "hi");
        assert_eq!(req.run.tools[0].name, "f");
    }

    #[test]
    fn string_input_is_one_user_message() {
        let req = parse(json!({"model": "m", "input": "hello"})).unwrap();
        assert_eq!(req.run.messages.len(), 1);
        assert_eq!(req.run.messages[0].role, Role::User);
        assert!(!req.run.stream);
        assert_eq!(req.echo, ResponseEcho::default());
    }

    #[test]
    fn every_bad_field_names_its_parameter() {
        let cases: Vec<(Value, &str)> = vec![
            (json!({"input": "x"}), "model"),
            (json!({"model": "m"}), "input"),
            (with("input", json!([])), "input"),
            (with("input", json!(5)), "input"),
            (with("input", json!([7])), "input[0]"),
            (with("input", json!([{"content": "x"}])), "input[0].type"),
            (
                with("input", json!([{"role": "tool", "content": "x"}])),
                "input[0].role",
            ),
            (with("input", json!([{"role": "user"}])), "input[0].content"),
            (
                with(
                    "input",
                    json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                ),
                "input[0].content[0].image_url",
            ),
            (
                with(
                    "input",
                    json!([{"type": "function_call", "name": "f", "arguments": "{}"}]),
                ),
                "input[0].call_id",
            ),
            (
                with(
                    "input",
                    json!([{"type": "function_call", "call_id": "c", "arguments": "{}"}]),
                ),
                "input[0].name",
            ),
            (
                with(
                    "input",
                    json!([{"type": "function_call", "call_id": "c", "name": "f"}]),
                ),
                "input[0].arguments",
            ),
            (
                with(
                    "input",
                    json!([{"type": "function_call_output", "call_id": "c"}]),
                ),
                "input[0].output",
            ),
            (
                with(
                    "input",
                    json!([{"type": "function_call_output", "output": "x"}]),
                ),
                "input[0].call_id",
            ),
            (
                with("input", json!([{"type": "item_reference", "id": "msg_1"}])),
                "input[0].type",
            ),
            (with("input", json!([{"type": "bogus"}])), "input[0].type"),
            (with("instructions", json!(1)), "instructions"),
            (
                with("tools", json!([{"type": "web_search_preview"}])),
                "tools[0].type",
            ),
            (
                with("tools", json!([{"type": "function"}])),
                "tools[0].name",
            ),
            (
                with(
                    "tools",
                    json!([{"type": "function", "name": "f", "parameters": []}]),
                ),
                "tools[0].parameters",
            ),
            (with("tool_choice", json!("maybe")), "tool_choice"),
            (
                with("tool_choice", json!({"type": "file_search"})),
                "tool_choice.type",
            ),
            (
                with("tool_choice", json!({"type": "function"})),
                "tool_choice.name",
            ),
            (with("temperature", json!(3)), "temperature"),
            (with("top_p", json!(-1)), "top_p"),
            (with("max_output_tokens", json!(0)), "max_output_tokens"),
            (with("stream", json!(1)), "stream"),
            (
                with("previous_response_id", json!(1)),
                "previous_response_id",
            ),
            (with("background", json!(1)), "background"),
            (
                {
                    let mut body = with("background", json!(true));
                    body["store"] = json!(false);
                    body
                },
                "store",
            ),
            (
                with("text", json!({"format": {"type": "json_schema"}})),
                "text.format.name",
            ),
            (with("metadata", json!("x")), "metadata"),
        ];
        for (body, expected) in cases {
            let err = parse(body.clone()).expect_err("must be rejected");
            assert_eq!(err.status, 400);
            assert_eq!(err.param.as_deref(), Some(expected), "body: {body}");
        }
    }

    fn usage(p: u64, c: u64) -> Usage {
        Usage::tokens(p, c)
    }

    fn tool_delta(index: u32, id: Option<&str>, name: Option<&str>, args: &str) -> RunEventKind {
        RunEventKind::ToolCallDelta(ToolCallDelta {
            index,
            id: id.map(Into::into),
            name: name.map(Into::into),
            arguments_delta: args.into(),
        })
    }

    /// One streamed event as the client reads it.
    #[derive(Debug)]
    struct ResponsesEvent {
        event: String,
        data: Value,
    }

    fn events_of(body: &[u8]) -> Vec<ResponsesEvent> {
        framing::parse_sse(body)
            .into_iter()
            .map(|(name, data)| ResponsesEvent {
                event: name.expect("every Responses event is named"),
                data: serde_json::from_str(&data).expect("JSON data"),
            })
            .collect()
    }

    fn names(events: &[ResponsesEvent]) -> Vec<&str> {
        events.iter().map(|e| e.event.as_str()).collect()
    }

    fn run(stream: &mut ResponsesStream, events: &[RunEventKind]) -> Vec<ResponsesEvent> {
        let mut out = Vec::new();
        for e in events {
            stream.push(e, &mut out);
        }
        events_of(&out)
    }

    fn fail(stream: &mut ResponsesStream, err: &ApiError) -> Vec<ResponsesEvent> {
        let mut out = Vec::new();
        stream.fail(err, &mut out);
        events_of(&out)
    }

    fn assert_sequence_numbers(events: &[ResponsesEvent]) {
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e.data["sequence_number"], i as u64, "{}", e.event);
            assert_eq!(e.data["type"], e.event);
        }
    }

    #[test]
    fn text_stream_follows_the_documented_sequence() {
        let mut stream = ResponsesStream::new("resp_1", "m", 1_700_000_000);
        let events = run(
            &mut stream,
            &[
                RunEventKind::Started {
                    session_id: "s".into(),
                },
                RunEventKind::TextDelta("Hel".into()),
                RunEventKind::TextDelta("lo".into()),
                RunEventKind::Completed {
                    finish_reason: FinishReason::Stop,
                    usage: Some(usage(5, 2)),
                },
            ],
        );
        assert_eq!(
            names(&events),
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_sequence_numbers(&events);
        let created = &events[0].data["response"];
        assert_eq!(created["id"], "resp_1");
        assert_eq!(created["object"], "response");
        assert_eq!(created["status"], "in_progress");
        assert_eq!(created["created_at"], 1_700_000_000);
        assert_eq!(created["output"], json!([]));
        assert!(created["usage"].is_null());

        let added = &events[2].data;
        assert_eq!(added["output_index"], 0);
        assert_eq!(added["item"]["type"], "message");
        assert_eq!(added["item"]["role"], "assistant");
        assert_eq!(added["item"]["status"], "in_progress");
        let item_id = added["item"]["id"].as_str().unwrap().to_owned();
        assert!(item_id.starts_with("msg_"));
        assert_eq!(events[3].data["part"]["type"], "output_text");
        assert_eq!(events[3].data["part"]["annotations"], json!([]));
        assert_eq!(events[4].data["delta"], "Hel");
        assert_eq!(events[4].data["item_id"], item_id.as_str());
        assert_eq!(events[4].data["content_index"], 0);
        assert_eq!(events[4].data["logprobs"], json!([]));
        assert_eq!(events[6].data["text"], "Hello");
        assert_eq!(events[7].data["part"]["text"], "Hello");
        assert_eq!(events[8].data["item"]["status"], "completed");
        assert_eq!(events[8].data["item"]["content"][0]["text"], "Hello");

        let done = &events[9].data["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["type"], "output_text");
        assert_eq!(done["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(done["output"][0]["content"][0]["annotations"], json!([]));
        assert_eq!(done["usage"]["input_tokens"], 5);
        assert_eq!(done["usage"]["output_tokens"], 2);
        assert_eq!(done["usage"]["total_tokens"], 7);
        assert!(stream.is_finished());
        assert!(run(&mut stream, &[RunEventKind::TextDelta("late".into())]).is_empty());
    }

    #[test]
    fn reasoning_is_a_reasoning_item_before_the_message() {
        let mut stream = ResponsesStream::new("resp_r", "m", 1);
        let events = run(
            &mut stream,
            &[
                RunEventKind::ReasoningDelta("Let me ".into()),
                RunEventKind::ReasoningDelta("think.".into()),
                RunEventKind::TextDelta("Hi".into()),
                RunEventKind::Completed {
                    finish_reason: FinishReason::Stop,
                    usage: Some(usage(3, 4)),
                },
            ],
        );
        assert_eq!(
            names(&events),
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_sequence_numbers(&events);
        let added = &events[2].data;
        assert_eq!(added["output_index"], 0);
        assert_eq!(added["item"]["type"], "reasoning");
        assert_eq!(added["item"]["summary"], json!([]));
        assert_eq!(added["item"]["content"], json!([]));
        let item_id = added["item"]["id"].as_str().unwrap().to_owned();
        assert!(item_id.starts_with("rs_"));
        assert_eq!(
            events[3].data["part"],
            json!({"type": "reasoning_text", "text": ""})
        );
        assert_eq!(events[4].data["delta"], "Let me ");
        assert_eq!(events[4].data["item_id"], item_id.as_str());
        assert_eq!(events[4].data["content_index"], 0);
        assert_eq!(events[6].data["output_index"], 1);
        assert_eq!(events[9].data["text"], "Let me think.");
        assert_eq!(events[10].data["part"]["text"], "Let me think.");
        assert_eq!(events[11].data["item"]["status"], "completed");
        let done = &events[15].data["response"];
        assert_eq!(
            done["output"][0]["content"],
            json!([{"type": "reasoning_text", "text": "Let me think."}])
        );
        assert_eq!(done["output"][1]["type"], "message");
        assert_eq!(done["output"][1]["content"][0]["text"], "Hi");

        // The whole answer holds the same items.
        let mut acc = ResponsesAccumulator::new("resp_r", "m", 1);
        for e in [
            RunEventKind::ReasoningDelta("Let me think.".into()),
            RunEventKind::TextDelta("Hi".into()),
            RunEventKind::Completed {
                finish_reason: FinishReason::Stop,
                usage: None,
            },
        ] {
            acc.push(&e);
        }
        let whole = acc.finish().unwrap();
        assert_eq!(whole["output"][0], done["output"][0]);
        assert_eq!(whole["output"][1]["content"], done["output"][1]["content"]);
        // What a continuation is given leaves the reasoning out.
        assert_eq!(acc.assistant_message().content, "Hi");
    }

    #[test]
    fn reasoning_items_passed_back_are_accepted_and_left_out() {
        let mut body = sdk_body();
        body["input"] = json!([
            {"role": "user", "content": "q"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"},
        ]);
        body["reasoning"] = json!({"effort": "high"});
        let parsed = parse(body).unwrap();
        let roles: Vec<Role> = parsed.run.messages.iter().map(|m| m.role).collect();
        assert!(!parsed.run.messages.iter().any(|m| m.content.contains("hm")));
        assert_eq!(
            &roles[roles.len() - 3..],
            &[Role::User, Role::Assistant, Role::User]
        );
        assert_eq!(parsed.echo.reasoning_effort.as_deref(), Some("high"));
        let mut stream = ResponsesStream::new("r", "m", 1).with_echo(parsed.echo);
        let created = &run(&mut stream, &[RunEventKind::TextDelta("x".into())])[0];
        assert_eq!(created.data["response"]["reasoning"]["effort"], "high");
    }

    #[test]
    fn function_call_stream_has_argument_deltas_and_done_events() {
        let mut stream = ResponsesStream::new("resp_2", "m", 1);
        let events = run(
            &mut stream,
            &[
                tool_delta(0, Some("call_a"), Some("get_weather"), "{\"city\":"),
                tool_delta(0, None, None, "\"Paris\"}"),
                RunEventKind::Usage(usage(9, 4)),
                RunEventKind::Completed {
                    finish_reason: FinishReason::ToolCalls,
                    usage: None,
                },
            ],
        );
        assert_eq!(
            names(&events),
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_sequence_numbers(&events);
        let item = &events[2].data["item"];
        assert_eq!(item["type"], "function_call");
        assert_eq!(item["call_id"], "call_a");
        assert_eq!(item["name"], "get_weather");
        assert_eq!(item["arguments"], "");
        assert!(item["id"].as_str().unwrap().starts_with("fc_"));
        assert_eq!(events[3].data["delta"], "{\"city\":");
        assert_eq!(events[5].data["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(events[6].data["item"]["arguments"], "{\"city\":\"Paris\"}");
        let done = &events[7].data["response"];
        assert_eq!(done["output"][0]["type"], "function_call");
        assert_eq!(done["output"][0]["call_id"], "call_a");
        assert_eq!(done["usage"]["total_tokens"], 13);
    }

    #[test]
    fn text_then_tool_calls_give_ordered_items() {
        let mut stream = ResponsesStream::new("resp_3", "m", 1);
        let events = run(
            &mut stream,
            &[
                RunEventKind::TextDelta("Checking.".into()),
                tool_delta(0, None, Some("a"), "{}"),
                tool_delta(1, Some("call_b"), Some("b"), "{}"),
                RunEventKind::Completed {
                    finish_reason: FinishReason::ToolCalls,
                    usage: None,
                },
            ],
        );
        assert_sequence_numbers(&events);
        let done = &events.last().unwrap().data["response"];
        let output = done["output"].as_array().unwrap();
        assert_eq!(output.len(), 3);
        assert_eq!(output[0]["type"], "message");
        assert_eq!(output[1]["type"], "function_call");
        assert_eq!(output[1]["call_id"], "call_30001");
        assert_eq!(output[2]["call_id"], "call_b");
        let done_indexes: Vec<_> = events
            .iter()
            .filter(|e| e.event == "response.output_item.done")
            .map(|e| e.data["output_index"].as_u64().unwrap())
            .collect();
        assert_eq!(done_indexes, vec![0, 1, 2]);
    }

    #[test]
    fn length_finish_is_an_incomplete_response() {
        let mut stream = ResponsesStream::new("resp_4", "m", 1);
        let events = run(
            &mut stream,
            &[
                RunEventKind::TextDelta("cut".into()),
                RunEventKind::Completed {
                    finish_reason: FinishReason::Length,
                    usage: None,
                },
            ],
        );
        let last = events.last().unwrap();
        assert_eq!(last.event, "response.incomplete");
        assert_eq!(last.data["response"]["status"], "incomplete");
        assert_eq!(
            last.data["response"]["incomplete_details"]["reason"],
            "max_output_tokens"
        );
    }

    #[test]
    fn failure_after_commit_is_error_then_failed() {
        let mut stream = ResponsesStream::new("resp_5", "m", 1);
        let mut events = run(&mut stream, &[RunEventKind::TextDelta("par".into())]);
        events.extend(run(
            &mut stream,
            &[RunEventKind::Failed(ExecutionFailure::new(
                FailureCode::ResponseStalled,
            ))],
        ));
        assert_eq!(&names(&events)[5..], &["error", "response.failed"]);
        assert_sequence_numbers(&events);
        let error = &events[5].data;
        assert_eq!(error["code"], "response_stalled");
        assert!(error["message"].is_string());
        assert_eq!(error["error"]["type"], "timeout_error");
        let failed = &events[6].data["response"];
        assert_eq!(failed["status"], "failed");
        assert_eq!(failed["error"]["code"], "server_error");
        assert_eq!(failed["output"][0]["status"], "incomplete");
        assert!(fail(&mut stream, &ApiError::budget_expired()).is_empty());
    }

    #[test]
    fn failing_before_any_output_still_opens_the_stream() {
        let mut stream = ResponsesStream::new("resp_6", "m", 1);
        let events = fail(&mut stream, &ApiError::budget_expired());
        assert_eq!(
            names(&events),
            vec![
                "response.created",
                "response.in_progress",
                "error",
                "response.failed"
            ]
        );
        let mut out = Vec::new();
        stream.start(&mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn echo_fields_appear_in_the_response() {
        let req = parse(sdk_body()).unwrap();
        let mut acc = ResponsesAccumulator::new("resp_7", "llama3", 9).with_echo(req.echo);
        acc.push(&RunEventKind::TextDelta("ok".into()));
        acc.push(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(1, 1)),
        });
        let v = acc.finish().unwrap();
        assert_eq!(v["instructions"], "Be terse.");
        assert_eq!(v["tools"][0]["name"], "get_weather");
        assert_eq!(v["temperature"].as_f64().unwrap() as f32, 0.2);
        assert_eq!(v["max_output_tokens"], 100);
        assert_eq!(v["parallel_tool_calls"], false);
    }

    #[test]
    fn accumulator_builds_the_response_object() {
        let mut acc = ResponsesAccumulator::new("resp_8", "m", 42);
        for e in [
            RunEventKind::TextDelta("Hi ".into()),
            RunEventKind::TextDelta("there".into()),
            tool_delta(0, Some("call_x"), Some("f"), "{\"a\""),
            tool_delta(0, None, None, ":1}"),
            RunEventKind::Completed {
                finish_reason: FinishReason::ToolCalls,
                usage: Some(usage(3, 4)),
            },
        ] {
            acc.push(&e);
        }
        let v = acc.finish().unwrap();
        assert_eq!(v["id"], "resp_8");
        assert_eq!(v["object"], "response");
        assert_eq!(v["created_at"], 42);
        assert_eq!(v["status"], "completed");
        assert_eq!(v["model"], "m");
        assert!(v["error"].is_null());
        assert_eq!(v["output"][0]["type"], "message");
        assert_eq!(v["output"][0]["status"], "completed");
        assert_eq!(
            v["output"][0]["content"][0],
            json!({"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []})
        );
        assert_eq!(v["output"][1]["type"], "function_call");
        assert_eq!(v["output"][1]["call_id"], "call_x");
        assert_eq!(v["output"][1]["name"], "f");
        assert_eq!(v["output"][1]["arguments"], "{\"a\":1}");
        assert_eq!(
            v["usage"],
            json!({"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                   "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": 7})
        );
    }

    #[test]
    fn accumulator_reports_failures() {
        let mut acc = ResponsesAccumulator::new("r", "m", 1);
        assert_eq!(acc.finish().unwrap_err().code, Some("transport_closed"));
        acc.push(&RunEventKind::Failed(ExecutionFailure::new(
            FailureCode::DeadlineExceeded,
        )));
        assert_eq!(acc.finish().unwrap_err().status, 504);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_parser(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_responses_request(&body);
        }

        #[test]
        fn arbitrary_json_never_panics(body in arbitrary_json(4)) {
            if let Err(err) = parse_responses_request(body.to_string().as_bytes()) {
                prop_assert_eq!(err.status, 400);
            }
        }

        #[test]
        fn mutated_sdk_bodies_never_panic(path in 0usize..60, replacement in arbitrary_json(2)) {
            let mut body = sdk_body();
            replace_nth_value(&mut body, path, replacement);
            let _ = parse_responses_request(body.to_string().as_bytes());
        }

        #[test]
        fn typed_delta_events_write_what_the_json_object_model_wrote(
            text in "\\PC{0,8}|[\"\\\\\\x00-\\x1f]{0,4}",
            item_id in "[a-z_0-9\"]{0,8}",
            output_index in 0usize..1_000,
            sequence_number in any::<u64>(),
        ) {
            let typed = serde_json::to_string(&OutputTextDelta {
                content_index: 0,
                delta: &text,
                item_id: &item_id,
                logprobs: [],
                output_index,
                sequence_number,
                kind: "response.output_text.delta",
            }).unwrap();
            let tree = json!({
                "type": "response.output_text.delta",
                "sequence_number": sequence_number,
                "item_id": item_id,
                "output_index": output_index,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            });
            prop_assert_eq!(typed, tree.to_string());
            let typed = serde_json::to_string(&ArgumentsDelta {
                delta: &text,
                item_id: &item_id,
                output_index,
                sequence_number,
                kind: "response.function_call_arguments.delta",
            }).unwrap();
            let tree = json!({
                "type": "response.function_call_arguments.delta",
                "sequence_number": sequence_number,
                "item_id": item_id,
                "output_index": output_index,
                "delta": text,
            });
            prop_assert_eq!(typed, tree.to_string());
            let typed = serde_json::to_string(&ReasoningTextDelta {
                content_index: 0,
                delta: &text,
                item_id: &item_id,
                output_index,
                sequence_number,
                kind: "response.reasoning_text.delta",
            }).unwrap();
            let tree = json!({
                "type": "response.reasoning_text.delta",
                "sequence_number": sequence_number,
                "item_id": item_id,
                "output_index": output_index,
                "content_index": 0,
                "delta": text,
            });
            prop_assert_eq!(typed, tree.to_string());
        }

        #[test]
        fn stream_sequence_numbers_are_dense_for_any_event_order(
            events in proptest::collection::vec(any::<RunEventKindSample>(), 0..20)
        ) {
            let mut stream = ResponsesStream::new("resp_p", "m", 1);
            let events: Vec<RunEventKind> = events.into_iter().map(RunEventKindSample::into_event).collect();
            let all = run(&mut stream, &events);
            for (i, e) in all.iter().enumerate() {
                prop_assert_eq!(e.data["sequence_number"].as_u64(), Some(i as u64));
            }
            let terminals = all.iter().filter(|e| matches!(e.event.as_str(),
                "response.completed" | "response.incomplete" | "response.failed")).count();
            prop_assert!(terminals <= 1);
        }
    }

    /// A small generator of run events for property tests.
    #[derive(Debug, Clone)]
    enum RunEventKindSample {
        Text(String),
        Reasoning(String),
        Tool(u32, bool, String),
        Usage(u8, u8),
        Done(u8),
        Fail,
    }

    impl Arbitrary for RunEventKindSample {
        type Parameters = ();
        type Strategy = BoxedStrategy<Self>;
        fn arbitrary_with((): ()) -> Self::Strategy {
            prop_oneof![
                4 => ".{0,4}".prop_map(RunEventKindSample::Text),
                2 => ".{0,4}".prop_map(RunEventKindSample::Reasoning),
                3 => (0u32..3, any::<bool>(), ".{0,4}")
                    .prop_map(|(i, first, a)| RunEventKindSample::Tool(i, first, a)),
                1 => (any::<u8>(), any::<u8>()).prop_map(|(p, c)| RunEventKindSample::Usage(p, c)),
                1 => (0u8..4).prop_map(RunEventKindSample::Done),
                1 => Just(RunEventKindSample::Fail),
            ]
            .boxed()
        }
    }

    impl RunEventKindSample {
        fn into_event(self) -> RunEventKind {
            match self {
                RunEventKindSample::Text(t) => RunEventKind::TextDelta(t),
                RunEventKindSample::Reasoning(t) => RunEventKind::ReasoningDelta(t),
                RunEventKindSample::Tool(index, first, args) => {
                    RunEventKind::ToolCallDelta(ToolCallDelta {
                        index,
                        id: first.then(|| format!("call_{index}")),
                        name: first.then(|| "f".to_owned()),
                        arguments_delta: args,
                    })
                }
                RunEventKindSample::Usage(p, c) => {
                    RunEventKind::Usage(usage(u64::from(p), u64::from(c)))
                }
                RunEventKindSample::Done(r) => RunEventKind::Completed {
                    finish_reason: FinishReason::ALL[usize::from(r) % FinishReason::ALL.len()],
                    usage: None,
                },
                RunEventKindSample::Fail => {
                    RunEventKind::Failed(ExecutionFailure::new(FailureCode::ProviderError))
                }
            }
        }
    }
}
