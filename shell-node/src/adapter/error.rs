//! The typed failure of one provider call and its mapping onto the wire's
//! [`ExecutionFailure`].
//!
//! Errors carry classes and HTTP statuses only: never a provider payload, a
//! URL with its query, or a credential.

use super::client::HttpError;
use iop_wire::{ExecutionFailure, FailureCode, HealthFailureCode};

use iop_core::edge::health::classify_http_status;

/// Why a provider call failed, by who is at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderCallError {
    /// The request was refused before any provider call (our caller's fault).
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
    /// The provider could not be reached (connect, DNS, TLS, reset).
    #[error("provider unreachable")]
    Unreachable,
    /// The provider did not answer within a bound.
    #[error("provider call timed out")]
    Timeout,
    /// The connection broke while the answer was streaming.
    #[error("provider connection broke mid-answer")]
    ConnectionBroke,
    /// The provider answered with an HTTP error status.
    #[error("provider answered HTTP {status}")]
    Status {
        /// The HTTP status.
        status: u16,
    },
    /// The provider reported an error inside a successful stream.
    #[error("provider reported an error mid-stream")]
    Reported,
    /// The answer could not be parsed.
    #[error("provider answer was malformed")]
    Malformed,
    /// The answer ended cleanly but without its terminal.
    #[error("provider answer ended without a terminal")]
    Truncated,
    /// The adapter has no base URL for its target (a configuration bug).
    #[error("adapter target is not configured")]
    Unconfigured,
}

impl ProviderCallError {
    /// Classify a failed provider call; `mid_body` if the answer's body was
    /// being read.
    pub fn from_http(err: HttpError, mid_body: bool) -> Self {
        match err {
            HttpError::Timeout => ProviderCallError::Timeout,
            HttpError::Builder => ProviderCallError::InvalidRequest("request could not be built"),
            HttpError::Body => ProviderCallError::ConnectionBroke,
            HttpError::Unreachable if mid_body => ProviderCallError::ConnectionBroke,
            HttpError::Unreachable => ProviderCallError::Unreachable,
        }
    }

    /// The wire failure. Never retryable: the Node never retries (R-WD-8)
    /// and leaves the decision to the Edge.
    pub fn failure(&self) -> ExecutionFailure {
        let (code, health, status) = match *self {
            ProviderCallError::InvalidRequest(_) => (FailureCode::InvalidRequest, None, None),
            ProviderCallError::Unreachable | ProviderCallError::ConnectionBroke => (
                FailureCode::ProviderUnreachable,
                Some(HealthFailureCode::TransportFailed),
                None,
            ),
            ProviderCallError::Timeout => (
                FailureCode::ProviderUnreachable,
                Some(HealthFailureCode::Timeout),
                None,
            ),
            ProviderCallError::Status { status } => (
                FailureCode::ProviderError,
                classify_http_status(status),
                Some(status),
            ),
            ProviderCallError::Reported => (
                FailureCode::ProviderError,
                Some(HealthFailureCode::ProviderRejected),
                None,
            ),
            ProviderCallError::Malformed | ProviderCallError::Truncated => (
                FailureCode::MalformedResponse,
                Some(HealthFailureCode::MalformedResponse),
                None,
            ),
            ProviderCallError::Unconfigured => (FailureCode::Internal, None, None),
        };
        let mut failure = ExecutionFailure::new(code);
        failure.health_failure = health;
        failure.http_status = status;
        failure
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_errors_carry_status_and_classified_health() {
        let f = ProviderCallError::Status { status: 503 }.failure();
        assert_eq!(f.code, FailureCode::ProviderError);
        assert_eq!(f.http_status, Some(503));
        assert_eq!(f.health_failure, Some(HealthFailureCode::Http5xx));
        assert!(!f.retryable);
    }

    #[test]
    fn transport_and_parse_failures_map_to_their_codes() {
        let f = ProviderCallError::Timeout.failure();
        assert_eq!(
            (f.code, f.health_failure),
            (
                FailureCode::ProviderUnreachable,
                Some(HealthFailureCode::Timeout)
            )
        );
        let f = ProviderCallError::Unreachable.failure();
        assert_eq!(
            (f.code, f.health_failure),
            (
                FailureCode::ProviderUnreachable,
                Some(HealthFailureCode::TransportFailed)
            )
        );
        let f = ProviderCallError::Malformed.failure();
        assert_eq!(
            (f.code, f.health_failure),
            (
                FailureCode::MalformedResponse,
                Some(HealthFailureCode::MalformedResponse)
            )
        );
    }
}
