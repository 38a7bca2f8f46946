//! # iop-attack: the hostile-input attack suite (SPEC §7, R-LIM-1..6)
//!
//! Starts a real deployment on loopback (an `iop-edge` process with its
//! default limits, an `iop-node` process in front of a mock provider, and
//! an in-process hostile node speaking the wire protocol with its own
//! certificate), then runs each attack for a bounded time while a
//! legitimate client sends requests at a fixed rate. For each attack it
//! reports the legitimate client's success rate and latency percentiles
//! and the Edge's peak RSS, and fails (exit 1) when the success rate falls
//! under `--min-success` or the RSS goes over `--max-rss-mib`, or when an
//! attack saw an answer it must never get (a violation: a 5xx for a
//! malformed id, a second Edge running with another's `edge_id`, a
//! failover that waits for nothing).
//!
//! The Edge keeps durable responses on a real `nats-server` when one is
//! installed (`$NATS_SERVER`, `PATH`, `/usr/sbin`), as a shared
//! deployment does; else in its embedded store, and `duplicate_edge_id`
//! and `store_outage_midstream` are skipped. `--store embedded` runs the
//! embedded store with a server installed.
//!
//! `scripts/attack` builds the binaries and runs it.

mod evil_node;
mod flood;
mod reads;
mod store;
mod tenant;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Parser;
use iop_bench::deployment::{
    API_KEY, BENCH_EDGE_ID, Binaries, JournalStore, NatsServer, Proc, edge_config_head,
    free_tcp_port, free_udp_port, nats_server_binary, node_config, write_pki,
};
use store::StoreControl;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// The attacker's own valid API key (a tenant gone rogue).
pub const ATTACKER_KEY: &str = "sk-attacker-0123456789abcdef";

#[derive(Debug, Parser)]
#[command(about = "Run the hostile-input attack suite against a live Edge + Node on loopback")]
struct Cli {
    /// Working directory (emptied first): certificates, configs, logs.
    #[arg(long, default_value = "target/attack")]
    dir: PathBuf,
    /// Seconds each attack (and the baseline) runs.
    #[arg(long, default_value_t = 15)]
    seconds: u64,
    /// Legitimate requests per second.
    #[arg(long, default_value_t = 20)]
    rate: u32,
    /// Run only these attacks (by name); all when empty.
    #[arg(long)]
    only: Vec<String>,
    /// Fail when the legitimate success rate is under this (percent).
    #[arg(long, default_value_t = 99.0)]
    min_success: f64,
    /// Fail when the Edge's peak RSS is over this (MiB).
    #[arg(long, default_value_t = 1024)]
    max_rss_mib: u64,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The Edge's journal store: `nats` (the default when `nats-server`
    /// is installed) or `embedded`.
    #[arg(long, value_enum)]
    store: Option<JournalStore>,
}

/// The attacks, in the order they run.
const ATTACKS: &[&str] = &[
    "idle_tcp_5000",
    "slowloris_headers",
    "half_http2_prefaces",
    "junk_bodies_8mib_x200",
    "stale_ready_flood",
    "maximal_tunnel_heads",
    "duplicate_node_certificate",
    "malformed_ids",
    "duplicate_edge_id",
    "failover_nowhere",
    "background_flood",
    "parked_report_flood",
    "cancel_storm",
    "ids_in_logs",
    "store_down_at_start",
    "store_outage_midstream",
    "long_chain_reads",
    "durable_write_burst",
];

/// The running deployment.
struct Rig {
    dir: PathBuf,
    bins: Binaries,
    edge: Proc,
    _mock: Proc,
    _sick_mock: Proc,
    _slow_mock: Proc,
    _endless_mock: Proc,
    /// The endless provider's address (its `/mock/stats`).
    endless_addr: SocketAddr,
    _node: Proc,
    /// The journal's store, and how to take it away and give it back.
    store: Arc<StoreControl>,
    http: SocketAddr,
    quic: SocketAddr,
    /// Edge processes started so far (each restart's log is its own).
    edge_starts: u32,
}

/// What one attack did to the legitimate client and the Edge.
#[derive(Debug, Clone)]
struct Row {
    attack: String,
    sent: u64,
    ok: u64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    peak_rss_mib: f64,
    attacker: String,
    first_errors: Vec<String>,
    /// Answers the attack must never get (the first few).
    violations: Vec<String>,
    violation_count: u64,
}

impl Row {
    fn success_pct(&self) -> f64 {
        if self.sent == 0 {
            0.0
        } else {
            100.0 * self.ok as f64 / self.sent as f64
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let bins = Binaries::beside_current_exe()?;
    let store = match cli.store {
        Some(JournalStore::Memory) => bail!("--store is nats or embedded"),
        Some(store) => store,
        None if nats_server_binary().is_some() => JournalStore::Nats,
        None => JournalStore::Embedded,
    };
    let mut rig = Rig::start(bins, &cli.dir, store).await?;
    eprintln!("journal store: {}", rig.store.as_str());
    let duration = Duration::from_secs(cli.seconds);
    let mut rows = vec![attack_row(&mut rig, "baseline", duration, cli.rate).await?];
    print_row(&rows[0]);
    for name in ATTACKS {
        if !cli.only.is_empty() && !cli.only.iter().any(|o| o == name) {
            continue;
        }
        let row = attack_row(&mut rig, name, duration, cli.rate).await?;
        print_row(&row);
        rows.push(row);
        // Let closed connections and evicted state settle.
        tokio::time::sleep(Duration::from_secs(2)).await;
        rig.edge.check_alive()?;
    }
    println!();
    println!("{}", markdown_table(&rows));
    if let Some(path) = &cli.json {
        std::fs::write(path, json(&rows).to_string())?;
    }
    let mut failed = Vec::new();
    for row in &rows {
        if row.success_pct() < cli.min_success {
            failed.push(format!(
                "{}: legitimate success {:.2} % < {}",
                row.attack,
                row.success_pct(),
                cli.min_success
            ));
        }
        if row.violation_count > 0 {
            failed.push(format!(
                "{}: {} violations, e.g. {}",
                row.attack,
                row.violation_count,
                row.violations.join(" | ")
            ));
        }
        if row.peak_rss_mib > cli.max_rss_mib as f64 {
            failed.push(format!(
                "{}: Edge RSS {:.0} MiB > {}",
                row.attack, row.peak_rss_mib, cli.max_rss_mib
            ));
        }
    }
    if !failed.is_empty() {
        bail!("attacks not withstood:\n  {}", failed.join("\n  "));
    }
    Ok(())
}

fn print_row(row: &Row) {
    eprintln!(
        "{:<28} legit {}/{} ({:.2} %) p50 {:.1} ms p99 {:.1} ms max {:.1} ms, edge rss {:.0} MiB; attacker: {}{}",
        row.attack,
        row.ok,
        row.sent,
        row.success_pct(),
        row.p50_ms,
        row.p99_ms,
        row.max_ms,
        row.peak_rss_mib,
        row.attacker,
        if row.first_errors.is_empty() {
            String::new()
        } else {
            format!("; errors: {}", row.first_errors.join(" | "))
        }
    );
    if row.violation_count > 0 {
        eprintln!(
            "{:<28} VIOLATED {} times: {}",
            "",
            row.violation_count,
            row.violations.join(" | ")
        );
    }
}

fn markdown_table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| attack | legitimate success | p50 ms | p99 ms | max ms | Edge peak RSS MiB | attacker saw | violations |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {}/{} ({:.2} %) | {:.1} | {:.1} | {:.1} | {:.0} | {} | {} |\n",
            r.attack,
            r.ok,
            r.sent,
            r.success_pct(),
            r.p50_ms,
            r.p99_ms,
            r.max_ms,
            r.peak_rss_mib,
            r.attacker,
            if r.violation_count == 0 {
                "0".to_owned()
            } else {
                format!("{}: {}", r.violation_count, r.violations.join("; "))
            }
        ));
    }
    out
}

fn json(rows: &[Row]) -> serde_json::Value {
    serde_json::Value::Array(
        rows.iter()
            .map(|r| {
                serde_json::json!({
                    "attack": r.attack,
                    "sent": r.sent,
                    "ok": r.ok,
                    "success_pct": r.success_pct(),
                    "p50_ms": r.p50_ms,
                    "p99_ms": r.p99_ms,
                    "max_ms": r.max_ms,
                    "edge_peak_rss_mib": r.peak_rss_mib,
                    "attacker": r.attacker,
                    "first_errors": r.first_errors,
                    "violations": r.violation_count,
                    "first_violations": r.violations,
                })
            })
            .collect(),
    )
}

impl Rig {
    async fn start(bins: Binaries, dir: &Path, journal: JournalStore) -> anyhow::Result<Self> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir)?;
        let dir = dir.canonicalize()?;
        write_pki(&dir, &["n1".to_owned(), "evil".to_owned()])?;
        write_secret(&dir.join("attacker-key"), ATTACKER_KEY)?;
        let mock_addr = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
        let mock = Proc::spawn(
            "mock",
            &bins.node,
            &[
                "mock-provider".into(),
                "--listen".into(),
                mock_addr.to_string(),
                "--tokens".into(),
                "8".into(),
                "--tps".into(),
                "0".into(),
            ],
            &dir,
            false,
        )?;
        // A provider slow enough for a durable stream to be in flight when
        // the store goes away (R-JRN-6).
        let slow_addr = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
        let slow_mock = Proc::spawn(
            "mock-slow",
            &bins.node,
            &[
                "mock-provider".into(),
                "--listen".into(),
                slow_addr.to_string(),
                "--tokens".into(),
                "40".into(),
                "--tps".into(),
                "20".into(),
            ],
            &dir,
            false,
        )?;
        // A provider that answers every request 503 (R-FAIL-1).
        let sick_addr = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
        let sick_mock = Proc::spawn(
            "mock-sick",
            &bins.node,
            &[
                "mock-provider".into(),
                "--listen".into(),
                sick_addr.to_string(),
                "--http-error".into(),
                "503".into(),
            ],
            &dir,
            false,
        )?;
        // A provider whose answers take minutes: runs still going when
        // they are cancelled.
        let endless_addr = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
        let endless_mock = Proc::spawn(
            "mock-endless",
            &bins.node,
            &[
                "mock-provider".into(),
                "--listen".into(),
                endless_addr.to_string(),
                "--tokens".into(),
                "100000".into(),
                "--tps".into(),
                "200".into(),
            ],
            &dir,
            false,
        )?;
        let store = match journal {
            JournalStore::Nats => {
                let nats = NatsServer::start(&dir).await?;
                StoreControl::Nats {
                    addr: nats.addr,
                    dir: dir.clone(),
                    proc: Box::new(tokio::sync::Mutex::new(Some(nats.proc))),
                }
            }
            _ => StoreControl::Embedded {
                file: dir.join("edge-state").join("journal.redb"),
            },
        };
        let quic = SocketAddr::from(([127, 0, 0, 1], free_udp_port()?));
        let http = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
        let nats_url = store.nats_url();
        std::fs::write(
            dir.join("edge.toml"),
            edge_toml(quic, http, "edge-state", nats_url.as_deref())?,
        )?;
        let edge = Proc::spawn(
            "edge",
            &bins.edge,
            &["run".into(), "--config".into(), "edge.toml".into()],
            &dir,
            false,
        )?;
        std::fs::write(
            dir.join("node-n1.toml"),
            node_config(
                "n1",
                quic,
                256,
                &format!(
                    "[[providers]]\nadapter = \"openai\"\ntarget = \"m\"\nbase_url = \"http://{mock_addr}\"\n\
                     [[providers]]\nadapter = \"openai\"\ntarget = \"sick\"\nbase_url = \"http://{sick_addr}\"\n\
                     [[providers]]\nadapter = \"openai\"\ntarget = \"{}\"\nbase_url = \"http://{slow_addr}\"\n\
                     [[providers]]\nadapter = \"openai\"\ntarget = \"endless\"\nbase_url = \"http://{endless_addr}\"\n",
                    store::SLOW_TARGET
                ),
            ),
        )?;
        let node = Proc::spawn(
            "node-n1",
            &bins.node,
            &["run".into(), "--config".into(), "node-n1.toml".into()],
            &dir,
            false,
        )?;
        let rig = Self {
            dir,
            bins,
            edge,
            _mock: mock,
            _sick_mock: sick_mock,
            _slow_mock: slow_mock,
            _endless_mock: endless_mock,
            endless_addr,
            _node: node,
            store: Arc::new(store),
            http,
            quic,
            edge_starts: 1,
        };
        rig.wait_route().await?;
        Ok(rig)
    }

    /// Kill the Edge process and start it again with the same config.
    async fn restart_edge(&mut self) -> anyhow::Result<()> {
        self.edge_starts += 1;
        let edge = Proc::spawn(
            &format!("edge-{}", self.edge_starts),
            &self.bins.edge,
            &["run".into(), "--config".into(), "edge.toml".into()],
            &self.dir,
            false,
        )?;
        std::mem::replace(&mut self.edge, edge).stop().await;
        Ok(())
    }

    /// Until the Edge answers `/healthz`, then until a legitimate request
    /// succeeds (it needs the node connected again), bounded by `within`,
    /// or the Edge exits; how long each took.
    async fn until_served(&mut self, within: Duration) -> anyhow::Result<(Duration, Duration)> {
        let client = legit_client()?;
        let started = Instant::now();
        let mut answering = None;
        loop {
            if answering.is_none()
                && client
                    .get(format!("http://{}/healthz", self.http))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success())
            {
                answering = Some(started.elapsed());
            }
            if let Some(answering) = answering
                && legit_request(&client, self.http).await.is_ok()
            {
                return Ok((answering, started.elapsed()));
            }
            self.edge.check_alive()?;
            if started.elapsed() > within {
                bail!("no answer within {} s", within.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Until one legitimate request succeeds (bounded).
    async fn wait_route(&self) -> anyhow::Result<()> {
        let client = legit_client()?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if legit_request(&client, self.http).await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "the deployment never answered a request (logs in {})",
                    self.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The Edge's configuration: its listeners and `state_dir`, the
/// attacker's key, the legitimate route `m`, the hostile node's tunnel
/// route `evil`, the pool `fragile` of an offline provider (node `ghost`
/// never connects) and a failing one, the route `slow` of durable streams
/// long enough to be in flight when the store goes away, and the journal
/// on `nats_url` when there is one (else in the embedded file). The
/// ownership lease's TTL is 3 s (scanned every second), so an Edge
/// restarted on NATS watches its former lease for 2 s, not 10 (R-TAKE-2).
/// The journal's bounds are lowered so that one tenant can reach them: 8
/// requests of a principal reading stored responses at once (R-LIM-6), and
/// an embedded writer queue of 32 operations, 8 of one principal
/// (R-TEN-1; 4,096 and 1,024 by default, more than this rig's node can
/// fill).
fn edge_toml(
    quic: SocketAddr,
    http: SocketAddr,
    state_dir: &str,
    nats_url: Option<&str>,
) -> anyhow::Result<String> {
    let mut toml = edge_config_head(quic.port(), http.port(), 256).replace(
        "state_dir = \"edge-state\"",
        &format!("state_dir = \"{state_dir}\""),
    );
    toml.push_str(&format!(
        "[[api_keys]]\nprincipal = \"attacker\"\nkey_file = \"attacker-key\"\n\
         [[providers]]\nid = \"legit\"\nnode = \"n1\"\nadapter = \"openai\"\ntarget = \"m\"\ncapacity = 64\n\
         [[routes]]\nmodel = \"m\"\nproviders = [\"legit\"]\n\
         [[providers]]\nid = \"evil\"\nnode = \"evil\"\nadapter = \"openai\"\ntarget = \"t\"\ncapacity = 64\nmode = \"tunnel\"\n\
         [[routes]]\nmodel = \"evil\"\nproviders = [\"evil\"]\n\
         [[providers]]\nid = \"ghost\"\nnode = \"ghost\"\nadapter = \"openai\"\ntarget = \"g\"\ncapacity = 64\n\
         [[providers]]\nid = \"sick\"\nnode = \"n1\"\nadapter = \"openai\"\ntarget = \"sick\"\ncapacity = 64\n\
         [[routes]]\nmodel = \"{}\"\nproviders = [\"ghost\", \"sick\"]\n\
         [[routes]]\nmodel = \"{}\"\nproviders = [\"ghost\"]\n\
         [[providers]]\nid = \"slow\"\nnode = \"n1\"\nadapter = \"openai\"\ntarget = \"{}\"\ncapacity = 64\n\
         [[routes]]\nmodel = \"{}\"\nproviders = [\"slow\"]\n\
         [[providers]]\nid = \"endless\"\nnode = \"n1\"\nadapter = \"openai\"\ntarget = \"endless\"\ncapacity = 128\n\
         [[routes]]\nmodel = \"{}\"\nproviders = [\"endless\"]\n",
        tenant::FRAGILE_MODEL,
        tenant::OFFLINE_MODEL,
        store::SLOW_TARGET,
        store::SLOW_MODEL,
        tenant::ENDLESS_MODEL
    ));
    let store = if nats_url.is_some() {
        JournalStore::Nats
    } else {
        JournalStore::Embedded
    };
    store.add_to_edge_config(&mut toml, nats_url)?;
    Ok(toml.replace(
        "[journal]\n",
        "[journal]\nlease_ttl_ms = 3000\ntakeover_scan_interval_ms = 1000\n\
         reads_in_flight_per_principal = 8\nwriter_queue = 32\nwriter_queue_per_principal = 8\n",
    ))
}

/// Write a secret file with mode 0600 (the Edge refuses wider modes).
fn write_secret(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(text.as_bytes())
}

fn legit_client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(10))
        .build()?)
}

/// One legitimate chat request; its latency when it succeeded.
async fn legit_request(client: &reqwest::Client, http: SocketAddr) -> Result<Duration, String> {
    let started = Instant::now();
    let response = client
        .post(format!("http://{http}/v1/chat/completions"))
        .bearer_auth(API_KEY)
        .header("content-type", "application/json")
        .body(r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = response.status();
    let body = response.bytes().await.map_err(|e| format!("body: {e}"))?;
    if !status.is_success() {
        return Err(format!(
            "{status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(160)])
        ));
    }
    Ok(started.elapsed())
}

/// Counters an attack reports.
#[derive(Debug, Default)]
pub struct AttackStats {
    /// Free-form counters, by name.
    pub counters: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
    /// Answers the attack must never get: how many, and the first few.
    pub violations: std::sync::Mutex<(u64, Vec<String>)>,
}

/// Violations a row keeps the text of.
const VIOLATIONS_SHOWN: usize = 3;

impl AttackStats {
    /// Note an answer the attack must never get.
    pub fn violate(&self, what: impl Into<String>) {
        let mut v = self.violations.lock().unwrap_or_else(|e| e.into_inner());
        v.0 += 1;
        if v.1.len() < VIOLATIONS_SHOWN {
            v.1.push(what.into());
        }
    }

    fn violations(&self) -> (u64, Vec<String>) {
        self.violations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Add one to `name`.
    pub fn count(&self, name: impl Into<String>) {
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        *c.entry(name.into()).or_insert(0) += 1;
    }

    fn summary(&self) -> String {
        let c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        if c.is_empty() {
            return "-".into();
        }
        c.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Run `name` for `duration` beside the legitimate client.
async fn attack_row(
    rig: &mut Rig,
    name: &str,
    duration: Duration,
    rate: u32,
) -> anyhow::Result<Row> {
    let stats = Arc::new(AttackStats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = JoinSet::new();
    let mut extra_procs = Vec::new();
    let mut duplicate_edge: Option<Proc> = None;
    match name {
        "baseline" => {}
        "idle_tcp_5000" | "slowloris_headers" | "half_http2_prefaces" => {
            let (count, hold) = match name {
                "idle_tcp_5000" => (5000, flood::Hold::Idle),
                "slowloris_headers" => (1000, flood::Hold::Slowloris),
                _ => (1000, flood::Hold::HalfH2Preface),
            };
            flood::hold_connections(&mut attackers, rig.http, count, hold, &stop, &stats)
        }
        "junk_bodies_8mib_x200" => flood::junk_bodies(&mut attackers, rig.http, 200, &stop, &stats),
        "stale_ready_flood" => {
            let node = evil_node::EvilNode::connect(&rig.dir, rig.quic).await?;
            attackers.spawn(node.flood_stale_ready(stop.clone(), stats.clone()));
        }
        "maximal_tunnel_heads" => {
            let node = evil_node::EvilNode::connect(&rig.dir, rig.quic).await?;
            attackers.spawn(node.answer_with_maximal_heads(stop.clone(), stats.clone()));
            flood::tunnel_requests(&mut attackers, rig.http, 32, &stop, &stats);
        }
        "duplicate_node_certificate" => {
            // A second process with n1's certificate and configuration.
            let config = std::fs::read_to_string(rig.dir.join("node-n1.toml"))?
                .replace("state_dir = \"state-n1\"", "state_dir = \"state-n1-dup\"");
            std::fs::write(rig.dir.join("node-n1-dup.toml"), config)?;
            extra_procs.push(Proc::spawn(
                "node-n1-dup",
                &rig.bins.node,
                &["run".into(), "--config".into(), "node-n1-dup.toml".into()],
                &rig.dir,
                false,
            )?);
        }
        "malformed_ids" => tenant::malformed_ids(&mut attackers, rig.http, 8, &stop, &stats),
        "duplicate_edge_id" => match rig.store.nats_url() {
            // A second Edge process with the first one's edge_id on the
            // shared store (R-TAKE-2).
            Some(url) => {
                let quic = SocketAddr::from(([127, 0, 0, 1], free_udp_port()?));
                let http = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
                std::fs::write(
                    rig.dir.join("edge-dup.toml"),
                    edge_toml(quic, http, "edge-state-dup", Some(&url))?,
                )?;
                duplicate_edge = Some(Proc::spawn(
                    "edge-dup",
                    &rig.bins.edge,
                    &["run".into(), "--config".into(), "edge-dup.toml".into()],
                    &rig.dir,
                    false,
                )?);
            }
            None => stats.count("skipped: no nats-server"),
        },
        "failover_nowhere" => {
            tenant::failover_nowhere(&mut attackers, rig.http, 4, &stop, &stats);
        }
        "background_flood" => {
            tenant::background_flood(&mut attackers, rig.http, 64, &stop, &stats);
        }
        "parked_report_flood" => {
            attackers.spawn(evil_node::EvilNode::flood_parked_reports(
                rig.dir.clone(),
                rig.quic,
                stop.clone(),
                stats.clone(),
            ));
        }
        "cancel_storm" => {
            tenant::cancel_storm(
                &mut attackers,
                rig.http,
                rig.endless_addr,
                16,
                &stop,
                &stats,
            );
        }
        "ids_in_logs" => {
            tenant::ids_in_logs(
                &mut attackers,
                rig.http,
                rig.dir.join("edge.log"),
                8,
                &stop,
                &stats,
            );
        }
        "long_chain_reads" => {
            reads::long_chain_reads(&mut attackers, rig.http, 256, &stop, &stats).await;
        }
        "durable_write_burst" => {
            reads::durable_write_burst(&mut attackers, rig.http, 64, &stop, &stats);
        }
        "store_down_at_start" => {
            // R-JRN-6: the Edge restarted while its store is away.
            rig.store.down().await?;
            rig.restart_edge().await?;
            match rig.until_served(Duration::from_secs(20)).await {
                Ok((answering, serving)) => {
                    stats.count(format!(
                        "Edge answering {:.1} s and serving chat {:.1} s (its node back) after its start with the store away",
                        answering.as_secs_f64(),
                        serving.as_secs_f64()
                    ));
                    store::durable_while_store_away(
                        &mut attackers,
                        rig.http,
                        rig.store.clone(),
                        &stop,
                        &stats,
                    );
                }
                Err(e) => {
                    stats.violate(format!("the Edge did not serve with its store away: {e:#}"));
                    // Put the rig back for the rows after this one.
                    rig.store.up().await?;
                    rig.restart_edge().await?;
                    rig.wait_route().await?;
                }
            }
        }
        "store_outage_midstream" => {
            if matches!(*rig.store, StoreControl::Nats { .. }) {
                store::streams_through_an_outage(
                    &mut attackers,
                    rig.http,
                    8,
                    rig.store.clone(),
                    &stop,
                    &stats,
                );
            } else {
                stats.count("skipped: no outage to make in an embedded file");
            }
        }
        other => bail!("unknown attack {other}"),
    }
    // Let the attack take hold before measuring.
    if name != "baseline" {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let edge_pid = rig.edge.pid();
    let peak_rss = Arc::new(AtomicU64::new(0));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = tokio::spawn({
        let peak = peak_rss.clone();
        let sampling = sampling.clone();
        async move {
            while sampling.load(Ordering::Relaxed) {
                if let Ok(rss) = iop_bench::procfs::rss_bytes(edge_pid) {
                    peak.fetch_max(rss, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let outcome = legit_load(rig.http, rate, duration).await?;
    stop.store(true, Ordering::Relaxed);
    sampling.store(false, Ordering::Relaxed);
    let _ = sampler.await;
    // Attackers notice `stop` within a second or so; then they are gone.
    let _ = tokio::time::timeout(Duration::from_secs(3), async {
        while attackers.join_next().await.is_some() {}
    })
    .await;
    attackers.abort_all();
    for p in extra_procs {
        p.stop().await;
    }
    if let Some(mut dup) = duplicate_edge {
        // R-TAKE-2: refused at start, naming the conflict.
        match dup.check_alive() {
            Ok(()) => stats.violate(format!(
                "a second Edge with edge_id {BENCH_EDGE_ID:?} still runs after {} s",
                duration.as_secs() + 1
            )),
            Err(_) => {
                let log = std::fs::read_to_string(rig.dir.join("edge-dup.log")).unwrap_or_default();
                if log.contains("is in use") {
                    stats.count("second Edge refused at start (edge_id in use)");
                } else {
                    stats.violate("the second Edge exited without naming the conflict");
                }
            }
        }
        dup.stop().await;
    }
    let (violation_count, violations) = stats.violations();
    Ok(Row {
        attack: name.to_owned(),
        sent: outcome.sent,
        ok: outcome.ok,
        p50_ms: outcome.percentile_ms(50.0),
        p99_ms: outcome.percentile_ms(99.0),
        max_ms: outcome.percentile_ms(100.0),
        peak_rss_mib: peak_rss.load(Ordering::Relaxed) as f64 / (1024.0 * 1024.0),
        attacker: stats.summary(),
        first_errors: outcome.errors,
        violations,
        violation_count,
    })
}

/// The legitimate client's view of one attack.
struct LoadOutcome {
    sent: u64,
    ok: u64,
    latencies: Vec<Duration>,
    errors: Vec<String>,
}

impl LoadOutcome {
    /// Latency percentile over every request sent; a failed request counts
    /// as its time to fail (at most the client's 10 s timeout).
    fn percentile_ms(&self, p: f64) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        let mut sorted = self.latencies.clone();
        sorted.sort();
        let rank = ((p / 100.0) * (sorted.len() as f64)).ceil() as usize;
        let index = rank.clamp(1, sorted.len()) - 1;
        sorted[index].as_secs_f64() * 1000.0
    }
}

/// Open-loop load: `rate` requests per second for `duration`, each on its
/// own task (a slow answer does not delay the next request).
async fn legit_load(
    http: SocketAddr,
    rate: u32,
    duration: Duration,
) -> anyhow::Result<LoadOutcome> {
    let client = legit_client()?;
    let mut tick = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let until = Instant::now() + duration;
    let mut requests = JoinSet::new();
    while Instant::now() < until {
        tick.tick().await;
        let client = client.clone();
        requests.spawn(async move {
            let started = Instant::now();
            let result = legit_request(&client, http).await;
            (result, started.elapsed())
        });
    }
    let mut outcome = LoadOutcome {
        sent: 0,
        ok: 0,
        latencies: Vec::new(),
        errors: Vec::new(),
    };
    while let Some(done) = requests.join_next().await {
        let (result, elapsed) = done?;
        outcome.sent += 1;
        outcome.latencies.push(elapsed);
        match result {
            Ok(_) => outcome.ok += 1,
            Err(e) => {
                if outcome.errors.len() < 3 {
                    outcome.errors.push(e);
                }
            }
        }
    }
    Ok(outcome)
}
