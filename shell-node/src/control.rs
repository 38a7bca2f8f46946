//! What run handlers and their connection's link say to each other: the
//! messages a handler sends the link ([`LinkMsg`], over a [`LinkTx`]) and
//! the link's answers and orders to one handler ([`RunControl`]). Only
//! types live here, so the link, the run handlers and the durable runs
//! each depend on this module and none on another's.

use iop_core::ids::RunId;
use iop_core::node::watchdog::{Emission, ProbeOutcome, ProviderEvent, RunKind, RunTerminal};
use iop_transport::framed::{FramedRecv, FramedSend};
use iop_wire::{AdapterKind, AdoptRequest, FailureCode, TransportStatusReport};
use tokio::sync::{mpsc, oneshot};

/// What the link tells one run handler.
pub enum RunControl {
    /// Stop the provider call now (stall claimed, canceled, disconnected).
    CancelProvider,
    /// Write this terminal and end (the watchdog's decision).
    Terminal(RunTerminal),
    /// A connection adopts this parked durable run (R-PARK-2).
    Attach(Box<Attach>),
    /// An Edge can use this parked run no more (R-PARK-1).
    CancelParked,
}

impl std::fmt::Debug for RunControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunControl::CancelProvider => f.write_str("CancelProvider"),
            RunControl::Terminal(t) => f.debug_tuple("Terminal").field(t).finish(),
            RunControl::CancelParked => f.write_str("CancelParked"),
            RunControl::Attach(a) => f
                .debug_struct("Attach")
                .field("run_id", &a.request.run_id)
                .field("key", &a.request.key)
                .finish_non_exhaustive(),
        }
    }
}

/// What run handlers tell the link.
pub enum LinkMsg {
    /// A handler wants to start a run (admission + watchdog start).
    Start {
        /// The run.
        run_id: RunId,
        /// Normalized or tunnel.
        kind: RunKind,
        /// Wire stall timeout (already validated).
        stall_timeout: std::time::Duration,
        /// Hard deadline, if any.
        deadline: Option<std::time::Duration>,
        /// Adapter/target (for the probe).
        adapter: AdapterKind,
        /// Target.
        target: String,
        /// The request carries a sealed credential lease.
        carries_lease: bool,
        /// A parked run being adopted: it already holds its capacity.
        adopted: bool,
        /// Control channel to the handler.
        control: mpsc::UnboundedSender<RunControl>,
        /// Admitted, or the failure to answer with.
        reply: oneshot::Sender<Result<(), FailureCode>>,
    },
    /// A provider output; the reply says whether to forward it (R-WD-6).
    Event {
        /// The run.
        run_id: RunId,
        /// Classified output.
        event: ProviderEvent,
        /// Forward or drop.
        reply: oneshot::Sender<Emission>,
    },
    /// Several outputs of one run that were ready together, in order: one
    /// message instead of one per output.
    Events {
        /// The run.
        run_id: RunId,
        /// Classified outputs, in the order the provider produced them.
        events: Vec<ProviderEvent>,
        /// Forward or drop, one per output.
        reply: oneshot::Sender<Vec<Emission>>,
    },
    /// The handler dropped its provider call on a cancel: the call ended
    /// (R-WD-4 timing).
    ProviderReturned {
        /// The run.
        run_id: RunId,
    },
    /// The handler ended.
    Finished {
        /// The run.
        run_id: RunId,
    },
    /// The Edge canceled the run by resetting its stream.
    Canceled {
        /// The run.
        run_id: RunId,
    },
    /// A probe finished.
    ProbeDone {
        /// The run.
        run_id: RunId,
        /// Its verdict.
        outcome: ProbeOutcome,
    },
    /// A `TransportStatus` command.
    Status {
        /// The answer.
        reply: oneshot::Sender<TransportStatusReport>,
    },
    /// Open the run's credential lease (R-CRED-2), after admission and
    /// right before the provider call. `Ok(None)`: the target is not
    /// managed and no lease came; `Err`: fail closed.
    OpenLease {
        /// The run (the lease's slot).
        run_id: RunId,
        /// Adapter of the target about to be called.
        adapter: AdapterKind,
        /// The target about to be called.
        target: String,
        /// The route (model) when the node can tell.
        route: Option<String>,
        /// The sealed lease, if one came.
        lease: Option<Vec<u8>>,
        /// The credential, or the closed rejection reason.
        reply: oneshot::Sender<Result<Option<iop_core::cred::Secret>, &'static str>>,
    },
    /// A `Capabilities` command: take the next observation sequence.
    TakeObservationSeq {
        /// The sequence.
        reply: oneshot::Sender<u64>,
    },
}

/// A handle run handlers use to reach their link.
#[derive(Clone)]
pub struct LinkTx(pub(crate) mpsc::Sender<LinkMsg>);

impl LinkTx {
    /// Send a message and await its oneshot answer; `None` if the link ended.
    pub async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> LinkMsg) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.0.send(make(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Fire and forget.
    pub async fn tell(&self, msg: LinkMsg) {
        let _ = self.0.send(msg).await;
    }
}

/// A connection taking a parked run over.
pub struct Attach {
    /// The stream the run's frames go to from now on.
    pub send: FramedSend,
    /// Its other half (acknowledgements, a reset).
    pub recv: FramedRecv,
    /// The connection's link.
    pub link: LinkTx,
    /// The connection (to tell whether it is still up).
    pub conn: quinn::Connection,
    /// What the Edge asked.
    pub request: AdoptRequest,
}
