//! How tenants' state is laid out in its buckets: bucket names, keys
//! (every name escaped into one subject token, as the journal's ids are)
//! and values (a format byte, then postcard). Pure, so unit-tested alone.

use bytes::Bytes;
use iop_core::tenant::key_format::{KeyRecordError, decode_key_record, encode_key_record};
use iop_core::tenant::keys::KeyRecord;
use iop_core::tenant::usage::{UsageKey, UsageQuery, UsageTotals};
use iop_core::tenant::{ClaimedCounter, CounterKey, DAY_MS, Meter, Subject};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::layout::{DecodeError, hex, token};

/// The longest subject token a name becomes; a longer one is replaced by
/// its hash ([`name_token`]), so no client-chosen name (a model's) makes a
/// subject longer than the server takes.
pub(crate) const MAX_TOKEN_BYTES: usize = 128;

/// The format of every counter and usage value this build writes and
/// reads, and of key records without limits per model (format 1 of
/// [`iop_core::tenant::key_format`]).
const VALUE_FORMAT: u8 = 1;
const _: () = assert!(VALUE_FORMAT == iop_core::tenant::key_format::KEY_FORMAT_V1);

/// A name as one subject token: [`token`], or when that is longer than
/// [`MAX_TOKEN_BYTES`], `==` and the hex SHA-256 of the name (never a
/// [`token`]: there every `=` is followed by two hex digits).
pub(crate) fn name_token(name: &str) -> String {
    let t = token(name);
    if t.len() <= MAX_TOKEN_BYTES {
        return t;
    }
    format!("=={}", hex(&Sha256::digest(name.as_bytes())))
}

/// The names of the tenants' buckets, after the journal's bucket.
#[derive(Debug, Clone)]
pub(crate) struct TenantNames {
    /// Counters of minute windows (requests, tokens): expire by the
    /// bucket's `max_age`, and a sweep forgets them once over.
    pub(crate) rates: String,
    /// Spend counters per budget period: kept until a sweep finds the
    /// period over (a budget in total for good).
    pub(crate) budgets: String,
    /// Usage rows: expire by the bucket's `max_age` (their retention).
    pub(crate) usage: String,
    /// Runtime API keys.
    pub(crate) keys: String,
}

impl TenantNames {
    pub(crate) fn new(journal_bucket: &str) -> Self {
        TenantNames {
            rates: format!("{journal_bucket}_rates"),
            budgets: format!("{journal_bucket}_budgets"),
            usage: format!("{journal_bucket}_usage"),
            keys: format!("{journal_bucket}_keys"),
        }
    }

    /// The bucket holding `counter`.
    pub(crate) fn counter_bucket(&self, counter: &CounterKey) -> &str {
        match counter.meter {
            // Concurrency gauges have no window: kept with the budgets.
            Meter::Spend | Meter::Slots => &self.budgets,
            Meter::Requests | Meter::Tokens | Meter::JournalBytes | Meter::Background => {
                &self.rates
            }
        }
    }
}

/// The subject of bucket key `key` in `bucket`.
pub(crate) fn subject(bucket: &str, key: &str) -> String {
    format!("$KV.{bucket}.{key}")
}

fn meter_token(meter: Meter) -> &'static str {
    match meter {
        Meter::Requests => "requests",
        Meter::Tokens => "tokens",
        Meter::Spend => "spend",
        Meter::JournalBytes => "journal_bytes",
        Meter::Background => "background",
        Meter::Slots => "slots",
    }
}

/// A counter's bucket key: `c.<meter>.<window>.<k|p>.<name>`, and for a
/// limit per model (R-TEN-1) `c.<meter>.<window>.<km|pm>.<name>.<model>`.
pub(crate) fn counter_key(counter: &CounterKey) -> String {
    let (kind, name, model) = match &counter.subject {
        Subject::Key(id) => ("k", id, None),
        Subject::Principal(name) => ("p", name, None),
        Subject::KeyModel { key, model } => ("km", key, Some(model)),
        Subject::PrincipalModel { principal, model } => ("pm", principal, Some(model)),
    };
    let mut key = format!(
        "c.{}.{}.{kind}.{}",
        meter_token(counter.meter),
        counter.window_unix_ms,
        name_token(name)
    );
    if let Some(model) = model {
        key.push('.');
        key.push_str(&name_token(model));
    }
    key
}

/// A usage row's bucket key: `u.<day>.<principal>.<key>.<model>`.
pub(crate) fn usage_key(row: &UsageKey) -> String {
    format!(
        "u.{}.{}.{}.{}",
        row.day_unix_ms,
        name_token(&row.principal),
        name_token(&row.key),
        name_token(&row.model)
    )
}

/// The bucket keys a usage query may match, as a subject filter (after
/// the bucket's prefix): one day's when it asks for one, one principal's
/// or key's when it names one; every row read is then checked with
/// [`UsageQuery::matches`].
pub(crate) fn usage_filter(query: &UsageQuery) -> String {
    let day = if query.from_day_unix_ms == query.to_day_unix_ms
        && query.from_day_unix_ms.is_multiple_of(DAY_MS)
    {
        query.from_day_unix_ms.to_string()
    } else {
        "*".into()
    };
    let name = |n: &Option<String>| n.as_deref().map_or_else(|| "*".into(), name_token);
    format!("u.{day}.{}.{}.*", name(&query.principal), name(&query.key))
}

/// A key record's bucket key: `k.<id>`.
pub(crate) fn key_key(id: &str) -> String {
    format!("k.{}", name_token(id))
}

/// Keys of key records start with this.
pub(crate) const KEY_KEY_PREFIX: &str = "k.";

fn encode<T: Serialize>(value: &T) -> Result<Bytes, DecodeError> {
    let mut out = vec![VALUE_FORMAT];
    out.extend(postcard::to_allocvec(value).map_err(|e| DecodeError::Record(e.to_string()))?);
    Ok(out.into())
}

fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, DecodeError> {
    match bytes.split_first() {
        Some((&VALUE_FORMAT, body)) => {
            postcard::from_bytes(body).map_err(|e| DecodeError::Record(e.to_string()))
        }
        Some((&other, _)) => Err(DecodeError::RecordFormat(other)),
        None => Err(DecodeError::Record("empty".into())),
    }
}

/// A counter's value: itself (so a sweep reads what it is), how much is
/// claimed, and, once a stopping Edge gave back to it, the holders whose
/// give-back it took (R-TEN-3). Without give-backs it is the pair earlier
/// builds write; with them the set follows the pair, which earlier builds
/// read past (postcard leaves trailing bytes unread), so they still read
/// the claimed total; their claims write the pair alone, dropping the set.
pub(crate) fn encode_counter(
    counter: &CounterKey,
    stored: &ClaimedCounter,
) -> Result<Bytes, DecodeError> {
    if stored.gave_back.is_empty() {
        encode(&(counter, stored.claimed))
    } else {
        encode(&(counter, stored.claimed, &stored.gave_back))
    }
}

/// A counter's value, either shape [`encode_counter`] writes.
pub(crate) fn decode_counter(bytes: &[u8]) -> Result<(CounterKey, ClaimedCounter), DecodeError> {
    type WithGiveBacks = (CounterKey, u64, std::collections::BTreeSet<String>);
    if let Ok((counter, claimed, gave_back)) = decode::<WithGiveBacks>(bytes) {
        return Ok((counter, ClaimedCounter { claimed, gave_back }));
    }
    let (counter, claimed): (CounterKey, u64) = decode(bytes)?;
    Ok((
        counter,
        ClaimedCounter {
            claimed,
            ..ClaimedCounter::default()
        },
    ))
}

/// A concurrency gauge's value: itself and its holders (R-TEN-1).
pub(crate) fn encode_slots(
    counter: &CounterKey,
    book: &iop_core::tenant::slots::SlotBook,
) -> Result<Bytes, DecodeError> {
    encode(&(counter, book))
}

pub(crate) fn decode_slots(
    bytes: &[u8],
) -> Result<(CounterKey, iop_core::tenant::slots::SlotBook), DecodeError> {
    decode(bytes)
}

/// A usage row's value: its key (a listing reads it back whole) and its
/// totals.
pub(crate) fn encode_usage(row: &UsageKey, totals: &UsageTotals) -> Result<Bytes, DecodeError> {
    encode(&(row, totals))
}

pub(crate) fn decode_usage(bytes: &[u8]) -> Result<(UsageKey, UsageTotals), DecodeError> {
    decode(bytes)
}

/// A key record's value: its format byte ([`VALUE_FORMAT`] for format 1,
/// as earlier builds write and read every record; see
/// [`iop_core::tenant::key_format`]), then the record.
pub(crate) fn encode_key(record: &KeyRecord) -> Result<Bytes, DecodeError> {
    let (format, bytes) = encode_key_record(record);
    let mut out = Vec::with_capacity(bytes.len() + 1);
    out.push(format);
    out.extend(bytes);
    Ok(out.into())
}

pub(crate) fn decode_key(bytes: &[u8]) -> Result<KeyRecord, DecodeError> {
    match bytes.split_first() {
        Some((&format, body)) => decode_key_record(format, body).map_err(|e| match e {
            KeyRecordError::UnknownFormat(f) => DecodeError::RecordFormat(f),
            KeyRecordError::Undecodable { reason, .. } => DecodeError::Record(reason),
        }),
        None => Err(DecodeError::Record("empty".into())),
    }
}

#[cfg(test)]
mod tests {
    use iop_core::tenant::Limits;

    use super::*;

    #[test]
    fn names_are_one_token_each_and_long_ones_are_hashed() {
        assert_eq!(name_token("team-a"), "team-a");
        assert_eq!(name_token("m.2/x"), "m=2E2=2Fx");
        let long = "m".repeat(MAX_TOKEN_BYTES + 1);
        let hashed = name_token(&long);
        assert!(hashed.starts_with("==") && hashed.len() == 66, "{hashed}");
        assert_ne!(hashed, name_token(&"m".repeat(MAX_TOKEN_BYTES + 2)));
        assert_eq!(
            name_token(&"m".repeat(MAX_TOKEN_BYTES)).len(),
            MAX_TOKEN_BYTES
        );
        let escaped = "é".repeat(MAX_TOKEN_BYTES);
        assert!(name_token(&escaped).len() <= 66);
    }

    #[test]
    fn keys_have_a_fixed_number_of_tokens_whatever_the_names() {
        let c = CounterKey {
            subject: Subject::Principal("a.b *>".into()),
            meter: Meter::Spend,
            window_unix_ms: 0,
        };
        assert_eq!(counter_key(&c), "c.spend.0.p.a=2Eb=20=2A=3E");
        let per_model = |subject| CounterKey {
            subject,
            meter: Meter::Requests,
            window_unix_ms: 60_000,
        };
        assert_eq!(
            counter_key(&per_model(Subject::KeyModel {
                key: "k".into(),
                model: "llama3:8b".into()
            })),
            "c.requests.60000.km.k.llama3=3A8b"
        );
        assert_eq!(
            counter_key(&per_model(Subject::PrincipalModel {
                principal: "p.1".into(),
                model: "org/m.2".into()
            })),
            "c.requests.60000.pm.p=2E1.org=2Fm=2E2"
        );
        assert_ne!(
            counter_key(&per_model(Subject::KeyModel {
                key: "k".into(),
                model: "m".into()
            })),
            counter_key(&per_model(Subject::Key("k.m".into()))),
            "a per-model counter never meets a whole one"
        );
        let row = UsageKey {
            day_unix_ms: 2 * DAY_MS,
            principal: "p".into(),
            key: "k.1".into(),
            model: "".into(),
        };
        assert_eq!(usage_key(&row), format!("u.{}.p.k=2E1.=", 2 * DAY_MS));
        assert_eq!(key_key("key_00ff"), "k.key_00ff");
    }

    #[test]
    fn a_usage_filter_narrows_to_a_day_a_principal_or_a_key() {
        let mut q = UsageQuery {
            from_day_unix_ms: DAY_MS,
            to_day_unix_ms: 3 * DAY_MS,
            principal: None,
            key: None,
            max_rows: 10,
        };
        assert_eq!(usage_filter(&q), "u.*.*.*.*");
        q.principal = Some("p.1".into());
        assert_eq!(usage_filter(&q), "u.*.p=2E1.*.*");
        q.to_day_unix_ms = DAY_MS;
        q.key = Some("k".into());
        assert_eq!(usage_filter(&q), format!("u.{DAY_MS}.p=2E1.k.*"));
    }

    #[test]
    fn values_round_trip_and_a_foreign_format_is_refused() {
        let c = CounterKey {
            subject: Subject::Key("k".into()),
            meter: Meter::Tokens,
            window_unix_ms: 60_000,
        };
        let plain = ClaimedCounter {
            claimed: 42,
            ..ClaimedCounter::default()
        };
        let bytes = encode_counter(&c, &plain).unwrap();
        assert_eq!(decode_counter(&bytes).unwrap(), (c.clone(), plain));
        let pair: (CounterKey, u64) = decode(&bytes).unwrap();
        assert_eq!(pair, (c.clone(), 42), "as earlier builds write it");
        let given = ClaimedCounter {
            claimed: 40,
            gave_back: ["edge-1".to_owned()].into(),
        };
        let bytes = encode_counter(&c, &given).unwrap();
        assert_eq!(decode_counter(&bytes).unwrap(), (c.clone(), given));
        let pair: (CounterKey, u64) = decode(&bytes).unwrap();
        assert_eq!(pair, (c.clone(), 40), "an earlier build reads the total");
        let row = UsageKey {
            day_unix_ms: DAY_MS,
            principal: "p".into(),
            key: "k".into(),
            model: "m".into(),
        };
        let totals = UsageTotals {
            requests: 1,
            input_tokens: 2,
            cached_input_tokens: 1,
            output_tokens: 3,
            spend_micros: 4,
        };
        assert_eq!(
            decode_usage(&encode_usage(&row, &totals).unwrap()).unwrap(),
            (row, totals)
        );
        let record = KeyRecord {
            id: "key_0000000000000001".into(),
            principal: "p".into(),
            name: None,
            secret_sha256: "00".repeat(32),
            models: vec!["*".into()],
            limits: Limits::default(),
            expires_unix_ms: None,
            revoked_unix_ms: None,
            created_unix_ms: 1,
            updated_unix_ms: 1,
        };
        let mut bytes = encode_key(&record).unwrap().to_vec();
        assert_eq!(decode_key(&bytes).unwrap(), record);
        // R-TEN-4: what an earlier build stored (the format byte, then its
        // record) is read, with no limits per model; a record without them
        // is written as an earlier build reads it.
        let old = iop_core::tenant::key_format::KeyRecordV1::of(&record);
        let mut stored = vec![1];
        stored.extend(postcard::to_allocvec(&old).unwrap());
        assert_eq!(decode_key(&stored).unwrap(), record);
        assert_eq!(bytes, stored);
        let mut with_limits = record.clone();
        with_limits.limits.per_model.insert(
            "gpt-4o".into(),
            iop_core::tenant::ModelLimits {
                requests_per_minute: Some(3),
                ..Default::default()
            },
        );
        let v2 = encode_key(&with_limits).unwrap();
        assert_eq!(v2[0], 2);
        assert_eq!(decode_key(&v2).unwrap(), with_limits);
        bytes[0] = 9;
        assert_eq!(decode_key(&bytes), Err(DecodeError::RecordFormat(9)));
        assert!(decode_key(&[]).is_err());
    }
}
