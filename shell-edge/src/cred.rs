//! Managed credential leases, the Edge's side (R-CRED-1): the lease signing
//! key, the profiles and sealing one lease per dispatch. Every check, which
//! profile is active (revocations included) and all the cryptography are
//! `iop_core::cred`'s ([`ProfileBook`]); this module holds the keys, keeps
//! the revocations on disk, reads the clock and the OS RNG, and moves
//! bytes.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::RwLock;

use ed25519_dalek::SigningKey;
use iop_core::cred::keys;
pub use iop_core::cred::profiles::NoLease;
use iop_core::cred::profiles::{Profile, ProfileBook};
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
    book: RwLock<ProfileBook>,
    revocations_path: std::path::PathBuf,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("profiles", &self.states())
            .finish_non_exhaustive()
    }
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
            book: RwLock::new(ProfileBook::new(revoked)),
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
        self.write().replace(profiles.iter().map(|p| {
            (
                p.profile.clone(),
                Profile {
                    secret: p.secret.clone(),
                    revision: p.revision,
                    active: p.active,
                },
            )
        }));
    }

    /// Mark `profile` inactive at its current revision, and persist that in
    /// `state_dir` so a restart or reload keeps it revoked; `Ok(false)` if
    /// unknown. On a write error the profile is still inactive in this
    /// process.
    pub fn revoke(&self, profile: &str) -> std::io::Result<bool> {
        let snapshot = {
            let mut book = self.write();
            if !book.revoke(profile) {
                return Ok(false);
            }
            book.revoked().clone()
        };
        store_revocations(&self.revocations_path, &snapshot)?;
        Ok(true)
    }

    /// Every profile's revision and active flag (no secrets).
    pub fn states(&self) -> Vec<CredentialProfileState> {
        self.read().states()
    }

    /// Seal a fresh lease of `profile` for the dispatch `lease` (R-CRED-1);
    /// an inactive profile gets none ([`ProfileBook::seal`], R-CRED-3).
    pub fn seal(
        &self,
        profile: &str,
        lease: &Lease,
        recipient: Option<&PublicKey>,
        principal: &str,
        route: &str,
    ) -> Result<Vec<u8>, NoLease> {
        self.read().seal(
            profile,
            lease,
            recipient,
            principal,
            route,
            iop_transport::clock::unix_ms(),
            &self.signing,
            &mut rand::rng(),
        )
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, ProfileBook> {
        self.book.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, ProfileBook> {
        self.book.write().unwrap_or_else(|e| e.into_inner())
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
