//! Node metrics: the stall watchdog's observations as OpenTelemetry
//! instruments, exported as Prometheus text on the optional
//! `[node] metrics_listen` address and over OTLP when `[otlp]` is set
//! (R-OBS-1: closed label values only; `adapter` and `target` are the
//! node's configured targets).
//!
//! Series from the start: every counter whose label set is closed is
//! declared at 0 when the node starts, per configured target where a label
//! is a target ([`NodeMetrics::observe_link`]).

use std::sync::Arc;
use std::time::Instant;

use iop_transport::telemetry::{BoundSets, MetricsPipeline};
use iop_transport::traces::{Kind, TracePipeline, TraceSpan, Tracer};
use iop_wire::{AdapterKind, FailureCode, ProviderHealth, StreamErrorCode, Usage};
use opentelemetry::KeyValue;
use opentelemetry::metrics::{BoundCounter, BoundHistogram, Counter, Histogram};

/// Stall kinds (`kind` label).
pub const RUN_KINDS: &[&str] = &["normalized", "tunnel"];
/// Why a credential lease was refused (`reason` label), a closed set.
pub const CREDENTIAL_REJECTION_REASONS: &[&str] = &[
    "missing_lease",
    "no_recipient_key",
    "no_signing_key",
    "revoked",
    "disabled",
    "expired",
    "not_yet_valid",
    "stale_revision",
    "replayed",
    "replay_cache_full",
    "wrong_recipient",
    "tampered",
    "bad_signature",
    "binding_mismatch_node",
    "binding_mismatch_generation",
    "binding_mismatch_slot",
    "binding_mismatch_target",
    "binding_mismatch_profile",
    "binding_mismatch_route",
    "binding_mismatch_principal",
    "malformed",
    "unsupported_version",
];
/// The outcome of a run or tunnel that ended without a failure.
pub const RUN_OK: &str = "ok";

/// Every run outcome: `ok` and each failure code.
pub fn run_outcomes() -> impl Iterator<Item = &'static str> {
    std::iter::once(RUN_OK).chain(FailureCode::ALL.iter().map(|c| c.as_str()))
}

const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Every Node instrument.
pub struct NodeMetrics {
    pipeline: MetricsPipeline,
    stalls: Counter<u64>,
    credential_rejections: Counter<u64>,
    wire_protocol_errors: Counter<u64>,
    stall_duration: Histogram<f64>,
    runs: Counter<u64>,
    tokens: Counter<u64>,
    relayed_bytes: Counter<u64>,
    ttft: Histogram<f64>,
    probes: Counter<u64>,
    /// The instruments a run measures, bound per configured target met.
    targets: BoundSets<(AdapterKind, String), TargetBound>,
    traces: TracePipeline,
}

/// A target's labels.
fn target_pair(adapter: AdapterKind, target: &str) -> [KeyValue; 2] {
    [
        KeyValue::new("adapter", adapter.as_str()),
        KeyValue::new("target", target.to_owned()),
    ]
}

/// A target's labels and one more.
fn target_labels(
    adapter: AdapterKind,
    target: &str,
    key: &'static str,
    value: &'static str,
) -> [KeyValue; 3] {
    let [a, t] = target_pair(adapter, target);
    [a, t, KeyValue::new(key, value)]
}

/// The instruments a run or tunnel on one target measures, bound to its
/// labels (`adapter`, `target`, and the one label each adds).
struct TargetBound {
    target: String,
    /// `iop_node_runs` per outcome.
    runs: BoundSets<&'static str, BoundCounter<u64>>,
    /// `iop_node_provider_tokens`, input and output.
    tokens: [BoundCounter<u64>; 2],
    /// `iop_node_relayed_bytes` per kind (normalized, tunnel).
    relayed_bytes: BoundSets<&'static str, BoundCounter<u64>>,
    ttft: BoundHistogram<f64>,
}

impl std::fmt::Debug for TargetBound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetBound")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for NodeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeMetrics").finish_non_exhaustive()
    }
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new(MetricsPipeline::prometheus_only("iop-node"))
    }
}

impl NodeMetrics {
    /// Build the instruments on `pipeline` (Prometheus, and OTLP when
    /// configured).
    pub fn new(pipeline: MetricsPipeline) -> Self {
        Self::with_traces(pipeline, TracePipeline::disabled())
    }

    /// Build the instruments on `pipeline` and start spans on `traces`.
    pub fn with_traces(pipeline: MetricsPipeline, traces: TracePipeline) -> Self {
        let meter = pipeline.meter("iop-node");
        iop_transport::telemetry::observe_process(&meter, "iop_node");
        let this = Self {
            runs: meter
                .u64_counter("iop_node_runs")
                .with_description(
                    "Runs and tunnels ended, by target and outcome (ok or the failure code)",
                )
                .build(),
            tokens: meter
                .u64_counter("iop_node_provider_tokens")
                .with_description("Tokens by target and kind (input, output), from provider usage")
                .build(),
            relayed_bytes: meter
                .u64_counter("iop_node_relayed_bytes")
                .with_description(
                    "Provider output relayed to the Edge: text and tool-call bytes of runs, \
                     body bytes of tunnels",
                )
                .build(),
            ttft: meter
                .f64_histogram("iop_node_provider_ttft_seconds")
                .with_description("Time from the provider call to its first content")
                .with_boundaries(TTFT_BUCKETS.to_vec())
                .build(),
            probes: meter
                .u64_counter("iop_node_probes")
                .with_description("Exact-target health probes by target and verdict")
                .build(),
            targets: BoundSets::default(),
            traces,
            stalls: meter
                .u64_counter("iop_node_response_stalls")
                .with_description("Response stalls claimed by the watchdog (R-WD-2)")
                .build(),
            stall_duration: meter
                .f64_histogram("iop_node_response_stall_duration_seconds")
                .with_description("Time without progress when a stall was claimed")
                .with_boundaries(vec![
                    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                ])
                .build(),
            credential_rejections: meter
                .u64_counter("iop_node_credential_rejections")
                .with_description("Credential leases refused (R-CRED-3), by closed reason")
                .build(),
            wire_protocol_errors: meter
                .u64_counter("iop_node_wire_protocol_errors")
                .with_description(
                    "Malformed, oversize or truncated frames from the Edge; the stream or \
                     connection was closed with this code (SPEC §5)",
                )
                .build(),
            pipeline,
        };
        this.declare_closed_series();
        this
    }

    /// Counters whose labels do not name a target, declared at 0.
    fn declare_closed_series(&self) {
        for kind in RUN_KINDS {
            for health in ProviderHealth::ALL {
                for retryable in ["true", "false"] {
                    self.stalls.add(
                        0,
                        &[
                            KeyValue::new("kind", *kind),
                            KeyValue::new("provider_health", health.as_str()),
                            KeyValue::new("retryable", retryable),
                        ],
                    );
                }
            }
        }
        for reason in CREDENTIAL_REJECTION_REASONS {
            self.credential_rejections
                .add(0, &[KeyValue::new("reason", *reason)]);
        }
        for code in StreamErrorCode::ALL {
            self.wire_protocol_errors
                .add(0, &[KeyValue::new("code", code.as_str())]);
        }
    }

    /// Counters per configured target, declared at 0.
    pub(crate) fn declare_target_series(&self, adapter: AdapterKind, target: &str) {
        let with = |k, v| target_labels(adapter, target, k, v);
        for outcome in run_outcomes() {
            self.runs.add(0, &with("outcome", outcome));
        }
        for kind in ["input", "output"] {
            self.tokens.add(0, &with("kind", kind));
        }
        for kind in RUN_KINDS {
            self.relayed_bytes.add(0, &with("kind", kind));
        }
        for health in ProviderHealth::ALL {
            self.probes.add(0, &with("status", health.as_str()));
        }
    }

    /// The instruments of runs on `target`, bound the first time it is met.
    fn target(&self, adapter: AdapterKind, target: &str) -> Arc<TargetBound> {
        self.targets
            .get((adapter, target.to_owned()), || TargetBound {
                target: target.to_owned(),
                runs: BoundSets::default(),
                tokens: [
                    self.tokens
                        .bind(&target_labels(adapter, target, "kind", "input")),
                    self.tokens
                        .bind(&target_labels(adapter, target, "kind", "output")),
                ],
                relayed_bytes: BoundSets::default(),
                ttft: self.ttft.bind(&target_pair(adapter, target)),
            })
    }

    /// The tracer run spans start on.
    pub fn tracer(&self) -> Tracer {
        self.traces.tracer()
    }

    /// The meter of the node's own instruments.
    pub(crate) fn meter(&self) -> opentelemetry::metrics::Meter {
        self.pipeline.meter("iop-node")
    }

    /// The `node.run` span of a run or tunnel: a child of the Edge's span
    /// when the request carries a trace context (R-OBS-1: identifiers and
    /// closed values only).
    pub(crate) fn run_span(
        &self,
        kind: &'static str,
        parent: Option<iop_wire::TraceContext>,
    ) -> TraceSpan {
        let span = self.tracer().start("node.run", Kind::Server, parent);
        span.set("iop.kind", kind);
        span
    }

    /// Final metric and span export (blocking; bounded by the export
    /// timeouts). Call from a blocking context at graceful shutdown.
    pub fn shutdown(&self) {
        self.pipeline.shutdown();
        self.traces.shutdown();
    }

    /// One exact-target probe's verdict (R-CAP-1, R-WD-5).
    pub fn probe(&self, adapter: AdapterKind, target: &str, status: ProviderHealth) {
        self.probes.add(
            1,
            &target_labels(adapter, target, "status", status.as_str()),
        );
    }

    /// One stall observation (closed labels only).
    pub fn stall(
        &self,
        kind: &'static str,
        health: &'static str,
        retryable: bool,
        elapsed_ms: u64,
    ) {
        let labels = [
            KeyValue::new("kind", kind),
            KeyValue::new("provider_health", health),
            KeyValue::new("retryable", if retryable { "true" } else { "false" }),
        ];
        self.stalls.add(1, &labels);
        self.stall_duration
            .record(elapsed_ms as f64 / 1000.0, &[KeyValue::new("kind", kind)]);
    }

    /// One refused credential lease (closed reason label only).
    pub fn credential_rejected(&self, reason: &'static str) {
        self.credential_rejections
            .add(1, &[KeyValue::new("reason", reason)]);
    }

    /// Count `error` if it is the peer's protocol error (a malformed,
    /// oversize or truncated frame), labelled with the code the stream was
    /// stopped with (a closed set). Other stream ends (resets, a lost
    /// connection) are not protocol errors and are not counted.
    pub fn wire_error(&self, error: &iop_transport::framed::FramedError) {
        if let iop_transport::framed::FramedError::PeerProtocol { code, .. } = error {
            self.wire_protocol_errors
                .add(1, &[KeyValue::new("code", code.as_str())]);
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        self.pipeline.render()
    }

    /// The pipeline (OTLP flush and shutdown).
    pub fn pipeline(&self) -> &MetricsPipeline {
        &self.pipeline
    }
}

/// The `node.run` span, ended with the run's outcome.
pub(crate) struct RunSpan(pub(crate) TraceSpan);

impl RunSpan {
    pub(crate) fn end(&self, record: &RunRecord<'_>) {
        let outcome = record.outcome();
        self.0.set("iop.outcome", outcome);
        if outcome == RUN_OK {
            self.0.ok();
        } else {
            self.0.fail(outcome);
        }
    }
}

/// One run or tunnel on a configured target, from the provider call to its
/// end: its `node.provider_call` span, time to first content, usage,
/// relayed bytes and outcome, recorded when it is dropped (a run dropped
/// without an outcome was canceled).
#[derive(Debug)]
pub struct RunRecord<'a> {
    metrics: &'a NodeMetrics,
    adapter: AdapterKind,
    bound: Arc<TargetBound>,
    kind: &'static str,
    call: Option<TraceSpan>,
    call_started: Option<Instant>,
    first_content: bool,
    usage: Option<Usage>,
    relayed_bytes: u64,
    outcome: Option<&'static str>,
}

impl<'a> RunRecord<'a> {
    /// A run of `kind` (`normalized`, `tunnel`) on a configured target.
    pub fn new(
        metrics: &'a NodeMetrics,
        adapter: AdapterKind,
        target: &str,
        kind: &'static str,
    ) -> Self {
        Self {
            metrics,
            adapter,
            bound: metrics.target(adapter, target),
            kind,
            call: None,
            call_started: None,
            first_content: false,
            usage: None,
            relayed_bytes: 0,
            outcome: None,
        }
    }

    /// The provider call starts now, as a child span of `run`.
    pub fn provider_call(&mut self, run: &TraceSpan) {
        let call = run.child("node.provider_call", iop_transport::traces::Kind::Client);
        call.set("iop.adapter", self.adapter.as_str());
        call.set_configured("iop.target", &self.bound.target);
        self.call = Some(call);
        self.call_started = Some(Instant::now());
    }

    /// Provider output forwarded to the Edge: `content_bytes` of text,
    /// tool-call arguments or tunnel body (0 for other events), and the
    /// usage it reports.
    pub fn forwarded(&mut self, content_bytes: u64, usage: Option<Usage>) {
        if usage.is_some() {
            self.usage = usage;
        }
        if content_bytes == 0 {
            return;
        }
        self.relayed_bytes += content_bytes;
        if !self.first_content {
            self.first_content = true;
            if let Some(started) = self.call_started {
                let ttft = started.elapsed();
                self.bound.ttft.record(ttft.as_secs_f64());
                if let Some(call) = &self.call {
                    let ms = u64::try_from(ttft.as_millis()).unwrap_or(u64::MAX);
                    call.set("iop.ttft_ms", ms);
                    call.event("first_content", &[]);
                }
            }
        }
    }

    /// The provider call was canceled (the watchdog's claim, R-WD-2): its
    /// span ends now; the run goes on to its terminal.
    pub fn call_canceled(&mut self) {
        if let Some(call) = self.call.take() {
            call.set("iop.outcome", FailureCode::Canceled.as_str());
            call.fail(FailureCode::Canceled.as_str());
        }
    }

    /// The run's outcome so far (`canceled` until one is set).
    pub fn outcome(&self) -> &'static str {
        self.outcome.unwrap_or(FailureCode::Canceled.as_str())
    }

    /// The run ended: `None` on success, else its failure code. The first
    /// outcome set is kept.
    pub fn finish(&mut self, failure: Option<FailureCode>) {
        if self.outcome.is_none() {
            self.outcome = Some(failure.map_or(RUN_OK, FailureCode::as_str));
        }
    }
}

impl Drop for RunRecord<'_> {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or(FailureCode::Canceled.as_str());
        let (metrics, bound, adapter) = (self.metrics, &self.bound, self.adapter);
        let labels = |k, v| target_labels(adapter, &bound.target, k, v);
        bound
            .runs
            .get(outcome, || metrics.runs.bind(&labels("outcome", outcome)))
            .add(1);
        if let Some(u) = self.usage {
            let [input, output] = &bound.tokens;
            input.add(u.prompt_tokens);
            output.add(u.completion_tokens);
        }
        if self.relayed_bytes > 0 {
            bound
                .relayed_bytes
                .get(self.kind, || {
                    metrics.relayed_bytes.bind(&labels("kind", self.kind))
                })
                .add(self.relayed_bytes);
        }
        if let Some(call) = self.call.take() {
            call.set("iop.outcome", outcome);
            if outcome == RUN_OK {
                call.ok();
            } else {
                call.fail(outcome);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sample lines of `name` in `text` with every `labels` among them.
    fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
            .find(|l| labels.iter().all(|want| l.contains(want)))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    #[test]
    fn a_runs_measurements_reach_its_targets_series_through_the_bound_instruments() {
        let metrics = NodeMetrics::default();
        metrics.declare_target_series(AdapterKind::OpenAi, "small");
        let run_span = metrics.run_span("normalized", None);
        for _ in 0..3 {
            let mut record = RunRecord::new(&metrics, AdapterKind::OpenAi, "small", "normalized");
            record.provider_call(&run_span);
            record.forwarded(5, None);
            record.forwarded(
                7,
                Some(Usage {
                    prompt_tokens: 11,
                    completion_tokens: 2,
                    ..Usage::default()
                }),
            );
            record.finish(None);
        }
        let mut failed = RunRecord::new(&metrics, AdapterKind::OpenAi, "small", "tunnel");
        failed.forwarded(4, None);
        failed.finish(Some(FailureCode::ProviderError));
        drop(failed);
        // Another target's runs do not share the first one's series.
        drop(RunRecord::new(
            &metrics,
            AdapterKind::Mock,
            "other",
            "tunnel",
        ));

        let text = metrics.render();
        let target = ["adapter=\"openai\"", "target=\"small\""];
        let with = |extra: &'static str| [target[0], target[1], extra];
        assert_eq!(
            sample(&text, "iop_node_runs_total", &with("outcome=\"ok\"")),
            Some(3.0),
            "{text}"
        );
        assert_eq!(
            sample(
                &text,
                "iop_node_runs_total",
                &with("outcome=\"provider_error\"")
            ),
            Some(1.0)
        );
        assert_eq!(
            sample(&text, "iop_node_runs_total", &with("outcome=\"canceled\"")),
            Some(0.0)
        );
        assert_eq!(
            sample(
                &text,
                "iop_node_provider_tokens_total",
                &with("kind=\"input\"")
            ),
            Some(33.0)
        );
        assert_eq!(
            sample(
                &text,
                "iop_node_provider_tokens_total",
                &with("kind=\"output\"")
            ),
            Some(6.0)
        );
        assert_eq!(
            sample(
                &text,
                "iop_node_relayed_bytes_total",
                &with("kind=\"normalized\"")
            ),
            Some(36.0)
        );
        assert_eq!(
            sample(
                &text,
                "iop_node_relayed_bytes_total",
                &with("kind=\"tunnel\"")
            ),
            Some(4.0)
        );
        // Time to first content: once per run whose provider call started.
        assert_eq!(
            sample(&text, "iop_node_provider_ttft_seconds_count", &target),
            Some(3.0)
        );
        assert_eq!(
            sample(
                &text,
                "iop_node_runs_total",
                &[
                    "adapter=\"mock\"",
                    "target=\"other\"",
                    "outcome=\"canceled\""
                ]
            ),
            Some(1.0)
        );
    }
}
