//! A real node process frozen with SIGSTOP (what a power cut or a network
//! partition looks like: no FIN, no ICMP, the peer just stops answering).
//! With the application heartbeat at its production profile (30 s / 45 s),
//! only transport-level loss detection can notice it (R-FAIL-2): the
//! frozen node's streams end with one in-stream error within
//! `loss_detect_ms` + 1 s, its capacity comes back, and a long prefill on a
//! live node is never taken for a loss.

mod common;

use common::{signal, write_secret};
use iop_edge::config::ConfigFile as _;

use std::process::Stdio;
use std::time::Duration;

use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};

const KEY: &str = "sk-freeze-test-0123456789";
const LOSS_DETECT_MS: u64 = 1_000;

struct Deployment {
    dir: tempfile::TempDir,
    edge: RunningEdge,
    /// Node processes, in the order of `deploy`'s `nodes`.
    nodes: Vec<tokio::process::Child>,
    /// Each node's own mock provider.
    mocks: Vec<MockServer>,
    /// The tunnel-mode provider's mock (target `tt` of every node).
    tunnel_mock: MockServer,
}

/// An Edge in process and node processes (`node-1`, `node-2`, ...) each in
/// front of its own mock provider, all with the production heartbeat and a
/// short `loss_detect_ms`. Models `m` and `mock:*` (the mock's script in
/// the name) are served by every node's normalized provider (`p-node-N`,
/// capacity 4, in node order); model `tunnel` by node-1's tunnel-mode
/// provider (its mock's default script). Only the first `started` nodes
/// are started.
async fn deploy_nodes(count: usize, started: usize, script: MockScript) -> Deployment {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let names: Vec<String> = (1..=count).map(|i| format!("node-{i}")).collect();
    let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
    iop_transport::generate_dev_pki(&certs, &name_refs, &[]).unwrap();
    write_secret(&dir.path().join("key"), KEY);
    let heartbeat = format!("[heartbeat]\nloss_detect_ms = {LOSS_DETECT_MS}\n");
    let mut providers = String::new();
    let pool: Vec<String> = names.iter().map(|n| format!("\"p-{n}\"")).collect();
    for name in &names {
        providers.push_str(&format!(
            "[[providers]]\nid = \"p-{name}\"\nnode = \"{name}\"\nadapter = \"openai\"\n\
             target = \"t\"\nmodels = [\"m\"]\ncapacity = 4\n"
        ));
    }
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
{providers}
[[providers]]
id = "tun"
node = "node-1"
adapter = "openai"
target = "tt"
mode = "tunnel"
[[routes]]
model = "tunnel"
providers = ["tun"]
[[routes]]
model = "mock:*"
providers = [{pool}]
[[api_keys]]
principal = "tester"
key_file = "key"
"#,
        pool = pool.join(", ")
    );
    let edge = RunningEdge::start(EdgeConfig::parse(&edge_toml, dir.path()).unwrap())
        .await
        .unwrap();
    let mut mocks = Vec::new();
    for _ in &names {
        mocks.push(MockServer::start(script.clone()).await.unwrap());
    }
    let mut d = Deployment {
        dir,
        edge,
        nodes: Vec::new(),
        mocks,
        tunnel_mock: MockServer::start(script).await.unwrap(),
    };
    for i in 0..started {
        d.start_node(i).await;
    }
    d
}

/// One node (`node-1`) in front of a mock provider.
async fn deploy(script: MockScript) -> Deployment {
    deploy_nodes(1, 1, script).await
}

impl Deployment {
    /// Start node `index` (`node-{index + 1}`) and wait until it is ready.
    async fn start_node(&mut self, index: usize) {
        let name = format!("node-{}", index + 1);
        let node_toml = format!(
            r#"
[node]
edge = "{edge}"
state_dir = "state-{name}"
[tls]
ca = "certs/ca.pem"
cert = "certs/node-{name}.pem"
key = "certs/node-{name}.key"
[heartbeat]
loss_detect_ms = {LOSS_DETECT_MS}
[[providers]]
adapter = "openai"
target = "t"
base_url = "{mock}"
[[providers]]
adapter = "openai"
target = "tt"
base_url = "{tunnel}"
"#,
            edge = self.edge.quic_addr,
            mock = self.mocks[index].base_url(),
            tunnel = self.tunnel_mock.base_url()
        );
        let node_config = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&node_config, node_toml).unwrap();
        let node = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-node"))
            .args(["run", "--config"])
            .arg(&node_config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn iop-node");
        self.nodes.push(node);
        loop {
            if self
                .edge
                .hub
                .link(name.as_str().into())
                .await
                .unwrap()
                .is_some()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop(mut self) {
        for node in &mut self.nodes {
            let _ = node.start_kill();
        }
        self.edge.shutdown().await;
    }
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
    let d = deploy(MockScript {
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
        signal(&d.nodes[0], "-STOP");
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
        signal(&d.nodes[0], "-CONT");
    };
    tokio::time::timeout(Duration::from_secs(60), test)
        .await
        .expect("bounded");
    d.stop().await;
}

#[tokio::test]
async fn a_prefill_longer_than_loss_detect_is_not_a_loss_r_fail_2() {
    let d = deploy(MockScript {
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
    d.stop().await;
}

/// A streamed chat request for `model`, its status checked.
async fn stream_model(edge: &RunningEdge, model: &str) -> reqwest::Response {
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", edge.http_addr))
        .bearer_auth(KEY)
        .json(&serde_json::json!({
            "model": model, "stream": true,
            "messages": [{"role": "user", "content": "hi"}],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp
}

async fn read_all(mut resp: reqwest::Response) -> String {
    let mut body = String::new();
    while let Some(chunk) = resp.chunk().await.unwrap() {
        body.push_str(&String::from_utf8_lossy(&chunk));
    }
    body
}

/// Two nodes serve model `m`; node-1 is frozen with requests on it. Its
/// requests still before their first content complete on node-2 (R-FAIL-1:
/// a lost connection is a retryable attempt failure), its committed
/// stream ends with one in-stream error, the loss is seen within
/// `loss_detect_ms` + 1 s, and a new request goes to node-2 only.
#[tokio::test]
async fn a_frozen_nodes_requests_before_commit_complete_on_the_other_node_r_fail_1() {
    let mut d = deploy_nodes(2, 1, MockScript::default()).await;
    let test = async {
        // On node-1 (the only one up): one committed stream, two requests
        // in their prefill.
        let mut committed = stream_model(&d.edge, "mock:tokens=2000,tps=20").await;
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let edge_http = d.edge.http_addr;
                tokio::spawn(async move {
                    let resp = reqwest::Client::new()
                        .post(format!("http://{edge_http}/v1/chat/completions"))
                        .bearer_auth(KEY)
                        .json(&serde_json::json!({
                            "model": "mock:prefill_ms=2500,tokens=3", "stream": true,
                            "messages": [{"role": "user", "content": "hi"}],
                        }))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(resp.status(), 200);
                    read_all(resp).await
                })
            })
            .collect();
        let mut body = String::new();
        while !body.contains("tok1") {
            let chunk = committed.chunk().await.unwrap().expect("stream open");
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        d.mocks[0].wait_for(|s| s.in_flight == 3).await;
        d.start_node(1).await;
        let frozen_at = std::time::Instant::now();
        signal(&d.nodes[0], "-STOP");
        while let Some(chunk) = committed.chunk().await.unwrap() {
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        let lost_after = frozen_at.elapsed();
        assert_eq!(body.matches("\"error\"").count(), 1, "one error: {body}");
        assert!(!body.contains("[DONE]"), "{body}");
        assert!(
            lost_after <= Duration::from_millis(LOSS_DETECT_MS + 1_000),
            "lost after {lost_after:?}"
        );
        for w in waiting {
            let body = w.await.unwrap();
            assert!(
                body.contains("[DONE]"),
                "completed on the other node: {body}"
            );
            assert!(!body.contains("\"error\""), "{body}");
        }
        assert_eq!(d.mocks[1].requests(), 2, "re-admitted to node-2");
        let body = read_all(stream_model(&d.edge, "mock:tokens=3").await).await;
        assert!(body.contains("[DONE]"), "{body}");
        assert_eq!(d.mocks[1].requests(), 3, "a new request goes to node-2");
        assert_eq!(d.mocks[0].requests(), 3, "nothing new reached node-1");
        signal(&d.nodes[0], "-CONT");
    };
    tokio::time::timeout(Duration::from_secs(60), test)
        .await
        .expect("bounded");
    d.stop().await;
}

/// No false loss (R-FAIL-2): while requests with a prefill far longer than
/// `loss_detect_ms` run one after another, a tunnelled stream whose client
/// reads in bursts with pauses twice as long as `loss_detect_ms` (so flow
/// control holds the node's stream back) runs to its end, and no
/// connection is lost. It runs `IOP_SOAK_SECS` seconds (default 8; the
/// soak runs it for 600, with 120 s prefills: see docs/operations.md).
#[tokio::test]
async fn a_long_prefill_and_a_back_pressured_tunnel_are_no_loss_r_fail_2() {
    let secs: u64 = std::env::var("IOP_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let prefill_ms = (secs * 1000 / 4).min(120_000);
    // The tunnel's script is its mock's default: its longest answer (about 64 MB
    // of SSE), unpaced, so only flow control holds it back. It must outgrow
    // every buffer on its way, the kernel's included: a socket's receive
    // buffer grows to `tcp_rmem`'s maximum (32 MiB on Debian's defaults)
    // behind a reader as fast as the Node, and 15 MB fitted.
    let d = deploy(MockScript {
        tokens: iop_node::mock::MAX_MOCK_TOKENS,
        tokens_per_second: 0.0,
        ..MockScript::default()
    })
    .await;
    let test = async {
        let fences_before = d.edge.hub.snapshot().await.unwrap().fences;
        let started = std::time::Instant::now();
        let edge_http = d.edge.http_addr;
        let prefills = tokio::spawn(async move {
            let mut done = 0;
            while started.elapsed() < Duration::from_secs(secs) {
                let resp = reqwest::Client::new()
                    .post(format!("http://{edge_http}/v1/chat/completions"))
                    .bearer_auth(KEY)
                    .json(&serde_json::json!({
                        "model": format!("mock:prefill_ms={prefill_ms},tokens=3"), "stream": true,
                        "messages": [{"role": "user", "content": "hi"}],
                    }))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let body = read_all(resp).await;
                assert!(
                    body.contains("[DONE]") && !body.contains("\"error\""),
                    "{body}"
                );
                done += 1;
            }
            done
        });
        // Tunnelled streams one after another for the whole soak, each
        // read in 200 ms bursts with pauses of twice `loss_detect_ms`.
        let mut tunnels = 0;
        while tunnels == 0 || started.elapsed() < Duration::from_secs(secs) {
            let mut resp = stream_model(&d.edge, "tunnel").await;
            let mut held_back = 0;
            let mut body_len = 0usize;
            let mut tail = String::new();
            loop {
                // A pause first: the stream is far bigger than every buffer
                // on its way, so the provider is held back while nobody
                // reads (however fast the last burst drained).
                tokio::time::sleep(Duration::from_millis(2 * LOSS_DETECT_MS)).await;
                // Still sending after a pause: flow control holds the
                // provider's answer back, all the way to the node.
                if d.tunnel_mock.stats().in_flight > 0 {
                    held_back += 1;
                }
                let burst = tokio::time::Instant::now() + Duration::from_millis(200);
                let mut ended = false;
                while tokio::time::Instant::now() < burst {
                    match tokio::time::timeout_at(burst, resp.chunk()).await {
                        Ok(Ok(Some(chunk))) => {
                            body_len += chunk.len();
                            tail = String::from_utf8_lossy(&chunk).into_owned();
                        }
                        Ok(Ok(None)) => {
                            ended = true;
                            break;
                        }
                        Ok(Err(e)) => panic!("tunnel broke: {e}"),
                        Err(_) => break,
                    }
                }
                if ended {
                    break;
                }
            }
            assert!(tail.contains("[DONE]"), "the tunnel ran to its end: {tail}");
            assert!(
                body_len > 1_000_000,
                "a stream big enough to back up: {body_len}"
            );
            assert!(held_back >= 1, "the tunnel was never held back");
            tunnels += 1;
        }
        let prefills_done = prefills.await.unwrap();
        assert!(prefills_done >= 1);
        let snap = d.edge.hub.snapshot().await.unwrap();
        assert_eq!(snap.fences, fences_before, "no false loss: {snap:?}");
        assert_eq!(snap.closes_by_reason.values().sum::<u64>(), 0, "{snap:?}");
    };
    tokio::time::timeout(Duration::from_secs(secs * 4 + 60), test)
        .await
        .expect("bounded");
    d.stop().await;
}
