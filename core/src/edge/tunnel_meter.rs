//! What a tunnelled answer used (R-TEN-2): the usage its provider reported
//! in its own format, read from the bytes the Edge relays.
//!
//! A tunnel relays the provider's answer as it came; no run event carries
//! its usage. The meter reads the body beside the relay and finds:
//!
//! * the usage the provider reported: OpenAI's `usage` (a whole answer's,
//!   or a stream's last chunk with `stream_options.include_usage`; the
//!   Responses API's `response.usage` in `response.completed`), the
//!   Messages API's (`message_start`'s input and cache counts,
//!   `message_delta`'s output; a whole answer's `usage`), Ollama's
//!   `prompt_eval_count` and `eval_count`. A streamed report counts once
//!   it gives the output (the last one wins: every API reports running
//!   totals); a whole answer's is whole as it is (an embedding's has no
//!   output);
//! * else the text it produced, estimated as every other unreported
//!   output is ([`CHARS_PER_TOKEN`]): content, reasoning and tool-call
//!   arguments of each streamed event. A whole (non-streamed) answer
//!   without a report is estimated by its bytes, an upper estimate.
//!
//! Bounded whatever the provider sends: a streamed answer is read line by
//! line, a line longer than [`MAX_LINE_BYTES`] is not parsed (its bytes
//! count as text); of a whole answer only the last [`TAIL_BYTES`] are
//! kept, where every API puts its usage.

use iop_wire::{AdapterKind, Usage};
use serde::Deserialize;

use crate::provider_usage::{PromptCounting, ReportedCounts, UsageReport};

use super::prompt_estimate::CHARS_PER_TOKEN;

/// The longest streamed line (an SSE `data` line, an NDJSON object) the
/// meter parses; a longer one counts by its bytes.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// How much of a whole answer's end the meter keeps to find its usage.
pub const TAIL_BYTES: usize = 16 * 1024;

/// The provider API a raw client request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TunnelApi {
    /// OpenAI (`/v1/...`): `openai` and `mock` adapters.
    OpenAi,
    /// Ollama (`/api/...`): `ollama` adapters.
    Ollama,
    /// Anthropic's Messages API (`/v1/messages`): `anthropic` adapters,
    /// and the OpenAI-compatible servers that also serve it (vLLM,
    /// llama.cpp's server; the mock).
    Messages,
}

impl TunnelApi {
    /// Can a provider of `adapter` take this raw request?
    pub fn spoken_by(self, adapter: AdapterKind) -> bool {
        matches!(
            (self, adapter),
            (TunnelApi::OpenAi, AdapterKind::OpenAi | AdapterKind::Mock)
                | (TunnelApi::Ollama, AdapterKind::Ollama)
                | (
                    TunnelApi::Messages,
                    AdapterKind::Anthropic | AdapterKind::OpenAi | AdapterKind::Mock
                )
        )
    }
}

/// How the body is framed, from its `content-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Server-sent events or newline-delimited JSON: one event per line.
    Lines,
    /// One JSON document.
    Whole,
}

/// Reads what one tunnelled attempt's answer used; see the module docs.
#[derive(Debug, Clone)]
pub struct TunnelMeter {
    api: TunnelApi,
    framing: Framing,
    /// [`Framing::Lines`]: the unterminated line so far;
    /// [`Framing::Whole`]: the body's last bytes.
    buf: Vec<u8>,
    /// The current line passed [`MAX_LINE_BYTES`]: skipped to its end.
    skipping: bool,
    body_bytes: u64,
    /// Characters of text read from streamed events.
    text_chars: u64,
    /// Bytes of lines too long to parse.
    unread_bytes: u64,
    reported: ReportedCounts,
    finished: bool,
}

impl TunnelMeter {
    /// A meter for an answer of `api` whose head said `content_type`.
    pub fn new(api: TunnelApi, content_type: Option<&str>) -> Self {
        let essence = content_type
            .and_then(|t| t.split(';').next())
            .map(|t| t.trim().to_ascii_lowercase())
            .unwrap_or_default();
        let framing = match essence.as_str() {
            "text/event-stream"
            | "application/x-ndjson"
            | "application/jsonl"
            | "application/jsonlines" => Framing::Lines,
            _ => Framing::Whole,
        };
        Self {
            api,
            framing,
            buf: Vec::new(),
            skipping: false,
            body_bytes: 0,
            text_chars: 0,
            unread_bytes: 0,
            reported: ReportedCounts::default(),
            finished: false,
        }
    }

    /// A meter for a tunnel whose head carried `headers`.
    pub fn from_head(api: TunnelApi, headers: &[(String, String)]) -> Self {
        let content_type = headers
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
            .map(|(_, value)| value.as_str());
        Self::new(api, content_type)
    }

    /// Read the next bytes of the body.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.finished {
            return;
        }
        self.body_bytes = self.body_bytes.saturating_add(bytes.len() as u64);
        match self.framing {
            Framing::Whole if bytes.len() >= TAIL_BYTES => {
                self.buf.clear();
                self.buf
                    .extend_from_slice(&bytes[bytes.len() - TAIL_BYTES..]);
            }
            Framing::Whole => {
                self.buf.extend_from_slice(bytes);
                if self.buf.len() > 2 * TAIL_BYTES {
                    let cut = self.buf.len() - TAIL_BYTES;
                    self.buf.drain(..cut);
                }
            }
            Framing::Lines => self.feed_lines(bytes),
        }
    }

    /// The body ended: read what is left (a last line without its end, a
    /// whole answer's usage).
    pub fn finish(&mut self) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let rest = std::mem::take(&mut self.buf);
        match self.framing {
            Framing::Lines if !self.skipping => self.line(&rest),
            Framing::Lines => {}
            Framing::Whole => self.whole_tail(&rest),
        }
    }

    /// The usage the provider reported, once it gave the output.
    pub fn usage(&self) -> Option<Usage> {
        self.reported.usage(self.counting())
    }

    /// The prompt tokens the provider reported before its output (a
    /// Messages stream's `message_start`), for an attempt cut before its
    /// usage was complete.
    pub fn reported_input(&self) -> Option<u64> {
        self.reported.prompt_tokens(self.counting())
    }

    fn counting(&self) -> PromptCounting {
        match self.api {
            // The Messages API counts the cache's parts apart.
            TunnelApi::Messages => PromptCounting::Parts,
            TunnelApi::OpenAi | TunnelApi::Ollama => PromptCounting::Whole,
        }
    }

    /// The output tokens estimated from what was read, for an answer
    /// without a complete report: its text (and any line too long to
    /// read, by its bytes); a whole answer by its bytes.
    pub fn output_estimate(&self) -> u64 {
        match self.framing {
            Framing::Lines => self
                .text_chars
                .saturating_add(self.unread_bytes)
                .div_ceil(CHARS_PER_TOKEN),
            Framing::Whole => self.body_bytes.div_ceil(CHARS_PER_TOKEN),
        }
    }

    fn feed_lines(&mut self, mut bytes: &[u8]) {
        while let Some(end) = memchr::memchr2(b'\n', b'\r', bytes) {
            let (head, rest) = (&bytes[..end], &bytes[end + 1..]);
            if self.skipping {
                self.unread_bytes = self.unread_bytes.saturating_add(head.len() as u64);
                self.skipping = false;
            } else if self.buf.is_empty() {
                self.line(head);
            } else if self.buf.len() + head.len() > MAX_LINE_BYTES {
                self.unread_bytes = self
                    .unread_bytes
                    .saturating_add((self.buf.len() + head.len()) as u64);
                self.buf.clear();
            } else {
                let mut line = std::mem::take(&mut self.buf);
                line.extend_from_slice(head);
                self.line(&line);
                line.clear();
                self.buf = line;
            }
            bytes = rest;
        }
        if self.skipping {
            self.unread_bytes = self.unread_bytes.saturating_add(bytes.len() as u64);
        } else if self.buf.len() + bytes.len() > MAX_LINE_BYTES {
            self.unread_bytes = self
                .unread_bytes
                .saturating_add((self.buf.len() + bytes.len()) as u64);
            self.buf.clear();
            self.skipping = true;
        } else {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// One complete line: an SSE `data` field or an NDJSON object; other
    /// lines (SSE's `event`, `id`, comments, blank ones) say nothing.
    fn line(&mut self, line: &[u8]) {
        let json = match line.strip_prefix(b"data:") {
            Some(data) => data.strip_prefix(b" ").unwrap_or(data),
            None => line,
        };
        let json = json.trim_ascii();
        if !json.starts_with(b"{") {
            return;
        }
        if let Ok(event) = serde_json::from_slice::<Event>(json) {
            self.event(event);
        }
    }

    fn event(&mut self, event: Event) {
        if let Some(usage) = &event.usage {
            self.reported.take(usage, true);
        }
        // `message_start`'s: the prompt's counts; its output count is
        // where the answer begins, not a report of it.
        if let Some(Nested::Object(message)) = &event.message {
            if let Some(usage) = &message.usage {
                self.reported.take(usage, false);
            }
            self.text_chars += message.text_chars();
        }
        match &event.response {
            Some(Nested::Object(response)) => {
                if let Some(usage) = &response.usage {
                    self.reported.take(usage, true);
                }
            }
            Some(Nested::Text(text)) => self.text_chars += chars(text),
            _ => {}
        }
        match &event.delta {
            Some(Nested::Object(delta)) => self.text_chars += delta.text_chars(),
            Some(Nested::Text(text)) => self.text_chars += chars(text),
            _ => {}
        }
        for choice in event.choices.iter().flatten() {
            self.text_chars += choice.text.as_deref().map_or(0, chars);
            if let Some(delta) = &choice.delta {
                self.text_chars += delta.text_chars();
            }
        }
        self.text_chars += event.thinking.as_deref().map_or(0, chars);
        self.ollama_counts(event.prompt_eval_count, event.eval_count);
    }

    /// Ollama's counts: with the output's, a prompt it does not count (it
    /// was all cached) is 0.
    fn ollama_counts(&mut self, prompt: Option<u64>, output: Option<u64>) {
        let r = &mut self.reported;
        r.input = prompt.or(r.input);
        if output.is_some() {
            r.output = output;
            r.input = r.input.or(Some(0));
        }
    }

    /// A whole answer's last bytes: the last `usage` object (or Ollama's
    /// counts) in them. A whole answer's report is its last: a count it
    /// leaves out is 0 (an embedding's output).
    fn whole_tail(&mut self, tail: &[u8]) {
        for at in keys(tail, b"\"usage\"") {
            if let Some(usage) = value_at::<UsageReport>(tail, at)
                && (usage.input().is_some() || usage.output().is_some())
            {
                self.reported.take(&usage, true);
                let r = &mut self.reported;
                r.input = r.input.or(Some(0));
                r.output = r.output.or(Some(0));
                return;
            }
        }
        let count = |key: &[u8]| keys(tail, key).find_map(|at| value_at::<u64>(tail, at));
        let (prompt, output) = (count(b"\"prompt_eval_count\""), count(b"\"eval_count\""));
        if prompt.is_some() || output.is_some() {
            self.ollama_counts(prompt, Some(output.unwrap_or(0)));
        }
    }
}

fn chars(text: &str) -> u64 {
    text.chars().count() as u64
}

fn calls_chars(calls: &Option<Vec<ToolCall>>) -> u64 {
    calls.iter().flatten().map(ToolCall::chars).sum()
}

/// Where the value of `key` (quoted) as an object's key begins in `json`,
/// last first: the quoted key followed by `:`. Never inside a string: a
/// string's quotes are escaped, so its text never holds `"key"`.
fn keys<'a>(json: &'a [u8], key: &'a [u8]) -> impl Iterator<Item = usize> + 'a {
    memchr::memmem::rfind_iter(json, key).filter_map(move |at| {
        let after = at + key.len();
        let colon = after
            + json[after..]
                .iter()
                .take_while(|b| b.is_ascii_whitespace())
                .count();
        (json.get(colon) == Some(&b':')).then_some(colon + 1)
    })
}

/// The JSON value that starts at `at` (whatever follows it).
fn value_at<T: serde::de::DeserializeOwned>(json: &[u8], at: usize) -> Option<T> {
    serde_json::Deserializer::from_slice(json.get(at..)?)
        .into_iter::<T>()
        .next()?
        .ok()
}

/// One streamed event of any of the APIs: only the fields that say what
/// the answer used.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Event {
    usage: Option<UsageReport>,
    /// Messages: `message_start`'s message; Ollama's chat message.
    message: Option<Nested<Message>>,
    /// Responses: the response of `response.completed`; Ollama's
    /// generated text.
    response: Option<Nested<Response>>,
    /// Messages: a content block's delta; Responses: a text delta.
    delta: Option<Nested<Delta>>,
    choices: Option<Vec<Choice>>,
    thinking: Option<String>,
    prompt_eval_count: Option<u64>,
    eval_count: Option<u64>,
}

/// A field that is text in one API and an object in another (anything
/// else is read and ignored, so an odd field never hides the event).
#[derive(Deserialize)]
#[serde(untagged)]
enum Nested<T> {
    Text(String),
    Object(T),
    Other(serde::de::IgnoredAny),
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Message {
    usage: Option<UsageReport>,
    content: Option<Nested<serde::de::IgnoredAny>>,
    thinking: Option<String>,
    tool_calls: Option<Vec<ToolCall>>,
}

impl Message {
    fn text_chars(&self) -> u64 {
        let content = match &self.content {
            Some(Nested::Text(text)) => chars(text),
            _ => 0,
        };
        content + self.thinking.as_deref().map_or(0, chars) + calls_chars(&self.tool_calls)
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Response {
    usage: Option<UsageReport>,
}

/// A delta object: OpenAI's `choices[].delta`, the Messages API's
/// `content_block_delta`'s.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Delta {
    content: Option<String>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
    text: Option<String>,
    partial_json: Option<String>,
    thinking: Option<String>,
    tool_calls: Option<Vec<ToolCall>>,
}

impl Delta {
    fn text_chars(&self) -> u64 {
        [
            &self.content,
            &self.reasoning_content,
            &self.reasoning,
            &self.text,
            &self.partial_json,
            &self.thinking,
        ]
        .into_iter()
        .map(|t| t.as_deref().map_or(0, chars))
        .sum::<u64>()
            + calls_chars(&self.tool_calls)
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Choice {
    text: Option<String>,
    delta: Option<Delta>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ToolCall {
    function: Option<Function>,
}

impl ToolCall {
    fn chars(&self) -> u64 {
        self.function.as_ref().map_or(0, |f| {
            f.name.as_deref().map_or(0, chars)
                + match &f.arguments {
                    Some(Nested::Text(text)) => chars(text),
                    // Ollama's arguments are an object: counted by its
                    // JSON's length.
                    Some(Nested::Object(value)) => value.to_string().chars().count() as u64,
                    _ => 0,
                }
        })
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Function {
    name: Option<String>,
    arguments: Option<Nested<serde_json::Value>>,
}

#[cfg(test)]
#[path = "tunnel_meter_tests.rs"]
mod tests;
