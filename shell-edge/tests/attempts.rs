//! Attempts that never reach a node and handshakes that never finish, over
//! real QUIC and real HTTP: the request's budget governs opening the node
//! stream (R-GATE-1, R-GATE-3), and a generation the hub accepted is fenced
//! whichever way its handshake ends (R-GEN-3).

mod common;

use std::time::{Duration, Instant};

use common::*;
use iop_edge::server::RunningEdge;
use iop_transport::{ClientTls, FramedRecv, FramedSend, QuicTuning, client_endpoint, connect};
use iop_wire::{
    DataRequest, EdgeControl, NodeControl, NodeReadyRequest, PROTOCOL_VERSION, RegisterRequest,
    RegisterResponse, RunEvent, RunEventKind, Usage,
};

const KEY: &str = "sk-test-0123456789abcdef";

/// The request budget of these tests.
const REQUEST_BUDGET_MS: u64 = 1_500;

/// An edge with provider `p` on `node-1` serving model `m`, a short request
/// budget, and health that stays as the first probe answer left it for the
/// whole test.
async fn edge(pki: &Pki) -> RunningEdge {
    write_secret(&pki.path().join("key"), KEY);
    let extra = "[[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"mock\"\nmodels = [\"m\"]\n\
         [[api_keys]]\nprincipal = \"tester\"\nkey_file = \"key\"\n\
         [health]\nprobe_timeout_ms = 60000\nstale_after_ms = 120000\n";
    let mut config = edge_config(pki, 0, extra);
    config.admission.request_budget_ms = REQUEST_BUDGET_MS;
    RunningEdge::start(config).await.expect("edge starts")
}

/// A hand-driven node that lets the Edge open at most `streams` data
/// streams and never accepts any of them.
struct RawNode {
    conn: quinn::Connection,
    send: FramedSend,
    recv: FramedRecv,
}

impl RawNode {
    async fn connect(pki: &Pki, edge: &RunningEdge, streams: u32) -> Self {
        let certs = pki.certs();
        let tls = ClientTls::from_files(
            &certs.join("node-node-1.pem"),
            &certs.join("node-node-1.key"),
            &certs.join("ca.pem"),
        )
        .unwrap();
        let tuning = QuicTuning {
            max_concurrent_bidi_streams: streams,
            ..QuicTuning::default()
        };
        let endpoint = client_endpoint(&tls, &tuning).unwrap();
        let conn = connect(&endpoint, edge.quic_addr, "localhost")
            .await
            .unwrap();
        let (send, recv) = iop_transport::open_framed(&conn).await.unwrap();
        Self { conn, send, recv }
    }

    async fn register(&mut self) -> u64 {
        self.send
            .send(&NodeControl::Register(RegisterRequest {
                protocol_version: PROTOCOL_VERSION,
                node_version: "raw".into(),
                providers: vec![],
                max_concurrent_runs: 4,
                recipient_public_key: None,
                parked: Vec::new(),
            }))
            .await
            .unwrap();
        loop {
            match self.recv.recv::<EdgeControl>().await.unwrap() {
                Some(EdgeControl::Registered(RegisterResponse::Accepted {
                    generation, ..
                })) => {
                    return generation;
                }
                Some(EdgeControl::Registered(other)) => panic!("refused: {other:?}"),
                Some(_) => continue,
                None => panic!("control stream ended"),
            }
        }
    }

    /// Report ready and wait until the Edge accepts it.
    async fn ready(&mut self, generation: u64) {
        self.send
            .send(&NodeControl::Ready(NodeReadyRequest { generation }))
            .await
            .unwrap();
        loop {
            match self.recv.recv::<EdgeControl>().await.unwrap() {
                Some(EdgeControl::ReadyAck(a)) => {
                    assert!(a.accepted);
                    return;
                }
                Some(_) => continue,
                None => panic!("control stream ended"),
            }
        }
    }

    /// Report ready, then answer heartbeats in the background for as long
    /// as the connection lives.
    async fn ready_and_keep_alive(mut self, generation: u64) -> quinn::Connection {
        self.ready(generation).await;
        let conn = self.conn.clone();
        tokio::spawn(async move {
            while let Ok(Some(frame)) = self.recv.recv::<EdgeControl>().await {
                if let EdgeControl::Ping(hb) = frame
                    && self.send.send(&NodeControl::Pong(hb)).await.is_err()
                {
                    return;
                }
            }
        });
        conn
    }
}

/// What a hand-driven node does with a run stream.
#[derive(Clone, Copy)]
enum OnRun {
    /// Start, then send usage reports (never content) until the Edge stops
    /// reading.
    FloodWithoutContent,
    /// Close the whole connection.
    DropConnection,
}

/// Serve the Edge's data streams on `conn`: health probes are answered
/// `available` (R-HT-5: the provider is eligible only then), runs get
/// `on_run`. Returns how many frames were sent on runs.
fn serve_data_streams(
    conn: quinn::Connection,
    on_run: OnRun,
) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = sent.clone();
    tokio::spawn(async move {
        while let Ok((mut send, mut recv)) = iop_transport::accept_framed(&conn).await {
            let conn = conn.clone();
            let counter = counter.clone();
            tokio::spawn(async move {
                let run = match recv.recv::<DataRequest>().await {
                    Ok(Some(DataRequest::Run(run))) => run,
                    Ok(Some(DataRequest::Command(cmd))) => {
                        let _ = send
                            .send(&iop_wire::CommandResult {
                                command_id: cmd.command_id,
                                session_id: cmd.session_id,
                                body: iop_wire::CommandResultBody::Capabilities(
                                    iop_wire::CapabilitiesReport {
                                        targets: vec![iop_wire::TargetHealth {
                                            adapter: iop_wire::AdapterKind::Mock,
                                            target: "mock".into(),
                                            status: iop_wire::ProviderHealth::Available,
                                            failure_code: None,
                                            models: vec!["m".into()],
                                        }],
                                        health_observation_seq: 1,
                                    },
                                ),
                            })
                            .await;
                        let _ = send.finish();
                        std::future::pending::<()>().await;
                        return;
                    }
                    _ => return,
                };
                match on_run {
                    OnRun::DropConnection => conn.close(0u32.into(), b"gone"),
                    OnRun::FloodWithoutContent => {
                        let started = RunEventKind::Started {
                            session_id: run.session_id.clone(),
                        };
                        let usage = RunEventKind::Usage(Usage::tokens(1, 0));
                        for kind in std::iter::once(started).chain(std::iter::repeat(usage)) {
                            let event = RunEvent {
                                run_id: run.run_id,
                                kind,
                            };
                            if send.send(&event).await.is_err() {
                                return;
                            }
                            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    sent
}

async fn chat(edge: &RunningEdge) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", edge.http_addr))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#)
        .send()
        .await
        .expect("http");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

#[tokio::test]
async fn node_sending_only_non_content_frames_fails_the_attempt_at_the_held_bound() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        let mut raw = RawNode::connect(&pki, &edge, 16).await;
        let generation = raw.register().await;
        let conn = raw.ready_and_keep_alive(generation).await;
        ready_generation(&edge, "node-1").await;
        let sent = serve_data_streams(conn, OnRun::FloodWithoutContent);

        let started = Instant::now();
        let (status, body) = chat(&edge).await;
        // The Edge held at most MAX_HELD_DELIVERIES of them, then failed the
        // attempt well before the request's budget.
        assert_eq!(status, 502, "{body}");
        assert!(body.contains("malformed_response"), "{body}");
        assert!(
            started.elapsed() < Duration::from_millis(REQUEST_BUDGET_MS),
            "failed at the bound, not at the budget"
        );
        let held = iop_core::edge::request::MAX_HELD_DELIVERIES as u64;
        assert!(
            sent.load(std::sync::atomic::Ordering::Relaxed) > held,
            "the node sent past the bound"
        );
        wait_for(&edge, "the request to leave the hub", |s| {
            s.leases_in_use == 0 && s.queue_depth == 0 && s.waiters == 0
        })
        .await;
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn request_fenced_with_its_connection_ends_once_and_leaves_no_waiter() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        let before = edge.hub.snapshot().await.unwrap().fences;
        let mut raw = RawNode::connect(&pki, &edge, 16).await;
        let generation = raw.register().await;
        let conn = raw.ready_and_keep_alive(generation).await;
        ready_generation(&edge, "node-1").await;
        let _sent = serve_data_streams(conn, OnRun::DropConnection);

        // R-GEN-3: the generation's fence ends the run with one transport
        // terminal; the request's lease and waiter go with it.
        let (status, body) = chat(&edge).await;
        assert_eq!(status, 502, "{body}");
        let snap = wait_for(&edge, "the fence to clear the hub", |s| {
            s.leases_in_use == 0 && s.waiters == 0 && s.links == 0
        })
        .await;
        assert_eq!(snap.fences, before + 1);
        assert_eq!(node_state(&snap, "node-1").0, None);
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn request_whose_node_stream_cannot_be_opened_ends_within_its_budget() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        // One data stream allowed, and the edge's first health probe takes
        // it and never gets an answer: no request stream can ever open.
        let mut raw = RawNode::connect(&pki, &edge, 1).await;
        let generation = raw.register().await;
        let _conn = raw.ready_and_keep_alive(generation).await;
        ready_generation(&edge, "node-1").await;

        let started = Instant::now();
        let response = reqwest::Client::new()
            .post(format!("http://{}/v1/chat/completions", edge.http_addr))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#)
            .send()
            .await
            .expect("http");
        let elapsed = started.elapsed();
        // R-GATE-3: one error in the API's format once the budget is spent,
        // not a request stuck opening a stream forever.
        assert_eq!(response.status(), 504);
        let body = response.text().await.unwrap();
        assert!(body.contains("budget_expired"), "{body}");
        assert!(
            elapsed >= Duration::from_millis(REQUEST_BUDGET_MS - 100),
            "ended before its budget: {elapsed:?}"
        );
        assert!(
            elapsed < Duration::from_millis(REQUEST_BUDGET_MS + 3_000),
            "ended long after its budget: {elapsed:?}"
        );
        // The lease is released and nothing of the request stays in the hub.
        let snap = wait_for(&edge, "the request to leave the hub", |s| {
            s.leases_in_use == 0 && s.queue_depth == 0 && s.waiters == 0
        })
        .await;
        assert_eq!(node_state(&snap, "node-1"), (Some(generation), true));
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn handshake_ending_after_registration_fences_the_generation() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        let before = edge.hub.snapshot().await.unwrap().fences;
        let mut raw = RawNode::connect(&pki, &edge, 16).await;
        let generation = raw.register().await;
        let snap = edge.hub.snapshot().await.unwrap();
        assert_eq!(node_state(&snap, "node-1"), (Some(generation), false));
        assert_eq!(snap.links, 1);
        // The control stream ends before Ready: the handshake fails after
        // the hub accepted the registration.
        raw.send.finish().unwrap();
        let snap = wait_for(&edge, "the generation to be fenced", |s| {
            node_state(s, "node-1").0.is_none()
        })
        .await;
        assert_eq!(snap.fences, before + 1, "fenced exactly once (R-GEN-3)");
        assert_eq!(snap.links, 0, "no link entry left behind");
        let err = raw.conn.closed().await;
        assert!(
            iop_transport::close_code_of(&err).is_some(),
            "closed with a code: {err:?}"
        );
        // A late message of the fenced generation is ignored and counted.
        let mut again = RawNode::connect(&pki, &edge, 16).await;
        let next = again.register().await;
        assert!(next > generation, "R-GEN-1");
        again
            .send
            .send(&NodeControl::Ready(NodeReadyRequest { generation }))
            .await
            .unwrap();
        wait_for(&edge, "the stale Ready to be counted", |s| {
            s.fenced_messages >= 1
        })
        .await;
        edge.shutdown().await;
    })
    .await;
}

/// R-LIM-4: a node that floods frames of a stale generation is
/// disconnected (protocol error), instead of filling the hub's queue; a few
/// (a reconnect race) are only counted.
#[tokio::test]
async fn a_node_flooding_stale_frames_is_disconnected() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        let mut raw = RawNode::connect(&pki, &edge, 4).await;
        let generation = raw.register().await;
        let stale = NodeControl::Ready(NodeReadyRequest {
            generation: generation.wrapping_add(1000),
        });
        for _ in 0..iop_edge::node_link::MAX_STALE_FRAMES_PER_CONNECTION {
            raw.send.send(&stale).await.unwrap();
        }
        // At the bound the connection is still there and can get ready.
        let conn = raw.conn.clone();
        let mut raw = raw;
        raw.send.send(&stale).await.unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(5), conn.closed())
            .await
            .expect("closed past the bound");
        let code = iop_transport::close_code_of(&closed);
        assert_eq!(code, Some(iop_wire::CloseCode::ProtocolError), "{closed:?}");
        let snap = wait_for(&edge, "the generation fenced", |s| {
            s.closes_by_reason.get("protocol_error").copied() == Some(1)
        })
        .await;
        assert_eq!(
            snap.fenced_messages,
            u64::from(iop_edge::node_link::MAX_STALE_FRAMES_PER_CONNECTION)
        );
        edge.shutdown().await;
    })
    .await;
}

/// R-LIM-4: parked-run reports on a live connection (R-PARK-2) are
/// budgeted per window: a node within it is served, one past it is
/// disconnected (protocol error), so it cannot fill the hub's queue.
#[tokio::test]
async fn a_node_flooding_parked_run_reports_is_disconnected() {
    use iop_core::edge::flood::PARKED_REPORTS_PER_WINDOW;
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        let mut raw = RawNode::connect(&pki, &edge, 4).await;
        let generation = raw.register().await;
        raw.ready(generation).await;
        let report = NodeControl::Parked { runs: Vec::new() };
        for _ in 0..PARKED_REPORTS_PER_WINDOW {
            raw.send.send(&report).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(raw.conn.close_reason().is_none(), "within the budget");
        raw.send.send(&report).await.unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(5), raw.conn.closed())
            .await
            .expect("closed past the budget");
        let code = iop_transport::close_code_of(&closed);
        assert_eq!(code, Some(iop_wire::CloseCode::ProtocolError), "{closed:?}");
        edge.shutdown().await;
    })
    .await;
}
