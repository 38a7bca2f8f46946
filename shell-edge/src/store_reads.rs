//! Store reads in flight per principal and per key (R-LIM-6): the shared
//! registry of core's [`StoreReads`] under a lock, and the slot a reader
//! holds while it reads the journal (a retrieve, `input_items`, a cancel
//! or delete, a `previous_response_id` conversation), given back when
//! dropped. A reader over a bound is answered 503 `server_busy` with
//! `Retry-After`, as a request over its principal's memory share, and
//! counted in `iop_edge_store_reads_refused_total{bound}`. The custody's
//! takeover reads take places of their own share ([`ReadSlots::begin_takeover`]).

use std::sync::{Arc, Mutex};

use iop_core::edge::store_reads::{ReadLimits, ReadRefusal, StoreReads};

use crate::api::ApiError;
use crate::api::error::ErrorKind;
use crate::config::ApiKey;
use crate::metrics::EdgeMetrics;

/// Every reader in flight (cheap to clone: one shared registry).
#[derive(Debug, Clone)]
pub struct ReadSlots {
    reads: Arc<Mutex<StoreReads>>,
    metrics: Arc<EdgeMetrics>,
}

/// A takeover reader's place in the takeovers' share; given back when
/// dropped.
#[derive(Debug)]
pub struct TakeoverReadSlot {
    reads: Arc<Mutex<StoreReads>>,
}

impl Drop for TakeoverReadSlot {
    fn drop(&mut self) {
        self.reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .end_takeover();
    }
}

/// One reader's place; the place is given back when dropped.
#[derive(Debug)]
pub struct ReadSlot {
    reads: Arc<Mutex<StoreReads>>,
    principal: String,
    key: String,
}

impl ReadSlots {
    /// No reader in flight, under `limits` (validated at config load);
    /// refusals counted in `metrics`.
    pub fn new(limits: ReadLimits, metrics: Arc<EdgeMetrics>) -> Self {
        Self {
            reads: Arc::new(Mutex::new(StoreReads::new(limits))),
            metrics,
        }
    }

    /// A place for one of the custody's takeover reads (R-LIM-6: their own
    /// share, never a client's), or `None` while the share is in use.
    pub fn begin_takeover(&self) -> Option<TakeoverReadSlot> {
        let begun = self
            .reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .begin_takeover();
        match begun {
            Ok(()) => Some(TakeoverReadSlot {
                reads: self.reads.clone(),
            }),
            Err(refusal) => {
                self.metrics.store_read_refused(refusal.as_str());
                None
            }
        }
    }

    /// A place for a reader of `key`, or the refusal's error.
    pub fn begin(&self, key: &ApiKey) -> Result<ReadSlot, ApiError> {
        self.begin_as(&key.principal, &key.id)
    }

    /// [`Self::begin`] of `principal`'s key `key_id`.
    pub fn begin_as(&self, principal: &str, key_id: &str) -> Result<ReadSlot, ApiError> {
        let begun = self
            .reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .begin(principal, key_id);
        match begun {
            Ok(()) => Ok(ReadSlot {
                reads: self.reads.clone(),
                principal: principal.to_owned(),
                key: key_id.to_owned(),
            }),
            Err(refusal) => {
                self.metrics.store_read_refused(refusal.as_str());
                Err(refused(refusal))
            }
        }
    }

    /// Readers in flight now.
    pub fn in_flight(&self) -> usize {
        self.reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .in_flight()
    }
}

impl Drop for ReadSlot {
    fn drop(&mut self) {
        self.reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .end(&self.principal, &self.key);
    }
}

/// The answer to a reader over a bound: 503 `server_busy`, retry in a
/// second (the bound is of reads in flight, which end within moments).
fn refused(refusal: ReadRefusal) -> ApiError {
    let whose = match refusal {
        ReadRefusal::Key => "This key has",
        ReadRefusal::Principal => "This key's owner has",
        ReadRefusal::Total | ReadRefusal::Takeover => "The server has",
    };
    ApiError {
        status: 503,
        kind: ErrorKind::ServiceUnavailable,
        code: Some("server_busy"),
        message: format!("{whose} too many stored responses being read. Retry shortly."),
        param: None,
        retry_after_secs: Some(1),
        headers: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r_lim_6_a_slot_is_given_back_when_dropped_and_a_refusal_is_503_server_busy() {
        let metrics = EdgeMetrics::new(iop_transport::telemetry::MetricsPipeline::prometheus_only(
            "iop-edge",
        ));
        let slots = ReadSlots::new(
            ReadLimits {
                total: 4,
                per_principal: 2,
                per_key: 1,
            },
            metrics.clone(),
        );
        let first = slots.begin_as("p", "k").unwrap();
        let refused = slots.begin_as("p", "k").unwrap_err();
        assert_eq!(refused.status, 503);
        assert_eq!(refused.code, Some("server_busy"));
        assert_eq!(refused.retry_after_secs, Some(1));
        assert_eq!(slots.in_flight(), 1);
        drop(first);
        assert_eq!(slots.in_flight(), 0);
        assert!(slots.begin_as("p", "k").is_ok());
        // R-OBS-1: the refusal is counted by its bound, never its key.
        let text = metrics.render();
        assert!(
            text.contains("iop_edge_store_reads_refused_total{bound=\"key\"} 1"),
            "{text}"
        );
        assert!(!text.contains("bound=\"k\""));
        // Takeovers read in their own share: clients at their bounds do
        // not hold them up.
        let _held = slots.begin_as("p", "k").unwrap();
        let takeovers: Vec<_> = (0..iop_core::edge::store_reads::TAKEOVER_READS_IN_FLIGHT)
            .map(|_| slots.begin_takeover().expect("a takeover's place"))
            .collect();
        assert!(slots.begin_takeover().is_none());
        assert_eq!(slots.in_flight(), 1, "no client's place taken");
        drop(takeovers);
        assert!(slots.begin_takeover().is_some());
    }
}
