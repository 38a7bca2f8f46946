//! The Anthropic Messages API end to end: real HTTP into the Edge, real
//! QUIC to a Node, real HTTP to the mock provider (SPEC §5, R-GATE-*,
//! R-IDEM-1); and the official `anthropic` Python SDK against it.

mod common;

use common::*;
use iop_edge::config::ConfigFile as _;
use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use serde_json::{Value, json};

const KEY: &str = "sk-messages-0123456789";

struct Deployment {
    _pki: Pki,
    edge: RunningEdge,
    node: iop_node::RunningNode,
    mock: MockServer,
    http: reqwest::Client,
}

/// The provider behind the Edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Upstream {
    /// An `openai` provider in front of the HTTP mock.
    OpenAi,
    /// [`Upstream::OpenAi`] asking for the usage on every streamed chunk
    /// (`continuous_usage`, as vLLM gives it).
    OpenAiContinuousUsage,
    /// An `anthropic` provider in front of a mock that speaks only the
    /// Messages API (as Anthropic's server), which takes its key in
    /// `x-api-key`.
    MessagesOnly,
    /// [`Upstream::MessagesOnly`] in tunnel mode: a Messages client's
    /// request relayed as it is.
    MessagesOnlyTunnel,
}

/// The key the Messages-only upstream requires.
const UPSTREAM_KEY: &str = "sk-ant-upstream";

impl Deployment {
    /// One `openai` provider (capacity `capacity`) in front of the HTTP
    /// mock, serving `m`, `mock` and `mock:*`; an admission queue of
    /// `queue_capacity`.
    async fn start(script: MockScript, capacity: u32, queue_capacity: u32) -> Self {
        Self::start_with(script, capacity, queue_capacity, Upstream::OpenAi).await
    }

    /// [`Deployment::start`] with the provider `upstream`.
    async fn start_with(
        script: MockScript,
        capacity: u32,
        queue_capacity: u32,
        upstream: Upstream,
    ) -> Self {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let (mock, adapter, mode) = match upstream {
            Upstream::OpenAi | Upstream::OpenAiContinuousUsage => (
                MockServer::start(script).await.unwrap(),
                "openai",
                "normalized",
            ),
            Upstream::MessagesOnly | Upstream::MessagesOnlyTunnel => {
                let script = MockScript {
                    require_key: Some(UPSTREAM_KEY.into()),
                    ..script
                };
                let mode = if upstream == Upstream::MessagesOnlyTunnel {
                    "tunnel"
                } else {
                    "normalized"
                };
                (
                    MockServer::start_messages_only(script).await.unwrap(),
                    "anthropic",
                    mode,
                )
            }
        };
        let text = format!(
            r#"
[edge]
quic_listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
state_dir = "edge-state"
drain_timeout_ms = 2000
sse_keep_alive_ms = 50
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge.key"
[heartbeat]
interval_ms = {HB_INTERVAL_MS}
wait_ms = {HB_WAIT_MS}
[admission]
queue_capacity = {queue_capacity}
queue_timeout_ms = 10000
[[providers]]
id = "p1"
node = "node-1"
adapter = "{adapter}"
mode = "{mode}"
target = "t"
capacity = {capacity}
stall_timeout_ms = 2000
[[routes]]
model = "m"
providers = ["p1"]
[[routes]]
model = "mock"
providers = ["p1"]
[[routes]]
model = "mock:*"
providers = ["p1"]
[[api_keys]]
principal = "tester"
key_file = "key"
admin = true
"#
        );
        let config = EdgeConfig::parse(&text, pki.path()).expect("edge config");
        let edge = RunningEdge::start(config).await.expect("edge");
        let mut node_config = node_config(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"{adapter}\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                mock.base_url()
            ),
        );
        if adapter == "anthropic" {
            // The target's static key (what `api_key_env` names).
            node_config.providers[0].api_key = Some(UPSTREAM_KEY.into());
        }
        node_config.providers[0].continuous_usage = upstream == Upstream::OpenAiContinuousUsage;
        let node = iop_node::RunningNode::start(node_config);
        ready_generation(&edge, "node-1").await;
        Self {
            _pki: pki,
            edge,
            node,
            mock,
            http: reqwest::Client::new(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.edge.http_addr)
    }

    /// POST `body` with the key in `x-api-key`, as Anthropic's clients send it.
    async fn post(&self, path: &str, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut r = self
            .http
            .post(self.url(path))
            .header("x-api-key", KEY)
            .header("anthropic-version", "2023-06-01")
            .header("content-type", "application/json")
            .body(body.to_string());
        for (name, value) in headers {
            r = r.header(*name, *value);
        }
        r.send().await.expect("http")
    }

    async fn wait_idle(&self) {
        wait_for(&self.edge, "no leases in use and no waiters", |s| {
            s.leases_in_use == 0 && s.queue_depth == 0 && s.waiters == 0
        })
        .await;
    }

    async fn stop(self) {
        let _ = self.node.shutdown().await;
        self.edge.shutdown().await;
    }
}

fn request(model: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "max_tokens": 256,
        "stream": stream,
        "system": "be brief",
        "messages": [{"role": "user", "content": "hello there"}],
    })
}

/// `(id, event name, data)` of every SSE event of `body`.
fn events(body: &str) -> Vec<(Option<u64>, String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|event| {
            let (mut id, mut name, mut data) = (None, String::new(), Value::Null);
            for line in event.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    id = v.parse().ok();
                } else if let Some(v) = line.strip_prefix("event: ") {
                    name = v.to_owned();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(v).expect("JSON data");
                }
            }
            (id, name, data)
        })
        .collect()
}

fn streamed_text(events: &[(Option<u64>, String, Value)]) -> String {
    events
        .iter()
        .filter(|(_, name, _)| name == "content_block_delta")
        .filter_map(|(_, _, d)| d["delta"]["text"].as_str())
        .collect()
}

#[tokio::test]
async fn a_message_is_answered_whole_and_streamed_with_the_providers_usage() {
    bounded(async {
        let d = Deployment::start(MockScript::default(), 4, 64).await;
        let r = d
            .post("/v1/messages", &request("mock:tokens=5", false), &[])
            .await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["type"], "message");
        assert_eq!(v["role"], "assistant");
        assert!(v["id"].as_str().unwrap().starts_with("msg_"));
        assert_eq!(
            v["content"],
            json!([{"type": "text", "text": expected_text(5)}])
        );
        assert_eq!(v["stop_reason"], "end_turn");
        // The mock's usage: ceil(prompt characters / 4), tokens produced.
        let prompt_tokens = ("be brief".len() + "hello there".len()).div_ceil(4);
        // An OpenAI-compatible provider that reports no prompt cache: its
        // counts are null, never zeros.
        assert_eq!(
            v["usage"],
            json!({"input_tokens": prompt_tokens, "output_tokens": 5,
                   "cache_creation_input_tokens": null, "cache_read_input_tokens": null})
        );

        let r = d
            .post("/v1/messages", &request("mock:tokens=4", true), &[])
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["content-type"], "text/event-stream");
        let body = r.text().await.unwrap();
        let evs = events(&body);
        let names: Vec<&str> = evs.iter().map(|(_, n, _)| n.as_str()).collect();
        assert_eq!(names[..3], ["message_start", "ping", "content_block_start"]);
        assert_eq!(
            names[names.len() - 3..],
            ["content_block_stop", "message_delta", "message_stop"]
        );
        assert_eq!(streamed_text(&evs), expected_text(4));
        let delta = &evs[evs.len() - 2].2;
        assert_eq!(delta["delta"]["stop_reason"], "end_turn");
        assert_eq!(delta["usage"]["output_tokens"], 4);
        assert_eq!(delta["usage"]["input_tokens"], prompt_tokens);

        // count_tokens estimates the same prompt as the mock counted it.
        let mut count = request("m", false);
        let count = count.as_object_mut().unwrap();
        count.remove("max_tokens");
        count.remove("stream");
        let r = d
            .post(
                "/v1/messages/count_tokens",
                &Value::Object(count.clone()),
                &[],
            )
            .await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v, json!({"input_tokens": prompt_tokens}));
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn stop_reasons_tools_and_thinking_come_back_in_anthropics_shapes() {
    bounded(async {
        let d = Deployment::start(MockScript::default(), 4, 64).await;
        let mut truncated = request("mock:tokens=10", false);
        truncated["max_tokens"] = json!(3);
        let v: Value = d
            .post("/v1/messages", &truncated, &[])
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["stop_reason"], "max_tokens");
        assert_eq!(v["usage"]["output_tokens"], 3);

        let mut tool = request("mock:tool_call=1", false);
        tool["tools"] = json!([{"name": "get_weather", "input_schema": {"type": "object"}}]);
        tool["tool_choice"] = json!({"type": "tool", "name": "get_weather"});
        let v: Value = d
            .post("/v1/messages", &tool, &[])
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["stop_reason"], "tool_use", "{v}");
        assert_eq!(v["content"][0]["type"], "tool_use");
        assert_eq!(v["content"][0]["name"], "get_weather");
        assert!(v["content"][0]["input"]["text"].is_string(), "{v}");
        tool["stream"] = json!(true);
        let body = d
            .post("/v1/messages", &tool, &[])
            .await
            .text()
            .await
            .unwrap();
        let evs = events(&body);
        let start = evs
            .iter()
            .find(|(_, n, _)| n == "content_block_start")
            .unwrap();
        assert_eq!(start.2["content_block"]["type"], "tool_use");
        let json: String = evs
            .iter()
            .filter_map(|(_, _, d)| d["delta"]["partial_json"].as_str())
            .collect();
        assert!(serde_json::from_str::<Value>(&json).unwrap()["text"].is_string());

        let mut thinking = request("mock:tokens=2", false);
        thinking["max_tokens"] = json!(4096);
        thinking["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
        let v: Value = d
            .post("/v1/messages", &thinking, &[])
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["content"][0]["type"], "thinking", "{v}");
        assert_eq!(v["content"][0]["thinking"], iop_node::mock::MOCK_REASONING);
        assert_eq!(v["content"][1]["text"], expected_text(2));
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn errors_are_anthropics_and_bad_requests_never_reach_a_provider() {
    bounded(async {
        let d = Deployment::start(MockScript::default(), 4, 64).await;
        let error = |v: &Value| (v["type"].clone(), v["error"]["type"].clone());
        // No key, a wrong key in either header, and the Bearer form works.
        let r = d
            .http
            .post(d.url("/v1/messages"))
            .body(request("m", false).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
        let v: Value = r.json().await.unwrap();
        assert_eq!(error(&v), (json!("error"), json!("authentication_error")));
        let r = d
            .http
            .post(d.url("/v1/messages"))
            .header("x-api-key", "sk-wrong-0123456789")
            .body(request("m", false).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
        let r = d
            .http
            .post(d.url("/v1/messages"))
            .bearer_auth(KEY)
            .body(request("mock:tokens=1", false).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);

        let r = d
            .post("/v1/messages", &request("no-such-model", false), &[])
            .await;
        assert_eq!(r.status(), 404);
        assert_eq!(error(&r.json().await.unwrap()).1, "not_found_error");
        let r = d
            .post(
                "/v1/messages/count_tokens",
                &json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
                &[],
            )
            .await;
        assert_eq!(r.status(), 404);

        let before = d.mock.requests();
        let mut no_max = request("m", false);
        no_max.as_object_mut().unwrap().remove("max_tokens");
        // A document by file id: the id is an account's the gateway does
        // not share.
        let mut by_file_id = request("m", false);
        by_file_id["messages"][0]["content"] =
            json!([{"type": "document", "source": {"type": "file", "file_id": "file_011"}}]);
        for (body, words) in [(no_max, "max_tokens"), (by_file_id, "source.type")] {
            let r = d.post("/v1/messages", &body, &[]).await;
            assert_eq!(r.status(), 400);
            let v: Value = r.json().await.unwrap();
            assert_eq!(error(&v).1, "invalid_request_error");
            assert!(
                v["error"]["message"].as_str().unwrap().contains(words),
                "{v}"
            );
        }
        assert_eq!(
            d.mock.requests(),
            before,
            "bad requests never reached the provider"
        );
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn a_full_queue_is_a_429_rate_limit_error_with_retry_after() {
    bounded(async {
        let slow = MockScript {
            tokens_per_second: 10.0,
            tokens: 30,
            ..MockScript::default()
        };
        let d = Deployment::start(slow, 1, 2).await;
        let mut held = Vec::new();
        for _ in 0..3 {
            let http = d.http.clone();
            let url = d.url("/v1/messages");
            held.push(tokio::spawn(async move {
                http.post(url)
                    .header("x-api-key", KEY)
                    .body(request("mock", true).to_string())
                    .send()
                    .await
                    .unwrap()
                    .text()
                    .await
            }));
        }
        wait_for(&d.edge, "queue full", |s| s.queue_depth == 2).await;
        let r = d.post("/v1/messages", &request("mock", false), &[]).await;
        assert_eq!(r.status(), 429);
        assert!(r.headers().get("retry-after").is_some());
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error");
        for h in held {
            h.abort();
        }
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn an_idempotency_key_runs_once_and_a_stream_resumes_after_last_event_id() {
    bounded(async {
        let d = Deployment::start(MockScript::default(), 4, 64).await;
        let before = d.mock.requests();
        let whole = request("mock:tokens=6", false);
        let first = d
            .post("/v1/messages", &whole, &[("idempotency-key", "once-1")])
            .await;
        assert_eq!(first.status(), 200);
        let first: Value = first.json().await.unwrap();
        let again = d
            .post("/v1/messages", &whole, &[("idempotency-key", "once-1")])
            .await;
        assert_eq!(again.status(), 200);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(
            again.json::<Value>().await.unwrap(),
            first,
            "the same message"
        );
        assert_eq!(d.mock.requests(), before + 1, "one provider call per key");

        let streamed = request("mock:tokens=6", true);
        let live = d
            .post("/v1/messages", &streamed, &[("idempotency-key", "once-2")])
            .await
            .text()
            .await
            .unwrap();
        let live = events(&live);
        let ids: Vec<u64> = live.iter().map(|(id, ..)| id.expect("numbered")).collect();
        assert_eq!(ids, (0..live.len() as u64).collect::<Vec<_>>());
        for after in [0, 3, live.len() as u64 - 2] {
            let resumed = d
                .post(
                    "/v1/messages",
                    &streamed,
                    &[
                        ("idempotency-key", "once-2"),
                        ("last-event-id", &after.to_string()),
                    ],
                )
                .await
                .text()
                .await
                .unwrap();
            assert_eq!(
                events(&resumed),
                live[after as usize + 1..],
                "after {after}"
            );
        }
        assert_eq!(d.mock.requests(), before + 2, "no call for a resume");
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn the_prompt_caches_counts_reach_messages_and_openai_clients_and_the_journal() {
    // 19 prompt characters: 5 prompt tokens; the provider read 2 of them
    // from its cache and wrote 1 to it. An OpenAI-compatible provider says
    // so in `prompt_tokens_details`, a Messages one in its cache counts.
    let model = "mock:tokens=3,cache_read=2,cache_write=1";
    let counts = json!({"input_tokens": 2, "output_tokens": 3,
                        "cache_creation_input_tokens": 1, "cache_read_input_tokens": 2});
    for upstream in [Upstream::OpenAi, Upstream::MessagesOnly] {
        bounded(async {
            let d = Deployment::start_with(MockScript::default(), 4, 64, upstream).await;
            let v: Value = d
                .post("/v1/messages", &request(model, false), &[])
                .await
                .json()
                .await
                .unwrap();
            assert_eq!(v["usage"], counts, "{upstream:?} whole");

            let body = d
                .post("/v1/messages", &request(model, true), &[])
                .await
                .text()
                .await
                .unwrap();
            let evs = events(&body);
            assert_eq!(evs[evs.len() - 2].2["usage"], counts, "{upstream:?} stream");
            let start = &evs[0].2["message"]["usage"];
            if upstream == Upstream::MessagesOnly {
                // A Messages provider reports the prompt's counts before its
                // answer, and they are in message_start as Anthropic sends
                // them.
                assert_eq!(
                    *start,
                    json!({"input_tokens": 2, "output_tokens": 1,
                           "cache_creation_input_tokens": 1, "cache_read_input_tokens": 2})
                );
            } else {
                // An OpenAI-compatible stream says its usage at its end.
                assert_eq!(
                    *start,
                    json!({"input_tokens": 0, "output_tokens": 0,
                           "cache_creation_input_tokens": null, "cache_read_input_tokens": null})
                );
            }

            // A durable answer keeps them: the replay reads them from the
            // journal.
            let key = [("idempotency-key", "cache-counts")];
            let first: Value = d
                .post("/v1/messages", &request(model, false), &key)
                .await
                .json()
                .await
                .unwrap();
            let again = d.post("/v1/messages", &request(model, false), &key).await;
            assert_eq!(again.headers()["idempotent-replayed"], "true");
            let again: Value = again.json().await.unwrap();
            assert_eq!((&first["usage"], &again["usage"]), (&counts, &counts));

            // An OpenAI client sees the same counts in OpenAI's shape.
            let chat = json!({
                "model": model,
                "messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "hello there"}],
            });
            let v: Value = post_bearer(&d, "/v1/chat/completions", &chat)
                .await
                .json()
                .await
                .unwrap();
            assert_eq!(
                v["usage"],
                json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                       "prompt_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 1}}),
                "{upstream:?} chat"
            );
            d.wait_idle().await;
            d.stop().await;
        })
        .await;
    }
}

#[tokio::test]
async fn cache_control_reaches_a_messages_provider_through_a_normalized_run() {
    // The Messages-only mock reports the prompt up to its last breakpoint
    // as written to its cache: a breakpoint that reaches it comes back as
    // cache_creation_input_tokens.
    bounded(async {
        let d = Deployment::start_with(MockScript::default(), 4, 64, Upstream::MessagesOnly).await;
        let system = "You are a careful assistant. ".repeat(8);
        let marked = |stream: bool| {
            json!({
                "model": "mock:tokens=2",
                "max_tokens": 16,
                "stream": stream,
                "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                "messages": [{"role": "user", "content": "hello there"}],
            })
        };
        let system_tokens = system.len().div_ceil(4);
        let v: Value = d
            .post("/v1/messages", &marked(false), &[])
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["usage"]["cache_creation_input_tokens"], system_tokens, "{v}");
        assert_eq!(v["usage"]["cache_read_input_tokens"], 0);
        let body = d
            .post("/v1/messages", &marked(true), &[])
            .await
            .text()
            .await
            .unwrap();
        let evs = events(&body);
        assert_eq!(
            evs[0].2["message"]["usage"]["cache_creation_input_tokens"],
            system_tokens
        );
        // Without the breakpoint nothing is written to the cache.
        let mut plain = marked(false);
        plain["system"] = json!(system);
        let v: Value = d.post("/v1/messages", &plain, &[]).await.json().await.unwrap();
        assert_eq!(v["usage"]["cache_creation_input_tokens"], 0, "{v}");
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

/// The official Anthropic Python SDK against a live deployment. CI installs
/// it (see `.ci/run`) and sets `IOP_SDK_PYTHON`; elsewhere the test uses
/// `python3` if it can import `anthropic`, and says so if it cannot.
#[tokio::test]
async fn official_anthropic_python_sdk_end_to_end() {
    let python = match std::env::var("IOP_SDK_PYTHON") {
        Ok(p) => p,
        Err(_) => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must provide IOP_SDK_PYTHON (a python with the anthropic package)"
            );
            let ok = std::process::Command::new("python3")
                .args(["-c", "import anthropic"])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("anthropic SDK not installed locally; run .ci/run to exercise this test");
                return;
            }
            "python3".into()
        }
    };
    // Once in front of an OpenAI-compatible provider, once in front of a
    // Messages-only one (the `anthropic` adapter).
    for upstream in [Upstream::OpenAi, Upstream::MessagesOnly] {
        bounded(async {
            // One slot and a queue of two, so the script can fill it for a 429.
            let d = Deployment::start_with(MockScript::default(), 1, 2, upstream).await;
            let script = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/sdk/anthropic_sdk_e2e.py"
            );
            let out = tokio::process::Command::new(&python)
                .arg(script)
                .arg(d.url(""))
                .arg(KEY)
                .arg(d.mock.base_url())
                .arg(if upstream == Upstream::OpenAi {
                    "openai"
                } else {
                    "messages"
                })
                .output()
                .await
                .expect("run python");
            assert!(
                out.status.success(),
                "sdk e2e failed ({upstream:?}):\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            d.wait_idle().await;
            d.stop().await;
        })
        .await;
    }
}

/// POST `body` to an OpenAI or Ollama route, the key as a bearer token.
async fn post_bearer(d: &Deployment, path: &str, body: &Value) -> reqwest::Response {
    d.http
        .post(d.url(path))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("http")
}

#[tokio::test]
async fn openai_and_ollama_clients_reach_a_messages_only_upstream() {
    bounded(async {
        let d = Deployment::start_with(MockScript::default(), 4, 64, Upstream::MessagesOnly).await;
        let chat = |stream: bool| {
            json!({
                "model": "mock:tokens=5",
                "stream": stream,
                "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
                "messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "hello there"}],
            })
        };
        let prompt_tokens = ("be brief".len() + "hello there".len()).div_ceil(4);

        // OpenAI Chat Completions, whole: the upstream's text and usage.
        let r = post_bearer(&d, "/v1/chat/completions", &chat(false)).await;
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], expected_text(5));
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
        assert_eq!(v["usage"]["completion_tokens"], 5);

        // Streamed, with usage.
        let r = post_bearer(&d, "/v1/chat/completions", &chat(true)).await;
        assert_eq!(r.status(), 200);
        let body = r.text().await.unwrap();
        let chunks: Vec<Value> = body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, expected_text(5));
        let usage = chunks.iter().find_map(|c| c["usage"].as_object()).unwrap();
        assert_eq!(usage["completion_tokens"], 5);

        // A tool call, as OpenAI's tool_calls.
        let tools = json!({
            "model": "mock:tool_call=1,tokens=2",
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}],
        });
        let v: Value = post_bearer(&d, "/v1/chat/completions", &tools)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        let call = &v["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args["text"], "tok0 tok1");

        // A matched stop sequence is OpenAI's `stop`.
        let mut stopped = chat(false);
        stopped["stop"] = json!(["tok3"]);
        let v: Value = post_bearer(&d, "/v1/chat/completions", &stopped)
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 tok2 ");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");

        // Ollama's /api/chat, whole and streamed.
        let ollama = |stream: bool| {
            json!({"model": "mock:tokens=3", "stream": stream,
                   "messages": [{"role": "user", "content": "hello there"}]})
        };
        let v: Value = post_bearer(&d, "/api/chat", &ollama(false))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(v["message"]["content"], expected_text(3));
        assert_eq!(v["done"], true);
        assert_eq!(v["eval_count"], 3);
        let body = post_bearer(&d, "/api/chat", &ollama(true))
            .await
            .text()
            .await
            .unwrap();
        let lines: Vec<Value> = body
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let text: String = lines
            .iter()
            .filter_map(|l| l["message"]["content"].as_str())
            .collect();
        assert_eq!(text, expected_text(3));
        assert_eq!(lines.last().unwrap()["done_reason"], "stop");

        // Every call reached the Messages-only upstream (its only API).
        assert_eq!(d.mock.requests(), 6);
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn a_stop_sequence_comes_back_as_stop_reason_stop_sequence() {
    bounded(async {
        for upstream in [Upstream::MessagesOnly, Upstream::MessagesOnlyTunnel] {
            let d = Deployment::start_with(MockScript::default(), 4, 64, upstream).await;
            let mut body = request("mock:tokens=8", false);
            body["stop_sequences"] = json!(["tok3"]);
            let beta = [("anthropic-beta", "prompt-caching-2024-07-31")];
            let r = d.post("/v1/messages", &body, &beta).await;
            assert_eq!(r.status(), 200, "{upstream:?}");
            if upstream == Upstream::MessagesOnlyTunnel {
                // A tunnel-mode provider reads the client's API version and
                // beta features (the mock echoes what reached it).
                assert_eq!(r.headers()["x-mock-anthropic-beta"], beta[0].1);
                assert_eq!(r.headers()["x-mock-anthropic-version"], "2023-06-01");
            }
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["content"][0]["text"], "tok0 tok1 tok2 ", "{upstream:?}");
            assert_eq!(v["stop_reason"], "stop_sequence", "{upstream:?}");
            assert_eq!(v["stop_sequence"], "tok3", "{upstream:?}");

            body["stream"] = json!(true);
            let r = d.post("/v1/messages", &body, &[]).await;
            assert_eq!(r.status(), 200, "{upstream:?}");
            let evs = events(&r.text().await.unwrap());
            assert_eq!(streamed_text(&evs), "tok0 tok1 tok2 ", "{upstream:?}");
            let delta = &evs.iter().find(|(_, n, _)| n == "message_delta").unwrap().2;
            assert_eq!(
                delta["delta"]["stop_reason"], "stop_sequence",
                "{upstream:?}"
            );
            assert_eq!(delta["delta"]["stop_sequence"], "tok3", "{upstream:?}");
            assert_eq!(d.mock.requests(), 2, "{upstream:?}");
            d.wait_idle().await;
            d.stop().await;
        }
    })
    .await;
}

#[tokio::test]
async fn a_providers_own_error_is_passed_on_in_every_apis_shape_and_class() {
    bounded(async {
        for upstream in [Upstream::OpenAi, Upstream::MessagesOnly] {
            let d = Deployment::start_with(MockScript::default(), 4, 64, upstream).await;
            let chat = |model: &str| {
                json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
            };
            // A validation error of the provider's (HTTP 422): a 400, with its
            // message, in the OpenAI shape ...
            let r = post_bearer(&d, "/v1/chat/completions", &chat("mock:error=422")).await;
            assert_eq!(r.status(), 400, "{upstream:?}");
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["type"], "invalid_request_error");
            assert_eq!(v["error"]["code"], "provider_rejected_request");
            assert_eq!(
                v["error"]["message"],
                "The provider rejected the request (HTTP 422): scripted mock error"
            );
            // ... Ollama's ...
            let r = post_bearer(&d, "/api/chat", &chat("mock:error=422")).await;
            assert_eq!(r.status(), 400);
            let v: Value = r.json().await.unwrap();
            assert_eq!(
                v["error"],
                "The provider rejected the request (HTTP 422): scripted mock error"
            );
            // ... and Anthropic's, streamed or not, durable or not.
            for (stream, key) in [(false, None), (true, None), (false, Some("err-1"))] {
                let headers: Vec<(&str, &str)> =
                    key.map(|k| vec![("idempotency-key", k)]).unwrap_or_default();
                let r = d
                    .post("/v1/messages", &request("mock:error=422", stream), &headers)
                    .await;
                assert_eq!(r.status(), 400, "stream {stream} key {key:?}");
                let v: Value = r.json().await.unwrap();
                assert_eq!(v["error"]["type"], "invalid_request_error");
                assert_eq!(
                    v["error"]["message"],
                    "The provider rejected the request (HTTP 422): scripted mock error",
                    "stream {stream} key {key:?}"
                );
            }
            // A provider's 5xx stays a gateway error, with the provider's
            // message.
            let r = post_bearer(&d, "/v1/chat/completions", &chat("mock:error=500")).await;
            assert_eq!(r.status(), 502);
            let v: Value = r.json().await.unwrap();
            assert_eq!(
                v["error"]["message"],
                "The provider returned an error (HTTP 500): scripted mock error"
            );
            let r = d.post("/v1/messages", &request("mock:error=500", false), &[]).await;
            assert_eq!(r.status(), 502);
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["type"], "api_error");
            // What a provider says about our credential is not passed on.
            let r = post_bearer(&d, "/v1/chat/completions", &chat("mock:error=401")).await;
            assert_eq!(r.status(), 502);
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["message"], "The provider returned an error (HTTP 401).");
            d.wait_idle().await;
            d.stop().await;
        }
    })
    .await;
}

/// A turn with a PDF, and a tool result with text, an image and a PDF.
fn attachments_request(pdf_source: Value) -> Value {
    json!({
        "model": "mock:tokens=3",
        "max_tokens": 64,
        "messages": [
            {"role": "user", "content": "take a screenshot"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "here it is"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                    {"type": "document", "title": "Manual", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"}}
                ]},
                {"type": "document", "source": pdf_source},
                {"type": "text", "text": "compare them"}
            ]}
        ],
        "tools": [{"name": "shot", "input_schema": {"type": "object"}}],
    })
}

#[tokio::test]
async fn pdfs_and_tool_result_images_reach_both_kinds_of_provider() {
    let base64 = json!({"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"});
    let url = json!({"type": "url", "url": "https://example.com/a.pdf"});
    for upstream in [Upstream::OpenAi, Upstream::MessagesOnly] {
        bounded(async {
            let d = Deployment::start_with(MockScript::default(), 4, 64, upstream).await;
            for stream in [false, true] {
                let mut body = attachments_request(base64.clone());
                body["stream"] = json!(stream);
                let r = d.post("/v1/messages", &body, &[]).await;
                assert_eq!(r.status(), 200, "{upstream:?}");
                let text = r.text().await.unwrap();
                if stream {
                    assert_eq!(streamed_text(&events(&text)), expected_text(3));
                } else {
                    let v: Value = serde_json::from_str(&text).unwrap();
                    assert_eq!(v["content"][0]["text"], expected_text(3), "{v}");
                }
            }
            // Every image and PDF reached the provider, in its own API's
            // shape (the mock refuses an OpenAI tool message of parts).
            let stats = d.mock.stats();
            assert_eq!((stats.images, stats.documents), (2, 4), "{upstream:?}");

            // A PDF by URL: a Messages provider takes it; the OpenAI API
            // has no such part, which the client is told before any call.
            let r = d
                .post("/v1/messages", &attachments_request(url.clone()), &[])
                .await;
            if upstream == Upstream::MessagesOnly {
                assert_eq!(r.status(), 200);
                assert_eq!(d.mock.stats().documents, 6);
            } else {
                assert_eq!(r.status(), 400);
                let v: Value = r.json().await.unwrap();
                assert_eq!(v["error"]["type"], "invalid_request_error");
                let message = v["error"]["message"].as_str().unwrap();
                assert!(
                    message.contains("OpenAI API") && message.contains("URL"),
                    "{message}"
                );
                assert_eq!(d.mock.stats().requests, 2);
            }
            d.wait_idle().await;
            d.stop().await;
        })
        .await;
    }
}

#[tokio::test]
async fn anthropic_beta_reaches_messages_providers_of_normalized_runs_only() {
    let beta = [("anthropic-beta", "pdfs-2024-09-25,context-1m-2025-08-07")];
    for upstream in [Upstream::MessagesOnly, Upstream::OpenAi] {
        bounded(async {
            let d = Deployment::start_with(MockScript::default(), 4, 64, upstream).await;
            for stream in [false, true] {
                let r = d
                    .post("/v1/messages", &request("mock:tokens=2", stream), &beta)
                    .await;
                assert_eq!(r.status(), 200);
                r.text().await.unwrap();
            }
            let r = d
                .post("/v1/messages", &request("mock:tokens=2", false), &[])
                .await;
            assert_eq!(r.status(), 200);
            let carried = d.mock.stats().anthropic_beta;
            match upstream {
                Upstream::MessagesOnly => assert_eq!(carried, 2),
                _ => assert_eq!(carried, 0, "an OpenAI-compatible provider gets no beta"),
            }
            // A malformed one is the client's 400, before any call.
            let calls = d.mock.stats().requests;
            let r = d
                .post(
                    "/v1/messages",
                    &request("m", false),
                    &[("anthropic-beta", "no spaces allowed")],
                )
                .await;
            assert_eq!(r.status(), 400);
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["type"], "invalid_request_error");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("anthropic-beta")
            );
            assert_eq!(d.mock.stats().requests, calls);
            d.wait_idle().await;
            d.stop().await;
        })
        .await;
    }
}

#[tokio::test]
async fn message_start_carries_the_prompts_tokens_when_the_provider_says_them_first() {
    let prompt_tokens = ("be brief".len() + "hello there".len()).div_ceil(4);
    for upstream in [
        Upstream::OpenAi,
        Upstream::OpenAiContinuousUsage,
        Upstream::MessagesOnly,
    ] {
        bounded(async {
            let d = Deployment::start_with(MockScript::default(), 4, 64, upstream).await;
            let body = d
                .post("/v1/messages", &request("mock:tokens=4", true), &[])
                .await
                .text()
                .await
                .unwrap();
            let evs = events(&body);
            assert_eq!(evs[0].1, "message_start");
            let start = &evs[0].2["message"]["usage"]["input_tokens"];
            let delta = &evs[evs.len() - 2];
            assert_eq!(delta.1, "message_delta");
            // The totals, input_tokens included, are always in
            // message_delta (what the SDKs keep).
            assert_eq!(
                delta.2["usage"]["input_tokens"], prompt_tokens,
                "{upstream:?}"
            );
            assert_eq!(delta.2["usage"]["output_tokens"], 4, "{upstream:?}");
            if upstream == Upstream::OpenAi {
                // Its stream says usage only at its end.
                assert_eq!(*start, 0);
            } else {
                assert_eq!(*start, prompt_tokens, "{upstream:?}");
            }
            assert_eq!(streamed_text(&evs), expected_text(4));
            d.wait_idle().await;
            d.stop().await;
        })
        .await;
    }
}
