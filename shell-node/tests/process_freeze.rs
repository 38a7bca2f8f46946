//! A real node process frozen with SIGSTOP (what a power cut or a network
//! partition looks like: no FIN, no ICMP, the peer just stops answering).
//! With the application heartbeat at its production profile (30 s / 45 s),
//! only transport-level loss detection can notice it (R-FAIL-2): the
//! frozen node's streams end with one in-stream error within
//! `loss_detect_ms` + 1 s, its capacity comes back, and a long prefill on a
//! live node is never taken for a loss.

use std::process::Stdio;
use std::time::Duration;

use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};

const KEY: &str = "sk-freeze-test-0123456789";
const LOSS_DETECT_MS: u64 = 1_000;

struct Deployment {
    _dir: tempfile::TempDir,
    edge: RunningEdge,
    node: tokio::process::Child,
    _mock: MockServer,
}

/// An Edge in process and a node process in front of a mock provider, both
/// with the production heartbeat and a short `loss_detect_ms`.
async fn deploy(script: MockScript) -> Deployment {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    iop_transport::generate_dev_pki(&certs, &["node-1"], &[]).unwrap();
    write_secret(&dir.path().join("key"), KEY);
    let mock = MockServer::start(script).await.unwrap();
    let heartbeat = format!("[heartbeat]\nloss_detect_ms = {LOSS_DETECT_MS}\n");
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
{heartbeat}
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
"#
    );
    let edge = RunningEdge::start(EdgeConfig::parse(&edge_toml, dir.path()).unwrap())
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
{heartbeat}
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
    let node = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-node"))
        .args(["run", "--config"])
        .arg(&node_config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn iop-node");
    loop {
        if edge.hub.link("node-1".into()).await.unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Deployment {
        _dir: dir,
        edge,
        node,
        _mock: mock,
    }
}

fn signal(child: &tokio::process::Child, sig: &str) {
    let pid = child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {sig} {pid}");
}

async fn stream(edge: &RunningEdge) -> reqwest::Response {
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", edge.http_addr))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp
}

#[tokio::test]
async fn a_frozen_node_is_lost_within_loss_detect_and_its_streams_end_once_r_fail_2() {
    let mut d = deploy(MockScript {
        tokens_per_second: 20.0,
        tokens: 2000,
        ..MockScript::default()
    })
    .await;
    let test = async {
        let mut resp = stream(&d.edge).await;
        let mut body = String::new();
        while !body.contains("tok1") {
            let chunk = resp.chunk().await.unwrap().expect("stream open");
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        let frozen_at = std::time::Instant::now();
        signal(&d.node, "-STOP");
        while let Some(chunk) = resp.chunk().await.unwrap() {
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        let elapsed = frozen_at.elapsed();
        assert_eq!(body.matches("\"error\"").count(), 1, "one error: {body}");
        assert!(!body.contains("[DONE]"), "no success terminal: {body}");
        // The heartbeat would take 30 s + 45 s; the transport notices.
        assert!(
            elapsed <= Duration::from_millis(LOSS_DETECT_MS + 1_000),
            "lost after {elapsed:?}"
        );
        let snap = d.edge.hub.snapshot().await.unwrap();
        assert_eq!(snap.leases_in_use, 0, "{snap:?}");
        assert!(
            !snap
                .nodes
                .iter()
                .any(|(n, g, ready, _)| n.as_str() == "node-1" && g.is_some() && *ready),
            "no request is routed to the frozen node: {snap:?}"
        );
        assert!(snap.fences >= 1, "{snap:?}");
        signal(&d.node, "-CONT");
    };
    tokio::time::timeout(Duration::from_secs(60), test)
        .await
        .expect("bounded");
    let _ = d.node.start_kill();
    d.edge.shutdown().await;
}

#[tokio::test]
async fn a_prefill_longer_than_loss_detect_is_not_a_loss_r_fail_2() {
    let mut d = deploy(MockScript {
        prefill_ms: 4 * LOSS_DETECT_MS,
        tokens_per_second: 50.0,
        tokens: 5,
        ..MockScript::default()
    })
    .await;
    let test = async {
        let fences_before = d.edge.hub.snapshot().await.unwrap().fences;
        let mut resp = stream(&d.edge).await;
        let mut body = String::new();
        while let Some(chunk) = resp.chunk().await.unwrap() {
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        assert!(body.contains("[DONE]"), "completed: {body}");
        assert!(!body.contains("\"error\""), "{body}");
        let snap = d.edge.hub.snapshot().await.unwrap();
        assert_eq!(snap.fences, fences_before, "no false loss: {snap:?}");
    };
    tokio::time::timeout(Duration::from_secs(60), test)
        .await
        .expect("bounded");
    let _ = d.node.start_kill();
    d.edge.shutdown().await;
}

/// Write a secret file as an operator must: mode 0600.
fn write_secret(path: &std::path::Path, text: &str) {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .expect("secret file");
    std::io::Write::write_all(&mut file, text.as_bytes()).expect("secret written");
}
