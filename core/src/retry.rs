//! Which failures another provider may answer (R-FAIL-1), written once for
//! the Node, which marks a terminal `retryable`, and the Edge, which
//! re-admits only such a terminal before commit.

use iop_wire::FailureCode;

/// Whether a failure of this class leaves the request for another provider
/// to answer: the node is overloaded (no provider was called), the provider
/// could not be reached, answered a 5xx or a 429, or the connection was
/// lost. A client error (invalid request, another 4xx), a rejected
/// credential (R-CRED-3: no fallback), a cancel, a deadline, an unknown
/// target or a malformed answer never is; a stall has its own rule
/// (R-WD-4, R-GATE-2).
pub fn class_may_fail_over(code: FailureCode, http_status: Option<u16>) -> bool {
    match code {
        FailureCode::NodeOverloaded
        | FailureCode::ProviderUnreachable
        | FailureCode::TransportClosed => true,
        FailureCode::ProviderError => match http_status {
            Some(status) => status == 429 || (500..600).contains(&status),
            None => true,
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overloaded_unreachable_5xx_and_429_may_fail_over_client_errors_never() {
        use FailureCode as C;
        for (code, status, expected) in [
            (C::NodeOverloaded, None, true),
            (C::ProviderUnreachable, None, true),
            (C::TransportClosed, None, true),
            (C::ProviderError, Some(500), true),
            (C::ProviderError, Some(503), true),
            (C::ProviderError, Some(429), true),
            (C::ProviderError, None, true),
            (C::ProviderError, Some(400), false),
            (C::ProviderError, Some(404), false),
            (C::InvalidRequest, None, false),
            (C::CredentialRejected, None, false),
            (C::Canceled, None, false),
            (C::DeadlineExceeded, None, false),
            (C::UnknownTarget, None, false),
            (C::MalformedResponse, None, false),
            (C::ResponseStalled, None, false),
            (C::Internal, None, false),
        ] {
            assert_eq!(
                class_may_fail_over(code, status),
                expected,
                "{code:?} {status:?}"
            );
        }
    }
}
