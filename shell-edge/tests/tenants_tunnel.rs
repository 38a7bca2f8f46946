//! A tunnelled answer is charged what its provider reported in its own
//! format (R-TEN-2): the Edge relays the provider's bytes and reads the
//! usage from them (OpenAI's `usage`, the Responses API's
//! `response.completed`, the Messages API's `message_start` and
//! `message_delta`, Ollama's counts), over real HTTP and real QUIC. The
//! usage rows must hold exactly what each client was told; an answer
//! without a report is charged its text's estimate.

mod common;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use serde_json::{Value, json};

/// One key per case, each of its own principal (so each has its row).
const CASES: [&str; 10] = [
    "whole",
    "stream",
    "unreported",
    "messages",
    "ollama",
    "responses",
    "embeddings",
    "ollama-embed",
    "capped",
    "embed-budget",
];

/// What a request without a maximum reserves for its output, and is held
/// to when a budget counts it (the mock answers 13 tokens).
const CAP: u64 = 5;

/// An embedding request of route `m` (input 1 micro a token, output 2).
fn embed_body() -> Value {
    json!({"model": "m", "input": "hi"})
}

/// Its body's bytes: its prompt's reservation, in micros at `m`'s price.
fn embed_body_bytes() -> u64 {
    serde_json::to_vec(&embed_body()).unwrap().len() as u64
}

fn secret(case: &str) -> String {
    format!("sk-tunnel-{case}-0123456789")
}

struct Deployment {
    edge: RunningEdge,
    _node: iop_node::RunningNode,
    _mock: MockServer,
    _pki: Pki,
}

async fn deployment() -> Deployment {
    let pki = Pki::new(&["node-1"]);
    let mut keys = String::new();
    for (i, case) in CASES.iter().enumerate() {
        write_secret(&pki.path().join(case), &secret(case));
        keys.push_str(&format!(
            "[[api_keys]]\nprincipal = \"team-{case}\"\nkey_file = \"{case}\"\nadmin = {}\n",
            i == 0
        ));
    }
    let mock = MockServer::start(MockScript {
        tokens: 13,
        ..MockScript::default()
    })
    .await
    .unwrap();
    let extra = format!(
        r#"
[[providers]]
id = "p1"
node = "node-1"
adapter = "openai"
mode = "tunnel"
target = "t"
[[providers]]
id = "p2"
node = "node-1"
adapter = "ollama"
mode = "tunnel"
target = "o"
[[providers]]
id = "p3"
node = "node-1"
adapter = "openai"
target = "n"
[[routes]]
model = "m"
providers = ["p1"]
[[routes]]
model = "om"
providers = ["p2"]
[[routes]]
model = "mn"
providers = ["p3"]
[[prices]]
model = "m"
input_per_mtok = 1000000
output_per_mtok = 2000000
[[prices]]
model = "om"
input_per_mtok = 1000000
output_per_mtok = 1000000
[[prices]]
model = "mn"
input_per_mtok = 1000000
output_per_mtok = 1000000
[tenants]
default_max_output_tokens = {CAP}
[[principals]]
name = "team-capped"
limits = {{ budget_micros = 1000000000, budget_period = "day" }}
[[principals]]
name = "team-embed-budget"
limits = {{ budget_micros = {embed_budget}, budget_period = "day" }}
{keys}"#,
        embed_budget = embed_body_bytes() + 1,
    );
    let edge = RunningEdge::start(edge_config(&pki, 0, &extra))
        .await
        .unwrap();
    let node = start_node(
        &pki,
        "node-1",
        edge.quic_addr,
        &format!(
            "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{0}\"\n\
             [[providers]]\nadapter = \"ollama\"\ntarget = \"o\"\nbase_url = \"{0}\"\n\
             [[providers]]\nadapter = \"openai\"\ntarget = \"n\"\nbase_url = \"{0}\"\n",
            mock.base_url()
        ),
    );
    ready_generation(&edge, "node-1").await;
    Deployment {
        edge,
        _node: node,
        _mock: mock,
        _pki: pki,
    }
}

async fn post(d: &Deployment, case: &str, path: &str, body: Value) -> String {
    let r = reqwest::Client::new()
        .post(format!("http://{}{path}", d.edge.http_addr))
        .bearer_auth(secret(case))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{case}");
    r.text().await.unwrap()
}

/// Every JSON object of an SSE or NDJSON body.
fn events(body: &str) -> Vec<Value> {
    body.lines()
        .map(|l| l.strip_prefix("data: ").unwrap_or(l))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The (input, output) tokens of a principal's usage rows, once written.
async fn charged(d: &Deployment, case: &str) -> (u64, u64) {
    for _ in 0..100 {
        let r = reqwest::Client::new()
            .get(format!(
                "http://{}/admin/usage?principal=team-{case}",
                d.edge.http_addr
            ))
            .bearer_auth(secret(CASES[0]))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.unwrap();
        let total = &body["total"];
        if total["requests"] == 1 {
            return (
                total["input_tokens"].as_u64().unwrap(),
                total["output_tokens"].as_u64().unwrap(),
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("team-{case}'s usage was never written");
}

fn tokens(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("a count: {v}"))
}

#[tokio::test]
async fn r_ten_2_a_tunnelled_answer_is_charged_the_usage_its_provider_reported() {
    bounded(async {
        let d = deployment().await;
        let chat = |stream: bool, usage: bool| {
            let mut body = json!({
                "model": "m",
                "max_tokens": 50,
                "stream": stream,
                "messages": [{"role": "user", "content": "tell me something, briefly"}],
            });
            if usage {
                body["stream_options"] = json!({"include_usage": true});
            }
            body
        };
        let mut expected = Vec::new();

        // A whole answer: its `usage`.
        let answer: Value = serde_json::from_str(
            &post(&d, "whole", "/v1/chat/completions", chat(false, false)).await,
        )
        .unwrap();
        let u = &answer["usage"];
        expected.push((
            "whole",
            tokens(&u["prompt_tokens"]),
            tokens(&u["completion_tokens"]),
        ));

        // A stream with `include_usage`: its last chunk's.
        let body = post(&d, "stream", "/v1/chat/completions", chat(true, true)).await;
        let last = events(&body)
            .into_iter()
            .rfind(|e| e["usage"].is_object())
            .expect("a usage chunk");
        let u = &last["usage"];
        expected.push((
            "stream",
            tokens(&u["prompt_tokens"]),
            tokens(&u["completion_tokens"]),
        ));

        // A stream without: its text, estimated (4 characters a token).
        let body = post(&d, "unreported", "/v1/chat/completions", chat(true, false)).await;
        let chars: usize = events(&body)
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
            .map(|t| t.chars().count())
            .sum();
        assert!(chars > 0, "{body}");
        let (input, output) = charged(&d, "unreported").await;
        assert_eq!(output, (chars as u64).div_ceil(4), "the text's estimate");
        assert!(input > 0, "its prompt, estimated");

        // The Messages API, streamed: `message_start`'s prompt,
        // `message_delta`'s output.
        let body = post(
            &d,
            "messages",
            "/v1/messages",
            json!({
                "model": "m",
                "max_tokens": 50,
                "stream": true,
                "messages": [{"role": "user", "content": "hello"}],
            }),
        )
        .await;
        let sse = events(&body);
        let start = sse
            .iter()
            .find(|e| e["type"] == "message_start")
            .expect("message_start");
        let delta = sse
            .iter()
            .rfind(|e| e["type"] == "message_delta")
            .expect("message_delta");
        let u = &start["message"]["usage"];
        let input = tokens(&u["input_tokens"])
            + u["cache_read_input_tokens"].as_u64().unwrap_or(0)
            + u["cache_creation_input_tokens"].as_u64().unwrap_or(0);
        expected.push(("messages", input, tokens(&delta["usage"]["output_tokens"])));

        // Ollama's chat, streamed as NDJSON: its last line's counts.
        let body = post(
            &d,
            "ollama",
            "/api/chat",
            json!({"model": "om", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        let last = events(&body).pop().expect("a line");
        assert_eq!(last["done"], true, "{body}");
        expected.push((
            "ollama",
            tokens(&last["prompt_eval_count"]),
            tokens(&last["eval_count"]),
        ));

        // The Responses API, streamed: `response.completed`'s.
        let body = post(
            &d,
            "responses",
            "/v1/responses",
            json!({"model": "m", "input": "hello", "stream": true, "max_output_tokens": 50}),
        )
        .await;
        let completed = events(&body)
            .into_iter()
            .find(|e| e["type"] == "response.completed")
            .expect("response.completed");
        let u = &completed["response"]["usage"];
        expected.push((
            "responses",
            tokens(&u["input_tokens"]),
            tokens(&u["output_tokens"]),
        ));

        // Embeddings: a prompt, no output.
        let answer: Value = serde_json::from_str(
            &post(
                &d,
                "embeddings",
                "/v1/embeddings",
                json!({"model": "m", "input": "hello there"}),
            )
            .await,
        )
        .unwrap();
        expected.push(("embeddings", tokens(&answer["usage"]["prompt_tokens"]), 0));
        let answer: Value = serde_json::from_str(
            &post(
                &d,
                "ollama-embed",
                "/api/embed",
                json!({"model": "om", "input": "hello there"}),
            )
            .await,
        )
        .unwrap();
        expected.push(("ollama-embed", tokens(&answer["prompt_eval_count"]), 0));

        for (case, input, output) in expected {
            assert!(input > 0, "{case}: a report of its prompt");
            assert_eq!(
                charged(&d, case).await,
                (input, output),
                "{case}: as reported"
            );
        }
        d.edge.shutdown().await;
    })
    .await;
}

/// R-TEN-2: a request a budget counts, sent without a maximum, reserved
/// `default_max_output_tokens` for its output and its provider is asked
/// for no more, through a tunnel (the field each API reads, added to the
/// relayed body) and a normalized run alike; a key no limit counts gets
/// the whole answer.
#[tokio::test]
async fn r_ten_2_an_answer_without_a_maximum_is_held_to_what_its_budget_reserved() {
    bounded(async {
        let d = deployment().await;
        let ask = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        for model in ["m", "mn"] {
            let answer: Value = serde_json::from_str(
                &post(&d, "capped", "/v1/chat/completions", ask(model)).await,
            )
            .unwrap();
            assert_eq!(answer["usage"]["completion_tokens"], CAP, "{model}: {answer}");
            assert_eq!(answer["choices"][0]["finish_reason"], "length", "{model}");
        }
        // The Responses API and Ollama's, tunnelled: their own fields.
        let answer: Value = serde_json::from_str(
            &post(&d, "capped", "/v1/responses", json!({"model": "m", "input": "hi"})).await,
        )
        .unwrap();
        assert_eq!(answer["usage"]["output_tokens"], CAP, "{answer}");
        let answer: Value = serde_json::from_str(
            &post(
                &d,
                "capped",
                "/api/chat",
                json!({"model": "om", "stream": false, "messages": [{"role": "user", "content": "hi"}]}),
            )
            .await,
        )
        .unwrap();
        assert_eq!(answer["eval_count"], CAP, "{answer}");
        // An embedding reserves no output: a budget its prompt alone fits
        // (one micro over it, short of CAP output tokens) admits it.
        let answer: Value = serde_json::from_str(
            &post(&d, "embed-budget", "/v1/embeddings", embed_body()).await,
        )
        .unwrap();
        assert!(answer["data"][0]["embedding"].is_array(), "{answer}");
        // Nothing counts this key's output: the whole answer.
        let answer: Value =
            serde_json::from_str(&post(&d, "whole", "/v1/chat/completions", ask("m")).await)
                .unwrap();
        assert_eq!(answer["usage"]["completion_tokens"], 13, "{answer}");
        d.edge.shutdown().await;
    })
    .await;
}
