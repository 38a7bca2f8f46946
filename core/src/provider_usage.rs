//! The usage reports of the providers' APIs, read one way wherever they are
//! read: by the Node's adapters from a provider's answer, and by the Edge
//! from a tunnelled answer's bytes
//! ([`TunnelMeter`](crate::edge::tunnel_meter::TunnelMeter), R-TEN-2).
//!
//! Every API reports running totals (a later report of a count replaces an
//! earlier one), under its own names: OpenAI's Chat Completions
//! `prompt_tokens` and `completion_tokens` with
//! `prompt_tokens_details.cached_tokens` (and some servers'
//! `cache_write_tokens`); the Responses API's `input_tokens` and
//! `output_tokens` with `input_tokens_details.cached_tokens`; the Messages
//! API's `input_tokens` (the prompt's *uncached* part), `output_tokens`,
//! `cache_read_input_tokens` and `cache_creation_input_tokens`. A run's
//! [`Usage`] counts every prompt token, the cache's parts included, as
//! OpenAI does: the Messages API's three prompt counts are summed
//! ([`PromptCounting::Parts`]).

use iop_wire::Usage;
use serde::Deserialize;

/// One usage object of any of the APIs; a count not sent is `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct UsageReport {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    prompt_tokens_details: Option<TokensDetails>,
    input_tokens_details: Option<TokensDetails>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

/// OpenAI's `prompt_tokens_details` (`input_tokens_details`): the prompt
/// cache's share.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
struct TokensDetails {
    cached_tokens: Option<u64>,
    cache_write_tokens: Option<u64>,
}

impl UsageReport {
    /// The prompt's count as sent: every prompt token (OpenAI) or its
    /// uncached part (the Messages API).
    pub fn input(&self) -> Option<u64> {
        self.prompt_tokens.or(self.input_tokens)
    }

    /// The output's count.
    pub fn output(&self) -> Option<u64> {
        self.completion_tokens.or(self.output_tokens)
    }

    fn details(&self) -> Option<&TokensDetails> {
        self.prompt_tokens_details
            .as_ref()
            .or(self.input_tokens_details.as_ref())
    }

    /// Prompt tokens read from the provider's cache.
    pub fn cache_read(&self) -> Option<u64> {
        self.cache_read_input_tokens
            .or(self.details().and_then(|d| d.cached_tokens))
    }

    /// Prompt tokens written to the provider's cache.
    pub fn cache_write(&self) -> Option<u64> {
        self.cache_creation_input_tokens
            .or(self.details().and_then(|d| d.cache_write_tokens))
    }

    /// An OpenAI-style report as a run's usage (a count it does not send
    /// is 0; its prompt count holds the cache's parts).
    pub fn openai_usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.input().unwrap_or(0),
            completion_tokens: self.output().unwrap_or(0),
            cache_read_tokens: self.cache_read(),
            cache_write_tokens: self.cache_write(),
        }
    }
}

/// What an API's prompt count holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptCounting {
    /// Every prompt token, the cache's parts included (OpenAI, Ollama).
    Whole,
    /// Only the uncached part; the cache's are counted apart (the Messages
    /// API).
    Parts,
}

/// One answer's counts, each as last reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReportedCounts {
    /// The prompt's count as the API sends it ([`PromptCounting`]).
    pub input: Option<u64>,
    /// The output's.
    pub output: Option<u64>,
    /// Read from the provider's cache.
    pub cache_read: Option<u64>,
    /// Written to it.
    pub cache_write: Option<u64>,
}

impl ReportedCounts {
    /// Take the prompt's counts of `report` (those it sends; the others
    /// keep their value), and its output's when `with_output`.
    pub fn take(&mut self, report: &UsageReport, with_output: bool) {
        self.input = report.input().or(self.input);
        self.cache_read = report.cache_read().or(self.cache_read);
        self.cache_write = report.cache_write().or(self.cache_write);
        if with_output {
            self.output = report.output().or(self.output);
        }
    }

    /// Every prompt token, once the prompt's count is known.
    pub fn prompt_tokens(&self, counting: PromptCounting) -> Option<u64> {
        let input = self.input?;
        Some(match counting {
            PromptCounting::Whole => input,
            PromptCounting::Parts => input
                .saturating_add(self.cache_read.unwrap_or(0))
                .saturating_add(self.cache_write.unwrap_or(0)),
        })
    }

    /// The run's usage, once both the prompt's and the output's counts are
    /// known.
    pub fn usage(&self, counting: PromptCounting) -> Option<Usage> {
        Some(Usage {
            prompt_tokens: self.prompt_tokens(counting)?,
            completion_tokens: self.output?,
            cache_read_tokens: self.cache_read,
            cache_write_tokens: self.cache_write,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(json: &str) -> UsageReport {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn every_api_s_names_read_the_same_counts() {
        let chat = report(
            r#"{"prompt_tokens":30,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":24,"cache_write_tokens":6}}"#,
        );
        assert_eq!(
            chat.openai_usage(),
            Usage {
                prompt_tokens: 30,
                completion_tokens: 2,
                cache_read_tokens: Some(24),
                cache_write_tokens: Some(6),
            }
        );
        let responses = report(
            r#"{"input_tokens":12,"input_tokens_details":{"cached_tokens":4},"output_tokens":7,"total_tokens":19}"#,
        );
        assert_eq!(
            responses.openai_usage(),
            Usage {
                prompt_tokens: 12,
                completion_tokens: 7,
                cache_read_tokens: Some(4),
                cache_write_tokens: None,
            }
        );
        // `null` details and missing counts are not reports.
        let sparse = report(r#"{"prompt_tokens":3,"prompt_tokens_details":null}"#);
        assert_eq!(sparse.openai_usage(), Usage::tokens(3, 0));
    }

    #[test]
    fn the_messages_api_s_prompt_is_its_three_parts_each_as_last_reported() {
        let mut counts = ReportedCounts::default();
        counts.take(
            &report(
                r#"{"input_tokens":25,"cache_read_input_tokens":10,"cache_creation_input_tokens":5,"output_tokens":1}"#,
            ),
            false,
        );
        assert_eq!(counts.prompt_tokens(PromptCounting::Parts), Some(40));
        assert_eq!(counts.usage(PromptCounting::Parts), None, "no output yet");
        // A later report keeps the counts it leaves out.
        counts.take(&report(r#"{"output_tokens":15}"#), true);
        assert_eq!(
            counts.usage(PromptCounting::Parts),
            Some(Usage {
                prompt_tokens: 40,
                completion_tokens: 15,
                cache_read_tokens: Some(10),
                cache_write_tokens: Some(5),
            })
        );
        assert_eq!(counts.prompt_tokens(PromptCounting::Whole), Some(25));
    }
}
