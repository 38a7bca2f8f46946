//! Sealing and opening a lease (R-CRED-1, R-CRED-3).
//!
//! ## Envelope, version 1
//!
//! ```text
//! offset        len   field
//! 0             1     version (= LEASE_FORMAT_VERSION)
//! 1             32    ephemeral X25519 public key (fresh per lease)
//! 33            32    recipient X25519 public key (the Node's)
//! 65            4     scope length n, u32 big-endian (1..=MAX_SCOPE_BYTES)
//! 69            n     scope: postcard-encoded LeaseScope
//! 69+n          m+16  ciphertext: ChaCha20-Poly1305(secret) with its tag (m >= 1)
//! len-64        64    Ed25519 signature by the Edge
//! ```
//!
//! * Key agreement: `shared = X25519(ephemeral, recipient)`, refused when not
//!   contributory (low-order points).
//! * Key schedule: HKDF-SHA256 with `salt = ephemeral_pk || recipient_pk`,
//!   `ikm = shared`, `info = HKDF_INFO || scope`; 44 bytes out: the AEAD key
//!   (32) and nonce (12). The key is fresh per lease, so the nonce never
//!   repeats under one key.
//! * AEAD: ChaCha20-Poly1305, associated data = every byte before the
//!   ciphertext (version, both public keys, scope length and scope).
//! * Signature: Ed25519 (strict verification) over
//!   `SIGNATURE_CONTEXT || every byte before the signature`, so it covers
//!   the scope, both public keys and the ciphertext: nobody but the Edge can
//!   pair a scope with a secret, even though anyone can encrypt to a Node.

use chacha20poly1305::aead::AeadInOut;
use chacha20poly1305::{ChaCha20Poly1305, KeyInit, Nonce, Tag};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use hkdf::Hkdf;
use rand_core::CryptoRng;
use sha2::Sha256;
use x25519_dalek::{EphemeralSecret, PublicKey, SharedSecret, StaticSecret};
use zeroize::Zeroizing;

use super::keys::{KEY_LEN, is_contributory};
use super::rejection::{CredentialRejected, RejectionReason};
use super::replay::{ReplayCache, ReplayError};
use super::scope::{ExpectedBinding, LeaseScope};
use super::secret::Secret;
use super::{
    LEASE_FORMAT_VERSION, MAX_LEASE_LIFETIME_MS, MAX_SCOPE_BYTES, MAX_SEALED_LEASE_BYTES,
    MAX_SECRET_BYTES,
};

/// Bytes before the scope: version, two public keys, scope length.
pub(crate) const HEADER_LEN: usize = 1 + KEY_LEN + KEY_LEN + 4;
/// ChaCha20-Poly1305 tag length.
pub(crate) const TAG_LEN: usize = 16;
/// Ed25519 signature length.
pub(crate) const SIGNATURE_LEN: usize = 64;
const AEAD_KEY_LEN: usize = 32;
const AEAD_NONCE_LEN: usize = 12;

/// Domain separation for the HKDF info (version 1).
const HKDF_INFO: &[u8] = b"iop/credential-lease/v1/seal";
/// Domain separation for the Edge's signature (version 1).
const SIGNATURE_CONTEXT: &[u8] = b"iop/credential-lease/v1/sign";

/// The Edge could not seal a lease. Never carries secret bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// The credential is empty.
    #[error("credential is empty")]
    EmptySecret,
    /// The credential is longer than [`MAX_SECRET_BYTES`].
    #[error("credential is {len} bytes, more than {MAX_SECRET_BYTES}")]
    SecretTooLarge {
        /// Its length.
        len: usize,
    },
    /// The encoded scope is longer than [`MAX_SCOPE_BYTES`].
    #[error("encoded scope is {len} bytes, more than {MAX_SCOPE_BYTES}")]
    ScopeTooLarge {
        /// Its length.
        len: usize,
    },
    /// `expires_at` is not after `issued_at`, or the lifetime exceeds
    /// [`MAX_LEASE_LIFETIME_MS`].
    #[error("lease lifetime must be in 1..={MAX_LEASE_LIFETIME_MS} ms")]
    InvalidLifetime,
    /// The recipient key is a low-order point; sealing to it would be
    /// readable by anyone.
    #[error("low-order recipient key")]
    LowOrderRecipientKey,
    /// The scope could not be encoded.
    #[error("scope could not be encoded: {0}")]
    Encode(String),
}

/// A sealed lease: what travels in `RunRequest.credential_lease` (as
/// [`SealedLease::to_bytes`]). Contains no plaintext secret; `Debug` shows
/// only lengths.
#[derive(Clone, PartialEq, Eq)]
pub struct SealedLease {
    ephemeral_public: [u8; KEY_LEN],
    recipient_public: [u8; KEY_LEN],
    scope_bytes: Vec<u8>,
    ciphertext: Vec<u8>,
    signature: [u8; SIGNATURE_LEN],
}

impl std::fmt::Debug for SealedLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealedLease")
            .field("version", &LEASE_FORMAT_VERSION)
            .field("scope_len", &self.scope_bytes.len())
            .field("ciphertext_len", &self.ciphertext.len())
            .finish_non_exhaustive()
    }
}

impl SealedLease {
    /// The versioned envelope (see the module docs).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.signed_part();
        out.extend_from_slice(&self.signature);
        out
    }

    /// Parse an envelope, checking its version and every length. Does no
    /// cryptography; [`open_lease`] does.
    pub fn from_bytes(bytes: &[u8]) -> Result<SealedLease, CredentialRejected> {
        let malformed = CredentialRejected::from(RejectionReason::Malformed);
        let Some(&version) = bytes.first() else {
            return Err(malformed);
        };
        if version != LEASE_FORMAT_VERSION {
            return Err(RejectionReason::UnsupportedVersion.into());
        }
        if bytes.len() > MAX_SEALED_LEASE_BYTES || bytes.len() < HEADER_LEN {
            return Err(malformed);
        }
        let (header, rest) = bytes.split_at(HEADER_LEN);
        let ephemeral_public = key_at(header, 1).ok_or(malformed)?;
        let recipient_public = key_at(header, 1 + KEY_LEN).ok_or(malformed)?;
        let scope_len_bytes: [u8; 4] = header[1 + 2 * KEY_LEN..]
            .try_into()
            .map_err(|_| malformed)?;
        let scope_len =
            usize::try_from(u32::from_be_bytes(scope_len_bytes)).map_err(|_| malformed)?;
        if scope_len == 0 || scope_len > MAX_SCOPE_BYTES {
            return Err(malformed);
        }
        // What follows the scope: at least one byte of ciphertext, its tag, the signature.
        let tail_len = rest.len().checked_sub(scope_len).ok_or(malformed)?;
        if tail_len < 1 + TAG_LEN + SIGNATURE_LEN {
            return Err(malformed);
        }
        let (scope_bytes, tail) = rest.split_at(scope_len);
        let (ciphertext, signature) = tail.split_at(tail_len - SIGNATURE_LEN);
        if ciphertext.len() > MAX_SECRET_BYTES + TAG_LEN {
            return Err(malformed);
        }
        let signature: [u8; SIGNATURE_LEN] = signature.try_into().map_err(|_| malformed)?;
        Ok(SealedLease {
            ephemeral_public,
            recipient_public,
            scope_bytes: scope_bytes.to_vec(),
            ciphertext: ciphertext.to_vec(),
            signature,
        })
    }

    /// The recipient public key the lease was sealed to.
    pub fn recipient_public_key(&self) -> [u8; KEY_LEN] {
        self.recipient_public
    }

    /// Header and scope: the AEAD's associated data.
    fn associated_data(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.scope_bytes.len());
        out.push(LEASE_FORMAT_VERSION);
        out.extend_from_slice(&self.ephemeral_public);
        out.extend_from_slice(&self.recipient_public);
        // from_bytes and seal_lease both bound the scope to MAX_SCOPE_BYTES, which fits in u32.
        let scope_len = u32::try_from(self.scope_bytes.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&scope_len.to_be_bytes());
        out.extend_from_slice(&self.scope_bytes);
        out
    }

    /// Everything the signature covers (after [`SIGNATURE_CONTEXT`]).
    fn signed_part(&self) -> Vec<u8> {
        let mut out = self.associated_data();
        out.extend_from_slice(&self.ciphertext);
        out
    }

    fn signature_message(&self) -> Vec<u8> {
        let mut message = SIGNATURE_CONTEXT.to_vec();
        message.extend_from_slice(&self.signed_part());
        message
    }
}

fn key_at(bytes: &[u8], offset: usize) -> Option<[u8; KEY_LEN]> {
    bytes.get(offset..offset + KEY_LEN)?.try_into().ok()
}

/// The AEAD built from the key schedule (module docs), with its nonce.
fn lease_cipher(
    shared: &SharedSecret,
    ephemeral_public: &[u8; KEY_LEN],
    recipient_public: &[u8; KEY_LEN],
    scope_bytes: &[u8],
) -> Option<(ChaCha20Poly1305, Nonce)> {
    let mut salt = [0u8; 2 * KEY_LEN];
    salt[..KEY_LEN].copy_from_slice(ephemeral_public);
    salt[KEY_LEN..].copy_from_slice(recipient_public);
    let hkdf = Hkdf::<Sha256>::new(Some(&salt), shared.as_bytes());
    let mut okm = Zeroizing::new([0u8; AEAD_KEY_LEN + AEAD_NONCE_LEN]);
    hkdf.expand_multi_info(&[HKDF_INFO, scope_bytes], &mut okm[..])
        .ok()?;
    // Built straight from the zeroizing buffer so no copy of the key lingers.
    let cipher = ChaCha20Poly1305::new_from_slice(&okm[..AEAD_KEY_LEN]).ok()?;
    let nonce = Nonce::try_from(&okm[AEAD_KEY_LEN..]).ok()?;
    Some((cipher, nonce))
}

/// Seal `secret` for one dispatch (R-CRED-1): the Edge's side.
///
/// Encrypts `secret` to `recipient` (the Node's registered X25519 key) under
/// a fresh ephemeral key drawn from `rng`, bound to `scope`, and signs the
/// whole envelope with `signing_key`. `scope.nonce` must be fresh (see
/// [`super::random_nonce`]).
pub fn seal_lease(
    scope: &LeaseScope,
    secret: &[u8],
    signing_key: &SigningKey,
    recipient: &PublicKey,
    rng: &mut impl CryptoRng,
) -> Result<SealedLease, SealError> {
    if secret.is_empty() {
        return Err(SealError::EmptySecret);
    }
    if secret.len() > MAX_SECRET_BYTES {
        return Err(SealError::SecretTooLarge { len: secret.len() });
    }
    match scope.lifetime_ms() {
        Some(lifetime) if lifetime <= MAX_LEASE_LIFETIME_MS => {}
        _ => return Err(SealError::InvalidLifetime),
    }
    let scope_bytes = postcard::to_allocvec(scope).map_err(|e| SealError::Encode(e.to_string()))?;
    if scope_bytes.len() > MAX_SCOPE_BYTES {
        return Err(SealError::ScopeTooLarge {
            len: scope_bytes.len(),
        });
    }
    if !is_contributory(recipient) {
        return Err(SealError::LowOrderRecipientKey);
    }

    let ephemeral = EphemeralSecret::random_from_rng(rng);
    let ephemeral_public = PublicKey::from(&ephemeral).to_bytes();
    let shared = ephemeral.diffie_hellman(recipient);
    if !shared.was_contributory() {
        return Err(SealError::LowOrderRecipientKey);
    }
    let mut lease = SealedLease {
        ephemeral_public,
        recipient_public: recipient.to_bytes(),
        scope_bytes,
        ciphertext: Vec::new(),
        signature: [0u8; SIGNATURE_LEN],
    };
    let (cipher, nonce) = lease_cipher(
        &shared,
        &lease.ephemeral_public,
        &lease.recipient_public,
        &lease.scope_bytes,
    )
    .ok_or_else(|| SealError::Encode("key schedule".to_owned()))?;

    // Reserve room for the tag up front so the buffer holding the plaintext
    // is never reallocated (which would leave a copy behind).
    let mut ciphertext = Vec::with_capacity(secret.len() + TAG_LEN);
    ciphertext.extend_from_slice(secret);
    let tag = cipher
        .encrypt_inout_detached(
            &nonce,
            &lease.associated_data(),
            ciphertext.as_mut_slice().into(),
        )
        .map_err(|_| SealError::Encode("aead".to_owned()))?;
    ciphertext.extend_from_slice(&tag);
    lease.ciphertext = ciphertext;

    lease.signature = signing_key.sign(&lease.signature_message()).to_bytes();
    Ok(lease)
}

/// Open a lease right before the provider call (R-CRED-2, R-CRED-3): the
/// Node's side. Returns the credential, or why the lease fails closed.
///
/// Checks, in this order (the first failure is the reason):
/// 1. envelope version and lengths (`unsupported_version`, `malformed`);
/// 2. sealed to this Node's key (`wrong_recipient`);
/// 3. authenticated decryption, binding header and scope (`tampered`);
/// 4. the Edge's signature over the whole envelope (`bad_signature`);
/// 5. the scope decodes and is consistent (`malformed`);
/// 6. every bound field against `expected` (`binding_mismatch{field}`);
/// 7. time, with `skew_tolerance_ms` either way: refused when
///    `issued_at > now + skew` (`not_yet_valid`) or
///    `now >= expires_at + skew` (`expired`);
/// 8. `credential_state(profile)`, the Node's copy of the Edge's pushed
///    `(current revision, active)`: `None` is `revoked`, inactive is
///    `disabled`, any other revision is `stale_revision`;
/// 9. the nonce, recorded in `replay` until `expires_at + skew`
///    (`replayed`, `replay_cache_full`).
///
/// Only a lease that passed 1-8 reaches the replay cache, so nothing but
/// Edge-signed leases for this Node can occupy it.
#[allow(clippy::too_many_arguments)]
pub fn open_lease(
    bytes: &[u8],
    expected: &ExpectedBinding<'_>,
    edge_verifying_key: &VerifyingKey,
    recipient_secret: &StaticSecret,
    now_unix_ms: u64,
    skew_tolerance_ms: u64,
    replay: &mut ReplayCache,
    credential_state: &impl Fn(&str) -> Option<(u64, bool)>,
) -> Result<Secret, CredentialRejected> {
    let lease = SealedLease::from_bytes(bytes)?;

    if PublicKey::from(recipient_secret).to_bytes() != lease.recipient_public {
        return Err(RejectionReason::WrongRecipient.into());
    }

    let secret = decrypt(&lease, recipient_secret).ok_or(RejectionReason::Tampered)?;

    let signature = Signature::from_bytes(&lease.signature);
    edge_verifying_key
        .verify_strict(&lease.signature_message(), &signature)
        .map_err(|_| RejectionReason::BadSignature)?;

    let scope: LeaseScope = match postcard::take_from_bytes(&lease.scope_bytes) {
        Ok((scope, [])) => scope,
        _ => return Err(RejectionReason::Malformed.into()),
    };
    match scope.lifetime_ms() {
        Some(lifetime) if lifetime <= MAX_LEASE_LIFETIME_MS => {}
        _ => return Err(RejectionReason::Malformed.into()),
    }

    scope.check_binding(expected)?;

    if scope.issued_at_unix_ms > now_unix_ms.saturating_add(skew_tolerance_ms) {
        return Err(RejectionReason::NotYetValid.into());
    }
    let accept_until_unix_ms = scope.expires_at_unix_ms.saturating_add(skew_tolerance_ms);
    if now_unix_ms >= accept_until_unix_ms {
        return Err(RejectionReason::Expired.into());
    }

    match credential_state(&scope.profile) {
        None => return Err(RejectionReason::Revoked.into()),
        Some((_, false)) => return Err(RejectionReason::Disabled.into()),
        Some((revision, true)) if revision != scope.credential_revision => {
            return Err(RejectionReason::StaleRevision.into());
        }
        Some((_, true)) => {}
    }

    replay
        .check_and_insert(scope.nonce, accept_until_unix_ms, now_unix_ms)
        .map_err(|e| match e {
            ReplayError::Replayed => RejectionReason::Replayed,
            ReplayError::Full => RejectionReason::ReplayCacheFull,
            ReplayError::Expired => RejectionReason::Expired,
        })?;

    Ok(secret)
}

/// Key agreement, key schedule and authenticated decryption; `None` on any
/// failure (all of them mean the envelope was altered).
fn decrypt(lease: &SealedLease, recipient_secret: &StaticSecret) -> Option<Secret> {
    let shared = recipient_secret.diffie_hellman(&PublicKey::from(lease.ephemeral_public));
    if !shared.was_contributory() {
        return None;
    }
    let (cipher, nonce) = lease_cipher(
        &shared,
        &lease.ephemeral_public,
        &lease.recipient_public,
        &lease.scope_bytes,
    )?;
    let body_len = lease.ciphertext.len().checked_sub(TAG_LEN)?;
    let (body, tag) = lease.ciphertext.split_at(body_len);
    let tag = Tag::try_from(tag).ok()?;
    let mut plaintext = Zeroizing::new(body.to_vec());
    cipher
        .decrypt_inout_detached(
            &nonce,
            &lease.associated_data(),
            plaintext.as_mut_slice().into(),
            &tag,
        )
        .ok()?;
    Some(Secret::new(plaintext))
}
