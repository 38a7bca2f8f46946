//! The runtime keys as this store knows them: every key of the keys
//! bucket, kept by a bucket watch (and this store's own writes and
//! reads), so that listing them — which every Edge does every few
//! seconds (R-TEN-4's `key_sync_ms`) — costs no round trip. Revisions
//! order everything: a value older than the one held is ignored.

use std::collections::HashMap;
use std::sync::Mutex;

use async_nats::jetstream;
use iop_core::tenant::keys::KeyRecord;

use super::layout::decode_key;
use crate::follow::{Follower, is_marker};

/// Keys a book holds at most; past it a new key is not learnt (and says
/// so in the log): far beyond what one deployment's admins create.
pub(crate) const MAX_BOOK_KEYS: usize = 1_000_000;

#[derive(Debug, Default)]
pub(crate) struct KeyBook {
    /// By the key's bucket key (`k.<token>`): its record and revision.
    keys: HashMap<String, (KeyRecord, u64)>,
    /// The last revision the bucket watch delivered.
    followed: u64,
}

impl KeyBook {
    /// `record` is stored under bucket key `key` at `revision`.
    pub(crate) fn put(&mut self, key: &str, record: KeyRecord, revision: u64) {
        let full = self.keys.len() >= MAX_BOOK_KEYS;
        match self.keys.get_mut(key) {
            Some(known) if known.1 >= revision => {}
            Some(known) => *known = (record, revision),
            None if full => {
                tracing::warn!(key, "the key book is full: a key is not learnt");
            }
            None => {
                self.keys.insert(key.to_owned(), (record, revision));
            }
        }
    }

    /// The key under `key` was removed by the marker at `revision`.
    pub(crate) fn remove(&mut self, key: &str, revision: u64) {
        if self.keys.get(key).is_some_and(|k| k.1 < revision) {
            self.keys.remove(key);
        }
    }

    /// Every key with its revision, by id.
    pub(crate) fn all(&self) -> Vec<(KeyRecord, u64)> {
        let mut all: Vec<_> = self.keys.values().cloned().collect();
        all.sort_by(|a, b| a.0.id.cmp(&b.0.id));
        all
    }
}

pub(crate) fn lock(book: &Mutex<KeyBook>) -> std::sync::MutexGuard<'_, KeyBook> {
    // Every change is one insert or remove: consistent after a panic.
    book.lock().unwrap_or_else(|e| e.into_inner())
}

/// The keys bucket's watch feeding a [`KeyBook`].
pub(crate) struct KeyFollower {
    pub(crate) book: std::sync::Arc<Mutex<KeyBook>>,
    /// `$KV.<keys bucket>.`
    pub(crate) kv_prefix: String,
}

impl Follower for KeyFollower {
    fn apply(&self, message: &jetstream::Message) {
        let revision = match message.info() {
            Ok(info) => info.stream_sequence,
            Err(e) => {
                tracing::warn!(error = %e, "key watch: a message without metadata");
                return;
            }
        };
        let mut book = lock(&self.book);
        if let Some(key) = message.subject.as_str().strip_prefix(&self.kv_prefix) {
            if is_marker(message.headers.as_ref()) {
                book.remove(key, revision);
            } else {
                match decode_key(&message.payload) {
                    Ok(record) => book.put(key, record, revision),
                    Err(e) => tracing::warn!(key, error = %e, "key watch: an unreadable key"),
                }
            }
        }
        book.followed = book.followed.max(revision);
    }

    fn followed_revision(&self) -> u64 {
        lock(&self.book).followed
    }
}

#[cfg(test)]
mod tests {
    use iop_core::tenant::Limits;

    use super::*;

    fn record(name: &str) -> KeyRecord {
        KeyRecord {
            id: format!("key_{name}"),
            principal: "p".into(),
            name: Some(name.into()),
            secret_sha256: "00".repeat(32),
            models: vec!["*".into()],
            limits: Limits::default(),
            expires_unix_ms: None,
            revoked_unix_ms: None,
            created_unix_ms: 1,
            updated_unix_ms: 1,
        }
    }

    #[test]
    fn a_book_keeps_the_newest_revision_of_each_key_and_lists_by_id() {
        let mut book = KeyBook::default();
        book.put("k.key_b", record("b"), 5);
        book.put("k.key_a", record("a"), 3);
        let mut older = record("b");
        older.name = Some("older".into());
        book.put("k.key_b", older, 4);
        let all = book.all();
        assert_eq!(
            all.iter()
                .map(|(r, rev)| (r.id.as_str(), *rev))
                .collect::<Vec<_>>(),
            [("key_a", 3), ("key_b", 5)]
        );
        assert_eq!(all[1].0.name.as_deref(), Some("b"));
        book.remove("k.key_a", 2);
        assert_eq!(book.all().len(), 2, "a marker older than the value");
        book.remove("k.key_a", 9);
        assert_eq!(book.all().len(), 1);
    }
}
