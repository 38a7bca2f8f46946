//! The node connection machine: each rule it owns, as a test.

use chacha20::ChaCha20Rng;
use iop_wire::{
    Cancel, ConfigSnapshot, CredentialProfileState, ExecutionFailure, Heartbeat as HeartbeatMsg,
    NodeReadyResponse, OfferedProvider, PROTOCOL_VERSION,
};
use rand_core::SeedableRng;

use super::*;
use crate::cred::keys::{
    generate_recipient_key, generate_signing_key, recipient_public_key, verifying_key_to_bytes,
};
use crate::cred::{LeaseScope, random_nonce, seal_lease};
use crate::ids::NodeId;
use crate::node::watchdog::Progress;

const GEN: Generation = 7;
const HANDSHAKE: Duration = Duration::from_secs(5);

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn config() -> NodeLinkConfig {
    NodeLinkConfig {
        heartbeat: HeartbeatConfig {
            interval: Duration::from_secs(1),
            wait: Duration::from_secs(2),
        },
        watchdog: WatchdogConfig {
            close_grace: Duration::from_millis(200),
            probe_bound: Duration::from_millis(300),
            max_active_runs: 4,
        },
        handshake_timeout: Some(HANDSHAKE),
    }
}

fn register() -> RegisterRequest {
    RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        node_version: "test".into(),
        providers: vec![OfferedProvider {
            adapter: AdapterKind::Mock,
            target: "m".into(),
            models: vec!["x".into()],
            max_concurrent_runs: None,
        }],
        max_concurrent_runs: 4,
        recipient_public_key: None,
        parked: vec![],
    }
}

fn snapshot() -> ConfigSnapshot {
    ConfigSnapshot::default()
}

fn drain(link: &mut NodeLink) -> Vec<NodeLinkOutput> {
    std::iter::from_fn(|| link.poll_output()).collect()
}

fn control(link: &mut NodeLink, now: Instant, msg: EdgeControl) -> Vec<NodeLinkOutput> {
    link.handle_input(now, NodeLinkInput::Control(msg));
    drain(link)
}

fn accepted(config: ConfigSnapshot) -> EdgeControl {
    EdgeControl::Registered(RegisterResponse::Accepted {
        generation: GEN,
        config,
    })
}

fn ack(generation: Generation, accepted: bool) -> EdgeControl {
    EdgeControl::ReadyAck(NodeReadyResponse {
        generation,
        accepted,
    })
}

/// A connection through its handshake at 0 ms, outputs drained.
fn ready_link() -> NodeLink {
    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    drain(&mut link);
    control(&mut link, at(0), accepted(snapshot()));
    control(&mut link, at(0), ack(GEN, true));
    assert!(link.is_ready());
    link
}

/// Ask the connection to watch a run: its answer, directly.
fn start(
    link: &mut NodeLink,
    now: Instant,
    run_id: RunId,
    carries_lease: bool,
) -> Result<(), FailureCode> {
    link.start_run(
        now,
        RunStart {
            run_id,
            kind: RunKind::Normalized,
            stall_timeout: Duration::from_secs(1),
            deadline: None,
            adapter: AdapterKind::Mock,
            target: "m".into(),
            carries_lease,
        },
    )
}

/// A run the connection watches: admitted by the answer, nothing queued.
fn admit(link: &mut NodeLink, now: Instant, run_id: RunId) {
    assert_eq!(start(link, now, run_id, false), Ok(()));
    assert!(drain(link).is_empty());
}

fn input(link: &mut NodeLink, now: Instant, input: NodeLinkInput) -> Vec<NodeLinkOutput> {
    link.handle_input(now, input);
    drain(link)
}

/// Offer a run's provider outputs: the answer, and what else is queued.
fn offer(
    link: &mut NodeLink,
    now: Instant,
    run_id: RunId,
    events: Vec<ProviderEvent>,
) -> (Vec<Emission>, Vec<NodeLinkOutput>) {
    let emissions = link.offer(now, run_id, events);
    (emissions, drain(link))
}

/// Outputs other than the heartbeat's pings.
fn without_pings(outputs: Vec<NodeLinkOutput>) -> Vec<NodeLinkOutput> {
    outputs
        .into_iter()
        .filter(|o| !matches!(o, NodeLinkOutput::Send(NodeControl::Ping(_))))
        .collect()
}

fn ended(outputs: &[NodeLinkOutput]) -> Vec<(RunId, RunTerminal, bool)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            NodeLinkOutput::RunEnded {
                run_id,
                terminal,
                forwarded,
                ..
            } => Some((*run_id, terminal.clone(), *forwarded)),
            _ => None,
        })
        .collect()
}

#[test]
fn the_handshake_registers_then_readies_the_accepted_generation() {
    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    assert_eq!(
        drain(&mut link),
        vec![NodeLinkOutput::Send(NodeControl::Register(register()))]
    );
    assert_eq!(link.generation(), None);
    let out = control(&mut link, at(1), accepted(snapshot()));
    assert_eq!(
        out,
        vec![
            NodeLinkOutput::Managed(vec![]),
            NodeLinkOutput::Send(NodeControl::Ready(NodeReadyRequest { generation: GEN })),
        ]
    );
    assert_eq!(link.generation(), Some(GEN));
    assert!(!link.is_ready());
    // A second answer to the one registration changes nothing.
    assert!(control(&mut link, at(2), accepted(snapshot())).is_empty());
    let out = control(&mut link, at(3), ack(GEN, true));
    assert_eq!(out, vec![NodeLinkOutput::Ready { generation: GEN }]);
    assert!(link.is_ready());
    // Past the handshake bound nothing ends a ready connection.
    link.handle_timeout(at(6_000));
    assert!(
        !drain(&mut link)
            .iter()
            .any(|o| matches!(o, NodeLinkOutput::End(_)))
    );
}

#[test]
fn a_refused_registration_or_readiness_ends_the_connection() {
    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    drain(&mut link);
    let out = control(
        &mut link,
        at(1),
        EdgeControl::Registered(RegisterResponse::Rejected {
            reason: RejectReason::UnknownNode,
            message: "who".into(),
            edge_protocol_version: PROTOCOL_VERSION,
        }),
    );
    let end = LinkEnd::Rejected {
        reason: RejectReason::UnknownNode,
        message: "who".into(),
    };
    assert_eq!(end.close_code(), CloseCode::RegistrationRejected);
    assert_eq!(out, vec![NodeLinkOutput::End(end)]);
    // Over: a late acceptance is ignored.
    assert!(control(&mut link, at(2), accepted(snapshot())).is_empty());

    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    control(&mut link, at(0), accepted(snapshot()));
    let out = control(&mut link, at(1), ack(GEN, false));
    assert!(matches!(
        out.as_slice(),
        [NodeLinkOutput::End(LinkEnd::Rejected {
            reason: RejectReason::InvalidRegistration,
            ..
        })]
    ));
    assert!(!link.is_ready());
}

#[test]
fn a_readiness_answer_for_another_generation_is_a_protocol_error() {
    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    control(&mut link, at(0), accepted(snapshot()));
    let out = control(&mut link, at(1), ack(GEN + 1, true));
    assert_eq!(
        out,
        vec![NodeLinkOutput::End(LinkEnd::Closed(
            CloseCode::ProtocolError
        ))]
    );
}

#[test]
fn a_handshake_not_done_in_time_ends_the_connection_at_its_bound() {
    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    drain(&mut link);
    control(&mut link, at(10), accepted(snapshot()));
    let bound = at(0) + HANDSHAKE;
    assert!(link.poll_timeout().is_some_and(|t| t <= bound));
    link.handle_timeout(Instant::from_micros(bound.as_micros() - 1));
    assert!(
        !drain(&mut link)
            .iter()
            .any(|o| matches!(o, NodeLinkOutput::End(_)))
    );
    link.handle_timeout(bound);
    let out = drain(&mut link);
    assert!(out.contains(&NodeLinkOutput::End(LinkEnd::HandshakeTimedOut)));
    assert_eq!(
        LinkEnd::HandshakeTimedOut.close_code(),
        CloseCode::ProtocolError
    );
}

/// R-HB-1, R-HB-2: pings are answered from the first frame, and a peer
/// that stops answering ends the connection.
#[test]
fn r_hb_2_a_silent_edge_ends_the_connection_with_a_heartbeat_timeout() {
    let mut link = ready_link();
    let out = control(
        &mut link,
        at(100),
        EdgeControl::Ping(HeartbeatMsg { seq: 9 }),
    );
    assert_eq!(
        out,
        vec![NodeLinkOutput::Send(NodeControl::Pong(HeartbeatMsg {
            seq: 9
        }))]
    );
    link.handle_timeout(at(1_000));
    assert_eq!(
        drain(&mut link),
        vec![NodeLinkOutput::Send(NodeControl::Ping(HeartbeatMsg {
            seq: 1
        }))]
    );
    link.handle_timeout(at(3_000));
    assert_eq!(
        drain(&mut link),
        vec![NodeLinkOutput::End(LinkEnd::Closed(
            CloseCode::HeartbeatTimeout
        ))]
    );
    // Over: pings go unanswered, nothing more is sent.
    assert!(
        control(
            &mut link,
            at(3_001),
            EdgeControl::Ping(HeartbeatMsg { seq: 10 })
        )
        .is_empty()
    );
}

#[test]
fn the_edges_closing_ends_the_connection_with_its_code() {
    let mut link = ready_link();
    let out = control(
        &mut link,
        at(5),
        EdgeControl::Closing {
            code: CloseCode::Shutdown,
        },
    );
    assert_eq!(
        out,
        vec![NodeLinkOutput::End(LinkEnd::Closed(CloseCode::Shutdown))]
    );
}

/// R-WD-3, R-WD-6: a provider's own terminal is forwarded by its handler,
/// and the run's one end says so; nothing after it is forwarded.
#[test]
fn r_wd_6_a_forwarded_provider_terminal_is_the_runs_only_terminal() {
    let mut link = ready_link();
    admit(&mut link, at(10), 1);
    assert!(link.is_attached(1));
    // The answer is the call's return value; the run's end is an output.
    let (emissions, out) = offer(
        &mut link,
        at(20),
        1,
        vec![
            ProviderEvent::Neutral,
            ProviderEvent::Progress(Progress::Content),
            ProviderEvent::Returned(ProviderOutcome::Completed),
        ],
    );
    assert_eq!(emissions, vec![Emission::Forward; 3]);
    assert_eq!(
        out,
        vec![NodeLinkOutput::RunEnded {
            run_id: 1,
            adapter: AdapterKind::Mock,
            target: "m".into(),
            terminal: RunTerminal::Completed,
            forwarded: true,
        }]
    );
    assert_eq!(link.attached_runs(), 0);
    let (emissions, out) = offer(
        &mut link,
        at(30),
        1,
        vec![ProviderEvent::Progress(Progress::Content)],
    );
    assert_eq!(emissions, vec![Emission::Fenced]);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(link.fenced_outputs(), 1);
}

/// R-WD-2..5: a stall cancels the call, probes the run's exact target and
/// ends the run with the watchdog's terminal, which its handler writes.
#[test]
fn r_wd_3_a_stalled_run_ends_with_the_watchdogs_terminal_for_its_handler_to_write() {
    let mut link = ready_link();
    admit(&mut link, at(0), 1);
    // Output before the stall is forwarded; it is not the run's terminal.
    let (emissions, _) = offer(
        &mut link,
        at(0),
        1,
        vec![ProviderEvent::Progress(Progress::Content)],
    );
    assert_eq!(emissions, vec![Emission::Forward]);
    link.handle_timeout(at(1_000));
    assert_eq!(
        without_pings(drain(&mut link)),
        vec![
            NodeLinkOutput::CancelProvider { run_id: 1 },
            NodeLinkOutput::StartProbe {
                run_id: 1,
                adapter: AdapterKind::Mock,
                target: "m".into(),
            },
        ]
    );
    assert!(
        input(
            &mut link,
            at(1_050),
            NodeLinkInput::ProviderDropped { run_id: 1 }
        )
        .is_empty()
    );
    let out = input(
        &mut link,
        at(1_100),
        NodeLinkInput::ProbeDone {
            run_id: 1,
            outcome: ProbeOutcome::Healthy,
        },
    );
    assert!(matches!(
        out.first(),
        Some(NodeLinkOutput::StallObserved {
            run_id: 1,
            retryable: true,
            ..
        })
    ));
    let ends = ended(&out);
    assert_eq!(ends.len(), 1);
    let (run_id, terminal, forwarded) = &ends[0];
    assert_eq!(*run_id, 1);
    assert!(!forwarded, "the watchdog's terminal has no other writer");
    assert!(
        matches!(terminal, RunTerminal::Failed(f) if f.code == FailureCode::ResponseStalled && f.retryable)
    );
}

/// R-WD-5: a probe for a run that already left has no target: no verdict,
/// and the stall still ends.
#[test]
fn r_wd_5_a_stall_of_a_run_that_left_is_not_probed() {
    let mut link = ready_link();
    admit(&mut link, at(0), 1);
    admit(&mut link, at(0), 2);
    let out = input(&mut link, at(10), NodeLinkInput::RunLeft { run_id: 1 });
    assert_eq!(
        out,
        vec![NodeLinkOutput::RunDetached {
            run_id: 1,
            adapter: AdapterKind::Mock,
            target: "m".into(),
        }]
    );
    link.handle_timeout(at(1_000));
    let out = drain(&mut link);
    assert!(
        out.iter().all(|o| !matches!(
            o,
            NodeLinkOutput::CancelProvider { run_id: 1 }
                | NodeLinkOutput::StartProbe { run_id: 1, .. }
                | NodeLinkOutput::RunEnded { run_id: 1, .. }
        )),
        "{out:?}"
    );
    assert!(out.contains(&NodeLinkOutput::CancelProvider { run_id: 2 }));
}

/// R-PARK-1: a run that leaves (a durable run parking) gets nothing from
/// its old connection: no cancel, no terminal.
#[test]
fn r_park_1_a_run_that_left_gets_no_terminal_from_its_old_connection() {
    let mut link = ready_link();
    admit(&mut link, at(0), 1);
    let out = input(&mut link, at(5), NodeLinkInput::RunLeft { run_id: 1 });
    assert_eq!(ended(&out), vec![]);
    assert_eq!(out.len(), 1);
    assert!(
        input(&mut link, at(6), NodeLinkInput::RunLeft { run_id: 1 }).is_empty(),
        "a run leaves once"
    );
}

/// R-DISC-1: when the connection is gone every attached run leaves it,
/// and no terminal or cancel is given to a handler that no longer has a
/// stream.
#[test]
fn r_disc_1_a_lost_connection_detaches_every_run() {
    let mut link = ready_link();
    admit(&mut link, at(0), 1);
    admit(&mut link, at(0), 2);
    let out = input(&mut link, at(10), NodeLinkInput::Disconnected);
    let detached: Vec<RunId> = out
        .iter()
        .filter_map(|o| match o {
            NodeLinkOutput::RunDetached { run_id, .. } => Some(*run_id),
            _ => None,
        })
        .collect();
    assert_eq!(detached, vec![1, 2]);
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(link.attached_runs(), 0);
    assert_eq!(link.watchdog().active_runs(), 0);
    assert!(!link.is_ready());
    // A run asked for afterwards is refused.
    assert_eq!(
        start(&mut link, at(11), 3, false),
        Err(FailureCode::TransportClosed)
    );
}

/// R-CRED-3: a reused run id carrying a lease is a replay; without one it
/// is the Edge's invalid request.
#[test]
fn r_cred_3_a_reused_run_id_with_a_lease_is_refused_as_a_replay() {
    let mut link = ready_link();
    admit(&mut link, at(0), 1);
    assert_eq!(
        start(&mut link, at(1), 1, true),
        Err(FailureCode::CredentialRejected)
    );
    assert_eq!(
        start(&mut link, at(1), 1, false),
        Err(FailureCode::InvalidRequest)
    );
}

/// The one limit a connection's watchdog has is the node's own: the
/// driver admits against the node's run count first; a run past the
/// watchdog's bound is the Edge's invalid request.
#[test]
fn a_run_past_the_watchdogs_bound_is_refused() {
    let mut link = ready_link();
    for run_id in 1..=4 {
        admit(&mut link, at(0), run_id);
    }
    assert_eq!(
        start(&mut link, at(0), 5, false),
        Err(FailureCode::InvalidRequest)
    );
}

/// R-SEQ-1: a CAPABILITIES answer takes the connection's next number, after
/// every earlier stall terminal's.
#[test]
fn r_seq_1_observation_numbers_increase_across_stalls_and_answers() {
    let mut link = ready_link();
    let seq = |link: &mut NodeLink| {
        let NodeLinkAnswer::ObservationSeq(seq) =
            link.answer(at(0), NodeLinkQuery::TakeObservationSeq)
        else {
            panic!("answered with another kind");
        };
        assert!(drain(link).is_empty());
        seq
    };
    let first = seq(&mut link);
    admit(&mut link, at(0), 1);
    link.handle_timeout(at(1_000));
    drain(&mut link);
    link.handle_input(
        at(1_010),
        NodeLinkInput::ProbeDone {
            run_id: 1,
            outcome: ProbeOutcome::Failed,
        },
    );
    link.handle_input(at(1_011), NodeLinkInput::ProviderDropped { run_id: 1 });
    let stall_seq = ended(&drain(&mut link))
        .into_iter()
        .find_map(|(_, t, _)| match t {
            RunTerminal::Failed(f) => f.health_observation_seq,
            RunTerminal::Completed => None,
        })
        .expect("the stall ended the run");
    let later = seq(&mut link);
    assert!(
        first < stall_seq && stall_seq < later,
        "{first} {stall_seq} {later}"
    );
}

#[test]
fn a_refresh_is_applied_and_acknowledged_only_when_ready() {
    let managed = vec![ManagedTarget {
        adapter: AdapterKind::Mock,
        target: "m".into(),
        profile: "p".into(),
    }];
    let refreshed = ConfigSnapshot {
        managed_targets: managed.clone(),
        ..snapshot()
    };
    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    drain(&mut link);
    assert!(
        control(
            &mut link,
            at(0),
            EdgeControl::ConfigRefresh(refreshed.clone())
        )
        .is_empty()
    );
    let mut link = ready_link();
    let out = control(&mut link, at(1), EdgeControl::ConfigRefresh(refreshed));
    assert_eq!(
        out,
        vec![
            NodeLinkOutput::Managed(managed.clone()),
            NodeLinkOutput::Send(NodeControl::ConfigApplied { generation: GEN }),
        ]
    );
    assert_eq!(link.managed(), managed.as_slice());
}

#[test]
fn a_signing_key_that_does_not_parse_is_reported() {
    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    drain(&mut link);
    let out = control(
        &mut link,
        at(0),
        accepted(ConfigSnapshot {
            lease_signing_key: Some([0; 32]),
            ..snapshot()
        }),
    );
    assert_eq!(out.first(), Some(&NodeLinkOutput::SigningKeyRefused));
}

#[test]
fn the_edges_cancel_ends_a_run_with_canceled_for_its_handler_to_write() {
    let mut link = ready_link();
    admit(&mut link, at(0), 1);
    let out = control(&mut link, at(5), EdgeControl::Cancel(Cancel { run_id: 1 }));
    assert!(matches!(
        ended(&out).as_slice(),
        [(1, RunTerminal::Failed(f), false)] if f.code == FailureCode::Canceled
    ));
}

/// The credential fixture: one Edge key, one node key, a managed target.
struct Leases {
    rng: ChaCha20Rng,
    edge: ed25519_dalek::SigningKey,
    node: x25519_dalek::StaticSecret,
}

const NOW_MS: u64 = 1_800_000_000_000;

impl Leases {
    fn new() -> Self {
        let mut rng = ChaCha20Rng::seed_from_u64(11);
        let edge = generate_signing_key(&mut rng);
        let node = generate_recipient_key(&mut rng);
        Self { rng, edge, node }
    }

    fn snapshot(&self) -> ConfigSnapshot {
        ConfigSnapshot {
            providers: vec![],
            credential_profiles: vec![CredentialProfileState {
                profile: "prod".into(),
                revision: 2,
                active: true,
            }],
            lease_signing_key: Some(verifying_key_to_bytes(&self.edge.verifying_key())),
            managed_targets: vec![ManagedTarget {
                adapter: AdapterKind::Mock,
                target: "m".into(),
                profile: "prod".into(),
            }],
        }
    }

    fn seal(&mut self, generation: Generation, slot: RunId) -> Vec<u8> {
        let scope = LeaseScope {
            principal: "team".into(),
            route: "x".into(),
            slot,
            profile: "prod".into(),
            target: "m".into(),
            node: NodeId::new("node-1"),
            credential_revision: 2,
            generation,
            issued_at_unix_ms: NOW_MS,
            expires_at_unix_ms: NOW_MS + 60_000,
            nonce: random_nonce(&mut self.rng),
        };
        let recipient = recipient_public_key(&self.node);
        seal_lease(&scope, b"sk-secret", &self.edge, &recipient, &mut self.rng)
            .expect("seals")
            .to_bytes()
    }

    fn link(&self, replay: ReplayCache) -> NodeLink {
        let mut link = NodeLink::new(at(0), config(), register(), replay);
        control(
            &mut link,
            at(0),
            EdgeControl::Registered(RegisterResponse::Accepted {
                generation: GEN,
                config: self.snapshot(),
            }),
        );
        control(&mut link, at(0), ack(GEN, true));
        link
    }

    fn recipient(&self) -> Option<Recipient<'_>> {
        Some(Recipient {
            node: "node-1",
            secret: &self.node,
        })
    }
}

fn run_lease<'a>(run_id: RunId, target: &'a str, lease: Option<&'a [u8]>) -> RunLease<'a> {
    RunLease {
        run_id,
        adapter: AdapterKind::Mock,
        target,
        route: Some("x"),
        lease,
    }
}

/// R-CRED-2, R-CRED-3: a managed target's lease opens once, bound to this
/// connection's generation; a missing, replayed or foreign lease is
/// refused; the replay cache outlives the connection.
#[test]
fn r_cred_3_leases_open_once_on_their_generation_and_fail_closed() {
    let mut fx = Leases::new();
    let mut link = fx.link(ReplayCache::new());
    let lease = fx.seal(GEN, 1);
    let secret = link
        .open_lease(fx.recipient(), run_lease(1, "m", Some(&lease)), NOW_MS)
        .expect("opens")
        .expect("a managed target's secret");
    assert_eq!(secret.expose_secret(), b"sk-secret");
    assert_eq!(
        link.open_lease(fx.recipient(), run_lease(1, "m", Some(&lease)), NOW_MS)
            .err(),
        Some("replayed")
    );
    // A managed target's run without a lease: no fallback credential.
    assert_eq!(
        link.open_lease(fx.recipient(), run_lease(2, "m", None), NOW_MS)
            .err(),
        Some("missing_lease")
    );
    // An unmanaged target needs none.
    assert!(matches!(
        link.open_lease(fx.recipient(), run_lease(2, "other", None), NOW_MS),
        Ok(None)
    ));
    // A lease for an unmanaged target is bound to no profile: refused.
    let stray = fx.seal(GEN, 3);
    assert_eq!(
        link.open_lease(fx.recipient(), run_lease(3, "other", Some(&stray)), NOW_MS)
            .err(),
        Some("binding_mismatch_target")
    );
    // Another generation's lease.
    let old = fx.seal(GEN - 1, 4);
    assert_eq!(
        link.open_lease(fx.recipient(), run_lease(4, "m", Some(&old)), NOW_MS)
            .err(),
        Some("binding_mismatch_generation")
    );
    // Without the node's recipient key nothing opens.
    let fresh = fx.seal(GEN, 5);
    assert_eq!(
        link.open_lease(None, run_lease(5, "m", Some(&fresh)), NOW_MS)
            .err(),
        Some("no_recipient_key")
    );
    // The Edge's next connection keeps refusing the used lease.
    let mut next = fx.link(link.take_replay());
    assert_eq!(
        next.open_lease(fx.recipient(), run_lease(1, "m", Some(&lease)), NOW_MS)
            .err(),
        Some("replayed")
    );
    assert!(
        next.open_lease(fx.recipient(), run_lease(5, "m", Some(&fresh)), NOW_MS)
            .is_ok()
    );
}

#[test]
fn without_a_pushed_signing_key_every_lease_is_refused() {
    let mut fx = Leases::new();
    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    control(
        &mut link,
        at(0),
        EdgeControl::Registered(RegisterResponse::Accepted {
            generation: GEN,
            config: ConfigSnapshot {
                lease_signing_key: None,
                ..fx.snapshot()
            },
        }),
    );
    let lease = fx.seal(GEN, 1);
    assert_eq!(
        link.open_lease(fx.recipient(), run_lease(1, "m", Some(&lease)), NOW_MS)
            .err(),
        Some("no_signing_key")
    );
}

/// Inputs, questions, answers and outputs are plain data: they round-trip
/// through serde, so a trace records them as they are.
#[test]
fn inputs_queries_and_answers_round_trip_through_serde() {
    let inputs = vec![
        NodeLinkInput::Control(ack(GEN, true)),
        NodeLinkInput::RunCanceled { run_id: 1 },
        NodeLinkInput::Disconnected,
    ];
    let bytes = postcard::to_allocvec(&inputs).expect("serializes");
    let back: Vec<NodeLinkInput> = postcard::from_bytes(&bytes).expect("parses");
    assert_eq!(back, inputs);
    let queries = vec![
        NodeLinkQuery::StartRun(RunStart {
            run_id: 1,
            kind: RunKind::Tunnel,
            stall_timeout: Duration::from_secs(1),
            deadline: Some(at(9)),
            adapter: AdapterKind::Mock,
            target: "m".into(),
            carries_lease: true,
        }),
        NodeLinkQuery::Offer {
            run_id: 1,
            events: vec![ProviderEvent::Returned(ProviderOutcome::Failed(
                ExecutionFailure::new(FailureCode::ProviderError),
            ))],
        },
        NodeLinkQuery::TakeObservationSeq,
    ];
    let bytes = postcard::to_allocvec(&queries).expect("serializes");
    let back: Vec<NodeLinkQuery> = postcard::from_bytes(&bytes).expect("parses");
    assert_eq!(back, queries);
    let answers = vec![
        NodeLinkAnswer::Started(Ok(())),
        NodeLinkAnswer::Started(Err(FailureCode::CredentialRejected)),
        NodeLinkAnswer::Emissions(vec![Emission::Forward, Emission::Fenced]),
        NodeLinkAnswer::ObservationSeq(3),
    ];
    let bytes = postcard::to_allocvec(&answers).expect("serializes");
    let back: Vec<NodeLinkAnswer> = postcard::from_bytes(&bytes).expect("parses");
    assert_eq!(back, answers);
    let config = config();
    let bytes = postcard::to_allocvec(&config).expect("serializes");
    assert_eq!(
        postcard::from_bytes::<NodeLinkConfig>(&bytes).expect("parses"),
        config
    );
}

/// The connection's timer is exactly its next duty: the handshake bound,
/// then the heartbeat's next ping.
#[test]
fn the_timer_is_the_handshake_bound_then_the_next_ping() {
    let mut link = NodeLink::new(at(500), config(), register(), ReplayCache::new());
    assert_eq!(link.connected_at(), at(500));
    // The heartbeat's first ping (one interval) comes before the bound.
    assert_eq!(link.poll_timeout(), Some(at(1_500)));
    drain(&mut link);
    control(&mut link, at(600), accepted(snapshot()));
    control(&mut link, at(700), ack(GEN, true));
    assert_eq!(link.poll_timeout(), Some(at(1_500)));
    link.handle_timeout(at(1_500));
    // A ping outstanding: its wait.
    assert_eq!(link.poll_timeout(), Some(at(3_500)));
    let mut slow = NodeLink::new(
        at(0),
        NodeLinkConfig {
            handshake_timeout: Some(Duration::from_millis(300)),
            ..config()
        },
        register(),
        ReplayCache::new(),
    );
    assert_eq!(slow.poll_timeout(), Some(at(300)));
    slow.handle_timeout(at(300));
    drain(&mut slow);
    assert_eq!(slow.poll_timeout(), None, "over: nothing is due");
}

#[test]
fn the_attached_runs_and_fenced_outputs_are_counted() {
    let mut link = ready_link();
    admit(&mut link, at(0), 1);
    admit(&mut link, at(0), 2);
    assert_eq!(link.attached_runs(), 2);
    assert!(link.is_attached(2));
    assert!(!link.is_attached(3));
    input(&mut link, at(1), NodeLinkInput::RunLeft { run_id: 2 });
    assert!(!link.is_attached(2));
    offer(
        &mut link,
        at(2),
        2,
        vec![
            ProviderEvent::Progress(Progress::Content),
            ProviderEvent::Neutral,
        ],
    );
    assert_eq!(link.fenced_outputs(), 2);
}

/// One registration per connection: a refusal arriving after the
/// acceptance changes nothing.
#[test]
fn a_refusal_after_the_acceptance_changes_nothing() {
    let mut link = NodeLink::new(at(0), config(), register(), ReplayCache::new());
    drain(&mut link);
    control(&mut link, at(0), accepted(snapshot()));
    let out = control(
        &mut link,
        at(1),
        EdgeControl::Registered(RegisterResponse::Rejected {
            reason: RejectReason::UnknownNode,
            message: "late".into(),
            edge_protocol_version: PROTOCOL_VERSION,
        }),
    );
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(link.generation(), Some(GEN));
}
