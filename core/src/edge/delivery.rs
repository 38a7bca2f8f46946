//! What one client request's HTTP response receives, in order: the commit
//! of its head (R-GATE-2), events or tunnelled bytes, and one end (R-GATE-3).
//! The request machine ([`crate::edge::request::Request`]) produces it; a
//! durable response journals it as it is (R-JRN-1,
//! [`crate::edge::durable`]) so a resumed or adopted stream replays the
//! same deliveries.

use iop_wire::{ExecutionFailure, FailureCode, Header, RunEventKind};

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
        /// What the provider said, when the request ended on a provider's
        /// error ([`GateFailure::Attempt`] of
        /// [`FailureCode::ProviderError`]) and it said something.
        #[serde(default)]
        provider: Option<ProviderSaid>,
    },
}

/// What a provider said when it failed the attempt that ended a request:
/// its HTTP status and its own message, sanitized and bounded by the Node
/// ([`iop_wire::provider_message`]). The client is told both (R-GATE-3).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProviderSaid {
    /// The provider's HTTP status, if it answered one.
    pub http_status: Option<u16>,
    /// The provider's own error message, if it gave one.
    pub message: Option<String>,
}

/// Whose fault a provider's failure is, by what the provider said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderFault {
    /// The provider found the request itself invalid (HTTP 400, 413 or
    /// 422): the client's to fix, a 4xx in every API.
    InvalidRequest,
    /// The provider is rate limiting (HTTP 429): the client may retry later.
    RateLimited,
    /// The provider's (or the gateway's) own failure: 401/403 are the
    /// gateway's credential, 404 its routing, 5xx the provider's.
    Provider,
}

impl ProviderSaid {
    /// What `failure` says the provider said: `Some` for a provider's
    /// error that carries a status or a message.
    pub fn of(failure: &ExecutionFailure) -> Option<Self> {
        let said = Self {
            http_status: failure.http_status,
            message: failure.provider_message.clone(),
        };
        (failure.code == FailureCode::ProviderError && said != Self::default()).then_some(said)
    }

    /// Whose fault the failure is.
    pub fn fault(&self) -> ProviderFault {
        match self.http_status {
            Some(400 | 413 | 422) => ProviderFault::InvalidRequest,
            Some(429) => ProviderFault::RateLimited,
            _ => ProviderFault::Provider,
        }
    }
}
