//! The mock's Anthropic Messages API: `POST /v1/messages`, streamed
//! (Anthropic's event sequence) and whole, with the key in `x-api-key`.
//!
//! The script's steps become content blocks: its text one `text` block,
//! its tool call one `tool_use` block, a reasoning request (`thinking`
//! enabled) a `thinking` block first. `stop_sequences` are honoured: the
//! text stops before the first one that appears, with `stop_reason`
//! `stop_sequence` and the sequence in `stop_sequence`. Usage is the
//! script's, `input_tokens` in `message_start` and both counts in the
//! final `message_delta`; a request with `cache_control` breakpoints (and
//! a script without cache counts) has the prompt's tokens up to its last
//! breakpoint reported as `cache_creation_input_tokens`. The call's `anthropic-version` and
//! `anthropic-beta` come back as `x-mock-anthropic-version` and
//! `x-mock-anthropic-beta`, so a test sees what reached the provider.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use futures::stream::BoxStream;
use iop_wire::{FinishReason, Usage};
use serde_json::{Value, json};

use super::script::{MockPrompt, MockStep, play};
use super::server::{
    Dialect, MockState, abrupt, begin, content_chars, max_tokens, sse_event, streaming, tool_name,
};

const MESSAGE_ID: &str = "msg_mock";

/// The Messages `stop_reason` of a finish reason.
fn stop_reason(finish: FinishReason) -> &'static str {
    match finish {
        FinishReason::Length => "max_tokens",
        FinishReason::ToolCalls => "tool_use",
        FinishReason::ContentFilter => "refusal",
        FinishReason::StopSequence => "stop_sequence",
        FinishReason::Stop => "end_turn",
    }
}

/// The prompt's characters: `system` (a string or text blocks) and every
/// message's text blocks.
fn prompt_chars(request: &Value) -> usize {
    let messages = request["messages"].as_array().map_or(0, |ms| {
        ms.iter().map(|m| content_chars(&m["content"])).sum()
    });
    messages + content_chars(&request["system"])
}

/// `content`'s text pieces in order: each one's characters, and whether it
/// is marked as a prompt-cache breakpoint (`cache_control`).
fn cache_segments(content: &Value, out: &mut Vec<(usize, bool)>) {
    match content {
        Value::String(s) => out.push((s.chars().count(), false)),
        Value::Array(blocks) => out.extend(blocks.iter().map(|b| {
            let chars = b["text"].as_str().map_or(0, |t| t.chars().count());
            (chars, b.get("cache_control").is_some_and(|c| !c.is_null()))
        })),
        _ => {}
    }
}

/// The prompt's characters up to and including its last block marked with
/// `cache_control` (the system prompt's, then the messages'); 0 when none
/// is. The mock reports their tokens as written to its cache, as a
/// provider does on the first call with a breakpoint.
fn cached_prefix_chars(request: &Value) -> usize {
    let mut segments = Vec::new();
    cache_segments(&request["system"], &mut segments);
    for m in request["messages"].as_array().into_iter().flatten() {
        cache_segments(&m["content"], &mut segments);
    }
    let mut chars = 0;
    let mut marked = 0;
    for (n, is_marked) in segments {
        chars += n;
        if is_marked {
            marked = chars;
        }
    }
    marked
}

/// Where `text` first contains one of `stops`: the byte offset and the
/// sequence.
fn first_stop<'a>(text: &str, stops: &'a [String]) -> Option<(usize, &'a str)> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()).map(|at| (at, s.as_str())))
        .min_by_key(|(at, _)| *at)
}

/// What the script produced, cut at a stop sequence.
enum Played {
    Text(String),
    ToolStart {
        id: String,
        name: String,
    },
    ToolArgs(String),
    Malformed,
    AbruptClose,
    Finish {
        reason: &'static str,
        stop: Option<String>,
        usage: Usage,
    },
}

/// The script's steps with `stops` applied: text stops before the first
/// stop sequence in the answer so far, and the answer finishes there.
fn apply_stops(
    steps: BoxStream<'static, MockStep>,
    stops: Vec<String>,
) -> BoxStream<'static, Played> {
    Box::pin(async_stream::stream! {
        let mut steps = steps;
        let mut text = String::new();
        let mut tokens = 0u64;
        while let Some(step) = steps.next().await {
            match step {
                MockStep::Text(t) => {
                    let sent = text.len();
                    text.push_str(&t);
                    tokens += 1;
                    if let Some((at, stop)) = first_stop(&text, &stops) {
                        if at > sent {
                            yield Played::Text(text[sent..at].to_owned());
                        }
                        yield Played::Finish {
                            reason: "stop_sequence",
                            stop: Some(stop.to_owned()),
                            usage: Usage::tokens(0, tokens),
                        };
                        return;
                    }
                    yield Played::Text(t);
                }
                MockStep::ToolCallStart { id, name } => yield Played::ToolStart { id, name },
                MockStep::ToolCallArgs(a) => yield Played::ToolArgs(a),
                MockStep::Malformed => yield Played::Malformed,
                MockStep::AbruptClose => {
                    yield Played::AbruptClose;
                    return;
                }
                MockStep::Finish { finish_reason, usage } => {
                    yield Played::Finish { reason: stop_reason(finish_reason), stop: None, usage };
                }
            }
        }
    })
}

/// Anthropic's `usage`: `input_tokens` the prompt's uncached tokens, both
/// cache counts always (zero when the script has none).
fn usage_json(usage: &Usage) -> Value {
    json!({
        "input_tokens": usage.uncached_prompt_tokens(),
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": usage.cache_write_tokens.unwrap_or(0),
        "cache_read_input_tokens": usage.cache_read_tokens.unwrap_or(0),
    })
}

fn event(name: &str, mut v: Value) -> Bytes {
    v["type"] = json!(name);
    sse_event(name, &v)
}

/// `POST /v1/messages`.
pub(super) async fn messages(
    State(state): State<MockState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (guard, request, script) = match begin(&state, &headers, &body, Dialect::Anthropic).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let model = request["model"]
        .as_str()
        .unwrap_or(super::DEFAULT_MODEL)
        .to_owned();
    // The prompt's usage (with the script's cache counts), whatever stops
    // the answer.
    let mut prompt_usage = script.usage(prompt_chars(&request).div_ceil(4) as u64, 0);
    if script.cache_write_tokens.is_none() {
        let cached = cached_prefix_chars(&request).div_ceil(4) as u64;
        let uncached = prompt_usage.uncached_prompt_tokens();
        prompt_usage.cache_write_tokens = Some(cached.min(uncached));
    }
    let prompt = MockPrompt {
        prompt_chars: prompt_chars(&request),
        max_tokens: max_tokens(&request["max_tokens"]),
        tool_name: tool_name(&script, &request["tools"]),
        continue_from: 0,
    };
    let stops: Vec<String> = request["stop_sequences"]
        .as_array()
        .map(|s| {
            s.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let thinks = request["thinking"]["type"] == "enabled";
    let played = apply_stops(play(&script, prompt), stops);
    // What the call asked of the API, echoed for tests to see what reached
    // the provider.
    let echo: Vec<(HeaderName, HeaderValue)> = ["anthropic-version", "anthropic-beta"]
        .into_iter()
        .filter_map(|name| {
            let value = headers.get(name)?.clone();
            let echoed = HeaderName::try_from(format!("x-mock-{name}")).ok()?;
            Some((echoed, value))
        })
        .collect();
    let mut response = answer(request, model, prompt_usage, thinks, played, guard).await;
    response.headers_mut().extend(echo);
    response
}

/// The answer, whole or streamed.
async fn answer(
    request: Value,
    model: String,
    prompt_usage: Usage,
    thinks: bool,
    played: BoxStream<'static, Played>,
    mut guard: super::server::InFlight,
) -> Response {
    if request["stream"].as_bool() != Some(true) {
        let mut played = played;
        let mut content = Vec::new();
        if thinks {
            content.push(
                json!({"type": "thinking", "thinking": super::MOCK_REASONING, "signature": ""}),
            );
        }
        let mut text = String::new();
        let mut tool: Option<(String, String, String)> = None;
        let mut end = None;
        while let Some(p) = played.next().await {
            match p {
                Played::Text(t) => text.push_str(&t),
                Played::ToolStart { id, name } => tool = Some((id, name, String::new())),
                Played::ToolArgs(a) => {
                    if let Some(tool) = &mut tool {
                        tool.2.push_str(&a);
                    }
                }
                Played::Malformed => {
                    guard.finish();
                    return (
                        axum::http::StatusCode::OK,
                        [(axum::http::header::CONTENT_TYPE, "application/json")],
                        "{\"type\":\"message\",\"content\":[",
                    )
                        .into_response();
                }
                Played::AbruptClose => {
                    guard.finish();
                    return abrupt();
                }
                Played::Finish {
                    reason,
                    stop,
                    usage,
                } => end = Some((reason, stop, usage)),
            }
        }
        guard.finish();
        if !text.is_empty() || tool.is_none() {
            content.push(json!({"type": "text", "text": text}));
        }
        if let Some((id, name, args)) = tool {
            let input: Value = serde_json::from_str(&args).unwrap_or_else(|_| json!({}));
            content.push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
        }
        let (reason, stop, usage) = end.unwrap_or(("end_turn", None, Usage::default()));
        let usage = Usage {
            completion_tokens: usage.completion_tokens,
            ..prompt_usage
        };
        return axum::Json(json!({
            "id": MESSAGE_ID,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": stop,
            "usage": usage_json(&usage),
        }))
        .into_response();
    }
    guard.track_text();
    let body = async_stream::stream! {
        let mut played = played;
        let start_usage = Usage {
            completion_tokens: 1,
            ..prompt_usage
        };
        yield Ok(event("message_start", json!({"message": {
            "id": MESSAGE_ID, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": usage_json(&start_usage),
        }})));
        yield Ok(event("ping", json!({})));
        // The open block: its index, and whether it is the text block.
        let mut index = 0u32;
        let mut open: Option<bool> = None;
        if thinks {
            yield Ok(event("content_block_start", json!({"index": index, "content_block": {"type": "thinking", "thinking": "", "signature": ""}})));
            yield Ok(event("content_block_delta", json!({"index": index, "delta": {"type": "thinking_delta", "thinking": super::MOCK_REASONING}})));
            yield Ok(event("content_block_stop", json!({"index": index})));
            index += 1;
        }
        while let Some(p) = played.next().await {
            match p {
                Played::Text(t) => {
                    if open.is_none() {
                        yield Ok(event("content_block_start", json!({"index": index, "content_block": {"type": "text", "text": ""}})));
                        open = Some(true);
                    }
                    yield Ok(event("content_block_delta", json!({"index": index, "delta": {"type": "text_delta", "text": t}})));
                    guard.text_sent();
                }
                Played::ToolStart { id, name } => {
                    if open.take().is_some() {
                        yield Ok(event("content_block_stop", json!({"index": index})));
                        index += 1;
                    }
                    yield Ok(event("content_block_start", json!({"index": index, "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}})));
                    open = Some(false);
                }
                Played::ToolArgs(a) => {
                    yield Ok(event("content_block_delta", json!({"index": index, "delta": {"type": "input_json_delta", "partial_json": a}})));
                }
                Played::Malformed => yield Ok(Bytes::from_static(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":\n\n")),
                Played::AbruptClose => {
                    guard.finish();
                    // Pending once so hyper flushes what was yielded before
                    // the cut (it drops buffered bytes on a body error).
                    tokio::task::yield_now().await;
                    yield Err(std::io::Error::other("scripted abrupt close"));
                    return;
                }
                Played::Finish { reason, stop, usage } => {
                    if open.take().is_some() {
                        yield Ok(event("content_block_stop", json!({"index": index})));
                    }
                    let usage = Usage { completion_tokens: usage.completion_tokens, ..prompt_usage };
                    yield Ok(event("message_delta", json!({
                        "delta": {"stop_reason": reason, "stop_sequence": stop},
                        "usage": usage_json(&usage),
                    })));
                    yield Ok(event("message_stop", json!({})));
                }
            }
        }
        guard.finish();
    };
    streaming("text/event-stream", body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cached_prefix_ends_at_the_last_breakpoint() {
        let cached = json!({"type": "ephemeral"});
        let request = json!({
            "system": [{"type": "text", "text": "0123", "cache_control": cached}],
            "messages": [
                {"role": "user", "content": "abcdefgh"},
                {"role": "assistant", "content": [{"type": "text", "text": "xy", "cache_control": cached}]},
                {"role": "user", "content": "not cached"}
            ]
        });
        assert_eq!(cached_prefix_chars(&request), 4 + 8 + 2);
        assert_eq!(
            cached_prefix_chars(
                &json!({"system": "0123", "messages": [{"role": "user", "content": "a"}]})
            ),
            0
        );
    }

    #[test]
    fn the_first_stop_sequence_in_the_text_wins() {
        let stops = vec!["tok3".to_owned(), "1 t".to_owned()];
        assert_eq!(first_stop("tok0 tok1 tok2 tok3", &stops), Some((8, "1 t")));
        assert_eq!(first_stop("tok0", &stops), None);
        assert_eq!(first_stop("tok0", &[String::new()]), None);
    }
}
