//! `POST /v1/embeddings`, Ollama's `POST /api/embed`, and `POST
//! /v1/completions` (legacy text completions, with a fill-in-the-middle
//! `suffix`): parsing and answers.
//!
//! An embeddings request is a [`RunApi::Embeddings`] run with one user
//! message per input; its answer is one [`iop_wire::Embedding`] per input
//! and the provider's prompt token count. A text completion is a
//! [`RunApi::Completion`] run whose one user message is the prompt.

use base64::Engine as _;
use iop_wire::{ChatMessage, FinishReason, GenerationParams, Role, RunApi, RunEventKind, Usage};
use serde_json::{Value, json};

use super::NormalizedRun;
use super::chat::{MAX_STOP_SEQUENCES, parse_model, parse_stop, usage_json};
use super::error::ApiError;
use super::framing;
use super::request_object::{RequestObject, element, parse_body};
use super::surface::pass_through_fields;
use super::transcript::Transcript;

/// Most inputs one embeddings request may carry (OpenAI's limit).
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// The `/v1/embeddings` fields the Edge interprets.
const EMBEDDINGS_FIELDS: &[&str] = &["model", "input", "encoding_format"];

/// The `/api/embed` fields the Edge interprets or Ollama-only ones with no
/// meaning for another provider.
const OLLAMA_EMBED_FIELDS: &[&str] = &["model", "input", "truncate", "keep_alive", "options"];

/// The `/v1/completions` fields the Edge interprets.
const COMPLETIONS_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "suffix",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "echo",
    "best_of",
    "logprobs",
];

fn user_message(content: String) -> ChatMessage {
    ChatMessage {
        role: Role::User,
        content,
        tool_calls: Vec::new(),
        tool_call_id: None,
        name: None,
        images: Vec::new(),
        cache_control: None,
        documents: Vec::new(),
    }
}

/// `input`: one string or an array of strings (token arrays are refused).
fn parse_inputs(root: &RequestObject<'_>) -> Result<Vec<ChatMessage>, ApiError> {
    match root.get("input") {
        None => Err(ApiError::missing_parameter("input")),
        Some(Value::String(s)) => Ok(vec![user_message(s.clone())]),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(ApiError::invalid_value("input", "must not be empty."));
            }
            if items.len() > MAX_EMBEDDING_INPUTS {
                return Err(ApiError::invalid_value(
                    "input",
                    &format!("must contain at most {MAX_EMBEDDING_INPUTS} inputs."),
                ));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) => Ok(user_message(s.clone())),
                    Value::Array(_) | Value::Number(_) => Err(ApiError::unsupported_parameter(
                        &element("input", i),
                        "Token arrays are not supported; send text.",
                    )),
                    _ => Err(ApiError::invalid_type(&element("input", i), "a string")),
                })
                .collect()
        }
        Some(_) => Err(ApiError::invalid_type(
            "input",
            "a string or an array of strings",
        )),
    }
}

fn embeddings_run(
    model: String,
    messages: Vec<ChatMessage>,
    params: GenerationParams,
) -> NormalizedRun {
    NormalizedRun {
        model,
        stream: false,
        api: RunApi::Embeddings,
        messages,
        tools: Vec::new(),
        params,
        choices: 1,
    }
}

/// Parse a `POST /v1/embeddings` body; the option says whether the client
/// wants base64 vectors (`encoding_format: "base64"`, the SDKs' default).
pub fn parse_embeddings_request(body: &[u8]) -> Result<(NormalizedRun, bool), ApiError> {
    let value = parse_body(body)?;
    let root = RequestObject::root(&value)?;
    let model = parse_model(&root)?;
    let messages = parse_inputs(&root)?;
    let base64 = match root.string("encoding_format")? {
        None | Some("float") => false,
        Some("base64") => true,
        Some(_) => {
            return Err(ApiError::invalid_value(
                "encoding_format",
                "must be 'float' or 'base64'.",
            ));
        }
    };
    let params = GenerationParams {
        extra_json: pass_through_fields(&root, EMBEDDINGS_FIELDS)?,
        whole_answer: true,
        ..GenerationParams::default()
    };
    Ok((embeddings_run(model, messages, params), base64))
}

/// Parse a `POST /api/embed` body.
pub fn parse_ollama_embed(body: &[u8]) -> Result<NormalizedRun, ApiError> {
    let value = parse_body(body)?;
    let root = RequestObject::root(&value)?;
    let model = parse_model(&root)?;
    let messages = parse_inputs(&root)?;
    let params = GenerationParams {
        extra_json: pass_through_fields(&root, OLLAMA_EMBED_FIELDS)?,
        whole_answer: true,
        ..GenerationParams::default()
    };
    Ok(embeddings_run(model, messages, params))
}

/// Folds an embeddings run into the OpenAI `list` of embeddings.
#[derive(Debug, Clone)]
pub struct EmbeddingsAccumulator {
    model: String,
    base64: bool,
    transcript: Transcript,
}

impl EmbeddingsAccumulator {
    /// An accumulator for `model`, answering base64 vectors when asked.
    pub fn new(model: impl Into<String>, base64: bool) -> Self {
        Self {
            model: model.into(),
            base64,
            transcript: Transcript::new(""),
        }
    }

    /// Fold one event in.
    pub fn push(&mut self, event: &RunEventKind) {
        self.transcript.push(event);
    }

    /// `{"object":"list","data":[{"object":"embedding","index","embedding"}],
    /// "model","usage"}`, or the error the run ended with.
    pub fn finish(&self) -> Result<Value, ApiError> {
        self.transcript.finish_reason()?;
        let data: Vec<Value> = self
            .transcript
            .embeddings()
            .into_iter()
            .map(|e| {
                let embedding = if self.base64 {
                    let bytes: Vec<u8> = e.values.iter().flat_map(|v| v.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    json!(e.values)
                };
                json!({"object": "embedding", "index": e.index, "embedding": embedding})
            })
            .collect();
        let usage = self
            .transcript
            .usage()
            .map(|u| json!({"prompt_tokens": u.prompt_tokens, "total_tokens": u.prompt_tokens}));
        Ok(json!({"object": "list", "data": data, "model": self.model, "usage": usage}))
    }

    /// Ollama's `/api/embed` answer: `{"model","embeddings":[[..]],
    /// "total_duration","load_duration","prompt_eval_count"}`.
    pub fn finish_ollama(&self, total_duration_ns: u64) -> Result<Value, ApiError> {
        self.transcript.finish_reason()?;
        let embeddings: Vec<&Vec<f32>> = self
            .transcript
            .embeddings()
            .into_iter()
            .map(|e| &e.values)
            .collect();
        let mut answer = json!({
            "model": self.model,
            "embeddings": embeddings,
            "total_duration": total_duration_ns,
            "load_duration": 0,
        });
        if let Some(u) = self.transcript.usage() {
            answer["prompt_eval_count"] = json!(u.prompt_tokens);
        }
        Ok(answer)
    }
}

/// A parsed `/v1/completions` request.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// The run: one user message (the prompt), the suffix in its params.
    pub run: NormalizedRun,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
}

/// Parse a `POST /v1/completions` body.
pub fn parse_completion_request(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let value = parse_body(body)?;
    let root = RequestObject::root(&value)?;
    let model = parse_model(&root)?;
    let prompt = match root.get("prompt") {
        None => return Err(ApiError::missing_parameter("prompt")),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            items[0].as_str().unwrap_or_default().to_owned()
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::unsupported_parameter(
                "prompt",
                "Send one prompt string per request.",
            ));
        }
        Some(_) => return Err(ApiError::invalid_type("prompt", "a string")),
    };
    let stream = root.bool("stream")?.unwrap_or(false);
    let include_usage = match root.object("stream_options")? {
        Some(options) => options.bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    if root.bool("echo")? == Some(true) {
        return Err(ApiError::unsupported_parameter(
            "echo",
            "Echoing the prompt is not supported.",
        ));
    }
    if root.u32_at_least("best_of", 1)?.is_some_and(|n| n > 1) {
        return Err(ApiError::unsupported_parameter(
            "best_of",
            "Only best_of=1 is supported.",
        ));
    }
    if root.has("logprobs") {
        return Err(ApiError::unsupported_parameter(
            "logprobs",
            "Log probabilities of text completions are not supported; use chat completions.",
        ));
    }
    let params = GenerationParams {
        temperature: root.number_in("temperature", 0.0, 2.0)?,
        top_p: root.number_in("top_p", 0.0, 1.0)?,
        max_tokens: root.u32_at_least("max_tokens", 1)?,
        stop: parse_stop(&root, "stop", MAX_STOP_SEQUENCES)?,
        seed: root.i64("seed")?,
        presence_penalty: root.number_in("presence_penalty", -2.0, 2.0)?,
        frequency_penalty: root.number_in("frequency_penalty", -2.0, 2.0)?,
        suffix: root.string("suffix")?.map(str::to_owned),
        extra_json: pass_through_fields(&root, COMPLETIONS_FIELDS)?,
        whole_answer: !stream,
        ..GenerationParams::default()
    };
    Ok(CompletionRequest {
        run: NormalizedRun {
            model,
            stream,
            api: RunApi::Completion,
            messages: vec![user_message(prompt)],
            tools: Vec::new(),
            params,
            choices: root.u32_at_least("n", 1)?.unwrap_or(1),
        },
        include_usage,
    })
}

/// `cmpl-<16 hex>`: a text completion id.
pub fn completion_id(seed: u64) -> String {
    format!("cmpl-{seed:016x}")
}

fn completion_object(
    id: &str,
    model: &str,
    created_unix: u64,
    text: &str,
    finish: Option<FinishReason>,
) -> Value {
    json!({
        "id": id,
        "object": "text_completion",
        "created": created_unix,
        "model": model,
        "choices": [{
            "text": text,
            "index": 0,
            "logprobs": null,
            "finish_reason": finish.map(FinishReason::openai_str),
        }],
    })
}

/// Encodes a text completion run as SSE `text_completion` chunks.
#[derive(Debug, Clone)]
pub struct CompletionStream {
    id: String,
    model: String,
    created_unix: u64,
    include_usage: bool,
    usage: Option<Usage>,
    finished: bool,
}

impl CompletionStream {
    /// A stream for completion `id` of `model`.
    pub fn new(id: String, model: String, created_unix: u64, include_usage: bool) -> Self {
        Self {
            id,
            model,
            created_unix,
            include_usage,
            usage: None,
            finished: false,
        }
    }

    /// Append the SSE events for one run event.
    pub fn push(&mut self, event: &RunEventKind, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        match event {
            RunEventKind::TextDelta(text) if !text.is_empty() => {
                let chunk = completion_object(&self.id, &self.model, self.created_unix, text, None);
                framing::sse_json(out, None, &chunk);
            }
            RunEventKind::Usage(usage) => self.usage = Some(*usage),
            RunEventKind::Completed {
                finish_reason,
                usage,
            } => {
                let chunk = completion_object(
                    &self.id,
                    &self.model,
                    self.created_unix,
                    "",
                    Some(*finish_reason),
                );
                framing::sse_json(out, None, &chunk);
                if self.include_usage {
                    let mut last =
                        completion_object(&self.id, &self.model, self.created_unix, "", None);
                    last["choices"] = json!([]);
                    // The provider's usage, or `null` when it reported none.
                    last["usage"] = usage.or(self.usage).map_or(Value::Null, usage_json);
                    framing::sse_json(out, None, &last);
                }
                self.finished = true;
            }
            RunEventKind::Failed(failure) => {
                let err = ApiError::from_execution_failure(failure);
                self.fail(&err, out);
            }
            _ => {}
        }
    }

    /// End the stream with `err` (R-GATE-3).
    pub fn fail(&mut self, err: &ApiError, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        self.finished = true;
        framing::sse_json(out, None, &super::chat::error_payload(err));
    }
}

/// Folds a text completion run into one `text_completion` object.
#[derive(Debug, Clone)]
pub struct CompletionAccumulator {
    id: String,
    model: String,
    created_unix: u64,
    transcript: Transcript,
}

impl CompletionAccumulator {
    /// An accumulator for completion `id` of `model`.
    pub fn new(id: String, model: String, created_unix: u64) -> Self {
        Self {
            transcript: Transcript::new(id.clone()),
            id,
            model,
            created_unix,
        }
    }

    /// Fold one event in.
    pub fn push(&mut self, event: &RunEventKind) {
        self.transcript.push(event);
    }

    /// The `text_completion` object, or the error the run ended with.
    pub fn finish(&self) -> Result<Value, ApiError> {
        let finish = self.transcript.finish_reason()?;
        let mut object = completion_object(
            &self.id,
            &self.model,
            self.created_unix,
            self.transcript.text(),
            Some(finish),
        );
        object["usage"] = self.transcript.usage().map_or(Value::Null, usage_json);
        Ok(object)
    }
}

#[cfg(test)]
mod tests {
    use iop_wire::Embedding;

    use super::*;

    fn embedding(index: u32, values: Vec<f32>) -> RunEventKind {
        RunEventKind::Embedding(Embedding { index, values })
    }

    fn completed(usage: Option<Usage>) -> RunEventKind {
        RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage,
        }
    }

    #[test]
    fn embeddings_request_takes_one_or_many_texts_and_refuses_token_arrays() {
        let (run, base64) = parse_embeddings_request(
            br#"{"model":"e","input":["a","b"],"encoding_format":"base64","dimensions":4}"#,
        )
        .unwrap();
        assert!(base64);
        assert_eq!(run.api, RunApi::Embeddings);
        assert_eq!(run.messages.len(), 2);
        assert_eq!(
            run.params.extra_json.as_deref(),
            Some(r#"{"dimensions":4}"#)
        );
        let (run, base64) = parse_embeddings_request(br#"{"model":"e","input":"a"}"#).unwrap();
        assert!(!base64 && run.messages.len() == 1);
        let err = parse_embeddings_request(br#"{"model":"e","input":[[1,2]]}"#).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0]"));
        assert!(parse_embeddings_request(br#"{"model":"e"}"#).is_err());
    }

    #[test]
    fn embeddings_answer_in_input_order_as_floats_or_base64_with_the_providers_usage() {
        let mut acc = EmbeddingsAccumulator::new("e", false);
        acc.push(&embedding(1, vec![0.5]));
        acc.push(&embedding(0, vec![1.0, -1.0]));
        acc.push(&completed(Some(Usage::tokens(3, 0))));
        let v = acc.finish().unwrap();
        assert_eq!(v["data"][0]["embedding"], json!([1.0, -1.0]));
        assert_eq!(v["data"][1]["index"], 1);
        assert_eq!(v["usage"]["prompt_tokens"], 3);

        let mut acc = EmbeddingsAccumulator::new("e", true);
        acc.push(&embedding(0, vec![1.0]));
        acc.push(&completed(None));
        let v = acc.finish().unwrap();
        // 1.0f32 little-endian, base64.
        assert_eq!(v["data"][0]["embedding"], "AACAPw==");
        assert!(
            v["usage"].is_null(),
            "no usage is reported as none, not zero"
        );
    }

    #[test]
    fn completion_request_carries_prompt_and_suffix() {
        let req = parse_completion_request(
            br#"{"model":"m","prompt":"def f(","suffix":"return x","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .unwrap();
        assert_eq!(req.run.api, RunApi::Completion);
        assert_eq!(req.run.messages[0].content, "def f(");
        assert_eq!(req.run.params.suffix.as_deref(), Some("return x"));
        assert!(req.run.stream && req.include_usage);
        assert!(parse_completion_request(br#"{"model":"m","prompt":"x","echo":true}"#).is_err());
    }

    #[test]
    fn completion_stream_and_object_report_the_providers_usage_or_null() {
        let mut stream = CompletionStream::new("cmpl-1".into(), "m".into(), 1, true);
        let mut out = Vec::new();
        stream.push(&RunEventKind::TextDelta("hi".into()), &mut out);
        stream.push(&completed(None), &mut out);
        let text = String::from_utf8(out).unwrap();
        let chunks: Vec<Value> = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(chunks[0]["choices"][0]["text"], "hi");
        assert_eq!(chunks[1]["choices"][0]["finish_reason"], "stop");
        assert!(chunks[2]["usage"].is_null());

        let mut acc = CompletionAccumulator::new("cmpl-1".into(), "m".into(), 1);
        acc.push(&RunEventKind::TextDelta("hi".into()));
        acc.push(&completed(Some(Usage::tokens(2, 1))));
        let v = acc.finish().unwrap();
        assert_eq!(v["choices"][0]["text"], "hi");
        assert_eq!(v["usage"]["total_tokens"], 3);
    }
}
