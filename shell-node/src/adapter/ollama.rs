//! The `ollama` adapter: Ollama's native API. Runs use `/api/chat` or
//! `/api/generate`, streamed (NDJSON) or, where core says so
//! ([`AnswerCall::for_run`]: a client that takes the answer whole), one
//! non-streamed call; the probe is `GET /api/tags`.

use iop_wire::OLLAMA_OPTIONS;
use std::borrow::Cow;

use futures::StreamExt;
use futures::stream::BoxStream;
use iop_wire::{
    ChatMessage, Embedding, FinishReason, GenerationParams, RunApi, RunEventKind, RunRequest,
    ToolCallDelta, Usage,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use iop_core::node::provider::{AnswerCall, AnswerCallFacts};

use super::client::ProviderResponse;
use super::openai::{generate_prompt, tool_json};
use super::{
    HttpTarget, LineBuffer, ProbeVerdict, ProviderCallError, failed_run, http_run, probe_http,
    whole_answer_run,
};

/// An Ollama chat, generate or embed call as normalized run events.
pub(super) fn run(
    target: HttpTarget,
    req: RunRequest,
    auth: Option<String>,
) -> BoxStream<'static, RunEventKind> {
    let whole = AnswerCall::for_run(AnswerCallFacts {
        whole_answer: req.params.whole_answer,
        durable: req.park.is_some(),
        // Ollama's streams end with its token counts, as its whole answers do.
        stream_usage: true,
        whole_calls: target.whole_calls,
    }) == AnswerCall::Whole;
    let (path, body) = match request_body(&req, !whole) {
        Ok(x) => x,
        Err(e) => return failed_run(e),
    };
    let request = target.run_request(path, body);
    if req.api == RunApi::Embeddings {
        return http_run(target, request, auth, req.session_id, decode_embed);
    }
    if whole {
        return http_run(target, request, auth, req.session_id, decode_whole);
    }
    http_run(target, request, auth, req.session_id, decode)
}

/// The run events of one `/api/embed` answer: one `Embedding` per input,
/// then `Completed` with Ollama's `prompt_eval_count`.
fn decode_embed(response: ProviderResponse) -> BoxStream<'static, RunEventKind> {
    #[derive(Deserialize)]
    struct Answer {
        embeddings: Vec<Vec<f32>>,
        #[serde(default)]
        prompt_eval_count: Option<u64>,
    }
    whole_answer_run(response, |body| {
        let answer: Answer =
            serde_json::from_slice(body).map_err(|_| ProviderCallError::Malformed)?;
        let events = answer
            .embeddings
            .into_iter()
            .enumerate()
            .map(|(index, values)| {
                RunEventKind::Embedding(Embedding {
                    index: index as u32,
                    values,
                })
            })
            .collect();
        let usage = answer.prompt_eval_count.map(|p| Usage::tokens(p, 0));
        let terminal = RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage,
        };
        Ok((events, terminal))
    })
}

/// The run events of one non-streamed chat or generate answer: one JSON
/// object, the shape of a stream's lines with the whole message and
/// `done: true`.
fn decode_whole(response: ProviderResponse) -> BoxStream<'static, RunEventKind> {
    whole_answer_run(response, |body| {
        let body = std::str::from_utf8(body).map_err(|_| ProviderCallError::Malformed)?;
        let mut state = LineState::default();
        let mut events = Vec::new();
        state.on_line(body, &mut events)?;
        // An answer that does not say it is done did not finish.
        let terminal = state.terminal.take().ok_or(ProviderCallError::Truncated)?;
        Ok((events, terminal))
    })
}

/// The run events of a successful NDJSON answer.
fn decode(response: ProviderResponse) -> BoxStream<'static, RunEventKind> {
    Box::pin(async_stream::stream! {
        let mut bytes = response.bytes_stream();
        let mut lines = LineBuffer::default();
        let mut state = LineState::default();
        let mut events = Vec::new();
        let mut eof = false;
        loop {
            // Every line already received (at the end, the unterminated
            // last one), then the next bytes.
            loop {
                let line = if eof { lines.last_line() } else { lines.next_line() };
                let decoded = match line {
                    Ok(Some(line)) => state.on_line(line, &mut events),
                    Ok(None) => break,
                    Err(_) => Err(ProviderCallError::Malformed),
                };
                if let Err(e) = decoded {
                    yield RunEventKind::Failed(e.failure());
                    return;
                }
                for event in events.drain(..) {
                    yield event;
                }
                if let Some(terminal) = state.terminal.take() {
                    // After the `done` line only the body's framing is
                    // left; a failure closes the connection.
                    if !eof && !matches!(terminal, RunEventKind::Failed(_)) {
                        bytes.finish();
                    }
                    yield terminal;
                    return;
                }
            }
            if eof {
                yield RunEventKind::Failed(ProviderCallError::Truncated.failure());
                return;
            }
            match bytes.next().await {
                Some(Ok(chunk)) => lines.extend(&chunk),
                Some(Err(e)) => {
                    yield RunEventKind::Failed(super::error::from_http(e, true).failure());
                    return;
                }
                None => eof = true,
            }
        }
    })
}

/// `GET /api/tags` -> `{models: [{name}]}`.
pub(super) async fn probe(target: &HttpTarget) -> ProbeVerdict {
    probe_http(target, "/api/tags", parse_tags).await
}

fn parse_tags(body: &[u8]) -> Option<Vec<String>> {
    #[derive(Deserialize)]
    struct Tags {
        models: Vec<Tag>,
    }
    #[derive(Deserialize)]
    struct Tag {
        name: String,
    }
    let tags: Tags = serde_json::from_slice(body).ok()?;
    Some(tags.models.into_iter().map(|t| t.name).collect())
}

/// The path and body of the call, streamed or not.
fn request_body(
    req: &RunRequest,
    stream: bool,
) -> Result<(&'static str, Vec<u8>), ProviderCallError> {
    let mut body = Map::new();
    body.insert("model".into(), Value::String(req.model.clone()));
    body.insert("stream".into(), Value::Bool(stream));
    let path = match req.api {
        RunApi::Chat => {
            let messages = req
                .messages
                .iter()
                .map(message_json)
                .collect::<Result<Vec<_>, _>>()?;
            body.insert("messages".into(), Value::Array(messages));
            if !req.tools.is_empty() {
                let tools = req
                    .tools
                    .iter()
                    .map(tool_json)
                    .collect::<Result<Vec<_>, _>>()?;
                body.insert("tools".into(), Value::Array(tools));
            }
            "/api/chat"
        }
        RunApi::Generate | RunApi::Completion => {
            let (system, prompt) = generate_prompt(&req.messages);
            body.insert("prompt".into(), Value::String(prompt));
            if let Some(system) = system {
                body.insert("system".into(), Value::String(system));
            }
            if let Some(suffix) = &req.params.suffix {
                body.insert("suffix".into(), Value::String(suffix.clone()));
            }
            let images: Vec<Value> = req
                .messages
                .iter()
                .flat_map(|m| m.images.iter())
                .map(|url| base64_of(url).map(Value::String))
                .collect::<Result<_, _>>()?;
            if !images.is_empty() {
                body.insert("images".into(), Value::Array(images));
            }
            "/api/generate"
        }
        RunApi::Embeddings => {
            body.remove("stream");
            let inputs = req
                .messages
                .iter()
                .map(|m| Value::String(m.content.clone()))
                .collect();
            body.insert("input".into(), Value::Array(inputs));
            "/api/embed"
        }
    };
    if let Some(format) = &req.params.response_format_json {
        body.insert("format".into(), format_json(format)?);
    }
    if let Some(effort) = &req.params.reasoning_effort {
        // Ollama's `think`: off, or on (with a level for models that take one).
        let think = match effort.as_str() {
            "none" | "minimal" => json!(false),
            "low" | "medium" | "high" => json!(effort),
            _ => json!(true),
        };
        body.insert("think".into(), think);
    }
    let options = options_json(&req.params)?;
    if !options.is_empty() {
        body.insert("options".into(), Value::Object(options));
    }
    let body = serde_json::to_vec(&Value::Object(body))
        .map_err(|_| ProviderCallError::InvalidRequest("request is not serializable"))?;
    Ok((path, body))
}

/// A `response_format` (Chat shape) as Ollama's `format`: `"json"` or the
/// JSON Schema itself.
fn format_json(format: &str) -> Result<Value, ProviderCallError> {
    let format: Value = serde_json::from_str(format)
        .map_err(|_| ProviderCallError::InvalidRequest("response_format is not JSON"))?;
    match format["type"].as_str() {
        Some("json_schema") => match &format["json_schema"]["schema"] {
            schema @ Value::Object(_) => Ok(schema.clone()),
            _ => Ok(json!("json")),
        },
        _ => Ok(json!("json")),
    }
}

/// The base64 payload of a `data:` URL; Ollama takes nothing else.
fn base64_of(url: &str) -> Result<String, ProviderCallError> {
    url.split_once(";base64,")
        .filter(|(head, _)| head.starts_with("data:"))
        .map(|(_, data)| data.to_owned())
        .ok_or(ProviderCallError::InvalidRequest(
            "Ollama takes base64 data: images only",
        ))
}

fn message_json(m: &ChatMessage) -> Result<Value, ProviderCallError> {
    if !m.documents.is_empty() {
        // The Edge does not choose an Ollama provider for such a run.
        return Err(ProviderCallError::InvalidRequest(
            "Ollama takes no documents",
        ));
    }
    let mut out = Map::new();
    out.insert("role".into(), Value::String(m.role.as_str().into()));
    out.insert("content".into(), Value::String(m.content.clone()));
    if !m.images.is_empty() {
        let images = m
            .images
            .iter()
            .map(|url| base64_of(url).map(Value::String))
            .collect::<Result<Vec<_>, _>>()?;
        out.insert("images".into(), Value::Array(images));
    }
    if !m.tool_calls.is_empty() {
        // Ollama wants the arguments as an object, not a JSON string.
        let calls = m
            .tool_calls
            .iter()
            .map(|c| {
                let arguments: Value = serde_json::from_str(&c.arguments).map_err(|_| {
                    ProviderCallError::InvalidRequest("tool call arguments are not JSON")
                })?;
                Ok(json!({"function": {"name": c.name, "arguments": arguments}}))
            })
            .collect::<Result<Vec<_>, ProviderCallError>>()?;
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(name) = &m.name {
        out.insert("tool_name".into(), Value::String(name.clone()));
    }
    if let Some(id) = &m.tool_call_id {
        out.insert("tool_call_id".into(), Value::String(id.clone()));
    }
    Ok(Value::Object(out))
}

/// Ollama's generation options: the run's own fields, then pass-through
/// fields Ollama has as options (others were refused by the Edge; the
/// answer-neutral ones are left out here).
fn options_json(p: &GenerationParams) -> Result<Map<String, Value>, ProviderCallError> {
    let mut o = Map::new();
    if let Some(extra) = &p.extra_json {
        let Ok(Value::Object(extra)) = serde_json::from_str::<Value>(extra) else {
            return Err(ProviderCallError::InvalidRequest(
                "pass-through fields are not a JSON object",
            ));
        };
        for (key, value) in extra {
            if OLLAMA_OPTIONS.contains(&key.as_str()) {
                o.insert(key, value);
            }
        }
    }
    if let Some(v) = p.temperature {
        o.insert("temperature".into(), json!(v));
    }
    if let Some(v) = p.top_p {
        o.insert("top_p".into(), json!(v));
    }
    if let Some(v) = p.max_tokens {
        o.insert("num_predict".into(), json!(v));
    }
    if !p.stop.is_empty() {
        o.insert("stop".into(), json!(p.stop));
    }
    if let Some(v) = p.seed {
        o.insert("seed".into(), json!(v));
    }
    if let Some(v) = p.presence_penalty {
        o.insert("presence_penalty".into(), json!(v));
    }
    if let Some(v) = p.frequency_penalty {
        o.insert("frequency_penalty".into(), json!(v));
    }
    Ok(o)
}

// One NDJSON line, read without a JSON tree (except tool-call arguments,
// which are passed on re-serialized): strings borrow from the line unless
// they hold escapes, and fields not named here are skipped unread.
#[derive(Deserialize)]
struct Line<'a> {
    #[serde(default, borrow)]
    message: Option<Message<'a>>,
    #[serde(default, borrow)]
    response: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    thinking: Option<Cow<'a, str>>,
    #[serde(default)]
    done: bool,
    #[serde(default, borrow)]
    done_reason: Option<Cow<'a, str>>,
    #[serde(default)]
    prompt_eval_count: Option<u64>,
    #[serde(default)]
    eval_count: Option<u64>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    thinking: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    tool_calls: Option<Vec<ToolCall<'a>>>,
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(default, borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    function: Function<'a>,
}

#[derive(Deserialize)]
struct Function<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(default)]
    arguments: Option<Value>,
}

/// Decoding state of one NDJSON answer.
#[derive(Debug, Default)]
struct LineState {
    tool_calls: u32,
    terminal: Option<RunEventKind>,
}

impl LineState {
    /// Decode one line into non-terminal events, appended to `out`; a
    /// `done` line sets `terminal`.
    fn on_line(
        &mut self,
        line: &str,
        out: &mut Vec<RunEventKind>,
    ) -> Result<(), ProviderCallError> {
        if line.trim().is_empty() {
            return Ok(());
        }
        let line: Line<'_> =
            serde_json::from_str(line).map_err(|_| ProviderCallError::Malformed)?;
        if line.error.is_some() {
            return Err(ProviderCallError::Reported);
        }
        let (text, calls) = match line.message {
            Some(m) => {
                if let Some(thinking) = m.thinking.filter(|t| !t.is_empty()) {
                    out.push(RunEventKind::ReasoningDelta(thinking.into_owned()));
                }
                (m.content, m.tool_calls.unwrap_or_default())
            }
            None => {
                if let Some(thinking) = line.thinking.filter(|t| !t.is_empty()) {
                    out.push(RunEventKind::ReasoningDelta(thinking.into_owned()));
                }
                (line.response, Vec::new())
            }
        };
        if let Some(text) = text.filter(|t| !t.is_empty()) {
            out.push(RunEventKind::TextDelta(text.into_owned()));
        }
        // Ollama sends whole calls: one delta per call.
        for call in calls {
            let index = self.tool_calls;
            self.tool_calls += 1;
            let arguments_delta = match call.function.arguments {
                None => "{}".to_owned(),
                Some(Value::String(s)) => s,
                Some(v) => v.to_string(),
            };
            out.push(RunEventKind::ToolCallDelta(ToolCallDelta {
                index,
                id: Some(match call.id {
                    Some(id) => id.into_owned(),
                    None => format!("call_{index}"),
                }),
                name: Some(call.function.name.into_owned()),
                arguments_delta,
            }));
        }
        if line.done {
            let finish_reason = if self.tool_calls > 0 {
                FinishReason::ToolCalls
            } else if line.done_reason.as_deref() == Some("length") {
                FinishReason::Length
            } else {
                FinishReason::Stop
            };
            let usage =
                (line.prompt_eval_count.is_some() || line.eval_count.is_some()).then(|| {
                    Usage::tokens(
                        line.prompt_eval_count.unwrap_or(0),
                        line.eval_count.unwrap_or(0),
                    )
                });
            self.terminal = Some(RunEventKind::Completed {
                finish_reason,
                usage,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl LineState {
        fn on(&mut self, line: &str) -> Result<Vec<RunEventKind>, ProviderCallError> {
            let mut out = Vec::new();
            self.on_line(line, &mut out)?;
            Ok(out)
        }
    }

    #[test]
    fn the_request_maps_format_images_reasoning_and_options() {
        let mut req = crate::adapter::tests::run_request("m", RunApi::Chat, "what is this?");
        req.messages[0].images = vec!["data:image/png;base64,aGk=".into()];
        req.params.response_format_json = Some(
            r#"{"type":"json_schema","json_schema":{"name":"a","schema":{"type":"object"}}}"#
                .into(),
        );
        req.params.reasoning_effort = Some("none".into());
        req.params.extra_json = Some(r#"{"top_k":7,"num_ctx":4096,"user":"u"}"#.into());
        let (path, body) = request_body(&req, true).unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(path, "/api/chat");
        assert_eq!(body["messages"][0]["images"], json!(["aGk="]));
        assert_eq!(body["format"], json!({"type": "object"}));
        assert_eq!(body["think"], json!(false));
        assert_eq!(body["options"]["top_k"], 7);
        assert_eq!(body["options"]["num_ctx"], 4096);
        assert!(
            body["options"].get("user").is_none(),
            "answer-neutral metadata stays out"
        );

        req.params.response_format_json = Some(r#"{"type":"json_object"}"#.into());
        let (_, body) = request_body(&req, true).unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["format"], "json");

        req.messages[0].images = vec!["https://example.com/a.png".into()];
        assert!(matches!(
            request_body(&req, true),
            Err(ProviderCallError::InvalidRequest(_))
        ));
    }

    #[test]
    fn embeddings_and_suffixed_completions_take_their_own_paths() {
        let mut req = crate::adapter::tests::run_request("m", RunApi::Embeddings, "a");
        let (path, body) = request_body(&req, true).unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(path, "/api/embed");
        assert_eq!(body["input"], json!(["a"]));
        assert!(body.get("stream").is_none());

        req.api = RunApi::Completion;
        req.params.suffix = Some("end".into());
        let (path, body) = request_body(&req, true).unwrap();
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(path, "/api/generate");
        assert_eq!(body["prompt"], "a");
        assert_eq!(body["suffix"], "end");
    }

    #[test]
    fn thinking_is_relayed_as_reasoning() {
        let mut state = LineState::default();
        let mut out = Vec::new();
        state
            .on_line(
                r#"{"message":{"role":"assistant","content":"","thinking":"hm"},"done":false}"#,
                &mut out,
            )
            .unwrap();
        assert_eq!(out, vec![RunEventKind::ReasoningDelta("hm".into())]);
    }

    #[test]
    fn lines_decode_into_text_whole_tool_calls_and_a_final_usage() {
        let mut s = LineState::default();
        assert_eq!(
            s.on(r#"{"message":{"role":"assistant","content":"hi"},"done":false}"#)
                .unwrap(),
            vec![RunEventKind::TextDelta("hi".into())]
        );
        assert_eq!(
            s.on(r#"{"message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":{"a":1}}}]},"done":false}"#)
                .unwrap(),
            vec![RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: Some("call_0".into()),
                name: Some("f".into()),
                arguments_delta: r#"{"a":1}"#.into(),
            })]
        );
        assert!(s.terminal.is_none());
        s.on(r#"{"message":{"content":""},"done":true,"done_reason":"stop","prompt_eval_count":4,"eval_count":2}"#)
            .unwrap();
        assert_eq!(
            s.terminal,
            Some(RunEventKind::Completed {
                finish_reason: FinishReason::ToolCalls,
                usage: Some(Usage::tokens(4, 2)),
            })
        );
    }

    #[test]
    fn generate_lines_and_length_finish() {
        let mut s = LineState::default();
        assert_eq!(
            s.on(r#"{"response":"a","done":false}"#).unwrap(),
            vec![RunEventKind::TextDelta("a".into())]
        );
        s.on(r#"{"response":"","done":true,"done_reason":"length"}"#)
            .unwrap();
        assert_eq!(
            s.terminal,
            Some(RunEventKind::Completed {
                finish_reason: FinishReason::Length,
                usage: None
            })
        );
    }

    #[test]
    fn error_and_garbage_lines_fail_typed() {
        let mut s = LineState::default();
        assert_eq!(
            s.on(r#"{"error":"model exploded: secret"}"#),
            Err(ProviderCallError::Reported)
        );
        assert_eq!(s.on("{\"message\":"), Err(ProviderCallError::Malformed));
    }

    #[test]
    fn options_carry_num_predict_and_sampling() {
        let mut req = crate::adapter::tests::run_request("m", RunApi::Generate, "p");
        req.params.max_tokens = Some(5);
        req.params.temperature = Some(0.5);
        req.params.seed = Some(7);
        let (path, body) = request_body(&req, true).unwrap();
        assert_eq!(path, "/api/generate");
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["prompt"], json!("p"));
        assert_eq!(body["options"]["num_predict"], json!(5));
        assert_eq!(body["options"]["seed"], json!(7));
        assert_eq!(body["options"]["temperature"], json!(0.5));
    }
}
