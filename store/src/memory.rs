//! A store in process memory: the journal's rules without a disk. For
//! tests and the simulator; a restart loses it.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use iop_core::journal::{
    CreateOutcome, EdgeLease, JournalError, JournalEvent, JournalLimits, NewRecord, RecordMeta,
    StoredLease, Terminal, check_append, check_create, check_finish, check_raise_epoch, expired,
};
use tokio::sync::watch;

use crate::{
    BoxFuture, Held, HeldGauges, JournalStore, LeaseTable, Progress, StoreStats, StoredRecord,
    Subject,
};

#[derive(Default)]
struct State {
    records: HashMap<String, RecordMeta>,
    requests: HashMap<String, Vec<u8>>,
    events: HashMap<String, Vec<JournalEvent>>,
    keys: HashMap<[u8; 32], String>,
    watchers: HashMap<String, watch::Sender<Progress>>,
    stats: StoreStats,
    held: HeldGauges,
}

impl State {
    fn progress(meta: &RecordMeta) -> Progress {
        Progress {
            last_seq: meta.last_seq,
            ended: meta.terminal.is_some(),
        }
    }

    /// Store `meta` and tell its watchers.
    fn put(&mut self, meta: RecordMeta) {
        self.held
            .change_meta(self.records.get(&meta.id), Some(&meta));
        let old = self.records.get(&meta.id).map_or(0, |m| m.stored_bytes);
        self.stats.used_bytes = self.stats.used_bytes - old + meta.stored_bytes;
        if let Some(tx) = self.watchers.get(&meta.id) {
            tx.send_replace(Self::progress(&meta));
            if meta.terminal.is_some() && tx.receiver_count() == 0 {
                self.watchers.remove(&meta.id);
            }
        }
        self.records.insert(meta.id.clone(), meta);
        self.stats.records = self.records.len() as u64;
        self.stats.ops += 1;
        self.stats.syncs += 1;
    }

    fn remove(&mut self, id: &str) -> bool {
        let Some(meta) = self.records.remove(id) else {
            return false;
        };
        self.held.change_meta(Some(&meta), None);
        self.stats.used_bytes -= meta.stored_bytes;
        self.stats.records = self.records.len() as u64;
        self.requests.remove(id);
        self.events.remove(id);
        if let Some(key) = meta.idempotency_key
            && self.keys.get(&key).is_some_and(|k| k == id)
        {
            self.keys.remove(&key);
        }
        self.watchers.remove(id);
        true
    }

    fn live(&self, id: &str) -> Result<&RecordMeta, JournalError> {
        self.records.get(id).ok_or(JournalError::NotFound)
    }
}

/// The in-memory [`JournalStore`].
pub struct MemoryStore {
    limits: JournalLimits,
    state: Mutex<State>,
    leases: LeaseTable,
}

impl MemoryStore {
    /// An empty store with these limits.
    pub fn new(limits: JournalLimits) -> Self {
        MemoryStore {
            limits,
            state: Mutex::new(State::default()),
            leases: LeaseTable::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent maps (every
        // mutation is a single insert/remove): keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn create_now(&self, record: NewRecord) -> Result<CreateOutcome, JournalError> {
        let mut st = self.state();
        let same_key = record
            .idempotency_key
            .and_then(|k| st.keys.get(&k))
            .and_then(|id| st.records.get(id));
        let outcome = check_create(
            record.created_unix_ms,
            &self.limits,
            st.stats.used_bytes,
            st.records.get(&record.id),
            same_key,
            &record,
        )?;
        if let CreateOutcome::Create(meta) = &outcome {
            // An expired record under the same id or key gives way.
            st.remove(&record.id);
            if let Some(old) = record
                .idempotency_key
                .and_then(|k| st.keys.get(&k).cloned())
            {
                st.remove(&old);
            }
            if let Some(key) = record.idempotency_key {
                st.keys.insert(key, record.id.clone());
            }
            st.requests.insert(record.id.clone(), record.request);
            st.events.insert(record.id.clone(), Vec::new());
            st.put(meta.clone());
        }
        Ok(outcome)
    }

    fn append_now(
        &self,
        id: &str,
        epoch: u64,
        events: Vec<JournalEvent>,
    ) -> Result<RecordMeta, JournalError> {
        let mut st = self.state();
        let next = check_append(&self.limits, st.live(id)?, epoch, &events)?;
        st.events.entry(id.to_owned()).or_default().extend(events);
        st.put(next.clone());
        Ok(next)
    }

    fn finish_now(
        &self,
        id: &str,
        epoch: u64,
        terminal: Terminal,
    ) -> Result<RecordMeta, JournalError> {
        let mut st = self.state();
        let next = check_finish(&self.limits, st.live(id)?, epoch, &terminal)?;
        st.put(next.clone());
        Ok(next)
    }

    fn raise_now(&self, id: &str, expected: u64, owner: &str) -> Result<RecordMeta, JournalError> {
        let mut st = self.state();
        let next = check_raise_epoch(st.live(id)?, expected, owner)?;
        st.put(next.clone());
        Ok(next)
    }
}

impl JournalStore for MemoryStore {
    fn create(&self, record: NewRecord) -> BoxFuture<'_, Result<CreateOutcome, JournalError>> {
        let result = self.create_now(record);
        Box::pin(async move { result })
    }

    fn append(
        &self,
        id: String,
        epoch: u64,
        events: Vec<JournalEvent>,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        let result = self.append_now(&id, epoch, events);
        Box::pin(async move { result })
    }

    fn finish(
        &self,
        id: String,
        epoch: u64,
        terminal: Terminal,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        let result = self.finish_now(&id, epoch, terminal);
        Box::pin(async move { result })
    }

    fn raise_epoch(
        &self,
        id: String,
        expected: u64,
        owner: String,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        let result = self.raise_now(&id, expected, &owner);
        Box::pin(async move { result })
    }

    fn get(
        &self,
        id: String,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<Option<StoredRecord>, JournalError>> {
        let st = self.state();
        let found = st
            .records
            .get(&id)
            .filter(|m| !expired(m, now_unix_ms))
            .map(|m| (m.clone(), st.requests.get(&id).cloned().unwrap_or_default()));
        Box::pin(async move { Ok(found) })
    }

    fn events(
        &self,
        id: String,
        after: u64,
        max: usize,
    ) -> BoxFuture<'_, Result<Vec<JournalEvent>, JournalError>> {
        let st = self.state();
        let result = match st.events.get(&id) {
            None => Err(JournalError::NotFound),
            Some(events) => Ok(events
                .iter()
                .filter(|e| e.seq > after)
                .take(max)
                .cloned()
                .collect()),
        };
        Box::pin(async move { result })
    }

    fn delete(&self, id: String) -> BoxFuture<'_, Result<(), JournalError>> {
        let removed = self.state().remove(&id);
        Box::pin(async move {
            if removed {
                Ok(())
            } else {
                Err(JournalError::NotFound)
            }
        })
    }

    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>> {
        let list = self
            .state()
            .records
            .values()
            .filter(|m| m.terminal.is_none())
            .cloned()
            .collect();
        Box::pin(async move { Ok(list) })
    }

    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, JournalError>> {
        let mut st = self.state();
        let gone: Vec<String> = st
            .records
            .values()
            .filter(|m| expired(m, now_unix_ms))
            .map(|m| m.id.clone())
            .collect();
        for id in &gone {
            st.remove(id);
        }
        let n = gone.len();
        Box::pin(async move { Ok(n) })
    }

    fn watch(&self, id: String) -> BoxFuture<'_, Result<watch::Receiver<Progress>, JournalError>> {
        let mut st = self.state();
        let result = match st.records.get(&id).map(State::progress) {
            None => Err(JournalError::NotFound),
            Some(progress) => Ok(st
                .watchers
                .entry(id)
                .or_insert_with(|| watch::channel(progress).0)
                .subscribe()),
        };
        Box::pin(async move { result })
    }

    fn stats(&self) -> StoreStats {
        self.state().stats
    }

    fn put_lease(
        &self,
        lease: EdgeLease,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, JournalError>> {
        let result = self.leases.put(lease, expected);
        Box::pin(async move { result })
    }

    fn lease(&self, edge_id: String) -> BoxFuture<'_, Result<Option<StoredLease>, JournalError>> {
        let found = self.leases.get(&edge_id);
        Box::pin(async move { Ok(found) })
    }

    fn leases(&self) -> BoxFuture<'_, Result<Vec<StoredLease>, JournalError>> {
        let all = self.leases.all();
        Box::pin(async move { Ok(all) })
    }

    fn held(&self, subject: &Subject) -> Held {
        self.state().held.held(subject)
    }
}

#[cfg(test)]
mod tests {
    use iop_core::journal::{JournalApi, RecordStatus, fingerprint, idempotency_hash};

    use super::*;

    fn record(id: &str, key: Option<&str>) -> NewRecord {
        NewRecord {
            id: id.into(),
            principal: "p".into(),
            api: JournalApi::Responses,
            model: "m".into(),
            fingerprint: fingerprint("responses", b"{}"),
            idempotency_key: key.map(|k| idempotency_hash("p", k)),
            background: false,
            request: b"{}".to_vec(),
            created_unix_ms: 1,
            owner: "edge".into(),
            key_id: "key".into(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_memory_store_conforms() {
        crate::conformance::run_all(|limits| async move { MemoryStore::new(limits) }).await;
    }

    #[tokio::test]
    async fn the_memory_store_runs_the_journal_rules() {
        let store = MemoryStore::new(JournalLimits::default());
        assert!(matches!(
            store.create(record("r1", Some("k"))).await,
            Ok(CreateOutcome::Create(_))
        ));
        assert!(matches!(
            store.create(record("r2", Some("k"))).await,
            Ok(CreateOutcome::Existing(m)) if m.id == "r1"
        ));
        let mut watch = store.watch("r1".into()).await.unwrap();
        let ev = |seq| JournalEvent {
            seq,
            payload: vec![seq as u8],
        };
        store
            .append("r1".into(), 1, vec![ev(1), ev(2)])
            .await
            .unwrap();
        assert_eq!(watch.borrow_and_update().last_seq, 2);
        assert!(store.append("r1".into(), 2, vec![ev(3)]).await.is_err());
        let terminal = Terminal {
            status: RecordStatus::Completed,
            reason: None,
            message: None,
            at_unix_ms: 10,
        };
        store.finish("r1".into(), 1, terminal).await.unwrap();
        assert!(watch.borrow().ended);
        let events = store.events("r1".into(), 1, 10).await.unwrap();
        assert_eq!(events, vec![ev(2)]);
        assert!(store.unfinished().await.unwrap().is_empty());
        let until = store
            .get("r1".into(), 0)
            .await
            .unwrap()
            .unwrap()
            .0
            .expires_unix_ms;
        assert_eq!(store.sweep(until).await.unwrap(), 1);
        assert_eq!(store.stats().used_bytes, 0);
        // The key is free again.
        assert!(matches!(
            store.create(record("r3", Some("k"))).await,
            Ok(CreateOutcome::Create(_))
        ));
    }
}
