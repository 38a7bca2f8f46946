//! Transport over real quinn on loopback: registration, readiness,
//! heartbeats, reconnects and generation fencing (R-HB-*, R-GEN-*).

mod common;

use std::time::{Duration, Instant};

use common::*;
use iop_edge::server::RunningEdge;
use iop_transport::{ClientTls, QuicTuning, client_endpoint, connect, open_framed};
use iop_wire::{
    CloseCode, EdgeControl, NodeControl, NodeReadyRequest, PROTOCOL_VERSION, RegisterRequest,
    RegisterResponse, RejectReason,
};

const NODE_PROVIDERS: &str = "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"mock\"\nmodels = [\"m\"]\n\
[[providers]]\nid = \"p2\"\nnode = \"node-2\"\nadapter = \"mock\"\ntarget = \"mock\"\nmodels = [\"m\"]\n";

async fn edge(pki: &Pki) -> RunningEdge {
    RunningEdge::start(edge_config(pki, 0, NODE_PROVIDERS))
        .await
        .expect("edge starts")
}

/// A hand-driven node speaking the raw protocol, for cases a real node
/// would never produce.
struct RawNode {
    conn: quinn::Connection,
    send: iop_transport::FramedSend,
    recv: iop_transport::FramedRecv,
}

impl RawNode {
    async fn connect(pki: &Pki, node: &str, edge: &RunningEdge) -> Self {
        let certs = pki.certs();
        let tls = ClientTls::from_files(
            &certs.join(format!("node-{node}.pem")),
            &certs.join(format!("node-{node}.key")),
            &certs.join("ca.pem"),
        )
        .unwrap();
        let endpoint = client_endpoint(&tls, &QuicTuning::default()).unwrap();
        let conn = connect(&endpoint, edge.quic_addr, "localhost")
            .await
            .unwrap();
        let (send, recv) = open_framed(&conn).await.unwrap();
        Self { conn, send, recv }
    }

    async fn register(&mut self, version: u32) -> RegisterResponse {
        self.send
            .send(&NodeControl::Register(RegisterRequest {
                protocol_version: version,
                node_version: "raw".into(),
                providers: vec![],
                max_concurrent_runs: 1,
                recipient_public_key: None,
                parked: Vec::new(),
            }))
            .await
            .unwrap();
        loop {
            match self.recv.recv::<EdgeControl>().await.unwrap() {
                Some(EdgeControl::Registered(r)) => return r,
                Some(_) => continue,
                None => panic!("control stream ended"),
            }
        }
    }

    async fn ready(&mut self, generation: u64) -> bool {
        self.send
            .send(&NodeControl::Ready(NodeReadyRequest { generation }))
            .await
            .unwrap();
        loop {
            match self.recv.recv::<EdgeControl>().await.unwrap() {
                Some(EdgeControl::ReadyAck(a)) => return a.accepted,
                Some(_) => continue,
                None => panic!("control stream ended"),
            }
        }
    }
}

fn accepted_generation(r: RegisterResponse) -> u64 {
    match r {
        RegisterResponse::Accepted { generation, .. } => generation,
        other => panic!("registration refused: {other:?}"),
    }
}

#[tokio::test]
async fn node_registers_and_becomes_ready_and_dispatch_waits_for_readiness() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let edge = edge(&pki).await;
        let mut raw = RawNode::connect(&pki, "node-1", &edge).await;
        let generation = accepted_generation(raw.register(PROTOCOL_VERSION).await);
        // Registered but not ready: not dispatchable (R-GEN-2).
        let snap = edge.hub.snapshot().await.unwrap();
        assert_eq!(node_state(&snap, "node-1"), (Some(generation), false));
        assert!(edge.hub.link("node-1".into()).await.unwrap().is_none());
        assert!(raw.ready(generation).await);
        let (g, _) = edge
            .hub
            .link("node-1".into())
            .await
            .unwrap()
            .expect("dispatchable");
        assert_eq!(g, generation);

        // A real node does the same on its own.
        let node = start_node(&pki, "node-2", edge.quic_addr, "");
        let g2 = ready_generation(&edge, "node-2").await;
        assert!(g2 > generation, "generations are global and increasing");
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn protocol_version_mismatch_is_rejected_with_a_reason() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        let mut raw = RawNode::connect(&pki, "node-1", &edge).await;
        match raw.register(PROTOCOL_VERSION + 7).await {
            RegisterResponse::Rejected {
                reason,
                edge_protocol_version,
                ..
            } => {
                assert_eq!(reason, RejectReason::ProtocolVersionMismatch);
                assert_eq!(edge_protocol_version, PROTOCOL_VERSION);
            }
            other => panic!("{other:?}"),
        }
        let err = raw.conn.closed().await;
        assert_eq!(
            iop_transport::close_code_of(&err),
            Some(CloseCode::RegistrationRejected)
        );
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn dropped_connection_reconnects_with_a_greater_generation_and_late_messages_are_counted() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let edge = edge(&pki).await;
        let node = start_node(&pki, "node-1", edge.quic_addr, "");
        let g1 = ready_generation(&edge, "node-1").await;
        let (_, link) = edge.hub.link("node-1".into()).await.unwrap().unwrap();
        RunningEdge::close(&link.conn, CloseCode::ProtocolError);
        let snap = wait_for(
            &edge,
            "reconnect",
            |s| matches!(node_state(s, "node-1"), (Some(g), true) if g > g1),
        )
        .await;
        assert!(snap.fences >= 1);
        // The node's own metrics show it connected again (the node marks
        // itself ready when the Edge acknowledges, so poll, bounded).
        let connected = || {
            let text = node.shared().metrics.render();
            (
                iop_edge::metrics::scrape_value(&text, "iop_node_connected", &[]) == 1.0,
                text,
            )
        };
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while !connected().0 {
            assert!(tokio::time::Instant::now() < deadline, "{}", connected().1);
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let text = connected().1;
        assert!(text.contains("iop_node_disconnect_cancels_total"), "{text}");

        // A message attributed to a fenced generation is ignored and counted.
        let mut raw = RawNode::connect(&pki, "node-2", &edge).await;
        let r1 = accepted_generation(raw.register(PROTOCOL_VERSION).await);
        assert!(raw.ready(r1).await);
        let before = edge.hub.snapshot().await.unwrap().fenced_messages;
        raw.send
            .send(&NodeControl::ConfigApplied { generation: g1 })
            .await
            .unwrap();
        raw.send
            .send(&NodeControl::Ready(NodeReadyRequest { generation: r1 - 1 }))
            .await
            .unwrap();
        wait_for(&edge, "late messages counted", |s| {
            s.fenced_messages >= before + 2
        })
        .await;
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn generations_keep_increasing_across_an_edge_restart() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let first = edge(&pki).await;
        let port = first.quic_addr.port();
        let node = start_node(&pki, "node-1", first.quic_addr, "");
        let g1 = ready_generation(&first, "node-1").await;
        first.shutdown().await;
        // Same state dir and port: the node reconnects on its own. In one
        // process the old socket is released by its driver task shortly
        // after shutdown, so binding is retried briefly.
        let deadline = Instant::now() + Duration::from_secs(5);
        let second = loop {
            match RunningEdge::start(edge_config(&pki, port, NODE_PROVIDERS)).await {
                Ok(edge) => break edge,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("edge restarts: {e}"),
            }
        };
        let g2 = ready_generation(&second, "node-1").await;
        assert!(g2 > g1, "R-GEN-1 across restarts: {g2} > {g1}");
        node.shutdown().await.unwrap();
        second.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn silent_node_is_closed_with_heartbeat_timeout_within_wait_plus_interval() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        let node = start_node(&pki, "node-1", edge.quic_addr, "");
        let g1 = ready_generation(&edge, "node-1").await;
        let paused_at = Instant::now();
        node.pause_control(true);
        let snap = wait_for(&edge, "heartbeat timeout", |s| {
            s.closes_by_reason
                .get("heartbeat_timeout")
                .copied()
                .unwrap_or(0)
                >= 1
        })
        .await;
        let elapsed = paused_at.elapsed();
        // R-HB-2: within wait + one interval, plus scheduling slack.
        let bound = Duration::from_millis(HB_WAIT_MS + HB_INTERVAL_MS + 400);
        assert!(
            elapsed <= bound,
            "closed after {elapsed:?}, bound {bound:?}"
        );
        assert_ne!(node_state(&snap, "node-1"), (Some(g1), true));
        node.pause_control(false);
        let g2 = ready_generation(&edge, "node-1").await;
        assert!(g2 > g1);
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn garbage_on_one_connection_closes_only_that_connection() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let edge = edge(&pki).await;
        let node = start_node(&pki, "node-2", edge.quic_addr, "");
        let g2 = ready_generation(&edge, "node-2").await;

        let mut raw = RawNode::connect(&pki, "node-1", &edge).await;
        // An oversize length prefix on the control stream.
        raw.send
            .get_mut()
            .write_all(&u32::MAX.to_be_bytes())
            .await
            .unwrap();
        let err = raw.conn.closed().await;
        assert_eq!(
            iop_transport::close_code_of(&err),
            Some(CloseCode::ProtocolError)
        );
        // The other node is untouched.
        let snap = edge.hub.snapshot().await.unwrap();
        assert_eq!(node_state(&snap, "node-2"), (Some(g2), true));
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn node_with_a_certificate_from_another_ca_never_registers() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let other = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        // The node trusts our CA for the edge, but presents a foreign cert.
        let mut cfg = node_config(&pki, "node-1", edge.quic_addr, "");
        cfg.tls.cert = other.certs().join("node-node-1.pem");
        cfg.tls.key = other.certs().join("node-node-1.key");
        let node = iop_node::RunningNode::start(cfg);
        let failed = || {
            node.shared()
                .failed_attempts
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        while failed() < 2 {
            assert!(Instant::now() < deadline, "the node kept retrying");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let snap = edge.hub.snapshot().await.unwrap();
        assert_eq!(node_state(&snap, "node-1"), (None, false));
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn graceful_node_shutdown_fences_its_generation_at_once() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = edge(&pki).await;
        let node = start_node(&pki, "node-1", edge.quic_addr, "");
        ready_generation(&edge, "node-1").await;
        node.shutdown().await.unwrap();
        let snap = wait_for(&edge, "fence after shutdown", |s| {
            node_state(s, "node-1").0.is_none()
        })
        .await;
        assert_eq!(snap.closes_by_reason.get("shutdown"), Some(&1));
        edge.shutdown().await;
    })
    .await;
}
