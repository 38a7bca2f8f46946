//! The trace pipeline both shells share: OpenTelemetry spans, exported over
//! OTLP/HTTP (protobuf) when an `[otlp_traces]` section is configured, and
//! joined across the Edge and the Node by a W3C trace context carried in
//! the run and tunnel requests ([`iop_wire::TraceContext`]).
//!
//! What a span may hold (R-OBS-1 applies to spans as to logs): span names
//! and attribute keys are fixed strings; attribute values are closed enum
//! values, operator-configured names (provider id, adapter, target), counts
//! and durations. Never a prompt, an output, a key, a credential or a run
//! id: [`TraceSpan`] only takes values of [`SpanValue`], whose text form is
//! `&'static str` or a configured name.
//!
//! Export runs on the SDK's batch thread: a bounded queue
//! (`max_queue_spans`; a full queue drops spans, never blocks a request),
//! flushed every `interval_ms` and at shutdown.

use std::borrow::Cow;
use std::time::Duration;

use iop_wire::TraceContext;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};
use serde::Deserialize;

use crate::settings::{ConfigError, field_err};
use crate::telemetry::{MIN_OTLP_INTERVAL_MS, TelemetryError, normalise_endpoint};

/// Path appended to a traces endpoint given without one.
pub const OTLP_TRACES_PATH: &str = "/v1/traces";

/// The most spans `max_queue_spans` may hold.
pub const MAX_QUEUE_SPANS_LIMIT: usize = 1_000_000;

/// The W3C header a client's trace context arrives in.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// `[otlp_traces]`: optional OTLP/HTTP span export. Absent means off.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpTracesSection {
    /// Collector URL, `http://host:4318/v1/traces` (or `https://`). A URL
    /// without a path gets `/v1/traces`. Headers (an auth token) come from
    /// `OTEL_EXPORTER_OTLP_HEADERS`, never from this file.
    pub endpoint: String,
    /// Longest a finished span waits before it is exported.
    #[serde(default = "default_interval_ms")]
    pub interval_ms: u64,
    /// Bound of one export request.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Fraction of new traces recorded (0.0 to 1.0). A request that
    /// arrives with a `traceparent` follows its sampled flag instead.
    #[serde(default = "default_sample_ratio")]
    pub sample_ratio: f64,
    /// Finished spans waiting for export; past it spans are dropped.
    #[serde(default = "default_max_queue_spans")]
    pub max_queue_spans: usize,
    /// `service.instance.id` of the exported resource; defaults to the
    /// node id on a Node and `iop-edge` on the Edge.
    #[serde(default)]
    pub instance: Option<String>,
}

fn default_interval_ms() -> u64 {
    5_000
}
fn default_timeout_ms() -> u64 {
    5_000
}
fn default_sample_ratio() -> f64 {
    1.0
}
fn default_max_queue_spans() -> usize {
    2_048
}

impl OtlpTracesSection {
    /// Validate, naming `section.field`, and normalise the endpoint.
    pub fn validate(&mut self, section: &str) -> Result<(), ConfigError> {
        self.endpoint = normalise_endpoint(section, &self.endpoint, OTLP_TRACES_PATH)?;
        if self.interval_ms < MIN_OTLP_INTERVAL_MS {
            return Err(field_err(
                format!("{section}.interval_ms"),
                format!("must be >= {MIN_OTLP_INTERVAL_MS}"),
            ));
        }
        if self.timeout_ms == 0 {
            return Err(field_err(format!("{section}.timeout_ms"), "must be > 0"));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(field_err(
                format!("{section}.sample_ratio"),
                "must be between 0.0 and 1.0",
            ));
        }
        if self.max_queue_spans == 0 || self.max_queue_spans > MAX_QUEUE_SPANS_LIMIT {
            return Err(field_err(
                format!("{section}.max_queue_spans"),
                format!("must be 1 to {MAX_QUEUE_SPANS_LIMIT}"),
            ));
        }
        if let Some(instance) = &self.instance
            && !crate::settings::valid_name(instance)
        {
            return Err(field_err(
                format!("{section}.instance"),
                "must be 1-128 chars of [A-Za-z0-9._-]",
            ));
        }
        Ok(())
    }
}

/// One tracer provider: spans go to OTLP when configured, nowhere otherwise
/// (a trace context still flows through, so a Node exporting spans joins a
/// client's trace even when the Edge exports none).
#[derive(Debug, Clone)]
pub struct TracePipeline {
    provider: SdkTracerProvider,
    tracer: Tracer,
    export: bool,
}

impl TracePipeline {
    /// Build the pipeline for `service` (`iop-edge`, `iop-node`) named
    /// `instance` (unless `otlp.instance` names it). Building never dials.
    pub fn new(
        service: &'static str,
        instance: &str,
        otlp: Option<&OtlpTracesSection>,
    ) -> Result<Self, TelemetryError> {
        let Some(otlp) = otlp else {
            return Ok(Self::disabled());
        };
        // As for the metrics exporter: reqwest takes the process default
        // crypto provider (ring). Idempotent.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(otlp.endpoint.clone())
            .with_timeout(Duration::from_millis(otlp.timeout_ms))
            .build()
            .map_err(|e| TelemetryError::Otlp {
                endpoint: otlp.endpoint.clone(),
                message: e.to_string(),
            })?;
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(otlp.max_queue_spans)
            .with_max_export_batch_size(otlp.max_queue_spans.min(512))
            .with_scheduled_delay(Duration::from_millis(otlp.interval_ms))
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        let resource = Resource::builder_empty()
            .with_attributes([
                KeyValue::new("service.name", service),
                KeyValue::new(
                    "service.instance.id",
                    otlp.instance
                        .clone()
                        .unwrap_or_else(|| instance.to_string()),
                ),
                KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
            ])
            .build();
        let provider = SdkTracerProvider::builder()
            .with_resource(resource)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                otlp.sample_ratio,
            ))))
            .with_span_processor(processor)
            .build();
        let tracer = Tracer(Some(provider.tracer(service)));
        Ok(Self {
            provider,
            tracer,
            export: true,
        })
    }

    /// No export: spans are not recorded; trace contexts still flow.
    pub fn disabled() -> Self {
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::AlwaysOff)
            .build();
        Self {
            provider,
            tracer: Tracer(None),
            export: false,
        }
    }

    /// The tracer spans are started on.
    pub fn tracer(&self) -> Tracer {
        self.tracer.clone()
    }

    /// Export what is queued now (blocking; bounded by the export timeout).
    pub fn flush(&self) {
        if self.export
            && let Err(e) = self.provider.force_flush()
        {
            tracing::warn!(event = "otlp_traces_flush_failed", error = %e);
        }
    }

    /// Final export and shutdown (blocking; bounded by the export timeout).
    /// Call from a blocking context at graceful shutdown.
    pub fn shutdown(&self) {
        if self.export
            && let Err(e) = self.provider.shutdown()
        {
            tracing::warn!(event = "otlp_traces_shutdown_failed", error = %e);
        }
    }
}

/// Starts spans; a disabled tracer starts spans that record nothing and
/// only carry the trace context through.
#[derive(Debug, Clone, Default)]
pub struct Tracer(Option<SdkTracer>);

/// An attribute value a span may hold (see the module docs).
#[derive(Debug, Clone)]
pub enum SpanValue {
    /// A closed enum value (`as_str()`), or a fixed string.
    Closed(&'static str),
    /// An operator-configured name: provider id, adapter, target, node id.
    Configured(String),
    /// A count, size or duration.
    Int(i64),
    /// A flag.
    Bool(bool),
    /// A list of closed enum values (`gen_ai.response.finish_reasons`).
    ClosedList(Vec<&'static str>),
}

impl From<&'static str> for SpanValue {
    fn from(v: &'static str) -> Self {
        SpanValue::Closed(v)
    }
}
impl From<u64> for SpanValue {
    fn from(v: u64) -> Self {
        SpanValue::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}
impl From<u32> for SpanValue {
    fn from(v: u32) -> Self {
        SpanValue::Int(i64::from(v))
    }
}
impl From<bool> for SpanValue {
    fn from(v: bool) -> Self {
        SpanValue::Bool(v)
    }
}

impl SpanValue {
    fn into_value(self) -> opentelemetry::Value {
        match self {
            SpanValue::Closed(s) => opentelemetry::Value::String(s.into()),
            SpanValue::Configured(s) => opentelemetry::Value::String(s.into()),
            SpanValue::Int(i) => opentelemetry::Value::I64(i),
            SpanValue::Bool(b) => opentelemetry::Value::Bool(b),
            SpanValue::ClosedList(values) => opentelemetry::Value::Array(
                opentelemetry::Array::String(values.into_iter().map(Into::into).collect()),
            ),
        }
    }
}

/// Whether a span is the server side of a request, the client side of a
/// call, or internal work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Handles a request from a peer (a client, the Edge).
    Server,
    /// Calls a peer (a Node, a provider).
    Client,
    /// A step inside the process (queue wait, commit).
    Internal,
}

impl From<Kind> for SpanKind {
    fn from(k: Kind) -> Self {
        match k {
            Kind::Server => SpanKind::Server,
            Kind::Client => SpanKind::Client,
            Kind::Internal => SpanKind::Internal,
        }
    }
}

impl Tracer {
    /// A root span, or a child of `parent` received from a peer (a client's
    /// `traceparent`, or the wire's trace context).
    pub fn start(&self, name: &'static str, kind: Kind, parent: Option<TraceContext>) -> TraceSpan {
        let cx = match parent.filter(TraceContext::is_valid) {
            Some(p) => Context::new().with_remote_span_context(span_context_of(p)),
            None => Context::new(),
        };
        self.start_in(name, kind, &cx, parent)
    }

    fn start_in(
        &self,
        name: &'static str,
        kind: Kind,
        cx: &Context,
        parent: Option<TraceContext>,
    ) -> TraceSpan {
        match &self.0 {
            Some(tracer) => {
                let span = tracer
                    .span_builder(Cow::Borrowed(name))
                    .with_kind(kind.into())
                    .start_with_context(tracer, cx);
                TraceSpan {
                    tracer: self.clone(),
                    cx: cx.with_span(span),
                    passthrough: None,
                }
            }
            // Nothing recorded: children (and the wire) carry the parent on.
            None => TraceSpan {
                tracer: self.clone(),
                cx: Context::new(),
                passthrough: parent,
            },
        }
    }
}

/// One span; it ends when dropped (or at [`TraceSpan::end`]).
#[derive(Debug)]
pub struct TraceSpan {
    tracer: Tracer,
    cx: Context,
    /// With a disabled tracer: the context to pass on unchanged.
    passthrough: Option<TraceContext>,
}

impl TraceSpan {
    /// A span that records nothing and carries no context.
    pub fn none() -> Self {
        TraceSpan {
            tracer: Tracer(None),
            cx: Context::new(),
            passthrough: None,
        }
    }

    /// A child span of this one.
    pub fn child(&self, name: &'static str, kind: Kind) -> TraceSpan {
        if self.tracer.0.is_none() {
            return TraceSpan {
                tracer: self.tracer.clone(),
                cx: Context::new(),
                passthrough: self.passthrough,
            };
        }
        self.tracer.start_in(name, kind, &self.cx, None)
    }

    /// The trace context a peer's spans join as children of this span:
    /// this span when it is recording, else the context it carries on.
    pub fn context(&self) -> Option<TraceContext> {
        if self.tracer.0.is_none() {
            return self.passthrough;
        }
        let span = self.cx.span();
        let sc = span.span_context();
        sc.is_valid().then(|| TraceContext {
            trace_id: sc.trace_id().to_bytes(),
            parent_span_id: sc.span_id().to_bytes(),
            flags: sc.trace_flags().to_u8(),
        })
    }

    /// Whether this span is recorded.
    pub fn is_recording(&self) -> bool {
        self.tracer.0.is_some() && self.cx.span().is_recording()
    }

    /// Set an attribute.
    pub fn set(&self, key: &'static str, value: impl Into<SpanValue>) {
        if self.is_recording() {
            self.cx
                .span()
                .set_attribute(KeyValue::new(key, value.into().into_value()));
        }
    }

    /// Set an attribute to an operator-configured name (provider id,
    /// target): never a value from a client or a provider.
    pub fn set_configured(&self, key: &'static str, value: &str) {
        if self.is_recording() {
            self.set(key, SpanValue::Configured(value.to_owned()));
        }
    }

    /// Record a moment in the span (`committed`, `first_token`), with
    /// attributes.
    pub fn event(&self, name: &'static str, attributes: &[(&'static str, SpanValue)]) {
        if self.is_recording() {
            let attrs = attributes
                .iter()
                .map(|(k, v)| KeyValue::new(*k, v.clone().into_value()))
                .collect();
            self.cx.span().add_event(name, attrs);
        }
    }

    /// Mark the span failed with a closed error class (`error.type`).
    pub fn fail(&self, class: &'static str) {
        if self.is_recording() {
            let span = self.cx.span();
            span.set_attribute(KeyValue::new("error.type", class));
            span.set_status(Status::error(class));
        }
    }

    /// Mark the span successful.
    pub fn ok(&self) {
        if self.is_recording() {
            self.cx.span().set_status(Status::Ok);
        }
    }

    /// End the span now.
    pub fn end(self) {
        drop(self)
    }
}

impl Drop for TraceSpan {
    fn drop(&mut self) {
        if self.tracer.0.is_some() {
            self.cx.span().end();
        }
    }
}

fn span_context_of(p: TraceContext) -> SpanContext {
    SpanContext::new(
        TraceId::from_bytes(p.trace_id),
        SpanId::from_bytes(p.parent_span_id),
        TraceFlags::new(p.flags),
        true,
        TraceState::default(),
    )
}

/// The trace context in a `traceparent` header value, if it is well formed
/// (a malformed one starts a new trace; it never fails a request).
pub fn parse_traceparent(value: Option<&[u8]>) -> Option<TraceContext> {
    let value = std::str::from_utf8(value?).ok()?;
    TraceContext::from_traceparent(value)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{SpanData, SpanExporter};

    use super::*;

    /// Keeps every exported span.
    #[derive(Debug, Clone, Default)]
    struct Kept(Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for Kept {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.0.lock().unwrap().extend(batch);
            Ok(())
        }
    }

    impl Kept {
        fn get_finished_spans(&self) -> Result<Vec<SpanData>, ()> {
            Ok(self.0.lock().unwrap().clone())
        }
    }

    fn section(endpoint: &str) -> OtlpTracesSection {
        OtlpTracesSection {
            endpoint: endpoint.into(),
            interval_ms: default_interval_ms(),
            timeout_ms: default_timeout_ms(),
            sample_ratio: 1.0,
            max_queue_spans: default_max_queue_spans(),
            instance: None,
        }
    }

    fn field_of(e: ConfigError) -> String {
        match e {
            ConfigError::Field { field, .. } => field,
            other => panic!("expected a field error, got {other}"),
        }
    }

    fn recording() -> (Tracer, Kept, SdkTracerProvider) {
        let exporter = Kept::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        (Tracer(Some(provider.tracer("test"))), exporter, provider)
    }

    #[test]
    fn traces_endpoint_without_path_gets_the_traces_path() {
        let mut s = section("http://collector:4318");
        s.validate("otlp_traces").unwrap();
        assert_eq!(s.endpoint, "http://collector:4318/v1/traces");
        let mut s = section("http://collector:4318/custom");
        s.validate("otlp_traces").unwrap();
        assert_eq!(s.endpoint, "http://collector:4318/custom");
    }

    #[test]
    fn bad_traces_fields_are_named() {
        assert_eq!(
            field_of(section("collector").validate("otlp_traces").unwrap_err()),
            "otlp_traces.endpoint"
        );
        let mut s = section("http://c");
        s.sample_ratio = 1.5;
        assert_eq!(
            field_of(s.validate("otlp_traces").unwrap_err()),
            "otlp_traces.sample_ratio"
        );
        let mut s = section("http://c");
        s.max_queue_spans = 0;
        assert_eq!(
            field_of(s.validate("otlp_traces").unwrap_err()),
            "otlp_traces.max_queue_spans"
        );
        let mut s = section("http://c");
        s.interval_ms = 1;
        assert_eq!(
            field_of(s.validate("otlp_traces").unwrap_err()),
            "otlp_traces.interval_ms"
        );
        let mut s = section("http://c");
        s.timeout_ms = 0;
        assert_eq!(
            field_of(s.validate("otlp_traces").unwrap_err()),
            "otlp_traces.timeout_ms"
        );
    }

    #[test]
    fn a_child_of_a_remote_parent_joins_its_trace() {
        let (tracer, exporter, provider) = recording();
        let parent = TraceContext::from_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .unwrap();
        let root = tracer.start("edge.request", Kind::Server, Some(parent));
        let child = root.child("edge.attempt", Kind::Client);
        let wire = child.context().unwrap();
        assert_eq!(wire.trace_id, parent.trace_id);
        assert!(wire.is_sampled());
        child.end();
        root.end();
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        let root = spans.iter().find(|s| s.name == "edge.request").unwrap();
        let child = spans.iter().find(|s| s.name == "edge.attempt").unwrap();
        assert_eq!(root.parent_span_id.to_bytes(), parent.parent_span_id);
        assert_eq!(child.parent_span_id, root.span_context.span_id());
        assert_eq!(child.span_context.span_id().to_bytes(), wire.parent_span_id);
    }

    #[test]
    fn a_disabled_tracer_passes_the_context_through_unchanged() {
        let tracer = TracePipeline::disabled().tracer();
        let parent = TraceContext::from_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        );
        let span = tracer.start("edge.request", Kind::Server, parent);
        assert!(!span.is_recording());
        assert_eq!(span.child("x", Kind::Internal).context(), parent);
        let span = tracer.start("edge.request", Kind::Server, None);
        assert_eq!(span.context(), None);
    }

    #[test]
    fn a_new_trace_gets_a_valid_sampled_context() {
        let (tracer, _exporter, _provider) = recording();
        let span = tracer.start("edge.request", Kind::Server, None);
        let cx = span.context().unwrap();
        assert!(cx.is_valid() && cx.is_sampled());
        assert_eq!(
            TraceContext::from_traceparent(&cx.to_traceparent()),
            Some(cx)
        );
    }

    #[test]
    fn malformed_traceparent_headers_start_a_new_trace() {
        for bad in [
            &b""[..],
            b"garbage",
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"\xff\xfe",
        ] {
            assert_eq!(parse_traceparent(Some(bad)), None, "{bad:?}");
        }
        // A later version is read by its first four fields.
        assert!(
            parse_traceparent(Some(
                b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more"
            ))
            .is_some()
        );
    }
}
