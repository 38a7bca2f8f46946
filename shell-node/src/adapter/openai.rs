//! The `openai` adapter: any OpenAI-compatible server (vLLM, llama.cpp
//! server, LM Studio, cloud APIs). Runs use streaming Chat Completions with
//! usage, or one non-streamed call for a client that takes the answer whole
//! (core's `AnswerCall`); the probe is `GET /v1/models`.

use std::borrow::Cow;

use futures::StreamExt;
use futures::stream::BoxStream;
use iop_core::node::provider::{AnswerCall, AnswerCallFacts};
use iop_core::provider_usage::UsageReport;
use iop_wire::{
    ChatMessage, DocumentSource, Embedding, FinishReason, GenerationParams, Role, RunApi,
    RunEventKind, RunRequest, TokenLogprob, ToolCallDelta, ToolDefinition, Usage,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::client::ProviderResponse;
use super::sse::{EventTooLarge, SseDecoder};
use super::{
    HttpTarget, ProbeVerdict, ProviderCallError, failed_run, http_run, probe_http, whole_answer_run,
};

/// A run as normalized run events: a chat completion; a text completion
/// (`/v1/completions`) for a completion or a generate run with a suffix;
/// one embeddings call. Streamed, or one non-streamed call where core says
/// so ([`AnswerCall::for_run`]: a client that takes the answer whole).
pub(super) fn run(
    target: HttpTarget,
    mut req: RunRequest,
    auth: Option<String>,
) -> BoxStream<'static, RunEventKind> {
    if target.json_object_schema
        && let Some(format) = req.params.response_format_json.take()
    {
        req.params.response_format_json = Some(json_object_schema(&format));
    }
    let completion = req.api == RunApi::Completion
        || (req.api == RunApi::Generate && req.params.suffix.is_some());
    let whole = AnswerCall::for_run(AnswerCallFacts {
        whole_answer: req.params.whole_answer,
        durable: req.park.is_some(),
        stream_usage: target.stream_usage,
        whole_calls: target.whole_calls,
    }) == AnswerCall::Whole;
    let (path, body, decode): (
        _,
        _,
        fn(ProviderResponse) -> BoxStream<'static, RunEventKind>,
    ) = if req.api == RunApi::Embeddings {
        ("/v1/embeddings", embeddings_body(&req), decode_embeddings)
    } else if completion {
        (
            "/v1/completions",
            completion_body(&req, !whole, target.continuous_usage),
            if whole { decode_whole } else { decode },
        )
    } else if whole {
        (
            "/v1/chat/completions",
            chat_body_with(&req, false, false),
            decode_whole,
        )
    } else {
        (
            "/v1/chat/completions",
            chat_body_with(&req, true, target.continuous_usage),
            decode,
        )
    };
    let body = match body {
        Ok(body) => body,
        Err(e) => return failed_run(e),
    };
    let mut request = target.run_request(path, body);
    if req.api != RunApi::Embeddings && !whole {
        request = request.header(http::header::ACCEPT, "text/event-stream");
    }
    http_run(target, request, auth, req.session_id, decode)
}

/// A `json_schema` response format in the `{"type":"json_object","schema"}`
/// form some servers (llama-cpp-python) take instead; others unchanged.
pub(crate) fn json_object_schema(format: &str) -> String {
    match serde_json::from_str::<Value>(format) {
        Ok(v) if v["type"] == "json_schema" => {
            let mut out = json!({"type": "json_object"});
            if v["json_schema"]["schema"].is_object() {
                out["schema"] = v["json_schema"]["schema"].clone();
            }
            out.to_string()
        }
        _ => format.to_owned(),
    }
}

/// The run events of one non-streamed chat or text completion.
fn decode_whole(response: ProviderResponse) -> BoxStream<'static, RunEventKind> {
    whole_answer_run(response, |body| {
        let mut state = ChunkState::default();
        let mut events = Vec::new();
        state.on_whole(body, &mut events)?;
        Ok((events, state.completed()))
    })
}

/// The run events of one embeddings answer: one `Embedding` per input,
/// then `Completed` with the provider's prompt token count.
fn decode_embeddings(response: ProviderResponse) -> BoxStream<'static, RunEventKind> {
    whole_answer_run(response, |body| {
        let (vectors, usage) = parse_embeddings(body).ok_or(ProviderCallError::Malformed)?;
        let events = vectors.into_iter().map(RunEventKind::Embedding).collect();
        let terminal = RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage,
        };
        Ok((events, terminal))
    })
}

/// `{data: [{index, embedding: [..]}], usage: {prompt_tokens}}`.
pub(crate) fn parse_embeddings(body: &[u8]) -> Option<(Vec<Embedding>, Option<Usage>)> {
    #[derive(Deserialize)]
    struct Answer {
        data: Vec<Item>,
        #[serde(default)]
        usage: Option<UsageReport>,
    }
    #[derive(Deserialize)]
    struct Item {
        #[serde(default)]
        index: Option<u32>,
        embedding: Values,
    }
    // A server without pooling (llama-cpp-python serving a causal model)
    // answers one vector per token instead of one per input.
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Values {
        Pooled(Vec<f32>),
        PerToken(Vec<Vec<f32>>),
    }
    let answer: Answer = serde_json::from_slice(body).ok()?;
    let vectors = answer
        .data
        .into_iter()
        .enumerate()
        .map(|(pos, item)| {
            let values = match item.embedding {
                Values::Pooled(values) => values,
                Values::PerToken(tokens) => mean_pool(&tokens)?,
            };
            Some(Embedding {
                index: item.index.unwrap_or(pos as u32),
                values,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some((
        vectors,
        answer.usage.as_ref().map(UsageReport::openai_usage),
    ))
}

/// The mean of per-token vectors (llama.cpp's mean pooling); `None` when
/// there are none or their lengths differ.
fn mean_pool(tokens: &[Vec<f32>]) -> Option<Vec<f32>> {
    let first = tokens.first()?;
    if tokens.iter().any(|t| t.len() != first.len()) {
        return None;
    }
    let n = tokens.len() as f32;
    Some(
        (0..first.len())
            .map(|i| tokens.iter().map(|t| t[i]).sum::<f32>() / n)
            .collect(),
    )
}

/// The embeddings request: one input per user message, floats back.
fn embeddings_body(req: &RunRequest) -> Result<Vec<u8>, ProviderCallError> {
    let mut body = Map::new();
    body.insert("model".into(), Value::String(req.model.clone()));
    let inputs: Vec<Value> = req
        .messages
        .iter()
        .map(|m| Value::String(m.content.clone()))
        .collect();
    body.insert("input".into(), Value::Array(inputs));
    body.insert("encoding_format".into(), json!("float"));
    merge_extra(&req.params, &mut body)?;
    serde_json::to_vec(&Value::Object(body))
        .map_err(|_| ProviderCallError::InvalidRequest("request is not serializable"))
}

/// The text completion request: the prompt (user turns joined), the
/// suffix, the parameters.
fn completion_body(
    req: &RunRequest,
    stream: bool,
    continuous_usage: bool,
) -> Result<Vec<u8>, ProviderCallError> {
    let (system, prompt) = generate_prompt(&req.messages);
    let prompt = match system {
        Some(system) => format!("{system}\n\n{prompt}"),
        None => prompt,
    };
    let mut body = Map::new();
    body.insert("model".into(), Value::String(req.model.clone()));
    body.insert("prompt".into(), Value::String(prompt));
    if let Some(suffix) = &req.params.suffix {
        body.insert("suffix".into(), Value::String(suffix.clone()));
    }
    body.insert("stream".into(), Value::Bool(stream));
    if stream {
        body.insert("stream_options".into(), stream_options(continuous_usage));
    }
    params_json(&req.params, &mut body)?;
    serde_json::to_vec(&Value::Object(body))
        .map_err(|_| ProviderCallError::InvalidRequest("request is not serializable"))
}

/// The run events of a successful streaming answer.
fn decode(response: ProviderResponse) -> BoxStream<'static, RunEventKind> {
    Box::pin(async_stream::stream! {
        let mut bytes = response.bytes_stream();
        let mut sse = SseDecoder::default();
        let mut state = ChunkState::default();
        let mut events = Vec::new();
        loop {
            // Every event already received, then the next bytes.
            loop {
                let decoded = match sse.next_data() {
                    Ok(Some(data)) => state.on_data(data, &mut events),
                    Ok(None) => break,
                    Err(EventTooLarge) => Err(ProviderCallError::Malformed),
                };
                if let Err(e) = decoded {
                    yield RunEventKind::Failed(e.failure());
                    return;
                }
                for event in events.drain(..) {
                    yield event;
                }
                if state.done {
                    // What follows `[DONE]` is the body's framing.
                    bytes.finish();
                    yield state.completed();
                    return;
                }
            }
            match bytes.next().await {
                Some(Ok(chunk)) => sse.push(&chunk),
                Some(Err(e)) => {
                    yield RunEventKind::Failed(super::error::from_http(e, true).failure());
                    return;
                }
                None => {
                    yield state.terminal_at_eof();
                    return;
                }
            }
        }
    })
}

/// `GET /v1/models` -> `{data: [{id}]}`.
pub(super) async fn probe(target: &HttpTarget) -> ProbeVerdict {
    probe_http(target, "/v1/models", parse_models).await
}

pub(super) fn parse_models(body: &[u8]) -> Option<Vec<String>> {
    #[derive(Deserialize)]
    struct Models {
        data: Vec<Model>,
    }
    #[derive(Deserialize)]
    struct Model {
        id: String,
    }
    let models: Models = serde_json::from_slice(body).ok()?;
    Some(models.data.into_iter().map(|m| m.id).collect())
}

/// The streamed Chat Completions request body.
#[cfg(test)]
pub(crate) fn chat_body(req: &RunRequest) -> Result<Vec<u8>, ProviderCallError> {
    chat_body_with(req, true, false)
}

/// A stream's `stream_options`: its usage at the end, or with
/// `continuous_usage` the usage so far on every chunk (vLLM's
/// `continuous_usage_stats`), the prompt's from the first chunk on.
fn stream_options(continuous_usage: bool) -> Value {
    if continuous_usage {
        json!({"include_usage": true, "continuous_usage_stats": true})
    } else {
        json!({"include_usage": true})
    }
}

/// The Chat Completions request body, streamed (asking for usage) or not.
fn chat_body_with(
    req: &RunRequest,
    stream: bool,
    continuous_usage: bool,
) -> Result<Vec<u8>, ProviderCallError> {
    let messages = match req.api {
        RunApi::Chat => messages_json(&req.messages)?,
        // A plain completion is a chat with one user turn.
        RunApi::Generate | RunApi::Completion | RunApi::Embeddings => {
            let (system, prompt) = generate_prompt(&req.messages);
            let mut messages = Vec::new();
            if let Some(system) = system {
                messages.push(json!({"role": "system", "content": system}));
            }
            messages.push(json!({"role": "user", "content": prompt}));
            messages
        }
    };
    let mut body = Map::new();
    body.insert("model".into(), Value::String(req.model.clone()));
    body.insert("messages".into(), Value::Array(messages));
    body.insert("stream".into(), Value::Bool(stream));
    if stream {
        body.insert("stream_options".into(), stream_options(continuous_usage));
    }
    if req.continue_final && req.api == RunApi::Chat {
        // R-CONT-1: the final assistant message is a partial answer to
        // continue (vLLM's names; servers that prefill a final assistant
        // message, as llama.cpp's, continue it anyway).
        body.insert("continue_final_message".into(), Value::Bool(true));
        body.insert("add_generation_prompt".into(), Value::Bool(false));
    }
    // A plain completion (generate) offers no tools.
    if req.api == RunApi::Chat && !req.tools.is_empty() {
        let tools = req
            .tools
            .iter()
            .map(tool_json)
            .collect::<Result<Vec<_>, _>>()?;
        body.insert("tools".into(), Value::Array(tools));
    }
    params_json(&req.params, &mut body)?;
    serde_json::to_vec(&Value::Object(body))
        .map_err(|_| ProviderCallError::InvalidRequest("request is not serializable"))
}

/// `(system, prompt)` of a generate run: system turns joined, the rest joined.
pub(crate) fn generate_prompt(messages: &[ChatMessage]) -> (Option<String>, String) {
    let join = |system: bool| {
        messages
            .iter()
            .filter(|m| (m.role == Role::System) == system)
            .map(|m| m.content.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let system = join(true);
    ((!system.is_empty()).then_some(system), join(false))
}

/// A chat's messages in the OpenAI shape. A tool message takes text only
/// (the OpenAI API's rule): the images and documents of a run of tool
/// results go in one user message right after the run, each result's
/// attachments named by its call id when more than one result has some.
fn messages_json(messages: &[ChatMessage]) -> Result<Vec<Value>, ProviderCallError> {
    let mut out = Vec::with_capacity(messages.len());
    let mut i = 0;
    while i < messages.len() {
        if messages[i].role != Role::Tool {
            out.push(message_json(&messages[i])?);
            i += 1;
            continue;
        }
        let results = messages[i..]
            .iter()
            .take_while(|m| m.role == Role::Tool)
            .collect::<Vec<_>>();
        i += results.len();
        let with_attachments = results
            .iter()
            .filter(|m| !m.images.is_empty() || !m.documents.is_empty())
            .count();
        let mut parts = Vec::new();
        for m in results {
            out.push(message_json(&ChatMessage {
                images: Vec::new(),
                documents: Vec::new(),
                ..m.clone()
            })?);
            if m.images.is_empty() && m.documents.is_empty() {
                continue;
            }
            if with_attachments > 1 {
                let id = m.tool_call_id.as_deref().unwrap_or_default();
                parts.push(json!({"type": "text", "text": format!("tool_call_id: {id}")}));
            }
            attachment_parts(m, &mut parts)?;
        }
        if !parts.is_empty() {
            out.push(json!({"role": "user", "content": parts}));
        }
    }
    Ok(out)
}

/// A message's images as `image_url` parts and its PDFs as `file` parts
/// (the PDF's data as a `data:` URL; a document's context a text part
/// before it). A PDF by URL has no OpenAI form (the Edge does not choose
/// an OpenAI-compatible provider for it).
fn attachment_parts(m: &ChatMessage, parts: &mut Vec<Value>) -> Result<(), ProviderCallError> {
    for url in &m.images {
        parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
    }
    for (i, document) in m.documents.iter().enumerate() {
        let DocumentSource::PdfBase64(data) = &document.source else {
            return Err(ProviderCallError::InvalidRequest(
                "the OpenAI API takes a PDF's data, not its URL",
            ));
        };
        if let Some(context) = &document.context {
            parts.push(json!({"type": "text", "text": context}));
        }
        parts.push(json!({"type": "file", "file": {
            "filename": pdf_filename(document.title.as_deref(), i),
            "file_data": format!("data:{};base64,{data}", DocumentSource::PDF_MEDIA_TYPE),
        }}));
    }
    Ok(())
}

/// A PDF's file name: its title (with `.pdf`), else `document-N.pdf`.
fn pdf_filename(title: Option<&str>, index: usize) -> String {
    match title {
        Some(title) if title.to_ascii_lowercase().ends_with(".pdf") => title.to_owned(),
        Some(title) => format!("{title}.pdf"),
        None => format!("document-{}.pdf", index + 1),
    }
}

fn message_json(m: &ChatMessage) -> Result<Value, ProviderCallError> {
    let mut out = Map::new();
    out.insert("role".into(), Value::String(m.role.as_str().into()));
    if !m.images.is_empty() || !m.documents.is_empty() {
        let mut parts = Vec::with_capacity(m.images.len() + m.documents.len() + 1);
        if !m.content.is_empty() {
            parts.push(json!({"type": "text", "text": m.content}));
        }
        attachment_parts(m, &mut parts)?;
        out.insert("content".into(), Value::Array(parts));
    } else {
        // An assistant turn of tool calls alone has empty content: a string,
        // as every server takes it (llama-cpp-python's refuses `null`,
        // HTTP 500 "Input should be a valid string").
        out.insert("content".into(), Value::String(m.content.clone()));
    }
    if !m.tool_calls.is_empty() {
        let calls = m
            .tool_calls
            .iter()
            .map(|c| {
                json!({
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                })
            })
            .collect();
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = &m.tool_call_id {
        out.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    if let Some(name) = &m.name {
        out.insert("name".into(), Value::String(name.clone()));
    }
    Ok(Value::Object(out))
}

/// A function tool in the OpenAI shape (also Ollama's).
pub(crate) fn tool_json(t: &ToolDefinition) -> Result<Value, ProviderCallError> {
    let mut function = Map::new();
    function.insert("name".into(), Value::String(t.name.clone()));
    if let Some(d) = &t.description {
        function.insert("description".into(), Value::String(d.clone()));
    }
    if let Some(p) = &t.parameters_json {
        let parameters: Value = serde_json::from_str(p)
            .map_err(|_| ProviderCallError::InvalidRequest("tool parameters are not JSON"))?;
        function.insert("parameters".into(), parameters);
    }
    Ok(json!({"type": "function", "function": Value::Object(function)}))
}

/// The run's parameters into `body`; pass-through fields last, never
/// over a field the run set itself.
fn params_json(
    p: &GenerationParams,
    body: &mut Map<String, Value>,
) -> Result<(), ProviderCallError> {
    let mut put = |k: &str, v: Value| {
        body.insert(k.into(), v);
    };
    if let Some(v) = p.temperature {
        put("temperature", json!(v));
    }
    if let Some(v) = p.top_p {
        put("top_p", json!(v));
    }
    if let Some(v) = p.max_tokens {
        put("max_tokens", json!(v));
    }
    if !p.stop.is_empty() {
        put("stop", json!(p.stop));
    }
    if let Some(v) = p.seed {
        put("seed", json!(v));
    }
    if let Some(v) = p.presence_penalty {
        put("presence_penalty", json!(v));
    }
    if let Some(v) = p.frequency_penalty {
        put("frequency_penalty", json!(v));
    }
    if let Some(choice) = &p.tool_choice_json {
        // As the client sent it; a bare word (`auto`) is taken as a string.
        let v = serde_json::from_str(choice).unwrap_or_else(|_| Value::String(choice.clone()));
        put("tool_choice", v);
    }
    if let Some(format) = &p.response_format_json {
        let v: Value = serde_json::from_str(format)
            .map_err(|_| ProviderCallError::InvalidRequest("response_format is not JSON"))?;
        put("response_format", v);
    }
    if p.logprobs {
        put("logprobs", json!(true));
        if let Some(n) = p.top_logprobs {
            put("top_logprobs", json!(n));
        }
    }
    if let Some(effort) = &p.reasoning_effort {
        put("reasoning_effort", json!(effort));
    }
    if let Some(parallel) = p.parallel_tool_calls {
        put("parallel_tool_calls", json!(parallel));
    }
    merge_extra(p, body)
}

/// The pass-through fields into `body`, never over a field already set.
fn merge_extra(
    p: &GenerationParams,
    body: &mut Map<String, Value>,
) -> Result<(), ProviderCallError> {
    let Some(extra) = &p.extra_json else {
        return Ok(());
    };
    let Ok(Value::Object(extra)) = serde_json::from_str::<Value>(extra) else {
        return Err(ProviderCallError::InvalidRequest(
            "pass-through fields are not a JSON object",
        ));
    };
    for (key, value) in extra {
        body.entry(key).or_insert(value);
    }
    Ok(())
}

/// The OpenAI finish reason vocabulary.
pub(crate) fn finish_reason(s: &str) -> FinishReason {
    match s {
        "length" => FinishReason::Length,
        "tool_calls" | "function_call" => FinishReason::ToolCalls,
        "content_filter" => FinishReason::ContentFilter,
        _ => FinishReason::Stop,
    }
}

// One streamed chunk, read without a JSON tree: strings borrow from the
// event's bytes unless they hold escapes, and fields not named here are
// skipped unread.
#[derive(Deserialize)]
struct Chunk<'a> {
    // Some servers send `"choices": null` on usage-only chunks.
    #[serde(default, borrow)]
    choices: Option<Vec<Choice<'a>>>,
    #[serde(default)]
    usage: Option<UsageReport>,
    // llama.cpp's server reports its own token counts here.
    #[serde(default)]
    timings: Option<Timings>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default)]
    index: u32,
    // A streamed chat chunk has `delta`, a whole answer `message`.
    #[serde(default, borrow, alias = "message")]
    delta: Option<Delta<'a>>,
    // A text completion has `text`.
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
    // vLLM's: the stop string that ended the answer (a string), or a stop
    // token (a number); absent or null elsewhere.
    #[serde(default)]
    stop_reason: Option<Value>,
    #[serde(default)]
    logprobs: Option<ChoiceLogprobs>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow, alias = "reasoning")]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    tool_calls: Option<Vec<ToolCallChunk<'a>>>,
}

#[derive(Deserialize)]
struct ChoiceLogprobs {
    // Chat shape; a text completion's shape (`tokens`, `token_logprobs`)
    // has no `content` and is read as none.
    #[serde(default)]
    content: Option<Vec<LogprobEntry>>,
}

#[derive(Deserialize)]
struct LogprobEntry {
    token: String,
    logprob: f32,
    #[serde(default)]
    top_logprobs: Vec<TopEntry>,
}

#[derive(Deserialize)]
struct TopEntry {
    token: String,
    logprob: f32,
}

#[derive(Deserialize)]
struct Timings {
    #[serde(default)]
    prompt_n: Option<u64>,
    #[serde(default)]
    predicted_n: Option<u64>,
}

#[derive(Deserialize)]
struct ToolCallChunk<'a> {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default, borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    function: Option<FunctionChunk<'a>>,
}

#[derive(Deserialize)]
struct FunctionChunk<'a> {
    #[serde(default, borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
}

/// `[DONE]`, with any whitespace around it.
fn is_done_marker(data: &[u8]) -> bool {
    let data = data.trim_ascii();
    // Non-ASCII whitespace around it is rare enough to take the slow path.
    data == b"[DONE]"
        || (data.len() <= 32 && std::str::from_utf8(data).is_ok_and(|d| d.trim() == "[DONE]"))
}

/// What the chunks so far said about the end of the run.
#[derive(Debug, Default)]
struct ChunkState {
    finish: Option<FinishReason>,
    usage: Option<Usage>,
    saw_tool_call: bool,
    done: bool,
}

impl ChunkState {
    /// Decode one SSE `data` payload into non-terminal events, appended
    /// to `out`.
    fn on_data(
        &mut self,
        data: &[u8],
        out: &mut Vec<RunEventKind>,
    ) -> Result<(), ProviderCallError> {
        if is_done_marker(data) {
            self.done = true;
            return Ok(());
        }
        let chunk: Chunk<'_> =
            serde_json::from_slice(data).map_err(|_| ProviderCallError::Malformed)?;
        self.on_chunk(chunk, out, true)
    }

    /// Decode one whole (non-streamed) answer into non-terminal events.
    fn on_whole(
        &mut self,
        body: &[u8],
        out: &mut Vec<RunEventKind>,
    ) -> Result<(), ProviderCallError> {
        let chunk: Chunk<'_> =
            serde_json::from_slice(body).map_err(|_| ProviderCallError::Malformed)?;
        self.on_chunk(chunk, out, false)?;
        self.done = true;
        Ok(())
    }

    fn on_chunk(
        &mut self,
        chunk: Chunk<'_>,
        out: &mut Vec<RunEventKind>,
        streamed: bool,
    ) -> Result<(), ProviderCallError> {
        if chunk.error.is_some() {
            return Err(ProviderCallError::Reported);
        }
        let has_choices = chunk.choices.as_ref().is_some_and(|c| !c.is_empty());
        // n = 1: only the first choice is relayed.
        for choice in chunk.choices.into_iter().flatten().filter(|c| c.index == 0) {
            if let Some(delta) = choice.delta {
                if let Some(text) = delta.reasoning_content.filter(|t| !t.is_empty()) {
                    out.push(RunEventKind::ReasoningDelta(text.into_owned()));
                }
                if let Some(text) = delta.content.filter(|t| !t.is_empty()) {
                    out.push(RunEventKind::TextDelta(text.into_owned()));
                }
                for (pos, call) in delta.tool_calls.into_iter().flatten().enumerate() {
                    let (name, arguments) = match call.function {
                        Some(f) => (f.name, f.arguments.unwrap_or_default()),
                        None => (None, Cow::Borrowed("")),
                    };
                    if call.id.is_none() && name.is_none() && arguments.is_empty() {
                        continue;
                    }
                    self.saw_tool_call = true;
                    // A whole answer's calls have no index: their position is one.
                    let index = match (call.index, streamed) {
                        (Some(i), true) => i,
                        _ => pos as u32,
                    };
                    out.push(RunEventKind::ToolCallDelta(ToolCallDelta {
                        index,
                        id: call.id.map(Cow::into_owned),
                        name: name.map(Cow::into_owned),
                        arguments_delta: arguments.into_owned(),
                    }));
                }
            }
            if let Some(text) = choice.text.filter(|t| !t.is_empty()) {
                out.push(RunEventKind::TextDelta(text.into_owned()));
            }
            if let Some(entries) = choice.logprobs.and_then(|l| l.content)
                && !entries.is_empty()
            {
                out.push(RunEventKind::Logprobs(
                    entries
                        .into_iter()
                        .map(|e| TokenLogprob {
                            token: e.token,
                            logprob: e.logprob,
                            top: e
                                .top_logprobs
                                .into_iter()
                                .map(|t| (t.token, t.logprob))
                                .collect(),
                        })
                        .collect(),
                ));
            }
            if let Some(reason) = choice.finish_reason {
                self.finish = Some(match (finish_reason(&reason), &choice.stop_reason) {
                    // A stop string matched (vLLM says which).
                    (FinishReason::Stop, Some(Value::String(_))) => FinishReason::StopSequence,
                    (finish, _) => finish,
                });
            }
        }
        let usage = match (chunk.usage, chunk.timings) {
            (Some(u), _) => Some(u.openai_usage()),
            // No usage object: llama.cpp's own counts, when complete.
            (
                None,
                Some(Timings {
                    prompt_n: Some(p),
                    predicted_n: Some(c),
                }),
            ) => Some(Usage::tokens(p, c)),
            (None, _) => None,
        };
        if let Some(usage) = usage {
            // The first usage goes out at once (a server that reports it
            // on every chunk says the prompt's tokens before the answer);
            // after it, only a usage-only chunk's (the stream's totals):
            // the terminal carries the last one either way.
            if streamed && (self.usage.is_none() || !has_choices) {
                out.push(RunEventKind::Usage(usage));
            }
            self.usage = Some(usage);
        }
        Ok(())
    }

    fn completed(&self) -> RunEventKind {
        let fallback = if self.saw_tool_call {
            FinishReason::ToolCalls
        } else {
            FinishReason::Stop
        };
        RunEventKind::Completed {
            finish_reason: self.finish.unwrap_or(fallback),
            usage: self.usage,
        }
    }

    /// A clean end of body: complete if the run had finished, else truncated.
    fn terminal_at_eof(&self) -> RunEventKind {
        if self.done || self.finish.is_some() {
            self.completed()
        } else {
            RunEventKind::Failed(ProviderCallError::Truncated.failure())
        }
    }
}

#[cfg(test)]
mod tests {
    use iop_wire::ToolCall;

    use super::*;

    impl ChunkState {
        fn on(&mut self, data: &str) -> Result<Vec<RunEventKind>, ProviderCallError> {
            let mut out = Vec::new();
            self.on_data(data.as_bytes(), &mut out)?;
            Ok(out)
        }
    }

    #[test]
    fn chunks_decode_into_deltas_usage_and_finish() {
        let mut s = ChunkState::default();
        assert!(
            s.on(r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#)
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            s.on(r#"{"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}],"usage":null}"#)
                .unwrap(),
            vec![RunEventKind::TextDelta("hi".into())]
        );
        assert_eq!(
            s.on(r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","type":"function","function":{"name":"f","arguments":""}}]}}]}"#)
                .unwrap(),
            vec![RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: Some("c".into()),
                name: Some("f".into()),
                arguments_delta: String::new(),
            })]
        );
        s.on(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#)
            .unwrap();
        assert_eq!(
            s.on(r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#)
                .unwrap(),
            vec![RunEventKind::Usage(Usage::tokens(3, 2))]
        );
        s.on("[DONE]").unwrap();
        assert!(s.done);
        assert_eq!(
            s.completed(),
            RunEventKind::Completed {
                finish_reason: FinishReason::ToolCalls,
                usage: Some(Usage::tokens(3, 2)),
            }
        );
    }

    #[test]
    fn cached_prompt_tokens_are_carried_when_reported_and_never_invented() {
        let usage = |json: &str| {
            let mut s = ChunkState::default();
            s.on(&format!(r#"{{"choices":[],"usage":{json}}}"#))
                .unwrap();
            match s.completed() {
                RunEventKind::Completed { usage, .. } => usage,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(
            usage(
                r#"{"prompt_tokens":30,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":24,"audio_tokens":0}}"#
            ),
            Some(Usage {
                cache_read_tokens: Some(24),
                ..Usage::tokens(30, 2)
            })
        );
        assert_eq!(
            usage(
                r#"{"prompt_tokens":30,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0,"cache_write_tokens":30}}"#
            ),
            Some(Usage {
                cache_read_tokens: Some(0),
                cache_write_tokens: Some(30),
                ..Usage::tokens(30, 2)
            })
        );
        for silent in [
            r#"{"prompt_tokens":30,"completion_tokens":2}"#,
            r#"{"prompt_tokens":30,"completion_tokens":2,"prompt_tokens_details":null}"#,
            r#"{"prompt_tokens":30,"completion_tokens":2,"prompt_tokens_details":{"audio_tokens":0}}"#,
        ] {
            assert_eq!(usage(silent), Some(Usage::tokens(30, 2)), "{silent}");
        }
    }

    #[test]
    fn embeddings_are_read_pooled_or_mean_pooled_per_token() {
        let (vectors, usage) = parse_embeddings(
            br#"{"data":[{"index":0,"embedding":[1.0,2.0]},{"index":1,"embedding":[[1.0,0.0],[3.0,2.0]]}],"usage":{"prompt_tokens":4,"total_tokens":4}}"#,
        )
        .unwrap();
        assert_eq!(vectors[0].values, vec![1.0, 2.0]);
        assert_eq!(vectors[1].values, vec![2.0, 1.0]);
        assert_eq!(usage.unwrap().prompt_tokens, 4);
        assert!(parse_embeddings(br#"{"data":[{"embedding":[[1.0],[1.0,2.0]]}]}"#).is_none());
        assert!(
            parse_embeddings(br#"{"data":[{"embedding":[]}]}"#)
                .unwrap()
                .0[0]
                .values
                .is_empty()
        );
    }

    #[test]
    fn a_json_schema_format_takes_the_json_object_form_where_the_server_wants_it() {
        let format =
            r#"{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"object"}}}"#;
        let v: Value = serde_json::from_str(&json_object_schema(format)).unwrap();
        assert_eq!(
            v,
            json!({"type": "json_object", "schema": {"type": "object"}})
        );
        let plain = r#"{"type":"json_object"}"#;
        assert_eq!(json_object_schema(plain), plain);
    }

    #[test]
    fn the_request_carries_the_surface_and_pass_through_fields() {
        let mut req = crate::adapter::tests::run_request("m", RunApi::Chat, "hello");
        req.messages[0].images = vec!["data:image/png;base64,aGk=".into()];
        req.params.response_format_json = Some(r#"{"type":"json_object"}"#.into());
        req.params.logprobs = true;
        req.params.top_logprobs = Some(2);
        req.params.reasoning_effort = Some("low".into());
        req.params.extra_json = Some(r#"{"top_k":5,"temperature":9}"#.into());
        req.params.temperature = Some(0.5);
        let body: Value = serde_json::from_slice(&chat_body(&req).unwrap()).unwrap();
        assert_eq!(body["messages"][0]["content"][0]["text"], "hello");
        assert_eq!(
            body["messages"][0]["content"][1]["image_url"]["url"],
            "data:image/png;base64,aGk="
        );
        assert_eq!(body["response_format"]["type"], "json_object");
        assert_eq!(body["logprobs"], true);
        assert_eq!(body["top_logprobs"], 2);
        assert_eq!(body["reasoning_effort"], "low");
        assert_eq!(body["top_k"], 5);
        assert_eq!(
            body["temperature"],
            json!(0.5f32),
            "a pass-through field never overrides the run's own"
        );
    }

    #[test]
    fn a_stop_string_vllm_names_is_a_stop_sequence_finish() {
        let mut s = ChunkState::default();
        s.on(r#"{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop","stop_reason":"END"}]}"#)
            .unwrap();
        assert!(matches!(
            s.completed(),
            RunEventKind::Completed {
                finish_reason: FinishReason::StopSequence,
                ..
            }
        ));
        for other in [r#""stop_reason":128001"#, r#""stop_reason":null"#] {
            let mut s = ChunkState::default();
            s.on(&format!(
                r#"{{"choices":[{{"index":0,"delta":{{}},"finish_reason":"stop",{other}}}]}}"#
            ))
            .unwrap();
            assert!(
                matches!(
                    s.completed(),
                    RunEventKind::Completed {
                        finish_reason: FinishReason::Stop,
                        ..
                    }
                ),
                "{other}: a stop token or nothing is a plain stop"
            );
        }
    }

    #[test]
    fn usage_comes_from_llama_cpp_timings_when_no_usage_object_does() {
        let mut s = ChunkState::default();
        s.on(r#"{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop"}],"timings":{"prompt_n":32,"predicted_n":8}}"#)
            .unwrap();
        s.on("[DONE]").unwrap();
        assert_eq!(
            s.completed(),
            RunEventKind::Completed {
                finish_reason: FinishReason::Stop,
                usage: Some(Usage::tokens(32, 8)),
            }
        );
        let mut none = ChunkState::default();
        none.on(r#"{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop"}]}"#)
            .unwrap();
        assert_eq!(
            none.completed(),
            RunEventKind::Completed {
                finish_reason: FinishReason::Stop,
                usage: None
            },
            "no usage reported is none, never zeros"
        );
    }

    #[test]
    fn a_whole_answer_decodes_reasoning_text_tool_calls_logprobs_and_usage() {
        let mut s = ChunkState::default();
        let mut out = Vec::new();
        s.on_whole(
            br#"{"choices":[{"index":0,"message":{"role":"assistant","reasoning_content":"hm","content":"hi","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},"logprobs":{"content":[{"token":"hi","logprob":-0.1,"top_logprobs":[]}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#,
            &mut out,
        )
        .unwrap();
        assert_eq!(out[0], RunEventKind::ReasoningDelta("hm".into()));
        assert_eq!(out[1], RunEventKind::TextDelta("hi".into()));
        assert!(
            matches!(&out[2], RunEventKind::ToolCallDelta(d) if d.index == 0 && d.name.as_deref() == Some("f"))
        );
        assert!(matches!(&out[3], RunEventKind::Logprobs(l) if l[0].token == "hi"));
        assert_eq!(
            s.completed(),
            RunEventKind::Completed {
                finish_reason: FinishReason::ToolCalls,
                usage: Some(Usage::tokens(3, 2)),
            }
        );
    }

    #[test]
    fn unparseable_and_error_chunks_are_typed_failures() {
        let mut s = ChunkState::default();
        assert_eq!(s.on("{\"choices\":"), Err(ProviderCallError::Malformed));
        assert_eq!(
            s.on(r#"{"error":{"message":"secret payload"}}"#),
            Err(ProviderCallError::Reported)
        );
        assert_eq!(
            s.terminal_at_eof(),
            RunEventKind::Failed(ProviderCallError::Truncated.failure())
        );
    }

    #[test]
    fn the_request_embeds_tool_parameters_as_objects_and_asks_for_usage() {
        let req = crate::adapter::tests::run_request("m", RunApi::Chat, "hello");
        let mut req = req;
        req.tools.push(ToolDefinition {
            name: "f".into(),
            description: None,
            parameters_json: Some(r#"{"type":"object"}"#.into()),
            cache_control: None,
        });
        req.params.max_tokens = Some(7);
        req.params.tool_choice_json = Some("\"auto\"".into());
        let body: Value = serde_json::from_slice(&chat_body(&req).unwrap()).unwrap();
        assert_eq!(body["stream"], json!(true));
        assert_eq!(body["stream_options"]["include_usage"], json!(true));
        assert_eq!(
            body["tools"][0]["function"]["parameters"]["type"],
            json!("object")
        );
        assert_eq!(body["max_tokens"], json!(7));
        assert_eq!(body["tool_choice"], json!("auto"));
        assert_eq!(body["messages"][0]["content"], json!("hello"));

        req.tools[0].parameters_json = Some("{not json".into());
        assert!(matches!(
            chat_body(&req),
            Err(ProviderCallError::InvalidRequest(_))
        ));
    }

    #[test]
    fn an_assistant_turn_of_tool_calls_alone_has_empty_string_content() {
        let mut req = crate::adapter::tests::run_request("m", RunApi::Chat, "weather?");
        req.messages.push(ChatMessage {
            role: Role::Assistant,
            content: String::new(),
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
            }],
            tool_call_id: None,
            name: None,
            images: Vec::new(),
            cache_control: None,
            documents: Vec::new(),
        });
        let body: Value = serde_json::from_slice(&chat_body(&req).unwrap()).unwrap();
        let turn = &body["messages"][1];
        assert_eq!(turn["content"], json!(""));
        assert_eq!(turn["tool_calls"][0]["function"]["name"], "get_weather");
    }

    fn tool_result(
        id: &str,
        content: &str,
        images: &[&str],
        documents: Vec<iop_wire::Document>,
    ) -> ChatMessage {
        ChatMessage {
            role: Role::Tool,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: Some(id.into()),
            name: None,
            images: images.iter().map(|u| (*u).to_owned()).collect(),
            cache_control: None,
            documents,
        }
    }

    fn pdf(title: Option<&str>) -> iop_wire::Document {
        iop_wire::Document {
            source: DocumentSource::PdfBase64("JVBERi0=".into()),
            title: title.map(str::to_owned),
            context: None,
        }
    }

    #[test]
    fn a_tool_results_attachments_follow_the_tool_messages_in_one_user_message() {
        let mut req = crate::adapter::tests::run_request("m", RunApi::Chat, "look");
        let calls = ["call_1", "call_2", "call_3"].map(|id| ToolCall {
            id: id.into(),
            name: "shot".into(),
            arguments: "{}".into(),
        });
        req.messages.push(ChatMessage {
            tool_calls: calls.to_vec(),
            ..tool_result("", "", &[], Vec::new())
        });
        req.messages[1].role = Role::Assistant;
        req.messages[1].tool_call_id = None;
        req.messages.push(tool_result(
            "call_1",
            "a shot",
            &["https://example.com/s.png"],
            Vec::new(),
        ));
        req.messages
            .push(tool_result("call_2", "plain", &[], Vec::new()));
        req.messages
            .push(tool_result("call_3", "", &[], vec![pdf(Some("Manual"))]));
        req.messages.push(ChatMessage {
            documents: vec![pdf(None)],
            ..tool_result("", "and this", &[], Vec::new())
        });
        req.messages[5].role = Role::User;
        req.messages[5].tool_call_id = None;
        let body: Value = serde_json::from_slice(&chat_body(&req).unwrap()).unwrap();
        let messages = body["messages"].as_array().unwrap();
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        // The OpenAI API's order: every tool message right after the calls.
        assert_eq!(
            roles,
            ["user", "assistant", "tool", "tool", "tool", "user", "user"]
        );
        // Tool messages carry their text only.
        assert_eq!(messages[2]["content"], json!("a shot"));
        assert_eq!(messages[4]["content"], json!(""));
        assert_eq!(
            messages[5]["content"],
            json!([
                {"type": "text", "text": "tool_call_id: call_1"},
                {"type": "image_url", "image_url": {"url": "https://example.com/s.png"}},
                {"type": "text", "text": "tool_call_id: call_3"},
                {"type": "file", "file": {"filename": "Manual.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}}
            ])
        );
        assert_eq!(
            messages[6]["content"],
            json!([
                {"type": "text", "text": "and this"},
                {"type": "file", "file": {"filename": "document-1.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}}
            ])
        );
        // One result with attachments: no label.
        req.messages.truncate(3);
        let body: Value = serde_json::from_slice(&chat_body(&req).unwrap()).unwrap();
        assert_eq!(
            body["messages"][3]["content"],
            json!([{"type": "image_url", "image_url": {"url": "https://example.com/s.png"}}])
        );
        // A PDF by URL has no OpenAI form.
        req.messages[2].documents = vec![iop_wire::Document {
            source: DocumentSource::PdfUrl("https://example.com/a.pdf".into()),
            title: None,
            context: None,
        }];
        assert!(matches!(
            chat_body(&req),
            Err(ProviderCallError::InvalidRequest(_))
        ));
    }

    #[test]
    fn a_stream_with_usage_on_every_chunk_says_the_prompt_first_and_the_totals_last() {
        assert_eq!(
            stream_options(true),
            json!({"include_usage": true, "continuous_usage_stats": true})
        );
        let mut s = ChunkState::default();
        let usage = |c: u64| Usage::tokens(7, c);
        // vLLM's continuous usage: the first chunk (the role) has the prompt's.
        assert_eq!(
            s.on(r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"usage":{"prompt_tokens":7,"completion_tokens":0}}"#).unwrap(),
            vec![RunEventKind::Usage(usage(0))]
        );
        // Later chunks' running counts are not events of their own.
        assert_eq!(
            s.on(r#"{"choices":[{"index":0,"delta":{"content":"hi"}}],"usage":{"prompt_tokens":7,"completion_tokens":1}}"#).unwrap(),
            vec![RunEventKind::TextDelta("hi".into())]
        );
        assert!(
            s.on(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":7,"completion_tokens":1}}"#)
                .unwrap()
                .is_empty()
        );
        // The usage-only chunk: the stream's totals.
        assert_eq!(
            s.on(r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1}}"#)
                .unwrap(),
            vec![RunEventKind::Usage(usage(1))]
        );
        s.on("[DONE]").unwrap();
        assert_eq!(
            s.completed(),
            RunEventKind::Completed {
                finish_reason: FinishReason::Stop,
                usage: Some(usage(1)),
            }
        );
    }
}
