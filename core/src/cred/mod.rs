//! Managed credential leases (R-CRED-1..3): the cryptographic core.
//!
//! For a provider that needs a credential the Node does not hold (a cloud
//! API key), the Edge issues one *sealed lease* per dispatch. The lease
//! carries the credential encrypted to exactly one Node and bound to exactly
//! one run; the Node opens it right before the provider call and never
//! stores it. Everything here is a pure function or a small state machine:
//! no clock (time is an explicit Unix-milliseconds `u64`), no global RNG
//! (randomness is a `&mut impl rand_core::CryptoRng` the shell passes), no
//! I/O. `docs/credentials.md` has the design and the threat model.
//!
//! ## What the shells call
//!
//! *Edge*, once: [`keys::generate_signing_key`] (persist it with
//! [`keys::signing_key_to_bytes`]), publish
//! [`keys::verifying_key_to_bytes`] in `ConfigSnapshot.lease_signing_key`.
//! At registration, parse the Node's `recipient_public_key` with
//! [`keys::recipient_public_key_from_bytes`]. Per dispatch: build a
//! [`LeaseScope`] with a fresh [`random_nonce`], call [`seal_lease`], send
//! [`SealedLease::to_bytes`] in `RunRequest.credential_lease`.
//!
//! *Node*, once: [`keys::generate_recipient_key`] (persist it with
//! [`keys::recipient_secret_to_bytes`]), send
//! [`keys::recipient_public_key`] at registration. Per run, after capacity
//! admission and right before the provider call (R-CRED-2): [`open_lease`]
//! with the [`ExpectedBinding`] of that run, one long-lived [`ReplayCache`]
//! and the pushed credential state. Any [`CredentialRejected`] fails the run
//! closed with `credential_rejected` (R-CRED-3): no provider call, no
//! fallback credential.

pub mod keys;
mod lease;
mod node_leases;
pub mod profiles;
mod rejection;
mod replay;
mod scope;
mod secret;

pub use keys::KeyError;
pub use lease::{SealError, SealedLease, open_lease, seal_lease};
pub use node_leases::{LeaseRefusal, NodeLeases, Recipient, RunLease};
pub use rejection::{BindingField, CredentialRejected, RejectionReason};
pub use replay::{ReplayCache, ReplayError};
pub use scope::{ExpectedBinding, LeaseScope, random_nonce};
pub use secret::Secret;

/// The version byte every sealed lease starts with. A lease with another
/// version is refused as [`RejectionReason::UnsupportedVersion`].
pub const LEASE_FORMAT_VERSION: u8 = 1;

/// Length of a lease nonce (the replay-cache key), in bytes.
pub const LEASE_NONCE_LEN: usize = 16;

/// The largest encoded [`LeaseScope`] a lease may carry, in bytes.
pub const MAX_SCOPE_BYTES: usize = 4 * 1024;

/// The largest credential a lease may carry, in bytes.
pub const MAX_SECRET_BYTES: usize = 16 * 1024;

/// The largest sealed lease, in bytes: header, the largest scope, the largest
/// secret, the AEAD tag and the signature. Anything longer is malformed.
pub const MAX_SEALED_LEASE_BYTES: usize =
    lease::HEADER_LEN + MAX_SCOPE_BYTES + MAX_SECRET_BYTES + lease::TAG_LEN + lease::SIGNATURE_LEN;

/// The longest lifetime (`expires_at - issued_at`) a lease may have. A lease
/// only has to survive from sealing to the Node's open (dispatch plus Node
/// admission), not the whole run; short leases keep the replay cache small
/// and bound what a captured lease is worth.
pub const MAX_LEASE_LIFETIME_MS: u64 = 15 * 60 * 1000;

/// A sensible lifetime for the Edge to give each lease.
pub const DEFAULT_LEASE_LIFETIME_MS: u64 = 2 * 60 * 1000;

/// A sensible clock-skew tolerance between Edge and Node wall clocks, for
/// [`open_lease`]'s `skew_tolerance_ms`.
pub const DEFAULT_SKEW_TOLERANCE_MS: u64 = 30 * 1000;

/// Entries a [`ReplayCache`] holds at most. With leases of
/// [`DEFAULT_LEASE_LIFETIME_MS`] plus skew this admits well over 300 opens a
/// second, sustained, before the cache refuses (fails closed).
pub const REPLAY_CACHE_CAPACITY: usize = 65_536;

#[cfg(test)]
mod tests;
