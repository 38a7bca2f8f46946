//! The load generator: OpenAI Chat Completions requests, streamed or not,
//! in open or closed loop.
//!
//! **Open loop** ([`LoadMode::Open`]): a pacing thread computes each
//! request's intended send time `start + i / rate` and launches it then,
//! whether or not earlier requests have finished. Latency is measured from
//! the *intended* time, so a server that stalls the pacer's requests (or a
//! pacer that falls behind) shows up in the percentiles instead of being
//! omitted (coordinated omission). A request that cannot be launched
//! because [`LoadSpec::max_in_flight`] are outstanding is counted as a
//! `backlog` error rather than delayed.
//!
//! **Closed loop** ([`LoadMode::Closed`]): `concurrency` clients each send
//! their next request when the previous one ends; latency is measured from
//! the actual send time.
//!
//! Requests whose (intended) send time falls in the warm-up are sent but not
//! counted; the run then waits for every request still in flight (each is
//! bounded by [`LoadSpec::request_timeout`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use hdrhistogram::Histogram;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderName, HeaderValue};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::report::{LoadMode, LoadReport, Percentiles};
use crate::sse::{SseEvent, SseScanner};

/// Outcomes buffered between request tasks and the collector.
const OUTCOME_QUEUE: usize = 65_536;
/// The largest latency a histogram holds (one hour, in microseconds).
const HISTOGRAM_MAX_US: u64 = 3_600_000_000;
/// The most requests one run may have in flight (the bound of
/// [`LoadSpec::max_in_flight`]).
pub const MAX_IN_FLIGHT_LIMIT: usize = 50_000;
/// The highest open-loop rate the pacer accepts.
pub const MAX_RATE_PER_S: f64 = 1_000_000.0;
/// The most inter-chunk gaps kept per stream (the rest are counted as
/// chunks but not timed).
const MAX_GAPS_PER_STREAM: usize = 100_000;

/// Where requests go, and whether the gateway is asked to keep them.
#[derive(Debug, Clone)]
pub struct Target {
    /// The full Chat Completions URL (`http://host:port/v1/chat/completions`).
    pub url: String,
    /// Bearer key, if the target needs one.
    pub api_key: Option<String>,
    /// The `model` of every request.
    pub model: String,
    /// Whether every request asks for a durable response.
    pub durability: Durability,
    /// Headers every request carries besides the key (a peer gateway's
    /// routing headers).
    pub headers: Vec<(String, String)>,
}

/// How a request asks iop to keep its response (docs/durability.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    /// Neither `store` nor an `Idempotency-Key`: nothing is journaled.
    #[default]
    Ephemeral,
    /// `"store": true` in every body.
    Store,
    /// A fresh `Idempotency-Key` header on every request (unique across
    /// runs and processes, so no request is ever a replay).
    IdempotencyKey,
}

impl Durability {
    /// `ephemeral`, `store`, `idempotency_key`.
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Ephemeral => "ephemeral",
            Durability::Store => "store",
            Durability::IdempotencyKey => "idempotency_key",
        }
    }
}

/// One load run.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Names the run in reports.
    pub label: String,
    /// Where requests go.
    pub target: Target,
    /// `"stream": true` (SSE) or not.
    pub stream: bool,
    /// Open or closed loop.
    pub mode: LoadMode,
    /// Whole run, warm-up included.
    pub duration: Duration,
    /// Leading part of the run that is sent but not counted.
    pub warmup: Duration,
    /// Open loop: requests outstanding at once before new ones are
    /// counted as `backlog` errors instead of sent.
    pub max_in_flight: usize,
    /// Bound of one request, body included.
    pub request_timeout: Duration,
    /// Closed loop: start clients at this many per second (`None`: all at
    /// once).
    pub ramp_per_s: Option<f64>,
}

impl LoadSpec {
    /// A spec with the usual bounds: 1 s warm-up, 4,096 in flight, 30 s per
    /// request, no ramp.
    pub fn new(
        label: &str,
        target: Target,
        stream: bool,
        mode: LoadMode,
        duration: Duration,
    ) -> Self {
        Self {
            label: label.to_owned(),
            target,
            stream,
            mode,
            duration,
            warmup: Duration::from_secs(1).min(duration / 4),
            max_in_flight: 4096,
            request_timeout: Duration::from_secs(30),
            ramp_per_s: None,
        }
    }
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A field of the spec is out of range.
    #[error("invalid load spec: {0}")]
    InvalidSpec(&'static str),
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Client(#[from] reqwest::Error),
    /// The bearer key is not a valid header value.
    #[error("the API key is not a valid header value")]
    InvalidKey,
    /// A task of the run panicked.
    #[error("a load task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Why one request failed; a closed vocabulary of report keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RequestError {
    /// Connect, reset or protocol failure.
    Transport,
    /// [`LoadSpec::request_timeout`] elapsed.
    Timeout,
    /// A non-2xx status.
    Status(u16),
    /// The stream carried an error event.
    StreamError,
    /// The stream ended without `[DONE]`.
    Incomplete,
    /// The body was not a chat completion or the SSE was malformed.
    Malformed,
    /// Open loop: not sent, [`LoadSpec::max_in_flight`] were outstanding.
    Backlog,
}

impl RequestError {
    /// The report key (`http_429`, `transport`, ...).
    pub fn key(self) -> String {
        match self {
            RequestError::Transport => "transport".to_owned(),
            RequestError::Timeout => "timeout".to_owned(),
            RequestError::Status(code) => format!("http_{code}"),
            RequestError::StreamError => "stream_error".to_owned(),
            RequestError::Incomplete => "incomplete".to_owned(),
            RequestError::Malformed => "malformed".to_owned(),
            RequestError::Backlog => "backlog".to_owned(),
        }
    }
}

/// A successful request's timings.
#[derive(Debug, Default)]
struct Timings {
    total_us: u64,
    ttft_us: Option<u64>,
    gaps_us: Vec<u32>,
    chunks: u64,
}

struct Outcome {
    /// Intended (open loop) or actual (closed loop) send time.
    start: Instant,
    /// The trace id the request carried in its `traceparent`, if traced.
    trace_id: Option<u128>,
    result: Result<Timings, RequestError>,
}

/// A successful request of a traced run ([`run_traced`]): the trace id its
/// `traceparent` carried, so the gateway's spans of it can be joined with
/// what the client saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TracedRequest {
    /// The W3C trace id (16 bytes).
    pub trace_id: u128,
    /// Its intended (open loop) or actual (closed loop) send time, Unix
    /// nanoseconds.
    pub start_unix_ns: u64,
    /// Its total latency, µs.
    pub total_us: u64,
}

/// What every request of a run shares.
struct Prepared {
    client: reqwest::Client,
    url: reqwest::Url,
    auth: Option<HeaderValue>,
    body: Bytes,
    stream: bool,
    timeout: Duration,
    /// With [`Durability::IdempotencyKey`]: the prefix of every key, unique
    /// to this run.
    key_prefix: Option<String>,
    /// The number of the next key.
    next_key: AtomicU64,
    /// Traced runs: the high 64 bits of every trace id, unique to this run
    /// (the low 64 count requests).
    trace_prefix: Option<u64>,
    /// The number of the next request (traced runs).
    next_trace: AtomicU64,
    /// Traced runs: one request in this many carries a trace id.
    trace_every: u64,
    /// The target's own headers.
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl Prepared {
    /// The request, with its headers and body; `trace_id` goes in a
    /// sampled `traceparent`.
    fn request(&self, trace_id: Option<u128>) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(self.url.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .body(self.body.clone());
        if let Some(auth) = &self.auth {
            req = req.header(AUTHORIZATION, auth.clone());
        }
        for (name, value) in &self.headers {
            req = req.header(name.clone(), value.clone());
        }
        if let Some(prefix) = &self.key_prefix {
            let n = self.next_key.fetch_add(1, Ordering::Relaxed);
            // Visible ASCII only: always a valid header value.
            if let Ok(key) = HeaderValue::from_str(&format!("{prefix}-{n}")) {
                req = req.header(IDEMPOTENCY_KEY, key);
            }
        }
        if let Some(trace_id) = trace_id
            && let Ok(value) = HeaderValue::from_str(&format!("00-{trace_id:032x}-{:016x}-01", 1))
        {
            req = req.header(TRACEPARENT, value);
        }
        req
    }

    /// A fresh trace id for the next request of a traced run, if it is
    /// one of those traced.
    fn next_trace_id(&self) -> Option<u128> {
        let prefix = self.trace_prefix?;
        let n = self.next_trace.fetch_add(1, Ordering::Relaxed);
        n.is_multiple_of(self.trace_every)
            .then(|| (u128::from(prefix) << 64) | u128::from(n))
    }
}

/// The header that makes a request durable and idempotent.
const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The W3C trace-context header.
const TRACEPARENT: &str = "traceparent";

/// The high half of a traced run's trace ids: from the wall clock and the
/// process id, never 0 (an all-zero trace id is invalid).
fn trace_prefix() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos ^ (u64::from(std::process::id()) << 40)) | 1
}

/// A prefix no other run, of this process or another, uses: the process
/// id, the wall clock in nanoseconds and a per-process counter.
fn unique_key_prefix() -> String {
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "bench-{:x}-{nanos:x}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    )
}

/// An HTTP client for load: keep-alive pool without a size bound (each
/// concurrent request gets its own HTTP/1.1 connection), no Nagle delay.
pub fn client() -> Result<reqwest::Client, LoadError> {
    // reqwest is built without a default crypto provider; plain http on
    // loopback needs none, but the builder asks for one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(90))
        .build()?)
}

/// The request body: one short user message.
pub fn chat_body(model: &str, stream: bool) -> Bytes {
    chat_body_kept(model, stream, false)
}

/// The request body, with `"store": true` when `store`.
fn chat_body_kept(model: &str, stream: bool, store: bool) -> Bytes {
    let mut body = serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "hello"}],
    });
    if store {
        body["store"] = serde_json::Value::Bool(true);
    }
    Bytes::from(body.to_string())
}

fn prepare(
    client: &reqwest::Client,
    target: &Target,
    stream: bool,
    timeout: Duration,
    trace_every: Option<u64>,
) -> Result<Arc<Prepared>, LoadError> {
    let url = reqwest::Url::parse(&target.url).map_err(|_| LoadError::InvalidSpec("url"))?;
    let auth = target
        .api_key
        .as_ref()
        .map(|k| HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| LoadError::InvalidKey))
        .transpose()?;
    let headers = target
        .headers
        .iter()
        .map(|(name, value)| {
            Ok((
                HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| LoadError::InvalidSpec("a header name"))?,
                HeaderValue::from_str(value)
                    .map_err(|_| LoadError::InvalidSpec("a header value"))?,
            ))
        })
        .collect::<Result<Vec<_>, LoadError>>()?;
    let store = target.durability == Durability::Store;
    Ok(Arc::new(Prepared {
        headers,
        client: client.clone(),
        url,
        auth,
        body: chat_body_kept(&target.model, stream, store),
        stream,
        timeout,
        key_prefix: (target.durability == Durability::IdempotencyKey).then(unique_key_prefix),
        next_key: AtomicU64::new(0),
        trace_prefix: trace_every.map(|_| trace_prefix()),
        next_trace: AtomicU64::new(0),
        trace_every: trace_every.unwrap_or(1).max(1),
    }))
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn classify(e: &reqwest::Error) -> RequestError {
    if e.is_timeout() {
        RequestError::Timeout
    } else {
        RequestError::Transport
    }
}

async fn send_one(p: &Prepared, start: Instant) -> Outcome {
    let trace_id = p.next_trace_id();
    let result = match tokio::time::timeout(p.timeout, exchange(p, start, trace_id)).await {
        Ok(result) => result,
        Err(_) => Err(RequestError::Timeout),
    };
    Outcome {
        start,
        trace_id,
        result,
    }
}

async fn exchange(
    p: &Prepared,
    start: Instant,
    trace_id: Option<u128>,
) -> Result<Timings, RequestError> {
    let resp = p.request(trace_id).send().await.map_err(|e| classify(&e))?;
    let status = resp.status();
    if !status.is_success() {
        // Read the body so the connection can be reused.
        let _ = resp.bytes().await;
        return Err(RequestError::Status(status.as_u16()));
    }
    let mut t = Timings::default();
    if !p.stream {
        let body = resp.bytes().await.map_err(|e| classify(&e))?;
        if !body.windows(9).any(|w| w == b"\"choices\"") {
            return Err(RequestError::Malformed);
        }
        t.total_us = micros(start.elapsed());
        return Ok(t);
    }
    let mut scanner = SseScanner::new();
    let mut body = resp.bytes_stream();
    let mut last: Option<Instant> = None;
    let (mut done, mut errored) = (false, false);
    while let Some(piece) = body.next().await {
        let piece = piece.map_err(|e| classify(&e))?;
        let now = Instant::now();
        scanner
            .feed(&piece, |event| match event {
                SseEvent::Content | SseEvent::Other => {
                    t.chunks += 1;
                    if event == SseEvent::Content && t.ttft_us.is_none() {
                        t.ttft_us = Some(micros(now - start));
                    }
                    if let Some(prev) = last
                        && t.gaps_us.len() < MAX_GAPS_PER_STREAM
                    {
                        t.gaps_us
                            .push(u32::try_from(micros(now - prev)).unwrap_or(u32::MAX));
                    }
                    last = Some(now);
                }
                SseEvent::Done => done = true,
                SseEvent::Error => errored = true,
            })
            .map_err(|_| RequestError::Malformed)?;
    }
    if errored {
        return Err(RequestError::StreamError);
    }
    if !done {
        return Err(RequestError::Incomplete);
    }
    t.total_us = micros(start.elapsed());
    Ok(t)
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HISTOGRAM_MAX_US, 3).expect("constant histogram bounds are valid")
}

/// Accumulates outcomes that fall in the measured window.
struct Collector {
    from: Instant,
    until: Instant,
    requests: u64,
    ok: u64,
    errors: BTreeMap<RequestError, u64>,
    chunks: u64,
    total: Histogram<u64>,
    ttft: Histogram<u64>,
    gap: Histogram<u64>,
    /// An instant and the wall clock then, Unix nanoseconds: a send time
    /// on the wall clock.
    wall_origin: (Instant, u64),
    /// Successful traced requests.
    traced: Vec<TracedRequest>,
}

impl Collector {
    fn new(from: Instant, until: Instant) -> Self {
        let wall_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self {
            wall_origin: (Instant::now(), wall_now),
            traced: Vec::new(),
            from,
            until,
            requests: 0,
            ok: 0,
            errors: BTreeMap::new(),
            chunks: 0,
            total: histogram(),
            ttft: histogram(),
            gap: histogram(),
        }
    }

    fn add(&mut self, o: Outcome) {
        if o.start < self.from || o.start >= self.until {
            return;
        }
        self.requests += 1;
        match o.result {
            Ok(t) => {
                self.ok += 1;
                if let Some(trace_id) = o.trace_id {
                    let (origin, wall) = self.wall_origin;
                    let start_unix_ns = if o.start >= origin {
                        wall + (o.start - origin).as_nanos() as u64
                    } else {
                        wall.saturating_sub((origin - o.start).as_nanos() as u64)
                    };
                    self.traced.push(TracedRequest {
                        trace_id,
                        start_unix_ns,
                        total_us: t.total_us,
                    });
                }
                self.chunks += t.chunks;
                self.total.saturating_record(t.total_us);
                if let Some(ttft) = t.ttft_us {
                    self.ttft.saturating_record(ttft);
                }
                for g in t.gaps_us {
                    self.gap.saturating_record(u64::from(g));
                }
            }
            Err(e) => *self.errors.entry(e).or_default() += 1,
        }
    }

    fn report(&self, spec: &LoadSpec) -> LoadReport {
        let window_s = (self.until - self.from).as_secs_f64().max(1e-9);
        LoadReport {
            label: spec.label.clone(),
            mode: spec.mode,
            stream: spec.stream,
            window_s,
            requests: self.requests,
            ok: self.ok,
            errors: self.errors.iter().map(|(k, v)| (k.key(), *v)).collect(),
            throughput_rps: self.ok as f64 / window_s,
            chunks: self.chunks,
            chunks_per_s: self.chunks as f64 / window_s,
            total: Percentiles::of(&self.total),
            ttft: Percentiles::of(&self.ttft),
            gap: Percentiles::of(&self.gap),
        }
    }
}

/// Run one load and report what the measured window saw.
pub async fn run(client: &reqwest::Client, spec: &LoadSpec) -> Result<LoadReport, LoadError> {
    Ok(run_with(client, spec, None).await?.0)
}

/// [`run`], and the histogram of total latency (µs) of the measured
/// window's successful requests, so runs of one arm can be pooled
/// ([`Histogram::add`]) before their percentiles are read.
pub async fn run_with_histogram(
    client: &reqwest::Client,
    spec: &LoadSpec,
) -> Result<(LoadReport, Histogram<u64>), LoadError> {
    let (report, _, total) = run_with(client, spec, None).await?;
    Ok((report, total))
}

/// Several open loops at once, their requests alternating one by one:
/// every spec is an open loop at the same rate, for the same duration and
/// warm-up; request `i` goes to spec `i % n`, `n x rate` requests per
/// second in all, each measured from its intended send time. So every
/// arm sees the same moments of the machine (what another job's burst
/// does to one arm it does to the others), which rounds run one after
/// the other cannot give. Each spec's report and its latency histogram.
pub async fn run_alternating(
    client: &reqwest::Client,
    specs: &[LoadSpec],
) -> Result<Vec<(LoadReport, Histogram<u64>)>, LoadError> {
    let first = specs.first().ok_or(LoadError::InvalidSpec("no spec"))?;
    let LoadMode::Open { rate_per_s } = first.mode else {
        return Err(LoadError::InvalidSpec("alternating runs are open loop"));
    };
    if specs
        .iter()
        .any(|s| s.mode != first.mode || s.duration != first.duration || s.warmup != first.warmup)
    {
        return Err(LoadError::InvalidSpec(
            "alternating specs share their rate, duration and warm-up",
        ));
    }
    if first.duration.is_zero() || first.warmup >= first.duration {
        return Err(LoadError::InvalidSpec("duration must be > warmup"));
    }
    if first.max_in_flight == 0 || first.max_in_flight > MAX_IN_FLIGHT_LIMIT {
        return Err(LoadError::InvalidSpec("max_in_flight must be 1..=50000"));
    }
    let total_rate = rate_per_s * specs.len() as f64;
    if !(rate_per_s > 0.0 && total_rate <= MAX_RATE_PER_S) {
        return Err(LoadError::InvalidSpec("rate must be in (0, 1000000]"));
    }
    let prepared = specs
        .iter()
        .map(|s| prepare(client, &s.target, s.stream, s.request_timeout, None))
        .collect::<Result<Vec<_>, _>>()?;
    let start = Instant::now();
    let end = start + first.duration;
    let mut arms = Vec::new();
    let mut collects = Vec::new();
    for (p, s) in prepared.into_iter().zip(specs) {
        let (tx, mut rx) = mpsc::channel::<Outcome>(OUTCOME_QUEUE);
        let mut collector = Collector::new(start + s.warmup, end);
        collects.push(tokio::spawn(async move {
            while let Some(o) = rx.recv().await {
                collector.add(o);
            }
            collector
        }));
        arms.push((p, tx));
    }
    open_loop(arms, start, end, total_rate, first.max_in_flight).await?;
    let mut out = Vec::new();
    for (collect, s) in collects.into_iter().zip(specs) {
        let collector = collect.await?;
        out.push((collector.report(s), collector.total));
    }
    Ok(out)
}

/// An empty latency histogram of the load generator's bounds (1 µs to
/// one hour, 3 significant digits), to pool runs into.
pub fn latency_histogram() -> Histogram<u64> {
    histogram()
}

/// [`run`], one request in `every` (the first, then evenly spread) with a
/// sampled `traceparent` of its own trace id, the others with none: also
/// the successful traced requests of the measured window.
pub async fn run_traced(
    client: &reqwest::Client,
    spec: &LoadSpec,
    every: u64,
) -> Result<(LoadReport, Vec<TracedRequest>), LoadError> {
    let (report, traced, _) = run_with(client, spec, Some(every)).await?;
    Ok((report, traced))
}

async fn run_with(
    client: &reqwest::Client,
    spec: &LoadSpec,
    trace_every: Option<u64>,
) -> Result<(LoadReport, Vec<TracedRequest>, Histogram<u64>), LoadError> {
    if spec.duration.is_zero() || spec.warmup >= spec.duration {
        return Err(LoadError::InvalidSpec("duration must be > warmup"));
    }
    if spec.max_in_flight == 0 || spec.max_in_flight > MAX_IN_FLIGHT_LIMIT {
        return Err(LoadError::InvalidSpec("max_in_flight must be 1..=50000"));
    }
    let prepared = prepare(
        client,
        &spec.target,
        spec.stream,
        spec.request_timeout,
        trace_every,
    )?;
    let start = Instant::now();
    let end = start + spec.duration;
    let (tx, mut rx) = mpsc::channel::<Outcome>(OUTCOME_QUEUE);
    let mut collector = Collector::new(start + spec.warmup, end);
    let collect = tokio::spawn(async move {
        while let Some(o) = rx.recv().await {
            collector.add(o);
        }
        collector
    });
    match spec.mode {
        LoadMode::Open { rate_per_s } => {
            if !(rate_per_s > 0.0 && rate_per_s <= MAX_RATE_PER_S) {
                return Err(LoadError::InvalidSpec("rate must be in (0, 1000000]"));
            }
            open_loop(
                vec![(prepared, tx)],
                start,
                end,
                rate_per_s,
                spec.max_in_flight,
            )
            .await?;
        }
        LoadMode::Closed { concurrency } => {
            if concurrency == 0 || concurrency as usize > MAX_IN_FLIGHT_LIMIT {
                return Err(LoadError::InvalidSpec("concurrency must be 1..=50000"));
            }
            closed_loop(prepared, start, end, concurrency, spec.ramp_per_s, tx).await?;
        }
    }
    let mut collector = collect.await?;
    let report = collector.report(spec);
    let traced = std::mem::take(&mut collector.traced);
    Ok((report, traced, collector.total))
}

/// Offer `rate_per_s` requests per second in all, request `i` to arm
/// `i % arms.len()` (its target, and the collector of its outcomes).
async fn open_loop(
    arms: Vec<(Arc<Prepared>, mpsc::Sender<Outcome>)>,
    start: Instant,
    end: Instant,
    rate_per_s: f64,
    max_in_flight: usize,
) -> Result<(), LoadError> {
    let handle = tokio::runtime::Handle::current();
    let in_flight = Arc::new(AtomicUsize::new(0));
    // A plain thread paces: its sleep is precise to tens of microseconds,
    // the runtime's timer only to a millisecond.
    let pacer = tokio::task::spawn_blocking(move || {
        let interval = Duration::from_secs_f64(1.0 / rate_per_s);
        let mut i: u32 = 0;
        loop {
            let intended = start + interval * i;
            if intended >= end {
                break;
            }
            let now = Instant::now();
            if intended > now {
                std::thread::sleep(intended - now);
            }
            let (prepared, tx) = &arms[i as usize % arms.len()];
            if in_flight.load(Ordering::Relaxed) >= max_in_flight {
                let _ = tx.blocking_send(Outcome {
                    start: intended,
                    trace_id: None,
                    result: Err(RequestError::Backlog),
                });
            } else {
                in_flight.fetch_add(1, Ordering::Relaxed);
                let (p, tx, in_flight) = (prepared.clone(), tx.clone(), in_flight.clone());
                handle.spawn(async move {
                    let outcome = send_one(&p, intended).await;
                    in_flight.fetch_sub(1, Ordering::Relaxed);
                    let _ = tx.send(outcome).await;
                });
            }
            i = i.saturating_add(1);
        }
    });
    pacer.await?;
    Ok(())
}

async fn closed_loop(
    prepared: Arc<Prepared>,
    start: Instant,
    end: Instant,
    concurrency: u32,
    ramp_per_s: Option<f64>,
    tx: mpsc::Sender<Outcome>,
) -> Result<(), LoadError> {
    let mut clients = JoinSet::new();
    for i in 0..concurrency {
        let (p, tx) = (prepared.clone(), tx.clone());
        let begin = match ramp_per_s {
            Some(r) if r > 0.0 => start + Duration::from_secs_f64(f64::from(i) / r),
            _ => start,
        };
        clients.spawn(async move {
            tokio::time::sleep_until(begin.into()).await;
            while Instant::now() < end {
                let outcome = send_one(&p, Instant::now()).await;
                if tx.send(outcome).await.is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    while let Some(r) = clients.join_next().await {
        r?;
    }
    Ok(())
}

/// Streams held open (the memory scenario). Dropping it aborts every
/// stream, which the server sees as client disconnects.
pub struct HeldStreams {
    tasks: JoinSet<()>,
    counts: Arc<HoldCounts>,
}

#[derive(Default)]
struct HoldCounts {
    started: AtomicU64,
    first_chunk: AtomicU64,
    failed: AtomicU64,
    ended: AtomicU64,
}

/// Counters of [`HeldStreams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldSnapshot {
    /// Requests sent.
    pub started: u64,
    /// Streams that delivered their first chunk.
    pub first_chunk: u64,
    /// Streams that failed (status, transport, in-stream error).
    pub failed: u64,
    /// Streams that ended normally.
    pub ended: u64,
}

impl HeldStreams {
    /// The counters now.
    pub fn snapshot(&self) -> HoldSnapshot {
        let c = &self.counts;
        HoldSnapshot {
            started: c.started.load(Ordering::Relaxed),
            first_chunk: c.first_chunk.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            ended: c.ended.load(Ordering::Relaxed),
        }
    }

    /// Abort every stream and wait until their tasks are gone.
    pub async fn close(mut self) {
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Open `count` streaming requests to `target`, `ramp_per_s` per second,
/// and keep reading them until [`HeldStreams`] is dropped or closed.
pub async fn hold_streams(
    client: &reqwest::Client,
    target: &Target,
    count: usize,
    ramp_per_s: f64,
) -> Result<HeldStreams, LoadError> {
    if count == 0 || count > MAX_IN_FLIGHT_LIMIT || ramp_per_s.is_nan() || ramp_per_s <= 0.0 {
        return Err(LoadError::InvalidSpec("count must be 1..=50000, ramp > 0"));
    }
    let prepared = prepare(client, target, true, Duration::from_secs(24 * 3600), None)?;
    let counts = Arc::new(HoldCounts::default());
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    for i in 0..count {
        let due = start + Duration::from_secs_f64(i as f64 / ramp_per_s);
        tokio::time::sleep_until(due.into()).await;
        let (p, counts) = (prepared.clone(), counts.clone());
        counts.started.fetch_add(1, Ordering::Relaxed);
        tasks.spawn(async move {
            match hold_one(&p, &counts).await {
                Ok(()) => counts.ended.fetch_add(1, Ordering::Relaxed),
                Err(_) => counts.failed.fetch_add(1, Ordering::Relaxed),
            };
        });
    }
    Ok(HeldStreams { tasks, counts })
}

async fn hold_one(p: &Prepared, counts: &HoldCounts) -> Result<(), RequestError> {
    let resp = p.request(None).send().await.map_err(|e| classify(&e))?;
    if !resp.status().is_success() {
        return Err(RequestError::Status(resp.status().as_u16()));
    }
    let mut scanner = SseScanner::new();
    let mut body = resp.bytes_stream();
    let (mut first, mut done, mut errored) = (true, false, false);
    while let Some(piece) = body.next().await {
        let piece = piece.map_err(|e| classify(&e))?;
        scanner
            .feed(&piece, |event| match event {
                SseEvent::Content | SseEvent::Other => {
                    if first {
                        first = false;
                        counts.first_chunk.fetch_add(1, Ordering::Relaxed);
                    }
                }
                SseEvent::Done => done = true,
                SseEvent::Error => errored = true,
            })
            .map_err(|_| RequestError::Malformed)?;
    }
    match (errored, done) {
        (true, _) => Err(RequestError::StreamError),
        (false, false) => Err(RequestError::Incomplete),
        (false, true) => Ok(()),
    }
}
