//! The Edge's node connection machine: each rule it owns, as a test.

use iop_wire::{Heartbeat as HeartbeatMsg, NodeReadyRequest, ParkedRun, RejectReason, RunKey};

use super::*;
use crate::edge::flood::{MAX_STALE_FRAMES_PER_CONNECTION, PARKED_REPORTS_PER_WINDOW};
use crate::edge::registry::RejectCause;

const GEN: Generation = 4;
const HANDSHAKE: Duration = Duration::from_secs(10);

fn at(ms: u64) -> Instant {
    Instant::from_millis(ms)
}

fn config() -> EdgeLinkConfig {
    EdgeLinkConfig {
        heartbeat: HeartbeatConfig {
            interval: Duration::from_secs(1),
            wait: Duration::from_secs(2),
        },
        handshake_timeout: Some(HANDSHAKE),
    }
}

fn register() -> RegisterRequest {
    RegisterRequest {
        protocol_version: PROTOCOL_VERSION,
        node_version: "test".into(),
        providers: vec![],
        max_concurrent_runs: 4,
        recipient_public_key: None,
        parked: vec![],
    }
}

fn snapshot() -> ConfigSnapshot {
    ConfigSnapshot::default()
}

fn feed(link: &mut EdgeLink, now: Instant, input: EdgeLinkInput) -> Vec<EdgeLinkOutput> {
    link.handle_input(now, input);
    std::iter::from_fn(|| link.poll_output()).collect()
}

fn frame(link: &mut EdgeLink, now: Instant, frame: NodeControl) -> Vec<EdgeLinkOutput> {
    feed(link, now, EdgeLinkInput::Control(frame))
}

fn ready(generation: Generation) -> NodeControl {
    NodeControl::Ready(NodeReadyRequest { generation })
}

/// A connection registered as `GEN`, the node's `Ready` not yet sent.
fn registered() -> EdgeLink {
    let mut link = EdgeLink::new(at(0), config());
    frame(&mut link, at(0), NodeControl::Register(register()));
    feed(
        &mut link,
        at(0),
        EdgeLinkInput::Registered(Ok((GEN, snapshot()))),
    );
    link
}

/// A live connection of `GEN` at 0 ms.
fn live() -> EdgeLink {
    let mut link = registered();
    frame(&mut link, at(0), ready(GEN));
    feed(
        &mut link,
        at(0),
        EdgeLinkInput::ReadyAnswer { accepted: true },
    );
    assert!(link.is_live());
    link
}

fn end(code: CloseCode, generation: Option<Generation>) -> EdgeLinkOutput {
    EdgeLinkOutput::End { code, generation }
}

#[test]
fn the_handshake_registers_then_readies_through_the_dispatcher() {
    let mut link = EdgeLink::new(at(0), config());
    assert_eq!(
        frame(&mut link, at(1), NodeControl::Register(register())),
        vec![EdgeLinkOutput::Register(register())]
    );
    assert_eq!(link.generation(), None);
    assert_eq!(
        feed(
            &mut link,
            at(2),
            EdgeLinkInput::Registered(Ok((GEN, snapshot())))
        ),
        vec![EdgeLinkOutput::Send(EdgeControl::Registered(
            RegisterResponse::Accepted {
                generation: GEN,
                config: snapshot(),
            }
        ))]
    );
    assert_eq!(link.generation(), Some(GEN));
    assert_eq!(
        frame(&mut link, at(3), ready(GEN)),
        vec![EdgeLinkOutput::Ready(GEN)]
    );
    assert_eq!(
        feed(
            &mut link,
            at(4),
            EdgeLinkInput::ReadyAnswer { accepted: true }
        ),
        vec![
            EdgeLinkOutput::Send(EdgeControl::ReadyAck(NodeReadyResponse {
                generation: GEN,
                accepted: true,
            })),
            EdgeLinkOutput::Connected(GEN),
        ]
    );
    assert!(link.is_live());
    // The heartbeat starts at readiness: the first ping one interval on.
    assert_eq!(link.poll_timeout(), Some(at(1_004)));
}

#[test]
fn the_first_frame_must_be_a_registration() {
    let mut link = EdgeLink::new(at(0), config());
    assert_eq!(
        frame(&mut link, at(1), ready(GEN)),
        vec![end(CloseCode::ProtocolError, None)]
    );
    assert!(link.is_over());
    assert_eq!(link.poll_timeout(), None);
    assert!(frame(&mut link, at(2), NodeControl::Register(register())).is_empty());
}

#[test]
fn a_refused_registration_is_sent_then_the_connection_closes_without_a_generation() {
    let mut link = EdgeLink::new(at(0), config());
    frame(&mut link, at(0), NodeControl::Register(register()));
    let rejection = Rejection {
        reason: RejectReason::UnknownNode,
        cause: RejectCause::UnknownNode,
        message: "who".into(),
    };
    assert_eq!(
        feed(&mut link, at(1), EdgeLinkInput::Registered(Err(rejection))),
        vec![
            EdgeLinkOutput::Send(EdgeControl::Registered(RegisterResponse::Rejected {
                reason: RejectReason::UnknownNode,
                message: "who".into(),
                edge_protocol_version: PROTOCOL_VERSION,
            })),
            end(CloseCode::RegistrationRejected, None),
        ]
    );
}

/// R-GEN-2, R-GEN-3: a generation superseded while it registered is refused
/// readiness, and its end is reported.
#[test]
fn r_gen_2_a_superseded_generation_is_refused_readiness_and_ends() {
    let mut link = registered();
    frame(&mut link, at(1), ready(GEN));
    assert_eq!(
        feed(
            &mut link,
            at(2),
            EdgeLinkInput::ReadyAnswer { accepted: false }
        ),
        vec![
            EdgeLinkOutput::Send(EdgeControl::ReadyAck(NodeReadyResponse {
                generation: GEN,
                accepted: false,
            })),
            end(CloseCode::Superseded, Some(GEN)),
        ]
    );
}

/// R-GEN-3: once the dispatcher handed out a generation, every way the
/// connection ends reports it.
#[test]
fn r_gen_3_every_end_after_registration_reports_the_generation() {
    for input in [
        EdgeLinkInput::Lost(CloseCode::Normal),
        EdgeLinkInput::Close(CloseCode::Shutdown),
        EdgeLinkInput::Control(NodeControl::Closing {
            code: CloseCode::Shutdown,
        }),
        EdgeLinkInput::Control(NodeControl::Register(register())),
    ] {
        let code = match &input {
            EdgeLinkInput::Lost(c) | EdgeLinkInput::Close(c) => *c,
            EdgeLinkInput::Control(NodeControl::Closing { code }) => *code,
            _ => CloseCode::ProtocolError,
        };
        let mut link = registered();
        assert_eq!(
            feed(&mut link, at(1), input.clone()),
            vec![end(code, Some(GEN))]
        );
        let mut link = live();
        assert_eq!(feed(&mut link, at(1), input), vec![end(code, Some(GEN))]);
    }
    // Before a generation was handed out there is none to report.
    let mut link = EdgeLink::new(at(0), config());
    frame(&mut link, at(0), NodeControl::Register(register()));
    assert_eq!(
        feed(&mut link, at(1), EdgeLinkInput::Lost(CloseCode::Normal)),
        vec![end(CloseCode::Normal, None)]
    );
}

#[test]
fn a_handshake_not_done_in_time_ends_the_connection_at_its_bound() {
    let mut link = registered();
    let bound = at(0) + HANDSHAKE;
    assert_eq!(link.poll_timeout(), Some(bound));
    link.handle_timeout(Instant::from_micros(bound.as_micros() - 1));
    assert_eq!(link.poll_output(), None);
    link.handle_timeout(bound);
    assert_eq!(
        link.poll_output(),
        Some(end(CloseCode::ProtocolError, Some(GEN)))
    );
}

/// R-GEN-3, R-LIM-4: frames naming another generation are counted as late
/// messages, up to the connection's budget; past it the node is cut off.
#[test]
fn r_lim_4_stale_generation_frames_are_late_messages_until_the_budget() {
    let mut link = registered();
    assert_eq!(
        frame(&mut link, at(1), ready(GEN - 1)),
        vec![EdgeLinkOutput::LateMessage(GEN - 1)]
    );
    frame(&mut link, at(1), ready(GEN));
    feed(
        &mut link,
        at(1),
        EdgeLinkInput::ReadyAnswer { accepted: true },
    );
    // The connection's own generation is no stale frame.
    assert!(frame(&mut link, at(2), ready(GEN)).is_empty());
    assert!(
        frame(
            &mut link,
            at(2),
            NodeControl::ConfigApplied { generation: GEN }
        )
        .is_empty()
    );
    for _ in 1..MAX_STALE_FRAMES_PER_CONNECTION {
        assert_eq!(
            frame(
                &mut link,
                at(3),
                NodeControl::ConfigApplied { generation: 1 }
            ),
            vec![EdgeLinkOutput::LateMessage(1)]
        );
    }
    assert_eq!(
        frame(&mut link, at(4), ready(1)),
        vec![
            EdgeLinkOutput::Flooded(Flood::StaleFrames),
            end(CloseCode::ProtocolError, Some(GEN)),
        ]
    );
}

/// R-PARK-2, R-LIM-4: parked-run reports reach the dispatcher, within
/// their budget per window.
#[test]
fn r_lim_4_parked_reports_are_carried_within_their_budget() {
    let mut link = live();
    let runs = vec![ParkedRun {
        key: RunKey {
            generation: 1,
            run_id: 9,
        },
        response_id: "r".into(),
        adapter: iop_wire::AdapterKind::Mock,
        target: "t".into(),
        first_kept_frame: 1,
        last_frame: 1,
        ended: false,
    }];
    for _ in 0..PARKED_REPORTS_PER_WINDOW {
        assert_eq!(
            frame(&mut link, at(5), NodeControl::Parked { runs: runs.clone() }),
            vec![EdgeLinkOutput::Parked {
                generation: GEN,
                runs: runs.clone(),
            }]
        );
    }
    assert_eq!(
        frame(&mut link, at(5), NodeControl::Parked { runs }),
        vec![
            EdgeLinkOutput::Flooded(Flood::ParkedReports),
            end(CloseCode::ProtocolError, Some(GEN)),
        ]
    );
}

/// R-HB-1, R-HB-2: pings are answered during the handshake; from readiness
/// the Edge pings, and a silent node is cut off.
#[test]
fn r_hb_2_a_silent_node_ends_the_connection_with_a_heartbeat_timeout() {
    let mut link = registered();
    assert_eq!(
        frame(&mut link, at(1), NodeControl::Ping(HeartbeatMsg { seq: 3 })),
        vec![EdgeLinkOutput::Send(EdgeControl::Pong(HeartbeatMsg {
            seq: 3
        }))]
    );
    let mut link = live();
    link.handle_timeout(at(1_000));
    assert_eq!(
        link.poll_output(),
        Some(EdgeLinkOutput::Send(EdgeControl::Ping(HeartbeatMsg {
            seq: 1
        })))
    );
    assert_eq!(link.poll_timeout(), Some(at(3_000)));
    link.handle_timeout(at(3_000));
    assert_eq!(
        std::iter::from_fn(|| link.poll_output()).collect::<Vec<_>>(),
        vec![
            EdgeLinkOutput::HeartbeatTimedOut,
            end(CloseCode::HeartbeatTimeout, Some(GEN)),
        ]
    );
}

#[test]
fn the_hubs_cancels_and_refreshes_go_out_only_once_live() {
    let mut link = registered();
    assert!(feed(&mut link, at(1), EdgeLinkInput::Cancel(7)).is_empty());
    assert!(feed(&mut link, at(1), EdgeLinkInput::Refresh(snapshot())).is_empty());
    let mut link = live();
    assert_eq!(
        feed(&mut link, at(1), EdgeLinkInput::Cancel(7)),
        vec![EdgeLinkOutput::Send(EdgeControl::Cancel(
            iop_wire::Cancel { run_id: 7 }
        ))]
    );
    assert_eq!(
        feed(&mut link, at(1), EdgeLinkInput::Refresh(snapshot())),
        vec![EdgeLinkOutput::Send(EdgeControl::ConfigRefresh(snapshot()))]
    );
}

#[test]
fn inputs_and_outputs_round_trip_through_serde() {
    let inputs = vec![
        EdgeLinkInput::Control(NodeControl::Register(register())),
        EdgeLinkInput::Registered(Ok((GEN, snapshot()))),
        EdgeLinkInput::ReadyAnswer { accepted: true },
        EdgeLinkInput::Lost(CloseCode::Normal),
    ];
    let bytes = postcard::to_allocvec(&inputs).expect("serializes");
    let back: Vec<EdgeLinkInput> = postcard::from_bytes(&bytes).expect("parses");
    assert_eq!(back, inputs);
}

#[test]
fn the_heartbeat_runs_only_while_live() {
    let mut link = registered();
    assert!(link.heartbeat().is_none());
    assert!(!link.is_over());
    frame(&mut link, at(0), ready(GEN));
    feed(
        &mut link,
        at(0),
        EdgeLinkInput::ReadyAnswer { accepted: true },
    );
    assert!(!link.is_over());
    link.handle_timeout(at(1_000));
    assert_eq!(link.heartbeat().map(Heartbeat::pings_sent), Some(1));
    feed(&mut link, at(1_001), EdgeLinkInput::Lost(CloseCode::Normal));
    assert!(link.is_over());
    assert!(link.heartbeat().is_none());
}

/// A control stream the node ends before readiness is a protocol error
/// (the handshake was not done); once live it is a normal end.
#[test]
fn a_stream_ended_before_readiness_is_a_protocol_error() {
    let mut link = registered();
    assert_eq!(
        feed(&mut link, at(1), EdgeLinkInput::StreamEnded),
        vec![end(CloseCode::ProtocolError, Some(GEN))]
    );
    let mut link = live();
    assert_eq!(
        feed(&mut link, at(1), EdgeLinkInput::StreamEnded),
        vec![end(CloseCode::Normal, Some(GEN))]
    );
}
