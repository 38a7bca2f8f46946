//! The typed failure of one provider call, from the HTTP client's view of
//! how it ended. What each class means on the wire (and to a probe) is
//! core's rule: [`iop_core::node::provider`].

use super::client::HttpError;

pub use iop_core::node::provider::ProviderCallError;

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
