//! The typed failure of one provider call, from the HTTP client's view of
//! how it ended. What each class means on the wire (and to a probe) is
//! core's rule: [`iop_core::node::provider`].

use iop_wire::ExecutionFailure;
use serde_json::Value;

use super::client::{HttpError, ProviderResponse};

pub use iop_core::node::provider::ProviderCallError;

/// The most bytes of a provider's error body read for its message.
pub const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// The longest wait for a provider's error body; what arrived by then is
/// read (the status alone is the answer).
pub const ERROR_BODY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The failure of a call the provider answered with an error status: the
/// status's class (core's [`ProviderCallError::failure`]) and the
/// provider's own message, read from at most [`MAX_ERROR_BODY_BYTES`] of
/// its body within [`ERROR_BODY_WAIT`] ([`error_message`]), with `key` (the
/// call's credential) cut out. What a provider says about our credential
/// (401, 403, 407) is not passed on.
pub(super) async fn status_failure(
    mut response: ProviderResponse,
    key: Option<&str>,
) -> ExecutionFailure {
    let status = response.status().as_u16();
    let mut failure = ProviderCallError::Status { status }.failure();
    if matches!(status, 401 | 403 | 407) {
        return failure;
    }
    let mut body = Vec::new();
    let read = async {
        while body.len() < MAX_ERROR_BODY_BYTES {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    let room = MAX_ERROR_BODY_BYTES - body.len();
                    body.extend_from_slice(&chunk[..chunk.len().min(room)]);
                }
                // The status is the answer; a body cut short only shortens it.
                Ok(None) | Err(_) => break,
            }
        }
    };
    let _ = tokio::time::timeout(ERROR_BODY_WAIT, read).await;
    failure.provider_message = error_message(&body, key);
    failure
}

/// A provider's error message from its error body: the first of
/// `error.message`, `error` (a string), `message`, `detail` (a string, or
/// FastAPI's list of `{msg}`) of a JSON body, or a plain-text body (not an
/// HTML page); `key` cut out (`[redacted]`); sanitized and bounded by
/// [`iop_wire::provider_message`].
pub(crate) fn error_message(body: &[u8], key: Option<&str>) -> Option<String> {
    let text = String::from_utf8_lossy(body);
    let raw = match serde_json::from_str::<Value>(&text) {
        Ok(json) => json_message(&json)?,
        Err(_) => {
            let trimmed = text.trim_start();
            if trimmed.starts_with('<') || trimmed.starts_with('{') || trimmed.starts_with('[') {
                return None;
            }
            text.into_owned()
        }
    };
    let raw = match key.filter(|k| !k.is_empty()) {
        Some(key) => raw.replace(key, "[redacted]"),
        None => raw,
    };
    iop_wire::provider_message(&raw)
}

fn json_message(json: &Value) -> Option<String> {
    let text = |v: &Value| v.as_str().map(str::to_owned);
    if let Some(m) = text(&json["error"]["message"]).or_else(|| text(&json["error"])) {
        return Some(m);
    }
    if let Some(m) = text(&json["message"]).or_else(|| text(&json["detail"])) {
        return Some(m);
    }
    let details: Vec<String> = json["detail"]
        .as_array()?
        .iter()
        .filter_map(|d| text(&d["msg"]))
        .collect();
    (!details.is_empty()).then(|| details.join("; "))
}

/// Classify a failed provider call from how the HTTP client saw it end;
/// `mid_body` if the answer's body was being read. What each class means
/// for the Edge is core's rule ([`ProviderCallError::failure`]).
pub(super) fn from_http(err: HttpError, mid_body: bool) -> ProviderCallError {
    match err {
        HttpError::Timeout => ProviderCallError::Timeout,
        HttpError::Builder => ProviderCallError::InvalidRequest("request could not be built"),
        HttpError::Body => ProviderCallError::ConnectionBroke,
        HttpError::Unreachable if mid_body => ProviderCallError::ConnectionBroke,
        HttpError::Unreachable => ProviderCallError::Unreachable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_providers_message_is_read_from_each_error_shape_without_the_key() {
        for (body, expected) in [
            (
                r#"{"error":{"message":"bad schema","type":"invalid_request_error"}}"#,
                Some("bad schema"),
            ),
            (
                r#"{"error":"model 'x' not found"}"#,
                Some("model 'x' not found"),
            ),
            (
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: required"}}"#,
                Some("max_tokens: required"),
            ),
            (
                r#"{"object":"error","message":"too long"}"#,
                Some("too long"),
            ),
            (
                r#"{"detail":[{"loc":["body","response_format","type"],"msg":"Input should be 'text' or 'json_object'"}]}"#,
                Some("Input should be 'text' or 'json_object'"),
            ),
            ("upstream timed out\n", Some("upstream timed out")),
            ("<html><body>502</body></html>", None),
            (r#"{"unrelated":1}"#, None),
            ("", None),
        ] {
            assert_eq!(
                error_message(body.as_bytes(), None).as_deref(),
                expected,
                "{body}"
            );
        }
        assert_eq!(
            error_message(
                br#"{"error":{"message":"Incorrect API key provided: sk-secret-1234"}}"#,
                Some("sk-secret-1234")
            )
            .as_deref(),
            Some("Incorrect API key provided: [redacted]")
        );
    }

    #[test]
    fn a_break_mid_body_is_not_an_unreachable_provider() {
        assert_eq!(
            from_http(HttpError::Unreachable, false),
            ProviderCallError::Unreachable
        );
        assert_eq!(
            from_http(HttpError::Unreachable, true),
            ProviderCallError::ConnectionBroke
        );
        assert_eq!(
            from_http(HttpError::Body, false),
            ProviderCallError::ConnectionBroke
        );
        assert_eq!(
            from_http(HttpError::Timeout, true),
            ProviderCallError::Timeout
        );
        assert!(matches!(
            from_http(HttpError::Builder, false),
            ProviderCallError::InvalidRequest(_)
        ));
    }
}
