//! Journal entries of earlier formats, read when a record written by an
//! earlier build is replayed or adopted. Frozen: never changed, only read.
//!
//! Postcard names nothing: a layout is its fields' order and its enums'
//! variant order, so each mirror below keeps the order of the type it
//! stands for in the build that wrote it.

use iop_wire::{
    Embedding, ExecutionFailure, FinishReason, Header, RunEventKind, TokenLogprob, ToolCallDelta,
    Usage,
};
use serde::Deserialize;

use super::{FrameSource, JournalEntry};
use crate::edge::delivery::{Delivery, ProviderSaid};
use crate::edge::gate::GateFailure;

/// Format 1's usage: before it carried the prompt cache's counts.
#[derive(Deserialize)]
struct UsageV1 {
    prompt_tokens: u64,
    completion_tokens: u64,
}

impl UsageV1 {
    /// No cache count: format 1 had none (never invented).
    fn upgrade(self) -> Usage {
        Usage::tokens(self.prompt_tokens, self.completion_tokens)
    }
}

/// Format 1's [`RunEventKind`].
#[derive(Deserialize)]
enum RunEventKindV1 {
    Started {
        session_id: String,
    },
    TextDelta(String),
    ToolCallDelta(ToolCallDelta),
    Usage(UsageV1),
    Completed {
        finish_reason: FinishReason,
        usage: Option<UsageV1>,
    },
    Failed(ExecutionFailure),
    Embedding(Embedding),
    ReasoningDelta(String),
    Logprobs(Vec<TokenLogprob>),
}

impl RunEventKindV1 {
    fn upgrade(self) -> RunEventKind {
        match self {
            Self::Started { session_id } => RunEventKind::Started { session_id },
            Self::TextDelta(text) => RunEventKind::TextDelta(text),
            Self::ToolCallDelta(delta) => RunEventKind::ToolCallDelta(delta),
            Self::Usage(usage) => RunEventKind::Usage(usage.upgrade()),
            Self::Completed {
                finish_reason,
                usage,
            } => RunEventKind::Completed {
                finish_reason,
                usage: usage.map(UsageV1::upgrade),
            },
            Self::Failed(failure) => RunEventKind::Failed(failure),
            Self::Embedding(embedding) => RunEventKind::Embedding(embedding),
            Self::ReasoningDelta(text) => RunEventKind::ReasoningDelta(text),
            Self::Logprobs(logprobs) => RunEventKind::Logprobs(logprobs),
        }
    }
}

/// Format 1's [`Delivery`].
#[derive(Deserialize)]
enum DeliveryV1 {
    Commit {
        tunnel_head: Option<(u16, Vec<Header>)>,
    },
    Event(RunEventKindV1),
    Body(Vec<u8>),
    Finish,
    Fail {
        kind: GateFailure,
        in_stream: bool,
        provider: Option<ProviderSaid>,
    },
}

impl DeliveryV1 {
    fn upgrade(self) -> Delivery {
        match self {
            Self::Commit { tunnel_head } => Delivery::Commit { tunnel_head },
            Self::Event(event) => Delivery::Event(event.upgrade()),
            Self::Body(bytes) => Delivery::Body(bytes),
            Self::Finish => Delivery::Finish,
            Self::Fail {
                kind,
                in_stream,
                provider,
            } => Delivery::Fail {
                kind,
                in_stream,
                provider,
            },
        }
    }
}

/// A journal entry of format 1.
#[derive(Deserialize)]
pub(super) struct JournalEntryV1 {
    delivery: DeliveryV1,
    source: Option<FrameSource>,
}

impl JournalEntryV1 {
    /// The entry in the current format.
    pub(super) fn upgrade(self) -> JournalEntry {
        JournalEntry {
            delivery: self.delivery.upgrade(),
            source: self.source,
        }
    }
}
