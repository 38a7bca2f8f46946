use iop_wire::{FailureCode, ToolCall, ToolDefinition};

use super::*;

fn run_request(api: RunApi) -> RunRequest {
    crate::adapter::tests::run_request("claude", api, "hello")
}

fn message(role: Role, content: &str) -> ChatMessage {
    ChatMessage {
        role,
        content: content.into(),
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
        images: Vec::new(),
        cache_control: None,
        documents: Vec::new(),
    }
}

fn decode_all(events: &[Value]) -> (Vec<RunEventKind>, EventState) {
    let mut state = EventState::default();
    let mut out = Vec::new();
    for event in events {
        state
            .on_event(event.to_string().as_bytes(), &mut out)
            .expect("a valid event");
    }
    (out, state)
}

#[test]
fn a_messages_stream_becomes_text_reasoning_tool_calls_usage_and_its_stop_reason() {
    let (out, state) = decode_all(&[
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
            "content": [], "model": "claude", "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 10, "cache_creation_input_tokens": 5, "cache_read_input_tokens": 20, "output_tokens": 1}}}),
        json!({"type": "ping"}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hm"}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "abc"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}}),
        json!({"type": "content_block_stop", "index": 1}),
        json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}}),
        json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"city\":"}}),
        json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "\"Paris\"}"}}),
        json!({"type": "content_block_stop", "index": 2}),
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 7}}),
        json!({"type": "message_stop"}),
    ]);
    let usage = |completion_tokens| {
        RunEventKind::Usage(Usage {
            cache_read_tokens: Some(20),
            cache_write_tokens: Some(5),
            ..Usage::tokens(35, completion_tokens)
        })
    };
    assert_eq!(
        out,
        vec![
            usage(1),
            RunEventKind::ReasoningDelta("hm".into()),
            RunEventKind::TextDelta("Hi".into()),
            RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: Some("toolu_1".into()),
                name: Some("get_weather".into()),
                arguments_delta: String::new(),
            }),
            RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: None,
                name: None,
                arguments_delta: "{\"city\":".into(),
            }),
            RunEventKind::ToolCallDelta(ToolCallDelta {
                index: 0,
                id: None,
                name: None,
                arguments_delta: "\"Paris\"}".into(),
            }),
            usage(7),
        ]
    );
    assert!(state.done);
    assert_eq!(
        state.completed(),
        RunEventKind::Completed {
            finish_reason: FinishReason::ToolCalls,
            usage: Some(Usage {
                cache_read_tokens: Some(20),
                cache_write_tokens: Some(5),
                ..Usage::tokens(35, 7)
            }),
        },
        "the prompt counts uncached, cache-written and cache-read tokens"
    );
}

#[test]
fn a_message_delta_updates_the_counts_it_gives_and_keeps_the_others() {
    let start = |usage: Value| {
        json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
            "content": [], "model": "claude", "stop_reason": null, "stop_sequence": null, "usage": usage}})
    };
    let delta = |usage: Value| json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": usage});
    let stop = json!({"type": "message_stop"});
    // Cumulative counts in the delta (newer servers) replace the start's.
    let (_, state) = decode_all(&[
        start(json!({"input_tokens": 4, "cache_read_input_tokens": 0, "output_tokens": 1})),
        delta(json!({"input_tokens": 4, "cache_read_input_tokens": 96, "output_tokens": 3})),
        stop.clone(),
    ]);
    assert_eq!(
        state.run_usage(),
        Some(Usage {
            cache_read_tokens: Some(96),
            ..Usage::tokens(100, 3)
        })
    );
    // A server that reports no cache counts: none are invented.
    let (_, state) = decode_all(&[
        start(json!({"input_tokens": 4, "output_tokens": 1})),
        delta(json!({"output_tokens": 3})),
        stop,
    ]);
    assert_eq!(state.run_usage(), Some(Usage::tokens(4, 3)));
}

#[test]
fn streamed_blocks_of_one_call_id_are_one_tool_call() {
    // LiteLLM's proxy in front of llama-cpp-python: a block per piece of
    // the one call's input, each with the call's id.
    let mut events = Vec::new();
    for (index, piece) in ["{", " \"", "city", "\":", " \"Paris\"", " }"]
        .iter()
        .enumerate()
    {
        events.push(json!({"type": "content_block_start", "index": index,
            "content_block": {"type": "tool_use", "id": "call_0", "name": "get_weather", "input": {}}}));
        events.push(json!({"type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": piece}}));
        events.push(json!({"type": "content_block_stop", "index": index}));
    }
    // Then a second call, of another id.
    events.push(json!({"type": "content_block_start", "index": 6,
        "content_block": {"type": "tool_use", "id": "call_1", "name": "get_time", "input": {}}}));
    events.push(json!({"type": "content_block_delta", "index": 6,
        "delta": {"type": "input_json_delta", "partial_json": "{}"}}));
    events.push(json!({"type": "content_block_stop", "index": 6}));
    events.push(json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}}));
    events.push(json!({"type": "message_stop"}));
    let (out, state) = decode_all(&events);
    let calls: Vec<(u32, Option<String>, String)> = out
        .iter()
        .filter_map(|e| match e {
            RunEventKind::ToolCallDelta(d) => {
                Some((d.index, d.id.clone(), d.arguments_delta.clone()))
            }
            _ => None,
        })
        .collect();
    let started: Vec<_> = calls.iter().filter(|c| c.1.is_some()).collect();
    assert_eq!(started.len(), 2, "{calls:?}");
    let arguments = |call| {
        calls
            .iter()
            .filter(|c| c.0 == call)
            .map(|c| c.2.as_str())
            .collect::<String>()
    };
    assert_eq!(
        serde_json::from_str::<Value>(&arguments(0)).unwrap(),
        json!({"city": "Paris"})
    );
    assert_eq!(arguments(1), "{}");
    assert_eq!(
        state.tool_blocks.len(),
        2,
        "only the calls' last blocks are kept"
    );
    assert!(matches!(
        state.completed(),
        RunEventKind::Completed {
            finish_reason: FinishReason::ToolCalls,
            ..
        }
    ));
}

#[test]
fn every_stop_reason_maps_to_its_finish_reason() {
    for (reason, finish) in [
        ("end_turn", FinishReason::Stop),
        ("pause_turn", FinishReason::Stop),
        ("stop_sequence", FinishReason::StopSequence),
        ("max_tokens", FinishReason::Length),
        ("model_context_window_exceeded", FinishReason::Length),
        ("tool_use", FinishReason::ToolCalls),
        ("refusal", FinishReason::ContentFilter),
        ("something_newer", FinishReason::Stop),
    ] {
        let (_, state) = decode_all(&[
            json!({"type": "message_delta", "delta": {"stop_reason": reason}, "usage": {"output_tokens": 1}}),
            json!({"type": "message_stop"}),
        ]);
        assert_eq!(
            state.completed(),
            RunEventKind::Completed {
                finish_reason: finish,
                usage: None
            },
            "{reason}: no input count reported, no usage invented"
        );
    }
}

#[test]
fn an_error_event_is_the_providers_failure_with_its_sanitized_message() {
    let mut state = EventState::default();
    let mut out = Vec::new();
    let err = state
        .on_event(
            json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded\r\n now"}})
                .to_string()
                .as_bytes(),
            &mut out,
        )
        .unwrap_err();
    let failure = err.failure();
    assert_eq!(failure.code, FailureCode::ProviderError);
    assert_eq!(failure.provider_message.as_deref(), Some("Overloaded now"));
    assert_eq!(
        state.on_event(b"{\"type\":", &mut out),
        Err(Failure::Call(ProviderCallError::Malformed))
    );
    assert_eq!(
        state.on_event(
            br#"{"type":"content_block_delta","index":9,"delta":{"type":"input_json_delta","partial_json":"{}"}}"#,
            &mut out
        ),
        Err(Failure::Call(ProviderCallError::Malformed)),
        "arguments of a block that was never started"
    );
}

#[test]
fn a_whole_answer_becomes_the_same_events() {
    let mut state = EventState::default();
    let mut out = Vec::new();
    state
        .on_whole(
            json!({"id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Hi"},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                    {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}}
                ],
                "stop_reason": "stop_sequence", "stop_sequence": "END",
                "usage": {"input_tokens": 3, "cache_creation_input_tokens": 4, "cache_read_input_tokens": 0, "output_tokens": 2}})
            .to_string()
            .as_bytes(),
            &mut out,
        )
        .unwrap();
    assert_eq!(out[0], RunEventKind::ReasoningDelta("hm".into()));
    assert_eq!(out[1], RunEventKind::TextDelta("Hi".into()));
    assert_eq!(
        out[2],
        RunEventKind::ToolCallDelta(ToolCallDelta {
            index: 0,
            id: Some("toolu_1".into()),
            name: Some("f".into()),
            arguments_delta: r#"{"a":1}"#.into(),
        })
    );
    assert!(
        matches!(&out[3], RunEventKind::ToolCallDelta(d) if d.index == 1 && d.arguments_delta == "{}")
    );
    assert_eq!(
        state.completed(),
        RunEventKind::Completed {
            finish_reason: FinishReason::StopSequence,
            usage: Some(Usage {
                cache_read_tokens: Some(0),
                cache_write_tokens: Some(4),
                ..Usage::tokens(7, 2)
            }),
        }
    );
}

#[test]
fn a_chat_run_becomes_the_messages_request_it_describes() {
    let mut req = run_request(RunApi::Chat);
    let mut image = message(Role::User, "what is this?");
    image.images = vec![
        "data:image/png;base64,aGk=".into(),
        "https://example.com/a.jpg".into(),
    ];
    let mut assistant = message(Role::Assistant, "Let me check.");
    assistant.tool_calls = vec![ToolCall {
        id: "toolu_1".into(),
        name: "get_weather".into(),
        arguments: r#"{"city":"Paris"}"#.into(),
    }];
    let mut tool = message(Role::Tool, "18C");
    tool.tool_call_id = Some("toolu_1".into());
    req.messages = vec![
        message(Role::System, "be brief"),
        image,
        assistant,
        tool,
        message(Role::User, "and tomorrow?"),
    ];
    req.tools.push(ToolDefinition {
        name: "get_weather".into(),
        description: Some("Weather".into()),
        parameters_json: Some(r#"{"type":"object"}"#.into()),
        cache_control: None,
    });
    req.params.tool_choice_json =
        Some(r#"{"type":"function","function":{"name":"get_weather"}}"#.into());
    req.params.parallel_tool_calls = Some(false);
    req.params.stop = vec!["END".into()];
    req.params.temperature = Some(0.5);
    req.params.reasoning_effort = Some("medium".into());
    req.params.max_tokens = Some(100);
    req.params.extra_json = Some(r#"{"top_k":5,"user":"u-1","store":true}"#.into());
    let body = request_json(&req, true).unwrap();
    assert_eq!(
        body,
        json!({
            "model": "claude",
            "system": "be brief",
            "messages": [
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
                    {"type": "text", "text": "what is this?"}
                ]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
                ]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}]},
                {"role": "user", "content": "and tomorrow?"}
            ],
            // The thinking budget is part of max_tokens, which must exceed it.
            "max_tokens": MEDIUM_THINKING_BUDGET_TOKENS + 1,
            "thinking": {"type": "enabled", "budget_tokens": MEDIUM_THINKING_BUDGET_TOKENS},
            "stream": true,
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
            "top_k": 5,
            "metadata": {"user_id": "u-1"}
        })
    );
}

#[test]
fn cache_breakpoints_go_on_the_last_block_of_their_message_or_tool() {
    let mut req = run_request(RunApi::Chat);
    let hour = Some(iop_wire::CacheControl {
        ttl: Some(iop_wire::CacheTtl::OneHour),
    });
    let five = Some(iop_wire::CacheControl::default());
    let mut system = message(Role::System, "rules");
    system.cache_control = hour;
    let mut user = message(Role::User, "a long document");
    user.cache_control = five;
    let mut tool = message(Role::Tool, "18C");
    tool.tool_call_id = Some("toolu_1".into());
    tool.cache_control = five;
    req.messages = vec![system, user, tool, message(Role::User, "and tomorrow?")];
    req.tools.push(ToolDefinition {
        name: "f".into(),
        description: None,
        parameters_json: None,
        cache_control: five,
    });
    let body = request_json(&req, false).unwrap();
    assert_eq!(
        body["system"],
        json!([{"type": "text", "text": "rules", "cache_control": {"type": "ephemeral", "ttl": "1h"}}])
    );
    assert_eq!(
        body["messages"][0]["content"],
        json!([{"type": "text", "text": "a long document", "cache_control": {"type": "ephemeral"}}])
    );
    assert_eq!(
        body["messages"][1]["content"][0]["cache_control"],
        json!({"type": "ephemeral"})
    );
    assert_eq!(body["messages"][2]["content"], json!("and tomorrow?"));
    assert_eq!(
        body["tools"][0]["cache_control"],
        json!({"type": "ephemeral"})
    );
    // Without breakpoints the system prompt is a string.
    req.messages[0].cache_control = None;
    assert_eq!(request_json(&req, false).unwrap()["system"], json!("rules"));
}

#[test]
fn max_tokens_is_always_sent_and_runs_the_messages_api_cannot_carry_are_refused() {
    let req = run_request(RunApi::Generate);
    let body = request_json(&req, false).unwrap();
    assert_eq!(body["max_tokens"], json!(DEFAULT_MAX_TOKENS));
    assert_eq!(
        body["messages"],
        json!([{"role": "user", "content": "hello"}])
    );
    assert!(body.get("stream").is_none());

    let mut fim = run_request(RunApi::Completion);
    fim.params.suffix = Some("end".into());
    assert!(matches!(
        request_json(&fim, true),
        Err(ProviderCallError::InvalidRequest(_))
    ));
    let mut bad_args = run_request(RunApi::Chat);
    let mut assistant = message(Role::Assistant, "");
    assistant.tool_calls = vec![ToolCall {
        id: "c".into(),
        name: "f".into(),
        arguments: "[1]".into(),
    }];
    bad_args.messages.push(assistant);
    assert!(matches!(
        request_json(&bad_args, true),
        Err(ProviderCallError::InvalidRequest(_))
    ));
}

#[test]
fn tool_choice_modes_map_to_the_messages_vocabulary() {
    assert_eq!(tool_choice_json(None, None), None);
    assert_eq!(
        tool_choice_json(Some("\"auto\""), None),
        Some(json!({"type": "auto"}))
    );
    assert_eq!(
        tool_choice_json(Some("required"), None),
        Some(json!({"type": "any"}))
    );
    assert_eq!(
        tool_choice_json(Some("\"none\""), None),
        Some(json!({"type": "none"}))
    );
    assert_eq!(
        tool_choice_json(None, Some(false)),
        Some(json!({"type": "auto", "disable_parallel_tool_use": true}))
    );
}

#[test]
fn images_and_pdfs_become_blocks_of_their_turn_and_of_a_tool_result() {
    let pdf = Document {
        source: DocumentSource::PdfBase64("JVBERi0=".into()),
        title: Some("Manual".into()),
        context: Some("v2".into()),
    };
    let mut req = run_request(RunApi::Chat);
    req.messages = vec![
        ChatMessage {
            images: vec!["data:image/png;base64,iVBO".into()],
            documents: vec![Document {
                source: DocumentSource::PdfUrl("https://example.com/a.pdf".into()),
                title: None,
                context: None,
            }],
            ..message(Role::User, "read these")
        },
        ChatMessage {
            tool_calls: vec![ToolCall {
                id: "toolu_1".into(),
                name: "shot".into(),
                arguments: "{}".into(),
            }],
            ..message(Role::Assistant, "")
        },
        ChatMessage {
            tool_call_id: Some("toolu_1".into()),
            images: vec!["https://example.com/s.png".into()],
            documents: vec![pdf],
            cache_control: Some(CacheControl::default()),
            ..message(Role::Tool, "done")
        },
    ];
    let body = request_json(&req, false).unwrap();
    assert_eq!(
        body["messages"][0]["content"],
        json!([
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
            {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}},
            {"type": "text", "text": "read these"}
        ])
    );
    assert_eq!(
        body["messages"][2]["content"],
        json!([{
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": [
                {"type": "text", "text": "done"},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/s.png"}},
                {"type": "document", "title": "Manual", "context": "v2",
                 "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
            ],
            "cache_control": {"type": "ephemeral"}
        }])
    );
}
