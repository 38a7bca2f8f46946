//! The Node's bounded memory of accepted lease nonces (R-CRED-3, replay).

use std::collections::{BTreeMap, BTreeSet};

use super::{LEASE_NONCE_LEN, REPLAY_CACHE_CAPACITY};

/// Why [`ReplayCache::check_and_insert`] refused a nonce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    /// The nonce is held by an unexpired entry: the lease was seen before.
    #[error("nonce already seen")]
    Replayed,
    /// Every slot holds an unexpired entry. Refusing is the fail-closed
    /// choice: forgetting an entry early would reopen its replay window.
    #[error("replay cache full of unexpired entries")]
    Full,
    /// The entry would already be expired at `now`; such a lease cannot be
    /// accepted, so it is refused rather than recorded.
    #[error("entry already expired")]
    Expired,
}

/// Nonces of accepted leases, each kept until the last moment its lease
/// could still be accepted (its expiry plus the skew tolerance).
///
/// Bounded by a capacity ([`REPLAY_CACHE_CAPACITY`] by default). Expired
/// entries are evicted first; a cache full of unexpired entries refuses new
/// nonces instead of forgetting old ones. Ordered containers only, so
/// behaviour is deterministic (no hasher seeded from the OS).
///
/// The cache is process-local. A restarted Node starts empty, which is safe
/// because leases are also bound to the connection generation, which changes
/// on every registration.
#[derive(Debug, Clone)]
pub struct ReplayCache {
    capacity: usize,
    /// nonce -> the moment (Unix ms) the entry expires.
    entries: BTreeMap<[u8; LEASE_NONCE_LEN], u64>,
    /// (expiry, nonce), to evict the earliest-expiring first.
    by_expiry: BTreeSet<(u64, [u8; LEASE_NONCE_LEN])>,
}

impl Default for ReplayCache {
    fn default() -> Self {
        Self::new()
    }
}

impl ReplayCache {
    /// An empty cache holding at most [`REPLAY_CACHE_CAPACITY`] entries.
    pub fn new() -> Self {
        Self::with_capacity(REPLAY_CACHE_CAPACITY)
    }

    /// An empty cache holding at most `capacity` entries (at least one).
    pub fn with_capacity(capacity: usize) -> Self {
        ReplayCache {
            capacity: capacity.max(1),
            entries: BTreeMap::new(),
            by_expiry: BTreeSet::new(),
        }
    }

    /// The most entries this cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Entries held now (expired ones included until the next eviction).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Record `nonce` as used until `expires_at_unix_ms` (exclusive), or
    /// refuse it. Entries that expired at or before `now_unix_ms` are evicted
    /// first. `expires_at_unix_ms` must be the last moment the lease could be
    /// accepted: its `expires_at` plus the skew tolerance.
    pub fn check_and_insert(
        &mut self,
        nonce: [u8; LEASE_NONCE_LEN],
        expires_at_unix_ms: u64,
        now_unix_ms: u64,
    ) -> Result<(), ReplayError> {
        self.evict_expired(now_unix_ms);
        if self.entries.contains_key(&nonce) {
            return Err(ReplayError::Replayed);
        }
        if expires_at_unix_ms <= now_unix_ms {
            return Err(ReplayError::Expired);
        }
        if self.entries.len() >= self.capacity {
            return Err(ReplayError::Full);
        }
        self.entries.insert(nonce, expires_at_unix_ms);
        self.by_expiry.insert((expires_at_unix_ms, nonce));
        debug_assert_eq!(self.entries.len(), self.by_expiry.len());
        Ok(())
    }

    /// Drop every entry that expired at or before `now_unix_ms`.
    pub fn evict_expired(&mut self, now_unix_ms: u64) {
        while let Some(&(expires_at, nonce)) = self.by_expiry.first() {
            if expires_at > now_unix_ms {
                break;
            }
            self.by_expiry.pop_first();
            self.entries.remove(&nonce);
        }
        debug_assert_eq!(self.entries.len(), self.by_expiry.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nonce(i: u64) -> [u8; LEASE_NONCE_LEN] {
        let mut n = [0u8; LEASE_NONCE_LEN];
        n[..8].copy_from_slice(&i.to_be_bytes());
        n
    }

    #[test]
    fn a_nonce_is_accepted_once_until_it_expires() {
        let mut cache = ReplayCache::new();
        assert_eq!(cache.check_and_insert(nonce(1), 2_000, 1_000), Ok(()));
        assert_eq!(
            cache.check_and_insert(nonce(1), 2_000, 1_999),
            Err(ReplayError::Replayed)
        );
        // A different nonce is independent.
        assert_eq!(cache.check_and_insert(nonce(2), 2_000, 1_999), Ok(()));
        assert_eq!(cache.len(), 2);
        // At its expiry the entry is evicted (the lease itself is no longer acceptable then).
        cache.evict_expired(2_000);
        assert!(cache.is_empty());
    }

    #[test]
    fn an_already_expired_entry_is_refused_not_recorded() {
        let mut cache = ReplayCache::new();
        assert_eq!(
            cache.check_and_insert(nonce(1), 1_000, 1_000),
            Err(ReplayError::Expired)
        );
        assert!(cache.is_empty());
    }

    #[test]
    fn a_full_cache_of_unexpired_entries_refuses_rather_than_forgets() {
        let mut cache = ReplayCache::with_capacity(3);
        for i in 0..3 {
            assert_eq!(cache.check_and_insert(nonce(i), 10_000 + i, 0), Ok(()));
        }
        assert_eq!(
            cache.check_and_insert(nonce(99), 50_000, 1),
            Err(ReplayError::Full)
        );
        // Nothing was forgotten: every earlier nonce is still refused.
        for i in 0..3 {
            assert_eq!(
                cache.check_and_insert(nonce(i), 10_000 + i, 2),
                Err(ReplayError::Replayed)
            );
        }
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn expired_entries_are_evicted_first_to_make_room() {
        let mut cache = ReplayCache::with_capacity(3);
        assert_eq!(cache.check_and_insert(nonce(0), 100, 0), Ok(()));
        assert_eq!(cache.check_and_insert(nonce(1), 5_000, 0), Ok(()));
        assert_eq!(cache.check_and_insert(nonce(2), 5_000, 0), Ok(()));
        // At t=100 entry 0 has expired; the new nonce takes its place.
        assert_eq!(cache.check_and_insert(nonce(3), 5_000, 100), Ok(()));
        assert_eq!(cache.len(), 3);
        // The unexpired ones are still remembered.
        assert_eq!(
            cache.check_and_insert(nonce(1), 5_000, 100),
            Err(ReplayError::Replayed)
        );
    }

    #[test]
    fn the_default_cache_holds_exactly_its_named_capacity() {
        let mut cache = ReplayCache::new();
        assert_eq!(cache.capacity(), REPLAY_CACHE_CAPACITY);
        for i in 0..REPLAY_CACHE_CAPACITY as u64 {
            assert_eq!(cache.check_and_insert(nonce(i), 60_000, 0), Ok(()));
        }
        assert_eq!(cache.len(), REPLAY_CACHE_CAPACITY);
        let extra = nonce(REPLAY_CACHE_CAPACITY as u64);
        assert_eq!(
            cache.check_and_insert(extra, 60_000, 59_999),
            Err(ReplayError::Full)
        );
        // Once they expire, the cache accepts again and has dropped them all.
        assert_eq!(cache.check_and_insert(extra, 120_000, 60_000), Ok(()));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn zero_capacity_is_raised_to_one() {
        let mut cache = ReplayCache::with_capacity(0);
        assert_eq!(cache.capacity(), 1);
        assert_eq!(cache.check_and_insert(nonce(0), 10, 0), Ok(()));
        assert_eq!(
            cache.check_and_insert(nonce(1), 10, 0),
            Err(ReplayError::Full)
        );
    }
}
