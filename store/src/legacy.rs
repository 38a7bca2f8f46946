//! Record layouts of earlier store formats, read when a store written by
//! an earlier build is opened (the embedded file's formats 1 and 2, the
//! NATS bucket's record formats 1 and 2). Frozen: never changed, only read.

use iop_core::journal::{Fingerprint, JournalApi, NO_KEY_ID, NO_OWNER, RecordMeta, Terminal};
use serde::{Deserialize, Serialize};

/// A record of format 1: [`RecordMeta`] before records named their owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordMetaV1 {
    /// See [`RecordMeta::id`].
    pub id: String,
    /// See [`RecordMeta::principal`].
    pub principal: String,
    /// See [`RecordMeta::api`].
    pub api: JournalApi,
    /// See [`RecordMeta::model`].
    pub model: String,
    /// See [`RecordMeta::fingerprint`].
    pub fingerprint: Fingerprint,
    /// See [`RecordMeta::idempotency_key`].
    pub idempotency_key: Option<[u8; 32]>,
    /// See [`RecordMeta::background`].
    pub background: bool,
    /// See [`RecordMeta::created_unix_ms`].
    pub created_unix_ms: u64,
    /// See [`RecordMeta::epoch`].
    pub epoch: u64,
    /// See [`RecordMeta::last_seq`].
    pub last_seq: u64,
    /// See [`RecordMeta::terminal`].
    pub terminal: Option<Terminal>,
    /// See [`RecordMeta::expires_unix_ms`].
    pub expires_unix_ms: u64,
    /// See [`RecordMeta::stored_bytes`].
    pub stored_bytes: u64,
}

impl RecordMetaV1 {
    /// The record in the current format: owned by [`NO_OWNER`] (the one
    /// Edge that wrote the store then), of no key ([`NO_KEY_ID`]).
    pub fn upgrade(self) -> RecordMeta {
        RecordMetaV2 {
            id: self.id,
            principal: self.principal,
            api: self.api,
            model: self.model,
            fingerprint: self.fingerprint,
            idempotency_key: self.idempotency_key,
            background: self.background,
            created_unix_ms: self.created_unix_ms,
            epoch: self.epoch,
            last_seq: self.last_seq,
            terminal: self.terminal,
            expires_unix_ms: self.expires_unix_ms,
            stored_bytes: self.stored_bytes,
            owner: NO_OWNER.to_owned(),
        }
        .upgrade()
    }
}

/// A record of format 2: [`RecordMeta`] before records named their API
/// key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordMetaV2 {
    /// See [`RecordMeta::id`].
    pub id: String,
    /// See [`RecordMeta::principal`].
    pub principal: String,
    /// See [`RecordMeta::api`].
    pub api: JournalApi,
    /// See [`RecordMeta::model`].
    pub model: String,
    /// See [`RecordMeta::fingerprint`].
    pub fingerprint: Fingerprint,
    /// See [`RecordMeta::idempotency_key`].
    pub idempotency_key: Option<[u8; 32]>,
    /// See [`RecordMeta::background`].
    pub background: bool,
    /// See [`RecordMeta::created_unix_ms`].
    pub created_unix_ms: u64,
    /// See [`RecordMeta::epoch`].
    pub epoch: u64,
    /// See [`RecordMeta::last_seq`].
    pub last_seq: u64,
    /// See [`RecordMeta::terminal`].
    pub terminal: Option<Terminal>,
    /// See [`RecordMeta::expires_unix_ms`].
    pub expires_unix_ms: u64,
    /// See [`RecordMeta::stored_bytes`].
    pub stored_bytes: u64,
    /// See [`RecordMeta::owner`].
    pub owner: String,
}

impl RecordMetaV2 {
    /// The record in the current format: of no key ([`NO_KEY_ID`]); it
    /// counts against its principal's quotas only.
    pub fn upgrade(self) -> RecordMeta {
        RecordMeta {
            id: self.id,
            principal: self.principal,
            api: self.api,
            model: self.model,
            fingerprint: self.fingerprint,
            idempotency_key: self.idempotency_key,
            background: self.background,
            created_unix_ms: self.created_unix_ms,
            epoch: self.epoch,
            last_seq: self.last_seq,
            terminal: self.terminal,
            expires_unix_ms: self.expires_unix_ms,
            stored_bytes: self.stored_bytes,
            owner: self.owner,
            key_id: NO_KEY_ID.to_owned(),
        }
    }

    /// This record as format 2 wrote it (for tests of the upgrade).
    pub fn from_current(meta: &RecordMeta) -> Self {
        RecordMetaV2 {
            id: meta.id.clone(),
            principal: meta.principal.clone(),
            api: meta.api,
            model: meta.model.clone(),
            fingerprint: meta.fingerprint,
            idempotency_key: meta.idempotency_key,
            background: meta.background,
            created_unix_ms: meta.created_unix_ms,
            epoch: meta.epoch,
            last_seq: meta.last_seq,
            terminal: meta.terminal.clone(),
            expires_unix_ms: meta.expires_unix_ms,
            stored_bytes: meta.stored_bytes,
            owner: meta.owner.clone(),
        }
    }
}
