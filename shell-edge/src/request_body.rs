//! Reading a client's request body under R-LIM-2: a global budget of body
//! bytes held at once, taken before a byte is read; a per-body size limit
//! checked against `Content-Length` before reading; a read timeout; and a
//! client that goes away mid-body told apart from one that sent too much.
//! How much a body takes at each point of its read, and when it is too
//! large or too complex, is the core's rule
//! ([`iop_core::edge::limits::BodyRule`]); this module holds the
//! semaphores, reads and times the body, and measures its decoded tree.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, header};
use bytes::Bytes;
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use iop_core::edge::limits::{BodyRefusal, BodyRule};
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
    /// Its decoded form would take more than a body of the largest size
    /// is allowed ([`crate::decoded_size`], [`BodyRule::once_read`]): small
    /// nested values in bulk.
    #[error("request body decodes to {decoded_bytes} bytes, over {limit_bytes}")]
    TooComplex {
        /// What the decoded tree would take.
        decoded_bytes: usize,
        /// The most one body may take decoded.
        limit_bytes: usize,
    },
}

impl From<BodyRefusal> for BodyError {
    fn from(refusal: BodyRefusal) -> Self {
        match refusal {
            BodyRefusal::TooLarge { limit_bytes } => BodyError::TooLarge { limit_bytes },
            BodyRefusal::TooComplex {
                decoded_bytes,
                limit_bytes,
            } => BodyError::TooComplex {
                decoded_bytes,
                limit_bytes,
            },
        }
    }
}

impl BodyError {
    /// The client-facing error.
    pub fn to_api_error(self) -> ApiError {
        let (status, kind, code, message, retry_after_secs) = match self {
            BodyError::TooLarge { limit_bytes } => return ApiError::body_too_large(limit_bytes),
            BodyError::TooComplex {
                decoded_bytes,
                limit_bytes,
            } => (
                413,
                ErrorKind::InvalidRequest,
                "request_too_complex",
                format!(
                    "The request body would take {decoded_bytes} bytes of memory once decoded, \
                     over the limit of {limit_bytes}: send fewer, larger values."
                ),
                None,
            ),
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
            headers: Vec::new(),
        }
    }
}

/// A request's share of the memory budgets: the global one and its
/// principal's; returned when dropped.
#[derive(Debug)]
pub struct BodyPermit {
    total: OwnedSemaphorePermit,
    principal: OwnedSemaphorePermit,
}

impl BodyPermit {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.total.num_permits()
    }

    /// Give back everything above `bytes` (at least one is kept).
    pub fn shrink_to(&mut self, bytes: usize) {
        let keep = bytes.max(1);
        let held = self.total.num_permits();
        if held > keep {
            drop(self.total.split(held - keep));
            drop(self.principal.split(held - keep));
        }
    }

    fn merge(&mut self, more: BodyPermit) {
        self.total.merge(more.total);
        self.principal.merge(more.principal);
    }
}

/// A body read whole, and its share of the budget.
#[derive(Debug)]
pub struct HeldBody {
    /// The body.
    pub bytes: Bytes,
    /// Kept as long as the request holds the body or what was parsed from
    /// it; [`BodyPermit::shrink_to`] once parsed.
    pub permit: BodyPermit,
}

/// The memory budgets every request body is read under (R-LIM-2).
#[derive(Debug, Clone)]
pub struct BodyBudget {
    total: Arc<Semaphore>,
    /// One semaphore per principal, created on first use (principals come
    /// from the configuration: bounded).
    principals: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
    principal_bytes: usize,
    rule: BodyRule,
    read_timeout: Duration,
}

impl BodyBudget {
    /// `total_bytes` of request memory across every request, at most
    /// `principal_bytes` of it for one principal; each body at most
    /// `max_body_bytes` (whose decoded size must fit both), read within
    /// `read_timeout`.
    pub fn new(
        total_bytes: usize,
        principal_bytes: usize,
        max_body_bytes: usize,
        read_timeout: Duration,
    ) -> Self {
        Self {
            total: Arc::new(Semaphore::new(total_bytes)),
            principals: Arc::new(Mutex::new(HashMap::new())),
            principal_bytes,
            rule: BodyRule::new(max_body_bytes),
            read_timeout,
        }
    }

    /// Bytes that may be taken now across every principal.
    pub fn available_bytes(&self) -> usize {
        self.total.available_permits()
    }

    fn principal(&self, principal: &str) -> Arc<Semaphore> {
        let mut map = self.principals.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(principal.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(self.principal_bytes)))
            .clone()
    }

    /// Take `bytes` from both budgets at once, or nothing.
    fn take(&self, share: &Arc<Semaphore>, bytes: usize) -> Result<BodyPermit, BodyError> {
        let n = u32::try_from(bytes.max(1)).map_err(|_| BodyError::BudgetExhausted)?;
        let total = self
            .total
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| BodyError::BudgetExhausted)?;
        let principal = share
            .clone()
            .try_acquire_many_owned(n)
            .map_err(|_| BodyError::BudgetExhausted)?;
        Ok(BodyPermit { total, principal })
    }

    /// Read `body` of `principal`'s request whole, taking from the budgets
    /// what the core's [`BodyRule`] says (R-LIM-2): before reading when
    /// `Content-Length` declares the size, else as the bytes arrive; once
    /// read, what its decoded tree will take. No room means a fast refusal,
    /// never a wait; a body whose tree would take more than the largest
    /// body may is refused ([`BodyError::TooComplex`]).
    pub async fn read(
        &self,
        principal: &str,
        headers: &HeaderMap,
        body: Body,
    ) -> Result<HeldBody, BodyError> {
        let limit = self.rule.max_body_bytes;
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let before = self.rule.before_read(declared)?;
        let share = self.principal(principal);
        let mut permit = self.take(&share, before)?;
        let read = async {
            let mut body = Limited::new(body, limit);
            let mut chunks: Vec<Bytes> = Vec::new();
            let mut received = 0usize;
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| {
                    if e.downcast_ref::<LengthLimitError>().is_some() {
                        BodyError::TooLarge { limit_bytes: limit }
                    } else {
                        // The stream ended early: a closed connection, an
                        // HTTP/2 reset, a chunked body cut short.
                        BodyError::ClientClosed
                    }
                })?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                received += data.len();
                let needed = self.rule.while_reading(received);
                if needed > permit.bytes() {
                    let more = self.take(&share, needed - permit.bytes())?;
                    permit.merge(more);
                }
                chunks.push(data);
            }
            Ok::<_, BodyError>(match chunks.len() {
                0 => Bytes::new(),
                1 => chunks.swap_remove(0),
                _ => {
                    let mut all = Vec::with_capacity(received);
                    for c in &chunks {
                        all.extend_from_slice(c);
                    }
                    Bytes::from(all)
                }
            })
        };
        let bytes = match tokio::time::timeout(self.read_timeout, read).await {
            Err(_) => {
                return Err(BodyError::Timeout {
                    timeout_ms: u64::try_from(self.read_timeout.as_millis()).unwrap_or(u64::MAX),
                });
            }
            Ok(result) => result?,
        };
        // What the parse will really take (`None`: not JSON).
        let tree = crate::decoded_size::decoded_size(&bytes).ok();
        let needed = self.rule.once_read(bytes.len(), tree)?;
        if needed > permit.bytes() {
            let more = self.take(&share, needed - permit.bytes())?;
            permit.merge(more);
        } else {
            permit.shrink_to(needed);
        }
        Ok(HeldBody { bytes, permit })
    }

    /// Take `principal`'s share for a stored request of `bytes` read back
    /// from the journal (R-LIM-6: a read is bounded like a write): what
    /// its parse takes, as for a body of that size. No room: refused at
    /// once, as a body would be.
    pub fn hold_stored(&self, principal: &str, bytes: &[u8]) -> Result<BodyPermit, BodyError> {
        let tree = crate::decoded_size::decoded_size(bytes).ok();
        let needed = self.rule.once_read(bytes.len(), tree).unwrap_or(
            bytes
                .len()
                .saturating_mul(iop_core::edge::limits::DECODED_BYTES_PER_BODY_BYTE),
        );
        let share = self.principal(principal);
        self.take(&share, needed)
    }

    /// Take `principal`'s share for an answer a read builds from the
    /// journal (R-LIM-6: a retrieve's rendering, a conversation's
    /// answers): `bytes`, at most half a share, so an answer larger than
    /// a share is still read (alone) beside the stored request it reads.
    /// No room: refused at once, as a body would be.
    pub fn hold_answer(&self, principal: &str, bytes: usize) -> Result<BodyPermit, BodyError> {
        let share = self.principal(principal);
        self.take(&share, bytes.min(self.principal_bytes / 2))
    }

    /// Make `permit` (of `principal`'s share) hold `bytes`: what beyond is
    /// given back, what is missing taken (or refused at once, the permit
    /// as it was).
    pub fn refit(
        &self,
        principal: &str,
        permit: &mut BodyPermit,
        bytes: usize,
    ) -> Result<(), BodyError> {
        if bytes > permit.bytes() {
            let share = self.principal(principal);
            let more = self.take(&share, bytes - permit.bytes())?;
            permit.merge(more);
        } else {
            permit.shrink_to(bytes);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt as _;

    use iop_core::edge::limits::{DECODED_BYTES_PER_BODY_BYTE, kept_bytes};

    use super::*;

    const D: usize = DECODED_BYTES_PER_BODY_BYTE;

    fn headers(len: Option<usize>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(n) = len {
            h.insert(header::CONTENT_LENGTH, n.into());
        }
        h
    }

    fn budget_of(total_body_bytes: usize, max_body_bytes: usize) -> BodyBudget {
        BodyBudget::new(
            total_body_bytes * D,
            total_body_bytes * D,
            max_body_bytes,
            Duration::from_secs(1),
        )
    }

    #[tokio::test]
    async fn a_declared_length_over_the_limit_is_refused_before_reading() {
        let budget = budget_of(100, 10);
        let err = budget
            .read("p", &headers(Some(11)), Body::from("x".repeat(11)))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::TooLarge { limit_bytes: 10 });
        assert_eq!(budget.available_bytes(), 100 * D);
    }

    #[tokio::test]
    async fn a_body_holds_its_decoded_size_of_the_budget_until_dropped() {
        // R-LIM-2: memory in flight is bounded across all requests, and
        // accounted as decoded.
        let budget = budget_of(15, 10);
        let mut held = budget
            .read("p", &headers(Some(8)), Body::from("not json"))
            .await
            .unwrap();
        assert_eq!(&held.bytes[..], b"not json");
        assert_eq!(budget.available_bytes(), 7 * D);
        let err = budget
            .read("q", &headers(Some(8)), Body::from("not json"))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::BudgetExhausted);
        // Parsed: the request keeps less.
        held.permit.shrink_to(kept_bytes(8));
        assert_eq!(budget.available_bytes(), 15 * D - kept_bytes(8));
        drop(held);
        assert_eq!(budget.available_bytes(), 15 * D);
    }

    #[tokio::test]
    async fn once_read_a_body_holds_what_its_decoded_tree_takes() {
        let d = |body: &str| crate::decoded_size::decoded_size(body.as_bytes()).unwrap();
        // Text: far less than 16x.
        let budget = budget_of(1_000, 1_000);
        let text = format!("\"{}\"", "x".repeat(500));
        let held = budget
            .read("p", &headers(Some(text.len())), Body::from(text.clone()))
            .await
            .unwrap();
        assert_eq!(held.permit.bytes(), d(&text) + text.len());
        drop(held);
        // Small objects: more than 16x, taken before the parse.
        let objects = format!("[{}{{}}]", "{\"\":0},".repeat(20));
        let need = d(&objects) + objects.len();
        assert!(need > objects.len() * D);
        let held = budget
            .read(
                "p",
                &headers(Some(objects.len())),
                Body::from(objects.clone()),
            )
            .await
            .unwrap();
        assert_eq!(held.permit.bytes(), need);
        assert_eq!(budget.available_bytes(), 1_000 * D - need);
        drop(held);
        // Beyond what the largest body may take: refused, nothing held.
        let small = budget_of(1_000, objects.len());
        let err = small
            .read(
                "p",
                &headers(Some(objects.len())),
                Body::from(objects.clone()),
            )
            .await
            .unwrap_err();
        assert_eq!(
            err,
            BodyError::TooComplex {
                decoded_bytes: need,
                limit_bytes: objects.len() * D
            }
        );
        assert_eq!(err.to_api_error().status, 413);
        assert_eq!(small.available_bytes(), 1_000 * D);
    }

    #[tokio::test]
    async fn one_principal_cannot_take_more_than_its_share() {
        let budget = BodyBudget::new(100 * D, 10 * D, 10, Duration::from_secs(1));
        let _a = budget
            .read("a", &headers(Some(10)), Body::from("x".repeat(10)))
            .await
            .unwrap();
        let err = budget
            .read("a", &headers(Some(1)), Body::from("x"))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::BudgetExhausted);
        assert_eq!(budget.available_bytes(), 90 * D, "nothing taken on refusal");
        budget
            .read("b", &headers(Some(10)), Body::from("x".repeat(10)))
            .await
            .unwrap();
    }

    #[test]
    fn r_lim_6_a_stored_request_read_back_takes_its_principals_share() {
        let budget = BodyBudget::new(100 * D, 10 * D, 10, Duration::from_secs(1));
        let stored = br#"{"a":1}"#;
        let held = budget.hold_stored("a", stored).unwrap();
        assert!(held.bytes() >= stored.len());
        // Reads of "a" past its share are refused; "b" still reads.
        let mut reads = vec![held];
        let refused = loop {
            match budget.hold_stored("a", stored) {
                Ok(p) => reads.push(p),
                Err(e) => break e,
            }
            assert!(reads.len() < 100, "the share bounds reads");
        };
        assert_eq!(refused, BodyError::BudgetExhausted);
        assert!(budget.hold_stored("b", stored).is_ok());
        let available = budget.available_bytes();
        drop(reads);
        assert!(
            budget.available_bytes() > available,
            "given back when dropped"
        );
    }

    #[tokio::test]
    async fn a_body_of_unknown_length_is_accounted_as_it_arrives() {
        let budget = budget_of(20, 10);
        let stream = futures::stream::iter([
            Ok::<_, std::io::Error>(Bytes::from("ab")),
            Ok(Bytes::from("c")),
        ]);
        let held = budget
            .read("p", &headers(None), Body::from_stream(stream))
            .await
            .unwrap();
        assert_eq!(&held.bytes[..], b"abc");
        assert_eq!(budget.available_bytes(), 17 * D, "not JSON: as read");
        drop(held);
        let big = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from("x".repeat(11)))]);
        let err = budget
            .read("p", &headers(None), Body::from_stream(big))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::TooLarge { limit_bytes: 10 });
        assert_eq!(budget.available_bytes(), 20 * D);
        // Chunks past the budget are refused as they arrive.
        let small = budget_of(4, 10);
        let chunks = futures::stream::iter([
            Ok::<_, std::io::Error>(Bytes::from("abc")),
            Ok(Bytes::from("de")),
        ]);
        let err = small
            .read("p", &headers(None), Body::from_stream(chunks))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::BudgetExhausted);
        assert_eq!(small.available_bytes(), 4 * D);
    }

    #[tokio::test]
    async fn a_stream_that_breaks_mid_body_is_the_client_closing_not_too_large() {
        let budget = budget_of(20, 10);
        let stream = futures::stream::iter([
            Ok(Bytes::from("ab")),
            Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
        ]);
        let err = budget
            .read("p", &headers(Some(9)), Body::from_stream(stream))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::ClientClosed);
        assert_eq!(err.to_api_error().code, Some(CLIENT_CLOSED_CODE));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_arriving_times_out() {
        let budget = BodyBudget::new(20 * D, 20 * D, 10, Duration::from_millis(500));
        let stream = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from("ab"))])
            .chain(futures::stream::pending());
        let err = budget
            .read("p", &headers(Some(9)), Body::from_stream(stream))
            .await
            .unwrap_err();
        assert_eq!(err, BodyError::Timeout { timeout_ms: 500 });
        assert_eq!(err.to_api_error().status, 408);
        assert_eq!(budget.available_bytes(), 20 * D);
    }
}
