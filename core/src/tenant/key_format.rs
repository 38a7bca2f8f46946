//! How a runtime key is encoded in the deployment's store (R-TEN-4), by
//! format, so a record stored by an earlier build stays readable and a
//! record an earlier build can read is written so that it can.
//!
//! * Format 1: the record as every build before limits per model wrote
//!   it ([`KeyRecordV1`], postcard).
//! * Format 2: the record with its limits per model (R-TEN-1), postcard.
//!
//! A record is written in format 1 whenever format 1 holds all of it (no
//! limit per model), and always once revoked (a revoked key never works
//! again, so its limits per model are dropped): an Edge of an earlier
//! build reads it, and every Edge honours a revocation. Only a live key
//! with limits per model needs format 2. The stores frame the format: the
//! NATS store's value starts with the format byte (it always has); the
//! embedded store keeps format 1 bare, as before, and marks format 2 with
//! a leading 0 (a bare record starts with its id's length, never 0).

use serde::{Deserialize, Serialize};

use super::keys::KeyRecord;
use super::{Budget, Limits};

/// The format of records as earlier builds wrote them.
pub const KEY_FORMAT_V1: u8 = 1;

/// The format of records with limits per model.
pub const KEY_FORMAT_V2: u8 = 2;

/// A stored key record that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyRecordError {
    /// A format this build does not know (a later build's).
    #[error("a key record of unknown format {0}")]
    UnknownFormat(u8),
    /// Its bytes are not a record of its format.
    #[error("a key record of format {format} does not decode: {reason}")]
    Undecodable {
        /// Its format.
        format: u8,
        /// Why.
        reason: String,
    },
}

/// A key record in format 1 (frozen: the layout earlier builds read and
/// write).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecordV1 {
    /// See [`KeyRecord::id`].
    pub id: String,
    /// See [`KeyRecord::principal`].
    pub principal: String,
    /// See [`KeyRecord::name`].
    pub name: Option<String>,
    /// See [`KeyRecord::secret_sha256`].
    pub secret_sha256: String,
    /// See [`KeyRecord::models`].
    pub models: Vec<String>,
    /// Its limits, without limits per model.
    pub limits: LimitsV1,
    /// See [`KeyRecord::expires_unix_ms`].
    pub expires_unix_ms: Option<u64>,
    /// See [`KeyRecord::revoked_unix_ms`].
    pub revoked_unix_ms: Option<u64>,
    /// See [`KeyRecord::created_unix_ms`].
    pub created_unix_ms: u64,
    /// See [`KeyRecord::updated_unix_ms`].
    pub updated_unix_ms: u64,
}

/// Limits in format 1 (frozen).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LimitsV1 {
    /// See [`Limits::requests_per_minute`].
    pub requests_per_minute: Option<u64>,
    /// See [`Limits::tokens_per_minute`].
    pub tokens_per_minute: Option<u64>,
    /// See [`Limits::concurrent_requests`].
    pub concurrent_requests: Option<u64>,
    /// See [`Limits::budget`].
    pub budget: Option<Budget>,
    /// See [`Limits::journal_bytes`].
    pub journal_bytes: Option<u64>,
    /// See [`Limits::background_responses`].
    pub background_responses: Option<u64>,
}

impl KeyRecordV1 {
    /// The record this build uses: no limits per model.
    pub fn upgrade(self) -> KeyRecord {
        let l = self.limits;
        KeyRecord {
            id: self.id,
            principal: self.principal,
            name: self.name,
            secret_sha256: self.secret_sha256,
            models: self.models,
            limits: Limits {
                requests_per_minute: l.requests_per_minute,
                tokens_per_minute: l.tokens_per_minute,
                concurrent_requests: l.concurrent_requests,
                budget: l.budget,
                journal_bytes: l.journal_bytes,
                background_responses: l.background_responses,
                per_model: Default::default(),
            },
            expires_unix_ms: self.expires_unix_ms,
            revoked_unix_ms: self.revoked_unix_ms,
            created_unix_ms: self.created_unix_ms,
            updated_unix_ms: self.updated_unix_ms,
        }
    }

    /// `record` in format 1, its limits per model left out.
    pub fn of(record: &KeyRecord) -> KeyRecordV1 {
        let l = &record.limits;
        KeyRecordV1 {
            id: record.id.clone(),
            principal: record.principal.clone(),
            name: record.name.clone(),
            secret_sha256: record.secret_sha256.clone(),
            models: record.models.clone(),
            limits: LimitsV1 {
                requests_per_minute: l.requests_per_minute,
                tokens_per_minute: l.tokens_per_minute,
                concurrent_requests: l.concurrent_requests,
                budget: l.budget,
                journal_bytes: l.journal_bytes,
                background_responses: l.background_responses,
            },
            expires_unix_ms: record.expires_unix_ms,
            revoked_unix_ms: record.revoked_unix_ms,
            created_unix_ms: record.created_unix_ms,
            updated_unix_ms: record.updated_unix_ms,
        }
    }
}

/// `record` encoded: its format and its bytes (see the module docs for
/// which format).
pub fn encode_key_record(record: &KeyRecord) -> (u8, Vec<u8>) {
    // Plain data: postcard cannot fail on it short of running out of memory.
    if record.limits.per_model.is_empty() || record.revoked_unix_ms.is_some() {
        let bytes = postcard::to_allocvec(&KeyRecordV1::of(record)).unwrap_or_default();
        return (KEY_FORMAT_V1, bytes);
    }
    (
        KEY_FORMAT_V2,
        postcard::to_allocvec(record).unwrap_or_default(),
    )
}

/// A record of `format` from its bytes.
pub fn decode_key_record(format: u8, bytes: &[u8]) -> Result<KeyRecord, KeyRecordError> {
    let undecodable = |e: postcard::Error| KeyRecordError::Undecodable {
        format,
        reason: e.to_string(),
    };
    match format {
        KEY_FORMAT_V1 => postcard::from_bytes::<KeyRecordV1>(bytes)
            .map(KeyRecordV1::upgrade)
            .map_err(undecodable),
        KEY_FORMAT_V2 => postcard::from_bytes(bytes).map_err(undecodable),
        other => Err(KeyRecordError::UnknownFormat(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::super::keys::key_id;
    use super::super::{ModelLimits, Period};
    use super::*;

    fn record() -> KeyRecord {
        KeyRecord {
            id: key_id(7),
            principal: "team-a".into(),
            name: Some("ci".into()),
            secret_sha256: "ab".repeat(32),
            models: vec!["gpt-*".into()],
            limits: Limits {
                requests_per_minute: Some(60),
                budget: Some(Budget {
                    limit_micros: 5,
                    period: Period::Month,
                }),
                background_responses: Some(2),
                ..Limits::default()
            },
            expires_unix_ms: Some(9_000),
            revoked_unix_ms: None,
            created_unix_ms: 1_000,
            updated_unix_ms: 2_000,
        }
    }

    fn per_model(mut r: KeyRecord) -> KeyRecord {
        r.limits.per_model.insert(
            "gpt-4o".into(),
            ModelLimits {
                requests_per_minute: Some(10),
                tokens_per_minute: Some(1_000),
                concurrent_requests: None,
            },
        );
        r
    }

    #[test]
    fn r_ten_4_a_record_an_earlier_build_stored_decodes_with_no_limits_per_model() {
        // Exactly what an earlier build wrote: postcard of its record.
        let old = KeyRecordV1::of(&record());
        let bytes = postcard::to_allocvec(&old).unwrap();
        let read = decode_key_record(KEY_FORMAT_V1, &bytes).unwrap();
        assert_eq!(read, record());
        assert!(read.limits.per_model.is_empty());
    }

    #[test]
    fn r_ten_4_a_record_without_limits_per_model_is_written_as_earlier_builds_read_it() {
        let (format, bytes) = encode_key_record(&record());
        assert_eq!(format, KEY_FORMAT_V1);
        // An earlier build decodes it as its own record.
        let theirs: KeyRecordV1 = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(theirs.upgrade(), record());
    }

    #[test]
    fn r_ten_1_limits_per_model_round_trip_in_format_2_and_a_revocation_is_readable_by_every_build()
    {
        let live = per_model(record());
        let (format, bytes) = encode_key_record(&live);
        assert_eq!(format, KEY_FORMAT_V2);
        assert_eq!(decode_key_record(format, &bytes).unwrap(), live);

        let mut revoked = live.clone();
        revoked.revoked_unix_ms = Some(3_000);
        let (format, bytes) = encode_key_record(&revoked);
        assert_eq!(format, KEY_FORMAT_V1, "every build must see the revocation");
        let theirs: KeyRecordV1 = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(theirs.revoked_unix_ms, Some(3_000));
        let read = decode_key_record(format, &bytes).unwrap();
        assert_eq!(
            read.usable(3_000),
            Err(super::super::keys::KeyUnusable::Revoked)
        );
    }

    #[test]
    fn a_record_of_an_unknown_format_or_bad_bytes_is_a_typed_error() {
        assert_eq!(
            decode_key_record(3, &[]),
            Err(KeyRecordError::UnknownFormat(3))
        );
        assert!(matches!(
            decode_key_record(KEY_FORMAT_V2, &[0xff, 0xff]),
            Err(KeyRecordError::Undecodable { format: 2, .. })
        ));
        // A format 2 record is not read as format 1 (nor the reverse)
        // without an error or the same record.
        let (_, v2) = encode_key_record(&per_model(record()));
        assert_ne!(
            decode_key_record(KEY_FORMAT_V1, &v2).ok(),
            Some(per_model(record()))
        );
    }
}
