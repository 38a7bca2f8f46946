//! The Edge's credential profiles (R-CRED-1, R-CRED-3): which profile is
//! active at which revision, revocations that outlive reloads, and the one
//! lease sealed per dispatch. The Edge's shell keeps a [`ProfileBook`]
//! behind a lock, persists [`ProfileBook::revoked`] and passes the clock,
//! the signing key and the OS RNG in.

use std::collections::BTreeMap;

use ed25519_dalek::SigningKey;
use iop_wire::CredentialProfileState;
use rand_core::CryptoRng;
use x25519_dalek::PublicKey;
use zeroize::Zeroizing;

use super::{DEFAULT_LEASE_LIFETIME_MS, LeaseScope, random_nonce, seal_lease};
use crate::edge::admission::Lease;

/// One configured profile.
#[derive(Clone, PartialEq, Eq)]
pub struct Profile {
    /// The secret (never logged: `Debug` is redacted).
    pub secret: Zeroizing<Vec<u8>>,
    /// Its revision: a rotated secret gets a higher one.
    pub revision: u64,
    /// False when disabled in the configuration.
    pub active: bool,
}

impl std::fmt::Debug for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Profile")
            .field("secret", &"<redacted>")
            .field("revision", &self.revision)
            .field("active", &self.active)
            .finish()
    }
}

/// Why no lease was sealed. Never carries secret bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoLease {
    /// The profile is not configured (any more).
    UnknownProfile,
    /// The profile is revoked or disabled (R-CRED-3): no lease, so the Node
    /// answers `credential_rejected` without calling the provider.
    InactiveProfile,
    /// The Node registered without a valid recipient key.
    NoRecipient,
    /// [`seal_lease`] refused.
    SealFailed,
}

/// The Edge's profiles and revocations.
#[derive(Debug, Clone, Default)]
pub struct ProfileBook {
    profiles: BTreeMap<String, Profile>,
    /// Profile -> the highest revision revoked. A revocation holds until
    /// the profile is configured with a higher revision.
    revoked: BTreeMap<String, u64>,
}

impl ProfileBook {
    /// A book with no profile yet and the revocations kept from before.
    pub fn new(revoked: BTreeMap<String, u64>) -> Self {
        ProfileBook {
            profiles: BTreeMap::new(),
            revoked,
        }
    }

    /// Replace every profile (a reload, R-CRED-3): one revoked at its
    /// configured revision or a later one stays inactive; a higher
    /// revision (a rotated secret) is active again.
    pub fn replace(&mut self, profiles: impl IntoIterator<Item = (String, Profile)>) {
        self.profiles = profiles
            .into_iter()
            .map(|(name, mut p)| {
                if self.revoked.get(&name).is_some_and(|r| p.revision <= *r) {
                    p.active = false;
                }
                (name, p)
            })
            .collect();
    }

    /// Revoke `profile` at its current revision (R-CRED-3); `false` if it
    /// is not configured. A revocation never lowers a revision revoked
    /// before.
    pub fn revoke(&mut self, profile: &str) -> bool {
        let Some(p) = self.profiles.get_mut(profile) else {
            return false;
        };
        p.active = false;
        let revision = p.revision;
        let entry = self.revoked.entry(profile.to_owned()).or_insert(revision);
        *entry = (*entry).max(revision);
        true
    }

    /// Profile -> the highest revision revoked: what the shell persists.
    pub fn revoked(&self) -> &BTreeMap<String, u64> {
        &self.revoked
    }

    /// Every profile's revision and active flag (no secrets), as pushed to
    /// the Nodes.
    pub fn states(&self) -> Vec<CredentialProfileState> {
        self.profiles
            .iter()
            .map(|(name, p)| CredentialProfileState {
                profile: name.clone(),
                revision: p.revision,
                active: p.active,
            })
            .collect()
    }

    /// Seal a fresh lease of `profile` for the dispatch `lease` (R-CRED-1),
    /// bound to that run on that node and generation, valid for
    /// [`DEFAULT_LEASE_LIFETIME_MS`] from `now_unix_ms`. Fails closed: no
    /// recipient key, an unknown profile or an inactive one (revoked or
    /// disabled, even before the Node heard the refresh, R-CRED-3) gets no
    /// lease at all.
    #[allow(clippy::too_many_arguments)]
    pub fn seal(
        &self,
        profile: &str,
        lease: &Lease,
        recipient: Option<&PublicKey>,
        principal: &str,
        route: &str,
        now_unix_ms: u64,
        signing: &SigningKey,
        rng: &mut impl CryptoRng,
    ) -> Result<Vec<u8>, NoLease> {
        let recipient = recipient.ok_or(NoLease::NoRecipient)?;
        let entry = self.profiles.get(profile).ok_or(NoLease::UnknownProfile)?;
        if !entry.active {
            return Err(NoLease::InactiveProfile);
        }
        let scope = LeaseScope {
            principal: principal.to_owned(),
            route: route.to_owned(),
            slot: lease.run_id,
            profile: profile.to_owned(),
            target: lease.target.clone(),
            node: lease.node.clone(),
            credential_revision: entry.revision,
            generation: lease.generation,
            issued_at_unix_ms: now_unix_ms,
            expires_at_unix_ms: now_unix_ms.saturating_add(DEFAULT_LEASE_LIFETIME_MS),
            nonce: random_nonce(rng),
        };
        seal_lease(&scope, &entry.secret, signing, recipient, rng)
            .map(|sealed| sealed.to_bytes())
            .map_err(|_| NoLease::SealFailed)
    }
}

#[cfg(test)]
mod tests {
    use iop_wire::AdapterKind;

    use super::*;
    use crate::cred::keys::{generate_recipient_key, generate_signing_key, recipient_public_key};
    use crate::cred::tests::test_rng;
    use crate::cred::{ExpectedBinding, ReplayCache, open_lease};
    use crate::ids::{NodeId, ProviderId};

    const NOW_MS: u64 = 1_800_000_000_000;

    fn profile(revision: u64, active: bool) -> (String, Profile) {
        (
            "prod".to_owned(),
            Profile {
                secret: Zeroizing::new(b"sk-secret".to_vec()),
                revision,
                active,
            },
        )
    }

    fn active(book: &ProfileBook) -> Vec<(u64, bool)> {
        book.states()
            .iter()
            .map(|s| (s.revision, s.active))
            .collect()
    }

    fn lease() -> Lease {
        Lease {
            lease_id: 1,
            request_id: 1,
            provider_id: ProviderId::from("p0"),
            adapter: AdapterKind::OpenAi,
            target: "api.example".to_owned(),
            node: NodeId::new("node-1"),
            generation: 3,
            run_id: 42,
            stall_timeout_ms: 0,
        }
    }

    #[test]
    fn a_revocation_holds_across_reloads_until_a_higher_revision_r_cred_3() {
        let mut book = ProfileBook::new(BTreeMap::new());
        book.replace([profile(2, true)]);
        assert!(book.revoke("prod"));
        assert!(!book.revoke("other"), "unknown");
        assert_eq!(active(&book), vec![(2, false)]);
        assert_eq!(book.revoked().get("prod"), Some(&2));
        book.replace([profile(2, true)]);
        assert_eq!(
            active(&book),
            vec![(2, false)],
            "same revision: still revoked"
        );
        book.replace([profile(1, true)]);
        assert_eq!(active(&book), vec![(1, false)], "an older one too");
        book.replace([profile(3, true)]);
        assert_eq!(active(&book), vec![(3, true)], "a rotated secret");
        assert!(book.revoke("prod"));
        book.replace([profile(2, true)]);
        assert!(book.revoke("prod"));
        assert_eq!(
            book.revoked().get("prod"),
            Some(&3),
            "a revocation never lowers the revision revoked"
        );
        let restarted = {
            let mut b = ProfileBook::new(book.revoked().clone());
            b.replace([profile(3, true)]);
            b
        };
        assert_eq!(
            active(&restarted),
            vec![(3, false)],
            "kept across a restart"
        );
    }

    #[test]
    fn a_lease_is_sealed_only_for_an_active_profile_and_a_known_recipient_r_cred_1_r_cred_3() {
        let mut rng = test_rng(7);
        let signing = generate_signing_key(&mut rng);
        let node = generate_recipient_key(&mut rng);
        let recipient = recipient_public_key(&node);
        let mut book = ProfileBook::new(BTreeMap::new());
        book.replace([profile(2, true)]);
        let seal = |book: &ProfileBook, name: &str, recipient, rng: &mut _| {
            book.seal(
                name,
                &lease(),
                recipient,
                "team",
                "gpt",
                NOW_MS,
                &signing,
                rng,
            )
        };
        assert_eq!(
            seal(&book, "prod", None, &mut rng),
            Err(NoLease::NoRecipient)
        );
        assert_eq!(
            seal(&book, "other", Some(&recipient), &mut rng),
            Err(NoLease::UnknownProfile)
        );
        let sealed = seal(&book, "prod", Some(&recipient), &mut rng).expect("sealed");
        let expected = ExpectedBinding {
            node: "node-1",
            generation: 3,
            slot: 42,
            target: "api.example",
            profile: "prod",
            route: Some("gpt"),
            principal: Some("team"),
        };
        let secret = open_lease(
            &sealed,
            &expected,
            &signing.verifying_key(),
            &node,
            NOW_MS + 1,
            0,
            &mut ReplayCache::with_capacity(16),
            &|_| Some((2, true)),
        )
        .expect("the node opens it for that run");
        assert_eq!(secret.expose_secret(), b"sk-secret");
        book.replace([profile(2, false)]);
        assert_eq!(
            seal(&book, "prod", Some(&recipient), &mut rng),
            Err(NoLease::InactiveProfile),
            "disabled"
        );
        book.replace([profile(2, true)]);
        book.revoke("prod");
        assert_eq!(
            seal(&book, "prod", Some(&recipient), &mut rng),
            Err(NoLease::InactiveProfile),
            "revoked"
        );
    }
}
