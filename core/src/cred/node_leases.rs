//! The Node's side of managed credentials over one Edge (R-CRED-2,
//! R-CRED-3): what the Edge last pushed (its signing key, the profiles and
//! their revisions, which targets are managed) and the replay cache, and
//! the one decision of whether a run needs, may carry, or must be refused
//! its lease.

use std::collections::BTreeMap;

use ed25519_dalek::VerifyingKey;
use iop_wire::{AdapterKind, ConfigSnapshot, ManagedTarget};
use x25519_dalek::StaticSecret;

use super::{
    BindingField, DEFAULT_SKEW_TOLERANCE_MS, ExpectedBinding, KeyError, RejectionReason,
    ReplayCache, Secret,
};
use crate::ids::{Generation, RunId};

/// Why a run's lease was refused: a closed label for logs and metrics.
pub type LeaseRefusal = &'static str;

/// The Node's key pair for one lease: who it is, and the secret half of the
/// recipient key it published at registration.
#[derive(Clone, Copy)]
pub struct Recipient<'a> {
    /// This node's id (the lease's node binding).
    pub node: &'a str,
    /// Its X25519 recipient secret.
    pub secret: &'a StaticSecret,
}

/// One run's lease, as the Node opens it.
#[derive(Debug, Clone, Copy)]
pub struct RunLease<'a> {
    /// The run (the lease's slot binding).
    pub run_id: RunId,
    /// Its provider's kind.
    pub adapter: AdapterKind,
    /// Its provider target.
    pub target: &'a str,
    /// Its route (model), for a normalized run.
    pub route: Option<&'a str>,
    /// The sealed lease it carries, if any.
    pub lease: Option<&'a [u8]>,
}

/// The Edge's pushed credential state on this node, per Edge, and the
/// replay cache of that Edge's leases (see the module docs).
#[derive(Debug, Default)]
pub struct NodeLeases {
    signing_key: Option<VerifyingKey>,
    /// Profile -> (current revision, active).
    profiles: BTreeMap<String, (u64, bool)>,
    managed: Vec<ManagedTarget>,
    replay: ReplayCache,
}

impl NodeLeases {
    /// No pushed state yet; `replay` carries the Edge's earlier leases
    /// (a reconnect must not reopen a lease already used).
    pub fn new(replay: ReplayCache) -> Self {
        Self {
            replay,
            ..Self::default()
        }
    }

    /// Take the Edge's latest snapshot. A signing key that does not parse
    /// is dropped (every lease is then refused, fail closed) and returned
    /// as the error to log.
    pub fn apply(&mut self, snapshot: &ConfigSnapshot) -> Result<(), KeyError> {
        let key = snapshot
            .lease_signing_key
            .map(|bytes| super::keys::verifying_key_from_bytes(&bytes))
            .transpose();
        self.profiles = snapshot
            .credential_profiles
            .iter()
            .map(|p| (p.profile.clone(), (p.revision, p.active)))
            .collect();
        self.managed = snapshot.managed_targets.clone();
        match key {
            Ok(key) => {
                self.signing_key = key;
                Ok(())
            }
            Err(e) => {
                self.signing_key = None;
                Err(e)
            }
        }
    }

    /// The targets whose credential is managed, as last pushed.
    pub fn managed(&self) -> &[ManagedTarget] {
        &self.managed
    }

    /// Take the replay cache, to hand to the Edge's next connection.
    pub fn take_replay(&mut self) -> ReplayCache {
        std::mem::take(&mut self.replay)
    }

    fn profile_of<'m>(
        managed: &'m [ManagedTarget],
        adapter: AdapterKind,
        target: &str,
    ) -> Option<&'m str> {
        managed
            .iter()
            .find(|m| m.adapter == adapter && m.target == target)
            .map(|m| m.profile.as_str())
    }

    /// Open `run`'s lease on connection `generation` (R-CRED-2: after
    /// capacity admission, right before the provider call).
    ///
    /// * A run for an unmanaged target without a lease needs none: `None`.
    /// * A managed target's run without a lease is refused
    ///   (`missing_lease`): no fallback credential (R-CRED-3).
    /// * A lease for a target this node was not told is managed is opened
    ///   against no profile, so its binding check refuses it.
    /// * Without a recipient key or a pushed signing key every lease is
    ///   refused.
    pub fn open(
        &mut self,
        recipient: Option<Recipient<'_>>,
        generation: Generation,
        run: RunLease<'_>,
        now_unix_ms: u64,
    ) -> Result<Option<Secret>, LeaseRefusal> {
        let profile = Self::profile_of(&self.managed, run.adapter, run.target);
        let (lease, profile) = match (run.lease, profile) {
            (None, None) => return Ok(None),
            (None, Some(_)) => return Err("missing_lease"),
            (Some(lease), profile) => (lease, profile.unwrap_or("")),
        };
        let Some(recipient) = recipient else {
            return Err("no_recipient_key");
        };
        let Some(signing_key) = self.signing_key.as_ref() else {
            return Err("no_signing_key");
        };
        let expected = ExpectedBinding {
            node: recipient.node,
            generation,
            slot: run.run_id,
            target: run.target,
            profile,
            route: run.route,
            principal: None,
        };
        let profiles = &self.profiles;
        super::open_lease(
            lease,
            &expected,
            signing_key,
            recipient.secret,
            now_unix_ms,
            DEFAULT_SKEW_TOLERANCE_MS,
            &mut self.replay,
            &|p: &str| profiles.get(p).copied(),
        )
        .map(Some)
        .map_err(|rejected| rejected.reason.label())
    }
}

impl RejectionReason {
    /// The closed label of a refusal, naming a binding mismatch's field
    /// (`binding_mismatch_route`); the metric and log value.
    pub fn label(self) -> &'static str {
        use BindingField as F;
        match self {
            RejectionReason::BindingMismatch { field } => match field {
                F::Node => "binding_mismatch_node",
                F::Generation => "binding_mismatch_generation",
                F::Slot => "binding_mismatch_slot",
                F::Target => "binding_mismatch_target",
                F::Profile => "binding_mismatch_profile",
                F::Route => "binding_mismatch_route",
                F::Principal => "binding_mismatch_principal",
            },
            other => other.as_str(),
        }
    }
}
