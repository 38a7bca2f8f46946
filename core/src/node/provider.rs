//! What a failed provider call means, classified once for every path that
//! reports one: a run's terminal, a tunnel's failure frame, a parked run's
//! terminal and an exact-target probe.
//!
//! The shell's HTTP client says how a call ended (could not connect, timed
//! out, broke mid-body, answered an error status, ...) as a
//! [`ProviderCallError`]; the rules here decide what the Edge is told:
//!
//! * [`ProviderCallError::failure`]: the wire's [`ExecutionFailure`], with
//!   the sanitized health class the Edge's per-provider tracker records
//!   (R-HT-1) and never a retry mark, because the Node never retries and
//!   leaves the decision to the Edge (R-WD-8, R-FAIL-1);
//! * [`ProviderCallError::missing_terminal`]: the one failure for an answer
//!   that ended without its terminal, whichever layer sees the end
//!   (R-WD-6: every run gets exactly one terminal);
//! * [`ProviderCallError::probe_answer`]: what a probe that failed before a
//!   complete answer reports (R-WD-5: a timeout or a broken transport is no
//!   verdict; an error status is one).
//!
//! Errors carry classes and HTTP statuses only: never a provider payload,
//! a URL with its query, or a credential.

use iop_wire::{ExecutionFailure, FailureCode, HealthFailureCode};

use crate::edge::health::classify_http_status;
use crate::node::probe::ProbeAnswer;

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
    /// The wire failure. Never retryable: the Node never retries (R-WD-8)
    /// and leaves the decision to the Edge (R-FAIL-1).
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

    /// The terminal of an answer that ended without one, whichever layer
    /// sees the end first (the adapter's stream contract, the run task, a
    /// parked run): a malformed answer, the same everywhere (R-WD-6).
    pub fn missing_terminal() -> ExecutionFailure {
        ProviderCallError::Truncated.failure()
    }

    /// What a probe that ended with this error reports (R-WD-5): an error
    /// status is the target's answer; a timeout, a broken transport or an
    /// unreadable answer is no verdict.
    pub fn probe_answer(&self) -> ProbeAnswer {
        match *self {
            ProviderCallError::Status { status } => ProbeAnswer::HttpStatus(status),
            ProviderCallError::Timeout => ProbeAnswer::TimedOut,
            ProviderCallError::Malformed | ProviderCallError::Truncated => ProbeAnswer::Malformed,
            ProviderCallError::InvalidRequest(_)
            | ProviderCallError::Unreachable
            | ProviderCallError::ConnectionBroke
            | ProviderCallError::Reported
            | ProviderCallError::Unconfigured => ProbeAnswer::TransportFailed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [ProviderCallError; 9] = [
        ProviderCallError::InvalidRequest("x"),
        ProviderCallError::Unreachable,
        ProviderCallError::Timeout,
        ProviderCallError::ConnectionBroke,
        ProviderCallError::Status { status: 503 },
        ProviderCallError::Reported,
        ProviderCallError::Malformed,
        ProviderCallError::Truncated,
        ProviderCallError::Unconfigured,
    ];

    fn code_and_health(e: ProviderCallError) -> (FailureCode, Option<HealthFailureCode>) {
        let f = e.failure();
        (f.code, f.health_failure)
    }

    #[test]
    fn http_errors_carry_status_and_classified_health_r_ht_1() {
        let f = ProviderCallError::Status { status: 503 }.failure();
        assert_eq!(f.code, FailureCode::ProviderError);
        assert_eq!(f.http_status, Some(503));
        assert_eq!(f.health_failure, Some(HealthFailureCode::Http5xx));
        let f = ProviderCallError::Status { status: 401 }.failure();
        assert_eq!(f.http_status, Some(401));
        assert_eq!(f.health_failure, classify_http_status(401));
    }

    #[test]
    fn each_error_maps_to_its_code_and_health_class() {
        use FailureCode as C;
        use HealthFailureCode as H;
        let expected = [
            (C::InvalidRequest, None),
            (C::ProviderUnreachable, Some(H::TransportFailed)),
            (C::ProviderUnreachable, Some(H::Timeout)),
            (C::ProviderUnreachable, Some(H::TransportFailed)),
            (C::ProviderError, Some(H::Http5xx)),
            (C::ProviderError, Some(H::ProviderRejected)),
            (C::MalformedResponse, Some(H::MalformedResponse)),
            (C::MalformedResponse, Some(H::MalformedResponse)),
            (C::Internal, None),
        ];
        for (e, want) in ALL.into_iter().zip(expected) {
            assert_eq!(code_and_health(e), want, "{e:?}");
        }
        // Only an error status carries one.
        for e in ALL {
            let has_status = matches!(e, ProviderCallError::Status { .. });
            assert_eq!(e.failure().http_status.is_some(), has_status, "{e:?}");
        }
    }

    #[test]
    fn the_node_never_marks_a_failure_retryable_r_wd_8() {
        for e in ALL {
            let f = e.failure();
            assert!(!f.retryable, "{e:?}");
            assert_eq!(f.provider_health, None, "{e:?}");
            assert_eq!(f.stall, None, "{e:?}");
        }
    }

    #[test]
    fn an_answer_without_its_terminal_is_one_malformed_failure_r_wd_6() {
        let f = ProviderCallError::missing_terminal();
        assert_eq!(f, ProviderCallError::Truncated.failure());
        assert_eq!(f.code, FailureCode::MalformedResponse);
        assert_eq!(f.health_failure, Some(HealthFailureCode::MalformedResponse));
    }

    #[test]
    fn a_failed_probe_is_a_verdict_only_when_the_target_answered_r_wd_5() {
        use ProbeAnswer as P;
        let expected = [
            P::TransportFailed,
            P::TransportFailed,
            P::TimedOut,
            P::TransportFailed,
            P::HttpStatus(503),
            P::TransportFailed,
            P::Malformed,
            P::Malformed,
            P::TransportFailed,
        ];
        for (e, want) in ALL.into_iter().zip(expected) {
            assert_eq!(e.probe_answer(), want, "{e:?}");
        }
    }
}
