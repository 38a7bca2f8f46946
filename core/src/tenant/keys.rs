//! Runtime API keys (SPEC §9, R-TEN-4): what a key created through the
//! admin API is, as the deployment's store holds it, and the rules that
//! decide whether it may be used and whether an admin's change is valid.
//!
//! A key is stored by its id with the SHA-256 of its secret, never the
//! secret itself (the secret is shown once, when the key is created or
//! rotated). Every Edge reads the stored keys and honours a change within
//! its key sync interval; a revoked or expired key is refused on every
//! Edge from then on.

use serde::{Deserialize, Serialize};

use super::Limits;

/// The prefix of a runtime key's id.
pub const KEY_ID_PREFIX: &str = "key_";

/// The hex digits after [`KEY_ID_PREFIX`].
pub const KEY_ID_HEX_DIGITS: usize = 16;

/// The prefix of a runtime key's secret (`sk-iop-` then 48 hex digits).
pub const SECRET_PREFIX: &str = "sk-iop-";

/// The most model patterns a key may list.
pub const MAX_KEY_MODELS: usize = 64;

/// The longest model pattern, in bytes.
pub const MAX_MODEL_PATTERN_BYTES: usize = 256;

/// The longest key name, in characters.
pub const MAX_KEY_NAME_CHARS: usize = 128;

/// A runtime key's id from a random `seed`: `key_<16 hex>`.
pub fn key_id(seed: u64) -> String {
    format!("{KEY_ID_PREFIX}{seed:016x}")
}

/// Whether `id` has the shape of a runtime key's id (R-LIM-5: checked
/// before it reaches a store or a log).
pub fn key_id_ok(id: &str) -> bool {
    id.strip_prefix(KEY_ID_PREFIX).is_some_and(|hex| {
        hex.len() == KEY_ID_HEX_DIGITS
            && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// A runtime key as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// Its id ([`key_id`]): what logs, audit events and usage name.
    pub id: String,
    /// The principal it belongs to.
    pub principal: String,
    /// A name for people (optional).
    #[serde(default)]
    pub name: Option<String>,
    /// SHA-256 of the secret, lower-case hex.
    pub secret_sha256: String,
    /// The models it may use (a trailing `*` matches a prefix; `*` all).
    pub models: Vec<String>,
    /// Its own limits and budget.
    #[serde(default)]
    pub limits: Limits,
    /// When it stops working, Unix ms.
    #[serde(default)]
    pub expires_unix_ms: Option<u64>,
    /// When it was revoked, Unix ms (a revoked key is kept for the audit
    /// trail and never works again).
    #[serde(default)]
    pub revoked_unix_ms: Option<u64>,
    /// When it was created, Unix ms.
    pub created_unix_ms: u64,
    /// When it was last changed, Unix ms.
    pub updated_unix_ms: u64,
}

/// Why a stored key may not be used now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyUnusable {
    /// Revoked.
    Revoked,
    /// Past its expiry.
    Expired,
}

impl KeyRecord {
    /// Whether the key may be used at `unix_ms`.
    pub fn usable(&self, unix_ms: u64) -> Result<(), KeyUnusable> {
        if self.revoked_unix_ms.is_some() {
            return Err(KeyUnusable::Revoked);
        }
        if self.expires_unix_ms.is_some_and(|at| unix_ms >= at) {
            return Err(KeyUnusable::Expired);
        }
        Ok(())
    }
}

/// A field of an admin's key change that is not valid: which, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFieldError {
    /// The field, as the admin API names it.
    pub field: &'static str,
    /// Why.
    pub reason: &'static str,
}

/// Check the fields of a key an admin creates or changes (R-LIM-5: every
/// string bounded before it is stored).
pub fn check_key_fields(record: &KeyRecord, now_unix_ms: u64) -> Result<(), KeyFieldError> {
    let err = |field, reason| Err(KeyFieldError { field, reason });
    if !principal_ok(&record.principal) {
        return err("principal", "must be 1-128 chars of [A-Za-z0-9._-]");
    }
    if let Some(name) = &record.name
        && (name.chars().count() > MAX_KEY_NAME_CHARS || name.chars().any(char::is_control))
    {
        return err(
            "name",
            "must be at most 128 characters, none a control character",
        );
    }
    if record.models.is_empty() {
        return err(
            "models",
            "must list at least one model pattern (\"*\" for all)",
        );
    }
    if record.models.len() > MAX_KEY_MODELS {
        return err("models", "lists more than 64 patterns");
    }
    if record.models.iter().any(|m| {
        m.is_empty() || m.len() > MAX_MODEL_PATTERN_BYTES || m.chars().any(char::is_control)
    }) {
        return err(
            "models",
            "each pattern must be 1-256 bytes, no control characters",
        );
    }
    let l = &record.limits;
    if [
        l.requests_per_minute,
        l.tokens_per_minute,
        l.concurrent_requests,
        l.journal_bytes,
        l.background_responses,
    ]
    .contains(&Some(0))
        || l.budget.is_some_and(|b| b.limit_micros == 0)
    {
        return err(
            "limits",
            "a limit must be at least 1 (leave it out for no limit)",
        );
    }
    if record
        .expires_unix_ms
        .is_some_and(|at| at <= now_unix_ms && record.revoked_unix_ms.is_none())
    {
        return err("expires_at", "must be in the future");
    }
    Ok(())
}

/// Whether `name` is a valid principal name: 1-128 chars of
/// `[A-Za-z0-9._-]`.
pub fn principal_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> KeyRecord {
        KeyRecord {
            id: key_id(7),
            principal: "team-a".into(),
            name: Some("ci".into()),
            secret_sha256: "00".repeat(32),
            models: vec!["*".into()],
            limits: Limits::default(),
            expires_unix_ms: Some(2_000),
            revoked_unix_ms: None,
            created_unix_ms: 1_000,
            updated_unix_ms: 1_000,
        }
    }

    #[test]
    fn r_lim_5_key_ids_have_one_shape() {
        assert!(key_id_ok(&key_id(0)));
        assert!(key_id_ok(&key_id(u64::MAX)));
        for bad in [
            "",
            "key_",
            "key_0123",
            "key_0123456789ABCDEF",
            "kex_0123456789abcdef",
            "key_0123456789abcdef0",
        ] {
            assert!(!key_id_ok(bad), "{bad:?}");
        }
    }

    #[test]
    fn r_ten_4_a_revoked_or_expired_key_is_unusable() {
        let mut r = record();
        assert_eq!(r.usable(1_999), Ok(()));
        assert_eq!(r.usable(2_000), Err(KeyUnusable::Expired));
        r.revoked_unix_ms = Some(1_500);
        assert_eq!(r.usable(1_600), Err(KeyUnusable::Revoked));
    }

    #[test]
    fn r_ten_4_key_fields_are_bounded_and_named() {
        assert_eq!(check_key_fields(&record(), 1_000), Ok(()));
        let field = |f: fn(&mut KeyRecord)| {
            let mut r = record();
            f(&mut r);
            check_key_fields(&r, 1_000).unwrap_err().field
        };
        assert_eq!(field(|r| r.principal = "a b".into()), "principal");
        assert_eq!(field(|r| r.models.clear()), "models");
        assert_eq!(field(|r| r.models = vec!["m".into(); 65]), "models");
        assert_eq!(field(|r| r.name = Some("x".repeat(129))), "name");
        assert_eq!(field(|r| r.limits.requests_per_minute = Some(0)), "limits");
        assert_eq!(field(|r| r.expires_unix_ms = Some(999)), "expires_at");
    }
}
