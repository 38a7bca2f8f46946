//! Many Edges on one NATS JetStream journal (SPEC §8, R-MULTI-1), with a
//! real `nats-server` on loopback: a durable stream written through one
//! Edge is resumed live on another, receiving exactly the rest (R-JRN-2);
//! an idempotent retry sent to the other Edge attaches to the same
//! response and calls no provider (R-IDEM-1); an Edge killed with SIGKILL
//! has its streams adopted by another Edge through the nodes connected to
//! both, and the clients resume there exactly, with one provider call each
//! (R-PARK-2, R-TAKE-1); an Edge frozen (SIGSTOP) past its lease has its
//! streams taken over the same way, and when it wakes its requests are
//! fenced while their clients read on from the records (R-JRN-3,
//! R-JRN-1); when no node reports a run, its response is
//! ended `incomplete` (`edge_lost`) by a live Edge once the dead one's
//! ownership lease expired (R-TAKE-1); a NATS restart
//! loses no acknowledged event; a store outage makes durable requests
//! fail fast with 503 while ephemeral ones succeed.
//!
//! Without `nats-server` installed each test says why and passes, unless
//! `CI` is set (then it fails), as the store's own tests do.

mod common;
#[path = "../../store-nats/tests/support/mod.rs"]
mod nats;

use iop_edge::config::ConfigFile as _;
use std::time::Duration;

use common::*;
use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use nats::NatsServer;
use serde_json::{Value, json};

const KEY: &str = "sk-many-edges-0123456789";
/// Tokens of each answer.
const TOKENS: u32 = 40;
/// The ownership lease's TTL in these tests (renewed every third of it).
const LEASE_TTL_MS: u64 = 1_000;
/// How long a parked run waits for an Edge (short: nothing adopts here).
const PARK_GRACE_MS: u64 = 500;

/// The config of Edge `edge_id` on the journal at `nats_url`; its own
/// state directory, its QUIC and HTTP ports (0: any).
fn edge_toml(edge_id: &str, nats_url: &str, quic_port: u16, http_port: u16) -> String {
    edge_toml_with(edge_id, nats_url, quic_port, http_port, PARK_GRACE_MS, "")
}

/// [`edge_toml`] with its park grace and `extra` TOML at the end.
fn edge_toml_with(
    edge_id: &str,
    nats_url: &str,
    quic_port: u16,
    http_port: u16,
    park_grace_ms: u64,
    extra: &str,
) -> String {
    let head = edge_head_toml(edge_id, quic_port, http_port);
    let journal = nats_journal_toml(nats_url, "edges", LEASE_TTL_MS, park_grace_ms, 30000);
    format!(
        r#"
{head}[admission]
queue_capacity = 64
queue_timeout_ms = 5000
{journal}{P1_ON_NODE_1_TOML}{TESTER_ADMIN_KEY_TOML}{extra}
"#
    )
}

fn edge_config(pki: &Pki, edge_id: &str, nats_url: &str) -> EdgeConfig {
    EdgeConfig::parse(&edge_toml(edge_id, nats_url, 0, 0), pki.path()).expect("edge config")
}

/// Two Edges on one NATS server and a node connected to the first.
struct TwoEdges {
    a: RunningEdge,
    b: RunningEdge,
    node: iop_node::RunningNode,
    mock: MockServer,
}

impl TwoEdges {
    async fn start(pki: &Pki, server: &NatsServer, script: MockScript) -> Self {
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(script).await.unwrap();
        let a = RunningEdge::start(edge_config(pki, "edge-a", &server.url()))
            .await
            .unwrap();
        let b = RunningEdge::start(edge_config(pki, "edge-b", &server.url()))
            .await
            .unwrap();
        let node = start_node(pki, "node-1", a.quic_addr, &node_providers(&mock));
        ready_generation(&a, "node-1").await;
        TwoEdges { a, b, node, mock }
    }

    async fn shutdown(self) {
        self.node.shutdown().await.unwrap();
        self.a.shutdown().await;
        self.b.shutdown().await;
    }
}

fn node_providers(mock: &MockServer) -> String {
    format!(
        "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
        mock.base_url()
    )
}

fn url(edge: &RunningEdge, path: &str) -> String {
    format!("http://{}{path}", edge.http_addr)
}

fn text_of(events: &[(u64, Value)]) -> String {
    events
        .iter()
        .filter(|(_, d)| d["type"] == "response.output_text.delta")
        .filter_map(|(_, d)| d["delta"].as_str())
        .collect()
}

async fn get(url: String) -> (u16, String) {
    let r = reqwest::Client::new()
        .get(url)
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

fn post(url: String, body: &Value, key: Option<&str>) -> reqwest::RequestBuilder {
    let mut r = reqwest::Client::new()
        .post(url)
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(key) = key {
        r = r.header("idempotency-key", key);
    }
    r
}

/// The response object from `edge` once `done` holds of it (bounded).
async fn object_when(edge_url: &str, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = get(format!("{edge_url}/v1/responses/{id}")).await;
        if status == 200 {
            let object: Value = serde_json::from_str(&body).unwrap();
            if done(&object) {
                return object;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}: {object}"
            );
        } else {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}: {status} {body}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Read SSE events from `r` until `n` complete events arrived; the
/// events and the text read.
async fn read_events(r: &mut reqwest::Response, n: usize) -> Vec<(u64, Value)> {
    let mut text = String::new();
    loop {
        let seen = sse_events(&text);
        if seen.len() >= n {
            return seen;
        }
        match r.chunk().await.unwrap() {
            Some(chunk) => text.push_str(&String::from_utf8_lossy(&chunk)),
            None => return seen,
        }
    }
}

/// R-MULTI-1, R-JRN-2, R-IDEM-1: a client streams through Edge A, leaves,
/// and resumes on Edge B while the answer is still being written: B
/// follows A's appends live (through its own watch of the store) and the
/// client gets exactly the rest. An idempotent retry sent to B attaches to
/// the same response: the provider is called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_through_one_edge_resumes_live_on_another_and_a_retry_there_attaches() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let d = TwoEdges::start(
            &pki,
            &server,
            MockScript {
                tokens: TOKENS,
                tokens_per_second: 10.0,
                ..MockScript::default()
            },
        )
        .await;
        let body = json!({"model": "m", "input": "hello", "stream": true});
        let mut on_a = post(url(&d.a, "/v1/responses"), &body, Some("order-1"))
            .send()
            .await
            .unwrap();
        assert_eq!(on_a.status(), 200);
        let seen = read_events(&mut on_a, 6).await;
        drop(on_a);
        let id = seen[0].1["response"]["id"].as_str().unwrap().to_owned();
        let last = seen.last().unwrap().0;
        // Still being written through A when the client comes to B.
        let object = object_when(&url(&d.b, ""), &id, "the record on B", |_| true).await;
        assert_eq!(object["status"], "in_progress", "{object}");
        let (status, rest) = get(url(
            &d.b,
            &format!("/v1/responses/{id}?stream=true&starting_after={last}"),
        ))
        .await;
        assert_eq!(status, 200, "{rest}");
        let rest = sse_events(&rest);
        assert_eq!(
            rest.first().map(|(n, _)| *n),
            Some(last + 1),
            "exactly after the last event seen"
        );
        assert_eq!(
            rest.last().and_then(|(_, d)| d["type"].as_str()),
            Some("response.completed")
        );
        let mut joined = seen.clone();
        joined.extend(rest);
        let (_, full) = get(url(&d.b, &format!("/v1/responses/{id}?stream=true"))).await;
        assert_eq!(joined, sse_events(&full), "the concatenation is the stream");
        assert_eq!(text_of(&joined), expected_text(TOKENS));
        // The same request again, on B: the same response, nothing runs.
        let retry = post(url(&d.b, "/v1/responses"), &body, Some("order-1"))
            .send()
            .await
            .unwrap();
        assert_eq!(retry.status(), 200);
        assert_eq!(
            retry
                .headers()
                .get("idempotent-replayed")
                .and_then(|v| v.to_str().ok()),
            Some("true")
        );
        let replayed = sse_events(&retry.text().await.unwrap());
        assert_eq!(replayed, joined);
        assert_eq!(d.mock.requests(), 1, "one provider call (R-IDEM-1)");
        // Each Edge sees the other's lease.
        let (_, status) = get(url(&d.b, "/status")).await;
        let status: Value = serde_json::from_str(&status).unwrap();
        let journal = &status["journal"];
        assert_eq!(
            (journal["store"].as_str(), journal["edge_id"].as_str()),
            (Some("nats"), Some("edge-b"))
        );
        assert_eq!(journal["state"], "ok", "{journal}");
        let edges: Vec<&str> = journal["edges"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["edge_id"].as_str())
            .collect();
        assert!(
            edges.contains(&"edge-a") && edges.contains(&"edge-b"),
            "{journal}"
        );
        d.shutdown().await;
    })
    .await;
}

/// R-TAKE-1, R-MULTI-1: Edge A, a real process, is killed with SIGKILL
/// while durable streams run through it. Edge B sees A's ownership lease
/// stop moving; once it expired and the park window passed (A's node
/// reported its parked runs to nobody: it knows only A), B takes each of
/// A's unfinished responses over and ends it `incomplete` (`edge_lost`)
/// with its durable prefix: every event a client saw through A is in it
/// (R-JRN-1), and a resume on B gets the rest up to one terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_edges_unfinished_responses_are_ended_by_a_live_one_after_its_lease_expired() {
    const STREAMS: usize = 3;
    let Some(server) = NatsServer::start() else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript {
            tokens: 400,
            tokens_per_second: 20.0,
            ..MockScript::default()
        })
        .await
        .unwrap();
        let (quic_port, http_port) = (free_udp_port(), free_tcp_port());
        let config = pki.path().join("edge-a.toml");
        std::fs::write(
            &config,
            edge_toml("edge-a", &server.url(), quic_port, http_port),
        )
        .unwrap();
        let mut a = start_edge_process_with_node(&pki, &config, quic_port, http_port, &mock).await;
        let b = RunningEdge::start(edge_config(&pki, "edge-b", &server.url()))
            .await
            .unwrap();
        let b_url = url(&b, "");
        // Streams through A, each read until it has a few events.
        let mut seen_all = Vec::new();
        let mut open = Vec::new();
        for n in 0..STREAMS {
            let body = json!({"model": "m", "input": format!("stream {n}"), "stream": true});
            let mut r = post(format!("{}/v1/responses", a.edge.http), &body, None)
                .send()
                .await
                .unwrap();
            let seen = read_events(&mut r, 5).await;
            open.push(r);
            seen_all.push(seen);
        }
        a.edge.child.start_kill().unwrap();
        let _ = a.edge.child.wait().await;
        for mut r in open {
            // Whatever else arrived before the kill was seen too.
            while let Ok(Some(_)) = r.chunk().await {}
        }
        for seen in &seen_all {
            let id = seen[0].1["response"]["id"].as_str().unwrap();
            let object = object_when(&b_url, id, "B to end A's response", |o| {
                o["status"] == "incomplete"
            })
            .await;
            assert_eq!(
                object["incomplete_details"]["reason"], "edge_lost",
                "{object}"
            );
            let (_, full) = get(format!("{b_url}/v1/responses/{id}?stream=true")).await;
            let full = sse_events(&full);
            assert!(
                full.len() > seen.len() && full[..seen.len()] == seen[..],
                "{id}: every event a client saw is durable and in place (R-JRN-1)"
            );
            assert_eq!(
                full.last().and_then(|(_, d)| d["type"].as_str()),
                Some("response.incomplete"),
                "one terminal"
            );
            let last = seen.last().unwrap().0;
            let (_, rest) = get(format!(
                "{b_url}/v1/responses/{id}?stream=true&starting_after={last}"
            ))
            .await;
            let mut joined = seen.clone();
            joined.extend(sse_events(&rest));
            assert_eq!(
                joined, full,
                "{id}: the resume is exactly the rest (R-JRN-2)"
            );
        }
        assert_eq!(mock.requests(), STREAMS as u64, "no run was sent again");
        let (_, status) = get(format!("{b_url}/status")).await;
        let status: Value = serde_json::from_str(&status).unwrap();
        let edge_a = status["journal"]["edges"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["edge_id"] == "edge-a")
            .cloned();
        assert_eq!(
            edge_a.as_ref().map(|e| e["state"].clone()),
            Some(json!("expired")),
            "{status}"
        );
        a.node.shutdown().await.unwrap();
        b.shutdown().await;
    })
    .await
    .expect("test exceeded its bound");
}

/// R-MULTI-1, R-PARK-2, R-TAKE-1, R-JRN-2, R-IDEM-1: two Edges on one
/// NATS server, two nodes each connected to both. Edge A, a real process,
/// is killed with SIGKILL while durable streams run through it. The nodes
/// see A's connection go, park its runs and report them to B on their live
/// connections; B wins each record's epoch and adopts the run where A's
/// journal left it. Each client resumes on B after the last event it saw
/// and receives exactly the missing events up to `response.completed`; an
/// idempotent retry sent to B attaches to the same response; the
/// providers were called once per stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_edges_streams_are_adopted_by_another_edge_and_resume_there_exactly() {
    const STREAMS: usize = 4;
    const LONG_TOKENS: u32 = 120;
    let Some(server) = NatsServer::start() else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        let pki = Pki::new(&["node-1", "node-2"]);
        write_secret(&pki.path().join("key"), KEY);
        let script = MockScript {
            tokens: LONG_TOKENS,
            tokens_per_second: 20.0,
            ..MockScript::default()
        };
        let mocks = [
            MockServer::start(script.clone()).await.unwrap(),
            MockServer::start(script).await.unwrap(),
        ];
        let second_provider = r#"
[[providers]]
id = "p2"
node = "node-2"
adapter = "openai"
target = "t"
models = ["m"]
capacity = 64
"#;
        // Long enough for B to adopt what the nodes park.
        let (mut a, b, nodes) =
            killable_edge_beside_edge(&pki, &server, 20_000, second_provider, &mocks).await;
        let b_url = url(&b, "");
        let mut seen_all = Vec::new();
        let mut open = Vec::new();
        for n in 0..STREAMS {
            let body = json!({"model": "m", "input": format!("stream {n}"), "stream": true});
            let key = (n == 0).then_some("retry-me");
            let mut r = post(format!("{}/v1/responses", a.http), &body, key)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let seen = read_events(&mut r, 6).await;
            open.push(r);
            seen_all.push((body, seen));
        }
        a.child.start_kill().unwrap();
        let _ = a.child.wait().await;
        for mut r in open {
            // Whatever else arrived before the kill was seen too.
            while let Ok(Some(_)) = r.chunk().await {}
        }
        for (n, (body, seen)) in seen_all.iter().enumerate() {
            let id = seen[0].1["response"]["id"].as_str().unwrap();
            let last = seen.last().unwrap().0;
            let (status, rest) = get(format!(
                "{b_url}/v1/responses/{id}?stream=true&starting_after={last}"
            ))
            .await;
            assert_eq!(status, 200, "{rest}");
            let rest = sse_events(&rest);
            assert_eq!(
                rest.first().map(|(n, _)| *n),
                Some(last + 1),
                "{id}: exactly after the last event seen (R-JRN-2)"
            );
            assert_eq!(
                rest.last().and_then(|(_, d)| d["type"].as_str()),
                Some("response.completed"),
                "{id}: adopted and finished on B, not ended incomplete"
            );
            let mut joined = seen.clone();
            joined.extend(rest);
            let (_, full) = get(format!("{b_url}/v1/responses/{id}?stream=true")).await;
            assert_eq!(
                joined,
                sse_events(&full),
                "{id}: the concatenation is the stream"
            );
            assert_eq!(text_of(&joined), expected_text(LONG_TOKENS), "{id}");
            if n == 0 {
                // The same request again, on B: the same response.
                let retry = post(format!("{b_url}/v1/responses"), body, Some("retry-me"))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(retry.status(), 200);
                assert_eq!(sse_events(&retry.text().await.unwrap()), joined);
            }
        }
        let calls: u64 = mocks.iter().map(MockServer::requests).sum();
        assert_eq!(
            calls, STREAMS as u64,
            "each provider called once per stream"
        );
        for node in nodes {
            node.shutdown().await.unwrap();
        }
        b.shutdown().await;
    })
    .await
    .expect("test exceeded its bound");
}

/// R-JRN-3, R-JRN-1, R-MULTI-1, R-PARK-2: Edge A, a real process, is
/// frozen (SIGSTOP) while durable streams run through it, for longer than
/// its ownership lease. The nodes lose its connection and park the runs; B
/// sees A's lease expire, raises each record's epoch, adopts the run and
/// finishes the answer. Then A wakes (SIGCONT) with its requests still
/// open: their journal writes are fenced, and they tell their clients
/// nothing of their own. Each client, still on A's stream, reads on from
/// the record B wrote to `response.completed`: the same stream B serves,
/// with one provider call per stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_edges_clients_read_on_from_the_edge_that_took_their_records_when_it_wakes() {
    const STREAMS: usize = 3;
    const LONG_TOKENS: u32 = 120;
    let Some(server) = NatsServer::start() else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript {
            tokens: LONG_TOKENS,
            tokens_per_second: 40.0,
            ..MockScript::default()
        })
        .await
        .unwrap();
        let (a, b, nodes) =
            killable_edge_beside_edge(&pki, &server, 20_000, "", std::slice::from_ref(&mock)).await;
        let b_url = url(&b, "");
        let mut open = Vec::new();
        for n in 0..STREAMS {
            let body = json!({"model": "m", "input": format!("frozen {n}"), "stream": true});
            let mut r = post(format!("{}/v1/responses", a.http), &body, None)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let mut text = String::new();
            while sse_events(&text).len() < 4 {
                let chunk = r.chunk().await.unwrap().expect("the stream goes on");
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
            open.push((r, text));
        }
        signal(&a.child, "-STOP");
        let ids: Vec<String> = open
            .iter()
            .map(|(_, text)| {
                sse_events(text)[0].1["response"]["id"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        for id in &ids {
            object_when(&b_url, id, "B to finish the answer", |o| {
                o["status"] == "completed"
            })
            .await;
        }
        signal(&a.child, "-CONT");
        for ((mut r, mut text), id) in open.into_iter().zip(&ids) {
            while let Some(chunk) = r.chunk().await.unwrap() {
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
            let events = sse_events(&text);
            assert_eq!(
                events.last().and_then(|(_, d)| d["type"].as_str()),
                Some("response.completed"),
                "{id}: the client on the woken Edge read B's end: {text}"
            );
            let (_, full) = get(format!("{b_url}/v1/responses/{id}?stream=true")).await;
            assert_eq!(events, sse_events(&full), "{id}: the record's stream");
            assert_eq!(text_of(&events), expected_text(LONG_TOKENS), "{id}");
        }
        assert_eq!(
            mock.requests(),
            STREAMS as u64,
            "one provider call per stream"
        );
        // The woken Edge's requests found their records taken (R-JRN-3).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let (_, metrics) = get(format!("{}/metrics", a.http)).await;
            let fenced: f64 = metrics
                .lines()
                .filter(|l| l.starts_with("iop_edge_journal_writes_total{"))
                .filter(|l| l.contains("outcome=\"fenced\""))
                .filter(|l| l.contains("op=\"append\"") || l.contains("op=\"finish\""))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            if fenced >= 1.0 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the woken Edge never wrote its records again: {metrics}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for node in nodes {
            node.shutdown().await.unwrap();
        }
        b.shutdown().await;
    })
    .await
    .expect("test exceeded its bound");
}

/// Send `sig` (`-STOP`, `-CONT`) to a running child process.
fn signal(child: &tokio::process::Child, sig: &str) {
    let pid = child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {sig} {pid}");
}

/// Edge A as a process of its own (to kill) and Edge B in this process,
/// both on `server`'s journal with `park_grace_ms` and `extra` TOML; a node
/// `node-<i>` for each mock, dialing both, ready on both with a generation
/// each.
async fn killable_edge_beside_edge(
    pki: &Pki,
    server: &NatsServer,
    park_grace_ms: u64,
    extra: &str,
    mocks: &[MockServer],
) -> (EdgeProcess, RunningEdge, Vec<iop_node::RunningNode>) {
    let b_config = EdgeConfig::parse(
        &edge_toml_with("edge-b", &server.url(), 0, 0, park_grace_ms, extra),
        pki.path(),
    )
    .unwrap();
    let b = RunningEdge::start(b_config).await.unwrap();
    let (quic_port, http_port) = (free_udp_port(), free_tcp_port());
    let a_config = pki.path().join("edge-a.toml");
    std::fs::write(
        &a_config,
        edge_toml_with(
            "edge-a",
            &server.url(),
            quic_port,
            http_port,
            park_grace_ms,
            extra,
        ),
    )
    .unwrap();
    let a_quic: std::net::SocketAddr = format!("127.0.0.1:{quic_port}").parse().unwrap();
    let nodes: Vec<iop_node::RunningNode> = mocks
        .iter()
        .enumerate()
        .map(|(i, mock)| {
            iop_node::RunningNode::start(node_config_edges(
                pki,
                &format!("node-{}", i + 1),
                &[a_quic, b.quic_addr],
                &node_providers(mock),
            ))
        })
        .collect();
    let a = start_edge_process(&a_config, http_port, KEY).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !nodes
        .iter()
        .all(|n| n.generations().iter().all(Option::is_some))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "nodes not ready on both Edges"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (a, b, nodes)
}

/// R-PARK-2, R-TAKE-1, R-IDEM-1: an Edge killed after it started a
/// durable run and before the run's first event was journaled leaves the
/// run parked on its node with nothing of it durable. Another Edge adopts
/// the run from its first frame: the client's retry with the same key gets
/// the whole answer there, and the provider is called once. (Refused as
/// "nothing journaled", the record would end `incomplete` without an
/// event, freeing its key, and the retry would call the provider again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_edge_died_before_its_first_event_is_adopted_elsewhere_not_called_again() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    tokio::time::timeout(Duration::from_secs(90), async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        // The first token comes long after the call: the Edge dies in
        // between, with nothing to journal yet.
        let mock = MockServer::start(MockScript {
            tokens: TOKENS,
            tokens_per_second: 200.0,
            prefill_ms: 2_000,
            ..MockScript::default()
        })
        .await
        .unwrap();
        let (mut a, b, nodes) =
            killable_edge_beside_edge(&pki, &server, 20_000, "", std::slice::from_ref(&mock)).await;
        let body = json!({"model": "m", "input": "first event", "stream": true});
        let first =
            tokio::spawn(post(format!("{}/v1/responses", a.http), &body, Some("first")).send());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while mock.requests() == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the provider was never called"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        a.child.start_kill().unwrap();
        let _ = a.child.wait().await;
        let _ = first.await;
        // The same request again, on B, until it answers with the stream.
        let b_url = url(&b, "");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let events = loop {
            let r = post(format!("{b_url}/v1/responses"), &body, Some("first"))
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .unwrap();
            if r.status() == 200 {
                break sse_events(&r.text().await.unwrap());
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "B never answered the retry: {}",
                r.status()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            events.last().and_then(|(_, d)| d["type"].as_str()),
            Some("response.completed"),
            "adopted and finished on B: {events:?}"
        );
        assert_eq!(text_of(&events), expected_text(TOKENS));
        assert_eq!(mock.requests(), 1, "the provider was called once");
        for node in nodes {
            node.shutdown().await.unwrap();
        }
        b.shutdown().await;
    })
    .await
    .expect("test exceeded its bound");
}

/// An Edge on its own embedded journal (`state_dir` of its own) with two
/// providers on node-1: `p1` on target `t1`, `p2` on target `t2`.
fn two_target_edge(pki: &Pki, name: &str) -> EdgeConfig {
    let head = edge_sections_toml(None, &format!("{name}-state"), 0, 0);
    let text = format!(
        r#"
{head}[admission]
queue_capacity = 64
queue_timeout_ms = 5000
[[providers]]
id = "p1"
node = "node-1"
adapter = "openai"
target = "t1"
models = ["m"]
capacity = 8
[[providers]]
id = "p2"
node = "node-1"
adapter = "openai"
target = "t2"
models = ["m"]
capacity = 8
[[api_keys]]
principal = "tester"
key_file = "key"
"#
    );
    EdgeConfig::parse(&text, pki.path()).expect("edge config")
}

/// R-MULTI-1, R-FAIL-1: a provider's capacity holds however many Edges
/// dispatch to it. One node connected to two Edges; its target `t1` takes
/// one run at a time (`[[providers]] max_concurrent_runs = 1`) while each
/// Edge believes it takes 8. Streams sent through both Edges at once: the
/// node refuses every run past the limit with `node_overloaded` before
/// calling the provider, each Edge re-admits those to `t2`, and every
/// client gets its whole answer; `t1`'s server never answers two calls at
/// once, and no provider call is made twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_capacity_holds_across_edges_and_the_overflow_goes_elsewhere() {
    const PER_EDGE: usize = 3;
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let script = MockScript {
            tokens: TOKENS,
            tokens_per_second: 40.0,
            ..MockScript::default()
        };
        let small = MockServer::start(script.clone()).await.unwrap();
        let big = MockServer::start(script).await.unwrap();
        let a = RunningEdge::start(two_target_edge(&pki, "cap-a")).await.unwrap();
        let b = RunningEdge::start(two_target_edge(&pki, "cap-b")).await.unwrap();
        let providers = format!(
            "[[providers]]\nadapter = \"openai\"\ntarget = \"t1\"\nbase_url = \"{}\"\nmax_concurrent_runs = 1\n\
             [[providers]]\nadapter = \"openai\"\ntarget = \"t2\"\nbase_url = \"{}\"\n",
            small.base_url(),
            big.base_url()
        );
        let node = iop_node::RunningNode::start(node_config_edges(
            &pki,
            "node-1",
            &[a.quic_addr, b.quic_addr],
            &providers,
        ));
        ready_generation(&a, "node-1").await;
        ready_generation(&b, "node-1").await;
        let generations = node.generations();
        assert!(
            generations.iter().all(Option::is_some),
            "one ready connection per Edge: {generations:?}"
        );
        let body = json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "stream": true
        });
        let mut calls = Vec::new();
        for edge in [&a, &b] {
            for _ in 0..PER_EDGE {
                let r = post(url(edge, "/v1/chat/completions"), &body, None).send();
                calls.push(tokio::spawn(async move {
                    let r = r.await.unwrap();
                    (r.status().as_u16(), r.text().await.unwrap())
                }));
            }
        }
        for call in calls {
            let (status, text) = call.await.unwrap();
            assert_eq!(status, 200, "{text}");
            let content: String = text
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
                .collect();
            assert_eq!(content, expected_text(TOKENS), "a whole answer: {text}");
        }
        assert!(small.requests() >= 1, "t1 served some");
        assert_eq!(
            small.max_in_flight(),
            1,
            "t1 never ran more than its limit, whichever Edge sent the run"
        );
        assert_eq!(
            small.requests() + big.requests(),
            (2 * PER_EDGE) as u64,
            "a refused run called no provider"
        );
        node.shutdown().await.unwrap();
        a.shutdown().await;
        b.shutdown().await;
    })
    .await;
}

struct ProcessDeployment {
    edge: EdgeProcess,
    node: iop_node::RunningNode,
}

async fn start_edge_process_with_node(
    pki: &Pki,
    config: &std::path::Path,
    quic_port: u16,
    http_port: u16,
    mock: &MockServer,
) -> ProcessDeployment {
    let edge_addr: std::net::SocketAddr = format!("127.0.0.1:{quic_port}").parse().unwrap();
    let node = start_node(pki, "node-1", edge_addr, &node_providers(mock));
    let edge = start_edge_process(config, http_port, KEY).await;
    ProcessDeployment { edge, node }
}

/// A NATS server restart (SIGKILL, then started on the same store
/// directory) loses no acknowledged event: a response finished before it
/// reads back whole from either Edge after it, and its idempotent retry
/// still runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_loses_no_finished_response() {
    let Some(mut server) = NatsServer::start() else {
        return;
    };
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let d = TwoEdges::start(
            &pki,
            &server,
            MockScript {
                tokens: TOKENS,
                ..MockScript::default()
            },
        )
        .await;
        let body = json!({"model": "m", "input": "keep me"});
        let r = post(url(&d.a, "/v1/responses"), &body, Some("kept-1"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let before: Value = r.json().await.unwrap();
        assert_eq!(before["status"], "completed");
        let id = before["id"].as_str().unwrap().to_owned();
        server.restart();
        for edge in [&d.a, &d.b] {
            let after =
                object_when(&url(edge, ""), &id, "the store to answer again", |_| true).await;
            assert_eq!(after["status"], "completed");
            assert_eq!(after["output"], before["output"], "the same answer");
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let retry = loop {
            let r = post(url(&d.b, "/v1/responses"), &body, Some("kept-1"))
                .send()
                .await
                .unwrap();
            if r.status() == 200 {
                break r;
            }
            assert!(tokio::time::Instant::now() < deadline, "{}", r.status());
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let retried: Value = retry.json().await.unwrap();
        assert_eq!(retried["id"], before["id"]);
        assert_eq!(d.mock.requests(), 1, "the retry ran nothing (R-IDEM-1)");
        d.shutdown().await;
    })
    .await;
}

/// A store outage (the NATS server killed): durable requests fail fast
/// with 503 `response_store_unavailable` (the store's 30 s answer timeout
/// is never waited for: the client here gives up after 10 s), ephemeral
/// ones succeed, `/status` shows the store failing; once the server is
/// back durable requests work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_fails_durable_requests_fast_and_leaves_ephemeral_ones_alone() {
    let Some(mut server) = NatsServer::start() else {
        return;
    };
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let d = TwoEdges::start(
            &pki,
            &server,
            MockScript {
                tokens: 5,
                ..MockScript::default()
            },
        )
        .await;
        server.kill();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let durable = json!({"model": "m", "input": "keep me"});
        let mut refused = None;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while refused.is_none() {
            let r = client
                .post(url(&d.a, "/v1/responses"))
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(durable.to_string())
                .send()
                .await
                .expect("answered within the client's bound");
            if r.status() == 503 {
                refused = Some(r.json::<Value>().await.unwrap());
            } else {
                assert!(tokio::time::Instant::now() < deadline, "{}", r.status());
            }
        }
        let refused = refused.unwrap();
        assert_eq!(
            refused["error"]["code"], "response_store_unavailable",
            "{refused}"
        );
        let keyed = client
            .post(url(&d.a, "/v1/chat/completions"))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .header("idempotency-key", "during-outage")
            .body(
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
            )
            .send()
            .await
            .expect("answered within the client's bound");
        assert_eq!(keyed.status(), 503);
        // Ephemeral traffic never touches the store.
        for (path, body) in [
            (
                "/v1/chat/completions",
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            ),
            (
                "/v1/responses",
                json!({"model": "m", "input": "hi", "store": false}),
            ),
        ] {
            let r = client
                .post(url(&d.a, path))
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{path}: {}", r.text().await.unwrap());
        }
        let (_, status) = get(url(&d.a, "/status")).await;
        let status: Value = serde_json::from_str(&status).unwrap();
        assert_eq!(status["journal"]["state"], "failing", "{status}");
        assert!(status["journal"]["errors"].as_u64() > Some(0));
        server.restart();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let r = post(url(&d.a, "/v1/responses"), &durable, None)
                .send()
                .await
                .unwrap();
            if r.status() == 200 {
                let object: Value = r.json().await.unwrap();
                assert_eq!(object["status"], "completed");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the store came back"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        d.shutdown().await;
    })
    .await;
}

/// R-JRN-4, R-JRN-6: a store outage that outlasts a running response's
/// write retries (here `write_retry_ms = 100`, then its terminal tried
/// five times in all) leaves its request unable to end the record. The
/// Edge's custody ends it once the store is back, without a restart and
/// without waiting for a scan's park window (30 s here): `failed`
/// (`journal_unavailable`) with the events that were durable, the
/// provider called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_terminal_the_store_refused_is_ended_once_the_store_is_back() {
    let Some(mut server) = NatsServer::start() else {
        return;
    };
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript {
            tokens: 400,
            tokens_per_second: 40.0,
            ..MockScript::default()
        })
        .await
        .unwrap();
        let text = edge_toml_with("edge-a", &server.url(), 0, 0, 30_000, "").replacen(
            "[journal]\n",
            "[journal]\nwrite_retry_ms = 100\n",
            1,
        );
        let edge = RunningEdge::start(EdgeConfig::parse(&text, pki.path()).unwrap())
            .await
            .unwrap();
        let node = start_node(&pki, "node-1", edge.quic_addr, &node_providers(&mock));
        ready_generation(&edge, "node-1").await;
        let body = json!({"model": "m", "input": "outlast me", "stream": true});
        let mut r = post(url(&edge, "/v1/responses"), &body, None)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let seen = read_events(&mut r, 4).await;
        let id = seen[0].1["response"]["id"].as_str().unwrap().to_owned();
        server.kill();
        // Past the request's retries: an append refused, then its
        // terminal five times, 0.5 s apart.
        tokio::time::sleep(Duration::from_secs(6)).await;
        drop(r);
        server.restart();
        let object = object_when(&url(&edge, ""), &id, "the record's terminal", |o| {
            o["status"] != "in_progress"
        })
        .await;
        assert_eq!(object["status"], "failed", "{object}");
        let (status, stream) = get(url(&edge, &format!("/v1/responses/{id}?stream=true"))).await;
        assert_eq!(status, 200, "{stream}");
        let events = sse_events(&stream);
        assert!(
            events.len() > seen.len(),
            "the durable prefix, then the terminal: {events:?}"
        );
        assert_eq!(
            events[..seen.len()],
            seen[..],
            "what the client saw is kept"
        );
        assert_eq!(
            events.last().and_then(|(_, d)| d["type"].as_str()),
            Some("response.failed"),
            "{stream}"
        );
        assert_eq!(mock.requests(), 1, "nothing sent again");
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

/// R-JRN-6: an Edge that cannot reach its NATS servers starts all the
/// same (at once: a refused connection ends the first attempt), and
/// refuses durable requests with 503 `response_store_unavailable` while it
/// keeps trying (see tests/store_faults.rs for the store coming back).
#[tokio::test]
async fn an_unreachable_nats_server_leaves_the_edge_serving_with_durable_refused() {
    let pki = Pki::new(&["node-1"]);
    write_secret(&pki.path().join("key"), KEY);
    let dead = format!("nats://127.0.0.1:{}", free_tcp_port());
    let edge = tokio::time::timeout(
        Duration::from_secs(10),
        RunningEdge::start(edge_config(&pki, "edge-a", &dead)),
    )
    .await
    .expect("the start does not wait for the store")
    .expect("the Edge starts");
    assert_ne!(
        edge.journal_store_state(),
        iop_core::journal::availability::StoreState::Up
    );
    let r = post(
        url(&edge, "/v1/responses"),
        &json!({"model": "m", "input": "hi"}),
        None,
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 503);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["error"]["code"], "response_store_unavailable",
        "{body}"
    );
    let (_, status) = get(url(&edge, "/status")).await;
    let status: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["journal"]["store_state"], "connecting", "{status}");
    assert_eq!(
        status["journal"]["last_open_failure"], "unreachable",
        "{status}"
    );
    edge.shutdown().await;
}

/// R-TAKE-2: a second Edge process started with a live Edge's `edge_id`
/// on the same NATS journal is refused as soon as its lease watch sees
/// the other renew it, naming the conflict, having written nothing under
/// that id (its durable requests were refused meanwhile); once the first
/// is killed (its lease no longer renewed), the same id starts again
/// within one lease TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_with_a_live_edges_id_is_refused_and_a_restart_after_a_crash_starts() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let (quic_port, http_port) = (free_udp_port(), free_tcp_port());
        let config = pki.path().join("edge-a.toml");
        std::fs::write(
            &config,
            edge_toml("edge-a", &server.url(), quic_port, http_port),
        )
        .unwrap();
        let mut a = start_edge_process_with_node(&pki, &config, quic_port, http_port, &mock).await;
        // The twin: the same edge_id, its own ports and state directory.
        let twin_http = free_tcp_port();
        let twin_config = pki.path().join("edge-a-twin.toml");
        std::fs::write(
            &twin_config,
            edge_toml("edge-a", &server.url(), free_udp_port(), twin_http)
                .replace("state_dir = \"edge-a-state\"", "state_dir = \"twin-state\""),
        )
        .unwrap();
        let twin = tokio::time::timeout(
            Duration::from_secs(20),
            tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-edge"))
                .args(["run", "--config"])
                .arg(&twin_config)
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("the twin is refused within its watch, not left running")
        .unwrap();
        assert!(!twin.status.success());
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&twin.stdout),
            String::from_utf8_lossy(&twin.stderr)
        );
        assert!(said.contains("edge_id \"edge-a\" is in use"), "{said}");
        // The first Edge still serves, its lease untouched.
        let (status, _) = get(format!("{}/healthz", a.edge.http)).await;
        assert_eq!(status, 200);
        // A crash: the lease stops moving, and a restart takes it.
        a.edge.child.start_kill().unwrap();
        let _ = a.edge.child.wait().await;
        let restarted_at = tokio::time::Instant::now();
        let restarted = start_edge_process(&config, http_port, KEY).await;
        assert!(
            restarted_at.elapsed() < Duration::from_millis(LEASE_TTL_MS) + Duration::from_secs(10),
            "took {:?}",
            restarted_at.elapsed()
        );
        drop(restarted);
        a.node.shutdown().await.unwrap();
    })
    .await;
}
