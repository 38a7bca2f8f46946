//! Assembling a running Edge: the QUIC listener for nodes, the hub, and
//! (from [`crate::http`]) the client-facing HTTP server.

use std::net::SocketAddr;
use std::sync::Arc;

use iop_core::edge::dispatch::DispatchConfig;
use iop_transport::{CertDenylist, ServerTls, close_connection, server_endpoint_with_denylist};
use iop_wire::CloseCode;
use tokio::task::JoinHandle;

use crate::config::EdgeConfig;
use crate::generation_store::GenerationStore;
use crate::hub::{self, HubHandle};
use crate::node_link::{self, LinkSettings};
use iop_transport::clock::{Clock, unix_ms};

/// Why the Edge could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Certificates could not be loaded.
    #[error("tls: {0}")]
    Tls(#[from] iop_transport::PkiError),
    /// The QUIC endpoint could not be created.
    #[error("quic: {0}")]
    Transport(#[from] iop_transport::TransportError),
    /// The state directory is unusable.
    #[error("state directory: {0}")]
    State(#[from] std::io::Error),
    /// The health settings are unusable.
    #[error("health config: {0}")]
    Health(#[from] iop_core::edge::health::HealthTrackerError),
    /// The metrics pipeline (Prometheus or OTLP exporter) could not be built.
    #[error("metrics: {0}")]
    Metrics(#[from] iop_transport::telemetry::TelemetryError),
    /// The journal of durable responses cannot be set up (its
    /// configuration; a store that cannot be reached is opened later,
    /// R-JRN-6).
    #[error("{0}")]
    Journal(#[from] crate::durable::OpenError),
}

/// How long a starting Edge waits for its journal store's first open
/// attempt before it serves without it (R-JRN-6).
const FIRST_OPEN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Streams a node may have open towards the Edge: its control stream, and
/// one spare for a control stream reopened while the old one closes.
const NODE_OPENED_STREAMS: u32 = 2;

/// A running Edge.
pub struct RunningEdge {
    /// Where nodes connect.
    pub quic_addr: SocketAddr,
    /// Where clients connect.
    pub http_addr: SocketAddr,
    /// Where `/metrics` is served when `[edge] metrics_listen` is set.
    pub metrics_addr: Option<SocketAddr>,
    /// The hub.
    pub hub: HubHandle,
    /// The validated configuration.
    pub config: Arc<EdgeConfig>,
    /// Metrics.
    pub metrics: Arc<crate::metrics::EdgeMetrics>,
    /// Managed credentials (signing key, profiles).
    pub creds: Arc<crate::cred::Credentials>,
    endpoint: quinn::Endpoint,
    denylist: CertDenylist,
    http_stop: tokio::sync::watch::Sender<bool>,
    accept_task: JoinHandle<()>,
    http_task: JoinHandle<()>,
    hub_task: JoinHandle<()>,
    /// Removes expired durable responses.
    sweeper: JoinHandle<()>,
    /// The ownership lease's renewal and the custody task (the takeover
    /// scan, adoptions of parked runs, continuations).
    background: Vec<JoinHandle<()>>,
    /// Tenants: their settled usage is written once more at shutdown.
    tenancy: Arc<crate::tenancy::Tenancy>,
    /// The console's live streams, ended at shutdown.
    console: Arc<crate::console_sessions::ConsoleSessions>,
    /// Durable responses: the journal store's state.
    durable: Arc<crate::durable::Durable>,
}

/// Process options that are not configuration.
#[derive(Debug, Clone, Default)]
pub struct EdgeOptions {
    /// Record every dispatcher input and output to this file (iop-trace),
    /// and each machine of `trace_machines` to a file named after it.
    pub record_trace: Option<std::path::PathBuf>,
    /// The machines recorded with `record_trace` (empty: the dispatcher
    /// alone). The dispatcher's trace is the file itself; each other
    /// machine's is `<file>.<kind>.<n>`.
    pub trace_machines: Vec<iop_trace::MachineKind>,
}

impl EdgeOptions {
    /// Which machines this process records, and where.
    pub fn trace_files(&self) -> iop_trace::TraceFiles {
        match &self.record_trace {
            Some(base) if self.trace_machines.is_empty() => {
                iop_trace::TraceFiles::new(base.clone(), [iop_trace::MachineKind::EdgeDispatch])
            }
            Some(base) => {
                iop_trace::TraceFiles::new(base.clone(), self.trace_machines.iter().copied())
            }
            None => iop_trace::TraceFiles::off(),
        }
    }
}

impl RunningEdge {
    /// Start listening for nodes.
    pub async fn start(config: EdgeConfig) -> Result<Self, StartError> {
        Self::start_with(config, EdgeOptions::default()).await
    }

    /// Start with process options.
    pub async fn start_with(config: EdgeConfig, options: EdgeOptions) -> Result<Self, StartError> {
        let traces = Arc::new(options.trace_files());
        let trace: Option<Box<dyn std::io::Write + Send>> =
            match traces.records(iop_trace::MachineKind::EdgeDispatch) {
                true => Some(Box::new(std::io::BufWriter::new(std::fs::File::create(
                    traces.base(),
                )?))),
                false => None,
            };
        let tls = ServerTls::from_files(&config.tls.cert, &config.tls.key, &config.tls.ca)?;
        let mut tuning = config.quic_tuning;
        // A node opens only its control stream (every run, tunnel and
        // command stream is opened by the Edge): bound what a peer can pin
        // in unread streams.
        tuning.max_concurrent_bidi_streams = NODE_OPENED_STREAMS;
        let denylist = CertDenylist::new(config.edge.revoked_fingerprints());
        let endpoint = server_endpoint_with_denylist(
            &tls,
            config.edge.quic_listen,
            &tuning,
            denylist.clone(),
        )?;
        let quic_addr = endpoint.local_addr()?;
        let store = GenerationStore::open(&config.edge.state_dir)?;
        // Plus a random offset (core's rule, R-MULTI-1).
        let floor =
            iop_core::edge::generations::start_floor(store.floor(unix_ms())?, rand::random());
        // R-GEN-1: a reservation ahead of every generation this run hands
        // out is durable before any node registers; later ones are saved
        // off the hub's task.
        let mark = iop_core::edge::generations::initial_mark(floor);
        store.save(mark)?;
        let clock = Clock::new();
        let metrics = crate::metrics::EdgeMetrics::with_traces(
            iop_transport::telemetry::MetricsPipeline::new(
                "iop-edge",
                "iop-edge",
                config.otlp.as_ref(),
            )?,
            iop_transport::traces::TracePipeline::new(
                "iop-edge",
                "iop-edge",
                config.otlp_traces.as_ref(),
            )?,
        );
        metrics.declare_series(&config);
        if let Some(traces) = &config.otlp_traces {
            tracing::info!(
                event = "edge_otlp_traces_enabled",
                endpoint = %traces.endpoint,
                sample_ratio = traces.sample_ratio
            );
        }
        if let Some(otlp) = &config.otlp {
            tracing::info!(
                event = "edge_otlp_export_enabled",
                endpoint = %otlp.endpoint,
                interval_ms = otlp.interval_ms
            );
        }
        let creds = Arc::new(crate::cred::Credentials::open(
            &config.edge.state_dir,
            &config.credentials,
        )?);
        let mut managed: std::collections::HashMap<_, Vec<iop_wire::ManagedTarget>> =
            std::collections::HashMap::new();
        for p in &config.providers {
            if let Some(profile) = &p.credential {
                managed
                    .entry(p.spec.node.clone())
                    .or_default()
                    .push(iop_wire::ManagedTarget {
                        adapter: p.spec.adapter,
                        target: p.spec.target.clone(),
                        profile: profile.clone(),
                    });
            }
        }
        let (hub, hub_task) = hub::spawn(
            DispatchConfig {
                admission: config.admission_config(),
                providers: config.providers.iter().map(|p| p.spec.clone()).collect(),
                generation_floor: floor,
                generation_mark: Some(mark),
                known_nodes: config.edge.restrict_nodes.then(|| config.known_nodes()),
                health: config.health_config(),
                capacity_from_node: config.capacity_from_node(),
                parked_hold_ms: iop_core::time::duration_ms(config.journal.park_window()),
            },
            Some(store),
            clock,
            metrics.clone(),
            trace,
            creds.clone(),
            managed,
        )?;
        let settings = LinkSettings {
            heartbeat: config.heartbeat,
            denylist: denylist.clone(),
            traces: traces.clone(),
        };
        let validate_addresses = config.edge.quic_address_validation;
        let max_node_connections = config.edge.max_node_connections;
        let accept_task = tokio::spawn({
            let endpoint = endpoint.clone();
            let hub = hub.clone();
            async move {
                // Link tasks live in this set: stopping the accept task
                // stops them too, so no connection outlives the endpoint.
                let mut links = tokio::task::JoinSet::new();
                loop {
                    tokio::select! {
                        incoming = endpoint.accept() => match incoming {
                            Some(incoming) => {
                                match admit_node_connection(&incoming, validate_addresses, links.len(), max_node_connections) {
                                    NodeAdmission::Accept => {
                                        links.spawn(node_link::serve(incoming, hub.clone(), clock, settings.clone()));
                                    }
                                    NodeAdmission::Retry => {
                                        let _ = incoming.retry();
                                    }
                                    NodeAdmission::Refuse => incoming.refuse(),
                                }
                            }
                            None => break,
                        },
                        Some(_) = links.join_next(), if !links.is_empty() => {}
                    }
                }
                while links.join_next().await.is_some() {}
            }
        });
        tracing::info!(event = "edge_quic_listening", addr = %quic_addr);
        // The journal of durable responses: opened in the background
        // (R-JRN-6), so the Edge serves ephemeral requests at once, and
        // durable ones once the store is open and this Edge's ownership
        // lease is taken (R-TAKE-1; refused for good, the Edge stops, when
        // another process renews its edge_id, R-TAKE-2).
        let durable = Arc::new(
            crate::durable::Durable::open(
                &config.journal,
                &config.edge.state_dir,
                config.edge.edge_id(),
                metrics.clone(),
            )
            .await?,
        );
        let (store_up, first_scan) = tokio::sync::oneshot::channel();
        let keeper = durable.spawn_keeper(traces.clone(), move |unfinished| {
            let _ = store_up.send(unfinished);
        });
        let custody_config = durable.custody_config(
            config.journal.park_window(),
            std::time::Duration::from_millis(config.journal.takeover_scan_interval_ms),
        );
        let parked = hub.parked_runs();
        let sweeper = durable.spawn_sweeper(std::time::Duration::from_millis(
            config.journal.sweep_interval_ms,
        ));
        // A store that answers at once is up before the first client
        // arrives; one that does not (down, slow, a lease to watch) is
        // waited for no longer than this, then opened in the background.
        if tokio::time::timeout(FIRST_OPEN_WAIT, durable.first_attempt())
            .await
            .is_err()
            || durable.store_state() != iop_core::journal::availability::StoreState::Up
        {
            tracing::warn!(
                event = "edge_serving_without_journal_store",
                "serving ephemeral requests; durable ones get 503 until the journal store is open"
            );
        }
        let config = Arc::new(config);
        let listener = tokio::net::TcpListener::bind(config.edge.http_listen).await?;
        let http_addr = listener.local_addr()?;
        let state = crate::app_state::AppState::new(
            config.clone(),
            hub.clone(),
            clock,
            metrics.clone(),
            creds.clone(),
            durable.clone(),
            traces.clone(),
        );
        // R-TAKE-1, R-PARK-2, R-CONT-1: a response this Edge's former run,
        // or a dead Edge, left unfinished is adopted when its node reports
        // the run parked, continued on its pool when its route continues
        // answers, or ends `incomplete` after the park window. The custody
        // starts once the store is open, from its first scan.
        let custody = {
            let record_state = state.clone();
            let record_run: crate::custody::RecordRun = Arc::new(move |meta, stored| {
                Box::pin(crate::stored::record_run(
                    record_state.clone(),
                    meta,
                    stored,
                ))
            });
            let (ctx, durable) = (state.driver_context().clone(), durable.clone());
            let traces = traces.clone();
            let start_state = state.clone();
            let reads = state.reads().clone();
            tokio::spawn(async move {
                let Ok(unfinished) = first_scan.await else {
                    return;
                };
                let task = crate::custody::CustodyTask::new(
                    durable.clone(),
                    custody_config,
                    unfinished,
                    record_run,
                    reads,
                    &traces,
                );
                task.run(parked, move |mut start| {
                    // R-TEN-2: a run a takeover starts is charged to the
                    // record's key and principal, an adopted one too.
                    match &mut start {
                        crate::custody::Start::Continue { meta, work, .. } => {
                            crate::stored::hold_taken_over(&start_state, meta, work, false)
                        }
                        crate::custody::Start::Adopt { meta, work, .. } => {
                            crate::stored::hold_taken_over(&start_state, meta, work, true)
                        }
                        // An answer it ended without running it is charged
                        // what its journal holds.
                        crate::custody::Start::Charge { meta, used, work } => {
                            crate::stored::charge_ended(&start_state, meta, used, work.as_ref())
                        }
                        _ => {}
                    }
                    crate::custody::start_run(&ctx, &durable, start);
                })
                .await;
            })
        };
        // R-TEN-4: the runtime keys are read before the Edge serves (a
        // store that cannot answer leaves the config file's keys; the sync
        // keeps trying); R-TEN-5: settled usage goes to the store in
        // batches.
        if let Err(e) = state.keys().sync().await {
            tracing::warn!(event = "edge_runtime_keys_sync_failed", error = %e, "serving with the config file's keys until the store answers");
        }
        let key_sync = state
            .keys()
            .spawn_sync(std::time::Duration::from_millis(config.tenants.key_sync_ms));
        let usage_writer = state
            .tenancy()
            .spawn_usage_writer(std::time::Duration::from_millis(
                config.tenants.usage_flush_ms,
            ));
        let tenancy = state.tenancy().clone();
        // `/metrics` on its own listener, when configured.
        let (metrics_addr, metrics_task) = match config.edge.metrics_listen {
            Some(addr) => {
                let listener = tokio::net::TcpListener::bind(addr).await?;
                let addr = listener.local_addr()?;
                let app = crate::http::metrics_router(state.clone());
                tracing::info!(event = "edge_metrics_listening", addr = %addr);
                let task = tokio::spawn(async move {
                    if let Err(e) = axum::serve(listener, app).await {
                        tracing::error!(event = "edge_metrics_listener_failed", error = %e);
                    }
                });
                (Some(addr), Some(task))
            }
            None => (None, None),
        };
        let console = state.console().clone();
        let durable_handle = state.durable().clone();
        let app = crate::http::router(state);
        let (http_stop, stop) = tokio::sync::watch::channel(false);
        let limits = crate::serve::HttpLimits::from_config(&config);
        let http_task = tokio::spawn(crate::serve::serve(
            listener,
            app,
            limits,
            metrics.clone(),
            stop,
        ));
        tracing::info!(event = "edge_http_listening", addr = %http_addr);
        Ok(Self {
            denylist,
            quic_addr,
            http_addr,
            hub,
            config,
            metrics,
            creds,
            endpoint,
            http_stop,
            accept_task,
            http_task,
            hub_task,
            sweeper,
            background: [keeper, custody, key_sync, usage_writer]
                .into_iter()
                .chain(metrics_task)
                .collect(),
            metrics_addr,
            tenancy,
            console,
            durable: durable_handle,
        })
    }

    /// Resolves once the journal store refuses this Edge for good (another
    /// live process renews its `edge_id`'s ownership lease, R-TAKE-2),
    /// naming why: the Edge must then stop. Never resolves otherwise.
    pub fn refused(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        self.durable.refused()
    }

    /// Where the journal store stands (R-JRN-6).
    pub fn journal_store_state(&self) -> iop_core::journal::availability::StoreState {
        self.durable.store_state()
    }

    /// Apply a re-read `[edge] revoked_node_certificates` (SIGHUP): the
    /// next handshake of a listed certificate is refused.
    pub fn reload_revoked_node_certificates(&self, config: &EdgeConfig) {
        self.denylist.replace(config.edge.revoked_fingerprints());
    }

    /// Apply a re-read `[[credentials]]` section (SIGHUP): new secrets,
    /// revisions and disabled flags, pushed to every connected node.
    pub fn reload_credentials(&self, profiles: &[crate::config::CredentialProfile]) {
        self.creds.replace(profiles);
        self.hub.refresh_credentials();
    }

    /// Revoke a profile (mark it inactive) and push the new states.
    pub fn revoke_credential(&self, profile: &str) -> bool {
        let known = match self.creds.revoke(profile) {
            Ok(known) => known,
            Err(e) => {
                // Revoked in this process; only the record for the next
                // start is missing.
                tracing::error!(event = "edge_credential_revocation_not_persisted", profile = %profile, error = %e);
                true
            }
        };
        self.hub.refresh_credentials();
        known
    }

    /// Stop accepting clients and let in-flight responses finish (at most
    /// `[edge] drain_timeout_ms`), give back the tenants' concurrency slots
    /// this Edge holds and the unused rest of its windows' chunks (within
    /// 2 s), then close every node connection with
    /// `shutdown`, wait briefly for the closes to go out, and push the final
    /// metrics to the OTLP collector when one is configured.
    pub async fn shutdown(self) {
        self.sweeper.abort();
        for task in &self.background {
            task.abort();
        }
        // Console streams never end by themselves: they must not hold the
        // drain of the answers in flight.
        self.console.close_streams();
        self.http_stop.send_replace(true);
        let _ = self.http_task.await;
        // What the drained requests settled (R-TEN-5).
        self.tenancy.flush_usage().await;
        // The concurrency slots this Edge holds go back now, not when its
        // lease lapses, and what it claimed of each window and did not use
        // goes back once (R-TEN-1, R-TEN-2, R-TEN-3).
        self.tenancy.hand_back(crate::tenancy::CLAIM_TIMEOUT).await;
        // Refuse new handshakes first: nodes keep dialing while we drain.
        self.endpoint.set_server_config(None);
        self.endpoint.close(
            CloseCode::Shutdown.code().into(),
            CloseCode::Shutdown.as_str().as_bytes(),
        );
        // Every link sees its connection close and reports it; give them a
        // moment, then stop whatever is left.
        let mut accept = self.accept_task;
        if tokio::time::timeout(std::time::Duration::from_secs(2), &mut accept)
            .await
            .is_err()
        {
            accept.abort();
            let _ = accept.await;
        }
        self.hub.shutdown();
        // The hub ends and drops its trace writer, flushing it.
        let _ = self.hub_task.await;
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), self.endpoint.wait_idle())
            .await;
        let metrics = self.metrics;
        let _ = tokio::task::spawn_blocking(move || metrics.shutdown()).await;
    }

    /// Close one connection (tests use this to drop a node).
    pub fn close(conn: &quinn::Connection, code: CloseCode) {
        close_connection(conn, code);
    }
}

/// What the accept loop does with a node's connection attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeAdmission {
    Accept,
    /// Prove the source address first (QUIC Retry): a spoofed flood costs
    /// one stateless packet each, no handshake.
    Retry,
    /// Past `max_node_connections`.
    Refuse,
}

fn admit_node_connection(
    incoming: &quinn::Incoming,
    validate_addresses: bool,
    open: usize,
    max_open: usize,
) -> NodeAdmission {
    if validate_addresses && !incoming.remote_address_validated() && incoming.may_retry() {
        return NodeAdmission::Retry;
    }
    if open >= max_open {
        tracing::warn!(
            event = "edge_node_connection_refused",
            reason = "max_node_connections",
            open
        );
        return NodeAdmission::Refuse;
    }
    NodeAdmission::Accept
}
