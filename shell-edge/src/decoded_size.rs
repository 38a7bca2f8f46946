//! What a JSON body costs once decoded (R-LIM-2: memory is accounted as
//! decoded, not as wire bytes).
//!
//! The API parsers build a `serde_json::Value` tree. Its cost per wire byte
//! depends on the shape: `0,` becomes a 32-byte `Value` (16x), but
//! `{"":0},` becomes a `BTreeMap` leaf node of several hundred bytes
//! (about 100x). [`decoded_size`] walks the body once without building
//! anything and returns an upper bound of the heap the tree will take, so a
//! request is charged what it will really cost before the tree exists, and
//! a body whose tree would be too large is refused unparsed.

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// The size of one `serde_json::Value`: its slot in an array or a map.
const VALUE_BYTES: usize = std::mem::size_of::<serde_json::Value>();

/// An upper bound of one `BTreeMap<String, Value>` node (a leaf holds up to
/// 11 keys and values; an internal node also 12 child pointers).
const MAP_NODE_BYTES: usize = 11 * (std::mem::size_of::<String>() + VALUE_BYTES) + 12 * 8 + 16;

/// Why a body has no decoded size: it is not one JSON value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a JSON value: {0}")]
pub struct NotJson(String);

/// An upper bound of the heap bytes the `serde_json::Value` tree of `body`
/// takes, including the root's own slot; an error when `body` is not one
/// JSON value (the parser will say so).
pub fn decoded_size(body: &[u8]) -> Result<usize, NotJson> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let below = Cost
        .deserialize(&mut de)
        .map_err(|e| NotJson(e.to_string()))?;
    de.end().map_err(|e| NotJson(e.to_string()))?;
    Ok(below.saturating_add(VALUE_BYTES))
}

/// A `Vec<Value>` of `n` pushed elements: capacity doubles from 4.
fn vec_bytes(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        n.max(4)
            .checked_next_power_of_two()
            .unwrap_or(usize::MAX)
            .saturating_mul(VALUE_BYTES)
    }
}

/// A map of `n` entries: every node but the root holds at least 5.
fn map_bytes(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (1 + n / 5).saturating_mul(MAP_NODE_BYTES)
    }
}

/// Visits one value; its result is the heap below the value's own slot.
#[derive(Clone, Copy)]
struct Cost;

impl<'de> DeserializeSeed<'de> for Cost {
    type Value = usize;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<usize, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Cost {
    type Value = usize;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_i64<E>(self, _: i64) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_u64<E>(self, _: u64) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_f64<E>(self, _: f64) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_unit<E>(self) -> Result<usize, E> {
        Ok(0)
    }

    fn visit_str<E>(self, v: &str) -> Result<usize, E> {
        Ok(v.len())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        let (mut n, mut below) = (0usize, 0usize);
        while let Some(cost) = seq.next_element_seed(self)? {
            n += 1;
            below = below.saturating_add(cost);
        }
        Ok(below.saturating_add(vec_bytes(n)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<usize, A::Error> {
        let (mut n, mut below) = (0usize, 0usize);
        while let Some(key) = map.next_key_seed(self)? {
            let value = map.next_value_seed(self)?;
            n += 1;
            below = below.saturating_add(key).saturating_add(value);
        }
        Ok(below.saturating_add(map_bytes(n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_cost_what_their_tree_costs() {
        assert_eq!(decoded_size(b"0").unwrap(), VALUE_BYTES);
        assert_eq!(decoded_size(b"\"abc\"").unwrap(), VALUE_BYTES + 3);
        assert_eq!(decoded_size(b"[]").unwrap(), VALUE_BYTES);
        assert_eq!(decoded_size(b"[1]").unwrap(), VALUE_BYTES + 4 * VALUE_BYTES);
        assert_eq!(decoded_size(b"{}").unwrap(), VALUE_BYTES);
        assert_eq!(
            decoded_size(br#"{"ab":"c"}"#).unwrap(),
            VALUE_BYTES + MAP_NODE_BYTES + 3
        );
        // Small objects in an array: about 100 bytes per wire byte.
        let objects = format!("[{}{{\"\":0}}]", "{\"\":0},".repeat(999));
        let size = decoded_size(objects.as_bytes()).unwrap();
        assert!(size > 90 * objects.len(), "{size} for {}", objects.len());
        // Text: about its own size.
        let text = format!(
            "{{\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
            "x".repeat(100_000)
        );
        let size = decoded_size(text.as_bytes()).unwrap();
        assert!(size < text.len() + 4096, "{size}");
    }

    #[test]
    fn what_is_not_one_json_value_has_no_size() {
        assert!(decoded_size(b"").is_err());
        assert!(decoded_size(b"[1,").is_err());
        assert!(decoded_size(b"1 2").is_err());
        assert!(
            decoded_size(&b"[".repeat(10_000)).is_err(),
            "the recursion limit holds"
        );
    }
}
