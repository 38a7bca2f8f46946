//! Lease keys: the Edge's Ed25519 signing key and each Node's X25519
//! recipient key. Generated from an injected CSPRNG; encoded as 32-byte
//! arrays for the shells to persist (secret ones with mode 0600) and to
//! send on the wire (public ones).

use ed25519_dalek::{SigningKey, VerifyingKey};
use rand_core::CryptoRng;
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

/// Length of every encoded lease key, in bytes.
pub const KEY_LEN: usize = 32;

/// A key could not be decoded. Never carries key bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The encoding is not exactly [`KEY_LEN`] bytes.
    #[error("key must be {KEY_LEN} bytes, got {got}")]
    WrongLength {
        /// The length found.
        got: usize,
    },
    /// Not the encoding of a curve point.
    #[error("not a valid Ed25519 verifying key")]
    InvalidVerifyingKey,
    /// A small-order Ed25519 point: signatures under it prove nothing.
    #[error("weak (small-order) Ed25519 verifying key")]
    WeakVerifyingKey,
    /// A low-order X25519 point: a lease sealed to it would be readable by
    /// anyone.
    #[error("low-order X25519 recipient key")]
    LowOrderRecipientKey,
}

fn array(bytes: &[u8]) -> Result<[u8; KEY_LEN], KeyError> {
    <[u8; KEY_LEN]>::try_from(bytes).map_err(|_| KeyError::WrongLength { got: bytes.len() })
}

/// A new Edge lease signing key.
pub fn generate_signing_key(rng: &mut impl CryptoRng) -> SigningKey {
    SigningKey::generate(rng)
}

/// The signing key's secret bytes, for the Edge to persist (mode 0600).
/// Wiped when dropped.
pub fn signing_key_to_bytes(key: &SigningKey) -> Zeroizing<[u8; KEY_LEN]> {
    Zeroizing::new(key.to_bytes())
}

/// A signing key read back from [`signing_key_to_bytes`].
pub fn signing_key_from_bytes(bytes: &[u8]) -> Result<SigningKey, KeyError> {
    let secret = Zeroizing::new(array(bytes)?);
    Ok(SigningKey::from_bytes(&secret))
}

/// The public half the Node verifies leases with
/// (`ConfigSnapshot.lease_signing_key`).
pub fn verifying_key_to_bytes(key: &VerifyingKey) -> [u8; KEY_LEN] {
    key.to_bytes()
}

/// The Edge's verifying key as received by the Node. Refuses invalid and
/// weak (small-order) points.
pub fn verifying_key_from_bytes(bytes: &[u8]) -> Result<VerifyingKey, KeyError> {
    let key =
        VerifyingKey::from_bytes(&array(bytes)?).map_err(|_| KeyError::InvalidVerifyingKey)?;
    if key.is_weak() {
        return Err(KeyError::WeakVerifyingKey);
    }
    Ok(key)
}

/// A new Node recipient key.
pub fn generate_recipient_key(rng: &mut impl CryptoRng) -> StaticSecret {
    StaticSecret::random_from_rng(rng)
}

/// The recipient key's secret bytes, for the Node to persist (mode 0600).
/// Wiped when dropped.
pub fn recipient_secret_to_bytes(key: &StaticSecret) -> Zeroizing<[u8; KEY_LEN]> {
    Zeroizing::new(key.to_bytes())
}

/// A recipient key read back from [`recipient_secret_to_bytes`].
pub fn recipient_secret_from_bytes(bytes: &[u8]) -> Result<StaticSecret, KeyError> {
    let secret = Zeroizing::new(array(bytes)?);
    Ok(StaticSecret::from(*secret))
}

/// The public half the Node sends at registration
/// (`RegisterRequest.recipient_public_key`).
pub fn recipient_public_key(key: &StaticSecret) -> PublicKey {
    PublicKey::from(key)
}

/// A Node's recipient public key as received by the Edge. Refuses low-order
/// points, to which sealing would be readable by anyone.
pub fn recipient_public_key_from_bytes(bytes: &[u8]) -> Result<PublicKey, KeyError> {
    let key = PublicKey::from(array(bytes)?);
    if !is_contributory(&key) {
        return Err(KeyError::LowOrderRecipientKey);
    }
    Ok(key)
}

/// Whether Diffie-Hellman with `key` yields a contributory shared secret.
/// X25519 scalars are multiples of the cofactor, so a fixed nonzero scalar
/// maps every low-order point (and only those) to the all-zero output that
/// `was_contributory` detects.
pub(crate) fn is_contributory(key: &PublicKey) -> bool {
    StaticSecret::from([1u8; KEY_LEN])
        .diffie_hellman(key)
        .was_contributory()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cred::tests::test_rng;

    #[test]
    fn keys_round_trip_through_their_32_byte_encodings() {
        let mut rng = test_rng(7);
        let signing = generate_signing_key(&mut rng);
        let restored =
            signing_key_from_bytes(&signing_key_to_bytes(&signing)[..]).expect("32 bytes");
        assert_eq!(restored.verifying_key(), signing.verifying_key());
        let public = verifying_key_to_bytes(&signing.verifying_key());
        assert_eq!(
            verifying_key_from_bytes(&public),
            Ok(signing.verifying_key())
        );

        let recipient = generate_recipient_key(&mut rng);
        let restored = recipient_secret_from_bytes(&recipient_secret_to_bytes(&recipient)[..])
            .expect("32 bytes");
        assert_eq!(
            recipient_public_key(&restored),
            recipient_public_key(&recipient)
        );
        let public = recipient_public_key(&recipient).to_bytes();
        assert_eq!(
            recipient_public_key_from_bytes(&public),
            Ok(recipient_public_key(&recipient))
        );
    }

    #[test]
    fn generation_is_driven_by_the_injected_rng() {
        let a = generate_signing_key(&mut test_rng(1)).verifying_key();
        let b = generate_signing_key(&mut test_rng(1)).verifying_key();
        let c = generate_signing_key(&mut test_rng(2)).verifying_key();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn wrong_lengths_are_refused() {
        assert_eq!(
            signing_key_from_bytes(&[0u8; 31]).err(),
            Some(KeyError::WrongLength { got: 31 })
        );
        assert_eq!(
            verifying_key_from_bytes(&[0u8; 33]).err(),
            Some(KeyError::WrongLength { got: 33 })
        );
        assert_eq!(
            recipient_secret_from_bytes(&[]).err(),
            Some(KeyError::WrongLength { got: 0 })
        );
        assert_eq!(
            recipient_public_key_from_bytes(&[0u8; 64]).err(),
            Some(KeyError::WrongLength { got: 64 })
        );
    }

    #[test]
    fn low_order_recipient_keys_are_refused() {
        // The identity (u = 0) and the order-2 point (u = 1) are low-order.
        let mut one = [0u8; KEY_LEN];
        one[0] = 1;
        for low in [[0u8; KEY_LEN], one] {
            assert_eq!(
                recipient_public_key_from_bytes(&low).err(),
                Some(KeyError::LowOrderRecipientKey)
            );
        }
    }

    #[test]
    fn weak_verifying_keys_are_refused() {
        // The Ed25519 identity point (y = 1) has small order.
        let mut identity = [0u8; KEY_LEN];
        identity[0] = 1;
        assert_eq!(
            verifying_key_from_bytes(&identity).err(),
            Some(KeyError::WeakVerifyingKey)
        );
    }
}
