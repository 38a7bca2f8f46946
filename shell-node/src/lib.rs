//! # iop-node
//!
//! The Node agent: dials out to the Edge over QUIC with mutual TLS,
//! registers its providers, completes readiness, keeps the connection live
//! with heartbeats, and executes normalized runs and raw provider tunnels
//! under the core's stall watchdog.

pub mod adapter;
pub mod config;
pub mod control;
pub mod error;
pub mod link;
pub mod metrics;
pub mod mock;
pub mod parking;
pub mod run;
pub mod state;
pub mod supervisor;

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::adapter::Adapter;
use crate::config::NodeConfig;
use crate::state::LinkShared;

/// A running node (the supervisor task and its shared state).
pub struct RunningNode {
    shutdown: watch::Sender<bool>,
    shared: Arc<LinkShared>,
    /// `None` once [`RunningNode::stopped`] has seen the task end.
    task: Option<JoinHandle<Result<(), error::StartError>>>,
}

/// Process options that are not configuration.
#[derive(Debug, Clone, Default)]
pub struct NodeOptions {
    /// Record each connection's machine inputs and outputs to
    /// `<path>.<n>` (iop-trace), and each machine of `trace_machines` to a
    /// file named after it.
    pub record_trace: Option<std::path::PathBuf>,
    /// The machines recorded with `record_trace` (empty: the connections
    /// alone). A connection's trace is `<path>.<n>`; each other machine's
    /// (`node-run`) is `<path>.<kind>.<n>`.
    pub trace_machines: Vec<iop_trace::MachineKind>,
}

impl RunningNode {
    /// Start the supervisor: it dials the Edge and keeps reconnecting.
    pub fn start(config: NodeConfig) -> Self {
        Self::start_with(config, NodeOptions::default())
    }

    /// Start with process options.
    pub fn start_with(config: NodeConfig, options: NodeOptions) -> Self {
        // Tunnels pass redirects through as they are; runs have no overall
        // timeout on purpose: the stall watchdog bounds them.
        let http = adapter::ProviderHttp::new();
        let adapters = config
            .providers
            .iter()
            .map(|p| Adapter::new(p, http.clone()))
            .collect();
        // One run count over every Edge connection (R-MULTI-1).
        let capacity = config.providers.iter().fold(
            iop_core::node::capacity::NodeCapacity::new(config.node.max_concurrent_runs as usize),
            |c, p| match p.max_concurrent_runs {
                Some(cap) => c.with_target_cap(p.adapter, &p.target, cap as usize),
                None => c,
            },
        );
        let mut shared = LinkShared::new(
            adapters,
            config.watchdog.probe_bound,
            &config.edges,
            capacity,
        );
        shared.traces = match options.record_trace {
            Some(base) if options.trace_machines.is_empty() => {
                iop_trace::TraceFiles::new(base, [iop_trace::MachineKind::NodeLink])
            }
            Some(base) => iop_trace::TraceFiles::new(base, options.trace_machines),
            None => iop_trace::TraceFiles::off(),
        };
        shared.park_buffer_bytes = config.node.park_buffer_bytes;
        // The lease recipient key and this node's id (R-CRED-1): a node
        // that cannot load them does not start.
        // The optional metrics address is bound now, so a taken port fails
        // the start instead of leaving a node without its metrics.
        let metrics_listener = config
            .node
            .metrics_listen
            .map(|addr| {
                std::net::TcpListener::bind(addr)
                    .and_then(|l| l.set_nonblocking(true).map(|()| l))
                    .and_then(tokio::net::TcpListener::from_std)
                    .map_err(|source| error::StartError::MetricsListen { addr, source })
            })
            .transpose();
        let identity = metrics_listener.and_then(|listener| {
            state::NodeIdentity::load(&config).map(|identity| (identity, listener))
        });
        let identity = identity.and_then(|(identity, listener)| {
            // The metrics pipeline is named after the node (OTLP resource).
            shared.metrics = metrics::NodeMetrics::with_traces(
                iop_transport::telemetry::MetricsPipeline::new(
                    "iop-node",
                    &identity.node_id,
                    config.otlp.as_ref(),
                )?,
                iop_transport::traces::TracePipeline::new(
                    "iop-node",
                    &identity.node_id,
                    config.otlp_traces.as_ref(),
                )?,
            );
            Ok((identity, listener))
        });
        let metrics_listener = match identity {
            Ok((identity, listener)) => {
                shared.identity = Some(identity);
                listener
            }
            Err(e) => {
                let (shutdown, _) = watch::channel(false);
                let shared = Arc::new(shared);
                return Self {
                    shutdown,
                    shared,
                    task: Some(tokio::spawn(async move { Err(e) })),
                };
            }
        };
        let shared = Arc::new(shared);
        LinkShared::observe_metrics(&shared);
        let (shutdown, rx) = watch::channel(false);
        if let Some(listener) = metrics_listener {
            let shared = shared.clone();
            let mut stop = rx.clone();
            tokio::spawn(async move {
                let ready = shared.clone();
                let app = axum::Router::new()
                    .route(
                        "/metrics",
                        axum::routing::get(move || {
                            let shared = shared.clone();
                            async move { shared.metrics.render() }
                        }),
                    )
                    // Liveness: the process serves. Readiness: at least one
                    // Edge connection is ready (container and Kubernetes
                    // probes, `iop-node health`).
                    .route("/healthz", axum::routing::get(|| async { "ok" }))
                    .route(
                        "/readyz",
                        axum::routing::get(move || {
                            let any_ready =
                                ready.edges.iter().any(|e| e.ready_generation().is_some());
                            async move {
                                if any_ready {
                                    (http::StatusCode::OK, "ready")
                                } else {
                                    (
                                        http::StatusCode::SERVICE_UNAVAILABLE,
                                        "no Edge connection is ready",
                                    )
                                }
                            }
                        }),
                    );
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stop.changed().await;
                    })
                    .await;
            });
        }
        let task = tokio::spawn(supervisor::run(Arc::new(config), shared.clone(), rx));
        Self {
            shutdown,
            shared,
            task: Some(task),
        }
    }

    /// Test hook: stop (or resume) reading the control stream and answering
    /// heartbeats, while the connection stays up.
    pub fn pause_control(&self, paused: bool) {
        self.shared.pause_control.send_replace(paused);
    }

    /// The generation of the current connection to the first configured
    /// Edge, once ready.
    pub fn generation(&self) -> Option<u64> {
        self.shared.edges.first().and_then(|e| e.ready_generation())
    }

    /// Each configured Edge's current generation, once ready, in
    /// configuration order (R-MULTI-1).
    pub fn generations(&self) -> Vec<Option<u64>> {
        self.shared
            .edges
            .iter()
            .map(state::EdgeSlot::ready_generation)
            .collect()
    }

    /// Shared counters (fenced late outputs, stalls, disconnect cancels).
    pub fn shared(&self) -> &Arc<LinkShared> {
        &self.shared
    }

    /// Resolves when the supervisor ends on its own. Before [`shutdown`]
    /// it only does so when the node cannot start (identity, recipient key,
    /// certificates, QUIC endpoint, metrics pipeline): the binary waits on
    /// this and on the shutdown signal together, so a start error ends the
    /// process instead of leaving it running idle. Cancel-safe; after it
    /// has resolved once it never resolves again.
    ///
    /// [`shutdown`]: RunningNode::shutdown
    pub async fn stopped(&mut self) -> Result<(), error::StartError> {
        let Some(task) = self.task.as_mut() else {
            return std::future::pending().await;
        };
        let result = task.await;
        self.task = None;
        result.unwrap_or(Ok(()))
    }

    /// Close the connection with `shutdown`, stop, and push the final
    /// metrics to the OTLP collector when one is configured.
    pub async fn shutdown(self) -> Result<(), error::StartError> {
        self.shutdown.send_replace(true);
        let result = match self.task {
            Some(task) => task.await.unwrap_or(Ok(())),
            None => Ok(()),
        };
        let shared = self.shared;
        let _ = tokio::task::spawn_blocking(move || shared.metrics.shutdown()).await;
        result
    }

    /// Stop without a goodbye (as a crash would): the task is aborted.
    pub fn abort(self) {
        if let Some(task) = self.task {
            task.abort();
        }
    }
}
