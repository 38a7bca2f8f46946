//! The journal store as it is open now (R-JRN-6): every task of the Edge
//! holds the slot's two handles ([`SlotJournal`], [`SlotTenants`]), never
//! the store behind them, so a store opened after the Edge started, or
//! opened again after a failure, is used at once, and while none is open
//! every operation is refused at once with the store's state
//! ([`JournalError::Unavailable`], [`TenantStoreError::Unavailable`]).
//!
//! The slot decides nothing: [`super::keeper`] carries out
//! [`iop_core::journal::availability::Availability`] and fills or empties
//! it.

use std::sync::{Arc, Mutex, PoisonError};

use iop_core::journal::availability::StoreState;
use iop_core::journal::{
    CreateOutcome, EdgeLease, JournalError, JournalEvent, NewRecord, RecordMeta, StoredLease,
    Terminal,
};
use iop_core::tenant::keys::KeyRecord;
use iop_core::tenant::usage::{UsageKey, UsageQuery, UsageTotals};
use iop_core::tenant::{CounterKey, Held, Subject};
use iop_store::{
    BoxFuture, JournalStore, Progress, StoreStats, StoredRecord, TenantStore, TenantStoreError,
    UsageWriteError,
};
use tokio::sync::watch;

/// A store that is open: the journal and the tenants' state in it.
#[derive(Clone)]
pub(crate) struct Opened {
    pub(crate) journal: Arc<dyn JournalStore>,
    pub(crate) tenants: Arc<dyn TenantStore>,
}

struct Current {
    opened: Option<Opened>,
    state: StoreState,
}

/// The store open now, if any, and where it stands.
pub(crate) struct StoreSlot {
    current: Mutex<Current>,
}

impl StoreSlot {
    /// An empty slot: the store is being connected.
    pub(crate) fn connecting() -> Self {
        StoreSlot {
            current: Mutex::new(Current {
                opened: None,
                state: StoreState::Connecting,
            }),
        }
    }

    /// A slot holding `opened`, up (a store handed over already open).
    pub(crate) fn open(opened: Opened) -> Self {
        StoreSlot {
            current: Mutex::new(Current {
                opened: Some(opened),
                state: StoreState::Up,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Current> {
        // Each change replaces the whole value.
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Put `opened` in: it serves from now on.
    pub(crate) fn fill(&self, opened: Opened) {
        let mut c = self.lock();
        c.opened = Some(opened);
        c.state = StoreState::Up;
    }

    /// Take the store out (it is closed once the operations in flight on
    /// it end); `state` says why every operation is refused meanwhile.
    pub(crate) fn empty(&self, state: StoreState) -> Option<Opened> {
        let mut c = self.lock();
        c.state = state;
        c.opened.take()
    }

    /// Where the store stands.
    pub(crate) fn state(&self) -> StoreState {
        self.lock().state
    }

    /// The journal open now, or why there is none.
    pub(crate) fn journal(&self) -> Result<Arc<dyn JournalStore>, JournalError> {
        let c = self.lock();
        c.opened
            .as_ref()
            .map(|o| o.journal.clone())
            .ok_or(JournalError::Unavailable(c.state))
    }

    fn tenants(&self) -> Result<Arc<dyn TenantStore>, TenantStoreError> {
        let c = self.lock();
        c.opened.as_ref().map(|o| o.tenants.clone()).ok_or_else(|| {
            TenantStoreError::Unavailable(format!(
                "the deployment's store is not open ({})",
                c.state.as_str()
            ))
        })
    }
}

/// The journal through the slot (see the module docs).
pub(crate) struct SlotJournal(pub(crate) Arc<StoreSlot>);

/// Run `f` on the journal open now, or refuse at once.
fn with_journal<'a, T: Send + 'a>(
    slot: &StoreSlot,
    f: impl FnOnce(Arc<dyn JournalStore>) -> BoxFuture<'a, Result<T, JournalError>>,
) -> BoxFuture<'a, Result<T, JournalError>> {
    match slot.journal() {
        Ok(store) => f(store),
        Err(e) => Box::pin(async move { Err(e) }),
    }
}

impl JournalStore for SlotJournal {
    fn create(&self, record: NewRecord) -> BoxFuture<'_, Result<CreateOutcome, JournalError>> {
        with_journal(&self.0, |s| Box::pin(async move { s.create(record).await }))
    }

    fn append(
        &self,
        id: String,
        epoch: u64,
        events: Vec<JournalEvent>,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        with_journal(&self.0, |s| {
            Box::pin(async move { s.append(id, epoch, events).await })
        })
    }

    fn finish(
        &self,
        id: String,
        epoch: u64,
        terminal: Terminal,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        with_journal(&self.0, |s| {
            Box::pin(async move { s.finish(id, epoch, terminal).await })
        })
    }

    fn raise_epoch(
        &self,
        id: String,
        expected: u64,
        owner: String,
    ) -> BoxFuture<'_, Result<RecordMeta, JournalError>> {
        with_journal(&self.0, |s| {
            Box::pin(async move { s.raise_epoch(id, expected, owner).await })
        })
    }

    fn get(
        &self,
        id: String,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<Option<StoredRecord>, JournalError>> {
        with_journal(&self.0, |s| {
            Box::pin(async move { s.get(id, now_unix_ms).await })
        })
    }

    fn events(
        &self,
        id: String,
        after: u64,
        max: usize,
    ) -> BoxFuture<'_, Result<Vec<JournalEvent>, JournalError>> {
        with_journal(&self.0, |s| {
            Box::pin(async move { s.events(id, after, max).await })
        })
    }

    fn delete(&self, id: String) -> BoxFuture<'_, Result<(), JournalError>> {
        with_journal(&self.0, |s| Box::pin(async move { s.delete(id).await }))
    }

    fn unfinished(&self) -> BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>> {
        with_journal(&self.0, |s| Box::pin(async move { s.unfinished().await }))
    }

    fn unfinished_hint(&self) -> BoxFuture<'_, Result<Vec<RecordMeta>, JournalError>> {
        with_journal(&self.0, |s| {
            Box::pin(async move { s.unfinished_hint().await })
        })
    }

    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, JournalError>> {
        with_journal(&self.0, |s| {
            Box::pin(async move { s.sweep(now_unix_ms).await })
        })
    }

    fn watch(&self, id: String) -> BoxFuture<'_, Result<watch::Receiver<Progress>, JournalError>> {
        with_journal(&self.0, |s| Box::pin(async move { s.watch(id).await }))
    }

    fn stats(&self) -> StoreStats {
        self.0.journal().map(|s| s.stats()).unwrap_or_default()
    }

    fn needs_reopen(&self) -> bool {
        self.0.journal().is_ok_and(|s| s.needs_reopen())
    }

    fn put_lease(
        &self,
        lease: EdgeLease,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, JournalError>> {
        with_journal(&self.0, |s| {
            Box::pin(async move { s.put_lease(lease, expected).await })
        })
    }

    fn lease(&self, edge_id: String) -> BoxFuture<'_, Result<Option<StoredLease>, JournalError>> {
        with_journal(&self.0, |s| Box::pin(async move { s.lease(edge_id).await }))
    }

    fn leases(&self) -> BoxFuture<'_, Result<Vec<StoredLease>, JournalError>> {
        with_journal(&self.0, |s| Box::pin(async move { s.leases().await }))
    }

    fn held(&self, subject: &Subject) -> Held {
        // Nothing open: a durable request is refused at its create anyway.
        self.0
            .journal()
            .map(|s| s.held(subject))
            .unwrap_or_default()
    }
}

/// The tenants' state through the slot (see the module docs).
pub(crate) struct SlotTenants(pub(crate) Arc<StoreSlot>);

/// Run `f` on the tenants' store open now, or refuse at once.
fn with_tenants<'a, T: Send + 'a>(
    slot: &StoreSlot,
    f: impl FnOnce(Arc<dyn TenantStore>) -> BoxFuture<'a, Result<T, TenantStoreError>>,
) -> BoxFuture<'a, Result<T, TenantStoreError>> {
    match slot.tenants() {
        Ok(store) => f(store),
        Err(e) => Box::pin(async move { Err(e) }),
    }
}

impl TenantStore for SlotTenants {
    fn claim(
        &self,
        counter: CounterKey,
        amount: u64,
        limit: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        with_tenants(&self.0, |s| {
            Box::pin(async move { s.claim(counter, amount, limit).await })
        })
    }

    fn claimed(&self, counter: CounterKey) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        with_tenants(&self.0, |s| {
            Box::pin(async move { s.claimed(counter).await })
        })
    }

    fn hold_slots(
        &self,
        ask: iop_core::tenant::slots::SlotAsk,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        with_tenants(&self.0, |s| {
            Box::pin(async move { s.hold_slots(ask).await })
        })
    }

    fn give_back(
        &self,
        counter: CounterKey,
        holder: String,
        amount: u64,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<iop_core::tenant::GiveBackOutcome, TenantStoreError>> {
        with_tenants(&self.0, |s| {
            Box::pin(async move { s.give_back(counter, holder, amount, now_unix_ms).await })
        })
    }

    fn slots(
        &self,
        counter: CounterKey,
    ) -> BoxFuture<'_, Result<iop_core::tenant::slots::SlotBook, TenantStoreError>> {
        with_tenants(&self.0, |s| Box::pin(async move { s.slots(counter).await }))
    }

    fn add_usage(
        &self,
        rows: Vec<(UsageKey, UsageTotals)>,
    ) -> BoxFuture<'_, Result<(), UsageWriteError>> {
        match self.0.tenants() {
            Ok(s) => Box::pin(async move { s.add_usage(rows).await }),
            Err(error) => Box::pin(async move {
                Err(UsageWriteError {
                    error,
                    unwritten: rows,
                })
            }),
        }
    }

    fn usage(
        &self,
        query: UsageQuery,
    ) -> BoxFuture<'_, Result<Vec<(UsageKey, UsageTotals)>, TenantStoreError>> {
        with_tenants(&self.0, |s| Box::pin(async move { s.usage(query).await }))
    }

    fn put_key(
        &self,
        record: KeyRecord,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        with_tenants(&self.0, |s| {
            Box::pin(async move { s.put_key(record, expected).await })
        })
    }

    fn key(&self, id: String) -> BoxFuture<'_, Result<Option<(KeyRecord, u64)>, TenantStoreError>> {
        with_tenants(&self.0, |s| Box::pin(async move { s.key(id).await }))
    }

    fn keys(&self) -> BoxFuture<'_, Result<Vec<(KeyRecord, u64)>, TenantStoreError>> {
        with_tenants(&self.0, |s| Box::pin(async move { s.keys().await }))
    }

    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, TenantStoreError>> {
        with_tenants(&self.0, |s| {
            Box::pin(async move { s.sweep(now_unix_ms).await })
        })
    }
}

#[cfg(test)]
mod tests {
    use iop_core::journal::JournalLimits;
    use iop_store::{MemoryStore, MemoryTenantStore};

    use super::*;

    #[tokio::test]
    async fn an_empty_slot_refuses_at_once_with_the_stores_state_and_a_filled_one_serves() {
        let slot = Arc::new(StoreSlot::connecting());
        let journal = SlotJournal(slot.clone());
        let tenants = SlotTenants(slot.clone());
        assert_eq!(
            journal.get("r".into(), 0).await,
            Err(JournalError::Unavailable(StoreState::Connecting))
        );
        assert!(matches!(
            tenants.keys().await,
            Err(TenantStoreError::Unavailable(_))
        ));
        assert_eq!(journal.stats(), StoreStats::default());
        let store: Arc<dyn JournalStore> = Arc::new(MemoryStore::new(JournalLimits::default()));
        slot.fill(Opened {
            journal: store.clone(),
            tenants: Arc::new(MemoryTenantStore::new()),
        });
        assert_eq!(journal.get("r".into(), 0).await, Ok(None));
        assert_eq!(tenants.keys().await, Ok(Vec::new()));
        // Emptied to be opened again: refused with that state, and the
        // store itself is handed back to be closed.
        assert!(slot.empty(StoreState::Reopening).is_some());
        assert_eq!(
            journal.unfinished().await,
            Err(JournalError::Unavailable(StoreState::Reopening))
        );
    }
}
