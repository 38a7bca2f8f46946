//! The mock's script, overrides, HTTP endpoints and CLI flags.

use std::time::Duration;

use clap::Parser;
use futures::StreamExt;
use iop_wire::{FinishReason, Usage};
use serde_json::{Value, json};

use super::*;
use crate::adapter::tests::http_client;

const BOUND: Duration = Duration::from_secs(10);

#[test]
fn model_name_overrides_follow_the_documented_syntax() {
    let d = MockScript::default();
    assert_eq!(d.for_model("mock").unwrap(), d);
    assert_eq!(d.for_model("llama3:8b").unwrap(), d);
    let s = d
        .for_model("mock:stall_after=3,prefill_ms=200,tokens=5,tps=50,error=503,malformed_after=2,close_after=2,tool_call=1,hang_headers=1")
        .unwrap();
    assert_eq!(s.stall_after, Some(3));
    assert_eq!(s.prefill_ms, 200);
    assert_eq!(s.tokens, 5);
    assert_eq!(s.tokens_per_second, 50.0);
    assert_eq!(s.http_error, Some(503));
    assert_eq!(s.malformed_after, Some(2));
    assert_eq!(s.abrupt_close_after, Some(2));
    assert!(s.tool_call && s.hang_before_headers);
    // Untouched fields keep the defaults.
    assert_eq!(s.health, d.health);
}

#[test]
fn bad_overrides_are_refused() {
    let d = MockScript::default();
    assert_eq!(
        d.for_model("mock:colour=blue"),
        Err(ScriptError::UnknownKey("colour".into()))
    );
    assert!(matches!(
        d.for_model("mock:tokens"),
        Err(ScriptError::NotKeyValue(_))
    ));
    assert_eq!(
        d.for_model("mock:tokens=-1"),
        Err(ScriptError::BadValue("tokens"))
    );
    assert_eq!(
        d.for_model(&format!("mock:tokens={}", crate::mock::MAX_MOCK_TOKENS + 1)),
        Err(ScriptError::BadValue("tokens"))
    );
    assert_eq!(
        d.for_model("mock:error=200"),
        Err(ScriptError::BadValue("error"))
    );
    assert_eq!(
        d.for_model("mock:tps=inf"),
        Err(ScriptError::BadValue("tps"))
    );
    assert_eq!(
        d.for_model("mock:tool_call=maybe"),
        Err(ScriptError::BadValue("tool_call"))
    );
    let long = format!("mock:{}=1", "k".repeat(500));
    match d.for_model(&long) {
        Err(ScriptError::UnknownKey(k)) => assert!(k.len() <= 32),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_script_debug_output_redacts_the_key() {
    let s = MockScript {
        require_key: Some("sk-hidden".into()),
        ..MockScript::default()
    };
    assert!(!format!("{s:?}").contains("sk-hidden"));
}

#[tokio::test(start_paused = true)]
async fn the_script_plays_deterministic_tokens_and_usage() {
    let script = MockScript {
        tokens: 3,
        prefill_ms: 100,
        tokens_per_second: 10.0,
        ..MockScript::default()
    };
    let prompt = MockPrompt {
        prompt_chars: 9,
        ..MockPrompt::default()
    };
    let start = tokio::time::Instant::now();
    let steps: Vec<_> = play(&script, prompt).collect().await;
    // Prefill, then two gaps of 1/tps between three tokens.
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_millis(300) && elapsed < Duration::from_millis(310),
        "{elapsed:?}"
    );
    assert_eq!(
        steps,
        vec![
            MockStep::Text("tok0".into()),
            MockStep::Text(" tok1".into()),
            MockStep::Text(" tok2".into()),
            MockStep::Finish {
                finish_reason: FinishReason::Stop,
                usage: Usage::tokens(3, 3),
            },
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_stall_really_hangs_after_its_tokens() {
    let script = MockScript::default()
        .for_model("mock:stall_after=2")
        .unwrap();
    let mut steps = play(&script, MockPrompt::default());
    let mut got = Vec::new();
    // Virtual time: an hour passes instantly unless something is produced.
    while let Ok(Some(step)) = tokio::time::timeout(Duration::from_secs(3600), steps.next()).await {
        got.push(step);
    }
    assert_eq!(
        got,
        vec![
            MockStep::Text("tok0".into()),
            MockStep::Text(" tok1".into())
        ]
    );
}

#[tokio::test]
async fn faults_appear_at_their_token() {
    let script = MockScript::default()
        .for_model("mock:tokens=3,malformed_after=1,close_after=2")
        .unwrap();
    let steps: Vec<_> = play(&script, MockPrompt::default()).collect().await;
    assert_eq!(
        steps,
        vec![
            MockStep::Text("tok0".into()),
            MockStep::Malformed,
            MockStep::Text(" tok1".into()),
            MockStep::AbruptClose,
        ]
    );
}

async fn post(server: &MockServer, path: &str, body: Value) -> (u16, String) {
    let resp = tokio::time::timeout(
        BOUND,
        http_client()
            .post(format!("{}{path}", server.base_url()))
            .body(body.to_string())
            .send(),
    )
    .await
    .unwrap()
    .unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

#[tokio::test]
async fn chat_completions_without_stream_answers_one_json_with_usage() {
    let server = MockServer::start(MockScript::default()).await.unwrap();
    let (status, body) = post(
        &server,
        "/v1/chat/completions",
        json!({"model": "mock:tokens=2", "messages": [{"role": "user", "content": "abcd"}]}),
    )
    .await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens"], 1);
    assert_eq!(v["usage"]["completion_tokens"], 2);

    let (_, body) = post(
        &server,
        "/v1/chat/completions",
        json!({"model": "mock:tool_call=1,tokens=1", "messages": [],
               "tools": [{"type": "function", "function": {"name": "f"}}]}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "f");
    assert_eq!(call["function"]["arguments"], r#"{"text":"tok0"}"#);
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn a_script_reports_prompt_cache_counts_in_each_apis_shape() {
    let server = MockServer::start(MockScript::default()).await.unwrap();
    // 20 prompt characters: 5 prompt tokens, 2 read from the cache and 1
    // written to it.
    let prompt = json!([{"role": "user", "content": "abcdefghijklmnopqrst"}]);
    let (_, body) = post(
        &server,
        "/v1/chat/completions",
        json!({"model": "mock:tokens=1,cache_read=2,cache_write=1", "messages": prompt}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
               "prompt_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 1}})
    );
    let (_, body) = post(
        &server,
        "/v1/messages",
        json!({"model": "mock:tokens=1,cache_read=2,cache_write=1", "max_tokens": 8, "messages": prompt}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["usage"],
        json!({"input_tokens": 2, "output_tokens": 1,
               "cache_creation_input_tokens": 1, "cache_read_input_tokens": 2})
    );
    // Streamed: message_start has the prompt's counts already.
    let (_, body) = post(
        &server,
        "/v1/messages",
        json!({"model": "mock:tokens=1,cache_read=2", "max_tokens": 8, "stream": true, "messages": prompt}),
    )
    .await;
    let start = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .find(|v| v["type"] == "message_start")
        .unwrap();
    assert_eq!(
        start["message"]["usage"],
        json!({"input_tokens": 3, "output_tokens": 1,
               "cache_creation_input_tokens": 0, "cache_read_input_tokens": 2})
    );
    // At most the whole prompt; none scripted, none in OpenAI's shape.
    let (_, body) = post(
        &server,
        "/v1/chat/completions",
        json!({"model": "mock:tokens=1,cache_read=99,cache_write=9", "messages": prompt}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens_details"],
        json!({"cached_tokens": 5, "cache_write_tokens": 0})
    );
    let (_, body) = post(
        &server,
        "/v1/chat/completions",
        json!({"model": "mock:tokens=1", "messages": prompt}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["usage"].get("prompt_tokens_details").is_none(), "{v}");
}

#[tokio::test]
async fn chat_completions_stream_omits_usage_unless_asked() {
    let server = MockServer::start(MockScript::default()).await.unwrap();
    let (_, body) = post(
        &server,
        "/v1/chat/completions",
        json!({"model": "mock:tokens=1", "stream": true, "messages": []}),
    )
    .await;
    assert!(!body.contains("\"usage\""));
    assert!(body.ends_with("data: [DONE]\n\n"));
}

fn sse_event_names(body: &str) -> Vec<&str> {
    body.lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect()
}

#[tokio::test]
async fn responses_stream_created_deltas_completed() {
    let server = MockServer::start(MockScript::default()).await.unwrap();
    let (status, body) = post(
        &server,
        "/v1/responses",
        json!({"model": "mock:tokens=2", "input": "hello", "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        sse_event_names(&body),
        vec![
            "response.created",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.completed"
        ]
    );
    let completed = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .next_back()
        .unwrap();
    let v: Value = serde_json::from_str(completed).unwrap();
    assert_eq!(v["response"]["status"], "completed");
    assert_eq!(
        v["response"]["output"][0]["content"][0]["text"],
        "tok0 tok1"
    );
    assert_eq!(v["response"]["usage"]["input_tokens"], 2);
    assert_eq!(v["response"]["usage"]["output_tokens"], 2);

    let (_, body) = post(
        &server,
        "/v1/responses",
        json!({"model": "mock:tokens=1", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "response");
    assert_eq!(v["output"][0]["content"][0]["text"], "tok0");
    assert_eq!(v["usage"]["input_tokens"], 1);
    assert_eq!(server.requests(), 2);
}

#[tokio::test]
async fn ollama_endpoints_answer_ndjson_and_single_json() {
    let server = MockServer::start(MockScript::default()).await.unwrap();
    let (_, body) = post(
        &server,
        "/api/generate",
        json!({"model": "mock:tokens=2", "prompt": "abcd"}),
    )
    .await;
    let lines: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["response"], "tok0");
    assert_eq!(lines[2]["done"], true);
    assert_eq!(lines[2]["eval_count"], 2);

    let (_, body) = post(
        &server,
        "/api/chat",
        json!({"model": "mock:tokens=2", "stream": false, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["message"]["content"], "tok0 tok1");
    assert_eq!(v["done"], true);
    assert_eq!(v["done_reason"], "stop");
}

#[tokio::test]
async fn scripted_errors_use_each_api_error_format() {
    let server = MockServer::start(MockScript::default()).await.unwrap();
    let (status, body) = post(
        &server,
        "/v1/chat/completions",
        json!({"model": "mock:error=429", "messages": []}),
    )
    .await;
    assert_eq!(status, 429);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"]["message"].is_string());
    let (status, body) = post(&server, "/api/chat", json!({"model": "mock:error=500"})).await;
    assert_eq!(status, 500);
    assert!(serde_json::from_str::<Value>(&body).unwrap()["error"].is_string());
    let (status, _) = post(&server, "/api/chat", json!({"model": "mock:nope=1"})).await;
    assert_eq!(status, 400);
    assert_eq!(server.requests(), 3);
    assert_eq!(server.in_flight(), 0);
}

#[tokio::test]
async fn a_header_hang_lasts_until_the_client_gives_up() {
    let server = MockServer::start(MockScript {
        hang_before_headers: true,
        ..MockScript::default()
    })
    .await
    .unwrap();
    let client = http_client();
    let url = format!("{}/api/chat", server.base_url());
    let call = client.post(url).body(r#"{"model":"mock"}"#).send();
    // The client's own bound is what ends it.
    assert!(
        tokio::time::timeout(Duration::from_millis(200), call)
            .await
            .is_err()
    );
    let stats = tokio::time::timeout(BOUND, server.wait_for(|s| s.in_flight == 0))
        .await
        .unwrap();
    assert_eq!((stats.requests, stats.disconnects), (1, 1));
}

#[tokio::test]
async fn stats_reset_over_http() {
    let server = MockServer::start(MockScript::default()).await.unwrap();
    post(&server, "/api/generate", json!({"model": "mock"})).await;
    let (status, _) = post(&server, "/mock/reset", json!({})).await;
    assert_eq!(status, 204);
    assert_eq!(server.stats(), MockStats::default());
}

#[tokio::test]
async fn serve_refuses_an_out_of_range_script() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let bad = MockScript {
        tokens_per_second: -1.0,
        ..MockScript::default()
    };
    assert!(matches!(
        serve(listener, bad).await,
        Err(MockServerError::Script(ScriptError::BadValue("tps")))
    ));
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    mock: MockArgs,
}

#[test]
fn cli_flags_build_the_default_script() {
    let cli = Cli::try_parse_from([
        "mock-provider",
        "--listen",
        "127.0.0.1:0",
        "--tps",
        "25",
        "--prefill-ms",
        "150",
        "--tokens",
        "4",
        "--stall-after",
        "2",
        "--hang-before-headers",
        "--http-error",
        "502",
        "--malformed-after",
        "1",
        "--close-after",
        "3",
        "--tool-call",
        "--require-key",
        "sk-cli",
        "--health",
        "unhealthy",
    ])
    .unwrap();
    let s = cli.mock.script();
    assert_eq!(
        s,
        MockScript {
            tokens_per_second: 25.0,
            prefill_ms: 150,
            tokens: 4,
            stall_after: Some(2),
            resume_after_ms: None,
            hang_before_headers: true,
            http_error: Some(502),
            malformed_after: Some(1),
            abrupt_close_after: Some(3),
            tool_call: true,
            stream_usage: true,
            cache_read_tokens: None,
            cache_write_tokens: None,
            health: ProbeHealth::Unhealthy,
            require_key: Some("sk-cli".into()),
        }
    );
    assert!(!format!("{:?}", cli.mock).contains("sk-cli"));
    assert!(Cli::try_parse_from(["m", "--http-error", "200"]).is_err());
    // TCP_NODELAY unless `--nagle`.
    assert_eq!(
        cli.mock.serve_options(),
        ServeOptions {
            nodelay: true,
            apis: MockApis::All
        }
    );
    assert_eq!(
        ServeOptions::default(),
        ServeOptions {
            nodelay: true,
            apis: MockApis::All
        }
    );
    let nagle = Cli::try_parse_from(["m", "--nagle"]).unwrap();
    assert_eq!(
        nagle.mock.serve_options(),
        ServeOptions {
            nodelay: false,
            apis: MockApis::All
        }
    );
}

#[tokio::test]
async fn a_mock_with_nagle_on_answers_like_the_default() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = serve_with(
        listener,
        MockScript::default(),
        ServeOptions {
            nodelay: false,
            apis: MockApis::All,
        },
    )
    .await
    .unwrap();
    let (status, body) = post(
        &server,
        "/v1/chat/completions",
        json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["choices"][0]["finish_reason"], "stop");
    let (status, body) = post(
        &server,
        "/v1/chat/completions",
        json!({"model": "mock", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert_eq!(server.requests(), 2);
}

#[test]
fn a_partial_answer_of_the_scripts_own_tokens_is_continued_r_cont_1() {
    use super::script::continued_tokens;
    assert_eq!(continued_tokens(None), 0);
    assert_eq!(continued_tokens(Some("")), 0);
    assert_eq!(continued_tokens(Some("tok0")), 1);
    assert_eq!(continued_tokens(Some("tok0 tok1 tok2")), 3);
    // Anything else is a new answer.
    assert_eq!(continued_tokens(Some("tok0 tok2")), 0);
    assert_eq!(continued_tokens(Some("hello")), 0);
    assert_eq!(continued_tokens(Some("tok0 to")), 0);
}

#[tokio::test]
async fn a_continued_answer_picks_up_at_its_next_token() {
    let script = MockScript {
        tokens: 5,
        ..MockScript::default()
    };
    let prompt = MockPrompt {
        continue_from: 3,
        ..MockPrompt::default()
    };
    let steps: Vec<_> = play(&script, prompt).collect().await;
    let text: String = steps
        .iter()
        .filter_map(|s| match s {
            MockStep::Text(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, " tok3 tok4");
    assert!(matches!(
        steps.last(),
        Some(MockStep::Finish { usage, .. }) if usage.completion_tokens == 2
    ));
}
