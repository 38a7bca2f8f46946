//! The normalized request surface over loopback (Edge + Node + the built-in
//! mock provider): the provider's usage or none (never invented),
//! embeddings, text completions, JSON answers, log probabilities,
//! reasoning, a 400 naming what a provider cannot do, and Ollama's
//! `/api/embed`, `/api/show`, `/api/ps`.

mod common;

use common::*;
use iop_edge::server::RunningEdge;
use serde_json::{Value, json};

const KEY: &str = "sk-surface-test-key";

struct Surface {
    _pki: Pki,
    edge: RunningEdge,
    node: iop_node::RunningNode,
    http: reqwest::Client,
}

impl Surface {
    /// Model `mock*` on a mock provider; model `llama*` on an Ollama
    /// provider whose node is never started (refusals happen before any
    /// dispatch).
    async fn start() -> Self {
        let pki = Pki::new(&["node-1", "node-2"]);
        common::write_secret(&pki.path().join("key"), KEY);
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"mock\"\n\
             [[providers]]\nid = \"o\"\nnode = \"node-2\"\nadapter = \"ollama\"\ntarget = \"o\"\n\
             [[routes]]\nmodel = \"mock\"\nproviders = [\"p\"]\n\
             [[routes]]\nmodel = \"mock:*\"\nproviders = [\"p\"]\n\
             [[routes]]\nmodel = \"llama\"\nproviders = [\"o\"]\n\
             [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n",
        ))
        .await
        .expect("edge");
        let node = start_node(&pki, "node-1", edge.quic_addr, &mock_provider_node("mock"));
        ready_generation(&edge, "node-1").await;
        Self {
            _pki: pki,
            edge,
            node,
            http: reqwest::Client::new(),
        }
    }

    async fn post(&self, path: &str, body: Value) -> (u16, String) {
        let r = self
            .http
            .post(format!("http://{}{path}", self.edge.http_addr))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .expect("http");
        (r.status().as_u16(), r.text().await.unwrap())
    }

    async fn post_json(&self, path: &str, body: Value) -> Value {
        let (status, text) = self.post(path, body).await;
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).expect("json")
    }

    async fn stop(self) {
        wait_for(&self.edge, "idle", |s| {
            s.leases_in_use == 0 && s.waiters == 0
        })
        .await;
        let _ = self.node.shutdown().await;
        self.edge.shutdown().await;
    }
}

/// The `data:` payloads of an SSE body, `[DONE]` left out.
fn sse_json(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("json chunk"))
        .collect()
}

#[tokio::test]
async fn usage_is_the_providers_or_null_never_zeros() {
    bounded(async {
        let s = Surface::start().await;
        let messages = json!([{"role": "user", "content": "hello there"}]);
        // A provider whose streams carry usage.
        let (_, body) = s
            .post(
                "/v1/chat/completions",
                json!({"model": "mock:tokens=3", "messages": messages, "stream": true,
                       "stream_options": {"include_usage": true}}),
            )
            .await;
        let last = sse_json(&body).pop().unwrap();
        assert_eq!(last["usage"]["completion_tokens"], 3, "{body}");
        // One whose streams carry none: the usage chunk says null.
        let (_, body) = s
            .post(
                "/v1/chat/completions",
                json!({"model": "mock:tokens=3,usage=0", "messages": messages, "stream": true,
                       "stream_options": {"include_usage": true}}),
            )
            .await;
        let last = sse_json(&body).pop().unwrap();
        assert!(last["choices"].as_array().unwrap().is_empty(), "{body}");
        assert!(last["usage"].is_null(), "usage is null, not zeros: {body}");
        // A whole answer gets the provider's usage even from such a server.
        let v = s
            .post_json(
                "/v1/chat/completions",
                json!({"model": "mock:tokens=3,usage=0", "messages": messages}),
            )
            .await;
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
        // Ollama streams: no counts rather than zero counts.
        let (_, body) = s
            .post(
                "/api/chat",
                json!({"model": "mock:tokens=2,usage=0", "messages": messages}),
            )
            .await;
        let last: Value = serde_json::from_str(body.lines().last().unwrap()).unwrap();
        assert_eq!(last["done"], true, "{body}");
        assert!(last.get("eval_count").is_none(), "{body}");
        s.stop().await;
    })
    .await;
}

#[tokio::test]
async fn embeddings_answer_floats_base64_and_ollama_vectors() {
    bounded(async {
        let s = Surface::start().await;
        let v = s
            .post_json(
                "/v1/embeddings",
                json!({"model": "mock", "input": ["a", "bb"], "encoding_format": "float"}),
            )
            .await;
        let data = v["data"].as_array().unwrap();
        assert_eq!(data.len(), 2, "{v}");
        let first: Vec<f32> = serde_json::from_value(data[0]["embedding"].clone()).unwrap();
        assert_eq!(first, iop_node::mock::mock_embedding("a"));
        assert_eq!(v["usage"]["prompt_tokens"], 1);

        let v = s
            .post_json(
                "/v1/embeddings",
                json!({"model": "mock", "input": "a", "encoding_format": "base64"}),
            )
            .await;
        let b64 = v["data"][0]["embedding"].as_str().unwrap();
        assert_eq!(
            b64.len(),
            (iop_node::mock::MOCK_EMBEDDING_DIMENSIONS * 4).div_ceil(3) * 4
        );

        let v = s
            .post_json("/api/embed", json!({"model": "mock", "input": ["a"]}))
            .await;
        assert_eq!(v["embeddings"].as_array().unwrap().len(), 1, "{v}");
        assert_eq!(v["prompt_eval_count"], 1);

        let (status, body) = s
            .post(
                "/v1/embeddings",
                json!({"model": "mock", "input": [[1, 2]]}),
            )
            .await;
        assert_eq!(status, 400);
        assert!(body.contains("input[0]"), "{body}");
        s.stop().await;
    })
    .await;
}

#[tokio::test]
async fn text_completions_stream_and_answer_whole() {
    bounded(async {
        let s = Surface::start().await;
        let v = s
            .post_json(
                "/v1/completions",
                json!({"model": "mock:tokens=4", "prompt": "def f(", "suffix": "return 1"}),
            )
            .await;
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 tok3", "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 4);

        let (_, body) = s
            .post(
                "/v1/completions",
                json!({"model": "mock:tokens=2", "prompt": "x", "stream": true}),
            )
            .await;
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        let text: String = sse_json(&body)
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(text, "tok0 tok1");
        s.stop().await;
    })
    .await;
}

#[tokio::test]
async fn json_answers_logprobs_and_reasoning_reach_the_client() {
    bounded(async {
        let s = Surface::start().await;
        let v = s
            .post_json(
                "/v1/chat/completions",
                json!({"model": "mock:tokens=2", "messages": [{"role": "user", "content": "hi"}],
                       "response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": true,
                           "schema": {"type": "object", "properties": {"answer": {"type": "string"}}}}},
                       "logprobs": true, "top_logprobs": 2, "reasoning_effort": "low",
                       "top_k": 3}),
            )
            .await;
        let message = &v["choices"][0]["message"];
        let answer: Value = serde_json::from_str(message["content"].as_str().unwrap()).unwrap();
        assert_eq!(answer["answer"], "tok0 tok1", "{v}");
        assert_eq!(message["reasoning_content"], iop_node::mock::MOCK_REASONING);
        let logprobs = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(logprobs.len(), 2, "{v}");
        assert_eq!(logprobs[0]["top_logprobs"].as_array().unwrap().len(), 2);
        s.stop().await;
    })
    .await;
}

/// Reasoning a provider streams reaches a Responses client as a reasoning
/// item (its `reasoning_text` deltas), before the message, streamed or not.
#[tokio::test]
async fn reasoning_reaches_a_responses_client_as_a_reasoning_item() {
    bounded(async {
        let s = Surface::start().await;
        let ask = |stream: bool| {
            json!({"model": "mock:tokens=2", "input": "hi", "stream": stream,
                   "reasoning": {"effort": "low"}})
        };
        let (status, body) = s.post("/v1/responses", ask(true)).await;
        assert_eq!(status, 200, "{body}");
        let events = sse_json(&body);
        let reasoning: String = events
            .iter()
            .filter(|e| e["type"] == "response.reasoning_text.delta")
            .filter_map(|e| e["delta"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(reasoning, iop_node::mock::MOCK_REASONING, "{body}");
        let done = events.last().unwrap();
        assert_eq!(done["type"], "response.completed", "{body}");
        let output = &done["response"]["output"];
        assert_eq!(output[0]["type"], "reasoning");
        assert_eq!(
            output[0]["content"][0]["text"],
            iop_node::mock::MOCK_REASONING
        );
        assert_eq!(output[1]["type"], "message");
        assert_eq!(done["response"]["reasoning"]["effort"], "low");
        let whole = s.post_json("/v1/responses", ask(false)).await;
        assert_eq!(whole["output"][0]["type"], "reasoning", "{whole}");
        assert_eq!(whole["output"][0]["content"], output[0]["content"]);
        s.stop().await;
    })
    .await;
}

#[tokio::test]
async fn what_a_provider_cannot_do_is_a_400_naming_the_parameter() {
    bounded(async {
        let s = Surface::start().await;
        let hi = json!([{"role": "user", "content": "hi"}]);
        let (status, body) = s
            .post(
                "/v1/chat/completions",
                json!({"model": "mock", "messages": hi, "n": 2}),
            )
            .await;
        assert_eq!(status, 400, "{body}");
        let err: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(err["error"]["param"], "n");
        let (status, body) = s
            .post(
                "/v1/chat/completions",
                json!({"model": "llama", "messages": hi, "logprobs": true}),
            )
            .await;
        assert_eq!(status, 400, "{body}");
        let err: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(err["error"]["param"], "logprobs");
        let (status, body) = s
            .post(
                "/v1/chat/completions",
                json!({"model": "llama", "messages": hi, "logit_bias": {"1": 2}}),
            )
            .await;
        assert_eq!(status, 400, "{body}");
        assert!(body.contains("logit_bias"), "{body}");
        s.stop().await;
    })
    .await;
}

#[tokio::test]
async fn ollama_show_and_ps_describe_routable_models() {
    bounded(async {
        let s = Surface::start().await;
        let v = s.post_json("/api/show", json!({"model": "mock"})).await;
        assert!(
            v["capabilities"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c == "completion"),
            "{v}"
        );
        let (status, _) = s.post("/api/show", json!({"model": "nope"})).await;
        assert_eq!(status, 404);
        let r = s
            .http
            .get(format!("http://{}/api/ps", s.edge.http_addr))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        let v: Value = r.json().await.unwrap();
        assert!(
            v["models"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["name"] == "mock"),
            "{v}"
        );
        s.stop().await;
    })
    .await;
}

#[tokio::test]
async fn a_model_the_node_reports_is_listed_and_routed_without_edge_config() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        common::write_secret(&pki.path().join("key"), KEY);
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[health]\nrefresh_interval_ms = 100\nprobe_timeout_ms = 1000\nstale_after_ms = 5000\n\
             [[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"mock\"\n\
             [[providers]]\nid = \"quiet\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"quiet\"\ndiscover_models = false\n\
             [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n",
        ))
        .await
        .expect("edge");
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            "[[providers]]\nadapter = \"mock\"\ntarget = \"mock\"\nmodels = [\"found-model\"]\n\
             [[providers]]\nadapter = \"mock\"\ntarget = \"quiet\"\nmodels = [\"hidden-model\"]\n",
        );
        ready_generation(&edge, "node-1").await;
        wait_for(&edge, "the reported model", |_| {
            edge.hub.catalog().pool_for("found-model").len() == 1
                && edge.hub.catalog().pool_for("hidden-model").len() == 1
        })
        .await;
        let http = reqwest::Client::new();
        let url = |p: &str| format!("http://{}{p}", edge.http_addr);
        let v: Value = http
            .get(url("/v1/models"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let ids: Vec<&str> = v["data"].as_array().unwrap().iter().filter_map(|m| m["id"].as_str()).collect();
        assert_eq!(ids, vec!["found-model"], "discover_models = false keeps a provider's models out");
        let r = http
            .post(url("/v1/chat/completions"))
            .bearer_auth(KEY)
            .json(&json!({"model": "found-model", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let r = http
            .post(url("/v1/chat/completions"))
            .bearer_auth(KEY)
            .json(&json!({"model": "hidden-model", "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
        wait_for(&edge, "idle", |s| s.leases_in_use == 0 && s.waiters == 0).await;
        let _ = node.shutdown().await;
        edge.shutdown().await;
    })
    .await;
}

/// `[discovered_models]`: a hidden model is neither listed nor routed; a
/// renamed one is listed and asked for by its new name only, and its
/// providers are asked for the discovered name, normalized (the mock's
/// script is in that name) and tunnelled (the provider's own answer names
/// what it was asked for); API keys restrict by the new name.
#[tokio::test]
async fn discovered_models_can_be_hidden_and_renamed() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        common::write_secret(&pki.path().join("key"), KEY);
        common::write_secret(&pki.path().join("key2"), "sk-surface-fast-only-key");
        let mock = iop_node::mock::MockServer::start(iop_node::mock::MockScript::default())
            .await
            .unwrap();
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[health]\nrefresh_interval_ms = 100\nprobe_timeout_ms = 1000\nstale_after_ms = 5000\n\
             [[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"mock\"\n\
             [[providers]]\nid = \"t\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"oa\"\nmode = \"tunnel\"\n\
             [discovered_models]\nhide = [\"embed*\"]\n\
             [discovered_models.rename]\n\"mock:tokens=3\" = \"fast\"\n\"mock\" = \"tunnelled\"\n\
             [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n\
             [[api_keys]]\nprincipal = \"r\"\nkey_file = \"key2\"\nmodels = [\"fast\"]\n",
        ))
        .await
        .expect("edge");
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"mock\"\ntarget = \"mock\"\nmodels = [\"mock:tokens=3\", \"embed-small\", \"other\"]\n\
                 [[providers]]\nadapter = \"openai\"\ntarget = \"oa\"\nbase_url = \"{}\"\n",
                mock.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        wait_for(&edge, "the reported models", |_| {
            edge.hub.catalog().pool_for("mock:tokens=3").len() == 1
                && edge.hub.catalog().pool_for("mock").len() == 1
        })
        .await;
        let http = reqwest::Client::new();
        let url = |p: &str| format!("http://{}{p}", edge.http_addr);
        let listed = |key: &'static str| {
            let http = http.clone();
            let u = url("/v1/models");
            async move {
                let v: Value = http.get(u).bearer_auth(key).send().await.unwrap().json().await.unwrap();
                let mut ids: Vec<String> = v["data"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_owned))
                    .collect();
                ids.sort();
                ids
            }
        };
        assert_eq!(listed(KEY).await, vec!["fast", "other", "tunnelled"]);
        assert_eq!(listed("sk-surface-fast-only-key").await, vec!["fast"]);
        let chat = |key: &'static str, model: &str| {
            http.post(url("/v1/chat/completions"))
                .bearer_auth(key)
                .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}))
                .send()
        };
        let r = chat(KEY, "fast").await.unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["model"], "fast", "the client's name in the answer");
        assert_eq!(
            v["choices"][0]["message"]["content"], "tok0 tok1 tok2",
            "the provider was asked for the discovered name: {v}"
        );
        for (key, model) in [
            (KEY, "mock:tokens=3"),
            (KEY, "embed-small"),
            ("sk-surface-fast-only-key", "other"),
        ] {
            assert_eq!(chat(key, model).await.unwrap().status(), 404, "{model}");
        }
        assert_eq!(
            chat("sk-surface-fast-only-key", "fast").await.unwrap().status(),
            200
        );
        let r = chat(KEY, "tunnelled").await.unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["model"], "mock", "the tunnelled body named the discovered model: {v}");
        assert_eq!(mock.requests(), 1);
        wait_for(&edge, "idle", |s| s.leases_in_use == 0 && s.waiters == 0).await;
        let _ = node.shutdown().await;
        edge.shutdown().await;
    })
    .await;
}

/// Capacity from the node: an Edge provider entry without `capacity` takes
/// the node's `[[providers]] max_concurrent_runs` for its target, so two
/// slow requests to a provider the node limits to one run: the second waits
/// in the Edge's queue (never a `node_overloaded` refusal) and both answer.
#[tokio::test]
async fn a_provider_without_capacity_takes_the_nodes_limit() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        common::write_secret(&pki.path().join("key"), KEY);
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"mock\"\n\
             [[routes]]\nmodel = \"mock:*\"\nproviders = [\"p\"]\n\
             [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n",
        ))
        .await
        .expect("edge");
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            "[[providers]]\nadapter = \"mock\"\ntarget = \"mock\"\nmax_concurrent_runs = 1\n",
        );
        ready_generation(&edge, "node-1").await;
        let snap = edge.hub.snapshot().await.unwrap();
        let view = snap
            .providers
            .iter()
            .find(|c| c.provider_id.as_str() == "p")
            .unwrap();
        assert_eq!(view.capacity, 1, "the node's limit, not the default 4");
        let http = reqwest::Client::new();
        let ask = || {
            http.post(format!("http://{}/v1/chat/completions", edge.http_addr))
                .bearer_auth(KEY)
                .json(&json!({"model": "mock:tokens=10,tps=20",
                              "messages": [{"role": "user", "content": "hi"}]}))
                .send()
        };
        let (a, b) = tokio::join!(ask(), ask());
        for r in [a, b] {
            let r = r.unwrap();
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        }
        let _ = node.shutdown().await;
        edge.shutdown().await;
    })
    .await;
}
