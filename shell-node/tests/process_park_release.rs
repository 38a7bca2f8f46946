//! A durable run parked on a real node process whose response ends while
//! the node is away (SPEC §6, R-PARK-1): when the node comes back
//! and reports the run, the Edge finds its response ended and tells the
//! node to end it, so its provider call stops at once instead of running
//! for the rest of the park grace.
//!
//! The node is frozen with SIGSTOP (the Edge loses it; its durable request
//! ends or waits for the run to be reported), the client cancels the
//! response, and the node is let go on with SIGCONT: it reconnects and reports the
//! run parked. The mock provider's counters show the one call abandoned
//! within seconds, where the grace (60 s) and the answer (100 s) are far
//! longer.

mod common;

use common::{signal, write_secret};
use iop_edge::config::ConfigFile as _;

use std::process::Stdio;
use std::time::Duration;

use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use serde_json::{Value, json};

const KEY: &str = "sk-park-release-0123456789";
const LOSS_DETECT_MS: u64 = 1_000;

#[tokio::test]
async fn a_parked_run_whose_response_ended_is_ended_when_its_node_reports_it_r_park_1() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    iop_transport::generate_dev_pki(&dir.path().join("certs"), &["node-1"], &[]).unwrap();
    write_secret(&dir.path().join("key"), KEY);
    let mock = MockServer::start(MockScript {
        tokens_per_second: 20.0,
        tokens: 2000,
        ..MockScript::default()
    })
    .await
    .unwrap();
    let edge_toml = format!(
        r#"
[edge]
quic_listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
state_dir = "edge-state"
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge.key"
[heartbeat]
loss_detect_ms = {LOSS_DETECT_MS}
[journal]
park_grace_ms = 60000
[[providers]]
id = "p1"
node = "node-1"
adapter = "openai"
target = "t"
models = ["m"]
capacity = 4
[[api_keys]]
principal = "tester"
key_file = "key"
"#
    );
    let edge = RunningEdge::start(EdgeConfig::parse(&edge_toml, dir.path()).unwrap())
        .await
        .unwrap();
    let node_toml = format!(
        r#"
[node]
edge = "{edge}"
state_dir = "state-node-1"
[tls]
ca = "certs/ca.pem"
cert = "certs/node-node-1.pem"
key = "certs/node-node-1.key"
[heartbeat]
loss_detect_ms = {LOSS_DETECT_MS}
[[providers]]
adapter = "openai"
target = "t"
base_url = "{mock}"
"#,
        edge = edge.quic_addr,
        mock = mock.base_url(),
    );
    let node_config = dir.path().join("node-1.toml");
    std::fs::write(&node_config, node_toml).unwrap();
    let node = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-node"))
        .args(["run", "--config"])
        .arg(&node_config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn iop-node");
    let ready = async {
        while edge.hub.link("node-1".into()).await.unwrap().is_none() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), ready)
        .await
        .expect("the node registers");

    let test = async {
        let http = format!("http://{}", edge.http_addr);
        let client = reqwest::Client::new();
        let created: Value = client
            .post(format!("{http}/v1/responses"))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(json!({"model": "m", "input": "go", "background": true}).to_string())
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = created["id"].as_str().expect("an id").to_owned();
        mock.wait_for(|s| s.requests >= 1).await;
        tokio::time::sleep(Duration::from_millis(500)).await;

        // The node goes silent: the Edge loses it and its request waits
        // for the run to be reported (R-PARK-1).
        signal(&node, "-STOP");
        tokio::time::sleep(Duration::from_millis(LOSS_DETECT_MS + 1_500)).await;
        let canceled = client
            .post(format!("{http}/v1/responses/{id}/cancel"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        assert!(canceled.status().is_success(), "{}", canceled.status());
        assert_eq!(
            mock.stats().disconnects,
            0,
            "the frozen node's call still runs"
        );

        // The node goes on: it finds its connection gone, parks the run,
        // reconnects and reports it; the Edge ends it there.
        let resumed = std::time::Instant::now();
        signal(&node, "-CONT");
        tokio::time::timeout(
            Duration::from_secs(15),
            mock.wait_for(|s| s.disconnects >= 1),
        )
        .await
        .expect("the parked run's provider call is ended well before its 60 s grace");
        let waited = resumed.elapsed();
        assert_eq!(mock.requests(), 1, "one provider call, never another");
        let object: Value = client
            .get(format!("{http}/v1/responses/{id}"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        // Ended while the node was away (canceled, or failed by the loss
        // before the cancel reached it): either way no Edge can use the run.
        let status = object["status"].as_str().unwrap_or("");
        assert!(
            ["cancelled", "failed", "incomplete"].contains(&status),
            "{object}"
        );
        eprintln!("the parked run ended {waited:?} after the node went on");
    };
    tokio::time::timeout(Duration::from_secs(60), test)
        .await
        .expect("bounded");
    drop(node);
    edge.shutdown().await;
}
