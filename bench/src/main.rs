//! `iop-bench`: the load generator and the end-to-end benchmark suite.

use iop_edge::config::ConfigFile as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use iop_bench::deployment::{Binaries, Deployment, JournalStore};
use iop_bench::gateways::GatewaySettings;
use iop_bench::load::{self, Durability, LoadSpec, Target};
use iop_bench::peers::{self, PeerKind};
use iop_bench::report::{LoadMode, load_table};
use iop_bench::scenario::{self, DurableSettings, LatencySettings, Machine, SuiteReport};

/// Load generator and end-to-end benchmarks of iop (docs/benchmarks.md).
#[derive(Parser)]
#[command(name = "iop-bench", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Offer load to one OpenAI-compatible endpoint and report latency
    /// percentiles, TTFT, inter-chunk gaps, throughput and errors.
    Load(LoadArgs),
    /// Run the end-to-end scenarios against a fresh loopback deployment of
    /// separate processes (mock, `iop-edge run`, `iop-node run`) and write
    /// `report.json` and `report.md`.
    Suite(Box<SuiteArgs>),
    /// The added-latency scenario with a peer gateway measured alongside
    /// iop, against the same mock (see scripts/bench-litellm).
    Peer(PeerArgs),
    /// Run an Edge in this process from a config file, as `iop-edge run
    /// --config` does, but on the system allocator (the `iop-edge` binary
    /// runs on mimalloc), so a heap profiler that hooks `malloc` sees every
    /// allocation: `heaptrack target/release/iop-bench edge-run --config
    /// edge.toml` (docs/benchmarks.md, "Why the Edge grows").
    #[command(hide = true)]
    EdgeRun {
        /// The Edge's config file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Run many Nodes in this process (used by the node-scale scenario).
    Fleet {
        /// Directory holding `fleet-node-<i>.toml` and the certificates.
        #[arg(long)]
        dir: PathBuf,
        /// Nodes to run.
        #[arg(long)]
        count: usize,
    },
}

#[derive(clap::Args)]
struct LoadArgs {
    /// Chat Completions URL.
    #[arg(long, default_value = "http://127.0.0.1:8080/v1/chat/completions")]
    url: String,
    /// `model` of every request.
    #[arg(long, default_value = "mock")]
    model: String,
    /// Environment variable holding a bearer key.
    #[arg(long)]
    key_env: Option<String>,
    /// Streamed requests (SSE).
    #[arg(long)]
    stream: bool,
    /// Ask for durable responses: `store` (`"store": true`) or
    /// `idempotency-key` (a fresh `Idempotency-Key` per request).
    #[arg(long, value_enum, default_value_t = DurableArg::No)]
    durable: DurableArg,
    /// Open loop: requests per second.
    #[arg(
        long,
        conflicts_with = "concurrency",
        required_unless_present = "concurrency"
    )]
    rate: Option<f64>,
    /// Closed loop: concurrent clients.
    #[arg(long)]
    concurrency: Option<u32>,
    /// Whole run, seconds (warm-up included).
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// Warm-up not counted, seconds.
    #[arg(long, default_value_t = 1.0)]
    warmup_s: f64,
    /// Open loop: outstanding requests before new ones count as `backlog`.
    #[arg(long, default_value_t = 4096)]
    max_in_flight: usize,
    /// Bound of one request, seconds.
    #[arg(long, default_value_t = 30.0)]
    timeout_s: f64,
    /// Label in the report.
    #[arg(long, default_value = "target")]
    label: String,
    /// Also write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ScenarioName {
    /// Added latency, non-streaming (direct vs tunnel vs normalized).
    Latency,
    /// The latency scenario against a provider with Nagle's algorithm on
    /// (a mock without `TCP_NODELAY`, as many real servers are).
    Nagle,
    /// Relayed SSE chunks per second, TTFT and chunk gaps.
    Streaming,
    /// Memory per in-flight stream.
    Memory,
    /// Many Nodes on one Edge.
    Nodes,
    /// Durable vs ephemeral responses on each journal store.
    Durable,
    /// Where the slowest non-streaming requests waited: the latency
    /// scenario's requests traced through the Edge's and the Node's spans
    /// (not in the default run: tracing costs CPU of its own).
    Tail,
    /// Tenants' limits and budgets on vs off at one rate, rounds
    /// interleaved, the counters in the embedded store and on NATS.
    Tenants,
    /// Edge memory while durable responses are retained: ephemeral and
    /// durable load at once for minutes, RSS over time.
    Retention,
    /// Edge memory under many retrieves of one large stored response.
    Retrieve,
    /// The mock alone, iop in both modes and peer gateways (Portkey,
    /// LiteLLM) in one run: one request at a time, the most requests/s
    /// with p99 under a bound, peak memory (not in the default run: the
    /// peers are installed apart).
    Gateways,
}

/// Does a suite run with `--only only` run scenario `s` (none = all but
/// the tail and gateways scenarios, which run only when named)?
fn wants(only: &[ScenarioName], s: ScenarioName) -> bool {
    if matches!(s, ScenarioName::Tail | ScenarioName::Gateways) {
        return only.contains(&s);
    }
    only.is_empty() || only.contains(&s)
}

/// A peer of the gateways scenario, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PeerArg {
    /// Portkey's open-source gateway.
    Portkey,
    /// LiteLLM's proxy.
    Litellm,
    /// No peer.
    None,
}

/// The gateways scenario's settings from the suite's flags (`bins`: this
/// build's binaries).
fn gateway_settings(
    a: &SuiteArgs,
    bins: &Binaries,
    duration: Duration,
) -> anyhow::Result<GatewaySettings> {
    let peers: Vec<PeerKind> = if a.gateway_peers.is_empty() {
        vec![PeerKind::Portkey, PeerKind::Litellm]
    } else {
        a.gateway_peers
            .iter()
            .filter_map(|p| match p {
                PeerArg::Portkey => Some(PeerKind::Portkey),
                PeerArg::Litellm => Some(PeerKind::Litellm),
                PeerArg::None => None,
            })
            .collect()
    };
    let program = |kind: PeerKind| match kind {
        PeerKind::Portkey => a.portkey_server.clone(),
        PeerKind::Litellm => a.litellm_bin.clone(),
    };
    let worker_threads = if a.gateway_worker_threads.is_empty() {
        vec![None]
    } else {
        a.gateway_worker_threads
            .iter()
            .map(|w| match w.as_str() {
                "default" => Ok(None),
                n => n.parse::<usize>().map(Some).with_context(|| {
                    format!("--gateway-worker-threads: `{n}` is neither `default` nor a number")
                }),
            })
            .collect::<anyhow::Result<_>>()?
    };
    let quic = if a.gateway_quic.is_empty() {
        vec![None]
    } else {
        a.gateway_quic
            .iter()
            .map(|q| {
                iop_bench::gateways::QuicVariant::parse(q)
                    .map_err(|e| anyhow::anyhow!("--gateway-quic: {e}"))
            })
            .collect::<anyhow::Result<_>>()?
    };
    anyhow::ensure!(
        a.gateway_p99_ms.is_finite() && a.gateway_p99_ms > 0.0,
        "--gateway-p99-ms must be > 0"
    );
    let baseline = match &a.gateway_baseline {
        Some(dir) => Some(
            Binaries::in_dir(&std::path::absolute(dir)?, bins.bench.clone())
                .context("--gateway-baseline")?,
        ),
        None => None,
    };
    Ok(GatewaySettings {
        runs: a.gateway_runs.unwrap_or(if a.quick { 1 } else { 3 }),
        duration,
        step_duration: match a.gateway_step_s {
            Some(s) => secs(s)?,
            None => duration / 2,
        },
        p99_bound: Duration::from_secs_f64(a.gateway_p99_ms / 1e3),
        max_concurrency: a.gateway_max_concurrency,
        open_rates: or_default(&a.gateway_rates, a.quick, &[1000.0], &[1000.0, 2000.0]),
        worker_threads,
        quic,
        baseline,
        peers: peers
            .into_iter()
            .map(|kind| (kind, program(kind).or_else(|| peers::default_program(kind))))
            .collect(),
        pause: iop_bench::gateways::PAUSE,
    })
}

/// How requests ask for a durable response.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DurableArg {
    /// Ephemeral: neither `store` nor an `Idempotency-Key`.
    No,
    /// `"store": true` in the body.
    Store,
    /// A fresh `Idempotency-Key` header per request.
    IdempotencyKey,
}

impl DurableArg {
    fn durability(self) -> Durability {
        match self {
            DurableArg::No => Durability::Ephemeral,
            DurableArg::Store => Durability::Store,
            DurableArg::IdempotencyKey => Durability::IdempotencyKey,
        }
    }
}

#[derive(clap::Args)]
struct SuiteArgs {
    /// Where report.json and report.md go.
    #[arg(long, default_value = "target/bench-results")]
    out: PathBuf,
    /// Working directory for configs, certificates and logs.
    #[arg(long, default_value = "target/bench-work")]
    work: PathBuf,
    /// Scenarios to run, comma-separated (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<ScenarioName>,
    /// A short version of everything (seconds instead of minutes).
    #[arg(long)]
    quick: bool,
    /// Open-loop rates of the latency and nagle scenarios.
    #[arg(long, value_delimiter = ',')]
    rates: Vec<f64>,
    /// Closed-loop concurrencies of the latency and nagle scenarios
    /// (saturation).
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<u32>,
    /// Closed-loop concurrencies of the streaming scenario.
    #[arg(long, value_delimiter = ',')]
    stream_concurrency: Vec<u32>,
    /// Seconds per load run.
    #[arg(long)]
    duration_s: Option<f64>,
    /// In-flight stream levels of the memory scenario.
    #[arg(long, value_delimiter = ',')]
    memory_levels: Vec<usize>,
    /// Node processes of the memory scenario (a QUIC connection carries at
    /// most 4,096 concurrent streams).
    #[arg(long, default_value_t = 3)]
    memory_nodes: usize,
    /// Streams opened per second in the memory scenario.
    #[arg(long, default_value_t = 1000.0)]
    memory_ramp_per_s: f64,
    /// Nodes of the node-scale scenario.
    #[arg(long)]
    fleet_nodes: Option<usize>,
    /// Idle CPU window of the node-scale scenario, seconds.
    #[arg(long)]
    idle_window_s: Option<f64>,
    /// Heartbeat interval of the node-scale scenario, ms (default: the
    /// configured default, 30000).
    #[arg(long)]
    heartbeat_ms: Option<u64>,
    /// Journal stores of the durable scenario, one deployment each
    /// (default: embedded,memory,nats; `nats` starts a local `nats-server
    /// -js`, from the Debian package `nats-server`).
    #[arg(long, value_enum, value_delimiter = ',')]
    journal_stores: Vec<JournalStore>,
    /// Closed-loop stream concurrencies of the durable scenario.
    #[arg(long, value_delimiter = ',')]
    durable_stream_concurrency: Vec<u32>,
    /// Open-loop rates of the durable scenario's non-streamed calls.
    #[arg(long, value_delimiter = ',')]
    durable_rates: Vec<f64>,
    /// How the durable scenario's durable requests ask for it.
    #[arg(long, value_enum, default_value_t = DurableArg::IdempotencyKey)]
    durable_via: DurableArg,
    /// Stores of the tenants' counters in the tenants scenario, one
    /// deployment each (default: embedded,nats).
    #[arg(long, value_enum, value_delimiter = ',')]
    tenant_stores: Vec<JournalStore>,
    /// Open-loop rate of the tenants scenario.
    #[arg(long, default_value_t = 1000.0)]
    tenant_rate: f64,
    /// Rounds of the tenants scenario (each runs both arms and the direct
    /// baseline; the arms alternate which goes first).
    #[arg(long)]
    tenant_rounds: Option<usize>,
    /// Runs of the tenants scenario with the two arms' requests
    /// alternating one by one (`--tenant-rate` in all, half each).
    #[arg(long)]
    tenant_alternating_rounds: Option<usize>,
    /// Journal stores of the retention scenario (default: embedded,nats).
    #[arg(long, value_enum, value_delimiter = ',')]
    retention_stores: Vec<JournalStore>,
    /// Ephemeral requests per second of the retention scenario.
    #[arg(long, default_value_t = 600.0)]
    retention_ephemeral_rate: f64,
    /// Durable requests per second of the retention scenario.
    #[arg(long, default_value_t = 100.0)]
    retention_durable_rate: f64,
    /// Seconds of load of the retention scenario.
    #[arg(long)]
    retention_s: Option<f64>,
    /// Seconds of the retention scenario left out of the slope.
    #[arg(long)]
    retention_warmup_s: Option<f64>,
    /// Also run each retention store with ephemeral requests only, at the
    /// same total rate (a control).
    #[arg(long)]
    retention_control: bool,
    /// The retrieve scenario's journal store.
    #[arg(long, value_enum, default_value_t = JournalStore::Embedded)]
    retrieve_store: JournalStore,
    /// Tokens of the retrieve scenario's stored answer (about 9 bytes of
    /// text each; at most 100,000, the mock's bound).
    #[arg(long)]
    retrieve_tokens: Option<u32>,
    /// KiB of input text of the retrieve scenario's stored request (the
    /// mock takes request bodies up to 2 MiB).
    #[arg(long)]
    retrieve_input_kib: Option<usize>,
    /// Retrieves of the retrieve scenario.
    #[arg(long)]
    retrieves: Option<u64>,
    /// Concurrent clients of the retrieve scenario.
    #[arg(long, default_value_t = 32)]
    retrieve_concurrency: u32,
    /// The Edge's `request_memory_bytes` in the retrieve scenario, MiB
    /// (default: the Edge's default, 1024).
    #[arg(long)]
    retrieve_memory_mib: Option<u64>,
    /// Runs of the gateways scenario (each figure: the median of them).
    #[arg(long)]
    gateway_runs: Option<usize>,
    /// Seconds of each step of the gateways scenario's rate search
    /// (default: half of --duration-s).
    #[arg(long)]
    gateway_step_s: Option<f64>,
    /// The p99 the gateways scenario's rate search stays under, ms.
    #[arg(long, default_value_t = 20.0)]
    gateway_p99_ms: f64,
    /// The most clients the gateways scenario's rate search tries.
    #[arg(long, default_value_t = 256)]
    gateway_max_concurrency: u32,
    /// Open-loop rates of the gateways scenario, offered to each path that
    /// sustained them in the rate search (default: 1000,2000).
    #[arg(long, value_delimiter = ',')]
    gateway_rates: Vec<f64>,
    /// Peers of the gateways scenario (default: portkey,litellm; `none`
    /// measures iop alone).
    #[arg(long, value_delimiter = ',')]
    gateway_peers: Vec<PeerArg>,
    /// One iop deployment per value, each with this `[runtime]
    /// worker_threads` (`default`: no `[runtime]`), measured side by side
    /// in the gateways scenario (default: `default`).
    #[arg(long, value_delimiter = ',')]
    gateway_worker_threads: Vec<String>,
    /// One iop deployment per value, each with this `[quic]` table
    /// (`default`: none; else `name=value` settings joined by `+`, e.g.
    /// `ack_eliciting_threshold=0+max_ack_delay_ms=1`), measured side by
    /// side in the gateways scenario (default: `default`).
    #[arg(long, value_delimiter = ',')]
    gateway_quic: Vec<String>,
    /// A directory holding another build's `iop-edge` and `iop-node` (for
    /// example copies made before a change): the gateways scenario deploys
    /// them too, labelled `(baseline)`, and measures them in the same run.
    #[arg(long)]
    gateway_baseline: Option<PathBuf>,
    /// Portkey's `start-server.js` (default: where scripts/portkey-gateway
    /// installs it).
    #[arg(long)]
    portkey_server: Option<PathBuf>,
    /// LiteLLM's `litellm` command (default: the one scripts/provider-venv
    /// builds).
    #[arg(long)]
    litellm_bin: Option<PathBuf>,
    /// The `iop-edge` binary (default: beside this one).
    #[arg(long)]
    edge_bin: Option<PathBuf>,
    /// The `iop-node` binary (default: beside this one).
    #[arg(long)]
    node_bin: Option<PathBuf>,
}

#[derive(clap::Args)]
struct PeerArgs {
    /// The peer's name in the table.
    #[arg(long, default_value = "litellm")]
    name: String,
    /// The peer's Chat Completions URL.
    #[arg(long)]
    url: String,
    /// The model the peer routes to the mock.
    #[arg(long, default_value = "mock")]
    model: String,
    /// Environment variable holding the peer's key.
    #[arg(long)]
    key_env: Option<String>,
    /// The running mock the peer points at (iop uses it too).
    #[arg(long)]
    mock_addr: SocketAddr,
    /// The peer's process: its CPU time per request is reported beside
    /// iop's (closed-loop runs).
    #[arg(long)]
    peer_pid: Option<u32>,
    /// Open-loop rates.
    #[arg(long, value_delimiter = ',', default_value = "100,250,500,1000")]
    rates: Vec<f64>,
    /// Closed-loop concurrencies (saturation).
    #[arg(long, value_delimiter = ',', default_value = "16")]
    concurrency: Vec<u32>,
    /// Seconds per load run.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// Where report.json and report.md go.
    #[arg(long, default_value = "target/bench-results/peer")]
    out: PathBuf,
    /// Working directory.
    #[arg(long, default_value = "target/bench-work")]
    work: PathBuf,
}

fn secs(s: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(s.is_finite() && s > 0.0, "durations must be > 0");
    Ok(Duration::from_secs_f64(s))
}

fn key_from(env: Option<&String>) -> anyhow::Result<Option<String>> {
    env.map(|var| {
        std::env::var(var).with_context(|| format!("environment variable `{var}` is not set"))
    })
    .transpose()
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

async fn run_load(a: LoadArgs) -> anyhow::Result<()> {
    let mode = match (a.rate, a.concurrency) {
        (Some(r), _) => LoadMode::Open { rate_per_s: r },
        (None, Some(c)) => LoadMode::Closed { concurrency: c },
        (None, None) => anyhow::bail!("--rate or --concurrency is required"),
    };
    let target = Target {
        url: a.url,
        api_key: key_from(a.key_env.as_ref())?,
        model: a.model,
        durability: a.durable.durability(),
        headers: Vec::new(),
    };
    let mut spec = LoadSpec::new(&a.label, target, a.stream, mode, secs(a.duration_s)?);
    spec.warmup = Duration::from_secs_f64(a.warmup_s.max(0.0));
    spec.max_in_flight = a.max_in_flight;
    spec.request_timeout = secs(a.timeout_s)?;
    let report = load::run(&load::client()?, &spec).await?;
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(path) = &a.json {
        std::fs::write(path, &json).with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{json}");
    println!();
    print!("{}", load_table(std::slice::from_ref(&report)));
    Ok(())
}

/// The tenants and retention scenarios' stores unless `--tenant-stores`
/// or `--retention-stores` says otherwise: the embedded store and NATS.
const TENANT_STORES: &[JournalStore] = &[JournalStore::Embedded, JournalStore::Nats];

/// The durable scenario's stores unless `--journal-stores` says otherwise
/// (with `--quick` too): NATS is measured against the embedded store in
/// the same run.
const DURABLE_STORES: &[JournalStore] = &[
    JournalStore::Embedded,
    JournalStore::Memory,
    JournalStore::Nats,
];

fn or_default<T: Clone>(
    given: &[T],
    quick: bool,
    quick_default: &[T],
    full_default: &[T],
) -> Vec<T> {
    if !given.is_empty() {
        given.to_vec()
    } else if quick {
        quick_default.to_vec()
    } else {
        full_default.to_vec()
    }
}

async fn run_suite(a: SuiteArgs) -> anyhow::Result<()> {
    let mut bins = Binaries::beside_current_exe()?;
    if let Some(p) = &a.edge_bin {
        bins.edge = std::path::absolute(p)?;
    }
    if let Some(p) = &a.node_bin {
        bins.node = std::path::absolute(p)?;
    }
    let want = |s: ScenarioName| wants(&a.only, s);
    let q = a.quick;
    let duration = secs(a.duration_s.unwrap_or(if q { 3.0 } else { 10.0 }))?;
    let work = std::path::absolute(&a.work)?;
    // Checked before any scenario runs (a bad --gateway-baseline fails at
    // once).
    let gateways = if want(ScenarioName::Gateways) {
        Some(gateway_settings(&a, &bins, duration)?)
    } else {
        None
    };
    let mut report = SuiteReport {
        machine: Machine::current(),
        command: command_line(),
        latency: None,
        nagle: None,
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
    let latency_settings = LatencySettings {
        rates: or_default(
            &a.rates,
            q,
            &[200.0, 1000.0],
            &[250.0, 500.0, 1000.0, 2000.0, 3000.0],
        ),
        concurrencies: or_default(&a.concurrency, q, &[8], &[16]),
        duration,
        peer_pids: Vec::new(),
    };
    if want(ScenarioName::Latency) || want(ScenarioName::Nagle) || want(ScenarioName::Streaming) {
        let mut spec = scenario::latency_deployment(&work, None);
        if want(ScenarioName::Nagle) {
            spec.mocks.push(scenario::nagle_mock());
        }
        let mut d = Deployment::start(&bins, &spec).await?;
        if want(ScenarioName::Latency) {
            report.latency = Some(scenario::latency(&d, &latency_settings, &[]).await?);
        }
        if want(ScenarioName::Nagle) {
            let nagle = scenario::latency_to(&d, scenario::NAGLE_MOCK, &latency_settings, &[]);
            report.nagle = Some(nagle.await?);
        }
        if want(ScenarioName::Streaming) {
            let cs = or_default(&a.stream_concurrency, q, &[8], &[1, 16, 64]);
            report.streaming = Some(scenario::streaming(&d, &cs, 200.0, duration).await?);
        }
        d.check_alive()?;
        d.stop().await;
    }
    if want(ScenarioName::Memory) {
        let levels = or_default(&a.memory_levels, q, &[500], &[1000, 10_000]);
        report.memory = Some(
            scenario::memory(&bins, &work, a.memory_nodes, &levels, a.memory_ramp_per_s).await?,
        );
    }
    if want(ScenarioName::Durable) {
        anyhow::ensure!(
            a.durable_via != DurableArg::No,
            "--durable-via must ask for durable responses"
        );
        let settings = DurableSettings {
            stores: or_default(&a.journal_stores, q, DURABLE_STORES, DURABLE_STORES),
            stream_concurrencies: or_default(&a.durable_stream_concurrency, q, &[8], &[1, 16, 64]),
            rates: or_default(&a.durable_rates, q, &[200.0], &[250.0, 500.0, 1000.0]),
            duration,
            durability: a.durable_via.durability(),
        };
        report.durable = Some(scenario::durable(&bins, &work, &settings).await?);
    }
    if want(ScenarioName::Tail) {
        report.tail = Some(scenario::tail(&bins, &work, &latency_settings.rates, duration).await?);
    }
    if want(ScenarioName::Tenants) {
        let settings = iop_bench::tenants::TenantSettings {
            stores: or_default(&a.tenant_stores, q, TENANT_STORES, TENANT_STORES),
            rate_per_s: a.tenant_rate,
            round: duration,
            rounds: a.tenant_rounds.unwrap_or(if q { 2 } else { 6 }),
            alternating_rounds: a.tenant_alternating_rounds.unwrap_or(if q { 2 } else { 6 }),
        };
        report.tenants = Some(iop_bench::tenants::tenants(&bins, &work, &settings).await?);
    }
    if want(ScenarioName::Retention) {
        let settings = iop_bench::durable_memory::RetentionSettings {
            stores: or_default(&a.retention_stores, q, TENANT_STORES, TENANT_STORES),
            ephemeral_rate: a.retention_ephemeral_rate,
            durable_rate: a.retention_durable_rate,
            duration: secs(a.retention_s.unwrap_or(if q { 20.0 } else { 120.0 }))?,
            warmup: secs(a.retention_warmup_s.unwrap_or(if q { 5.0 } else { 30.0 }))?,
            sample_every: Duration::from_secs(1),
            durability: a.durable_via.durability(),
            control: a.retention_control,
        };
        anyhow::ensure!(
            settings.durability != Durability::Ephemeral,
            "--durable-via must ask for durable responses"
        );
        report.retention =
            Some(iop_bench::durable_memory::retention(&bins, &work, &settings).await?);
    }
    if want(ScenarioName::Retrieve) {
        let settings = iop_bench::durable_memory::RetrieveSettings {
            store: a.retrieve_store,
            tokens: a
                .retrieve_tokens
                .unwrap_or(if q { 20_000 } else { 100_000 }),
            input_bytes: a.retrieve_input_kib.unwrap_or(if q { 64 } else { 1024 }) * 1024,
            retrieves: a.retrieves.unwrap_or(if q { 500 } else { 20_000 }),
            concurrency: a.retrieve_concurrency,
            request_memory_bytes: a.retrieve_memory_mib.map(|m| m * 1024 * 1024),
        };
        report.retrieve = Some(iop_bench::durable_memory::retrieve(&bins, &work, &settings).await?);
    }
    if let Some(settings) = gateways {
        report.gateways = Some(iop_bench::gateways::gateways(&bins, &work, &settings).await?);
    }
    if want(ScenarioName::Nodes) {
        let count = a.fleet_nodes.unwrap_or(if q { 50 } else { 200 });
        let window = secs(a.idle_window_s.unwrap_or(if q { 5.0 } else { 60.0 }))?;
        report.nodes = Some(scenario::nodes(&bins, &work, count, window, a.heartbeat_ms).await?);
    }
    let (json, md) = report.write(&a.out)?;
    print!("{}", report.markdown());
    eprintln!("wrote {} and {}", json.display(), md.display());
    Ok(())
}

async fn run_peer(a: PeerArgs) -> anyhow::Result<()> {
    let bins = Binaries::beside_current_exe()?;
    let work = std::path::absolute(&a.work)?;
    let mut spec = scenario::latency_deployment(&work, Some(a.mock_addr));
    spec.dir = work.join("peer");
    let d = Deployment::start(&bins, &spec).await?;
    let peer = Target {
        url: a.url,
        api_key: key_from(a.key_env.as_ref())?,
        model: a.model,
        durability: Durability::Ephemeral,
        headers: Vec::new(),
    };
    let settings = LatencySettings {
        rates: a.rates,
        concurrencies: a.concurrency,
        duration: secs(a.duration_s)?,
        peer_pids: a
            .peer_pid
            .map(|pid| (a.name.clone(), pid))
            .into_iter()
            .collect(),
    };
    let latency = scenario::latency(&d, &settings, &[(a.name, peer)]).await?;
    d.stop().await;
    let report = SuiteReport {
        machine: Machine::current(),
        command: command_line(),
        latency: Some(latency),
        nagle: None,
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
    let (json, md) = report.write(&a.out)?;
    print!("{}", report.markdown());
    eprintln!("wrote {} and {}", json.display(), md.display());
    Ok(())
}

/// `iop-bench edge-run`: an Edge in this process until SIGINT/SIGTERM.
async fn edge_run(config: &std::path::Path) -> anyhow::Result<()> {
    let env = iop_transport::environment::Environment::from_process();
    let config = iop_edge::config::EdgeConfig::load_in(Some(config), &env)?;
    let edge = iop_edge::server::RunningEdge::start(config).await?;
    iop_transport::signals::shutdown_signal().await;
    edge.shutdown().await;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        match cli.command {
            Command::Load(a) => run_load(a).await,
            Command::Suite(a) => run_suite(*a).await,
            Command::Peer(a) => run_peer(a).await,
            Command::EdgeRun { config } => {
                iop_transport::logging::init(iop_transport::logging::LogFormat::Text);
                edge_run(&config).await
            }
            Command::Fleet { dir, count } => {
                iop_transport::logging::init(iop_transport::logging::LogFormat::Text);
                iop_bench::fleet::run(&dir, count).await
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suite(args: &[&str]) -> SuiteArgs {
        let cli = Cli::try_parse_from(["iop-bench", "suite"].iter().chain(args)).unwrap();
        match cli.command {
            Command::Suite(a) => *a,
            _ => unreachable!("a suite command"),
        }
    }

    fn bins() -> Binaries {
        Binaries {
            edge: "iop-edge".into(),
            node: "iop-node".into(),
            bench: "iop-bench".into(),
        }
    }

    /// `--gateway-baseline DIR` deploys the `iop-edge` and `iop-node` in
    /// DIR; a directory without both, or with one not executable, is
    /// refused with an error naming it.
    #[test]
    fn a_gateway_baseline_needs_both_binaries_executable() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_owned();
        let settings = |d: &str| {
            gateway_settings(
                &suite(&["--gateway-baseline", d]),
                &bins(),
                Duration::from_secs(1),
            )
        };
        let err = format!("{:#}", settings(&d).unwrap_err());
        assert!(
            err.contains("--gateway-baseline") && err.contains(&d),
            "{err}"
        );
        assert!(err.contains("iop-edge"), "{err}");
        let exe = |name: &str, mode: u32| {
            let p = dir.path().join(name);
            std::fs::write(&p, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        exe("iop-edge", 0o755);
        let err = format!("{:#}", settings(&d).unwrap_err());
        assert!(err.contains(&d) && err.contains("iop-node"), "{err}");
        exe("iop-node", 0o644);
        let err = format!("{:#}", settings(&d).unwrap_err());
        assert!(
            err.contains(&d) && err.contains("iop-node is not executable"),
            "{err}"
        );
        exe("iop-node", 0o755);
        let baseline = settings(&d).unwrap().baseline.expect("a baseline");
        assert_eq!(baseline.edge, dir.path().join("iop-edge"));
        assert_eq!(baseline.node, dir.path().join("iop-node"));
        assert_eq!(baseline.bench, bins().bench);
        let missing = dir.path().join("absent");
        let err = format!("{:#}", settings(missing.to_str().unwrap()).unwrap_err());
        assert!(
            err.contains("absent") && err.contains("not a directory"),
            "{err}"
        );
        assert!(
            gateway_settings(&suite(&[]), &bins(), Duration::from_secs(1))
                .unwrap()
                .baseline
                .is_none()
        );
    }

    fn only(args: &[&str]) -> Vec<ScenarioName> {
        let cli = Cli::try_parse_from(["iop-bench", "suite"].iter().chain(args)).unwrap();
        match cli.command {
            Command::Suite(a) => a.only,
            _ => unreachable!("a suite command"),
        }
    }

    #[test]
    fn only_selects_scenarios_and_none_selects_all() {
        use ScenarioName::*;
        let all = [
            Latency, Nagle, Streaming, Memory, Nodes, Durable, Tenants, Retention, Retrieve,
        ];
        // The default full run includes every scenario, nagle too.
        assert!(all.iter().all(|&s| wants(&only(&[]), s)));
        let nagle = only(&["--only", "nagle"]);
        assert_eq!(nagle, [Nagle]);
        assert!(wants(&nagle, Nagle) && !wants(&nagle, Latency));
        assert_eq!(only(&["--only", "latency,nagle"]), [Latency, Nagle]);
        assert_eq!(
            only(&["--only", "latency", "--only", "nagle"]),
            [Latency, Nagle]
        );
        assert!(Cli::try_parse_from(["iop-bench", "suite", "--only", "nagel"]).is_err());
        // The tail and gateways scenarios run only when named.
        assert!(!wants(&only(&[]), Tail));
        assert!(wants(&only(&["--only", "latency,tail"]), Tail));
        assert!(!wants(&only(&[]), Gateways));
        assert!(wants(&only(&["--only", "gateways"]), Gateways));
    }
}
