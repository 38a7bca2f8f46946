//! Continuation (R-CONT-1) over real QUIC and real HTTP: a committed answer
//! whose provider fails mid-stream goes on on another provider of its pool,
//! which gets the answer so far as the assistant's partial message. The
//! mock providers' deterministic tokens show no text lost or repeated; their
//! request counters show one call each.

mod common;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use serde_json::{Value, json};

const KEY: &str = "sk-continuation-0123456789";
const TOKENS: u32 = 40;

struct Deployment {
    edge: RunningEdge,
    nodes: Vec<iop_node::RunningNode>,
    failing: MockServer,
    healthy: MockServer,
}

/// `p1` (node-1) cuts its answers after `cut_after` tokens; `p2` (node-2)
/// is healthy; model `m` routes to both, `continuation` as given.
async fn deployment(pki: &Pki, cut_after: u32, continuation: bool) -> Deployment {
    write_secret(&pki.path().join("key"), KEY);
    let script = MockScript {
        tokens: TOKENS,
        tokens_per_second: 400.0,
        ..MockScript::default()
    };
    let failing = MockServer::start(MockScript {
        abrupt_close_after: Some(cut_after),
        ..script.clone()
    })
    .await
    .unwrap();
    let healthy = MockServer::start(script).await.unwrap();
    let extra = format!(
        "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\n\
         [[providers]]\nid = \"p2\"\nnode = \"node-2\"\nadapter = \"openai\"\ntarget = \"t\"\n\
         [[routes]]\nmodel = \"m\"\nproviders = [\"p1\", \"p2\"]\ncontinuation = {continuation}\n\
         [[api_keys]]\nprincipal = \"tester\"\nkey_file = \"key\"\n"
    );
    let edge = RunningEdge::start(edge_config(pki, 0, &extra))
        .await
        .unwrap();
    let node = |url: String| {
        format!("[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{url}\"\n")
    };
    let nodes = vec![
        start_node(pki, "node-1", edge.quic_addr, &node(failing.base_url())),
        start_node(pki, "node-2", edge.quic_addr, &node(healthy.base_url())),
    ];
    ready_generation(&edge, "node-1").await;
    ready_generation(&edge, "node-2").await;
    Deployment {
        edge,
        nodes,
        failing,
        healthy,
    }
}

impl Deployment {
    async fn post(&self, path: &str, body: Value) -> String {
        reqwest::Client::new()
            .post(format!("http://{}{path}", self.edge.http_addr))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn stop(self) {
        for n in self.nodes {
            n.shutdown().await.unwrap();
        }
        self.edge.shutdown().await;
    }
}

fn data(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

fn expected_text() -> String {
    (0..TOKENS).map(iop_node::mock::token_text).collect()
}

#[tokio::test]
async fn r_cont_1_a_chat_stream_cut_mid_answer_goes_on_on_the_other_provider() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let d = deployment(&pki, 10, true).await;
        let body = d
            .post(
                "/v1/chat/completions",
                json!({"model": "m", "stream": true,
                    "messages": [{"role": "user", "content": "hi"}]}),
            )
            .await;
        let chunks = data(&body);
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, expected_text(), "no lost or repeated text: {body}");
        assert!(
            !body.contains("\"error\""),
            "one terminal, no error: {body}"
        );
        assert!(body.trim_end().ends_with("data: [DONE]"));
        assert_eq!(d.failing.requests(), 1);
        assert_eq!(d.healthy.requests(), 1, "the other provider continued once");
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn r_cont_1_a_durable_response_cut_mid_answer_is_continued_and_stored_whole() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let d = deployment(&pki, 10, true).await;
        let body = d
            .post(
                "/v1/responses",
                json!({"model": "m", "input": "hi", "stream": true}),
            )
            .await;
        let events = data(&body);
        let text: String = events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .filter_map(|e| e["delta"].as_str())
            .collect();
        assert_eq!(text, expected_text(), "{body}");
        let last = events.last().unwrap();
        assert_eq!(last["type"], "response.completed", "{body}");
        // The stored response is the whole answer, once.
        let id = last["response"]["id"].as_str().unwrap();
        let stored: Value = reqwest::Client::new()
            .get(format!("http://{}/v1/responses/{id}", d.edge.http_addr))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(stored["output"][0]["content"][0]["text"], expected_text());
        assert_eq!((d.failing.requests(), d.healthy.requests()), (1, 1));
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn without_continuation_a_cut_answer_ends_with_one_in_stream_error() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let d = deployment(&pki, 10, false).await;
        let body = d
            .post(
                "/v1/chat/completions",
                json!({"model": "m", "stream": true,
                    "messages": [{"role": "user", "content": "hi"}]}),
            )
            .await;
        assert_eq!(body.matches("\"error\"").count(), 1, "{body}");
        assert!(!body.contains("[DONE]"), "{body}");
        assert_eq!(d.healthy.requests(), 0, "nothing continued");
        d.stop().await;
    })
    .await;
}
