//! The measured scenarios. Each compares iop against a baseline measured
//! in the same run, on the same machine, against the same mock process:
//!
//! * [`latency`]: added latency, direct to the mock vs through Edge+Node in
//!   tunnel and in normalized mode, at the same open-loop rates up to
//!   saturation, plus closed-loop saturation throughput;
//! * the nagle scenario: the same measurement ([`latency_to`]) against a
//!   mock that leaves Nagle's algorithm on ([`NAGLE_MOCK`]), as many real
//!   provider servers do;
//! * [`streaming`]: relayed SSE chunks per second;
//! * [`memory`]: RSS of the Edge and the Nodes with N streams in flight;
//! * [`nodes`]: many Nodes on one Edge, memory per connection and idle CPU;
//! * [`durable`]: durable vs ephemeral responses, streamed (chunks/s) and
//!   not (added latency), on each journal store, with the journal's own
//!   metrics.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::BufReader;

use crate::deployment::{
    Binaries, DeployError, Deployment, DeploymentSpec, EdgeExtras, JournalStore, MockSpec, Proc,
    edge_config_head, free_tcp_port, free_udp_port, node_config, read_line_until, wait_http_ok,
    wait_providers_ready, write_pki,
};
pub use crate::gateway::{Gateway, LONG_MOCK, SHORT_MOCK, ScenarioError, latency_deployment};
use crate::journal::{self, OpStats};
use crate::load::{self, Durability, LoadSpec, Target};
use crate::procfs::TICKS_PER_SECOND;
use crate::report::{
    Comparison, LoadMode, LoadReport, added_latency_table, added_us, load_table, ms_signed,
};

impl Gateway for Deployment {
    fn direct(&self, mock: &str) -> Option<Target> {
        Deployment::direct(self, mock)
    }

    fn via(&self, mock: &str, tunnel: bool) -> Target {
        Deployment::via(self, mock, tunnel)
    }

    fn edge_http(&self) -> SocketAddr {
        self.edge_http
    }

    fn cpu_ticks(&self) -> Option<Result<(u64, u64), DeployError>> {
        Some(iop_cpu_ticks(self))
    }

    fn store_cpu_ticks(&self) -> Option<Result<u64, DeployError>> {
        self.nats.as_ref().map(|n| n.proc.cpu_ticks())
    }

    fn context_switches(&self) -> Option<Result<u64, DeployError>> {
        let count = || -> Result<u64, DeployError> {
            let mut total = crate::procfs::context_switches(self.edge.pid())?;
            for node in &self.nodes {
                total += crate::procfs::context_switches(node.pid())?;
            }
            Ok(total)
        };
        Some(count())
    }
}

/// The machine a suite ran on.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// `nproc`.
    pub cpus: usize,
    /// `model name` of `/proc/cpuinfo`.
    pub cpu_model: String,
    /// `cpu MHz` of `/proc/cpuinfo`.
    pub cpu_mhz: String,
    /// `MemTotal` of `/proc/meminfo`.
    pub mem_total: String,
    /// Kernel release.
    pub kernel: String,
    /// Build profile of this binary.
    pub profile: String,
}

impl Machine {
    /// Read it from `/proc`.
    pub fn current() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |text: &str, name: &str| {
            text.lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    (k.trim() == name).then(|| v.trim().to_owned())
                })
                .unwrap_or_else(|| "unknown".into())
        };
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        Self {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model: field(&cpuinfo, "model name"),
            cpu_mhz: field(&cpuinfo, "cpu MHz"),
            mem_total: field(&meminfo, "MemTotal"),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|_| "unknown".into()),
            profile: if cfg!(debug_assertions) {
                "debug".into()
            } else {
                "release".into()
            },
        }
    }

    /// A markdown bullet list.
    pub fn markdown(&self) -> String {
        format!(
            "- CPUs (nproc): {}\n- CPU: {} ({} MHz)\n- memory: {}\n- kernel: {}\n- build: {}\n",
            self.cpus, self.cpu_model, self.cpu_mhz, self.mem_total, self.kernel, self.profile
        )
    }
}

/// The mock of the nagle scenario: a process that leaves Nagle's
/// algorithm on for its accepted connections (no `TCP_NODELAY`), as many
/// real provider servers do (axum's `serve` by default, cpp-httplib and so
/// llama.cpp's server), playing the latency scenario's script (8 tokens, as
/// fast as possible) after [`NAGLE_PREFILL_MS`].
pub const NAGLE_MOCK: &str = "short-nagle";
/// The nagle mock's delay before its first token, ms. A streamed answer
/// (normalized runs ask the provider for one) then goes out as a real
/// server's does, in more than one write: the headers, then the tokens. With
/// no delay the mock's whole answer is one write, which Nagle never holds.
pub const NAGLE_PREFILL_MS: u64 = 1;
/// The mock script of the memory scenario: one token a second for ten
/// minutes, so streams stay in flight.
pub const SLOW_MOCK: &str = "slow";

/// The gateway paths every comparison measures.
fn paths(d: &dyn Gateway, mock: &str) -> Vec<(String, Target)> {
    vec![
        (
            "direct".into(),
            d.direct(mock).unwrap_or_else(|| d.via(mock, false)),
        ),
        ("iop tunnel".into(), d.via(mock, true)),
        ("iop normalized".into(), d.via(mock, false)),
    ]
}

/// The mock of the nagle scenario, to add to [`latency_deployment`].
pub fn nagle_mock() -> MockSpec {
    MockSpec {
        name: NAGLE_MOCK.into(),
        tokens: 8,
        tps: 0.0,
        prefill_ms: NAGLE_PREFILL_MS,
        external: None,
        nagle: true,
    }
}

/// Settings of the latency scenario (and of the nagle scenario).
#[derive(Debug, Clone)]
pub struct LatencySettings {
    /// Open-loop rates, requests per second.
    pub rates: Vec<f64>,
    /// Closed-loop concurrencies for saturation.
    pub concurrencies: Vec<u32>,
    /// Length of each run, warm-up included.
    pub duration: Duration,
    /// Extra paths served by another process (a peer gateway): its CPU
    /// time, not iop's, is what a request on that path costs.
    pub peer_pids: Vec<(String, u32)>,
}

/// How long after a run its last journal operations take to be counted.
const METRICS_SETTLE: Duration = Duration::from_millis(200);

/// What to read around each run through iop (every path but the first,
/// the direct one).
#[derive(Debug, Default)]
struct Probes {
    /// The Edge's and the Nodes' CPU time per chunk (streams only).
    cpu: Option<Vec<ChunkCpu>>,
    /// The Edge's journal metrics.
    journal: Option<Vec<JournalRun>>,
    /// CPU time per answered request of each run (iop's Edge and Nodes,
    /// or the peer process of a peer path).
    request_cpu: Option<Vec<RequestCpu>>,
    /// Paths served by another process, and its pid.
    peer_pids: Vec<(String, u32)>,
}

impl Probes {
    fn cpu() -> Self {
        Probes {
            cpu: Some(Vec::new()),
            ..Probes::default()
        }
    }

    fn cpu_and_journal() -> Self {
        Probes {
            cpu: Some(Vec::new()),
            journal: Some(Vec::new()),
            ..Probes::default()
        }
    }

    fn request_cpu(peer_pids: &[(String, u32)]) -> Self {
        Probes {
            request_cpu: Some(Vec::new()),
            peer_pids: peer_pids.to_vec(),
            ..Probes::default()
        }
    }

    /// Context switches so far of whatever serves path `label` (`None`:
    /// not measured).
    fn switches_of(
        &self,
        gateway: &dyn Gateway,
        label: &str,
    ) -> Result<Option<u64>, ScenarioError> {
        if self.request_cpu.is_none() {
            return Ok(None);
        }
        if let Some((_, pid)) = self.peer_pids.iter().find(|(l, _)| l == label) {
            return Ok(crate::procfs::context_switches(*pid).ok());
        }
        Ok(gateway.context_switches().transpose()?)
    }

    /// CPU ticks so far of whatever serves path `label` (`None`: not
    /// measured).
    fn ticks_of(&self, gateway: &dyn Gateway, label: &str) -> Result<Option<u64>, ScenarioError> {
        if self.request_cpu.is_none() {
            return Ok(None);
        }
        if let Some((_, pid)) = self.peer_pids.iter().find(|(l, _)| l == label) {
            return Ok(crate::procfs::cpu_ticks(*pid).ok());
        }
        Ok(gateway
            .cpu_ticks()
            .transpose()?
            .map(|(edge, nodes)| edge + nodes))
    }
}

/// Run `spec` against each path in turn (the order rotates per row so no
/// path always goes first), reading `probes` around each run through iop.
#[allow(clippy::too_many_arguments)]
async fn compare(
    client: &reqwest::Client,
    gateway: &dyn Gateway,
    paths: &[(String, Target)],
    stream: bool,
    mode: LoadMode,
    duration: Duration,
    row: usize,
    probes: &mut Probes,
) -> Result<Comparison, ScenarioError> {
    let mut reports: Vec<Option<LoadReport>> = vec![None; paths.len()];
    for k in 0..paths.len() {
        let i = (k + row) % paths.len();
        let (label, target) = &paths[i];
        let spec = LoadSpec::new(label, target.clone(), stream, mode, duration);
        let via = i > 0;
        let ticks_before = match (&probes.cpu, via) {
            (Some(_), true) => gateway.cpu_ticks().transpose()?,
            _ => None,
        };
        let store_ticks_before = match (&probes.cpu, via) {
            (Some(_), true) => gateway.store_cpu_ticks().transpose()?,
            _ => None,
        };
        let journal_before = match (&probes.journal, via) {
            (Some(_), true) => Some(journal::scrape(client, gateway.edge_http()).await?),
            _ => None,
        };
        let (request_ticks_before, switches_before) = if via {
            (
                probes.ticks_of(gateway, label)?,
                probes.switches_of(gateway, label)?,
            )
        } else {
            (None, None)
        };
        let started = Instant::now();
        let r = load::run(client, &spec).await?;
        let elapsed_s = started.elapsed().as_secs_f64();
        if let Some(before) = request_ticks_before
            && let Some(after) = probes.ticks_of(gateway, label)?
        {
            let switches_after = match switches_before {
                Some(_) => probes.switches_of(gateway, label)?,
                None => None,
            };
            let answered = r.ok.max(1) as f64;
            if let Some(rows) = probes.request_cpu.as_mut() {
                rows.push(RequestCpu {
                    load: mode.label(),
                    target: label.clone(),
                    us_per_request: after.saturating_sub(before) as f64 * 1e6
                        / TICKS_PER_SECOND as f64
                        / answered,
                    switches_per_request: switches_before
                        .zip(switches_after)
                        .map(|(before, after)| after.saturating_sub(before) as f64 / answered),
                });
            }
        }
        if let (Some(before), Some(runs)) = (journal_before, probes.journal.as_mut()) {
            // Every request of the run has ended when `load::run` returns,
            // and each one's last operation was durable before its answer;
            // the Edge counts an operation just after its answer, hence the
            // pause.
            tokio::time::sleep(METRICS_SETTLE).await;
            let after = journal::scrape(client, gateway.edge_http()).await?;
            runs.push(JournalRun {
                load: mode.label(),
                target: label.clone(),
                durability: target.durability,
                stream,
                chunks_per_ok: if r.ok > 0 {
                    r.chunks as f64 / r.ok as f64
                } else {
                    0.0
                },
                ops: after.since(&before),
            });
        }
        if let (Some(rows), Some((edge0, nodes0))) = (probes.cpu.as_mut(), ticks_before)
            && let Some(ticks) = gateway.cpu_ticks()
        {
            let (edge1, nodes1) = ticks?;
            let store1 = gateway.store_cpu_ticks().transpose()?;
            // The chunk rate of the measured window, over the whole run
            // (its warm-up included, as the CPU time is).
            let chunks = (r.chunks_per_s * elapsed_s).max(1.0);
            let us_per_chunk = |ticks: u64| ticks as f64 * 1e6 / TICKS_PER_SECOND as f64 / chunks;
            rows.push(ChunkCpu {
                load: mode.label(),
                target: label.clone(),
                edge_us_per_chunk: us_per_chunk(edge1.saturating_sub(edge0)),
                nodes_us_per_chunk: us_per_chunk(nodes1.saturating_sub(nodes0)),
                store_us_per_chunk: store_ticks_before
                    .zip(store1)
                    .map(|(before, after)| us_per_chunk(after.saturating_sub(before))),
            });
        }
        eprintln!(
            "  {:<16} {:<14} ok {:>7} err {:>5} rps {:>8.0} p50 {} p99 {} ms chunks/s {:.0}",
            label,
            mode.label(),
            r.ok,
            r.error_count(),
            r.throughput_rps,
            r.total.map_or("-".into(), |p| crate::report::ms(p.p50_us)),
            r.total.map_or("-".into(), |p| crate::report::ms(p.p99_us)),
            r.chunks_per_s,
        );
        reports[i] = Some(r);
        // Let sockets in TIME_WAIT and queued work drain between runs.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut reports = reports.into_iter().flatten();
    let direct = reports
        .next()
        .ok_or_else(|| ScenarioError::Timeout("no baseline run".into()))?;
    Ok(Comparison {
        direct,
        via: reports.collect(),
    })
}

/// Results of the latency scenario.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatencyResult {
    /// Open-loop rows, one per rate.
    pub open: Vec<Comparison>,
    /// Closed-loop rows (saturation), one per concurrency.
    pub closed: Vec<Comparison>,
    /// CPU per request of each closed-loop run through iop or a peer.
    #[serde(default)]
    pub cpu: Vec<RequestCpu>,
}

/// The CPU time spent per answered request over one run: iop's Edge and
/// Nodes together, or a peer gateway's process (its threads; not child
/// processes). Read from `/proc` in 10 ms ticks over the whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestCpu {
    /// The load (`closed x16`).
    pub load: String,
    /// The path (`iop tunnel`, `iop normalized`, a peer).
    pub target: String,
    /// CPU time per answered request, µs.
    pub us_per_request: f64,
    /// Context switches per answered request, every thread of the same
    /// processes (voluntary and involuntary; `None`: not read). At one
    /// request at a time each is a wake-up on the request's path
    /// (docs/benchmarks.md, "Where one request's time goes, measured").
    #[serde(default)]
    pub switches_per_request: Option<f64>,
}

/// Added latency (non-streaming): direct vs tunnel vs normalized at each
/// rate, then closed-loop saturation, against [`SHORT_MOCK`]. `extra`
/// paths (a peer gateway) are measured alongside.
pub async fn latency(
    d: &dyn Gateway,
    settings: &LatencySettings,
    extra: &[(String, Target)],
) -> Result<LatencyResult, ScenarioError> {
    latency_to(d, SHORT_MOCK, settings, extra).await
}

/// [`latency`] against mock `mock` (the nagle scenario: [`NAGLE_MOCK`]).
pub async fn latency_to(
    d: &dyn Gateway,
    mock: &str,
    settings: &LatencySettings,
    extra: &[(String, Target)],
) -> Result<LatencyResult, ScenarioError> {
    let client = load::client()?;
    let mut ps = paths(d, mock);
    ps.extend(extra.iter().cloned());
    let mut open = Vec::new();
    for (row, rate) in settings.rates.iter().enumerate() {
        eprintln!("latency ({mock}): open loop {rate}/s");
        let mode = LoadMode::Open { rate_per_s: *rate };
        let none = &mut Probes::default();
        open.push(compare(&client, d, &ps, false, mode, settings.duration, row, none).await?);
    }
    let mut closed = Vec::new();
    // CPU per request where the CPUs are busy: the closed-loop runs.
    let mut cpu = Probes::request_cpu(&settings.peer_pids);
    for (row, c) in settings.concurrencies.iter().enumerate() {
        eprintln!("latency ({mock}): closed loop x{c}");
        let mode = LoadMode::Closed { concurrency: *c };
        closed.push(
            compare(
                &client,
                d,
                &ps,
                false,
                mode,
                settings.duration,
                row,
                &mut cpu,
            )
            .await?,
        );
    }
    Ok(LatencyResult {
        open,
        closed,
        cpu: cpu.request_cpu.unwrap_or_default(),
    })
}

impl LatencyResult {
    /// The open-loop and saturation tables, `what` added to their titles.
    pub fn markdown(&self, what: &str) -> String {
        let mut out = format!(
            "## Added latency{what} (non-streaming, 8-token answers; ms)\n\n{}\n\
             ### Saturation (closed loop){what}\n\n{}\n",
            added_latency_table(&self.open),
            added_latency_table(&self.closed),
        );
        if !self.cpu.is_empty() {
            out.push_str(&format!(
                "### CPU per request{what} (closed loop; µs; from /proc, whole run)\n\n\
                 | load | target | µs/request (iop: Edge + Nodes; a peer: its process) | context switches/request |\n\
                 | --- | --- | ---: | ---: |\n"
            ));
            for c in &self.cpu {
                let switches = c
                    .switches_per_request
                    .map_or_else(|| "-".to_string(), |s| format!("{s:.2}"));
                out.push_str(&format!(
                    "| {} | {} | {:.1} | {switches} |\n",
                    c.load, c.target, c.us_per_request
                ));
            }
            out.push('\n');
        }
        out
    }
}

/// Results of the streaming scenario.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StreamingResult {
    /// Long streams (1,000 chunks each), closed loop, per concurrency.
    pub throughput: Vec<Comparison>,
    /// Short streams (8 chunks) at a fixed rate: TTFT and gaps.
    pub ttft: Vec<Comparison>,
    /// CPU per relayed chunk of each long-stream run through iop.
    #[serde(default)]
    pub cpu: Vec<ChunkCpu>,
}

/// The CPU time the Edge and the Nodes spent per chunk the client
/// received, over one streaming run through iop. Read from `/proc` in
/// 10 ms ticks over the whole run, so it does not depend on how much CPU
/// other processes left them, unlike chunks per second.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChunkCpu {
    /// The load (`closed x64`).
    pub load: String,
    /// The path (`iop tunnel`, `iop normalized`).
    pub target: String,
    /// Edge CPU time per chunk, µs.
    pub edge_us_per_chunk: f64,
    /// CPU time of all node processes per chunk, µs.
    pub nodes_us_per_chunk: f64,
    /// CPU time of the journal store's server (`nats-server`) per chunk,
    /// µs, when the store has one.
    #[serde(default)]
    pub store_us_per_chunk: Option<f64>,
}

/// CPU ticks so far of the Edge and of all node processes.
fn iop_cpu_ticks(d: &Deployment) -> Result<(u64, u64), DeployError> {
    let mut nodes = 0;
    for node in &d.nodes {
        nodes += node.cpu_ticks()?;
    }
    Ok((d.edge.cpu_ticks()?, nodes))
}

/// Relayed SSE chunks per second (long streams, closed loop) and TTFT of
/// short streams at a fixed rate.
pub async fn streaming(
    d: &dyn Gateway,
    concurrencies: &[u32],
    ttft_rate: f64,
    duration: Duration,
) -> Result<StreamingResult, ScenarioError> {
    let client = load::client()?;
    let mut throughput = Vec::new();
    let mut probes = Probes::cpu();
    for (row, c) in concurrencies.iter().enumerate() {
        eprintln!("streaming: closed loop x{c}, 1000-token streams");
        let mode = LoadMode::Closed { concurrency: *c };
        let paths = paths(d, LONG_MOCK);
        throughput.push(compare(&client, d, &paths, true, mode, duration, row, &mut probes).await?);
    }
    eprintln!("streaming: open loop {ttft_rate}/s, 8-token streams");
    let mode = LoadMode::Open {
        rate_per_s: ttft_rate,
    };
    let paths = paths(d, SHORT_MOCK);
    let none = &mut Probes::default();
    let ttft = vec![compare(&client, d, &paths, true, mode, duration, 0, none).await?];
    Ok(StreamingResult {
        throughput,
        ttft,
        cpu: probes.cpu.unwrap_or_default(),
    })
}

/// One memory measurement: N streams in flight.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemoryRow {
    /// `normalized` or `tunnel`.
    pub mode: String,
    /// Streams opened.
    pub streams: u64,
    /// Streams that delivered a first chunk and were in flight at the mock
    /// when RSS was read.
    pub in_flight: u64,
    /// Streams that failed.
    pub failed: u64,
    /// Edge RSS before the streams.
    pub edge_rss_idle: u64,
    /// Edge RSS with the streams in flight.
    pub edge_rss_loaded: u64,
    /// `(loaded - idle) / in_flight`.
    pub edge_bytes_per_stream: f64,
    /// Sum of node RSS before.
    pub nodes_rss_idle: u64,
    /// Sum of node RSS with the streams in flight.
    pub nodes_rss_loaded: u64,
    /// `(loaded - idle) / in_flight`.
    pub nodes_bytes_per_stream: f64,
    /// Edge threads with the streams in flight.
    pub edge_threads: u64,
}

/// Results of the memory scenario.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemoryResult {
    /// Node processes (each QUIC connection carries at most 4,096 streams).
    pub nodes: usize,
    /// One row per mode and level.
    pub rows: Vec<MemoryRow>,
}

/// The memory deployment: the slow mock behind `nodes` Nodes.
pub fn memory_deployment(work: &Path, nodes: usize, max_streams: usize) -> DeploymentSpec {
    let per_node = (max_streams / nodes.max(1) + 256) as u32;
    DeploymentSpec {
        dir: work.join("memory"),
        mocks: vec![MockSpec {
            name: SLOW_MOCK.into(),
            tokens: 600,
            tps: 1.0,
            prefill_ms: 0,
            external: None,
            nagle: false,
        }],
        nodes,
        capacity: per_node,
        max_concurrent_runs: per_node + 64,
        queue_capacity: 1024,
        journal: JournalStore::default(),
        otlp_traces: None,
        extras: EdgeExtras::default(),
        worker_threads: None,
        quic: None,
    }
}

async fn wait_mock_in_flight(
    d: &Deployment,
    what: &str,
    bound: Duration,
    cond: impl Fn(u64) -> bool,
) -> Result<u64, ScenarioError> {
    let deadline = Instant::now() + bound;
    loop {
        let n = d.mock_in_flight(SLOW_MOCK).await.unwrap_or(u64::MAX);
        if n != u64::MAX && cond(n) {
            return Ok(n);
        }
        if Instant::now() > deadline {
            return Err(ScenarioError::Timeout(format!(
                "{what}: mock in flight {n} after {bound:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// RSS of the Edge and the Nodes at each level of in-flight streams, in
/// both modes. Each row gets a fresh deployment, so memory the allocator
/// kept from an earlier row does not hide in the idle baseline.
pub async fn memory(
    bins: &Binaries,
    work: &Path,
    nodes: usize,
    levels: &[usize],
    ramp_per_s: f64,
) -> Result<MemoryResult, ScenarioError> {
    let client = load::client()?;
    let max = levels.iter().copied().max().unwrap_or(1);
    let mut rows = Vec::new();
    for tunnel in [false, true] {
        for &level in levels {
            let mode = if tunnel { "tunnel" } else { "normalized" };
            eprintln!("memory: {level} streams, {mode}");
            let mut d = Deployment::start(bins, &memory_deployment(work, nodes, max)).await?;
            let row = memory_row(&client, &mut d, tunnel, level, ramp_per_s).await;
            d.stop().await;
            rows.push(row?);
        }
    }
    Ok(MemoryResult { nodes, rows })
}

async fn memory_row(
    client: &reqwest::Client,
    d: &mut Deployment,
    tunnel: bool,
    level: usize,
    ramp_per_s: f64,
) -> Result<MemoryRow, ScenarioError> {
    let target = d.via(SLOW_MOCK, tunnel);
    // Warm the path once, then let it settle.
    let warm = load::hold_streams(client, &target, 8, 100.0).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    warm.close().await;
    wait_mock_in_flight(d, "drain after warm-up", Duration::from_secs(60), |n| {
        n == 0
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let edge_rss_idle = d.edge.rss_bytes()?;
    let nodes_rss_idle = d.nodes_rss_bytes()?;
    let held = load::hold_streams(client, &target, level, ramp_per_s).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = held.snapshot();
        if s.first_chunk + s.failed >= level as u64 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Let buffers settle, then read.
    tokio::time::sleep(Duration::from_secs(3)).await;
    d.check_alive()?;
    let in_flight = d.mock_in_flight(SLOW_MOCK).await.unwrap_or(0);
    let s = held.snapshot();
    let edge_rss_loaded = d.edge.rss_bytes()?;
    let nodes_rss_loaded = d.nodes_rss_bytes()?;
    let edge_threads = crate::procfs::threads(d.edge.pid()).unwrap_or(0);
    let per = |loaded: u64, idle: u64| (loaded as f64 - idle as f64) / (in_flight.max(1) as f64);
    let row = MemoryRow {
        mode: if tunnel { "tunnel" } else { "normalized" }.into(),
        streams: level as u64,
        in_flight,
        failed: s.failed,
        edge_rss_idle,
        edge_rss_loaded,
        edge_bytes_per_stream: per(edge_rss_loaded, edge_rss_idle),
        nodes_rss_idle,
        nodes_rss_loaded,
        nodes_bytes_per_stream: per(nodes_rss_loaded, nodes_rss_idle),
        edge_threads,
    };
    eprintln!(
        "  in flight {} failed {} edge {:.1} KiB/stream nodes {:.1} KiB/stream",
        row.in_flight,
        row.failed,
        row.edge_bytes_per_stream / 1024.0,
        row.nodes_bytes_per_stream / 1024.0
    );
    held.close().await;
    Ok(row)
}

/// Results of the node-scale scenario.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeScaleResult {
    /// Nodes connected.
    pub nodes: usize,
    /// Milliseconds until every node was ready.
    pub ready_after_ms: u64,
    /// Edge RSS with no node.
    pub edge_rss_idle: u64,
    /// Edge RSS with every node connected and ready.
    pub edge_rss_connected: u64,
    /// `(connected - idle) / nodes`.
    pub edge_bytes_per_connection: f64,
    /// Fleet RSS with configs loaded, before any node started.
    pub fleet_rss_loaded: u64,
    /// Fleet RSS with every node ready.
    pub fleet_rss_connected: u64,
    /// `(connected - loaded) / nodes`.
    pub fleet_bytes_per_node: f64,
    /// Idle measurement window, seconds.
    pub idle_window_s: f64,
    /// Heartbeat interval in force, ms.
    pub heartbeat_interval_ms: u64,
    /// Edge CPU seconds over the window.
    pub edge_cpu_s: f64,
    /// Fleet CPU seconds over the window.
    pub fleet_cpu_s: f64,
    /// Edge CPU as a percentage of one core.
    pub edge_cpu_pct: f64,
    /// Fleet CPU as a percentage of one core.
    pub fleet_cpu_pct: f64,
    /// Edge CPU per node connection, microseconds per second.
    pub edge_cpu_us_per_node_s: f64,
}

/// Many nodes (one `iop-bench fleet` process) on one Edge: memory per
/// connection and CPU at idle (heartbeats, QUIC keep-alives and health
/// refresh at their configured cadence) over `window`.
pub async fn nodes(
    bins: &Binaries,
    work: &Path,
    count: usize,
    window: Duration,
    heartbeat_interval_ms: Option<u64>,
) -> Result<NodeScaleResult, ScenarioError> {
    let dir = work.join("nodes");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| DeployError::Io {
            what: "clearing nodes dir".into(),
            source: e,
        })?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| DeployError::Io {
        what: "creating nodes dir".into(),
        source: e,
    })?;
    let ids: Vec<String> = (1..=count).map(crate::fleet::node_id).collect();
    write_pki(&dir, &ids)?;
    let quic = free_udp_port()?;
    let http_port = free_tcp_port()?;
    let heartbeat = heartbeat_interval_ms
        .map(|ms| {
            format!(
                "[heartbeat]\ninterval_ms = {ms}\nwait_ms = {}\n",
                ms * 3 / 2
            )
        })
        .unwrap_or_default();
    let mut edge_toml = edge_config_head(quic, http_port, 256);
    edge_toml.push_str(&heartbeat);
    for id in &ids {
        edge_toml.push_str(&format!(
            "[[providers]]\nid = \"p-{id}\"\nnode = \"{id}\"\nadapter = \"mock\"\ntarget = \"m\"\ncapacity = 1\n"
        ));
    }
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text).map_err(|e| DeployError::Io {
            what: format!("writing {name}"),
            source: e,
        })
    };
    write("edge.toml", &edge_toml)?;
    let quic_addr = std::net::SocketAddr::from(([127, 0, 0, 1], quic));
    for (i, id) in ids.iter().enumerate() {
        let text = node_config(
            id,
            quic_addr,
            4,
            "[[providers]]\nadapter = \"mock\"\ntarget = \"m\"\n",
        );
        write(
            &crate::fleet::node_config_file(i + 1),
            &format!("{text}{heartbeat}"),
        )?;
    }
    let http = load::client()?;
    let edge_http = std::net::SocketAddr::from(([127, 0, 0, 1], http_port));
    let mut edge = Proc::spawn(
        "edge",
        &bins.edge,
        &["run".into(), "--config".into(), "edge.toml".into()],
        &dir,
        false,
    )?;
    wait_http_ok(
        &http,
        &format!("http://{edge_http}/healthz"),
        "edge",
        &mut edge,
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let edge_rss_idle = edge.rss_bytes()?;

    let mut fleet = Proc::spawn(
        "fleet",
        &bins.bench,
        &[
            "fleet".into(),
            "--dir".into(),
            dir.display().to_string(),
            "--count".into(),
            count.to_string(),
        ],
        &dir,
        true,
    )?;
    let stdout = fleet
        .take_stdout()
        .ok_or_else(|| ScenarioError::Timeout("fleet stdout".into()))?;
    let mut lines = BufReader::new(stdout);
    let event = |name: &'static str| {
        move |line: &str| {
            let v: serde_json::Value = serde_json::from_str(line).ok()?;
            (v["event"] == name).then_some(v)
        }
    };
    let loaded = read_line_until(&mut lines, Duration::from_secs(60), event("fleet_loaded"))
        .await
        .ok_or_else(|| ScenarioError::Timeout("fleet did not load its configs".into()))?;
    let ready = read_line_until(&mut lines, Duration::from_secs(150), event("fleet_ready"))
        .await
        .ok_or_else(|| ScenarioError::Timeout("fleet nodes did not become ready".into()))?;
    wait_providers_ready(&http, edge_http, &mut edge).await?;
    // Let connection setup finish (first health refresh, allocations).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let edge_rss_connected = edge.rss_bytes()?;
    let fleet_rss_connected = fleet.rss_bytes()?;
    eprintln!("nodes: {count} ready; idle CPU over {window:?}");
    let (e0, f0, t0) = (edge.cpu_ticks()?, fleet.cpu_ticks()?, Instant::now());
    tokio::time::sleep(window).await;
    let (e1, f1, elapsed) = (edge.cpu_ticks()?, fleet.cpu_ticks()?, t0.elapsed());
    edge.check_alive()?;
    fleet.check_alive()?;
    let secs = elapsed.as_secs_f64();
    let edge_cpu_s = (e1 - e0) as f64 / TICKS_PER_SECOND as f64;
    let fleet_cpu_s = (f1 - f0) as f64 / TICKS_PER_SECOND as f64;
    let fleet_rss_loaded = loaded["rss_bytes"].as_u64().unwrap_or(0);
    let result = NodeScaleResult {
        nodes: count,
        ready_after_ms: ready["ready_after_ms"].as_u64().unwrap_or(0),
        edge_rss_idle,
        edge_rss_connected,
        edge_bytes_per_connection: (edge_rss_connected as f64 - edge_rss_idle as f64)
            / count as f64,
        fleet_rss_loaded,
        fleet_rss_connected,
        fleet_bytes_per_node: (fleet_rss_connected as f64 - fleet_rss_loaded as f64) / count as f64,
        idle_window_s: secs,
        heartbeat_interval_ms: heartbeat_interval_ms.unwrap_or(30_000),
        edge_cpu_s,
        fleet_cpu_s,
        edge_cpu_pct: 100.0 * edge_cpu_s / secs,
        fleet_cpu_pct: 100.0 * fleet_cpu_s / secs,
        edge_cpu_us_per_node_s: 1e6 * edge_cpu_s / secs / count as f64,
    };
    fleet.stop().await;
    edge.stop().await;
    Ok(result)
}

/// The label of ephemeral runs through iop in the durable scenario
/// (normalized mode: a durable answer is always rendered by the Edge).
pub const EPHEMERAL: &str = "iop ephemeral";
/// The label of durable runs through iop.
pub const DURABLE: &str = "iop durable";

/// Settings of the durable scenario.
#[derive(Debug, Clone)]
pub struct DurableSettings {
    /// Journal stores to measure, one deployment each.
    pub stores: Vec<JournalStore>,
    /// Closed-loop concurrencies of the long streams (1,000 chunks).
    pub stream_concurrencies: Vec<u32>,
    /// Open-loop rates of the non-streamed calls (8-token answers).
    pub rates: Vec<f64>,
    /// Length of each run, warm-up included.
    pub duration: Duration,
    /// How the durable requests ask for it.
    pub durability: Durability,
}

/// What the journal did during one run through iop, from the Edge's
/// `/metrics` read before and after it (warm-up included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JournalRun {
    /// The load (`closed x16`, `open 500/s`).
    pub load: String,
    /// The path (`iop ephemeral`, `iop durable`).
    pub target: String,
    /// How its requests asked to be kept.
    pub durability: Durability,
    /// Streamed or not.
    pub stream: bool,
    /// SSE chunks per successful stream (0 when not streamed).
    pub chunks_per_ok: f64,
    /// Operations by kind.
    pub ops: Vec<OpStats>,
}

impl JournalRun {
    /// One kind's operations, if any happened.
    pub fn op(&self, op: &str) -> Option<&OpStats> {
        self.ops.iter().find(|o| o.op == op)
    }

    /// Durable responses the run created (one `create` each).
    pub fn responses(&self) -> u64 {
        self.op("create").map_or(0, |o| o.ok)
    }

    /// Appends per durable response: one per group commit of its events.
    pub fn appends_per_response(&self) -> Option<f64> {
        let responses = self.responses();
        (responses > 0).then(|| self.op("append").map_or(0, |o| o.ok) as f64 / responses as f64)
    }

    /// Operations that did not succeed.
    pub fn failed(&self) -> u64 {
        self.ops.iter().map(|o| o.failed).sum()
    }
}

/// One row of the durable scenario: direct, ephemeral and durable at the
/// same load, with what was read around the runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DurableRow {
    /// `direct`, then `iop ephemeral` and `iop durable`.
    pub comparison: Comparison,
    /// The journal's operations during each run through iop.
    pub journal: Vec<JournalRun>,
    /// CPU per chunk of each run through iop (streams, separate
    /// processes only).
    pub cpu: Vec<ChunkCpu>,
    /// `/proc/loadavg` (1, 5, 15 min) before the row's first run.
    pub load_avg_before: [f64; 3],
    /// And after its last.
    pub load_avg_after: [f64; 3],
}

impl DurableRow {
    fn report(&self, label: &str) -> Option<&LoadReport> {
        self.comparison.via.iter().find(|r| r.label == label)
    }

    fn cpu_of(&self, label: &str) -> Option<&ChunkCpu> {
        self.cpu.iter().find(|c| c.target == label)
    }

    /// Durable chunks/s over ephemeral chunks/s.
    pub fn durable_over_ephemeral_chunks(&self) -> Option<f64> {
        let e = self.report(EPHEMERAL)?.chunks_per_s;
        let d = self.report(DURABLE)?.chunks_per_s;
        (e > 0.0).then(|| d / e)
    }
}

/// The durable scenario on one journal store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DurableStoreResult {
    /// The Edge's `[journal] store`.
    pub store: JournalStore,
    /// How the durable requests asked for it.
    pub durability: Durability,
    /// Long streams, closed loop, per concurrency.
    pub streaming: Vec<DurableRow>,
    /// Non-streamed calls, open loop, per rate.
    pub latency: Vec<DurableRow>,
}

/// Results of the durable scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DurableResult {
    /// One per journal store.
    pub stores: Vec<DurableStoreResult>,
}

/// Direct, ephemeral (normalized) and durable (normalized, asked as
/// `durability`) to mock `mock`.
fn durable_paths(g: &dyn Gateway, mock: &str, durability: Durability) -> Vec<(String, Target)> {
    let ephemeral = g.via(mock, false);
    let mut durable = ephemeral.clone();
    durable.durability = durability;
    vec![
        (
            "direct".into(),
            g.direct(mock).unwrap_or_else(|| ephemeral.clone()),
        ),
        (EPHEMERAL.into(), ephemeral),
        (DURABLE.into(), durable),
    ]
}

/// The deployment of the durable scenario: the latency scenario's shape
/// (the short and long mocks behind one Node) with the Edge's journal on
/// `store`.
pub fn durable_deployment(work: &Path, store: JournalStore) -> DeploymentSpec {
    let mut spec = latency_deployment(work, None);
    spec.dir = work.join(format!("durable-{}", store.as_str()));
    spec.journal = store;
    spec
}

/// Durable vs ephemeral responses on each journal store, each on a fresh
/// deployment of separate processes.
pub async fn durable(
    bins: &Binaries,
    work: &Path,
    settings: &DurableSettings,
) -> Result<DurableResult, ScenarioError> {
    let mut stores = Vec::new();
    for &store in &settings.stores {
        let mut d = Deployment::start(bins, &durable_deployment(work, store)).await?;
        let result = durable_runs(&d, store, settings).await;
        let alive = d.check_alive();
        d.stop().await;
        alive?;
        stores.push(result?);
    }
    Ok(DurableResult { stores })
}

/// The durable scenario against one gateway whose Edge keeps its journal
/// on `store`: relayed chunks/s of long streams (closed loop), then added
/// latency of non-streamed calls (open loop), each direct vs ephemeral vs
/// durable in the same row, with the journal's metrics around every run
/// through iop.
pub async fn durable_runs(
    g: &dyn Gateway,
    store: JournalStore,
    settings: &DurableSettings,
) -> Result<DurableStoreResult, ScenarioError> {
    let client = load::client()?;
    let mut streaming = Vec::new();
    for (row, c) in settings.stream_concurrencies.iter().enumerate() {
        eprintln!(
            "durable ({} store): closed loop x{c}, 1000-token streams",
            store.as_str()
        );
        let mode = LoadMode::Closed { concurrency: *c };
        let paths = durable_paths(g, LONG_MOCK, settings.durability);
        let probes = Probes::cpu_and_journal();
        streaming.push(
            durable_row(
                &client,
                g,
                &paths,
                true,
                mode,
                settings.duration,
                row,
                probes,
            )
            .await?,
        );
    }
    let mut latency = Vec::new();
    for (row, rate) in settings.rates.iter().enumerate() {
        eprintln!(
            "durable ({} store): open loop {rate}/s, not streamed",
            store.as_str()
        );
        let mode = LoadMode::Open { rate_per_s: *rate };
        let paths = durable_paths(g, SHORT_MOCK, settings.durability);
        let probes = Probes {
            journal: Some(Vec::new()),
            ..Probes::default()
        };
        latency.push(
            durable_row(
                &client,
                g,
                &paths,
                false,
                mode,
                settings.duration,
                row,
                probes,
            )
            .await?,
        );
    }
    Ok(DurableStoreResult {
        store,
        durability: settings.durability,
        streaming,
        latency,
    })
}

#[allow(clippy::too_many_arguments)]
async fn durable_row(
    client: &reqwest::Client,
    g: &dyn Gateway,
    paths: &[(String, Target)],
    stream: bool,
    mode: LoadMode,
    duration: Duration,
    row: usize,
    mut probes: Probes,
) -> Result<DurableRow, ScenarioError> {
    let load_avg_before = crate::procfs::load_average().unwrap_or_default();
    let comparison = compare(client, g, paths, stream, mode, duration, row, &mut probes).await?;
    Ok(DurableRow {
        comparison,
        journal: probes.journal.unwrap_or_default(),
        cpu: probes.cpu.unwrap_or_default(),
        load_avg_before,
        load_avg_after: crate::procfs::load_average().unwrap_or_default(),
    })
}

/// `1.2 → 3.4` (one-minute load average before and after).
fn load_cell(row: &DurableRow) -> String {
    format!(
        "{:.1} → {:.1}",
        row.load_avg_before[0], row.load_avg_after[0]
    )
}

/// Rows of `rows` and `base` at the same load.
fn pair_rows<'a>(
    rows: &'a [DurableRow],
    base: &'a [DurableRow],
) -> Vec<(&'a DurableRow, &'a DurableRow)> {
    rows.iter()
        .filter_map(|r| {
            let mode = r.comparison.direct.mode;
            base.iter()
                .find(|b| b.comparison.direct.mode == mode)
                .map(|b| (r, b))
        })
        .collect()
}

fn ratio_cell(num: f64, den: f64) -> String {
    if den > 0.0 {
        format!("{:.2}", num / den)
    } else {
        "-".into()
    }
}

fn opt_ms(s: Option<f64>) -> String {
    s.map_or_else(|| "-".into(), |s| format!("{:.3}", s * 1e3))
}

impl DurableResult {
    /// The result on `store`, if it was measured.
    pub fn store(&self, store: JournalStore) -> Option<&DurableStoreResult> {
        self.stores.iter().find(|s| s.store == store)
    }

    /// Pairs of streaming rows at the same load on `store` and on the
    /// embedded store (measured in the same run).
    fn streaming_pairs(&self, store: JournalStore) -> Vec<(&DurableRow, &DurableRow)> {
        let (Some(s), Some(base)) = (self.store(store), self.store(JournalStore::Embedded)) else {
            return Vec::new();
        };
        pair_rows(&s.streaming, &base.streaming)
    }

    /// Durable chunks/s on `store` over durable chunks/s on the embedded
    /// store, per streaming load (`closed x16`), from the same run.
    pub fn durable_chunks_vs_embedded(&self, store: JournalStore) -> Vec<(String, f64)> {
        self.streaming_pairs(store)
            .into_iter()
            .filter_map(|(r, b)| {
                let d = r.report(DURABLE)?.chunks_per_s;
                let base = b.report(DURABLE)?.chunks_per_s;
                (base > 0.0).then(|| (r.comparison.direct.mode.label(), d / base))
            })
            .collect()
    }

    /// Every measured store but the embedded one, when the embedded one
    /// was measured too.
    fn others(&self) -> Vec<JournalStore> {
        if self.store(JournalStore::Embedded).is_none() {
            return Vec::new();
        }
        self.stores
            .iter()
            .map(|s| s.store)
            .filter(|s| *s != JournalStore::Embedded)
            .collect()
    }

    /// The streaming rows of each other store against the embedded
    /// store's, at the same load (empty without the embedded store).
    fn versus_embedded_streaming(&self) -> String {
        let others = self.others();
        if others.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "\n#### Each store against the embedded store, same run (streaming)\n\n\
             | stores | load | durable chunks/s | embedded durable chunks/s | **durable chunks/s on store / on embedded** | ephemeral chunks/s, store / embedded (control) | durable / ephemeral on store | durable / ephemeral on embedded | (durable / ephemeral) store ÷ embedded |\n\
             | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for store in others {
            for (r, b) in self.streaming_pairs(store) {
                let (Some(rd), Some(re), Some(bd), Some(be)) = (
                    r.report(DURABLE),
                    r.report(EPHEMERAL),
                    b.report(DURABLE),
                    b.report(EPHEMERAL),
                ) else {
                    continue;
                };
                // Each store's durable rate over its own ephemeral one,
                // relative: what is left when both deployments ran at
                // different speeds (other load on the machine).
                let relative = if re.chunks_per_s > 0.0 && be.chunks_per_s > 0.0 {
                    ratio_cell(
                        rd.chunks_per_s / re.chunks_per_s,
                        bd.chunks_per_s / be.chunks_per_s,
                    )
                } else {
                    "-".into()
                };
                out.push_str(&format!(
                    "| {} / embedded | {} | {:.0} | {:.0} | **{}** | {} | {} | {} | {} |\n",
                    store.as_str(),
                    r.comparison.direct.mode.label(),
                    rd.chunks_per_s,
                    bd.chunks_per_s,
                    ratio_cell(rd.chunks_per_s, bd.chunks_per_s),
                    ratio_cell(re.chunks_per_s, be.chunks_per_s),
                    ratio_cell(rd.chunks_per_s, re.chunks_per_s),
                    ratio_cell(bd.chunks_per_s, be.chunks_per_s),
                    relative,
                ));
            }
        }
        out
    }

    /// The non-streamed rows of each other store against the embedded
    /// store's, at the same load (empty without the embedded store).
    fn versus_embedded_latency(&self) -> String {
        let others = self.others();
        let Some(base) = self.store(JournalStore::Embedded) else {
            return String::new();
        };
        if others.is_empty() {
            return String::new();
        }
        let mut out = String::from(
            "\n#### Each store against the embedded store, same run (not streamed; ms)\n\n\
             | stores | load | dur − eph p50 on store | dur − eph p50 on embedded | dur added p50 on store | dur added p50 on embedded | dur added p99 on store | dur added p99 on embedded |\n\
             | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        let between = |row: &DurableRow| match (
            row.report(EPHEMERAL).and_then(|r| r.total),
            row.report(DURABLE).and_then(|r| r.total),
        ) {
            (Some(e), Some(d)) => ms_signed(d.p50_us as i64 - e.p50_us as i64),
            _ => "-".into(),
        };
        let added = |row: &DurableRow, i: usize| {
            row.report(DURABLE)
                .and_then(|d| added_us(&row.comparison.direct, d))
                .map_or_else(|| "-".into(), |a| ms_signed(a[i]))
        };
        for store in others {
            let Some(s) = self.store(store) else { continue };
            for (r, b) in pair_rows(&s.latency, &base.latency) {
                out.push_str(&format!(
                    "| {} / embedded | {} | {} | {} | {} | {} | {} | {} |\n",
                    store.as_str(),
                    r.comparison.direct.mode.label(),
                    between(r),
                    between(b),
                    added(r, 0),
                    added(b, 0),
                    added(r, 2),
                    added(b, 2),
                ));
            }
        }
        out
    }

    /// The scenario's tables: streaming ratios, added latency, journal
    /// operations.
    pub fn markdown(&self) -> String {
        let mut out = String::from(
            "### Durable vs ephemeral streaming (1,000-chunk streams; chunks/s)\n\n\
             | store | load | direct | ephemeral | durable | ephemeral / direct | durable / direct | durable / ephemeral | errors (eph / dur) | Edge µs/chunk eph | Edge µs/chunk dur | store server µs/chunk dur | load avg |\n\
             | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |\n",
        );
        for s in &self.stores {
            for row in &s.streaming {
                let (Some(e), Some(d)) = (row.report(EPHEMERAL), row.report(DURABLE)) else {
                    continue;
                };
                let base = row.comparison.direct.chunks_per_s;
                let cpu = |label: &str| {
                    row.cpu_of(label)
                        .map_or_else(|| "-".into(), |c| format!("{:.2}", c.edge_us_per_chunk))
                };
                let store_cpu = row
                    .cpu_of(DURABLE)
                    .and_then(|c| c.store_us_per_chunk)
                    .map_or_else(|| "-".into(), |us| format!("{us:.2}"));
                out.push_str(&format!(
                    "| {} | {} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} / {} | {} | {} | {} | {} |\n",
                    s.store.as_str(),
                    row.comparison.direct.mode.label(),
                    base,
                    e.chunks_per_s,
                    d.chunks_per_s,
                    ratio_cell(e.chunks_per_s, base),
                    ratio_cell(d.chunks_per_s, base),
                    ratio_cell(d.chunks_per_s, e.chunks_per_s),
                    e.error_count(),
                    d.error_count(),
                    cpu(EPHEMERAL),
                    cpu(DURABLE),
                    store_cpu,
                    load_cell(row),
                ));
            }
        }
        out.push_str(&self.versus_embedded_streaming());
        out.push_str(
            "\n### Durable vs ephemeral, not streamed (8-token answers; ms, added = via − direct)\n\n\
             | store | load | direct p50 | direct p99 | eph added p50 | eph added p90 | eph added p99 | dur added p50 | dur added p90 | dur added p99 | dur − eph p50 | errors (eph / dur) | load avg |\n\
             | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |\n",
        );
        for s in &self.stores {
            for row in &s.latency {
                let (Some(e), Some(d)) = (row.report(EPHEMERAL), row.report(DURABLE)) else {
                    continue;
                };
                let direct = &row.comparison.direct;
                let (ae, ad) = (added_us(direct, e), added_us(direct, d));
                let cell = |a: Option<[i64; 4]>, i: usize| {
                    a.map_or_else(|| "-".into(), |a| ms_signed(a[i]))
                };
                let between = match (e.total, d.total) {
                    (Some(e), Some(d)) => ms_signed(d.p50_us as i64 - e.p50_us as i64),
                    _ => "-".into(),
                };
                out.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} |\n",
                    s.store.as_str(),
                    direct.mode.label(),
                    direct
                        .total
                        .map_or("-".into(), |p| crate::report::ms(p.p50_us)),
                    direct
                        .total
                        .map_or("-".into(), |p| crate::report::ms(p.p99_us)),
                    cell(ae, 0),
                    cell(ae, 1),
                    cell(ae, 2),
                    cell(ad, 0),
                    cell(ad, 1),
                    cell(ad, 2),
                    between,
                    e.error_count(),
                    d.error_count(),
                    load_cell(row),
                ));
            }
        }
        out.push_str(&self.versus_embedded_latency());
        out.push_str(
            "\n### The journal during each run (Edge `/metrics`, warm-up included; ms until durable)\n\n\
             | store | load | target | responses | appends / response | chunks / append | append mean | append p50 ≤ | append p99 ≤ | create mean | finish mean | failed ops |\n\
             | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        );
        for s in &self.stores {
            for row in s.streaming.iter().chain(&s.latency) {
                // An ephemeral run that journaled nothing has no row; one
                // that did would show here.
                for j in row.journal.iter().filter(|j| !j.ops.is_empty()) {
                    let append = j.op("append");
                    let per = j.appends_per_response();
                    let chunks_per_append = match per {
                        Some(per) if j.stream && per > 0.0 => {
                            format!("{:.1}", j.chunks_per_ok / per)
                        }
                        _ => "-".into(),
                    };
                    out.push_str(&format!(
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                        s.store.as_str(),
                        j.load,
                        j.target,
                        j.responses(),
                        per.map_or_else(|| "-".into(), |p| format!("{p:.1}")),
                        chunks_per_append,
                        opt_ms(append.and_then(OpStats::mean_s)),
                        opt_ms(append.and_then(|a| a.p50_at_most_s)),
                        opt_ms(append.and_then(|a| a.p99_at_most_s)),
                        opt_ms(j.op("create").and_then(OpStats::mean_s)),
                        opt_ms(j.op("finish").and_then(OpStats::mean_s)),
                        j.failed(),
                    ));
                }
            }
        }
        out
    }
}

/// Results of the tail scenario: traced runs of the latency scenario's
/// requests, each with where its median and its slowest requests spent
/// their time.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TailResult {
    /// One per rate and path.
    pub runs: Vec<TailRun>,
}

/// One traced run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TailRun {
    /// What the client saw.
    pub report: LoadReport,
    /// The phases of its median and slowest requests.
    pub profile: crate::spans::TailProfile,
}

/// How long after a run its last spans take to reach the collector (the
/// export interval is 100 ms).
const SPAN_SETTLE: Duration = Duration::from_secs(1);
/// One request in this many is traced in the tail scenario: enough of
/// them for a slowest 1 % of tens of requests at 1,000/s over 10 s, few
/// enough that exporting spans barely loads the CPUs the run measures.
const TAIL_TRACE_EVERY: u64 = 10;

/// The tail scenario: the latency scenario's requests (non-streaming, 8
/// tokens, open loop at each of `rates`) through the tunnel and normalized
/// paths of a deployment whose Edge and Node export the spans of the
/// requests that ask (one in [`TAIL_TRACE_EVERY`], each with its own trace
/// id); joined, they say where the slowest 1 % of those requests waited,
/// against the median ones. Exporting spans costs CPU of its own.
pub async fn tail(
    bins: &Binaries,
    work: &Path,
    rates: &[f64],
    duration: Duration,
) -> Result<TailResult, ScenarioError> {
    let collector = crate::spans::SpanCollector::start()
        .await
        .map_err(ScenarioError::Collector)?;
    let mut spec = latency_deployment(work, None);
    spec.dir = work.join("tail");
    spec.otlp_traces = Some(collector.endpoint());
    let mut d = Deployment::start(bins, &spec).await?;
    let client = load::client()?;
    let mut runs = Vec::new();
    for rate in rates {
        let mode = LoadMode::Open { rate_per_s: *rate };
        for tunnel in [true, false] {
            let label = if tunnel {
                "iop tunnel"
            } else {
                "iop normalized"
            };
            let spec = LoadSpec::new(label, d.via(SHORT_MOCK, tunnel), false, mode, duration);
            // Spans of the deployment's checks and of earlier runs go.
            let _ = collector.take();
            let (report, traced) = load::run_traced(&client, &spec, TAIL_TRACE_EVERY).await?;
            tokio::time::sleep(SPAN_SETTLE).await;
            let (spans, dropped) = collector.take();
            let (phases, incomplete) = crate::spans::join(&traced, &spans);
            let profile =
                crate::spans::TailProfile::of(&mode.label(), label, phases, incomplete, dropped);
            eprintln!(
                "  tail {label:<16} {:<12} ok {:>7} p50 {} p99 {} ms; joined {} incomplete {}",
                mode.label(),
                report.ok,
                report
                    .total
                    .map_or("-".into(), |p| crate::report::ms(p.p50_us)),
                report
                    .total
                    .map_or("-".into(), |p| crate::report::ms(p.p99_us)),
                profile.joined,
                profile.incomplete,
            );
            runs.push(TailRun { report, profile });
        }
    }
    d.check_alive()?;
    d.stop().await;
    Ok(TailResult { runs })
}

impl TailResult {
    /// The client's view of each run and its phase tables.
    pub fn markdown(&self) -> String {
        let mut out = String::from(
            "## Where the slowest requests waited (traced, non-streaming)\n\n\
             One request in ten carries its own trace id; the Edge's and the \
             Node's spans of it split what the client saw into phases on one \
             clock. The client's percentiles are of every request.\n\n",
        );
        let reports: Vec<LoadReport> = self.runs.iter().map(|r| r.report.clone()).collect();
        out.push_str(&load_table(&reports));
        out.push('\n');
        for run in &self.runs {
            out.push_str(&run.profile.markdown());
        }
        out
    }
}

/// Everything one suite run measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SuiteReport {
    /// Where it ran.
    pub machine: Machine,
    /// The command that produced it.
    pub command: String,
    /// Added latency.
    pub latency: Option<LatencyResult>,
    /// Added latency against a provider with Nagle's algorithm on.
    #[serde(default)]
    pub nagle: Option<LatencyResult>,
    /// Streaming throughput.
    pub streaming: Option<StreamingResult>,
    /// Memory per stream.
    pub memory: Option<MemoryResult>,
    /// Node scale.
    pub nodes: Option<NodeScaleResult>,
    /// Durable vs ephemeral responses.
    #[serde(default)]
    pub durable: Option<DurableResult>,
    /// Where the slowest requests waited.
    #[serde(default)]
    pub tail: Option<TailResult>,
    /// Tenants' limits and budgets on vs off.
    #[serde(default)]
    pub tenants: Option<crate::tenants::TenantResult>,
    /// Edge memory while durable responses are retained.
    #[serde(default)]
    pub retention: Option<crate::durable_memory::RetentionResult>,
    /// Edge memory under retrieves of one large stored response.
    #[serde(default)]
    pub retrieve: Option<crate::durable_memory::RetrieveResult>,
    /// The mock alone, iop and peer gateways side by side.
    #[serde(default)]
    pub gateways: Option<crate::gateways::GatewaysResult>,
}

fn kib(bytes: f64) -> String {
    format!("{:.1}", bytes / 1024.0)
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1024.0 * 1024.0))
}

/// Ratio of each path's chunks/s to the direct baseline's.
fn chunk_ratio_table(rows: &[Comparison]) -> String {
    let mut out = String::from(
        "| load | target | chunks/s | vs direct | streams/s | errors |\n| --- | --- | ---: | ---: | ---: | ---: |\n",
    );
    for row in rows {
        let base = row.direct.chunks_per_s.max(1e-9);
        for r in std::iter::once(&row.direct).chain(&row.via) {
            out.push_str(&format!(
                "| {} | {} | {:.0} | {:.2} | {:.1} | {} |\n",
                r.mode.label(),
                r.label,
                r.chunks_per_s,
                r.chunks_per_s / base,
                r.throughput_rps,
                r.error_count()
            ));
        }
    }
    out
}

impl SuiteReport {
    /// The whole report as markdown.
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "## Machine\n\n{}\nCommand: `{}`\n\n",
            self.machine.markdown(),
            self.command
        );
        if let Some(l) = &self.latency {
            out.push_str(&l.markdown(""));
        }
        if let Some(l) = &self.nagle {
            out.push_str(&l.markdown(", provider with Nagle on"));
        }
        if let Some(s) = &self.streaming {
            out.push_str("## Streaming: relayed SSE chunks per second (1,000-chunk streams)\n\n");
            out.push_str(&chunk_ratio_table(&s.throughput));
            if !s.cpu.is_empty() {
                out.push_str(
                    "\n### CPU per relayed chunk (µs; from /proc, whole run)\n\n\
                     | load | target | Edge µs/chunk | Nodes µs/chunk |\n| --- | --- | ---: | ---: |\n",
                );
                for c in &s.cpu {
                    out.push_str(&format!(
                        "| {} | {} | {:.2} | {:.2} |\n",
                        c.load, c.target, c.edge_us_per_chunk, c.nodes_us_per_chunk
                    ));
                }
            }
            out.push_str("\n### Streaming detail (ms)\n\n");
            let all: Vec<LoadReport> = s
                .throughput
                .iter()
                .chain(&s.ttft)
                .flat_map(|c| std::iter::once(c.direct.clone()).chain(c.via.iter().cloned()))
                .collect();
            out.push_str(&load_table(&all));
            out.push('\n');
        }
        if let Some(m) = &self.memory {
            out.push_str(&format!(
                "## Memory per in-flight stream ({} node processes)\n\n\
                 | mode | streams | in flight | failed | Edge RSS idle MiB | Edge RSS loaded MiB | Edge KiB/stream | Nodes RSS idle MiB | Nodes RSS loaded MiB | Nodes KiB/stream |\n\
                 | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
                m.nodes
            ));
            for r in &m.rows {
                out.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    r.mode,
                    r.streams,
                    r.in_flight,
                    r.failed,
                    mib(r.edge_rss_idle),
                    mib(r.edge_rss_loaded),
                    kib(r.edge_bytes_per_stream),
                    mib(r.nodes_rss_idle),
                    mib(r.nodes_rss_loaded),
                    kib(r.nodes_bytes_per_stream),
                ));
            }
            for r in m.rows.iter().filter(|r| r.in_flight < r.streams) {
                out.push_str(&format!(
                    "\n**{} {}: only {} of {} streams were in flight ({} failed)**: that row \
                     measures fewer streams than it names (check the Edge's connection \
                     limits and the open-file limit).\n",
                    r.mode, r.streams, r.in_flight, r.streams, r.failed
                ));
            }
            out.push('\n');
        }
        if let Some(t) = &self.tail {
            out.push_str(&t.markdown());
        }
        if let Some(dr) = &self.durable {
            out.push_str("## Durable vs ephemeral responses\n\n");
            out.push_str(&dr.markdown());
            out.push('\n');
        }
        if let Some(t) = &self.tenants {
            out.push_str(&t.markdown());
        }
        if let Some(r) = &self.retention {
            out.push_str(&r.markdown());
        }
        if let Some(r) = &self.retrieve {
            out.push_str(&r.markdown());
        }
        if let Some(g) = &self.gateways {
            out.push_str(&g.markdown());
        }
        if let Some(n) = &self.nodes {
            out.push_str(&format!(
                "## Node scale ({} nodes on one Edge)\n\n\
                 | measure | value |\n| --- | ---: |\n\
                 | all ready after | {} ms |\n\
                 | Edge RSS, no node | {} MiB |\n\
                 | Edge RSS, {} nodes | {} MiB |\n\
                 | Edge memory per node connection | {} KiB |\n\
                 | Fleet process RSS per node (its side: endpoint, connection, tasks) | {} KiB |\n\
                 | idle window (heartbeat every {} ms) | {:.1} s |\n\
                 | Edge CPU at idle | {:.2} % of a core ({:.2} s) |\n\
                 | Edge CPU per node connection | {:.1} µs/s |\n\
                 | Fleet CPU at idle | {:.2} % of a core ({:.2} s) |\n\n",
                n.nodes,
                n.ready_after_ms,
                mib(n.edge_rss_idle),
                n.nodes,
                mib(n.edge_rss_connected),
                kib(n.edge_bytes_per_connection),
                kib(n.fleet_bytes_per_node),
                n.heartbeat_interval_ms,
                n.idle_window_s,
                n.edge_cpu_pct,
                n.edge_cpu_s,
                n.edge_cpu_us_per_node_s,
                n.fleet_cpu_pct,
                n.fleet_cpu_s,
            ));
        }
        out
    }

    /// Write `report.json` and `report.md` into `dir`.
    pub fn write(&self, dir: &Path) -> std::io::Result<(PathBuf, PathBuf)> {
        std::fs::create_dir_all(dir)?;
        let json = dir.join("report.json");
        let md = dir.join("report.md");
        std::fs::write(
            &json,
            serde_json::to_string_pretty(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::write(&md, self.markdown())?;
        Ok((json, md))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::report::Percentiles;

    fn run(label: &str, mode: LoadMode, chunks_per_s: f64, p50_us: u64) -> LoadReport {
        LoadReport {
            label: label.to_owned(),
            mode,
            stream: chunks_per_s > 0.0,
            window_s: 1.0,
            requests: 10,
            ok: 10,
            errors: BTreeMap::new(),
            throughput_rps: 10.0,
            chunks: chunks_per_s as u64,
            chunks_per_s,
            total: Some(Percentiles {
                count: 10,
                p50_us,
                p90_us: p50_us,
                p99_us: p50_us,
                p999_us: p50_us,
                max_us: p50_us,
                mean_us: p50_us as f64,
            }),
            ttft: None,
            gap: None,
        }
    }

    fn row(mode: LoadMode, [direct, eph, dur]: [f64; 3], p50_us: [u64; 3]) -> DurableRow {
        DurableRow {
            comparison: Comparison {
                direct: run("direct", mode, direct, p50_us[0]),
                via: vec![
                    run(EPHEMERAL, mode, eph, p50_us[1]),
                    run(DURABLE, mode, dur, p50_us[2]),
                ],
            },
            journal: Vec::new(),
            cpu: Vec::new(),
            load_avg_before: [0.0; 3],
            load_avg_after: [0.0; 3],
        }
    }

    fn store(store: JournalStore, eph: f64, dur: f64, dur_p50_us: u64) -> DurableStoreResult {
        let closed = LoadMode::Closed { concurrency: 16 };
        let open = LoadMode::Open { rate_per_s: 250.0 };
        DurableStoreResult {
            store,
            durability: Durability::IdempotencyKey,
            streaming: vec![row(closed, [300_000.0, eph, dur], [1, 1, 1])],
            latency: vec![row(open, [0.0; 3], [500, 1_500, dur_p50_us])],
        }
    }

    #[test]
    fn nats_is_compared_with_the_embedded_store_of_the_same_run() {
        let r = DurableResult {
            stores: vec![
                store(JournalStore::Embedded, 100_000.0, 80_000.0, 4_500),
                store(JournalStore::Memory, 100_000.0, 100_000.0, 1_600),
                store(JournalStore::Nats, 110_000.0, 40_000.0, 6_500),
            ],
        };
        assert_eq!(
            r.durable_chunks_vs_embedded(JournalStore::Nats),
            vec![("closed x16".to_owned(), 0.5)]
        );
        let md = r.markdown();
        assert!(
            md.contains(
                "| nats / embedded | closed x16 | 40000 | 80000 | **0.50** | 1.10 | 0.36 | 0.80 | 0.45 |"
            ),
            "{md}"
        );
        assert!(
            md.contains(
                "| nats / embedded | open 250/s | +5.000 | +3.000 | +6.000 | +4.000 | +6.000 | +4.000 |"
            ),
            "{md}"
        );
        assert!(md.contains("| memory / embedded | closed x16 |"), "{md}");
        // Every store keeps its rows in the per-store tables.
        for s in ["embedded", "memory", "nats"] {
            let rows = md.lines().filter(|l| l.starts_with(&format!("| {s} |")));
            assert_eq!(rows.count(), 2, "{s}: {md}");
        }
        // Without the embedded store there is nothing to compare with.
        let alone = DurableResult {
            stores: vec![store(JournalStore::Nats, 1.0, 1.0, 1)],
        };
        assert!(
            alone
                .durable_chunks_vs_embedded(JournalStore::Nats)
                .is_empty()
        );
        assert!(!alone.markdown().contains("/ embedded"));
    }

    #[test]
    fn the_nagle_scenario_has_its_own_mock_and_its_own_tables() {
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let mock = nagle_mock();
        let args = mock.args(addr).join(" ");
        assert!(args.ends_with("--prefill-ms 1 --nagle"), "{args}");
        let latency = latency_deployment(Path::new("w"), None);
        for m in &latency.mocks {
            assert!(!m.args(addr).contains(&"--nagle".to_owned()), "{m:?}");
            assert_ne!(m.name, mock.name);
        }
        let open = LoadMode::Open { rate_per_s: 250.0 };
        let closed = LoadMode::Closed { concurrency: 16 };
        let result = |p50_us: u64| LatencyResult {
            open: vec![Comparison {
                direct: run("direct", open, 0.0, 300),
                via: vec![run("iop normalized", open, 0.0, p50_us)],
            }],
            closed: vec![Comparison {
                direct: run("direct", closed, 0.0, 300),
                via: vec![run("iop normalized", closed, 0.0, p50_us)],
            }],
            cpu: vec![RequestCpu {
                load: closed.label(),
                target: "iop normalized".into(),
                us_per_request: 123.4,
                switches_per_request: Some(4.5),
            }],
        };
        let mut report = SuiteReport {
            machine: Machine::current(),
            command: "iop-bench suite".into(),
            latency: Some(result(1_000)),
            nagle: Some(result(41_000)),
            streaming: None,
            memory: None,
            nodes: None,
            durable: None,
            tail: None,
            tenants: None,
            retention: None,
            retrieve: None,
            gateways: None,
        };
        let md = report.markdown();
        let plain = md
            .find("## Added latency (non-streaming, 8-token answers; ms)")
            .expect(&md);
        let nagle = md
            .find("## Added latency, provider with Nagle on (non-streaming, 8-token answers; ms)")
            .expect(&md);
        assert!(plain < nagle, "{md}");
        assert!(md.contains("### Saturation (closed loop), provider with Nagle on"));
        assert!(md[..nagle].contains("| open 250/s | iop normalized |"));
        assert!(md[nagle..].contains("+40.700"), "{md}");
        assert!(
            md.contains("### CPU per request, provider with Nagle on (closed loop")
                && md.contains("| closed x16 | iop normalized | 123.4 | 4.50 |"),
            "{md}"
        );
        // Reports written before the scenario (and the CPU rows) existed
        // still read.
        let mut old = serde_json::to_value(&report).unwrap();
        old["latency"].as_object_mut().unwrap().remove("cpu");
        let old: SuiteReport = serde_json::from_value(old).unwrap();
        assert!(old.latency.unwrap().cpu.is_empty());
        // ... and so do CPU rows written before the context switches.
        let mut old = serde_json::to_value(&report).unwrap();
        old["latency"]["cpu"][0]
            .as_object_mut()
            .unwrap()
            .remove("switches_per_request");
        let old: SuiteReport = serde_json::from_value(old).unwrap();
        let latency = old.latency.unwrap();
        assert_eq!(latency.cpu[0].switches_per_request, None);
        assert!(latency.markdown("").contains("| 123.4 | - |"));
        report.nagle = None;
        let mut json: serde_json::Value = serde_json::to_value(&report).unwrap();
        json.as_object_mut().unwrap().remove("nagle");
        let back: SuiteReport = serde_json::from_value(json).unwrap();
        assert!(back.nagle.is_none());
        assert!(!back.markdown().contains("Nagle"));
    }

    #[test]
    fn a_memory_row_that_held_fewer_streams_than_it_names_is_flagged() {
        let row = |streams, in_flight| MemoryRow {
            mode: "normalized".into(),
            streams,
            in_flight,
            failed: streams - in_flight,
            edge_rss_idle: 10 << 20,
            edge_rss_loaded: 20 << 20,
            edge_bytes_per_stream: 40_000.0,
            nodes_rss_idle: 10 << 20,
            nodes_rss_loaded: 20 << 20,
            nodes_bytes_per_stream: 30_000.0,
            edge_threads: 3,
        };
        let report = SuiteReport {
            machine: Machine::current(),
            command: "iop-bench suite".into(),
            latency: None,
            nagle: None,
            streaming: None,
            memory: Some(MemoryResult {
                nodes: 3,
                rows: vec![row(1_000, 1_000), row(10_000, 1_024)],
            }),
            nodes: None,
            durable: None,
            tail: None,
            tenants: None,
            retention: None,
            retrieve: None,
            gateways: None,
        };
        let md = report.markdown();
        assert!(
            md.contains(
                "**normalized 10000: only 1024 of 10000 streams were in flight (8976 failed)**"
            ),
            "{md}"
        );
        assert!(!md.contains("normalized 1000: only"), "{md}");
    }

    #[test]
    fn the_nats_store_config_puts_edge_id_in_the_edge_table() {
        let mut toml = crate::deployment::edge_config_head(1, 2, 3);
        JournalStore::Nats
            .add_to_edge_config(&mut toml, Some("nats://127.0.0.1:4222"))
            .unwrap();
        assert_eq!(toml.matches("[edge]").count(), 1, "{toml}");
        assert!(
            toml.starts_with("[edge]\nedge_id = \"bench-edge\"\n"),
            "{toml}"
        );
        assert!(toml.ends_with(
            "[journal]\nstore = \"nats\"\n[journal.nats]\nservers = [\"nats://127.0.0.1:4222\"]\n"
        ));
        assert!(matches!(
            JournalStore::Nats.config_section(None),
            Err(DeployError::NoNatsUrl)
        ));
        let mut toml = crate::deployment::edge_config_head(1, 2, 3);
        JournalStore::Embedded
            .add_to_edge_config(&mut toml, None)
            .unwrap();
        assert!(!toml.contains("edge_id"));
        assert!(toml.ends_with("[journal]\nstore = \"embedded\"\n"));
    }
}
