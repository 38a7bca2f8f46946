//! Client-facing errors in the OpenAI and Ollama formats (SPEC §5, R-GATE-3).
//!
//! Every external failure becomes one [`ApiError`]: an HTTP status, a closed
//! [`ErrorKind`], an optional stable `code`, a human-readable message and the
//! parameter at fault. Messages are written here from fixed text plus bounded
//! client-supplied names (a model, a parameter path); they never contain API
//! keys, raw request bodies or raw provider payloads.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use iop_core::edge::gate::{AdmissionFailure, GateFailure};
use iop_core::edge::request::{ProviderFault, ProviderSaid};
use iop_wire::{ExecutionFailure, FailureCode};
use serde_json::{Value, json};

/// The longest client-supplied name (model, parameter path) echoed in a message.
pub const MAX_ECHOED_NAME_CHARS: usize = 256;

/// The OpenAI error `type` (a closed vocabulary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The client sent something we cannot accept (400, 404 on a path, 413).
    InvalidRequest,
    /// No or wrong API key (401).
    Authentication,
    /// The key may not do this (403).
    Permission,
    /// No such model or resource (404).
    NotFound,
    /// Over capacity: the queue is full, or a tenant's rate limit (429).
    RateLimit,
    /// A tenant's quota or budget is used up (429, R-TEN-1, R-TEN-2).
    InsufficientQuota,
    /// A failure on our side or the provider's (500, 502).
    Server,
    /// Nothing can serve the request right now (503).
    ServiceUnavailable,
    /// The request ran out of time (504).
    Timeout,
}

impl ErrorKind {
    /// The value of the `type` field in an OpenAI error body.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RateLimit => "rate_limit_error",
            ErrorKind::InsufficientQuota => "insufficient_quota",
            ErrorKind::Server => "server_error",
            ErrorKind::ServiceUnavailable => "service_unavailable_error",
            ErrorKind::Timeout => "timeout_error",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One client-facing error.
///
/// Build it with the named constructors; render it with [`ApiError::to_json`]
/// (OpenAI), [`ApiError::to_ollama_json`] (Ollama) or as an axum response
/// (OpenAI body, plus `Retry-After` when set). Wrap it in [`OllamaError`] to
/// answer in the Ollama format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    /// HTTP status code.
    pub status: u16,
    /// The OpenAI error `type`.
    pub kind: ErrorKind,
    /// Stable machine-readable code (`model_not_found`, `rate_limit_exceeded`, ...).
    pub code: Option<&'static str>,
    /// Human-readable message; safe to show to the client.
    pub message: String,
    /// The request parameter at fault (`messages[2].content`, `temperature`, ...).
    pub param: Option<String>,
    /// Seconds for the `Retry-After` header (429 only).
    pub retry_after_secs: Option<u64>,
    /// More headers of the answer (a tenant's `x-ratelimit-*`).
    pub headers: Vec<(String, String)>,
}

/// Cut a client-supplied name to [`MAX_ECHOED_NAME_CHARS`] characters.
fn bounded(name: &str) -> String {
    if name.chars().count() <= MAX_ECHOED_NAME_CHARS {
        name.to_owned()
    } else {
        let mut cut: String = name.chars().take(MAX_ECHOED_NAME_CHARS).collect();
        cut.push('…');
        cut
    }
}

impl ApiError {
    fn new(status: u16, kind: ErrorKind, code: Option<&'static str>, message: String) -> Self {
        Self {
            status,
            kind,
            code,
            message,
            param: None,
            retry_after_secs: None,
            headers: Vec::new(),
        }
    }

    fn with_param(mut self, param: &str) -> Self {
        self.param = Some(bounded(param));
        self
    }

    /// 400: the body is not valid JSON (or not a JSON object).
    ///
    /// `detail` must not quote the body; [`ApiError::from_json_error`] builds
    /// one from position information only.
    pub fn malformed_json(detail: &str) -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("invalid_json"),
            format!("We could not parse the JSON body of your request: {detail}"),
        )
    }

    /// 400 from a `serde_json` parse error, naming only its category and position.
    pub fn from_json_error(err: &serde_json::Error) -> Self {
        let category = match err.classify() {
            serde_json::error::Category::Io => "read error",
            serde_json::error::Category::Syntax => "syntax error",
            serde_json::error::Category::Data => "unexpected data",
            serde_json::error::Category::Eof => "unexpected end of input",
        };
        Self::malformed_json(&format!(
            "{category} at line {} column {}",
            err.line(),
            err.column()
        ))
    }

    /// 400: a field this endpoint does not know, where unknown fields matter.
    pub fn unknown_field(param: &str) -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("unknown_parameter"),
            format!("Unrecognized request argument supplied: {}", bounded(param)),
        )
        .with_param(param)
    }

    /// 400: a parameter (or value of it) this gateway does not support.
    pub fn unsupported_parameter(param: &str, detail: &str) -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("unsupported_parameter"),
            format!("Unsupported parameter: '{}'. {detail}", bounded(param)),
        )
        .with_param(param)
    }

    /// 400: a required parameter is missing.
    pub fn missing_parameter(param: &str) -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("missing_required_parameter"),
            format!("Missing required parameter: '{}'.", bounded(param)),
        )
        .with_param(param)
    }

    /// 400: a parameter has the wrong JSON type; `expected` names the right one.
    pub fn invalid_type(param: &str, expected: &str) -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("invalid_type"),
            format!(
                "Invalid type for '{}': expected {expected}.",
                bounded(param)
            ),
        )
        .with_param(param)
    }

    /// 400: a parameter has the right type but a value out of range or not allowed.
    pub fn invalid_value(param: &str, detail: &str) -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("invalid_value"),
            format!("Invalid value for '{}': {detail}", bounded(param)),
        )
        .with_param(param)
    }

    /// 404: no configured provider serves `model`.
    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            404,
            ErrorKind::NotFound,
            Some("model_not_found"),
            format!(
                "The model `{}` does not exist or you do not have access to it.",
                bounded(model)
            ),
        )
        .with_param("model")
    }

    /// 404: the key may not use `model`.
    ///
    /// Deliberately indistinguishable from [`ApiError::model_not_found`], so a
    /// key cannot probe which models exist (as OpenAI does).
    pub fn model_not_allowed(model: &str) -> Self {
        Self::model_not_found(model)
    }

    /// 401: an `Authorization` header was sent but the key is not valid.
    ///
    /// The key itself is never echoed.
    pub fn invalid_api_key() -> Self {
        Self::new(
            401,
            ErrorKind::Authentication,
            Some("invalid_api_key"),
            "Incorrect API key provided.".to_owned(),
        )
    }

    /// 401: no API key was sent.
    pub fn missing_api_key() -> Self {
        Self::new(
            401,
            ErrorKind::Authentication,
            Some("missing_api_key"),
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.".to_owned(),
        )
    }

    /// 403: the key is valid but may not call this endpoint.
    pub fn permission_denied() -> Self {
        Self::new(
            403,
            ErrorKind::Permission,
            Some("permission_denied"),
            "This API key is not allowed to perform this request.".to_owned(),
        )
    }

    /// 409: an admin's change lost a race with another change.
    pub fn admin_conflict(message: &str) -> Self {
        Self::new(
            409,
            ErrorKind::InvalidRequest,
            Some("conflict"),
            message.to_owned(),
        )
    }

    /// 503: the store of tenants' keys, counters and usage did not answer.
    pub fn tenant_store_unavailable() -> Self {
        Self::new(
            503,
            ErrorKind::ServiceUnavailable,
            Some("tenant_store_unavailable"),
            "The store of keys and usage is not reachable; try again shortly.".to_owned(),
        )
    }

    /// 429: the console's live streams are all taken (`max` at once).
    pub fn console_streams_full(max: usize) -> Self {
        let mut err = Self::new(
            429,
            ErrorKind::RateLimit,
            Some("console_streams_full"),
            format!("{max} console streams are open already; close one or retry later."),
        );
        err.retry_after_secs = Some(5);
        err
    }

    /// 404: no such path or resource.
    pub fn not_found(what: &str) -> Self {
        Self::new(
            404,
            ErrorKind::NotFound,
            Some("not_found"),
            format!("{} not found.", bounded(what)),
        )
    }

    /// 429: the admission queue is full; retry after `retry_after_secs`.
    pub fn queue_full(retry_after_secs: u64) -> Self {
        let mut err = Self::new(
            429,
            ErrorKind::RateLimit,
            Some("rate_limit_exceeded"),
            format!(
                "The server is at capacity and its queue is full. Retry after {retry_after_secs} s."
            ),
        );
        err.retry_after_secs = Some(retry_after_secs);
        err
    }

    /// 429 `rate_limit_exceeded`: `what` (a tenant's limit, R-TEN-1) is
    /// reached; retry after `retry_after_secs` when waiting helps.
    pub fn tenant_rate_limited(what: &str, retry_after_secs: Option<u64>) -> Self {
        let mut err = Self::new(
            429,
            ErrorKind::RateLimit,
            Some("rate_limit_exceeded"),
            format!("Rate limit reached: {what}."),
        );
        err.retry_after_secs = retry_after_secs;
        err
    }

    /// 429 `insufficient_quota`: `what` (a tenant's quota or budget,
    /// R-TEN-1, R-TEN-2) does not fit this request; `retry_after_secs`
    /// when its period ends.
    pub fn insufficient_quota(what: &str, retry_after_secs: Option<u64>) -> Self {
        let mut err = Self::new(
            429,
            ErrorKind::InsufficientQuota,
            Some("insufficient_quota"),
            format!("You exceeded your current quota: {what}."),
        );
        err.retry_after_secs = retry_after_secs;
        err
    }

    /// 413: the request body is larger than `limit_bytes`.
    pub fn body_too_large(limit_bytes: usize) -> Self {
        Self::new(
            413,
            ErrorKind::InvalidRequest,
            Some("request_too_large"),
            format!("The request body exceeds the limit of {limit_bytes} bytes."),
        )
    }

    /// 503: no provider that serves the model is eligible right now.
    pub fn no_provider() -> Self {
        Self::new(
            503,
            ErrorKind::ServiceUnavailable,
            Some("no_provider_available"),
            "No provider is available for this model right now.".to_owned(),
        )
    }

    /// 503: the request waited in the admission queue for too long.
    pub fn queue_timeout() -> Self {
        Self::new(
            503,
            ErrorKind::ServiceUnavailable,
            Some("queue_timeout"),
            "The request timed out waiting for a free provider.".to_owned(),
        )
    }

    /// 504: the request's recovery budget (attempts or total time) is spent (R-GATE-3).
    pub fn budget_expired() -> Self {
        Self::new(
            504,
            ErrorKind::Timeout,
            Some("budget_expired"),
            "The request did not complete within its time and attempt budget.".to_owned(),
        )
    }

    /// 409: the `Idempotency-Key` already names a response to a different
    /// request (R-IDEM-1).
    pub fn idempotency_key_conflict() -> Self {
        Self::new(
            409,
            ErrorKind::InvalidRequest,
            Some("idempotency_key_conflict"),
            "This Idempotency-Key was already used with a different request; use a new key."
                .to_owned(),
        )
        .with_param("Idempotency-Key")
    }

    /// 503: the response store cannot take a new durable request (it is
    /// full, or it failed); requests without `store`, `background` or an
    /// `Idempotency-Key` are still served (R-JRN-5).
    pub fn journal_unavailable(full: bool) -> Self {
        let (code, message) = if full {
            (
                "response_store_full",
                "The response store is full; retry later or send the request with \"store\": false and no Idempotency-Key.",
            )
        } else {
            (
                "response_store_unavailable",
                "The response store is unavailable; retry later or send the request with \"store\": false and no Idempotency-Key.",
            )
        };
        let mut err = Self::new(
            503,
            ErrorKind::ServiceUnavailable,
            Some(code),
            message.to_owned(),
        );
        err.retry_after_secs = Some(1);
        err
    }

    /// 503 `response_store_unavailable`: the response store is not open
    /// (`state`: the Edge is connecting to it, or opening it again after a
    /// failure; R-JRN-6). Requests without `store`, `background` or an
    /// `Idempotency-Key` are served meanwhile.
    pub fn journal_not_open(state: &str) -> Self {
        let mut err = Self::new(
            503,
            ErrorKind::ServiceUnavailable,
            Some("response_store_unavailable"),
            format!(
                "The response store is not reachable yet ({state}); retry in a few seconds, or send \
                 the request with \"store\": false and no Idempotency-Key."
            ),
        );
        err.retry_after_secs = Some(1);
        err
    }

    /// 400: `previous_response_id` names a response whose conversation
    /// was stored by a build this one cannot read.
    pub fn previous_response_unreadable() -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("previous_response_unreadable"),
            "The previous response's conversation was stored by an older version of this gateway \
             and cannot be continued; send the full conversation in 'input'."
                .to_owned(),
        )
        .with_param("previous_response_id")
    }

    /// 400: `previous_response_id` names a response whose conversation
    /// cannot be rebuilt: an earlier response of it is no longer stored
    /// (it expired, or was deleted) or cannot be read (R-LIM-6).
    pub fn previous_response_unavailable() -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("previous_response_unavailable"),
            "An earlier response of this conversation is no longer stored (it expired or was \
             deleted), so the conversation cannot be rebuilt; send the full conversation in \
             'input'."
                .to_owned(),
        )
        .with_param("previous_response_id")
    }

    /// 400: `previous_response_id` names a conversation of more stored
    /// responses than one continuation is rebuilt from (R-LIM-6).
    pub fn conversation_too_long(max_links: usize) -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("conversation_too_long"),
            format!(
                "The conversation continues more than {max_links} stored responses; send it in \
                 'input' instead of continuing it with previous_response_id."
            ),
        )
        .with_param("previous_response_id")
    }

    /// 400: `previous_response_id` names a response that cannot be
    /// continued yet (it is still running).
    pub fn previous_response_running() -> Self {
        Self::new(
            400,
            ErrorKind::InvalidRequest,
            Some("previous_response_in_progress"),
            "The previous response is still in progress; wait for it to finish.".to_owned(),
        )
        .with_param("previous_response_id")
    }

    /// 404: `previous_response_id` names no stored response of this key.
    pub fn previous_response_not_found() -> Self {
        Self::new(
            404,
            ErrorKind::InvalidRequest,
            Some("previous_response_not_found"),
            "The previous response was not found (it was not stored, or it expired).".to_owned(),
        )
        .with_param("previous_response_id")
    }

    /// 502: a durable response ended without its answer: the Edge that ran
    /// it restarted (`reason` `edge_restart`) or it was cancelled. Its
    /// durable prefix is what was delivered.
    pub fn response_interrupted(reason: &str) -> Self {
        let (code, message) = match reason {
            "cancelled" => ("response_cancelled", "The response was cancelled."),
            _ => (
                "response_incomplete",
                "The response ended before it was complete (the gateway running it restarted).",
            ),
        };
        Self::new(502, ErrorKind::Server, Some(code), message.to_owned())
    }

    /// 500: a failure inside the gateway.
    pub fn internal() -> Self {
        Self::new(
            500,
            ErrorKind::Server,
            Some("internal_error"),
            "The server had an internal error while processing your request.".to_owned(),
        )
    }

    /// The error a run's gate failure is answered with (R-GATE-3): before
    /// commit as the HTTP error, after it in the stream.
    pub fn from_gate_failure(kind: GateFailure) -> Self {
        match kind {
            GateFailure::Admission(AdmissionFailure::QueueFull) => Self::queue_full(1),
            GateFailure::Admission(AdmissionFailure::NoEligibleProvider) => Self::no_provider(),
            GateFailure::Admission(AdmissionFailure::QueueTimeout) => Self::queue_timeout(),
            // R-TEN-2: a further attempt's reservation did not fit.
            GateFailure::Admission(AdmissionFailure::Tenant {
                kind,
                retry_after_ms,
            }) => {
                let what =
                    "this key's or its principal's limits, for another attempt of this request";
                let retry_after_secs = retry_after_ms.map(|ms| ms.div_ceil(1_000).max(1));
                match kind {
                    iop_core::tenant::RefusalKind::RateLimited => {
                        Self::tenant_rate_limited(what, retry_after_secs)
                    }
                    iop_core::tenant::RefusalKind::InsufficientQuota => {
                        Self::insufficient_quota(what, retry_after_secs)
                    }
                }
            }
            GateFailure::BudgetExpired => Self::budget_expired(),
            GateFailure::Attempt(code) => Self::from_failure(code),
        }
    }

    /// 502: a non-streaming answer grew past `limit_bytes` of text and tool
    /// calls (R-LIM-3); the client can ask for it streamed.
    pub fn answer_too_large(limit_bytes: usize) -> Self {
        Self::new(
            502,
            ErrorKind::Server,
            Some("response_too_large"),
            format!(
                "The provider's answer exceeds {limit_bytes} bytes; request it with \"stream\": true."
            ),
        )
    }

    /// Map a run's failure code to the client error (fixed messages only).
    pub fn from_failure(code: FailureCode) -> Self {
        let (status, kind, message) = match code {
            FailureCode::ResponseStalled => (
                504,
                ErrorKind::Timeout,
                "The provider stopped producing output (response stalled).",
            ),
            FailureCode::ProviderError => {
                (502, ErrorKind::Server, "The provider returned an error.")
            }
            FailureCode::ProviderUnreachable => {
                (502, ErrorKind::Server, "The provider could not be reached.")
            }
            // A cancel the client did not cause (its own disconnect has no reader).
            FailureCode::Canceled => (500, ErrorKind::Server, "The request was canceled."),
            FailureCode::DeadlineExceeded => (
                504,
                ErrorKind::Timeout,
                "The request exceeded its deadline.",
            ),
            FailureCode::CredentialRejected => (
                502,
                ErrorKind::Server,
                "The provider credential was rejected.",
            ),
            FailureCode::InvalidRequest => (
                400,
                ErrorKind::InvalidRequest,
                "The request was rejected before reaching the provider.",
            ),
            FailureCode::NodeOverloaded => (
                503,
                ErrorKind::ServiceUnavailable,
                "The node serving this model is overloaded.",
            ),
            FailureCode::MalformedResponse => (
                502,
                ErrorKind::Server,
                "The provider returned a response that could not be parsed.",
            ),
            FailureCode::UnknownTarget => (
                502,
                ErrorKind::Server,
                "The provider target is not available on its node.",
            ),
            FailureCode::TransportClosed => (
                502,
                ErrorKind::Server,
                "The connection to the node serving this request was lost.",
            ),
            FailureCode::Internal => (
                500,
                ErrorKind::Server,
                "The node had an internal error while processing your request.",
            ),
        };
        let code_str = match code {
            FailureCode::Internal => "internal_error",
            other => other.as_str(),
        };
        Self::new(status, kind, Some(code_str), message.to_owned())
    }

    /// Like [`ApiError::from_failure`], with what the provider said (see
    /// [`ApiError::from_gate_failure_with`]).
    pub fn from_execution_failure(failure: &ExecutionFailure) -> Self {
        Self::from_gate_failure_with(
            GateFailure::Attempt(failure.code),
            ProviderSaid::of(failure).as_ref(),
        )
    }

    /// The error a request that ended with `kind` is answered with, with
    /// what its provider said (R-GATE-3): a provider's verdict that the
    /// request itself is invalid (core's [`ProviderFault`]: HTTP 400, 413,
    /// 422) is a 400, its rate limiting a 429, so a client sees e.g. a
    /// context-length error as the 400 it is; other provider statuses stay
    /// gateway errors (401/403 are our credential's problem, 404 our
    /// routing's). The provider's own message, sanitized by the Node, is
    /// part of the message in every case.
    pub fn from_gate_failure_with(kind: GateFailure, provider: Option<&ProviderSaid>) -> Self {
        let Some(said) = provider else {
            return Self::from_gate_failure(kind);
        };
        let status = said
            .http_status
            .map(|s| format!(" (HTTP {s})"))
            .unwrap_or_default();
        let with_message = |text: String| match &said.message {
            Some(message) => format!("{text}{status}: {message}"),
            None => format!("{text}{status}."),
        };
        match said.fault() {
            ProviderFault::InvalidRequest => Self::new(
                400,
                ErrorKind::InvalidRequest,
                Some("provider_rejected_request"),
                with_message("The provider rejected the request".to_owned()),
            ),
            ProviderFault::RateLimited => Self::new(
                429,
                ErrorKind::RateLimit,
                Some("provider_rate_limited"),
                with_message("The provider is rate limiting requests".to_owned()),
            ),
            ProviderFault::Provider => {
                let mut err = Self::from_gate_failure(kind);
                let fixed = err.message.trim_end_matches('.').to_owned();
                err.message = with_message(fixed);
                err
            }
        }
    }

    /// The OpenAI error body: `{"error":{"message","type","code","param"}}`.
    pub fn to_json(&self) -> Value {
        json!({ "error": self.error_object() })
    }

    /// The inner `{"message","type","code","param"}` object.
    pub fn error_object(&self) -> Value {
        json!({
            "message": self.message,
            "type": self.kind.as_str(),
            "code": self.code,
            "param": self.param,
        })
    }

    /// The Ollama error body: `{"error":"message"}`.
    pub fn to_ollama_json(&self) -> Value {
        json!({ "error": self.message })
    }

    /// The HTTP status; 500 if `status` is not a valid code.
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn response_with_body(&self, body: Value) -> Response {
        let mut response = (self.status_code(), axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        for (name, value) in &self.headers {
            if let (Ok(name), Ok(value)) = (
                header::HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) {
                response.headers_mut().insert(name, value);
            }
        }
        response
    }
}

impl IntoResponse for ApiError {
    /// The OpenAI JSON body with the status and, for 429, `Retry-After`.
    fn into_response(self) -> Response {
        self.response_with_body(self.to_json())
    }
}

/// An [`ApiError`] answered in the Ollama format (`{"error":"message"}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OllamaError(pub ApiError);

impl From<ApiError> for OllamaError {
    fn from(err: ApiError) -> Self {
        Self(err)
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        self.0.response_with_body(self.0.to_ollama_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_json_has_message_type_code_and_param() {
        let err = ApiError::invalid_value("temperature", "must be between 0 and 2.");
        let v = err.to_json();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "invalid_value");
        assert_eq!(v["error"]["param"], "temperature");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("temperature")
        );
        assert_eq!(v.as_object().unwrap().len(), 1);
        assert_eq!(v["error"].as_object().unwrap().len(), 4);
    }

    #[test]
    fn error_json_has_null_code_and_param_when_absent() {
        let mut err = ApiError::internal();
        err.code = None;
        let v = err.to_json();
        assert!(v["error"]["code"].is_null());
        assert!(v["error"]["param"].is_null());
    }

    #[test]
    fn ollama_error_json_is_a_single_string() {
        let v = ApiError::model_not_found("llama3").to_ollama_json();
        assert_eq!(
            v,
            json!({"error": "The model `llama3` does not exist or you do not have access to it."})
        );
    }

    #[test]
    fn bad_input_constructors_have_spec_statuses_and_codes() {
        let cases = [
            (ApiError::malformed_json("x"), 400, "invalid_json"),
            (ApiError::unknown_field("foo"), 400, "unknown_parameter"),
            (
                ApiError::unsupported_parameter("n", "only 1"),
                400,
                "unsupported_parameter",
            ),
            (ApiError::model_not_found("m"), 404, "model_not_found"),
            (ApiError::model_not_allowed("m"), 404, "model_not_found"),
            (ApiError::invalid_api_key(), 401, "invalid_api_key"),
            (ApiError::missing_api_key(), 401, "missing_api_key"),
            (ApiError::queue_full(3), 429, "rate_limit_exceeded"),
            (ApiError::body_too_large(1024), 413, "request_too_large"),
            (ApiError::no_provider(), 503, "no_provider_available"),
            (ApiError::queue_timeout(), 503, "queue_timeout"),
            (ApiError::budget_expired(), 504, "budget_expired"),
        ];
        for (err, status, code) in cases {
            assert_eq!(err.status, status, "{err:?}");
            assert_eq!(err.code, Some(code), "{err:?}");
        }
        assert_eq!(ApiError::queue_full(7).retry_after_secs, Some(7));
        assert_eq!(ApiError::unknown_field("foo").param.as_deref(), Some("foo"));
    }

    #[test]
    fn every_failure_code_maps_to_an_error_status() {
        for &code in FailureCode::ALL {
            let err = ApiError::from_failure(code);
            assert!((400..600).contains(&err.status), "{code}");
            assert!(err.code.is_some());
        }
        assert_eq!(
            ApiError::from_failure(FailureCode::ResponseStalled).status,
            504
        );
        assert_eq!(
            ApiError::from_failure(FailureCode::ResponseStalled).code,
            Some("response_stalled")
        );
        assert_eq!(
            ApiError::from_failure(FailureCode::ProviderError).status,
            502
        );
        assert_eq!(
            ApiError::from_failure(FailureCode::ProviderUnreachable).status,
            502
        );
        assert_eq!(
            ApiError::from_failure(FailureCode::NodeOverloaded).status,
            503
        );
        assert_eq!(
            ApiError::from_failure(FailureCode::DeadlineExceeded).status,
            504
        );
        assert_eq!(
            ApiError::from_failure(FailureCode::CredentialRejected).status,
            502
        );
        assert_eq!(
            ApiError::from_failure(FailureCode::InvalidRequest).status,
            400
        );
        assert_eq!(
            ApiError::from_failure(FailureCode::TransportClosed).status,
            502
        );
        assert_eq!(ApiError::from_failure(FailureCode::Canceled).status, 500);
    }

    #[test]
    fn a_providers_message_is_passed_on_with_its_class() {
        let said = |status: Option<u16>| ProviderSaid {
            http_status: status,
            message: Some("Input should be 'text' or 'json_object'".into()),
        };
        let provider_error = GateFailure::Attempt(FailureCode::ProviderError);
        let err = ApiError::from_gate_failure_with(provider_error, Some(&said(Some(500))));
        assert_eq!(err.status, 502);
        assert_eq!(
            err.message,
            "The provider returned an error (HTTP 500): Input should be 'text' or 'json_object'"
        );
        let err = ApiError::from_gate_failure_with(provider_error, Some(&said(Some(422))));
        assert_eq!((err.status, err.kind), (400, ErrorKind::InvalidRequest));
        assert_eq!(
            err.message,
            "The provider rejected the request (HTTP 422): Input should be 'text' or 'json_object'"
        );
        assert_eq!(err.to_ollama_json()["error"], err.message.as_str());
        let quiet = ProviderSaid {
            http_status: Some(429),
            message: None,
        };
        let err = ApiError::from_gate_failure_with(provider_error, Some(&quiet));
        assert_eq!(err.status, 429);
        assert_eq!(
            err.message,
            "The provider is rate limiting requests (HTTP 429)."
        );
        assert_eq!(
            ApiError::from_gate_failure_with(provider_error, None),
            ApiError::from_gate_failure(provider_error)
        );
    }

    #[test]
    fn provider_client_errors_keep_their_class() {
        let mut failure = ExecutionFailure::new(FailureCode::ProviderError);
        failure.http_status = Some(400);
        assert_eq!(ApiError::from_execution_failure(&failure).status, 400);
        failure.http_status = Some(429);
        assert_eq!(ApiError::from_execution_failure(&failure).status, 429);
        failure.http_status = Some(422);
        assert_eq!(ApiError::from_execution_failure(&failure).status, 400);
        failure.http_status = Some(404);
        assert_eq!(ApiError::from_execution_failure(&failure).status, 502);
        failure.http_status = Some(401);
        assert_eq!(ApiError::from_execution_failure(&failure).status, 502);
        failure.http_status = Some(500);
        assert_eq!(ApiError::from_execution_failure(&failure).status, 502);
    }

    #[test]
    fn json_parse_errors_never_quote_the_body() {
        let secret = "sk-very-secret-key";
        let body = format!("{{\"api_key\": \"{secret}\" oops");
        let err = serde_json::from_str::<Value>(&body).unwrap_err();
        let api = ApiError::from_json_error(&err);
        assert_eq!(api.status, 400);
        assert!(!api.message.contains(secret));
        assert!(api.message.contains("line 1"));
    }

    #[test]
    fn echoed_names_are_bounded() {
        let long = "m".repeat(10_000);
        let err = ApiError::model_not_found(&long);
        assert!(err.message.len() < MAX_ECHOED_NAME_CHARS + 100);
    }

    #[test]
    fn into_response_sets_status_and_retry_after() {
        let response = ApiError::queue_full(5).into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "5");
        let response = OllamaError(ApiError::no_provider()).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
}
