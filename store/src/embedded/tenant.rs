//! Tenants' state in the embedded store's file (SPEC §9): the counters
//! Edges claim allowances from (R-TEN-3), usage rows (R-TEN-5) and runtime
//! API keys (R-TEN-4), in tables beside the journal's, so a budget's spend,
//! the day's usage and every key survive a restart of the Edge.
//!
//! | table | key | value |
//! | --- | --- | --- |
//! | `tenant_counters` | postcard [`CounterKey`] | claimed (u64) |
//! | `tenant_give_backs` | postcard [`CounterKey`] | postcard set of the holders whose give-back the counter took |
//! | `tenant_usage` | (day_unix_ms, principal, key id, model) | (requests, input, cached input, output tokens, spend µ) |
//! | `tenant_keys` | key id | (revision, the [`KeyRecord`] by format: format 1 bare, format 2 after the bytes 0, 2) |
//! | `tenant_meta` | `key_revision` | the last key revision given (u64) |
//!
//! Writes go through the journal's one writer ([`super::writer`]): a
//! claim, a usage batch, a key write or a bounded part of a sweep is one
//! operation of a group-committed batch, so redb's one write transaction
//! at a time is kept, a claim shares its fsync with the journal's appends
//! waiting beside it, and the journal's queue bound (R-LIM-4) covers both.
//! A give-back (a stopping Edge's unused claim, R-TEN-3) reads and writes
//! the counter and its holders in one write transaction, so the decrement
//! and the record that makes a retry free nothing are one.
//! Every decision comes from [`iop_core::tenant`] ([`check_claim`],
//! [`check_give_back`]) or
//! [`crate::tenant`] (what expires); this module reads and writes.
//! Reads run in read transactions on tokio's blocking pool.

use std::ops::Bound;
use std::sync::{Arc, Weak};

use iop_core::tenant::key_format::{KEY_FORMAT_V1, decode_key_record, encode_key_record};
use iop_core::tenant::keys::KeyRecord;
use iop_core::tenant::usage::{UsageKey, UsageQuery, UsageTotals};
use iop_core::tenant::{
    ClaimedCounter, CounterKey, DAY_MS, GiveBackOutcome, check_claim, check_give_back,
};
use redb::{
    Database, ReadTransaction, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction,
};

use super::ops::{Reply, Request};
use super::tables::Fault;
use super::writer::Shared;
use crate::BoxFuture;
use crate::tenant::{
    TenantStore, TenantStoreError, USAGE_RETENTION_DAYS, UsageWriteError, counter_expired,
};

/// Counters: postcard [`CounterKey`] -> claimed so far.
pub(super) const COUNTERS: TableDefinition<'static, &[u8], u64> =
    TableDefinition::new("tenant_counters");
/// The holders whose give-back each counter took (R-TEN-3): postcard
/// [`CounterKey`] -> postcard set of holder ids. Apart from `COUNTERS`,
/// whose values earlier builds read as they are.
pub(super) const GIVE_BACKS: TableDefinition<'static, &[u8], &[u8]> =
    TableDefinition::new("tenant_give_backs");
/// A usage row's key, in [`UsageKey`]'s order: (day, principal, key, model).
type UsageRowKey = (u64, &'static str, &'static str, &'static str);
/// A usage row's totals: requests, input, cached input, output tokens,
/// spend.
type UsageRowValue = (u64, u64, u64, u64, u64);
/// Usage rows, ordered as [`UsageKey`] orders them.
/// Concurrency gauges (R-TEN-1): the encoded counter, its
/// [`SlotBook`](iop_core::tenant::slots::SlotBook).
pub(super) const SLOTS: TableDefinition<'static, &[u8], &[u8]> =
    TableDefinition::new("tenant_slots");

pub(super) const USAGE: TableDefinition<'static, UsageRowKey, UsageRowValue> =
    TableDefinition::new("tenant_usage");
/// Runtime keys: id -> (revision, the record: [`encode_key`]).
pub(super) const KEYS: TableDefinition<'static, &str, (u64, &[u8])> =
    TableDefinition::new("tenant_keys");
/// The key revision counter.
pub(super) const META: TableDefinition<'static, &str, u64> = TableDefinition::new("tenant_meta");
const META_KEY_REVISION: &str = "key_revision";

/// Counters or usage rows one sweep operation removes at most; a larger
/// sweep runs as several operations, so the writer is never held long.
pub(super) const SWEEP_BATCH: usize = 1024;

/// One write of tenants' state, run by the journal's writer.
#[derive(Debug)]
pub(super) enum TenantOp {
    Claim {
        counter: CounterKey,
        amount: u64,
        limit: u64,
    },
    HoldSlots(iop_core::tenant::slots::SlotAsk),
    GiveBack {
        counter: CounterKey,
        holder: String,
        amount: u64,
        now_unix_ms: u64,
    },
    AddUsage(Vec<(UsageKey, UsageTotals)>),
    PutKey {
        record: Box<KeyRecord>,
        expected: u64,
    },
    /// Forget at most `max` expired counters and usage rows.
    Sweep {
        now_unix_ms: u64,
        max: usize,
    },
}

impl TenantOp {
    /// Bytes it carries, for the batch's byte bound.
    pub(super) fn bytes(&self) -> usize {
        match self {
            TenantOp::AddUsage(rows) => rows
                .iter()
                .map(|(k, _)| 48 + k.principal.len() + k.key.len() + k.model.len())
                .sum(),
            TenantOp::PutKey { record, .. } => {
                256 + record.models.iter().map(String::len).sum::<usize>()
                    + record
                        .limits
                        .per_model
                        .keys()
                        .map(|m| 32 + m.len())
                        .sum::<usize>()
            }
            TenantOp::HoldSlots(ask) => 64 + ask.holder.len(),
            TenantOp::GiveBack { holder, .. } => 64 + holder.len(),
            TenantOp::Claim { .. } | TenantOp::Sweep { .. } => 0,
        }
    }
}

/// What the writer answered a [`TenantOp`].
#[derive(Debug)]
pub(super) enum TenantReply {
    Claimed(u64),
    SlotsHeld(u64),
    GaveBack(GiveBackOutcome),
    UsageAdded,
    KeyPut(Result<u64, TenantStoreError>),
    Swept { removed: usize, more: bool },
}

impl TenantReply {
    /// Did it change the file?
    pub(super) fn accepted(&self) -> bool {
        match self {
            TenantReply::Claimed(granted) => *granted > 0,
            TenantReply::SlotsHeld(_) => true,
            TenantReply::GaveBack(outcome) => matches!(outcome, GiveBackOutcome::Freed(_)),
            TenantReply::UsageAdded => true,
            TenantReply::KeyPut(r) => r.is_ok(),
            TenantReply::Swept { removed, .. } => *removed > 0,
        }
    }
}

/// Create the tables (in the opening transaction).
pub(super) fn init(txn: &WriteTransaction) -> Result<(), Fault> {
    txn.open_table(COUNTERS)?;
    txn.open_table(SLOTS)?;
    txn.open_table(GIVE_BACKS)?;
    txn.open_table(USAGE)?;
    txn.open_table(KEYS)?;
    txn.open_table(META)?;
    Ok(())
}

fn encode<T: serde::Serialize>(what: &str, value: &T) -> Result<Vec<u8>, Fault> {
    postcard::to_allocvec(value).map_err(|e| Fault::Corrupt(format!("encoding {what}: {e}")))
}

fn decode<'a, T: serde::Deserialize<'a>>(what: &str, bytes: &'a [u8]) -> Result<T, Fault> {
    postcard::from_bytes(bytes).map_err(|e| Fault::Corrupt(format!("{what} does not decode: {e}")))
}

/// The byte in front of a key record of a format other than 1: a bare
/// record (format 1, as every earlier build wrote them all) starts with
/// its id's length, never 0.
const KEY_FORMAT_MARK: u8 = 0;

/// A key record's value (R-TEN-4, [`iop_core::tenant::key_format`]):
/// format 1 bare, as earlier builds write and read it; any later format
/// after [`KEY_FORMAT_MARK`] and its format byte.
pub(super) fn encode_key(record: &KeyRecord) -> Vec<u8> {
    match encode_key_record(record) {
        (KEY_FORMAT_V1, bytes) => bytes,
        (format, bytes) => {
            let mut out = Vec::with_capacity(bytes.len() + 2);
            out.extend([KEY_FORMAT_MARK, format]);
            out.extend(bytes);
            out
        }
    }
}

/// A key record from its value ([`encode_key`]).
pub(super) fn decode_key(bytes: &[u8]) -> Result<KeyRecord, Fault> {
    let decoded = match bytes {
        [KEY_FORMAT_MARK, format, rest @ ..] => decode_key_record(*format, rest),
        bare => decode_key_record(KEY_FORMAT_V1, bare),
    };
    decoded.map_err(|e| Fault::Corrupt(e.to_string()))
}

fn totals(v: UsageRowValue) -> UsageTotals {
    UsageTotals {
        requests: v.0,
        input_tokens: v.1,
        cached_input_tokens: v.2,
        output_tokens: v.3,
        spend_micros: v.4,
    }
}

fn row_value(t: &UsageTotals) -> UsageRowValue {
    (
        t.requests,
        t.input_tokens,
        t.cached_input_tokens,
        t.output_tokens,
        t.spend_micros,
    )
}

/// Run `op` in the batch's transaction: its reply, and whether it wrote.
pub(super) fn apply(txn: &WriteTransaction, op: TenantOp) -> Result<TenantReply, Fault> {
    match op {
        TenantOp::Claim {
            counter,
            amount,
            limit,
        } => {
            let key = encode("a counter", &counter)?;
            let mut table = txn.open_table(COUNTERS)?;
            let claimed = table.get(key.as_slice())?.map_or(0, |v| v.value());
            let (total, granted) = check_claim(claimed, amount, limit);
            if granted > 0 {
                table.insert(key.as_slice(), total)?;
            }
            Ok(TenantReply::Claimed(granted))
        }
        TenantOp::HoldSlots(ask) => {
            let key = encode("a gauge", &ask.counter)?;
            let mut table = txn.open_table(SLOTS)?;
            let mut book: iop_core::tenant::slots::SlotBook = match table.get(key.as_slice())? {
                Some(v) => decode("a gauge", v.value())?,
                None => Default::default(),
            };
            let held = book.hold_ask(&ask);
            if book.holders.is_empty() {
                table.remove(key.as_slice())?;
            } else {
                let value = encode("a gauge", &book)?;
                table.insert(key.as_slice(), value.as_slice())?;
            }
            Ok(TenantReply::SlotsHeld(held))
        }
        TenantOp::GiveBack {
            counter,
            holder,
            amount,
            now_unix_ms,
        } => {
            let key = encode("a counter", &counter)?;
            let mut counters = txn.open_table(COUNTERS)?;
            let mut given = txn.open_table(GIVE_BACKS)?;
            let stored = ClaimedCounter {
                claimed: counters.get(key.as_slice())?.map_or(0, |v| v.value()),
                gave_back: match given.get(key.as_slice())? {
                    Some(v) => decode("a counter's give-backs", v.value())?,
                    None => Default::default(),
                },
            };
            // R-TEN-3: the rule decides, on the counter as stored, in this
            // one transaction.
            let (written, outcome) =
                check_give_back(&stored, &counter, &holder, amount, now_unix_ms);
            if let Some(written) = written {
                counters.insert(key.as_slice(), written.claimed)?;
                let value = encode("a counter's give-backs", &written.gave_back)?;
                given.insert(key.as_slice(), value.as_slice())?;
            }
            Ok(TenantReply::GaveBack(outcome))
        }
        TenantOp::AddUsage(rows) => {
            let mut table = txn.open_table(USAGE)?;
            for (key, add) in &rows {
                let row = (
                    key.day_unix_ms,
                    key.principal.as_str(),
                    key.key.as_str(),
                    key.model.as_str(),
                );
                let mut sum = table
                    .get(row)?
                    .map(|v| totals(v.value()))
                    .unwrap_or_default();
                sum.add(add);
                table.insert(row, row_value(&sum))?;
            }
            Ok(TenantReply::UsageAdded)
        }
        TenantOp::PutKey { record, expected } => {
            let mut keys = txn.open_table(KEYS)?;
            let current = keys.get(record.id.as_str())?.map_or(0, |v| v.value().0);
            if current != expected {
                return Ok(TenantReply::KeyPut(Err(TenantStoreError::Conflict {
                    current,
                })));
            }
            let mut meta = txn.open_table(META)?;
            let revision = meta.get(META_KEY_REVISION)?.map_or(0, |v| v.value()) + 1;
            meta.insert(META_KEY_REVISION, revision)?;
            let bytes = encode_key(&record);
            keys.insert(record.id.as_str(), (revision, bytes.as_slice()))?;
            Ok(TenantReply::KeyPut(Ok(revision)))
        }
        TenantOp::Sweep { now_unix_ms, max } => sweep(txn, now_unix_ms, max),
    }
}

/// Remove up to `max` counters whose windows are over and usage rows past
/// retention.
fn sweep(txn: &WriteTransaction, now_unix_ms: u64, max: usize) -> Result<TenantReply, Fault> {
    let mut counters = txn.open_table(COUNTERS)?;
    let mut due: Vec<Vec<u8>> = Vec::new();
    for entry in counters.iter()? {
        if due.len() >= max {
            break;
        }
        let (key, _) = entry?;
        let counter: CounterKey = decode("a counter", key.value())?;
        if counter_expired(&counter, now_unix_ms) {
            due.push(key.value().to_vec());
        }
    }
    for key in &due {
        counters.remove(key.as_slice())?;
    }
    // A counter's give-backs go with it (the same rule: its window is
    // over).
    let mut given = txn.open_table(GIVE_BACKS)?;
    let mut given_due: Vec<Vec<u8>> = Vec::new();
    for entry in given.iter()? {
        if due.len() + given_due.len() >= max {
            break;
        }
        let (key, _) = entry?;
        let counter: CounterKey = decode("a counter", key.value())?;
        if counter_expired(&counter, now_unix_ms) {
            given_due.push(key.value().to_vec());
        }
    }
    for key in &given_due {
        given.remove(key.as_slice())?;
    }
    let mut removed = due.len() + given_due.len();
    // Usage rows sort by day first: the expired ones are a prefix.
    let retention_ms = USAGE_RETENTION_DAYS * DAY_MS;
    let mut usage = txn.open_table(USAGE)?;
    let mut rows: Vec<(u64, String, String, String)> = Vec::new();
    if let Some(first_kept_day) = now_unix_ms.checked_sub(retention_ms).map(|d| d + 1) {
        let upper: Bound<UsageRowKey> = Bound::Excluded((first_kept_day, "", "", ""));
        for entry in usage.range::<UsageRowKey>((Bound::Unbounded, upper))? {
            if removed + rows.len() >= max {
                break;
            }
            let (key, _) = entry?;
            let (day, principal, key_id, model) = key.value();
            rows.push((day, principal.into(), key_id.into(), model.into()));
        }
    }
    for (day, principal, key_id, model) in &rows {
        usage.remove((*day, principal.as_str(), key_id.as_str(), model.as_str()))?;
    }
    removed += rows.len();
    Ok(TenantReply::Swept {
        removed,
        more: removed >= max,
    })
}

/// Reads, each in its own read transaction.
mod read {
    use super::*;

    pub(super) fn claimed(txn: &ReadTransaction, counter: &CounterKey) -> Result<u64, Fault> {
        let key = encode("a counter", counter)?;
        Ok(txn
            .open_table(COUNTERS)?
            .get(key.as_slice())?
            .map_or(0, |v| v.value()))
    }

    pub(super) fn slots(
        txn: &ReadTransaction,
        counter: &CounterKey,
    ) -> Result<iop_core::tenant::slots::SlotBook, Fault> {
        let key = encode("a gauge", counter)?;
        match txn.open_table(SLOTS)?.get(key.as_slice())? {
            Some(v) => decode("a gauge", v.value()),
            None => Ok(Default::default()),
        }
    }

    pub(super) fn usage(
        txn: &ReadTransaction,
        query: &UsageQuery,
    ) -> Result<Vec<(UsageKey, UsageTotals)>, Fault> {
        let mut out = Vec::new();
        if query.max_rows == 0 || query.from_day_unix_ms > query.to_day_unix_ms {
            return Ok(out);
        }
        let table = txn.open_table(USAGE)?;
        let lower: Bound<UsageRowKey> = Bound::Included((query.from_day_unix_ms, "", "", ""));
        let upper: Bound<UsageRowKey> = match query.to_day_unix_ms.checked_add(1) {
            Some(next) => Bound::Excluded((next, "", "", "")),
            None => Bound::Unbounded,
        };
        for entry in table.range::<UsageRowKey>((lower, upper))? {
            let (key, value) = entry?;
            let (day, principal, key_id, model) = key.value();
            let row = UsageKey {
                day_unix_ms: day,
                principal: principal.to_owned(),
                key: key_id.to_owned(),
                model: model.to_owned(),
            };
            if query.matches(&row) {
                out.push((row, totals(value.value())));
                if out.len() >= query.max_rows {
                    break;
                }
            }
        }
        Ok(out)
    }

    pub(super) fn key(txn: &ReadTransaction, id: &str) -> Result<Option<(KeyRecord, u64)>, Fault> {
        match txn.open_table(KEYS)?.get(id)? {
            None => Ok(None),
            Some(v) => {
                let (revision, bytes) = v.value();
                Ok(Some((decode_key(bytes)?, revision)))
            }
        }
    }

    pub(super) fn keys(txn: &ReadTransaction) -> Result<Vec<(KeyRecord, u64)>, Fault> {
        let mut out = Vec::new();
        for entry in txn.open_table(KEYS)?.iter()? {
            let (_, v) = entry?;
            let (revision, bytes) = v.value();
            out.push((decode_key(bytes)?, revision));
        }
        Ok(out)
    }
}

fn unavailable(e: impl std::fmt::Display) -> TenantStoreError {
    TenantStoreError::Unavailable(e.to_string())
}

/// Tenants' state in the embedded store's file: what
/// [`EmbeddedStore::tenant_store`](super::EmbeddedStore::tenant_store)
/// returns. A view of the store: it writes through the store's writer and
/// never keeps the file open itself, so once the store is dropped (the
/// file closed, and free to open again) every operation fails with
/// [`TenantStoreError::Unavailable`].
pub(super) struct EmbeddedTenantStore {
    pub(super) db: Weak<Database>,
    pub(super) shared: Arc<Shared>,
}

impl EmbeddedTenantStore {
    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&ReadTransaction) -> Result<T, Fault> + Send + 'static,
    ) -> Result<T, TenantStoreError> {
        let db = self
            .db
            .upgrade()
            .ok_or_else(|| unavailable("the store is closed"))?;
        tokio::task::spawn_blocking(move || {
            let txn = db.begin_read().map_err(Fault::from)?;
            f(&txn)
        })
        .await
        .map_err(|e| unavailable(format_args!("tenant read task: {e}")))?
        .map_err(unavailable)
    }

    /// Submit `op` now; the future waits until its batch is durable.
    fn write(
        &self,
        op: TenantOp,
    ) -> impl Future<Output = Result<TenantReply, TenantStoreError>> + Send + 'static {
        let rx = self.shared.submit(Request::Tenant(op));
        async move {
            let answer = rx
                .map_err(unavailable)?
                .await
                .map_err(|_| unavailable("the store's writer has stopped"))?;
            match answer.map_err(unavailable)? {
                Reply::Tenant(reply) => Ok(reply),
                other => Err(unavailable(format_args!(
                    "the writer answered out of kind: {other:?}"
                ))),
            }
        }
    }
}

fn out_of_kind(reply: TenantReply) -> TenantStoreError {
    unavailable(format_args!("the writer answered out of kind: {reply:?}"))
}

impl TenantStore for EmbeddedTenantStore {
    fn claim(
        &self,
        counter: CounterKey,
        amount: u64,
        limit: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        let answer = self.write(TenantOp::Claim {
            counter,
            amount,
            limit,
        });
        Box::pin(async move {
            match answer.await? {
                TenantReply::Claimed(granted) => Ok(granted),
                other => Err(out_of_kind(other)),
            }
        })
    }

    fn claimed(&self, counter: CounterKey) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(self.read(move |txn| read::claimed(txn, &counter)))
    }

    fn hold_slots(
        &self,
        ask: iop_core::tenant::slots::SlotAsk,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        let answer = self.write(TenantOp::HoldSlots(ask));
        Box::pin(async move {
            match answer.await? {
                TenantReply::SlotsHeld(held) => Ok(held),
                other => Err(out_of_kind(other)),
            }
        })
    }

    fn give_back(
        &self,
        counter: CounterKey,
        holder: String,
        amount: u64,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<GiveBackOutcome, TenantStoreError>> {
        let answer = self.write(TenantOp::GiveBack {
            counter,
            holder,
            amount,
            now_unix_ms,
        });
        Box::pin(async move {
            match answer.await? {
                TenantReply::GaveBack(outcome) => Ok(outcome),
                other => Err(out_of_kind(other)),
            }
        })
    }

    fn slots(
        &self,
        counter: CounterKey,
    ) -> BoxFuture<'_, Result<iop_core::tenant::slots::SlotBook, TenantStoreError>> {
        Box::pin(self.read(move |txn| read::slots(txn, &counter)))
    }

    fn add_usage(
        &self,
        rows: Vec<(UsageKey, UsageTotals)>,
    ) -> BoxFuture<'_, Result<(), UsageWriteError>> {
        // The batch is one operation: all of it is written or none, so on
        // an error every row comes back.
        let kept = rows.clone();
        let answer = self.write(TenantOp::AddUsage(rows));
        Box::pin(async move {
            let error = match answer.await {
                Ok(TenantReply::UsageAdded) => return Ok(()),
                Ok(other) => out_of_kind(other),
                Err(error) => error,
            };
            Err(UsageWriteError {
                error,
                unwritten: kept,
            })
        })
    }

    fn usage(
        &self,
        query: UsageQuery,
    ) -> BoxFuture<'_, Result<Vec<(UsageKey, UsageTotals)>, TenantStoreError>> {
        Box::pin(self.read(move |txn| read::usage(txn, &query)))
    }

    fn put_key(
        &self,
        record: KeyRecord,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        let answer = self.write(TenantOp::PutKey {
            record: Box::new(record),
            expected,
        });
        Box::pin(async move {
            match answer.await? {
                TenantReply::KeyPut(result) => result,
                other => Err(out_of_kind(other)),
            }
        })
    }

    fn key(&self, id: String) -> BoxFuture<'_, Result<Option<(KeyRecord, u64)>, TenantStoreError>> {
        Box::pin(self.read(move |txn| read::key(txn, &id)))
    }

    fn keys(&self) -> BoxFuture<'_, Result<Vec<(KeyRecord, u64)>, TenantStoreError>> {
        Box::pin(self.read(read::keys))
    }

    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, TenantStoreError>> {
        Box::pin(async move {
            let mut total = 0;
            loop {
                let op = TenantOp::Sweep {
                    now_unix_ms,
                    max: SWEEP_BATCH,
                };
                match self.write(op).await? {
                    TenantReply::Swept { removed, more } => {
                        total += removed;
                        if !more {
                            return Ok(total);
                        }
                    }
                    other => return Err(out_of_kind(other)),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests;
