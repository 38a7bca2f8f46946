//! The Ollama API: `POST /api/chat`, `POST /api/generate` (NDJSON streams)
//! and `GET /api/tags`.
//!
//! * [`parse_ollama_chat`] / [`parse_ollama_generate`] turn a body into an
//!   [`OllamaRequest`]. `stream` defaults to true, as in Ollama. A generate
//!   run carries an optional system message and one user message (the
//!   prompt). A request with no messages (chat) or an empty prompt
//!   (generate) only asks Ollama to load the model: see
//!   [`OllamaRequest::is_load_only`] and [`load_response_json`].
//! * [`OllamaStream`] turns run events into NDJSON objects, one per line:
//!   content chunks with `done: false`, the assembled tool calls (chat) in
//!   one chunk at the end, then the final `done: true` object with
//!   `done_reason` and token counts. A failure is one `{"error": "..."}` line.
//! * [`OllamaAccumulator`] builds the single non-streaming object.
//!
//! Timestamps (`created_at`) are RFC 3339 strings built from caller-supplied
//! Unix milliseconds; durations are nanoseconds between the caller's start
//! and finish times (load and eval durations are not measured and are 0).

use iop_wire::{
    ChatMessage, FinishReason, GenerationParams, Role, RunApi, RunEventKind, ToolCall, Usage,
};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::NormalizedRun;
use super::chat::{parse_function_tools, parse_model, parse_stop};
use super::error::ApiError;
use super::framing;
use super::request_object::{RequestObject, element, parse_body};
use super::transcript::{ToolCallAssembly, Transcript};

/// Most stop sequences an Ollama request may give.
pub const MAX_OLLAMA_STOP_SEQUENCES: usize = 16;

/// A parsed Ollama chat or generate request.
#[derive(Debug, Clone, PartialEq)]
pub struct OllamaRequest {
    /// The run: [`RunApi::Chat`] for `/api/chat`, [`RunApi::Generate`] for
    /// `/api/generate`; no messages for a load-only request; tools for chat
    /// only; parameters from `options`; `stream` (NDJSON) by default.
    pub run: NormalizedRun,
}

impl OllamaRequest {
    /// True when the request only asks to load the model (no messages or an
    /// empty prompt): answer with [`load_response_json`] instead of a run.
    pub fn is_load_only(&self) -> bool {
        self.run.messages.is_empty()
    }
}

/// Parse a `POST /api/chat` body.
pub fn parse_ollama_chat(body: &[u8]) -> Result<OllamaRequest, ApiError> {
    let value = parse_body(body)?;
    let root = RequestObject::root(&value)?;
    let model = parse_model(&root)?;
    let stream = root.bool("stream")?.unwrap_or(true);
    let response_format_json = parse_format(&root)?;

    let mut messages = Vec::new();
    let mut unanswered: Vec<ToolCall> = Vec::new();
    if let Some(items) = root.array("messages")? {
        for (i, item) in items.iter().enumerate() {
            let message = parse_ollama_message(item, element("messages", i), i, &mut unanswered)?;
            messages.push(message);
        }
    }
    let tools = parse_function_tools(&root, "tools")?;
    let mut params = parse_options(&root)?;
    params.response_format_json = response_format_json;
    params.whole_answer = !stream;
    Ok(OllamaRequest {
        run: NormalizedRun {
            model,
            stream,
            api: RunApi::Chat,
            messages,
            tools,
            params,
            choices: 1,
        },
    })
}

/// Parse a `POST /api/generate` body.
pub fn parse_ollama_generate(body: &[u8]) -> Result<OllamaRequest, ApiError> {
    let value = parse_body(body)?;
    let root = RequestObject::root(&value)?;
    let model = parse_model(&root)?;
    let stream = root.bool("stream")?.unwrap_or(true);
    let response_format_json = parse_format(&root)?;
    if root.bool("raw")? == Some(true) {
        return Err(ApiError::unsupported_parameter(
            "raw",
            "Raw prompts are not supported.",
        ));
    }
    let suffix = root
        .string("suffix")?
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    if root.string("template")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported_parameter(
            "template",
            "Prompt templates are not supported.",
        ));
    }
    let images = parse_images(&root)?;
    reject_non_empty_array(&root, "context", "Context token arrays are not supported.")?;

    let prompt = root.string("prompt")?.unwrap_or_default();
    let system = root.string("system")?;
    let mut messages = Vec::new();
    if !prompt.is_empty() {
        if let Some(system) = system {
            messages.push(text_message(Role::System, system.to_owned()));
        }
        let mut user = text_message(Role::User, prompt.to_owned());
        user.images = images;
        messages.push(user);
    }
    let mut params = parse_options(&root)?;
    params.response_format_json = response_format_json;
    params.suffix = suffix;
    params.whole_answer = !stream;
    Ok(OllamaRequest {
        run: NormalizedRun {
            model,
            stream,
            api: RunApi::Generate,
            messages,
            tools: Vec::new(),
            params,
            choices: 1,
        },
    })
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

/// `format`: `"json"` (JSON mode) or a JSON Schema object (structured
/// output), as a `response_format` in the Chat shape.
fn parse_format(root: &RequestObject<'_>) -> Result<Option<String>, ApiError> {
    match root.get("format") {
        None => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) if s == "json" => {
            Ok(Some(json!({"type": "json_object"}).to_string()))
        }
        Some(schema @ Value::Object(_)) => Ok(Some(
            json!({"type": "json_schema",
                   "json_schema": {"name": "response", "schema": schema, "strict": true}})
            .to_string(),
        )),
        Some(_) => Err(ApiError::invalid_value(
            "format",
            "must be \"json\" or a JSON Schema object.",
        )),
    }
}

/// `images`: base64 strings, as `data:` URLs (the type sniffed from the
/// first bytes; PNG when unknown).
fn parse_images(obj: &RequestObject<'_>) -> Result<Vec<String>, ApiError> {
    let Some(items) = obj.array("images")? else {
        return Ok(Vec::new());
    };
    let path = obj.param("images");
    if items.len() > super::surface::MAX_IMAGES_PER_REQUEST {
        return Err(ApiError::invalid_value(
            &path,
            &format!(
                "must contain at most {} images.",
                super::surface::MAX_IMAGES_PER_REQUEST
            ),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(b64) if !b64.is_empty() => {
                let mime = if b64.starts_with("/9j/") {
                    "image/jpeg"
                } else if b64.starts_with("R0lG") {
                    "image/gif"
                } else if b64.starts_with("UklG") {
                    "image/webp"
                } else {
                    "image/png"
                };
                Ok(format!("data:{mime};base64,{b64}"))
            }
            _ => Err(ApiError::invalid_type(
                &element(&path, i),
                "a non-empty base64 string",
            )),
        })
        .collect()
}

fn reject_non_empty_array(
    obj: &RequestObject<'_>,
    key: &str,
    detail: &str,
) -> Result<(), ApiError> {
    match obj.array(key)? {
        Some(items) if !items.is_empty() => {
            Err(ApiError::unsupported_parameter(&obj.param(key), detail))
        }
        _ => Ok(()),
    }
}

fn parse_ollama_message(
    value: &Value,
    path: String,
    message_index: usize,
    unanswered: &mut Vec<ToolCall>,
) -> Result<ChatMessage, ApiError> {
    let obj = RequestObject::at(value, path)?;
    let role = match obj.non_empty_string("role")? {
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        _ => {
            return Err(ApiError::invalid_value(
                &obj.param("role"),
                "must be one of 'system', 'user', 'assistant' or 'tool'.",
            ));
        }
    };
    let content = obj.string("content")?.unwrap_or_default().to_owned();
    let images = parse_images(&obj)?;

    let mut message = text_message(role, content);
    message.images = images;
    if let Some(calls) = obj.array("tool_calls")? {
        if role != Role::Assistant {
            return Err(ApiError::invalid_value(
                &obj.param("tool_calls"),
                "only assistant messages may carry tool calls.",
            ));
        }
        let calls_path = obj.param("tool_calls");
        for (j, call) in calls.iter().enumerate() {
            let call = RequestObject::at(call, element(&calls_path, j))?;
            let Some(function) = call.object("function")? else {
                return Err(ApiError::missing_parameter(&call.param("function")));
            };
            let arguments = match function.get("arguments") {
                None => "{}".to_owned(),
                Some(Value::String(s)) => s.clone(),
                Some(args @ Value::Object(_)) => args.to_string(),
                Some(_) => {
                    return Err(ApiError::invalid_type(
                        &function.param("arguments"),
                        "an object",
                    ));
                }
            };
            // Ollama tool calls have no ids; derive stable ones for adapters that need them.
            let id = match call.string("id")? {
                Some(id) if !id.is_empty() => id.to_owned(),
                _ => format!("call_{message_index:x}_{j:x}"),
            };
            message.tool_calls.push(ToolCall {
                id,
                name: function.non_empty_string("name")?.to_owned(),
                arguments,
            });
        }
        unanswered.clone_from(&message.tool_calls);
    }
    if role == Role::Tool {
        let name = match obj.string("tool_name")? {
            Some(name) => Some(name.to_owned()),
            None => obj.string("name")?.map(str::to_owned),
        };
        let id = match obj.string("tool_call_id")? {
            Some(id) => {
                unanswered.retain(|c| c.id != id);
                Some(id.to_owned())
            }
            // Answer the oldest unanswered call of the same name, else the oldest.
            None => {
                let position = name
                    .as_deref()
                    .and_then(|n| unanswered.iter().position(|c| c.name == n))
                    .or(if unanswered.is_empty() { None } else { Some(0) });
                position.map(|p| unanswered.remove(p).id)
            }
        };
        message.tool_call_id = id;
        message.name = name;
    }
    Ok(message)
}

/// The `options` the normalized run carries in its own fields.
const NORMALIZED_OPTIONS: &[&str] = &[
    "temperature",
    "top_p",
    "num_predict",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
];

/// `options`: temperature, top_p, num_predict, stop, seed and penalties in
/// the run's fields; every other option (num_ctx, top_k, min_p, ...) passes
/// through: back into `options` for an Ollama provider, as a top-level
/// field for an OpenAI-compatible one (llama.cpp and vLLM take `top_k`,
/// `min_p`, `repeat_penalty`).
fn parse_options(root: &RequestObject<'_>) -> Result<GenerationParams, ApiError> {
    let Some(options) = root.object("options")? else {
        return Ok(GenerationParams::default());
    };
    let max_tokens = match options.i64("num_predict")? {
        // -1 (infinite) and -2 (fill context) mean no limit.
        None => None,
        Some(n) if n < 0 => None,
        Some(0) => {
            return Err(ApiError::invalid_value(
                &options.param("num_predict"),
                "must be at least 1, or negative for no limit.",
            ));
        }
        Some(n) => Some(u32::try_from(n).unwrap_or(u32::MAX)),
    };
    Ok(GenerationParams {
        temperature: options.number_in("temperature", 0.0, 2.0)?,
        top_p: options.number_in("top_p", 0.0, 1.0)?,
        max_tokens,
        stop: parse_stop(&options, "stop", MAX_OLLAMA_STOP_SEQUENCES)?,
        seed: options.i64("seed")?,
        presence_penalty: options.number_in("presence_penalty", -2.0, 2.0)?,
        frequency_penalty: options.number_in("frequency_penalty", -2.0, 2.0)?,
        extra_json: super::surface::pass_through_fields(&options, NORMALIZED_OPTIONS)?,
        ..GenerationParams::default()
    })
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    // Howard Hinnant's algorithm, restricted to dates after the epoch.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// `unix_ms` as RFC 3339 UTC with milliseconds: `2024-05-01T12:00:00.000Z`.
pub fn rfc3339_utc(unix_ms: u64) -> String {
    Rfc3339Utc(unix_ms).to_string()
}

/// A Unix millisecond time written as RFC 3339 UTC with milliseconds, as a
/// JSON string too, without an intermediate `String`.
#[derive(Debug, Clone, Copy)]
struct Rfc3339Utc(u64);

impl std::fmt::Display for Rfc3339Utc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let unix_ms = self.0;
        let secs = unix_ms / 1_000;
        let (year, month, day) = civil_from_days(secs / 86_400);
        let in_day = secs % 86_400;
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
            in_day / 3_600,
            in_day % 3_600 / 60,
            in_day % 60,
            unix_ms % 1_000
        )
    }
}

impl Serialize for Rfc3339Utc {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

fn done_reason(finish_reason: FinishReason) -> &'static str {
    match finish_reason {
        FinishReason::Length => "length",
        // Ollama reports tool calls, filtered output and a matched stop
        // sequence as a normal stop.
        FinishReason::Stop
        | FinishReason::StopSequence
        | FinishReason::ToolCalls
        | FinishReason::ContentFilter => "stop",
    }
}

fn tool_calls_json(calls: &ToolCallAssembly) -> Value {
    let calls: Vec<Value> = calls
        .calls()
        .enumerate()
        .map(|(index, call)| {
            // Ollama clients expect an object; arguments that are not a JSON
            // object are passed on as the string the model produced.
            let arguments = match serde_json::from_str::<Value>(&call.arguments) {
                Ok(args @ Value::Object(_)) => args,
                _ if call.arguments.trim().is_empty() => json!({}),
                _ => Value::String(call.arguments.clone()),
            };
            json!({
                "id": call.id,
                "function": { "index": index, "name": call.name, "arguments": arguments },
            })
        })
        .collect();
    Value::Array(calls)
}

/// The fields every streamed object starts with.
fn object_head(model: &str, now_unix_ms: u64) -> Map<String, Value> {
    let mut head = Map::new();
    head.insert("model".into(), json!(model));
    head.insert("created_at".into(), json!(rfc3339_utc(now_unix_ms)));
    head
}

/// `message` (chat) or `response` (generate) with this text.
fn insert_text(
    object: &mut Map<String, Value>,
    api: RunApi,
    text: &str,
    tool_calls: Option<Value>,
) {
    match api {
        RunApi::Chat => {
            let mut message = Map::new();
            message.insert("role".into(), json!("assistant"));
            message.insert("content".into(), json!(text));
            if let Some(calls) = tool_calls {
                message.insert("tool_calls".into(), calls);
            }
            object.insert("message".into(), Value::Object(message));
        }
        _ => {
            object.insert("response".into(), json!(text));
        }
    }
}

/// Ollama's `thinking`: in `message` (chat) or beside `response` (generate).
fn insert_thinking(object: &mut Map<String, Value>, api: RunApi, text: &str) {
    match (api, object.get_mut("message")) {
        (RunApi::Chat, Some(Value::Object(message))) => {
            message.insert("thinking".into(), json!(text));
        }
        _ => {
            object.insert("thinking".into(), json!(text));
        }
    }
}

/// The statistics fields of a final object.
fn insert_done(
    object: &mut Map<String, Value>,
    finish_reason: FinishReason,
    usage: Option<Usage>,
    total_duration_ns: u64,
) {
    object.insert("done".into(), json!(true));
    object.insert("done_reason".into(), json!(done_reason(finish_reason)));
    object.insert("total_duration".into(), json!(total_duration_ns));
    object.insert("load_duration".into(), json!(0));
    // The provider's token counts; absent when it reported none (never
    // invented as zeros).
    if let Some(usage) = usage {
        object.insert("prompt_eval_count".into(), json!(usage.prompt_tokens));
        object.insert("prompt_eval_duration".into(), json!(0));
        object.insert("eval_count".into(), json!(usage.completion_tokens));
        object.insert("eval_duration".into(), json!(0));
    }
}

fn duration_ns(started_unix_ms: u64, now_unix_ms: u64) -> u64 {
    now_unix_ms
        .saturating_sub(started_unix_ms)
        .saturating_mul(1_000_000)
}

/// Encodes run events as Ollama NDJSON objects, one per line.
///
/// A text chunk is a typed struct borrowing the event's text, written
/// straight into the response body; its keys come in the order the sorted
/// JSON object model of `serde_json` gave them (and the final object, built
/// once per stream, still comes from that model).
#[derive(Debug, Clone)]
pub struct OllamaStream {
    model: String,
    api: RunApi,
    started_unix_ms: u64,
    tool_calls: ToolCallAssembly,
    usage: Option<Usage>,
    finished: bool,
}

/// A streamed text object: `message` (chat) or `response` (generate).
#[derive(Serialize)]
struct TextChunk<'a> {
    created_at: Rfc3339Utc,
    done: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<AssistantText<'a>>,
    model: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<&'a str>,
}

#[derive(Serialize)]
struct AssistantText<'a> {
    content: &'a str,
    role: &'static str,
}

impl OllamaStream {
    /// A stream for `model` and `api`, started at `started_unix_ms`.
    pub fn new(model: impl Into<String>, api: RunApi, started_unix_ms: u64) -> Self {
        Self {
            model: model.into(),
            api,
            started_unix_ms,
            tool_calls: ToolCallAssembly::default(),
            usage: None,
            finished: false,
        }
    }

    /// True once a terminal event was encoded.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Append the NDJSON lines for one run event at `now_unix_ms` to `out`,
    /// in order (possibly none).
    pub fn push(&mut self, event: &RunEventKind, now_unix_ms: u64, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        match event {
            RunEventKind::Started { .. } => {}
            RunEventKind::Usage(usage) => self.usage = Some(*usage),
            RunEventKind::TextDelta(text) => {
                if !text.is_empty() {
                    let (message, response) = match self.api {
                        RunApi::Chat => (
                            Some(AssistantText {
                                content: text,
                                role: "assistant",
                            }),
                            None,
                        ),
                        _ => (None, Some(text.as_str())),
                    };
                    let chunk = TextChunk {
                        created_at: Rfc3339Utc(now_unix_ms),
                        done: false,
                        message,
                        model: &self.model,
                        response,
                    };
                    framing::ndjson_line(out, &chunk);
                }
            }
            RunEventKind::ToolCallDelta(delta) => {
                // Ollama sends whole tool calls, so fragments are assembled first.
                self.tool_calls.push(delta, "");
            }
            RunEventKind::ReasoningDelta(text) => {
                if !text.is_empty() {
                    let mut object = object_head(&self.model, now_unix_ms);
                    insert_text(&mut object, self.api, "", None);
                    insert_thinking(&mut object, self.api, text);
                    object.insert("done".into(), json!(false));
                    framing::ndjson_line(out, &object);
                }
            }
            // Ollama's chat and generate answers carry no log probabilities
            // (the Edge refuses `logprobs` for them) and no embeddings.
            RunEventKind::Logprobs(_) | RunEventKind::Embedding(_) => {}
            RunEventKind::Completed {
                finish_reason,
                usage,
            } => {
                if self.api == RunApi::Chat && !self.tool_calls.is_empty() {
                    let mut object = object_head(&self.model, now_unix_ms);
                    insert_text(
                        &mut object,
                        self.api,
                        "",
                        Some(tool_calls_json(&self.tool_calls)),
                    );
                    object.insert("done".into(), json!(false));
                    framing::ndjson_line(out, &object);
                }
                let mut object = object_head(&self.model, now_unix_ms);
                insert_text(&mut object, self.api, "", None);
                insert_done(
                    &mut object,
                    *finish_reason,
                    usage.or(self.usage),
                    duration_ns(self.started_unix_ms, now_unix_ms),
                );
                framing::ndjson_line(out, &object);
                self.finished = true;
            }
            RunEventKind::Failed(failure) => {
                self.fail(&ApiError::from_execution_failure(failure), out);
            }
        }
    }

    /// End the stream with one `{"error": "..."}` line (R-GATE-3).
    pub fn fail(&mut self, err: &ApiError, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        self.finished = true;
        framing::ndjson_line(out, &err.to_ollama_json());
    }
}

/// Folds run events into the single non-streaming Ollama object.
#[derive(Debug, Clone)]
pub struct OllamaAccumulator {
    model: String,
    api: RunApi,
    started_unix_ms: u64,
    transcript: Transcript,
}

impl OllamaAccumulator {
    /// An accumulator for `model` and `api`, started at `started_unix_ms`.
    pub fn new(model: impl Into<String>, api: RunApi, started_unix_ms: u64) -> Self {
        Self {
            model: model.into(),
            api,
            started_unix_ms,
            transcript: Transcript::new(""),
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

    /// The final object at `now_unix_ms`, or the error the run ended with.
    pub fn finish(&self, now_unix_ms: u64) -> Result<Value, ApiError> {
        let finish_reason = self.transcript.finish_reason()?;
        let calls = self.transcript.tool_calls();
        let mut object = object_head(&self.model, now_unix_ms);
        let tool_calls =
            (self.api == RunApi::Chat && !calls.is_empty()).then(|| tool_calls_json(calls));
        insert_text(&mut object, self.api, self.transcript.text(), tool_calls);
        if !self.transcript.reasoning().is_empty() {
            insert_thinking(&mut object, self.api, self.transcript.reasoning());
        }
        insert_done(
            &mut object,
            finish_reason,
            self.transcript.usage(),
            duration_ns(self.started_unix_ms, now_unix_ms),
        );
        Ok(Value::Object(object))
    }
}

/// The answer to a load-only request (`done_reason: "load"`).
pub fn load_response_json(model: &str, api: RunApi, now_unix_ms: u64) -> Value {
    let mut object = object_head(model, now_unix_ms);
    insert_text(&mut object, api, "", None);
    object.insert("done".into(), json!(true));
    object.insert("done_reason".into(), json!("load"));
    Value::Object(object)
}

/// `GET /api/tags`: `{"models":[{name, model, modified_at, size, digest, details}]}`.
///
/// Sizes, digests and details are not known at the Edge and are left empty.
pub fn tags_json(models: &[String]) -> Value {
    let models: Vec<Value> = models
        .iter()
        .map(|name| {
            json!({
                "name": name,
                "model": name,
                "modified_at": rfc3339_utc(0),
                "size": 0,
                "digest": "",
                "details": {
                    "parent_model": "",
                    "format": "",
                    "family": "",
                    "families": [],
                    "parameter_size": "",
                    "quantization_level": "",
                },
            })
        })
        .collect();
    json!({ "models": models })
}

/// The model named by a `POST /api/show` body (`model`, or the older `name`).
pub fn parse_show_request(body: &[u8]) -> Result<String, ApiError> {
    let value = parse_body(body)?;
    let root = RequestObject::root(&value)?;
    match root.string("model")? {
        Some(model) if !model.is_empty() => Ok(model.to_owned()),
        _ => Ok(root.non_empty_string("name")?.to_owned()),
    }
}

/// `POST /api/show` of a routable model: its capabilities as its providers'
/// kinds allow (completion always; embeddings, tools and vision through
/// providers that take them); no modelfile, template or weights details,
/// which only the provider itself knows.
pub fn show_json(model: &str, adapters: &[iop_wire::AdapterKind]) -> Value {
    let mut capabilities = vec!["completion", "tools", "insert", "vision"];
    if !adapters.is_empty() {
        capabilities.push("embedding");
    }
    json!({
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": {
            "parent_model": "",
            "format": "",
            "family": "",
            "families": [],
            "parameter_size": "",
            "quantization_level": "",
        },
        "model_info": {"general.basename": model},
        "capabilities": capabilities,
        "modified_at": rfc3339_utc(0),
    })
}

/// `GET /api/ps`: `{"models":[{name, model, size, digest, details,
/// expires_at, size_vram}]}` for the models routable now.
pub fn ps_json(models: &[String]) -> Value {
    let mut tags = tags_json(models);
    if let Some(Value::Array(items)) = tags.get_mut("models") {
        for item in items {
            if let Value::Object(m) = item {
                m.remove("modified_at");
                m.insert("expires_at".into(), json!(rfc3339_utc(0)));
                m.insert("size_vram".into(), json!(0));
            }
        }
    }
    tags
}

/// `GET /api/version`: `{"version": "..."}`.
pub fn version_json(version: &str) -> Value {
    json!({ "version": version })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::arbitrary_body::{arbitrary_json, replace_nth_value};
    use iop_wire::{ExecutionFailure, FailureCode, ToolCallDelta};
    use proptest::prelude::*;

    fn chat(body: Value) -> Result<OllamaRequest, ApiError> {
        parse_ollama_chat(body.to_string().as_bytes())
    }

    fn generate(body: Value) -> Result<OllamaRequest, ApiError> {
        parse_ollama_generate(body.to_string().as_bytes())
    }

    fn chat_body() -> Value {
        json!({
            "model": "llama3.2",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris and time?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_time", "arguments": {}}},
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ]},
                {"role": "tool", "tool_name": "get_weather", "content": "21C"},
                {"role": "tool", "content": "noon"}
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
            "options": {"temperature": 0.3, "top_p": 0.8, "num_predict": 64, "stop": ["###"],
                        "seed": 7, "num_ctx": 4096, "top_k": 40},
            "keep_alive": "5m",
            "think": false
        })
    }

    #[test]
    fn chat_body_parses_with_stream_default_true() {
        let req = chat(chat_body()).unwrap();
        assert_eq!(req.run.model, "llama3.2");
        assert!(req.run.stream);
        assert_eq!(req.run.api, RunApi::Chat);
        assert_eq!(req.run.messages.len(), 5);
        let calls = &req.run.messages[2].tool_calls;
        assert_eq!(calls[0].name, "get_time");
        assert_eq!(calls[0].arguments, "{}");
        assert_eq!(calls[1].arguments, "{\"city\":\"Paris\"}");
        assert_eq!(calls[0].id, "call_2_0");
        assert_eq!(
            req.run.messages[3].tool_call_id.as_deref(),
            Some("call_2_1")
        );
        assert_eq!(req.run.messages[3].name.as_deref(), Some("get_weather"));
        assert_eq!(
            req.run.messages[4].tool_call_id.as_deref(),
            Some("call_2_0")
        );
        assert_eq!(req.run.tools[0].name, "get_weather");
        assert_eq!(req.run.params.temperature, Some(0.3));
        assert_eq!(req.run.params.top_p, Some(0.8));
        assert_eq!(req.run.params.max_tokens, Some(64));
        assert_eq!(req.run.params.stop, vec!["###".to_owned()]);
        assert_eq!(req.run.params.seed, Some(7));
        assert!(!req.is_load_only());
    }

    #[test]
    fn generate_body_parses_into_system_and_prompt() {
        let req = generate(json!({"model": "m", "prompt": "Why?", "system": "Sys",
                                  "stream": false, "options": {"num_predict": -1}}))
        .unwrap();
        assert_eq!(req.run.api, RunApi::Generate);
        assert!(!req.run.stream);
        assert_eq!(req.run.messages.len(), 2);
        assert_eq!(
            (
                req.run.messages[0].role,
                req.run.messages[0].content.as_str()
            ),
            (Role::System, "Sys")
        );
        assert_eq!(
            (
                req.run.messages[1].role,
                req.run.messages[1].content.as_str()
            ),
            (Role::User, "Why?")
        );
        assert_eq!(req.run.params.max_tokens, None);
    }

    #[test]
    fn empty_prompt_or_messages_is_load_only() {
        assert!(generate(json!({"model": "m"})).unwrap().is_load_only());
        assert!(
            generate(json!({"model": "m", "prompt": ""}))
                .unwrap()
                .is_load_only()
        );
        assert!(
            chat(json!({"model": "m", "messages": []}))
                .unwrap()
                .is_load_only()
        );
        let v = load_response_json("m", RunApi::Generate, 0);
        assert_eq!(v["done"], true);
        assert_eq!(v["done_reason"], "load");
        assert_eq!(v["response"], "");
    }

    #[test]
    fn every_bad_field_names_its_parameter() {
        let cases: Vec<(Result<OllamaRequest, ApiError>, &str)> = vec![
            (chat(json!({"messages": []})), "model"),
            (chat(json!({"model": "m", "stream": "no"})), "stream"),
            (chat(json!({"model": "m", "messages": {}})), "messages"),
            (
                chat(json!({"model": "m", "messages": [{"content": "x"}]})),
                "messages[0].role",
            ),
            (
                chat(json!({"model": "m", "messages": [{"role": "x"}]})),
                "messages[0].role",
            ),
            (
                chat(json!({"model": "m", "messages": [{"role": "user", "content": 1}]})),
                "messages[0].content",
            ),
            (
                chat(
                    json!({"model": "m", "messages": [{"role": "user", "content": "x", "images": [""]}]}),
                ),
                "messages[0].images[0]",
            ),
            (
                chat(
                    json!({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{}]}]}),
                ),
                "messages[0].tool_calls[0].function",
            ),
            (
                chat(
                    json!({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]}),
                ),
                "messages[0].tool_calls[0].function.arguments",
            ),
            (
                chat(json!({"model": "m", "messages": [{"role": "user", "tool_calls": []}]})),
                "messages[0].tool_calls",
            ),
            (chat(json!({"model": "m", "format": "yaml"})), "format"),
            (
                chat(json!({"model": "m", "tools": [{"type": "x"}]})),
                "tools[0].type",
            ),
            (chat(json!({"model": "m", "options": []})), "options"),
            (
                chat(json!({"model": "m", "options": {"temperature": "hot"}})),
                "options.temperature",
            ),
            (
                chat(json!({"model": "m", "options": {"top_p": 2}})),
                "options.top_p",
            ),
            (
                chat(json!({"model": "m", "options": {"num_predict": 0}})),
                "options.num_predict",
            ),
            (
                chat(json!({"model": "m", "options": {"num_predict": 1.5}})),
                "options.num_predict",
            ),
            (
                chat(json!({"model": "m", "options": {"stop": [1]}})),
                "options.stop[0]",
            ),
            (
                chat(json!({"model": "m", "options": {"seed": "x"}})),
                "options.seed",
            ),
            (generate(json!({"model": "m", "prompt": 1})), "prompt"),
            (
                generate(json!({"model": "m", "prompt": "x", "system": 1})),
                "system",
            ),
            (
                generate(json!({"model": "m", "prompt": "x", "raw": true})),
                "raw",
            ),
            (
                generate(json!({"model": "m", "prompt": "x", "images": [1]})),
                "images[0]",
            ),
            (
                generate(json!({"model": "m", "prompt": "x", "context": [1, 2]})),
                "context",
            ),
            (
                generate(json!({"model": "m", "prompt": "x", "format": 3})),
                "format",
            ),
        ];
        for (result, expected) in cases {
            let err = result.expect_err(expected);
            assert_eq!(err.status, 400);
            assert_eq!(err.param.as_deref(), Some(expected));
        }
    }

    fn text(s: &str) -> RunEventKind {
        RunEventKind::TextDelta(s.into())
    }

    fn usage(p: u64, c: u64) -> Usage {
        Usage::tokens(p, c)
    }

    fn push(stream: &mut OllamaStream, event: &RunEventKind, now_unix_ms: u64) -> Vec<Value> {
        let mut out = Vec::new();
        stream.push(event, now_unix_ms, &mut out);
        framing::ndjson_values(&out)
    }

    #[test]
    fn chat_stream_objects_have_the_ollama_shape() {
        let mut stream = OllamaStream::new("llama3", RunApi::Chat, 1_000);
        let mut lines = push(&mut stream, &text("Hi"), 1_500);
        lines.extend(push(&mut stream, &text(""), 1_600));
        lines.extend(push(
            &mut stream,
            &RunEventKind::Completed {
                finish_reason: FinishReason::Stop,
                usage: Some(usage(12, 3)),
            },
            3_000,
        ));
        assert_eq!(lines.len(), 2);
        assert_eq!(
            lines[0],
            json!({"model": "llama3", "created_at": "1970-01-01T00:00:01.500Z",
                   "message": {"role": "assistant", "content": "Hi"}, "done": false})
        );
        assert_eq!(
            lines[1],
            json!({"model": "llama3", "created_at": "1970-01-01T00:00:03.000Z",
                   "message": {"role": "assistant", "content": ""}, "done": true,
                   "done_reason": "stop", "total_duration": 2_000_000_000u64,
                   "load_duration": 0, "prompt_eval_count": 12, "prompt_eval_duration": 0,
                   "eval_count": 3, "eval_duration": 0})
        );
        assert!(stream.is_finished());
        assert!(push(&mut stream, &text("late"), 4_000).is_empty());
    }

    #[test]
    fn generate_stream_objects_carry_response_text() {
        let mut stream = OllamaStream::new("m", RunApi::Generate, 0);
        let mut lines = push(&mut stream, &text("The"), 0);
        lines.extend(push(
            &mut stream,
            &RunEventKind::Completed {
                finish_reason: FinishReason::Length,
                usage: None,
            },
            0,
        ));
        assert_eq!(lines[0]["response"], "The");
        assert_eq!(lines[0]["done"], false);
        assert!(lines[0].get("message").is_none());
        assert_eq!(lines[1]["response"], "");
        assert_eq!(lines[1]["done"], true);
        assert_eq!(lines[1]["done_reason"], "length");
    }

    #[test]
    fn chat_stream_emits_assembled_tool_calls_before_done() {
        let mut stream = OllamaStream::new("m", RunApi::Chat, 0);
        let events = [
            RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: Some("call_a".into()),
                name: Some("get_weather".into()),
                arguments_delta: "{\"city\":".into(),
            }),
            RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: None,
                name: None,
                arguments_delta: "\"Paris\"}".into(),
            }),
            RunEventKind::Completed {
                finish_reason: FinishReason::ToolCalls,
                usage: None,
            },
        ];
        let lines: Vec<Value> = events
            .iter()
            .flat_map(|e| push(&mut stream, e, 0))
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["done"], false);
        assert_eq!(
            lines[0]["message"]["tool_calls"],
            json!([{"id": "call_a", "function": {"index": 0, "name": "get_weather",
                    "arguments": {"city": "Paris"}}}])
        );
        assert_eq!(lines[1]["done_reason"], "stop");
    }

    // The exact bytes of a stream, as the JSON object model of serde_json
    // wrote them before text objects were typed (keys sorted, compact).
    #[test]
    fn streams_write_these_exact_lines() {
        let mut chat = OllamaStream::new("llama3", RunApi::Chat, 1_000);
        let mut out = Vec::new();
        chat.push(&text("Hé\n\"x\""), 1_500, &mut out);
        chat.push(
            &RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: Some("call_a".into()),
                name: Some("get_weather".into()),
                arguments_delta: "{\"city\":\"Paris\"}".into(),
            }),
            1_600,
            &mut out,
        );
        chat.push(
            &RunEventKind::Completed {
                finish_reason: FinishReason::ToolCalls,
                usage: Some(usage(12, 3)),
            },
            3_000,
            &mut out,
        );
        let mut generate = OllamaStream::new("m", RunApi::Generate, 0);
        generate.push(&text("The"), 86_400_001, &mut out);
        generate.push(
            &RunEventKind::Failed(ExecutionFailure::new(FailureCode::ResponseStalled)),
            86_400_002,
            &mut out,
        );
        let lines = [
            r#"{"created_at":"1970-01-01T00:00:01.500Z","done":false,"message":{"content":"Hé\n\"x\"","role":"assistant"},"model":"llama3"}"#,
            r#"{"created_at":"1970-01-01T00:00:03.000Z","done":false,"message":{"content":"","role":"assistant","tool_calls":[{"function":{"arguments":{"city":"Paris"},"index":0,"name":"get_weather"},"id":"call_a"}]},"model":"llama3"}"#,
            r#"{"created_at":"1970-01-01T00:00:03.000Z","done":true,"done_reason":"stop","eval_count":3,"eval_duration":0,"load_duration":0,"message":{"content":"","role":"assistant"},"model":"llama3","prompt_eval_count":12,"prompt_eval_duration":0,"total_duration":2000000000}"#,
            r#"{"created_at":"1970-01-02T00:00:00.001Z","done":false,"model":"m","response":"The"}"#,
            r#"{"error":"The provider stopped producing output (response stalled)."}"#,
        ];
        let expected: String = lines.iter().map(|l| format!("{l}\n")).collect();
        assert_eq!(String::from_utf8(out).unwrap(), expected);
    }

    #[test]
    fn stream_failure_is_one_error_line() {
        let mut stream = OllamaStream::new("m", RunApi::Chat, 0);
        let lines = push(
            &mut stream,
            &RunEventKind::Failed(ExecutionFailure::new(FailureCode::ProviderUnreachable)),
            0,
        );
        assert_eq!(lines.len(), 1);
        assert!(lines[0]["error"].is_string());
        assert_eq!(lines[0].as_object().unwrap().len(), 1);
        let mut out = Vec::new();
        stream.fail(&ApiError::internal(), &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn accumulator_builds_the_final_chat_object() {
        let mut acc = OllamaAccumulator::new("m", RunApi::Chat, 0);
        for e in [
            text("Hello "),
            text("there"),
            RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: None,
                name: Some("f".into()),
                arguments_delta: "not json".into(),
            }),
            RunEventKind::Usage(usage(2, 2)),
            RunEventKind::Completed {
                finish_reason: FinishReason::Stop,
                usage: None,
            },
        ] {
            acc.push(&e);
        }
        let v = acc.finish(10).unwrap();
        assert_eq!(v["message"]["content"], "Hello there");
        assert_eq!(v["message"]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(
            v["message"]["tool_calls"][0]["function"]["arguments"],
            "not json"
        );
        assert_eq!(v["done"], true);
        assert_eq!(v["prompt_eval_count"], 2);
        assert_eq!(v["eval_count"], 2);
        assert_eq!(v["total_duration"], 10_000_000);
    }

    #[test]
    fn accumulator_builds_the_final_generate_object_and_reports_failures() {
        let mut acc = OllamaAccumulator::new("m", RunApi::Generate, 0);
        acc.push(&text("42"));
        assert!(acc.finish(0).is_err());
        acc.push(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(1, 1)),
        });
        let v = acc.finish(0).unwrap();
        assert_eq!(v["response"], "42");
        assert_eq!(v["done_reason"], "stop");

        let mut failed = OllamaAccumulator::new("m", RunApi::Chat, 0);
        failed.push(&RunEventKind::Failed(ExecutionFailure::new(
            FailureCode::Canceled,
        )));
        assert_eq!(failed.finish(0).unwrap_err().status, 500);
    }

    #[test]
    fn tags_list_every_model() {
        let v = tags_json(&["llama3:latest".to_owned()]);
        let model = &v["models"][0];
        assert_eq!(model["name"], "llama3:latest");
        assert_eq!(model["model"], "llama3:latest");
        assert_eq!(model["modified_at"], "1970-01-01T00:00:00.000Z");
        assert!(model["details"].is_object());
        assert_eq!(tags_json(&[]), json!({"models": []}));
        assert_eq!(version_json("0.1.0"), json!({"version": "0.1.0"}));
    }

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_utc(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339_utc(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339_utc(4_102_444_799_999), "2099-12-31T23:59:59.999Z");
        let _ = rfc3339_utc(u64::MAX);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_parsers(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_ollama_chat(&body);
            let _ = parse_ollama_generate(&body);
        }

        #[test]
        fn arbitrary_json_never_panics(body in arbitrary_json(4)) {
            let bytes = body.to_string();
            for result in [parse_ollama_chat(bytes.as_bytes()), parse_ollama_generate(bytes.as_bytes())] {
                if let Err(err) = result {
                    prop_assert_eq!(err.status, 400);
                }
            }
        }

        #[test]
        fn mutated_chat_bodies_never_panic(path in 0usize..50, replacement in arbitrary_json(2)) {
            let mut body = chat_body();
            replace_nth_value(&mut body, path, replacement);
            let _ = parse_ollama_chat(body.to_string().as_bytes());
        }

        #[test]
        fn any_timestamp_formats(ms in any::<u64>()) {
            let s = rfc3339_utc(ms);
            prop_assert!(s.ends_with('Z'));
            prop_assert_eq!(&s[s.len() - 5..s.len() - 4], ".");
        }
    }
}
