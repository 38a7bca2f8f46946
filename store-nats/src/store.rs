//! The operations: each reads the record, decides with the journal's
//! `check_*`, writes, and commits with a compare-and-set on the record's
//! revision (see the crate docs for why that is safe).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_nats::HeaderMap;
use async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE;
use async_nats::jetstream::{self, ErrorCode, stream::DirectGetErrorKind, stream::Stream};
use bytes::Bytes;
use futures::StreamExt;
use iop_core::journal::{
    CreateOutcome, EdgeLease, JournalError, JournalEvent, JournalLimits, NewRecord, RecordMeta,
    StoredLease, Terminal, check_append, check_create, check_finish, check_put_lease,
    check_raise_epoch, expired,
};
use iop_store::{Progress, StoreStats, StoredRecord};
use tokio::sync::watch;

use crate::directory::Directory;
use crate::error::{Failure, publish_failure, store_error};
use crate::follow::{is_marker, lock};
use crate::layout::{
    AppendHead, Names, RecordValue, decode_lease, encode_lease, frame_append, frame_request, token,
    unframe_append, unframe_request_part,
};
use crate::options::NatsOptions;

/// Read-decide-commit rounds before an operation gives up under
/// contention (each lost round means another write committed).
const MAX_ATTEMPTS: usize = 64;
/// Orphaned append messages one append clears at most before it gives up.
const MAX_ORPHANS: usize = 1024;
/// Records removed, or read, at once by a sweep or the restart scan.
const SCAN_CONCURRENCY: usize = 16;
/// Delete markers purged by one sweep at most.
const MAX_MARKER_PURGES: usize = 10_000;
/// Quarantined records one sweep removes at most (R-JRN-6).
const MAX_QUARANTINED_SWEPT: usize = 256;
/// Records whose read positions are remembered.
const MAX_ANCHORED_RECORDS: usize = 4096;
/// Read positions remembered per record.
const ANCHORS_PER_RECORD: usize = 4;

/// A record key's last entry.
enum Slot {
    Absent,
    Deleted(u64),
    /// A value that does not decode (R-JRN-6): quarantined, treated as
    /// absent by every operation.
    Damaged(u64),
    Present(u64, Box<RecordValue>),
}

impl Slot {
    /// The revision a compare-and-set on this key expects.
    fn revision(&self) -> u64 {
        match self {
            Slot::Absent => 0,
            Slot::Deleted(r) | Slot::Damaged(r) | Slot::Present(r, _) => *r,
        }
    }

    fn meta(&self) -> Option<&RecordMeta> {
        match self {
            Slot::Present(_, v) => Some(&v.meta),
            _ => None,
        }
    }
}

/// An idempotency key entry: free (never written, or deleted at that
/// revision) or naming a response id.
enum KeySlot {
    Free(u64),
    Held(u64, String),
}

/// Where a reader may start: the first append message holding an event
/// `>= next_seq` of incarnation `incarnation` is at or after `from_msg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Anchor {
    incarnation: u64,
    next_seq: u64,
    from_msg: u64,
}

#[derive(Debug, Default)]
struct Anchors {
    by_record: HashMap<String, Vec<Anchor>>,
}

impl Anchors {
    fn best(&self, tok: &str, incarnation: u64, after: u64) -> Option<u64> {
        self.by_record
            .get(tok)?
            .iter()
            .filter(|a| a.incarnation == incarnation && a.next_seq <= after.saturating_add(1))
            .max_by_key(|a| a.next_seq)
            .map(|a| a.from_msg)
    }

    fn note(&mut self, tok: &str, anchor: Anchor) {
        if self.by_record.len() >= MAX_ANCHORED_RECORDS && !self.by_record.contains_key(tok) {
            self.by_record.clear();
        }
        let list = self.by_record.entry(tok.to_owned()).or_default();
        list.retain(|a| a.incarnation == anchor.incarnation && a.next_seq != anchor.next_seq);
        list.push(anchor);
        if list.len() > ANCHORS_PER_RECORD {
            list.remove(0);
        }
    }
}

/// The sizes of the stream and the bucket, as last asked.
#[derive(Debug, Default)]
struct Usage {
    at: Option<Instant>,
    stream_bytes: u64,
    bucket_bytes: u64,
}

pub(crate) struct Inner {
    /// The connection, asked for its state before every operation: during
    /// an outage an operation fails at once instead of waiting for its
    /// answer's timeout.
    pub(crate) client: async_nats::Client,
    pub(crate) js: jetstream::Context,
    pub(crate) events: Stream,
    pub(crate) kv: Stream,
    pub(crate) names: Names,
    pub(crate) opts: NatsOptions,
    pub(crate) max_message_bytes: usize,
    pub(crate) directory: Arc<Mutex<Directory>>,
    usage: tokio::sync::Mutex<Usage>,
    anchors: Mutex<Anchors>,
    syncs: AtomicU64,
    ops: AtomicU64,
    /// Orphaned append messages purged with their removed records.
    pub(crate) orphans_purged: AtomicU64,
    #[cfg(test)]
    pub(crate) hooks: crate::tests::Hooks,
}

fn contention() -> JournalError {
    JournalError::Store("too much contention on the record".into())
}

impl Inner {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        client: async_nats::Client,
        js: jetstream::Context,
        events: Stream,
        kv: Stream,
        names: Names,
        opts: NatsOptions,
        max_message_bytes: usize,
        directory: Arc<Mutex<Directory>>,
    ) -> Self {
        Inner {
            client,
            js,
            events,
            kv,
            names,
            opts,
            max_message_bytes,
            directory,
            usage: tokio::sync::Mutex::new(Usage::default()),
            anchors: Mutex::new(Anchors::default()),
            syncs: AtomicU64::new(0),
            ops: AtomicU64::new(0),
            orphans_purged: AtomicU64::new(0),
            #[cfg(test)]
            hooks: Default::default(),
        }
    }

    fn limits(&self) -> &JournalLimits {
        &self.opts.limits
    }

    /// Fail at once when the connection to the server is down (it
    /// reconnects by itself): a durable request then gets its 503 without
    /// waiting for a timeout, and nothing is written.
    fn reachable(&self) -> Result<(), JournalError> {
        match self.client.connection_state() {
            async_nats::connection::State::Connected => Ok(()),
            _ => Err(JournalError::Store(
                "not connected to the NATS server (reconnecting)".into(),
            )),
        }
    }

    fn dir(&self) -> std::sync::MutexGuard<'_, Directory> {
        lock(&self.directory)
    }

    fn anchors(&self) -> std::sync::MutexGuard<'_, Anchors> {
        // Single inserts and removes: consistent after a panic.
        self.anchors.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn synced(&self) {
        self.syncs.fetch_add(1, Ordering::Relaxed);
    }

    fn done(&self) {
        self.ops.fetch_add(1, Ordering::Relaxed);
    }

    // ---- reads -----------------------------------------------------------

    /// The record's last bucket entry; the directory learns it too.
    async fn read_record(&self, tok: &str) -> Result<Slot, JournalError> {
        let subject = self.names.kv_subject(&Names::record_key(tok));
        let slot = match self.kv.direct_get_last_for_subject(subject).await {
            Ok(m) if is_marker(Some(&m.headers)) => Slot::Deleted(m.sequence),
            Ok(m) => match RecordValue::decode(&m.payload) {
                Ok(value) => Slot::Present(m.sequence, Box::new(value)),
                Err(e) => {
                    if self.dir().quarantine(tok, m.sequence) {
                        // R-JRN-6, R-OBS-1: counted and logged, unnamed.
                        tracing::warn!(
                            event = "journal_record_quarantined",
                            revision = m.sequence,
                            error = %e,
                            "a record in the bucket does not decode: it is skipped"
                        );
                    }
                    Slot::Damaged(m.sequence)
                }
            },
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => Slot::Absent,
            Err(e) => return Err(store_error("reading a record", e)),
        };
        match &slot {
            Slot::Present(r, v) => self.dir().put(tok, *r, v),
            Slot::Deleted(r) => self.dir().delete(tok, *r),
            Slot::Absent | Slot::Damaged(_) => {}
        }
        Ok(slot)
    }

    /// The record as last known here (the directory), or read.
    async fn known_record(
        &self,
        tok: &str,
        fresh: bool,
    ) -> Result<(u64, RecordValue), JournalError> {
        if !fresh && let Some(known) = self.dir().get(tok) {
            return Ok(known);
        }
        match self.read_record(tok).await? {
            Slot::Present(r, v) => Ok((r, *v)),
            _ => Err(JournalError::NotFound),
        }
    }

    async fn read_key(&self, key: &str) -> Result<KeySlot, JournalError> {
        let subject = self.names.kv_subject(key);
        match self.kv.direct_get_last_for_subject(subject).await {
            Ok(m) if is_marker(Some(&m.headers)) => Ok(KeySlot::Free(m.sequence)),
            Ok(m) => Ok(KeySlot::Held(
                m.sequence,
                String::from_utf8_lossy(&m.payload).into_owned(),
            )),
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(KeySlot::Free(0)),
            Err(e) => Err(store_error("reading an idempotency key", e)),
        }
    }

    // ---- writes ----------------------------------------------------------

    /// Write bucket key `key` (a value, or a delete marker for `None`) if
    /// its last revision is still `expected` (0: never written): the
    /// compare-and-set every commit is. The new revision.
    async fn kv_write(
        &self,
        key: &str,
        expected: u64,
        value: Option<Bytes>,
    ) -> Result<u64, Failure> {
        let mut headers = HeaderMap::new();
        headers.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            expected.to_string().as_str(),
        );
        let payload = match value {
            Some(v) => v,
            None => {
                headers.insert("KV-Operation", "DEL");
                Bytes::new()
            }
        };
        let ack = self
            .js
            .publish_with_headers(self.names.kv_subject(key), headers, payload)
            .await
            .map_err(|e| publish_failure("writing the bucket", e))?
            .await
            .map_err(|e| publish_failure("writing the bucket", e))?;
        self.synced();
        Ok(ack.sequence)
    }

    /// Commit `value` as the record `tok` if its revision is still
    /// `expected`; the directory (and the record's watchers) learn it at
    /// once. The new revision.
    async fn commit(&self, tok: &str, expected: u64, value: &RecordValue) -> Result<u64, Failure> {
        let encoded = value
            .encode()
            .map_err(|e| Failure::Store(format!("encoding a record: {e}")))?;
        let revision = self
            .kv_write(&Names::record_key(tok), expected, Some(encoded))
            .await?;
        self.dir().put(tok, revision, value);
        Ok(revision)
    }

    /// Publish the parts of a request, all before waiting for any ack. The
    /// parts' stream sequences.
    async fn publish_request(&self, tok: &str, request: &[u8]) -> Result<Vec<u64>, JournalError> {
        let bodies = frame_request(request, self.max_message_bytes)
            .map_err(|e| store_error("framing a request", e))?;
        let subject = self.names.request_subject(tok);
        let mut acks = Vec::with_capacity(bodies.len());
        for body in bodies {
            match self.js.publish(subject.clone(), body).await {
                Ok(ack) => acks.push(ack),
                Err(e) => return Err(publish_failure("storing a request", e).into()),
            }
        }
        let mut seqs = Vec::with_capacity(acks.len());
        let mut failure = None;
        for ack in acks {
            match ack.await {
                Ok(a) => seqs.push(a.sequence),
                Err(e) => {
                    failure.get_or_insert(publish_failure("storing a request", e));
                }
            }
        }
        self.synced();
        if let Some(f) = failure {
            self.discard(&seqs).await;
            return Err(f.into());
        }
        Ok(seqs)
    }

    /// Remove messages nothing will name (best effort: what stays is
    /// never read, and goes with its record's id).
    async fn discard(&self, seqs: &[u64]) {
        for &seq in seqs {
            if let Err(e) = self.events.delete_message(seq).await {
                tracing::debug!(seq, error = %e, "discarding an unused message");
            }
        }
    }

    /// Publish the parts of an append after the subject's message
    /// `expected` (the record's last committed one). One part is one
    /// publish and one ack; further parts each expect the previous one, so
    /// nothing else can land between them. First and last sequence.
    async fn publish_append(
        &self,
        subject: &str,
        expected: u64,
        bodies: &[Bytes],
    ) -> Result<(u64, u64), Failure> {
        let mut last = expected;
        let mut first = 0;
        for body in bodies {
            let mut headers = HeaderMap::new();
            headers.insert(
                NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
                last.to_string().as_str(),
            );
            let ack = self
                .js
                .publish_with_headers(subject.to_owned(), headers, body.clone())
                .await
                .map_err(|e| publish_failure("appending events", e))?
                .await
                .map_err(|e| publish_failure("appending events", e))?;
            if first == 0 {
                first = ack.sequence;
            }
            last = ack.sequence;
        }
        self.synced();
        Ok((first, last))
    }

    /// After a refused publish: the subject's last message, if the append
    /// may go after it, for a writer that read the record `tok` at
    /// `*revision` as `value`. `None`: read the record again.
    ///
    /// A message decided on a revision below `*revision` can never be
    /// committed: its writer's compare-and-set expects that older revision
    /// and the record has left it. It is an orphan. One decided on
    /// `*revision` itself belongs to a writer that has not committed: still
    /// in flight, or given up (its commit failed, its ack was lost with a
    /// server restart). The record is then written again unchanged, a
    /// compare-and-set like any commit (and `*revision` moves to it): from
    /// then on that writer's commit can never succeed, and its message is
    /// an orphan too. One decided on a later revision means this read is
    /// stale.
    async fn orphans_end(
        &self,
        tok: &str,
        subject: &str,
        revision: &mut u64,
        value: &RecordValue,
    ) -> Result<Option<u64>, JournalError> {
        let last = match self.events.direct_get_last_for_subject(subject).await {
            Ok(m) => m,
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(store_error("reading the last append", e)),
        };
        if last.sequence <= value.events_last_msg {
            return Ok(None);
        }
        // A message that is not an append was never written by a store:
        // nothing commits it either.
        let base = AppendHead::parse(&last.payload).map_or(0, |(h, _)| h.base_revision);
        if base > *revision {
            return Ok(None);
        }
        if base == *revision {
            match self.commit(tok, *revision, value).await {
                Ok(fenced) => *revision = fenced,
                Err(Failure::Conflict) => return Ok(None),
                Err(f) => return Err(f.into()),
            }
        }
        Ok(Some(last.sequence))
    }

    /// Remove the orphans between the record's committed end and this
    /// writer's first message `first_msg`, before it commits: then the
    /// messages up to the record's end are exactly its committed appends.
    /// (The subject's last message is never removed while others stay: a
    /// 2.9 server loses track of a subject's last sequence then.)
    async fn remove_orphans(
        &self,
        subject: &str,
        committed_last: u64,
        first_msg: u64,
    ) -> Result<(), JournalError> {
        if committed_last == 0 {
            // Nothing of this record is committed: everything before its
            // first append goes at once (orphans, or an earlier record's
            // messages under the same id).
            return self
                .events
                .purge()
                .filter(subject)
                .sequence(first_msg)
                .await
                .map(|_| ())
                .map_err(|e| store_error("removing orphaned appends", e));
        }
        for _ in 0..MAX_ORPHANS {
            let m = match self
                .events
                .direct_get_next_for_subject(subject, Some(committed_last + 1))
                .await
            {
                Ok(m) => m,
                Err(e) => return Err(store_error("reading orphaned appends", e)),
            };
            if m.sequence >= first_msg {
                return Ok(());
            }
            tracing::debug!(subject, seq = m.sequence, "removing an orphaned append");
            match self.events.delete_message(m.sequence).await {
                Ok(_) => {}
                Err(e) => match e.kind() {
                    async_nats::jetstream::stream::DeleteMessageErrorKind::JetStream(js)
                        if js.error_code() == ErrorCode::NO_MESSAGE_FOUND
                            || js.error_code() == ErrorCode::SEQUENCE_NOT_FOUND => {}
                    _ => return Err(store_error("removing an orphaned append", e)),
                },
            }
        }
        Err(JournalError::Store("too many orphaned appends".into()))
    }

    /// Is there room for a new record? The stream and the bucket refuse
    /// writes at their `max_bytes` (discard new); creates stop earlier, at
    /// `max_bytes - reserve`, so the records already accepted can still
    /// grow to their terminal (R-JRN-5). Sizes are asked at most every
    /// `usage_refresh` and grown by what this store writes in between.
    async fn check_room(&self, request_bytes: u64) -> Result<(), JournalError> {
        let o = &self.opts;
        let mut usage = self.usage.lock().await;
        if usage.at.is_none_or(|at| at.elapsed() >= o.usage_refresh) {
            let events = self
                .events
                .get_info()
                .await
                .map_err(|e| store_error("asking the stream's size", e))?;
            let kv = self
                .kv
                .get_info()
                .await
                .map_err(|e| store_error("asking the bucket's size", e))?;
            *usage = Usage {
                at: Some(Instant::now()),
                stream_bytes: events.state.bytes,
                bucket_bytes: kv.state.bytes,
            };
        }
        if usage.stream_bytes.saturating_add(o.stream_reserve_bytes) > o.stream_max_bytes
            || usage.bucket_bytes.saturating_add(o.bucket_reserve_bytes) > o.bucket_max_bytes
        {
            return Err(JournalError::Full);
        }
        usage.stream_bytes = usage.stream_bytes.saturating_add(request_bytes);
        usage.bucket_bytes = usage.bucket_bytes.saturating_add(512);
        Ok(())
    }

    /// Purge what an incarnation committed in the stream, once its record
    /// is gone or replaced (bounded by its own sequences, so nothing of a
    /// later incarnation is touched). Best effort: what stays is never read.
    async fn purge_incarnation(&self, tok: &str, value: &RecordValue) {
        let mut targets = Vec::with_capacity(2);
        if value.events_last_msg > 0 {
            targets.push((self.names.events_subject(tok), value.events_last_msg));
        }
        if let Some(&last) = value.request_parts.iter().max() {
            targets.push((self.names.request_subject(tok), last));
        }
        for (subject, last) in targets {
            if let Err(e) = self
                .events
                .purge()
                .filter(&subject)
                .sequence(last + 1)
                .await
            {
                tracing::warn!(subject, error = %e, "purging a removed response's messages");
            }
        }
    }

    /// Remove the record `tok`, seen at `revision` as `value`: its delete
    /// marker is the commit; then its idempotency key (if it still names
    /// it) and its messages. `false`: the record changed meanwhile.
    async fn remove(
        &self,
        tok: &str,
        revision: u64,
        value: &RecordValue,
    ) -> Result<bool, JournalError> {
        let marker = match self.kv_write(&Names::record_key(tok), revision, None).await {
            Ok(marker) => marker,
            Err(Failure::Conflict) => return Ok(false),
            Err(f) => return Err(f.into()),
        };
        self.dir().delete(tok, marker);
        self.free_key(&value.meta).await?;
        self.purge_incarnation(tok, value).await;
        self.purge_orphans(tok, value).await;
        Ok(true)
    }

    /// Purge the orphaned appends a removed record leaves after its
    /// committed end (a writer's message whose commit never came, and no
    /// later writer cleared): without it they stay in the stream for
    /// good, and the stream creeps toward full. Everything on the
    /// record's events subject up to the subject's last message goes,
    /// unless the record's id holds a new incarnation already (then only
    /// its own committed end, as [`Self::purge_incarnation`] did). A new
    /// incarnation appends only after its record is committed, so after
    /// the last message read here: a read of the record that still finds
    /// it removed leaves nothing of a newer one below that message. Best
    /// effort: what stays is never read.
    async fn purge_orphans(&self, tok: &str, value: &RecordValue) {
        let subject = self.names.events_subject(tok);
        let last = match self.events.direct_get_last_for_subject(&subject).await {
            Ok(m) => m.sequence,
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => return,
            Err(e) => {
                tracing::debug!(error = %e, "reading a removed response's last append");
                return;
            }
        };
        if last <= value.events_last_msg {
            return;
        }
        match self.read_record(tok).await {
            Ok(Slot::Absent | Slot::Deleted(_)) => {}
            // A new incarnation, or the read failed: leave it.
            _ => return,
        }
        match self
            .events
            .purge()
            .filter(&subject)
            .sequence(last + 1)
            .await
        {
            Ok(p) => {
                self.orphans_purged.fetch_add(p.purged, Ordering::Relaxed);
                tracing::debug!(
                    purged = p.purged,
                    "purged a removed response's orphaned appends"
                );
            }
            Err(e) => tracing::warn!(error = %e, "purging a removed response's orphaned appends"),
        }
    }

    /// Delete the idempotency key entry of a record that is gone, if it
    /// still names it (a key entry naming a missing record is stale
    /// anyway; this keeps the bucket small).
    async fn free_key(&self, meta: &RecordMeta) -> Result<(), JournalError> {
        let Some(hash) = &meta.idempotency_key else {
            return Ok(());
        };
        let key = Names::idempotency_key(hash);
        if let KeySlot::Held(revision, held) = self.read_key(&key).await?
            && held == meta.id
        {
            match self.kv_write(&key, revision, None).await {
                Ok(_) | Err(Failure::Conflict) => {}
                Err(f) => {
                    tracing::warn!(error = ?f, "freeing the idempotency key of a removed response")
                }
            }
        }
        Ok(())
    }

    // ---- the operations --------------------------------------------------

    pub(crate) async fn create(&self, new: NewRecord) -> Result<CreateOutcome, JournalError> {
        self.reachable()?;
        let tok = token(&new.id);
        let key = new.idempotency_key.as_ref().map(Names::idempotency_key);
        for _ in 0..MAX_ATTEMPTS {
            let same_id = self.read_record(&tok).await?;
            let key_slot = match &key {
                Some(k) => Some(self.read_key(k).await?),
                None => None,
            };
            // The live record the key names, if it still names one that
            // carries it (R-IDEM-1): a key entry whose record is gone or
            // was replaced is free.
            let holder = match &key_slot {
                Some(KeySlot::Held(_, held)) if *held == new.id => match &same_id {
                    Slot::Present(r, v) => Some((tok.clone(), *r, v.clone())),
                    _ => None,
                },
                Some(KeySlot::Held(_, held)) => {
                    let held_tok = token(held);
                    match self.read_record(&held_tok).await? {
                        Slot::Present(r, v) => Some((held_tok, r, v)),
                        _ => None,
                    }
                }
                _ => None,
            }
            .filter(|(_, _, v)| v.meta.idempotency_key == new.idempotency_key);
            let used = self.dir().used_bytes();
            let outcome = check_create(
                new.created_unix_ms,
                self.limits(),
                used,
                same_id.meta(),
                holder.as_ref().map(|(_, _, v)| &v.meta),
                &new,
            )?;
            let meta = match outcome {
                CreateOutcome::Existing(meta) => return Ok(CreateOutcome::Existing(meta)),
                CreateOutcome::Create(meta) => meta,
            };
            self.check_room(new.request.len() as u64).await?;

            // 1. The request, durable before the record names it.
            let parts = self.publish_request(&tok, &new.request).await?;
            let value = RecordValue {
                meta,
                incarnation: parts.first().copied().unwrap_or(0),
                request_parts: parts.clone(),
                events_last_msg: 0,
            };
            // 2. The record: the commit point of the create.
            let revision = match self.commit(&tok, same_id.revision(), &value).await {
                Ok(r) => r,
                Err(Failure::Conflict) => {
                    self.discard(&parts).await;
                    continue;
                }
                Err(f) => {
                    self.discard(&parts).await;
                    return Err(f.into());
                }
            };
            // 3. The key, claimed after the record so that a key entry
            // always names a record that was written: one naming a missing
            // record is stale, never a create in flight. Losing it means
            // another create took the key: ours gives way and the next
            // round answers with that one.
            if let (Some(k), Some(slot)) = (&key, &key_slot) {
                let expected = match slot {
                    KeySlot::Free(r) | KeySlot::Held(r, _) => *r,
                };
                match self
                    .kv_write(k, expected, Some(Bytes::from(new.id.clone().into_bytes())))
                    .await
                {
                    Ok(_) => {}
                    Err(f) => {
                        if !self.remove(&tok, revision, &value).await.unwrap_or(false) {
                            tracing::warn!(id = %new.id, "a create that lost its key could not be undone");
                        }
                        match f {
                            Failure::Conflict => continue,
                            f => return Err(f.into()),
                        }
                    }
                }
            }
            // 4. What gave way: an expired or superseded record under the
            // key, an expired one under the id.
            if let Some((held_tok, held_rev, held)) = &holder
                && *held_tok != tok
                && let Err(e) = self.remove(held_tok, *held_rev, held).await
            {
                tracing::warn!(error = %e, "removing a record its key gave up");
            }
            if let Slot::Present(_, old) = &same_id {
                if old.meta.idempotency_key != new.idempotency_key
                    && let Err(e) = self.free_key(&old.meta).await
                {
                    tracing::warn!(error = %e, "freeing the key of a replaced record");
                }
                self.purge_incarnation(&tok, old).await;
            }
            self.done();
            return Ok(CreateOutcome::Create(value.meta));
        }
        Err(contention())
    }

    pub(crate) async fn append(
        &self,
        id: &str,
        epoch: u64,
        events: Vec<JournalEvent>,
    ) -> Result<RecordMeta, JournalError> {
        self.reachable()?;
        let tok = token(id);
        let subject = self.names.events_subject(&tok);
        let mut fresh = false;
        for _ in 0..MAX_ATTEMPTS {
            let (revision, value) = self.known_record(&tok, fresh).await?;
            let next = match check_append(self.limits(), &value.meta, epoch, &events) {
                Ok(next) => next,
                // Decided on a value known here, maybe stale: decide again
                // on the stored one before refusing.
                Err(_) if !fresh => {
                    fresh = true;
                    continue;
                }
                Err(e) => return Err(e),
            };
            if events.is_empty() {
                return Ok(next);
            }
            fresh = true;
            let mut revision = revision;
            let mut expected = value.events_last_msg;
            let mut published = None;
            for _ in 0..MAX_ORPHANS {
                let bodies = frame_append(revision, epoch, &events, self.max_message_bytes)
                    .map_err(|e| store_error("framing an append", e))?;
                match self.publish_append(&subject, expected, &bodies).await {
                    Ok(seqs) => {
                        published = Some(seqs);
                        break;
                    }
                    // Something is after the committed end: orphans of a
                    // writer that lost its commit, or a write deciding on
                    // another value of the record.
                    Err(Failure::Conflict) => {
                        match self
                            .orphans_end(&tok, &subject, &mut revision, &value)
                            .await?
                        {
                            Some(last) => expected = last,
                            None => break,
                        }
                    }
                    Err(f) => return Err(f.into()),
                }
            }
            let Some((first_msg, last_msg)) = published else {
                continue;
            };
            self.remove_orphans(&subject, value.events_last_msg, first_msg)
                .await?;
            #[cfg(test)]
            self.hooks.before_commit().await;
            let committed = RecordValue {
                meta: next.clone(),
                events_last_msg: last_msg,
                ..value
            };
            match self.commit(&tok, revision, &committed).await {
                Ok(_) => {
                    self.anchors().note(
                        &tok,
                        Anchor {
                            incarnation: committed.incarnation,
                            next_seq: events[0].seq,
                            from_msg: first_msg,
                        },
                    );
                    self.done();
                    return Ok(next);
                }
                // Lost to another write (a takeover, a terminal): what was
                // published is an orphan, never read, cleared by the next
                // append. Decide again on what won.
                Err(Failure::Conflict) => continue,
                Err(f) => return Err(f.into()),
            }
        }
        Err(contention())
    }

    /// Read, decide with `decide`, commit by compare-and-set; again on a
    /// lost race.
    async fn update(
        &self,
        id: &str,
        decide: impl Fn(&RecordMeta) -> Result<RecordMeta, JournalError>,
    ) -> Result<RecordMeta, JournalError> {
        self.reachable()?;
        let tok = token(id);
        let mut fresh = false;
        for _ in 0..MAX_ATTEMPTS {
            let (revision, value) = self.known_record(&tok, fresh).await?;
            let next = match decide(&value.meta) {
                Ok(next) => next,
                Err(_) if !fresh => {
                    fresh = true;
                    continue;
                }
                Err(e) => return Err(e),
            };
            fresh = true;
            let committed = RecordValue {
                meta: next.clone(),
                ..value
            };
            match self.commit(&tok, revision, &committed).await {
                Ok(_) => {
                    self.done();
                    return Ok(next);
                }
                Err(Failure::Conflict) => continue,
                Err(f) => return Err(f.into()),
            }
        }
        Err(contention())
    }

    pub(crate) async fn finish(
        &self,
        id: &str,
        epoch: u64,
        terminal: Terminal,
    ) -> Result<RecordMeta, JournalError> {
        let limits = *self.limits();
        self.update(id, |meta| check_finish(&limits, meta, epoch, &terminal))
            .await
    }

    pub(crate) async fn raise_epoch(
        &self,
        id: &str,
        expected: u64,
        owner: &str,
    ) -> Result<RecordMeta, JournalError> {
        self.update(id, |meta| check_raise_epoch(meta, expected, owner))
            .await
    }

    pub(crate) async fn get(
        &self,
        id: &str,
        now_unix_ms: u64,
    ) -> Result<Option<StoredRecord>, JournalError> {
        self.reachable()?;
        let tok = token(id);
        let Slot::Present(_, value) = self.read_record(&tok).await? else {
            return Ok(None);
        };
        if expired(&value.meta, now_unix_ms) {
            return Ok(None);
        }
        let subject = self.names.request_subject(&tok);
        let parts = value.request_parts.len();
        let mut request = Vec::new();
        for (i, &seq) in value.request_parts.iter().enumerate() {
            let message = match self.events.direct_get(seq).await {
                Ok(m) => m,
                // Removed meanwhile?
                Err(e) if e.kind() == DirectGetErrorKind::NotFound => {
                    return match self.read_record(&tok).await? {
                        Slot::Present(_, v) if v.incarnation == value.incarnation => {
                            Err(JournalError::Store("a stored request is missing".into()))
                        }
                        _ => Ok(None),
                    };
                }
                Err(e) => return Err(store_error("reading a request", e)),
            };
            if message.subject.as_str() != subject {
                return Err(JournalError::Store("a stored request is misplaced".into()));
            }
            let data = unframe_request_part(&message.payload, i, parts)
                .map_err(|e| store_error("reading a request", e))?;
            request.extend_from_slice(data);
        }
        Ok(Some((value.meta, request)))
    }

    pub(crate) async fn events(
        &self,
        id: &str,
        after: u64,
        max: usize,
    ) -> Result<Vec<JournalEvent>, JournalError> {
        self.reachable()?;
        let tok = token(id);
        let Slot::Present(_, value) = self.read_record(&tok).await? else {
            return Err(JournalError::NotFound);
        };
        let last_seq = value.meta.last_seq;
        let mut out = Vec::new();
        if max == 0 || after >= last_seq || value.events_last_msg == 0 {
            return Ok(out);
        }
        let want = usize::try_from(last_seq - after)
            .unwrap_or(usize::MAX)
            .min(max);
        let subject = self.names.events_subject(&tok);
        // Every message of this incarnation is after its first request
        // part; everything up to `events_last_msg` is committed (see the
        // crate docs).
        let mut from = self
            .anchors()
            .best(&tok, value.incarnation, after)
            .unwrap_or(value.incarnation);
        while from <= value.events_last_msg && out.len() < want {
            let start = from;
            let mut head: Option<AppendHead> = None;
            let mut data = Vec::new();
            loop {
                let m = match self
                    .events
                    .direct_get_next_for_subject(&subject, Some(from))
                    .await
                {
                    Ok(m) if m.sequence <= value.events_last_msg => m,
                    Ok(_) => return self.missing(&tok, &value).await,
                    Err(e) if e.kind() == DirectGetErrorKind::NotFound => {
                        return self.missing(&tok, &value).await;
                    }
                    Err(e) => return Err(store_error("reading events", e)),
                };
                from = m.sequence + 1;
                let (h, rest) =
                    AppendHead::parse(&m.payload).map_err(|e| store_error("reading events", e))?;
                let expected_part = head.map_or(0, |h0| h0.part + 1);
                if h.part != expected_part
                    || head.is_some_and(|h0| {
                        (h0.base_revision, h0.parts) != (h.base_revision, h.parts)
                    })
                {
                    return Err(JournalError::Store(
                        "an append's parts are out of order".into(),
                    ));
                }
                data.extend_from_slice(rest);
                let h0 = *head.get_or_insert(h);
                if h.part + 1 == h.parts {
                    let events =
                        unframe_append(&h0, &data).map_err(|e| store_error("reading events", e))?;
                    let end = h0.first_seq + u64::from(h0.count);
                    for event in events {
                        if event.seq > after && out.len() < want {
                            out.push(event);
                        }
                    }
                    let anchor = if out.last().is_some_and(|e| e.seq + 1 < end) {
                        // Stopped inside this append: start here next time.
                        Anchor {
                            incarnation: value.incarnation,
                            next_seq: h0.first_seq,
                            from_msg: start,
                        }
                    } else {
                        Anchor {
                            incarnation: value.incarnation,
                            next_seq: end,
                            from_msg: from,
                        }
                    };
                    self.anchors().note(&tok, anchor);
                    break;
                }
            }
        }
        if out.len() < want {
            return self.missing(&tok, &value).await;
        }
        Ok(out)
    }

    /// Committed events could not be read: the record was removed or
    /// replaced meanwhile (not found), or the stream lost them.
    async fn missing(
        &self,
        tok: &str,
        value: &RecordValue,
    ) -> Result<Vec<JournalEvent>, JournalError> {
        match self.read_record(tok).await? {
            Slot::Present(_, v) if v.incarnation == value.incarnation => Err(JournalError::Store(
                "committed events are missing from the stream".into(),
            )),
            _ => Err(JournalError::NotFound),
        }
    }

    pub(crate) async fn delete(&self, id: &str) -> Result<(), JournalError> {
        self.reachable()?;
        let tok = token(id);
        for _ in 0..MAX_ATTEMPTS {
            let Slot::Present(revision, value) = self.read_record(&tok).await? else {
                return Err(JournalError::NotFound);
            };
            if self.remove(&tok, revision, &value).await? {
                self.done();
                return Ok(());
            }
        }
        Err(contention())
    }

    pub(crate) async fn unfinished(&self) -> Result<Vec<RecordMeta>, JournalError> {
        self.reachable()?;
        let toks = self.dir().unfinished();
        let reads = futures::stream::iter(toks)
            .map(|tok| async move { self.read_record(&tok).await })
            .buffer_unordered(SCAN_CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        let mut out = Vec::new();
        for slot in reads {
            if let Slot::Present(_, v) = slot?
                && v.meta.terminal.is_none()
            {
                out.push(v.meta);
            }
        }
        Ok(out)
    }

    /// The records without a terminal as the directory knows them (no
    /// round trip; the takeover scan reads each again before it acts).
    pub(crate) fn unfinished_hint(&self) -> Result<Vec<RecordMeta>, JournalError> {
        self.reachable()?;
        Ok(self.dir().unfinished_metas())
    }

    pub(crate) async fn sweep(&self, now_unix_ms: u64) -> Result<usize, JournalError> {
        self.reachable()?;
        let candidates = self.dir().expired(now_unix_ms);
        let results = futures::stream::iter(candidates)
            .map(|(tok, known_revision)| async move {
                match self.read_record(&tok).await? {
                    // Decided on the record as stored, by the journal's rule.
                    Slot::Present(revision, value) if expired(&value.meta, now_unix_ms) => {
                        self.remove(&tok, revision, &value).await
                    }
                    Slot::Absent => {
                        self.dir().forget(&tok, known_revision);
                        Ok(false)
                    }
                    _ => Ok(false),
                }
            })
            .buffer_unordered(SCAN_CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        let mut removed = 0;
        for r in results {
            if r? {
                removed += 1;
            }
        }
        removed += self.sweep_quarantined(now_unix_ms).await?;
        self.purge_markers(now_unix_ms).await;
        self.dir().prune_watchers();
        Ok(removed)
    }

    /// Remove the quarantined records (R-JRN-6) that stayed unchanged and
    /// unreadable for a retention since a sweep first saw them: nobody
    /// can read them, and a record kept that long would have expired. A
    /// record a newer build writes changes meanwhile (its clock starts
    /// again) and is left alone. Its bucket entry goes (a delete marker
    /// on the revision seen: a record written since is not touched), then
    /// its messages up to the last one before the marker.
    async fn sweep_quarantined(&self, now_unix_ms: u64) -> Result<usize, JournalError> {
        let due = self.dir().quarantined_due(
            now_unix_ms,
            self.limits().retention_ms,
            MAX_QUARANTINED_SWEPT,
        );
        let mut removed = 0;
        for (tok, revision) in due {
            match self.read_record(&tok).await? {
                Slot::Damaged(r) if r == revision => {}
                Slot::Damaged(_) => continue,
                Slot::Present(r, _) | Slot::Deleted(r) => {
                    self.dir().unquarantine(&tok, r);
                    continue;
                }
                Slot::Absent => {
                    self.dir().unquarantine(&tok, revision);
                    continue;
                }
            }
            // The messages it may have: everything on its subjects up to
            // now (a new record of the id writes after the marker).
            let mut lasts = Vec::with_capacity(2);
            for subject in [
                self.names.events_subject(&tok),
                self.names.request_subject(&tok),
            ] {
                match self.events.direct_get_last_for_subject(&subject).await {
                    Ok(m) => lasts.push((subject, m.sequence)),
                    Err(e) if e.kind() == DirectGetErrorKind::NotFound => {}
                    Err(e) => return Err(store_error("reading a damaged record's messages", e)),
                }
            }
            let marker = match self
                .kv_write(&Names::record_key(&tok), revision, None)
                .await
            {
                Ok(marker) => marker,
                Err(Failure::Conflict) => continue,
                Err(f) => return Err(f.into()),
            };
            self.dir().delete(&tok, marker);
            for (subject, last) in lasts {
                if let Err(e) = self
                    .events
                    .purge()
                    .filter(&subject)
                    .sequence(last + 1)
                    .await
                {
                    tracing::warn!(subject, error = %e, "purging a damaged record's messages");
                }
            }
            tracing::info!(
                event = "journal_quarantined_record_removed",
                revision,
                "a record that did not decode for a whole retention is removed"
            );
            removed += 1;
        }
        Ok(removed)
    }

    /// Purge delete markers every follower has had time to see.
    async fn purge_markers(&self, now_unix_ms: u64) {
        let grace_ms = u64::try_from(self.opts.marker_grace.as_millis()).unwrap_or(u64::MAX);
        let due = self
            .dir()
            .due_markers(now_unix_ms, grace_ms, MAX_MARKER_PURGES);
        for marker in due {
            let subject = self.names.kv_subject(&marker.key);
            // Up to the marker only: a newer value of the key stays.
            match self
                .kv
                .purge()
                .filter(&subject)
                .sequence(marker.revision + 1)
                .await
            {
                Ok(_) => self.dir().marker_purged(marker.revision),
                Err(e) => {
                    tracing::warn!(key = marker.key, error = %e, "purging a delete marker");
                    break;
                }
            }
        }
    }

    pub(crate) async fn watch(&self, id: &str) -> Result<watch::Receiver<Progress>, JournalError> {
        let tok = token(id);
        if let Some(rx) = self.dir().subscribe(&tok) {
            return Ok(rx);
        }
        self.reachable()?;
        // Not known here yet (another Edge's record the watch has not
        // delivered): the read teaches the directory.
        match self.read_record(&tok).await? {
            Slot::Present(..) => self.dir().subscribe(&tok).ok_or(JournalError::NotFound),
            _ => Err(JournalError::NotFound),
        }
    }

    // ---- ownership leases (R-TAKE-1) -------------------------------------

    /// The lease stored under `key`, read from the stream's leader (a
    /// direct get may be answered by a replica that lags, and a takeover
    /// decides on this read).
    async fn read_lease(&self, key: &str) -> Result<Option<StoredLease>, JournalError> {
        let subject = self.names.kv_subject(key);
        match self.kv.get_last_raw_message_by_subject(&subject).await {
            Ok(m) if is_marker(Some(&m.headers)) => Ok(None),
            Ok(m) => {
                let lease =
                    decode_lease(&m.payload).map_err(|e| store_error("reading a lease", e))?;
                Ok(Some(StoredLease {
                    revision: m.sequence,
                    lease,
                }))
            }
            Err(e)
                if e.kind()
                    == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
            {
                Ok(None)
            }
            Err(e) => Err(store_error("reading a lease", e)),
        }
    }

    pub(crate) async fn put_lease(
        &self,
        lease: EdgeLease,
        expected: u64,
    ) -> Result<u64, JournalError> {
        self.reachable()?;
        let key = Names::lease_key(&lease.edge_id);
        let value = encode_lease(&lease).map_err(|e| store_error("encoding a lease", e))?;
        match self.kv_write(&key, expected, Some(value)).await {
            Ok(revision) => {
                self.dir().lease_key(&key, revision);
                Ok(revision)
            }
            // The stored lease is not the one this writer read: say which
            // it is, as the journal's rule words it.
            Err(Failure::Conflict) => {
                let stored = self.read_lease(&key).await?;
                check_put_lease(stored.as_ref(), expected)?;
                Err(JournalError::Fenced {
                    current: stored.map_or(0, |s| s.revision),
                    writer: expected,
                })
            }
            Err(f) => Err(f.into()),
        }
    }

    pub(crate) async fn lease(&self, edge_id: &str) -> Result<Option<StoredLease>, JournalError> {
        self.reachable()?;
        self.read_lease(&Names::lease_key(edge_id)).await
    }

    pub(crate) async fn leases(&self) -> Result<Vec<StoredLease>, JournalError> {
        self.reachable()?;
        let keys = self.dir().lease_keys();
        let reads = futures::stream::iter(keys)
            .map(|key| async move { self.read_lease(&key).await })
            .buffer_unordered(SCAN_CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        let mut out = Vec::new();
        for read in reads {
            if let Some(lease) = read? {
                out.push(lease);
            }
        }
        Ok(out)
    }

    /// What `subject` holds, as the directory counts every record it
    /// knows (every Edge's, within the bucket watch's lag).
    pub(crate) fn held(&self, subject: &iop_store::Subject) -> iop_store::Held {
        self.dir().held(subject)
    }

    pub(crate) fn stats(&self) -> StoreStats {
        let d = self.dir();
        StoreStats {
            records: d.records(),
            used_bytes: d.used_bytes(),
            syncs: self.syncs.load(Ordering::Relaxed),
            ops: self.ops.load(Ordering::Relaxed),
            quarantined: d.quarantined(),
        }
    }
}
