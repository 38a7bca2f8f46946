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
//! [`crate::tenant::Tenants::plant`],
//! [`crate::node::watchdog::Watchdog::plant`]) because the simulator reaches
//! its machines through recording wrappers that hand out read access only.
//! It is an atomic bit set, read with relaxed ordering: no lock, no clock,
//! and each machine still has one owner.
//!
//! The bugs of durable responses live where there is no machine to plant
//! them in: the journal's rules are pure functions every store calls
//! ([`crate::journal`]), and the [`Publisher`](crate::edge::durable::Publisher)
//! is built inside its request. They are planted for the current thread
//! instead ([`plant_in_thread`], [`in_thread`], [`clear_thread`]): the
//! simulator runs each world on one thread and switches the set on for the
//! world's lifetime, so parallel worlds with different bugs never see each
//! other's ([`PlantedBug::in_thread_scope`] says which bugs these are).

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};

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
    /// R-JRN-1: the publisher hands content to the client before its
    /// append is acknowledged durable (`Publisher::poll_publish`); a crash
    /// then loses what a client already saw.
    PublishBeforeDurable,
    /// R-JRN-3: an append is checked against the record's own epoch instead
    /// of the writer's (`journal::check_append`), so a fenced former owner's
    /// late append is accepted after a takeover raised the epoch.
    AppendIgnoresEpoch,
    /// R-JRN-4: once its terminal is durable the publisher writes it again
    /// (`Publisher::ack`): a second terminal for one record.
    SecondJournalTerminal,
    /// R-JRN-3, R-TAKE-1: the takeover's compare-and-set answers success
    /// without moving the epoch (`journal::check_raise_epoch`), so the
    /// restart scan ends records under the dead owner's epoch and a zombie
    /// write of that owner still lands.
    TakeoverWithoutRaise,
    /// R-PARK-2: an adoption replays every frame the parked run still
    /// keeps, as if the Edge resumed from frame 0, instead of those after
    /// the Edge's resume point (`RunPark::adopt`): frames the journal
    /// already holds but the node had no ack for yet are published again.
    ResumeFromZero,
    /// R-PARK-2, R-JRN-2: an off-by-one in the adoption's replay filter
    /// (`RunPark::adopt`) skips the first frame after the resume point: the
    /// client's answer loses the output the provider produced there.
    ReplaySkipsAFrame,
    /// R-FAIL-1, R-WD-4: the request machine re-admits a confirmed stall
    /// whatever the node's `retryable` mark (`Request`, at the terminal's
    /// verdict), so a stall whose provider call may still be running gets
    /// a second attempt elsewhere.
    ReadmitUnretryableStall,
    /// R-FAIL-2, R-GEN-3: a connection the Edge declared lost by its
    /// liveness detection (`heartbeat_timeout`) is not fenced
    /// (`Registry::connection_closed`): its generation stays current and
    /// ready, and requests are dispatched to it past its loss deadline.
    KeepLostConnection,
    /// R-MULTI-1, R-PARK-2: the custody adopts a parked run of another
    /// Edge's record without waiting for that Edge's lease to expire
    /// (`Custody::owner_may_be_alive` answers no), so a live owner's
    /// request is fenced by a peer's raise.
    AdoptWithoutOwnerWait,
    /// R-MULTI-1, R-TAKE-1: a lease view calls a renewing lease expired
    /// (`LeaseView::state`), so a peer takes over the records of an Edge
    /// that lives.
    RenewingLeaseExpired,
    /// R-SEQ-1, R-OVL-2: a node replays a parked run's stall terminal
    /// verbatim on the adopting connection (`RunFrame::replayed`), with
    /// the observation sequence number and evidence of the connection it
    /// was produced on.
    ReplayStaleEvidence,
    /// R-TEN-2: settling a request gives its reservations back twice
    /// (`Tenants::settle`): the Edge's count of what is used drops below
    /// what requests reserved and spent, so budgets admit past their limit.
    DoubleSettle,
    /// R-TEN-2: a further attempt that sends the prompt again is answered
    /// "reserved" without reserving anything (`Tenants::reserve_attempt`),
    /// as before per-attempt reservations: a failover or continuation may
    /// pass its budget by the prompt sent again.
    MissingReservation,
    /// R-TEN-2: an Edge that adopts a dead Edge's parked run holds its
    /// request to nothing (`Tenants::admit_adopted`), as before adoptions
    /// were charged: the run's usage is never charged to its key, its
    /// principal or their budgets.
    AdoptionNotCharged,
    /// R-TEN-1: admission never consults the limits per model
    /// (`Tenants::admit`): a key's or a principal's limit for a model is
    /// not counted, so that model's requests pass it on every Edge.
    IgnoreModelLimits,
    /// R-TEN-1: requests in flight are counted per Edge, as before the
    /// slots shared across Edges (`Tenants::slot_fits` admits up to the
    /// limit on this Edge alone): over several Edges a key has up to
    /// Edges x its limit in flight.
    ConcurrencyPerEdge,
    /// R-TEN-2: an attempt that ends without a usage report is charged
    /// only the estimate of its text, never its prompt
    /// (`Request::unmetered`), as before a cut attempt's input was
    /// charged: the prompt its provider read and bills is charged to no
    /// key.
    CutInputNotCharged,
    /// R-TEN-2, R-TAKE-1: a takeover does not charge what the journal of
    /// an answer it ends without running it holds, nor read the journal
    /// of a run it adopts on a route that does not continue answers
    /// (`Custody`), as before such answers were charged: the text the
    /// dead Edge's run produced is charged to no key.
    EndedTextNotCharged,
    /// R-TAKE-1, R-JRN-3: a takeover ignores the answer's end its journal
    /// holds (`Custody`, `durable::journaled_terminal` not consulted), as
    /// before the fix: an orphan whose writer journaled its end and died
    /// before the record's terminal is ended `incomplete`, or continued
    /// on its pool (its provider called again), instead of ending as its
    /// journal says.
    IgnoreJournaledEnd,
    /// R-PARK-2, R-TAKE-1, R-IDEM-1: a takeover refuses a parked run whose
    /// record holds nothing journaled yet (`durable::takeover_resume_point`
    /// as before the fix): an Edge that died after it started a durable
    /// run and before the run's first event leaves that run to die on its
    /// node; its record ends `incomplete` with no event, which frees its
    /// idempotency key, and a client's retry calls a provider again.
    RefuseUnjournaledPark,
    /// R-IDEM-1: a record that failed or was cut short gives its
    /// idempotency key up even when events of it were journaled
    /// (`journal::superseded` without its "nothing journaled" test): a
    /// retry with the key runs the request again, and an answer already
    /// published in part is answered anew.
    SupersedeWithEvents,
}

impl PlantedBug {
    /// Every planted bug.
    pub const ALL: [PlantedBug; 30] = [
        PlantedBug::DoubleRelease,
        PlantedBug::AcceptStaleGeneration,
        PlantedBug::LowerOnStaleEvidence,
        PlantedBug::SecondTerminal,
        PlantedBug::DispatchBeforeReady,
        PlantedBug::SkipPreSendFence,
        PlantedBug::SkipCancelRelease,
        PlantedBug::DuplicateTerminal,
        PlantedBug::IgnoreGateTimeout,
        PlantedBug::PublishBeforeDurable,
        PlantedBug::AppendIgnoresEpoch,
        PlantedBug::SecondJournalTerminal,
        PlantedBug::TakeoverWithoutRaise,
        PlantedBug::ResumeFromZero,
        PlantedBug::ReplaySkipsAFrame,
        PlantedBug::ReadmitUnretryableStall,
        PlantedBug::KeepLostConnection,
        PlantedBug::AdoptWithoutOwnerWait,
        PlantedBug::RenewingLeaseExpired,
        PlantedBug::ReplayStaleEvidence,
        PlantedBug::DoubleSettle,
        PlantedBug::MissingReservation,
        PlantedBug::IgnoreModelLimits,
        PlantedBug::ConcurrencyPerEdge,
        PlantedBug::AdoptionNotCharged,
        PlantedBug::CutInputNotCharged,
        PlantedBug::EndedTextNotCharged,
        PlantedBug::IgnoreJournaledEnd,
        PlantedBug::RefuseUnjournaledPark,
        PlantedBug::SupersedeWithEvents,
    ];

    /// Whether the bug lives in the request machine (`Request`), which the
    /// dispatcher and watchdog fuzz harnesses do not drive.
    pub fn in_request_machine(self) -> bool {
        matches!(
            self,
            PlantedBug::SkipCancelRelease
                | PlantedBug::DuplicateTerminal
                | PlantedBug::IgnoreGateTimeout
                | PlantedBug::ReadmitUnretryableStall
                | PlantedBug::CutInputNotCharged
        )
    }

    /// Whether the bug lives in the tenants' machine (`Tenants`), which
    /// neither fuzz harness drives.
    pub fn in_tenants_machine(self) -> bool {
        matches!(
            self,
            PlantedBug::DoubleSettle
                | PlantedBug::MissingReservation
                | PlantedBug::AdoptionNotCharged
                | PlantedBug::IgnoreModelLimits
                | PlantedBug::ConcurrencyPerEdge
        )
    }

    /// Whether the bug is planted for a thread ([`plant_in_thread`]) rather
    /// than in one machine: it lives in the journal's rules, the publisher
    /// of durable responses or a node's park machine (one per durable run,
    /// generic over its frames), which neither fuzz harness drives.
    pub fn in_thread_scope(self) -> bool {
        matches!(
            self,
            PlantedBug::PublishBeforeDurable
                | PlantedBug::AppendIgnoresEpoch
                | PlantedBug::SecondJournalTerminal
                | PlantedBug::TakeoverWithoutRaise
                | PlantedBug::ResumeFromZero
                | PlantedBug::ReplaySkipsAFrame
                | PlantedBug::AdoptWithoutOwnerWait
                | PlantedBug::RenewingLeaseExpired
                | PlantedBug::ReplayStaleEvidence
                | PlantedBug::EndedTextNotCharged
                | PlantedBug::IgnoreJournaledEnd
                | PlantedBug::RefuseUnjournaledPark
                | PlantedBug::SupersedeWithEvents
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
            PlantedBug::PublishBeforeDurable => "publish-before-durable",
            PlantedBug::AppendIgnoresEpoch => "append-ignores-epoch",
            PlantedBug::SecondJournalTerminal => "second-journal-terminal",
            PlantedBug::TakeoverWithoutRaise => "takeover-without-raise",
            PlantedBug::ResumeFromZero => "resume-from-zero",
            PlantedBug::ReplaySkipsAFrame => "replay-skips-a-frame",
            PlantedBug::ReadmitUnretryableStall => "readmit-unretryable-stall",
            PlantedBug::KeepLostConnection => "keep-lost-connection",
            PlantedBug::AdoptWithoutOwnerWait => "adopt-without-owner-wait",
            PlantedBug::RenewingLeaseExpired => "renewing-lease-expired",
            PlantedBug::ReplayStaleEvidence => "replay-stale-evidence",
            PlantedBug::DoubleSettle => "double-settle",
            PlantedBug::MissingReservation => "missing-reservation",
            PlantedBug::AdoptionNotCharged => "adoption-not-charged",
            PlantedBug::IgnoreModelLimits => "ignore-model-limits",
            PlantedBug::ConcurrencyPerEdge => "concurrency-per-edge",
            PlantedBug::CutInputNotCharged => "cut-input-not-charged",
            PlantedBug::EndedTextNotCharged => "ended-text-not-charged",
            PlantedBug::IgnoreJournaledEnd => "ignore-journaled-end",
            PlantedBug::RefuseUnjournaledPark => "refuse-unjournaled-park",
            PlantedBug::SupersedeWithEvents => "supersede-with-events",
        }
    }

    /// Parse a name from [`PlantedBug::as_str`].
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.as_str() == name)
    }

    fn bit(self) -> u32 {
        1 << (self as u8)
    }
}

/// The bugs planted in one machine; empty unless a test switches one on.
#[derive(Debug, Default)]
pub struct Planted(AtomicU32);

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

thread_local! {
    /// The bugs planted for this thread (see the module docs).
    static THREAD: Cell<u32> = const { Cell::new(0) };
}

/// Switch `bug` on for the current thread: the journal's rules and every
/// publisher running on it see it until [`clear_thread`].
pub fn plant_in_thread(bug: PlantedBug) {
    THREAD.with(|t| t.set(t.get() | bug.bit()));
}

/// Is `bug` switched on for the current thread?
pub fn in_thread(bug: PlantedBug) -> bool {
    THREAD.with(|t| t.get() & bug.bit() != 0)
}

/// Switch every bug of the current thread off.
pub fn clear_thread() {
    THREAD.with(|t| t.set(0));
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
                generation_mark: None,
                known_nodes: None,
                health: crate::edge::health::HealthConfig::default(),
                capacity_from_node: Default::default(),
                parked_hold_ms: 0,
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

    /// Ready generation `g` of node `n` and answer its provider's first
    /// probe `available` (R-HT-5: before that it is not eligible).
    fn ready(d: &mut Dispatcher, g: u64) {
        use crate::edge::dispatch::DispatchOutput;
        assert!(d.ready(T, &NodeId::from("n"), g));
        let tickets: Vec<_> = std::iter::from_fn(|| d.poll_output())
            .filter_map(|o| match o {
                DispatchOutput::ProbeDue { ticket, .. } => Some(ticket),
                _ => None,
            })
            .collect();
        let report = iop_wire::CapabilitiesReport {
            targets: vec![iop_wire::TargetHealth {
                adapter: AdapterKind::Mock,
                target: "t".into(),
                status: iop_wire::ProviderHealth::Available,
                failure_code: None,
                models: vec![],
            }],
            health_observation_seq: 0,
        };
        for ticket in tickets {
            let _ = d.probe_answer(T, &ticket, Ok((&NodeId::from("n"), g, &report)));
        }
        assert!(d.health().is_available(&ProviderId::from("p")));
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

    /// Runs `f` with `bug` planted for this thread, then clears the set
    /// (each test runs on its own thread).
    fn with_thread_bug<T>(bug: PlantedBug, f: impl FnOnce() -> T) -> T {
        plant_in_thread(bug);
        let out = f();
        clear_thread();
        out
    }

    fn record() -> crate::journal::RecordMeta {
        use crate::journal::{CreateOutcome, JournalApi, JournalLimits, NewRecord, check_create};
        let new = NewRecord {
            id: "r".into(),
            principal: "p".into(),
            api: JournalApi::Responses,
            model: "m".into(),
            fingerprint: [0; 32],
            idempotency_key: None,
            background: false,
            request: vec![],
            created_unix_ms: 0,
            owner: "edge".into(),
            key_id: "key".into(),
        };
        match check_create(0, &JournalLimits::default(), 0, None, None, &new) {
            Ok(CreateOutcome::Create(meta)) => meta,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn thread_scoped_bugs_are_per_thread_and_cleared() {
        plant_in_thread(PlantedBug::AppendIgnoresEpoch);
        assert!(in_thread(PlantedBug::AppendIgnoresEpoch));
        assert!(!in_thread(PlantedBug::TakeoverWithoutRaise));
        // That another thread sees nothing is checked outside core, where
        // threads may be spawned (sim/tests/planted_core_bugs.rs).
        clear_thread();
        assert!(!in_thread(PlantedBug::AppendIgnoresEpoch));
        for bug in PlantedBug::ALL {
            assert_eq!(
                bug.in_thread_scope(),
                matches!(
                    bug,
                    PlantedBug::PublishBeforeDurable
                        | PlantedBug::AppendIgnoresEpoch
                        | PlantedBug::SecondJournalTerminal
                        | PlantedBug::TakeoverWithoutRaise
                        | PlantedBug::ResumeFromZero
                        | PlantedBug::ReplaySkipsAFrame
                        | PlantedBug::AdoptWithoutOwnerWait
                        | PlantedBug::RenewingLeaseExpired
                        | PlantedBug::ReplayStaleEvidence
                        | PlantedBug::EndedTextNotCharged
                        | PlantedBug::IgnoreJournaledEnd
                        | PlantedBug::RefuseUnjournaledPark
                        | PlantedBug::SupersedeWithEvents
                )
            );
        }
    }

    #[test]
    fn append_ignores_epoch_accepts_a_fenced_writer() {
        use crate::journal::{JournalEvent, JournalLimits, check_append, check_raise_epoch};
        let raised = check_raise_epoch(&record(), 1, "edge").expect("raised");
        let event = [JournalEvent {
            seq: 1,
            payload: vec![],
        }];
        let limits = JournalLimits::default();
        assert!(check_append(&limits, &raised, 1, &event).is_err());
        let planted = with_thread_bug(PlantedBug::AppendIgnoresEpoch, || {
            check_append(&limits, &raised, 1, &event)
        });
        assert!(planted.is_ok(), "the fenced epoch-1 writer is accepted");
    }

    #[test]
    fn supersede_with_events_frees_the_key_of_an_answer_published_in_part() {
        use crate::journal::{
            JournalEvent, JournalLimits, RecordStatus, Terminal, check_append, check_finish,
            superseded,
        };
        let limits = JournalLimits::default();
        let event = [JournalEvent {
            seq: 1,
            payload: vec![],
        }];
        let started = check_append(&limits, &record(), 1, &event).expect("appended");
        let terminal = Terminal {
            status: RecordStatus::Incomplete,
            reason: None,
            message: None,
            at_unix_ms: 0,
        };
        let cut = check_finish(&limits, &started, 1, &terminal).expect("ended");
        assert!(!superseded(&cut));
        let planted = with_thread_bug(PlantedBug::SupersedeWithEvents, || superseded(&cut));
        assert!(planted, "its key is given up");
    }

    #[test]
    fn takeover_without_raise_leaves_the_epoch_where_it_was() {
        use crate::journal::check_raise_epoch;
        let raised = with_thread_bug(PlantedBug::TakeoverWithoutRaise, || {
            check_raise_epoch(&record(), 1, "edge")
        });
        assert_eq!(raised.map(|m| m.epoch), Ok(1));
    }

    #[test]
    fn publish_before_durable_publishes_content_before_its_ack() {
        use crate::edge::durable::{JournalSpec, Publisher};
        use crate::edge::request::Delivery;
        let spec = JournalSpec {
            response_id: "r".into(),
            epoch: 1,
            batch_until_terminal: false,
        };
        let text = Delivery::Event(iop_wire::RunEventKind::TextDelta("a".into()));
        let published = with_thread_bug(PlantedBug::PublishBeforeDurable, || {
            let mut p = Publisher::new(spec, 0);
            p.push(text.clone());
            let _write = p.poll_write();
            p.poll_publish()
        });
        assert_eq!(published, Some(text), "published with its append in flight");
    }

    #[test]
    fn second_journal_terminal_writes_the_terminal_again() {
        use crate::edge::durable::{JournalAck, JournalSpec, JournalWrite, Publisher};
        use crate::edge::request::Delivery;
        let spec = JournalSpec {
            response_id: "r".into(),
            epoch: 1,
            batch_until_terminal: false,
        };
        let again = with_thread_bug(PlantedBug::SecondJournalTerminal, || {
            let mut p = Publisher::new(spec, 0);
            p.push(Delivery::Finish);
            assert!(matches!(p.poll_write(), Some(JournalWrite::Finish { .. })));
            p.ack(JournalAck::Finished);
            p.poll_write()
        });
        assert!(
            matches!(again, Some(JournalWrite::Finish { .. })),
            "{again:?}"
        );
    }

    #[test]
    fn resume_from_zero_replays_frames_the_journal_already_holds() {
        use crate::node::park::RunPark;
        let replay = with_thread_bug(PlantedBug::ResumeFromZero, || {
            let mut p: RunPark<u64> = RunPark::new(Duration::from_secs(1), 100);
            for f in 1..=3 {
                p.produced(f, 1, false);
            }
            p.acked(1);
            p.detached(T);
            p.adopt(T, 2).expect("adopted")
        });
        assert_eq!(replay, vec![(2, 2), (3, 3)], "frame 2 again");
    }

    #[test]
    fn replay_skips_a_frame_loses_the_first_frame_after_the_resume_point() {
        use crate::node::park::RunPark;
        let replay = with_thread_bug(PlantedBug::ReplaySkipsAFrame, || {
            let mut p: RunPark<u64> = RunPark::new(Duration::from_secs(1), 100);
            for f in 1..=3 {
                p.produced(f, 1, false);
            }
            p.detached(T);
            p.adopt(T, 1).expect("adopted")
        });
        assert_eq!(replay, vec![(3, 3)], "frame 2 lost");
    }

    #[test]
    fn double_release_breaks_the_lease_count_at_the_fence() {
        let mut d = dispatcher(2);
        let g = register(&mut d);
        ready(&mut d, g);
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
    fn keep_lost_connection_leaves_a_timed_out_generation_dispatchable() {
        let mut d = dispatcher(1);
        let g = register(&mut d);
        ready(&mut d, g);
        d.plant(PlantedBug::KeepLostConnection);
        // Only a loss found by liveness detection is kept.
        d.connection_closed(T, &NodeId::from("n"), g, CloseCode::HeartbeatTimeout);
        assert!(d.registry().is_dispatchable(&NodeId::from("n"), g));
        lease(&mut d, 1);
        d.connection_closed(T, &NodeId::from("n"), g, CloseCode::Normal);
        assert!(!d.registry().is_dispatchable(&NodeId::from("n"), g));
    }

    /// A request of 10 prompt + 20 output tokens at 1 micro-unit a token
    /// under a budget in total of 1,000, admitted on a machine whose claims
    /// are answered in full.
    fn tenants_with_one_request() -> crate::tenant::Tenants {
        use crate::tenant::{Tenants, TenantsConfig, TenantsInput, TenantsOutput};
        let mut t = Tenants::new(TenantsConfig {
            chunk_fraction: 1.0,
            ..TenantsConfig::default()
        });
        let request = one_request(1);
        assert!(t.admit(T, &request).is_ok());
        while let Some(TenantsOutput::Claim {
            counter, amount, ..
        }) = t.poll_output()
        {
            t.handle_input(
                T,
                TenantsInput::Claimed {
                    counter,
                    granted: Some(amount),
                },
            );
        }
        t
    }

    /// Request `ticket` of key "k", principal "p": 10 prompt + 20 output
    /// tokens at 1 micro-unit a token, the principal's budget 1,000.
    fn one_request(ticket: u64) -> crate::tenant::AdmitRequest {
        use crate::tenant::{AdmitRequest, Budget, Held, Limits, Period, Price};
        AdmitRequest {
            ticket,
            key: "k".into(),
            principal: "p".into(),
            key_limits: Limits::default(),
            principal_limits: Limits {
                budget: Some(Budget {
                    limit_micros: 1_000,
                    period: Period::Total,
                }),
                ..Limits::default()
            },
            price: Some(Price {
                input_per_mtok: 1_000_000,
                output_per_mtok: 1_000_000,
                ..Price::default()
            }),
            prompt_tokens_max: 10,
            output_tokens_max: 20,
            unix_ms: 0,
            model: "m".into(),
            durable: false,
            background: false,
            key_held: Held::default(),
            principal_held: Held::default(),
        }
    }

    fn principal_spend() -> crate::tenant::CounterKey {
        crate::tenant::CounterKey {
            subject: crate::tenant::Subject::Principal("p".into()),
            meter: crate::tenant::Meter::Spend,
            window_unix_ms: 0,
        }
    }

    #[test]
    fn double_settle_gives_reservations_back_twice() {
        let mut t = tenants_with_one_request();
        t.plant(PlantedBug::DoubleSettle);
        let used = crate::tenant::TokenUse {
            input: 10,
            output: 2,
            ..Default::default()
        };
        // A second request of 30 holds its reservation meanwhile.
        assert_eq!(t.reserve_attempt(T, 1, 0, 0), Ok(()));
        assert_eq!(t.used(&principal_spend()), Some(60));
        assert!(t.settle(T, 1, used).is_some());
        // 60 reserved, 12 spent: 12 counted, then 60 given back again.
        assert_eq!(t.used(&principal_spend()), Some(0));
    }

    #[test]
    fn missing_reservation_answers_an_attempt_without_reserving() {
        let mut t = tenants_with_one_request();
        t.plant(PlantedBug::MissingReservation);
        assert_eq!(t.reserve_attempt(T, 1, 0, 0), Ok(()));
        assert_eq!(t.reservations_of(1), 1, "no second reservation");
        assert_eq!(t.used(&principal_spend()), Some(30));
    }

    #[test]
    fn adoption_not_charged_holds_the_adopted_request_to_nothing() {
        let mut t = tenants_with_one_request();
        t.plant(PlantedBug::AdoptionNotCharged);
        let mut adopted = one_request(2);
        adopted.key = "k2".into();
        t.admit_adopted(T, &adopted);
        assert_eq!(t.reservations_of(2), 0, "no hold");
        assert_eq!(t.used(&principal_spend()), Some(30), "only request 1's");
    }

    #[test]
    fn skip_pre_send_fence_answers_send_for_a_fenced_lease() {
        let mut d = dispatcher(1);
        let g = register(&mut d);
        ready(&mut d, g);
        let l = lease(&mut d, 1);
        d.plant(PlantedBug::SkipPreSendFence);
        d.connection_closed(T, &NodeId::from("n"), g, CloseCode::HeartbeatTimeout);
        assert!(matches!(d.pre_send(T, l.lease_id), PreSend::Send(_)));
    }
}
