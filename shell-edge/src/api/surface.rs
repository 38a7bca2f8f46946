//! The normalized request surface beyond plain text, shared by every run
//! API: content parts with images, `response_format` (JSON mode and
//! structured outputs), log probabilities, reasoning effort, fields the Edge
//! does not interpret (passed through), and which provider can honour what.
//!
//! Every parameter is either carried to the provider, or refused with a 400
//! that names it ([`provider_refusal`]): nothing is dropped silently. What a
//! normalized provider can do is decided from its adapter kind, which the
//! Node reports for each provider it offers; a tunnel-mode provider is not
//! asked (the Edge relays the client's body to it as it is).

use iop_wire::AdapterKind;
use serde_json::{Map, Value, json};

use super::NormalizedRun;
use super::error::ApiError;
use super::request_object::{RequestObject, element, type_name};

/// Most images one request may attach, over all its messages.
pub const MAX_IMAGES_PER_REQUEST: usize = 16;

/// The largest `top_logprobs` (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// Most top-level fields a request may carry that the Edge passes through
/// without interpreting them.
pub const MAX_PASS_THROUGH_FIELDS: usize = 64;

/// Longest `json_schema.name` (OpenAI's limit).
pub const MAX_SCHEMA_NAME_CHARS: usize = 64;

/// The `reasoning_effort` values the OpenAI API defines.
pub const REASONING_EFFORTS: &[&str] = &["none", "minimal", "low", "medium", "high", "xhigh"];

pub use iop_wire::OLLAMA_OPTIONS;

/// `metadata`, if sent: an object of at most 16 string pairs, keys of at
/// most 64 characters and values of at most 512 (R-LIM-5, decided by
/// [`iop_core::edge::client_ids::check_metadata`]); else a 400 naming it.
pub(crate) fn parse_metadata<'a>(
    root: &RequestObject<'a>,
) -> Result<Option<RequestObject<'a>>, ApiError> {
    let Some(metadata) = root.object("metadata")? else {
        return Ok(None);
    };
    iop_core::edge::client_ids::check_metadata(
        metadata.entries().map(|(k, v)| (k.as_str(), v.as_str())),
    )
    .map_err(|fault| ApiError::invalid_value(&root.param("metadata"), fault.detail()))?;
    Ok(Some(metadata))
}

/// Request metadata that does not change the answer (end-user ids, tags,
/// caching hints). It passes through to OpenAI-compatible providers; an
/// Ollama provider has no such fields, and leaving them out changes nothing
/// the client can observe.
pub const ANSWER_NEUTRAL_FIELDS: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

/// The text and images of one message's `content`.
#[derive(Debug, Default)]
pub(crate) struct Content {
    pub(crate) text: String,
    pub(crate) images: Vec<String>,
}

/// How one API names its content parts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PartTypes {
    /// Part types that carry text in `text`.
    pub(crate) text: &'static [&'static str],
    /// The image part type, and whether its `image_url` is an object with
    /// a `url` (Chat) or the URL string itself (Responses).
    pub(crate) image: Option<(&'static str, bool)>,
}

/// Chat Completions parts: `text`, `image_url: {url}`.
pub(crate) const CHAT_PARTS: PartTypes = PartTypes {
    text: &["text"],
    image: Some(("image_url", true)),
};

/// `content`: a string, or an array of text parts (joined by newlines) and
/// image parts. Other parts (audio, files) are refused naming `path`.
/// `images_left` bounds the images of the whole request.
pub(crate) fn parse_content(
    content: &Value,
    path: &str,
    types: PartTypes,
    images_left: &mut usize,
) -> Result<Content, ApiError> {
    match content {
        Value::String(s) => Ok(Content {
            text: s.clone(),
            images: Vec::new(),
        }),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            let mut images = Vec::new();
            for (i, part) in parts.iter().enumerate() {
                let part = RequestObject::at(part, element(path, i))?;
                let kind = part.required_string("type")?;
                if types.text.contains(&kind) {
                    texts.push(part.required_string("text")?.to_owned());
                } else if kind == "refusal" {
                    texts.push(part.required_string("refusal")?.to_owned());
                } else if let Some((image_kind, nested)) = types.image
                    && kind == image_kind
                {
                    let url = if nested {
                        match part.get("image_url") {
                            Some(Value::String(url)) => url.as_str(),
                            Some(Value::Object(_)) => match part.object("image_url")? {
                                Some(obj) => obj.non_empty_string("url")?,
                                None => {
                                    return Err(ApiError::missing_parameter(
                                        &part.param("image_url"),
                                    ));
                                }
                            },
                            Some(_) => {
                                return Err(ApiError::invalid_type(
                                    &part.param("image_url"),
                                    "an object",
                                ));
                            }
                            None => {
                                return Err(ApiError::missing_parameter(&part.param("image_url")));
                            }
                        }
                    } else {
                        if part.has("file_id") && !part.has("image_url") {
                            return Err(ApiError::unsupported_parameter(
                                &part.param("file_id"),
                                "Images by file id are not supported; send an image URL.",
                            ));
                        }
                        part.non_empty_string("image_url")?
                    };
                    let param = part.param("image_url");
                    check_image_url(url, &param)?;
                    if *images_left == 0 {
                        return Err(ApiError::invalid_value(
                            &param,
                            &format!(
                                "a request may attach at most {MAX_IMAGES_PER_REQUEST} images."
                            ),
                        ));
                    }
                    *images_left -= 1;
                    images.push(url.to_owned());
                } else {
                    return Err(ApiError::unsupported_parameter(
                        path,
                        "Only text and image content is supported.",
                    ));
                }
            }
            Ok(Content {
                text: texts.join("\n"),
                images,
            })
        }
        other => Err(ApiError::invalid_type(
            path,
            &format!(
                "a string or an array of content parts, not {}",
                type_name(other)
            ),
        )),
    }
}

/// An image is an `http(s)://` URL or a base64 `data:image/...` URL.
fn check_image_url(url: &str, param: &str) -> Result<(), ApiError> {
    let ok = url.starts_with("https://")
        || url.starts_with("http://")
        || (url.starts_with("data:image/") && url.contains(";base64,"));
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid_value(
            param,
            "must be an http(s) URL or a base64 data:image/... URL.",
        ))
    }
}

/// `response_format` in the Chat shape: `text` (None), `json_object`, or
/// `json_schema` with a `json_schema: {name, schema, strict}` object. The
/// result is what providers receive, JSON-encoded.
pub(crate) fn parse_response_format(
    root: &RequestObject<'_>,
    key: &str,
) -> Result<Option<String>, ApiError> {
    let Some(format) = root.object(key)? else {
        return Ok(None);
    };
    match format.required_string("type")? {
        "text" => Ok(None),
        "json_object" => Ok(Some(json!({"type": "json_object"}).to_string())),
        "json_schema" => {
            let Some(schema) = format.object("json_schema")? else {
                return Err(ApiError::missing_parameter(&format.param("json_schema")));
            };
            let spec = json_schema_spec(&schema)?;
            Ok(Some(
                json!({"type": "json_schema", "json_schema": spec}).to_string(),
            ))
        }
        _ => Err(ApiError::invalid_value(
            &format.param("type"),
            "must be 'text', 'json_object' or 'json_schema'.",
        )),
    }
}

/// `{name, description?, schema?, strict?}` of a JSON schema format, checked.
pub(crate) fn json_schema_spec(obj: &RequestObject<'_>) -> Result<Value, ApiError> {
    let name = obj.non_empty_string("name")?;
    if name.chars().count() > MAX_SCHEMA_NAME_CHARS
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(ApiError::invalid_value(
            &obj.param("name"),
            &format!(
                "must be at most {MAX_SCHEMA_NAME_CHARS} characters of a-z, A-Z, 0-9, '_' and '-'."
            ),
        ));
    }
    let mut spec = Map::new();
    spec.insert("name".into(), json!(name));
    if let Some(d) = obj.string("description")? {
        spec.insert("description".into(), json!(d));
    }
    match obj.get("schema") {
        None => {}
        Some(schema @ Value::Object(_)) => {
            spec.insert("schema".into(), schema.clone());
        }
        Some(_) => {
            return Err(ApiError::invalid_type(
                &obj.param("schema"),
                "a JSON Schema object",
            ));
        }
    }
    if let Some(strict) = obj.bool("strict")? {
        spec.insert("strict".into(), json!(strict));
    }
    Ok(Value::Object(spec))
}

/// `logprobs` and `top_logprobs` (the latter needs the former).
pub(crate) fn parse_logprobs(
    root: &RequestObject<'_>,
    logprobs_key: &str,
) -> Result<(bool, Option<u8>), ApiError> {
    let logprobs = root.bool(logprobs_key)?.unwrap_or(false);
    let top = match root.get("top_logprobs") {
        None => None,
        Some(v) => match v.as_u64() {
            Some(n) if n <= MAX_TOP_LOGPROBS => Some(n as u8),
            Some(_) => {
                return Err(ApiError::invalid_value(
                    &root.param("top_logprobs"),
                    &format!("must be between 0 and {MAX_TOP_LOGPROBS}."),
                ));
            }
            None => {
                return Err(ApiError::invalid_type(
                    &root.param("top_logprobs"),
                    "an integer",
                ));
            }
        },
    };
    if top.is_some() && !logprobs && logprobs_key == "logprobs" {
        return Err(ApiError::invalid_value(
            &root.param("top_logprobs"),
            "requires 'logprobs' to be true.",
        ));
    }
    Ok((logprobs || top.is_some(), top))
}

/// `reasoning_effort`: one of [`REASONING_EFFORTS`].
pub(crate) fn parse_reasoning_effort(
    obj: &RequestObject<'_>,
    key: &str,
) -> Result<Option<String>, ApiError> {
    match obj.string(key)? {
        None => Ok(None),
        Some(effort) if REASONING_EFFORTS.contains(&effort) => Ok(Some(effort.to_owned())),
        Some(_) => Err(ApiError::invalid_value(
            &obj.param(key),
            &format!("must be one of {}.", REASONING_EFFORTS.join(", ")),
        )),
    }
}

/// The top-level fields of `obj` not in `known`, as one JSON object (or
/// `None` when there are none), for providers to receive unchanged.
pub(crate) fn pass_through_fields(
    obj: &RequestObject<'_>,
    known: &[&str],
) -> Result<Option<String>, ApiError> {
    let mut extra = Map::new();
    for (key, value) in obj.entries() {
        if value.is_null() || known.contains(&key.as_str()) {
            continue;
        }
        if extra.len() == MAX_PASS_THROUGH_FIELDS {
            return Err(ApiError::invalid_value(
                &obj.param(key),
                &format!(
                    "a request may carry at most {MAX_PASS_THROUGH_FIELDS} fields the gateway does not interpret."
                ),
            ));
        }
        extra.insert(key.clone(), value.clone());
    }
    Ok((!extra.is_empty()).then(|| Value::Object(extra).to_string()))
}

/// Why a provider of `adapter` kind cannot run `run` normalized, as the
/// 400 naming the parameter; `None` when it can.
///
/// A normalized run relays one choice. (A tunnel-mode provider takes the
/// client's body as it is, so it can do whatever its server can: its
/// caller does not ask.)
pub fn provider_refusal(adapter: AdapterKind, run: &NormalizedRun) -> Option<ApiError> {
    if run.choices > 1 {
        return Some(ApiError::unsupported_parameter(
            "n",
            "This model's providers answer one choice per request (n=1).",
        ));
    }
    match adapter {
        AdapterKind::Mock => None,
        AdapterKind::OpenAi => openai_refusal(run),
        AdapterKind::Ollama => ollama_refusal(run),
        AdapterKind::Anthropic => anthropic_refusal(run),
    }
}

/// The documents (PDFs) a run attaches, over all its messages.
fn documents(run: &NormalizedRun) -> impl Iterator<Item = &iop_wire::Document> {
    run.messages.iter().flat_map(|m| m.documents.iter())
}

/// What the OpenAI API cannot carry: a PDF by URL (its `file` content
/// parts take the file's data, or a file id of the provider's own).
fn openai_refusal(run: &NormalizedRun) -> Option<ApiError> {
    documents(run)
        .any(|d| matches!(d.source, iop_wire::DocumentSource::PdfUrl(_)))
        .then(|| {
            ApiError::unsupported_parameter(
                "document.source.url",
                "This model's providers speak the OpenAI API, whose file parts take a PDF's data, not its URL; send the PDF as base64.",
            )
        })
}

/// The pass-through fields a Messages provider takes (`user` as
/// `metadata.user_id`); the answer-neutral ones are left out.
pub const ANTHROPIC_FIELDS: &[&str] = &["top_k"];

/// What the Messages API has no place for: embeddings, fill-in-the-middle,
/// log probabilities, a `response_format`, a seed, penalties, other
/// pass-through fields.
fn anthropic_refusal(run: &NormalizedRun) -> Option<ApiError> {
    let p = &run.params;
    let refuse = |param: &str| {
        Some(ApiError::unsupported_parameter(
            param,
            "This model's providers speak Anthropic's Messages API, which has no such parameter.",
        ))
    };
    if run.api == iop_wire::RunApi::Embeddings {
        return refuse("input");
    }
    if p.suffix.is_some() {
        return refuse("suffix");
    }
    if p.logprobs {
        return refuse("logprobs");
    }
    if p.response_format_json.is_some() {
        return refuse("response_format");
    }
    if p.seed.is_some() {
        return refuse("seed");
    }
    if p.presence_penalty.is_some() {
        return refuse("presence_penalty");
    }
    if p.frequency_penalty.is_some() {
        return refuse("frequency_penalty");
    }
    let extra: Map<String, Value> = p
        .extra_json
        .as_deref()
        .and_then(|e| serde_json::from_str(e).ok())
        .unwrap_or_default();
    extra
        .keys()
        .find(|k| {
            !ANTHROPIC_FIELDS.contains(&k.as_str()) && !ANSWER_NEUTRAL_FIELDS.contains(&k.as_str())
        })
        .and_then(|k| refuse(k))
}

fn ollama_refusal(run: &NormalizedRun) -> Option<ApiError> {
    let p = &run.params;
    if documents(run).next().is_some() {
        return Some(ApiError::unsupported_parameter(
            "document",
            "This model's Ollama providers take no documents (PDF); send the document's text.",
        ));
    }
    if p.logprobs {
        return Some(ApiError::unsupported_parameter(
            "logprobs",
            "This model's Ollama providers do not return log probabilities.",
        ));
    }
    if run
        .messages
        .iter()
        .flat_map(|m| m.images.iter())
        .any(|url| !url.starts_with("data:"))
    {
        return Some(ApiError::unsupported_parameter(
            "image_url",
            "This model's Ollama providers take images as base64 data: URLs only.",
        ));
    }
    let extra: Map<String, Value> = p
        .extra_json
        .as_deref()
        .and_then(|e| serde_json::from_str(e).ok())
        .unwrap_or_default();
    for key in extra.keys() {
        if !OLLAMA_OPTIONS.contains(&key.as_str()) && !ANSWER_NEUTRAL_FIELDS.contains(&key.as_str())
        {
            return Some(ApiError::unsupported_parameter(
                key,
                "This model's Ollama providers have no such parameter.",
            ));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use iop_wire::{GenerationParams, RunApi};
    use serde_json::json;

    use super::*;

    fn run(params: GenerationParams) -> NormalizedRun {
        NormalizedRun {
            model: "m".into(),
            stream: false,
            api: RunApi::Chat,
            messages: Vec::new(),
            tools: Vec::new(),
            params,
            choices: 1,
        }
    }

    #[test]
    fn json_schema_format_is_checked_and_kept_in_the_chat_shape() {
        let body = json!({"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "strict": true,
            "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}}});
        let root = RequestObject::root(&body).unwrap();
        let format: Value = serde_json::from_str(
            &parse_response_format(&root, "response_format")
                .unwrap()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(format["json_schema"]["name"], "person");
        assert_eq!(format["json_schema"]["strict"], true);
        assert_eq!(format["json_schema"]["schema"]["type"], "object");

        let bad =
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}});
        let err = parse_response_format(&RequestObject::root(&bad).unwrap(), "response_format")
            .unwrap_err();
        assert_eq!(
            err.param.as_deref(),
            Some("response_format.json_schema.name")
        );
        let text = json!({"response_format": {"type": "text"}});
        assert_eq!(
            parse_response_format(&RequestObject::root(&text).unwrap(), "response_format").unwrap(),
            None
        );
    }

    #[test]
    fn unknown_fields_pass_through_and_known_ones_do_not() {
        let body = json!({"model": "m", "top_k": 40, "min_p": 0.05, "nothing": null});
        let root = RequestObject::root(&body).unwrap();
        let extra: Value =
            serde_json::from_str(&pass_through_fields(&root, &["model"]).unwrap().unwrap())
                .unwrap();
        assert_eq!(extra, json!({"top_k": 40, "min_p": 0.05}));
    }

    #[test]
    fn pass_through_fields_are_bounded() {
        let mut body = Map::new();
        for i in 0..=MAX_PASS_THROUGH_FIELDS {
            body.insert(format!("f{i:03}"), json!(i));
        }
        let body = Value::Object(body);
        let root = RequestObject::root(&body).unwrap();
        assert!(pass_through_fields(&root, &[]).is_err());
    }

    #[test]
    fn a_messages_provider_refuses_what_the_messages_api_cannot_carry_naming_it() {
        let refused = |params: GenerationParams| {
            provider_refusal(AdapterKind::Anthropic, &run(params))
                .and_then(|e| e.param)
                .unwrap_or_default()
        };
        assert_eq!(
            refused(GenerationParams {
                seed: Some(1),
                ..Default::default()
            }),
            "seed"
        );
        assert_eq!(
            refused(GenerationParams {
                response_format_json: Some(r#"{"type":"json_object"}"#.into()),
                ..Default::default()
            }),
            "response_format"
        );
        assert_eq!(
            refused(GenerationParams {
                extra_json: Some(r#"{"min_p":0.1}"#.into()),
                ..Default::default()
            }),
            "min_p"
        );
        let carried = run(GenerationParams {
            extra_json: Some(r#"{"top_k":5,"user":"u","store":true}"#.into()),
            stop: vec!["END".into()],
            reasoning_effort: Some("low".into()),
            ..Default::default()
        });
        assert!(provider_refusal(AdapterKind::Anthropic, &carried).is_none());
    }

    #[test]
    fn ollama_refuses_what_it_cannot_do_naming_the_parameter() {
        let logprobs = run(GenerationParams {
            logprobs: true,
            ..Default::default()
        });
        let err = provider_refusal(AdapterKind::Ollama, &logprobs).unwrap();
        assert_eq!(err.param.as_deref(), Some("logprobs"));
        assert!(provider_refusal(AdapterKind::OpenAi, &logprobs).is_none());

        let unknown = run(GenerationParams {
            extra_json: Some(json!({"top_k": 3, "logit_bias": {}}).to_string()),
            ..Default::default()
        });
        let err = provider_refusal(AdapterKind::Ollama, &unknown).unwrap();
        assert_eq!(err.param.as_deref(), Some("logit_bias"));
        let options = run(GenerationParams {
            extra_json: Some(json!({"top_k": 3, "user": "u"}).to_string()),
            ..Default::default()
        });
        assert!(provider_refusal(AdapterKind::Ollama, &options).is_none());
    }

    #[test]
    fn a_pdf_by_url_has_no_openai_form_and_ollama_takes_no_pdf() {
        let with_pdf = |source: iop_wire::DocumentSource| {
            let mut run = run(GenerationParams::default());
            run.messages.push(iop_wire::ChatMessage {
                role: iop_wire::Role::Tool,
                content: String::new(),
                tool_calls: Vec::new(),
                tool_call_id: Some("toolu_1".into()),
                name: None,
                images: Vec::new(),
                cache_control: None,
                documents: vec![iop_wire::Document {
                    source,
                    title: None,
                    context: None,
                }],
            });
            run
        };
        let data = with_pdf(iop_wire::DocumentSource::PdfBase64("JVBERi0=".into()));
        let url = with_pdf(iop_wire::DocumentSource::PdfUrl(
            "https://example.com/a.pdf".into(),
        ));
        for adapter in [
            AdapterKind::OpenAi,
            AdapterKind::Anthropic,
            AdapterKind::Mock,
        ] {
            assert!(provider_refusal(adapter, &data).is_none(), "{adapter:?}");
        }
        assert!(provider_refusal(AdapterKind::Anthropic, &url).is_none());
        let err = provider_refusal(AdapterKind::OpenAi, &url).unwrap();
        assert_eq!(err.param.as_deref(), Some("document.source.url"));
        assert!(err.message.contains("OpenAI API"), "{}", err.message);
        for run in [&data, &url] {
            let err = provider_refusal(AdapterKind::Ollama, run).unwrap();
            assert_eq!(err.param.as_deref(), Some("document"));
        }
    }

    #[test]
    fn a_normalized_provider_answers_one_choice() {
        let mut many = run(GenerationParams::default());
        many.choices = 2;
        for adapter in AdapterKind::ALL {
            let err = provider_refusal(*adapter, &many).unwrap();
            assert_eq!(err.param.as_deref(), Some("n"));
        }
    }
}
