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
    /// The field, as the admin API names it (`limits.per_model.<model>.<limit>`
    /// for a limit per model).
    pub field: String,
    /// Why.
    pub reason: &'static str,
}

/// Check the fields of a key an admin creates or changes (R-LIM-5: every
/// string bounded before it is stored).
pub fn check_key_fields(record: &KeyRecord, now_unix_ms: u64) -> Result<(), KeyFieldError> {
    let err = |field: &str, reason| {
        Err(KeyFieldError {
            field: field.to_owned(),
            reason,
        })
    };
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
    if let Err(e) = record.limits.check() {
        return Err(KeyFieldError {
            field: format!("limits.{}", e.field),
            reason: e.reason,
        });
    }
    if record
        .expires_unix_ms
        .is_some_and(|at| at <= now_unix_ms && record.revoked_unix_ms.is_none())
    {
        return err("expires_at", "must be in the future");
    }
    Ok(())
}

/// The fields an admin sets on a key (R-TEN-4): each `None` leaves the
/// field as it is; `Some(None)` clears an optional one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyUpdate {
    /// The principal (required to create; to update, only the key's own).
    pub principal: Option<String>,
    /// A name for people.
    pub name: Option<Option<String>>,
    /// The models it may use.
    pub models: Option<Vec<String>>,
    /// Its limits.
    pub limits: Option<Limits>,
    /// When it stops working, Unix ms.
    pub expires_unix_ms: Option<Option<u64>>,
}

/// What an admin does to a stored key (R-TEN-4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyChange {
    /// Change its fields.
    Update(KeyUpdate),
    /// Revoke it (again: no change).
    Revoke,
    /// Give it a new secret, by the new secret's SHA-256.
    Rotate {
        /// SHA-256 of the new secret, lower-case hex.
        secret_sha256: String,
    },
}

/// A new runtime key (R-TEN-4): `existing` runtime keys are stored (revoked
/// ones count) of at most `max_keys`; the fields are checked as
/// [`check_key_fields`] does. The count is the caller's view of the store:
/// Edges creating keys at the same moment can each pass it once.
pub fn new_key(
    id: String,
    secret_sha256: String,
    fields: &KeyUpdate,
    existing: usize,
    max_keys: usize,
    now_unix_ms: u64,
) -> Result<KeyRecord, KeyFieldError> {
    let Some(principal) = fields.principal.clone() else {
        return Err(KeyFieldError {
            field: "principal".into(),
            reason: "is required",
        });
    };
    if existing >= max_keys {
        return Err(KeyFieldError {
            field: "principal".into(),
            reason: "this deployment holds its most runtime keys ([tenants] max_keys); revoked keys count",
        });
    }
    let mut record = KeyRecord {
        id,
        principal,
        name: None,
        secret_sha256,
        models: vec!["*".to_owned()],
        limits: Limits::default(),
        expires_unix_ms: None,
        revoked_unix_ms: None,
        created_unix_ms: now_unix_ms,
        updated_unix_ms: now_unix_ms,
    };
    change_key(
        &mut record,
        &KeyChange::Update(KeyUpdate {
            principal: None,
            ..fields.clone()
        }),
        now_unix_ms,
    )?;
    Ok(record)
}

/// Apply an admin's change to a stored key (R-TEN-4): a key's principal
/// never changes (what it spent stays with whom it spent for), a revoked
/// key is never updated or rotated (revoking it again changes nothing),
/// and the fields are checked as [`check_key_fields`] does.
pub fn change_key(
    record: &mut KeyRecord,
    change: &KeyChange,
    now_unix_ms: u64,
) -> Result<(), KeyFieldError> {
    let revoked = record.revoked_unix_ms.is_some();
    match change {
        KeyChange::Revoke => {
            if !revoked {
                record.revoked_unix_ms = Some(now_unix_ms);
                record.updated_unix_ms = now_unix_ms;
            }
            Ok(())
        }
        _ if revoked => Err(KeyFieldError {
            field: "id".into(),
            reason: "the key is revoked",
        }),
        KeyChange::Rotate { secret_sha256 } => {
            record.secret_sha256.clone_from(secret_sha256);
            record.updated_unix_ms = now_unix_ms;
            Ok(())
        }
        KeyChange::Update(fields) => {
            if fields
                .principal
                .as_ref()
                .is_some_and(|p| *p != record.principal)
            {
                return Err(KeyFieldError {
                    field: "principal".into(),
                    reason: "a key's principal does not change; create a key for the other principal",
                });
            }
            let mut next = record.clone();
            if let Some(name) = &fields.name {
                next.name.clone_from(name);
            }
            if let Some(models) = &fields.models {
                next.models.clone_from(models);
            }
            if let Some(limits) = &fields.limits {
                next.limits = limits.clone();
            }
            if let Some(expires) = fields.expires_unix_ms {
                next.expires_unix_ms = expires;
            }
            next.updated_unix_ms = now_unix_ms;
            check_key_fields(&next, now_unix_ms)?;
            *record = next;
            Ok(())
        }
    }
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
        assert_eq!(
            field(|r| r.limits.requests_per_minute = Some(0)),
            "limits.requests_per_minute"
        );
        assert_eq!(
            field(|r| {
                r.limits.per_model.insert(
                    "gpt-4o".into(),
                    crate::tenant::ModelLimits {
                        concurrent_requests: Some(0),
                        ..Default::default()
                    },
                );
            }),
            "limits.per_model.gpt-4o.concurrent_requests"
        );
        assert_eq!(
            field(|r| {
                r.limits.per_model = (0..=crate::tenant::MAX_MODEL_LIMITS)
                    .map(|i| (format!("m{i}"), Default::default()))
                    .collect();
            }),
            "limits.per_model"
        );
        assert_eq!(field(|r| r.expires_unix_ms = Some(999)), "expires_at");
    }

    #[test]
    fn r_ten_4_a_keys_principal_never_changes_and_a_revoked_key_stays_revoked() {
        let mut r = record();
        let other = KeyChange::Update(KeyUpdate {
            principal: Some("team-b".into()),
            ..KeyUpdate::default()
        });
        assert_eq!(
            change_key(&mut r, &other, 1_100).unwrap_err().field,
            "principal"
        );
        let same = KeyChange::Update(KeyUpdate {
            principal: Some("team-a".into()),
            models: Some(vec!["gpt-*".into()]),
            ..KeyUpdate::default()
        });
        change_key(&mut r, &same, 1_100).unwrap();
        assert_eq!(
            (r.models.as_slice(), r.updated_unix_ms),
            (&["gpt-*".to_owned()][..], 1_100)
        );

        // An invalid change leaves the record as it was.
        let before = r.clone();
        let bad = KeyChange::Update(KeyUpdate {
            models: Some(vec![]),
            ..KeyUpdate::default()
        });
        assert_eq!(change_key(&mut r, &bad, 1_200).unwrap_err().field, "models");
        assert_eq!(r, before);

        change_key(&mut r, &KeyChange::Revoke, 1_300).unwrap();
        assert_eq!(r.revoked_unix_ms, Some(1_300));
        change_key(&mut r, &KeyChange::Revoke, 1_400).unwrap();
        assert_eq!(
            r.revoked_unix_ms,
            Some(1_300),
            "revoking again changes nothing"
        );
        let rotate = KeyChange::Rotate {
            secret_sha256: "11".repeat(32),
        };
        for change in [rotate, same] {
            assert_eq!(change_key(&mut r, &change, 1_500).unwrap_err().field, "id");
        }
        assert_eq!(r.secret_sha256, "00".repeat(32));
    }

    #[test]
    fn r_ten_4_a_new_key_needs_a_principal_and_room() {
        let fields = KeyUpdate {
            principal: Some("team-a".into()),
            limits: Some(Limits {
                requests_per_minute: Some(60),
                ..Limits::default()
            }),
            ..KeyUpdate::default()
        };
        let made = new_key(key_id(1), "00".repeat(32), &fields, 9, 10, 5).unwrap();
        assert_eq!(made.models, vec!["*".to_owned()]);
        assert_eq!(made.limits.requests_per_minute, Some(60));
        assert_eq!((made.created_unix_ms, made.revoked_unix_ms), (5, None));
        let full = new_key(key_id(2), "00".repeat(32), &fields, 10, 10, 5);
        assert_eq!(full.unwrap_err().field, "principal");
        let nobody = new_key(key_id(3), "00".repeat(32), &KeyUpdate::default(), 0, 10, 5);
        assert_eq!(nobody.unwrap_err().reason, "is required");
    }
}
