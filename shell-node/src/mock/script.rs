//! The script engine: one [`MockScript`] played as a timed sequence of
//! [`MockStep`]s. The HTTP server renders steps in each API's wire format;
//! the in-process adapter maps them to run events.

use std::time::Duration;

use futures::stream::BoxStream;
use iop_wire::{FinishReason, Usage};

use super::MockScript;

/// What one request asks of the script.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MockPrompt {
    /// Characters of the prompt (usage is `ceil(chars / 4)`).
    pub prompt_chars: usize,
    /// The request's output limit; below the script's tokens it truncates
    /// with finish reason `length`.
    pub max_tokens: Option<u32>,
    /// `Some(name)`: answer with one call of this tool instead of text.
    pub tool_name: Option<String>,
    /// Tokens of the answer the request already has (its final assistant
    /// message, R-CONT-1): the answer continues after them.
    pub continue_from: u32,
}

/// How many of the script's tokens a partial answer already holds: `tok0
/// tok1 ... tokK` (exactly the script's text) holds `K + 1`; anything else
/// holds none (the answer starts anew).
pub(crate) fn continued_tokens(partial: Option<&str>) -> u32 {
    let Some(text) = partial else {
        return 0;
    };
    let mut expected = String::new();
    let mut n = 0u32;
    while expected.len() < text.len() {
        expected.push_str(&token_text(n));
        n += 1;
    }
    if expected == text { n } else { 0 }
}

/// One step of a scripted answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MockStep {
    /// The next text token.
    Text(String),
    /// The tool call begins.
    ToolCallStart {
        /// Call id.
        id: String,
        /// Function name.
        name: String,
    },
    /// The next piece of the tool call's JSON arguments.
    ToolCallArgs(String),
    /// Emit one unparseable chunk here (the answer goes on after it).
    Malformed,
    /// Cut the connection here, without a terminal.
    AbruptClose,
    /// The answer ended.
    Finish {
        /// Why.
        finish_reason: FinishReason,
        /// Prompt and produced tokens.
        usage: Usage,
    },
}

/// The text of token `i`: `tok0`, then ` tok1`, ` tok2`, ...
pub fn token_text(i: u32) -> String {
    if i == 0 {
        "tok0".to_owned()
    } else {
        format!(" tok{i}")
    }
}

/// The id of the scripted tool call.
pub const MOCK_TOOL_CALL_ID: &str = "call_0";

const ARGS_OPEN: &str = "{\"text\":\"";
const ARGS_CLOSE: &str = "\"}";

/// Play `script` for `prompt`. Stalls await forever: only dropping the
/// stream ends them.
pub fn play(script: &MockScript, prompt: MockPrompt) -> BoxStream<'static, MockStep> {
    let script = script.clone();
    Box::pin(async_stream::stream! {
        if script.prefill_ms > 0 {
            tokio::time::sleep(Duration::from_millis(script.prefill_ms)).await;
        }
        let tool = prompt.tool_name;
        // A continued answer (R-CONT-1) picks up at its next token; the
        // request's limit counts what this call produces.
        let start = if tool.is_none() {
            prompt.continue_from.min(script.tokens)
        } else {
            0
        };
        let produced = script
            .tokens
            .min(start.saturating_add(prompt.max_tokens.unwrap_or(u32::MAX)));
        let truncated = produced < script.tokens;
        let interval = (script.tokens_per_second > 0.0)
            .then(|| Duration::from_secs_f64(1.0 / script.tokens_per_second));
        for i in start..=produced {
            if script.stall_after == Some(i) {
                match script.resume_after_ms {
                    Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                    None => futures::future::pending::<()>().await,
                }
            }
            if script.malformed_after == Some(i) {
                yield MockStep::Malformed;
            }
            if script.abrupt_close_after == Some(i) {
                yield MockStep::AbruptClose;
                return;
            }
            if i == produced {
                break;
            }
            if let (Some(interval), true) = (interval, i > start) {
                tokio::time::sleep(interval).await;
            }
            match &tool {
                None => yield MockStep::Text(token_text(i)),
                Some(name) => {
                    if i == 0 {
                        yield MockStep::ToolCallStart {
                            id: MOCK_TOOL_CALL_ID.to_owned(),
                            name: name.clone(),
                        };
                        yield MockStep::ToolCallArgs(format!("{ARGS_OPEN}{}", token_text(i)));
                    } else {
                        yield MockStep::ToolCallArgs(token_text(i));
                    }
                }
            }
        }
        if let Some(name) = &tool {
            if produced == 0 {
                yield MockStep::ToolCallStart {
                    id: MOCK_TOOL_CALL_ID.to_owned(),
                    name: name.clone(),
                };
                yield MockStep::ToolCallArgs(format!("{ARGS_OPEN}{ARGS_CLOSE}"));
            } else {
                yield MockStep::ToolCallArgs(ARGS_CLOSE.to_owned());
            }
        }
        let finish_reason = if tool.is_some() {
            FinishReason::ToolCalls
        } else if truncated {
            FinishReason::Length
        } else {
            FinishReason::Stop
        };
        yield MockStep::Finish {
            finish_reason,
            usage: script.usage(prompt.prompt_chars.div_ceil(4) as u64, u64::from(produced - start)),
        };
    })
}
