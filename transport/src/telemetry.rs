//! The metrics pipeline both shells share (R-OBS-1): one OpenTelemetry
//! meter provider with a Prometheus reader (scraped at `/metrics`) and, when
//! an `[otlp]` section is configured, a periodic OTLP/HTTP (protobuf)
//! exporter pushing the same instruments to a collector.
//!
//! Labels are the instruments' business: every shell records closed enum
//! values only. The OTLP resource carries `service.name` (`iop-edge` or
//! `iop-node`) and `service.instance.id` (the configured edge or node name),
//! both bounded operator-chosen values.

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider, Temporality};
use prometheus::{Encoder as _, TextEncoder};
use serde::Deserialize;

use crate::settings::{ConfigError, field_err};

/// Path appended to an OTLP endpoint given without one.
pub const OTLP_METRICS_PATH: &str = "/v1/metrics";

/// How cumulative sums and histograms are reported over OTLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OtlpTemporality {
    /// Totals since start (what Prometheus-backed collectors expect).
    #[default]
    Cumulative,
    /// Change since the previous export.
    Delta,
}

/// `[otlp]`: optional OTLP/HTTP metrics export. Absent means off.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpSection {
    /// Collector URL, `http://host:4318/v1/metrics` (or `https://`). A URL
    /// without a path gets `/v1/metrics`. Extra headers (for example an
    /// authorization token) come from `OTEL_EXPORTER_OTLP_HEADERS`, never
    /// from this file.
    pub endpoint: String,
    /// Export period.
    #[serde(default = "default_interval_ms")]
    pub interval_ms: u64,
    /// Bound of one export request.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// `cumulative` (default) or `delta`.
    #[serde(default)]
    pub temporality: OtlpTemporality,
    /// `service.instance.id` of the exported resource; defaults to the
    /// node id on a Node and `iop-edge` on the Edge.
    #[serde(default)]
    pub instance: Option<String>,
}

fn default_interval_ms() -> u64 {
    15_000
}
fn default_timeout_ms() -> u64 {
    5_000
}

/// Shortest accepted export period.
pub const MIN_OTLP_INTERVAL_MS: u64 = 100;

impl OtlpSection {
    /// Validate, naming `section.field`, and normalise the endpoint.
    pub fn validate(&mut self, section: &str) -> Result<(), ConfigError> {
        self.endpoint = normalise_endpoint(section, &self.endpoint, OTLP_METRICS_PATH)?;
        if self.interval_ms < MIN_OTLP_INTERVAL_MS {
            return Err(field_err(
                format!("{section}.interval_ms"),
                format!("must be >= {MIN_OTLP_INTERVAL_MS}"),
            ));
        }
        if self.timeout_ms == 0 {
            return Err(field_err(format!("{section}.timeout_ms"), "must be > 0"));
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

/// Check an OTLP/HTTP collector URL, naming `section.endpoint`, and give a
/// URL without a path `default_path` (`/v1/metrics`, `/v1/traces`).
pub(crate) fn normalise_endpoint(
    section: &str,
    endpoint: &str,
    default_path: &str,
) -> Result<String, ConfigError> {
    let endpoint = endpoint.trim();
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .ok_or_else(|| {
            field_err(
                format!("{section}.endpoint"),
                "must be an http:// or https:// URL",
            )
        })?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if authority.is_empty() || authority.contains(|c: char| c.is_whitespace() || c == '@') {
        return Err(field_err(
            format!("{section}.endpoint"),
            "needs a host[:port] and no credentials",
        ));
    }
    let mut normalised = endpoint.to_string();
    if path.is_empty() || path == "/" {
        normalised = format!("{}{default_path}", endpoint.trim_end_matches('/'));
    }
    if normalised.parse::<http::Uri>().is_err() {
        return Err(field_err(
            format!("{section}.endpoint"),
            "is not a valid URL",
        ));
    }
    Ok(normalised)
}

/// Why the metrics pipeline could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The Prometheus reader could not be registered.
    #[error("cannot build the Prometheus exporter: {0}")]
    Prometheus(String),
    /// The OTLP exporter refused its configuration.
    #[error("cannot build the OTLP exporter for {endpoint}: {message}")]
    Otlp {
        /// Configured endpoint.
        endpoint: String,
        /// Cause.
        message: String,
    },
}

/// One meter provider: Prometheus always, OTLP when configured.
pub struct MetricsPipeline {
    registry: prometheus::Registry,
    provider: SdkMeterProvider,
    otlp: bool,
}

impl std::fmt::Debug for MetricsPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsPipeline")
            .field("otlp", &self.otlp)
            .finish_non_exhaustive()
    }
}

impl MetricsPipeline {
    /// Build the pipeline for `service` (`iop-edge`, `iop-node`) named
    /// `instance` (unless `otlp.instance` names it). With `otlp`, a background thread exports every
    /// `interval_ms`; export failures are logged by the SDK and never
    /// affect request handling.
    pub fn new(
        service: &'static str,
        instance: &str,
        otlp: Option<&OtlpSection>,
    ) -> Result<Self, TelemetryError> {
        let registry = prometheus::Registry::new();
        let prometheus = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_units()
            .without_target_info()
            .scope_info_enabled(false)
            .build()
            .map_err(|e| TelemetryError::Prometheus(e.to_string()))?;
        let resource = Resource::builder_empty()
            .with_attributes([
                KeyValue::new("service.name", service),
                KeyValue::new(
                    "service.instance.id",
                    otlp.and_then(|o| o.instance.clone())
                        .unwrap_or_else(|| instance.to_string()),
                ),
            ])
            .build();
        let mut builder = SdkMeterProvider::builder()
            .with_resource(resource)
            .with_reader(prometheus);
        if let Some(otlp) = otlp {
            // reqwest is built without a bundled crypto provider; an
            // https collector needs the process default (ring, as for
            // every other rustls config here). Idempotent.
            let _ = rustls::crypto::ring::default_provider().install_default();
            let err = |e: &dyn std::fmt::Display| TelemetryError::Otlp {
                endpoint: otlp.endpoint.clone(),
                message: e.to_string(),
            };
            let exporter = opentelemetry_otlp::MetricExporter::builder()
                .with_http()
                .with_endpoint(otlp.endpoint.clone())
                .with_timeout(Duration::from_millis(otlp.timeout_ms))
                .with_temporality(match otlp.temporality {
                    OtlpTemporality::Cumulative => Temporality::Cumulative,
                    OtlpTemporality::Delta => Temporality::Delta,
                })
                .build()
                .map_err(|e| err(&e))?;
            let reader = PeriodicReader::builder(exporter)
                .with_interval(Duration::from_millis(otlp.interval_ms))
                .build();
            builder = builder.with_reader(reader);
        }
        Ok(Self {
            registry,
            provider: builder.build(),
            otlp: otlp.is_some(),
        })
    }

    /// A pipeline with only the Prometheus reader (tests, tools).
    pub fn prometheus_only(service: &'static str) -> Self {
        match Self::new(service, service, None) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(event = "metrics_exporter_failed", error = %e);
                Self {
                    registry: prometheus::Registry::new(),
                    provider: SdkMeterProvider::builder().build(),
                    otlp: false,
                }
            }
        }
    }

    /// The meter instruments are created on.
    pub fn meter(&self, scope: &'static str) -> Meter {
        self.provider.meter(scope)
    }

    /// Whether OTLP export is on.
    pub fn otlp_enabled(&self) -> bool {
        self.otlp
    }

    /// Prometheus text exposition of every instrument.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(event = "metrics_encode_failed", error = %e);
        }
        String::from_utf8(out).unwrap_or_default()
    }

    /// Push what is pending to the collector now (blocking; bounded by the
    /// export timeout). A no-op without OTLP.
    pub fn flush(&self) {
        if self.otlp
            && let Err(e) = self.provider.force_flush()
        {
            tracing::warn!(event = "otlp_flush_failed", error = %e);
        }
    }

    /// Final export and shutdown (blocking; bounded by the export timeout).
    /// Call from a blocking context at graceful shutdown; afterwards the
    /// instruments record nothing.
    pub fn shutdown(&self) {
        if self.otlp
            && let Err(e) = self.provider.shutdown()
        {
            tracing::warn!(event = "otlp_shutdown_failed", error = %e);
        }
    }
}

/// Instruments bound to each label set met so far, at most
/// [`MAX_BOUND_SETS`] of them; past that a set is bound for each
/// measurement (the same numbers, more work). A bound instrument
/// (OpenTelemetry's `bind`) writes to its series directly, without the
/// attributes' sorting, hashing and lookup of every `add` or `record`.
/// The label values come from the configuration and closed sets only, as
/// every label's do, so the sets stay few, and none is a stranger's choice:
/// the map hashes them with FxHash (unkeyed, a few instructions a key)
/// rather than SipHash.
pub struct BoundSets<K, V> {
    sets: std::sync::Mutex<rustc_hash::FxHashMap<K, std::sync::Arc<V>>>,
}

impl<K, V> Default for BoundSets<K, V> {
    fn default() -> Self {
        BoundSets {
            sets: std::sync::Mutex::new(rustc_hash::FxHashMap::default()),
        }
    }
}

impl<K, V> std::fmt::Debug for BoundSets<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundSets").finish_non_exhaustive()
    }
}

impl<K: Eq + std::hash::Hash, V> BoundSets<K, V> {
    /// The instruments bound to `key`'s set, bound by `bind` the first
    /// time it is met.
    pub fn get(&self, key: K, bind: impl FnOnce() -> V) -> std::sync::Arc<V> {
        let mut sets = self
            .sets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(bound) = sets.get(&key) {
            return std::sync::Arc::clone(bound);
        }
        let bound = std::sync::Arc::new(bind());
        if sets.len() < MAX_BOUND_SETS {
            sets.insert(key, std::sync::Arc::clone(&bound));
        }
        bound
    }
}

/// Most label sets a [`BoundSets`] keeps bound.
pub const MAX_BOUND_SETS: usize = 4096;

/// Observe the process (CPU seconds, resident memory, open and maximum
/// file descriptors, start time) under the names Prometheus' own client
/// libraries use, and `<prefix>_build_info{version}` at 1, on `meter`.
/// Values are read from `/proc/self` at each collection; where it is
/// absent (not Linux) the process series are simply not reported.
pub fn observe_process(meter: &Meter, prefix: &'static str) {
    meter
        .f64_observable_counter("process_cpu_seconds")
        .with_description("User and system CPU time spent, in seconds")
        .with_callback(|o| {
            if let Some(v) = process::cpu_seconds() {
                o.observe(v, &[])
            }
        })
        .build();
    meter
        .u64_observable_gauge("process_resident_memory_bytes")
        .with_description("Resident memory size, in bytes")
        .with_callback(|o| {
            if let Some(v) = process::resident_bytes() {
                o.observe(v, &[])
            }
        })
        .build();
    meter
        .u64_observable_gauge("process_open_fds")
        .with_description("Open file descriptors")
        .with_callback(|o| {
            if let Some(v) = process::open_fds() {
                o.observe(v, &[])
            }
        })
        .build();
    meter
        .u64_observable_gauge("process_max_fds")
        .with_description("The soft limit of open file descriptors")
        .with_callback(|o| {
            if let Some(v) = process::max_fds() {
                o.observe(v, &[])
            }
        })
        .build();
    let started = crate::clock::unix_ms() as f64 / 1000.0;
    meter
        .f64_observable_gauge("process_start_time_seconds")
        .with_description("Start time of the process since the Unix epoch, in seconds")
        .with_callback(move |o| o.observe(started, &[]))
        .build();
    meter
        .u64_observable_gauge(format!("{prefix}_build_info"))
        .with_description("Always 1; the labels say which build is running")
        .with_callback(|o| o.observe(1, &[KeyValue::new("version", env!("CARGO_PKG_VERSION"))]))
        .build();
}

/// Readers of `/proc/self` (Linux); `None` elsewhere or on a parse error.
mod process {
    /// `/proc` reports CPU times in USER_HZ ticks, 100 per second on Linux.
    const TICKS_PER_SECOND: f64 = 100.0;

    pub(super) fn cpu_seconds() -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The command name (field 2) may hold spaces; fields after it are
        // counted from its closing parenthesis. utime and stime are fields
        // 14 and 15, the 12th and 13th after it.
        let rest = &stat[stat.rfind(')')? + 1..];
        let mut fields = rest.split_whitespace().skip(11);
        let utime: u64 = fields.next()?.parse().ok()?;
        let stime: u64 = fields.next()?.parse().ok()?;
        Some((utime + stime) as f64 / TICKS_PER_SECOND)
    }

    pub(super) fn resident_bytes() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    pub(super) fn open_fds() -> Option<u64> {
        Some(std::fs::read_dir("/proc/self/fd").ok()?.count() as u64)
    }

    pub(super) fn max_fds() -> Option<u64> {
        let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
        let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
        line["Max open files".len()..]
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(endpoint: &str) -> OtlpSection {
        OtlpSection {
            endpoint: endpoint.into(),
            interval_ms: default_interval_ms(),
            timeout_ms: default_timeout_ms(),
            temporality: OtlpTemporality::Cumulative,
            instance: None,
        }
    }

    fn field_of(e: ConfigError) -> String {
        match e {
            ConfigError::Field { field, .. } => field,
            other => panic!("expected a field error, got {other}"),
        }
    }

    #[test]
    fn bound_sets_bind_a_set_once_and_past_their_bound_each_time() {
        let sets: BoundSets<usize, usize> = BoundSets::default();
        let mut binds = 0;
        let first = sets.get(7, || {
            binds += 1;
            70
        });
        let again = sets.get(7, || unreachable!("a set met before is not bound again"));
        assert!(std::sync::Arc::ptr_eq(&first, &again));
        assert_eq!((*again, binds), (70, 1));
        for key in 0..MAX_BOUND_SETS + 10 {
            sets.get(key, || key);
        }
        // Past the bound a set is bound for each measurement, never kept.
        let mut binds = 0;
        for _ in 0..2 {
            let v = sets.get(MAX_BOUND_SETS + 5, || {
                binds += 1;
                1
            });
            assert_eq!(*v, 1);
        }
        assert_eq!(binds, 2);
        assert_eq!(sets.sets.lock().unwrap().len(), MAX_BOUND_SETS);
    }

    #[test]
    fn endpoint_without_path_gets_the_metrics_path() {
        let mut s = section("http://collector:4318");
        s.validate("otlp").unwrap();
        assert_eq!(s.endpoint, "http://collector:4318/v1/metrics");
        let mut s = section("https://collector:4318/");
        s.validate("otlp").unwrap();
        assert_eq!(s.endpoint, "https://collector:4318/v1/metrics");
        let mut s = section("http://collector:4318/custom/metrics");
        s.validate("otlp").unwrap();
        assert_eq!(s.endpoint, "http://collector:4318/custom/metrics");
    }

    #[test]
    fn bad_fields_are_named() {
        for bad in [
            "collector:4318",
            "ftp://x",
            "http://",
            "http://u:p@host/",
            "http://a b",
        ] {
            assert_eq!(
                field_of(section(bad).validate("otlp").unwrap_err()),
                "otlp.endpoint",
                "{bad}"
            );
        }
        let mut s = section("http://c:4318");
        s.interval_ms = 10;
        assert_eq!(
            field_of(s.validate("otlp").unwrap_err()),
            "otlp.interval_ms"
        );
        let mut s = section("http://c:4318");
        s.instance = Some("a b".into());
        assert_eq!(field_of(s.validate("otlp").unwrap_err()), "otlp.instance");
        let mut s = section("http://c:4318");
        s.timeout_ms = 0;
        assert_eq!(field_of(s.validate("otlp").unwrap_err()), "otlp.timeout_ms");
    }

    #[test]
    fn prometheus_reader_renders_recorded_instruments() {
        let p = MetricsPipeline::new("iop-test", "unit", None).unwrap();
        assert!(!p.otlp_enabled());
        let c = p.meter("iop-test").u64_counter("iop_test_things").build();
        c.add(3, &[KeyValue::new("kind", "a")]);
        let text = p.render();
        assert!(
            text.contains("iop_test_things_total{kind=\"a\"} 3"),
            "{text}"
        );
    }

    #[test]
    fn process_metrics_and_build_info_are_observed() {
        let p = MetricsPipeline::new("iop-test", "unit", None).unwrap();
        observe_process(&p.meter("iop-test"), "iop_test");
        let text = p.render();
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_open_fds ",
            "process_max_fds ",
            "process_start_time_seconds ",
        ] {
            assert!(text.contains(name), "{name} missing: {text}");
        }
        assert!(
            text.contains(&format!(
                "iop_test_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
        assert!(super::process::resident_bytes().unwrap() > 0);
        assert!(super::process::open_fds().unwrap() > 0);
        assert!(super::process::cpu_seconds().is_some());
    }

    #[test]
    fn otlp_pipeline_builds_without_a_reachable_collector() {
        // Building never dials; an unreachable collector only logs at export.
        let mut s = section("http://127.0.0.1:9");
        s.validate("otlp").unwrap();
        let p = MetricsPipeline::new("iop-test", "unit", Some(&s)).unwrap();
        assert!(p.otlp_enabled());
        p.meter("iop-test")
            .u64_counter("iop_test_x")
            .build()
            .add(1, &[]);
        assert!(p.render().contains("iop_test_x_total 1"));
    }
}
