//! `GET /v1/models` and `GET /v1/models/{id}` bodies.

use serde_json::{Value, json};

/// The `owned_by` value of every model this gateway lists.
pub const OWNED_BY: &str = "iop";

/// One `model` object: `{id, object:"model", created, owned_by}`.
pub fn model_json(id: &str, created_unix: u64) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": created_unix,
        "owned_by": OWNED_BY,
    })
}

/// The list body: `{object:"list", data:[model, ...]}` in the given order.
pub fn models_list_json(models: &[String], created_unix: u64) -> Value {
    let data: Vec<Value> = models
        .iter()
        .map(|id| model_json(id, created_unix))
        .collect();
    json!({ "object": "list", "data": data })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_list_has_the_openai_shape() {
        let v = models_list_json(&["a".to_owned(), "b".to_owned()], 1_700_000_000);
        assert_eq!(
            v,
            json!({
                "object": "list",
                "data": [
                    {"id": "a", "object": "model", "created": 1_700_000_000, "owned_by": "iop"},
                    {"id": "b", "object": "model", "created": 1_700_000_000, "owned_by": "iop"}
                ]
            })
        );
    }

    #[test]
    fn empty_models_list_is_still_a_list() {
        assert_eq!(
            models_list_json(&[], 0),
            json!({"object": "list", "data": []})
        );
    }
}
