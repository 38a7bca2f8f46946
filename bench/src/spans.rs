//! Where a slow request's time went: the tail scenario's spans.
//!
//! The Edge and the Node export their spans (`[otlp_traces]`) to a
//! loopback OTLP/HTTP collector here ([`SpanCollector`]); the load
//! generator gives every request a `traceparent` of its own trace id
//! ([`crate::load::run_traced`]). Joined by trace id, each request's
//! client-side latency splits into consecutive phases on one clock (every
//! process reads the same host's wall clock), from the client's send to its
//! last byte ([`Phases`]). [`TailProfile`] compares the phases of the
//! slowest 1 % of requests with those of the median ones: the phases that
//! grow are what the tail waited on.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;
use serde::{Deserialize, Serialize};

use crate::load::TracedRequest;

/// The most spans a collector keeps (later ones are counted, not kept).
const MAX_SPANS: usize = 2_000_000;

/// One exported span: its trace, name and times (Unix nanoseconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanRecord {
    /// The W3C trace id.
    pub trace_id: u128,
    /// `edge.request`, `node.run`, ...
    pub name: String,
    /// Start, Unix ns.
    pub start_ns: u64,
    /// End, Unix ns.
    pub end_ns: u64,
    /// Its `first_content` event (a provider call's first text or body
    /// relayed), Unix ns.
    pub first_content_ns: Option<u64>,
}

#[derive(Default)]
struct Kept {
    spans: Vec<SpanRecord>,
    dropped: u64,
}

/// A loopback OTLP/HTTP (protobuf) traces collector keeping every span.
pub struct SpanCollector {
    addr: SocketAddr,
    kept: Arc<Mutex<Kept>>,
    server: tokio::task::JoinHandle<()>,
}

impl SpanCollector {
    /// Listen on a free loopback port.
    pub async fn start() -> std::io::Result<Self> {
        let kept = Arc::new(Mutex::new(Kept::default()));
        let into = kept.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let into = into.clone();
                async move {
                    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
                        return axum::http::StatusCode::BAD_REQUEST;
                    };
                    let spans = request
                        .resource_spans
                        .into_iter()
                        .flat_map(|r| r.scope_spans)
                        .flat_map(|s| s.spans)
                        .filter_map(|s| {
                            let trace_id: [u8; 16] = s.trace_id.as_slice().try_into().ok()?;
                            let first_content_ns = s
                                .events
                                .iter()
                                .find(|e| e.name == "first_content")
                                .map(|e| e.time_unix_nano);
                            Some(SpanRecord {
                                trace_id: u128::from_be_bytes(trace_id),
                                name: s.name,
                                start_ns: s.start_time_unix_nano,
                                end_ns: s.end_time_unix_nano,
                                first_content_ns,
                            })
                        });
                    let mut kept = into.lock().unwrap_or_else(|p| p.into_inner());
                    for span in spans {
                        if kept.spans.len() < MAX_SPANS {
                            kept.spans.push(span);
                        } else {
                            kept.dropped += 1;
                        }
                    }
                    axum::http::StatusCode::OK
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, kept, server })
    }

    /// The traces endpoint to configure (`[otlp_traces] endpoint`).
    pub fn endpoint(&self) -> String {
        format!("http://{}/v1/traces", self.addr)
    }

    /// Every span received so far (emptying the collector), and how many
    /// were dropped past its bound.
    pub fn take(&self) -> (Vec<SpanRecord>, u64) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let dropped = std::mem::take(&mut kept.dropped);
        (std::mem::take(&mut kept.spans), dropped)
    }
}

impl Drop for SpanCollector {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// The `[otlp_traces]` section that sends the spans of the requests that
/// ask for it (a sampled `traceparent`; no other request is traced) to
/// `endpoint` at once (the smallest export interval, a queue for a whole
/// run).
pub fn otlp_traces_section(endpoint: &str) -> String {
    format!(
        "[otlp_traces]\nendpoint = \"{endpoint}\"\ninterval_ms = 100\nsample_ratio = 0.0\nmax_queue_spans = 200000\n"
    )
}

/// The names of the phases, in order.
pub const PHASES: [&str; 10] = [
    "client -> Edge handler",
    "Edge: body, admission",
    "Edge -> Node run",
    "Node: to the provider call",
    "provider call: to first content",
    "provider call: first content to end",
    "Node: after the call",
    "Node run end -> Edge attempt end",
    "Edge: attempt end -> request end",
    "Edge request end -> client",
];

/// One request's latency split at its spans' boundaries, ns (a phase may
/// be negative where two spans of different processes overlap: the Edge
/// may see a run's terminal before the Node's span of it ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phases {
    /// The client's latency, ns.
    pub total_ns: i64,
    /// Each of [`PHASES`], ns; they add up to `total_ns`.
    pub ns: [i64; 10],
}

/// The spans of one request, first of each name.
#[derive(Debug, Default, Clone, Copy)]
struct Found {
    request: Option<(u64, u64)>,
    attempt: Option<(u64, u64)>,
    run: Option<(u64, u64)>,
    call: Option<(u64, u64)>,
    /// The call's first content (its end if it relayed none).
    first_content: Option<u64>,
    attempts: u32,
}

impl Phases {
    /// Split `request` by its spans; `None` unless it has exactly one
    /// attempt and each of `edge.request`, `edge.attempt`, `node.run` and
    /// `node.provider_call`.
    fn of(request: &TracedRequest, found: &Found) -> Option<Self> {
        if found.attempts != 1 {
            return None;
        }
        let (req0, req1) = found.request?;
        let (att0, att1) = found.attempt?;
        let (run0, run1) = found.run?;
        let (call0, call1) = found.call?;
        let first = found.first_content.unwrap_or(call1).clamp(call0, call1);
        let start = request.start_unix_ns;
        let end = start + request.total_us * 1_000;
        let points = [
            start, req0, att0, run0, call0, first, call1, run1, att1, req1, end,
        ];
        let mut ns = [0i64; 10];
        for (i, pair) in points.windows(2).enumerate() {
            ns[i] = pair[1] as i64 - pair[0] as i64;
        }
        Some(Self {
            total_ns: end as i64 - start as i64,
            ns,
        })
    }
}

/// Join `requests` with `spans` by trace id: the phases of every request
/// whose spans are complete, and how many were not.
pub fn join(requests: &[TracedRequest], spans: &[SpanRecord]) -> (Vec<Phases>, usize) {
    let mut by_trace: HashMap<u128, Found> = HashMap::with_capacity(requests.len());
    for r in requests {
        by_trace.insert(r.trace_id, Found::default());
    }
    for s in spans {
        let Some(found) = by_trace.get_mut(&s.trace_id) else {
            continue;
        };
        let times = Some((s.start_ns, s.end_ns));
        let slot = match s.name.as_str() {
            "edge.request" => &mut found.request,
            "edge.attempt" => {
                found.attempts += 1;
                &mut found.attempt
            }
            "node.run" => &mut found.run,
            "node.provider_call" => {
                if found.call.is_none() {
                    found.first_content = s.first_content_ns;
                }
                &mut found.call
            }
            _ => continue,
        };
        if slot.is_none() {
            *slot = times;
        }
    }
    let mut phases = Vec::with_capacity(requests.len());
    let mut incomplete = 0;
    for r in requests {
        match by_trace.get(&r.trace_id).and_then(|f| Phases::of(r, f)) {
            Some(p) => phases.push(p),
            None => incomplete += 1,
        }
    }
    (phases, incomplete)
}

/// The mean phases of a group of requests, µs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseMeans {
    /// Requests in the group.
    pub requests: usize,
    /// Their mean latency, µs.
    pub total_us: f64,
    /// The mean of each of [`PHASES`], µs.
    pub phases_us: Vec<f64>,
}

impl PhaseMeans {
    fn of(group: &[Phases]) -> Self {
        let n = group.len().max(1) as f64;
        let mean =
            |f: &dyn Fn(&Phases) -> i64| group.iter().map(|p| f(p) as f64).sum::<f64>() / n / 1e3;
        Self {
            requests: group.len(),
            total_us: mean(&|p| p.total_ns),
            phases_us: (0..PHASES.len()).map(|i| mean(&|p| p.ns[i])).collect(),
        }
    }
}

/// Where one traced run's time went: the median requests (p45 to p55 of
/// client latency) against the slowest 1 %.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TailProfile {
    /// The run (`open 2000/s`).
    pub load: String,
    /// The path (`iop tunnel`, `iop normalized`).
    pub target: String,
    /// Requests whose phases were joined.
    pub joined: usize,
    /// Successful requests whose spans were not all found (a retried
    /// attempt, a span dropped by a full export queue).
    pub incomplete: usize,
    /// Spans the collector dropped past its bound.
    pub dropped_spans: u64,
    /// The requests around the median.
    pub median: PhaseMeans,
    /// The slowest 1 % (at least one request).
    pub slowest: PhaseMeans,
}

impl TailProfile {
    /// Profile `phases` (any order).
    pub fn of(
        load: &str,
        target: &str,
        mut phases: Vec<Phases>,
        incomplete: usize,
        dropped_spans: u64,
    ) -> Self {
        phases.sort_by_key(|p| p.total_ns);
        let n = phases.len();
        let (lo, hi) = (n * 45 / 100, (n * 55 / 100).max(n * 45 / 100 + 1).min(n));
        let slow_from = n - (n / 100).max(1).min(n);
        Self {
            load: load.into(),
            target: target.into(),
            joined: n,
            incomplete,
            dropped_spans,
            median: PhaseMeans::of(&phases[lo.min(n)..hi]),
            slowest: PhaseMeans::of(&phases[slow_from..]),
        }
    }

    /// A markdown table: each phase's mean for the median and the slowest
    /// requests, and its share of the difference.
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "#### {} {} ({} requests joined, {} incomplete, {} spans dropped)\n\n\
             | phase | median requests µs | slowest 1 % µs | share of the difference |\n\
             | --- | ---: | ---: | ---: |\n",
            self.load, self.target, self.joined, self.incomplete, self.dropped_spans
        );
        let diff = self.slowest.total_us - self.median.total_us;
        for (i, name) in PHASES.iter().enumerate() {
            let (m, s) = (self.median.phases_us[i], self.slowest.phases_us[i]);
            let share = if diff.abs() > f64::EPSILON {
                format!("{:.0} %", (s - m) / diff * 100.0)
            } else {
                "-".into()
            };
            out.push_str(&format!("| {name} | {m:.1} | {s:.1} | {share} |\n"));
        }
        out.push_str(&format!(
            "| **total (client)** | {:.1} | {:.1} | 100 % |\n\n",
            self.median.total_us, self.slowest.total_us
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(trace_id: u128, name: &str, start_ns: u64, end_ns: u64) -> SpanRecord {
        SpanRecord {
            trace_id,
            name: name.into(),
            start_ns,
            end_ns,
            first_content_ns: None,
        }
    }

    fn spans_of(trace_id: u128, at: u64, slow_call_ns: u64) -> Vec<SpanRecord> {
        vec![
            span(trace_id, "edge.request", at + 100, at + 900 + slow_call_ns),
            span(trace_id, "edge.queue_wait", at + 150, at + 180),
            span(trace_id, "edge.attempt", at + 200, at + 800 + slow_call_ns),
            span(trace_id, "node.run", at + 300, at + 700 + slow_call_ns),
            SpanRecord {
                first_content_ns: Some(at + 450),
                ..span(
                    trace_id,
                    "node.provider_call",
                    at + 400,
                    at + 600 + slow_call_ns,
                )
            },
        ]
    }

    #[test]
    fn phases_add_up_to_the_client_latency_and_follow_the_spans() {
        let r = TracedRequest {
            trace_id: 7,
            start_unix_ns: 1_000,
            total_us: 1,
        };
        let (phases, incomplete) = join(&[r], &spans_of(7, 1_000, 0));
        assert_eq!(incomplete, 0);
        let p = phases[0];
        assert_eq!(p.ns, [100, 100, 100, 100, 50, 150, 100, 100, 100, 100]);
        assert_eq!(p.ns.iter().sum::<i64>(), p.total_ns);
    }

    #[test]
    fn a_request_without_all_its_spans_or_with_two_attempts_is_incomplete() {
        let a = TracedRequest {
            trace_id: 1,
            start_unix_ns: 0,
            total_us: 1,
        };
        let b = TracedRequest { trace_id: 2, ..a };
        let mut spans = spans_of(1, 0, 0);
        spans.retain(|s| s.name != "node.run");
        spans.extend(spans_of(2, 0, 0));
        spans.push(span(2, "edge.attempt", 0, 1));
        let (phases, incomplete) = join(&[a, b], &spans);
        assert!(phases.is_empty());
        assert_eq!(incomplete, 2);
    }

    #[test]
    fn the_profile_names_the_phase_the_slowest_requests_waited_on() {
        let mut requests = Vec::new();
        let mut spans = Vec::new();
        for i in 0..200u64 {
            // Every 100th request's provider call takes 50 µs longer.
            let slow = if i % 100 == 99 { 50_000 } else { 0 };
            let at = i * 1_000_000;
            requests.push(TracedRequest {
                trace_id: u128::from(i) + 1,
                start_unix_ns: at,
                total_us: 1 + slow / 1_000,
            });
            spans.extend(spans_of(u128::from(i) + 1, at, slow));
        }
        let (phases, incomplete) = join(&requests, &spans);
        let profile = TailProfile::of("open 1/s", "iop normalized", phases, incomplete, 0);
        assert_eq!(profile.joined, 200);
        assert_eq!(profile.slowest.requests, 2);
        assert!((profile.slowest.total_us - profile.median.total_us - 50.0).abs() < 1e-9);
        // All of the difference is the provider call's, after its first
        // content.
        assert!((profile.slowest.phases_us[5] - profile.median.phases_us[5] - 50.0).abs() < 1e-9);
        let table = profile.markdown();
        assert!(
            table.contains("| provider call: to first content | 0.1 | 0.1 | 0 % |"),
            "{table}"
        );
        assert!(
            table.contains("| provider call: first content to end | 0.1 | 50.1 | 100 % |"),
            "{table}"
        );
    }
}
