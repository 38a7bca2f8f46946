//! Durable responses over real QUIC and real HTTP (SPEC §6): stored
//! Responses and chat completions fetched and resumed, idempotency keys,
//! background responses, cancel and delete, continued conversations; the
//! mock provider's request counter shows what ran (R-JRN-1, R-JRN-2,
//! R-IDEM-1).

mod common;
#[path = "../../store-nats/tests/support/mod.rs"]
mod nats;

use std::sync::Arc;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};
use serde_json::{Value, json};

const KEY: &str = "sk-durable-0123456789";
const OTHER_KEY: &str = "sk-durable-other-0123";

struct Deployment {
    edge: RunningEdge,
    node: iop_node::RunningNode,
    mock: MockServer,
}

impl Deployment {
    async fn start(pki: &Pki, script: MockScript, journal: &str) -> Self {
        Self::start_with(pki, script, "", journal).await
    }

    /// [`Self::start`] with `edge_lines` in the Edge's `[edge]` section.
    async fn start_with(pki: &Pki, script: MockScript, edge_lines: &str, journal: &str) -> Self {
        write_secret(&pki.path().join("key"), KEY);
        write_secret(&pki.path().join("other"), OTHER_KEY);
        let mock = MockServer::start(script).await.unwrap();
        let extra = format!(
            "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\nmodels = [\"m\"]\n\
             [[api_keys]]\nprincipal = \"tester\"\nkey_file = \"key\"\n\
             [[api_keys]]\nprincipal = \"other\"\nkey_file = \"other\"\n{journal}"
        );
        let edge = RunningEdge::start(edge_config_with(pki, 0, edge_lines, &extra))
            .await
            .unwrap();
        let node = start_node(
            pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                mock.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        Deployment { edge, node, mock }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.edge.http_addr)
    }

    async fn post(&self, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, String) {
        let mut r = reqwest::Client::new()
            .post(self.url(path))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(body.to_string());
        for (name, value) in headers {
            r = r.header(*name, *value);
        }
        let r = r.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.text().await.unwrap())
    }

    async fn get(&self, path: &str, key: &str, headers: &[(&str, &str)]) -> (u16, String) {
        let mut r = reqwest::Client::new().get(self.url(path)).bearer_auth(key);
        for (name, value) in headers {
            r = r.header(*name, *value);
        }
        let r = r.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.text().await.unwrap())
    }

    /// The response object once it has its terminal (bounded wait).
    async fn wait_terminal(&self, id: &str) -> Value {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let (_, body) = self.get(&format!("/v1/responses/{id}"), KEY, &[]).await;
            let object = json_of(&body);
            if !matches!(object["status"].as_str(), Some("queued" | "in_progress")) {
                return object;
            }
            assert!(tokio::time::Instant::now() < deadline, "{object}");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    async fn shutdown(self) {
        self.node.shutdown().await.unwrap();
        self.edge.shutdown().await;
    }
}

/// `(id, event name, data)` of each SSE event of a body (comment lines,
/// the keep-alives, are no part of any event).
fn sse(body: &str) -> Vec<(Option<u64>, String, Value)> {
    body.split("\n\n")
        .filter(|e| {
            e.lines()
                .any(|l| !l.trim().is_empty() && !l.starts_with(':'))
        })
        .map(|event| {
            let mut id = None;
            let mut name = String::new();
            let mut data = Value::Null;
            for line in event.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    id = v.parse().ok();
                } else if let Some(v) = line.strip_prefix("event: ") {
                    name = v.to_owned();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(v).unwrap_or(Value::String(v.to_owned()));
                }
            }
            (id, name, data)
        })
        .collect()
}

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

#[tokio::test]
async fn a_stored_response_is_fetched_and_its_stream_resumed_exactly_r_jrn_2() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let d = Deployment::start(&pki, MockScript::default(), "").await;
        let (status, body) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "hello", "stream": true}),
                &[],
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let live = sse(&body);
        let ids: Vec<u64> = live.iter().map(|e| e.0.expect("numbered")).collect();
        assert_eq!(
            ids,
            (0..live.len() as u64).collect::<Vec<_>>(),
            "0, 1, 2, ..."
        );
        for (id, _, data) in &live {
            assert_eq!(
                data["sequence_number"].as_u64(),
                *id,
                "id = sequence_number"
            );
        }
        let id = live[0].2["response"]["id"].as_str().unwrap().to_owned();
        assert_eq!(live.last().unwrap().1, "response.completed");
        assert_eq!(d.mock.requests(), 1);

        // The whole object, as stored.
        let (status, body) = d.get(&format!("/v1/responses/{id}"), KEY, &[]).await;
        assert_eq!(status, 200, "{body}");
        let object = json_of(&body);
        assert_eq!(object["status"], "completed");
        assert_eq!(object["store"], true, "OpenAI's default is to store");
        let completed = &live.last().unwrap().2["response"];
        assert_eq!(&object, completed, "the stored object is the streamed one");

        // A replay is the same stream, and every resume point gives exactly
        // the rest (R-JRN-2).
        let (_, replay) = d
            .get(&format!("/v1/responses/{id}?stream=true"), KEY, &[])
            .await;
        assert_eq!(sse(&replay), live);
        for n in [0, 3, live.len() as u64 - 2] {
            let (_, rest) = d
                .get(
                    &format!("/v1/responses/{id}?stream=true&starting_after={n}"),
                    KEY,
                    &[],
                )
                .await;
            assert_eq!(sse(&rest), live[n as usize + 1..].to_vec(), "after {n}");
            let (_, rest) = d
                .get(
                    &format!("/v1/responses/{id}?stream=true"),
                    KEY,
                    &[("last-event-id", &n.to_string())],
                )
                .await;
            assert_eq!(
                sse(&rest),
                live[n as usize + 1..].to_vec(),
                "Last-Event-ID {n}"
            );
        }
        assert_eq!(d.mock.requests(), 1, "reads never call the provider");

        // Another key sees nothing.
        let (status, _) = d.get(&format!("/v1/responses/{id}"), OTHER_KEY, &[]).await;
        assert_eq!(status, 404);
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn store_false_is_not_kept_and_an_operator_may_change_the_default() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let d = Deployment::start(
            &pki,
            MockScript::default(),
            "[journal]\nstore = \"memory\"\nresponses_store_default = false\n",
        )
        .await;
        let (status, body) = d
            .post("/v1/responses", &json!({"model": "m", "input": "hi"}), &[])
            .await;
        assert_eq!(status, 200, "{body}");
        let object = json_of(&body);
        assert_eq!(object["store"], false);
        let (status, _) = d
            .get(
                &format!("/v1/responses/{}", object["id"].as_str().unwrap()),
                KEY,
                &[],
            )
            .await;
        assert_eq!(status, 404, "not stored");
        let (_, body) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "hi", "store": true}),
                &[],
            )
            .await;
        let object = json_of(&body);
        assert_eq!(object["store"], true);
        let (status, _) = d
            .get(
                &format!("/v1/responses/{}", object["id"].as_str().unwrap()),
                KEY,
                &[],
            )
            .await;
        assert_eq!(status, 200, "stored when asked");
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn an_idempotent_retry_storm_makes_one_provider_call_r_idem_1() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let script = MockScript {
            tokens: 20,
            tokens_per_second: 200.0,
            ..MockScript::default()
        };
        let d = Deployment::start(&pki, script, "").await;
        let body = json!({"model": "m", "stream": true,
            "messages": [{"role": "user", "content": "once"}]});
        let d = std::sync::Arc::new(d);
        let mut tasks = Vec::new();
        for _ in 0..50 {
            let d = d.clone();
            let body = body.clone();
            tasks.push(tokio::spawn(async move {
                d.post(
                    "/v1/chat/completions",
                    &body,
                    &[("idempotency-key", "storm-1")],
                )
                .await
            }));
        }
        let mut texts = Vec::new();
        for t in tasks {
            let (status, body) = t.await.unwrap();
            assert_eq!(status, 200, "{body}");
            let text: String = sse(&body)
                .iter()
                .filter_map(|(_, _, data)| data["choices"][0]["delta"]["content"].as_str())
                .collect();
            texts.push(text);
        }
        assert_eq!(d.mock.requests(), 1, "one provider call for 50 requests");
        assert!(texts.iter().all(|t| t == &texts[0]), "one answer");
        assert!(texts[0].starts_with("tok0 tok1"), "{}", texts[0]);
        // The same key with another body is a conflict, not a second run.
        let other = json!({"model": "m", "messages": [{"role": "user", "content": "other"}]});
        let (status, body) = d
            .post(
                "/v1/chat/completions",
                &other,
                &[("idempotency-key", "storm-1")],
            )
            .await;
        assert_eq!(status, 409, "{body}");
        assert_eq!(json_of(&body)["error"]["code"], "idempotency_key_conflict");
        // Keys are per principal: another key's identical request runs.
        assert_eq!(d.mock.requests(), 1);
        let d = std::sync::Arc::into_inner(d).unwrap();
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_stored_chat_completion_is_fetched_and_resumed_with_last_event_id() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let d = Deployment::start(&pki, MockScript::default(), "").await;
        let (status, body) = d
            .post(
                "/v1/chat/completions",
                &json!({"model": "m", "store": true, "stream": true,
                    "messages": [{"role": "user", "content": "hi"}]}),
                &[],
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let live = sse(&body);
        assert_eq!(live.last().unwrap().2, Value::String("[DONE]".into()));
        let id = live[0].2["id"].as_str().unwrap().to_owned();
        let (status, body) = d.get(&format!("/v1/chat/completions/{id}"), KEY, &[]).await;
        assert_eq!(status, 200, "{body}");
        let object = json_of(&body);
        assert_eq!(object["object"], "chat.completion");
        assert_eq!(object["id"], id.as_str());
        assert_eq!(
            object["choices"][0]["message"]["content"],
            "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7"
        );
        assert_eq!(object["choices"][0]["finish_reason"], "stop");
        let (_, rest) = d
            .get(
                &format!("/v1/chat/completions/{id}?stream=true"),
                KEY,
                &[("last-event-id", "2")],
            )
            .await;
        assert_eq!(sse(&rest), live[3..].to_vec());
        // Deleted, it is gone.
        let (status, body) = reqwest::Client::new()
            .delete(d.url(&format!("/v1/chat/completions/{id}")))
            .bearer_auth(KEY)
            .send()
            .await
            .map(|r| (r.status().as_u16(), r))
            .unwrap();
        assert_eq!(status, 200);
        assert_eq!(body.json::<Value>().await.unwrap()["deleted"], true);
        let (status, _) = d.get(&format!("/v1/chat/completions/{id}"), KEY, &[]).await;
        assert_eq!(status, 404);
        // Without `store` nothing is kept.
        let (_, body) = d
            .post(
                "/v1/chat/completions",
                &json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                &[],
            )
            .await;
        let id = json_of(&body)["id"].as_str().unwrap().to_owned();
        let (status, _) = d.get(&format!("/v1/chat/completions/{id}"), KEY, &[]).await;
        assert_eq!(status, 404);
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_durable_run_outlives_its_client_and_a_background_one_is_cancelled() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let script = MockScript {
            tokens: 40,
            tokens_per_second: 100.0,
            ..MockScript::default()
        };
        let d = Deployment::start(&pki, script, "").await;
        // A streaming client that leaves after the head: the run goes on.
        let r = reqwest::Client::new()
            .post(d.url("/v1/responses"))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(json!({"model": "m", "input": "x", "stream": true}).to_string())
            .send()
            .await
            .unwrap();
        let mut stream = r.bytes_stream();
        use futures::StreamExt as _;
        let first = stream.next().await.unwrap().unwrap();
        let first = String::from_utf8_lossy(&first).to_string();
        let id = sse(&first)[0].2["response"]["id"]
            .as_str()
            .unwrap()
            .to_owned();
        drop(stream);
        let stats = d
            .mock
            .wait_for(|s| s.in_flight == 0 && s.requests == 1)
            .await;
        assert_eq!(stats.disconnects, 0, "the provider call was not cut");
        let object = d.wait_terminal(&id).await;
        assert_eq!(object["status"], "completed", "{object}");
        assert!(
            object["output"][0]["content"][0]["text"]
                .as_str()
                .unwrap()
                .ends_with("tok39")
        );

        // Background: answered at once, then cancelled.
        let (status, body) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "y", "background": true}),
                &[],
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let object = json_of(&body);
        assert!(
            matches!(object["status"].as_str(), Some("queued" | "in_progress")),
            "{object}"
        );
        assert_eq!(object["background"], true);
        let id = object["id"].as_str().unwrap().to_owned();
        d.mock.wait_for(|s| s.in_flight == 1).await;
        let r = reqwest::Client::new()
            .post(d.url(&format!("/v1/responses/{id}/cancel")))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let object: Value = r.json().await.unwrap();
        assert_eq!(object["status"], "cancelled", "{object}");
        d.mock.wait_for(|s| s.in_flight == 0).await;
        let (_, body) = d.get(&format!("/v1/responses/{id}"), KEY, &[]).await;
        assert_eq!(json_of(&body)["status"], "cancelled");
        // Deleting removes it.
        let r = reqwest::Client::new()
            .delete(d.url(&format!("/v1/responses/{id}")))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let (status, _) = d.get(&format!("/v1/responses/{id}"), KEY, &[]).await;
        assert_eq!(status, 404);
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn previous_response_id_continues_the_stored_conversation() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let d = Deployment::start(&pki, MockScript::default(), "").await;
        let (_, body) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "a long first question to count",
                    "instructions": "be brief"}),
                &[],
            )
            .await;
        let first = json_of(&body);
        let first_id = first["id"].as_str().unwrap();
        let first_prompt = first["usage"]["input_tokens"].as_u64().unwrap();
        let (status, body) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "and?", "previous_response_id": first_id}),
                &[],
            )
            .await;
        assert_eq!(status, 200, "{body}");
        let second = json_of(&body);
        assert_eq!(second["previous_response_id"], first_id);
        let second_prompt = second["usage"]["input_tokens"].as_u64().unwrap();
        // The provider was given the first question, its answer (8 mock
        // tokens of text) and the new input, not the old instructions.
        assert!(
            second_prompt > first_prompt + 8,
            "{first_prompt} -> {second_prompt}"
        );
        // The input items are the request's own.
        let (_, body) = d
            .get(
                &format!(
                    "/v1/responses/{}/input_items",
                    second["id"].as_str().unwrap()
                ),
                KEY,
                &[],
            )
            .await;
        let items = json_of(&body);
        assert_eq!(items["data"].as_array().unwrap().len(), 1, "{items}");
        assert_eq!(items["data"][0]["content"][0]["text"], "and?");
        // Unknown, or another key's: 404 naming the parameter.
        let (status, body) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "x",
                    "previous_response_id": "resp_0000000000000000"}),
                &[],
            )
            .await;
        assert_eq!(status, 404, "{body}");
        assert_eq!(json_of(&body)["error"]["param"], "previous_response_id");
        // Not an id the Edge issues (R-LIM-5): 400 naming it, no lookup.
        let (status, body) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "x", "previous_response_id": "resp_nope"}),
                &[],
            )
            .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(json_of(&body)["error"]["param"], "previous_response_id");
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_request_that_fails_before_any_event_frees_its_idempotency_key() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let script = MockScript {
            http_error: Some(400),
            ..MockScript::default()
        };
        let d = Deployment::start(&pki, script, "").await;
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        let (ephemeral, _) = d.post("/v1/chat/completions", &body, &[]).await;
        assert_ne!(ephemeral, 200);
        let (status, _) = d
            .post("/v1/chat/completions", &body, &[("idempotency-key", "k-1")])
            .await;
        assert_eq!(
            status, ephemeral,
            "the same error as without a key, before commit"
        );
        assert_eq!(d.mock.requests(), 2);
        // The retry runs afresh rather than replaying the failure.
        let (status, _) = d
            .post("/v1/chat/completions", &body, &[("idempotency-key", "k-1")])
            .await;
        assert_eq!(status, ephemeral);
        assert_eq!(d.mock.requests(), 3);
        // A malformed key is refused by name.
        let (status, body) = d
            .post("/v1/chat/completions", &body, &[("idempotency-key", "")])
            .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(json_of(&body)["error"]["param"], "Idempotency-Key");
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn r_park_2_a_durable_stream_goes_on_when_its_node_connection_is_lost_and_comes_back() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let script = MockScript {
            tokens: 60,
            tokens_per_second: 100.0,
            ..MockScript::default()
        };
        let d = Deployment::start(&pki, script, "").await;
        let mut r = reqwest::Client::new()
            .post(d.url("/v1/responses"))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(json!({"model": "m", "input": "x", "stream": true}).to_string())
            .send()
            .await
            .unwrap();
        let mut body = String::new();
        while !body.contains("tok5") {
            let chunk = r.chunk().await.unwrap().expect("stream open");
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        // The node's connection goes away mid-answer (no goodbye for its
        // runs); the node reconnects, reports the run parked, and the
        // Edge adopts it (R-PARK-1, R-PARK-2).
        let (generation, link) = d.edge.hub.link("node-1".into()).await.unwrap().unwrap();
        RunningEdge::close(&link.conn, iop_wire::CloseCode::ProtocolError);
        while let Some(chunk) = r.chunk().await.unwrap() {
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        let events = sse(&body);
        let ids: Vec<u64> = events.iter().map(|e| e.0.expect("numbered")).collect();
        assert_eq!(ids, (0..events.len() as u64).collect::<Vec<_>>());
        assert!(
            !events
                .iter()
                .any(|(_, name, _)| name == "error" || name == "response.failed"),
            "no error: {body}"
        );
        assert_eq!(events.last().unwrap().1, "response.completed");
        let text: String = events
            .iter()
            .filter_map(|(_, _, data)| data["delta"].as_str())
            .collect();
        let expected: String = (0..60).map(iop_node::mock::token_text).collect();
        assert_eq!(text, expected, "no lost or repeated text");
        assert_eq!(d.mock.requests(), 1, "the provider was called once");
        let (now, _) = d.edge.hub.link("node-1".into()).await.unwrap().unwrap();
        assert!(now > generation, "it went on over a new connection");
        let snap = wait_for(&d.edge, "idle", |s| s.leases_in_use == 0).await;
        assert!(snap.providers.iter().all(|p| p.in_use == 0), "{snap:?}");
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn r_park_2_a_node_back_without_the_run_ends_its_wait_before_the_grace() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let script = MockScript {
            tokens: 600,
            tokens_per_second: 100.0,
            ..MockScript::default()
        };
        // A grace far longer than the answer below takes.
        let grace = std::time::Duration::from_secs(45);
        let journal = format!("[journal]\npark_grace_ms = {}\n", grace.as_millis());
        let d = Deployment::start(&pki, script, &journal).await;
        let mut r = reqwest::Client::new()
            .post(d.url("/v1/chat/completions"))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .header("idempotency-key", "node-back-without-it")
            .body(
                json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "x"}]})
                    .to_string(),
            )
            .send()
            .await
            .unwrap();
        let mut body = String::new();
        while !body.contains("tok5") {
            let chunk = r.chunk().await.unwrap().expect("stream open");
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        // The node dies with its runs (no goodbye) and comes back under
        // its id: its registration names no run, so the Edge's request
        // stops waiting for its run at once (R-PARK-2), not after the
        // grace, and ends in the stream (the route does not continue).
        let Deployment { edge, node, mock } = d;
        let (old, _) = edge.hub.link("node-1".into()).await.unwrap().unwrap();
        node.abort();
        let lost = tokio::time::Instant::now();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                mock.base_url()
            ),
        );
        while let Some(chunk) = r.chunk().await.unwrap() {
            body.push_str(&String::from_utf8_lossy(&chunk));
        }
        let waited = lost.elapsed();
        assert!(
            waited < grace / 3,
            "the wait ended {waited:?} after the node came back, not at the grace"
        );
        let (now, _) = edge.hub.link("node-1".into()).await.unwrap().unwrap();
        assert!(now > old, "the node registered again");
        let events = sse(&body);
        let last = &events.last().expect("events").2;
        assert_eq!(last["error"]["code"], "transport_closed", "{body}");
        assert_eq!(mock.requests(), 1, "the prompt was not sent again");
        let snap = wait_for(&edge, "idle", |s| s.leases_in_use == 0).await;
        assert!(snap.providers.iter().all(|p| p.in_use == 0), "{snap:?}");
        Deployment { edge, node, mock }.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn r_idem_1_every_run_endpoint_honours_an_idempotency_key() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let d = Deployment::start(&pki, MockScript::default(), "").await;
        // (`/v1/completions` goes through the same pipeline; the HTTP mock
        // has no completions route.)
        let cases = [
            ("/v1/embeddings", json!({"model": "m", "input": ["a", "b"]})),
            (
                "/api/chat",
                json!({"model": "m", "messages": [{"role": "user", "content": "once"}]}),
            ),
            (
                "/api/generate",
                json!({"model": "m", "prompt": "once", "stream": false}),
            ),
            ("/api/embed", json!({"model": "m", "input": "a"})),
            (
                "/v1/responses",
                json!({"model": "m", "input": "once", "store": false}),
            ),
        ];
        for (i, (path, body)) in cases.iter().enumerate() {
            let key = format!("every-endpoint-{i}");
            let before = d.mock.requests();
            let (status, first) = d.post(path, body, &[("idempotency-key", &key)]).await;
            assert_eq!(status, 200, "{path}: {first}");
            let (status, again) = d.post(path, body, &[("idempotency-key", &key)]).await;
            assert_eq!(status, 200, "{path}: {again}");
            // (The HTTP mock counts chat, generate and responses calls.)
            if !path.contains("embed") {
                assert_eq!(d.mock.requests(), before + 1, "{path}: one provider call");
            }
            // The same answer: the same ids and text (Ollama's durations
            // aside, which count from the replay).
            let strip = |s: &str| -> String {
                s.lines()
                    .map(
                        |l| match serde_json::from_str::<Value>(l.trim_start_matches("data: ")) {
                            Ok(mut v) => {
                                for f in [
                                    "total_duration",
                                    "load_duration",
                                    "prompt_eval_duration",
                                    "eval_duration",
                                    "created_at",
                                ] {
                                    v.as_object_mut().map(|o| o.remove(f));
                                }
                                v.to_string()
                            }
                            Err(_) => l.to_owned(),
                        },
                    )
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            assert_eq!(strip(&first), strip(&again), "{path}: the same response");
        }
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn malformed_ids_and_metadata_fail_only_their_request_r_lim_5() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let d = Deployment::start(&pki, MockScript::default(), "").await;
        let (status, body) = d
            .post("/v1/responses", &json!({"model": "m", "input": "x"}), &[])
            .await;
        assert_eq!(status, 200, "{body}");
        let stored = json_of(&body)["id"].as_str().unwrap().to_owned();
        let long = format!("resp_{}", "a".repeat(4_100));
        let client = reqwest::Client::new();
        for id in [
            long.as_str(),
            "resp_*",
            "resp_a.b.>",
            "resp_0123456789ABCDEF",
        ] {
            for path in [
                format!("/v1/responses/{id}"),
                format!("/v1/responses/{id}/input_items"),
                format!("/v1/chat/completions/{id}"),
            ] {
                let (status, body) = d.get(&path, KEY, &[]).await;
                assert_eq!(status, 404, "{path}: {body}");
                assert_eq!(json_of(&body)["error"]["code"], "not_found");
            }
            let deleted = client
                .delete(d.url(&format!("/v1/responses/{id}")))
                .bearer_auth(KEY)
                .send()
                .await
                .unwrap();
            assert_eq!(deleted.status(), 404);
            let cancelled = client
                .post(d.url(&format!("/v1/responses/{id}/cancel")))
                .bearer_auth(KEY)
                .send()
                .await
                .unwrap();
            assert_eq!(cancelled.status(), 404);
            let (status, body) = d
                .post(
                    "/v1/responses",
                    &json!({"model": "m", "input": "x", "previous_response_id": id}),
                    &[],
                )
                .await;
            assert_eq!(status, 400, "{body}");
        }
        // Metadata past its bounds is refused by name; within them it is
        // echoed.
        let seventeen: serde_json::Map<String, Value> =
            (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        for metadata in [
            Value::Object(seventeen),
            json!({ "k".repeat(65): "v" }),
            json!({ "k": "v".repeat(513) }),
            json!({ "k": 1 }),
        ] {
            for (path, body) in [
                (
                    "/v1/responses",
                    json!({"model": "m", "input": "x", "metadata": metadata}),
                ),
                (
                    "/v1/chat/completions",
                    json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "metadata": metadata}),
                ),
            ] {
                let (status, answer) = d.post(path, &body, &[]).await;
                assert_eq!(status, 400, "{path} {metadata}: {answer}");
                assert_eq!(json_of(&answer)["error"]["param"], "metadata");
            }
        }
        let (status, body) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "x", "metadata": {"k": "v".repeat(512)}}),
                &[],
            )
            .await;
        assert_eq!(status, 200, "{body}");
        // The store and the stored response are as they were.
        let (status, body) = d.get(&format!("/v1/responses/{stored}"), KEY, &[]).await;
        assert_eq!(status, 200, "{body}");
        d.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_background_response_admission_refuses_is_answered_429_not_200() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        // Model `offline` is served only by a node that never connects:
        // each background response to it waits in the queue (64 places).
        let offline = "[[providers]]\nid = \"off\"\nnode = \"node-x\"\nadapter = \"openai\"\ntarget = \"t\"\nmodels = [\"offline\"]\n";
        let d = Deployment::start(&pki, MockScript::default(), offline).await;
        let body = json!({"model": "offline", "input": "x", "background": true});
        for i in 0..64 {
            let (status, answer) = d.post("/v1/responses", &body, &[]).await;
            assert_eq!(status, 200, "{i}: {answer}");
            assert_eq!(json_of(&answer)["status"], "queued");
        }
        let r = reqwest::Client::new()
            .post(d.url("/v1/responses"))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 429);
        assert!(r.headers().contains_key("retry-after"));
        // A foreground request is refused the same way.
        let (status, _) = d
            .post(
                "/v1/responses",
                &json!({"model": "offline", "input": "x"}),
                &[],
            )
            .await;
        assert_eq!(status, 429);
        d.shutdown().await;
    })
    .await;
}

/// An admin key of principal `ops` (it reads `/status`), for
/// [`Deployment::start`]'s `journal` lines; its secret is written to `ops`.
const OPS_KEY: &str = "sk-durable-ops-0123456789";
const OPS_KEY_TOML: &str = "[[api_keys]]\nprincipal = \"ops\"\nkey_file = \"ops\"\nadmin = true\n";

impl Deployment {
    /// The journal's bytes held, as `/status` shows them.
    async fn journal_bytes(&self) -> u64 {
        let (status, body) = self.get("/status", OPS_KEY, &[]).await;
        assert_eq!(status, 200, "{body}");
        json_of(&body)["journal"]["bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("{body}"))
    }
}

/// R-LIM-6: a conversation continued with `previous_response_id` is stored
/// link by link, each message once (a link keeps its own input and the id
/// it continues): 200 links hold journal bytes linear in their number,
/// where storing the whole conversation in every link grows with its
/// square; each link still gives the provider the whole conversation. A
/// link removed from the middle leaves the links after it uncontinuable
/// (a 400 that says so) and the ones before it continuable.
#[tokio::test]
async fn a_200_link_conversation_stores_each_message_once_r_lim_6() {
    const LINKS: usize = 200;
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("ops"), OPS_KEY);
        let d = Deployment::start(&pki, MockScript::default(), OPS_KEY_TOML).await;
        let before = d.journal_bytes().await;
        let mut ids: Vec<String> = Vec::new();
        // Journal bytes held after each link.
        let mut held: Vec<u64> = Vec::new();
        // The conversation's characters after each link (inputs and
        // answers).
        let mut chars = 0usize;
        let mut chars_after: Vec<usize> = Vec::new();
        for turn in 0..LINKS {
            let input = format!("turn {turn}");
            let mut body = json!({"model": "m", "input": input});
            if let Some(previous) = ids.last() {
                body["previous_response_id"] = json!(previous);
            }
            let (status, text) = d.post("/v1/responses", &body, &[]).await;
            assert_eq!(status, 200, "link {turn}: {text}");
            let object = json_of(&text);
            chars += input.chars().count();
            // The mock counts a token per 4 characters of the prompt:
            // every earlier input and answer, and this input.
            let prompt = object["usage"]["input_tokens"].as_u64().unwrap();
            assert_eq!(
                prompt,
                chars.div_ceil(4) as u64,
                "link {turn} sent the whole conversation: {object}"
            );
            let answer = object["output"][0]["content"][0]["text"]
                .as_str()
                .unwrap_or_else(|| panic!("{object}"));
            chars += answer.chars().count();
            chars_after.push(chars);
            ids.push(object["id"].as_str().unwrap().to_owned());
            held.push(d.journal_bytes().await - before);
        }
        // Linear: the second hundred links hold no more than the first
        // hundred (+10 % for longer turn numbers); whole histories would
        // hold about three times as much.
        let (first, total) = (held[LINKS / 2 - 1], held[LINKS - 1]);
        let second = total - first;
        eprintln!(
            "{LINKS} links: {total} journal bytes ({} per link); first 100 {first}, next 100 \
             {second}; the conversation is {chars} characters",
            total / LINKS as u64
        );
        assert!(
            second * 10 <= first * 11,
            "linear in the links: first half {first} B, second half {second} B"
        );
        // A whole history per link would store each of the n(n-1)/2
        // earlier messages again: far more than what is held.
        let quadratic = (LINKS * (LINKS - 1) / 2) as u64 * (chars / (2 * LINKS)) as u64;
        assert!(
            total < quadratic,
            "{total} B held, a whole history per link would add {quadratic} B"
        );
        // Removing link 100 leaves the links after it uncontinuable and
        // the ones before it continuable.
        let r = reqwest::Client::new()
            .delete(d.url(&format!("/v1/responses/{}", ids[100])))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let (status, text) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "more", "previous_response_id": ids[LINKS - 1]}),
                &[],
            )
            .await;
        assert_eq!(status, 400, "{text}");
        let error = &json_of(&text)["error"];
        assert_eq!(error["code"], "previous_response_unavailable", "{text}");
        assert_eq!(error["param"], "previous_response_id");
        let (status, text) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "more", "previous_response_id": ids[99]}),
                &[],
            )
            .await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(
            json_of(&text)["usage"]["input_tokens"].as_u64().unwrap(),
            (chars_after[99] + "more".len()).div_ceil(4) as u64,
            "the first hundred links and the new input"
        );
        d.shutdown().await;
    })
    .await;
}

/// A message of a stored history.
fn message(role: iop_wire::Role, content: &str) -> iop_wire::ChatMessage {
    iop_wire::ChatMessage {
        role,
        content: content.to_owned(),
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
        images: Vec::new(),
        cache_control: None,
        documents: Vec::new(),
    }
}

/// R-LIM-6: a response an older build stored with the whole conversation
/// before it (its `history`, in every link) is still continued: its
/// conversation is that history, its own input and its answer. The link
/// that continues it is stored as a link, and continuing that walks back
/// to the older record.
#[tokio::test]
async fn a_response_an_older_build_stored_with_its_history_is_still_continued_r_lim_6() {
    use iop_core::edge::request::Delivery;
    use iop_core::journal::{JournalApi, JournalEvent, NewRecord, RecordStatus, Terminal};
    use iop_store::JournalStore as _;
    use iop_wire::Role;
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let id = "resp_00000000000000a1";
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        {
            // The Edge's journal file as an older build left it.
            let store = iop_store::EmbeddedStore::open(
                &pki.path().join("edge-state").join("journal.redb"),
                iop_core::journal::JournalLimits::default(),
            )
            .unwrap();
            let stored = iop_edge::durable::StoredRequest {
                id_seed: 0xa1,
                created_unix_ms: now,
                store: true,
                background: false,
                body: json!({"model": "m", "input": "second question"})
                    .to_string()
                    .into_bytes(),
                history: Some(vec![
                    message(Role::User, "first question"),
                    message(Role::Assistant, "first answer"),
                ]),
                previous: None,
                history_unreadable: false,
            };
            let created = store
                .create(NewRecord {
                    id: id.into(),
                    principal: "tester".into(),
                    api: JournalApi::Responses,
                    model: "m".into(),
                    fingerprint: iop_core::journal::fingerprint("responses", b"{}"),
                    idempotency_key: None,
                    background: false,
                    request: stored.encode(),
                    created_unix_ms: now,
                    owner: String::new(),
                    key_id: String::new(),
                })
                .await
                .unwrap();
            let iop_store::CreateOutcome::Create(meta) = created else {
                panic!("{created:?}");
            };
            let event = Delivery::Event(iop_wire::RunEventKind::TextDelta("second answer".into()));
            store
                .append(
                    id.into(),
                    meta.epoch,
                    vec![JournalEvent {
                        seq: 1,
                        payload: iop_core::edge::durable::encode_delivery(&event),
                    }],
                )
                .await
                .unwrap();
            store
                .finish(
                    id.into(),
                    meta.epoch,
                    Terminal {
                        status: RecordStatus::Completed,
                        reason: None,
                        message: None,
                        at_unix_ms: now,
                    },
                )
                .await
                .unwrap();
        }
        let d = Deployment::start(&pki, MockScript::default(), "").await;
        let (status, text) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "third", "previous_response_id": id}),
                &[],
            )
            .await;
        assert_eq!(status, 200, "{text}");
        let third = json_of(&text);
        // The mock counts a token per 4 characters of the prompt.
        let chars = [
            "first question",
            "first answer",
            "second question",
            "second answer",
        ]
        .iter()
        .map(|s| s.len())
        .sum::<usize>()
            + "third".len();
        assert_eq!(
            third["usage"]["input_tokens"].as_u64().unwrap(),
            chars.div_ceil(4) as u64,
            "the older record's history, input and answer, then the new input: {third}"
        );
        let answer = third["output"][0]["content"][0]["text"].as_str().unwrap();
        let (status, text) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "fourth",
                    "previous_response_id": third["id"]}),
                &[],
            )
            .await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(
            json_of(&text)["usage"]["input_tokens"].as_u64().unwrap(),
            (chars + answer.len() + "fourth".len()).div_ceil(4) as u64,
        );
        d.shutdown().await;
    })
    .await;
}

/// R-LIM-6: the object a retrieve builds is charged to the caller's share
/// of request memory (its bound, from the record's size, before it is
/// built; its body's size until the body has been handed to the
/// connection), not only the stored request it reads. 32 concurrent
/// retrieves of one large answer by one key fit its share a few at a time:
/// the rest are refused at once (503 `server_busy`), while another key's
/// retrieves at the same moment are served from its own share; once they
/// are done the key is served again. Without the charge every one of them
/// is served, each holding the whole answer (the stored request they read
/// is small).
#[tokio::test]
async fn retrieves_of_a_large_answer_are_held_to_the_keys_share_r_lim_6() {
    large_answers_are_held_to_the_keys_share(reqwest::Method::GET, "").await;
}

/// R-LIM-6: the object a cancel answers (here of a response that had
/// already ended: its object as it ended) is built within the key's share
/// of request memory as a retrieve's is: many at once of one large answer
/// fill the share and the rest get a fast 503 `server_busy`, while another
/// key's cancel is served. A background response's first object is built
/// by the same read (`held_responses_object` in `stored.rs`).
#[tokio::test]
async fn cancels_of_a_large_answer_are_held_to_the_keys_share_r_lim_6() {
    large_answers_are_held_to_the_keys_share(reqwest::Method::POST, "/cancel").await;
}

/// 32 concurrent `method` requests of one key to
/// `/v1/responses/{id}{suffix}` of one large answer (that had already
/// ended) and one of another key's to its own: some of the first key's are
/// served, the rest refused at once with 503 `server_busy`, the other
/// key's served; afterwards the first key is served again.
async fn large_answers_are_held_to_the_keys_share(method: reqwest::Method, suffix: &'static str) {
    /// The key's share of request memory.
    const SHARE: usize = 4 * 1024 * 1024;
    const READERS: usize = 32;
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let script = MockScript {
            tokens: 100_000,
            ..MockScript::default()
        };
        let d = Deployment::start_with(
            &pki,
            script,
            &format!("max_body_bytes = 65536\nrequest_memory_bytes_per_key = {SHARE}\n"),
            "",
        )
        .await;
        let client = reqwest::Client::new();
        let mut ids = Vec::new();
        for key in [KEY, OTHER_KEY] {
            let r = client
                .post(d.url("/v1/responses"))
                .bearer_auth(key)
                .json(&json!({"model": "m", "input": "long"}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let object = json_of(&r.text().await.unwrap());
            ids.push(object["id"].as_str().unwrap().to_owned());
        }
        let read = |key: &'static str, id: String, start: Arc<tokio::sync::Barrier>| {
            let (client, url) = (
                client.clone(),
                d.url(&format!("/v1/responses/{id}{suffix}")),
            );
            let method = method.clone();
            tokio::spawn(async move {
                start.wait().await;
                let r = client
                    .request(method, url)
                    .bearer_auth(key)
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                (status, r.text().await.unwrap())
            })
        };
        let start = Arc::new(tokio::sync::Barrier::new(READERS + 2));
        let mine: Vec<_> = (0..READERS)
            .map(|_| read(KEY, ids[0].clone(), start.clone()))
            .collect();
        let other = read(OTHER_KEY, ids[1].clone(), start.clone());
        start.wait().await;
        let (mut served, mut refused) = (0, 0);
        for task in mine {
            let (status, body) = task.await.unwrap();
            match status {
                200 => {
                    assert_eq!(json_of(&body)["status"], "completed", "it had ended");
                    assert!(body.len() > SHARE / 8, "the whole answer: {} B", body.len());
                    served += 1;
                }
                503 => {
                    assert_eq!(json_of(&body)["error"]["code"], "server_busy", "{body}");
                    refused += 1;
                }
                other => panic!("{other}: {body}"),
            }
        }
        eprintln!(
            "{READERS} concurrent {method} {suffix} of one key: {served} served, {refused} refused"
        );
        assert!(served >= 1, "the share holds one answer at least");
        assert!(refused >= 1, "the rest do not fit the key's share");
        // Another key's share is its own.
        let (status, body) = other.await.unwrap();
        assert_eq!(status, 200, "another key is served: {body}");
        // Done, their share is back.
        let (status, body) = d.get(&format!("/v1/responses/{}", ids[0]), KEY, &[]).await;
        assert_eq!(status, 200, "{body}");
        d.shutdown().await;
    })
    .await;
}

/// R-LIM-6: one key continuing a long conversation many times at once
/// (each continuation reads its 100 links from the store one after
/// another) holds at most its share of the readers in flight, on a real
/// `nats-server` (every read a request on the Edge's one connection):
/// past its bound it is answered 503 `server_busy` with `Retry-After` at
/// once, and another principal's retrieves and new requests meanwhile are
/// all served, promptly.
#[tokio::test]
async fn one_key_continuing_long_chains_leaves_the_store_to_others_on_nats_r_lim_6() {
    const LINKS: usize = 100;
    const CONTINUATIONS: usize = 64;
    /// The attacker's bound on readers in flight (its principal's).
    const PER_PRINCIPAL: usize = 4;
    let Some(server) = nats::NatsServer::start() else {
        return;
    };
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let journal = format!(
            "[journal]\nstore = \"nats\"\nreads_in_flight = 64\n\
             reads_in_flight_per_principal = {PER_PRINCIPAL}\n\
             [journal.nats]\nservers = [\"{}\"]\nconnect_timeout_ms = 5000\n\
             request_timeout_ms = 5000\n",
            server.url()
        );
        let d =
            Deployment::start_with(&pki, MockScript::default(), "edge_id = \"e1\"\n", &journal)
                .await;
        // The attacker's conversation of LINKS links.
        let mut last: Option<String> = None;
        for turn in 0..LINKS {
            let mut body = json!({"model": "m", "input": format!("turn {turn}")});
            if let Some(previous) = &last {
                body["previous_response_id"] = json!(previous);
            }
            let (status, text) = d.post("/v1/responses", &body, &[]).await;
            assert_eq!(status, 200, "link {turn}: {text}");
            last = Some(json_of(&text)["id"].as_str().unwrap().to_owned());
        }
        let last = last.unwrap();
        // The other principal's stored response.
        let client = reqwest::Client::new();
        let r = client
            .post(d.url("/v1/responses"))
            .bearer_auth(OTHER_KEY)
            .json(&json!({"model": "m", "input": "mine"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let theirs = json_of(&r.text().await.unwrap())["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let start = Arc::new(tokio::sync::Barrier::new(CONTINUATIONS + 1));
        let attack: Vec<_> = (0..CONTINUATIONS)
            .map(|i| {
                let (client, url, start) = (client.clone(), d.url("/v1/responses"), start.clone());
                let body = json!({
                    "model": "m", "input": format!("again {i}"), "store": false,
                    "previous_response_id": last,
                });
                tokio::spawn(async move {
                    start.wait().await;
                    let r = client.post(url).bearer_auth(KEY).json(&body).send().await.unwrap();
                    let status = r.status().as_u16();
                    let retry_after = r.headers().get("retry-after").cloned();
                    let text = r.text().await.unwrap();
                    (status, retry_after, text)
                })
            })
            .collect();
        start.wait().await;
        // Meanwhile the other principal retrieves its response and sends
        // new requests, one after another.
        let (mut served, mut slowest) = (0usize, std::time::Duration::ZERO);
        let attacked = tokio::time::Instant::now();
        for i in 0..20 {
            let began = tokio::time::Instant::now();
            let (status, body) = if i % 2 == 0 {
                d.get(&format!("/v1/responses/{theirs}"), OTHER_KEY, &[]).await
            } else {
                let r = client
                    .post(d.url("/v1/responses"))
                    .bearer_auth(OTHER_KEY)
                    .json(&json!({"model": "m", "input": "more", "previous_response_id": theirs}))
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                (status, r.text().await.unwrap())
            };
            assert_eq!(status, 200, "the other principal is served: {body}");
            served += 1;
            slowest = slowest.max(began.elapsed());
        }
        let theirs_took = attacked.elapsed();
        let (mut continued, mut refused) = (0usize, 0usize);
        for task in attack {
            let (status, retry_after, text) = task.await.unwrap();
            match status {
                200 => continued += 1,
                503 => {
                    assert_eq!(json_of(&text)["error"]["code"], "server_busy", "{text}");
                    assert_eq!(retry_after.as_ref().map(|v| v.to_str().unwrap()), Some("1"));
                    refused += 1;
                }
                other => panic!("{other}: {text}"),
            }
        }
        eprintln!(
            "{CONTINUATIONS} continuations of a {LINKS}-link conversation at once: {continued} \
             continued, {refused} refused; the other principal: {served} served in {theirs_took:?}, \
             slowest {slowest:?}; the attack took {:?}",
            attacked.elapsed()
        );
        assert!(continued >= 1, "the key's share reads");
        assert!(
            refused >= 1,
            "past {PER_PRINCIPAL} readers in flight the key is refused"
        );
        // R-LIM-6, R-OBS-1: each refusal is counted by its bound, with no
        // key or principal in the labels.
        let metrics = d.edge.metrics.render();
        let counted =
            iop_edge::metrics::scrape_value(&metrics, "iop_edge_store_reads_refused_total", &[]);
        assert_eq!(counted as usize, refused, "{metrics}");
        let by_bound: f64 = ["key", "principal"]
            .iter()
            .map(|bound| {
                iop_edge::metrics::scrape_value(
                    &metrics,
                    "iop_edge_store_reads_refused_total",
                    &[("bound", bound)],
                )
            })
            .sum();
        assert_eq!(by_bound as usize, refused, "the key's or its principal's bound");
        assert!(!metrics.contains("tester"), "no principal in the metrics");
        assert!(
            slowest < std::time::Duration::from_secs(5),
            "the other principal is served promptly: slowest {slowest:?}"
        );
        d.shutdown().await;
    })
    .await;
}
