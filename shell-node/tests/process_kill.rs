//! A real node process killed mid-stream (SIGKILL): the client gets one
//! terminal error after the heartbeat wait and every provider's capacity
//! returns to full (R-HB-2, R-GEN-3, R-GATE-3, R-LEASE-2).

mod common;

use common::write_secret;
use iop_edge::config::ConfigFile as _;

use std::process::Stdio;
use std::time::Duration;

use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};

const KEY: &str = "sk-kill-test-0123456789";

#[tokio::test]
async fn node_killed_mid_stream_ends_the_stream_and_frees_capacity() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    iop_transport::generate_dev_pki(&certs, &["node-1"], &[]).unwrap();
    write_secret(&dir.path().join("key"), KEY);
    let mock = MockServer::start(MockScript {
        tokens_per_second: 20.0,
        tokens: 2000,
        ..MockScript::default()
    })
    .await
    .unwrap();

    let edge_toml = r#"
[edge]
quic_listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
state_dir = "edge-state"
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge.key"
[heartbeat]
interval_ms = 200
wait_ms = 300
[[providers]]
id = "p1"
node = "node-1"
adapter = "openai"
target = "t"
models = ["m"]
capacity = 2
[[api_keys]]
principal = "tester"
key_file = "key"
"#;
    let edge = RunningEdge::start(EdgeConfig::parse(edge_toml, dir.path()).unwrap())
        .await
        .unwrap();
    let node_toml = format!(
        r#"
[node]
edge = "{edge}"
state_dir = "node-state"
[tls]
ca = "certs/ca.pem"
cert = "certs/node-node-1.pem"
key = "certs/node-node-1.key"
[heartbeat]
interval_ms = 200
wait_ms = 300
[[providers]]
adapter = "openai"
target = "t"
base_url = "{mock}"
"#,
        edge = edge.quic_addr,
        mock = mock.base_url()
    );
    let node_config = dir.path().join("node.toml");
    std::fs::write(&node_config, node_toml).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-node"))
        .args(["run", "--config"])
        .arg(&node_config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn iop-node");

    let test = async {
        // Ready.
        loop {
            if edge.hub.link("node-1".into()).await.unwrap().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let http = reqwest::Client::new();
        let mut resp = http
            .post(format!("http://{}/v1/chat/completions", edge.http_addr))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = String::new();
        while !body.contains("tok1") {
            let chunk = resp.chunk().await.unwrap().expect("stream open");
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        assert_eq!(edge.hub.snapshot().await.unwrap().leases_in_use, 1);

        // A real process kill: no goodbye, the connection just goes silent.
        let killed_at = std::time::Instant::now();
        child.start_kill().unwrap();
        let _ = child.wait().await;
        while let Some(chunk) = resp.chunk().await.unwrap() {
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        let elapsed = killed_at.elapsed();
        // One in-stream error terminal, after the heartbeat wait.
        let errors = body.matches("\"error\"").count();
        assert_eq!(errors, 1, "one terminal error: {body}");
        assert!(!body.contains("[DONE]"), "no success terminal: {body}");
        assert!(
            elapsed >= Duration::from_millis(300),
            "not before the wait: {elapsed:?}"
        );

        // Every provider's capacity is back to full.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let snap = edge.hub.snapshot().await.unwrap();
            if snap.leases_in_use == 0 && snap.providers.iter().all(|p| p.in_use == 0) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "capacity leaked: {snap:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), test)
        .await
        .expect("bounded");
    edge.shutdown().await;
}
