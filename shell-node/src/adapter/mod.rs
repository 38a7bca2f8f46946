//! Provider adapters: the one place where the Node speaks a provider's HTTP
//! API.
//!
//! An [`Adapter`] serves one configured `(adapter, target)` and offers four
//! calls the run handlers code against:
//!
//! * [`Adapter::run`]: a normalized run, as ordered [`RunEventKind`]s ending in
//!   exactly one terminal (`Completed` or `Failed`), nothing after it;
//! * [`Adapter::tunnel`]: a raw HTTP relay, as a `Head`, `Body` chunks streamed
//!   as they arrive and exactly one terminal (`End` or `Failure`);
//! * [`Adapter::ollama_api`]: an Ollama API call relayed like a tunnel;
//! * [`Adapter::probe`]: the exact-target health probe (R-WD-2, R-CAP-1).
//!
//! Dropping a returned stream drops the in-flight HTTP future, which
//! closes the provider connection: cancellation (R-WD-2, R-DISC-1) relies on
//! it. Adapters never retry (R-WD-8).
//!
//! Failures are typed ([`ProviderCallError`]) and reach the wire as an
//! [`iop_wire::ExecutionFailure`] with a sanitized [`HealthFailureCode`].
//! Credentials never enter a failure or a log line, and provider payload
//! text only as the provider's own error message of a failed call, for the
//! client: read from a bounded error body, the call's key cut out, control
//! characters stripped and its length bounded ([`iop_wire::provider_message`]),
//! and never for a 401, 403 or 407 (what the provider says about our
//! credential is not the client's).

pub mod anthropic;
pub mod client;
mod error;
mod lines;
mod mock;
mod ollama;
mod openai;
mod relay;
mod sse;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use iop_core::node::probe::{ProbeAnswer, ProbeEvidence};
use iop_wire::{
    AdapterKind, HealthFailureCode, OllamaApiCall, ProviderHealth, ProviderTunnelFrame,
    ProviderTunnelRequest, RunEventKind, RunRequest,
};

pub use client::{HttpError, ProviderHttp};
use client::{ProviderRequest, ProviderResponse};
pub use error::{ERROR_BODY_WAIT, MAX_ERROR_BODY_BYTES, ProviderCallError};
pub use lines::{LineBuffer, LineError, MAX_LINE_BYTES};
pub use sse::MAX_EVENT_BYTES;

use mock::InProcessMock;

/// The largest probe answer read; more is malformed.
pub const MAX_PROBE_BODY_BYTES: usize = 4 * 1024 * 1024;

/// The largest tunnel `Body` frame; bigger provider chunks are split.
pub const MAX_BODY_CHUNK_BYTES: usize = 64 * 1024;

/// The verdict of one exact-target health probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeVerdict {
    /// Available, unavailable or unknown.
    pub health: ProviderHealth,
    /// Why, when not available.
    pub failure: Option<HealthFailureCode>,
    /// Models the target reported (empty is a valid answer, R-HT-2).
    pub models: Vec<String>,
}

impl ProbeVerdict {
    /// How the probe ended, classified by core (R-WD-5): only an answer
    /// from the target is a verdict; a probe error or timeout is `unknown`.
    pub fn from_answer(answer: ProbeAnswer) -> Self {
        let evidence = ProbeEvidence::classify(answer);
        Self {
            health: evidence.health,
            failure: evidence.failure,
            models: Vec::new(),
        }
    }

    /// The target answered with a valid (possibly empty) model list.
    pub fn available(models: Vec<String>) -> Self {
        Self {
            models,
            ..Self::from_answer(ProbeAnswer::Models)
        }
    }

    /// The target answered that it is unhealthy for `failure`.
    pub fn unavailable(failure: HealthFailureCode) -> Self {
        Self::from_answer(ProbeAnswer::Unhealthy(failure))
    }
}

/// One provider server reached over HTTP.
#[derive(Clone)]
pub(crate) struct HttpTarget {
    /// Base URL without a trailing `/`.
    pub(crate) base_url: String,
    /// Static key of the target, used when a call brings none (never logged).
    pub(crate) api_key: Option<String>,
    pub(crate) http: ProviderHttp,
    /// The target's streams carry usage (`stream_options.include_usage`).
    /// When false, a client that takes the answer whole is answered from a
    /// non-streamed call, whose usage is the provider's own.
    pub(crate) stream_usage: bool,
    /// Streams are asked for the usage so far on every chunk (vLLM's
    /// `stream_options.continuous_usage_stats`).
    pub(crate) continuous_usage: bool,
    /// Whole answers of ephemeral runs come from non-streamed calls
    /// (core's [`iop_core::node::provider::AnswerCall::for_run`]).
    pub(crate) whole_calls: bool,
    /// The target takes a JSON Schema as `{"type":"json_object","schema":..}`.
    pub(crate) json_object_schema: bool,
    /// A Messages target receives prompt-cache breakpoints.
    pub(crate) cache_control: bool,
    /// How the target takes its key.
    pub(crate) auth: KeyHeader,
}

/// Where a provider takes its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyHeader {
    /// `Authorization: Bearer <key>` (OpenAI-compatible servers, Ollama
    /// behind a proxy).
    Bearer,
    /// `x-api-key: <key>`, with `anthropic-version` (the Messages API).
    XApiKey,
}

impl HttpTarget {
    /// The key for a call: the call's own secret wins over the static key.
    pub(crate) fn key(&self, auth: Option<String>) -> Option<String> {
        auth.or_else(|| self.api_key.clone())
    }

    /// Send `request` with the call's key ([`HttpTarget::key`]) where the
    /// target takes it; the answer whatever its status, or the typed
    /// transport failure.
    pub(crate) async fn send(
        &self,
        request: ProviderRequest,
        auth: Option<String>,
    ) -> Result<ProviderResponse, ProviderCallError> {
        let key = self.key(auth);
        let request = match (self.auth, key) {
            (KeyHeader::Bearer, Some(key)) => request.bearer_auth(&key),
            (KeyHeader::Bearer, None) => request,
            (KeyHeader::XApiKey, key) => {
                let request = request.header_if_absent(
                    http::header::HeaderName::from_static("anthropic-version"),
                    anthropic::ANTHROPIC_VERSION,
                );
                match key {
                    Some(key) => request
                        .sensitive_header(http::header::HeaderName::from_static("x-api-key"), &key),
                    None => request,
                }
            }
        };
        request.send().await.map_err(|e| error::from_http(e, false))
    }

    /// [`HttpTarget::send`], with an HTTP error status a failure too. The
    /// error body is the provider's text: it is never read into a failure.
    pub(crate) async fn send_expecting_success(
        &self,
        request: ProviderRequest,
        auth: Option<String>,
    ) -> Result<ProviderResponse, ProviderCallError> {
        let response = self.send(request, auth).await?;
        if !response.status().is_success() {
            let status = response.status().as_u16();
            return Err(ProviderCallError::Status { status });
        }
        Ok(response)
    }

    /// The streamed JSON `POST` of a run to `path`.
    pub(crate) fn run_request(&self, path: &str, body: Vec<u8>) -> ProviderRequest {
        self.http
            .post(format!("{}{path}", self.base_url))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body)
    }
}

/// A run over HTTP: send `request`, then `Started` and the events `decode`
/// reads from the successful answer. Failing to send or an error status is
/// the run's one `Failed`, and `Started` is never sent; an error status's
/// failure carries the provider's own message ([`error::status_failure`]).
pub(crate) fn http_run(
    target: HttpTarget,
    request: ProviderRequest,
    auth: Option<String>,
    session_id: String,
    decode: fn(ProviderResponse) -> BoxStream<'static, RunEventKind>,
) -> BoxStream<'static, RunEventKind> {
    Box::pin(async_stream::stream! {
        let key = target.key(auth.clone());
        let response = match target.send(request, auth).await {
            Ok(r) => r,
            Err(e) => {
                yield RunEventKind::Failed(e.failure());
                return;
            }
        };
        if !response.status().is_success() {
            yield RunEventKind::Failed(error::status_failure(response, key.as_deref()).await);
            return;
        }
        yield RunEventKind::Started { session_id };
        let mut events = decode(response);
        while let Some(event) = events.next().await {
            yield event;
        }
    })
}

#[derive(Clone)]
enum Backend {
    OpenAi(HttpTarget),
    Ollama(HttpTarget),
    Anthropic(HttpTarget),
    Mock(InProcessMock),
    /// An HTTP adapter without a base URL: every call fails `internal`.
    Unconfigured(AdapterKind),
}

struct AdapterInner {
    target: String,
    models: Vec<String>,
    backend: Backend,
}

/// One configured `(adapter, target)`: cheap to clone, shared by every run
/// of that target.
#[derive(Clone)]
pub struct Adapter {
    inner: Arc<AdapterInner>,
}

impl std::fmt::Debug for Adapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // No base URL or key: base URLs may embed credentials.
        f.debug_struct("Adapter")
            .field("kind", &self.kind())
            .field("target", &self.inner.target)
            .field("models", &self.inner.models)
            .finish_non_exhaustive()
    }
}

impl Adapter {
    /// The adapter for a validated provider entry. `http` is shared by every
    /// adapter of the process; the mock ignores it.
    pub fn new(target: &crate::config::ProviderTarget, http: ProviderHttp) -> Self {
        let http_target = |base_url: &String| HttpTarget {
            base_url: base_url.trim_end_matches('/').to_owned(),
            api_key: target.api_key.clone(),
            // A provider's plain-`http` calls are driven by the run's task
            // (`ProviderHttp::caller_driven`): no connection task between
            // the provider's socket and the run (issue 42's hops).
            http: http.caller_driven(),
            stream_usage: target.stream_usage,
            continuous_usage: target.continuous_usage,
            whole_calls: target.whole_calls,
            json_object_schema: target.json_object_schema,
            cache_control: target.cache_control,
            auth: match target.adapter {
                AdapterKind::Anthropic => KeyHeader::XApiKey,
                AdapterKind::OpenAi | AdapterKind::Ollama | AdapterKind::Mock => KeyHeader::Bearer,
            },
        };
        let backend = match (target.adapter, &target.base_url) {
            (AdapterKind::Mock, _) => Backend::Mock(InProcessMock::new(
                crate::mock::MockScript::default(),
                target.api_key.clone(),
            )),
            (AdapterKind::OpenAi, Some(url)) => Backend::OpenAi(http_target(url)),
            (AdapterKind::Ollama, Some(url)) => Backend::Ollama(http_target(url)),
            (AdapterKind::Anthropic, Some(url)) => Backend::Anthropic(http_target(url)),
            (kind, None) => Backend::Unconfigured(kind),
        };
        Self::with_backend(target.target.clone(), target.models.clone(), backend)
    }

    /// A `mock` adapter running `script` in process, for tests and demos.
    pub fn in_process_mock(target: &str, script: crate::mock::MockScript) -> Self {
        Self::with_backend(
            target.to_owned(),
            Vec::new(),
            Backend::Mock(InProcessMock::new(script, None)),
        )
    }

    fn with_backend(target: String, mut models: Vec<String>, backend: Backend) -> Self {
        if models.is_empty() && matches!(backend, Backend::Mock(_)) {
            models.push(crate::mock::DEFAULT_MODEL.to_owned());
        }
        Self {
            inner: Arc::new(AdapterInner {
                target,
                models,
                backend,
            }),
        }
    }

    /// The kind of provider server.
    pub fn kind(&self) -> AdapterKind {
        match &self.inner.backend {
            Backend::OpenAi(_) => AdapterKind::OpenAi,
            Backend::Ollama(_) => AdapterKind::Ollama,
            Backend::Anthropic(_) => AdapterKind::Anthropic,
            Backend::Mock(_) => AdapterKind::Mock,
            Backend::Unconfigured(kind) => *kind,
        }
    }

    /// The target name.
    pub fn target(&self) -> &str {
        &self.inner.target
    }

    /// The configured models (informational).
    pub fn models(&self) -> &[String] {
        &self.inner.models
    }

    /// A normalized run: ordered events ending in exactly one terminal
    /// (`Completed` or `Failed`), nothing after it. `auth` is a bearer secret
    /// for the provider request's auth header only (never logged); without
    /// it the target's static key is used.
    pub fn run(&self, req: RunRequest, auth: Option<String>) -> BoxStream<'static, RunEventKind> {
        let events = match &self.inner.backend {
            Backend::OpenAi(t) => openai::run(t.clone(), req, auth),
            Backend::Ollama(t) => ollama::run(t.clone(), req, auth),
            Backend::Anthropic(t) => anthropic::run(t.clone(), req, auth),
            Backend::Mock(m) => m.run(req, auth),
            Backend::Unconfigured(_) => failed_run(ProviderCallError::Unconfigured),
        };
        one_terminal(events, RunEventKind::is_terminal, || {
            RunEventKind::Failed(ProviderCallError::missing_terminal())
        })
    }

    /// A raw tunnel: `Head`, `Body` chunks streamed as they arrive (never the
    /// whole body buffered), exactly one terminal (`End` or `Failure`).
    /// HTTP error statuses are relayed as they are; only transport failures
    /// become a `Failure`.
    pub fn tunnel(
        &self,
        req: ProviderTunnelRequest,
        auth: Option<String>,
    ) -> BoxStream<'static, ProviderTunnelFrame> {
        let call = relay::RelayCall {
            method: req.method,
            path: req.path,
            headers: req.headers,
            body: req.body,
            scope: relay::PathScope::Any,
        };
        self.relay(call, auth)
    }

    /// An Ollama API call relayed to this target, streamed like a tunnel.
    /// Paths outside `/api/` are refused with an `invalid_request` failure.
    pub fn ollama_api(&self, call: OllamaApiCall) -> BoxStream<'static, ProviderTunnelFrame> {
        let call = relay::RelayCall {
            method: call.method,
            path: call.path,
            headers: Vec::new(),
            body: call.body,
            scope: relay::PathScope::OllamaApi,
        };
        self.relay(call, None)
    }

    fn relay(
        &self,
        call: relay::RelayCall,
        auth: Option<String>,
    ) -> BoxStream<'static, ProviderTunnelFrame> {
        let frames = match &self.inner.backend {
            Backend::OpenAi(t) | Backend::Ollama(t) | Backend::Anthropic(t) => {
                relay::relay(t.clone(), call, auth)
            }
            Backend::Mock(m) => m.relay(call, auth),
            Backend::Unconfigured(_) => failed_tunnel(ProviderCallError::Unconfigured),
        };
        one_terminal(frames, ProviderTunnelFrame::is_terminal, || {
            ProviderTunnelFrame::Failure(ProviderCallError::missing_terminal())
        })
    }

    /// The exact-target health probe: the adapter's cheapest real liveness
    /// call (openai and anthropic: `GET /v1/models`; ollama: `GET /api/tags`; mock: its
    /// scripted health). An empty but valid model list is success (R-HT-2).
    /// The whole probe, HTTP included, is bounded by `bound` (the node's
    /// `[watchdog] probe_bound_ms`); reaching it drops the request. What
    /// the ending means is core's decision ([`ProbeEvidence::classify`]):
    /// a timeout, a transport error or an unreadable answer is `unknown`
    /// (R-WD-5), an error status `unavailable`.
    pub async fn probe(&self, bound: Duration) -> ProbeVerdict {
        let probe = async {
            match &self.inner.backend {
                Backend::OpenAi(t) => openai::probe(t).await,
                Backend::Ollama(t) => ollama::probe(t).await,
                Backend::Anthropic(t) => anthropic::probe(t).await,
                Backend::Mock(m) => m.probe(&self.inner.models).await,
                // No base URL: this node can never reach the target.
                Backend::Unconfigured(_) => {
                    ProbeVerdict::unavailable(HealthFailureCode::TransportFailed)
                }
            }
        };
        tokio::time::timeout(bound, probe)
            .await
            .unwrap_or_else(|_| ProbeVerdict::from_answer(ProbeAnswer::TimedOut))
    }
}

/// The largest non-streamed answer read (a whole chat completion, a whole
/// Ollama answer or an embeddings list); more is malformed.
pub(crate) const MAX_WHOLE_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// Read a whole answer body, bounded by [`MAX_WHOLE_ANSWER_BYTES`].
pub(crate) async fn read_whole(
    mut response: ProviderResponse,
) -> Result<Vec<u8>, ProviderCallError> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > MAX_WHOLE_ANSWER_BYTES {
                    return Err(ProviderCallError::Malformed);
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body),
            Err(e) => return Err(error::from_http(e, true)),
        }
    }
}

/// What a non-streamed answer says: its events in order, then its terminal.
pub(crate) type WholeAnswer = (Vec<RunEventKind>, RunEventKind);

/// The run events of one non-streamed answer: its body read whole
/// ([`read_whole`]), `parse` makes its events and terminal, and the events
/// go out cut to frame size ([`frame_sized`], R-LIM-3) before the terminal.
pub(crate) fn whole_answer_run(
    response: ProviderResponse,
    parse: fn(&[u8]) -> Result<WholeAnswer, ProviderCallError>,
) -> BoxStream<'static, RunEventKind> {
    Box::pin(async_stream::stream! {
        let parsed = match read_whole(response).await {
            Ok(body) => parse(&body),
            Err(e) => Err(e),
        };
        match parsed {
            Ok((events, terminal)) => {
                let mut pieces = Vec::with_capacity(events.len());
                for event in events {
                    frame_sized(event, &mut pieces);
                }
                for event in pieces {
                    yield event;
                }
                yield terminal;
            }
            Err(e) => yield RunEventKind::Failed(e.failure()),
        }
    })
}

/// The most bytes of text, reasoning or tool-call arguments in one event
/// cut from a whole answer: every frame a Node sends stays far under
/// [`iop_wire::NODE_FRAME_MAX_LEN`] (R-LIM-3) whatever the answer's size.
pub const MAX_PIECE_BYTES: usize = 1024 * 1024;

/// The most token log probabilities in one event cut from a whole answer
/// (each at most a token and its top alternatives).
pub const MAX_PIECE_LOGPROBS: usize = 1024;

/// `event` as events that each fit a Node frame: a whole answer's text,
/// reasoning, tool-call arguments and log probabilities cut into pieces
/// (at character boundaries) in order, which the Edge joins as it joins a
/// streamed answer's deltas. Anything else, and anything small, as it is.
pub(crate) fn frame_sized(event: RunEventKind, out: &mut Vec<RunEventKind>) {
    match event {
        RunEventKind::TextDelta(text) if text.len() > MAX_PIECE_BYTES => {
            out.extend(pieces(&text).map(|p| RunEventKind::TextDelta(p.to_owned())));
        }
        RunEventKind::ReasoningDelta(text) if text.len() > MAX_PIECE_BYTES => {
            out.extend(pieces(&text).map(|p| RunEventKind::ReasoningDelta(p.to_owned())));
        }
        RunEventKind::ToolCallDelta(call) if call.arguments_delta.len() > MAX_PIECE_BYTES => {
            let mut first = Some((call.id, call.name));
            for piece in pieces(&call.arguments_delta) {
                let (id, name) = first.take().unwrap_or((None, None));
                out.push(RunEventKind::ToolCallDelta(iop_wire::ToolCallDelta {
                    index: call.index,
                    id,
                    name,
                    arguments_delta: piece.to_owned(),
                }));
            }
        }
        RunEventKind::Logprobs(tokens) if tokens.len() > MAX_PIECE_LOGPROBS => {
            out.extend(
                tokens
                    .chunks(MAX_PIECE_LOGPROBS)
                    .map(|c| RunEventKind::Logprobs(c.to_vec())),
            );
        }
        event => out.push(event),
    }
}

/// `text` in consecutive pieces of at most [`MAX_PIECE_BYTES`], cut at
/// character boundaries.
fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len().min(MAX_PIECE_BYTES);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

/// A run that fails at once.
pub(crate) fn failed_run(err: ProviderCallError) -> BoxStream<'static, RunEventKind> {
    futures::stream::once(async move { RunEventKind::Failed(err.failure()) }).boxed()
}

/// A tunnel that fails at once.
pub(crate) fn failed_tunnel(err: ProviderCallError) -> BoxStream<'static, ProviderTunnelFrame> {
    futures::stream::once(async move { ProviderTunnelFrame::Failure(err.failure()) }).boxed()
}

/// Enforce the stream contract whatever the backend does: items up to and
/// including the first terminal, nothing after it, and a synthesized
/// terminal if the backend ends without one.
fn one_terminal<T: Send + 'static>(
    inner: BoxStream<'static, T>,
    is_terminal: fn(&T) -> bool,
    missing: fn() -> T,
) -> BoxStream<'static, T> {
    Box::pin(async_stream::stream! {
        let mut inner = inner;
        while let Some(item) = inner.next().await {
            let terminal = is_terminal(&item);
            yield item;
            if terminal {
                return;
            }
        }
        yield missing();
    })
}

/// GET `path` and parse the answer with `models`. Unbounded here: the
/// caller ([`Adapter::probe`]) bounds the whole probe.
async fn probe_http(
    target: &HttpTarget,
    path: &str,
    models: fn(&[u8]) -> Option<Vec<String>>,
) -> ProbeVerdict {
    let request = target.http.get(format!("{}{path}", target.base_url));
    let mut response = match target.send_expecting_success(request, None).await {
        Ok(r) => r,
        Err(e) => return ProbeVerdict::from_answer(e.probe_answer()),
    };
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > MAX_PROBE_BODY_BYTES {
                    return ProbeVerdict::from_answer(ProbeAnswer::Malformed);
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => break,
            Err(e) => return ProbeVerdict::from_answer(error::from_http(e, true).probe_answer()),
        }
    }
    match models(&body) {
        Some(models) => ProbeVerdict::available(models),
        None => ProbeVerdict::from_answer(ProbeAnswer::Malformed),
    }
}

#[cfg(test)]
pub(crate) mod tests;
