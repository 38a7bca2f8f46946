//! Node identity under hostile conditions: a revoked node certificate is
//! refused at the handshake (and admitted again when taken off the list, a
//! SIGHUP reload), and node connections are capped.

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
