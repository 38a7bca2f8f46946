//! Tenants' shared state (SPEC §9): the counters Edges claim their
//! allowances from (R-TEN-3), usage per day, principal, key and model
//! (R-TEN-5), and runtime API keys (R-TEN-4), behind one trait,
//! [`TenantStore`]. Every decision comes from [`iop_core::tenant`]: a claim
//! is decided by [`check_claim`] inside the store's compare-and-set (a
//! stopping Edge's give-back by [`check_give_back`], in the same one), a
//! key's validity by [`KeyRecord::usable`](iop_core::tenant::keys::KeyRecord::usable);
//! the store reads, writes and commits.
//!
//! * [`MemoryTenantStore`]: in process memory (tests, the simulator).
//! * The embedded store's tenant tables (one Edge; survive a restart).
//! * NATS JetStream key-value buckets (`iop-store-nats`; shared by Edges).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use iop_core::tenant::keys::KeyRecord;
use iop_core::tenant::slots::{SlotAsk, SlotBook};
use iop_core::tenant::usage::{UsageKey, UsageQuery, UsageTotals};
use iop_core::tenant::{
    ClaimedCounter, CounterKey, DAY_MS, GiveBackOutcome, MINUTE_MS, Meter, check_claim,
    check_give_back,
};

use crate::BoxFuture;

/// Why a tenant store operation did not happen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantStoreError {
    /// The store could not be reached or failed; nothing is known to have
    /// been written.
    #[error("tenant store unavailable: {0}")]
    Unavailable(String),
    /// A compare-and-set found another revision (`current`; 0: absent).
    #[error("the stored revision is {current}")]
    Conflict {
        /// The stored revision.
        current: u64,
    },
}

/// A usage write that did not add every row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error} ({} usage rows not written)", unwritten.len())]
pub struct UsageWriteError {
    /// Why.
    pub error: TenantStoreError,
    /// The rows not added.
    pub unwritten: Vec<(UsageKey, UsageTotals)>,
}

/// How long usage rows are kept, in days.
pub const USAGE_RETENTION_DAYS: u64 = 400;

/// Whether `counter`'s window is over at `now_unix_ms`, so the store may
/// forget it: a minute's two minutes later, a budget period's once it has
/// ended (a budget in total never).
pub fn counter_expired(counter: &CounterKey, now_unix_ms: u64) -> bool {
    match counter.meter {
        Meter::Requests | Meter::Tokens | Meter::JournalBytes | Meter::Background => {
            counter.window_unix_ms + 2 * MINUTE_MS <= now_unix_ms
        }
        // A concurrency gauge has no window: its holders' leases lapse.
        Meter::Slots => false,
        Meter::Spend => {
            counter.window_unix_ms != 0 && counter.window_unix_ms + 31 * DAY_MS <= now_unix_ms
        }
    }
}

/// Whether a usage row of `day_unix_ms` is past [`USAGE_RETENTION_DAYS`].
pub fn usage_expired(day_unix_ms: u64, now_unix_ms: u64) -> bool {
    day_unix_ms + USAGE_RETENTION_DAYS * DAY_MS <= now_unix_ms
}

/// Tenants' shared state; every method is one transaction, durable when
/// it returns `Ok`.
pub trait TenantStore: Send + Sync + 'static {
    /// Claim `amount` of `counter` whose limit is `limit`, deciding with
    /// [`check_claim`] on the counter as stored (compare-and-set; retried
    /// on a lost race): the amount granted (0: the window is exhausted).
    fn claim(
        &self,
        counter: CounterKey,
        amount: u64,
        limit: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>>;
    /// Set `ask.holder`'s (an Edge process's) holding of the concurrency
    /// gauge `ask.counter` (limit `ask.limit`) to `ask.want`, as
    /// [`SlotBook::hold`] decides on the gauge as stored at
    /// `ask.now_unix_ms` (compare-and-set; retried on a lost race), its
    /// lease running `ask.lease_ms`: what it holds now (R-TEN-1, R-TEN-3).
    fn hold_slots(&self, ask: SlotAsk) -> BoxFuture<'_, Result<u64, TenantStoreError>>;
    /// Give back `amount` of the windowed counter `counter` for `holder`
    /// (the Edge process's id, the one it holds slots as), as
    /// [`check_give_back`] decides on the counter as stored at
    /// `now_unix_ms`, in the same compare-and-set as the decrement
    /// (retried on a lost race): applied at most once per holder and
    /// counter, however often it is sent, never below zero, a no-op once
    /// the window is over (R-TEN-2, R-TEN-3).
    fn give_back(
        &self,
        counter: CounterKey,
        holder: String,
        amount: u64,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<GiveBackOutcome, TenantStoreError>>;
    /// The gauge `counter` as stored (empty: nobody holds a slot).
    fn slots(&self, counter: CounterKey) -> BoxFuture<'_, Result<SlotBook, TenantStoreError>>;
    /// What the Edges have claimed of `counter` so far (0: nothing).
    fn claimed(&self, counter: CounterKey) -> BoxFuture<'_, Result<u64, TenantStoreError>>;
    /// Add each row's totals to its stored row, each row all or nothing.
    /// On an error, the rows not added come back in [`UsageWriteError`]
    /// (the caller keeps them for its next write); a store that writes
    /// the batch in one transaction returns them all.
    fn add_usage(
        &self,
        rows: Vec<(UsageKey, UsageTotals)>,
    ) -> BoxFuture<'_, Result<(), UsageWriteError>>;
    /// The rows `query` asks for, in key order, at most `query.max_rows`.
    fn usage(
        &self,
        query: UsageQuery,
    ) -> BoxFuture<'_, Result<Vec<(UsageKey, UsageTotals)>, TenantStoreError>>;
    /// Write `record` if the stored revision of its id is `expected` (0:
    /// none stored): the new revision, greater than every earlier one.
    fn put_key(
        &self,
        record: KeyRecord,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>>;
    /// The key with `id` and its revision, read fresh.
    fn key(&self, id: String) -> BoxFuture<'_, Result<Option<(KeyRecord, u64)>, TenantStoreError>>;
    /// Every stored key with its revision.
    fn keys(&self) -> BoxFuture<'_, Result<Vec<(KeyRecord, u64)>, TenantStoreError>>;
    /// Forget the counters whose windows are over ([`counter_expired`])
    /// and usage rows past retention ([`usage_expired`]); how many. (A
    /// store whose engine expires usage rows by itself, as the NATS
    /// bucket's `max_age` does, may leave those to it and not count them.)
    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, TenantStoreError>>;
}

#[derive(Default)]
struct MemoryState {
    counters: BTreeMap<CounterKey, ClaimedCounter>,
    slots: BTreeMap<CounterKey, SlotBook>,
    usage: BTreeMap<UsageKey, UsageTotals>,
    keys: HashMap<String, (KeyRecord, u64)>,
    revision: u64,
    down: bool,
}

/// Tenants' state in process memory: for tests and the simulator (a
/// restart loses it).
#[derive(Default)]
pub struct MemoryTenantStore {
    state: Mutex<MemoryState>,
}

impl MemoryTenantStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Make every operation fail with [`TenantStoreError::Unavailable`]
    /// (`true`) or work again (`false`), as a store that cannot be reached.
    pub fn set_down(&self, down: bool) {
        self.lock().down = down;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn up(&self) -> Result<std::sync::MutexGuard<'_, MemoryState>, TenantStoreError> {
        let state = self.lock();
        if state.down {
            return Err(TenantStoreError::Unavailable("the store is down".into()));
        }
        Ok(state)
    }
}

impl TenantStore for MemoryTenantStore {
    fn claim(
        &self,
        counter: CounterKey,
        amount: u64,
        limit: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(async move {
            let mut state = self.up()?;
            let stored = state.counters.entry(counter).or_default();
            let (total, granted) = check_claim(stored.claimed, amount, limit);
            stored.claimed = total;
            Ok(granted)
        })
    }

    fn give_back(
        &self,
        counter: CounterKey,
        holder: String,
        amount: u64,
        now_unix_ms: u64,
    ) -> BoxFuture<'_, Result<GiveBackOutcome, TenantStoreError>> {
        Box::pin(async move {
            let mut state = self.up()?;
            let stored = state.counters.get(&counter).cloned().unwrap_or_default();
            let (written, outcome) =
                check_give_back(&stored, &counter, &holder, amount, now_unix_ms);
            if let Some(written) = written {
                state.counters.insert(counter, written);
            }
            Ok(outcome)
        })
    }

    fn claimed(&self, counter: CounterKey) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(async move { Ok(self.up()?.counters.get(&counter).map_or(0, |c| c.claimed)) })
    }

    fn hold_slots(&self, ask: SlotAsk) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(async move {
            let mut state = self.up()?;
            let book = state.slots.entry(ask.counter.clone()).or_default();
            Ok(book.hold_ask(&ask))
        })
    }

    fn slots(&self, counter: CounterKey) -> BoxFuture<'_, Result<SlotBook, TenantStoreError>> {
        Box::pin(async move { Ok(self.up()?.slots.get(&counter).cloned().unwrap_or_default()) })
    }

    fn add_usage(
        &self,
        rows: Vec<(UsageKey, UsageTotals)>,
    ) -> BoxFuture<'_, Result<(), UsageWriteError>> {
        Box::pin(async move {
            let mut state = match self.up() {
                Ok(state) => state,
                Err(error) => {
                    return Err(UsageWriteError {
                        error,
                        unwritten: rows,
                    });
                }
            };
            for (key, totals) in rows {
                state.usage.entry(key).or_default().add(&totals);
            }
            Ok(())
        })
    }

    fn usage(
        &self,
        query: UsageQuery,
    ) -> BoxFuture<'_, Result<Vec<(UsageKey, UsageTotals)>, TenantStoreError>> {
        Box::pin(async move {
            let state = self.up()?;
            Ok(state
                .usage
                .iter()
                .filter(|(k, _)| query.matches(k))
                .take(query.max_rows)
                .map(|(k, t)| (k.clone(), *t))
                .collect())
        })
    }

    fn put_key(
        &self,
        record: KeyRecord,
        expected: u64,
    ) -> BoxFuture<'_, Result<u64, TenantStoreError>> {
        Box::pin(async move {
            let mut state = self.up()?;
            let current = state.keys.get(&record.id).map_or(0, |(_, r)| *r);
            if current != expected {
                return Err(TenantStoreError::Conflict { current });
            }
            state.revision += 1;
            let revision = state.revision;
            state.keys.insert(record.id.clone(), (record, revision));
            Ok(revision)
        })
    }

    fn key(&self, id: String) -> BoxFuture<'_, Result<Option<(KeyRecord, u64)>, TenantStoreError>> {
        Box::pin(async move { Ok(self.up()?.keys.get(&id).cloned()) })
    }

    fn keys(&self) -> BoxFuture<'_, Result<Vec<(KeyRecord, u64)>, TenantStoreError>> {
        Box::pin(async move {
            let state = self.up()?;
            let mut keys: Vec<_> = state.keys.values().cloned().collect();
            keys.sort_by(|a, b| a.0.id.cmp(&b.0.id));
            Ok(keys)
        })
    }

    fn sweep(&self, now_unix_ms: u64) -> BoxFuture<'_, Result<usize, TenantStoreError>> {
        Box::pin(async move {
            let mut state = self.up()?;
            let before = state.counters.len() + state.usage.len();
            state
                .counters
                .retain(|k, _| !counter_expired(k, now_unix_ms));
            state
                .usage
                .retain(|k, _| !usage_expired(k.day_unix_ms, now_unix_ms));
            Ok(before - state.counters.len() - state.usage.len())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_memory_tenant_store_conforms() {
        crate::conformance::tenant::run_all(|| async {
            std::sync::Arc::new(MemoryTenantStore::new()) as std::sync::Arc<dyn TenantStore>
        })
        .await;
    }

    #[tokio::test]
    async fn a_memory_tenant_store_that_is_down_answers_unavailable_and_keeps_the_rows() {
        let store = MemoryTenantStore::new();
        store.set_down(true);
        let counter = crate::conformance::tenant::counter(
            iop_core::tenant::Subject::Key("k".into()),
            Meter::Requests,
            0,
        );
        assert!(matches!(
            store.claim(counter.clone(), 1, 10).await,
            Err(TenantStoreError::Unavailable(_))
        ));
        let row = UsageKey {
            day_unix_ms: 0,
            principal: "p".into(),
            key: "k".into(),
            model: "m".into(),
        };
        let failed = store
            .add_usage(vec![(row, UsageTotals::default())])
            .await
            .unwrap_err();
        assert_eq!(failed.unwritten.len(), 1);
        store.set_down(false);
        assert_eq!(store.claim(counter, 1, 10).await, Ok(1));
    }
}
