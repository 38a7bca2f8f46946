//! Node identity: the node id a certificate carries (SPEC §3).
//!
//! A Node's identity is the SAN URI `node://<id>` in its client certificate,
//! never a message field. The common name is not accepted as an identity:
//! every certificate the deployment CA issues has a CN (the Edge's own server
//! certificate included), so falling back to it would let a certificate that
//! was never meant to be a node's act as one.

use x509_parser::extensions::GeneralName;

/// The URI scheme prefix of a node identity SAN: `node://<id>`.
pub const NODE_URI_PREFIX: &str = "node://";

/// The longest node id accepted, in bytes.
pub const NODE_ID_MAX_LEN: usize = 128;

/// Why no node id could be taken from a certificate or a string.
///
/// Every variant except [`IdentityError::InvalidNodeId`] on a caller-chosen
/// id is the fault of whoever issued or presented the certificate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// The peer presented no certificate (or the connection has no TLS
    /// session yet).
    #[error("peer presented no certificate")]
    NoPeerCertificate,
    /// The certificate is not valid DER X.509.
    #[error("certificate does not parse: {0}")]
    UnparsableCertificate(String),
    /// The certificate carries no `node://<id>` SAN URI.
    #[error("certificate carries no node identity (SAN URI {NODE_URI_PREFIX}<id>)")]
    NoNodeIdentity,
    /// The certificate carries more than one distinct node identity.
    #[error("certificate carries {count} node identities; exactly one is required")]
    AmbiguousNodeIdentity {
        /// How many distinct `node://` URIs were found.
        count: usize,
    },
    /// The node id is empty, too long or has characters outside
    /// `[A-Za-z0-9._-]`.
    #[error("invalid node id {id:?}: {reason}")]
    InvalidNodeId {
        /// The refused id (bounded: at most a few hundred bytes are kept).
        id: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Check that `id` is a well-formed node id: 1 to [`NODE_ID_MAX_LEN`] bytes
/// of `[A-Za-z0-9._-]`.
pub fn validate_node_id(id: &str) -> Result<(), IdentityError> {
    let refuse = |reason| IdentityError::InvalidNodeId {
        id: truncate_for_error(id),
        reason,
    };
    if id.is_empty() {
        return Err(refuse("empty"));
    }
    if id.len() > NODE_ID_MAX_LEN {
        return Err(refuse("longer than 128 bytes"));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(refuse("only A-Z a-z 0-9 . _ - are allowed"));
    }
    Ok(())
}

/// The last second a DER certificate is valid (its `notAfter`), in Unix
/// seconds; `None` if it cannot be read.
pub fn cert_not_after_unix(der: &[u8]) -> Option<i64> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(cert.validity().not_after.timestamp())
}

/// The node id a DER certificate carries as its SAN URI `node://<id>`.
///
/// Refuses certificates without such a URI, with two different ones, or
/// whose id fails [`validate_node_id`]. Does not verify the chain: call it
/// on a certificate rustls already verified (see
/// [`crate::peer_node_id`]).
pub fn node_id_from_cert(der: &[u8]) -> Result<String, IdentityError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| IdentityError::UnparsableCertificate(e.to_string()))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| IdentityError::UnparsableCertificate(e.to_string()))?;
    let Some(san) = san else {
        return Err(IdentityError::NoNodeIdentity);
    };
    let mut ids: Vec<&str> = san
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) => uri.strip_prefix(NODE_URI_PREFIX),
            _ => None,
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    match ids.as_slice() {
        [] => Err(IdentityError::NoNodeIdentity),
        [id] => {
            validate_node_id(id)?;
            Ok((*id).to_owned())
        }
        many => Err(IdentityError::AmbiguousNodeIdentity { count: many.len() }),
    }
}

/// Keep error messages bounded when a peer sends a huge bogus id.
fn truncate_for_error(id: &str) -> String {
    const KEEP: usize = NODE_ID_MAX_LEN + 16;
    if id.len() <= KEEP {
        return id.to_owned();
    }
    let mut end = KEEP;
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &id[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_within_the_alphabet_and_length_are_accepted() {
        for id in [
            "a",
            "node-1",
            "gpu_box.eu-west",
            &"x".repeat(NODE_ID_MAX_LEN),
        ] {
            assert_eq!(validate_node_id(id), Ok(()), "{id}");
        }
    }

    #[test]
    fn empty_long_or_foreign_node_ids_are_refused() {
        let too_long = "x".repeat(NODE_ID_MAX_LEN + 1);
        for id in [
            "",
            "a/b",
            "a b",
            "ünï",
            "node://x",
            "a\0",
            too_long.as_str(),
        ] {
            assert!(
                matches!(
                    validate_node_id(id),
                    Err(IdentityError::InvalidNodeId { .. })
                ),
                "{id:?} was accepted"
            );
        }
    }

    #[test]
    fn refused_ids_are_truncated_in_errors() {
        let huge = "é".repeat(10_000);
        let Err(IdentityError::InvalidNodeId { id, .. }) = validate_node_id(&huge) else {
            panic!("a huge id was accepted");
        };
        assert!(id.len() <= NODE_ID_MAX_LEN + 16 + 3);
    }

    #[test]
    fn garbage_der_is_unparsable() {
        assert!(matches!(
            node_id_from_cert(b"not a certificate"),
            Err(IdentityError::UnparsableCertificate(_))
        ));
    }
}
