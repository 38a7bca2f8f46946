//! What the Edge records about one client request beyond its outcome:
//! the request span (the root of the request's trace on the Edge), one
//! span per queue wait and per attempt, tokens from provider usage,
//! attempts per request and time in queue (R-OBS-1: closed labels and
//! configured names only; spans never hold a prompt, an output or a key).
//!
//! The request span is started where the HTTP request enters the run
//! pipeline ([`start_request`]); its trace context comes from the client's
//! `traceparent` header or is new, and travels to the Node in the run or
//! tunnel request so the Node's spans join the same trace.
//!
//! The request driver reports each attempt through [`AttemptObservation`]
//! and each wait for capacity through [`QueueWait`]:
//!
//! 1. before admission: `QueueWait::start(&metrics, work.trace_context, route)`;
//!    when the lease is granted `wait.granted(&provider)`, else
//!    `wait.failed(class)`;
//! 2. when the lease is granted: `AttemptObservation::start(&metrics,
//!    work.trace_context, route, &work.model, &provider, attempt_number)`,
//!    and the request sent to the Node carries `attempt.context()` (so the
//!    Node's `node.run` span is a child of `edge.attempt`);
//! 3. every run event relayed: `attempt.event(&kind)`; tunnel body bytes:
//!    `attempt.relayed_body()`;
//! 4. the attempt's end: `attempt.finish(None)` on success, or
//!    `attempt.finish(Some(code))` with its failure code;
//! 5. the request's end: `metrics.attempts_per_request(route, attempts)`,
//!    and [`genai_operation`] with the request's [`RequestView`].
//!
//! ## GenAI conventions
//!
//! The request span and three histograms follow the OpenTelemetry GenAI
//! semantic conventions (development status; names as of semconv 1.41):
//! `gen_ai.operation.name` (from the route), `gen_ai.provider.name` (the
//! adapter of the provider of the last attempt), `gen_ai.request.model` and
//! `gen_ai.response.model` (the configured route the model matched, never
//! the client's string: a wildcard route is its pattern), token usage and
//! finish reasons from the answer, and `server.address`, the Node that
//! reached the provider. Metrics carry the operation, provider name, route
//! model, token type and `error.type`: closed values and configured names.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use iop_core::ids::ProviderId;
use iop_transport::traces::{Kind, SpanValue, TRACEPARENT_HEADER, TraceSpan, parse_traceparent};
use iop_wire::{FailureCode, RunEventKind, TraceContext, Usage};

use crate::genai::{self, GenAiLabels, operation_name};
use crate::in_flight::RequestView;
use crate::metrics::{ATTEMPT_OK, EdgeMetrics};

/// What a request's view says of its GenAI operation: its labels, and the
/// Node that served its last attempt; `None` if no provider was reached.
fn genai_of(metrics: &EdgeMetrics, view: &RequestView) -> Option<(GenAiLabels, String)> {
    let read = view.read();
    let provider = read.provider_id?;
    let (adapter, node) = metrics.provider_facts(provider.as_str())?;
    let p = read.progress;
    // Failed: how the client was told, else how its last attempt ended; an
    // answer that finished did not fail.
    let error_type = match (p.finish_reason, view.failure()) {
        (_, Some(failure)) => Some(failure),
        (Some(_), None) => None,
        (None, None) => Some(view.last_attempt_failure().unwrap_or("canceled")),
    };
    Some((
        GenAiLabels {
            operation: operation_name(view.route()),
            provider_name: adapter,
            model: metrics.route_model(view.model()).to_owned(),
            error_type,
        },
        node.to_owned(),
    ))
}

/// Record the GenAI operation metrics of a request whose driver ended
/// (once per request, whoever waits for it).
pub fn genai_operation(metrics: &EdgeMetrics, view: &RequestView) {
    let Some((labels, _node)) = genai_of(metrics, view) else {
        return;
    };
    let read = view.read();
    let first_chunk = view
        .streamed()
        .then_some(read.progress.first_content)
        .flatten();
    metrics.genai_operation(
        &labels,
        view.started().elapsed(),
        read.progress.usage,
        first_chunk,
    );
}

/// Set the GenAI attributes the request's view holds on its span (at the
/// request's end).
pub fn genai_attributes(metrics: &EdgeMetrics, span: &TraceSpan, view: &RequestView) {
    if !span.is_recording() {
        return;
    }
    let model = metrics.route_model(view.model());
    span.set_configured(genai::REQUEST_MODEL, model);
    span.set_configured(genai::RESPONSE_MODEL, model);
    let read = view.read();
    if let Some((labels, node)) = genai_of(metrics, view) {
        span.set(genai::PROVIDER_NAME, labels.provider_name);
        span.set_configured(genai::SERVER_ADDRESS, &node);
    }
    if let Some(usage) = read.progress.usage {
        span.set(genai::USAGE_INPUT_TOKENS, usage.prompt_tokens);
        span.set(genai::USAGE_OUTPUT_TOKENS, usage.completion_tokens);
        // Only what the provider reported: never a zero it did not say.
        if let Some(n) = usage.cache_read_tokens {
            span.set(genai::USAGE_CACHE_READ_INPUT_TOKENS, n);
        }
        if let Some(n) = usage.cache_write_tokens {
            span.set(genai::USAGE_CACHE_CREATION_INPUT_TOKENS, n);
        }
    }
    if let Some(reason) = read.progress.finish_reason {
        span.set(
            genai::RESPONSE_FINISH_REASONS,
            SpanValue::ClosedList(vec![reason.as_str()]),
        );
    }
}

/// Span and attribute names (documented in `docs/operations.md`).
pub mod names {
    /// The client request on the Edge (kind server).
    pub const REQUEST: &str = "edge.request";
    /// One wait for a capacity lease.
    pub const QUEUE_WAIT: &str = "edge.queue_wait";
    /// One attempt on a provider (kind client; the Node's spans are its
    /// children).
    pub const ATTEMPT: &str = "edge.attempt";
}

/// Start the request span: a child of the client's `traceparent` when it
/// sent a well-formed one, else the root of a new trace.
pub fn start_request(metrics: &EdgeMetrics, route: &'static str, headers: &HeaderMap) -> TraceSpan {
    let parent = parse_traceparent(headers.get(TRACEPARENT_HEADER).map(|v| v.as_bytes()));
    let span = metrics.tracer().start(names::REQUEST, Kind::Server, parent);
    span.set("iop.route", route);
    span.set(genai::OPERATION_NAME, operation_name(route));
    span
}

/// End-of-request attributes: the closed outcome, the HTTP-level result
/// and the bytes streamed.
pub fn finish_request(span: &TraceSpan, outcome: &'static str, relayed_bytes: u64) {
    span.set("iop.outcome", outcome);
    span.set("iop.relayed_bytes", relayed_bytes);
    if outcome == "ok" {
        span.ok();
    } else {
        span.fail(outcome);
    }
}

/// The usage an attempt reports: the latest report wins, and a terminal's
/// usage replaces any earlier one (usage reports are cumulative).
#[derive(Debug, Clone, Copy, Default)]
pub struct UsageTally {
    usage: Option<Usage>,
}

impl UsageTally {
    /// Take `event`'s usage, if it carries one.
    pub fn observe(&mut self, event: &RunEventKind) {
        match event {
            RunEventKind::Usage(u) => self.usage = Some(*u),
            RunEventKind::Completed { usage: Some(u), .. } => self.usage = Some(*u),
            _ => {}
        }
    }

    /// The attempt's usage, if the provider reported any.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }
}

/// One wait for a capacity lease.
#[derive(Debug)]
pub struct QueueWait {
    metrics: Arc<EdgeMetrics>,
    span: TraceSpan,
    route: &'static str,
    started: Instant,
}

impl QueueWait {
    /// The request asks for a lease now.
    pub fn start(
        metrics: &Arc<EdgeMetrics>,
        parent: Option<TraceContext>,
        route: &'static str,
    ) -> Self {
        let span = metrics
            .tracer()
            .start(names::QUEUE_WAIT, Kind::Internal, parent);
        Self {
            metrics: metrics.clone(),
            span,
            route,
            started: Instant::now(),
        }
    }

    /// A lease on `provider` was granted.
    pub fn granted(self, provider: &ProviderId) -> Duration {
        let waited = self.started.elapsed();
        self.metrics.queue_wait(self.route, waited);
        self.span.set_configured("iop.provider", provider.as_str());
        self.span.ok();
        waited
    }

    /// No lease: `class` is the closed admission failure
    /// (`queue_full`, `no_eligible_provider`, `queue_timeout`, ...).
    pub fn failed(self, class: &'static str) {
        self.span.fail(class);
    }
}

/// One attempt of a request on one provider.
#[derive(Debug)]
pub struct AttemptObservation {
    metrics: Arc<EdgeMetrics>,
    span: TraceSpan,
    provider: String,
    route_model: String,
    usage: UsageTally,
    started: Instant,
    first_content: bool,
    relayed_events: u64,
}

impl AttemptObservation {
    /// Attempt `number` (1-based) of a request for `model` on `provider`
    /// starts now.
    pub fn start(
        metrics: &Arc<EdgeMetrics>,
        parent: Option<TraceContext>,
        route: &'static str,
        model: &str,
        provider: &ProviderId,
        number: u32,
    ) -> Self {
        let span = metrics.tracer().start(names::ATTEMPT, Kind::Client, parent);
        span.set("iop.route", route);
        span.set_configured("iop.provider", provider.as_str());
        span.set("iop.attempt", number);
        Self {
            route_model: metrics.route_model(model).to_owned(),
            metrics: metrics.clone(),
            span,
            provider: provider.as_str().to_owned(),
            usage: UsageTally::default(),
            started: Instant::now(),
            first_content: false,
            relayed_events: 0,
        }
    }

    /// The trace context the Node's spans join (this attempt's span).
    pub fn context(&self) -> Option<TraceContext> {
        self.span.context()
    }

    /// One run event from the Node.
    pub fn event(&mut self, event: &RunEventKind) {
        self.usage.observe(event);
        self.relayed_events += 1;
        if !self.first_content
            && matches!(
                event,
                RunEventKind::TextDelta(_) | RunEventKind::ToolCallDelta(_)
            )
        {
            self.first_content();
        }
    }

    /// Tunnelled body bytes arrived (their first is the first content).
    pub fn relayed_body(&mut self) {
        self.relayed_events += 1;
        if !self.first_content {
            self.first_content();
        }
    }

    fn first_content(&mut self) {
        self.first_content = true;
        let ttft_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.span
            .event("first_content", &[("iop.ttft_ms", ttft_ms.into())]);
    }

    /// The attempt ended: `None` on success, else its failure code.
    pub fn finish(self, failure: Option<FailureCode>) {
        let outcome = failure.map_or(ATTEMPT_OK, FailureCode::as_str);
        self.metrics.attempt(&self.provider, outcome);
        if let Some(usage) = self.usage.usage() {
            self.metrics
                .tokens(&self.provider, &self.route_model, usage);
            self.span.set("iop.input_tokens", usage.prompt_tokens);
            self.span.set("iop.output_tokens", usage.completion_tokens);
        }
        self.span.set("iop.relayed_events", self.relayed_events);
        self.span.set("iop.outcome", outcome);
        match failure {
            None => self.span.ok(),
            Some(code) => self.span.fail(code.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use iop_transport::telemetry::MetricsPipeline;
    use iop_wire::FinishReason;

    use super::*;
    use crate::metrics::scrape_value;

    fn metrics() -> Arc<EdgeMetrics> {
        let m = EdgeMetrics::new(MetricsPipeline::prometheus_only("iop-edge"));
        m.set_route_models(vec!["llama3".into(), "mock*".into()]);
        m
    }

    fn usage(p: u64, c: u64) -> Usage {
        Usage::tokens(p, c)
    }

    #[test]
    fn usage_tally_keeps_the_latest_report_and_the_terminal_wins() {
        let mut t = UsageTally::default();
        assert_eq!(t.usage(), None);
        t.observe(&RunEventKind::TextDelta("x".into()));
        t.observe(&RunEventKind::Usage(usage(3, 1)));
        t.observe(&RunEventKind::Usage(usage(3, 2)));
        assert_eq!(t.usage(), Some(usage(3, 2)));
        t.observe(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(3, 5)),
        });
        assert_eq!(t.usage(), Some(usage(3, 5)));
        t.observe(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: None,
        });
        assert_eq!(
            t.usage(),
            Some(usage(3, 5)),
            "a terminal without usage keeps the last"
        );
    }

    #[test]
    fn an_attempt_counts_its_outcome_and_provider_tokens_under_the_route_model() {
        let m = metrics();
        let p1 = ProviderId::new("p1");
        let mut a = AttemptObservation::start(&m, None, "chat", "mock:tps=5", &p1, 1);
        a.event(&RunEventKind::TextDelta("SENTINEL".into()));
        a.event(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            usage: Some(usage(7, 11)),
        });
        a.finish(None);
        let b = AttemptObservation::start(&m, None, "chat", "llama3", &p1, 2);
        b.finish(Some(FailureCode::ResponseStalled));
        let text = m.render();
        let v = |name, labels: &[(&str, &str)]| scrape_value(&text, name, labels);
        assert_eq!(
            v(
                "iop_edge_provider_tokens_total",
                &[("provider", "p1"), ("model", "mock*"), ("kind", "input")]
            ),
            7.0
        );
        assert_eq!(
            v(
                "iop_edge_provider_tokens_total",
                &[("provider", "p1"), ("model", "mock*"), ("kind", "output")]
            ),
            11.0
        );
        assert_eq!(
            v(
                "iop_edge_attempts_total",
                &[("provider", "p1"), ("outcome", "ok")]
            ),
            1.0
        );
        assert_eq!(
            v(
                "iop_edge_attempts_total",
                &[("provider", "p1"), ("outcome", "response_stalled")]
            ),
            1.0
        );
        assert!(!text.contains("SENTINEL") && !text.contains("mock:tps"));
    }

    #[test]
    fn a_genai_operation_is_recorded_under_closed_labels_and_prometheus_names() {
        let m = metrics();
        m.set_providers(
            [("p1".to_owned(), ("openai", "node-1".to_owned()))]
                .into_iter()
                .collect(),
        );
        let view = RequestView::new("chat", "mock:SENTINEL", true);
        view.attempt_started(&ProviderId::new("p1"), 1);
        view.committed();
        view.delivered(&RunEventKind::Completed {
            finish_reason: FinishReason::Stop,
            // 7 prompt tokens, 4 of them read from the provider's cache
            // and 2 written to it.
            usage: Some(Usage {
                cache_read_tokens: Some(4),
                cache_write_tokens: Some(2),
                ..usage(7, 11)
            }),
        });
        view.attempt_ended(None);
        genai_operation(&m, &view);
        let failed = RequestView::new("embeddings", "llama3", false);
        failed.attempt_started(&ProviderId::new("p1"), 1);
        failed.attempt_ended(Some(FailureCode::ProviderError));
        failed.failed(iop_core::edge::gate::GateFailure::Attempt(
            FailureCode::ProviderError,
        ));
        genai_operation(&m, &failed);
        // No provider reached: no GenAI operation.
        genai_operation(&m, &RequestView::new("chat", "llama3", false));
        let text = m.render();
        let v = |name, labels: &[(&str, &str)]| scrape_value(&text, name, labels);
        let chat = [
            ("gen_ai_operation_name", "chat"),
            ("gen_ai_provider_name", "openai"),
            ("gen_ai_request_model", "mock*"),
        ];
        assert_eq!(
            v("gen_ai_client_operation_duration_count", &chat),
            1.0,
            "{text}"
        );
        let with = |more: (&'static str, &'static str)| {
            let mut l = chat.to_vec();
            l.push(more);
            l
        };
        assert_eq!(
            v(
                "gen_ai_client_token_usage_sum",
                &with(("gen_ai_token_type", "output"))
            ),
            11.0
        );
        assert_eq!(
            v(
                "gen_ai_client_token_usage_sum",
                &with(("gen_ai_token_type", "input"))
            ),
            7.0,
            "input tokens count the cached ones"
        );
        // The prompt cache's counts: counters of their own.
        let unknown = with(("gen_ai_token_modality", "unknown"));
        assert_eq!(
            v(
                "gen_ai_client_inference_usage_cache_read_input_tokens_total",
                &unknown
            ),
            4.0,
            "{text}"
        );
        assert_eq!(
            v(
                "gen_ai_client_inference_usage_cache_write_input_tokens_total",
                &unknown
            ),
            2.0
        );
        assert_eq!(
            v("gen_ai_client_operation_time_to_first_chunk_count", &chat),
            1.0
        );
        let embed = [
            ("gen_ai_operation_name", "embeddings"),
            ("error_type", "provider_error"),
        ];
        assert_eq!(v("gen_ai_client_operation_duration_count", &embed), 1.0);
        assert_eq!(
            v("gen_ai_client_operation_duration_count", &[]),
            2.0,
            "the request that reached no provider is no operation"
        );
        assert_eq!(
            v(
                "gen_ai_client_operation_time_to_first_chunk_count",
                &[("gen_ai_operation_name", "embeddings")]
            ),
            0.0,
            "only streamed answers have a first chunk"
        );
        assert!(!text.contains("SENTINEL"));
    }

    #[test]
    fn an_unrouted_model_is_labelled_other_never_by_its_name() {
        let m = metrics();
        assert_eq!(m.route_model("llama3"), "llama3");
        assert_eq!(m.route_model("mock-anything"), "mock*");
        assert_eq!(m.route_model("client-chosen-SENTINEL"), "other");
    }

    #[test]
    fn queue_wait_and_attempts_per_request_are_histograms_by_route() {
        let m = metrics();
        let w = QueueWait::start(&m, None, "responses");
        w.granted(&ProviderId::new("p1"));
        QueueWait::start(&m, None, "responses").failed("queue_full");
        m.attempts_per_request("responses", 2);
        let text = m.render();
        assert_eq!(
            scrape_value(
                &text,
                "iop_edge_queue_wait_seconds_count",
                &[("route", "responses")]
            ),
            1.0
        );
        assert_eq!(
            scrape_value(
                &text,
                "iop_edge_request_attempts_sum",
                &[("route", "responses")]
            ),
            2.0
        );
    }
}
