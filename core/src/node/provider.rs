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
//!
//! [`AnswerCall::for_run`] decides how a normalized run asks its provider
//! for the answer: streamed, or as one non-streamed call.

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

/// How the Node asks a provider for a normalized run's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerCall {
    /// A streamed call: every token is progress for the stall watchdog
    /// (R-WD-1) and reaches the Edge as it arrives.
    Streamed,
    /// One non-streamed call, read in one piece, as the client itself would
    /// call the provider: the stall timer runs until the whole answer
    /// arrives, so the stall timeout bounds the whole generation (as in
    /// tunnel mode, where a non-streamed client's answer is one body).
    Whole,
}

/// What [`AnswerCall::for_run`] decides from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnswerCallFacts {
    /// The client takes the answer whole (it did not ask for a stream).
    pub whole_answer: bool,
    /// The run writes a durable response (it parks if its Edge is lost).
    pub durable: bool,
    /// The target's streams carry usage (`[[providers]] stream_usage`).
    pub stream_usage: bool,
    /// The target answers whole answers from non-streamed calls
    /// (`[[providers]] whole_calls`, default true).
    pub whole_calls: bool,
}

impl AnswerCall {
    /// The call a run makes, in order:
    ///
    /// 1. a client that streams gets a streamed call;
    /// 2. a target whose streams carry no usage answers a whole answer with
    ///    a non-streamed call: the provider's usage is only there (durable
    ///    or not: such a run's continuation has no prefix to start from);
    /// 3. a durable run streams, so its journal keeps the prefix as it is
    ///    generated: a parked run's buffer (R-PARK-1) and a continuation's
    ///    prefix (R-CONT-1) hold what the provider already produced, and a
    ///    takeover never starts the answer again (R-TAKE-1);
    /// 4. otherwise the target's `whole_calls` setting: a whole call costs
    ///    the Node and the Edge one event instead of one per token, and a
    ///    provider that writes each SSE event as a small separate write has
    ///    no stream to hold back (docs/benchmarks.md).
    pub fn for_run(facts: AnswerCallFacts) -> Self {
        if !facts.whole_answer {
            AnswerCall::Streamed
        } else if !facts.stream_usage {
            AnswerCall::Whole
        } else if facts.durable || !facts.whole_calls {
            AnswerCall::Streamed
        } else {
            AnswerCall::Whole
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streaming_client_always_gets_a_streamed_call() {
        for (durable, stream_usage, whole_calls) in bools3() {
            let facts = AnswerCallFacts {
                whole_answer: false,
                durable,
                stream_usage,
                whole_calls,
            };
            assert_eq!(
                AnswerCall::for_run(facts),
                AnswerCall::Streamed,
                "{facts:?}"
            );
        }
    }

    /// Every client that takes its answer whole:
    /// (durable, stream_usage, whole_calls) -> the call.
    const WHOLE_ANSWER_CALLS: [((bool, bool, bool), AnswerCall); 8] = [
        // Ephemeral: the target's setting.
        ((false, true, true), AnswerCall::Whole),
        ((false, true, false), AnswerCall::Streamed),
        // Durable: streamed, so its prefix is journaled (R-PARK-1, R-CONT-1).
        ((true, true, true), AnswerCall::Streamed),
        ((true, true, false), AnswerCall::Streamed),
        // No usage in the target's streams: whole, its usage is only there.
        ((false, false, true), AnswerCall::Whole),
        ((false, false, false), AnswerCall::Whole),
        ((true, false, true), AnswerCall::Whole),
        ((true, false, false), AnswerCall::Whole),
    ];

    #[test]
    fn a_durable_whole_answer_streams_so_its_prefix_is_journaled_r_park_1_r_cont_1() {
        for ((durable, stream_usage, whole_calls), call) in WHOLE_ANSWER_CALLS {
            let facts = AnswerCallFacts {
                whole_answer: true,
                durable,
                stream_usage,
                whole_calls,
            };
            assert_eq!(AnswerCall::for_run(facts), call, "{facts:?}");
        }
        // The table covers every case once.
        let mut cases: Vec<_> = WHOLE_ANSWER_CALLS.iter().map(|(f, _)| *f).collect();
        cases.sort();
        cases.dedup();
        assert_eq!(cases.len(), 8);
    }

    fn bools3() -> impl Iterator<Item = (bool, bool, bool)> {
        (0..8u8).map(|i| (i & 1 != 0, i & 2 != 0, i & 4 != 0))
    }

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
