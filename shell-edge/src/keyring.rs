//! Who a caller is: the API keys of the config file and the runtime keys
//! of the deployment's store (R-TEN-4), both compared only through the
//! SHA-256 of the secret.
//!
//! Runtime keys are read from the store every `[tenants] key_sync_ms`
//! (and at once after a change made on this Edge), so a key created,
//! changed or revoked through any Edge is honoured by every Edge within
//! that interval. Whether a stored key may be used is core's rule
//! ([`KeyRecord::usable`]), checked at every lookup, so an expiry takes
//! effect on time between syncs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use iop_core::tenant::keys::KeyRecord;
use iop_store::TenantStore;
use sha2::{Digest, Sha256};

use crate::config::ApiKey;

/// How long one read of the stored keys may take.
const SYNC_TIMEOUT: Duration = Duration::from_secs(5);

/// The SHA-256 of a secret.
pub fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// The SHA-256 of a secret, lower-case hex (how a key record stores it).
pub fn digest_hex(secret: &str) -> String {
    digest(secret).iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Every stored key (revoked ones too), by id, with its revision.
pub type KeyRecords = HashMap<String, (Arc<KeyRecord>, u64)>;

/// A runtime key as a lookup finds it.
#[derive(Clone)]
struct RuntimeKey {
    key: Arc<ApiKey>,
    record: Arc<KeyRecord>,
}

/// The keys of the Edge.
pub struct KeyRing {
    /// The config file's keys, by digest (shared: a request holds its key
    /// without copying it, the secret included).
    config: HashMap<[u8; 32], Arc<ApiKey>>,
    /// The stored keys as last read, by digest of their secret.
    runtime: RwLock<Arc<HashMap<[u8; 32], RuntimeKey>>>,
    /// Every stored key (revoked ones too), by id, with its revision.
    records: RwLock<Arc<KeyRecords>>,
    store: Arc<dyn TenantStore>,
    syncs: AtomicU64,
    sync_failures: AtomicU64,
    last_sync_unix_ms: AtomicU64,
}

impl KeyRing {
    /// The config file's `keys`, and the runtime keys of `store` (read by
    /// [`Self::sync`]).
    pub fn new(keys: &[ApiKey], store: Arc<dyn TenantStore>) -> Self {
        KeyRing {
            config: keys
                .iter()
                .map(|k| (digest(&k.key), Arc::new(k.clone())))
                .collect(),
            runtime: RwLock::new(Arc::new(HashMap::new())),
            records: RwLock::new(Arc::new(HashMap::new())),
            store,
            syncs: AtomicU64::new(0),
            sync_failures: AtomicU64::new(0),
            last_sync_unix_ms: AtomicU64::new(0),
        }
    }

    /// The key whose secret is `secret`, if it may be used now.
    pub fn lookup(&self, secret: &str) -> Option<Arc<ApiKey>> {
        let digest = digest(secret);
        if let Some(key) = self.config.get(&digest) {
            return Some(key.clone());
        }
        let runtime = self
            .runtime
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let found = runtime.get(&digest)?;
        found
            .record
            .usable(iop_transport::clock::unix_ms())
            .ok()
            .map(|()| found.key.clone())
    }

    /// Whether a config file key has id `id`.
    pub fn is_config_key(&self, id: &str) -> bool {
        self.config.values().any(|k| k.id == id)
    }

    /// The limits of the key whose id is `id` (a config file key, or a
    /// stored one even if revoked since), if this Edge knows it: what a
    /// taken-over request of that key is held to (R-TEN-2).
    pub fn limits_of(&self, id: &str) -> Option<iop_core::tenant::Limits> {
        if let Some(key) = self.config.values().find(|k| k.id == id) {
            return Some(key.limits.clone());
        }
        self.records()
            .get(id)
            .map(|(record, _)| record.limits.clone())
    }

    /// The config file's keys.
    pub fn config_keys(&self) -> impl Iterator<Item = &ApiKey> {
        self.config.values().map(|k| &**k)
    }

    /// Every stored key as last read, with its revision, by id.
    pub fn records(&self) -> Arc<KeyRecords> {
        self.records
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Read the stored keys now; how many may be used.
    pub async fn sync(&self) -> Result<usize, iop_store::TenantStoreError> {
        let read = tokio::time::timeout(SYNC_TIMEOUT, self.store.keys()).await;
        let stored = match read {
            Ok(Ok(stored)) => stored,
            Ok(Err(e)) => {
                self.sync_failures.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
            Err(_) => {
                self.sync_failures.fetch_add(1, Ordering::Relaxed);
                return Err(iop_store::TenantStoreError::Unavailable(
                    "the store did not answer in time".into(),
                ));
            }
        };
        self.install(stored);
        Ok(self.runtime.read().unwrap_or_else(|e| e.into_inner()).len())
    }

    /// Use `stored` as the runtime keys.
    fn install(&self, stored: Vec<(KeyRecord, u64)>) {
        let mut runtime = HashMap::with_capacity(stored.len());
        let mut records = HashMap::with_capacity(stored.len());
        for (record, revision) in stored {
            let record = Arc::new(record);
            records.insert(record.id.clone(), (record.clone(), revision));
            // A config key's id wins: a stored key cannot stand in for it.
            if record.revoked_unix_ms.is_some() || self.is_config_key(&record.id) {
                continue;
            }
            let Some(digest) = from_hex(&record.secret_sha256) else {
                tracing::warn!(event = "edge_runtime_key_unreadable", key = %record.id);
                continue;
            };
            let key = ApiKey {
                principal: record.principal.clone(),
                key: String::new(),
                models: record.models.clone(),
                admin: false,
                id: record.id.clone(),
                limits: record.limits.clone(),
            };
            runtime.insert(
                digest,
                RuntimeKey {
                    key: Arc::new(key),
                    record,
                },
            );
        }
        *self.runtime.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(runtime);
        *self.records.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(records);
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.last_sync_unix_ms
            .store(iop_transport::clock::unix_ms(), Ordering::Relaxed);
    }

    /// Read the stored keys every `every` until the task is dropped; a
    /// failed read keeps the keys last read (and is counted and logged).
    pub fn spawn_sync(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let ring = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            loop {
                tick.tick().await;
                match ring.sync().await {
                    Ok(_) if failing => {
                        failing = false;
                        tracing::info!(event = "edge_runtime_keys_synced_again");
                    }
                    Ok(_) => {}
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(event = "edge_runtime_keys_sync_failed", error = %e, "the keys last read stay in use");
                    }
                    Err(_) => {}
                }
            }
        })
    }

    /// What `/status` shows of the keys.
    pub fn status(&self) -> serde_json::Value {
        let records = self.records();
        let now = iop_transport::clock::unix_ms();
        let usable = records
            .values()
            .filter(|(r, _)| r.usable(now).is_ok())
            .count();
        serde_json::json!({
            "config_keys": self.config.len(),
            "runtime_keys": records.len(),
            "runtime_keys_usable": usable,
            "syncs": self.syncs.load(Ordering::Relaxed),
            "sync_failures": self.sync_failures.load(Ordering::Relaxed),
            "last_sync_unix_ms": self.last_sync_unix_ms.load(Ordering::Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iop_store::MemoryTenantStore;

    fn record(id: &str, secret: &str) -> KeyRecord {
        KeyRecord {
            id: id.into(),
            principal: "team-a".into(),
            name: None,
            secret_sha256: digest_hex(secret),
            models: vec!["*".into()],
            limits: Default::default(),
            expires_unix_ms: None,
            revoked_unix_ms: None,
            created_unix_ms: 1,
            updated_unix_ms: 1,
        }
    }

    #[tokio::test]
    async fn r_ten_4_a_stored_key_works_after_a_sync_and_a_revoked_one_stops() {
        let store = Arc::new(MemoryTenantStore::new());
        let ring = KeyRing::new(&[], store.clone());
        let id = iop_core::tenant::keys::key_id(1);
        let rev = store.put_key(record(&id, "sk-iop-one"), 0).await.unwrap();
        assert!(ring.lookup("sk-iop-one").is_none(), "not before a sync");
        ring.sync().await.unwrap();
        let key = ring.lookup("sk-iop-one").unwrap();
        assert_eq!((key.id.as_str(), key.admin), (id.as_str(), false));
        assert!(ring.lookup("sk-iop-two").is_none());
        let mut revoked = record(&id, "sk-iop-one");
        revoked.revoked_unix_ms = Some(2);
        store.put_key(revoked, rev).await.unwrap();
        ring.sync().await.unwrap();
        assert!(ring.lookup("sk-iop-one").is_none());
        assert_eq!(ring.records().len(), 1, "a revoked key stays on record");
    }

    #[tokio::test]
    async fn r_ten_4_an_expired_key_is_refused_without_a_sync_and_a_failed_sync_keeps_the_keys() {
        let store = Arc::new(MemoryTenantStore::new());
        let ring = KeyRing::new(&[], store.clone());
        let mut r = record(&iop_core::tenant::keys::key_id(2), "sk-iop-x");
        r.expires_unix_ms = Some(iop_transport::clock::unix_ms() + 60_000);
        store.put_key(r.clone(), 0).await.unwrap();
        ring.sync().await.unwrap();
        assert!(ring.lookup("sk-iop-x").is_some());
        store.set_down(true);
        assert!(ring.sync().await.is_err());
        assert!(ring.lookup("sk-iop-x").is_some(), "the keys last read stay");
        r.expires_unix_ms = Some(1);
        ring.install(vec![(r, 2)]);
        assert!(ring.lookup("sk-iop-x").is_none(), "past its expiry");
    }
}
