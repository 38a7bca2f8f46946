//! How a streamed answer is framed: Server-Sent Events (the OpenAI APIs) or
//! NDJSON lines (Ollama), written straight into the response body.
//!
//! The stream encoders append whole frames to one body buffer per delivery
//! ([`AnswerStream`](super::endpoint::AnswerStream)), so a streamed chunk
//! costs one JSON serialization into bytes the client receives as they are:
//! no JSON tree, no per-frame buffer. Payloads are compact JSON, which never
//! contains a line break, so each SSE payload is exactly one `data:` line.

use serde::Serialize;

/// The SSE keep-alive comment, sent when a stream was silent for
/// `edge.sse_keep_alive_ms`: a comment line alone, with no blank line after
/// it. A blank line ends an event, and a client that keeps the last event
/// id across events (as the SSE specification says; the official OpenAI
/// SDK does) takes a blank line after an `id:` was seen as an event with
/// empty data, which it then fails to parse as JSON. A comment line alone
/// dispatches nothing in any parser and still moves bytes, which is all a
/// keep-alive is for.
pub const SSE_KEEP_ALIVE: &[u8] = b":\n";

/// Append one SSE event, `[event: NAME\n]data: PAYLOAD\n\n`, to `out`;
/// `payload` writes the one-line payload.
pub fn sse_event(out: &mut Vec<u8>, name: Option<&str>, payload: impl FnOnce(&mut Vec<u8>)) {
    if let Some(name) = name {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
    }
    out.extend_from_slice(b"data: ");
    let start = out.len();
    payload(out);
    debug_assert!(
        !out[start..].contains(&b'\n') && !out[start..].contains(&b'\r'),
        "an SSE payload is one line"
    );
    out.extend_from_slice(b"\n\n");
}

/// Numbers the SSE events of a durable stream with `id:` lines, 0, 1, 2,
/// ... in the order written, and leaves out those a resumed client already
/// has (`skip_through`: the last id it received). Every rendering of a
/// record writes the same events in the same order, so an event's id is
/// the same in every rendering (R-JRN-2).
#[derive(Debug, Clone, Default)]
pub struct SseNumbering {
    next_id: u64,
    skip_through: Option<u64>,
}

impl SseNumbering {
    /// Number from 0, writing only events after `skip_through`.
    pub fn after(skip_through: Option<u64>) -> Self {
        Self {
            next_id: 0,
            skip_through,
        }
    }

    /// Copy the whole SSE events in `events` to `out`, each numbered, the
    /// skipped ones left out. `events` holds complete events only (as the
    /// encoders write them).
    pub fn number(&mut self, events: &[u8], out: &mut Vec<u8>) {
        let mut rest = events;
        while !rest.is_empty() {
            let end = rest
                .windows(2)
                .position(|w| w == b"\n\n")
                .map_or(rest.len(), |i| i + 2);
            let (event, tail) = rest.split_at(end);
            rest = tail;
            let id = self.next_id;
            self.next_id += 1;
            if self.skip_through.is_some_and(|skip| id <= skip) {
                continue;
            }
            out.extend_from_slice(b"id: ");
            out.extend_from_slice(id.to_string().as_bytes());
            out.push(b'\n');
            out.extend_from_slice(event);
        }
    }
}

/// Append one SSE `data:` event whose payload is `value` as JSON.
pub fn sse_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, name: Option<&str>, value: &T) {
    sse_event(out, name, |out| write_json(out, value));
}

/// Append one NDJSON line, `value` as JSON then `\n`, to `out`.
pub fn ndjson_line<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    write_json(out, value);
    out.push(b'\n');
}

/// Append `value` as compact JSON (what `serde_json::to_string` writes).
pub fn write_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    let start = out.len();
    // Serializing into memory fails only for a map with non-string keys,
    // which no payload here has; a failure leaves nothing half-written.
    if serde_json::to_writer(&mut *out, value).is_err() {
        debug_assert!(false, "payload is not serializable");
        out.truncate(start);
    }
}

/// The `(event name, data)` of every SSE event in `body`, for tests; each
/// event must be one of [`sse_event`]'s (one `data:` line).
#[cfg(test)]
pub(crate) fn parse_sse(body: &[u8]) -> Vec<(Option<String>, String)> {
    let body = std::str::from_utf8(body).expect("UTF-8 body");
    let Some(body) = body.strip_suffix("\n\n") else {
        assert!(body.is_empty(), "unterminated event: {body:?}");
        return Vec::new();
    };
    body.split("\n\n")
        .map(|event| {
            let (name, data) = match event.strip_prefix("event: ") {
                Some(rest) => {
                    let (name, data) = rest.split_once('\n').expect("event then data");
                    (Some(name.to_owned()), data)
                }
                None => (None, event),
            };
            let data = data.strip_prefix("data: ").expect("one data line");
            assert!(!data.contains('\n'), "one data line: {event:?}");
            (name, data.to_owned())
        })
        .collect()
}

/// The JSON data of every SSE event in `body`, for tests.
#[cfg(test)]
pub(crate) fn sse_json_payloads(body: &[u8]) -> Vec<serde_json::Value> {
    parse_sse(body)
        .into_iter()
        .map(|(_, data)| serde_json::from_str(&data).expect("JSON payload"))
        .collect()
}

/// Every NDJSON line of `body` as JSON, for tests.
#[cfg(test)]
pub(crate) fn ndjson_values(body: &[u8]) -> Vec<serde_json::Value> {
    let body = std::str::from_utf8(body).expect("UTF-8 body");
    assert!(body.is_empty() || body.ends_with('\n'), "unterminated line");
    body.lines()
        .map(|line| serde_json::from_str(line).expect("JSON line"))
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_sse_event_is_its_name_one_data_line_and_a_blank_line() {
        let mut out = Vec::new();
        sse_json(&mut out, None, &json!({"a": "x\ny"}));
        sse_json(&mut out, Some("response.created"), &json!({"b": 1}));
        sse_event(&mut out, None, |p| p.extend_from_slice(b"[DONE]"));
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "data: {\"a\":\"x\\ny\"}\n\nevent: response.created\ndata: {\"b\":1}\n\ndata: [DONE]\n\n"
        );
    }

    #[test]
    fn ndjson_lines_are_compact_json_each_ended_by_a_newline() {
        let mut out = Vec::new();
        ndjson_line(&mut out, &json!({"done": false, "model": "m"}));
        ndjson_line(&mut out, &json!({"error": "e"}));
        assert_eq!(
            out,
            b"{\"done\":false,\"model\":\"m\"}\n{\"error\":\"e\"}\n"
        );
    }

    fn events(n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..n {
            sse_json(&mut out, Some("e"), &serde_json::json!({ "i": i }));
        }
        out
    }

    #[test]
    fn durable_sse_events_are_numbered_in_order_across_writes() {
        let mut numbering = SseNumbering::after(None);
        let mut out = Vec::new();
        numbering.number(&events(2), &mut out);
        numbering.number(&events(1), &mut out);
        let ids: Vec<&str> = std::str::from_utf8(&out)
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("id: "))
            .collect();
        assert_eq!(ids, ["0", "1", "2"]);
        assert!(out.ends_with(b"\n\n"));
    }

    #[test]
    fn a_resumed_stream_writes_exactly_the_events_after_its_id() {
        let all = events(5);
        let mut whole = Vec::new();
        SseNumbering::after(None).number(&all, &mut whole);
        for skip in 0..5u64 {
            let mut rest = Vec::new();
            SseNumbering::after(Some(skip)).number(&all, &mut rest);
            let text = std::str::from_utf8(&whole).unwrap();
            let expected: Vec<&str> = text
                .split_inclusive("\n\n")
                .skip(skip as usize + 1)
                .collect();
            assert_eq!(std::str::from_utf8(&rest).unwrap(), expected.concat());
        }
    }
}
