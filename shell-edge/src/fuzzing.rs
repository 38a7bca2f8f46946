//! Fuzz harness bodies for the client API parsers (chat completions,
//! responses, Ollama chat and generate), kept in the library so `cargo test`
//! on stable replays the committed seed corpus and `cargo fuzz` drives the
//! same code (`fuzz/fuzz_targets/api_*.rs`).
//!
//! A harness panics only on a violation: any bytes must parse or be
//! refused with a client error (4xx) whose message stays bounded.

use iop_wire::RunApi;

use crate::api::ApiError;
use crate::api::endpoint::{ChatCompletions, Ollama, Responses, RunEndpoint};

/// The longest error message a parser may answer with.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 4096;

fn check<E: RunEndpoint>(endpoint: &E, body: &[u8]) {
    match endpoint.parse(body) {
        Ok((run, _options)) => {
            // Whatever parses is a run with a model to route.
            assert!(!run.model.is_empty(), "a run without a model parsed");
        }
        Err(err) => check_error(&err),
    }
}

fn check_error(err: &ApiError) {
    assert!(
        (400..500).contains(&err.status),
        "client input answered with {}: {err}",
        err.status
    );
    assert!(
        err.message.len() <= MAX_ERROR_MESSAGE_BYTES,
        "an error message of {} bytes",
        err.message.len()
    );
}

/// `POST /v1/chat/completions` bodies.
pub fn fuzz_chat(body: &[u8]) {
    check(&ChatCompletions, body);
}

/// `POST /v1/responses` bodies.
pub fn fuzz_responses(body: &[u8]) {
    check(&Responses, body);
}

/// `POST /api/chat` and `POST /api/generate` bodies.
pub fn fuzz_ollama(body: &[u8]) {
    check(&Ollama(RunApi::Chat), body);
    check(&Ollama(RunApi::Generate), body);
}
