//! What a run said, folded from its events: the text, the tool calls
//! assembled from their fragments, the usage and how the run ended.
//!
//! The non-streaming Chat Completions and Ollama answers are both a
//! [`Transcript`] rendered in their own shape; the Ollama stream assembles
//! its whole tool calls with the same [`ToolCallAssembly`].

use std::collections::BTreeMap;

use iop_wire::{
    Embedding, ExecutionFailure, FailureCode, FinishReason, RunEventKind, TokenLogprob, ToolCall,
    ToolCallDelta, Usage,
};

use super::error::ApiError;
use super::ids;

/// Most distinct tool calls one run may stream; fragments of further calls
/// are dropped, so a misbehaving Node cannot grow our state without bound.
pub const MAX_TOOL_CALLS_PER_RUN: usize = 128;

/// Tool calls assembled from streamed fragments, by call index.
#[derive(Debug, Clone, Default)]
pub(crate) struct ToolCallAssembly {
    calls: BTreeMap<u32, ToolCall>,
}

impl ToolCallAssembly {
    /// Fold one fragment in; returns false if it was dropped at the bound.
    pub(crate) fn push(&mut self, delta: &ToolCallDelta, id_parent: &str) -> bool {
        if !self.calls.contains_key(&delta.index) && self.calls.len() >= MAX_TOOL_CALLS_PER_RUN {
            return false;
        }
        let call = self.calls.entry(delta.index).or_insert_with(|| ToolCall {
            id: String::new(),
            name: String::new(),
            arguments: String::new(),
        });
        if call.id.is_empty() {
            call.id = delta
                .id
                .clone()
                .unwrap_or_else(|| ids::derived_id("call_", id_parent, delta.index));
        }
        if call.name.is_empty()
            && let Some(name) = &delta.name
        {
            call.name.clone_from(name);
        }
        call.arguments.push_str(&delta.arguments_delta);
        true
    }

    /// The calls in index order.
    pub(crate) fn calls(&self) -> impl Iterator<Item = &ToolCall> {
        self.calls.values()
    }

    /// True when no call was seen.
    pub(crate) fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }
}

/// How a run ended, as seen by an accumulator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RunOutcome {
    /// No terminal yet.
    Running,
    /// `Completed`.
    Completed(FinishReason),
    /// `Failed`.
    Failed(ExecutionFailure),
}

impl RunOutcome {
    /// The finish reason of a completed run, or the client error of one
    /// that did not complete.
    pub(crate) fn finish_reason(&self) -> Result<FinishReason, ApiError> {
        match self {
            RunOutcome::Completed(finish_reason) => Ok(*finish_reason),
            RunOutcome::Failed(failure) => Err(ApiError::from_execution_failure(failure)),
            // The event stream ended without a terminal: the transport went away.
            RunOutcome::Running => Err(ApiError::from_failure(FailureCode::TransportClosed)),
        }
    }
}

/// A run's events folded into one answer: all text, the assembled tool
/// calls, the last usage and the outcome. Events after the terminal are
/// ignored.
#[derive(Debug, Clone)]
pub(crate) struct Transcript {
    call_id_parent: String,
    text: String,
    reasoning: String,
    logprobs: Vec<TokenLogprob>,
    embeddings: Vec<Embedding>,
    tool_calls: ToolCallAssembly,
    usage: Option<Usage>,
    outcome: RunOutcome,
}

impl Transcript {
    /// An empty transcript; a tool call the provider gave no id gets one
    /// derived from `call_id_parent` (see [`ids::derived_id`]).
    pub(crate) fn new(call_id_parent: impl Into<String>) -> Self {
        Self {
            call_id_parent: call_id_parent.into(),
            text: String::new(),
            reasoning: String::new(),
            logprobs: Vec::new(),
            embeddings: Vec::new(),
            tool_calls: ToolCallAssembly::default(),
            usage: None,
            outcome: RunOutcome::Running,
        }
    }

    /// Fold one event in; events after the terminal are ignored.
    pub(crate) fn push(&mut self, event: &RunEventKind) {
        if self.is_finished() {
            return;
        }
        match event {
            RunEventKind::Started { .. } => {}
            RunEventKind::TextDelta(text) => self.text.push_str(text),
            RunEventKind::ToolCallDelta(delta) => {
                self.tool_calls.push(delta, &self.call_id_parent);
            }
            RunEventKind::Usage(usage) => self.usage = Some(*usage),
            RunEventKind::Completed {
                finish_reason,
                usage,
            } => {
                if usage.is_some() {
                    self.usage = *usage;
                }
                self.outcome = RunOutcome::Completed(*finish_reason);
            }
            RunEventKind::Failed(failure) => self.outcome = RunOutcome::Failed(failure.clone()),
            RunEventKind::ReasoningDelta(text) => self.reasoning.push_str(text),
            RunEventKind::Logprobs(entries) => self.logprobs.extend_from_slice(entries),
            RunEventKind::Embedding(embedding) => self.embeddings.push(embedding.clone()),
        }
    }

    /// All reasoning deltas, concatenated.
    pub(crate) fn reasoning(&self) -> &str {
        &self.reasoning
    }

    /// Every token's log probability, in order.
    pub(crate) fn logprobs(&self) -> &[TokenLogprob] {
        &self.logprobs
    }

    /// The embedding vectors, by input index.
    pub(crate) fn embeddings(&self) -> Vec<&Embedding> {
        let mut sorted: Vec<&Embedding> = self.embeddings.iter().collect();
        sorted.sort_by_key(|e| e.index);
        sorted
    }

    /// True once a terminal event was folded in.
    pub(crate) fn is_finished(&self) -> bool {
        self.outcome != RunOutcome::Running
    }

    /// The finish reason, or the error the run ended with.
    pub(crate) fn finish_reason(&self) -> Result<FinishReason, ApiError> {
        self.outcome.finish_reason()
    }

    /// All text deltas, concatenated.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// The tool calls, assembled.
    pub(crate) fn tool_calls(&self) -> &ToolCallAssembly {
        &self.tool_calls
    }

    /// The last usage the provider reported; `None` when it reported none
    /// (never invented).
    pub(crate) fn usage(&self) -> Option<Usage> {
        self.usage
    }
}
