//! The operations the embedded store's one writer runs, what the journal's
//! rules answer each, and what watchers learn once a batch is durable:
//! shared by the writer thread ([`super::writer`]) and the tables it runs
//! them on ([`super::tables`]).

use iop_core::journal::{
    CreateOutcome, JournalError, JournalEvent, NewRecord, RecordMeta, Terminal,
};

use super::tenant::{TenantOp, TenantReply};
use crate::{Holding, Progress};

/// One write operation, as the writer thread runs it.
#[derive(Debug)]
pub(super) enum Request {
    Create(NewRecord),
    Append {
        id: String,
        epoch: u64,
        events: Vec<JournalEvent>,
    },
    Finish {
        id: String,
        epoch: u64,
        terminal: Terminal,
    },
    RaiseEpoch {
        id: String,
        expected: u64,
        owner: String,
    },
    Delete {
        id: String,
    },
    /// Remove at most `max_records` expired records.
    Sweep {
        now_unix_ms: u64,
        max_records: usize,
    },
    /// A write of tenants' state ([`super::tenant`]).
    Tenant(TenantOp),
}

impl Request {
    /// The record the operation writes, if one.
    pub(super) fn record_id(&self) -> Option<&str> {
        match self {
            Request::Append { id, .. }
            | Request::Finish { id, .. }
            | Request::RaiseEpoch { id, .. }
            | Request::Delete { id } => Some(id),
            Request::Create(record) => Some(&record.id),
            Request::Sweep { .. } | Request::Tenant(_) => None,
        }
    }

    /// Bytes the operation carries, for the batch's byte bound.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Request::Create(record) => record.request.len(),
            Request::Append { events, .. } => events.iter().map(|e| e.payload.len()).sum(),
            Request::Tenant(op) => op.bytes(),
            _ => 0,
        }
    }
}

/// What the rules answered one operation (inside a transaction that may
/// still fail to commit).
#[derive(Debug)]
pub(super) enum Reply {
    Create(Result<CreateOutcome, JournalError>),
    Meta(Result<RecordMeta, JournalError>),
    Deleted(Result<(), JournalError>),
    /// How many records were removed, and whether the scan stopped at its
    /// bound (more may be expired).
    Swept {
        removed: usize,
        more: bool,
    },
    Tenant(TenantReply),
}

impl Reply {
    /// Did the operation change the store?
    pub(super) fn accepted(&self) -> bool {
        match self {
            Reply::Create(r) => matches!(r, Ok(CreateOutcome::Create(_))),
            Reply::Meta(r) => r.is_ok(),
            Reply::Deleted(r) => r.is_ok(),
            Reply::Swept { removed, .. } => *removed > 0,
            Reply::Tenant(reply) => reply.accepted(),
        }
    }
}

/// The answer a caller receives: the rules' reply once the batch is
/// durable, or the store's failure for the whole batch.
pub(super) type Answer = Result<Reply, JournalError>;

/// What watchers learn once a batch is durable.
#[derive(Debug)]
pub(super) enum Notice {
    /// The record now stands here.
    Progress(String, Progress),
    /// The record is gone: its watchers' senders are dropped.
    Gone(String),
    /// The record runs, its writes counted against this share of the
    /// writer's queue (`Some`), or has its terminal (`None`).
    Share(String, Option<u64>),
    /// A record that held `old` against its key and principal now holds
    /// `new` (R-TEN-1's gauges).
    Held {
        old: Option<Holding>,
        new: Option<Holding>,
    },
}
