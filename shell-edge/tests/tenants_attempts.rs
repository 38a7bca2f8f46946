//! A fresh reservation per attempt over real HTTP and real QUIC (R-TEN-2):
//! a failover sends the prompt again, so it reserves again before it is
//! admitted. A principal whose budget holds one attempt's reservation but
//! not a second's gets 429 `insufficient_quota` when its first provider
//! fails, and the second provider is never called (its mock's request
//! counter stays put); a principal with room for both is served by the
//! failover.

mod common;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use serde_json::Value;

const POOR: &str = "sk-attempts-poor-0123456789";
const RICH: &str = "sk-attempts-rich-0123456789";

/// Most output tokens each request asks for.
const MAX_TOKENS: u64 = 40;

/// The request's body: its bytes bound its prompt (`prompt_tokens_max`).
fn body() -> String {
    format!(
        r#"{{"model":"m","max_tokens":{MAX_TOKENS},"messages":[{{"role":"user","content":"hi"}}]}}"#
    )
}

/// What one attempt reserves at 1 micro-unit a token: its prompt's bound
/// and its most output.
fn reservation() -> u64 {
    body().len() as u64 + MAX_TOKENS
}

struct Deployment {
    edge: RunningEdge,
    nodes: Vec<iop_node::RunningNode>,
    /// `p1`, the pool's first: answers 503 before any content.
    failing: MockServer,
    /// `p2`: healthy.
    healthy: MockServer,
    _pki: Pki,
}

async fn deployment() -> Deployment {
    let pki = Pki::new(&["node-1", "node-2"]);
    write_secret(&pki.path().join("poor"), POOR);
    write_secret(&pki.path().join("rich"), RICH);
    let failing = MockServer::start(MockScript {
        http_error: Some(503),
        ..MockScript::default()
    })
    .await
    .unwrap();
    let healthy = MockServer::start(MockScript::default()).await.unwrap();
    // `poor`'s budget holds one attempt's reservation and a half: its
    // chunk (a tenth of it) is less than a reservation, so what the Edge
    // holds is what the store granted. `rich`'s holds ten: its chunk is a
    // whole reservation.
    let r = reservation();
    let extra = format!(
        r#"
[[providers]]
id = "p1"
node = "node-1"
adapter = "openai"
target = "t"
models = ["m"]
[[providers]]
id = "p2"
node = "node-2"
adapter = "openai"
target = "t"
models = ["m"]
[[api_keys]]
principal = "poor"
key_file = "poor"
[[api_keys]]
principal = "rich"
key_file = "rich"
[[principals]]
name = "poor"
limits = {{ budget_micros = {poor}, budget_period = "total" }}
[[principals]]
name = "rich"
limits = {{ budget_micros = {rich}, budget_period = "total" }}
[[prices]]
model = "m"
input_per_mtok = 1000000
output_per_mtok = 1000000
"#,
        poor = r * 3 / 2,
        rich = r * 10,
    );
    let edge = RunningEdge::start(edge_config(&pki, 0, &extra))
        .await
        .unwrap();
    let node = |url: String| {
        format!("[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{url}\"\n")
    };
    let nodes = vec![
        start_node(&pki, "node-1", edge.quic_addr, &node(failing.base_url())),
        start_node(&pki, "node-2", edge.quic_addr, &node(healthy.base_url())),
    ];
    ready_generation(&edge, "node-1").await;
    ready_generation(&edge, "node-2").await;
    Deployment {
        edge,
        nodes,
        failing,
        healthy,
        _pki: pki,
    }
}

async fn chat(d: &Deployment, key: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", d.edge.http_addr))
        .bearer_auth(key)
        .header("content-type", "application/json")
        .body(body())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Send `key`'s request until its admission's reservation fits (the first
/// is refused while the Edge claims its allowance from the store, with
/// `Retry-After`, as any client would be): the answer of the admitted one.
async fn admitted_chat(d: &Deployment, key: &str) -> (u16, Value) {
    for _ in 0..50 {
        let (status, body) = chat(d, key).await;
        let message = body["error"]["message"].as_str().unwrap_or_default();
        let refused_at_admission = status == 429 && !message.contains("another attempt");
        if !refused_at_admission {
            return (status, body);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("{key} was never admitted");
}

#[tokio::test]
async fn r_ten_2_a_failover_that_does_not_fit_the_budget_is_refused_and_calls_no_provider() {
    bounded(async {
        let d = deployment().await;
        // Both providers are empty: the pool's first, p1, is chosen, and
        // answers 503; its failover to p2 must reserve again and does not
        // fit.
        let (status, body) = admitted_chat(&d, POOR).await;
        assert_eq!(status, 429, "{body}");
        assert_eq!(body["error"]["code"], "insufficient_quota", "{body}");
        assert_eq!(body["error"]["type"], "insufficient_quota", "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("another attempt")),
            "{body}"
        );
        assert_eq!(d.failing.requests(), 1, "the first attempt was made");
        assert_eq!(
            d.healthy.requests(),
            0,
            "no provider call for the refused attempt"
        );
        // Another principal with room for both attempts is served, by p2
        // (after p1's 503 if p1 is chosen again).
        let before = d.failing.requests();
        let (status, body) = admitted_chat(&d, RICH).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(d.healthy.requests(), 1, "answered once");
        assert!(d.failing.requests() - before <= 1);
        let snap = wait_for(&d.edge, "idle", |s| s.leases_in_use == 0).await;
        assert_eq!(snap.queue_depth, 0);
        for n in d.nodes {
            n.shutdown().await.unwrap();
        }
        d.edge.shutdown().await;
    })
    .await;
}
