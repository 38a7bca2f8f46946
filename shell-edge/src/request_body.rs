//! Reading a client's request body under R-LIM-2: a global budget of body
//! bytes held at once, taken before a byte is read; a per-body size limit
//! checked against `Content-Length` before reading; a read timeout; and a
//! client that goes away mid-body told apart from one that sent too much.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, header};
use bytes::Bytes;
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::api::ApiError;
use crate::api::error::ErrorKind;

/// The error code of a body the client stopped sending; its outcome is
/// `client_disconnected`, never `invalid_request`.
pub const CLIENT_CLOSED_CODE: &str = "client_closed_request";

/// Why a body could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// Larger than `max_body_bytes` (declared or sent): the client's fault.
    #[error("request body larger than {limit_bytes} bytes")]
    TooLarge {
        /// The per-body limit.
        limit_bytes: usize,
    },
    /// The global budget of body bytes in flight has no room for it.
    #[error("request body budget exhausted")]
    BudgetExhausted,
    /// The body did not arrive within the read timeout.
    #[error("request body not received within {timeout_ms} ms")]
    Timeout {
        /// The read timeout.
        timeout_ms: u64,
    },
    /// The client closed or reset the stream before the body ended.
    #[error("client closed the request before its body ended")]
    ClientClosed,
}

impl BodyError {
    /// The client-facing error.
    pub fn to_api_error(self) -> ApiError {
        let (status, kind, code, message, retry_after_secs) = match self {
            BodyError::TooLarge { limit_bytes } => return ApiError::body_too_large(limit_bytes),
            BodyError::BudgetExhausted => (
                503,
                ErrorKind::ServiceUnavailable,
                "server_busy",
                "The server is receiving too many request bodies. Retry shortly.".to_owned(),
                Some(1),
            ),
            BodyError::Timeout { timeout_ms } => (
                408,
                ErrorKind::InvalidRequest,
                "request_timeout",
                format!("The request body did not arrive within {timeout_ms} ms."),
                None,
            ),
            BodyError::ClientClosed => (
                400,
                ErrorKind::InvalidRequest,
                CLIENT_CLOSED_CODE,
                "The client closed the request before its body ended.".to_owned(),
                None,
            ),
        };
        ApiError {
            status,
            kind,
            code: Some(code),
            message,
            param: None,
            retry_after_secs,
        }
    }
}

/// A body read whole, and its share of the budget (returned when dropped).
#[derive(Debug)]
pub struct HeldBody {
    /// The body.
    pub bytes: Bytes,
    /// Kept as long as the request holds the body or what was parsed from it.
    pub permit: OwnedSemaphorePermit,
}

/// The budget and limits every body is read under.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    permits: Arc<Semaphore>,
    max_body_bytes: usize,
    read_timeout: Duration,
}

impl BodyBudget {
    /// `total_bytes` held at once across every request; each body at most
    /// `max_body_bytes` (<= `total_bytes`, <= `u32::MAX`), read within
    /// `read_timeout`.
    pub fn new(total_bytes: usize, max_body_bytes: usize, read_timeout: Duration) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(total_bytes)),
            max_body_bytes,
            read_timeout,
        }
    }

    /// Body bytes that may be taken now.
    pub fn available_bytes(&self) -> usize {
        self.permits.available_permits()
    }

    /// Read `body` whole. The budget is taken before reading: the declared
    /// `Content-Length`, or `max_body_bytes` for a body of unknown length
    /// (the unused part is returned once the body is read). No room means a
    /// fast refusal, never a wait.
    pub async fn read(&self, headers: &HeaderMap, body: Body) -> Result<HeldBody, BodyError> {
        let limit = self.max_body_bytes;
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let reserve = match declared {
            Some(n) if n > limit as u64 => return Err(BodyError::TooLarge { limit_bytes: limit }),
            Some(n) => n as usize,
            None => limit,
        };
        // A zero-permit acquire always succeeds; keep one so every body,
        // even an empty one, is counted.
        let reserve_permits = u32::try_from(reserve.max(1)).unwrap_or(u32::MAX);
        let mut permit = self
            .permits
            .clone()
            .try_acquire_many_owned(reserve_permits)
            .map_err(|_| BodyError::BudgetExhausted)?;
        let read = tokio::time::timeout(self.read_timeout, Limited::new(body, limit).collect());
        let bytes = match read.await {
            Err(_) => {
                return Err(BodyError::Timeout {
                    timeout_ms: u64::try_from(self.read_timeout.as_millis()).unwrap_or(u64::MAX),
                });
            }
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return Err(BodyError::TooLarge { limit_bytes: limit });
            }
            // Any other error is the stream ending early: a closed
            // connection, an HTTP/2 reset, a chunked body cut short.
            Ok(Err(_)) => return Err(BodyError::ClientClosed),
            Ok(Ok(collected)) => collected.to_bytes(),
        };
        let keep = bytes.len().max(1);
        if permit.num_permits() > keep {
            drop(permit.split(permit.num_permits() - keep));
        }
        Ok(HeldBody { bytes, permit })
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt as _;

    use super::*;

    fn headers(len: Option<usize>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(n) = len {
            h.insert(header::CONTENT_LENGTH, n.into());
        }
        h
    }

    #[tokio::test]
    async fn a_declared_length_over_the_limit_is_refused_before_reading() {
        let budget = BodyBudget::new(100, 10, Duration::from_secs(1));
        let err = budget
            .read(&headers(Some(11)), Body::from("x".repeat(11)))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::TooLarge { limit_bytes: 10 });
        assert_eq!(budget.available_bytes(), 100);
    }

    #[tokio::test]
    async fn a_body_holds_its_bytes_of_the_budget_until_dropped() {
        // R-LIM-2: bytes in flight are bounded across all requests.
        let budget = BodyBudget::new(15, 10, Duration::from_secs(1));
        let held = budget
            .read(&headers(Some(8)), Body::from("12345678"))
            .await
            .unwrap();
        assert_eq!(&held.bytes[..], b"12345678");
        assert_eq!(budget.available_bytes(), 7);
        let err = budget
            .read(&headers(Some(8)), Body::from("12345678"))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::BudgetExhausted);
        drop(held);
        assert_eq!(budget.available_bytes(), 15);
    }

    #[tokio::test]
    async fn a_body_of_unknown_length_reserves_the_limit_then_keeps_what_it_used() {
        let budget = BodyBudget::new(20, 10, Duration::from_secs(1));
        let stream = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from("abc"))]);
        let held = budget
            .read(&headers(None), Body::from_stream(stream))
            .await
            .unwrap();
        assert_eq!(budget.available_bytes(), 17);
        drop(held);
        let big = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from("x".repeat(11)))]);
        let err = budget
            .read(&headers(None), Body::from_stream(big))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::TooLarge { limit_bytes: 10 });
        assert_eq!(budget.available_bytes(), 20);
    }

    #[tokio::test]
    async fn a_stream_that_breaks_mid_body_is_the_client_closing_not_too_large() {
        let budget = BodyBudget::new(20, 10, Duration::from_secs(1));
        let stream = futures::stream::iter([
            Ok(Bytes::from("ab")),
            Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
        ]);
        let err = budget
            .read(&headers(Some(9)), Body::from_stream(stream))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::ClientClosed);
        assert_eq!(err.to_api_error().code, Some(CLIENT_CLOSED_CODE));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_arriving_times_out() {
        let budget = BodyBudget::new(20, 10, Duration::from_millis(500));
        let stream = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from("ab"))])
            .chain(futures::stream::pending());
        let err = budget
            .read(&headers(Some(9)), Body::from_stream(stream))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::Timeout { timeout_ms: 500 });
        assert_eq!(err.to_api_error().status, 408);
        assert_eq!(budget.available_bytes(), 20);
    }
}
