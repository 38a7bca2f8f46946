//! Planted bugs (feature `planted-bugs`, test-only): known bugs compiled into
//! the real state machines and switched on at run time, so the simulator and
//! the fuzzers can prove that their invariants catch them ("proving the
//! invariants bite", after TigerBeetle's VOPR).
//!
//! Nothing here changes behaviour unless a test switches a bug on: every hook
//! is `if planted.has(bug) { .. }` on a set that starts empty. Building the
//! workspace's tests turns the feature on for every crate that links
//! `iop-core` (cargo unifies features), which is harmless for that reason.
//!
//! The set is switched through a shared reference
//! ([`crate::edge::dispatch::Dispatcher::plant`],
//! [`crate::edge::request::Request::plant`],
//! [`crate::node::watchdog::Watchdog::plant`]) because the simulator reaches
//! its machines through recording wrappers that hand out read access only.
//! It is an atomic bit set, read with relaxed ordering: no lock, no clock,
//! and each machine still has one owner.

use std::sync::atomic::{AtomicU16, Ordering};

/// A known bug a test can plant in a core machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PlantedBug {
    /// R-LEASE-2: the fence gives each fenced lease's capacity back twice
    /// (`Admission::fence`).
    DoubleRelease,
    /// R-GEN-3: a fenced generation of a connected node counts as current,
    /// so its late terminals and CAPABILITIES answers are processed
    /// (`Registry::is_current`).
    AcceptStaleGeneration,
    /// R-OVL-2: stall evidence lowers (or is recorded) without the freshness
    /// check (`Overlay::apply_stall_evidence`).
    LowerOnStaleEvidence,
    /// R-WD-6: a provider call that returns after its run's terminal emits a
    /// second terminal instead of being fenced (`Watchdog::provider_returned`).
    SecondTerminal,
    /// R-GEN-2: a node's providers come online when it registers, before its
    /// generation completed readiness (`Dispatcher::register`).
    DispatchBeforeReady,
    /// R-GEN-4: the pre-send fence is skipped: `Admission::pre_send` answers
    /// `Send` without re-checking the lease, also for a lease its
    /// generation's fence already released.
    SkipPreSendFence,
    /// R-LEASE-2, R-GATE-4: a request that ends never lets go of what it
    /// still holds (`Request`: no final cancel), so a client that leaves
    /// mid-run leaks its lease.
    SkipCancelRelease,
    /// R-GATE-3: a request delivers its terminal to the client twice
    /// (`Request`).
    DuplicateTerminal,
    /// R-GATE-3: a request's budget timer never fires (`Request`), so a
    /// request stuck in the queue or on a silent node never ends.
    IgnoreGateTimeout,
}

impl PlantedBug {
    /// Every planted bug.
    pub const ALL: [PlantedBug; 9] = [
        PlantedBug::DoubleRelease,
        PlantedBug::AcceptStaleGeneration,
        PlantedBug::LowerOnStaleEvidence,
        PlantedBug::SecondTerminal,
        PlantedBug::DispatchBeforeReady,
        PlantedBug::SkipPreSendFence,
        PlantedBug::SkipCancelRelease,
        PlantedBug::DuplicateTerminal,
        PlantedBug::IgnoreGateTimeout,
    ];

    /// Whether the bug lives in the request machine (`Request`), which the
    /// dispatcher and watchdog fuzz harnesses do not drive.
    pub fn in_request_machine(self) -> bool {
        matches!(
            self,
            PlantedBug::SkipCancelRelease
                | PlantedBug::DuplicateTerminal
                | PlantedBug::IgnoreGateTimeout
        )
    }

    /// The stable name (command line, reports).
    pub fn as_str(self) -> &'static str {
        match self {
            PlantedBug::DoubleRelease => "double-release",
            PlantedBug::AcceptStaleGeneration => "accept-stale-generation",
            PlantedBug::LowerOnStaleEvidence => "lower-on-stale-evidence",
            PlantedBug::SecondTerminal => "second-terminal",
            PlantedBug::DispatchBeforeReady => "dispatch-before-ready",
            PlantedBug::SkipPreSendFence => "skip-pre-send-fence",
            PlantedBug::SkipCancelRelease => "skip-cancel-release",
            PlantedBug::DuplicateTerminal => "duplicate-terminal",
            PlantedBug::IgnoreGateTimeout => "ignore-gate-timeout",
        }
    }

    /// Parse a name from [`PlantedBug::as_str`].
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.as_str() == name)
    }

    fn bit(self) -> u16 {
        1 << (self as u8)
    }
}

/// The bugs planted in one machine; empty unless a test switches one on.
#[derive(Debug, Default)]
pub struct Planted(AtomicU16);

impl Planted {
    /// Switch `bug` on.
    pub fn plant(&self, bug: PlantedBug) {
        self.0.fetch_or(bug.bit(), Ordering::Relaxed);
    }

    /// Is `bug` switched on?
    pub fn has(&self, bug: PlantedBug) -> bool {
        self.0.load(Ordering::Relaxed) & bug.bit() != 0
    }

    /// Is any bug switched on? (Assertions that a planted bug breaks on
    /// purpose are skipped, so the invariants, not a panic, report it.)
    pub fn any(&self) -> bool {
        self.0.load(Ordering::Relaxed) != 0
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use iop_wire::{
        AdapterKind, CloseCode, ExecutionFailure, FailureCode, PROTOCOL_VERSION, ProviderHealth,
        RegisterRequest,
    };

    use super::*;
    use crate::Instant;
    use crate::edge::admission::{AdmissionConfig, Admit, DispatchRequest, PreSend, ProviderSpec};
    use crate::edge::dispatch::{DispatchConfig, Dispatcher};
    use crate::edge::overlay::{EvidenceOutcome, Overlay};
    use crate::edge::registry::Registry;
    use crate::ids::{NodeId, ProviderId};
    use crate::node::watchdog::{
        CancelReason, Emission, ProviderOutcome, RunKind, Watchdog, WatchdogConfig, WatchdogOutput,
    };

    const T: Instant = Instant::ZERO;

    fn dispatcher(capacity: u32) -> Dispatcher {
        Dispatcher::new(
            T,
            DispatchConfig {
                admission: AdmissionConfig::default(),
                providers: vec![ProviderSpec {
                    id: ProviderId::from("p"),
                    node: NodeId::from("n"),
                    adapter: AdapterKind::Mock,
                    target: "t".into(),
                    capacity,
                    stall_timeout_ms: 1000,
                }],
                generation_floor: 0,
                known_nodes: None,
                health: crate::edge::health::HealthConfig::default(),
            },
        )
        .expect("valid config")
    }

    fn register(d: &mut Dispatcher) -> u64 {
        let request = RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            node_version: "t".into(),
            providers: vec![],
            max_concurrent_runs: 4,
            recipient_public_key: None,
            parked: Vec::new(),
        };
        d.register(T, &NodeId::from("n"), &request)
            .expect("accepted")
            .0
    }

    fn lease(d: &mut Dispatcher, request_id: u64) -> crate::edge::admission::Lease {
        match d.request(
            T,
            DispatchRequest::new(request_id, vec![ProviderId::from("p")]),
        ) {
            Admit::Leased(lease) => lease,
            other => panic!("expected a lease, got {other:?}"),
        }
    }

    #[test]
    fn names_round_trip_and_bits_are_distinct() {
        let planted = Planted::default();
        assert!(!planted.any());
        for bug in PlantedBug::ALL {
            assert_eq!(PlantedBug::parse(bug.as_str()), Some(bug));
            assert!(!planted.has(bug));
        }
        planted.plant(PlantedBug::SecondTerminal);
        assert!(planted.any());
        for bug in PlantedBug::ALL {
            assert_eq!(planted.has(bug), bug == PlantedBug::SecondTerminal);
        }
    }

    #[test]
    fn double_release_breaks_the_lease_count_at_the_fence() {
        let mut d = dispatcher(2);
        let g = register(&mut d);
        assert!(d.ready(T, &NodeId::from("n"), g));
        lease(&mut d, 1);
        lease(&mut d, 2);
        d.plant(PlantedBug::DoubleRelease);
        d.connection_closed(T, &NodeId::from("n"), g, CloseCode::HeartbeatTimeout);
        assert!(d.admission().check_invariants().is_err());
    }

    #[test]
    fn accept_stale_generation_admits_a_fenced_generation() {
        let mut r = Registry::new(0);
        let n = NodeId::from("n");
        let request = RegisterRequest {
            protocol_version: PROTOCOL_VERSION,
            node_version: "t".into(),
            providers: vec![],
            max_concurrent_runs: 4,
            recipient_public_key: None,
            parked: Vec::new(),
        };
        let g1 = r.register(T, &n, &request).expect("accepted");
        r.register(T, &n, &request).expect("accepted");
        assert!(!r.is_current(&n, g1));
        r.plant(PlantedBug::AcceptStaleGeneration);
        assert!(r.admit_message(&n, g1), "the fenced generation is admitted");
    }

    #[test]
    fn lower_on_stale_evidence_skips_the_freshness_check() {
        let mut o = Overlay::new();
        let p = ProviderId::from("p");
        o.apply_stall_evidence(&p, 1, Some(5), ProviderHealth::Available);
        o.plant(PlantedBug::LowerOnStaleEvidence);
        assert_eq!(
            o.apply_stall_evidence(&p, 1, Some(4), ProviderHealth::Unavailable),
            EvidenceOutcome::Lowered
        );
    }

    #[test]
    fn second_terminal_lets_a_late_return_end_the_run_again() {
        let mut w = Watchdog::new(WatchdogConfig::default(), None);
        w.plant(PlantedBug::SecondTerminal);
        w.start(T, 1, RunKind::Normalized, Duration::from_secs(1), None)
            .expect("started");
        w.cancel(T, 1, CancelReason::Client);
        let late = w.provider_returned(
            T,
            1,
            ProviderOutcome::Failed(ExecutionFailure::new(FailureCode::Canceled)),
        );
        assert_eq!(late, Emission::Forward);
        let terminals = std::iter::from_fn(|| w.poll_output())
            .filter(|o| matches!(o, WatchdogOutput::Terminal { .. }))
            .count();
        assert_eq!(terminals, 2);
    }

    #[test]
    fn dispatch_before_ready_leases_on_a_registered_generation() {
        let mut d = dispatcher(1);
        d.plant(PlantedBug::DispatchBeforeReady);
        let g = register(&mut d);
        let l = lease(&mut d, 1);
        assert_eq!(l.generation, g);
        assert!(!d.registry().is_dispatchable(&l.node, g));
    }

    #[test]
    fn skip_pre_send_fence_answers_send_for_a_fenced_lease() {
        let mut d = dispatcher(1);
        let g = register(&mut d);
        assert!(d.ready(T, &NodeId::from("n"), g));
        let l = lease(&mut d, 1);
        d.plant(PlantedBug::SkipPreSendFence);
        d.connection_closed(T, &NodeId::from("n"), g, CloseCode::HeartbeatTimeout);
        assert!(matches!(d.pre_send(T, l.lease_id), PreSend::Send(_)));
    }
}
