//! A loopback deployment for integration tests: a dev PKI in a temp dir,
//! an Edge with a short heartbeat profile, and Nodes.
#![allow(dead_code, unreachable_pub)]

use iop_edge::config::ConfigFile as _;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use iop_edge::config::EdgeConfig;
use iop_edge::hub::HubSnapshot;
use iop_edge::server::RunningEdge;
use iop_node::RunningNode;
use iop_node::config::NodeConfig;

/// Short heartbeat profile for tests (R-HB-1 is configurable).
pub const HB_INTERVAL_MS: u64 = 200;
/// Short heartbeat wait for tests.
pub const HB_WAIT_MS: u64 = 300;

pub fn init() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

pub struct Pki {
    pub dir: tempfile::TempDir,
}

impl Pki {
    pub fn new(nodes: &[&str]) -> Self {
        init();
        let dir = tempfile::tempdir().expect("tempdir");
        iop_transport::generate_dev_pki(&dir.path().join("certs"), nodes, &[]).expect("pki");
        Self { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn certs(&self) -> PathBuf {
        self.dir.path().join("certs")
    }
}

/// Edge TOML with the short heartbeat profile; `extra` appends providers,
/// routes and keys.
pub fn edge_config(pki: &Pki, quic_port: u16, extra: &str) -> EdgeConfig {
    edge_config_with(pki, quic_port, "", extra)
}

/// [`edge_config`] with `edge_lines` added to the `[edge]` section.
pub fn edge_config_with(pki: &Pki, quic_port: u16, edge_lines: &str, extra: &str) -> EdgeConfig {
    let text = format!(
        r#"
[edge]
quic_listen = "127.0.0.1:{quic_port}"
http_listen = "127.0.0.1:0"
state_dir = "edge-state"
drain_timeout_ms = 2000
{edge_lines}
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge.key"
[heartbeat]
interval_ms = {HB_INTERVAL_MS}
wait_ms = {HB_WAIT_MS}
[admission]
queue_capacity = 64
queue_timeout_ms = 5000
{extra}
"#
    );
    EdgeConfig::parse(&text, pki.path()).expect("edge config")
}

pub fn node_config(pki: &Pki, node: &str, edge: SocketAddr, extra: &str) -> NodeConfig {
    node_config_edges(pki, node, &[edge], extra)
}

/// A node connected to every Edge of `edges` (R-MULTI-1).
pub fn node_config_edges(pki: &Pki, node: &str, edges: &[SocketAddr], extra: &str) -> NodeConfig {
    let edges: Vec<String> = edges.iter().map(|e| format!("\"{e}\"")).collect();
    let edges = edges.join(", ");
    let text = format!(
        r#"
[node]
edges = [{edges}]
state_dir = "node-{node}-state"
max_concurrent_runs = 256
[tls]
ca = "certs/ca.pem"
cert = "certs/node-{node}.pem"
key = "certs/node-{node}.key"
[heartbeat]
interval_ms = {HB_INTERVAL_MS}
wait_ms = {HB_WAIT_MS}
[reconnect]
initial_ms = 50
max_ms = 400
[watchdog]
close_grace_ms = 200
probe_bound_ms = 300
{extra}
"#
    );
    NodeConfig::parse(&text, pki.path()).expect("node config")
}

/// A mock provider entry for both configs.
pub fn mock_provider_node(target: &str) -> String {
    format!("[[providers]]\nadapter = \"mock\"\ntarget = \"{target}\"\n")
}

/// Poll `check` against hub snapshots until it holds (bounded).
pub async fn wait_for<F>(edge: &RunningEdge, what: &str, mut check: F) -> HubSnapshot
where
    F: FnMut(&HubSnapshot) -> bool,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let snap = edge.hub.snapshot().await.expect("hub");
        if check(&snap) {
            return snap;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {snap:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The node's current (generation, ready) in a snapshot.
pub fn node_state(snap: &HubSnapshot, node: &str) -> (Option<u64>, bool) {
    snap.nodes
        .iter()
        .find(|(n, ..)| n.as_str() == node)
        .map(|(_, g, ready, _)| (*g, *ready))
        .unwrap_or((None, false))
}

pub async fn ready_generation(edge: &RunningEdge, node: &str) -> u64 {
    let snap = wait_for(edge, "node ready", |s| node_state(s, node).1).await;
    node_state(&snap, node).0.expect("generation")
}

pub fn start_node(pki: &Pki, node: &str, edge: SocketAddr, extra: &str) -> RunningNode {
    RunningNode::start(node_config(pki, node, edge, extra))
}

/// Run a test body with an overall bound, so a hang fails instead of
/// blocking CI.
pub async fn bounded<T>(fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .expect("test exceeded its 60 s bound")
}

/// A log sink for sentinel tests: everything the global subscriber writes.
#[derive(Clone, Default)]
pub struct Captured(pub std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut v) = self.0.lock() {
            v.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Write a secret file (an API key, a credential) as an operator must:
/// mode 0600, or the Edge refuses it.
pub fn write_secret(path: &Path, text: &str) {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .expect("secret file");
    std::io::Write::write_all(&mut file, text.as_bytes()).expect("secret written");
}

/// The whole text of an answer of `tokens` mock tokens.
pub fn expected_text(tokens: u32) -> String {
    (0..tokens).map(iop_node::mock::token_text).collect()
}

/// The lowest port [`free_port`] hands out.
const FIRST_TEST_PORT: u16 = 20_000;

/// Linux's first ephemeral port (`ip_local_port_range` starts at 32768):
/// test servers take ports below it, so no outgoing socket (a Node's
/// redial, a client's connection) is given a server's port while the
/// server is down between a kill and a restart.
const FIRST_EPHEMERAL_PORT: u16 = 32_768;

/// A port below the ephemeral range that `binds` could bind now (a
/// process binds it a moment later), tried from a random start.
fn free_port(binds: impl Fn(u16) -> bool) -> u16 {
    let span = FIRST_EPHEMERAL_PORT - FIRST_TEST_PORT;
    let start = rand::random::<u16>() % span;
    (0..span)
        .map(|i| FIRST_TEST_PORT + (start + i) % span)
        .find(|port| binds(*port))
        .expect("a free port below the ephemeral range")
}

/// A TCP port free now (a process binds it a moment later).
pub fn free_tcp_port() -> u16 {
    free_port(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
}

/// A UDP port free now.
pub fn free_udp_port() -> u16 {
    free_port(|port| std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok())
}

/// `(id, data)` of each SSE event in `text` with both an `id:` and a JSON
/// `data:` line (complete events only).
pub fn sse_events(text: &str) -> Vec<(u64, serde_json::Value)> {
    let complete = match text.rfind("\n\n") {
        Some(end) => &text[..end + 2],
        None => "",
    };
    complete
        .split("\n\n")
        .filter_map(|event| {
            let mut id = None;
            let mut data = None;
            for line in event.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    id = v.parse().ok();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(v).ok();
                }
            }
            Some((id?, data?))
        })
        .collect()
}

/// A real `iop-edge run` process (killed when dropped).
pub struct EdgeProcess {
    pub child: tokio::process::Child,
    /// Its base URL, `http://127.0.0.1:<port>`.
    pub http: String,
}

/// Start `iop-edge run --config <config>` listening on `http_port`, and
/// wait (bounded) until a node is ready on it and its models are routable,
/// read with the admin key `key`.
pub async fn start_edge_process(config: &Path, http_port: u16, key: &str) -> EdgeProcess {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-edge"))
        .args(["run", "--config"])
        .arg(config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn iop-edge");
    let http = format!("http://127.0.0.1:{http_port}");
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let routable = client
            .get(format!("{http}/v1/models"))
            .bearer_auth(key)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if routable
            && let Ok(r) = client
                .get(format!("{http}/status"))
                .bearer_auth(key)
                .send()
                .await
            && let Ok(v) = r.json::<serde_json::Value>().await
            && v.to_string().contains("\"node_ready\":true")
        {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "edge not ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    EdgeProcess { child, http }
}

/// The `iop-node` binary beside this test's target directory, built (or
/// found up to date) first: a binary left from an older tree would run
/// another build's protocol.
pub fn node_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target directory")
        .to_path_buf();
    let node = dir.join("iop-node");
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        if newer_than_its_sources(&node) {
            // Built by this `cargo test --workspace` (which builds every
            // member's binaries first): building it again with this
            // package's narrower feature set would compile the TLS and
            // QUIC stack a second time.
            return;
        }
        let status = std::process::Command::new(env!("CARGO"))
            .args(["build", "-p", "iop-node", "--bin", "iop-node"])
            .status()
            .expect("cargo build iop-node");
        assert!(status.success(), "building iop-node failed");
    });
    assert!(node.exists(), "no iop-node at {}", node.display());
    node
}

/// Whether `exe` was written after every source file of the crates it is
/// built from (the Node's and the workspace crates it links) and the lock
/// file.
fn newer_than_its_sources(exe: &Path) -> bool {
    fn newest(path: &Path, built: std::time::SystemTime) -> bool {
        let Ok(meta) = path.metadata() else {
            return false;
        };
        if meta.is_dir() {
            let Ok(entries) = std::fs::read_dir(path) else {
                return false;
            };
            entries.flatten().all(|e| newest(&e.path(), built))
        } else {
            meta.modified().is_ok_and(|m| m <= built)
        }
    }
    let Ok(built) = exe.metadata().and_then(|m| m.modified()) else {
        return false;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root");
    ["Cargo.lock", "Cargo.toml"]
        .iter()
        .map(|f| root.join(f))
        .chain(
            ["shell-node", "core", "wire", "transport", "trace"]
                .iter()
                .flat_map(|c| [root.join(c).join("src"), root.join(c).join("Cargo.toml")]),
        )
        .all(|p| newest(&p, built))
}

/// One process of the deployment, restartable with the same config.
pub struct Component {
    pub name: String,
    pub program: PathBuf,
    pub config: PathBuf,
    pub child: Option<tokio::process::Child>,
}

impl Component {
    /// An `iop-edge` process named `name`, its config `toml` written to
    /// `<name>.toml` in `pki`'s directory (its log beside it); not started.
    pub fn edge(pki: &Pki, name: &str, toml: &str) -> Component {
        let config = pki.path().join(format!("{name}.toml"));
        std::fs::write(&config, toml).expect("edge config");
        Component {
            name: name.to_owned(),
            program: PathBuf::from(env!("CARGO_BIN_EXE_iop-edge")),
            config,
            child: None,
        }
    }

    /// The `iop-node` process `node` ([`node_binary`]) dialing every Edge
    /// of `edges`, its one provider the OpenAI-compatible server at
    /// `mock_url` ([`node_toml`]); not started.
    pub fn node(pki: &Pki, node: &str, edges: &[String], mock_url: &str) -> Component {
        let config = pki.path().join(format!("{node}.toml"));
        std::fs::write(&config, node_toml(node, edges, mock_url)).expect("node config");
        Component {
            name: node.to_owned(),
            program: node_binary(),
            config,
            child: None,
        }
    }

    /// The last `lines` lines of its log (indented continuation lines
    /// left out), named.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.config.with_extension("log")).unwrap_or_default();
        let tail: Vec<&str> = log
            .lines()
            .filter(|l| !l.starts_with("  "))
            .rev()
            .take(lines)
            .collect();
        format!(
            "{}:\n{}",
            self.name,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }

    pub fn start(&mut self) {
        // Each run's log is kept beside its config, for a failure's story.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.config.with_extension("log"))
            .expect("log file");
        let child = tokio::process::Command::new(&self.program)
            .args(["run", "--config"])
            .arg(&self.config)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.name));
        self.child = Some(child);
    }

    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Stop it as an operator does (SIGTERM: a graceful shutdown) and wait
    /// until it exited, at most `within` (then it is killed).
    pub async fn terminate(&mut self, within: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        if tokio::time::timeout(within, child.wait()).await.is_err() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
}

/// The `[edge]`, `[tls]` and `[heartbeat]` sections of Edge `edge_id` in a
/// test of several Edge processes: its ports, its own state directory, the
/// test PKI's certificates and the short heartbeat profile.
pub fn edge_head_toml(edge_id: &str, quic_port: u16, http_port: u16) -> String {
    edge_sections_toml(
        Some(edge_id),
        &format!("{edge_id}-state"),
        quic_port,
        http_port,
    )
}

/// The `[edge]`, `[tls]` and `[heartbeat]` sections of an Edge keeping its
/// state in `state_dir`: its `edge_id` if it has one of its own, its ports
/// (0: any), the test PKI's certificates and the short heartbeat profile.
pub fn edge_sections_toml(
    edge_id: Option<&str>,
    state_dir: &str,
    quic_port: u16,
    http_port: u16,
) -> String {
    let edge_id = edge_id.map_or_else(String::new, |id| format!("edge_id = \"{id}\"\n"));
    format!(
        r#"[edge]
{edge_id}quic_listen = "127.0.0.1:{quic_port}"
http_listen = "127.0.0.1:{http_port}"
state_dir = "{state_dir}"
drain_timeout_ms = 500
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge.key"
[heartbeat]
interval_ms = {HB_INTERVAL_MS}
wait_ms = {HB_WAIT_MS}
"#
    )
}

/// The `[journal]` of Edges sharing the NATS server at `nats_url`
/// (R-MULTI-1): leases of `lease_ttl_ms`, scans every 200 ms, runs parked
/// for `park_grace_ms`, and the stream, bucket and subjects named after
/// `name` (`NAME_JOURNAL`, `name_journal`, `name.journal`).
pub fn nats_journal_toml(
    nats_url: &str,
    name: &str,
    lease_ttl_ms: u64,
    park_grace_ms: u64,
    request_timeout_ms: u64,
) -> String {
    let upper = name.to_uppercase();
    format!(
        r#"[journal]
store = "nats"
lease_ttl_ms = {lease_ttl_ms}
takeover_scan_interval_ms = 200
park_grace_ms = {park_grace_ms}
[journal.nats]
servers = ["{nats_url}"]
stream = "{upper}_JOURNAL"
bucket = "{name}_journal"
subject_prefix = "{name}.journal"
connect_timeout_ms = 5000
request_timeout_ms = {request_timeout_ms}
"#
    )
}

/// Provider `p1`: target `t` of node-1's OpenAI-compatible adapter,
/// serving model `m`, 64 runs at once.
pub const P1_ON_NODE_1_TOML: &str = r#"[[providers]]
id = "p1"
node = "node-1"
adapter = "openai"
target = "t"
models = ["m"]
capacity = 64
"#;

/// The admin key of principal `tester`, read from the file `key`.
pub const TESTER_ADMIN_KEY_TOML: &str = r#"[[api_keys]]
principal = "tester"
key_file = "key"
admin = true
"#;

/// The config of node process `node` dialing every Edge of `edges`, its
/// one provider the OpenAI-compatible server at `mock_url`.
pub fn node_toml(node: &str, edges: &[String], mock_url: &str) -> String {
    let edges: Vec<String> = edges.iter().map(|e| format!("\"{e}\"")).collect();
    let edges = edges.join(", ");
    format!(
        r#"
[node]
edges = [{edges}]
state_dir = "{node}-state"
max_concurrent_runs = 256
[tls]
ca = "certs/ca.pem"
cert = "certs/node-{node}.pem"
key = "certs/node-{node}.key"
[heartbeat]
interval_ms = {HB_INTERVAL_MS}
wait_ms = {HB_WAIT_MS}
[reconnect]
initial_ms = 50
max_ms = 400
[[providers]]
adapter = "openai"
target = "t"
base_url = "{mock_url}"
"#
    )
}

/// Until the Edge at `http` answers `/status` (read with `key`) and sees a
/// node ready, at most 30 s; past that, panic with the tail of each of
/// `components`' logs.
pub async fn wait_node_ready(http: &str, key: &str, components: &[&Component]) {
    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ready = match client
            .get(format!("{http}/status"))
            .bearer_auth(key)
            .send()
            .await
        {
            Ok(r) => r
                .text()
                .await
                .unwrap_or_default()
                .contains("\"node_ready\":true"),
            Err(_) => false,
        };
        if ready {
            return;
        }
        if std::time::Instant::now() >= deadline {
            let logs: Vec<String> = components.iter().map(|c| c.log_tail(12)).collect();
            panic!("{http} not ready; logs:\n{}", logs.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
