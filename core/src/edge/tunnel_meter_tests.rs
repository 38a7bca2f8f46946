use proptest::prelude::*;

use super::*;

/// `body` fed in pieces of `size` bytes, then finished.
fn read(api: TunnelApi, content_type: &str, body: &[u8], size: usize) -> TunnelMeter {
    let mut meter = TunnelMeter::new(api, Some(content_type));
    for piece in body.chunks(size.max(1)) {
        meter.feed(piece);
    }
    meter.finish();
    meter
}

/// The same reading however the body is split.
fn read_every_split(api: TunnelApi, content_type: &str, body: &[u8]) -> TunnelMeter {
    let whole = read(api, content_type, body, body.len());
    for size in [1, 2, 3, 7, 64] {
        let split = read(api, content_type, body, size);
        assert_eq!(split.usage(), whole.usage(), "pieces of {size}");
        assert_eq!(
            split.output_estimate(),
            whole.output_estimate(),
            "pieces of {size}"
        );
        assert_eq!(
            split.reported_input(),
            whole.reported_input(),
            "pieces of {size}"
        );
    }
    whole
}

const SSE: &str = "text/event-stream; charset=utf-8";

#[test]
fn r_ten_2_an_openai_stream_s_last_chunk_reports_the_usage() {
    let body = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hello\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" there\"}}],\"usage\":null}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":30,\"completion_tokens\":2,",
        "\"prompt_tokens_details\":{\"cached_tokens\":24}}}\n\n",
        "data: [DONE]\n\n"
    );
    let meter = read_every_split(TunnelApi::OpenAi, SSE, body.as_bytes());
    assert_eq!(
        meter.usage(),
        Some(Usage {
            prompt_tokens: 30,
            completion_tokens: 2,
            cache_read_tokens: Some(24),
            cache_write_tokens: None,
        })
    );
}

#[test]
fn r_ten_2_an_openai_stream_without_usage_is_estimated_by_its_text_and_tool_arguments() {
    // 8 + 12 + 4 characters of text, reasoning and a tool call's name and
    // arguments: 24 characters, 6 tokens.
    let body = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"abcdefgh\"}}]}\r\n\r\n",
        "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"ijklmnopqrst\"}}]}\r\n\r\n",
        "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"}\"}}]}}]}\r\n\r\n",
        "data: [DONE]\r\n\r\n"
    );
    let meter = read_every_split(TunnelApi::OpenAi, SSE, body.as_bytes());
    assert_eq!(meter.usage(), None);
    assert_eq!(meter.reported_input(), None);
    assert_eq!(meter.output_estimate(), 6);
}

#[test]
fn r_ten_2_a_messages_stream_reports_its_prompt_at_the_start_and_its_output_at_the_end() {
    let start = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"content\":[],",
        "\"usage\":{\"input_tokens\":25,\"cache_read_input_tokens\":10,",
        "\"cache_creation_input_tokens\":5,\"output_tokens\":1}}}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello world!\"}}\n\n",
    );
    let end = concat!(
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n",
        "event: message_stop\n",
        "data: {\"type\":\"message_stop\"}\n\n",
    );
    let whole = format!("{start}{end}");
    let meter = read_every_split(TunnelApi::Messages, SSE, whole.as_bytes());
    assert_eq!(
        meter.usage(),
        Some(Usage {
            prompt_tokens: 40,
            completion_tokens: 15,
            cache_read_tokens: Some(10),
            cache_write_tokens: Some(5),
        })
    );
    // Cut before its end: no report of the output (message_start's
    // `output_tokens` is where it begins), its prompt as reported, its
    // text estimated.
    let cut = read_every_split(TunnelApi::Messages, SSE, start.as_bytes());
    assert_eq!(cut.usage(), None);
    assert_eq!(cut.reported_input(), Some(40));
    assert_eq!(cut.output_estimate(), 3, "12 characters");
}

#[test]
fn r_ten_2_a_responses_stream_reports_in_response_completed() {
    let body = concat!(
        "event: response.created\n",
        "data: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null}}\n\n",
        "event: response.output_text.delta\n",
        "data: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi there\"}\n\n",
        "event: response.output_text.done\n",
        "data: {\"type\":\"response.output_text.done\",\"text\":\"Hi there\"}\n\n",
        "event: response.completed\n",
        "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"input_tokens\":12,",
        "\"input_tokens_details\":{\"cached_tokens\":4},\"output_tokens\":7,",
        "\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":19}}}\n\n",
    );
    let meter = read_every_split(TunnelApi::OpenAi, SSE, body.as_bytes());
    assert_eq!(
        meter.usage(),
        Some(Usage {
            prompt_tokens: 12,
            completion_tokens: 7,
            cache_read_tokens: Some(4),
            cache_write_tokens: None,
        })
    );
    let cut = &body[..body.find("event: response.completed").unwrap()];
    let cut = read_every_split(TunnelApi::OpenAi, SSE, cut.as_bytes());
    assert_eq!(cut.usage(), None);
    assert_eq!(
        cut.output_estimate(),
        2,
        "the delta's 8 characters, not the done event's"
    );
}

#[test]
fn r_ten_2_an_ollama_stream_reports_its_counts_on_its_last_line() {
    let chat = concat!(
        "{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"Hey\"},\"done\":false}\n",
        "{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":",
        "[{\"function\":{\"name\":\"get\",\"arguments\":{\"city\":\"Oslo\"}}}]},\"done\":false}\n",
        "{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,",
        "\"prompt_eval_count\":26,\"eval_count\":9}"
    );
    let meter = read_every_split(TunnelApi::Ollama, "application/x-ndjson", chat.as_bytes());
    assert_eq!(meter.usage(), Some(Usage::tokens(26, 9)));
    let cut = &chat[..chat.rfind('\n').unwrap() + 1];
    let cut = read_every_split(TunnelApi::Ollama, "application/x-ndjson", cut.as_bytes());
    assert_eq!(cut.usage(), None);
    // "Hey", "get" and `{"city":"Oslo"}`: 3 + 3 + 15 characters.
    assert_eq!(cut.output_estimate(), 6);
    let generate = concat!(
        "{\"response\":\"abcd\",\"thinking\":\"efgh\",\"done\":false}\n",
        "{\"response\":\"\",\"done\":true,\"eval_count\":2}\n"
    );
    let meter = read_every_split(
        TunnelApi::Ollama,
        "application/x-ndjson",
        generate.as_bytes(),
    );
    assert_eq!(
        meter.usage(),
        Some(Usage::tokens(0, 2)),
        "a cached prompt has no count"
    );
    let cut = read_every_split(
        TunnelApi::Ollama,
        "application/x-ndjson",
        generate.lines().next().unwrap().as_bytes(),
    );
    assert_eq!(cut.output_estimate(), 2);
}

#[test]
fn r_ten_2_a_whole_answer_s_usage_is_read_from_its_end_not_from_its_text() {
    // The answer's text and an echoed tool schema both hold a `usage`,
    // neither of them the report.
    let body = r#"{
  "id": "c",
  "tools": [{"parameters": {"properties": {"usage": {"type": "string"}}}}],
  "choices": [{"message": {"content": "the \"usage\": {\"completion_tokens\": 999}"}}],
  "usage": {"prompt_tokens": 11, "completion_tokens": 3, "prompt_tokens_details": null},
  "system_fingerprint": "x"
}"#;
    let meter = read_every_split(TunnelApi::OpenAi, "application/json", body.as_bytes());
    assert_eq!(meter.usage(), Some(Usage::tokens(11, 3)));
    // After the report: a schema's `usage` (no count) and text quoting one.
    let responses = r#"{"usage":{"input_tokens":3,"output_tokens":4},"tools":[{"parameters":{"properties":{"usage":{"type":"string"}}}}],"metadata":{"note":"\\\"usage\\\": {\\\"output_tokens\\\": 9}"}}"#;
    let meter = read_every_split(TunnelApi::OpenAi, "application/json", responses.as_bytes());
    assert_eq!(meter.usage(), Some(Usage::tokens(3, 4)));
    // Only text quoting a report: none.
    let quoted = r#"{"choices":[{"message":{"content":"\"usage\": {\"completion_tokens\": 999}, \\\"eval_count\\\": 3"}}]}"#;
    let meter = read_every_split(TunnelApi::OpenAi, "application/json", quoted.as_bytes());
    assert_eq!(meter.usage(), None);
    let messages = r#"{"id":"m","content":[{"type":"text","text":"Hi"}],"stop_reason":"end_turn","usage":{"input_tokens":7,"cache_read_input_tokens":3,"output_tokens":2}}"#;
    let meter = read_every_split(TunnelApi::Messages, "application/json", messages.as_bytes());
    assert_eq!(
        meter.usage(),
        Some(Usage {
            prompt_tokens: 10,
            completion_tokens: 2,
            cache_read_tokens: Some(3),
            cache_write_tokens: None,
        })
    );
    let ollama = r#"{"model":"m","message":{"content":"say \"eval_count\": 5"},"done":true,"prompt_eval_count":26,"eval_count":298}"#;
    let meter = read_every_split(TunnelApi::Ollama, "application/json", ollama.as_bytes());
    assert_eq!(meter.usage(), Some(Usage::tokens(26, 298)));
}

#[test]
fn r_ten_2_an_embedding_s_report_has_no_output_and_is_whole() {
    let openai = br#"{"object":"list","data":[{"embedding":[0.1,-0.2]}],"usage":{"prompt_tokens":5,"total_tokens":5}}"#;
    let meter = read_every_split(TunnelApi::OpenAi, "application/json", openai);
    assert_eq!(meter.usage(), Some(Usage::tokens(5, 0)));
    let ollama =
        br#"{"model":"m","embeddings":[[0.1,-0.2]],"total_duration":1,"prompt_eval_count":8}"#;
    let meter = read_every_split(TunnelApi::Ollama, "application/json", ollama);
    assert_eq!(meter.usage(), Some(Usage::tokens(8, 0)));
}

#[test]
fn r_ten_2_a_long_whole_answer_keeps_only_its_end_and_finds_the_usage_there() {
    let text = "x".repeat(10 * TAIL_BYTES);
    let body = format!(
        r#"{{"choices":[{{"message":{{"content":"{text}"}}}}],"usage":{{"prompt_tokens":5,"completion_tokens":40000}}}}"#
    );
    let mut meter = TunnelMeter::new(TunnelApi::OpenAi, Some("application/json"));
    for piece in body.as_bytes().chunks(1000) {
        meter.feed(piece);
        assert!(meter.buf.len() <= 2 * TAIL_BYTES);
    }
    meter.feed(b"");
    meter.finish();
    assert_eq!(meter.usage(), Some(Usage::tokens(5, 40_000)));
    // One frame larger than the tail keeps only the tail.
    let mut meter = TunnelMeter::new(TunnelApi::OpenAi, None);
    meter.feed(body.as_bytes());
    assert_eq!(meter.buf.len(), TAIL_BYTES);
    meter.finish();
    assert_eq!(meter.usage(), Some(Usage::tokens(5, 40_000)));
}

#[test]
fn r_ten_2_a_whole_answer_without_usage_is_estimated_by_its_bytes() {
    let body = br#"{"choices":[{"message":{"content":"hello"}}]}"#;
    let meter = read_every_split(TunnelApi::OpenAi, "application/json", body);
    assert_eq!(meter.usage(), None);
    assert_eq!(meter.output_estimate(), (body.len() as u64).div_ceil(4));
}

#[test]
fn r_lim_a_streamed_line_past_the_bound_is_counted_by_its_bytes_not_kept() {
    let long = format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
        "y".repeat(MAX_LINE_BYTES)
    );
    let body = format!(
        "{long}data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":2}}}}\n\n"
    );
    for size in [1000, 4096, MAX_LINE_BYTES + 10] {
        let mut meter = TunnelMeter::new(TunnelApi::OpenAi, Some(SSE));
        for piece in body.as_bytes().chunks(size) {
            meter.feed(piece);
            assert!(meter.buf.len() <= MAX_LINE_BYTES, "pieces of {size}");
        }
        meter.finish();
        assert_eq!(meter.usage(), Some(Usage::tokens(1, 2)), "pieces of {size}");
        // Unreported: the long line by its bytes.
        let mut cut = TunnelMeter::new(TunnelApi::OpenAi, Some(SSE));
        for piece in long.as_bytes().chunks(size) {
            cut.feed(piece);
        }
        cut.finish();
        let line = long.trim_end().len() as u64;
        assert_eq!(cut.output_estimate(), line.div_ceil(4), "pieces of {size}");
    }
}

#[test]
fn content_types_choose_the_framing() {
    let body =
        b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n";
    for content_type in ["text/event-stream", "Text/Event-Stream; charset=utf-8"] {
        let meter = read(TunnelApi::OpenAi, content_type, body, 5);
        assert_eq!(meter.framing, Framing::Lines, "{content_type}");
        assert_eq!(meter.usage(), Some(Usage::tokens(1, 2)));
    }
    let headers = vec![("Content-Type".to_owned(), "application/x-ndjson".to_owned())];
    assert_eq!(
        TunnelMeter::from_head(TunnelApi::Ollama, &headers).framing,
        Framing::Lines
    );
    assert_eq!(
        TunnelMeter::from_head(TunnelApi::Ollama, &[]).framing,
        Framing::Whole
    );
}

proptest! {
    /// Whatever a provider sends, the meter keeps at most its bounds and
    /// never panics; its estimate never exceeds the body's bytes.
    #[test]
    fn any_body_is_read_within_bounds(
        chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..40),
        lines in any::<bool>(),
        api in prop_oneof![Just(TunnelApi::OpenAi), Just(TunnelApi::Messages), Just(TunnelApi::Ollama)],
    ) {
        let content_type = if lines { "text/event-stream" } else { "application/json" };
        let mut meter = TunnelMeter::new(api, Some(content_type));
        let mut total = 0u64;
        for chunk in &chunks {
            meter.feed(chunk);
            total += chunk.len() as u64;
            prop_assert!(meter.buf.len() <= MAX_LINE_BYTES.max(2 * TAIL_BYTES));
        }
        meter.finish();
        prop_assert!(meter.output_estimate() <= total.div_ceil(4));
    }
}
