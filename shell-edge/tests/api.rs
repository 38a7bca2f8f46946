//! The client-facing API end to end: real HTTP into the Edge, real QUIC to
//! Nodes, real HTTP to mock providers (R-GATE-*, SPEC §5).

mod common;

use std::time::Duration;

use common::*;
use iop_edge::metrics::scrape_value;
use iop_edge::server::RunningEdge;
use iop_node::RunningNode;
use iop_node::mock::{MockScript, MockServer};

const KEY: &str = "sk-test-0123456789abcdef";

struct Deployment {
    _pki: Pki,
    edge: RunningEdge,
    nodes: Vec<RunningNode>,
    mocks: Vec<MockServer>,
    http: reqwest::Client,
}

impl Deployment {
    /// One node per mock, each serving provider `p<i>` on node `node-<i>`,
    /// all in one pool for model `m` (and `mock`).
    async fn start(scripts: Vec<MockScript>, extra_edge: &str) -> Self {
        Self::start_with(scripts, "", extra_edge).await
    }

    /// [`Deployment::start`] with `edge_lines` added to the `[edge]` section.
    async fn start_with(scripts: Vec<MockScript>, edge_lines: &str, extra_edge: &str) -> Self {
        let ids: Vec<String> = (1..=scripts.len()).map(|i| format!("node-{i}")).collect();
        let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let pki = Pki::new(&id_refs);
        write_secret(&pki.path().join("key"), KEY);
        let mut mocks = Vec::new();
        for s in scripts {
            mocks.push(MockServer::start(s).await.unwrap());
        }
        let mut providers = String::new();
        for (i, _) in mocks.iter().enumerate() {
            providers.push_str(&format!(
                "[[providers]]\nid = \"p{n}\"\nnode = \"node-{n}\"\nadapter = \"openai\"\ntarget = \"t\"\ncapacity = 4\nstall_timeout_ms = 400\n",
                n = i + 1
            ));
        }
        let pool: Vec<String> = (1..=mocks.len()).map(|i| format!("\"p{i}\"")).collect();
        let edge_extra = format!(
            "{providers}\n[[routes]]\nmodel = \"m\"\nproviders = [{pool}]\n[[routes]]\nmodel = \"mock\"\nproviders = [{pool}]\n[[routes]]\nmodel = \"mock:*\"\nproviders = [{pool}]\n\
             [[api_keys]]\nprincipal = \"tester\"\nkey_file = \"key\"\nadmin = true\n{extra_edge}",
            pool = pool.join(", ")
        );
        let edge = RunningEdge::start(edge_config_with(&pki, 0, edge_lines, &edge_extra))
            .await
            .expect("edge");
        let mut nodes = Vec::new();
        for (i, mock) in mocks.iter().enumerate() {
            let target = format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                mock.base_url()
            );
            nodes.push(start_node(
                &pki,
                &format!("node-{}", i + 1),
                edge.quic_addr,
                &target,
            ));
        }
        for i in 0..nodes.len() {
            ready_generation(&edge, &format!("node-{}", i + 1)).await;
        }
        Self {
            _pki: pki,
            edge,
            nodes,
            mocks,
            http: reqwest::Client::new(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.edge.http_addr)
    }

    async fn post(&self, path: &str, body: &str) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .expect("http")
    }

    async fn metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn wait_idle(&self) {
        // Every request also left the hub's event routing (no waiter leaks).
        wait_for(&self.edge, "no leases in use and no waiters", |s| {
            s.leases_in_use == 0 && s.queue_depth == 0 && s.waiters == 0
        })
        .await;
    }

    async fn stop(self) {
        for n in self.nodes {
            let _ = n.shutdown().await;
        }
        self.edge.shutdown().await;
    }
}

fn chat_body(model: &str, stream: bool) -> String {
    format!(
        r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"hello"}}]}}"#
    )
}

/// The concatenated `delta.content` of an SSE chat stream, and whether it
/// ended with `[DONE]` or an in-stream error.
fn sse_text(body: &str) -> (String, bool, Option<serde_json::Value>) {
    let mut text = String::new();
    let mut done = false;
    let mut error = None;
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(data).expect("json chunk");
        if v.get("error").is_some() {
            error = Some(v);
            continue;
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    (text, done, error)
}

#[tokio::test]
async fn chat_completion_streams_and_returns_json() {
    bounded(async {
        let d = Deployment::start(vec![MockScript::default()], "").await;
        let r = d
            .post("/v1/chat/completions", &chat_body("mock", false))
            .await;
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert!(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .contains("tok")
        );
        let r = d
            .post("/v1/chat/completions", &chat_body("mock", true))
            .await;
        assert_eq!(r.status(), 200);
        let (text, done, error) = sse_text(&r.text().await.unwrap());
        assert!(text.contains("tok") && done && error.is_none());
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

/// `name -> (dur ms, desc)` of a `Server-Timing` header.
fn server_timing(r: &reqwest::Response) -> Vec<(String, f64, Option<String>)> {
    let value = r
        .headers()
        .get("server-timing")
        .expect("a Server-Timing header")
        .to_str()
        .unwrap();
    value
        .split(", ")
        .map(|metric| {
            let mut parts = metric.split(';');
            let name = parts.next().unwrap().to_owned();
            let (mut dur, mut desc) = (f64::NAN, None);
            for p in parts {
                if let Some(d) = p.strip_prefix("dur=") {
                    dur = d.parse().unwrap();
                } else if let Some(d) = p.strip_prefix("desc=") {
                    desc = Some(d.trim_matches('"').to_owned());
                }
            }
            (name, dur, desc)
        })
        .collect()
}

fn timing(t: &[(String, f64, Option<String>)], name: &str) -> f64 {
    t.iter()
        .find(|(n, ..)| n == name)
        .map_or(f64::NAN, |(_, d, _)| *d)
}

/// Every answer says how long the client waited and iop's share of it:
/// a whole answer covers the whole request (its provider time holds the
/// provider's prefill), a streamed one only what was known when its
/// headers went out, and a refusal was all the Edge's.
#[tokio::test]
async fn every_answer_carries_server_timing_with_the_edge_s_own_share() {
    bounded(async {
        let d = Deployment::start(vec![MockScript::default()], "").await;
        let started = std::time::Instant::now();
        let r = d
            .post(
                "/v1/chat/completions",
                &chat_body("mock:prefill_ms=300,tokens=3", false),
            )
            .await;
        let waited_ms = started.elapsed().as_secs_f64() * 1000.0;
        assert_eq!(r.status(), 200);
        let t = server_timing(&r);
        let names: Vec<&str> = t.iter().map(|(n, ..)| n.as_str()).collect();
        assert_eq!(names, ["queue", "provider", "edge", "total"]);
        let (queue, provider, edge, total) = (
            timing(&t, "queue"),
            timing(&t, "provider"),
            timing(&t, "edge"),
            timing(&t, "total"),
        );
        assert!(
            provider >= 300.0,
            "the provider's prefill is its time: {t:?}"
        );
        assert!(
            total <= waited_ms + 1.0,
            "no more than the client waited: {t:?} vs {waited_ms}"
        );
        assert!(
            ((queue + provider + edge) - total).abs() <= 0.3,
            "the parts add up: {t:?}"
        );
        assert!(edge < 250.0, "the Edge's own share is small: {t:?}");

        let r = d
            .post(
                "/v1/chat/completions",
                &chat_body("mock:prefill_ms=200,tokens=50,tps=100", true),
            )
            .await;
        assert_eq!(r.status(), 200);
        let t = server_timing(&r);
        let desc = |name| {
            t.iter()
                .find(|(n, ..)| n == name)
                .and_then(|(_, _, d)| d.clone())
        };
        assert_eq!(desc("total").as_deref(), Some("to headers"), "{t:?}");
        assert_eq!(
            desc("provider").as_deref(),
            Some("to first content"),
            "{t:?}"
        );
        let to_headers = timing(&t, "total");
        assert!(
            to_headers >= 200.0,
            "headers follow the first content: {t:?}"
        );
        assert!(
            to_headers < 450.0,
            "the stream's ~500 ms after its first content are not in it: {t:?}"
        );
        let (text, done, _) = sse_text(&r.text().await.unwrap());
        assert!(done && !text.is_empty());

        let r = d
            .post("/v1/chat/completions", &chat_body("unrouted", false))
            .await;
        assert_eq!(r.status(), 404);
        let t = server_timing(&r);
        assert_eq!(timing(&t, "provider"), 0.0, "{t:?}");
        assert_eq!(
            timing(&t, "edge"),
            timing(&t, "total"),
            "all the Edge's: {t:?}"
        );
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn stall_before_first_content_is_answered_by_the_other_node_with_one_readmission() {
    bounded(async {
        let stalling = MockScript {
            stall_after: Some(0),
            ..MockScript::default()
        };
        let d = Deployment::start(vec![stalling, MockScript::default()], "").await;
        let r = d.post("/v1/chat/completions", &chat_body("m", true)).await;
        assert_eq!(r.status(), 200);
        let (text, done, error) = sse_text(&r.text().await.unwrap());
        assert!(error.is_none(), "{error:?}");
        assert!(done);
        assert_eq!(
            text.split_whitespace().count(),
            8,
            "a complete answer: {text}"
        );
        assert_eq!(d.mocks[0].requests(), 1);
        assert_eq!(d.mocks[1].requests(), 1);
        let m = d.metrics().await;
        assert_eq!(
            scrape_value(
                &m,
                "iop_edge_liveness_recovery_results_total",
                &[("result", "readmitted")]
            ),
            1.0,
            "{m}"
        );
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn stall_after_first_content_ends_with_one_in_stream_error() {
    bounded(async {
        let d = Deployment::start(vec![MockScript::default()], "").await;
        let r = d
            .post(
                "/v1/chat/completions",
                &chat_body("mock:stall_after=2", true),
            )
            .await;
        assert_eq!(r.status(), 200, "committed before the stall");
        let (text, _done, error) = sse_text(&r.text().await.unwrap());
        assert_eq!(text.split_whitespace().count(), 2);
        let error = error.expect("one in-stream error");
        assert_eq!(error["error"]["code"], "response_stalled");
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn two_hundred_parallel_streams_then_zero_leases() {
    bounded(async {
        let d = Deployment::start(vec![MockScript::default(), MockScript::default()], "").await;
        let mut tasks = Vec::new();
        for _ in 0..200 {
            let http = d.http.clone();
            let url = d.url("/v1/chat/completions");
            tasks.push(tokio::spawn(async move {
                let r = http
                    .post(url)
                    .bearer_auth(KEY)
                    .header("content-type", "application/json")
                    .body(chat_body("m", true))
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                (status, r.text().await.unwrap())
            }));
        }
        let mut ok = 0;
        for t in tasks {
            let (status, body) = t.await.unwrap();
            if status == 200 {
                let (text, done, error) = sse_text(&body);
                assert!(done && error.is_none() && !text.is_empty());
                ok += 1;
            } else {
                // Over capacity with a full queue is the one allowed refusal.
                assert_eq!(status, 429, "{body}");
            }
        }
        assert!(ok >= 64, "most streams completed ({ok})");
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn bad_input_gets_openai_errors_and_disturbs_nothing() {
    bounded(async {
        let d = Deployment::start(vec![MockScript::default()], "").await;
        let cases: Vec<(Option<&str>, String, u16)> = vec![
            (Some(KEY), "{not json".into(), 400),
            (Some(KEY), chat_body("no-such-model", false), 404),
            (None, chat_body("mock", false), 401),
            (
                Some("sk-wrong-wrong-wrong-wrong"),
                chat_body("mock", false),
                401,
            ),
            (
                Some(KEY),
                r#"{"model":"mock","n":3,"messages":[{"role":"user","content":"x"}]}"#.into(),
                400,
            ),
            (
                Some(KEY),
                r#"{"model":"mock","temperature":9,"messages":[{"role":"user","content":"x"}]}"#
                    .into(),
                400,
            ),
        ];
        for (key, body, status) in cases {
            let mut req = d
                .http
                .post(d.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(body.clone());
            if let Some(k) = key {
                req = req.bearer_auth(k);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status().as_u16(), status, "{body}");
            let v: serde_json::Value = r.json().await.unwrap();
            assert!(v["error"]["message"].is_string(), "{v}");
            assert!(v["error"]["type"].is_string(), "{v}");
        }
        // Oversize body.
        let big = format!(
            r#"{{"model":"mock","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(9 * 1024 * 1024)
        );
        let r = d.post("/v1/chat/completions", &big).await;
        assert_eq!(r.status(), 413);
        // Unsupported parameter values name the parameter.
        let r = d
            .post(
                "/v1/chat/completions",
                r#"{"model":"mock","n":2,"messages":[{"role":"user","content":"x"}]}"#,
            )
            .await;
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], "n");
        // Nothing was disturbed: a good request still works.
        let r = d
            .post("/v1/chat/completions", &chat_body("mock", false))
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            d.mocks[0].requests(),
            1,
            "bad requests never reached a provider"
        );
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn full_queue_answers_429_with_retry_after() {
    bounded(async {
        let slow = MockScript {
            tokens_per_second: 10.0,
            tokens: 30,
            ..MockScript::default()
        };
        let d = Deployment::start(vec![slow], "").await;
        // Capacity 4 and a queue of 64 (common config): fill both.
        let mut held = Vec::new();
        for _ in 0..68 {
            let http = d.http.clone();
            let url = d.url("/v1/chat/completions");
            held.push(tokio::spawn(async move {
                http.post(url)
                    .bearer_auth(KEY)
                    .header("content-type", "application/json")
                    .body(chat_body("mock", true))
                    .send()
                    .await
                    .unwrap()
                    // Keep reading: the stream holds its lease until the end.
                    .text()
                    .await
            }));
        }
        wait_for(&d.edge, "queue full", |s| s.queue_depth == 64).await;
        let r = d
            .post("/v1/chat/completions", &chat_body("mock", false))
            .await;
        assert_eq!(r.status(), 429);
        assert!(r.headers().get("retry-after").is_some());
        let v: serde_json::Value = r.json().await.unwrap();
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
async fn client_disconnect_cancels_the_run_and_releases_the_lease() {
    bounded(async {
        let slow = MockScript {
            tokens_per_second: 20.0,
            tokens: 1000,
            ..MockScript::default()
        };
        let d = Deployment::start(vec![slow], "").await;
        let mut r = d
            .post("/v1/chat/completions", &chat_body("mock", true))
            .await;
        assert_eq!(r.status(), 200);
        let _first = r.chunk().await.unwrap();
        drop(r);
        d.mocks[0].wait_for(|s| s.in_flight == 0).await;
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn models_lists_what_the_key_may_use_and_responses_works() {
    bounded(async {
        let d = Deployment::start(vec![MockScript::default()], "").await;
        let r = d
            .http
            .get(d.url("/v1/models"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        let v: serde_json::Value = r.json().await.unwrap();
        let ids: Vec<&str> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["id"].as_str())
            .collect();
        assert!(ids.contains(&"m") && ids.contains(&"mock"), "{ids:?}");
        let r = d
            .post("/v1/responses", r#"{"model":"mock","input":"hello"}"#)
            .await;
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["object"], "response");
        assert_eq!(v["status"], "completed");
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn ollama_api_chat_generate_and_tags() {
    bounded(async {
        let d = Deployment::start(vec![MockScript::default()], "").await;
        let r = d
            .post(
                "/api/chat",
                r#"{"model":"mock","messages":[{"role":"user","content":"hi"}]}"#,
            )
            .await;
        assert_eq!(r.status(), 200);
        let body = r.text().await.unwrap();
        let last: serde_json::Value = serde_json::from_str(body.lines().last().unwrap()).unwrap();
        assert_eq!(last["done"], true, "{body}");
        let r = d
            .post(
                "/api/generate",
                r#"{"model":"mock","prompt":"hi","stream":false}"#,
            )
            .await;
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(v["response"].as_str().unwrap().contains("tok"), "{v}");
        let r = d
            .http
            .get(d.url("/api/tags"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(
            v["models"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["name"] == "mock")
        );
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
}

/// The official OpenAI Python SDK against a live deployment. CI installs it
/// (see `.ci/run`) and sets `IOP_SDK_PYTHON`; elsewhere the test uses
/// `python3` if it can import `openai`, and says so if it cannot.
#[tokio::test]
async fn official_openai_python_sdk_end_to_end() {
    let python = match std::env::var("IOP_SDK_PYTHON") {
        Ok(p) => p,
        Err(_) => {
            assert!(
                std::env::var("CI").is_err(),
                "CI must provide IOP_SDK_PYTHON (a python with the openai package)"
            );
            let ok = std::process::Command::new("python3")
                .args(["-c", "import openai"])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("openai SDK not installed locally; run .ci/run to exercise this test");
                return;
            }
            "python3".into()
        }
    };
    bounded(async {
        // Keep-alive comments every 50 ms fall between the slow streams'
        // tokens (200 ms apart).
        let d =
            Deployment::start_with(vec![MockScript::default()], "sse_keep_alive_ms = 50", "").await;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sdk/openai_sdk_e2e.py");
        let out = tokio::process::Command::new(&python)
            .arg(script)
            .arg(d.url("/v1"))
            .arg(KEY)
            .output()
            .await
            .expect("run python");
        assert!(
            out.status.success(),
            "sdk e2e failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        d.wait_idle().await;
        d.stop().await;
    })
    .await;
    let _ = Duration::ZERO;
}

/// Tunnel-mode providers: OpenAI requests relayed byte for byte to an
/// `openai` provider, Ollama requests to an `ollama` provider, both under
/// the same stream gate.
#[tokio::test]
async fn tunnel_mode_relays_openai_and_ollama_requests() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[[providers]]\nid = \"oa\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"oa\"\nmode = \"tunnel\"\nmodels = [\"mock\"]\n\
             [[providers]]\nid = \"ol\"\nnode = \"node-1\"\nadapter = \"ollama\"\ntarget = \"ol\"\nmode = \"tunnel\"\n\
             [[routes]]\nmodel = \"mock:*\"\nproviders = [\"ol\"]\n\
             [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n",
        ))
        .await
        .unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"oa\"\nbase_url = \"{u}\"\n\
                 [[providers]]\nadapter = \"ollama\"\ntarget = \"ol\"\nbase_url = \"{u}\"\n",
                u = mock.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        let http = reqwest::Client::new();
        let r = http
            .post(format!("http://{}/v1/chat/completions", edge.http_addr))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(chat_body("mock", true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let (text, done, error) = sse_text(&r.text().await.unwrap());
        assert!(text.contains("tok") && done && error.is_none());
        let r = http
            .post(format!("http://{}/api/chat", edge.http_addr))
            .bearer_auth(KEY)
            .body(r#"{"model":"mock:tokens=3","messages":[{"role":"user","content":"hi"}]}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let body = r.text().await.unwrap();
        let last: serde_json::Value = serde_json::from_str(body.lines().last().unwrap()).unwrap();
        assert_eq!(last["done"], true, "{body}");
        // Not streamed (R-LIM-3): a small answer is collected and sent
        // whole, with its length; one past MAX_COLLECTED_TUNNEL_BYTES is
        // streamed on after what was collected, every byte in order.
        for (tokens, whole) in [(3usize, true), (60_000, false)] {
            let r = http
                .post(format!("http://{}/api/chat", edge.http_addr))
                .bearer_auth(KEY)
                .body(format!(
                    r#"{{"model":"mock:tokens={tokens}","stream":false,"messages":[{{"role":"user","content":"hi"}}]}}"#
                ))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(r.content_length().is_some(), whole, "{tokens} tokens");
            let body = r.bytes().await.unwrap();
            assert_eq!(
                body.len() > iop_core::edge::whole_answer::MAX_COLLECTED_TUNNEL_BYTES,
                !whole,
                "{} bytes",
                body.len()
            );
            let answer: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(answer["done"], true);
            let content = answer["message"]["content"].as_str().unwrap();
            assert!(content.contains(&format!("tok{}", tokens - 1)), "the whole answer");
        }
        assert_eq!(mock.requests(), 4, "all went to the provider as tunnels");
        wait_for(&edge, "idle", |s| s.leases_in_use == 0).await;
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}
