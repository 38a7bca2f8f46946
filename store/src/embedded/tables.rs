//! The file's tables, and the journal's operations on them inside one
//! write transaction. Every decision is a call into
//! [`iop_core::journal`]; this module only reads and writes.

use std::ops::Bound;

use iop_core::journal::{
    CreateOutcome, EVENT_OVERHEAD_BYTES, JournalError, JournalEvent, JournalLimits, NewRecord,
    RECORD_OVERHEAD_BYTES, RecordMeta, check_append, check_create, check_finish, check_raise_epoch,
    expired,
};
use redb::{
    ReadTransaction, ReadableTable, ReadableTableMetadata, Table, TableDefinition, TableHandle,
    WriteTransaction,
};

use super::ops::{Notice, Reply, Request};
use crate::{HeldGauges, Holding, Progress};

/// Records: response id -> postcard [`RecordMeta`].
pub(super) const RECORDS: TableDefinition<'static, &str, &[u8]> = TableDefinition::new("records");
/// Stored requests: response id -> bytes.
pub(super) const REQUESTS: TableDefinition<'static, &str, &[u8]> = TableDefinition::new("requests");
/// Events: (response id, seq) -> payload. The key orders a record's events
/// by number, so "after N, at most M" is one range scan (R-JRN-2).
pub(super) const EVENTS: TableDefinition<'static, (&str, u64), &[u8]> =
    TableDefinition::new("events");
/// Idempotency keys: hashed key -> response id (R-IDEM-1).
pub(super) const KEYS: TableDefinition<'static, &[u8; 32], &str> =
    TableDefinition::new("idempotency_keys");
/// Finished records by when they expire: (expires_unix_ms, id) -> (), so a
/// sweep reads only what has expired (R-JRN-5). Running records are not in
/// it: they never expire.
pub(super) const EXPIRY: TableDefinition<'static, (u64, &str), ()> = TableDefinition::new("expiry");
/// Counters and the format version: name -> u64.
pub(super) const META: TableDefinition<'static, &str, u64> = TableDefinition::new("meta");
/// Records set aside at open because they do not decode (R-JRN-6): response
/// id -> the record's bytes as found. Their requests, events, keys and
/// index entries are removed; nothing reads them again.
pub(super) const QUARANTINE: TableDefinition<'static, &str, &[u8]> =
    TableDefinition::new("quarantined_records");

/// The layout this build writes and reads: 3, records name their owner
/// (R-TAKE-1) and their API key (R-TEN-1), and tenants' tables are there
/// ([`super::tenant`]). A file of format 1 ([`FORMAT_VERSION_UNOWNED`]) or
/// 2 ([`FORMAT_VERSION_KEYLESS`]) is upgraded at open.
pub(super) const FORMAT_VERSION: u64 = 3;
/// The format before records named their owner; its records are rewritten
/// at open with [`NO_OWNER`](iop_core::journal::NO_OWNER) and
/// [`NO_KEY_ID`](iop_core::journal::NO_KEY_ID).
pub(super) const FORMAT_VERSION_UNOWNED: u64 = 1;
/// The format before records named their API key; its records are
/// rewritten at open with [`NO_KEY_ID`](iop_core::journal::NO_KEY_ID).
pub(super) const FORMAT_VERSION_KEYLESS: u64 = 2;
pub(super) const META_FORMAT_VERSION: &str = "format_version";
/// Bytes held, as the journal's rules count them (the sum of every
/// record's `stored_bytes`), kept in the same transactions as the records.
pub(super) const META_USED_BYTES: &str = "used_bytes";

/// Why the store could not run an operation (never a rule's refusal).
#[derive(Debug, thiserror::Error)]
pub(super) enum Fault {
    /// The engine failed (I/O, a commit, a corrupt page).
    #[error("{0}")]
    Engine(#[from] redb::Error),
    /// Something in the file does not decode or contradicts the layout.
    #[error("corrupt journal file: {0}")]
    Corrupt(String),
}

macro_rules! fault_from {
    ($($t:ty),*) => {$(
        impl From<$t> for Fault {
            fn from(e: $t) -> Self {
                Fault::Engine(e.into())
            }
        }
    )*};
}
fault_from!(
    redb::StorageError,
    redb::TableError,
    redb::TransactionError,
    redb::CommitError,
    redb::SetDurabilityError
);

impl From<Fault> for JournalError {
    fn from(f: Fault) -> Self {
        JournalError::Store(f.to_string())
    }
}

pub(super) fn encode_meta(meta: &RecordMeta) -> Result<Vec<u8>, Fault> {
    postcard::to_allocvec(meta).map_err(|e| Fault::Corrupt(format!("encoding {}: {e}", meta.id)))
}

pub(super) fn decode_meta(id: &str, bytes: &[u8]) -> Result<RecordMeta, Fault> {
    let meta: RecordMeta = postcard::from_bytes(bytes)
        .map_err(|e| Fault::Corrupt(format!("record {id:?} does not decode: {e}")))?;
    if meta.id != id {
        return Err(Fault::Corrupt(format!(
            "record {id:?} is stored as {:?}",
            meta.id
        )));
    }
    Ok(meta)
}

/// Rewrite every record of a file of format `from` (1 or 2) in the
/// current format, in the opening transaction: the file is all of one
/// format, never a mix. A format-1 record is owned by
/// [`NO_OWNER`](iop_core::journal::NO_OWNER) (the one Edge that wrote the
/// file); a record of either is of no key
/// ([`NO_KEY_ID`](iop_core::journal::NO_KEY_ID)).
fn upgrade_records(txn: &WriteTransaction, from: u64) -> Result<(), Fault> {
    let mut records = txn.open_table(RECORDS)?;
    let mut upgraded = Vec::new();
    for entry in records.iter()? {
        let (_, bytes) = entry?;
        // A record that does not decode stays as it is: the scan after
        // the upgrade quarantines it (R-JRN-6).
        let meta = if from == FORMAT_VERSION_UNOWNED {
            postcard::from_bytes::<crate::legacy::RecordMetaV1>(bytes.value())
                .ok()
                .map(crate::legacy::RecordMetaV1::upgrade)
        } else {
            postcard::from_bytes::<crate::legacy::RecordMetaV2>(bytes.value())
                .ok()
                .map(crate::legacy::RecordMetaV2::upgrade)
        };
        upgraded.extend(meta);
    }
    for meta in &upgraded {
        records.insert(meta.id.as_str(), encode_meta(meta)?.as_slice())?;
    }
    drop(records);
    txn.open_table(META)?
        .insert(META_FORMAT_VERSION, FORMAT_VERSION)?;
    tracing::info!(
        event = "journal_file_upgraded",
        records = upgraded.len(),
        from,
        to = FORMAT_VERSION
    );
    Ok(())
}

pub(super) fn progress(meta: &RecordMeta) -> Progress {
    Progress {
        last_seq: meta.last_seq,
        ended: meta.terminal.is_some(),
    }
}

/// What a format check at open found.
pub(super) enum Format {
    /// The file's version is this build's.
    Current,
    /// A version this build does not know.
    Unknown(u64),
    /// redb tables, but not a journal's.
    Foreign,
}

/// Check the format version of the file, writing it into a new one, and
/// create the tables. Returns the format found and, when current, the
/// stored `used_bytes` and record count.
pub(super) fn init(txn: &WriteTransaction) -> Result<(Format, u64, u64), Fault> {
    let existing: Vec<String> = txn.list_tables()?.map(|t| t.name().to_owned()).collect();
    let version = if existing.iter().any(|n| n == META.name()) {
        txn.open_table(META)?
            .get(META_FORMAT_VERSION)?
            .map(|v| v.value())
    } else {
        None
    };
    match version {
        Some(from @ (FORMAT_VERSION_UNOWNED | FORMAT_VERSION_KEYLESS)) => {
            upgrade_records(txn, from)?
        }
        Some(v) if v != FORMAT_VERSION => return Ok((Format::Unknown(v), 0, 0)),
        None if !existing.is_empty() => return Ok((Format::Foreign, 0, 0)),
        _ => {}
    }
    let mut meta = txn.open_table(META)?;
    if version.is_none() {
        meta.insert(META_FORMAT_VERSION, FORMAT_VERSION)?;
        meta.insert(META_USED_BYTES, 0)?;
    }
    let used = meta
        .get(META_USED_BYTES)?
        .map(|v| v.value())
        .ok_or_else(|| Fault::Corrupt("no used_bytes counter".into()))?;
    drop(meta);
    let records = txn.open_table(RECORDS)?.len()?;
    txn.open_table(REQUESTS)?;
    txn.open_table(EVENTS)?;
    txn.open_table(KEYS)?;
    txn.open_table(EXPIRY)?;
    txn.open_table(QUARANTINE)?;
    super::tenant::init(txn)?;
    Ok((Format::Current, used, records))
}

/// What the scan of every record at open found.
pub(super) struct RecordScan {
    /// What each key and principal holds (R-TEN-1).
    pub(super) held: HeldGauges,
    /// The write share of each record without a terminal (its principal's,
    /// [`iop_core::journal::write_share`]).
    pub(super) shares: std::collections::HashMap<String, u64>,
    /// Records in quarantine (this scan's and earlier ones').
    pub(super) quarantined: u64,
    /// The byte count after the quarantine.
    pub(super) used_bytes: u64,
    /// Records held after the quarantine.
    pub(super) records: u64,
}

/// Read every record at open, in the opening transaction: count what
/// each key and principal holds and note the running records' shares;
/// a record that does not decode is quarantined (R-JRN-6): its bytes go
/// to [`QUARANTINE`], its request, events, key and index entries are
/// removed and its bytes uncounted, and the rest is served.
pub(super) fn scan_records(txn: &WriteTransaction, used_bytes: u64) -> Result<RecordScan, Fault> {
    let mut held = HeldGauges::new();
    let mut shares = std::collections::HashMap::new();
    let mut damaged: Vec<(String, Vec<u8>)> = Vec::new();
    let records = txn.open_table(RECORDS)?;
    for entry in records.iter()? {
        let (id, bytes) = entry?;
        match decode_meta(id.value(), bytes.value()) {
            Ok(meta) => {
                held.change_meta(None, Some(&meta));
                if meta.terminal.is_none() {
                    shares.insert(
                        meta.id.clone(),
                        iop_core::journal::write_share(&meta.principal),
                    );
                }
            }
            Err(_) => damaged.push((id.value().to_owned(), bytes.value().to_vec())),
        }
    }
    drop(records);
    let mut used_bytes = used_bytes;
    let quarantined_now = damaged.len() as u64;
    if !damaged.is_empty() {
        let mut records = txn.open_table(RECORDS)?;
        let mut requests = txn.open_table(REQUESTS)?;
        let mut events = txn.open_table(EVENTS)?;
        let mut keys = txn.open_table(KEYS)?;
        let mut expiry = txn.open_table(EXPIRY)?;
        let mut quarantine = txn.open_table(QUARANTINE)?;
        let gone: std::collections::HashSet<&str> =
            damaged.iter().map(|(id, _)| id.as_str()).collect();
        for (id, bytes) in &damaged {
            let id = id.as_str();
            // What it held, as the journal counts it: its request, its
            // events and the record's overhead.
            let mut counted = RECORD_OVERHEAD_BYTES;
            if let Some(r) = requests.remove(id)? {
                counted += r.value().len() as u64;
            }
            for ev in events.extract_from_if((id, 0)..=(id, u64::MAX), |_, _| true)? {
                let (_, payload) = ev?;
                counted += payload.value().len() as u64 + EVENT_OVERHEAD_BYTES;
            }
            used_bytes = used_bytes.saturating_sub(counted);
            records.remove(id)?;
            quarantine.insert(id, bytes.as_slice())?;
        }
        keys.retain(|_, id| !gone.contains(id))?;
        expiry.retain(|(_, id), _| !gone.contains(id))?;
        txn.open_table(META)?.insert(META_USED_BYTES, used_bytes)?;
        // R-JRN-6, R-OBS-1: counted and logged, never named.
        tracing::warn!(
            event = "journal_records_quarantined",
            records = quarantined_now,
            "records that do not decode were set aside; the rest is served"
        );
    }
    let records = txn.open_table(RECORDS)?.len()?;
    let quarantined = txn.open_table(QUARANTINE)?.len()?;
    Ok(RecordScan {
        held,
        shares,
        quarantined,
        used_bytes,
        records,
    })
}

/// The range of one record's events after `after`.
fn events_after(id: &str, after: u64) -> Option<std::ops::RangeInclusive<(&str, u64)>> {
    let first = after.checked_add(1)?;
    Some((id, first)..=(id, u64::MAX))
}

/// The tables of one write transaction, with the running byte count and
/// what the watchers will learn once it commits.
pub(super) struct WriteTables<'t> {
    txn: &'t WriteTransaction,
    limits: JournalLimits,
    records: Table<'t, &'static str, &'static [u8]>,
    requests: Table<'t, &'static str, &'static [u8]>,
    events: Table<'t, (&'static str, u64), &'static [u8]>,
    keys: Table<'t, &'static [u8; 32], &'static str>,
    expiry: Table<'t, (u64, &'static str), ()>,
    meta: Table<'t, &'static str, u64>,
    used_bytes: u64,
    dirty: bool,
    notices: Vec<Notice>,
}

/// What a batch's transaction left, once its tables are closed.
pub(super) struct BatchSummary {
    pub(super) used_bytes: u64,
    pub(super) records: u64,
    /// Something was written: the transaction must commit (and sync).
    pub(super) dirty: bool,
    pub(super) notices: Vec<Notice>,
}

impl<'t> WriteTables<'t> {
    pub(super) fn open(txn: &'t WriteTransaction, limits: JournalLimits) -> Result<Self, Fault> {
        let meta = txn.open_table(META)?;
        let used_bytes = meta
            .get(META_USED_BYTES)?
            .map(|v| v.value())
            .ok_or_else(|| Fault::Corrupt("no used_bytes counter".into()))?;
        Ok(WriteTables {
            txn,
            limits,
            records: txn.open_table(RECORDS)?,
            requests: txn.open_table(REQUESTS)?,
            events: txn.open_table(EVENTS)?,
            keys: txn.open_table(KEYS)?,
            expiry: txn.open_table(EXPIRY)?,
            meta,
            used_bytes,
            dirty: false,
            notices: Vec::new(),
        })
    }

    /// Write the byte count and close the tables.
    pub(super) fn close(mut self) -> Result<BatchSummary, Fault> {
        if self.dirty {
            self.meta.insert(META_USED_BYTES, self.used_bytes)?;
        }
        Ok(BatchSummary {
            used_bytes: self.used_bytes,
            records: self.records.len()?,
            dirty: self.dirty,
            notices: self.notices,
        })
    }

    /// Run one operation against the transaction's current state (which
    /// includes the batch's earlier operations).
    pub(super) fn apply(&mut self, request: Request) -> Result<Reply, Fault> {
        Ok(match request {
            Request::Create(record) => Reply::Create(self.create(record)?),
            Request::Append { id, epoch, events } => Reply::Meta(self.append(&id, epoch, events)?),
            Request::Finish {
                id,
                epoch,
                terminal,
            } => Reply::Meta(self.with_live(&id, |limits, meta| {
                check_finish(limits, meta, epoch, &terminal)
            })?),
            Request::RaiseEpoch {
                id,
                expected,
                owner,
            } => Reply::Meta(
                self.with_live(&id, |_, meta| check_raise_epoch(meta, expected, &owner))?,
            ),
            Request::Delete { id } => Reply::Deleted(if self.remove(&id)? {
                Ok(())
            } else {
                Err(JournalError::NotFound)
            }),
            Request::Sweep {
                now_unix_ms,
                max_records,
            } => self.sweep(now_unix_ms, max_records)?,
            Request::Tenant(op) => {
                let reply = super::tenant::apply(self.txn, op)?;
                self.dirty |= reply.accepted();
                Reply::Tenant(reply)
            }
        })
    }

    fn meta_of(&self, id: &str) -> Result<Option<RecordMeta>, Fault> {
        match self.records.get(id)? {
            None => Ok(None),
            Some(bytes) => decode_meta(id, bytes.value()).map(Some),
        }
    }

    /// Store `meta` (new or changed), keeping the byte count and the
    /// expiry index with it.
    fn put(&mut self, meta: &RecordMeta) -> Result<(), Fault> {
        let old = self.meta_of(&meta.id)?;
        if let Some(old) = &old
            && old.terminal.is_some()
        {
            self.expiry.remove((old.expires_unix_ms, old.id.as_str()))?;
        }
        if meta.terminal.is_some() {
            self.expiry
                .insert((meta.expires_unix_ms, meta.id.as_str()), ())?;
        }
        let old_bytes = old.as_ref().map_or(0, |m| m.stored_bytes);
        self.used_bytes = self
            .used_bytes
            .saturating_sub(old_bytes)
            .saturating_add(meta.stored_bytes);
        let (old_held, new_held) = (old.as_ref().map(Holding::of), Holding::of(meta));
        if old_held.as_ref() != Some(&new_held) {
            self.notices.push(Notice::Held {
                old: old_held,
                new: Some(new_held),
            });
        }
        self.records
            .insert(meta.id.as_str(), encode_meta(meta)?.as_slice())?;
        self.dirty = true;
        // The writer's queue counts a running record's writes against its
        // principal's share (R-TEN-1); it learns of it when it is created
        // and forgets it at its terminal.
        let was_running = old.as_ref().is_some_and(|m| m.terminal.is_none());
        if meta.terminal.is_none() && !was_running {
            self.notices.push(Notice::Share(
                meta.id.clone(),
                Some(iop_core::journal::write_share(&meta.principal)),
            ));
        } else if meta.terminal.is_some() && was_running {
            self.notices.push(Notice::Share(meta.id.clone(), None));
        }
        self.notices
            .push(Notice::Progress(meta.id.clone(), progress(meta)));
        Ok(())
    }

    /// Remove a record with its request, events, key and index entry.
    fn remove(&mut self, id: &str) -> Result<bool, Fault> {
        let Some(meta) = self.meta_of(id)? else {
            return Ok(false);
        };
        self.records.remove(id)?;
        self.requests.remove(id)?;
        self.events
            .retain_in((id, 0)..=(id, u64::MAX), |_, _| false)?;
        if let Some(key) = meta.idempotency_key {
            let ours = self.keys.get(&key)?.is_some_and(|v| v.value() == id);
            if ours {
                self.keys.remove(&key)?;
            }
        }
        if meta.terminal.is_some() {
            self.expiry.remove((meta.expires_unix_ms, id))?;
        }
        self.used_bytes = self.used_bytes.saturating_sub(meta.stored_bytes);
        self.dirty = true;
        self.notices.push(Notice::Gone(id.to_owned()));
        self.notices.push(Notice::Held {
            old: Some(Holding::of(&meta)),
            new: None,
        });
        Ok(true)
    }

    fn create(&mut self, record: NewRecord) -> Result<Result<CreateOutcome, JournalError>, Fault> {
        let same_id = self.meta_of(&record.id)?;
        let key_holder = match &record.idempotency_key {
            Some(key) => self.keys.get(key)?.map(|v| v.value().to_owned()),
            None => None,
        };
        let same_key = match &key_holder {
            Some(holder) => self.meta_of(holder)?,
            None => None,
        };
        let outcome = match check_create(
            record.created_unix_ms,
            &self.limits,
            self.used_bytes,
            same_id.as_ref(),
            same_key.as_ref(),
            &record,
        ) {
            Ok(outcome) => outcome,
            Err(refused) => return Ok(Err(refused)),
        };
        if let CreateOutcome::Create(meta) = &outcome {
            // An expired record under the same id, or an expired or
            // superseded one under the same key, gives way.
            self.remove(&record.id)?;
            if let Some(key) = &record.idempotency_key {
                let holder = self.keys.get(key)?.map(|v| v.value().to_owned());
                if let Some(holder) = holder {
                    self.remove(&holder)?;
                }
                self.keys.insert(key, record.id.as_str())?;
            }
            self.requests
                .insert(record.id.as_str(), record.request.as_slice())?;
            self.put(meta)?;
        }
        Ok(Ok(outcome))
    }

    fn append(
        &mut self,
        id: &str,
        epoch: u64,
        events: Vec<JournalEvent>,
    ) -> Result<Result<RecordMeta, JournalError>, Fault> {
        let Some(meta) = self.meta_of(id)? else {
            return Ok(Err(JournalError::NotFound));
        };
        let next = match check_append(&self.limits, &meta, epoch, &events) {
            Ok(next) => next,
            Err(refused) => return Ok(Err(refused)),
        };
        for event in &events {
            self.events
                .insert((id, event.seq), event.payload.as_slice())?;
        }
        self.put(&next)?;
        Ok(Ok(next))
    }

    /// A decision on the stored record (`NotFound` if there is none),
    /// stored when accepted.
    fn with_live(
        &mut self,
        id: &str,
        decide: impl FnOnce(&JournalLimits, &RecordMeta) -> Result<RecordMeta, JournalError>,
    ) -> Result<Result<RecordMeta, JournalError>, Fault> {
        let Some(meta) = self.meta_of(id)? else {
            return Ok(Err(JournalError::NotFound));
        };
        match decide(&self.limits, &meta) {
            Ok(next) => {
                self.put(&next)?;
                Ok(Ok(next))
            }
            Err(refused) => Ok(Err(refused)),
        }
    }

    /// Remove up to `max_records` expired records, reading only the part
    /// of the expiry index that is due.
    fn sweep(&mut self, now_unix_ms: u64, max_records: usize) -> Result<Reply, Fault> {
        let upper = match now_unix_ms.checked_add(1) {
            Some(next) => Bound::Excluded((next, "")),
            None => Bound::Unbounded,
        };
        let mut due: Vec<(u64, String)> = Vec::new();
        for entry in self
            .expiry
            .range::<(u64, &str)>((Bound::Unbounded, upper))?
        {
            if due.len() >= max_records {
                break;
            }
            let (key, _) = entry?;
            let (expires, id) = key.value();
            due.push((expires, id.to_owned()));
        }
        let more = due.len() >= max_records;
        let mut removed = 0;
        for (expires, id) in due {
            match self.meta_of(&id)? {
                // The rule decides, not the index (R-JRN-5).
                Some(meta) if expired(&meta, now_unix_ms) => {
                    self.remove(&id)?;
                    removed += 1;
                }
                Some(meta) if meta.terminal.is_some() && meta.expires_unix_ms == expires => {}
                _ => {
                    // An index entry no record stands behind.
                    self.expiry.remove((expires, id.as_str()))?;
                    self.dirty = true;
                }
            }
        }
        Ok(Reply::Swept { removed, more })
    }
}

/// Reads, each in its own read transaction.
pub(super) mod read {
    use super::*;

    pub(in crate::embedded) fn meta(
        txn: &ReadTransaction,
        id: &str,
    ) -> Result<Option<RecordMeta>, Fault> {
        match txn.open_table(RECORDS)?.get(id)? {
            None => Ok(None),
            Some(bytes) => decode_meta(id, bytes.value()).map(Some),
        }
    }

    pub(in crate::embedded) fn get(
        txn: &ReadTransaction,
        id: &str,
        now_unix_ms: u64,
    ) -> Result<Option<(RecordMeta, Vec<u8>)>, Fault> {
        let Some(meta) = meta(txn, id)?.filter(|m| !expired(m, now_unix_ms)) else {
            return Ok(None);
        };
        let request = txn
            .open_table(REQUESTS)?
            .get(id)?
            .map(|v| v.value().to_vec())
            .unwrap_or_default();
        Ok(Some((meta, request)))
    }

    pub(in crate::embedded) fn events(
        txn: &ReadTransaction,
        id: &str,
        after: u64,
        max: usize,
    ) -> Result<Result<Vec<JournalEvent>, JournalError>, Fault> {
        if txn.open_table(RECORDS)?.get(id)?.is_none() {
            return Ok(Err(JournalError::NotFound));
        }
        let Some(range) = events_after(id, after) else {
            return Ok(Ok(Vec::new()));
        };
        let table = txn.open_table(EVENTS)?;
        let mut out = Vec::new();
        for entry in table.range(range)? {
            if out.len() >= max {
                break;
            }
            let (key, payload) = entry?;
            out.push(JournalEvent {
                seq: key.value().1,
                payload: payload.value().to_vec(),
            });
        }
        Ok(Ok(out))
    }

    pub(in crate::embedded) fn unfinished(txn: &ReadTransaction) -> Result<Vec<RecordMeta>, Fault> {
        let mut out = Vec::new();
        for entry in txn.open_table(RECORDS)?.iter()? {
            let (id, bytes) = entry?;
            // A record that stopped decoding since the open is skipped
            // here, never fatal to the scan (R-JRN-6); the next open
            // quarantines it.
            if let Ok(meta) = decode_meta(id.value(), bytes.value())
                && meta.terminal.is_none()
            {
                out.push(meta);
            }
        }
        Ok(out)
    }
}

/// The most problems a [`verify`] lists.
const MAX_PROBLEMS: usize = 100;

/// What [`EmbeddedStore::verify`](crate::EmbeddedStore::verify) found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VerifyReport {
    /// Records held.
    pub records: u64,
    /// Events held.
    pub events: u64,
    /// The stored byte count.
    pub used_bytes: u64,
    /// Records in quarantine (R-JRN-6): set aside at an open because they
    /// did not decode.
    pub quarantined: u64,
    /// Every way the file contradicts the journal's invariants (at most
    /// 100 listed); empty for a sound file.
    pub problems: Vec<String>,
}

impl VerifyReport {
    fn problem(&mut self, p: String) {
        if self.problems.len() < MAX_PROBLEMS {
            self.problems.push(p);
        }
    }
}

/// Check every invariant the journal's rules promise on the stored file:
/// each record's events are exactly 1..=last_seq (R-JRN-2; so none past a
/// terminal, R-JRN-4), its `stored_bytes` is what its request and events
/// count, `used_bytes` is the sum over records (R-JRN-5), every key names
/// the record that holds it (R-IDEM-1), the expiry index lists exactly the
/// finished records, and no event, request or key is left without its
/// record.
pub(super) fn verify(txn: &ReadTransaction) -> Result<VerifyReport, Fault> {
    let records = txn.open_table(RECORDS)?;
    let requests = txn.open_table(REQUESTS)?;
    let events = txn.open_table(EVENTS)?;
    let keys = txn.open_table(KEYS)?;
    let expiry = txn.open_table(EXPIRY)?;
    let meta = txn.open_table(META)?;
    let quarantined = txn.open_table(QUARANTINE)?;
    let mut report = VerifyReport {
        quarantined: quarantined.len()?,
        used_bytes: meta
            .get(META_USED_BYTES)?
            .map(|v| v.value())
            .ok_or_else(|| Fault::Corrupt("no used_bytes counter".into()))?,
        ..VerifyReport::default()
    };
    let mut sum = 0u64;
    let mut finished = 0u64;
    for entry in records.iter()? {
        let (id, bytes) = entry?;
        let id = id.value();
        let m = match decode_meta(id, bytes.value()) {
            Ok(m) => m,
            Err(e) => {
                report.problem(e.to_string());
                continue;
            }
        };
        report.records += 1;
        sum = sum.saturating_add(m.stored_bytes);
        let mut counted = RECORD_OVERHEAD_BYTES;
        match requests.get(id)? {
            Some(r) => counted += r.value().len() as u64,
            None => report.problem(format!("{id}: no stored request")),
        }
        let mut expected = 1u64;
        for ev in events.range((id, 0)..=(id, u64::MAX))? {
            let (key, payload) = ev?;
            let seq = key.value().1;
            if seq != expected {
                report.problem(format!("{id}: event {seq} where {expected} was due"));
            }
            expected = seq.saturating_add(1);
            counted += payload.value().len() as u64 + EVENT_OVERHEAD_BYTES;
            report.events += 1;
        }
        if expected - 1 != m.last_seq {
            report.problem(format!(
                "{id}: events end at {}, the record at {}",
                expected - 1,
                m.last_seq
            ));
        }
        if counted != m.stored_bytes {
            report.problem(format!(
                "{id}: stored_bytes {} but its request and events count {counted}",
                m.stored_bytes
            ));
        }
        if let Some(key) = m.idempotency_key
            && keys.get(&key)?.is_none_or(|v| v.value() != id)
        {
            report.problem(format!("{id}: its idempotency key names another record"));
        }
        if m.terminal.is_some() {
            finished += 1;
            if expiry.get((m.expires_unix_ms, id))?.is_none() {
                report.problem(format!("{id}: finished but not in the expiry index"));
            }
        }
    }
    if sum != report.used_bytes {
        report.problem(format!(
            "used_bytes is {} but the records hold {sum}",
            report.used_bytes
        ));
    }
    if expiry.len()? != finished {
        report.problem(format!(
            "the expiry index has {} entries for {finished} finished records",
            expiry.len()?
        ));
    }
    if events.len()? != report.events {
        report.problem(format!(
            "{} events belong to no record",
            events.len()? - report.events
        ));
    }
    if requests.len()? != report.records {
        report.problem("requests without a record".into());
    }
    for entry in keys.iter()? {
        let (_, id) = entry?;
        if records.get(id.value())?.is_none() {
            report.problem(format!(
                "an idempotency key names {:?}, which is gone",
                id.value()
            ));
        }
    }
    Ok(report)
}
