//! What one client request's HTTP response receives, in order: the commit
//! of its head (R-GATE-2), events or tunnelled bytes, and one end (R-GATE-3).
//! The request machine ([`crate::edge::request::Request`]) produces it; a
//! durable response journals it as it is (R-JRN-1,
//! [`crate::edge::durable`]) so a resumed or adopted stream replays the
//! same deliveries.

use iop_wire::{Header, RunEventKind};

use crate::edge::gate::GateFailure;

/// What the HTTP response receives, in order.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// Send the response head now (R-GATE-2: the first content arrived, or
    /// the answer completed without any). A tunnel's own status and headers
    /// ride along.
    Commit {
        /// `Some` for a tunnelled response.
        tunnel_head: Option<(u16, Vec<Header>)>,
    },
    /// A normalized event.
    Event(RunEventKind),
    /// Tunnelled body bytes.
    Body(Vec<u8>),
    /// Normal end.
    Finish,
    /// The one error terminal (R-GATE-3): before commit as an HTTP error,
    /// after commit in the stream.
    Fail {
        /// Why.
        kind: GateFailure,
        /// After commit?
        in_stream: bool,
    },
}
