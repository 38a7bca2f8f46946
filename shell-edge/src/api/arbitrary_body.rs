//! Generators of arbitrary request bodies for the parsers' property tests.

use proptest::prelude::*;
use serde_json::{Value, json};

/// Arbitrary JSON biased towards the field names the parser reads.
pub(crate) fn arbitrary_json(depth: u32) -> impl Strategy<Value = Value> {
    let keys = prop_oneof![
        Just("model".to_owned()),
        Just("messages".to_owned()),
        Just("role".to_owned()),
        Just("content".to_owned()),
        Just("tools".to_owned()),
        Just("type".to_owned()),
        Just("function".to_owned()),
        Just("name".to_owned()),
        Just("input".to_owned()),
        Just("options".to_owned()),
        Just("prompt".to_owned()),
        Just("tool_calls".to_owned()),
        "[a-z_]{1,8}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|n| json!(n)),
        prop_oneof![
            Just("user".to_owned()),
            Just("assistant".to_owned()),
            Just("tool".to_owned()),
            Just("function".to_owned()),
            Just("text".to_owned()),
            Just("message".to_owned()),
            ".{0,6}"
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(depth, 64, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec((keys.clone(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Replace the `n`-th value (depth-first) of `root` with `replacement`.
pub(crate) fn replace_nth_value(root: &mut Value, n: usize, replacement: Value) {
    fn walk(v: &mut Value, n: &mut usize, replacement: &mut Option<Value>) {
        if *n == 0 {
            if let Some(r) = replacement.take() {
                *v = r;
            }
            return;
        }
        *n -= 1;
        match v {
            Value::Array(items) => items.iter_mut().for_each(|i| walk(i, n, replacement)),
            Value::Object(map) => map.values_mut().for_each(|i| walk(i, n, replacement)),
            _ => {}
        }
    }
    let mut n = n;
    walk(root, &mut n, &mut Some(replacement));
}
