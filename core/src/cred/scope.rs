//! What a lease is for (R-CRED-1), and what the Node expects it to be for.

use rand_core::CryptoRng;
use serde::{Deserialize, Serialize};

use super::LEASE_NONCE_LEN;
use super::rejection::{BindingField, RejectionReason};
use crate::ids::{Generation, NodeId};

/// The scope of one lease: who may use which credential, where, for which
/// run, and until when. The Edge signs its postcard encoding; the Node
/// checks every field it can against an [`ExpectedBinding`].
///
/// Contains no secret; its `Debug` output is safe (it holds identifiers,
/// so keep it out of metric labels, R-OBS-1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseScope {
    /// The client principal the run is for (accounting and audit).
    pub principal: String,
    /// The route (client-facing model) the run serves.
    pub route: String,
    /// The dispatch slot: the run or tunnel id the lease was issued for, as
    /// the Node sees it in `RunRequest.run_id` / `ProviderTunnelRequest.run_id`.
    pub slot: u64,
    /// The managed credential profile the secret belongs to.
    pub profile: String,
    /// The target (server/model on the Node) the secret may be sent to.
    pub target: String,
    /// The Node the lease is for.
    pub node: NodeId,
    /// The profile's credential revision at sealing time.
    pub credential_revision: u64,
    /// The Node's connection generation at sealing time (R-GEN-1).
    pub generation: Generation,
    /// When the Edge sealed the lease, Unix milliseconds (Edge clock).
    pub issued_at_unix_ms: u64,
    /// When the lease stops being valid, Unix milliseconds (Edge clock).
    pub expires_at_unix_ms: u64,
    /// Fresh random bytes per lease (see [`random_nonce`]); the Node's replay
    /// cache key.
    pub nonce: [u8; LEASE_NONCE_LEN],
}

impl LeaseScope {
    /// `expires_at - issued_at`, or `None` if the lease expires before (or
    /// when) it is issued.
    pub fn lifetime_ms(&self) -> Option<u64> {
        self.expires_at_unix_ms
            .checked_sub(self.issued_at_unix_ms)
            .filter(|lifetime| *lifetime > 0)
    }

    /// The first bound field that differs from `expected`, in
    /// [`BindingField::ALL`] order.
    pub(crate) fn check_binding(
        &self,
        expected: &ExpectedBinding<'_>,
    ) -> Result<(), RejectionReason> {
        let mismatch = |field| Err(RejectionReason::BindingMismatch { field });
        if self.node.as_str() != expected.node {
            return mismatch(BindingField::Node);
        }
        if self.generation != expected.generation {
            return mismatch(BindingField::Generation);
        }
        if self.slot != expected.slot {
            return mismatch(BindingField::Slot);
        }
        if self.target != expected.target {
            return mismatch(BindingField::Target);
        }
        if self.profile != expected.profile {
            return mismatch(BindingField::Profile);
        }
        if expected.route.is_some_and(|route| route != self.route) {
            return mismatch(BindingField::Route);
        }
        if expected
            .principal
            .is_some_and(|principal| principal != self.principal)
        {
            return mismatch(BindingField::Principal);
        }
        Ok(())
    }
}

/// What the Node knows about the run it is about to execute; every field
/// here must equal the lease's scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedBinding<'a> {
    /// This Node's id, from its own certificate.
    pub node: &'a str,
    /// The generation the Edge assigned to this connection at registration.
    pub generation: Generation,
    /// The run or tunnel id of the request carrying the lease.
    pub slot: u64,
    /// The target the Node is about to call.
    pub target: &'a str,
    /// The credential profile the Node's configuration uses for that target.
    pub profile: &'a str,
    /// The route, when the Node can tell it (checked only when `Some`).
    pub route: Option<&'a str>,
    /// The principal, when the Node can tell it (checked only when `Some`).
    pub principal: Option<&'a str>,
}

/// Fresh nonce bytes for [`LeaseScope::nonce`]. Draw one per lease from the
/// shell's CSPRNG; never reuse one (a reused nonce is refused as replayed).
pub fn random_nonce(rng: &mut impl CryptoRng) -> [u8; LEASE_NONCE_LEN] {
    let mut nonce = [0u8; LEASE_NONCE_LEN];
    rng.fill_bytes(&mut nonce);
    nonce
}
