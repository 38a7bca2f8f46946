//! Object ids in the OpenAI style (`chatcmpl-…`, `resp_…`, `msg_…`, `call_…`).
//!
//! Randomness is an input: the caller supplies a `u64` (from its own RNG or
//! counter) and these functions only format it. Ids of the items inside one
//! response are derived from the response id plus an index, so one seed per
//! request is enough and every derived id is unique within its response.

use iop_core::edge::client_ids;

/// `chatcmpl-<16 hex>`: a Chat Completions id (its shape is core's, which
/// checks a client's ids against it, R-LIM-5).
pub fn chat_completion_id(seed: u64) -> String {
    client_ids::issued_id(client_ids::CHAT_COMPLETION_ID_PREFIX, seed)
}

/// `resp_<16 hex>`: a Responses API response id (its shape is core's).
pub fn response_id(seed: u64) -> String {
    client_ids::issued_id(client_ids::RESPONSE_ID_PREFIX, seed)
}

/// `msg_<16 hex>`: a Responses API message item id.
pub fn message_id(seed: u64) -> String {
    format!("msg_{seed:016x}")
}

/// `call_<16 hex>`: a tool call id.
pub fn call_id(seed: u64) -> String {
    format!("call_{seed:016x}")
}

/// `fc_<16 hex>`: a Responses API function-call item id.
pub fn function_call_item_id(seed: u64) -> String {
    format!("fc_{seed:016x}")
}

/// The longest suffix taken from a parent id when deriving item ids.
const MAX_SUFFIX_CHARS: usize = 48;

/// An id for item `index` of the object `parent_id`: `<prefix><suffix><index as 4 hex>`.
///
/// `suffix` is the part of `parent_id` after its first `_` or `-`, cut to
/// ASCII alphanumerics, so `derived_id("msg_", "resp_00ab", 1)` is
/// `msg_00ab0001`.
pub fn derived_id(prefix: &str, parent_id: &str, index: u32) -> String {
    let suffix = parent_id
        .split_once(['_', '-'])
        .map_or(parent_id, |(_, rest)| rest);
    let suffix: String = suffix
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(MAX_SUFFIX_CHARS)
        .collect();
    format!("{prefix}{suffix}{index:04x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_prefix_and_the_seed_in_hex() {
        assert_eq!(chat_completion_id(0xab), "chatcmpl-00000000000000ab");
        assert_eq!(response_id(1), "resp_0000000000000001");
        assert_eq!(message_id(u64::MAX), "msg_ffffffffffffffff");
        assert_eq!(call_id(2), "call_0000000000000002");
        assert_eq!(function_call_item_id(3), "fc_0000000000000003");
    }

    #[test]
    fn derived_ids_are_unique_per_index_and_sanitized() {
        let parent = response_id(7);
        assert_eq!(derived_id("msg_", &parent, 1), "msg_00000000000000070001");
        assert_ne!(derived_id("fc_", &parent, 1), derived_id("fc_", &parent, 2));
        assert_eq!(derived_id("call_", "we/ird id", 0), "call_weirdid0000");
    }
}
