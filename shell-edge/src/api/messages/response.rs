//! The whole answer ([`MessagesAccumulator`]) and what it shares with the
//! stream: the `stop_reason` of a run's end and the `usage` object.

use iop_wire::{FailureCode, FinishReason, RunEventKind, Usage};
use serde_json::{Map, Value, json};

use super::super::error::ApiError;
use super::super::transcript::Transcript;

/// Anthropic's `stop_reason` for a run that ended with `finish_reason`,
/// having called tools or not.
pub fn stop_reason(finish_reason: FinishReason, called_tools: bool) -> &'static str {
    match finish_reason {
        FinishReason::Length => "max_tokens",
        FinishReason::ContentFilter => "refusal",
        FinishReason::ToolCalls => "tool_use",
        FinishReason::Stop | FinishReason::StopSequence if called_tools => "tool_use",
        FinishReason::StopSequence => "stop_sequence",
        FinishReason::Stop => "end_turn",
    }
}

/// The `stop_sequence` of an answer that stopped for `reason`: the
/// request's stop sequence when it stopped at one and the request gave
/// exactly one (a provider names no sequence through the run), else
/// `null`.
pub(super) fn stop_sequence_json(reason: &str, stop_sequences: &[String]) -> Value {
    match (reason, stop_sequences) {
        ("stop_sequence", [only]) => json!(only),
        _ => Value::Null,
    }
}

/// The `usage` object: the provider's counts, or `null`s when it reported
/// none (never invented). `input_tokens` is the prompt's tokens neither
/// read from nor written to the prompt cache, as Anthropic counts them;
/// the cache counts are `null` when the provider reported none.
pub(super) fn usage_json(usage: Option<Usage>) -> Value {
    match usage {
        Some(u) => json!({
            "input_tokens": u.uncached_prompt_tokens(),
            "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": u.cache_write_tokens,
            "cache_read_input_tokens": u.cache_read_tokens,
        }),
        None => json!({
            "input_tokens": null,
            "output_tokens": null,
            "cache_creation_input_tokens": null,
            "cache_read_input_tokens": null,
        }),
    }
}

/// Folds run events into one Anthropic `message` object.
#[derive(Debug, Clone)]
pub struct MessagesAccumulator {
    id: String,
    model: String,
    transcript: Transcript,
    stop_sequences: Vec<String>,
}

impl MessagesAccumulator {
    /// An accumulator for message `id` of `model`.
    pub fn new(id: impl Into<String>, model: impl Into<String>) -> Self {
        let id = id.into();
        Self {
            transcript: Transcript::new(id.clone()),
            id,
            model: model.into(),
            stop_sequences: Vec::new(),
        }
    }

    /// The request's `stop_sequences`, for the answer's `stop_sequence`.
    pub fn with_stop_sequences(mut self, stop_sequences: Vec<String>) -> Self {
        self.stop_sequences = stop_sequences;
        self
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
        let reason = stop_reason(finish_reason, !tool_calls.is_empty());
        Ok(json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop_sequence_json(reason, &self.stop_sequences),
            "usage": usage_json(self.transcript.usage()),
        }))
    }
}
