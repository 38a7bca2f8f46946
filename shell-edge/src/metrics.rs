//! Edge metrics: OpenTelemetry instruments exported as Prometheus text at
//! `/metrics` (R-OBS-1). Every label value is a closed, low-cardinality
//! enum's `as_str()` or an operator-configured name (provider id, route
//! model); no key, run id, payload, client-supplied model name or other
//! unbounded value ever becomes a label.
//!
//! Series from the start: every counter whose label set is closed is
//! declared at 0 when the Edge starts ([`EdgeMetrics::declare_series`]), per
//! configured provider where a label is a provider, so `increase()` and
//! `absent()` alerts and dashboards work on a fresh deployment.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use iop_core::edge::limits::RefusedBy;
use iop_core::journal::JournalError;
use iop_transport::telemetry::{BoundSets, MetricsPipeline};
use iop_transport::traces::{TracePipeline, Tracer};
use iop_wire::{CloseCode, FailureCode, Usage};
use opentelemetry::KeyValue;
use opentelemetry::metrics::{BoundCounter, BoundHistogram, Counter, Histogram};

use crate::config::EdgeConfig;

/// Route classes (`route` label).
pub const ROUTES: &[&str] = &[
    "chat",
    "responses",
    "completions",
    "embeddings",
    "ollama_chat",
    "ollama_generate",
    "ollama_embed",
    "messages",
    "retrieve",
];
/// Journal operations (`op` label of the journal metrics, SPEC §6).
pub const JOURNAL_OPS: &[&str] = &["create", "append", "finish", "raise_epoch"];
/// The `outcome` of a journal write that succeeded.
pub const JOURNAL_OK: &str = "ok";
/// Request outcomes (`outcome` label of `iop_edge_requests_total`).
pub const REQUEST_OUTCOMES: &[&str] = &[
    "ok",
    "invalid_request",
    "unauthorized",
    "not_found",
    "rate_limited",
    "provider_error",
    "unavailable",
    "timeout",
    "client_disconnected",
    "internal",
];
/// Health evidence values (`health` label).
pub const EVIDENCE_HEALTH: &[&str] = &["available", "unavailable", "unknown"];
/// What happened to evidence (`outcome` label of the evidence counter).
pub const EVIDENCE_OUTCOMES: &[&str] = &["lowered", "recorded", "stale"];
/// Overlay transitions.
pub const TRANSITIONS: &[&str] = &["lowered", "recovered"];
/// Recovery eligibility decisions (R-GATE-2).
pub const ELIGIBILITY: &[&str] = &[
    "eligible",
    "not_eligible_committed",
    "not_eligible_attempts",
    "not_eligible_budget",
    "not_eligible_unconfirmed",
];
/// Recovery results (R-GATE-2).
pub const RECOVERY_RESULTS: &[&str] = &[
    "readmitted",
    "recovered",
    "exhausted",
    "failed",
    "abandoned",
];
/// Client connection outcomes (`outcome` label): admitted, or refused by
/// [`RefusedBy`].
pub const CLIENT_CONNECTION_OUTCOMES: &[&str] = &["admitted", "source_share", "cap"];

/// The `bound` label of `iop_edge_store_reads_refused_total`: core's
/// `ReadRefusal::as_str` (R-LIM-6).
pub const STORE_READ_BOUNDS: &[&str] = &["key", "principal", "total", "takeover"];
/// Token directions (`kind` label of the token counter).
pub const TOKEN_KINDS: &[&str] = &["input", "output"];
/// The `model` label of a request whose model matched no configured route
/// (cannot happen for an admitted request; kept so the label stays closed).
pub const OTHER_MODEL: &str = "other";
/// The outcome of an attempt that ended without a failure code.
pub const ATTEMPT_OK: &str = "ok";

/// Every attempt outcome: `ok` and each failure code.
pub fn attempt_outcomes() -> impl Iterator<Item = &'static str> {
    std::iter::once(ATTEMPT_OK).chain(FailureCode::ALL.iter().map(|c| c.as_str()))
}

/// Values the hub publishes for the gauges.
#[derive(Debug, Default)]
pub struct Gauges {
    /// Requests waiting for capacity.
    pub queue_depth: AtomicU64,
    /// Leases held.
    pub leases_in_use: AtomicU64,
    /// Nodes with a current connection.
    pub nodes_connected: AtomicU64,
    /// Messages ignored because their generation was fenced (monotonic).
    pub fenced_late_messages: AtomicU64,
    /// Messages waiting for the hub (the dispatch task), R-LIM-4.
    pub hub_backlog: AtomicU64,
    /// Durable responses held by the journal store.
    pub journal_records: AtomicU64,
    /// Bytes the journal store holds (as its bound counts them).
    pub journal_bytes: AtomicU64,
    /// 1 while the journal store is open and its last answer was not a
    /// failure.
    pub journal_store_up: AtomicU64,
    /// Where the journal store stands: the index of its
    /// [`StoreState`](iop_core::journal::availability::StoreState) in
    /// `StoreState::ALL` (R-JRN-6).
    pub journal_store_state: AtomicU64,
    /// Journal records set aside because they do not decode (R-JRN-6).
    pub journal_quarantined: AtomicU64,
    /// Edges (this one included) whose ownership lease the last takeover
    /// scan saw live.
    pub journal_live_edges: AtomicU64,
    /// Client requests finished since start (the status surface's count).
    pub requests_finished: AtomicU64,
    /// Of them, those that ended `ok`.
    pub requests_ok: AtomicU64,
    /// Input tokens providers reported since start.
    pub input_tokens: AtomicU64,
    /// Output tokens providers reported since start.
    pub output_tokens: AtomicU64,
}

/// Every Edge instrument.
pub struct EdgeMetrics {
    pipeline: MetricsPipeline,
    /// Published by the hub.
    pub gauges: Arc<Gauges>,
    requests: Counter<u64>,
    ttft: Histogram<f64>,
    duration: Histogram<f64>,
    heartbeat_timeouts: Counter<u64>,
    generation_fences: Counter<u64>,
    health_evidence: Counter<u64>,
    health_transitions: Counter<u64>,
    recovery_eligibility: Counter<u64>,
    recovery_results: Counter<u64>,
    tokens: Counter<u64>,
    attempts: Counter<u64>,
    attempts_per_request: Histogram<u64>,
    queue_wait: Histogram<f64>,
    relayed_bytes: Counter<u64>,
    journal_writes: Counter<u64>,
    journal_write_seconds: Histogram<f64>,
    journal_write_retries: Counter<u64>,
    client_connections: Counter<u64>,
    client_connections_evicted: Counter<u64>,
    store_reads_refused: Counter<u64>,
    genai_token_usage: Histogram<u64>,
    genai_cache_read_tokens: Counter<u64>,
    genai_cache_write_tokens: Counter<u64>,
    genai_duration: Histogram<f64>,
    genai_time_to_first_chunk: Histogram<f64>,
    /// The instruments a request measures, bound to each label set met
    /// so far.
    bound: BoundInstruments,
    /// Configured provider id -> (adapter, node), set once at start.
    providers: std::sync::OnceLock<std::collections::HashMap<String, (&'static str, String)>>,
    traces: TracePipeline,
    /// Configured route models (the `model` label), set once at start.
    route_models: std::sync::OnceLock<Vec<String>>,
    /// The observable instruments, kept alive with the rest.
    _observers: (
        Vec<opentelemetry::metrics::ObservableGauge<u64>>,
        opentelemetry::metrics::ObservableCounter<u64>,
    ),
}

/// The instruments every request measures, bound to each label set met
/// so far: a bound instrument writes to its series directly, without the
/// attribute lookup of every measurement.
#[derive(Default)]
struct BoundInstruments {
    genai: BoundSets<GenAiKey, GenAiBound>,
    /// Per route: attempts per request, queue wait, bytes relayed, TTFT.
    route: BoundSets<&'static str, RouteBound>,
    /// Per (route, outcome): requests and their duration.
    request: BoundSets<(&'static str, &'static str), RequestBound>,
    /// Per (provider, outcome): attempts.
    attempt: BoundSets<(String, &'static str), BoundCounter<u64>>,
    /// Per (provider, route model): input and output tokens.
    tokens: BoundSets<(String, String), [BoundCounter<u64>; 2]>,
}

/// A GenAI label set: operation, provider name, route model, error type.
type GenAiKey = (&'static str, &'static str, String, Option<&'static str>);

/// The GenAI instruments bound to one label set.
struct GenAiBound {
    duration: BoundHistogram<f64>,
    first_chunk: BoundHistogram<f64>,
    input: BoundHistogram<u64>,
    output: BoundHistogram<u64>,
    cache_read: BoundCounter<u64>,
    cache_write: BoundCounter<u64>,
}

/// The instruments labelled with a route alone, bound to one.
struct RouteBound {
    attempts_per_request: BoundHistogram<u64>,
    queue_wait: BoundHistogram<f64>,
    relayed_bytes: BoundCounter<u64>,
    ttft: BoundHistogram<f64>,
}

/// `iop_edge_requests_total` and the request duration, bound to one
/// route and outcome.
struct RequestBound {
    requests: BoundCounter<u64>,
    duration: BoundHistogram<f64>,
}

impl std::fmt::Debug for EdgeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeMetrics").finish_non_exhaustive()
    }
}

/// `gen_ai.client.token.usage` buckets (the GenAI conventions' advice).
const GENAI_TOKEN_BUCKETS: &[f64] = &[
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];

/// `gen_ai.client.operation.duration` and time-to-first-chunk buckets
/// (the GenAI conventions' advice).
const GENAI_SECONDS_BUCKETS: &[f64] = &[
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

impl EdgeMetrics {
    /// Build the instruments on `pipeline` (Prometheus, and OTLP when
    /// configured), with no span export.
    pub fn new(pipeline: MetricsPipeline) -> Arc<Self> {
        Self::with_traces(pipeline, TracePipeline::disabled())
    }

    /// Build the instruments on `pipeline` and start spans on `traces`.
    pub fn with_traces(pipeline: MetricsPipeline, traces: TracePipeline) -> Arc<Self> {
        let meter = pipeline.meter("iop-edge");
        iop_transport::telemetry::observe_process(&meter, "iop_edge");
        let gauges = Arc::new(Gauges::default());
        let g = gauges.clone();
        let _queue = meter
            .u64_observable_gauge("iop_edge_queue_depth")
            .with_description("Requests waiting for capacity")
            .with_callback(move |o| o.observe(g.queue_depth.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _leases = meter
            .u64_observable_gauge("iop_edge_leases_in_use")
            .with_description("Capacity leases held")
            .with_callback(move |o| o.observe(g.leases_in_use.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _nodes = meter
            .u64_observable_gauge("iop_edge_nodes_connected")
            .with_description("Nodes with a current connection")
            .with_callback(move |o| o.observe(g.nodes_connected.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _backlog = meter
            .u64_observable_gauge("iop_edge_hub_backlog")
            .with_description("Messages waiting for the Edge's dispatch task (R-LIM-4)")
            .with_callback(move |o| o.observe(g.hub_backlog.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _late = meter
            .u64_observable_counter("iop_edge_fenced_late_messages")
            .with_description("Messages ignored because their generation was fenced (R-GEN-3)")
            .with_callback(move |o| o.observe(g.fenced_late_messages.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _journal_records = meter
            .u64_observable_gauge("iop_edge_journal_records")
            .with_description("Durable responses held by the journal store (SPEC §6)")
            .with_callback(move |o| o.observe(g.journal_records.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _journal_store_up = meter
            .u64_observable_gauge("iop_edge_journal_store_up")
            .with_description("1 while the journal store's last answer was not a failure (SPEC §6)")
            .with_callback(move |o| o.observe(g.journal_store_up.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _journal_live_edges = meter
            .u64_observable_gauge("iop_edge_journal_live_edges")
            .with_description(
                "Edges whose ownership lease the last takeover scan saw live (R-MULTI-1)",
            )
            .with_callback(move |o| o.observe(g.journal_live_edges.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _journal_store_state = meter
            .u64_observable_gauge("iop_edge_journal_store_state")
            .with_description(
                "1 for the journal store's state: connecting, up, reopening or refused (R-JRN-6)",
            )
            .with_callback(move |o| {
                let current = g.journal_store_state.load(Ordering::Relaxed);
                for (i, state) in iop_core::journal::availability::StoreState::ALL
                    .iter()
                    .enumerate()
                {
                    o.observe(
                        u64::from(i as u64 == current),
                        &[KeyValue::new("state", state.as_str())],
                    );
                }
            })
            .build();
        let g = gauges.clone();
        let _journal_quarantined = meter
            .u64_observable_gauge("iop_edge_journal_quarantined_records")
            .with_description("Journal records set aside because they do not decode (R-JRN-6)")
            .with_callback(move |o| o.observe(g.journal_quarantined.load(Ordering::Relaxed), &[]))
            .build();
        let g = gauges.clone();
        let _journal_bytes = meter
            .u64_observable_gauge("iop_edge_journal_bytes")
            .with_description("Bytes the journal store holds, as its bound counts them (R-JRN-5)")
            .with_callback(move |o| o.observe(g.journal_bytes.load(Ordering::Relaxed), &[]))
            .build();
        Arc::new(Self {
            requests: meter
                .u64_counter("iop_edge_requests")
                .with_description("Client requests by route class and outcome")
                .build(),
            ttft: meter
                .f64_histogram("iop_edge_request_ttft_seconds")
                .with_description("Time from request to the first committed content")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            duration: meter
                .f64_histogram("iop_edge_request_duration_seconds")
                .with_description("Total request time")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            client_connections: meter
                .u64_counter("iop_edge_client_connections")
                .with_description(
                    "Client TCP connections accepted, by outcome: admitted, or refused (a fast 503) by the source's share or the cap (R-LIM-1)",
                )
                .build(),
            store_reads_refused: meter
                .u64_counter("iop_edge_store_reads_refused")
                .with_description(
                    "Store reads refused at once (a fast 503 server_busy), by the bound that refused them: the key's, the principal's, the Edge's total, or the takeovers' share (R-LIM-6)",
                )
                .build(),
            client_connections_evicted: meter
                .u64_counter("iop_edge_client_connections_evicted")
                .with_description(
                    "Idle client connections closed to make room for a newcomer (R-LIM-1)",
                )
                .build(),
            heartbeat_timeouts: meter
                .u64_counter("iop_edge_heartbeat_timeouts")
                .with_description("Node connections closed for heartbeat_timeout (R-HB-2)")
                .build(),
            generation_fences: meter
                .u64_counter("iop_edge_generation_fences")
                .with_description("Generations fenced, by close reason (R-GEN-3)")
                .build(),
            health_evidence: meter
                .u64_counter("iop_edge_provider_health_evidence")
                .with_description(
                    "Validated stall evidence by health and overlay outcome (R-OVL-2)",
                )
                .build(),
            health_transitions: meter
                .u64_counter("iop_edge_provider_health_transitions")
                .with_description("Runtime overlay transitions (R-OVL-2, R-CAP-1)")
                .build(),
            recovery_eligibility: meter
                .u64_counter("iop_edge_liveness_recovery_eligibility")
                .with_description("Stream-gate recovery eligibility decisions (R-GATE-2)")
                .build(),
            recovery_results: meter
                .u64_counter("iop_edge_liveness_recovery_results")
                .with_description("Stream-gate recovery results (R-GATE-2)")
                .build(),
            tokens: meter
                .u64_counter("iop_edge_provider_tokens")
                .with_description(
                    "Tokens by provider, route model and kind (input, output), from provider usage",
                )
                .build(),
            attempts: meter
                .u64_counter("iop_edge_attempts")
                .with_description("Attempts by provider and outcome (ok or the failure code)")
                .build(),
            attempts_per_request: meter
                .u64_histogram("iop_edge_request_attempts")
                .with_description("Attempts a finished request took (R-GATE-2, R-FAIL-1)")
                .with_boundaries(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
                .build(),
            queue_wait: meter
                .f64_histogram("iop_edge_queue_wait_seconds")
                .with_description("Time from admission to a granted lease, per attempt")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            relayed_bytes: meter
                .u64_counter("iop_edge_relayed_bytes")
                .with_description("Response body bytes streamed to clients, by route")
                .build(),
            journal_writes: meter
                .u64_counter("iop_edge_journal_writes")
                .with_description("Journal store operations by op and outcome (SPEC §6)")
                .build(),
            journal_write_retries: meter
                .u64_counter("iop_edge_journal_write_retries")
                .with_description(
                    "A run's journal write tried again after the store failed it (R-JRN-6)",
                )
                .build(),
            journal_write_seconds: meter
                .f64_histogram("iop_edge_journal_write_seconds")
                .with_description("Time until a journal operation was durable (R-JRN-1)")
                .with_boundaries(vec![
                    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1.0, 2.5,
                ])
                .build(),
            genai_token_usage: meter
                .u64_histogram(crate::genai::CLIENT_TOKEN_USAGE)
                .with_unit("{token}")
                .with_description("Number of input and output tokens used (GenAI conventions)")
                .with_boundaries(GENAI_TOKEN_BUCKETS.to_vec())
                .build(),
            genai_cache_read_tokens: meter
                .u64_counter(crate::genai::CLIENT_USAGE_CACHE_READ_INPUT_TOKENS)
                .with_unit("{token}")
                .with_description(
                    "Input tokens read from a provider-managed prompt cache (GenAI conventions)",
                )
                .build(),
            genai_cache_write_tokens: meter
                .u64_counter(crate::genai::CLIENT_USAGE_CACHE_WRITE_INPUT_TOKENS)
                .with_unit("{token}")
                .with_description(
                    "Input tokens written to a provider-managed prompt cache (GenAI conventions)",
                )
                .build(),
            genai_duration: meter
                .f64_histogram(crate::genai::CLIENT_OPERATION_DURATION)
                .with_unit("s")
                .with_description("GenAI operation duration (GenAI conventions)")
                .with_boundaries(GENAI_SECONDS_BUCKETS.to_vec())
                .build(),
            genai_time_to_first_chunk: meter
                .f64_histogram(crate::genai::CLIENT_TIME_TO_FIRST_CHUNK)
                .with_unit("s")
                .with_description(
                    "Time to the first chunk of a streamed answer (GenAI conventions)",
                )
                .with_boundaries(GENAI_SECONDS_BUCKETS.to_vec())
                .build(),
            bound: BoundInstruments::default(),
            providers: std::sync::OnceLock::new(),
            traces,
            route_models: std::sync::OnceLock::new(),
            gauges,
            pipeline,
            _observers: (
                vec![
                    _queue,
                    _leases,
                    _nodes,
                    _backlog,
                    _journal_records,
                    _journal_bytes,
                    _journal_store_up,
                    _journal_live_edges,
                    _journal_store_state,
                    _journal_quarantined,
                ],
                _late,
            ),
        })
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        self.pipeline.render()
    }

    /// The pipeline (OTLP flush and shutdown).
    pub fn pipeline(&self) -> &MetricsPipeline {
        &self.pipeline
    }

    /// The tracer request spans start on.
    pub fn tracer(&self) -> Tracer {
        self.traces.tracer()
    }

    /// The span pipeline (flush and shutdown).
    pub fn traces(&self) -> &TracePipeline {
        &self.traces
    }

    /// Final metric and span export (blocking; bounded by the export
    /// timeouts). Call from a blocking context at graceful shutdown.
    pub fn shutdown(&self) {
        self.pipeline.shutdown();
        self.traces.shutdown();
    }

    /// Declare every closed-label counter at 0 (series from the start):
    /// requests per route and outcome, fences per close reason, health and
    /// recovery observations, and per configured provider its attempts by
    /// outcome and its tokens per route model.
    pub fn declare_series(&self, config: &EdgeConfig) {
        for route in ROUTES {
            for outcome in REQUEST_OUTCOMES {
                self.requests.add(
                    0,
                    &[
                        KeyValue::new("route", *route),
                        KeyValue::new("outcome", *outcome),
                    ],
                );
            }
            self.relayed_bytes.add(0, &[KeyValue::new("route", *route)]);
        }
        for op in ["append", "finish"] {
            self.journal_write_retries
                .add(0, &[KeyValue::new("op", op)]);
        }
        for op in JOURNAL_OPS {
            for outcome in std::iter::once(JOURNAL_OK).chain(JournalError::NAMES.iter().copied()) {
                self.journal_writes.add(
                    0,
                    &[KeyValue::new("op", *op), KeyValue::new("outcome", outcome)],
                );
            }
        }
        self.heartbeat_timeouts.add(0, &[]);
        for outcome in CLIENT_CONNECTION_OUTCOMES {
            self.client_connections
                .add(0, &[KeyValue::new("outcome", *outcome)]);
        }
        self.client_connections_evicted.add(0, &[]);
        for bound in STORE_READ_BOUNDS {
            self.store_reads_refused
                .add(0, &[KeyValue::new("bound", *bound)]);
        }
        for reason in CloseCode::ALL {
            self.generation_fences
                .add(0, &[KeyValue::new("reason", reason.as_str())]);
        }
        for health in EVIDENCE_HEALTH {
            for outcome in EVIDENCE_OUTCOMES {
                self.health_evidence.add(
                    0,
                    &[
                        KeyValue::new("health", *health),
                        KeyValue::new("outcome", *outcome),
                    ],
                );
            }
        }
        for t in TRANSITIONS {
            self.health_transitions
                .add(0, &[KeyValue::new("transition", *t)]);
        }
        for e in ELIGIBILITY {
            self.recovery_eligibility
                .add(0, &[KeyValue::new("eligibility", *e)]);
        }
        for r in RECOVERY_RESULTS {
            self.recovery_results.add(0, &[KeyValue::new("result", *r)]);
        }
        for p in &config.providers {
            let provider = p.spec.id.as_str().to_owned();
            for outcome in attempt_outcomes() {
                self.attempts.add(
                    0,
                    &[
                        KeyValue::new("provider", provider.clone()),
                        KeyValue::new("outcome", outcome),
                    ],
                );
            }
        }
        self.set_route_models(config.routes.iter().map(|(m, _)| m.clone()).collect());
        self.set_providers(
            config
                .providers
                .iter()
                .map(|p| {
                    (
                        p.spec.id.as_str().to_owned(),
                        (p.spec.adapter.as_str(), p.spec.node.as_str().to_owned()),
                    )
                })
                .collect(),
        );
        for (model, pool) in &config.routes {
            for provider in pool {
                for kind in TOKEN_KINDS {
                    self.tokens.add(
                        0,
                        &[
                            KeyValue::new("provider", provider.as_str().to_owned()),
                            KeyValue::new("model", model.clone()),
                            KeyValue::new("kind", *kind),
                        ],
                    );
                }
            }
        }
    }

    /// Set the configured providers' adapters and nodes once (later calls
    /// change nothing).
    pub fn set_providers(
        &self,
        providers: std::collections::HashMap<String, (&'static str, String)>,
    ) {
        let _ = self.providers.set(providers);
    }

    /// A configured provider's adapter and node.
    pub fn provider_facts(&self, provider: &str) -> Option<(&'static str, &str)> {
        let (adapter, node) = self.providers.get()?.get(provider)?;
        Some((adapter, node.as_str()))
    }

    /// One GenAI operation (a request that reached a provider), labelled by
    /// `labels` (closed values and configured names); `usage` and
    /// `first_chunk` when known.
    pub fn genai_operation(
        &self,
        labels: &crate::genai::GenAiLabels,
        duration: Duration,
        usage: Option<Usage>,
        first_chunk: Option<Duration>,
    ) {
        let bound = self.genai_bound(labels);
        if let Some(first_chunk) = first_chunk {
            bound.first_chunk.record(first_chunk.as_secs_f64());
        }
        if let Some(usage) = usage {
            bound.input.record(usage.prompt_tokens);
            // An embedding has no output tokens to count.
            if labels.operation != crate::genai::OPERATION_EMBEDDINGS {
                bound.output.record(usage.completion_tokens);
            }
            // The prompt cache's counts, as the provider reported them.
            if let Some(n) = usage.cache_read_tokens {
                bound.cache_read.add(n);
            }
            if let Some(n) = usage.cache_write_tokens {
                bound.cache_write.add(n);
            }
        }
        bound.duration.record(duration.as_secs_f64());
    }

    /// The GenAI instruments bound to `labels`' set.
    fn genai_bound(&self, labels: &crate::genai::GenAiLabels) -> Arc<GenAiBound> {
        use crate::genai;
        let key: GenAiKey = (
            labels.operation,
            labels.provider_name,
            labels.model.clone(),
            labels.error_type,
        );
        self.bound.genai.get(key, || {
            let attrs = [
                KeyValue::new(genai::OPERATION_NAME, labels.operation),
                KeyValue::new(genai::PROVIDER_NAME, labels.provider_name),
                KeyValue::new(genai::REQUEST_MODEL, labels.model.clone()),
            ];
            let with = |kv: KeyValue| {
                let mut a = attrs.to_vec();
                a.push(kv);
                a
            };
            let with_error = match labels.error_type {
                Some(error) => with(KeyValue::new(genai::ERROR_TYPE, error)),
                None => attrs.to_vec(),
            };
            let modality = with(KeyValue::new(
                genai::TOKEN_MODALITY,
                genai::MODALITY_UNKNOWN,
            ));
            GenAiBound {
                duration: self.genai_duration.bind(&with_error),
                first_chunk: self.genai_time_to_first_chunk.bind(&attrs),
                input: self
                    .genai_token_usage
                    .bind(&with(KeyValue::new(genai::TOKEN_TYPE, "input"))),
                output: self
                    .genai_token_usage
                    .bind(&with(KeyValue::new(genai::TOKEN_TYPE, "output"))),
                cache_read: self.genai_cache_read_tokens.bind(&modality),
                cache_write: self.genai_cache_write_tokens.bind(&modality),
            }
        })
    }

    /// The instruments labelled with `route` alone, bound to it.
    fn route_bound(&self, route: &'static str) -> Arc<RouteBound> {
        self.bound.route.get(route, || {
            let labels = [KeyValue::new("route", route)];
            RouteBound {
                attempts_per_request: self.attempts_per_request.bind(&labels),
                queue_wait: self.queue_wait.bind(&labels),
                relayed_bytes: self.relayed_bytes.bind(&labels),
                ttft: self.ttft.bind(&labels),
            }
        })
    }

    /// Set the configured route models once (later calls change nothing).
    pub fn set_route_models(&self, models: Vec<String>) {
        let _ = self.route_models.set(models);
    }

    /// The `model` label for a client's model name: the configured route
    /// it matched (exact, else the longest prefix pattern, as routing
    /// does), never the client's own string.
    pub fn route_model(&self, model: &str) -> &str {
        let routes = self
            .route_models
            .get()
            .map(Vec::as_slice)
            .unwrap_or_default();
        if let Some(exact) = routes.iter().find(|m| *m == model) {
            return exact;
        }
        routes
            .iter()
            .filter(|m| m.ends_with('*') && crate::catalog::model_matches(m, model))
            .max_by_key(|m| m.len())
            .map_or(OTHER_MODEL, String::as_str)
    }

    /// Provider-reported usage of one attempt, labelled with the provider
    /// id and the route model (both from the configuration).
    pub fn tokens(&self, provider: &str, route_model: &str, usage: Usage) {
        self.gauges
            .input_tokens
            .fetch_add(usage.prompt_tokens, Ordering::Relaxed);
        self.gauges
            .output_tokens
            .fetch_add(usage.completion_tokens, Ordering::Relaxed);
        let [input, output] =
            &*self
                .bound
                .tokens
                .get((provider.to_owned(), route_model.to_owned()), || {
                    ["input", "output"].map(|kind| {
                        self.tokens.bind(&[
                            KeyValue::new("provider", provider.to_owned()),
                            KeyValue::new("model", route_model.to_owned()),
                            KeyValue::new("kind", kind),
                        ])
                    })
                });
        input.add(usage.prompt_tokens);
        output.add(usage.completion_tokens);
    }

    /// One finished attempt on `provider`: `ok` or its failure code.
    pub fn attempt(&self, provider: &str, outcome: &'static str) {
        self.bound
            .attempt
            .get((provider.to_owned(), outcome), || {
                self.attempts.bind(&[
                    KeyValue::new("provider", provider.to_owned()),
                    KeyValue::new("outcome", outcome),
                ])
            })
            .add(1);
    }

    /// The attempts a finished request took.
    pub fn attempts_per_request(&self, route: &'static str, attempts: u32) {
        self.route_bound(route)
            .attempts_per_request
            .record(u64::from(attempts));
    }

    /// Time one attempt waited for its lease.
    pub fn queue_wait(&self, route: &'static str, waited: Duration) {
        self.route_bound(route)
            .queue_wait
            .record(waited.as_secs_f64());
    }

    /// Response body bytes streamed to a client.
    pub fn relayed(&self, route: &'static str, bytes: u64) {
        if bytes > 0 {
            self.route_bound(route).relayed_bytes.add(bytes);
        }
    }

    /// One finished client request.
    pub fn request(&self, route: &'static str, outcome: &'static str, total: Duration) {
        let bound = self.bound.request.get((route, outcome), || {
            let labels = [
                KeyValue::new("route", route),
                KeyValue::new("outcome", outcome),
            ];
            RequestBound {
                requests: self.requests.bind(&labels),
                duration: self.duration.bind(&labels),
            }
        });
        bound.requests.add(1);
        bound.duration.record(total.as_secs_f64());
        self.gauges
            .requests_finished
            .fetch_add(1, Ordering::Relaxed);
        if outcome == "ok" {
            self.gauges.requests_ok.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One journal operation (`op` of [`JOURNAL_OPS`]) and how it ended.
    pub fn journal_write(
        &self,
        op: &'static str,
        result: Result<(), &JournalError>,
        took: Duration,
    ) {
        let outcome = match result {
            Ok(()) => JOURNAL_OK,
            Err(e) => e.as_str(),
        };
        self.journal_writes.add(
            1,
            &[KeyValue::new("op", op), KeyValue::new("outcome", outcome)],
        );
        self.journal_write_seconds
            .record(took.as_secs_f64(), &[KeyValue::new("op", op)]);
    }

    /// A journal operation refused before it reached the store (counted,
    /// not timed).
    pub fn journal_refused(&self, op: &'static str, error: &JournalError) {
        self.journal_writes.add(
            1,
            &[
                KeyValue::new("op", op),
                KeyValue::new("outcome", error.as_str()),
            ],
        );
    }

    /// A run's journal write (`op`) is tried again (R-JRN-6).
    pub fn journal_write_retry(&self, op: &'static str) {
        self.journal_write_retries
            .add(1, &[KeyValue::new("op", op)]);
    }

    /// The journal store is now `state` (R-JRN-6).
    pub fn journal_store_state(&self, state: iop_core::journal::availability::StoreState) {
        let index = iop_core::journal::availability::StoreState::ALL
            .iter()
            .position(|s| *s == state)
            .unwrap_or(0);
        self.gauges
            .journal_store_state
            .store(index as u64, Ordering::Relaxed);
    }

    /// Time to first content of a request.
    pub fn ttft(&self, route: &'static str, ttft: Duration) {
        self.route_bound(route).ttft.record(ttft.as_secs_f64());
    }

    /// A client connection was admitted (`refused: None`) or refused;
    /// `evicted`: an idle one was closed to make room for it (R-LIM-1).
    pub fn client_connection(&self, refused: Option<RefusedBy>, evicted: bool) {
        let outcome = refused.map_or("admitted", RefusedBy::as_str);
        self.client_connections
            .add(1, &[KeyValue::new("outcome", outcome)]);
        if evicted {
            self.client_connections_evicted.add(1, &[]);
        }
    }

    /// A store read was refused by `bound` (R-LIM-6; one of
    /// [`STORE_READ_BOUNDS`], never a key or principal: R-OBS-1).
    pub fn store_read_refused(&self, bound: &'static str) {
        self.store_reads_refused
            .add(1, &[KeyValue::new("bound", bound)]);
    }

    /// A generation was fenced.
    pub fn fence(&self, reason: &'static str) {
        self.generation_fences
            .add(1, &[KeyValue::new("reason", reason)]);
        if reason == "heartbeat_timeout" {
            self.heartbeat_timeouts.add(1, &[]);
        }
    }

    /// Stall evidence was validated and applied.
    pub fn health_evidence(&self, health: &'static str, outcome: &'static str) {
        self.health_evidence.add(
            1,
            &[
                KeyValue::new("health", health),
                KeyValue::new("outcome", outcome),
            ],
        );
    }

    /// The overlay changed.
    pub fn health_transition(&self, transition: &'static str) {
        self.health_transitions
            .add(1, &[KeyValue::new("transition", transition)]);
    }

    /// A gate recovery eligibility decision.
    pub fn recovery_eligibility(&self, eligibility: &'static str) {
        self.recovery_eligibility
            .add(1, &[KeyValue::new("eligibility", eligibility)]);
    }

    /// A gate recovery result.
    pub fn recovery_result(&self, result: &'static str) {
        self.recovery_results
            .add(1, &[KeyValue::new("result", result)]);
    }
}

/// The value of a metric line in a Prometheus text document, summed over
/// lines whose labels contain every `label=value` pair given (test and
/// `iop-edge status` helper).
pub fn scrape_value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.starts_with(name) && matches!(l.as_bytes().get(name.len()), Some(b'{') | Some(b' '))
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_connection_outcomes_are_admitted_and_every_refusal_reason() {
        let mut expected = vec!["admitted"];
        expected.extend(RefusedBy::ALL.iter().map(|r| r.as_str()));
        assert_eq!(CLIENT_CONNECTION_OUTCOMES, expected.as_slice());
    }

    #[test]
    fn the_store_read_bounds_are_every_refusal_r_lim_6() {
        let bounds: Vec<&str> = iop_core::edge::store_reads::ReadRefusal::ALL
            .iter()
            .map(|r| r.as_str())
            .collect();
        assert_eq!(STORE_READ_BOUNDS, bounds.as_slice());
    }
}
