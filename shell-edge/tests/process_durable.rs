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
                r#"
[edge]
quic_listen = "127.0.0.1:{quic_port}"
http_listen = "127.0.0.1:{http_port}"
state_dir = "edge-state"
drain_timeout_ms = 500
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge.key"
[heartbeat]
interval_ms = {HB_INTERVAL_MS}
wait_ms = {HB_WAIT_MS}
[[providers]]
id = "p1"
node = "node-1"
adapter = "openai"
target = "t"
models = ["m"]
capacity = 64
[[api_keys]]
principal = "tester"
key_file = "key"
admin = true
"#
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

/// [`bounded`] for a test of several process restarts.
async fn bounded_long<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(180), fut)
        .await
        .expect("test exceeded its bound")
}
