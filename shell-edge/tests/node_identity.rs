//! Node identity under hostile conditions: a revoked node certificate is
//! refused at the handshake (and admitted again when taken off the list, a
//! SIGHUP reload), a connection ends when its certificate expires, node
//! connections are capped, and two processes with one
//! node certificate do not take the node from each other every second.

mod common;

use std::time::Duration;

use common::*;
use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;

fn fingerprint_of(pki: &Pki, node: &str) -> String {
    let chain = iop_transport::load_cert_chain(&pki.certs().join(format!("node-{node}.pem")))
        .expect("node certificate");
    iop_transport::tls::hex(&iop_transport::cert_fingerprint(&chain[0]))
}

fn providers() -> &'static str {
    "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"m\"\n\
     [[providers]]\nid = \"p2\"\nnode = \"node-2\"\nadapter = \"mock\"\ntarget = \"m\"\n"
}

#[tokio::test]
async fn a_revoked_node_certificate_cannot_register_until_taken_off_the_list() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let revoked = fingerprint_of(&pki, "node-1");
        let lines = format!("revoked_node_certificates = [\"{revoked}\"]");
        let edge = RunningEdge::start(edge_config_with(&pki, 0, &lines, providers()))
            .await
            .unwrap();
        let node1 = start_node(&pki, "node-1", edge.quic_addr, &mock_provider_node("m"));
        let node2 = start_node(&pki, "node-2", edge.quic_addr, &mock_provider_node("m"));
        ready_generation(&edge, "node-2").await;
        // node-1 keeps dialing and keeps being refused.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let snap = edge.hub.snapshot().await.unwrap();
        assert!(!node_state(&snap, "node-1").1, "{snap:?}");
        // A reload without the entry lets it in.
        let reloaded: EdgeConfig = edge_config_with(&pki, 0, "", providers());
        edge.reload_revoked_node_certificates(&reloaded);
        ready_generation(&edge, "node-1").await;
        // Revoked again while connected: the open connection ends at once
        // (its generation is fenced), not only the next handshake.
        let relisted = edge_config_with(&pki, 0, &lines, providers());
        edge.reload_revoked_node_certificates(&relisted);
        wait_for(&edge, "node-1's open connection ended", |s| {
            !node_state(s, "node-1").1
        })
        .await;
        node1.shutdown().await.unwrap();
        node2.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn node_connections_past_the_cap_are_refused() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let edge = RunningEdge::start(edge_config_with(
            &pki,
            0,
            "max_node_connections = 1",
            providers(),
        ))
        .await
        .unwrap();
        let node1 = start_node(&pki, "node-1", edge.quic_addr, &mock_provider_node("m"));
        ready_generation(&edge, "node-1").await;
        let node2 = start_node(&pki, "node-2", edge.quic_addr, &mock_provider_node("m"));
        tokio::time::sleep(Duration::from_millis(800)).await;
        let snap = edge.hub.snapshot().await.unwrap();
        assert!(!node_state(&snap, "node-2").1, "{snap:?}");
        assert!(node_state(&snap, "node-1").1, "{snap:?}");
        node1.shutdown().await.unwrap();
        // The slot freed, node-2 gets in.
        ready_generation(&edge, "node-2").await;
        node2.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

/// R-LIM-4: two node processes run with one certificate. Each new
/// connection supersedes the other's (R-GEN-1), so without a rule they
/// take turns at the reconnect backoff (50-400 ms in these tests) forever.
/// The superseded one waits long instead (core's `SUPERSEDED_BACKOFF`,
/// 30 s doubling), counts it and says so: over two seconds the Edge sees
/// at most two supersessions, not dozens.
#[tokio::test]
async fn two_processes_with_one_node_certificate_do_not_flap() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let edge = RunningEdge::start(edge_config(&pki, 0, providers()))
            .await
            .unwrap();
        let first = start_node(&pki, "node-1", edge.quic_addr, &mock_provider_node("m"));
        ready_generation(&edge, "node-1").await;
        let second = start_node(&pki, "node-1", edge.quic_addr, &mock_provider_node("m"));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let superseded = |n: &iop_node::RunningNode| {
            n.shared()
                .superseded
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        while superseded(&first) + superseded(&second) == 0 {
            assert!(tokio::time::Instant::now() < deadline, "no supersession");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let snap = edge.hub.snapshot().await.unwrap();
        let at_edge = snap
            .closes_by_reason
            .get("superseded")
            .copied()
            .unwrap_or(0);
        assert!(at_edge <= 2, "the two processes flap: {snap:?}");
        assert_eq!(superseded(&first) + superseded(&second), at_edge);
        assert!(node_state(&snap, "node-1").1, "one of them holds the node");
        first.shutdown().await.unwrap();
        second.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

/// A node connection lives no longer than its certificate: node-1's
/// certificate expires three seconds after it connects; the Edge closes
/// the open connection `unauthorized` then (the handshake alone would let
/// it run for as long as it stays up), and the node's redials are refused.
#[tokio::test]
async fn a_node_connection_ends_when_its_certificate_expires() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let certs = pki.certs();
        let ca_cert = std::fs::read_to_string(certs.join("ca.pem")).unwrap();
        let ca_key = std::fs::read_to_string(certs.join("ca.key")).unwrap();
        let short = iop_transport::pki::issue_node_cert(
            &ca_cert,
            &ca_key,
            "node-1",
            iop_transport::pki::Validity::from_now(Duration::from_secs(3)),
        )
        .unwrap();
        std::fs::write(certs.join("node-node-1.pem"), &short.cert_pem).unwrap();
        std::fs::write(certs.join("node-node-1.key"), &short.key_pem).unwrap();
        let edge = RunningEdge::start(edge_config(&pki, 0, providers()))
            .await
            .unwrap();
        let node = start_node(&pki, "node-1", edge.quic_addr, &mock_provider_node("m"));
        ready_generation(&edge, "node-1").await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        let closed = |n: &iop_node::RunningNode| n.shared().edges[0].last_close();
        while closed(&node) != Some(iop_wire::CloseCode::Unauthorized) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "still open: {:?}",
                closed(&node)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let snap = edge.hub.snapshot().await.unwrap();
        assert!(!node_state(&snap, "node-1").1, "{snap:?}");
        let registrations = snap.fences;
        // Redials with the expired certificate never get past the TLS
        // handshake (no session ticket resumes it): no registration more.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let snap = edge.hub.snapshot().await.unwrap();
        assert!(!node_state(&snap, "node-1").1, "{snap:?}");
        assert_eq!(snap.fences, registrations, "{snap:?}");
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}
