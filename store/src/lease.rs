//! Ownership leases kept in process memory, for the stores one process
//! opens alone (embedded, in-memory): there the only Edge is this one, and
//! its lease needs no storage that outlives it (R-TAKE-1: after a restart,
//! records this Edge owned are its previous incarnation's, whatever any
//! lease says).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use iop_core::journal::{EdgeLease, JournalError, StoredLease, check_put_lease};

/// Leases by Edge id, with revisions from one counter.
#[derive(Debug, Default)]
pub struct LeaseTable {
    state: Mutex<(BTreeMap<String, StoredLease>, u64)>,
}

impl LeaseTable {
    fn state(&self) -> MutexGuard<'_, (BTreeMap<String, StoredLease>, u64)> {
        // Each change is one insert: consistent after a panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`JournalStore::put_lease`](crate::JournalStore::put_lease).
    pub fn put(&self, lease: EdgeLease, expected: u64) -> Result<u64, JournalError> {
        let mut st = self.state();
        check_put_lease(st.0.get(&lease.edge_id), expected)?;
        st.1 += 1;
        let revision = st.1;
        st.0.insert(lease.edge_id.clone(), StoredLease { revision, lease });
        Ok(revision)
    }

    /// [`JournalStore::lease`](crate::JournalStore::lease).
    pub fn get(&self, edge_id: &str) -> Option<StoredLease> {
        self.state().0.get(edge_id).cloned()
    }

    /// [`JournalStore::leases`](crate::JournalStore::leases).
    pub fn all(&self) -> Vec<StoredLease> {
        self.state().0.values().cloned().collect()
    }
}
