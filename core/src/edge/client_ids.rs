//! Identifiers a client sends back to the Edge (R-LIM-5): the id of a
//! stored response or completion (in a path, or as `previous_response_id`),
//! an `Idempotency-Key`, and `metadata`. Each is checked for shape and
//! length here, before a store, a subject or a log sees it; the HTTP shell
//! answers a malformed one 404 (an id: no such object) or 400 for that
//! request alone.
//!
//! The Edge issues object ids itself ([`issued_id`]): a prefix naming the
//! object and 16 lower-case hex digits of a random seed. Any other string
//! names nothing the Edge could have stored, so it is not looked up: a
//! 4,000-character id, a NATS wildcard (`*`, `>`) or a subject separator
//! (`.`) never reaches the store.

use crate::journal::JournalApi;

/// The prefix of a Responses API response id (`resp_<16 hex>`).
pub const RESPONSE_ID_PREFIX: &str = "resp_";

/// The prefix of a Chat Completions id (`chatcmpl-<16 hex>`).
pub const CHAT_COMPLETION_ID_PREFIX: &str = "chatcmpl-";

/// Hex digits after an issued id's prefix.
pub const ISSUED_ID_HEX_DIGITS: usize = 16;

/// The longest `Idempotency-Key` accepted.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 255;

/// Key-value pairs `metadata` may hold (as OpenAI's API).
pub const MAX_METADATA_PAIRS: usize = 16;

/// The longest `metadata` key, in characters.
pub const MAX_METADATA_KEY_CHARS: usize = 64;

/// The longest `metadata` value, in characters.
pub const MAX_METADATA_VALUE_CHARS: usize = 512;

/// The id the Edge issues for an object with `prefix`, from a random
/// `seed`: `<prefix><seed as 16 lower-case hex>`.
pub fn issued_id(prefix: &str, seed: u64) -> String {
    format!("{prefix}{seed:016x}")
}

/// What a log names a response by (R-OBS-1): the first 12 hex digits of
/// the SHA-256 of its id. An operator who holds an id (a client sent it)
/// finds its log lines by computing the tag; a log reader cannot fetch,
/// cancel or continue a response from its tag.
pub fn log_tag(id: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(id.as_bytes())
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The seed of `id` if it has the shape [`issued_id`] gives an object with
/// `prefix`; `None` for any other string (R-LIM-5). Looks at no more than
/// the prefix and 16 bytes past it.
pub fn issued_id_seed(prefix: &str, id: &str) -> Option<u64> {
    let hex = id.strip_prefix(prefix)?;
    if hex.len() != ISSUED_ID_HEX_DIGITS
        || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// The prefix of the ids of `api`'s objects that a client can fetch by id
/// (`GET /v1/responses/{id}`, `GET /v1/chat/completions/{id}`); `None` for
/// an API whose stored objects are not fetched by id.
pub fn retrievable_id_prefix(api: JournalApi) -> Option<&'static str> {
    match api {
        JournalApi::Responses => Some(RESPONSE_ID_PREFIX),
        JournalApi::ChatCompletions => Some(CHAT_COMPLETION_ID_PREFIX),
        JournalApi::Completions
        | JournalApi::OllamaChat
        | JournalApi::OllamaGenerate
        | JournalApi::Embeddings
        | JournalApi::OllamaEmbed
        | JournalApi::Messages => None,
    }
}

/// Whether `id` can name a stored object of `api` at all (R-LIM-5): an id
/// that cannot is answered "not found" without a store read.
pub fn may_name_stored(api: JournalApi, id: &str) -> bool {
    retrievable_id_prefix(api).is_some_and(|prefix| issued_id_seed(prefix, id).is_some())
}

/// Whether `key` (trimmed) is an acceptable `Idempotency-Key`: 1 to
/// [`MAX_IDEMPOTENCY_KEY_CHARS`] visible ASCII characters (R-LIM-5).
pub fn idempotency_key_ok(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_IDEMPOTENCY_KEY_CHARS
        && key.bytes().all(|b| b.is_ascii_graphic())
}

/// What is wrong with a request's `metadata`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetadataFault {
    /// More than [`MAX_METADATA_PAIRS`] pairs.
    TooManyPairs,
    /// A key longer than [`MAX_METADATA_KEY_CHARS`].
    KeyTooLong,
    /// A value longer than [`MAX_METADATA_VALUE_CHARS`].
    ValueTooLong,
    /// A value that is not a string.
    ValueNotString,
}

impl MetadataFault {
    /// The stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            MetadataFault::TooManyPairs => "too_many_pairs",
            MetadataFault::KeyTooLong => "key_too_long",
            MetadataFault::ValueTooLong => "value_too_long",
            MetadataFault::ValueNotString => "value_not_string",
        }
    }

    /// What the client is told.
    pub fn detail(self) -> &'static str {
        match self {
            MetadataFault::TooManyPairs => "must have at most 16 key-value pairs.",
            MetadataFault::KeyTooLong => "keys must be at most 64 characters.",
            MetadataFault::ValueTooLong => "values must be at most 512 characters.",
            MetadataFault::ValueNotString => "values must be strings.",
        }
    }
}

/// Check `metadata`'s pairs, each a key and its value if that is a string
/// (R-LIM-5): at most [`MAX_METADATA_PAIRS`] of them, keys and values within
/// their lengths. Stops at the first fault or past the pair limit.
pub fn check_metadata<'a>(
    pairs: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
) -> Result<(), MetadataFault> {
    for (i, (key, value)) in pairs.into_iter().enumerate() {
        if i >= MAX_METADATA_PAIRS {
            return Err(MetadataFault::TooManyPairs);
        }
        if exceeds_chars(key, MAX_METADATA_KEY_CHARS) {
            return Err(MetadataFault::KeyTooLong);
        }
        let value = value.ok_or(MetadataFault::ValueNotString)?;
        if exceeds_chars(value, MAX_METADATA_VALUE_CHARS) {
            return Err(MetadataFault::ValueTooLong);
        }
    }
    Ok(())
}

/// Whether `s` has more than `max` characters (counting no further).
fn exceeds_chars(s: &str, max: usize) -> bool {
    s.len() > max && s.chars().nth(max).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn r_obs_1_a_log_tag_is_short_stable_and_not_the_id() {
        let id = issued_id(RESPONSE_ID_PREFIX, 0x1234);
        let tag = log_tag(&id);
        assert_eq!(tag.len(), 12);
        assert_eq!(tag, log_tag(&id));
        assert!(!tag.contains("1234") && !id.contains(&tag));
        assert_ne!(tag, log_tag(&issued_id(RESPONSE_ID_PREFIX, 0x1235)));
    }

    #[test]
    fn an_issued_id_has_its_prefix_and_16_hex_digits() {
        assert_eq!(issued_id(RESPONSE_ID_PREFIX, 0xab), "resp_00000000000000ab");
        assert_eq!(
            issued_id(CHAT_COMPLETION_ID_PREFIX, u64::MAX),
            "chatcmpl-ffffffffffffffff"
        );
    }

    #[test]
    fn malformed_ids_name_nothing_r_lim_5() {
        let long = format!("resp_{}", "a".repeat(4_100));
        for id in [
            "",
            "resp_",
            "resp_0123",
            "resp_0123456789abcdef0",
            "resp_0123456789ABCDEF",
            "resp_0123456789abcde*",
            "resp_0123456789abcd.>",
            "resp_012345678\u{e9}abcdef",
            " resp_0123456789abcdef",
            "chatcmpl-0123456789abcdef",
            long.as_str(),
        ] {
            assert!(!may_name_stored(JournalApi::Responses, id), "{id:?}");
        }
        assert!(may_name_stored(
            JournalApi::Responses,
            "resp_0123456789abcdef"
        ));
        assert!(may_name_stored(
            JournalApi::ChatCompletions,
            "chatcmpl-0123456789abcdef"
        ));
        assert!(!may_name_stored(
            JournalApi::Completions,
            "resp_0123456789abcdef"
        ));
    }

    #[test]
    fn idempotency_keys_are_1_to_255_visible_ascii_characters() {
        assert!(idempotency_key_ok("k"));
        assert!(idempotency_key_ok(&"k".repeat(MAX_IDEMPOTENCY_KEY_CHARS)));
        assert!(!idempotency_key_ok(""));
        assert!(!idempotency_key_ok(
            &"k".repeat(MAX_IDEMPOTENCY_KEY_CHARS + 1)
        ));
        assert!(!idempotency_key_ok("a b"));
        assert!(!idempotency_key_ok("\u{e9}"));
    }

    #[test]
    fn metadata_is_bounded_at_16_pairs_64_char_keys_512_char_values_r_lim_5() {
        let key = "k".repeat(MAX_METADATA_KEY_CHARS);
        let value = "\u{e9}".repeat(MAX_METADATA_VALUE_CHARS);
        let at_bound: Vec<(String, String)> = (0..MAX_METADATA_PAIRS)
            .map(|i| (format!("{i:064}"), value.clone()))
            .collect();
        fn pairs(v: &[(String, String)]) -> Vec<(&str, Option<&str>)> {
            v.iter()
                .map(|(k, v)| (k.as_str(), Some(v.as_str())))
                .collect()
        }
        assert_eq!(check_metadata(pairs(&at_bound)), Ok(()));
        let mut over = at_bound.clone();
        over.push(("x".into(), "y".into()));
        assert_eq!(
            check_metadata(pairs(&over)),
            Err(MetadataFault::TooManyPairs)
        );
        let long_key = format!("{key}k");
        assert_eq!(
            check_metadata([(long_key.as_str(), Some("v"))]),
            Err(MetadataFault::KeyTooLong)
        );
        let long_value = format!("{value}x");
        assert_eq!(
            check_metadata([("k", Some(long_value.as_str()))]),
            Err(MetadataFault::ValueTooLong)
        );
        assert_eq!(
            check_metadata([("k", None)]),
            Err(MetadataFault::ValueNotString)
        );
    }

    proptest! {
        #[test]
        fn every_issued_id_is_accepted_and_gives_back_its_seed(seed in any::<u64>()) {
            for prefix in [RESPONSE_ID_PREFIX, CHAT_COMPLETION_ID_PREFIX] {
                prop_assert_eq!(issued_id_seed(prefix, &issued_id(prefix, seed)), Some(seed));
            }
        }

        #[test]
        fn an_accepted_id_is_exactly_an_issued_one(id in "(resp_)?[0-9a-fA-F.*> _-]{0,40}|.{0,80}") {
            // Whatever is accepted is what the Edge would issue for its seed:
            // short, and free of subject separators and wildcards.
            if let Some(seed) = issued_id_seed(RESPONSE_ID_PREFIX, &id) {
                prop_assert_eq!(issued_id(RESPONSE_ID_PREFIX, seed), id.clone());
            }
            prop_assert!(!may_name_stored(JournalApi::Responses, &id) || id.len() == 21);
        }
    }
}
