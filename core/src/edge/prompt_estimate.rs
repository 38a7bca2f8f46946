//! An estimate of how many tokens a run's prompt is, without a tokenizer.
//!
//! The Edge never sees a model's tokenizer; a provider's own usage report
//! is the only exact count, and answers carry only that (never this
//! estimate). Where an API asks for a count before any provider call
//! (Anthropic's `POST /v1/messages/count_tokens`), this is the answer:
//!
//! * every character the provider would read as text (message contents,
//!   tool calls' names and arguments, tool results, the tools' names,
//!   descriptions and parameter schemas), summed, then
//!   `ceil(characters / `[`CHARS_PER_TOKEN`]`)`, the usual rule of thumb
//!   for English text and code under BPE tokenizers;
//! * plus [`IMAGE_TOKENS`] for each image, whatever its size (the Edge
//!   does not decode images);
//! * plus [`DOCUMENT_TOKENS`] for each PDF document, whatever its length
//!   (the Edge does not read its pages), and its title and context as
//!   text.
//!
//! It is deliberately simple, so a client can reproduce it: for a text-only
//! conversation it is exactly what the built-in mock provider reports as
//! its prompt tokens.

use iop_wire::{ChatMessage, ToolDefinition};

/// Characters per token of the estimate.
pub const CHARS_PER_TOKEN: u64 = 4;

/// Tokens counted for one image: about what a model that tiles images
/// into 28-pixel patches spends on a 1.15-megapixel image, the size
/// providers scale larger images down to.
pub const IMAGE_TOKENS: u64 = 1_600;

/// Tokens counted for one PDF document: about one page as a provider
/// that reads PDFs counts it (its text, about 3,000 tokens, and its
/// picture, [`IMAGE_TOKENS`]).
pub const DOCUMENT_TOKENS: u64 = 3_000 + IMAGE_TOKENS;

/// The estimated tokens of `text` alone: `ceil(characters /
/// `[`CHARS_PER_TOKEN`]`)`. What charges the output of an attempt that
/// ended without a provider's usage report (R-TEN-2): the answer's text it
/// produced, as the journal or the client has it.
pub fn text_tokens(text: &str) -> u64 {
    (text.chars().count() as u64).div_ceil(CHARS_PER_TOKEN)
}

/// The characters of output an event of a run carries besides its text:
/// reasoning, a tool call's name and arguments. Counted with the text by
/// the estimate of an output no usage report covers (R-TEN-2).
pub fn other_output_chars(event: &iop_wire::RunEventKind) -> u64 {
    let chars = |text: &str| text.chars().count() as u64;
    match event {
        iop_wire::RunEventKind::ReasoningDelta(text) => chars(text),
        iop_wire::RunEventKind::ToolCallDelta(call) => call
            .name
            .as_deref()
            .map_or(0, chars)
            .saturating_add(chars(&call.arguments_delta)),
        _ => 0,
    }
}

/// The estimated prompt tokens of `messages` with `tools` declared.
pub fn prompt_tokens(messages: &[ChatMessage], tools: &[ToolDefinition]) -> u64 {
    let mut chars: u64 = 0;
    let mut images: u64 = 0;
    let mut documents: u64 = 0;
    let mut add = |text: &str| chars = chars.saturating_add(text.chars().count() as u64);
    for message in messages {
        add(&message.content);
        for call in &message.tool_calls {
            add(&call.name);
            add(&call.arguments);
        }
        images = images.saturating_add(message.images.len() as u64);
        for document in &message.documents {
            add(document.title.as_deref().unwrap_or_default());
            add(document.context.as_deref().unwrap_or_default());
        }
        documents = documents.saturating_add(message.documents.len() as u64);
    }
    for tool in tools {
        add(&tool.name);
        add(tool.description.as_deref().unwrap_or_default());
        add(tool.parameters_json.as_deref().unwrap_or_default());
    }
    chars
        .div_ceil(CHARS_PER_TOKEN)
        .saturating_add(images.saturating_mul(IMAGE_TOKENS))
        .saturating_add(documents.saturating_mul(DOCUMENT_TOKENS))
}

#[cfg(test)]
mod tests {
    use iop_wire::{Role, ToolCall};

    use super::*;

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

    #[test]
    fn text_is_counted_as_characters_over_four_rounded_up() {
        assert_eq!(prompt_tokens(&[], &[]), 0);
        assert_eq!(prompt_tokens(&[message(Role::User, "hello")], &[]), 2);
        // Summed first, rounded once: 3 + 5 characters are 2 tokens.
        let two = [message(Role::System, "abc"), message(Role::User, "hello")];
        assert_eq!(prompt_tokens(&two, &[]), 2);
        // Characters, not bytes.
        assert_eq!(prompt_tokens(&[message(Role::User, "ééééé")], &[]), 2);
    }

    #[test]
    fn tool_calls_tools_and_images_count() {
        let mut call = message(Role::Assistant, "");
        call.tool_calls.push(ToolCall {
            id: "call_0".into(),
            name: "f".into(),
            arguments: "{}x".into(),
        });
        assert_eq!(prompt_tokens(std::slice::from_ref(&call), &[]), 1);
        let tool = ToolDefinition {
            name: "get".into(),
            description: Some("weather".into()),
            parameters_json: Some("{}".into()),
            cache_control: None,
        };
        assert_eq!(prompt_tokens(&[], std::slice::from_ref(&tool)), 3);
        let mut seeing = message(Role::User, "");
        seeing.images = vec!["https://example.com/a.png".into(); 2];
        assert_eq!(prompt_tokens(&[seeing], &[]), 2 * IMAGE_TOKENS);

        let mut reading = message(Role::User, "");
        reading.documents = vec![iop_wire::Document {
            source: iop_wire::DocumentSource::PdfBase64("JVBERi0=".repeat(1000)),
            title: Some("abcd".into()),
            context: None,
        }];
        assert_eq!(prompt_tokens(&[reading], &[]), 1 + DOCUMENT_TOKENS);
    }
}
