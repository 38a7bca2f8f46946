//! What every scenario shares: what it runs against ([`Gateway`]), how it
//! fails ([`ScenarioError`]) and the latency deployment other scenarios
//! reuse (its own module, so the scenarios that reuse it do not import
//! [`crate::scenario`], which reports their results).

use std::net::SocketAddr;
use std::path::Path;

use crate::deployment::{DeployError, DeploymentSpec, EdgeExtras, JournalStore, MockSpec};
use crate::journal::ScrapeError;
use crate::load::{LoadError, Target};

/// Why a scenario failed.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The deployment failed.
    #[error(transparent)]
    Deploy(#[from] DeployError),
    /// The load generator failed.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Something did not happen within its bound.
    #[error("{0}")]
    Timeout(String),
    /// The Edge's metrics could not be read.
    #[error(transparent)]
    Scrape(#[from] ScrapeError),
    /// The tail scenario's span collector could not listen.
    #[error("span collector: {0}")]
    Collector(std::io::Error),
}

/// What a scenario runs against: a [`Deployment`] of separate processes,
/// or (in tests) an Edge, a Node and a mock in the test's own process.
pub trait Gateway {
    /// Straight to mock `name`, bypassing iop (`None` if it has no own
    /// address).
    fn direct(&self, mock: &str) -> Option<Target>;
    /// Through the Edge to mock `name`, normalized or tunnelled.
    fn via(&self, mock: &str, tunnel: bool) -> Target;
    /// The Edge's client-facing address (its `/metrics` too).
    fn edge_http(&self) -> SocketAddr;
    /// CPU ticks so far of the Edge and of all node processes, when they
    /// are processes of their own.
    fn cpu_ticks(&self) -> Option<Result<(u64, u64), DeployError>>;
    /// Context switches so far of every thread of the Edge and of all
    /// node processes together, when they are processes of their own.
    fn context_switches(&self) -> Option<Result<u64, DeployError>> {
        None
    }
    /// CPU ticks so far of the journal store's own server process (the
    /// `nats` store's `nats-server`), when there is one.
    fn store_cpu_ticks(&self) -> Option<Result<u64, DeployError>> {
        None
    }
}

/// The mock script of the latency scenario: 8 tokens, as fast as possible.
pub const SHORT_MOCK: &str = "short";
/// The mock script of the streaming scenario: 1,000 tokens, as fast as
/// possible.
pub const LONG_MOCK: &str = "long";

/// The deployment of the latency and streaming scenarios: the short and
/// long mocks behind one Node.
pub fn latency_deployment(
    work: &Path,
    external_short_mock: Option<std::net::SocketAddr>,
) -> DeploymentSpec {
    DeploymentSpec {
        dir: work.join("latency"),
        mocks: vec![
            MockSpec {
                name: SHORT_MOCK.into(),
                tokens: 8,
                tps: 0.0,
                prefill_ms: 0,
                external: external_short_mock,
                nagle: false,
            },
            MockSpec {
                name: LONG_MOCK.into(),
                tokens: 1000,
                tps: 0.0,
                prefill_ms: 0,
                external: None,
                nagle: false,
            },
        ],
        nodes: 1,
        capacity: 2048,
        max_concurrent_runs: 2048,
        queue_capacity: 4096,
        journal: JournalStore::default(),
        otlp_traces: None,
        extras: EdgeExtras::default(),
        worker_threads: None,
        quic: None,
    }
}
