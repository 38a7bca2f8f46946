//! Tenants' limits and budgets over real HTTP and real QUIC (SPEC §9):
//! a key over its requests per minute gets 429 `rate_limit_exceeded` with
//! `Retry-After` and OpenAI's `x-ratelimit-*` headers while another
//! principal's key is served (R-TEN-1); a principal's budget refuses a
//! request whose reservation does not fit with 429 `insufficient_quota`,
//! before any provider call: the mock's request counter equals the
//! admitted count (R-TEN-2).

mod common;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use serde_json::{Value, json};

const LIMITED: &str = "sk-tenant-limited-0123456789";
const OTHER: &str = "sk-tenant-other-0123456789";
const BUDGETED: &str = "sk-tenant-budgeted-0123456789";

struct Deployment {
    edge: RunningEdge,
    _node: iop_node::RunningNode,
    mock: MockServer,
    _pki: Pki,
}

async fn deployment() -> Deployment {
    let pki = Pki::new(&["node-1"]);
    write_secret(&pki.path().join("limited"), LIMITED);
    write_secret(&pki.path().join("other"), OTHER);
    write_secret(&pki.path().join("budgeted"), BUDGETED);
    let mock = MockServer::start(MockScript {
        tokens: 100,
        ..MockScript::default()
    })
    .await
    .unwrap();
    // Each request of `budgeted` reserves its body's bytes plus 100 output
    // tokens at 1 micro-unit a token, and spends about 110; the
    // principal's budget is 2,000 a day.
    let extra = r#"
[[providers]]
id = "p1"
node = "node-1"
adapter = "openai"
target = "t"
[[routes]]
model = "m"
providers = ["p1"]
[[api_keys]]
principal = "team-a"
id = "team-a-limited"
key_file = "limited"
admin = true
limits = { requests_per_minute = 5 }
[[api_keys]]
principal = "team-b"
key_file = "other"
[[api_keys]]
principal = "team-c"
key_file = "budgeted"
[[principals]]
name = "team-c"
limits = { budget_micros = 2000, budget_period = "day" }
[[prices]]
model = "m"
input_per_mtok = 1000000
output_per_mtok = 1000000
"#;
    let edge = RunningEdge::start(edge_config(&pki, 0, extra))
        .await
        .unwrap();
    let node = start_node(
        &pki,
        "node-1",
        edge.quic_addr,
        &format!(
            "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
            mock.base_url()
        ),
    );
    ready_generation(&edge, "node-1").await;
    Deployment {
        edge,
        _node: node,
        mock,
        _pki: pki,
    }
}

async fn chat(d: &Deployment, key: &str, max_tokens: u32) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", d.edge.http_addr))
        .bearer_auth(key)
        .json(&json!({
            "model": "m",
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}],
        }))
        .send()
        .await
        .unwrap()
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

#[tokio::test]
async fn r_ten_1_a_key_over_its_rate_gets_429_with_headers_and_another_principal_is_served() {
    bounded(async {
        let d = deployment().await;
        let mut ok = 0;
        let mut remaining = Vec::new();
        let mut refused = Vec::new();
        for _ in 0..8 {
            let r = chat(&d, LIMITED, 16).await;
            match r.status().as_u16() {
                200 => {
                    ok += 1;
                    assert_eq!(
                        header(&r, "x-ratelimit-limit-requests").as_deref(),
                        Some("5")
                    );
                    assert!(header(&r, "x-ratelimit-reset-requests").is_some());
                    remaining.push(header(&r, "x-ratelimit-remaining-requests"));
                }
                429 => {
                    let retry_after: u64 = header(&r, "retry-after")
                        .and_then(|v| v.parse().ok())
                        .expect("Retry-After");
                    assert!((1..=60).contains(&retry_after));
                    assert_eq!(
                        header(&r, "x-ratelimit-remaining-requests").as_deref(),
                        Some("0")
                    );
                    let body: Value = r.json().await.unwrap();
                    refused.push(body["error"]["code"].clone());
                }
                other => panic!("unexpected {other}"),
            }
            // Another principal's key meanwhile is unaffected.
            assert_eq!(chat(&d, OTHER, 16).await.status(), 200);
        }
        assert_eq!(
            ok, 5,
            "the limit within one window (the test runs well within a minute)"
        );
        assert_eq!(
            remaining,
            ["4", "3", "2", "1", "0"]
                .map(|s| Some(s.to_owned()))
                .to_vec()
        );
        assert_eq!(refused, vec![json!("rate_limit_exceeded"); 3]);
        d.edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn r_ten_2_a_reservation_over_the_budget_is_refused_before_any_provider_call() {
    bounded(async {
        let d = deployment().await;
        let before = d.mock.requests();
        let mut admitted = 0u64;
        let mut quota = 0;
        for _ in 0..40 {
            let r = chat(&d, BUDGETED, 100).await;
            match r.status().as_u16() {
                200 => admitted += 1,
                429 => {
                    let body: Value = r.json().await.unwrap();
                    assert_eq!(body["error"]["code"], "insufficient_quota");
                    assert_eq!(body["error"]["type"], "insufficient_quota");
                    quota += 1;
                }
                other => panic!("unexpected {other}"),
            }
        }
        assert!(
            admitted > 0 && quota > 0,
            "admitted {admitted}, refused {quota}"
        );
        assert_eq!(
            d.mock.requests() - before,
            admitted,
            "no provider call for a refused request"
        );
        d.edge.shutdown().await;
    })
    .await;
}
