//! Adapters against real HTTP: the mock server on 127.0.0.1:0.

use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use iop_wire::{
    AdapterKind, ChatMessage, FailureCode, FinishReason, GenerationParams, HealthFailureCode,
    OllamaApiCall, ProviderHealth, ProviderTunnelFrame, ProviderTunnelRequest, Role, RunApi,
    RunEventKind, RunRequest, ToolDefinition, Usage,
};

use super::*;
use crate::config::ProviderTarget;
use crate::mock::{MockScript, MockServer, MockStats, ProbeHealth};

/// Every test's bound on one whole stream: far above what the scripts take.
const STREAM_BOUND: Duration = Duration::from_secs(10);

/// The probe bound of these tests (the node default).
const PROBE_BOUND: Duration = Duration::from_secs(5);

/// What core makes of a probe that got no verdict (R-WD-5).
fn no_verdict(answer: iop_core::node::probe::ProbeAnswer) -> ProbeVerdict {
    ProbeVerdict::from_answer(answer)
}

pub(crate) fn run_request(model: &str, api: RunApi, prompt: &str) -> RunRequest {
    RunRequest {
        run_id: 1,
        session_id: "s-1".into(),
        adapter: AdapterKind::OpenAi,
        target: "t".into(),
        model: model.into(),
        api,
        messages: vec![ChatMessage {
            role: Role::User,
            content: prompt.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            images: Vec::new(),
            cache_control: None,
            documents: Vec::new(),
        }],
        tools: Vec::new(),
        params: GenerationParams::default(),
        response_stall_timeout_ms: 0,
        deadline_ms: 0,
        credential_lease: None,
        trace_context: None,
        park: None,
        continue_final: false,
    }
}

fn with_tool(mut req: RunRequest) -> RunRequest {
    req.tools.push(ToolDefinition {
        name: "get_weather".into(),
        description: Some("Weather in a city".into()),
        parameters_json: Some(
            r#"{"type":"object","properties":{"city":{"type":"string"}}}"#.into(),
        ),
        cache_control: None,
    });
    req
}

pub(crate) fn http_client() -> reqwest::Client {
    // reqwest's `rustls-no-provider` needs a process-wide provider; another
    // test may have installed it already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .build()
        .expect("a plain HTTP client builds")
}

/// The Node's own provider client, as a running Node builds it.
pub(crate) fn provider_http() -> super::ProviderHttp {
    let _ = rustls::crypto::ring::default_provider().install_default();
    super::ProviderHttp::new()
}

/// Target `t` of `kind` at `base_url`, with the defaults but `whole_calls`.
fn provider_target(kind: AdapterKind, base_url: &str, whole_calls: bool) -> ProviderTarget {
    ProviderTarget {
        adapter: kind,
        target: "t".into(),
        base_url: Some(base_url.to_owned()),
        models: Vec::new(),
        api_key: None,
        stream_usage: true,
        continuous_usage: false,
        whole_calls,
        json_object_schema: false,
        cache_control: true,
        max_concurrent_runs: None,
    }
}

fn adapter(kind: AdapterKind, base_url: &str, api_key: Option<&str>) -> Adapter {
    let target = ProviderTarget {
        api_key: api_key.map(str::to_owned),
        ..provider_target(kind, base_url, true)
    };
    Adapter::new(&target, provider_http())
}

/// A run whose client takes the answer whole; `durable`: a parked one.
fn whole_request(model: &str, api: RunApi, prompt: &str, durable: bool) -> RunRequest {
    let mut req = run_request(model, api, prompt);
    req.params.whole_answer = true;
    req.park = durable.then(|| iop_wire::ParkSpec {
        response_id: "resp_1".into(),
        grace_ms: 0,
    });
    req
}

async fn mock(script: MockScript) -> MockServer {
    MockServer::start(script).await.expect("mock starts")
}

async fn collect<T>(stream: BoxStream<'static, T>) -> Vec<T> {
    tokio::time::timeout(STREAM_BOUND, stream.collect::<Vec<_>>())
        .await
        .expect("the stream ends by itself")
}

async fn wait_stats(server: &MockServer, cond: impl Fn(&MockStats) -> bool) -> MockStats {
    tokio::time::timeout(STREAM_BOUND, server.wait_for(cond))
        .await
        .expect("the mock reaches the expected counters")
}

fn assert_one_terminal(events: &[RunEventKind]) {
    let terminals = events.iter().filter(|e| e.is_terminal()).count();
    assert_eq!(terminals, 1, "exactly one terminal in {events:?}");
    assert!(
        events.last().is_some_and(RunEventKind::is_terminal),
        "terminal last"
    );
}

fn failure(events: &[RunEventKind]) -> &iop_wire::ExecutionFailure {
    match events.last() {
        Some(RunEventKind::Failed(f)) => f,
        other => panic!("expected a failure terminal, got {other:?}"),
    }
}

fn texts(events: &[RunEventKind]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            RunEventKind::TextDelta(t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

fn tool_deltas(events: &[RunEventKind]) -> Vec<iop_wire::ToolCallDelta> {
    events
        .iter()
        .filter_map(|e| match e {
            RunEventKind::ToolCallDelta(d) => Some(d.clone()),
            _ => None,
        })
        .collect()
}

fn tool_arguments(events: &[RunEventKind]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            RunEventKind::ToolCallDelta(d) => Some(d.arguments_delta.as_str()),
            _ => None,
        })
        .collect()
}

fn usage(prompt_tokens: u64, completion_tokens: u64) -> Usage {
    Usage::tokens(prompt_tokens, completion_tokens)
}

// ---- anthropic ----

async fn messages_only(script: MockScript) -> MockServer {
    MockServer::start_messages_only(script)
        .await
        .expect("mock starts")
}

#[tokio::test]
async fn anthropic_run_streams_a_messages_answer_with_the_key_in_x_api_key() {
    let server = messages_only(MockScript {
        tokens: 5,
        require_key: Some("sk-ant".into()),
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::Anthropic, &server.base_url(), Some("sk-ant"));
    let mut req = run_request("mock", RunApi::Chat, "hello world");
    req.params.reasoning_effort = Some("low".into());
    let events = collect(a.run(req, None)).await;
    assert_one_terminal(&events);
    assert_eq!(
        events[0],
        RunEventKind::Started {
            session_id: "s-1".into()
        }
    );
    assert!(events.contains(&RunEventKind::ReasoningDelta(
        crate::mock::MOCK_REASONING.into()
    )));
    assert_eq!(texts(&events), "tok0 tok1 tok2 tok3 tok4");
    assert_eq!(
        events.last(),
        Some(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            // The Messages API reports both cache counts, zeros here.
            usage: Some(Usage {
                cache_read_tokens: Some(0),
                cache_write_tokens: Some(0),
                ..usage(3, 5)
            }),
        })
    );
    assert_eq!(server.requests(), 1);

    // A managed credential lease's secret goes in x-api-key too; a wrong
    // key is the provider's 401.
    let events = collect(a.run(
        run_request("mock", RunApi::Chat, "hi"),
        Some("sk-ant".into()),
    ))
    .await;
    assert!(matches!(
        events.last(),
        Some(RunEventKind::Completed { .. })
    ));
    let events = collect(a.run(
        run_request("mock", RunApi::Chat, "hi"),
        Some("wrong".into()),
    ))
    .await;
    assert_eq!(failure(&events).http_status, Some(401));
    // An OpenAI adapter finds no chat completions there.
    let openai = adapter(AdapterKind::OpenAi, &server.base_url(), Some("sk-ant"));
    let events = collect(openai.run(run_request("mock", RunApi::Chat, "hi"), None)).await;
    assert_eq!(failure(&events).http_status, Some(404));
}

#[tokio::test]
async fn anthropic_stop_sequences_tools_limits_and_whole_answers() {
    let server = messages_only(MockScript {
        tokens: 6,
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::Anthropic, &server.base_url(), None);
    // A stop sequence: the text stops before it, and the finish says so.
    for whole in [false, true] {
        let mut req = run_request("mock", RunApi::Chat, "hello world");
        req.params.stop = vec![" tok3".into()];
        req.params.whole_answer = whole;
        let events = collect(a.run(req, None)).await;
        assert_one_terminal(&events);
        assert_eq!(texts(&events), "tok0 tok1 tok2", "whole: {whole}");
        assert!(
            matches!(
                events.last(),
                Some(RunEventKind::Completed {
                    finish_reason: FinishReason::StopSequence,
                    usage: Some(_)
                })
            ),
            "whole: {whole}: {events:?}"
        );
    }
    // max_tokens below the script: max_tokens, i.e. length.
    let mut req = run_request("mock", RunApi::Chat, "hello world");
    req.params.max_tokens = Some(2);
    let events = collect(a.run(req, None)).await;
    assert_eq!(texts(&events), "tok0 tok1");
    assert!(matches!(
        events.last(),
        Some(RunEventKind::Completed {
            finish_reason: FinishReason::Length,
            ..
        })
    ));
    // A tool call, streamed and whole: one call, its arguments JSON.
    let tools = messages_only(MockScript {
        tokens: 3,
        tool_call: true,
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::Anthropic, &tools.base_url(), None);
    for whole in [false, true] {
        let mut req = with_tool(run_request("mock", RunApi::Chat, "weather?"));
        req.params.whole_answer = whole;
        let events = collect(a.run(req, None)).await;
        let calls = tool_deltas(&events);
        assert_eq!(
            calls[0].name.as_deref(),
            Some("get_weather"),
            "whole: {whole}"
        );
        assert!(calls.iter().all(|c| c.index == 0));
        let args: serde_json::Value = serde_json::from_str(&tool_arguments(&events)).unwrap();
        assert_eq!(args["text"], "tok0 tok1 tok2");
        assert!(matches!(
            events.last(),
            Some(RunEventKind::Completed {
                finish_reason: FinishReason::ToolCalls,
                ..
            })
        ));
    }
    assert_eq!(tools.stats().requests, 2);
}

#[tokio::test]
async fn anthropic_faults_are_typed_failures() {
    for (script, code) in [
        (
            MockScript {
                http_error: Some(529),
                ..MockScript::default()
            },
            FailureCode::ProviderError,
        ),
        (
            MockScript {
                malformed_after: Some(1),
                ..MockScript::default()
            },
            FailureCode::MalformedResponse,
        ),
        (
            MockScript {
                abrupt_close_after: Some(1),
                ..MockScript::default()
            },
            FailureCode::ProviderUnreachable,
        ),
    ] {
        let server = messages_only(script).await;
        let a = adapter(AdapterKind::Anthropic, &server.base_url(), None);
        let events = collect(a.run(run_request("mock", RunApi::Chat, "hi"), None)).await;
        assert_one_terminal(&events);
        assert_eq!(failure(&events).code, code, "{events:?}");
    }
}

#[tokio::test]
async fn anthropic_probe_reads_v1_models_and_tunnels_reach_v1_messages() {
    let server = messages_only(MockScript {
        require_key: Some("sk-ant".into()),
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::Anthropic, &server.base_url(), Some("sk-ant"));
    let verdict = a.probe(PROBE_BOUND).await;
    assert_eq!(verdict.health, ProviderHealth::Available);
    assert_eq!(verdict.models, vec!["mock".to_owned()]);
    // A client's own x-api-key is the Edge's credential: replaced by the
    // target's.
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "mock", "max_tokens": 16, "stream": true,
        "messages": [{"role": "user", "content": "hi"}],
    }))
    .unwrap();
    let mut req = tunnel_request("POST", "/v1/messages", body);
    req.headers.push(("x-api-key".into(), "sk-client".into()));
    let frames = collect(a.tunnel(req, None)).await;
    assert_tunnel_shape(&frames);
    assert!(matches!(
        frames[0],
        ProviderTunnelFrame::Head { status: 200, .. }
    ));
    let body = String::from_utf8(body_of(&frames)).unwrap();
    assert!(body.contains("event: message_stop"), "{body}");
    assert_eq!(server.stats().requests, 1);
}

// ---- openai ----

#[tokio::test]
async fn openai_run_streams_text_usage_and_exactly_one_completed() {
    let server = mock(MockScript {
        tokens: 5,
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let events = collect(a.run(run_request("mock", RunApi::Chat, "hello world"), None)).await;
    assert_one_terminal(&events);
    assert_eq!(
        events[0],
        RunEventKind::Started {
            session_id: "s-1".into()
        }
    );
    assert_eq!(texts(&events), "tok0 tok1 tok2 tok3 tok4");
    // "hello world" is 11 chars: ceil(11 / 4) = 3 prompt tokens.
    let n = events.len();
    assert_eq!(events[n - 2], RunEventKind::Usage(usage(3, 5)));
    assert_eq!(
        events[n - 1],
        RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(3, 5)),
        }
    );
    assert_eq!(server.requests(), 1);
}

/// A streamed answer's connection carries the next call in every adapter:
/// the body's last chunk after the content's end (`[DONE]`,
/// `message_stop`, the `done` line) is read, in the background if it has
/// not come yet, so the provider sees one connection for many calls.
#[tokio::test]
async fn a_streamed_answers_connection_carries_the_next_call_in_every_adapter() {
    for kind in [
        AdapterKind::OpenAi,
        AdapterKind::Ollama,
        AdapterKind::Anthropic,
    ] {
        let script = MockScript {
            tokens: 5,
            ..MockScript::default()
        };
        let server = match kind {
            AdapterKind::Anthropic => messages_only(script).await,
            _ => mock(script).await,
        };
        let http = provider_http();
        let a = Adapter::new(
            &provider_target(kind, &server.base_url(), true),
            http.clone(),
        );
        for _ in 0..4 {
            let events = collect(a.run(run_request("mock", RunApi::Chat, "hello"), None)).await;
            assert_one_terminal(&events);
            assert!(matches!(
                events.last(),
                Some(RunEventKind::Completed { .. })
            ));
            while http.finishing() > 0 {
                tokio::task::yield_now().await;
            }
        }
        let stats = server.stats();
        assert_eq!((stats.requests, stats.connections), (4, 1), "{kind:?}");
    }
}

#[tokio::test]
async fn openai_usage_is_the_providers_or_none_never_zeros() {
    let server = mock(MockScript {
        tokens: 4,
        stream_usage: false,
        ..MockScript::default()
    })
    .await;
    // A streamed run from a server whose streams carry no usage: none.
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let events = collect(a.run(run_request("mock", RunApi::Chat, "hello world"), None)).await;
    assert_one_terminal(&events);
    assert!(!events.iter().any(|e| matches!(e, RunEventKind::Usage(_))));
    assert_eq!(
        events.last(),
        Some(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: None,
        })
    );
    // With `stream_usage = false`, a whole answer comes from a non-streamed
    // call and carries the provider's usage.
    let target = ProviderTarget {
        stream_usage: false,
        continuous_usage: false,
        ..provider_target(AdapterKind::OpenAi, &server.base_url(), true)
    };
    let whole = Adapter::new(&target, provider_http());
    let mut req = run_request("mock", RunApi::Chat, "hello world");
    req.params.whole_answer = true;
    let events = collect(whole.run(req, None)).await;
    assert_one_terminal(&events);
    assert_eq!(texts(&events), "tok0 tok1 tok2 tok3");
    assert_eq!(
        events.last(),
        Some(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(3, 4)),
        })
    );
}

#[tokio::test]
async fn the_prompt_caches_counts_reach_the_run_usage_from_both_apis() {
    let openai = mock(MockScript::default()).await;
    let messages = messages_only(MockScript::default()).await;
    // 20 prompt characters: 5 prompt tokens, 3 read from the cache, 1
    // written to it.
    let prompt = "abcdefghijklmnopqrst";
    let model = "mock:tokens=2,cache_read=3,cache_write=1";
    let cached = Usage {
        cache_read_tokens: Some(3),
        cache_write_tokens: Some(1),
        ..usage(5, 2)
    };
    for (kind, server) in [
        (AdapterKind::OpenAi, &openai),
        (AdapterKind::Anthropic, &messages),
    ] {
        for whole in [false, true] {
            let a = Adapter::new(
                &provider_target(kind, &server.base_url(), true),
                provider_http(),
            );
            let mut req = run_request(model, RunApi::Chat, prompt);
            req.params.whole_answer = whole;
            let events = collect(a.run(req, None)).await;
            assert_one_terminal(&events);
            assert_eq!(
                events.last(),
                Some(&RunEventKind::Completed {
                    finish_reason: FinishReason::Stop,
                    usage: Some(cached),
                }),
                "{kind:?} whole: {whole}"
            );
        }
    }
    // An OpenAI-compatible server that reports no cache: none invented.
    let a = adapter(AdapterKind::OpenAi, &openai.base_url(), None);
    let events = collect(a.run(run_request("mock:tokens=2", RunApi::Chat, prompt), None)).await;
    assert_eq!(
        events.last(),
        Some(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(5, 2)),
        })
    );
}

#[tokio::test]
async fn prompt_cache_breakpoints_reach_a_messages_provider_unless_turned_off() {
    // The Messages-only mock reports the prompt up to its last breakpoint
    // as written to its cache.
    let server = messages_only(MockScript::default()).await;
    let mut req = run_request("mock:tokens=1", RunApi::Chat, "0123456789abcdef");
    req.messages[0].cache_control = Some(iop_wire::CacheControl::default());
    req.params.whole_answer = true;
    for (cache_control, written) in [(true, 4), (false, 0)] {
        let target = ProviderTarget {
            cache_control,
            ..provider_target(AdapterKind::Anthropic, &server.base_url(), true)
        };
        let events = collect(Adapter::new(&target, provider_http()).run(req.clone(), None)).await;
        assert_one_terminal(&events);
        let written_tokens = match events.last() {
            Some(RunEventKind::Completed { usage, .. }) => usage.and_then(|u| u.cache_write_tokens),
            other => panic!("not completed: {other:?}"),
        };
        assert_eq!(
            written_tokens,
            Some(written),
            "cache_control = {cache_control}"
        );
    }
}

#[tokio::test]
async fn an_ephemeral_whole_answer_is_one_non_streamed_call_unless_durable_or_turned_off() {
    // The mock's streams carry no usage and its whole answers do: usage in
    // the run's terminal shows which call the adapter made.
    let server = mock(MockScript {
        tokens: 4,
        stream_usage: false,
        ..MockScript::default()
    })
    .await;
    let target =
        |whole_calls| provider_target(AdapterKind::OpenAi, &server.base_url(), whole_calls);
    let whole_request = |durable| whole_request("mock", RunApi::Chat, "hello world", durable);
    let terminal_usage = |events: &[RunEventKind]| match events.last() {
        Some(RunEventKind::Completed { usage, .. }) => *usage,
        other => panic!("not completed: {other:?}"),
    };
    let a = Adapter::new(&target(true), provider_http());
    // Ephemeral and whole: one non-streamed call, the provider's usage.
    let events = collect(a.run(whole_request(false), None)).await;
    assert_one_terminal(&events);
    assert_eq!(texts(&events), "tok0 tok1 tok2 tok3");
    assert_eq!(terminal_usage(&events), Some(usage(3, 4)));
    // Durable: streamed, so the journal keeps the prefix (R-PARK-1, R-CONT-1).
    let events = collect(a.run(whole_request(true), None)).await;
    assert_eq!(texts(&events), "tok0 tok1 tok2 tok3");
    assert_eq!(terminal_usage(&events), None);
    // Turned off for the target: streamed.
    let off = Adapter::new(&target(false), provider_http());
    let events = collect(off.run(whole_request(false), None)).await;
    assert_eq!(texts(&events), "tok0 tok1 tok2 tok3");
    assert_eq!(terminal_usage(&events), None);
    // A streaming client: streamed.
    let events = collect(a.run(run_request("mock", RunApi::Chat, "hello world"), None)).await;
    assert_eq!(terminal_usage(&events), None);
    assert_eq!(server.requests(), 4);
}

#[test]
fn a_whole_answer_is_cut_into_frame_sized_pieces_in_order_r_lim_3() {
    use super::{MAX_PIECE_BYTES, MAX_PIECE_LOGPROBS, frame_sized};
    // Multi-byte characters straddle every piece boundary.
    let text = "é".repeat(MAX_PIECE_BYTES + 7);
    let mut out = Vec::new();
    frame_sized(RunEventKind::TextDelta(text.clone()), &mut out);
    assert_eq!(out.len(), 3);
    assert!(
        out.iter()
            .all(|e| matches!(e, RunEventKind::TextDelta(t) if t.len() <= MAX_PIECE_BYTES))
    );
    assert_eq!(texts(&out), text);
    let call = iop_wire::ToolCallDelta {
        index: 2,
        id: Some("call_1".into()),
        name: Some("f".into()),
        arguments_delta: "x".repeat(2 * MAX_PIECE_BYTES + 1),
    };
    let mut out = Vec::new();
    frame_sized(RunEventKind::ToolCallDelta(call.clone()), &mut out);
    let calls: Vec<_> = out
        .iter()
        .map(|e| match e {
            RunEventKind::ToolCallDelta(c) => c,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(calls.len(), 3);
    assert_eq!(calls[0].id.as_deref(), Some("call_1"));
    assert_eq!(calls[0].name.as_deref(), Some("f"));
    assert!(
        calls[1..]
            .iter()
            .all(|c| c.id.is_none() && c.name.is_none() && c.index == 2)
    );
    let joined: String = calls.iter().map(|c| c.arguments_delta.as_str()).collect();
    assert_eq!(joined, call.arguments_delta);
    let token = iop_wire::TokenLogprob {
        token: "t".into(),
        logprob: -0.5,
        top: Vec::new(),
    };
    let mut out = Vec::new();
    frame_sized(
        RunEventKind::Logprobs(vec![token; MAX_PIECE_LOGPROBS + 1]),
        &mut out,
    );
    let sizes: Vec<usize> = out
        .iter()
        .map(|e| match e {
            RunEventKind::Logprobs(l) => l.len(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(sizes, [MAX_PIECE_LOGPROBS, 1]);
    // Small events pass as they are.
    let mut out = Vec::new();
    frame_sized(RunEventKind::TextDelta("hi".into()), &mut out);
    assert_eq!(out, [RunEventKind::TextDelta("hi".into())]);
}

#[tokio::test]
async fn openai_embeddings_are_one_event_per_input_with_prompt_usage() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let mut req = run_request("mock", RunApi::Embeddings, "abcd");
    req.messages.push(req.messages[0].clone());
    req.messages[1].content = "efgh".into();
    let events = collect(a.run(req, None)).await;
    assert_one_terminal(&events);
    let vectors: Vec<&iop_wire::Embedding> = events
        .iter()
        .filter_map(|e| match e {
            RunEventKind::Embedding(v) => Some(v),
            _ => None,
        })
        .collect();
    assert_eq!(vectors.len(), 2);
    assert_eq!(vectors[1].index, 1);
    assert_eq!(vectors[0].values, crate::mock::mock_embedding("abcd"));
    assert_eq!(
        events.last(),
        Some(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(2, 0)),
        })
    );
}

#[tokio::test]
async fn openai_max_tokens_below_the_script_finishes_with_length() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let mut req = run_request("mock:tokens=6", RunApi::Chat, "hi");
    req.params.max_tokens = Some(2);
    let events = collect(a.run(req, None)).await;
    assert_eq!(texts(&events), "tok0 tok1");
    assert_eq!(
        events.last(),
        Some(&RunEventKind::Completed {
            finish_reason: FinishReason::Length,
            usage: Some(usage(1, 2)),
        })
    );
}

#[tokio::test]
async fn openai_tool_call_streams_as_deltas_and_finishes_with_tool_calls() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let req = with_tool(run_request(
        "mock:tool_call=1,tokens=2",
        RunApi::Chat,
        "weather?",
    ));
    let events = collect(a.run(req, None)).await;
    assert_one_terminal(&events);
    let first = events
        .iter()
        .find_map(|e| match e {
            RunEventKind::ToolCallDelta(d) => Some(d.clone()),
            _ => None,
        })
        .expect("a tool call delta");
    assert_eq!(first.index, 0);
    assert_eq!(first.id.as_deref(), Some("call_0"));
    assert_eq!(first.name.as_deref(), Some("get_weather"));
    assert_eq!(tool_arguments(&events), r#"{"text":"tok0 tok1"}"#);
    assert!(texts(&events).is_empty());
    assert!(matches!(
        events.last(),
        Some(RunEventKind::Completed {
            finish_reason: FinishReason::ToolCalls,
            usage: Some(_)
        })
    ));
}

#[tokio::test]
async fn openai_http_error_is_provider_error_with_status_and_no_started() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let events = collect(a.run(run_request("mock:error=503", RunApi::Chat, "x"), None)).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let f = failure(&events);
    assert_eq!(f.code, FailureCode::ProviderError);
    assert_eq!(f.http_status, Some(503));
    assert_eq!(f.health_failure, Some(HealthFailureCode::Http5xx));

    let events = collect(a.run(run_request("mock:error=429", RunApi::Chat, "x"), None)).await;
    assert_eq!(
        failure(&events).health_failure,
        Some(HealthFailureCode::Http4xx)
    );
}

#[tokio::test]
async fn a_providers_own_error_message_reaches_the_failure_in_every_adapter() {
    let all = mock(MockScript::default()).await;
    let messages = messages_only(MockScript::default()).await;
    for (kind, server) in [
        (AdapterKind::OpenAi, &all),
        (AdapterKind::Ollama, &all),
        (AdapterKind::Anthropic, &messages),
    ] {
        let a = adapter(kind, &server.base_url(), None);
        let events = collect(a.run(run_request("mock:error=500", RunApi::Chat, "x"), None)).await;
        let f = failure(&events);
        assert_eq!(
            (f.code, f.http_status),
            (FailureCode::ProviderError, Some(500))
        );
        assert_eq!(
            f.provider_message.as_deref(),
            Some("scripted mock error"),
            "{kind}"
        );
        // A request the provider refuses: its reason, for the client.
        let events = collect(a.run(run_request("mock:tokens=x", RunApi::Chat, "x"), None)).await;
        let f = failure(&events);
        assert_eq!(f.http_status, Some(400), "{kind}");
        assert!(
            f.provider_message
                .as_deref()
                .is_some_and(|m| m.contains("tokens")),
            "{kind}: {f:?}"
        );
    }
    // The in-process mock says what the HTTP one says.
    let events =
        collect(in_process().run(run_request("mock:error=500", RunApi::Chat, "x"), None)).await;
    assert_eq!(
        failure(&events).provider_message.as_deref(),
        Some("scripted mock error")
    );
}

#[tokio::test]
async fn an_error_body_that_never_ends_is_read_for_a_bounded_time_only() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base_url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut request = vec![0u8; 64 * 1024];
        let _ = socket.read(&mut request).await;
        // The head and the start of a body that never ends.
        socket
            .write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"error\":{\"message\":\"half")
            .await
            .unwrap();
        futures::future::pending::<()>().await;
    });
    let a = adapter(AdapterKind::OpenAi, &base_url, None);
    let started = std::time::Instant::now();
    let events = collect(a.run(run_request("m", RunApi::Chat, "x"), None)).await;
    let f = failure(&events);
    assert_eq!(
        (f.code, f.http_status),
        (FailureCode::ProviderError, Some(500))
    );
    assert_eq!(
        f.provider_message, None,
        "no message from an unfinished body"
    );
    assert!(started.elapsed() >= ERROR_BODY_WAIT);
    assert!(started.elapsed() < ERROR_BODY_WAIT + Duration::from_secs(3));
    server.abort();
}

#[tokio::test]
async fn openai_malformed_chunk_is_malformed_response() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let events = collect(a.run(
        run_request("mock:malformed_after=2,tokens=4", RunApi::Chat, "x"),
        None,
    ))
    .await;
    assert_one_terminal(&events);
    // The two tokens before the garbage were relayed; nothing after it.
    assert_eq!(texts(&events), "tok0 tok1");
    let f = failure(&events);
    assert_eq!(f.code, FailureCode::MalformedResponse);
    assert_eq!(f.health_failure, Some(HealthFailureCode::MalformedResponse));
    assert_eq!(f.http_status, None);
}

#[tokio::test]
async fn openai_abrupt_close_ends_in_a_failure_terminal_never_a_hang() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let events = collect(a.run(
        run_request("mock:close_after=2,tokens=4", RunApi::Chat, "x"),
        None,
    ))
    .await;
    assert_one_terminal(&events);
    assert_eq!(texts(&events), "tok0 tok1");
    let f = failure(&events);
    assert_eq!(f.code, FailureCode::ProviderUnreachable);
    assert_eq!(f.health_failure, Some(HealthFailureCode::TransportFailed));
}

#[tokio::test]
async fn openai_probe_lists_models_and_is_not_a_request() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    assert_eq!(
        a.probe(PROBE_BOUND).await,
        ProbeVerdict::available(vec!["mock".into()])
    );
    assert_eq!((server.requests(), server.probes()), (0, 1));
}

#[tokio::test]
async fn openai_probe_of_an_unhealthy_target_is_unavailable_http_5xx() {
    let server = mock(MockScript {
        health: ProbeHealth::Unhealthy,
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    assert_eq!(
        a.probe(PROBE_BOUND).await,
        ProbeVerdict::unavailable(HealthFailureCode::Http5xx)
    );
}

#[tokio::test]
async fn probe_of_an_empty_model_list_is_success_and_garbage_is_no_verdict() {
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/v1/models",
            get(|| async { r#"{"object":"list","data":[]}"# }),
        )
        .route("/api/tags", get(|| async { "<html>not json</html>" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let openai = adapter(AdapterKind::OpenAi, &base, None);
    assert_eq!(
        openai.probe(PROBE_BOUND).await,
        ProbeVerdict::available(Vec::new())
    );
    let ollama = adapter(AdapterKind::Ollama, &base, None);
    // An unreadable answer is a probe error, not an unhealthy verdict.
    let verdict = ollama.probe(PROBE_BOUND).await;
    assert_eq!(verdict, no_verdict(ProbeAnswer::Malformed));
    assert_eq!(
        (verdict.health, verdict.failure),
        (
            ProviderHealth::Unknown,
            Some(HealthFailureCode::MalformedResponse)
        )
    );
    server.abort();
}

#[tokio::test]
async fn a_closed_port_probes_unknown_transport_failed_and_runs_unreachable() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let a = adapter(AdapterKind::OpenAi, &base, None);
    // A transport error is a probe error: no verdict (R-WD-5).
    let verdict = a.probe(PROBE_BOUND).await;
    assert_eq!(
        (verdict.health, verdict.failure),
        (
            ProviderHealth::Unknown,
            Some(HealthFailureCode::TransportFailed)
        )
    );
    let events = collect(a.run(run_request("m", RunApi::Chat, "x"), None)).await;
    assert_eq!(events.len(), 1);
    let f = failure(&events);
    assert_eq!(f.code, FailureCode::ProviderUnreachable);
    assert_eq!(f.health_failure, Some(HealthFailureCode::TransportFailed));
    let frames = collect(a.tunnel(tunnel_request("GET", "/v1/models", Vec::new()), None)).await;
    assert!(
        matches!(&frames[..], [ProviderTunnelFrame::Failure(f)] if f.code == FailureCode::ProviderUnreachable)
    );
}

#[tokio::test]
async fn require_key_accepts_the_right_key_and_401s_a_wrong_one() {
    let server = mock(MockScript {
        require_key: Some("sk-right".into()),
        ..MockScript::default()
    })
    .await;
    // The static key of the target.
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), Some("sk-right"));
    let events = collect(a.run(run_request("mock", RunApi::Chat, "x"), None)).await;
    assert!(matches!(
        events.last(),
        Some(RunEventKind::Completed { .. })
    ));
    assert_eq!(a.probe(PROBE_BOUND).await.health, ProviderHealth::Available);

    // A call's own secret wins over the static key.
    let events = collect(a.run(
        run_request("mock", RunApi::Chat, "x"),
        Some("sk-wrong".into()),
    ))
    .await;
    let f = failure(&events);
    assert_eq!(f.code, FailureCode::ProviderError);
    assert_eq!(f.http_status, Some(401));
    assert_eq!(
        f.health_failure,
        Some(HealthFailureCode::AuthenticationFailed)
    );

    let keyless = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    assert_eq!(
        keyless.probe(PROBE_BOUND).await,
        ProbeVerdict::unavailable(HealthFailureCode::AuthenticationFailed)
    );
    // 401s are still provider requests.
    assert_eq!((server.requests(), server.probes()), (2, 2));
}

#[tokio::test]
async fn failures_never_carry_the_key_or_the_provider_payload() {
    let server = mock(MockScript {
        require_key: Some("sk-right".into()),
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let events = collect(a.run(
        run_request("mock", RunApi::Chat, "x"),
        Some("sk-secret-wrong".into()),
    ))
    .await;
    let rendered = format!("{events:?} {a:?}");
    assert!(!rendered.contains("sk-secret-wrong"));
    assert!(
        !rendered.contains("invalid api key"),
        "provider text leaked: {rendered}"
    );
    assert!(!rendered.contains(&server.base_url()));
}

// ---- ollama ----

#[tokio::test]
async fn ollama_chat_streams_text_and_final_usage() {
    let server = mock(MockScript {
        tokens: 3,
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::Ollama, &server.base_url(), None);
    let events = collect(a.run(run_request("mock", RunApi::Chat, "12345678"), None)).await;
    assert_one_terminal(&events);
    assert_eq!(
        events,
        vec![
            RunEventKind::Started {
                session_id: "s-1".into()
            },
            RunEventKind::TextDelta("tok0".into()),
            RunEventKind::TextDelta(" tok1".into()),
            RunEventKind::TextDelta(" tok2".into()),
            RunEventKind::Completed {
                finish_reason: FinishReason::Stop,
                usage: Some(usage(2, 3)),
            },
        ]
    );
}

#[tokio::test]
async fn ollama_generate_streams_and_num_predict_limits_it() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::Ollama, &server.base_url(), None);
    let events = collect(a.run(run_request("mock:tokens=2", RunApi::Generate, "abcd"), None)).await;
    assert_one_terminal(&events);
    assert_eq!(texts(&events), "tok0 tok1");
    assert_eq!(
        events.last(),
        Some(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(1, 2)),
        })
    );
    let mut req = run_request("mock:tokens=5", RunApi::Generate, "abcd");
    req.params.max_tokens = Some(1);
    let events = collect(a.run(req, None)).await;
    assert_eq!(texts(&events), "tok0");
    assert!(matches!(
        events.last(),
        Some(RunEventKind::Completed {
            finish_reason: FinishReason::Length,
            ..
        })
    ));
}

#[tokio::test]
async fn ollama_tool_call_arrives_whole_with_json_arguments() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::Ollama, &server.base_url(), None);
    let req = with_tool(run_request(
        "mock:tool_call=1,tokens=2",
        RunApi::Chat,
        "weather?",
    ));
    let events = collect(a.run(req, None)).await;
    assert_one_terminal(&events);
    let calls = tool_deltas(&events);
    assert_eq!(calls.len(), 1, "one delta per whole call");
    assert_eq!(calls[0].name.as_deref(), Some("get_weather"));
    assert!(calls[0].id.is_some());
    let args: serde_json::Value = serde_json::from_str(&calls[0].arguments_delta).unwrap();
    assert_eq!(args, serde_json::json!({"text": "tok0 tok1"}));
    assert!(matches!(
        events.last(),
        Some(RunEventKind::Completed {
            finish_reason: FinishReason::ToolCalls,
            ..
        })
    ));
}

#[tokio::test]
async fn an_ephemeral_whole_ollama_answer_is_one_non_streamed_call_unless_durable_or_turned_off() {
    // A streamed answer arrives one delta per token; a non-streamed one as
    // one delta: the deltas show which call the adapter made.
    let server = mock(MockScript {
        tokens: 3,
        ..MockScript::default()
    })
    .await;
    let target =
        |whole_calls| provider_target(AdapterKind::Ollama, &server.base_url(), whole_calls);
    let whole_request =
        |model: &str, api: RunApi, durable| whole_request(model, api, "12345678", durable);
    let deltas = |events: &[RunEventKind]| {
        events
            .iter()
            .filter(|e| matches!(e, RunEventKind::TextDelta(_)))
            .count()
    };
    let completed = RunEventKind::Completed {
        finish_reason: FinishReason::Stop,
        usage: Some(usage(2, 3)),
    };
    let a = Adapter::new(&target(true), provider_http());
    // Ephemeral and whole, chat and generate: one non-streamed call.
    for api in [RunApi::Chat, RunApi::Generate] {
        let events = collect(a.run(whole_request("mock", api, false), None)).await;
        assert_one_terminal(&events);
        assert_eq!(texts(&events), "tok0 tok1 tok2");
        assert_eq!(deltas(&events), 1, "{api:?}: {events:?}");
        assert_eq!(events.last(), Some(&completed));
    }
    // A whole answer's tool call: one delta, and the run ends in tool calls.
    let events = collect(a.run(
        with_tool(whole_request(
            "mock:tool_call=1,tokens=2",
            RunApi::Chat,
            false,
        )),
        None,
    ))
    .await;
    assert_one_terminal(&events);
    let calls = tool_deltas(&events);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].name.as_deref(), Some("get_weather"));
    assert!(matches!(
        events.last(),
        Some(RunEventKind::Completed {
            finish_reason: FinishReason::ToolCalls,
            ..
        })
    ));
    // A garbled whole answer is malformed, not a panic or a hang.
    let events = collect(a.run(
        whole_request("mock:malformed_after=1", RunApi::Chat, false),
        None,
    ))
    .await;
    assert_one_terminal(&events);
    assert_eq!(failure(&events).code, FailureCode::MalformedResponse);
    // Durable: streamed, so the journal keeps the prefix (R-PARK-1, R-CONT-1).
    let events = collect(a.run(whole_request("mock", RunApi::Chat, true), None)).await;
    assert_eq!(deltas(&events), 3);
    assert_eq!(events.last(), Some(&completed));
    // Turned off for the target: streamed.
    let off = Adapter::new(&target(false), provider_http());
    let events = collect(off.run(whole_request("mock", RunApi::Chat, false), None)).await;
    assert_eq!(deltas(&events), 3);
    // A streaming client: streamed.
    let events = collect(a.run(run_request("mock", RunApi::Chat, "12345678"), None)).await;
    assert_eq!(deltas(&events), 3);
    assert_eq!(server.requests(), 7);
}

#[tokio::test]
async fn ollama_embed_is_one_event_per_input_with_prompt_eval_count() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::Ollama, &server.base_url(), None);
    let events = collect(a.run(run_request("mock", RunApi::Embeddings, "abcdefgh"), None)).await;
    assert_one_terminal(&events);
    assert!(
        matches!(&events[1], RunEventKind::Embedding(e) if e.values == crate::mock::mock_embedding("abcdefgh"))
    );
    assert_eq!(
        events.last(),
        Some(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(2, 0)),
        })
    );
}

#[tokio::test]
async fn ollama_errors_and_garbage_are_typed() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::Ollama, &server.base_url(), None);
    let events = collect(a.run(run_request("mock:error=500", RunApi::Chat, "x"), None)).await;
    assert_eq!(failure(&events).http_status, Some(500));
    let events = collect(a.run(
        run_request("mock:malformed_after=1", RunApi::Chat, "x"),
        None,
    ))
    .await;
    assert_one_terminal(&events);
    assert_eq!(failure(&events).code, FailureCode::MalformedResponse);
    let events = collect(a.run(run_request("mock:close_after=1", RunApi::Chat, "x"), None)).await;
    assert_one_terminal(&events);
    assert_eq!(failure(&events).code, FailureCode::ProviderUnreachable);
}

#[tokio::test]
async fn ollama_probe_reads_api_tags() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::Ollama, &server.base_url(), None);
    assert_eq!(
        a.probe(PROBE_BOUND).await,
        ProbeVerdict::available(vec!["mock".into()])
    );
    assert_eq!((server.requests(), server.probes()), (0, 1));
}

fn body_of(frames: &[ProviderTunnelFrame]) -> Vec<u8> {
    frames
        .iter()
        .filter_map(|f| match f {
            ProviderTunnelFrame::Body(b) => Some(b.as_slice()),
            _ => None,
        })
        .flatten()
        .copied()
        .collect()
}

fn assert_tunnel_shape(frames: &[ProviderTunnelFrame]) {
    assert!(
        matches!(frames.first(), Some(ProviderTunnelFrame::Head { .. })),
        "{frames:?}"
    );
    assert_eq!(frames.iter().filter(|f| f.is_terminal()).count(), 1);
    assert!(frames.last().is_some_and(ProviderTunnelFrame::is_terminal));
}

#[tokio::test]
async fn ollama_api_relays_api_tags_and_refuses_other_paths() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::Ollama, &server.base_url(), None);
    let call = |path: &str| OllamaApiCall {
        target: "t".into(),
        method: "GET".into(),
        path: path.into(),
        body: Vec::new(),
    };
    let frames = collect(a.ollama_api(call("/api/tags"))).await;
    assert_tunnel_shape(&frames);
    assert!(matches!(
        frames[0],
        ProviderTunnelFrame::Head { status: 200, .. }
    ));
    assert_eq!(frames.last(), Some(&ProviderTunnelFrame::End));
    let tags: serde_json::Value = serde_json::from_slice(&body_of(&frames)).unwrap();
    assert_eq!(tags["models"][0]["name"], "mock");

    for bad in ["/v1/models", "/api/../v1/models"] {
        let frames = collect(a.ollama_api(call(bad))).await;
        assert!(
            matches!(&frames[..], [ProviderTunnelFrame::Failure(f)] if f.code == FailureCode::InvalidRequest),
            "{bad}: {frames:?}"
        );
    }
    // The refused calls never reached the provider.
    assert_eq!((server.requests(), server.probes()), (0, 1));
}

// ---- tunnel ----

fn tunnel_request(method: &str, path: &str, body: Vec<u8>) -> ProviderTunnelRequest {
    ProviderTunnelRequest {
        run_id: 7,
        session_id: "s-7".into(),
        adapter: AdapterKind::OpenAi,
        target: "t".into(),
        method: method.into(),
        path: path.into(),
        headers: vec![
            ("Content-Type".into(), "application/json".into()),
            (
                "Authorization".into(),
                "Bearer client-key-for-the-edge".into(),
            ),
            ("Connection".into(), "keep-alive".into()),
        ],
        body,
        response_stall_timeout_ms: 0,
        deadline_ms: 0,
        credential_lease: None,
        trace_context: None,
    }
}

fn chat_body(model: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": model,
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hi"}],
    }))
    .unwrap()
}

#[tokio::test]
async fn tunnel_relays_sse_body_chunks_while_the_provider_is_still_streaming() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    // The provider sends three tokens and then never finishes: a relay that
    // buffered the body would never produce a Body frame.
    let req = tunnel_request(
        "POST",
        "/v1/chat/completions",
        chat_body("mock:stall_after=3,tps=50"),
    );
    let mut frames = a.tunnel(req, None);
    let head = tokio::time::timeout(STREAM_BOUND, frames.next())
        .await
        .unwrap();
    let Some(ProviderTunnelFrame::Head { status, headers }) = head else {
        panic!("expected a head, got {head:?}");
    };
    assert_eq!(status, 200);
    assert!(
        headers
            .iter()
            .any(|(k, v)| k == "content-type" && v == "text/event-stream")
    );
    assert!(
        !headers
            .iter()
            .any(|(k, _)| k == "transfer-encoding" || k == "connection")
    );
    let mut body = String::new();
    while !body.contains("tok2") {
        match tokio::time::timeout(STREAM_BOUND, frames.next())
            .await
            .unwrap()
        {
            Some(ProviderTunnelFrame::Body(b)) => body.push_str(&String::from_utf8_lossy(&b)),
            other => panic!("expected body bytes, got {other:?}"),
        }
    }
    assert!(!body.contains("[DONE]"));
    assert_eq!(server.in_flight(), 1, "the provider is still answering");
    // Dropping the tunnel closes the provider request.
    drop(frames);
    let stats = wait_stats(&server, |s| s.in_flight == 0).await;
    assert_eq!(stats.disconnects, 1);
}

/// Pieces of a tunnelled body the provider already sent travel in one
/// `Body` frame (one per event otherwise), and a piece still to come in a
/// frame of its own when it comes.
#[tokio::test]
async fn tunnel_pieces_already_sent_go_in_one_frame() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let events: Vec<String> = (0..50).map(|i| format!("data: {i}\n\n")).collect();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (go_tx, mut go) = tokio::sync::mpsc::unbounded_channel::<()>();
    let sent = events.clone();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request ended early");
            seen.extend_from_slice(&buf[..n]);
        }
        // The head and every event in one write: all there at the first read.
        let mut out =
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                .to_vec();
        for event in &sent {
            out.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
        }
        s.write_all(&out).await.unwrap();
        go.recv().await.unwrap();
        s.write_all(b"c\r\ndata: late\n\n\r\n").await.unwrap();
        go.recv().await.unwrap();
        // 100 pieces of 100 bytes at once: more than one merged frame holds.
        let piece = format!("data: {}\n\n", "x".repeat(92));
        let mut out = format!("{:x}\r\n{piece}\r\n", piece.len()).repeat(100);
        // Then one piece larger than a frame holds, merged after them.
        let big = format!("data: {}\n\n", "y".repeat(100_000));
        out.push_str(&format!("{:x}\r\n{big}\r\n", big.len()));
        out.push_str("0\r\n\r\n");
        s.write_all(out.as_bytes()).await.unwrap();
        let _ = s.read(&mut buf).await;
    });
    let a = adapter(AdapterKind::OpenAi, &format!("http://{addr}"), None);
    let mut frames = a.tunnel(
        tunnel_request("POST", "/v1/chat/completions", chat_body("m")),
        None,
    );
    let mut next = async || {
        tokio::time::timeout(STREAM_BOUND, frames.next())
            .await
            .unwrap()
            .unwrap()
    };
    assert!(matches!(
        next().await,
        ProviderTunnelFrame::Head { status: 200, .. }
    ));
    assert_eq!(
        next().await,
        ProviderTunnelFrame::Body(events.concat().into_bytes())
    );
    go_tx.send(()).unwrap();
    // (The 50 events fit one merged frame.)
    assert!(events.concat().len() < super::relay::MERGED_BODY_BYTES);
    assert_eq!(
        next().await,
        ProviderTunnelFrame::Body(b"data: late\n\n".to_vec())
    );
    go_tx.send(()).unwrap();
    let mut bodies = Vec::new();
    loop {
        match next().await {
            ProviderTunnelFrame::Body(b) => bodies.push(b),
            ProviderTunnelFrame::End => break,
            other => panic!("{other:?}"),
        }
    }
    let piece = format!("data: {}\n\n", "x".repeat(92));
    let big = format!("data: {}\n\n", "y".repeat(100_000));
    assert_eq!(
        bodies.concat(),
        format!("{}{big}", piece.repeat(100)).into_bytes()
    );
    let sizes: Vec<usize> = bodies.iter().map(Vec::len).collect();
    // No frame past the wire's bound, the large piece split to fit.
    assert!(
        sizes.iter().all(|&n| n <= super::MAX_BODY_CHUNK_BYTES),
        "{sizes:?}"
    );
    // The small pieces merged up to the bound, never more than one piece
    // past it.
    let mut at = 0;
    let small: Vec<usize> = sizes
        .iter()
        .copied()
        .take_while(|&n| {
            at += n;
            at <= 100 * 100
        })
        .collect();
    assert!(small.len() >= 2, "{sizes:?}");
    assert!(
        small
            .iter()
            .all(|&n| n < super::relay::MERGED_BODY_BYTES + 100),
        "{sizes:?}"
    );
}

#[tokio::test]
async fn tunnel_relays_a_whole_answer_with_one_terminal_and_replaces_the_client_credential() {
    let server = mock(MockScript {
        require_key: Some("sk-provider".into()),
        tokens: 3,
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let req = tunnel_request("POST", "/v1/chat/completions", chat_body("mock"));
    let frames = collect(a.tunnel(req.clone(), Some("sk-provider".into()))).await;
    assert_tunnel_shape(&frames);
    assert_eq!(frames.last(), Some(&ProviderTunnelFrame::End));
    let body = String::from_utf8(body_of(&frames)).unwrap();
    assert!(body.contains("tok2") && body.trim_end().ends_with("data: [DONE]"));

    // Without a provider credential the client's own header is not relayed.
    let frames = collect(a.tunnel(req, None)).await;
    assert!(matches!(
        frames[0],
        ProviderTunnelFrame::Head { status: 401, .. }
    ));
    assert_eq!(frames.last(), Some(&ProviderTunnelFrame::End));
    // HTTP errors are relayed as they are, not as failures.
    assert!(
        !frames
            .iter()
            .any(|f| matches!(f, ProviderTunnelFrame::Failure(_)))
    );
}

#[tokio::test]
async fn tunnel_refuses_bad_methods_and_paths_before_any_provider_call() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    for (method, path) in [
        ("G ET", "/v1/models"),
        ("GET", "v1/models"),
        ("GET", "//evil/x"),
    ] {
        let frames = collect(a.tunnel(tunnel_request(method, path, Vec::new()), None)).await;
        assert!(
            matches!(&frames[..], [ProviderTunnelFrame::Failure(f)] if f.code == FailureCode::InvalidRequest),
            "{method} {path}: {frames:?}"
        );
    }
    assert_eq!(server.stats(), MockStats::default());
}

#[tokio::test]
async fn tunnel_abrupt_close_is_one_failure_terminal() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let req = tunnel_request(
        "POST",
        "/v1/chat/completions",
        chat_body("mock:close_after=1"),
    );
    let frames = collect(a.tunnel(req, None)).await;
    assert_tunnel_shape(&frames);
    assert!(
        matches!(frames.last(), Some(ProviderTunnelFrame::Failure(f)) if f.code == FailureCode::ProviderUnreachable)
    );
}

// ---- cancellation ----

#[tokio::test]
async fn dropping_a_run_mid_stream_closes_the_provider_request() {
    let server = mock(MockScript::default()).await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let mut events = a.run(run_request("mock:stall_after=2", RunApi::Chat, "x"), None);
    let mut seen = Vec::new();
    while seen
        .iter()
        .filter(|e| matches!(e, RunEventKind::TextDelta(_)))
        .count()
        < 2
    {
        let e = tokio::time::timeout(STREAM_BOUND, events.next())
            .await
            .unwrap();
        seen.push(e.expect("the run is still open"));
    }
    assert_eq!(server.in_flight(), 1);
    drop(events);
    let stats = wait_stats(&server, |s| s.in_flight == 0).await;
    assert_eq!((stats.requests, stats.disconnects), (1, 1));
}

#[tokio::test]
async fn dropping_a_run_waiting_for_headers_closes_the_provider_request() {
    let server = mock(MockScript::default()).await;
    for kind in [AdapterKind::OpenAi, AdapterKind::Ollama] {
        server.reset_counts();
        let a = adapter(kind, &server.base_url(), None);
        let events = a.run(run_request("mock:hang_headers=1", RunApi::Chat, "x"), None);
        // Poll the run in a task until the provider holds the request.
        let task = tokio::spawn(async move { events.collect::<Vec<_>>().await });
        wait_stats(&server, |s| s.in_flight == 1).await;
        task.abort();
        let stats = wait_stats(&server, |s| s.in_flight == 0).await;
        assert_eq!(stats.disconnects, 1, "{kind}");
    }
}

// ---- in-process mock ----

fn in_process() -> Adapter {
    let target = ProviderTarget {
        target: "m".into(),
        base_url: None,
        ..provider_target(AdapterKind::Mock, "", true)
    };
    Adapter::new(&target, provider_http())
}

#[tokio::test]
async fn in_process_mock_yields_the_same_events_as_openai_over_http() {
    let server = mock(MockScript::default()).await;
    let http = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let local = in_process();
    assert_eq!(local.kind(), AdapterKind::Mock);
    for model in [
        "mock",
        "mock:tokens=0",
        "mock:tokens=3,tps=200",
        "mock:tool_call=1,tokens=3",
        "mock:tool_call=1,tokens=0",
        "mock:error=503",
        "mock:error=401",
        "mock:malformed_after=1",
        "mock:close_after=2",
        "mock:bogus=1",
    ] {
        for api in [RunApi::Chat, RunApi::Generate] {
            let mut req = with_tool(run_request(model, api, "hello there"));
            req.params.max_tokens = Some(6);
            let over_http = collect(http.run(req.clone(), None)).await;
            let in_proc = collect(local.run(req, None)).await;
            assert_eq!(in_proc, over_http, "{model} {api:?}");
        }
    }
}

#[tokio::test]
async fn in_process_mock_tunnels_and_probes_like_the_http_mock() {
    let server = mock(MockScript::default()).await;
    let http = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let local = in_process();
    for (method, path, body) in [
        ("POST", "/v1/chat/completions", chat_body("mock:tokens=4")),
        (
            "POST",
            "/v1/responses",
            br#"{"model":"mock","input":"hi","stream":true}"#.to_vec(),
        ),
        (
            "POST",
            "/api/chat",
            br#"{"model":"mock","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
        ),
        ("GET", "/v1/models", Vec::new()),
    ] {
        let over_http =
            collect(http.tunnel(tunnel_request(method, path, body.clone()), None)).await;
        let in_proc = collect(local.tunnel(tunnel_request(method, path, body), None)).await;
        assert_tunnel_shape(&in_proc);
        let status = |f: &[ProviderTunnelFrame]| match f.first() {
            Some(ProviderTunnelFrame::Head { status, .. }) => *status,
            _ => 0,
        };
        assert_eq!(status(&in_proc), status(&over_http), "{path}");
        assert_eq!(body_of(&in_proc), body_of(&over_http), "{path}");
        assert_eq!(in_proc.last(), over_http.last(), "{path}");
    }
    assert_eq!(
        local.probe(PROBE_BOUND).await,
        ProbeVerdict::available(vec!["mock".into()])
    );
}

#[tokio::test]
async fn in_process_mock_health_is_scripted() {
    let sick = Adapter::in_process_mock(
        "m",
        MockScript {
            health: ProbeHealth::Unhealthy,
            ..MockScript::default()
        },
    );
    assert_eq!(
        sick.probe(PROBE_BOUND).await,
        ProbeVerdict::unavailable(HealthFailureCode::Http5xx)
    );
}

#[tokio::test(start_paused = true)]
async fn a_hanging_probe_is_bounded_and_unknown_timeout() {
    let hung = Adapter::in_process_mock(
        "m",
        MockScript {
            health: ProbeHealth::Hang,
            ..MockScript::default()
        },
    );
    let started = tokio::time::Instant::now();
    let verdict = hung.probe(PROBE_BOUND).await;
    assert_eq!(started.elapsed(), PROBE_BOUND);
    assert_eq!(verdict, no_verdict(ProbeAnswer::TimedOut));
    assert_eq!(
        (verdict.health, verdict.failure),
        (ProviderHealth::Unknown, Some(HealthFailureCode::Timeout))
    );
}

#[tokio::test]
async fn an_http_probe_is_bounded_by_the_configured_bound_not_a_fixed_one() {
    // A probe bound above 5 s is honoured (it once was capped silently)
    // and one below it ends the HTTP request at the bound.
    let server = mock(MockScript {
        health: ProbeHealth::Hang,
        ..MockScript::default()
    })
    .await;
    let a = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let bound = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let verdict = a.probe(bound).await;
    let elapsed = started.elapsed();
    assert!(elapsed >= bound && elapsed < bound * 10, "{elapsed:?}");
    assert_eq!(verdict, no_verdict(ProbeAnswer::TimedOut));
}

#[tokio::test(start_paused = true)]
async fn a_probe_bound_above_five_seconds_is_not_capped() {
    let hung = Adapter::in_process_mock(
        "m",
        MockScript {
            health: ProbeHealth::Hang,
            ..MockScript::default()
        },
    );
    let bound = Duration::from_secs(12);
    let started = tokio::time::Instant::now();
    assert_eq!(hung.probe(bound).await, no_verdict(ProbeAnswer::TimedOut));
    assert_eq!(started.elapsed(), bound);
}

#[tokio::test]
async fn unconfigured_http_adapters_fail_closed() {
    let target = ProviderTarget {
        base_url: None,
        ..provider_target(AdapterKind::OpenAi, "", true)
    };
    let a = Adapter::new(&target, provider_http());
    let events = collect(a.run(run_request("m", RunApi::Chat, "x"), None)).await;
    assert_eq!(failure(&events).code, FailureCode::Internal);
    assert_eq!(
        a.probe(PROBE_BOUND).await.health,
        ProviderHealth::Unavailable
    );
}

// ---- counting ----

#[tokio::test]
async fn probes_are_counted_apart_from_requests_in_process_and_over_http() {
    let server = mock(MockScript::default()).await;
    let openai = adapter(AdapterKind::OpenAi, &server.base_url(), None);
    let ollama = adapter(AdapterKind::Ollama, &server.base_url(), None);
    openai.probe(PROBE_BOUND).await;
    openai.probe(PROBE_BOUND).await;
    ollama.probe(PROBE_BOUND).await;
    collect(openai.run(run_request("mock", RunApi::Chat, "x"), None)).await;
    assert_eq!((server.requests(), server.probes()), (1, 3));

    let client = http_client();
    let stats: MockStats = serde_json::from_slice(
        &client
            .get(format!("{}/mock/stats", server.base_url()))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        stats,
        MockStats {
            requests: 1,
            probes: 3,
            in_flight: 0,
            max_in_flight: 1,
            disconnects: 0,
            continued: 0,
            abandoned_before_text: 0,
            // One a client: each adapter's calls keep theirs, and this
            // read's.
            connections: 3,
            ..MockStats::default()
        }
    );
    // Reading the stats is neither a request nor a probe.
    assert_eq!((server.requests(), server.probes()), (1, 3));
    server.reset_counts();
    assert_eq!(server.stats(), MockStats::default());
}
