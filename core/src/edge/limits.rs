//! The limits every client of the Edge lives under (SPEC §7): its
//! connections (R-LIM-1) and its request bodies (R-LIM-2). The rules are
//! decided here; the Edge's HTTP shell accepts sockets, runs hyper, holds
//! the registry under its lock, keeps the timers and semaphores, and
//! carries out what these types answer.
//!
//! ## Connections (R-LIM-1)
//!
//! [`Connections`] holds every open client connection, oldest first, with
//! the requests it has in flight.
//!
//! * **Admission.** A connection is admitted or refused the moment it is
//!   accepted ([`Connections::admit`]); nothing waits in a backlog. Past
//!   [`ConnLimits::max_connections`], or past its source address's share
//!   ([`ConnLimits::max_connections_per_source`]), an idle connection is
//!   evicted to make room: the oldest one that never sent a request, else
//!   the oldest idle keep-alive one (of the same source when the share is
//!   what is reached). When every candidate is busy the newcomer is
//!   refused. An evicted connection no longer counts against either bound.
//! * **Idleness.** With no request in flight a connection is closed
//!   [`ConnLimits::first_request_timeout`] after it was accepted if it has
//!   never started a request (first byte, protocol detection and headers
//!   alike), else [`ConnLimits::idle_timeout`] after its last request
//!   ended.
//! * **Age.** At [`ConnLimits::max_age`] a connection drains (takes no new
//!   request; HTTP/1 closes after the current response, HTTP/2 sends
//!   GOAWAY) and at `max_age + age_grace` it is closed whatever it is
//!   doing.
//! * **Eviction.** An evicted connection that is idle when its task hears
//!   of it closes; one a request started on meanwhile drains instead.
//!
//! The registry is shared by every connection's task, so it has a plain
//! decision API rather than an output queue. The driver:
//!
//! 1. On accept, [`Connections::admit`]; on [`ConnAdmission::Refused`]
//!    answer `503` and close; on [`ConnAdmission::Admitted`] start the
//!    connection's task and tell the evicted connection's task, if any.
//! 2. When a request starts, [`Connections::request_started`]; when its
//!    response has been sent or abandoned, [`Connections::request_ended`];
//!    either way wake the connection's task, since its deadline moved.
//! 3. The task sleeps until [`Connections::poll_timeout`], then calls
//!    [`Connections::handle_timeout`]; told it was evicted,
//!    [`Connections::handle_eviction`]; at shutdown,
//!    [`Connections::handle_stop`]. It carries out the [`ConnStep`]
//!    answered and goes back to sleep.
//! 4. When the connection is gone, for whatever reason,
//!    [`Connections::closed`].
//!
//! ## Request bodies (R-LIM-2)
//!
//! [`BodyRule`] says how much of the request memory budgets a body takes
//! at each point of its read, accounted as decoded, not as wire bytes: a
//! declared `Content-Length` over the limit is refused before a byte is
//! read; before and while reading a body is accounted at
//! [`DECODED_BYTES_PER_BODY_BYTE`] per byte; once read, at what its decoded
//! JSON tree will take plus the body itself, refused when that is more
//! than the largest body may take; once parsed, at
//! [`KEPT_BYTES_PER_BODY_BYTE`] per byte. The shell measures the decoded
//! tree, holds the semaphores and times the read.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::time::Instant;

/// A client's source address as R-LIM-1 counts it: its 16 bytes (an IPv4
/// address in its IPv6-mapped form), a plain value the shell takes from
/// the socket, so this module needs no network type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceAddr(pub [u8; 16]);

/// The time and count limits of client connections (R-LIM-1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConnLimits {
    /// From accept to the first request started (first byte, protocol
    /// detection, headers).
    pub first_request_timeout: Duration,
    /// A connection with no request in flight, after its last one ended,
    /// is closed after this.
    pub idle_timeout: Duration,
    /// A connection stops taking requests at this age.
    pub max_age: Duration,
    /// After `max_age`, how long in-flight responses may take before the
    /// connection is closed anyway.
    pub age_grace: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one source address.
    pub max_connections_per_source: usize,
}

/// One admitted connection, unique for the registry's life; a later
/// connection has a larger id.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct ConnId(u64);

impl ConnId {
    /// The id as a number (for logs).
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

/// What the registry decided about a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnAdmission {
    /// It is open under `id`; `evict` names the idle connection closed to
    /// make room for it, whose task must be told.
    Admitted {
        /// The new connection.
        id: ConnId,
        /// The connection evicted for it, if the cap or the share was
        /// reached.
        evict: Option<ConnId>,
    },
    /// Every connection it could displace is busy: answer `503` and close.
    Refused(RefusedBy),
}

/// Which limit refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusedBy {
    /// Its source held its share (`max_connections_per_source`), all busy.
    SourceShare,
    /// The Edge held `max_connections`, all busy.
    Cap,
}

impl RefusedBy {
    /// Every reason, for declaring metric series.
    pub const ALL: [RefusedBy; 2] = [RefusedBy::SourceShare, RefusedBy::Cap];

    /// Its metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusedBy::SourceShare => "source_share",
            RefusedBy::Cap => "cap",
        }
    }
}

/// Why a connection is closed by the rules (a closed log label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloseReason {
    /// Idle past its first-request or idle timeout.
    Idle,
    /// Evicted to make room for a newcomer while idle.
    Evicted,
    /// Past `max_age + age_grace`.
    MaxAge,
}

impl CloseReason {
    /// The stable lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::Idle => "idle",
            CloseReason::Evicted => "evicted",
            CloseReason::MaxAge => "max_age",
        }
    }
}

/// What a connection's task does now.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnStep {
    /// Nothing; sleep until the next [`Connections::poll_timeout`].
    Wait,
    /// Stop taking requests and let the ones in flight finish (HTTP/1:
    /// close after the current response; HTTP/2: GOAWAY). Answered once
    /// per connection.
    Drain,
    /// Close the connection now.
    Close(CloseReason),
}

/// One open connection.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Conn {
    source: SourceAddr,
    accepted_at: Instant,
    /// Requests whose response has not finished.
    in_flight: usize,
    /// Some request started on it.
    served: bool,
    /// When it last became idle: accepted, or its last request ended.
    idle_since: Instant,
    /// Chosen to make room for a newcomer: no longer counted.
    evicted: bool,
    /// Taking no new requests; closed at `max_age + age_grace`.
    draining: bool,
}

impl Conn {
    fn is_idle(&self) -> bool {
        self.in_flight == 0
    }

    /// When an idle connection is closed for idleness.
    fn idle_deadline(&self, limits: &ConnLimits) -> Instant {
        if self.served {
            self.idle_since + limits.idle_timeout
        } else {
            self.idle_since + limits.first_request_timeout
        }
    }

    /// When it starts draining.
    fn age_deadline(&self, limits: &ConnLimits) -> Instant {
        self.accepted_at + limits.max_age
    }

    /// When it is closed whatever it is doing.
    fn close_deadline(&self, limits: &ConnLimits) -> Instant {
        self.age_deadline(limits) + limits.age_grace
    }

    /// The next moment a rule may act: the idle deadline while nothing is
    /// in flight, the age deadline always, only the hard close once
    /// draining.
    fn deadline(&self, limits: &ConnLimits) -> Instant {
        if self.draining {
            self.close_deadline(limits)
        } else if self.is_idle() {
            self.idle_deadline(limits).min(self.age_deadline(limits))
        } else {
            self.age_deadline(limits)
        }
    }
}

/// The open client connections and the rules they live under (R-LIM-1;
/// see the module docs for the driver).
#[derive(Debug, Clone)]
pub struct Connections {
    limits: ConnLimits,
    /// Every open connection, evicted ones included until they close;
    /// oldest first.
    conns: BTreeMap<ConnId, Conn>,
    /// Connections counted against the cap: open and not evicted.
    counted: usize,
    /// Counted connections per source address; no zero entries.
    per_source: HashMap<SourceAddr, usize>,
    next_id: u64,
}

impl Connections {
    /// An empty registry under `limits`.
    pub fn new(limits: ConnLimits) -> Self {
        Self {
            limits,
            conns: BTreeMap::new(),
            counted: 0,
            per_source: HashMap::new(),
            next_id: 0,
        }
    }

    /// The limits it applies.
    pub fn limits(&self) -> &ConnLimits {
        &self.limits
    }

    /// Admit a connection from `source` accepted at `now`, evicting an
    /// idle one to make room when the cap or the source's share is
    /// reached; refused when every candidate is busy (R-LIM-1).
    pub fn admit(&mut self, source: SourceAddr, now: Instant) -> ConnAdmission {
        let held = self.per_source.get(&source).copied().unwrap_or(0);
        let evict = if held >= self.limits.max_connections_per_source {
            // Over its share, a source displaces only its own.
            match self.idle_victim(Some(source)) {
                Some(victim) => Some(victim),
                None => return ConnAdmission::Refused(RefusedBy::SourceShare),
            }
        } else if self.counted >= self.limits.max_connections {
            match self.idle_victim(None) {
                Some(victim) => Some(victim),
                None => return ConnAdmission::Refused(RefusedBy::Cap),
            }
        } else {
            None
        };
        if let Some(victim) = evict {
            self.evict(victim);
        }
        let id = ConnId(self.next_id);
        self.next_id += 1;
        self.conns.insert(
            id,
            Conn {
                source,
                accepted_at: now,
                in_flight: 0,
                served: false,
                idle_since: now,
                evicted: false,
                draining: false,
            },
        );
        self.counted += 1;
        *self.per_source.entry(source).or_insert(0) += 1;
        debug_assert!(self.counted <= self.limits.max_connections);
        ConnAdmission::Admitted { id, evict }
    }

    /// The connection to evict for a newcomer: the oldest idle one that
    /// never sent a request, else the oldest idle keep-alive one (from
    /// `source` only, when given). Never a busy or an already evicted one.
    fn idle_victim(&self, source: Option<SourceAddr>) -> Option<ConnId> {
        let candidates = || {
            self.conns.iter().filter(move |(_, c)| {
                !c.evicted && c.is_idle() && source.is_none_or(|s| c.source == s)
            })
        };
        candidates()
            .find(|(_, c)| !c.served)
            .or_else(|| candidates().next())
            .map(|(id, _)| *id)
    }

    /// Stop counting `id`; it stays open until its task closes it.
    fn evict(&mut self, id: ConnId) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if conn.evicted {
            return;
        }
        conn.evicted = true;
        let source = conn.source;
        self.uncount(source);
    }

    fn uncount(&mut self, source: SourceAddr) {
        self.counted = self.counted.saturating_sub(1);
        if let Some(n) = self.per_source.get_mut(&source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_source.remove(&source);
            }
        }
    }

    /// A request started on `id`: it is busy, and has been served. An id
    /// not open is ignored.
    pub fn request_started(&mut self, id: ConnId) {
        if let Some(conn) = self.conns.get_mut(&id) {
            conn.in_flight = conn.in_flight.saturating_add(1);
            conn.served = true;
        }
    }

    /// A request on `id` ended at `now` (its response sent or abandoned):
    /// the idle clock restarts from here. An id not open is ignored.
    pub fn request_ended(&mut self, id: ConnId, now: Instant) {
        if let Some(conn) = self.conns.get_mut(&id) {
            debug_assert!(conn.in_flight > 0, "a request ended that never started");
            conn.in_flight = conn.in_flight.saturating_sub(1);
            conn.idle_since = now;
        }
    }

    /// `id` is gone: forget it and free its place.
    pub fn closed(&mut self, id: ConnId) {
        if let Some(conn) = self.conns.remove(&id)
            && !conn.evicted
        {
            self.uncount(conn.source);
        }
    }

    /// When `id`'s task must call [`Connections::handle_timeout`] next;
    /// `None` for an id not open.
    pub fn poll_timeout(&self, id: ConnId) -> Option<Instant> {
        self.conns.get(&id).map(|c| c.deadline(&self.limits))
    }

    /// `id` is draining: it takes no new request (its task stops watching
    /// for shutdown).
    pub fn is_draining(&self, id: ConnId) -> bool {
        self.conns.get(&id).is_some_and(|c| c.draining)
    }

    /// The moment from [`Connections::poll_timeout`] may have passed: close
    /// an idle connection past its idle deadline, drain one at its age,
    /// close a draining one at its age plus grace. Early calls answer
    /// [`ConnStep::Wait`].
    pub fn handle_timeout(&mut self, id: ConnId, now: Instant) -> ConnStep {
        let limits = self.limits;
        let Some(conn) = self.conns.get_mut(&id) else {
            return ConnStep::Wait;
        };
        if conn.draining {
            if now >= conn.close_deadline(&limits) {
                return ConnStep::Close(CloseReason::MaxAge);
            }
        } else if now >= conn.age_deadline(&limits) {
            conn.draining = true;
            return ConnStep::Drain;
        } else if conn.is_idle() && now >= conn.idle_deadline(&limits) {
            return ConnStep::Close(CloseReason::Idle);
        }
        ConnStep::Wait
    }

    /// `id`'s task heard it was evicted: an idle connection closes; one a
    /// request started on since it was chosen drains, so the request
    /// finishes.
    pub fn handle_eviction(&mut self, id: ConnId) -> ConnStep {
        let Some(conn) = self.conns.get_mut(&id) else {
            return ConnStep::Wait;
        };
        if !conn.evicted {
            return ConnStep::Wait;
        }
        if conn.is_idle() {
            ConnStep::Close(CloseReason::Evicted)
        } else if conn.draining {
            ConnStep::Wait
        } else {
            conn.draining = true;
            ConnStep::Drain
        }
    }

    /// The server is shutting down: `id` drains, unless it already does.
    pub fn handle_stop(&mut self, id: ConnId) -> ConnStep {
        match self.conns.get_mut(&id) {
            Some(conn) if !conn.draining => {
                conn.draining = true;
                ConnStep::Drain
            }
            _ => ConnStep::Wait,
        }
    }
}

/// Bytes of memory a request body is accounted as before and while it is
/// read, per byte of body; also the most one body may take decoded, per
/// byte of the largest body (R-LIM-2).
pub const DECODED_BYTES_PER_BODY_BYTE: usize = 16;

/// Bytes a parsed request keeps accounted per body byte: the body (kept
/// for a tunnel) and the run parsed from it (R-LIM-2).
pub const KEPT_BYTES_PER_BODY_BYTE: usize = 2;

/// Why a body is refused by the rules (the shell adds its own reasons:
/// no room in the budgets, a timeout, a client that left).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum BodyRefusal {
    /// Larger than `max_body_bytes`, declared or sent: the client's fault.
    #[error("request body larger than {limit_bytes} bytes")]
    TooLarge {
        /// The per-body limit.
        limit_bytes: usize,
    },
    /// Its decoded form would take more than a body of the largest size
    /// may: small nested values in bulk.
    #[error("request body decodes to {decoded_bytes} bytes, over {limit_bytes}")]
    TooComplex {
        /// What the body and its decoded tree would take.
        decoded_bytes: usize,
        /// The most one body may take decoded.
        limit_bytes: usize,
    },
}

/// How much of the request memory budgets one body takes at each point of
/// its read (R-LIM-2; see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BodyRule {
    /// The largest body, in wire bytes.
    pub max_body_bytes: usize,
}

impl BodyRule {
    /// Bodies of at most `max_body_bytes`.
    pub const fn new(max_body_bytes: usize) -> Self {
        Self { max_body_bytes }
    }

    /// The most one body may take decoded: the largest body at
    /// [`DECODED_BYTES_PER_BODY_BYTE`].
    pub fn most_decoded_bytes(&self) -> usize {
        self.max_body_bytes
            .saturating_mul(DECODED_BYTES_PER_BODY_BYTE)
    }

    /// Before a byte is read: refused when the declared `Content-Length`
    /// is over the limit, else the bytes to take from the budgets now
    /// (none when no length is declared).
    pub fn before_read(&self, declared: Option<u64>) -> Result<usize, BodyRefusal> {
        match declared {
            None => Ok(0),
            Some(n) => match usize::try_from(n) {
                Ok(n) if n <= self.max_body_bytes => {
                    Ok(n.saturating_mul(DECODED_BYTES_PER_BODY_BYTE))
                }
                _ => Err(BodyRefusal::TooLarge {
                    limit_bytes: self.max_body_bytes,
                }),
            },
        }
    }

    /// While reading: the bytes the body must hold once `received` bytes
    /// of it have arrived. (More than `max_body_bytes` arriving is
    /// [`BodyRefusal::TooLarge`]; the shell's length limit stops the read.)
    pub fn while_reading(&self, received: usize) -> usize {
        received.saturating_mul(DECODED_BYTES_PER_BODY_BYTE)
    }

    /// Once read whole: the bytes the body holds until it is parsed, its
    /// decoded tree plus itself (`decoded_tree` is `None` when it is not
    /// JSON: the parser will refuse it, until then it stays accounted as
    /// read); refused when that is more than [`BodyRule::most_decoded_bytes`].
    pub fn once_read(&self, len: usize, decoded_tree: Option<usize>) -> Result<usize, BodyRefusal> {
        let needed = match decoded_tree {
            Some(tree) => tree.saturating_add(len),
            None => len.saturating_mul(DECODED_BYTES_PER_BODY_BYTE),
        };
        let most = self.most_decoded_bytes();
        if needed > most {
            return Err(BodyRefusal::TooComplex {
                decoded_bytes: needed,
                limit_bytes: most,
            });
        }
        Ok(needed)
    }
}

/// Once parsed, the bytes a request keeps of a body of `len` bytes: the
/// body and the run parsed from it, [`KEPT_BYTES_PER_BODY_BYTE`] per byte.
pub fn kept_bytes(len: usize) -> usize {
    len.saturating_mul(KEPT_BYTES_PER_BODY_BYTE)
}

#[cfg(test)]
mod tests;
