//! The Edge's memory under durable responses (issue 39):
//!
//! * [`retention`]: an Edge taking ephemeral and durable requests at fixed
//!   open-loop rates for minutes, its RSS sampled every second: after the
//!   warm-up, does memory stay flat while the journal retains every
//!   durable response (the default retention is 24 h)? The slope of RSS
//!   over time (least squares) is reported per second and per retained
//!   response, beside the journal's own record count;
//! * [`retrieve`]: one large stored response (a long answer from the mock)
//!   read back many times by concurrent clients (`GET
//!   /v1/responses/{id}`), the Edge's RSS sampled every 50 ms: its peak
//!   against the Edge's configured request memory bound
//!   (`request_memory_bytes`, and the per-key share a retrieve is charged
//!   to, R-LIM-6).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde::{Deserialize, Serialize};

use crate::deployment::{API_KEY, Binaries, Deployment, DeploymentSpec, JournalStore, MockSpec};
use crate::gateway::{Gateway, SHORT_MOCK, ScenarioError, latency_deployment};
use crate::load::{self, Durability, LoadSpec, Target};
use crate::report::{LoadMode, LoadReport, Percentiles, ms};

/// One sample of the Edge over time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MemorySample {
    /// Seconds since the load started.
    pub t_s: f64,
    /// The Edge's RSS.
    pub rss_bytes: u64,
    /// Records the journal holds (`iop_edge_journal_records`), if read.
    pub records: Option<u64>,
    /// Bytes they hold (`iop_edge_journal_bytes`), if read.
    pub journal_bytes: Option<u64>,
    /// The embedded store's file size on disk, if there is one.
    #[serde(default)]
    pub file_bytes: Option<u64>,
}

/// The least-squares slope of `y` over `x` (`None` with fewer than two
/// distinct `x`).
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// Settings of the retention scenario.
#[derive(Debug, Clone)]
pub struct RetentionSettings {
    /// Stores of the journal, one deployment each.
    pub stores: Vec<JournalStore>,
    /// Open-loop rate of ephemeral requests.
    pub ephemeral_rate: f64,
    /// Open-loop rate of durable requests, at the same time.
    pub durable_rate: f64,
    /// The whole run.
    pub duration: Duration,
    /// Its leading part left out of the slope.
    pub warmup: Duration,
    /// How often the Edge's RSS and journal gauges are read.
    pub sample_every: Duration,
    /// How the durable requests ask for it.
    pub durability: Durability,
    /// Also run each store with ephemeral requests only, at the same total
    /// rate (a control: what grows without retained responses).
    pub control: bool,
}

/// One retention run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetentionRun {
    /// The journal's store.
    pub store: JournalStore,
    /// Ephemeral requests per second offered.
    pub ephemeral_rate: f64,
    /// Durable requests per second offered (0: the control run).
    pub durable_rate: f64,
    /// Seconds of load.
    pub duration_s: f64,
    /// Seconds left out of the slope.
    pub warmup_s: f64,
    /// The Edge's RSS before the load (warm, idle).
    pub rss_before: u64,
    /// Samples over the run.
    pub samples: Vec<MemorySample>,
    /// The Edge's RSS after the load and a pause.
    pub rss_after: u64,
    /// The ephemeral load.
    pub ephemeral: LoadReport,
    /// The durable load (none in the control run).
    pub durable: Option<LoadReport>,
}

impl RetentionRun {
    fn after_warmup(&self) -> impl Iterator<Item = &MemorySample> {
        self.samples.iter().filter(|s| s.t_s >= self.warmup_s)
    }

    /// RSS growth after the warm-up, bytes per second.
    pub fn rss_slope(&self) -> Option<f64> {
        let points: Vec<(f64, f64)> = self
            .after_warmup()
            .map(|s| (s.t_s, s.rss_bytes as f64))
            .collect();
        slope(&points)
    }

    /// Records retained per second after the warm-up (the journal's
    /// gauge).
    pub fn records_slope(&self) -> Option<f64> {
        let points: Vec<(f64, f64)> = self
            .after_warmup()
            .filter_map(|s| Some((s.t_s, s.records? as f64)))
            .collect();
        slope(&points)
    }

    /// Journal bytes retained per second after the warm-up.
    pub fn journal_bytes_slope(&self) -> Option<f64> {
        let points: Vec<(f64, f64)> = self
            .after_warmup()
            .filter_map(|s| Some((s.t_s, s.journal_bytes? as f64)))
            .collect();
        slope(&points)
    }

    /// Growth of the embedded store's file after the warm-up, bytes per
    /// second (its pages pass through redb's page cache, 64 MiB).
    pub fn file_slope(&self) -> Option<f64> {
        let points: Vec<(f64, f64)> = self
            .after_warmup()
            .filter_map(|s| Some((s.t_s, s.file_bytes? as f64)))
            .collect();
        slope(&points)
    }

    /// RSS growth per retained response (`None` without retained
    /// responses).
    pub fn bytes_per_retained_response(&self) -> Option<f64> {
        let records = self.records_slope()?;
        (records > 0.5).then(|| self.rss_slope().unwrap_or(0.0) / records)
    }

    /// The first sample at or after the warm-up, and the last.
    pub fn warm_and_last(&self) -> Option<(&MemorySample, &MemorySample)> {
        Some((self.after_warmup().next()?, self.samples.last()?))
    }
}

/// Results of the retention scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetentionResult {
    /// One per store (and control).
    pub runs: Vec<RetentionRun>,
}

/// The deployment of the retention scenario: the latency scenario's
/// shape (the short mock behind one Node) with the journal on `store`.
/// A NATS store's journal is sized for the run: 100 durable responses/s
/// for minutes take tens of MiB, and JetStream reserves each bucket's
/// bound when it makes it.
pub fn retention_deployment(work: &std::path::Path, store: JournalStore) -> DeploymentSpec {
    let mut spec = latency_deployment(work, None);
    spec.dir = work.join(format!("retention-{}", store.as_str()));
    spec.journal = store;
    spec.mocks.retain(|m| m.name == SHORT_MOCK);
    if store.needs_nats() {
        spec.extras.journal.push_str("max_bytes = 268435456\n");
        spec.extras.nats.push_str(&format!(
            "tenant_bucket_max_bytes = {}\n",
            crate::tenants::NATS_TENANT_BUCKET_MAX_BYTES
        ));
    }
    spec
}

/// The retention scenario on each store, each run on a fresh deployment.
pub async fn retention(
    bins: &Binaries,
    work: &std::path::Path,
    settings: &RetentionSettings,
) -> Result<RetentionResult, ScenarioError> {
    let mut runs = Vec::new();
    for &store in &settings.stores {
        let mut rates = vec![(settings.ephemeral_rate, settings.durable_rate)];
        if settings.control {
            rates.push((settings.ephemeral_rate + settings.durable_rate, 0.0));
        }
        for (ephemeral_rate, durable_rate) in rates {
            let mut spec = retention_deployment(work, store);
            if durable_rate == 0.0 {
                spec.dir = work.join(format!("retention-{}-control", store.as_str()));
            }
            let file = (store == JournalStore::Embedded)
                .then(|| spec.dir.join("edge-state").join("journal.redb"));
            let mut d = Deployment::start(bins, &spec).await?;
            let pid = d.edge.pid();
            let edge = EdgeUnderTest {
                pid,
                journal_file: file,
            };
            let run = retention_run(&d, &edge, store, ephemeral_rate, durable_rate, settings).await;
            let alive = d.check_alive();
            d.stop().await;
            alive?;
            runs.push(run?);
        }
    }
    Ok(RetentionResult { runs })
}

/// The Edge a memory scenario watches.
#[derive(Debug, Clone)]
pub struct EdgeUnderTest {
    /// Its process (in a test: the test's own).
    pub pid: u32,
    /// The embedded store's file, if it has one.
    pub journal_file: Option<std::path::PathBuf>,
}

/// Read the Edge's RSS and journal gauges every `every` until `stop`.
fn sample_edge(
    client: reqwest::Client,
    edge: EdgeUnderTest,
    edge_http: SocketAddr,
    every: Duration,
    start: Instant,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<MemorySample>> {
    tokio::spawn(async move {
        let mut samples = Vec::new();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let Ok(rss_bytes) = crate::procfs::rss_bytes(edge.pid) else {
                break;
            };
            let t_s = start.elapsed().as_secs_f64();
            let journal = crate::journal::scrape(&client, edge_http).await.ok();
            let file_bytes = edge
                .journal_file
                .as_ref()
                .and_then(|f| std::fs::metadata(f).ok())
                .map(|m| m.len());
            samples.push(MemorySample {
                t_s,
                rss_bytes,
                records: journal.as_ref().and_then(|j| j.records()),
                journal_bytes: journal.as_ref().and_then(|j| j.bytes()),
                file_bytes,
            });
        }
        samples
    })
}

/// One retention run against `g` (whose Edge is `edge`): ephemeral and
/// durable open loops at once for `settings.duration`, the Edge sampled
/// all along.
pub async fn retention_run(
    g: &dyn Gateway,
    edge: &EdgeUnderTest,
    store: JournalStore,
    ephemeral_rate: f64,
    durable_rate: f64,
    settings: &RetentionSettings,
) -> Result<RetentionRun, ScenarioError> {
    let client = load::client()?;
    eprintln!(
        "retention ({} store): {ephemeral_rate}/s ephemeral + {durable_rate}/s durable for {:?}",
        store.as_str(),
        settings.duration
    );
    let ephemeral = g.via(SHORT_MOCK, false);
    let mut durable = ephemeral.clone();
    durable.durability = settings.durability;
    // Warm the paths, then let the Edge settle.
    for target in [&ephemeral, &durable] {
        let mut spec = LoadSpec::new(
            "warm",
            target.clone(),
            false,
            LoadMode::Closed { concurrency: 2 },
            Duration::from_millis(500),
        );
        spec.warmup = Duration::ZERO;
        load::run(&client, &spec).await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_before =
        crate::procfs::rss_bytes(edge.pid).map_err(crate::deployment::DeployError::from)?;
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let sampler = sample_edge(
        client.clone(),
        edge.clone(),
        g.edge_http(),
        settings.sample_every,
        start,
        stop.clone(),
    );
    let spec = |label: &str, target: &Target, rate: f64| {
        let mut s = LoadSpec::new(
            label,
            target.clone(),
            false,
            LoadMode::Open { rate_per_s: rate },
            settings.duration,
        );
        s.warmup = settings.warmup.min(settings.duration / 2);
        s
    };
    let eph_spec = spec("iop ephemeral", &ephemeral, ephemeral_rate);
    let dur_spec = spec("iop durable", &durable, durable_rate.max(1e-3));
    let (eph, dur) = if durable_rate > 0.0 {
        let (e, d) = tokio::join!(load::run(&client, &eph_spec), load::run(&client, &dur_spec));
        (e?, Some(d?))
    } else {
        (load::run(&client, &eph_spec).await?, None)
    };
    // One more sample after the last request, then stop.
    tokio::time::sleep(settings.sample_every).await;
    stop.store(true, Ordering::Relaxed);
    let samples = sampler
        .await
        .map_err(|e| ScenarioError::Timeout(format!("sampler: {e}")))?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_after =
        crate::procfs::rss_bytes(edge.pid).map_err(crate::deployment::DeployError::from)?;
    let run = RetentionRun {
        store,
        ephemeral_rate,
        durable_rate,
        duration_s: settings.duration.as_secs_f64(),
        warmup_s: settings.warmup.as_secs_f64(),
        rss_before,
        samples,
        rss_after,
        ephemeral: eph,
        durable: dur,
    };
    eprintln!(
        "  RSS {:.1} → {:.1} MiB; slope after warm-up {} KiB/s, {} retained/s, {} B/retained response",
        mib(run.rss_before),
        mib(run.samples.last().map_or(0, |s| s.rss_bytes)),
        run.rss_slope()
            .map_or("-".into(), |b| format!("{:.1}", b / 1024.0)),
        run.records_slope()
            .map_or("-".into(), |r| format!("{r:.1}")),
        run.bytes_per_retained_response()
            .map_or("-".into(), |b| format!("{b:.0}")),
    );
    Ok(run)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn errors_cell(errors: &BTreeMap<String, u64>) -> String {
    if errors.is_empty() {
        "0".into()
    } else {
        errors
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl RetentionResult {
    /// The scenario's table.
    pub fn markdown(&self) -> String {
        let mut out = String::from(
            "## Edge memory while durable responses are retained\n\n\
             Open-loop ephemeral and durable requests at once (non-streaming, 8-token \
             answers); the Edge's RSS read every second, its slope after the warm-up by \
             least squares; retained/s is the slope of the journal's record count \
             (`iop_edge_journal_records`); per retained response = RSS slope / retained/s.\n\n\
             | store | load (eph + dur /s) | s (warm-up) | RSS before MiB | RSS at warm-up end MiB | RSS at end MiB | RSS slope KiB/s | retained/s | journal KiB/s | redb file KiB/s | **RSS B / retained response** | records at end | RSS 3 s after MiB | errors (eph / dur) |\n\
             | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
        );
        for r in &self.runs {
            let pair = r.warm_and_last();
            let warm = pair.map_or("-".into(), |(w, _)| format!("{:.1}", mib(w.rss_bytes)));
            let end = pair.map_or("-".into(), |(_, l)| format!("{:.1}", mib(l.rss_bytes)));
            let records = pair.and_then(|(_, l)| l.records);
            out.push_str(&format!(
                "| {} | {:.0} + {:.0} | {:.0} ({:.0}) | {:.1} | {} | {} | {} | {} | {} | {} | **{}** | {} | {:.1} | {} / {} |\n",
                r.store.as_str(),
                r.ephemeral_rate,
                r.durable_rate,
                r.duration_s,
                r.warmup_s,
                mib(r.rss_before),
                warm,
                end,
                r.rss_slope()
                    .map_or("-".into(), |b| format!("{:.1}", b / 1024.0)),
                r.records_slope().map_or("-".into(), |x| format!("{x:.1}")),
                r.journal_bytes_slope()
                    .map_or("-".into(), |b| format!("{:.1}", b / 1024.0)),
                r.file_slope()
                    .map_or("-".into(), |b| format!("{:.1}", b / 1024.0)),
                r.bytes_per_retained_response()
                    .map_or("-".into(), |b| format!("{b:.0}")),
                records.map_or("-".into(), |n| n.to_string()),
                mib(r.rss_after),
                errors_cell(&r.ephemeral.errors),
                r.durable
                    .as_ref()
                    .map_or("-".into(), |d| errors_cell(&d.errors)),
            ));
        }
        out.push('\n');
        out
    }
}

/// The mock of the retrieve scenario: one long answer, as fast as
/// possible.
pub const LARGE_MOCK: &str = "large";

/// Settings of the retrieve scenario.
#[derive(Debug, Clone)]
pub struct RetrieveSettings {
    /// The journal's store.
    pub store: JournalStore,
    /// Tokens of the stored answer (about 9 bytes of text each; the mock
    /// makes at most 100,000).
    pub tokens: u32,
    /// Bytes of the stored request's `input` text (a retrieve reads and
    /// parses the stored request, charged to the caller's share).
    pub input_bytes: usize,
    /// Retrieves in all.
    pub retrieves: u64,
    /// Concurrent clients.
    pub concurrency: u32,
    /// The Edge's `request_memory_bytes` (`None`: its default, 1 GiB); a
    /// smaller one also lowers `max_body_bytes` so the config is valid.
    pub request_memory_bytes: Option<u64>,
}

/// The Edge's default `request_memory_bytes`.
pub const DEFAULT_REQUEST_MEMORY_BYTES: u64 = 1024 * 1024 * 1024;

/// Results of the retrieve scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetrieveResult {
    /// The journal's store.
    pub store: JournalStore,
    /// Tokens of the stored answer.
    pub tokens: u32,
    /// Bytes of the stored request's `input` text.
    #[serde(default)]
    pub input_bytes: usize,
    /// Its response id's answer to the create, ms.
    pub create_ms: u64,
    /// Bytes of one retrieve's body (the `response` object).
    pub object_bytes: u64,
    /// Bytes the journal holds after the create.
    pub journal_bytes: Option<u64>,
    /// Retrieves sent.
    pub retrieves: u64,
    /// Concurrent clients.
    pub concurrency: u32,
    /// Answered 200 with a whole body.
    pub ok: u64,
    /// The others, by kind (`http_503`, `transport`, ...).
    pub errors: BTreeMap<String, u64>,
    /// Wall time of the retrieves, s.
    pub elapsed_s: f64,
    /// Latency of the successful retrieves.
    pub latency: Option<Percentiles>,
    /// The Edge's RSS after the create, idle.
    pub rss_idle: u64,
    /// The largest RSS sampled (every 50 ms) during the retrieves.
    pub rss_peak: u64,
    /// The Edge's `VmHWM` (peak RSS since start) after the retrieves.
    pub rss_hwm: u64,
    /// The Edge's RSS 3 s after the last retrieve.
    pub rss_after: u64,
    /// The Edge's `request_memory_bytes`.
    pub request_memory_bytes: u64,
    /// The per-key share of it a retrieve is charged to (a quarter).
    pub request_memory_per_key: u64,
}

impl RetrieveResult {
    /// Peak RSS over idle RSS.
    pub fn growth(&self) -> u64 {
        self.rss_peak
            .max(self.rss_hwm)
            .saturating_sub(self.rss_idle)
    }

    /// The scenario's table.
    pub fn markdown(&self) -> String {
        let peak = self.rss_peak.max(self.rss_hwm);
        let lat =
            |f: fn(&Percentiles) -> u64| self.latency.as_ref().map_or("-".into(), |p| ms(f(p)));
        format!(
            "## Edge memory under retrieves of one large stored response\n\n\
             One Responses API request with {:.2} MiB of input text and an answer of {} \
             tokens stored (`\"store\": true`), then `GET /v1/responses/{{id}}` {} times \
             by {} concurrent clients; the Edge's RSS read every 50 ms.\n\n\
             | measure | value |\n| --- | ---: |\n\
             | store | {} |\n\
             | response object per retrieve | {:.2} MiB |\n\
             | journal bytes held | {} |\n\
             | retrieves ok / sent | {} / {} |\n\
             | errors | {} |\n\
             | retrieves/s | {:.1} |\n\
             | retrieve latency p50 / p99 / max | {} / {} / {} ms |\n\
             | Edge RSS idle (after the create) | {:.1} MiB |\n\
             | Edge RSS peak (sampled; VmHWM) | {:.1} MiB ({:.1}; {:.1}) |\n\
             | **peak − idle** | **{:.1} MiB** |\n\
             | Edge RSS 3 s after | {:.1} MiB |\n\
             | request memory bound (`request_memory_bytes`) | {:.0} MiB |\n\
             | its per-key share (a retrieve is charged to it) | {:.0} MiB |\n\
             | **peak RSS within the bound** | **{}** |\n\n",
            mib(self.input_bytes as u64),
            self.tokens,
            self.retrieves,
            self.concurrency,
            self.store.as_str(),
            mib(self.object_bytes),
            self.journal_bytes
                .map_or("-".into(), |b| format!("{:.2} MiB", mib(b))),
            self.ok,
            self.retrieves,
            errors_cell(&self.errors),
            self.ok as f64 / self.elapsed_s.max(1e-9),
            lat(|p| p.p50_us),
            lat(|p| p.p99_us),
            lat(|p| p.max_us),
            mib(self.rss_idle),
            mib(peak),
            mib(self.rss_peak),
            mib(self.rss_hwm),
            mib(self.growth()),
            mib(self.rss_after),
            mib(self.request_memory_bytes),
            mib(self.request_memory_per_key),
            if peak <= self.request_memory_bytes {
                "yes"
            } else {
                "no"
            },
        )
    }
}

/// The deployment of the retrieve scenario: one mock whose every answer
/// is `tokens` long, behind one Node.
pub fn retrieve_deployment(work: &std::path::Path, settings: &RetrieveSettings) -> DeploymentSpec {
    let mut spec = latency_deployment(work, None);
    spec.dir = work.join(format!("retrieve-{}", settings.store.as_str()));
    spec.journal = settings.store;
    spec.mocks = vec![MockSpec {
        name: LARGE_MOCK.into(),
        tokens: settings.tokens,
        tps: 0.0,
        prefill_ms: 0,
        external: None,
        nagle: false,
    }];
    spec.capacity = 256;
    spec.max_concurrent_runs = 256;
    spec.extras.edge = edge_memory_lines(settings.request_memory_bytes);
    if settings.store.needs_nats() {
        spec.extras.journal.push_str("max_bytes = 67108864\n");
        spec.extras.nats.push_str(&format!(
            "tenant_bucket_max_bytes = {}\n",
            crate::tenants::NATS_TENANT_BUCKET_MAX_BYTES
        ));
    }
    spec
}

/// `[edge]` lines setting `request_memory_bytes` (and a `max_body_bytes`
/// small enough for it: one largest body, decoded, must fit a key's
/// quarter).
pub fn edge_memory_lines(request_memory_bytes: Option<u64>) -> String {
    match request_memory_bytes {
        None => String::new(),
        Some(total) => {
            let body = (total / 64).min(8 * 1024 * 1024);
            format!("request_memory_bytes = {total}\nmax_body_bytes = {body}\n")
        }
    }
}

/// The retrieve scenario on a fresh deployment.
pub async fn retrieve(
    bins: &Binaries,
    work: &std::path::Path,
    settings: &RetrieveSettings,
) -> Result<RetrieveResult, ScenarioError> {
    let mut d = Deployment::start(bins, &retrieve_deployment(work, settings)).await?;
    let pid = d.edge.pid();
    let result = retrieve_run(&d, pid, LARGE_MOCK, settings).await;
    let alive = d.check_alive();
    d.stop().await;
    alive?;
    result
}

/// How long the large answer may take to be made and stored.
const CREATE_BOUND: Duration = Duration::from_secs(300);
/// Bound of one retrieve.
const RETRIEVE_BOUND: Duration = Duration::from_secs(120);

/// The retrieve scenario against `g` (whose Edge is process `edge_pid`):
/// store one answer of model `model` (its mock makes it long), then read
/// it back `settings.retrieves` times.
pub async fn retrieve_run(
    g: &dyn Gateway,
    edge_pid: u32,
    model: &str,
    settings: &RetrieveSettings,
) -> Result<RetrieveResult, ScenarioError> {
    let client = load::client()?;
    let base = format!("http://{}", g.edge_http());
    eprintln!(
        "retrieve ({} store): storing one request of {} input bytes and its answer of {} tokens",
        settings.store.as_str(),
        settings.input_bytes,
        settings.tokens
    );
    let started = Instant::now();
    // The input: `hello ` again and again, `input_bytes` long.
    let input: String = "hello "
        .chars()
        .cycle()
        .take(settings.input_bytes.max(5))
        .collect();
    let body = serde_json::json!({"model": model, "input": input, "store": true});
    drop(input);
    let created = client
        .post(format!("{base}/v1/responses"))
        .bearer_auth(API_KEY)
        .header("content-type", "application/json")
        .body(body.to_string())
        .timeout(CREATE_BOUND)
        .send()
        .await
        .map_err(|e| ScenarioError::Timeout(format!("storing the large response: {e}")))?;
    let status = created.status();
    let answer = created
        .bytes()
        .await
        .map_err(|e| ScenarioError::Timeout(format!("the stored response's answer: {e}")))?;
    let doc: serde_json::Value = serde_json::from_slice(&answer).unwrap_or_default();
    let create_ms = started.elapsed().as_millis() as u64;
    let id = doc["id"]
        .as_str()
        .filter(|_| status.is_success() && doc["status"] == "completed")
        .ok_or_else(|| {
            ScenarioError::Timeout(format!(
                "storing the large response answered {status}: {}",
                doc.to_string().chars().take(300).collect::<String>()
            ))
        })?
        .to_owned();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let journal_bytes = crate::journal::scrape(&client, g.edge_http())
        .await
        .ok()
        .and_then(|j| j.bytes());
    let rss_idle =
        crate::procfs::rss_bytes(edge_pid).map_err(crate::deployment::DeployError::from)?;
    eprintln!(
        "  stored in {create_ms} ms; {} retrieves by {} clients",
        settings.retrieves, settings.concurrency
    );

    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(rss_idle));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                if let Ok(rss) = crate::procfs::rss_bytes(edge_pid) {
                    peak.fetch_max(rss, Ordering::Relaxed);
                }
            }
        })
    };
    let url = Arc::new(format!("{base}/v1/responses/{id}"));
    let next = Arc::new(AtomicU64::new(0));
    let object_bytes = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..settings.concurrency.max(1) {
        let (client, url, next, object_bytes) = (
            client.clone(),
            url.clone(),
            next.clone(),
            object_bytes.clone(),
        );
        let total = settings.retrieves;
        clients.spawn(async move {
            let mut hist = load::latency_histogram();
            let mut errors: BTreeMap<String, u64> = BTreeMap::new();
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let t0 = Instant::now();
                match tokio::time::timeout(RETRIEVE_BOUND, read_all(&client, &url)).await {
                    Ok(Ok(n)) => {
                        object_bytes.store(n, Ordering::Relaxed);
                        hist.saturating_record(t0.elapsed().as_micros() as u64);
                    }
                    Ok(Err(kind)) => *errors.entry(kind).or_default() += 1,
                    Err(_) => *errors.entry("timeout".into()).or_default() += 1,
                }
            }
            (hist, errors)
        });
    }
    let mut hist = load::latency_histogram();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut done = 0u64;
    let mut last_note = Instant::now();
    while let Some(joined) = clients.join_next().await {
        let (h, e) = joined.map_err(|e| ScenarioError::Timeout(format!("a client: {e}")))?;
        hist.add(&h)
            .map_err(|e| ScenarioError::Timeout(format!("pooling histograms: {e}")))?;
        for (k, v) in e {
            *errors.entry(k).or_default() += v;
        }
        done += 1;
        if last_note.elapsed() > Duration::from_secs(10) {
            eprintln!("  {done} clients done");
            last_note = Instant::now();
        }
    }
    let elapsed_s = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;
    let rss_hwm =
        crate::procfs::peak_rss_bytes(edge_pid).map_err(crate::deployment::DeployError::from)?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_after =
        crate::procfs::rss_bytes(edge_pid).map_err(crate::deployment::DeployError::from)?;
    let total = settings
        .request_memory_bytes
        .unwrap_or(DEFAULT_REQUEST_MEMORY_BYTES);
    let result = RetrieveResult {
        store: settings.store,
        tokens: settings.tokens,
        input_bytes: settings.input_bytes,
        create_ms,
        object_bytes: object_bytes.load(Ordering::Relaxed),
        journal_bytes,
        retrieves: settings.retrieves,
        concurrency: settings.concurrency,
        ok: hist.len(),
        errors,
        elapsed_s,
        latency: Percentiles::of(&hist),
        rss_idle,
        rss_peak: peak.load(Ordering::Relaxed),
        rss_hwm,
        rss_after,
        request_memory_bytes: total,
        request_memory_per_key: total / 4,
    };
    eprintln!(
        "  ok {} errors {:?} in {:.1} s; RSS idle {:.1} peak {:.1} (VmHWM {:.1}) MiB",
        result.ok,
        result.errors,
        elapsed_s,
        mib(rss_idle),
        mib(result.rss_peak),
        mib(rss_hwm)
    );
    Ok(result)
}

/// GET `url` and read its whole body, counting bytes (the body is not
/// kept); the error kind on failure.
async fn read_all(client: &reqwest::Client, url: &str) -> Result<u64, String> {
    let r = client
        .get(url)
        .bearer_auth(API_KEY)
        .send()
        .await
        .map_err(|_| "transport".to_owned())?;
    let status = r.status();
    let mut body = r.bytes_stream();
    let mut n = 0u64;
    while let Some(piece) = body.next().await {
        n += piece.map_err(|_| "transport".to_owned())?.len() as u64;
    }
    if !status.is_success() {
        return Err(format!("http_{}", status.as_u16()));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_is_least_squares() {
        assert_eq!(slope(&[(0.0, 1.0)]), None);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 2.0)]), None);
        let s = slope(&[(0.0, 0.0), (1.0, 2.0), (2.0, 4.0), (3.0, 6.0)]).unwrap();
        assert!((s - 2.0).abs() < 1e-12);
        let flat = slope(&[(0.0, 5.0), (1.0, 4.0), (2.0, 6.0), (3.0, 5.0)]).unwrap();
        assert!(flat.abs() < 0.5, "{flat}");
    }

    #[test]
    fn a_smaller_memory_bound_lowers_the_body_limit_with_it() {
        assert_eq!(edge_memory_lines(None), "");
        let lines = edge_memory_lines(Some(64 << 20));
        assert_eq!(
            lines,
            "request_memory_bytes = 67108864\nmax_body_bytes = 1048576\n"
        );
    }
}
