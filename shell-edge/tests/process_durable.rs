//! A real Edge process killed with SIGKILL, again and again, while clients
//! stream durable responses, restarted on the same `state_dir` each time,
//! its node alive (SPEC §6): after every restart each event a client saw
//! is in the journal (R-JRN-1), the node's parked runs are adopted and
//! finish (R-PARK-1, R-PARK-2, R-TAKE-1), a resume returns exactly the
//! events the client missed up to one terminal (R-JRN-2, R-JRN-4), the
//! answers have no lost or repeated text, and an idempotent retry runs
//! nothing (R-IDEM-1). The mock provider's request counter shows one
//! provider call per response.

mod common;

use std::time::Duration;

use common::*;
use iop_node::mock::{MockScript, MockServer};
use serde_json::{Value, json};

const KEY: &str = "sk-durable-kill-0123456789";
/// Edge restarts.
const ROUNDS: usize = 4;
/// Streams in flight at each kill.
const STREAMS: usize = 8;
/// Tokens of each answer.
const TOKENS: u32 = 60;

/// Stream one durable response until the connection breaks or ends: its
/// id and the events the client saw.
async fn stream_until_cut(http: String, n: usize) -> (Option<String>, Vec<(u64, Value)>) {
    let r = reqwest::Client::new()
        .post(format!("{http}/v1/responses"))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .header("idempotency-key", format!("kill-{n}"))
        .body(json!({"model": "m", "input": format!("stream {n}"), "stream": true}).to_string())
        .send()
        .await;
    let Ok(mut r) = r else {
        return (None, Vec::new());
    };
    let mut text = String::new();
    while let Ok(Some(chunk)) = r.chunk().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let seen = sse_events(&text);
    let id = seen
        .first()
        .and_then(|(_, d)| d["response"]["id"].as_str())
        .map(str::to_owned);
    (id, seen)
}

async fn get_text(url: String) -> String {
    reqwest::Client::new()
        .get(url)
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn durable_streams_survive_edge_kills_with_every_seen_event_journaled_r_jrn_1() {
    bounded_long(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript {
            tokens: TOKENS,
            tokens_per_second: 100.0,
            ..MockScript::default()
        })
        .await
        .unwrap();
        let (quic_port, http_port) = (free_udp_port(), free_tcp_port());
        let config = pki.path().join("edge.toml");
        std::fs::write(
            &config,
            format!(
                "\n{}{P1_ON_NODE_1_TOML}{TESTER_ADMIN_KEY_TOML}",
                edge_sections_toml(None, "edge-state", quic_port, http_port)
            ),
        )
        .unwrap();
        let edge_addr: std::net::SocketAddr = format!("127.0.0.1:{quic_port}").parse().unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                mock.base_url()
            ),
        );
        let mut seen_all: Vec<(String, Vec<(u64, Value)>)> = Vec::new();
        let mut cut = std::collections::HashSet::new();
        let mut edge = start_edge_process(&config, http_port, KEY).await;
        for round in 0..ROUNDS {
            let before = mock.requests();
            let streams: Vec<_> = (0..STREAMS)
                .map(|i| tokio::spawn(stream_until_cut(edge.http.clone(), round * STREAMS + i)))
                .collect();
            // Kill while the streams are in flight: after some output.
            mock.wait_for(|s| s.requests >= before + STREAMS as u64)
                .await;
            tokio::time::sleep(Duration::from_millis(150 + 40 * round as u64)).await;
            edge.child.start_kill().unwrap();
            let _ = edge.child.wait().await;
            for s in streams {
                let (id, seen) = s.await.unwrap();
                let id = id.expect("every stream was created before the kill");
                seen_all.push((id, seen));
            }
            edge = start_edge_process(&config, http_port, KEY).await;
            // After the restart, with the node alive, each stream cut by the
            // kill goes on (R-PARK-2, R-TAKE-1): a resume after the last
            // event the client saw gives exactly the missing events up to
            // the terminal, and the concatenation is the whole answer.
            let round_seen = &seen_all[round * STREAMS..];
            for (id, seen) in round_seen {
                if seen.last().and_then(|(_, d)| d["type"].as_str()) != Some("response.completed") {
                    cut.insert(id.clone());
                }
                let after = seen
                    .last()
                    .map_or(String::new(), |(n, _)| format!("&starting_after={n}"));
                let rest = sse_events(
                    &get_text(format!(
                        "{}/v1/responses/{id}?stream=true{after}",
                        edge.http
                    ))
                    .await,
                );
                let full = sse_events(
                    &get_text(format!("{}/v1/responses/{id}?stream=true", edge.http)).await,
                );
                assert!(
                    full.len() >= seen.len() && full[..seen.len()] == seen[..],
                    "{id}: every event a client saw is durable and in place (R-JRN-1)"
                );
                let mut joined = seen.clone();
                joined.extend(rest);
                assert_eq!(
                    joined, full,
                    "{id}: the resume is exactly the missing events (R-JRN-2)"
                );
                let object: Value = serde_json::from_str(
                    &get_text(format!("{}/v1/responses/{id}", edge.http)).await,
                )
                .unwrap();
                assert_eq!(
                    object["status"], "completed",
                    "{id}: adopted and finished: {object}"
                );
                let text = object["output"][0]["content"][0]["text"]
                    .as_str()
                    .unwrap_or("");
                assert_eq!(
                    text,
                    expected_text(TOKENS),
                    "{id}: no lost or repeated text"
                );
            }
        }
        // The kills cut streams mid-answer (else this proves nothing).
        assert!(
            cut.len() >= ROUNDS * STREAMS / 2,
            "{} of {} streams were cut",
            cut.len(),
            ROUNDS * STREAMS
        );
        // One provider call per response, whatever the kills: adoption
        // calls no provider, nor do reads or the retries below.
        let calls = mock.requests();
        assert_eq!(calls, (ROUNDS * STREAMS) as u64);
        for (n, (id, _)) in seen_all.iter().enumerate() {
            let (rid, _) = stream_until_cut(edge.http.clone(), n).await;
            assert_eq!(
                rid.as_deref(),
                Some(id.as_str()),
                "the key names the same response"
            );
        }
        assert_eq!(
            mock.requests(),
            calls,
            "idempotent retries run nothing (R-IDEM-1)"
        );
        edge.child.start_kill().unwrap();
        let _ = edge.child.wait().await;
        node.shutdown().await.unwrap();
    })
    .await;
}

/// The text of a Chat Completions stream's chunks.
/// An Edge process's config with providers `p1` (node-1) and `p2`
/// (node-2) in one pool for `m` whose answers continue (R-CONT-1), each in
/// front of its own mock answering [`TOKENS`] tokens at
/// `tokens_per_second`; `journal` are its `[journal]` lines. Nothing runs
/// yet but the mocks.
struct TwoProviders {
    pki: Pki,
    first: MockServer,
    second: MockServer,
    quic_port: u16,
    http_port: u16,
    config: std::path::PathBuf,
}

impl TwoProviders {
    async fn start(tokens_per_second: f64, journal: &str) -> Self {
        let pki = Pki::new(&["node-1", "node-2"]);
        write_secret(&pki.path().join("key"), KEY);
        let script = MockScript {
            tokens: TOKENS,
            tokens_per_second,
            ..MockScript::default()
        };
        let first = MockServer::start(script.clone()).await.unwrap();
        let second = MockServer::start(script).await.unwrap();
        let (quic_port, http_port) = (free_udp_port(), free_tcp_port());
        let head = edge_sections_toml(None, "edge-state", quic_port, http_port);
        let config = pki.path().join("edge.toml");
        let providers: String = (1..=2)
            .map(|n| {
                format!(
                    "[[providers]]\nid = \"p{n}\"\nnode = \"node-{n}\"\nadapter = \"openai\"\ntarget = \"t\"\ncapacity = 16\n"
                )
            })
            .collect();
        std::fs::write(
            &config,
            format!(
                "\n{head}[journal]\n{journal}\n{providers}[[routes]]\nmodel = \"m\"\nproviders = [\"p1\", \"p2\"]\ncontinuation = true\n{TESTER_ADMIN_KEY_TOML}"
            ),
        )
        .unwrap();
        Self {
            pki,
            first,
            second,
            quic_port,
            http_port,
            config,
        }
    }
}

fn chat_text(events: &[(u64, Value)]) -> String {
    events
        .iter()
        .filter_map(|(_, d)| d["choices"][0]["delta"]["content"].as_str())
        .collect()
}

/// The storm's lost answer (R-TAKE-1, R-CONT-1): an Edge killed mid-answer
/// whose node is gone too, so no node reports the run parked. After the
/// restart, past the park window, the orphan is continued on another
/// provider of its pool (its route opts in), never ended `incomplete`
/// and never sent from scratch: the client's resume gives the whole text
/// once, the first provider was called once and the second once, with
/// the answer so far.
#[tokio::test]
async fn an_orphan_whose_run_is_gone_is_continued_on_its_pool_after_an_edge_kill_r_take_1() {
    bounded_long(async {
        let TwoProviders {
            pki,
            first,
            second,
            quic_port,
            http_port,
            config,
        } = TwoProviders::start(
            60.0,
            "park_grace_ms = 1000\ntakeover_scan_interval_ms = 200",
        )
        .await;
        let edge_addr: std::net::SocketAddr = format!("127.0.0.1:{quic_port}").parse().unwrap();
        let node = |url: String| {
            format!("[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{url}\"\n")
        };
        let node_1 = start_node(&pki, "node-1", edge_addr, &node(first.base_url()));
        let mut edge = start_edge_process(&config, http_port, KEY).await;
        // Only node-1 is there: the answer starts on p1.
        let http = edge.http.clone();
        let stream = tokio::spawn(async move {
            let r = reqwest::Client::new()
                .post(format!("{http}/v1/chat/completions"))
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .header("idempotency-key", "orphan-1")
                .body(
                    json!({"model": "m", "stream": true,
                           "messages": [{"role": "user", "content": "go"}]})
                    .to_string(),
                )
                .send()
                .await
                .unwrap();
            let mut r = r;
            let mut text = String::new();
            while let Ok(Some(chunk)) = r.chunk().await {
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
            sse_events(&text)
        });
        first.wait_for(|s| s.requests >= 1).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The Edge dies mid-answer, and its node with the run.
        edge.child.start_kill().unwrap();
        let _ = edge.child.wait().await;
        node_1.shutdown().await.unwrap();
        let seen = stream.await.unwrap();
        let id = seen
            .first()
            .and_then(|(_, d)| d["id"].as_str())
            .map(str::to_owned)
            .expect("the stream started before the kill");
        let prefix = chat_text(&seen);
        assert!(
            !prefix.is_empty() && prefix.len() < expected_text(TOKENS).len(),
            "cut mid-answer: {prefix:?}"
        );
        let _node_2 = start_node(&pki, "node-2", edge_addr, &node(second.base_url()));
        edge = start_edge_process(&config, http_port, KEY).await;
        // The client resumes after what it saw: the rest arrives once the
        // orphan is continued, and the whole is the answer, once.
        let after = seen.last().map(|(n, _)| *n).unwrap_or(0);
        let rest = sse_events(
            &get_text(format!(
                "{}/v1/chat/completions/{id}?stream=true&starting_after={after}",
                edge.http
            ))
            .await,
        );
        let whole = format!("{prefix}{}", chat_text(&rest));
        assert_eq!(whole, expected_text(TOKENS), "no lost or repeated text");
        let object: Value = serde_json::from_str(
            &get_text(format!("{}/v1/chat/completions/{id}", edge.http)).await,
        )
        .unwrap();
        assert_eq!(
            object["choices"][0]["finish_reason"], "stop",
            "continued to its end, not incomplete: {object}"
        );
        assert_eq!(first.requests(), 1, "the first provider, once");
        assert_eq!(
            second.requests(),
            1,
            "one continuation, never the prompt again"
        );
        // R-TEN-2: the continuation is charged to the key the record names
        // (the killed Edge's hold on it died with that Edge): its usage
        // lands on the key's usage row (written every `usage_flush_ms`).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let row = loop {
            let r = reqwest::Client::new()
                .get(format!("{}/admin/usage?principal=tester", edge.http))
                .bearer_auth(KEY)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let usage: Value = r.json().await.unwrap();
            let row = usage["data"]
                .as_array()
                .and_then(|rows| rows.iter().find(|r| r["key"] == "tester-1"))
                .cloned();
            if let Some(row) = row.filter(|r| r["output_tokens"].as_u64() > Some(0)) {
                break row;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the continuation's usage on its key: {usage}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(row["principal"], "tester", "{row}");
        assert_eq!(row["model"], "m", "{row}");
        assert!(
            row["input_tokens"].as_u64() > Some(0),
            "the continuation's prompt and answer so far: {row}"
        );
        edge.child.start_kill().unwrap();
        let _ = edge.child.wait().await;
    })
    .await;
}

/// A Node process killed with SIGKILL under eight durable streams and
/// restarted at once (R-PARK-2, R-CONT-1): its registration names none of
/// its old runs, so the Edge stops waiting for them then, not at the end
/// of their park grace, and continues each answer on the pool's other
/// provider. Every client reads its whole answer once; the first provider
/// was called once per stream, the second once per stream with the answer
/// so far.
#[tokio::test]
async fn a_node_killed_and_restarted_has_its_streams_continued_before_their_grace_r_park_2() {
    bounded_long(async {
        const STREAMS: u64 = 8;
        // A grace far longer than the continued answers take.
        let grace = Duration::from_secs(60);
        let TwoProviders {
            pki,
            first,
            second,
            quic_port,
            http_port,
            config,
        } = TwoProviders::start(20.0, &format!("park_grace_ms = {}", grace.as_millis())).await;
        let edges = [format!("127.0.0.1:{quic_port}")];
        let mut node_1 = Component::node(&pki, "node-1", &edges, &first.base_url());
        node_1.start();
        let mut edge = start_edge_process(&config, http_port, KEY).await;
        // Every stream starts on p1 (node-2 is not there yet).
        let streams: Vec<_> = (0..STREAMS)
            .map(|n| {
                let http = edge.http.clone();
                tokio::spawn(async move {
                    let mut r = reqwest::Client::new()
                        .post(format!("{http}/v1/chat/completions"))
                        .bearer_auth(KEY)
                        .header("content-type", "application/json")
                        .header("idempotency-key", format!("node-kill-{n}"))
                        .body(
                            json!({"model": "m", "stream": true,
                                   "messages": [{"role": "user", "content": format!("go {n}")}]})
                            .to_string(),
                        )
                        .send()
                        .await
                        .unwrap();
                    let mut text = String::new();
                    while let Ok(Some(chunk)) = r.chunk().await {
                        text.push_str(&String::from_utf8_lossy(&chunk));
                    }
                    sse_events(&text)
                })
            })
            .collect();
        first.wait_for(|s| s.in_flight == STREAMS).await;
        let mut node_2 = Component::node(&pki, "node-2", &edges, &second.base_url());
        node_2.start();
        let client = reqwest::Client::new();
        let ready = tokio::time::Instant::now() + Duration::from_secs(30);
        while client
            .get(format!("{}/status", edge.http))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
            .matches("\"node_ready\":true")
            .count()
            < 2
        {
            assert!(tokio::time::Instant::now() < ready, "node-2 not ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Mid-answer (20 tokens a second: about a second of 60 tokens in).
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        node_1.kill().await;
        let killed = tokio::time::Instant::now();
        node_1.start();
        for stream in streams {
            let seen = stream.await.unwrap();
            assert_eq!(
                chat_text(&seen),
                expected_text(TOKENS),
                "each answer whole and once: {seen:?}"
            );
            assert_eq!(
                seen.iter()
                    .filter(|(_, d)| d["choices"][0]["finish_reason"] == "stop")
                    .count(),
                1,
                "one terminal"
            );
        }
        let took = killed.elapsed();
        assert!(
            took < grace / 4,
            "the answers went on {took:?} after the kill, not after the grace"
        );
        assert_eq!(first.requests(), STREAMS, "the first provider once each");
        let continued = second.stats();
        assert_eq!(
            (continued.requests, continued.continued),
            (STREAMS, STREAMS),
            "one continuation each, never the prompt alone"
        );
        edge.child.start_kill().unwrap();
        let _ = edge.child.wait().await;
        node_1.kill().await;
        node_2.kill().await;
    })
    .await;
}

/// [`bounded`] for a test of several process restarts.
async fn bounded_long<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(180), fut)
        .await
        .expect("test exceeded its bound")
}
