//! Node execution over real QUIC against the mock provider served over
//! real HTTP: normalized runs, tunnels, the stall watchdog (R-WD-*),
//! cancels, limits and commands.

mod common;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::RunningNode;
use iop_node::mock::{MockScript, MockServer, ProbeHealth};
use iop_transport::{FramedRecv, FramedSend, open_framed};
use iop_wire::{
    AdapterKind, ChatMessage, Command, CommandKind, CommandResult, CommandResultBody, DataRequest,
    FailureCode, GenerationParams, LivenessClassification, ProviderHealth, ProviderTunnelFrame,
    ProviderTunnelRequest, Role, RunApi, RunEvent, RunEventKind, RunRequest, StreamErrorCode,
};

/// An edge with no providers of its own (runs are sent by hand) and one node
/// whose `openai` target points at `mock`.
struct Rig {
    _pki: Pki,
    edge: RunningEdge,
    node: RunningNode,
    conn: quinn::Connection,
}

async fn rig_with(providers: &str, heartbeat_note: &str) -> Rig {
    let pki = Pki::new(&["node-1"]);
    let edge = RunningEdge::start(edge_config(
        &pki,
        0,
        "[[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"m\"\n",
    ))
    .await
    .expect("edge");
    let node = start_node(&pki, "node-1", edge.quic_addr, providers);
    ready_generation(&edge, "node-1").await;
    let (_, link) = edge
        .hub
        .link("node-1".into())
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("node ready {heartbeat_note}"));
    Rig {
        _pki: pki,
        edge,
        conn: link.conn,
        node,
    }
}

async fn rig(mock: &MockServer) -> Rig {
    rig_with(&openai_target("m", mock), "").await
}

fn openai_target(target: &str, mock: &MockServer) -> String {
    format!(
        "[[providers]]\nadapter = \"openai\"\ntarget = \"{target}\"\nbase_url = \"{}\"\n",
        mock.base_url()
    )
}

fn run_request(run_id: u64, model: &str, stall_timeout_ms: u64) -> RunRequest {
    RunRequest {
        run_id,
        session_id: "s".into(),
        adapter: AdapterKind::OpenAi,
        target: "m".into(),
        model: model.into(),
        api: RunApi::Chat,
        messages: vec![ChatMessage {
            role: Role::User,
            content: "hello".into(),
            tool_calls: vec![],
            tool_call_id: None,
            name: None,
            images: Vec::new(),
            cache_control: None,
            documents: Vec::new(),
        }],
        tools: vec![],
        params: GenerationParams::default(),
        response_stall_timeout_ms: stall_timeout_ms,
        deadline_ms: 0,
        credential_lease: None,
        trace_context: None,
        park: None,
        continue_final: false,
    }
}

async fn send_run(conn: &quinn::Connection, req: RunRequest) -> (FramedSend, FramedRecv) {
    let (mut send, recv) = open_framed(conn).await.unwrap();
    send.send(&DataRequest::Run(req)).await.unwrap();
    let _ = send.finish();
    (send, recv)
}

/// Every event until the stream ends; asserts exactly one terminal, last.
async fn collect(recv: &mut FramedRecv) -> Vec<RunEventKind> {
    let mut events = Vec::new();
    while let Some(ev) = recv.recv::<RunEvent>().await.expect("stream") {
        events.push(ev.kind);
    }
    let terminals = events.iter().filter(|e| e.is_terminal()).count();
    assert_eq!(terminals, 1, "exactly one terminal: {events:?}");
    assert!(
        events.last().is_some_and(RunEventKind::is_terminal),
        "terminal is last"
    );
    events
}

fn failure(events: &[RunEventKind]) -> &iop_wire::ExecutionFailure {
    match events.last() {
        Some(RunEventKind::Failed(f)) => f,
        other => panic!("expected a failure terminal, got {other:?}"),
    }
}

fn text(events: &[RunEventKind]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            RunEventKind::TextDelta(t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn normal_stream_carries_text_tool_calls_and_usage() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let (_s, mut recv) = send_run(&rig.conn, run_request(1, "mock:tokens=5", 0)).await;
        let events = collect(&mut recv).await;
        assert!(!text(&events).is_empty());
        assert!(
            matches!(
                events.last(),
                Some(RunEventKind::Completed { usage: Some(u), .. }) if u.completion_tokens == 5
            ) || events.iter().any(|e| matches!(e, RunEventKind::Usage(_)))
        );

        let (_s, mut recv) = send_run(&rig.conn, run_request(2, "mock:tool_call=1", 0)).await;
        let events = collect(&mut recv).await;
        assert!(
            events
                .iter()
                .any(|e| matches!(e, RunEventKind::ToolCallDelta(d) if d.name.is_some())),
            "{events:?}"
        );
        assert!(matches!(
            events.last(),
            Some(RunEventKind::Completed {
                finish_reason: iop_wire::FinishReason::ToolCalls,
                ..
            })
        ));
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn prefill_longer_than_the_heartbeat_wait_completes_without_heartbeat_timeout() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let prefill = HB_WAIT_MS * 3;
        let (_s, mut recv) = send_run(
            &rig.conn,
            run_request(1, &format!("mock:prefill_ms={prefill},tokens=3"), 0),
        )
        .await;
        let events = collect(&mut recv).await;
        assert!(matches!(
            events.last(),
            Some(RunEventKind::Completed { .. })
        ));
        let snap = rig.edge.hub.snapshot().await.unwrap();
        assert_eq!(snap.closes_by_reason.get("heartbeat_timeout"), None);
        assert_eq!(snap.fences, 0, "the connection never dropped");
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

async fn stall_with_health(health: ProbeHealth) -> iop_wire::ExecutionFailure {
    let script = MockScript {
        health,
        ..MockScript::default()
    };
    let mock = MockServer::start(script).await.unwrap();
    let rig = rig(&mock).await;
    let (_s, mut recv) = send_run(&rig.conn, run_request(1, "mock:stall_after=2", 300)).await;
    let events = collect(&mut recv).await;
    assert_eq!(text(&events).split_whitespace().count(), 2, "{events:?}");
    let f = failure(&events).clone();
    assert_eq!(f.code, FailureCode::ResponseStalled);
    // R-SEQ-1: the Edge's own capabilities probe on readiness may already
    // have taken 1 on this connection; the stall takes the next one.
    assert!(
        f.health_observation_seq
            .is_some_and(|s| (1..=3).contains(&s)),
        "{:?}",
        f.health_observation_seq
    );
    let stall = f.stall.expect("stall metadata");
    assert_eq!(stall.stall_timeout_ms, 300);
    assert_eq!(
        rig.node
            .shared()
            .stalls
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    rig.node.shutdown().await.unwrap();
    rig.edge.shutdown().await;
    f
}

#[tokio::test]
async fn stall_with_a_healthy_probe_is_available_request_stalled() {
    bounded(async {
        let f = stall_with_health(ProbeHealth::Ok).await;
        assert_eq!(f.provider_health, Some(ProviderHealth::Available));
        assert_eq!(
            f.liveness_classification,
            Some(LivenessClassification::RequestStalled)
        );
    })
    .await;
}

#[tokio::test]
async fn stall_with_an_unhealthy_probe_is_unavailable_provider_unhealthy() {
    bounded(async {
        let f = stall_with_health(ProbeHealth::Unhealthy).await;
        assert_eq!(f.provider_health, Some(ProviderHealth::Unavailable));
        assert_eq!(
            f.liveness_classification,
            Some(LivenessClassification::ProviderUnhealthy)
        );
    })
    .await;
}

#[tokio::test]
async fn stall_with_a_hanging_probe_is_unknown_health_unknown() {
    bounded(async {
        let f = stall_with_health(ProbeHealth::Hang).await;
        assert_eq!(f.provider_health, Some(ProviderHealth::Unknown));
        assert_eq!(
            f.liveness_classification,
            Some(LivenessClassification::HealthUnknown)
        );
    })
    .await;
}

#[tokio::test]
async fn invalid_stall_timeout_is_rejected_before_any_provider_request() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let (_s, mut recv) = send_run(&rig.conn, run_request(1, "mock", 5)).await;
        let events = collect(&mut recv).await;
        assert_eq!(failure(&events).code, FailureCode::InvalidRequest);
        assert_eq!(mock.requests(), 0, "no provider request was made");
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn cancel_by_stream_reset_closes_the_provider_request() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let (mut send, mut recv) =
            send_run(&rig.conn, run_request(1, "mock:tokens=1000,tps=20", 0)).await;
        // Wait for the first content, then cancel.
        loop {
            let ev = recv.recv::<RunEvent>().await.unwrap().expect("event");
            if matches!(ev.kind, RunEventKind::TextDelta(_)) {
                break;
            }
        }
        let _ = send.reset(StreamErrorCode::Canceled);
        let _ = recv.stop(StreamErrorCode::Canceled);
        mock.wait_for(|s| s.in_flight == 0).await;
        assert!(mock.disconnects() >= 1);
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn disconnect_cancels_every_run_and_closes_the_provider_requests() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let mut streams = Vec::new();
        for i in 0..3 {
            streams
                .push(send_run(&rig.conn, run_request(i + 1, "mock:tokens=1000,tps=20", 0)).await);
        }
        mock.wait_for(|s| s.in_flight == 3).await;
        // The edge drops the connection (R-DISC-1 on the node).
        RunningEdge::close(&rig.conn, iop_wire::CloseCode::ProtocolError);
        mock.wait_for(|s| s.in_flight == 0).await;
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn node_over_its_run_limit_answers_node_overloaded_without_calling_the_provider() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let pki = Pki::new(&["node-1"]);
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"m\"\n",
        ))
        .await
        .unwrap();
        let mut cfg = node_config(&pki, "node-1", edge.quic_addr, &openai_target("m", &mock));
        cfg.node.max_concurrent_runs = 1;
        let node = RunningNode::start(cfg);
        ready_generation(&edge, "node-1").await;
        let (_, link) = edge.hub.link("node-1".into()).await.unwrap().unwrap();
        mock.reset_counts();
        let (_a, _ra) = send_run(&link.conn, run_request(1, "mock:tokens=1000,tps=20", 0)).await;
        mock.wait_for(|s| s.requests == 1).await;
        let (_b, mut rb) = send_run(&link.conn, run_request(2, "mock", 0)).await;
        let events = collect(&mut rb).await;
        assert_eq!(failure(&events).code, FailureCode::NodeOverloaded);
        assert_eq!(
            mock.requests(),
            1,
            "the second run never reached the provider"
        );
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn tunnel_relays_head_body_and_one_terminal() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let (mut send, mut recv) = open_framed(&rig.conn).await.unwrap();
        let body = br#"{"model":"mock:tokens=4","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
        send.send(&DataRequest::Tunnel(ProviderTunnelRequest {
            run_id: 9,
            session_id: "s".into(),
            adapter: AdapterKind::OpenAi,
            target: "m".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: vec![("content-type".into(), "application/json".into())],
            body: body.to_vec(),
            response_stall_timeout_ms: 0,
            deadline_ms: 0,
            credential_lease: None,
            trace_context: None,
        }))
        .await
        .unwrap();
        let mut frames = Vec::new();
        while let Some(f) = recv.recv::<ProviderTunnelFrame>().await.unwrap() {
            frames.push(f);
        }
        assert!(matches!(frames.first(), Some(ProviderTunnelFrame::Head { status: 200, .. })));
        assert_eq!(frames.iter().filter(|f| f.is_terminal()).count(), 1);
        assert!(matches!(frames.last(), Some(ProviderTunnelFrame::End)));
        let body: Vec<u8> = frames
            .iter()
            .filter_map(|f| match f {
                ProviderTunnelFrame::Body(b) => Some(b.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        let body = String::from_utf8(body).unwrap();
        assert!(body.contains("data: [DONE]"), "{body}");
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn commands_answer_transport_status_and_capabilities() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let mut last_seq = 0;
        for (id, kind) in [
            (1, CommandKind::TransportStatus),
            (2, CommandKind::Capabilities { target: None }),
            (3, CommandKind::Capabilities { target: None }),
        ] {
            let (mut send, mut recv) = open_framed(&rig.conn).await.unwrap();
            send.send(&DataRequest::Command(Command {
                command_id: id,
                session_id: "c".into(),
                kind,
            }))
            .await
            .unwrap();
            let result = recv.recv::<CommandResult>().await.unwrap().expect("result");
            assert_eq!(result.command_id, id);
            match result.body {
                CommandResultBody::TransportStatus(s) => {
                    assert_eq!(Some(s.generation), rig.node.generation());
                    assert_eq!(s.max_concurrent_runs, 256);
                }
                CommandResultBody::Capabilities(c) => {
                    assert_eq!(c.targets.len(), 1);
                    assert_eq!(c.targets[0].status, ProviderHealth::Available);
                    assert!(c.health_observation_seq > last_seq, "R-SEQ-1: increasing");
                    last_seq = c.health_observation_seq;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(mock.requests(), 0, "probes are not provider requests");
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn ollama_adapter_runs_against_an_ollama_shaped_server() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let providers = format!(
            "[[providers]]\nadapter = \"ollama\"\ntarget = \"o\"\nbase_url = \"{}\"\n",
            mock.base_url()
        );
        let rig = rig_with(&providers, "").await;
        let mut req = run_request(1, "mock:tokens=3", 0);
        req.adapter = AdapterKind::Ollama;
        req.target = "o".into();
        let (_s, mut recv) = send_run(&rig.conn, req.clone()).await;
        let events = collect(&mut recv).await;
        assert!(!text(&events).is_empty());
        req.run_id = 2;
        req.api = RunApi::Generate;
        let (_s, mut recv) = send_run(&rig.conn, req).await;
        let events = collect(&mut recv).await;
        assert!(matches!(
            events.last(),
            Some(RunEventKind::Completed { .. })
        ));
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

/// A provider that stalls after two tokens and would only resume long after
/// the stall terminal: a hung call.
const HUNG_AFTER_TWO_TOKENS: &str = "mock:stall_after=2,resume_after_ms=5000,tokens=4";

/// Well below the hung provider's resume: the request must be closed by the
/// claim itself, not by the provider finishing.
const CANCEL_SEEN_WITHIN: std::time::Duration = std::time::Duration::from_millis(2500);

/// After a stall terminal: the mock saw its request canceled (dropped by the
/// node, not finished by the provider), nothing arrived late, one stall.
async fn assert_provider_call_was_canceled(rig: &Rig, mock: &MockServer) {
    let stats = tokio::time::timeout(CANCEL_SEEN_WITHIN, mock.wait_for(|s| s.in_flight == 0))
        .await
        .expect("the claim closes the provider request (R-WD-2)");
    assert_eq!(stats.disconnects, 1, "canceled, not finished: {stats:?}");
    let shared = rig.node.shared();
    assert_eq!(shared.stalls.load(std::sync::atomic::Ordering::Relaxed), 1);
    // The dropped call produced nothing after the claim (R-WD-6 fencing of
    // late output stays covered by core's watchdog tests).
    assert_eq!(
        shared
            .fenced_late_outputs
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test]
async fn stall_claim_cancels_the_hung_provider_call_and_the_terminal_is_retryable() {
    bounded(async {
        // R-WD-2: the claim cancels the provider call, so a hung request
        // stops holding the provider's slot; it ended within the close
        // grace, so the stall is retryable (R-WD-4).
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let (_s, mut recv) = send_run(&rig.conn, run_request(1, HUNG_AFTER_TWO_TOKENS, 300)).await;
        let events = collect(&mut recv).await;
        let f = failure(&events);
        assert_eq!(f.code, FailureCode::ResponseStalled);
        assert!(f.retryable, "the call ended at the claim, within the grace");
        assert_eq!(
            text(&events).split_whitespace().count(),
            2,
            "no late tokens are forwarded"
        );
        assert_provider_call_was_canceled(&rig, &mock).await;
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn stall_claim_cancels_the_hung_provider_call_of_a_tunnel_too() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let (mut send, mut recv) = open_framed(&rig.conn).await.unwrap();
        let body = format!(
            r#"{{"model":"{HUNG_AFTER_TWO_TOKENS}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}"#
        );
        send.send(&DataRequest::Tunnel(ProviderTunnelRequest {
            run_id: 5,
            session_id: "s".into(),
            adapter: AdapterKind::OpenAi,
            target: "m".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: vec![("content-type".into(), "application/json".into())],
            body: body.into_bytes(),
            response_stall_timeout_ms: 300,
            deadline_ms: 0,
            credential_lease: None,
            trace_context: None,
        }))
        .await
        .unwrap();
        let mut frames = Vec::new();
        while let Some(f) = recv.recv::<ProviderTunnelFrame>().await.unwrap() {
            frames.push(f);
        }
        assert_eq!(frames.iter().filter(|f| f.is_terminal()).count(), 1);
        match frames.last() {
            Some(ProviderTunnelFrame::Failure(f)) => {
                assert_eq!(f.code, FailureCode::ResponseStalled);
                assert!(f.retryable, "the call ended at the claim, within the grace");
            }
            other => panic!("expected a stall terminal, got {other:?}"),
        }
        let body: Vec<u8> = frames
            .iter()
            .filter_map(|f| match f {
                ProviderTunnelFrame::Body(b) => Some(b.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        let body = String::from_utf8(body).unwrap();
        assert!(!body.contains("tok2"), "no late bytes are forwarded: {body}");
        assert_provider_call_was_canceled(&rig, &mock).await;
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn bad_data_stream_frames_are_closed_with_their_code_and_counted_on_the_node() {
    bounded(async {
        // SPEC §5: a malformed or oversize wire frame closes its stream with
        // a protocol error code, and the node counts it by that code.
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        for (bytes, code) in [
            // A 3-byte frame that is no DataRequest.
            (
                vec![0u8, 0, 0, 3, 0xff, 0xff, 0xff],
                StreamErrorCode::Malformed,
            ),
            // A length prefix far above the maximum frame size.
            (vec![0xff; 4], StreamErrorCode::FrameTooLarge),
        ] {
            let (mut send, recv) = rig.conn.open_bi().await.unwrap();
            send.write_all(&bytes).await.unwrap();
            let _ = send.finish();
            match FramedRecv::new(recv).recv::<RunEvent>().await {
                Err(iop_transport::framed::FramedError::ResetByPeer { code: got, .. }) => {
                    assert_eq!(got, Some(code))
                }
                other => panic!("expected a reset with {code:?}, got {other:?}"),
            }
        }
        let text = rig.node.shared().metrics.render();
        for code in ["malformed", "frame_too_large"] {
            assert_eq!(
                iop_edge::metrics::scrape_value(
                    &text,
                    "iop_node_wire_protocol_errors_total",
                    &[("code", code)]
                ),
                1.0,
                "{text}"
            );
        }
        assert_eq!(mock.requests(), 0, "no provider call for a bad frame");
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn hard_deadline_wins_over_a_coincident_stall() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let mut req = run_request(1, "mock:stall_after=1", 300);
        req.deadline_ms = 300;
        let (_s, mut recv) = send_run(&rig.conn, req).await;
        let events = collect(&mut recv).await;
        assert_eq!(failure(&events).code, FailureCode::DeadlineExceeded);
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn saturated_tunnel_stream_does_not_close_the_connection() {
    bounded(async {
        // A large, fast answer the Edge side does not read for three times
        // the heartbeat wait: flow control stalls the tunnel's stream while
        // heartbeats keep flowing on the control stream.
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let rig = rig(&mock).await;
        let (mut send, mut recv) = open_framed(&rig.conn).await.unwrap();
        let body = br#"{"model":"mock:tokens=60000","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
        send.send(&DataRequest::Tunnel(ProviderTunnelRequest {
            run_id: 77,
            session_id: "s".into(),
            adapter: AdapterKind::OpenAi,
            target: "m".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: vec![("content-type".into(), "application/json".into())],
            body: body.to_vec(),
            response_stall_timeout_ms: 0,
            deadline_ms: 0,
            credential_lease: None,
            trace_context: None,
        }))
        .await
        .unwrap();
        let head = recv.recv::<ProviderTunnelFrame>().await.unwrap();
        assert!(matches!(head, Some(ProviderTunnelFrame::Head { status: 200, .. })));
        tokio::time::sleep(std::time::Duration::from_millis(3 * HB_WAIT_MS)).await;
        let snap = rig.edge.hub.snapshot().await.unwrap();
        assert_eq!(snap.fences, 0, "the connection stayed up: {snap:?}");
        assert!(snap.closes_by_reason.is_empty());
        // Now read everything: the tunnel completes.
        let mut bytes = 0usize;
        let mut terminal = None;
        while let Some(f) = recv.recv::<ProviderTunnelFrame>().await.unwrap() {
            match f {
                ProviderTunnelFrame::Body(b) => bytes += b.len(),
                other => terminal = Some(other),
            }
        }
        assert!(matches!(terminal, Some(ProviderTunnelFrame::End)), "{terminal:?}");
        assert!(bytes > 2 * 1024 * 1024, "large enough to saturate ({bytes} bytes)");
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn ollama_api_command_streams_an_ollama_call() {
    bounded(async {
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let providers = format!(
            "[[providers]]\nadapter = \"ollama\"\ntarget = \"o\"\nbase_url = \"{}\"\n",
            mock.base_url()
        );
        let rig = rig_with(&providers, "").await;
        let (mut send, mut recv) = open_framed(&rig.conn).await.unwrap();
        send.send(&DataRequest::Command(Command {
            command_id: 5,
            session_id: "o".into(),
            kind: CommandKind::OllamaApi(iop_wire::OllamaApiCall {
                target: "o".into(),
                method: "POST".into(),
                path: "/api/generate".into(),
                body: br#"{"model":"mock:tokens=3","prompt":"hi"}"#.to_vec(),
            }),
        }))
        .await
        .unwrap();
        let mut frames = Vec::new();
        while let Some(r) = recv.recv::<CommandResult>().await.unwrap() {
            match r.body {
                CommandResultBody::OllamaApi(f) => frames.push(f),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            frames.first(),
            Some(ProviderTunnelFrame::Head { status: 200, .. })
        ));
        assert!(matches!(frames.last(), Some(ProviderTunnelFrame::End)));
        let body: Vec<u8> = frames
            .iter()
            .filter_map(|f| match f {
                ProviderTunnelFrame::Body(b) => Some(b.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert!(String::from_utf8_lossy(&body).contains("\"done\":true"));
        rig.node.shutdown().await.unwrap();
        rig.edge.shutdown().await;
    })
    .await;
}
