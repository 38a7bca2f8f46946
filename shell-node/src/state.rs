//! The node's state that outlives one connection: who it is
//! ([`NodeIdentity`]), one [`EdgeSlot`] per configured Edge, and
//! [`LinkShared`], which every link, run handler and durable run holds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use iop_core::node::capacity::NodeCapacity;
use iop_core::node::probe::{ProbeEvidence, TargetCredential};
use iop_wire::{AdapterKind, CloseCode};
use tokio::sync::watch;

use crate::adapter::{Adapter, ProbeVerdict};
use crate::config::NodeConfig;

/// The file (in `state_dir`) holding the lease recipient key, mode 0600.
pub const RECIPIENT_KEY_FILE: &str = "recipient.key";

/// Who this node is, for credential leases (R-CRED-1): its id (from its own
/// certificate) and its X25519 recipient key. Debug never shows the key.
pub struct NodeIdentity {
    /// The node id in this node's certificate (`node://<id>`).
    pub node_id: String,
    pub(crate) recipient: x25519_dalek::StaticSecret,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

impl NodeIdentity {
    /// Load (or create, mode 0600) `state_dir/recipient.key` and read the
    /// node id from the configured certificate.
    pub fn load(config: &NodeConfig) -> Result<Self, crate::error::StartError> {
        use iop_core::cred::keys;
        use rustls::pki_types::{CertificateDer, pem::PemObject};
        let err = crate::error::StartError::Credentials;
        let cert = CertificateDer::from_pem_file(&config.tls.cert)
            .map_err(|e| err(format!("{}: {e}", config.tls.cert.display())))?;
        let node_id = iop_transport::node_id_from_cert(&cert)
            .map_err(|e| err(format!("{}: {e}", config.tls.cert.display())))?;
        let path = config.node.state_dir.join(RECIPIENT_KEY_FILE);
        let bytes = iop_transport::keyfile::load_or_create(&path, || {
            keys::recipient_secret_to_bytes(&keys::generate_recipient_key(&mut rand::rng()))
        })
        .map_err(|e| err(e.to_string()))?;
        let recipient = keys::recipient_secret_from_bytes(&bytes)
            .map_err(|e| err(format!("{}: {e}", path.display())))?;
        Ok(Self { node_id, recipient })
    }

    /// The public key leases are sealed to.
    pub fn public_key(&self) -> [u8; 32] {
        iop_core::cred::keys::recipient_public_key(&self.recipient).to_bytes()
    }
}

/// One configured Edge's connection, as the rest of the node sees it.
pub struct EdgeSlot {
    /// Its address as configured (`host:port`).
    pub address: String,
    /// The generation of its current connection (0 when disconnected).
    pub generation: AtomicU64,
    /// Whether its current connection completed readiness.
    pub ready: AtomicBool,
    /// The close code of its last connection that ended (`u64::MAX`: none).
    pub last_close_code: AtomicU64,
    /// The replay cache of this Edge's leases (R-CRED-3): owned by the
    /// current link task while a connection is up (taken at its start,
    /// handed back at its end); this lock is never touched on the run
    /// path. Each Edge seals its own leases, so each has its own cache.
    replay: std::sync::Mutex<Option<iop_core::cred::ReplayCache>>,
}

impl EdgeSlot {
    /// The slot of the Edge at `address`.
    pub fn new(address: &str) -> Self {
        Self {
            address: address.to_owned(),
            generation: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            last_close_code: AtomicU64::new(u64::MAX),
            replay: std::sync::Mutex::new(Some(iop_core::cred::ReplayCache::new())),
        }
    }

    /// Why its last connection ended.
    pub fn last_close(&self) -> Option<CloseCode> {
        CloseCode::from_code(self.last_close_code.load(Ordering::Relaxed))
    }

    /// Take this Edge's replay cache for a connection's lifetime
    /// (R-CRED-3); a fresh one if the last connection did not hand its
    /// back.
    pub(crate) fn take_replay(&self) -> iop_core::cred::ReplayCache {
        self.replay
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default()
    }

    /// Hand the replay cache back for this Edge's next connection.
    pub(crate) fn return_replay(&self, cache: iop_core::cred::ReplayCache) {
        *self.replay.lock().unwrap_or_else(|e| e.into_inner()) = Some(cache);
    }

    /// Its current connection's generation, once ready.
    pub fn ready_generation(&self) -> Option<u64> {
        self.ready
            .load(Ordering::Relaxed)
            .then(|| self.generation.load(Ordering::Relaxed))
            .filter(|g| *g != 0)
    }
}

/// State that outlives one connection.
pub struct LinkShared {
    /// One adapter per configured provider target.
    pub adapters: Vec<Adapter>,
    /// Bound of every exact-target probe (R-WD-3, R-CAP-1).
    pub probe_bound: std::time::Duration,
    /// Stall metrics.
    pub metrics: crate::metrics::NodeMetrics,
    /// Test hook: while true, the control loops stop reading and answering
    /// heartbeats (the connections themselves stay up).
    pub pause_control: watch::Sender<bool>,
    /// Late provider outputs fenced after a terminal, all connections (R-WD-6).
    pub fenced_late_outputs: AtomicU64,
    /// Stalls observed, all connections.
    pub stalls: AtomicU64,
    /// One slot per configured Edge, in configuration order (R-MULTI-1).
    pub edges: Vec<EdgeSlot>,
    /// Handlers canceled because their connection ended (R-DISC-1).
    pub disconnect_cancels: AtomicU64,
    /// Connection attempts that failed before readiness.
    pub failed_attempts: AtomicU64,
    /// Connections the Edge closed as superseded: another process with
    /// this node's certificate connected.
    pub superseded: AtomicU64,
    /// Which machines are recorded, and where (`--record-trace`,
    /// `--trace-machine`).
    pub traces: iop_trace::TraceFiles,
    /// This node's id and lease recipient key (`None`: no managed
    /// credentials; every lease is refused).
    pub identity: Option<NodeIdentity>,
    /// Credential leases refused, all connections.
    pub credential_rejections: AtomicU64,
    /// Targets whose credential the Edge manages, as of the latest snapshot
    /// (read by health probes only; the lease path uses the link's copy).
    managed: std::sync::RwLock<Vec<(AdapterKind, String)>>,
    /// Durable runs, which outlive their connection (R-PARK-1).
    pub parking: crate::parking::ParkingLot,
    /// Bytes one durable run keeps until acknowledged (`[node]
    /// park_buffer_bytes`).
    pub park_buffer_bytes: usize,
    /// The node's one run count over every connection (R-MULTI-1): the
    /// core's rule, shared by the links.
    capacity: std::sync::Mutex<NodeCapacity>,
}

/// Reads one value off the shared state, for a metric.
type ReadShared = fn(&LinkShared) -> u64;

impl LinkShared {
    /// Shared state for `adapters`, one Edge at `edges` each, at most
    /// `capacity` runs.
    pub fn new(
        adapters: Vec<Adapter>,
        probe_bound: std::time::Duration,
        edges: &[String],
        capacity: NodeCapacity,
    ) -> Self {
        Self {
            adapters,
            probe_bound,
            metrics: crate::metrics::NodeMetrics::default(),
            pause_control: watch::channel(false).0,
            fenced_late_outputs: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
            edges: edges.iter().map(|e| EdgeSlot::new(e)).collect(),
            disconnect_cancels: AtomicU64::new(0),
            failed_attempts: AtomicU64::new(0),
            superseded: AtomicU64::new(0),
            traces: iop_trace::TraceFiles::off(),
            identity: None,
            credential_rejections: AtomicU64::new(0),
            managed: std::sync::RwLock::new(Vec::new()),
            parking: crate::parking::ParkingLot::default(),
            park_buffer_bytes: iop_core::node::park::DEFAULT_MAX_KEPT_BYTES,
            capacity: std::sync::Mutex::new(capacity),
        }
    }

    pub(crate) fn capacity(&self) -> std::sync::MutexGuard<'_, NodeCapacity> {
        // Every change is one call on the count.
        self.capacity.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs attached to a connection now, over every connection.
    pub fn running(&self) -> usize {
        self.capacity().running()
    }

    /// Edge connections that completed readiness now.
    pub fn ready_edges(&self) -> usize {
        self.edges
            .iter()
            .filter(|e| e.ready.load(Ordering::Relaxed))
            .count()
    }

    /// The tap of the next connection's machine, built from `config()`:
    /// its trace goes to `<record-trace>.<n>` (the `n`th connection of
    /// this process, from 1) when connections are recorded.
    pub fn link_tap<C: serde::Serialize>(&self, config: impl FnOnce() -> C) -> iop_trace::Tap {
        use iop_trace::{MachineKind, Tap, TraceFiles};
        if !self.traces.records(MachineKind::NodeLink) {
            return Tap::off();
        }
        let n = self.traces.next_instance(MachineKind::NodeLink);
        let path = std::path::PathBuf::from(format!("{}.{n}", self.traces.base().display()));
        TraceFiles::tap_at(&path, MachineKind::NodeLink, &config()).unwrap_or_else(|e| {
            tracing::error!(event = "node_trace_open_failed", machine = "node-link", error = %e);
            Tap::off()
        })
    }

    /// Why the last connection to the first Edge ended.
    pub fn last_close(&self) -> Option<CloseCode> {
        self.edges.first().and_then(EdgeSlot::last_close)
    }

    /// A probe verdict for `adapter`/`target`, as core classifies it for
    /// where that target's credential comes from (a managed target is
    /// probed without one).
    pub fn probe_verdict(
        &self,
        adapter: AdapterKind,
        target: &str,
        verdict: ProbeVerdict,
    ) -> ProbeVerdict {
        let managed = self
            .managed
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|(a, t)| *a == adapter && t == target);
        let credential = if managed {
            TargetCredential::Managed
        } else {
            TargetCredential::Standing
        };
        let evidence = ProbeEvidence::new(verdict.health, verdict.failure).for_target(credential);
        ProbeVerdict {
            health: evidence.health,
            failure: evidence.failure,
            models: verdict.models,
        }
    }

    pub(crate) fn set_managed(&self, managed: &[iop_wire::ManagedTarget]) {
        *self.managed.write().unwrap_or_else(|e| e.into_inner()) = managed
            .iter()
            .map(|m| (m.adapter, m.target.clone()))
            .collect();
    }

    /// Gauges and counters read from the link's shared state at each
    /// collection: whether a connection is ready, and the connection and
    /// fencing counters. Holds only a weak reference (the state owns these
    /// metrics).
    pub fn observe_metrics(shared: &Arc<Self>) {
        for a in &shared.adapters {
            shared.metrics.declare_target_series(a.kind(), a.target());
        }
        let meter = shared.metrics.meter();
        let weak = Arc::downgrade(shared);
        let read = move |f: ReadShared| {
            let weak = weak.clone();
            move || weak.upgrade().map(|s| f(&s))
        };
        let connected = read(|s| s.ready_edges() as u64);
        meter
            .u64_observable_gauge("iop_node_connected")
            .with_description(
                "Edge connections ready now (1 with one Edge; up to the Edges configured)",
            )
            .with_callback(move |o| {
                if let Some(v) = connected() {
                    o.observe(v, &[])
                }
            })
            .build();
        let counters: [(&'static str, &'static str, ReadShared); 4] = [
            (
                "iop_node_superseded",
                "Connections the Edge closed as superseded: another process connected with this node's certificate",
                |s| s.superseded.load(Ordering::Relaxed),
            ),
            (
                "iop_node_failed_connection_attempts",
                "Connection attempts that failed before readiness",
                |s| s.failed_attempts.load(Ordering::Relaxed),
            ),
            (
                "iop_node_disconnect_cancels",
                "Provider calls canceled because their connection ended (R-DISC-1)",
                |s| s.disconnect_cancels.load(Ordering::Relaxed),
            ),
            (
                "iop_node_fenced_late_outputs",
                "Provider outputs dropped after their run's terminal (R-WD-6)",
                |s| s.fenced_late_outputs.load(Ordering::Relaxed),
            ),
        ];
        for (name, description, f) in counters {
            let value = read(f);
            meter
                .u64_observable_counter(name)
                .with_description(description)
                .with_callback(move |o| {
                    if let Some(v) = value() {
                        o.observe(v, &[])
                    }
                })
                .build();
        }
    }

    /// The adapter serving `adapter`/`target`.
    pub fn adapter(&self, adapter: AdapterKind, target: &str) -> Option<&Adapter> {
        self.adapters
            .iter()
            .find(|a| a.kind() == adapter && a.target() == target)
    }
}
