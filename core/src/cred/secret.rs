//! The opened credential.

use std::fmt;

use zeroize::Zeroizing;

/// A credential opened from a lease. Its bytes are wiped when it is dropped,
/// it cannot be cloned, serialized or displayed, and its `Debug` output is
/// redacted. Use it for the one provider call it was issued for, then drop it
/// (R-CRED-2: never store or log it).
pub struct Secret(Zeroizing<Vec<u8>>);

impl Secret {
    pub(crate) fn new(bytes: Zeroizing<Vec<u8>>) -> Self {
        Secret(bytes)
    }

    /// The credential bytes, for building the provider request.
    pub fn expose_secret(&self) -> &[u8] {
        &self.0
    }

    /// The credential's length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the credential is empty (never true for an opened lease).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}
