//! What one store knows of every record in the bucket: the latest value
//! and revision of each (from its own commits, its reads and the bucket
//! watch), the bytes they hold, and the local followers of each.
//!
//! It is a cache ordered by revision, never the truth: every decision is
//! committed by a compare-and-set on the bucket, which refuses one made on
//! a stale value. It gives the store what must not cost a round trip:
//! `used_bytes` for [`check_create`](iop_core::journal::check_create),
//! [`stats`](iop_store::JournalStore::stats), and the progress
//! of every watched record, changed by the same call that commits a write
//! (so a watcher has seen an append when it returns) or as soon as the
//! bucket watch delivers another Edge's write.
//!
//! Revisions order everything: a value older than the one held is
//! ignored, and a record this store deleted leaves a tombstone (the
//! delete marker's revision) that hides older values the bucket watch may
//! still deliver, until the watch has passed that marker.
//!
//! It is an index, not a copy of the bucket: a running record is kept
//! whole (the takeover scan reads its meta, its writer decides on it
//! without a round trip), a finished one only as what the directory
//! counts, sweeps and follows ([`Finished`]: its numbers, and its
//! principal and key interned), about a tenth of its value: an Edge's
//! memory grows with the records it retains by that much, not by their
//! requests' metadata, terminal messages and request parts. A finished
//! record's whole value is read from the bucket when asked for.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use iop_core::journal::{RecordMeta, expired};
use iop_store::{Held, HeldGauges, Progress, Subject};
use tokio::sync::watch;

use crate::layout::RecordValue;

/// The most delete markers remembered for purging; past it new ones are
/// not remembered (they stay in the bucket, a few dozen bytes each).
pub(crate) const MAX_MARKERS: usize = 1_000_000;

#[derive(Debug)]
struct Known {
    revision: u64,
    entry: Entry,
}

/// What the directory keeps of one record.
#[derive(Debug)]
enum Entry {
    /// Without a terminal: the whole value.
    Running(Box<RecordValue>),
    /// Finished: what is counted, swept and followed.
    Finished(Finished),
}

/// A finished record in the index.
#[derive(Debug)]
struct Finished {
    incarnation: u64,
    last_seq: u64,
    stored_bytes: u64,
    expires_unix_ms: u64,
    /// Interned ([`Directory::intern`]): one allocation per principal.
    principal: Arc<str>,
    /// Interned; [`iop_core::journal::NO_KEY_ID`] for none.
    key_id: Arc<str>,
}

impl Entry {
    fn stored_bytes(&self) -> u64 {
        match self {
            Entry::Running(v) => v.meta.stored_bytes,
            Entry::Finished(f) => f.stored_bytes,
        }
    }

    fn incarnation(&self) -> u64 {
        match self {
            Entry::Running(v) => v.incarnation,
            Entry::Finished(f) => f.incarnation,
        }
    }

    fn progress(&self) -> Progress {
        match self {
            Entry::Running(v) => progress(&v.meta),
            Entry::Finished(f) => Progress {
                last_seq: f.last_seq,
                ended: true,
            },
        }
    }

    /// What it holds against whom (R-TEN-1).
    fn holding(&self) -> (&str, &str, Held) {
        match self {
            Entry::Running(v) => (&v.meta.principal, &v.meta.key_id, v.meta.held()),
            Entry::Finished(f) => (
                &f.principal,
                &f.key_id,
                Held {
                    journal_bytes: f.stored_bytes,
                    // A finished record holds no background response.
                    background: 0,
                },
            ),
        }
    }
}

/// A delete marker in the bucket, to purge once every follower has seen it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Marker {
    /// The bucket key it marks.
    pub key: String,
    /// Its revision.
    pub revision: u64,
    /// When it was written (server time, Unix ms).
    pub written_unix_ms: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Directory {
    /// By record token.
    records: HashMap<String, Known>,
    used_bytes: u64,
    /// Record token -> revision of the delete marker this store wrote.
    tombstones: HashMap<String, u64>,
    /// The last revision the bucket watch delivered.
    followed_revision: u64,
    watchers: HashMap<String, watch::Sender<Progress>>,
    markers: BTreeMap<u64, Marker>,
    /// The bucket keys of Edges' ownership leases, with the last revision
    /// seen (at most [`MAX_LEASE_KEYS`]).
    lease_keys: BTreeMap<String, u64>,
    /// What each key and principal holds, over the records known here
    /// (R-TEN-1).
    held: HeldGauges,
    /// Record tokens whose latest value does not decode (R-JRN-6): each
    /// is treated as absent, counted, never fatal (at most
    /// [`MAX_QUARANTINED`] remembered, the rest only counted), with the
    /// revision seen and when a sweep first saw it so.
    quarantined: HashMap<String, Quarantined>,
    /// Quarantined records past [`MAX_QUARANTINED`].
    quarantined_overflow: u64,
    /// Principals and key ids of finished records, one allocation each.
    names: HashSet<Arc<str>>,
}

/// A record quarantined (R-JRN-6): the revision that does not decode,
/// and when a sweep first saw it (Unix ms).
#[derive(Debug, Clone, Copy)]
struct Quarantined {
    revision: u64,
    seen_unix_ms: Option<u64>,
}

/// Quarantined record tokens the directory remembers at most.
pub(crate) const MAX_QUARANTINED: usize = 4096;

/// Lease keys the directory remembers at most (Edges of one deployment).
pub(crate) const MAX_LEASE_KEYS: usize = iop_core::journal::MAX_TRACKED_EDGES;

fn progress(meta: &RecordMeta) -> Progress {
    Progress {
        last_seq: meta.last_seq,
        ended: meta.terminal.is_some(),
    }
}

impl Directory {
    /// The record `tok` at `revision` does not decode (R-JRN-6): it is
    /// quarantined (what was known of it is forgotten, as if deleted);
    /// `true` the first time this store sees it so.
    pub(crate) fn quarantine(&mut self, tok: &str, revision: u64) -> bool {
        if self
            .records
            .get(tok)
            .is_some_and(|k| k.revision >= revision)
        {
            return false;
        }
        if let Some(old) = self.records.remove(tok) {
            self.used_bytes = self.used_bytes.saturating_sub(old.entry.stored_bytes());
            self.held.change_parts(Some(old.entry.holding()), None);
        }
        self.watchers.remove(tok);
        if let Some(q) = self.quarantined.get_mut(tok) {
            // Written again, still unreadable: its clock starts again.
            if q.revision != revision {
                *q = Quarantined {
                    revision,
                    seen_unix_ms: None,
                };
            }
            return false;
        }
        if self.quarantined.len() < MAX_QUARANTINED {
            self.quarantined.insert(
                tok.to_owned(),
                Quarantined {
                    revision,
                    seen_unix_ms: None,
                },
            );
        } else {
            self.quarantined_overflow += 1;
        }
        true
    }

    /// The quarantined records (token, revision) that have stayed
    /// unchanged and unreadable for `after_ms` since a sweep first saw
    /// them, at most `max` (R-JRN-6: a record nobody can read is removed
    /// once a retention has passed, as it would have expired; one a newer
    /// build writes changes meanwhile and is left alone). Stamps the ones
    /// seen for the first time with `now_unix_ms`.
    pub(crate) fn quarantined_due(
        &mut self,
        now_unix_ms: u64,
        after_ms: u64,
        max: usize,
    ) -> Vec<(String, u64)> {
        let mut due = Vec::new();
        for (tok, q) in &mut self.quarantined {
            let seen = *q.seen_unix_ms.get_or_insert(now_unix_ms);
            if due.len() < max && now_unix_ms.saturating_sub(seen) >= after_ms {
                due.push((tok.clone(), q.revision));
            }
        }
        due
    }

    /// Record `tok` is no longer quarantined at `revision` (it reads, or is
    /// gone).
    pub(crate) fn unquarantine(&mut self, tok: &str, revision: u64) {
        if self
            .quarantined
            .get(tok)
            .is_some_and(|q| q.revision <= revision)
        {
            self.quarantined.remove(tok);
        }
    }

    /// Records quarantined (R-JRN-6).
    pub(crate) fn quarantined(&self) -> u64 {
        self.quarantined.len() as u64 + self.quarantined_overflow
    }

    /// `value` is the record `tok` at `revision`.
    pub(crate) fn put(&mut self, tok: &str, revision: u64, value: &RecordValue) {
        if self.tombstones.get(tok).is_some_and(|&r| revision < r) {
            return;
        }
        if self
            .records
            .get(tok)
            .is_some_and(|k| k.revision >= revision)
        {
            return;
        }
        if !self.quarantined.is_empty() {
            self.quarantined.remove(tok);
        }
        let entry = self.entry(value);
        self.held.change_parts(
            self.records.get(tok).map(|k| k.entry.holding()),
            Some(entry.holding()),
        );
        let new_bytes = entry.stored_bytes();
        let now = entry.progress();
        let incarnation = entry.incarnation();
        let old = self
            .records
            .insert(tok.to_owned(), Known { revision, entry });
        let old_bytes = old.as_ref().map_or(0, |k| k.entry.stored_bytes());
        self.used_bytes = self.used_bytes.saturating_sub(old_bytes) + new_bytes;
        let replaced = old.is_some_and(|k| k.entry.incarnation() != incarnation);
        if replaced {
            // A new record under the same id: followers of the old one end,
            // as if it was deleted.
            self.watchers.remove(tok);
        } else if let Some(tx) = self.watchers.get(tok) {
            tx.send_if_modified(|p| {
                let changed = *p != now;
                *p = now;
                changed
            });
            if tx.receiver_count() == 0 {
                self.watchers.remove(tok);
            }
        }
    }

    /// What the index keeps of `value`.
    fn entry(&mut self, value: &RecordValue) -> Entry {
        let meta = &value.meta;
        if meta.terminal.is_none() {
            return Entry::Running(Box::new(value.clone()));
        }
        Entry::Finished(Finished {
            incarnation: value.incarnation,
            last_seq: meta.last_seq,
            stored_bytes: meta.stored_bytes,
            expires_unix_ms: meta.expires_unix_ms,
            principal: self.intern(&meta.principal),
            key_id: self.intern(&meta.key_id),
        })
    }

    /// `name`, shared by every finished record that names it. Principals
    /// and key ids are the operator's (and the admin API's) few names:
    /// the set is bounded by them, not by the records.
    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some(shared) = self.names.get(name) {
            return shared.clone();
        }
        let shared: Arc<str> = Arc::from(name);
        self.names.insert(shared.clone());
        shared
    }

    /// The record `tok` was deleted by the marker at `marker_revision`.
    pub(crate) fn delete(&mut self, tok: &str, marker_revision: u64) {
        if !self.quarantined.is_empty() {
            self.quarantined.remove(tok);
        }
        if self
            .records
            .get(tok)
            .is_some_and(|k| k.revision < marker_revision)
            && let Some(old) = self.records.remove(tok)
        {
            self.used_bytes = self.used_bytes.saturating_sub(old.entry.stored_bytes());
            self.held.change_parts(Some(old.entry.holding()), None);
            self.watchers.remove(tok);
        }
        if marker_revision > self.followed_revision {
            let r = self.tombstones.entry(tok.to_owned()).or_insert(0);
            *r = (*r).max(marker_revision);
        }
    }

    /// The bucket watch delivered everything up to `revision`.
    pub(crate) fn followed(&mut self, revision: u64) {
        if revision <= self.followed_revision {
            return;
        }
        self.followed_revision = revision;
        if !self.tombstones.is_empty() {
            self.tombstones.retain(|_, r| *r > revision);
        }
    }

    /// The last revision the bucket watch delivered.
    pub(crate) fn followed_revision(&self) -> u64 {
        self.followed_revision
    }

    /// Forget `tok` if it is still at `revision` (a read found it gone and
    /// its delete marker already purged).
    pub(crate) fn forget(&mut self, tok: &str, revision: u64) {
        if self
            .records
            .get(tok)
            .is_some_and(|k| k.revision == revision)
            && let Some(old) = self.records.remove(tok)
        {
            self.used_bytes = self.used_bytes.saturating_sub(old.entry.stored_bytes());
            self.held.change_parts(Some(old.entry.holding()), None);
            self.watchers.remove(tok);
        }
    }

    /// The latest known value of a running record `tok` and its
    /// revision; `None` for a finished one (its value is read from the
    /// bucket) or an unknown one.
    pub(crate) fn get(&self, tok: &str) -> Option<(u64, RecordValue)> {
        self.records.get(tok).and_then(|k| match &k.entry {
            Entry::Running(v) => Some((k.revision, (**v).clone())),
            Entry::Finished(_) => None,
        })
    }

    /// Follow `tok`'s progress, if it is known.
    pub(crate) fn subscribe(&mut self, tok: &str) -> Option<watch::Receiver<Progress>> {
        let known = self.records.get(tok)?;
        let now = known.entry.progress();
        Some(
            self.watchers
                .entry(tok.to_owned())
                .or_insert_with(|| watch::channel(now).0)
                .subscribe(),
        )
    }

    /// Drop followers nobody listens to.
    pub(crate) fn prune_watchers(&mut self) {
        self.watchers.retain(|_, tx| tx.receiver_count() > 0);
    }

    /// Remember a delete marker to purge later.
    pub(crate) fn marker(&mut self, marker: Marker) {
        if self.markers.len() < MAX_MARKERS {
            self.markers.insert(marker.revision, marker);
        }
    }

    /// Markers older than `grace_ms` at `now_unix_ms` that this store's
    /// watch has passed, oldest first, at most `max`.
    pub(crate) fn due_markers(&self, now_unix_ms: u64, grace_ms: u64, max: usize) -> Vec<Marker> {
        self.markers
            .values()
            .take_while(|m| m.revision <= self.followed_revision)
            .filter(|m| m.written_unix_ms.saturating_add(grace_ms) <= now_unix_ms)
            .take(max)
            .cloned()
            .collect()
    }

    pub(crate) fn marker_purged(&mut self, revision: u64) {
        self.markers.remove(&revision);
    }

    /// The lease under bucket key `key` was written at `revision`.
    pub(crate) fn lease_key(&mut self, key: &str, revision: u64) {
        if let Some(r) = self.lease_keys.get_mut(key) {
            *r = (*r).max(revision);
        } else if self.lease_keys.len() < MAX_LEASE_KEYS {
            self.lease_keys.insert(key.to_owned(), revision);
        }
    }

    /// The lease under `key` was removed by the marker at `revision`.
    pub(crate) fn lease_key_deleted(&mut self, key: &str, revision: u64) {
        if self.lease_keys.get(key).is_some_and(|&r| r < revision) {
            self.lease_keys.remove(key);
        }
    }

    /// The bucket keys of every lease known here.
    pub(crate) fn lease_keys(&self) -> Vec<String> {
        self.lease_keys.keys().cloned().collect()
    }

    /// What `subject` holds over the known records.
    pub(crate) fn held(&self, subject: &Subject) -> Held {
        self.held.held(subject)
    }

    /// Bytes of every known record, as the journal counts them.
    pub(crate) fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    pub(crate) fn records(&self) -> u64 {
        self.records.len() as u64
    }

    /// Tokens of the known records without a terminal.
    pub(crate) fn unfinished(&self) -> Vec<String> {
        self.records
            .iter()
            .filter(|(_, k)| matches!(k.entry, Entry::Running(_)))
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// The known records without a terminal.
    pub(crate) fn unfinished_metas(&self) -> Vec<RecordMeta> {
        self.records
            .values()
            .filter_map(|k| match &k.entry {
                Entry::Running(v) => Some(v.meta.clone()),
                Entry::Finished(_) => None,
            })
            .collect()
    }

    /// Tokens and revisions of the known records expired at `now_unix_ms`
    /// (only a finished record expires, R-JRN-5; each is read again and
    /// decided by [`expired`] before it is removed).
    pub(crate) fn expired(&self, now_unix_ms: u64) -> Vec<(String, u64)> {
        self.records
            .iter()
            .filter(|(_, k)| match &k.entry {
                Entry::Finished(f) => f.expires_unix_ms <= now_unix_ms,
                Entry::Running(v) => expired(&v.meta, now_unix_ms),
            })
            .map(|(t, k)| (t.clone(), k.revision))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use iop_core::journal::{JournalApi, RecordStatus, Terminal};

    use super::*;

    fn value(incarnation: u64, last_seq: u64, bytes: u64, ended: bool) -> RecordValue {
        RecordValue {
            meta: RecordMeta {
                id: "r".into(),
                principal: "p".into(),
                api: JournalApi::Responses,
                model: "m".into(),
                fingerprint: [0; 32],
                idempotency_key: None,
                background: false,
                created_unix_ms: 0,
                epoch: 1,
                last_seq,
                terminal: ended.then_some(Terminal {
                    status: RecordStatus::Completed,
                    reason: None,
                    message: None,
                    at_unix_ms: 5,
                }),
                expires_unix_ms: if ended { 10 } else { u64::MAX },
                stored_bytes: bytes,
                owner: "edge".into(),
                key_id: "k".into(),
            },
            incarnation,
            request_parts: vec![incarnation],
            events_last_msg: 0,
        }
    }

    #[test]
    fn values_apply_in_revision_order_and_count_bytes() {
        let mut d = Directory::default();
        d.put("r", 5, &value(1, 2, 300, false));
        d.put("r", 4, &value(1, 1, 280, false));
        assert_eq!(
            d.get("r").map(|(rev, v)| (rev, v.meta.last_seq)),
            Some((5, 2))
        );
        assert_eq!(d.used_bytes(), 300);
        d.put("s", 6, &value(2, 0, 256, false));
        assert_eq!((d.records(), d.used_bytes()), (2, 556));
        d.put("r", 7, &value(1, 3, 310, true));
        assert_eq!(d.used_bytes(), 566);
        assert_eq!(d.unfinished(), vec!["s".to_string()]);
        assert_eq!(d.unfinished_metas().len(), 1);
        assert_eq!(d.expired(9), vec![]);
        assert_eq!(d.expired(10), vec![("r".to_string(), 7)]);
    }

    #[test]
    fn a_deleted_record_hides_older_values_until_the_watch_passes_its_marker() {
        let mut d = Directory::default();
        d.put("r", 5, &value(1, 2, 300, false));
        let mut rx = d.subscribe("r").unwrap();
        rx.borrow_and_update();
        d.delete("r", 8);
        assert!(rx.has_changed().is_err(), "the follower ends");
        assert_eq!((d.records(), d.used_bytes()), (0, 0));
        // The watch still delivers the old value: hidden.
        d.put("r", 5, &value(1, 2, 300, false));
        d.followed(5);
        assert_eq!(d.records(), 0);
        // Past the marker the tombstone goes; a newer record shows.
        d.followed(8);
        d.put("r", 9, &value(9, 0, 256, false));
        assert_eq!(d.records(), 1);
    }

    #[test]
    fn followers_see_progress_and_end_when_the_id_is_reused() {
        let mut d = Directory::default();
        assert!(d.subscribe("r").is_none());
        d.put("r", 5, &value(1, 2, 300, false));
        let mut rx = d.subscribe("r").unwrap();
        assert_eq!(
            *rx.borrow_and_update(),
            Progress {
                last_seq: 2,
                ended: false
            }
        );
        d.put("r", 6, &value(1, 4, 330, false));
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().last_seq, 4);
        d.put("r", 7, &value(1, 4, 330, true));
        assert!(rx.borrow_and_update().ended);
        d.put("r", 9, &value(8, 0, 256, false));
        assert!(rx.has_changed().is_err());
        drop(rx);
        let rx = d.subscribe("r").unwrap();
        drop(rx);
        d.prune_watchers();
        assert!(d.watchers.is_empty());
    }

    #[test]
    fn a_finished_record_is_kept_as_an_index_entry_that_still_counts_and_follows() {
        let mut d = Directory::default();
        d.put("r", 5, &value(1, 2, 300, false));
        assert!(d.get("r").is_some(), "a running record is kept whole");
        let mut rx = d.subscribe("r").unwrap();
        rx.borrow_and_update();
        let mut done = value(1, 3, 310, true);
        done.meta.terminal.as_mut().unwrap().message = Some("x".repeat(4096));
        d.put("r", 6, &done);
        assert!(
            d.get("r").is_none(),
            "a finished one is read from the bucket"
        );
        assert!(rx.borrow_and_update().ended, "its follower sees the end");
        assert_eq!((d.records(), d.used_bytes()), (1, 310));
        assert_eq!(
            d.held(&Subject::Principal("p".into())).journal_bytes,
            310,
            "it still counts against its principal (R-TEN-1)"
        );
        assert_eq!(d.held(&Subject::Key("k".into())).journal_bytes, 310);
        assert!(d.unfinished().is_empty() && d.unfinished_metas().is_empty());
        assert_eq!(d.expired(9), vec![]);
        assert_eq!(d.expired(10), vec![("r".to_string(), 6)]);
        // Many finished records share their principal's and key's names.
        for i in 0..100 {
            d.put(&format!("s{i}"), 10 + i, &value(2 + i, 1, 256, true));
        }
        assert_eq!(d.names.len(), 2);
        let Some(Known {
            entry: Entry::Finished(f),
            ..
        }) = d.records.get("s7")
        else {
            panic!("an index entry");
        };
        assert!(Arc::ptr_eq(&f.principal, d.names.get("p").unwrap()));
        // Deleted: nothing held any more.
        d.delete("r", 200);
        assert_eq!(
            d.held(&Subject::Principal("p".into())).journal_bytes,
            25_600
        );
    }

    #[test]
    fn markers_are_due_after_their_grace_once_followed() {
        let mut d = Directory::default();
        for (revision, at) in [(3, 100), (5, 200), (9, 300)] {
            d.marker(Marker {
                key: format!("rec.{revision}"),
                revision,
                written_unix_ms: at,
            });
        }
        d.followed(5);
        let due: Vec<u64> = d
            .due_markers(1200, 1000, 10)
            .iter()
            .map(|m| m.revision)
            .collect();
        assert_eq!(due, vec![3, 5]);
        assert_eq!(d.due_markers(1150, 1000, 10).len(), 1);
        d.marker_purged(3);
        assert_eq!(d.due_markers(u64::MAX, 1000, 1)[0].revision, 5);
    }
}
