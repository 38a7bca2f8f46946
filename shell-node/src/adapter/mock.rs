//! The `mock` adapter: the built-in provider ([`crate::mock`]) inside the
//! Node. Runs play the script directly; tunnels go through the same router
//! the HTTP mock serves, without a socket.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Request, header};
use futures::StreamExt;
use futures::stream::BoxStream;
use iop_wire::{
    Embedding, FinishReason, HealthFailureCode, ProviderTunnelFrame, RunApi, RunEventKind,
    RunRequest, TokenLogprob, ToolCallDelta, Usage,
};
use tower::ServiceExt;

use super::openai::generate_prompt;
use super::relay::{RelayCall, body_frames, request_headers, response_headers, validate};
use super::{ProbeVerdict, ProviderCallError, failed_tunnel};
use crate::mock::{
    MOCK_LOGPROB, MOCK_REASONING, MockPrompt, MockScript, MockState, MockStep, ProbeHealth,
    mock_embedding, play, router,
};

const DEFAULT_TOOL: &str = "mock_tool";

/// An in-process mock target.
#[derive(Clone)]
pub(crate) struct InProcessMock {
    defaults: Arc<MockScript>,
    /// The target's static key, sent like an HTTP adapter would.
    api_key: Option<String>,
    router: Router,
}

impl InProcessMock {
    pub(crate) fn new(defaults: MockScript, api_key: Option<String>) -> Self {
        Self {
            router: router(MockState::new(defaults.clone())),
            defaults: Arc::new(defaults),
            api_key,
        }
    }

    /// The same events an `openai` adapter yields against the HTTP mock.
    pub(crate) fn run(
        &self,
        req: RunRequest,
        auth: Option<String>,
    ) -> BoxStream<'static, RunEventKind> {
        // As the HTTP mock: a bad override is the provider's 400, with its
        // message.
        let script = match self.defaults.for_model(&req.model) {
            Ok(script) => script,
            Err(e) => {
                let mut failure = ProviderCallError::Status { status: 400 }.failure();
                failure.provider_message = iop_wire::provider_message(&e.to_string());
                return futures::stream::once(async move { RunEventKind::Failed(failure) }).boxed();
            }
        };
        let bearer = auth.or_else(|| self.api_key.clone());
        let prompt = MockPrompt {
            prompt_chars: prompt_chars(&req),
            max_tokens: req.params.max_tokens,
            // As an `openai` adapter's call: generate is a chat without tools.
            tool_name: script
                .tool_call
                .then(|| match (req.api, req.tools.first()) {
                    (RunApi::Chat, Some(tool)) => tool.name.clone(),
                    _ => DEFAULT_TOOL.to_owned(),
                }),
            continue_from: crate::mock::continued_tokens(
                req.messages
                    .last()
                    .filter(|m| m.role == iop_wire::Role::Assistant)
                    .map(|m| m.content.as_str()),
            ),
        };
        let session_id = req.session_id;
        let api = req.api;
        let inputs: Vec<String> = if api == RunApi::Embeddings {
            req.messages.iter().map(|m| m.content.clone()).collect()
        } else {
            Vec::new()
        };
        let json_answer = req.params.response_format_json.is_some();
        let logprobs = req
            .params
            .logprobs
            .then_some(req.params.top_logprobs.unwrap_or(0));
        let reasons = req
            .params
            .reasoning_effort
            .as_deref()
            .is_some_and(|e| e != "none");
        let stream_usage = script.stream_usage || req.params.whole_answer;
        Box::pin(async_stream::stream! {
            if let Some(key) = &script.require_key
                && bearer.as_deref() != Some(key.as_str()) {
                    yield RunEventKind::Failed(ProviderCallError::Status { status: 401 }.failure());
                    return;
                }
            if script.hang_before_headers {
                futures::future::pending::<()>().await;
            }
            if let Some(status) = script.http_error {
                // As the HTTP mock's error body says.
                let mut failure = ProviderCallError::Status { status }.failure();
                if !matches!(status, 401 | 403 | 407) {
                    failure.provider_message = iop_wire::provider_message("scripted mock error");
                }
                yield RunEventKind::Failed(failure);
                return;
            }
            yield RunEventKind::Started { session_id };
            if api == RunApi::Embeddings {
                let chars: usize = inputs.iter().map(|i| i.chars().count()).sum();
                for (index, input) in inputs.iter().enumerate() {
                    yield RunEventKind::Embedding(Embedding {
                        index: index as u32,
                        values: mock_embedding(input),
                    });
                }
                let usage = Usage::tokens(chars.div_ceil(4) as u64, 0);
                yield RunEventKind::Completed { finish_reason: FinishReason::Stop, usage: Some(usage) };
                return;
            }
            if reasons {
                yield RunEventKind::ReasoningDelta(MOCK_REASONING.to_owned());
            }
            if json_answer {
                yield RunEventKind::TextDelta("{\"answer\": \"".to_owned());
            }
            let mut steps = play(&script, prompt);
            while let Some(step) = steps.next().await {
                match step {
                    MockStep::Text(t) => {
                        let logprob = logprobs.map(|top| {
                            let alternatives = (0..top).map(|i| {
                                if i == 0 { (t.clone(), MOCK_LOGPROB) } else { (format!("alt{i}"), MOCK_LOGPROB - f32::from(i)) }
                            });
                            vec![TokenLogprob { token: t.clone(), logprob: MOCK_LOGPROB, top: alternatives.collect() }]
                        });
                        yield RunEventKind::TextDelta(t);
                        if let Some(logprob) = logprob {
                            yield RunEventKind::Logprobs(logprob);
                        }
                    }
                    MockStep::ToolCallStart { id, name } => {
                        yield RunEventKind::ToolCallDelta(ToolCallDelta {
                            index: 0,
                            id: Some(id),
                            name: Some(name),
                            arguments_delta: String::new(),
                        });
                    }
                    MockStep::ToolCallArgs(a) => {
                        yield RunEventKind::ToolCallDelta(ToolCallDelta {
                            index: 0,
                            id: None,
                            name: None,
                            arguments_delta: a,
                        });
                    }
                    MockStep::Malformed => {
                        yield RunEventKind::Failed(ProviderCallError::Malformed.failure());
                        return;
                    }
                    MockStep::AbruptClose => {
                        yield RunEventKind::Failed(ProviderCallError::ConnectionBroke.failure());
                        return;
                    }
                    MockStep::Finish { finish_reason, usage } => {
                        if json_answer {
                            yield RunEventKind::TextDelta("\"}".to_owned());
                        }
                        // As with `stream_options.include_usage`: usage, then
                        // the terminal; none from a server whose streams
                        // carry none.
                        if !stream_usage {
                            yield RunEventKind::Completed { finish_reason, usage: None };
                            return;
                        }
                        yield RunEventKind::Usage(usage);
                        yield RunEventKind::Completed { finish_reason, usage: Some(usage) };
                        return;
                    }
                }
            }
        })
    }

    /// Relay a raw call through the mock's router.
    pub(crate) fn relay(
        &self,
        call: RelayCall,
        auth: Option<String>,
    ) -> BoxStream<'static, ProviderTunnelFrame> {
        let request = match self.request(call, auth) {
            Ok(r) => r,
            Err(e) => return failed_tunnel(e),
        };
        let router = self.router.clone();
        Box::pin(async_stream::stream! {
            let response = match router.oneshot(request).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            yield ProviderTunnelFrame::Head {
                status: response.status().as_u16(),
                headers: response_headers(response.headers()),
            };
            let mut body = response.into_body().into_data_stream();
            while let Some(chunk) = body.next().await {
                match chunk {
                    Ok(chunk) => {
                        for frame in body_frames(&chunk) {
                            yield frame;
                        }
                    }
                    Err(_) => {
                        yield ProviderTunnelFrame::Failure(ProviderCallError::ConnectionBroke.failure());
                        return;
                    }
                }
            }
            yield ProviderTunnelFrame::End;
        })
    }

    fn request(
        &self,
        call: RelayCall,
        auth: Option<String>,
    ) -> Result<Request<Body>, ProviderCallError> {
        let (method, path) = validate(&call)?;
        let mut headers = request_headers(&call.headers)?;
        if let Some(key) = auth.or_else(|| self.api_key.clone()) {
            let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| ProviderCallError::InvalidRequest("invalid credential"))?;
            value.set_sensitive(true);
            headers.insert(header::AUTHORIZATION, value);
        }
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .body(Body::from(call.body))
            .map_err(|_| ProviderCallError::InvalidRequest("invalid request"))?;
        *request.headers_mut() = headers;
        Ok(request)
    }

    /// The scripted health.
    pub(crate) async fn probe(&self, models: &[String]) -> ProbeVerdict {
        if let Some(key) = &self.defaults.require_key
            && self.api_key.as_deref() != Some(key.as_str())
        {
            return ProbeVerdict::unavailable(HealthFailureCode::AuthenticationFailed);
        }
        match self.defaults.health {
            ProbeHealth::Ok => ProbeVerdict::available(models.to_vec()),
            ProbeHealth::Unhealthy => ProbeVerdict::unavailable(HealthFailureCode::Http5xx),
            // The adapter's probe bound ends it.
            ProbeHealth::Hang => futures::future::pending().await,
        }
    }
}

/// Prompt characters as the HTTP mock counts them for the same run.
fn prompt_chars(req: &RunRequest) -> usize {
    match req.api {
        RunApi::Chat | RunApi::Embeddings => {
            req.messages.iter().map(|m| m.content.chars().count()).sum()
        }
        RunApi::Generate | RunApi::Completion => {
            let (system, prompt) = generate_prompt(&req.messages);
            system.map_or(0, |s| s.chars().count()) + prompt.chars().count()
        }
    }
}
