//! Store reads in flight, per principal and per key (R-LIM-6: reads are
//! bounded like writes).
//!
//! Every read a client's key drives goes to the one journal store every
//! tenant shares: a retrieve, an `input_items` listing, a cancel or delete
//! reading its record, and a `previous_response_id` continuation, which
//! rebuilds its conversation by reading one record after another, up to
//! [`crate::journal::MAX_CONVERSATION_LINKS`] of them. Unbounded, one key
//! continuing many long chains at once keeps most of the store's
//! capacity (a NATS connection's requests, the embedded store's reads)
//! from every other tenant.
//!
//! [`StoreReads`] counts the readers in flight, each doing one store read
//! at a time (a conversation is read link after link), and decides whether
//! a new one may start:
//!
//! * at most [`ReadLimits::per_key`] of one key's, and
//!   [`ReadLimits::per_principal`] of one principal's (all its keys);
//! * at most [`ReadLimits::total`] of everyone's, of which the last
//!   [`ReadLimits::per_principal`] places are kept for principals with no
//!   reader in flight: however many readers the busiest tenants keep
//!   going, a tenant that reads nothing yet is served.
//!
//! The Edge's own reads, a takeover's (R-TAKE-1: the custody reading a
//! record, its events and the conversation it continues, to adopt or
//! continue it, and its scans of the unfinished records and the Edges'
//! leases), have a share of their own, [`TAKEOVER_READS_IN_FLIGHT`]
//! places beside the clients' [`ReadLimits::total`]
//! ([`StoreReads::begin_takeover`]): clients reading all they may never
//! hold a takeover up, and takeovers never take a client's place, so the
//! store sees at most `total + TAKEOVER_READS_IN_FLIGHT` readers of one
//! Edge. They are not counted against the record's principal or key: a
//! tenant reading up to its bounds must not keep its own records, nor
//! another tenant's, from being taken over, and a takeover is the Edge's
//! work, not a client's request. Each takeover's reads are bounded (one
//! record, its events within the record's bytes, at most
//! [`crate::journal::MAX_CONVERSATION_LINKS`] links), so a takeover waits
//! for a place for a bounded time, never for good.
//!
//! A reader over a bound is refused at once ([`ReadRefusal`]), never
//! queued; the Edge answers it 503 `server_busy` with `Retry-After`, as a
//! request over its principal's share of request memory. The counts need
//! no clock: a reader ends when its reads are done, whatever they took.
//!
//! Every client connection's task asks the one shared registry, so it has
//! a plain decision API (as [`crate::edge::limits::Connections`]), not an
//! output queue. The driver:
//!
//! 1. Before a reader's first store read, [`StoreReads::begin`]; refused,
//!    answer the refusal's error and read nothing.
//! 2. When its last read is done (or it fails, or its client goes), once,
//!    [`StoreReads::end`] with the same principal and key.

use std::collections::BTreeMap;

/// The bounds on readers in flight. `per_key <= per_principal < total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReadLimits {
    /// Readers in flight across every principal.
    pub total: usize,
    /// Readers in flight of one principal (all its keys).
    pub per_principal: usize,
    /// Readers in flight of one key.
    pub per_key: usize,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            total: 256,
            per_principal: 32,
            per_key: 32,
        }
    }
}

/// Why a [`ReadLimits`] cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReadLimitsError {
    /// `per_principal` is 0, or leaves no place for another principal.
    #[error("per_principal must be between 1 and total - 1 ({0})")]
    PerPrincipal(usize),
    /// `per_key` is 0 or over `per_principal`.
    #[error("per_key must be between 1 and per_principal ({0})")]
    PerKey(usize),
    /// `total` is over [`MAX_READS_IN_FLIGHT`].
    #[error("total must be at most {MAX_READS_IN_FLIGHT}")]
    Total,
}

/// The largest [`ReadLimits::total`].
pub const MAX_READS_IN_FLIGHT: usize = 65_536;

/// The places of the Edge's own takeover reads, beside the clients'
/// (R-LIM-6; the custody carries out at most this many store operations
/// at once).
pub const TAKEOVER_READS_IN_FLIGHT: usize = 16;

impl ReadLimits {
    /// The first bound that is wrong, if any.
    pub fn validate(&self) -> Result<(), ReadLimitsError> {
        if self.total > MAX_READS_IN_FLIGHT {
            return Err(ReadLimitsError::Total);
        }
        if self.per_principal == 0 || self.per_principal >= self.total {
            return Err(ReadLimitsError::PerPrincipal(self.total.saturating_sub(1)));
        }
        if self.per_key == 0 || self.per_key > self.per_principal {
            return Err(ReadLimitsError::PerKey(self.per_principal));
        }
        Ok(())
    }
}

/// Which bound refused a reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ReadRefusal {
    /// Its key has [`ReadLimits::per_key`] readers in flight.
    Key,
    /// Its principal has [`ReadLimits::per_principal`] readers in flight.
    Principal,
    /// Every place its principal may take is in use (the total, or the
    /// places kept for principals reading nothing).
    Total,
    /// Every place of the takeovers' share is in use.
    Takeover,
}

impl ReadRefusal {
    /// Every bound, in the order of the metric's label values.
    pub const ALL: [ReadRefusal; 4] = [
        ReadRefusal::Key,
        ReadRefusal::Principal,
        ReadRefusal::Total,
        ReadRefusal::Takeover,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            ReadRefusal::Key => "key",
            ReadRefusal::Principal => "principal",
            ReadRefusal::Total => "total",
            ReadRefusal::Takeover => "takeover",
        }
    }
}

/// The readers in flight (R-LIM-6). See the module docs.
#[derive(Debug, Clone)]
pub struct StoreReads {
    limits: ReadLimits,
    total: usize,
    /// Readers in flight by principal; a principal with none has no entry
    /// (so the map holds at most `total` entries).
    principals: BTreeMap<String, usize>,
    /// Readers in flight by (principal, key id); none, no entry.
    keys: BTreeMap<(String, String), usize>,
    /// Takeover readers in flight (their own share).
    takeovers: usize,
}

impl StoreReads {
    /// No reader in flight, under `limits` (validated by the caller).
    pub fn new(limits: ReadLimits) -> Self {
        StoreReads {
            limits,
            total: 0,
            principals: BTreeMap::new(),
            keys: BTreeMap::new(),
            takeovers: 0,
        }
    }

    /// The bounds.
    pub fn limits(&self) -> ReadLimits {
        self.limits
    }

    /// May a reader of `principal`'s key `key` start? Counted when it may.
    pub fn begin(&mut self, principal: &str, key: &str) -> Result<(), ReadRefusal> {
        let of_principal = self.of_principal(principal);
        let of_key = self
            .keys
            .get(&(principal.to_owned(), key.to_owned()))
            .copied()
            .unwrap_or(0);
        if of_key >= self.limits.per_key {
            return Err(ReadRefusal::Key);
        }
        if of_principal >= self.limits.per_principal {
            return Err(ReadRefusal::Principal);
        }
        // The last `per_principal` places are for principals reading
        // nothing yet.
        let open = if of_principal == 0 {
            self.limits.total
        } else {
            self.limits.total - self.limits.per_principal
        };
        if self.total >= open {
            return Err(ReadRefusal::Total);
        }
        self.total += 1;
        *self.principals.entry(principal.to_owned()).or_insert(0) += 1;
        *self
            .keys
            .entry((principal.to_owned(), key.to_owned()))
            .or_insert(0) += 1;
        Ok(())
    }

    /// A reader [`StoreReads::begin`] let start is done. One that was
    /// never begun changes nothing.
    pub fn end(&mut self, principal: &str, key: &str) {
        let key = (principal.to_owned(), key.to_owned());
        let Some(of_key) = self.keys.get_mut(&key) else {
            return;
        };
        *of_key -= 1;
        if *of_key == 0 {
            self.keys.remove(&key);
        }
        if let Some(of_principal) = self.principals.get_mut(principal) {
            *of_principal -= 1;
            if *of_principal == 0 {
                self.principals.remove(principal);
            }
        }
        self.total = self.total.saturating_sub(1);
    }

    /// May a takeover's reader start (the Edge's own reads of a record it
    /// adopts or continues, or of its scans)? Counted when it may, in the
    /// takeovers' own [`TAKEOVER_READS_IN_FLIGHT`] places: never refused
    /// for the clients' reads, and never taking their places.
    pub fn begin_takeover(&mut self) -> Result<(), ReadRefusal> {
        if self.takeovers >= TAKEOVER_READS_IN_FLIGHT {
            return Err(ReadRefusal::Takeover);
        }
        self.takeovers += 1;
        Ok(())
    }

    /// A takeover's reader [`StoreReads::begin_takeover`] let start is
    /// done.
    pub fn end_takeover(&mut self) {
        self.takeovers = self.takeovers.saturating_sub(1);
    }

    /// Takeover readers in flight.
    pub fn takeovers_in_flight(&self) -> usize {
        self.takeovers
    }

    /// Readers in flight across every principal.
    pub fn in_flight(&self) -> usize {
        self.total
    }

    /// Readers in flight of `principal`.
    pub fn of_principal(&self, principal: &str) -> usize {
        self.principals.get(principal).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_principal: usize, per_key: usize) -> ReadLimits {
        ReadLimits {
            total,
            per_principal,
            per_key,
        }
    }

    #[test]
    fn r_lim_6_a_key_and_a_principal_read_within_their_bounds() {
        let mut reads = StoreReads::new(limits(100, 6, 4));
        for _ in 0..4 {
            assert_eq!(reads.begin("p", "k1"), Ok(()));
        }
        assert_eq!(reads.begin("p", "k1"), Err(ReadRefusal::Key));
        // Another key of the same principal, up to the principal's bound.
        assert_eq!(reads.begin("p", "k2"), Ok(()));
        assert_eq!(reads.begin("p", "k2"), Ok(()));
        assert_eq!(reads.begin("p", "k2"), Err(ReadRefusal::Principal));
        // Another principal is not touched by either.
        assert_eq!(reads.begin("q", "k1"), Ok(()));
        assert_eq!(reads.of_principal("p"), 6);
        assert_eq!(reads.in_flight(), 7);
        // One done, one more of that key.
        reads.end("p", "k1");
        assert_eq!(reads.begin("p", "k1"), Ok(()));
    }

    #[test]
    fn r_lim_6_the_last_places_are_kept_for_a_principal_reading_nothing() {
        // 10 places, 4 kept: busy principals share the first 6.
        let mut reads = StoreReads::new(limits(10, 4, 4));
        for p in ["a", "a", "a", "a", "b", "b"] {
            assert_eq!(reads.begin(p, "k"), Ok(()));
        }
        assert_eq!(reads.begin("b", "k"), Err(ReadRefusal::Total));
        // Principals reading nothing take the kept places, one each.
        for p in ["c", "d", "e", "f"] {
            assert_eq!(reads.begin(p, "k"), Ok(()));
            assert_eq!(reads.begin(p, "k"), Err(ReadRefusal::Total), "{p}");
        }
        assert_eq!(reads.in_flight(), 10);
        assert_eq!(reads.begin("g", "k"), Err(ReadRefusal::Total));
        for p in ["c", "d", "e", "f"] {
            reads.end(p, "k");
        }
        assert_eq!(reads.begin("g", "k"), Ok(()));
    }

    #[test]
    fn r_lim_6_takeover_reads_have_a_share_of_their_own() {
        let mut reads = StoreReads::new(limits(10, 4, 4));
        // Clients read all they may: a takeover still reads.
        for p in ["a", "a", "a", "a", "b", "b", "c", "d", "e", "f"] {
            assert_eq!(reads.begin(p, "k"), Ok(()));
        }
        assert_eq!(reads.begin("g", "k"), Err(ReadRefusal::Total));
        for _ in 0..TAKEOVER_READS_IN_FLIGHT {
            assert_eq!(reads.begin_takeover(), Ok(()));
        }
        // Takeovers read all they may: refused past their share, and they
        // took no client's place.
        assert_eq!(reads.begin_takeover(), Err(ReadRefusal::Takeover));
        assert_eq!(reads.takeovers_in_flight(), TAKEOVER_READS_IN_FLIGHT);
        assert_eq!(reads.in_flight(), 10, "the clients' count is theirs");
        reads.end("c", "k");
        assert_eq!(reads.begin("g", "k"), Ok(()), "a client's place");
        reads.end_takeover();
        assert_eq!(reads.begin_takeover(), Ok(()));
        // Not counted against any principal: a principal at its bound
        // does not hold up a takeover of its records, nor the reverse.
        assert_eq!(reads.of_principal("a"), 4);
        for _ in 0..TAKEOVER_READS_IN_FLIGHT {
            reads.end_takeover();
        }
        reads.end_takeover();
        assert_eq!(reads.takeovers_in_flight(), 0, "never below nothing");
    }

    #[test]
    fn r_lim_6_ending_what_was_never_begun_changes_nothing() {
        let mut reads = StoreReads::new(limits(10, 2, 1));
        reads.end("p", "k");
        assert_eq!(reads.in_flight(), 0);
        assert_eq!(reads.begin("p", "k"), Ok(()));
        reads.end("p", "k");
        reads.end("p", "k");
        assert_eq!(reads.in_flight(), 0);
        assert_eq!(reads.of_principal("p"), 0);
        assert!(reads.principals.is_empty() && reads.keys.is_empty());
    }

    #[test]
    fn r_lim_6_read_limits_are_validated() {
        assert_eq!(ReadLimits::default().validate(), Ok(()));
        assert_eq!(
            limits(10, 10, 1).validate(),
            Err(ReadLimitsError::PerPrincipal(9))
        );
        assert_eq!(
            limits(10, 0, 1).validate(),
            Err(ReadLimitsError::PerPrincipal(9))
        );
        assert_eq!(limits(10, 4, 5).validate(), Err(ReadLimitsError::PerKey(4)));
        assert_eq!(limits(10, 4, 0).validate(), Err(ReadLimitsError::PerKey(4)));
        assert_eq!(
            limits(MAX_READS_IN_FLIGHT + 1, 4, 4).validate(),
            Err(ReadLimitsError::Total)
        );
    }

    proptest::proptest! {
        /// Whatever readers start and end, no bound is ever passed, a
        /// principal reading nothing is refused only when every place is
        /// in use, and takeovers and clients never take each other's
        /// places.
        #[test]
        fn r_lim_6_no_bound_is_ever_passed(
            steps in proptest::collection::vec((0u8..5, 0u8..3, proptest::bool::ANY), 0..400)
        ) {
            let l = limits(12, 5, 3);
            let mut reads = StoreReads::new(l);
            let mut held: Vec<(String, String)> = Vec::new();
            let mut takeovers = 0;
            for (p, k, start) in steps {
                // Principal 4's steps are a takeover's reads.
                if p == 4 {
                    if start {
                        match reads.begin_takeover() {
                            Ok(()) => takeovers += 1,
                            Err(refusal) => {
                                proptest::prop_assert_eq!(refusal, ReadRefusal::Takeover);
                                proptest::prop_assert_eq!(takeovers, TAKEOVER_READS_IN_FLIGHT);
                            }
                        }
                    } else if takeovers > 0 {
                        takeovers -= 1;
                        reads.end_takeover();
                    }
                    proptest::prop_assert_eq!(reads.takeovers_in_flight(), takeovers);
                    proptest::prop_assert_eq!(reads.in_flight(), held.len());
                    continue;
                }
                let (p, k) = (format!("p{p}"), format!("k{k}"));
                if start {
                    let idle = reads.of_principal(&p) == 0;
                    let before = reads.in_flight();
                    match reads.begin(&p, &k) {
                        Ok(()) => held.push((p.clone(), k.clone())),
                        Err(ReadRefusal::Total) if idle => {
                            proptest::prop_assert_eq!(before, l.total);
                        }
                        Err(_) => {}
                    }
                } else if let Some(i) = held.iter().position(|h| h.0 == p) {
                    let (p, k) = held.swap_remove(i);
                    reads.end(&p, &k);
                }
                proptest::prop_assert!(reads.in_flight() <= l.total);
                proptest::prop_assert_eq!(reads.in_flight(), held.len());
                for (p, k) in &held {
                    proptest::prop_assert!(reads.of_principal(p) <= l.per_principal);
                    let of_key = held.iter().filter(|h| &h.0 == p && &h.1 == k).count();
                    proptest::prop_assert!(of_key <= l.per_key);
                }
            }
        }
    }
}
