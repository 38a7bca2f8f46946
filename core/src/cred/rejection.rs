//! Why a lease was refused: a closed vocabulary (R-CRED-3).

use std::fmt;

/// A bound scope field that did not match what the Node expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BindingField {
    /// The lease names another node.
    Node,
    /// The lease was issued for another connection generation.
    Generation,
    /// The lease was issued for another run or tunnel.
    Slot,
    /// The lease was issued for another target.
    Target,
    /// The lease was issued for another credential profile.
    Profile,
    /// The lease was issued for another route (model).
    Route,
    /// The lease was issued for another principal.
    Principal,
}

impl BindingField {
    /// Every field, in the order [`crate::cred::open_lease`] checks them.
    pub const ALL: [BindingField; 7] = [
        BindingField::Node,
        BindingField::Generation,
        BindingField::Slot,
        BindingField::Target,
        BindingField::Profile,
        BindingField::Route,
        BindingField::Principal,
    ];

    /// The stable, closed label.
    pub fn as_str(self) -> &'static str {
        match self {
            BindingField::Node => "node",
            BindingField::Generation => "generation",
            BindingField::Slot => "slot",
            BindingField::Target => "target",
            BindingField::Profile => "profile",
            BindingField::Route => "route",
            BindingField::Principal => "principal",
        }
    }
}

impl fmt::Display for BindingField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why [`crate::cred::open_lease`] refused a lease. Closed: every value is a
/// low-cardinality label, and none carries secret or peer-supplied bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectionReason {
    /// The credential profile is not in the Node's credential state (removed
    /// by the Edge, or never pushed).
    Revoked,
    /// The credential profile is known but not active.
    Disabled,
    /// `now` is at or past `expires_at + skew_tolerance`.
    Expired,
    /// `issued_at` is more than the skew tolerance in the future.
    NotYetValid,
    /// The lease's credential revision is not the profile's current one.
    StaleRevision,
    /// The lease's nonce was already accepted.
    Replayed,
    /// The replay cache is full of unexpired entries; the lease is refused
    /// rather than an entry forgotten (fail closed).
    ReplayCacheFull,
    /// The lease was sealed to another recipient key.
    WrongRecipient,
    /// Authenticated decryption failed: ciphertext, scope, header or
    /// ephemeral key were altered (or the ephemeral key is low-order).
    Tampered,
    /// The Edge's signature does not verify (another signer, or an altered
    /// signature).
    BadSignature,
    /// A bound scope field differs from what the Node expected.
    BindingMismatch {
        /// The first field that differed.
        field: BindingField,
    },
    /// The bytes are not a well-formed lease (lengths, encoding, an
    /// inconsistent scope, an empty or oversize credential).
    Malformed,
    /// The lease's format version is not [`crate::cred::LEASE_FORMAT_VERSION`].
    UnsupportedVersion,
}

impl RejectionReason {
    /// The stable, closed label (the binding field is not part of it; see
    /// [`BindingField::as_str`]).
    pub fn as_str(self) -> &'static str {
        match self {
            RejectionReason::Revoked => "revoked",
            RejectionReason::Disabled => "disabled",
            RejectionReason::Expired => "expired",
            RejectionReason::NotYetValid => "not_yet_valid",
            RejectionReason::StaleRevision => "stale_revision",
            RejectionReason::Replayed => "replayed",
            RejectionReason::ReplayCacheFull => "replay_cache_full",
            RejectionReason::WrongRecipient => "wrong_recipient",
            RejectionReason::Tampered => "tampered",
            RejectionReason::BadSignature => "bad_signature",
            RejectionReason::BindingMismatch { .. } => "binding_mismatch",
            RejectionReason::Malformed => "malformed",
            RejectionReason::UnsupportedVersion => "unsupported_version",
        }
    }
}

impl fmt::Display for RejectionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectionReason::BindingMismatch { field } => write!(f, "binding_mismatch({field})"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// A lease failed closed (R-CRED-3). The run must end with
/// [`iop_wire::FailureCode::CredentialRejected`]; no provider call is made and
/// no fallback credential is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("credential_rejected: {reason}")]
pub struct CredentialRejected {
    /// Why.
    pub reason: RejectionReason,
}

impl CredentialRejected {
    /// The wire failure code a run or tunnel ends with.
    pub fn failure_code(&self) -> iop_wire::FailureCode {
        iop_wire::FailureCode::CredentialRejected
    }
}

impl From<RejectionReason> for CredentialRejected {
    fn from(reason: RejectionReason) -> Self {
        CredentialRejected { reason }
    }
}
