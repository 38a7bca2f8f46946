use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use iop_wire::{
    CacheControl, CacheTtl, ChatMessage, Document, DocumentSource, ExecutionFailure, FailureCode,
    FinishReason, GenerationParams, Role, RunApi, RunEventKind, ToolCall, ToolCallDelta,
    ToolDefinition, Usage,
};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

use super::request::message;
use super::*;
use crate::api::framing::parse_sse;

fn parse(body: Value) -> Result<NormalizedRun, ApiError> {
    parse_messages_request(body.to_string().as_bytes())
}

fn refused(body: Value) -> ApiError {
    let err = parse(body).expect_err("must be refused");
    assert_eq!(err.status, 400, "{err:?}");
    err
}

fn minimal() -> Value {
    json!({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]})
}

fn with(field: &str, value: Value) -> Value {
    let mut body = minimal();
    body[field] = value;
    body
}

fn user_blocks(blocks: Value) -> Value {
    with("messages", json!([{"role": "user", "content": blocks}]))
}

/// A body as the Anthropic Python SDK sends it for a tool-use round trip.
fn sdk_body() -> Value {
    json!({
        "model": "m",
        "max_tokens": 2048,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.jpg"}},
                {"type": "text", "text": "weather in Paris?"}
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call the tool", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "text", "text": "and tomorrow?"}
            ]}
        ],
        "tools": [{"name": "get_weather", "description": "Weather for a city",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "metadata": {"user_id": "u-1"},
        "thinking": {"type": "enabled", "budget_tokens": 512 + 1024},
        "stream": true
    })
}

#[test]
fn an_sdk_request_becomes_the_run_it_describes() {
    let run = parse(sdk_body()).unwrap();
    assert_eq!(run.model, "m");
    assert!(run.stream);
    assert_eq!(run.api, RunApi::Chat);
    let roles: Vec<Role> = run.messages.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::Tool,
            Role::User
        ]
    );
    assert_eq!(run.messages[0].content, "You are terse.");
    assert_eq!(
        run.messages[0].cache_control,
        Some(CacheControl::default()),
        "the system prompt's cache breakpoint"
    );
    assert_eq!(
        run.messages[1].images,
        [
            "data:image/png;base64,iVBORw0KGgo=",
            "https://example.com/a.jpg"
        ]
    );
    assert_eq!(run.messages[1].content, "weather in Paris?");
    // The earlier turn's thinking is not part of the context.
    assert_eq!(run.messages[2].content, "Let me check.");
    assert_eq!(run.messages[2].tool_calls[0].id, "toolu_1");
    assert_eq!(
        run.messages[2].tool_calls[0].arguments,
        r#"{"city":"Paris"}"#
    );
    assert_eq!(run.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
    assert_eq!(run.messages[3].content, "18C");
    assert_eq!(run.messages[4].content, "and tomorrow?");
    assert_eq!(run.tools[0].name, "get_weather");
    let p = &run.params;
    assert_eq!(p.max_tokens, Some(2048));
    assert_eq!(p.stop, ["END"]);
    assert_eq!((p.temperature, p.top_p), (Some(0.5), Some(0.9)));
    assert_eq!(p.reasoning_effort.as_deref(), Some("low"));
    assert_eq!(p.parallel_tool_calls, Some(false));
    let choice: Value = serde_json::from_str(p.tool_choice_json.as_deref().unwrap()).unwrap();
    assert_eq!(
        choice,
        json!({"type": "function", "function": {"name": "get_weather"}})
    );
    let extra: Value = serde_json::from_str(p.extra_json.as_deref().unwrap()).unwrap();
    assert_eq!(extra, json!({"top_k": 40, "user": "u-1"}));
    assert!(!p.whole_answer);
}

#[test]
fn cache_breakpoints_are_carried_at_the_end_of_turns_tool_results_tools_and_the_system() {
    let ephemeral = json!({"type": "ephemeral"});
    let hour = json!({"type": "ephemeral", "ttl": "1h"});
    let body = json!({
        "model": "m",
        "max_tokens": 16,
        "system": [
            {"type": "text", "text": "rules", "cache_control": ephemeral},
            {"type": "text", "text": "more rules", "cache_control": hour}
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "a long document", "cache_control": ephemeral},
                {"type": "text", "text": "a question"}
            ]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}, "cache_control": ephemeral}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C", "cache_control": hour},
                {"type": "text", "text": "and tomorrow?", "cache_control": ephemeral}
            ]}
        ],
        "tools": [
            {"name": "f", "input_schema": {"type": "object"}},
            {"name": "g", "input_schema": {"type": "object"}, "cache_control": ephemeral}
        ]
    });
    let run = parse(body).unwrap();
    let five = Some(CacheControl::default());
    let one_hour = Some(CacheControl {
        ttl: Some(CacheTtl::OneHour),
    });
    let breakpoints: Vec<(Role, Option<CacheControl>)> = run
        .messages
        .iter()
        .map(|m| (m.role, m.cache_control))
        .collect();
    assert_eq!(
        breakpoints,
        [
            // The system prompt's last block's.
            (Role::System, one_hour),
            // On an earlier block of the turn: not carried.
            (Role::User, None),
            (Role::Assistant, five),
            (Role::Tool, one_hour),
            (Role::User, five),
        ]
    );
    let tools: Vec<Option<CacheControl>> = run.tools.iter().map(|t| t.cache_control).collect();
    assert_eq!(tools, [None, five]);
    // What the Messages API would refuse is refused, naming the field.
    for (cache_control, field) in [
        (
            json!({"type": "persistent"}),
            "system[0].cache_control.type",
        ),
        (
            json!({"type": "ephemeral", "ttl": "2h"}),
            "system[0].cache_control.ttl",
        ),
        (json!("ephemeral"), "system[0].cache_control"),
    ] {
        let err = refused(with(
            "system",
            json!([{"type": "text", "text": "x", "cache_control": cache_control}]),
        ));
        assert_eq!(err.param.as_deref(), Some(field), "{err:?}");
    }
}

#[test]
fn max_tokens_is_required_as_anthropic_requires_it() {
    let mut body = minimal();
    body.as_object_mut().unwrap().remove("max_tokens");
    let err = refused(body);
    assert_eq!(err.param.as_deref(), Some("max_tokens"));
    assert_eq!(err.code, Some("missing_required_parameter"));
    assert_eq!(
        refused(with("max_tokens", json!(0))).param.as_deref(),
        Some("max_tokens")
    );
}

#[test]
fn fields_out_of_shape_are_refused_naming_them() {
    let cases = [
        (with("frequency_penalty", json!(1)), "frequency_penalty"),
        (with("temperature", json!(1.5)), "temperature"),
        (with("stop_sequences", json!("END")), "stop_sequences"),
        (
            with("metadata", json!({"session": "x"})),
            "metadata.session",
        ),
        (
            with("tool_choice", json!({"type": "function"})),
            "tool_choice.type",
        ),
        (
            with("tool_choice", json!({"type": "tool"})),
            "tool_choice.name",
        ),
        (
            with("thinking", json!({"type": "enabled", "budget_tokens": 100})),
            "thinking.budget_tokens",
        ),
        (
            with(
                "thinking",
                json!({"type": "enabled", "budget_tokens": 2048}),
            ),
            "thinking.budget_tokens",
        ),
        (with("system", json!([{"type": "image"}])), "system[0].type"),
        (
            with(
                "tools",
                json!([{"type": "web_search_20250305", "name": "web_search"}]),
            ),
            "tools[0].type",
        ),
        (
            with("tools", json!([{"name": "f"}])),
            "tools[0].input_schema",
        ),
        (
            with("tools", json!([{"name": "a b", "input_schema": {}}])),
            "tools[0].name",
        ),
        (
            with("messages", json!([{"role": "system", "content": "x"}])),
            "messages[0].role",
        ),
        (
            with("messages", json!([{"role": "user", "content": ""}])),
            "messages[0].content",
        ),
        (with("messages", json!([])), "messages"),
        (
            user_blocks(json!([{"type": "tool_use", "id": "t", "name": "f", "input": {}}])),
            "messages[0].content[0].type",
        ),
        (
            user_blocks(json!([{"type": "audio"}])),
            "messages[0].content[0].type",
        ),
        (
            user_blocks(
                json!([{"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": "AA=="}}]),
            ),
            "messages[0].content[0].source.media_type",
        ),
        (
            user_blocks(json!([{"type": "image", "source": {"type": "url", "url": "ftp://x"}}])),
            "messages[0].content[0].source.url",
        ),
        (
            user_blocks(
                json!([{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "ftp://x"}}]}]),
            ),
            "messages[0].content[0].content[0].source.url",
        ),
    ];
    for (body, param) in cases {
        let err = refused(body.clone());
        assert_eq!(err.param.as_deref(), Some(param), "{body}");
    }
}

#[test]
fn a_pdf_document_is_attached_and_a_text_one_is_carried_as_text() {
    let pdf = user_blocks(json!([
        {"type": "document", "title": "Q3", "context": "the board's copy",
         "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
         "cache_control": {"type": "ephemeral"}},
        {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}},
        {"type": "text", "text": "summarize"}
    ]));
    let run = parse(pdf).unwrap();
    assert_eq!(run.messages.len(), 1);
    let turn = &run.messages[0];
    assert_eq!(turn.content, "summarize");
    assert_eq!(
        turn.documents,
        vec![
            Document {
                source: DocumentSource::PdfBase64("JVBERi0=".into()),
                title: Some("Q3".into()),
                context: Some("the board's copy".into()),
            },
            Document {
                source: DocumentSource::PdfUrl("https://example.com/a.pdf".into()),
                title: None,
                context: None,
            },
        ]
    );
    // The breakpoint of an earlier block is not carried (the turn's is its
    // last block's).
    assert_eq!(turn.cache_control, None);
    // A PDF alone is a turn.
    let alone = user_blocks(json!([
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    ]));
    assert_eq!(parse(alone).unwrap().messages[0].documents.len(), 1);

    let text = user_blocks(json!([
        {"type": "document", "title": "Notes", "source": {"type": "text", "media_type": "text/plain", "data": "the text"}},
        {"type": "text", "text": "summarize"}
    ]));
    let run = parse(text).unwrap();
    assert_eq!(run.messages[0].content, "Notes\nthe text\nsummarize");
    assert!(run.messages[0].documents.is_empty());
}

#[test]
fn documents_the_run_cannot_carry_are_refused_naming_the_field() {
    let pdf = |source: Value| user_blocks(json!([{"type": "document", "source": source}]));
    for (body, param, code) in [
        (
            pdf(json!({"type": "file", "file_id": "file_1"})),
            "messages[0].content[0].source.type",
            "unsupported_parameter",
        ),
        (
            pdf(json!({"type": "base64", "media_type": "image/png", "data": "AAAA"})),
            "messages[0].content[0].source.media_type",
            "invalid_value",
        ),
        (
            pdf(json!({"type": "base64", "media_type": "application/pdf", "data": "not base64!"})),
            "messages[0].content[0].source.data",
            "invalid_value",
        ),
        (
            pdf(json!({"type": "url", "url": "ftp://example.com/a.pdf"})),
            "messages[0].content[0].source.url",
            "invalid_value",
        ),
        (
            user_blocks(json!([{"type": "document", "citations": {"enabled": true},
                "source": {"type": "text", "media_type": "text/plain", "data": "t"}}])),
            "messages[0].content[0].citations.enabled",
            "unsupported_parameter",
        ),
    ] {
        let err = refused(body.clone());
        assert_eq!(err.param.as_deref(), Some(param), "{body}");
        assert_eq!(err.code, Some(code), "{body}");
    }
    // Citations asked off are no request for them.
    let off = user_blocks(json!([{"type": "document", "citations": {"enabled": false},
        "source": {"type": "text", "media_type": "text/plain", "data": "t"}}]));
    assert!(parse(off).is_ok());
}

#[test]
fn images_and_documents_are_bounded_per_request_with_tool_results_counted() {
    let pdf = json!({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}});
    let image = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}});
    // At the bound: half in a tool result, half in the turn.
    let half = MAX_DOCUMENTS_PER_REQUEST / 2;
    let turn = |documents: usize, extra: Value| {
        let mut blocks = vec![json!({"type": "tool_result", "tool_use_id": "toolu_1",
            "content": vec![pdf.clone(); half]})];
        blocks.extend(std::iter::repeat_n(pdf.clone(), documents));
        blocks.push(extra);
        with(
            "messages",
            json!([
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                {"role": "user", "content": blocks}
            ]),
        )
    };
    let at_bound = turn(
        MAX_DOCUMENTS_PER_REQUEST - half,
        json!({"type": "text", "text": "ok"}),
    );
    let run = parse(at_bound).unwrap();
    let documents: usize = run.messages.iter().map(|m| m.documents.len()).sum();
    assert_eq!(documents, MAX_DOCUMENTS_PER_REQUEST);
    let over = turn(MAX_DOCUMENTS_PER_REQUEST - half, pdf.clone());
    let err = refused(over);
    assert_eq!(err.param.as_deref(), Some("messages[1].content[9].source"));
    // Images in tool results count toward the images' bound.
    let images = with(
        "messages",
        json!([
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": vec![image.clone(); super::super::surface::MAX_IMAGES_PER_REQUEST]},
                image
            ]}
        ]),
    );
    let err = refused(images);
    assert_eq!(err.param.as_deref(), Some("messages[1].content[1].source"));
}

#[test]
fn a_tool_result_carries_its_text_images_and_documents() {
    let body = with(
        "messages",
        json!([
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "a screenshot and the manual"},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/s.png"}},
                    {"type": "document", "title": "Manual", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
                    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain notes"}}
                ]},
                {"type": "text", "text": "what now?"}
            ]}
        ]),
    );
    let run = parse(body).unwrap();
    let tool = &run.messages[2];
    assert_eq!(tool.role, Role::Tool);
    assert_eq!(tool.tool_call_id.as_deref(), Some("toolu_1"));
    assert_eq!(tool.content, "a screenshot and the manual\nplain notes");
    assert_eq!(tool.images, vec!["https://example.com/s.png".to_owned()]);
    assert_eq!(tool.documents.len(), 1);
    assert_eq!(tool.documents[0].title.as_deref(), Some("Manual"));
    assert_eq!(run.messages[3].content, "what now?");
    // Other blocks in a tool result are refused naming them.
    let other = with(
        "messages",
        json!([
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                "content": [{"type": "search_result", "source": "s", "title": "t", "content": []}]}]}
        ]),
    );
    assert_eq!(
        refused(other).param.as_deref(),
        Some("messages[1].content[0].content[0].type")
    );
}

#[test]
fn the_beta_header_names_features_once_each_and_is_bounded() {
    use axum::http::{HeaderMap, HeaderValue};
    let headers = |values: &[&str]| {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(BETA_HEADER, HeaderValue::from_str(v).unwrap());
        }
        h
    };
    assert_eq!(
        parse_betas(&HeaderMap::new()).unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(
        parse_betas(&headers(&[
            "pdfs-2024-09-25, prompt-caching-2024-07-31",
            "pdfs-2024-09-25,,"
        ]))
        .unwrap(),
        vec![
            "pdfs-2024-09-25".to_owned(),
            "prompt-caching-2024-07-31".to_owned()
        ]
    );
    for bad in ["a b", "x;y", &"a".repeat(MAX_BETA_NAME_BYTES + 1)] {
        let err = parse_betas(&headers(&[bad])).unwrap_err();
        assert_eq!(
            (err.status, err.param.as_deref()),
            (400, Some(BETA_HEADER)),
            "{bad}"
        );
    }
    let many: Vec<String> = (0..=MAX_BETAS).map(|i| format!("b{i}")).collect();
    let at_bound = many[..MAX_BETAS].join(",");
    assert_eq!(
        parse_betas(&headers(&[&at_bound])).unwrap().len(),
        MAX_BETAS
    );
    assert!(parse_betas(&headers(&[&many.join(",")])).is_err());
}

#[test]
fn tool_choice_modes_map_to_the_runs_vocabulary() {
    for (anthropic, run) in [
        (json!({"type": "auto"}), json!("auto")),
        (json!({"type": "any"}), json!("required")),
        (json!({"type": "none"}), json!("none")),
        (
            json!({"type": "tool", "name": "f"}),
            json!({"type": "function", "function": {"name": "f"}}),
        ),
    ] {
        let run_choice = parse(with("tool_choice", anthropic))
            .unwrap()
            .params
            .tool_choice_json;
        assert_eq!(
            serde_json::from_str::<Value>(&run_choice.unwrap()).unwrap(),
            run
        );
    }
}

#[test]
fn thinking_budgets_map_to_reasoning_efforts() {
    for (budget, effort) in [
        (1024, "low"),
        (4095, "low"),
        (4096, "medium"),
        (16_384, "high"),
    ] {
        let mut body = with(
            "thinking",
            json!({"type": "enabled", "budget_tokens": budget}),
        );
        body["max_tokens"] = json!(32_000);
        assert_eq!(
            parse(body).unwrap().params.reasoning_effort.as_deref(),
            Some(effort)
        );
    }
    let off = parse(with("thinking", json!({"type": "disabled"}))).unwrap();
    assert_eq!(off.params.reasoning_effort, None);
}

#[test]
fn count_tokens_takes_the_conversation_without_max_tokens() {
    let body = json!({"model": "m", "system": "be brief", "messages": [{"role": "user", "content": "hello"}]});
    let run = parse_count_tokens_request(body.to_string().as_bytes()).unwrap();
    assert_eq!(run.messages.len(), 2);
    assert_eq!(
        iop_core::edge::prompt_estimate::prompt_tokens(&run.messages, &run.tools),
        4
    );
    let err = parse_count_tokens_request(minimal().to_string().as_bytes()).unwrap_err();
    assert_eq!(err.param.as_deref(), Some("max_tokens"));
}

#[test]
fn a_final_empty_assistant_turn_is_accepted_and_adds_nothing() {
    let body = with(
        "messages",
        json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]),
    );
    assert_eq!(parse(body).unwrap().messages.len(), 1);
}

fn text(s: &str) -> RunEventKind {
    RunEventKind::TextDelta(s.into())
}

fn completed(finish_reason: FinishReason, usage: Option<Usage>) -> RunEventKind {
    RunEventKind::Completed {
        finish_reason,
        usage,
    }
}

fn tool(index: u32, id: Option<&str>, name: Option<&str>, args: &str) -> RunEventKind {
    RunEventKind::ToolCallDelta(ToolCallDelta {
        index,
        id: id.map(str::to_owned),
        name: name.map(str::to_owned),
        arguments_delta: args.into(),
    })
}

fn encode(events: &[RunEventKind]) -> Vec<(String, Value)> {
    let mut stream = MessagesStream::new("msg_1", "m");
    let mut out = Vec::new();
    for e in events {
        stream.push(e, &mut out);
    }
    parse_sse(&out)
        .into_iter()
        .map(|(name, data)| (name.unwrap(), serde_json::from_str(&data).unwrap()))
        .collect()
}

#[test]
fn a_stream_is_anthropics_event_sequence_with_one_block_per_kind() {
    let usage = Usage::tokens(7, 3);
    let events = encode(&[
        RunEventKind::Started {
            session_id: "s".into(),
        },
        RunEventKind::ReasoningDelta("hmm".into()),
        text("Hel"),
        text("lo"),
        tool(0, Some("call_0"), Some("f"), "{\"a\""),
        tool(0, None, None, ":1}"),
        completed(FinishReason::ToolCalls, Some(usage)),
        text("after the end"),
    ]);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    for (name, data) in &events {
        assert_eq!(
            data["type"],
            name.as_str(),
            "the event name is the data's type"
        );
    }
    let start = &events[0].1["message"];
    assert_eq!(
        (start["id"].as_str(), start["model"].as_str()),
        (Some("msg_1"), Some("m"))
    );
    assert_eq!(start["content"], json!([]));
    assert_eq!(
        events[2].1["content_block"],
        json!({"type": "thinking", "thinking": "", "signature": ""})
    );
    assert_eq!(
        events[3].1["delta"],
        json!({"type": "thinking_delta", "thinking": "hmm"})
    );
    assert_eq!(events[5].1["index"], 1);
    assert_eq!(
        events[6].1["delta"],
        json!({"type": "text_delta", "text": "Hel"})
    );
    assert_eq!(
        events[9].1["content_block"],
        json!({"type": "tool_use", "id": "call_0", "name": "f", "input": {}})
    );
    assert_eq!(
        events[11].1["delta"],
        json!({"type": "input_json_delta", "partial_json": ":1}"})
    );
    assert_eq!(events[12].1["index"], 2);
    assert_eq!(
        events[13].1,
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
               "usage": {"input_tokens": 7, "output_tokens": 3,
                         "cache_creation_input_tokens": null, "cache_read_input_tokens": null}})
    );
    assert_eq!(
        start["usage"],
        json!({"input_tokens": 0, "output_tokens": 0,
               "cache_creation_input_tokens": null, "cache_read_input_tokens": null}),
        "no count before the answer: the SDKs take message_delta's"
    );
}

#[test]
fn usage_before_the_answer_is_in_message_start_with_the_caches_counts() {
    // What an Anthropic provider reports in its own message_start: 100
    // prompt tokens, 80 of them read from the cache and 15 written to it.
    let cached = |completion_tokens| Usage {
        cache_read_tokens: Some(80),
        cache_write_tokens: Some(15),
        ..Usage::tokens(100, completion_tokens)
    };
    let events = encode(&[
        RunEventKind::Usage(cached(1)),
        text("Hi"),
        completed(FinishReason::Stop, Some(cached(2))),
    ]);
    assert_eq!(events[0].0, "message_start");
    assert_eq!(
        events[0].1["message"]["usage"],
        json!({"input_tokens": 5, "output_tokens": 1,
               "cache_creation_input_tokens": 15, "cache_read_input_tokens": 80})
    );
    assert_eq!(events[1].0, "ping");
    let delta = &events[events.len() - 2].1;
    assert_eq!(
        delta["usage"],
        json!({"input_tokens": 5, "output_tokens": 2,
               "cache_creation_input_tokens": 15, "cache_read_input_tokens": 80})
    );
    // An OpenAI-compatible provider reports what it read from its cache
    // only, at the end.
    let read_only = Usage {
        cache_read_tokens: Some(64),
        ..Usage::tokens(70, 2)
    };
    let events = encode(&[text("Hi"), completed(FinishReason::Stop, Some(read_only))]);
    assert_eq!(
        events[events.len() - 2].1["usage"],
        json!({"input_tokens": 6, "output_tokens": 2,
               "cache_creation_input_tokens": null, "cache_read_input_tokens": 64})
    );
    let mut whole = MessagesAccumulator::new("msg_1", "m");
    whole.push(&text("Hi"));
    whole.push(&completed(FinishReason::Stop, Some(cached(2))));
    assert_eq!(
        whole.finish().unwrap()["usage"],
        json!({"input_tokens": 5, "output_tokens": 2,
               "cache_creation_input_tokens": 15, "cache_read_input_tokens": 80})
    );
}

#[test]
fn a_stream_that_fails_first_still_starts_with_message_start() {
    let events = encode(&[RunEventKind::Failed(ExecutionFailure::new(
        FailureCode::ResponseStalled,
    ))]);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["message_start", "ping", "error"]);
}

#[test]
fn a_stream_without_provider_usage_says_null_not_zero() {
    let events = encode(&[text("x"), completed(FinishReason::Length, None)]);
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(
        delta["usage"],
        json!({"input_tokens": null, "output_tokens": null,
               "cache_creation_input_tokens": null, "cache_read_input_tokens": null})
    );
}

#[test]
fn a_failed_stream_ends_with_an_anthropic_error_event() {
    let events = encode(&[
        text("x"),
        RunEventKind::Failed(ExecutionFailure::new(FailureCode::ResponseStalled)),
        text("late"),
    ]);
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error");
    assert_eq!(data["type"], "error");
    assert_eq!(data["error"]["type"], "timeout_error");
}

#[test]
fn stop_reasons_map_faithfully() {
    assert_eq!(stop_reason(FinishReason::Stop, false), "end_turn");
    assert_eq!(stop_reason(FinishReason::Length, false), "max_tokens");
    assert_eq!(stop_reason(FinishReason::ToolCalls, true), "tool_use");
    assert_eq!(stop_reason(FinishReason::Stop, true), "tool_use");
    assert_eq!(stop_reason(FinishReason::ContentFilter, false), "refusal");
    assert_eq!(
        stop_reason(FinishReason::StopSequence, false),
        "stop_sequence"
    );
}

#[test]
fn a_stop_at_a_stop_sequence_names_it_when_the_request_gave_one() {
    let events = [text("Hel"), completed(FinishReason::StopSequence, None)];
    let mut whole = MessagesAccumulator::new("msg_1", "m").with_stop_sequences(vec!["lo".into()]);
    let mut stream = MessagesStream::new("msg_1", "m").with_stop_sequences(vec!["lo".into()]);
    let mut out = Vec::new();
    for e in &events {
        whole.push(e);
        stream.push(e, &mut out);
    }
    let message = whole.finish().unwrap();
    assert_eq!(message["stop_reason"], "stop_sequence");
    assert_eq!(message["stop_sequence"], "lo");
    let delta = parse_sse(&out)
        .into_iter()
        .map(|(_, data)| serde_json::from_str::<Value>(&data).unwrap())
        .find(|v| v["type"] == "message_delta")
        .unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "stop_sequence");
    assert_eq!(delta["delta"]["stop_sequence"], "lo");
    // Several sequences: which one matched is not known, so none is named.
    let mut whole =
        MessagesAccumulator::new("msg_1", "m").with_stop_sequences(vec!["lo".into(), "x".into()]);
    for e in &events {
        whole.push(e);
    }
    assert!(whole.finish().unwrap()["stop_sequence"].is_null());
}

#[test]
fn a_whole_answer_is_one_message_object() {
    let mut whole = MessagesAccumulator::new("msg_1", "m");
    for e in [
        RunEventKind::ReasoningDelta("think".into()),
        text("Hi"),
        tool(0, Some("call_0"), Some("f"), "{\"a\":1}"),
        completed(FinishReason::ToolCalls, Some(Usage::tokens(5, 2))),
    ] {
        whole.push(&e);
    }
    assert_eq!(
        whole.finish().unwrap(),
        json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [
                {"type": "thinking", "thinking": "think", "signature": ""},
                {"type": "text", "text": "Hi"},
                {"type": "tool_use", "id": "call_0", "name": "f", "input": {"a": 1}}
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 5, "output_tokens": 2,
                      "cache_creation_input_tokens": null, "cache_read_input_tokens": null}
        })
    );
    let mut bad = MessagesAccumulator::new("msg_1", "m");
    bad.push(&tool(0, None, Some("f"), "not json"));
    bad.push(&completed(FinishReason::ToolCalls, None));
    assert_eq!(bad.finish().unwrap_err().code, Some("malformed_response"));
}

#[test]
fn errors_have_anthropics_shape_and_status_codes() {
    let cases = [
        (
            ApiError::missing_parameter("max_tokens"),
            400,
            "invalid_request_error",
        ),
        (ApiError::invalid_api_key(), 401, "authentication_error"),
        (ApiError::permission_denied(), 403, "permission_error"),
        (ApiError::model_not_found("m"), 404, "not_found_error"),
        (ApiError::body_too_large(1), 413, "request_too_large"),
        (ApiError::queue_full(1), 429, "rate_limit_error"),
        (ApiError::no_provider(), 529, "overloaded_error"),
        (ApiError::queue_timeout(), 529, "overloaded_error"),
        (ApiError::internal(), 500, "api_error"),
        (
            ApiError::from_failure(FailureCode::ProviderError),
            502,
            "api_error",
        ),
        (ApiError::budget_expired(), 504, "timeout_error"),
    ];
    for (err, status, kind) in cases {
        assert_eq!(error_status_and_type(&err), (status, kind), "{err:?}");
        let body = error_json(&err);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], kind);
        assert_eq!(body["error"]["message"], err.message.as_str());
    }
    let response = MessagesError(ApiError::queue_full(3)).into_response();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()[header::RETRY_AFTER], "3");
}

// Round trip: every run the Anthropic API can express is parsed back from
// its rendering unchanged.

fn text_strategy() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 .,!?é]{1,12}"
}

fn args_strategy() -> impl Strategy<Value = String> {
    proptest::collection::btree_map("[a-z]{1,4}", any::<i32>(), 0..3)
        .prop_map(|m| serde_json::to_string(&m).unwrap())
}

fn image_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        ("(jpeg|png|gif|webp)", "[A-Za-z0-9+/]{4,12}")
            .prop_map(|(kind, data)| format!("data:image/{kind};base64,{data}")),
        "[a-z]{1,8}".prop_map(|p| format!("https://example.com/{p}.png")),
    ]
}

fn document_strategy() -> impl Strategy<Value = Document> {
    (
        prop_oneof![
            "[A-Za-z0-9+/]{4,12}".prop_map(DocumentSource::PdfBase64),
            "[a-z]{1,8}"
                .prop_map(|p| DocumentSource::PdfUrl(format!("https://example.com/{p}.pdf"))),
        ],
        proptest::option::of(text_strategy()),
        proptest::option::of(text_strategy()),
    )
        .prop_map(|(source, title, context)| Document {
            source,
            title,
            context,
        })
}

fn turn_strategy() -> impl Strategy<Value = ChatMessage> {
    prop_oneof![
        (
            text_strategy(),
            proptest::collection::vec(image_strategy(), 0..2),
            proptest::collection::vec(document_strategy(), 0..2),
        )
            .prop_map(|(content, images, documents)| ChatMessage {
                images,
                documents,
                ..message(Role::User, content)
            }),
        (document_strategy()).prop_map(|document| ChatMessage {
            documents: vec![document],
            ..message(Role::User, String::new())
        }),
        (image_strategy()).prop_map(|image| ChatMessage {
            images: vec![image],
            ..message(Role::User, String::new())
        }),
        text_strategy().prop_map(|c| message(Role::Assistant, c)),
        (
            proptest::option::of(text_strategy()),
            proptest::collection::vec(("[a-z0-9_]{1,8}", "[a-z_]{1,8}", args_strategy()), 1..3)
        )
            .prop_map(|(content, calls)| ChatMessage {
                tool_calls: calls
                    .into_iter()
                    .map(|(id, name, arguments)| ToolCall {
                        id: format!("toolu_{id}"),
                        name,
                        arguments,
                    })
                    .collect(),
                ..message(Role::Assistant, content.unwrap_or_default())
            }),
        (
            "[a-z0-9_]{1,8}",
            proptest::option::of(text_strategy()),
            proptest::collection::vec(image_strategy(), 0..2),
            proptest::collection::vec(document_strategy(), 0..2),
        )
            .prop_map(|(id, content, images, documents)| ChatMessage {
                tool_call_id: Some(format!("toolu_{id}")),
                images,
                documents,
                ..message(Role::Tool, content.unwrap_or_default())
            }),
    ]
}

fn cache_strategy() -> impl Strategy<Value = Option<CacheControl>> {
    proptest::option::of(
        proptest::option::of(prop_oneof![
            Just(CacheTtl::FiveMinutes),
            Just(CacheTtl::OneHour)
        ])
        .prop_map(|ttl| CacheControl { ttl }),
    )
}

fn tool_strategy() -> impl Strategy<Value = ToolDefinition> {
    (
        "[a-zA-Z0-9_-]{1,12}",
        proptest::option::of(text_strategy()),
        proptest::collection::btree_map("[a-z]{1,4}", Just(json!({"type": "string"})), 0..3),
        cache_strategy(),
    )
        .prop_map(
            |(name, description, properties, cache_control)| ToolDefinition {
                name,
                description,
                parameters_json: Some(
                    json!({"type": "object", "properties": properties}).to_string(),
                ),
                cache_control,
            },
        )
}

prop_compose! {
    fn run_strategy()(
        system in proptest::option::of((text_strategy(), cache_strategy())),
        turns in proptest::collection::vec((turn_strategy(), cache_strategy()), 1..6),
        tools in proptest::collection::vec(tool_strategy(), 0..3),
        stream in any::<bool>(),
        max_tokens in 2_u32..100_000,
        stop in proptest::collection::vec(text_strategy(), 0..3),
        temperature in proptest::option::of(0_u8..=100),
        top_p in proptest::option::of(0_u8..=100),
        top_k in proptest::option::of(0_u32..500),
        user in proptest::option::of("[a-z0-9-]{1,12}"),
        choice in proptest::option::of((0_usize..4, "[a-z_]{1,8}", proptest::option::of(any::<bool>()))),
        effort in proptest::option::of(prop_oneof![Just("low"), Just("medium"), Just("high")]),
    ) -> NormalizedRun {
        let mut messages = Vec::new();
        if let Some((system, cache_control)) = system {
            messages.push(ChatMessage { cache_control, ..message(Role::System, system) });
        }
        messages.extend(turns.into_iter().map(|(turn, cache_control)| ChatMessage { cache_control, ..turn }));
        let mut extra = Map::new();
        if let Some(k) = top_k {
            extra.insert("top_k".into(), json!(k));
        }
        if let Some(user) = user {
            extra.insert("user".into(), json!(user));
        }
        // A tool choice needs tools (the Messages API refuses one without).
        let (tool_choice_json, parallel_tool_calls) = match choice.filter(|_| !tools.is_empty()) {
            None => (None, None),
            Some((mode, name, parallel)) => {
                let json = match mode {
                    0 => json!("auto"),
                    1 => json!("required"),
                    2 => json!("none"),
                    _ => json!({"type": "function", "function": {"name": name}}),
                };
                (Some(json.to_string()), parallel)
            }
        };
        let reasoning_effort = effort.map(str::to_owned);
        // A thinking budget is below max_tokens.
        let max_tokens = if reasoning_effort.is_some() { max_tokens.max(HIGH_THINKING_BUDGET_TOKENS + 1) } else { max_tokens };
        NormalizedRun {
            model: "m".into(),
            stream,
            api: RunApi::Chat,
            messages,
            tools,
            params: GenerationParams {
                temperature: temperature.map(|t| f32::from(t) / 100.0),
                top_p: top_p.map(|t| f32::from(t) / 100.0),
                max_tokens: Some(max_tokens),
                stop,
                tool_choice_json,
                parallel_tool_calls,
                reasoning_effort,
                extra_json: (!extra.is_empty()).then(|| Value::Object(extra).to_string()),
                whole_answer: !stream,
                ..GenerationParams::default()
            },
            choices: 1,
        }
    }
}

/// The Messages request the `anthropic` adapter sends for `run`: the
/// other direction of the translation, written once, in the node's adapter.
fn messages_request(run: &NormalizedRun) -> Value {
    let req = iop_wire::RunRequest {
        run_id: 1,
        session_id: "s".into(),
        adapter: iop_wire::AdapterKind::Anthropic,
        target: "t".into(),
        model: run.model.clone(),
        api: run.api,
        messages: run.messages.clone(),
        tools: run.tools.clone(),
        params: run.params.clone(),
        response_stall_timeout_ms: 0,
        deadline_ms: 0,
        credential_lease: None,
        trace_context: None,
        park: None,
        continue_final: false,
    };
    iop_node::adapter::anthropic::request_json(&req, run.stream)
        .expect("a run the front door parsed renders")
}

proptest! {
    #[test]
    fn a_request_survives_a_round_trip_through_the_run_model(run in run_strategy()) {
        let body = messages_request(&run);
        let parsed = parse(body.clone()).map_err(|e| TestCaseError::fail(format!("{e:?} for {body}")))?;
        prop_assert_eq!(&parsed, &run, "{}", body);
        // And the request renders back to the same body.
        prop_assert_eq!(messages_request(&parsed), body);
    }

    #[test]
    fn arbitrary_bodies_are_answered_not_panicked_on(body in crate::api::arbitrary_body::arbitrary_json(4)) {
        let _ = parse_messages_request(body.to_string().as_bytes());
        let _ = parse_count_tokens_request(body.to_string().as_bytes());
    }
}

// Round trip of answers: what a Messages provider answers (as the node's
// `anthropic` adapter reads it into a run) survives the Edge's Messages
// rendering read back by that adapter: the translation in both
// directions agrees, usage and the prompt cache's counts included.

/// One content block of an answer: its pieces as the provider streamed
/// them.
#[derive(Debug, Clone)]
enum AnswerPart {
    Text(Vec<String>),
    Reasoning(Vec<String>),
    /// A tool call: its id, name and the pieces of its JSON arguments.
    Tool(String, String, Vec<String>),
}

fn pieces_strategy() -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec("[a-zA-Z0-9 .,!?é\n\"\\\\]{1,8}", 1..4)
}

fn part_strategy() -> impl Strategy<Value = AnswerPart> {
    prop_oneof![
        pieces_strategy().prop_map(AnswerPart::Text),
        pieces_strategy().prop_map(AnswerPart::Reasoning),
        (
            "[a-z0-9_]{1,8}",
            "[a-zA-Z0-9_-]{1,12}",
            args_strategy(),
            proptest::collection::vec(any::<prop::sample::Index>(), 0..3),
        )
            .prop_map(|(id, name, args, cuts)| {
                // The arguments cut at character boundaries into pieces.
                let bounds: Vec<usize> = args.char_indices().map(|(i, _)| i).skip(1).collect();
                let mut at: Vec<usize> = cuts
                    .iter()
                    .filter(|_| !bounds.is_empty())
                    .map(|c| bounds[c.index(bounds.len())])
                    .collect();
                at.sort_unstable();
                at.dedup();
                let mut pieces = Vec::new();
                let mut from = 0;
                for cut in at.into_iter().chain([args.len()]) {
                    pieces.push(args[from..cut].to_owned());
                    from = cut;
                }
                AnswerPart::Tool(format!("toolu_{id}"), name, pieces)
            }),
    ]
}

/// Usage as a Messages provider reports it: every count a part of the
/// prompt; the cache's counts reported or not.
fn provider_usage_strategy() -> impl Strategy<Value = (Usage, Usage)> {
    (
        0_u64..100_000,
        proptest::option::of(0_u64..100_000),
        proptest::option::of(0_u64..100_000),
        0_u64..8,
        0_u64..10_000,
    )
        .prop_map(|(uncached, read, write, first, more)| {
            let at = |completion_tokens| Usage {
                prompt_tokens: uncached + read.unwrap_or(0) + write.unwrap_or(0),
                completion_tokens,
                cache_read_tokens: read,
                cache_write_tokens: write,
            };
            (at(first), at(first + more))
        })
}

prop_compose! {
    /// A run as the `anthropic` adapter reads a Messages stream into one:
    /// the prompt's usage first, the blocks' events, the final usage and
    /// the end.
    fn provider_answer_strategy()(
        parts in proptest::collection::vec(part_strategy(), 0..5),
        (start, end) in provider_usage_strategy(),
        finish in prop_oneof![
            Just(FinishReason::Stop),
            Just(FinishReason::Length),
            Just(FinishReason::StopSequence),
            Just(FinishReason::ContentFilter),
        ],
    ) -> Vec<RunEventKind> {
        let mut events = vec![RunEventKind::Usage(start)];
        let mut calls = 0;
        for part in parts {
            match part {
                AnswerPart::Text(pieces) => events.extend(pieces.into_iter().map(RunEventKind::TextDelta)),
                AnswerPart::Reasoning(pieces) => {
                    events.extend(pieces.into_iter().map(RunEventKind::ReasoningDelta));
                }
                AnswerPart::Tool(id, name, pieces) => {
                    let call = calls;
                    calls += 1;
                    events.push(tool(call, Some(&format!("{id}_{call}")), Some(&name), ""));
                    events.extend(pieces.iter().map(|p| tool(call, None, None, p)));
                }
            }
        }
        events.push(RunEventKind::Usage(end));
        let finish_reason = if calls > 0 { FinishReason::ToolCalls } else { finish };
        events.push(completed(finish_reason, Some(end)));
        events
    }
}

proptest! {
    #[test]
    fn a_providers_answer_survives_the_messages_rendering_read_back(events in provider_answer_strategy()) {
        // Streamed: the same run, event for event.
        let mut stream = MessagesStream::new("msg_1", "m");
        let mut out = Vec::new();
        for e in &events {
            stream.push(e, &mut out);
        }
        let data: Vec<String> = parse_sse(&out).into_iter().map(|(_, data)| data).collect();
        let read = iop_node::adapter::anthropic::stream_events(data.iter().map(|d| d.as_bytes()));
        prop_assert_eq!(&read, &events, "{}", String::from_utf8_lossy(&out));

        // Whole: the same message, read back and rendered again.
        let mut whole = MessagesAccumulator::new("msg_1", "m");
        for e in &events {
            whole.push(e);
        }
        let message = whole.finish().map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        let mut again = MessagesAccumulator::new("msg_1", "m");
        for e in iop_node::adapter::anthropic::whole_events(message.to_string().as_bytes()) {
            again.push(&e);
        }
        prop_assert_eq!(again.finish().map_err(|e| TestCaseError::fail(format!("{e:?}")))?, message);
    }
}
