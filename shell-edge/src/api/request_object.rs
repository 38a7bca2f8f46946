//! Typed reading of one JSON object of a request body.
//!
//! Every accessor knows the object's path (`messages[2].tool_calls[0]`) and
//! names the full parameter in its [`ApiError`]. A JSON `null` reads as
//! absent, as the OpenAI API treats it.

use serde_json::{Map, Value};

use super::error::ApiError;

/// Parse a request body into a JSON value; the error names only a position.
pub(crate) fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|err| ApiError::from_json_error(&err))
}

/// A JSON object plus its parameter path.
#[derive(Debug, Clone)]
pub(crate) struct RequestObject<'a> {
    map: &'a Map<String, Value>,
    path: String,
}

/// The JSON type name of a value, for error messages.
pub(crate) fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

impl<'a> RequestObject<'a> {
    /// The request body itself; it must be a JSON object.
    pub(crate) fn root(value: &'a Value) -> Result<Self, ApiError> {
        match value {
            Value::Object(map) => Ok(Self {
                map,
                path: String::new(),
            }),
            other => Err(ApiError::malformed_json(&format!(
                "the body must be a JSON object, not {}",
                type_name(other)
            ))),
        }
    }

    /// A nested object at `path`; a wrong type is an error naming `path`.
    pub(crate) fn at(value: &'a Value, path: String) -> Result<Self, ApiError> {
        match value {
            Value::Object(map) => Ok(Self { map, path }),
            _ => Err(ApiError::invalid_type(&path, "an object")),
        }
    }

    /// The full parameter name of `key` in this object.
    pub(crate) fn param(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    /// The value of `key`; `null` reads as absent.
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        match self.map.get(key) {
            None | Some(Value::Null) => None,
            Some(value) => Some(value),
        }
    }

    /// Every field of the object, in the body's order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (&'a String, &'a Value)> {
        self.map.iter()
    }

    /// True when `key` is present and not null.
    pub(crate) fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// An optional string.
    pub(crate) fn string(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(ApiError::invalid_type(&self.param(key), "a string")),
        }
    }

    /// A required string (may be empty).
    pub(crate) fn required_string(&self, key: &str) -> Result<&'a str, ApiError> {
        self.string(key)?
            .ok_or_else(|| ApiError::missing_parameter(&self.param(key)))
    }

    /// A required, non-empty string.
    pub(crate) fn non_empty_string(&self, key: &str) -> Result<&'a str, ApiError> {
        let s = self.required_string(key)?;
        if s.is_empty() {
            return Err(ApiError::invalid_value(
                &self.param(key),
                "must not be empty.",
            ));
        }
        Ok(s)
    }

    /// An optional boolean.
    pub(crate) fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::invalid_type(&self.param(key), "a boolean")),
        }
    }

    /// An optional number within `[min, max]`, as `f32`.
    pub(crate) fn number_in(&self, key: &str, min: f64, max: f64) -> Result<Option<f32>, ApiError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let Some(n) = value.as_f64() else {
            return Err(ApiError::invalid_type(&self.param(key), "a number"));
        };
        if !n.is_finite() || n < min || n > max {
            return Err(ApiError::invalid_value(
                &self.param(key),
                &format!("must be between {min} and {max}."),
            ));
        }
        // Range-checked above, so the narrowing only loses precision.
        Ok(Some(n as f32))
    }

    /// An optional integer `>= min` that fits a `u32`.
    pub(crate) fn u32_at_least(&self, key: &str, min: u32) -> Result<Option<u32>, ApiError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let too_small =
            || ApiError::invalid_value(&self.param(key), &format!("must be at least {min}."));
        if let Some(n) = value.as_u64() {
            if n < u64::from(min) {
                return Err(too_small());
            }
            return u32::try_from(n).map(Some).map_err(|_| {
                ApiError::invalid_value(&self.param(key), &format!("must be at most {}.", u32::MAX))
            });
        }
        if value.as_i64().is_some() {
            return Err(too_small());
        }
        Err(ApiError::invalid_type(&self.param(key), "an integer"))
    }

    /// An optional signed 64-bit integer.
    pub(crate) fn i64(&self, key: &str) -> Result<Option<i64>, ApiError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        if let Some(n) = value.as_i64() {
            return Ok(Some(n));
        }
        if value.as_u64().is_some() {
            return Err(ApiError::invalid_value(
                &self.param(key),
                "must fit a signed 64-bit integer.",
            ));
        }
        Err(ApiError::invalid_type(&self.param(key), "an integer"))
    }

    /// An optional array.
    pub(crate) fn array(&self, key: &str) -> Result<Option<&'a Vec<Value>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(_) => Err(ApiError::invalid_type(&self.param(key), "an array")),
        }
    }

    /// An optional nested object.
    pub(crate) fn object(&self, key: &str) -> Result<Option<RequestObject<'a>>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => RequestObject::at(value, self.param(key)).map(Some),
        }
    }

    /// Reject `key` if it is present and not null.
    pub(crate) fn reject(&self, key: &str, detail: &str) -> Result<(), ApiError> {
        if self.has(key) {
            return Err(ApiError::unsupported_parameter(&self.param(key), detail));
        }
        Ok(())
    }
}

/// The path of element `index` of the array at `path`.
pub(crate) fn element(path: &str, index: usize) -> String {
    format!("{path}[{index}]")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nested_params_carry_their_full_path() {
        let body = json!({"a": {"b": 1}});
        let root = RequestObject::root(&body).unwrap();
        let a = root.object("a").unwrap().unwrap();
        assert_eq!(a.string("b").unwrap_err().param.as_deref(), Some("a.b"));
    }

    #[test]
    fn null_reads_as_absent() {
        let body = json!({"x": null});
        let root = RequestObject::root(&body).unwrap();
        assert_eq!(root.string("x").unwrap(), None);
        assert_eq!(root.u32_at_least("x", 1).unwrap(), None);
    }

    #[test]
    fn integers_are_range_checked() {
        let body =
            json!({"zero": 0, "neg": -5, "huge": u64::MAX, "big": 5_000_000_000u64, "f": 1.5});
        let root = RequestObject::root(&body).unwrap();
        assert!(root.u32_at_least("zero", 1).is_err());
        assert!(root.u32_at_least("neg", 1).is_err());
        assert!(root.u32_at_least("huge", 1).is_err());
        assert!(root.u32_at_least("big", 1).is_err());
        assert_eq!(
            root.u32_at_least("f", 1).unwrap_err().code,
            Some("invalid_type")
        );
        assert!(root.i64("huge").is_err());
    }
}
