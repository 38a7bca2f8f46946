//! Managed credential leases, the Edge's side (R-CRED-1): the lease signing
//! key, the profiles (secret, revision, active) and sealing one lease per
//! dispatch. Every check and all the cryptography is `iop_core::cred`; this
//! module holds keys, reads the clock and the OS RNG, and moves bytes.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::RwLock;

use ed25519_dalek::SigningKey;
use iop_core::cred::{LeaseScope, keys, random_nonce, seal_lease};
use iop_core::edge::admission::Lease;
use iop_wire::CredentialProfileState;
use x25519_dalek::PublicKey;

use crate::config::CredentialProfile;

/// The file (in `state_dir`) holding the lease signing key, mode 0600.
pub const SIGNING_KEY_FILE: &str = "lease-signing.key";

/// The file (in `state_dir`) where revocations are kept across restarts
/// and reloads: a JSON object, profile -> the revision revoked.
pub const REVOCATIONS_FILE: &str = "revoked-credentials.json";

/// The Edge's credential state. Profiles change only on reload or revoke;
/// a dispatch takes a read lock for the duration of one seal.
pub struct Credentials {
    signing: SigningKey,
    verifying: [u8; 32],
    profiles: RwLock<BTreeMap<String, CredentialProfile>>,
    /// Profile -> highest revoked revision. A revocation holds until the
    /// profile is configured with a higher revision (a rotated secret).
    revoked: RwLock<BTreeMap<String, u64>>,
    revocations_path: std::path::PathBuf,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("profiles", &self.states())
            .finish_non_exhaustive()
    }
}

/// Why no lease could be sealed. Never carries secret bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoLease {
    /// The profile is not configured (any more).
    UnknownProfile,
    /// The profile is revoked or disabled (R-CRED-3): no lease, so the Node
    /// answers `credential_rejected` without calling the provider.
    InactiveProfile,
    /// The Node registered without a valid recipient key.
    NoRecipient,
    /// `seal_lease` refused.
    SealFailed,
}

impl Credentials {
    /// Load (or create, mode 0600) the signing key in `state_dir`.
    pub fn open(state_dir: &Path, profiles: &[CredentialProfile]) -> std::io::Result<Self> {
        let bytes =
            iop_transport::keyfile::load_or_create(&state_dir.join(SIGNING_KEY_FILE), || {
                keys::signing_key_to_bytes(&keys::generate_signing_key(&mut rand::rng()))
            })?;
        let signing = keys::signing_key_from_bytes(&bytes).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{SIGNING_KEY_FILE}: {e}"),
            )
        })?;
        let verifying = keys::verifying_key_to_bytes(&signing.verifying_key());
        let revocations_path = state_dir.join(REVOCATIONS_FILE);
        let revoked = load_revocations(&revocations_path)?;
        let creds = Self {
            signing,
            verifying,
            profiles: RwLock::new(BTreeMap::new()),
            revoked: RwLock::new(revoked),
            revocations_path,
        };
        creds.replace(profiles);
        Ok(creds)
    }

    /// The verifying key every Node gets.
    pub fn verifying_key(&self) -> [u8; 32] {
        self.verifying
    }

    /// Replace every profile (a reload). A profile revoked at its current
    /// revision or later stays inactive.
    pub fn replace(&self, profiles: &[CredentialProfile]) {
        let revoked = self.revoked.read().unwrap_or_else(|e| e.into_inner());
        let map = profiles
            .iter()
            .map(|p| {
                let mut p = p.clone();
                if revoked.get(&p.profile).is_some_and(|r| p.revision <= *r) {
                    p.active = false;
                }
                (p.profile.clone(), p)
            })
            .collect();
        *self.profiles.write().unwrap_or_else(|e| e.into_inner()) = map;
    }

    /// Mark `profile` inactive at its current revision, and persist that in
    /// `state_dir` so a restart or reload keeps it revoked; `Ok(false)` if
    /// unknown. On a write error the profile is still inactive in this
    /// process.
    pub fn revoke(&self, profile: &str) -> std::io::Result<bool> {
        let revision = {
            let mut map = self.profiles.write().unwrap_or_else(|e| e.into_inner());
            match map.get_mut(profile) {
                Some(p) => {
                    p.active = false;
                    p.revision
                }
                None => return Ok(false),
            }
        };
        let snapshot = {
            let mut revoked = self.revoked.write().unwrap_or_else(|e| e.into_inner());
            let entry = revoked.entry(profile.to_owned()).or_insert(revision);
            *entry = (*entry).max(revision);
            revoked.clone()
        };
        store_revocations(&self.revocations_path, &snapshot)?;
        Ok(true)
    }

    /// Every profile's revision and active flag (no secrets).
    pub fn states(&self) -> Vec<CredentialProfileState> {
        self.profiles
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|p| CredentialProfileState {
                profile: p.profile.clone(),
                revision: p.revision,
                active: p.active,
            })
            .collect()
    }

    /// Seal a fresh lease of `profile` for the dispatch `lease` (R-CRED-1).
    /// An inactive (revoked or disabled) profile gets no lease at all, even
    /// before the Node heard the refresh (R-CRED-3, fail closed here too).
    pub fn seal(
        &self,
        profile: &str,
        lease: &Lease,
        recipient: Option<&PublicKey>,
        principal: &str,
        route: &str,
    ) -> Result<Vec<u8>, NoLease> {
        let recipient = recipient.ok_or(NoLease::NoRecipient)?;
        let map = self.profiles.read().unwrap_or_else(|e| e.into_inner());
        let entry = map.get(profile).ok_or(NoLease::UnknownProfile)?;
        if !entry.active {
            return Err(NoLease::InactiveProfile);
        }
        let mut rng = rand::rng();
        let now = iop_transport::clock::unix_ms();
        let scope = LeaseScope {
            principal: principal.to_owned(),
            route: route.to_owned(),
            slot: lease.run_id,
            profile: profile.to_owned(),
            target: lease.target.clone(),
            node: lease.node.clone(),
            credential_revision: entry.revision,
            generation: lease.generation,
            issued_at_unix_ms: now,
            expires_at_unix_ms: now + iop_core::cred::DEFAULT_LEASE_LIFETIME_MS,
            nonce: random_nonce(&mut rng),
        };
        seal_lease(&scope, &entry.secret, &self.signing, recipient, &mut rng)
            .map(|sealed| sealed.to_bytes())
            .map_err(|_| NoLease::SealFailed)
    }
}

/// Read the revocations file; a missing file is no revocation.
fn load_revocations(path: &Path) -> std::io::Result<BTreeMap<String, u64>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(e) => Err(e),
    }
}

/// Replace the revocations file atomically (write, sync, rename, sync dir).
fn store_revocations(path: &Path, revoked: &BTreeMap<String, u64>) -> std::io::Result<()> {
    use std::io::Write as _;
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(revoked).map_err(std::io::Error::other)?;
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(&bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use iop_core::ids::{NodeId, ProviderId};

    fn profile(active: bool) -> CredentialProfile {
        CredentialProfile {
            profile: "k".into(),
            secret: zeroize::Zeroizing::new(b"sk-managed".to_vec()),
            revision: 1,
            active,
        }
    }

    fn lease() -> Lease {
        Lease {
            lease_id: 1,
            request_id: 1,
            provider_id: ProviderId::from("p"),
            adapter: iop_wire::AdapterKind::OpenAi,
            target: "t".into(),
            node: NodeId::from("n"),
            generation: 1,
            run_id: 7,
            stall_timeout_ms: 0,
        }
    }

    #[test]
    fn revoked_or_disabled_profile_gets_no_lease() {
        let dir = tempfile::tempdir().unwrap();
        let recipient = keys::recipient_public_key(&keys::generate_recipient_key(&mut rand::rng()));
        let creds = Credentials::open(dir.path(), &[profile(true)]).unwrap();
        assert!(
            creds
                .seal("k", &lease(), Some(&recipient), "p", "m")
                .is_ok()
        );
        // R-CRED-3: revoked before the Node heard the refresh.
        assert!(creds.revoke("k").unwrap());
        assert_eq!(
            creds.seal("k", &lease(), Some(&recipient), "p", "m"),
            Err(NoLease::InactiveProfile)
        );
        // Disabled in the configuration.
        creds.replace(&[profile(false)]);
        assert_eq!(
            creds.seal("k", &lease(), Some(&recipient), "p", "m"),
            Err(NoLease::InactiveProfile)
        );
        assert_eq!(
            creds.seal("ghost", &lease(), Some(&recipient), "p", "m"),
            Err(NoLease::UnknownProfile)
        );
    }

    #[test]
    fn a_revocation_survives_a_restart_and_a_reload_until_the_revision_rises() {
        let dir = tempfile::tempdir().unwrap();
        let recipient = keys::recipient_public_key(&keys::generate_recipient_key(&mut rand::rng()));
        let creds = Credentials::open(dir.path(), &[profile(true)]).unwrap();
        assert!(creds.revoke("k").unwrap());
        assert!(!creds.revoke("ghost").unwrap());
        // A reload (SIGHUP) of the same configuration keeps it revoked.
        creds.replace(&[profile(true)]);
        assert_eq!(
            creds.seal("k", &lease(), Some(&recipient), "p", "m"),
            Err(NoLease::InactiveProfile)
        );
        drop(creds);
        // So does a restart.
        let creds = Credentials::open(dir.path(), &[profile(true)]).unwrap();
        assert_eq!(
            creds.seal("k", &lease(), Some(&recipient), "p", "m"),
            Err(NoLease::InactiveProfile)
        );
        // A rotated secret (a higher revision) is active again.
        let mut rotated = profile(true);
        rotated.revision = 2;
        creds.replace(&[rotated]);
        assert!(
            creds
                .seal("k", &lease(), Some(&recipient), "p", "m")
                .is_ok()
        );
    }
}
