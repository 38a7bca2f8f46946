//! The streamed answer: Anthropic's event sequence ([`MessagesStream`]).

use std::collections::BTreeMap;

use iop_wire::{RunEventKind, ToolCallDelta, Usage};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::super::error::ApiError;
use super::super::framing;
use super::super::ids;
use super::super::transcript::MAX_TOOL_CALLS_PER_RUN;
use super::error::error_json;
use super::response::{stop_reason, stop_sequence_json, usage_json};

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
    /// `message_start` was written.
    started: bool,
    finished: bool,
    stop_sequences: Vec<String>,
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
            started: false,
            finished: false,
            stop_sequences: Vec::new(),
        }
    }

    /// The request's `stop_sequences`, for the answer's `stop_sequence`.
    pub fn with_stop_sequences(mut self, stop_sequences: Vec<String>) -> Self {
        self.stop_sequences = stop_sequences;
        self
    }

    /// True once a terminal was encoded.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// `message_start` (with an empty message) and a `ping`, once: with
    /// the first run event, so a provider's usage that comes before the
    /// answer (a Messages provider's prompt and cache counts, an
    /// OpenAI-compatible server's usage on its first chunk when asked for
    /// it on every chunk) is in it, as Anthropic sends it. Before any
    /// provider count it says zero tokens (the SDKs' types need numbers)
    /// and `null` cache counts; `message_delta` has the totals, prompt
    /// included, which the SDKs keep.
    fn start(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        let usage = match self.usage {
            Some(usage) => usage_json(Some(usage)),
            None => json!({
                "input_tokens": 0,
                "output_tokens": 0,
                "cache_creation_input_tokens": null,
                "cache_read_input_tokens": null,
            }),
        };
        let message = json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            "usage": usage,
        });
        StreamEvent::MessageStart { message }.write(out);
        StreamEvent::Ping.write(out);
    }

    /// Append the events for one run event.
    pub fn push(&mut self, event: &RunEventKind, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        if let RunEventKind::Usage(usage) = event {
            self.usage = Some(*usage);
        }
        self.start(out);
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
                    delta: json!({
                        "stop_reason": reason,
                        "stop_sequence": stop_sequence_json(reason, &self.stop_sequences),
                    }),
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
            | RunEventKind::Usage(_)
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
        self.start(out);
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
