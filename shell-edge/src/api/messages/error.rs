//! Errors in Anthropic's shape and status codes.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::super::error::{ApiError, ErrorKind};

/// The status and Anthropic error `type` of `err`: 400
/// `invalid_request_error`, 401 `authentication_error`, 403
/// `permission_error`, 404 `not_found_error`, 413 `request_too_large`,
/// 429 `rate_limit_error`, 529 `overloaded_error` (the Edge or its
/// providers over capacity or unavailable, the 503s of the other APIs),
/// 504 `timeout_error`, other 5xx `api_error`.
pub fn error_status_and_type(err: &ApiError) -> (u16, &'static str) {
    match (err.status, err.kind) {
        (413, _) => (413, "request_too_large"),
        (_, ErrorKind::Authentication) => (401, "authentication_error"),
        (_, ErrorKind::Permission) => (403, "permission_error"),
        (404, _) => (404, "not_found_error"),
        (_, ErrorKind::RateLimit) => (429, "rate_limit_error"),
        (_, ErrorKind::ServiceUnavailable) => (529, "overloaded_error"),
        (_, ErrorKind::Timeout) => (504, "timeout_error"),
        (status @ 400..=499, _) => (status, "invalid_request_error"),
        (status @ 500..=599, _) => (status, "api_error"),
        _ => (500, "api_error"),
    }
}

/// The Anthropic error body: `{"type":"error","error":{"type","message"}}`.
pub fn error_json(err: &ApiError) -> Value {
    let (_, kind) = error_status_and_type(err);
    json!({"type": "error", "error": {"type": kind, "message": err.message}})
}

/// An [`ApiError`] answered in Anthropic's shape and status codes, with
/// `retry-after` where the error has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagesError(pub ApiError);

impl IntoResponse for MessagesError {
    fn into_response(self) -> Response {
        let (status, _) = error_status_and_type(&self.0);
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(error_json(&self.0))).into_response();
        if let Some(secs) = self.0.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
