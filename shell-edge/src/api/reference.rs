//! The Value-tree stream encoders as they were before the typed ones
//! (kept only to prove the typed encoders write the same bytes).

#![allow(dead_code)]

use std::collections::BTreeMap;

use iop_wire::{FinishReason, RunApi, RunEventKind, ToolCallDelta, Usage};
use serde_json::{Map, Value, json};

use super::chat::{MAX_TOOL_CALLS_PER_RUN, error_payload, usage_json};
use super::error::ApiError;
use super::ids;
use super::ollama::rfc3339_utc;
use super::transcript::ToolCallAssembly;

/// Encodes run events as `chat.completion.chunk` payloads.
///
/// Sequence: one role chunk (`delta: {role:"assistant", content:""}`) before
/// the first content, tool call or finish; text and tool-call delta chunks;
/// one finish chunk carrying `finish_reason`; then, only with
/// [`ChatStream::with_usage_chunk`], a usage chunk with `choices: []`. A
/// failure yields one [`error_payload`] instead. After a terminal every
/// further event yields nothing. The handler appends `data: [DONE]` after a
/// successful finish.
#[derive(Debug, Clone)]
pub(crate) struct ValueChatStream {
    id: String,
    model: String,
    created_unix: u64,
    include_usage: bool,
    role_sent: bool,
    finished: bool,
    tool_call_indexes: BTreeMap<u32, ()>,
    usage: Option<Usage>,
}

impl ValueChatStream {
    /// A stream for completion `id` (see [`ids::chat_completion_id`]) of `model`.
    pub(crate) fn new(id: impl Into<String>, model: impl Into<String>, created_unix: u64) -> Self {
        Self {
            id: id.into(),
            model: model.into(),
            created_unix,
            include_usage: false,
            role_sent: false,
            finished: false,
            tool_call_indexes: BTreeMap::new(),
            usage: None,
        }
    }

    /// Whether to send the final usage chunk (`stream_options.include_usage`).
    #[must_use]
    pub(crate) fn with_usage_chunk(mut self, include_usage: bool) -> Self {
        self.include_usage = include_usage;
        self
    }

    /// The completion id.
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// True once a terminal event was encoded.
    pub(crate) fn is_finished(&self) -> bool {
        self.finished
    }

    /// The `data:` payloads for one run event, in order (possibly none).
    #[must_use]
    pub(crate) fn push(&mut self, event: &RunEventKind) -> Vec<Value> {
        if self.finished {
            return Vec::new();
        }
        let mut out = Vec::new();
        match event {
            RunEventKind::Started { .. } => {}
            RunEventKind::Usage(usage) => self.usage = Some(*usage),
            RunEventKind::TextDelta(text) => {
                self.ensure_role(&mut out);
                if !text.is_empty() {
                    out.push(self.chunk(json!({ "content": text }), None));
                }
            }
            RunEventKind::ToolCallDelta(delta) => {
                if let Some(call) = self.tool_call_delta_json(delta) {
                    self.ensure_role(&mut out);
                    out.push(self.chunk(json!({ "tool_calls": [call] }), None));
                }
            }
            RunEventKind::Completed {
                finish_reason,
                usage,
            } => {
                self.ensure_role(&mut out);
                out.push(self.chunk(json!({}), Some(*finish_reason)));
                if self.include_usage {
                    let usage = usage.or(self.usage).unwrap_or_default();
                    out.push(self.usage_chunk(usage));
                }
                self.finished = true;
            }
            RunEventKind::Failed(failure) => {
                out.push(error_payload(&ApiError::from_execution_failure(failure)));
                self.finished = true;
            }
        }
        out
    }

    /// Encode an error as the stream's terminal (e.g. budget expiry after commit).
    #[must_use]
    pub(crate) fn fail(&mut self, err: &ApiError) -> Vec<Value> {
        if self.finished {
            return Vec::new();
        }
        self.finished = true;
        vec![error_payload(err)]
    }

    fn ensure_role(&mut self, out: &mut Vec<Value>) {
        if !self.role_sent {
            self.role_sent = true;
            out.push(self.chunk(json!({ "role": "assistant", "content": "" }), None));
        }
    }

    fn tool_call_delta_json(&mut self, delta: &ToolCallDelta) -> Option<Value> {
        if self.tool_call_indexes.contains_key(&delta.index) {
            if delta.arguments_delta.is_empty() {
                return None;
            }
            return Some(json!({
                "index": delta.index,
                "function": { "arguments": delta.arguments_delta },
            }));
        }
        if self.tool_call_indexes.len() >= MAX_TOOL_CALLS_PER_RUN {
            return None;
        }
        self.tool_call_indexes.insert(delta.index, ());
        let id = delta
            .id
            .clone()
            .unwrap_or_else(|| ids::derived_id("call_", &self.id, delta.index));
        Some(json!({
            "index": delta.index,
            "id": id,
            "type": "function",
            "function": {
                "name": delta.name.clone().unwrap_or_default(),
                "arguments": delta.arguments_delta,
            },
        }))
    }

    fn base(&self) -> Map<String, Value> {
        let mut chunk = Map::new();
        chunk.insert("id".into(), json!(self.id));
        chunk.insert("object".into(), json!("chat.completion.chunk"));
        chunk.insert("created".into(), json!(self.created_unix));
        chunk.insert("model".into(), json!(self.model));
        chunk.insert("system_fingerprint".into(), Value::Null);
        chunk
    }

    fn chunk(&self, delta: Value, finish_reason: Option<FinishReason>) -> Value {
        let mut chunk = self.base();
        chunk.insert(
            "choices".into(),
            json!([{
                "index": 0,
                "delta": delta,
                "logprobs": null,
                "finish_reason": finish_reason.map(FinishReason::as_str),
            }]),
        );
        if self.include_usage {
            // With include_usage OpenAI sends `usage: null` on every other chunk.
            chunk.insert("usage".into(), Value::Null);
        }
        Value::Object(chunk)
    }

    fn usage_chunk(&self, usage: Usage) -> Value {
        let mut chunk = self.base();
        chunk.insert("choices".into(), json!([]));
        chunk.insert("usage".into(), usage_json(usage));
        Value::Object(chunk)
    }
}

fn done_reason(finish_reason: FinishReason) -> &'static str {
    match finish_reason {
        FinishReason::Length => "length",
        // Ollama reports tool calls and filtered output as a normal stop.
        FinishReason::Stop | FinishReason::ToolCalls | FinishReason::ContentFilter => "stop",
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
        RunApi::Generate => {
            object.insert("response".into(), json!(text));
        }
    }
}

/// The statistics fields of a final object.
fn insert_done(
    object: &mut Map<String, Value>,
    finish_reason: FinishReason,
    usage: Usage,
    total_duration_ns: u64,
) {
    object.insert("done".into(), json!(true));
    object.insert("done_reason".into(), json!(done_reason(finish_reason)));
    object.insert("total_duration".into(), json!(total_duration_ns));
    object.insert("load_duration".into(), json!(0));
    object.insert("prompt_eval_count".into(), json!(usage.prompt_tokens));
    object.insert("prompt_eval_duration".into(), json!(0));
    object.insert("eval_count".into(), json!(usage.completion_tokens));
    object.insert("eval_duration".into(), json!(0));
}

fn duration_ns(started_unix_ms: u64, now_unix_ms: u64) -> u64 {
    now_unix_ms
        .saturating_sub(started_unix_ms)
        .saturating_mul(1_000_000)
}

/// Encodes run events as Ollama NDJSON objects (one per line; the handler
/// writes each followed by `\n`).
#[derive(Debug, Clone)]
pub(crate) struct ValueOllamaStream {
    model: String,
    api: RunApi,
    started_unix_ms: u64,
    tool_calls: ToolCallAssembly,
    usage: Option<Usage>,
    finished: bool,
}

impl ValueOllamaStream {
    /// A stream for `model` and `api`, started at `started_unix_ms`.
    pub(crate) fn new(model: impl Into<String>, api: RunApi, started_unix_ms: u64) -> Self {
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
    pub(crate) fn is_finished(&self) -> bool {
        self.finished
    }

    /// The objects for one run event at `now_unix_ms`, in order (possibly none).
    #[must_use]
    pub(crate) fn push(&mut self, event: &RunEventKind, now_unix_ms: u64) -> Vec<Value> {
        if self.finished {
            return Vec::new();
        }
        let mut out = Vec::new();
        match event {
            RunEventKind::Started { .. } => {}
            RunEventKind::Usage(usage) => self.usage = Some(*usage),
            RunEventKind::TextDelta(text) => {
                if !text.is_empty() {
                    let mut object = object_head(&self.model, now_unix_ms);
                    insert_text(&mut object, self.api, text, None);
                    object.insert("done".into(), json!(false));
                    out.push(Value::Object(object));
                }
            }
            RunEventKind::ToolCallDelta(delta) => {
                // Ollama sends whole tool calls, so fragments are assembled first.
                self.tool_calls.push(delta, "");
            }
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
                    out.push(Value::Object(object));
                }
                let mut object = object_head(&self.model, now_unix_ms);
                insert_text(&mut object, self.api, "", None);
                insert_done(
                    &mut object,
                    *finish_reason,
                    usage.or(self.usage).unwrap_or_default(),
                    duration_ns(self.started_unix_ms, now_unix_ms),
                );
                out.push(Value::Object(object));
                self.finished = true;
            }
            RunEventKind::Failed(failure) => {
                return self.fail(&ApiError::from_execution_failure(failure));
            }
        }
        out
    }

    /// End the stream with one `{"error": "..."}` object (R-GATE-3).
    #[must_use]
    pub(crate) fn fail(&mut self, err: &ApiError) -> Vec<Value> {
        if self.finished {
            return Vec::new();
        }
        self.finished = true;
        vec![err.to_ollama_json()]
    }
}

#[cfg(test)]
mod tests {
    use iop_wire::{ExecutionFailure, FailureCode};
    use proptest::prelude::*;

    use super::*;
    use crate::api::chat::ChatStream;
    use crate::api::ollama::OllamaStream;

    fn event() -> impl Strategy<Value = RunEventKind> {
        let text = "[a-z\"\\\\\\x00-\\x1fé😀 <>/]{0,6}";
        prop_oneof![
            4 => text.prop_map(RunEventKind::TextDelta),
            3 => (0u32..3, proptest::option::of(text), proptest::option::of(text), text)
                .prop_map(|(index, id, name, arguments_delta)| {
                    RunEventKind::ToolCallDelta(ToolCallDelta { index, id, name, arguments_delta })
                }),
            1 => (any::<u32>(), any::<u32>()).prop_map(|(p, c)| RunEventKind::Usage(Usage {
                prompt_tokens: u64::from(p),
                completion_tokens: u64::from(c),
            })),
            1 => (0usize..4, proptest::option::of((any::<u64>(), any::<u64>()))).prop_map(|(r, u)| {
                RunEventKind::Completed {
                    finish_reason: FinishReason::ALL[r % FinishReason::ALL.len()],
                    usage: u.map(|(p, c)| Usage { prompt_tokens: p, completion_tokens: c }),
                }
            }),
            1 => Just(RunEventKind::Failed(ExecutionFailure::new(FailureCode::ProviderError))),
            1 => Just(RunEventKind::Started { session_id: "s".into() }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn typed_chat_chunks_are_the_value_tree_bytes(
            id in "[a-z0-9\"\\\\é-]{0,12}",
            model in "[a-z0-9:\"\\\\é/]{0,12}",
            created in any::<u64>(),
            include_usage in any::<bool>(),
            events in proptest::collection::vec(event(), 0..24),
            fail_at_end in any::<bool>(),
        ) {
            let mut typed = ChatStream::new(id.clone(), model.clone(), created).with_usage_chunk(include_usage);
            let mut old = ValueChatStream::new(id, model, created).with_usage_chunk(include_usage);
            let mut new_bytes = Vec::new();
            let mut old_bytes = String::new();
            for e in &events {
                typed.push(e, &mut new_bytes);
                for v in old.push(e) {
                    old_bytes.push_str(&format!("data: {v}\n\n"));
                }
            }
            if fail_at_end {
                typed.fail(&ApiError::budget_expired(), &mut new_bytes);
                for v in old.fail(&ApiError::budget_expired()) {
                    old_bytes.push_str(&format!("data: {v}\n\n"));
                }
            }
            prop_assert_eq!(String::from_utf8(new_bytes).unwrap(), old_bytes);
        }

        #[test]
        fn typed_ollama_lines_are_the_value_tree_bytes(
            model in "[a-z0-9:\"\\\\é/]{0,12}",
            generate in any::<bool>(),
            started in 0u64..4_000_000_000_000,
            events in proptest::collection::vec((event(), 0u64..100_000), 0..24),
        ) {
            let api = if generate { RunApi::Generate } else { RunApi::Chat };
            let mut typed = OllamaStream::new(model.clone(), api, started);
            let mut old = ValueOllamaStream::new(model, api, started);
            let mut new_bytes = Vec::new();
            let mut old_bytes = String::new();
            let mut now = started;
            for (e, step) in &events {
                now += step;
                typed.push(e, now, &mut new_bytes);
                for v in old.push(e, now) {
                    old_bytes.push_str(&format!("{v}\n"));
                }
            }
            prop_assert_eq!(String::from_utf8(new_bytes).unwrap(), old_bytes);
        }
    }
}
