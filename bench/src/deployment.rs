//! A real deployment on loopback, one OS process per component, so each
//! one's memory and CPU can be read from `/proc`:
//!
//! * one `iop-node mock-provider` process per [`MockSpec`] (the upstream),
//! * one `iop-edge run --config` process,
//! * one `iop-node run --config` process per node; every node serves every
//!   mock as a target of its `openai` adapter,
//! * or, for the node-scale scenario, one `iop-bench fleet` process running
//!   many nodes ([`crate::fleet`]);
//! * with the journal on NATS JetStream, one `nats-server -js` process
//!   ([`NatsServer`]).
//!
//! The Edge has, for each mock `m` and node `i`, a provider `m-norm-i`
//! (`mode = "normalized"`) and `m-tun-i` (`mode = "tunnel"`); the model `m`
//! routes to the normalized ones, `m-tunnel` to the tunnel ones. A model
//! name that does not start with `mock:` makes the mock play its process
//! defaults, so the same mock script serves every path.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

use crate::load::{Durability, Target};
use crate::procfs::{self, ProcError};

/// The API key every deployment accepts (also an admin key).
pub const API_KEY: &str = "sk-iop-bench-0123456789abcdef";

/// How long a component may take to come up.
const START_BOUND: Duration = Duration::from_secs(60);
/// Bound of one readiness or stats request.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `nats-server` may take to accept TCP connections.
const NATS_START_BOUND: Duration = Duration::from_secs(20);

/// Why a deployment could not start.
#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    /// A binary is missing.
    #[error(
        "binary not found: {0} (build with `cargo build --release -p iop-edge -p iop-node -p iop-bench`)"
    )]
    MissingBinary(PathBuf),
    /// A directory given for another build's binaries lacks one of them,
    /// or holds one that cannot be run.
    #[error("binaries in {dir}: {reason}")]
    BinaryDir {
        /// The directory.
        dir: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The journal store `nats` needs `nats-server`, which is not installed.
    #[error(
        "the nats journal store needs `nats-server` (not found on PATH, in /usr/sbin or /usr/local/bin, nor in $NATS_SERVER): install the Debian package `nats-server` (apt-get install nats-server), or measure other stores (--journal-stores embedded,memory)"
    )]
    MissingNatsServer,
    /// The journal store `nats` was configured without a server URL.
    #[error("the nats journal store needs a NATS server URL")]
    NoNatsUrl,
    /// File or process I/O failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// Certificates could not be generated.
    #[error("dev PKI: {0}")]
    Pki(String),
    /// A component exited early.
    #[error("{name} exited ({status}); see {log}")]
    Exited {
        /// The component.
        name: String,
        /// Its exit status.
        status: String,
        /// Its log file.
        log: PathBuf,
    },
    /// A component did not become ready in time.
    #[error("{0} did not become ready within the start bound")]
    NotReady(String),
    /// A config could not be written.
    #[error("config: {0}")]
    Config(String),
    /// `/proc` could not be read.
    #[error(transparent)]
    Proc(#[from] ProcError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DeployError {
    let what = what.into();
    move |source| DeployError::Io { what, source }
}

/// The binaries a deployment runs.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `iop-edge`.
    pub edge: PathBuf,
    /// `iop-node`.
    pub node: PathBuf,
    /// `iop-bench` (for `fleet`).
    pub bench: PathBuf,
}

impl Binaries {
    /// `iop-edge` and `iop-node` beside the running `iop-bench` (the same
    /// target directory and profile).
    pub fn beside_current_exe() -> Result<Self, DeployError> {
        let bench = std::env::current_exe().map_err(io("locating iop-bench"))?;
        let dir = bench.parent().map(Path::to_path_buf).unwrap_or_default();
        let found = |name: &str| {
            let p = dir.join(name);
            if p.exists() {
                Ok(p)
            } else {
                Err(DeployError::MissingBinary(p))
            }
        };
        Ok(Self {
            edge: found("iop-edge")?,
            node: found("iop-node")?,
            bench,
        })
    }

    /// Another build's `iop-edge` and `iop-node`, both in `dir` (for
    /// example a copy of the release binaries made before a change), with
    /// this build's `iop-bench` as `bench`. Both must be executable
    /// regular files; the error names `dir`.
    pub fn in_dir(dir: &Path, bench: PathBuf) -> Result<Self, DeployError> {
        use std::os::unix::fs::PermissionsExt;
        let bad = |reason: String| DeployError::BinaryDir {
            dir: dir.to_path_buf(),
            reason,
        };
        if !dir.is_dir() {
            return Err(bad("not a directory".into()));
        }
        let found = |name: &str| {
            let p = dir.join(name);
            let meta = std::fs::metadata(&p).map_err(|e| bad(format!("{name}: {e}")))?;
            if !meta.is_file() {
                return Err(bad(format!("{name} is not a file")));
            }
            if meta.permissions().mode() & 0o111 == 0 {
                return Err(bad(format!("{name} is not executable")));
            }
            Ok(p)
        };
        Ok(Self {
            edge: found("iop-edge")?,
            node: found("iop-node")?,
            bench,
        })
    }
}

/// A loopback TCP port free right now.
pub fn free_tcp_port() -> Result<u16, DeployError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(io("finding a free TCP port"))?;
    Ok(l.local_addr()
        .map_err(io("finding a free TCP port"))?
        .port())
}

/// A loopback UDP port free right now.
pub fn free_udp_port() -> Result<u16, DeployError> {
    let s = UdpSocket::bind("127.0.0.1:0").map_err(io("finding a free UDP port"))?;
    Ok(s.local_addr()
        .map_err(io("finding a free UDP port"))?
        .port())
}

/// One child process; killed when dropped.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    pid: u32,
    log: PathBuf,
}

impl Proc {
    /// Start `program args` in `dir`, stderr (and stdout unless piped) to
    /// `dir/<name>.log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        dir: &Path,
        pipe_stdout: bool,
    ) -> Result<Self, DeployError> {
        Self::spawn_with_env(name, program, args, &[], dir, pipe_stdout)
    }

    /// [`Proc::spawn`] with `env` added to its environment.
    pub fn spawn_with_env(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
        dir: &Path,
        pipe_stdout: bool,
    ) -> Result<Self, DeployError> {
        let log = dir.join(format!("{name}.log"));
        let file =
            std::fs::File::create(&log).map_err(io(format!("creating {}", log.display())))?;
        let err = file.try_clone().map_err(io("cloning a log handle"))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .current_dir(dir)
            .env(
                "RUST_LOG",
                std::env::var("IOP_BENCH_CHILD_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stderr(Stdio::from(err))
            .kill_on_drop(true);
        if pipe_stdout {
            cmd.stdout(Stdio::piped());
        } else {
            cmd.stdout(Stdio::from(file));
        }
        let child = cmd
            .spawn()
            .map_err(io(format!("starting {}", program.display())))?;
        let pid = child.id().ok_or_else(|| DeployError::Exited {
            name: name.to_owned(),
            status: "at once".into(),
            log: log.clone(),
        })?;
        Ok(Self {
            name: name.to_owned(),
            child,
            pid,
            log,
        })
    }

    /// The component's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The OS process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Its log file (stderr, and stdout unless piped).
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Its piped stdout (once).
    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    /// Resident memory now.
    pub fn rss_bytes(&self) -> Result<u64, DeployError> {
        Ok(procfs::rss_bytes(self.pid)?)
    }

    /// CPU time so far, in clock ticks.
    pub fn cpu_ticks(&self) -> Result<u64, DeployError> {
        Ok(procfs::cpu_ticks(self.pid)?)
    }

    /// An error if the process has exited.
    pub fn check_alive(&mut self) -> Result<(), DeployError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(DeployError::Exited {
                name: self.name.clone(),
                status: status.to_string(),
                log: self.log.clone(),
            }),
            Err(e) => Err(io(format!("waiting for {}", self.name))(e)),
        }
    }

    /// Stop it (SIGKILL) and reap it.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// One upstream mock process and the script it plays by default.
#[derive(Debug, Clone, PartialEq)]
pub struct MockSpec {
    /// Its name: the node target and the Edge model.
    pub name: String,
    /// Tokens per answer.
    pub tokens: u32,
    /// Tokens per second; 0 = as fast as possible.
    pub tps: f64,
    /// Delay before the first token, ms.
    pub prefill_ms: u64,
    /// An already running mock to use instead of starting one (the peer
    /// gateway scenario shares it).
    pub external: Option<SocketAddr>,
    /// Leave Nagle's algorithm on for the mock's accepted connections
    /// (`--nagle`), as many real provider servers do; otherwise the mock
    /// sets `TCP_NODELAY`.
    pub nagle: bool,
}

impl MockSpec {
    /// The arguments of `iop-node` that start this mock on `addr`.
    pub fn args(&self, addr: SocketAddr) -> Vec<String> {
        let mut args = vec![
            "mock-provider".into(),
            "--listen".into(),
            addr.to_string(),
            "--tokens".into(),
            self.tokens.to_string(),
            "--tps".into(),
            self.tps.to_string(),
            "--prefill-ms".into(),
            self.prefill_ms.to_string(),
        ];
        if self.nagle {
            args.push("--nagle".into());
        }
        args
    }
}

/// Which store the Edge keeps durable responses in (`[journal] store`,
/// docs/durability.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum JournalStore {
    /// The default: one redb file under the Edge's `state_dir`, an fsync
    /// per group commit.
    #[default]
    Embedded,
    /// Process memory: no file, no fsync.
    Memory,
    /// NATS JetStream (`[journal.nats]`): a local `nats-server -js` the
    /// deployment starts, its store directory in the deployment's.
    Nats,
}

/// The Edge's `edge_id` when its journal store is shared (`nats`).
pub const BENCH_EDGE_ID: &str = "bench-edge";

impl JournalStore {
    /// The value of `[journal] store`.
    pub fn as_str(self) -> &'static str {
        match self {
            JournalStore::Embedded => "embedded",
            JournalStore::Memory => "memory",
            JournalStore::Nats => "nats",
        }
    }

    /// Does a deployment with this store need a NATS server?
    pub fn needs_nats(self) -> bool {
        matches!(self, JournalStore::Nats)
    }

    /// The Edge's `[journal]` section selecting this store; `nats_url` is
    /// the server of the `nats` store (ignored by the others).
    pub fn config_section(self, nats_url: Option<&str>) -> Result<String, DeployError> {
        self.config_section_with(nats_url, &EdgeExtras::default())
    }

    /// [`Self::config_section`] with `extras`' lines in `[journal]` and
    /// (the `nats` store only) in `[journal.nats]`.
    pub fn config_section_with(
        self,
        nats_url: Option<&str>,
        extras: &EdgeExtras,
    ) -> Result<String, DeployError> {
        let mut out = format!("[journal]\nstore = \"{}\"\n", self.as_str());
        out.push_str(&extras.journal);
        if self.needs_nats() {
            let url = nats_url.ok_or(DeployError::NoNatsUrl)?;
            out.push_str(&format!("[journal.nats]\nservers = [\"{url}\"]\n"));
            out.push_str(&extras.nats);
        }
        Ok(out)
    }

    /// Add this store to an Edge config that starts with
    /// [`edge_config_head`]: the `edge_id` a shared store requires goes
    /// into the head's `[edge]` table (TOML forbids a second one), the
    /// `[journal]` section after the head.
    pub fn add_to_edge_config(
        self,
        edge_toml: &mut String,
        nats_url: Option<&str>,
    ) -> Result<(), DeployError> {
        self.add_to_edge_config_with(edge_toml, nats_url, &EdgeExtras::default())
    }

    /// [`Self::add_to_edge_config`] with `extras`: its `[edge]` lines in
    /// the head's `[edge]` table, its `[journal]` and `[journal.nats]`
    /// lines in those sections. Its tables are not added (they go last,
    /// after the providers and routes).
    pub fn add_to_edge_config_with(
        self,
        edge_toml: &mut String,
        nats_url: Option<&str>,
        extras: &EdgeExtras,
    ) -> Result<(), DeployError> {
        if !extras.edge.is_empty() {
            let Some(at) = edge_toml.find("\n[tls]\n") else {
                return Err(DeployError::Config(
                    "the Edge config has no [tls] table after its [edge] table".into(),
                ));
            };
            edge_toml.insert_str(at + 1, &extras.edge);
        }
        if self.needs_nats() {
            let id = format!("[edge]\nedge_id = \"{BENCH_EDGE_ID}\"\n");
            let Some(rest) = edge_toml.strip_prefix("[edge]\n") else {
                return Err(DeployError::Config(
                    "the Edge config does not start with its [edge] table".into(),
                ));
            };
            *edge_toml = format!("{id}{rest}");
        }
        edge_toml.push_str(&self.config_section_with(nats_url, extras)?);
        Ok(())
    }
}

/// What a scenario adds to the deployment's Edge config: lines inside its
/// tables, whole tables after everything else, and the secret files they
/// name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EdgeExtras {
    /// Lines added to the `[edge]` table (`request_memory_bytes = ...`).
    pub edge: String,
    /// Lines added to the `[journal]` table (`max_bytes = ...`).
    pub journal: String,
    /// Lines added to `[journal.nats]` (the `nats` store only).
    pub nats: String,
    /// Tables appended last: keys, principals, prices, routes.
    pub tables: String,
    /// Secret files the tables name, `(file name, secret)`, written with
    /// mode 0600 into the deployment's directory before the Edge starts.
    pub key_files: Vec<(String, String)>,
}

/// Write a secret (an API key) to `path`, readable by its owner only (the
/// Edge refuses a secret file other users could read).
pub fn write_secret_file(path: &Path, secret: &str) -> Result<(), DeployError> {
    write(path, secret)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(io(format!("chmod {}", path.display())))?;
    }
    Ok(())
}

/// Where `nats-server` is: `$NATS_SERVER`, else on `PATH`, else in
/// `/usr/sbin` (the Debian package) or `/usr/local/bin`.
pub fn nats_server_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NATS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/bin"].map(PathBuf::from))
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
}

/// JetStream's `max_file_store` for the servers started here. JetStream
/// reserves every file stream's `max_bytes` against it when the stream
/// is made; its default (three quarters of the disk free at start) would
/// make a run depend on the machine's free disk. What is written is
/// bounded by the journal's own limits.
pub const NATS_MAX_FILE_STORE: u64 = 1 << 40;

/// The arguments of a `nats-server` with JetStream listening on `addr`,
/// its store in `<dir>/nats-js` and its configuration (written here) in
/// `<dir>/nats-server.conf`.
pub fn nats_server_args(addr: SocketAddr, dir: &Path) -> Result<Vec<String>, DeployError> {
    let store = dir.join("nats-js");
    std::fs::create_dir_all(&store).map_err(io(format!("creating {}", store.display())))?;
    let config = dir.join("nats-server.conf");
    let text = format!(
        "jetstream {{\n  store_dir: {:?}\n  max_file_store: {NATS_MAX_FILE_STORE}\n}}\n",
        store.display().to_string()
    );
    std::fs::write(&config, text).map_err(io(format!("writing {}", config.display())))?;
    Ok(vec![
        "-c".into(),
        config.display().to_string(),
        "-a".into(),
        "127.0.0.1".into(),
        "-p".into(),
        addr.port().to_string(),
    ])
}

/// A `nats-server` with JetStream on a free loopback port, its store in
/// `<dir>/nats-js`, its log in `<dir>/nats-server.log`; killed when
/// stopped or dropped.
#[derive(Debug)]
pub struct NatsServer {
    /// The process.
    pub proc: Proc,
    /// Its client address.
    pub addr: SocketAddr,
}

impl NatsServer {
    /// Start it and wait (bounded) until it accepts TCP connections.
    pub async fn start(dir: &Path) -> Result<Self, DeployError> {
        let binary = nats_server_binary().ok_or(DeployError::MissingNatsServer)?;
        let addr = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
        let args = nats_server_args(addr, dir)?;
        let mut proc = Proc::spawn("nats-server", &binary, &args, dir, false)?;
        let deadline = Instant::now() + NATS_START_BOUND;
        loop {
            proc.check_alive()?;
            if let Ok(Ok(_)) =
                tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr)).await
            {
                return Ok(Self { proc, addr });
            }
            if Instant::now() > deadline {
                return Err(DeployError::NotReady("nats-server".into()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// Stop it (SIGKILL) and reap it.
    pub async fn stop(self) {
        self.proc.stop().await;
    }
}

/// What to deploy.
#[derive(Debug, Clone)]
pub struct DeploymentSpec {
    /// Working directory (certificates, configs, logs); emptied first.
    pub dir: PathBuf,
    /// Upstream mocks.
    pub mocks: Vec<MockSpec>,
    /// Node processes.
    pub nodes: usize,
    /// Capacity of each Edge provider.
    pub capacity: u32,
    /// `max_concurrent_runs` of each node.
    pub max_concurrent_runs: u32,
    /// Edge admission queue.
    pub queue_capacity: usize,
    /// The Edge's journal store.
    pub journal: JournalStore,
    /// Where the Edge and the Nodes export their spans (an OTLP/HTTP
    /// traces endpoint; `None`: no spans).
    pub otlp_traces: Option<String>,
    /// What the scenario adds to the Edge's config.
    pub extras: EdgeExtras,
    /// `[runtime] worker_threads` of the Edge and of every Node (`None`:
    /// no `[runtime]`, the binaries' default).
    pub worker_threads: Option<usize>,
    /// The body of the `[quic]` table of the Edge and of every Node, one
    /// `name = value` per line (`None`: no `[quic]`, quinn's defaults).
    pub quic: Option<String>,
}

/// A running mock.
#[derive(Debug)]
pub struct RunningMock {
    /// Its script.
    pub spec: MockSpec,
    /// Its address.
    pub addr: SocketAddr,
    /// Its process (`None` for an external mock).
    pub proc: Option<Proc>,
}

/// A running deployment.
#[derive(Debug)]
pub struct Deployment {
    /// The upstream mocks.
    pub mocks: Vec<RunningMock>,
    /// The Edge process.
    pub edge: Proc,
    /// The Edge's client-facing address.
    pub edge_http: SocketAddr,
    /// The Edge's QUIC address.
    pub edge_quic: SocketAddr,
    /// Node processes.
    pub nodes: Vec<Proc>,
    /// The NATS server of the `nats` journal store.
    pub nats: Option<NatsServer>,
    http: reqwest::Client,
}

fn fresh_dir(dir: &Path) -> Result<(), DeployError> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io(format!("clearing {}", dir.display())))?;
    }
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))
}

fn write(path: &Path, text: &str) -> Result<(), DeployError> {
    std::fs::write(path, text).map_err(io(format!("writing {}", path.display())))
}

/// Client connections the bench's Edge takes, all from one source.
///
/// The load generator is one source address, as a reverse proxy is, so
/// the Edge's per-source share (a quarter of `max_connections` by default)
/// would cap the memory scenario's in-flight streams; here the whole cap
/// is its share. The open-file limit (`scripts/bench` raises it to the
/// hard limit) bounds what is actually accepted.
pub const BENCH_CLIENT_CONNECTIONS: usize = 65_536;

/// The Edge config head: listeners, client connections, TLS, admission,
/// the bench key.
pub fn edge_config_head(quic_port: u16, http_port: u16, queue_capacity: usize) -> String {
    format!(
        r#"[edge]
quic_listen = "127.0.0.1:{quic_port}"
http_listen = "127.0.0.1:{http_port}"
state_dir = "edge-state"
max_connections = {BENCH_CLIENT_CONNECTIONS}
max_connections_per_source = {BENCH_CLIENT_CONNECTIONS}
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge.key"
[admission]
queue_capacity = {queue_capacity}
queue_timeout_ms = 30000
[[api_keys]]
principal = "bench"
key_file = "api-key"
admin = true
"#
    )
}

/// A node config (TLS from `certs/node-<id>.*`); `providers` is appended.
pub fn node_config(
    id: &str,
    edge_quic: SocketAddr,
    max_concurrent_runs: u32,
    providers: &str,
) -> String {
    format!(
        r#"[node]
edge = "{edge_quic}"
state_dir = "state-{id}"
max_concurrent_runs = {max_concurrent_runs}
[tls]
ca = "certs/ca.pem"
cert = "certs/node-{id}.pem"
key = "certs/node-{id}.key"
{providers}"#
    )
}

/// The `[runtime]` table that sets `worker_threads` (none for `None`).
pub fn runtime_section(worker_threads: Option<usize>) -> String {
    worker_threads.map_or_else(String::new, |n| {
        format!("[runtime]\nworker_threads = {n}\n")
    })
}

/// The `[quic]` table with `body` (none for `None`).
pub fn quic_section(body: Option<&str>) -> String {
    body.map_or_else(String::new, |b| format!("[quic]\n{b}"))
}

/// Certificates for `nodes` and the API key file, in `dir`.
pub fn write_pki(dir: &Path, nodes: &[String]) -> Result<(), DeployError> {
    let ids: Vec<&str> = nodes.iter().map(String::as_str).collect();
    iop_transport::generate_dev_pki(&dir.join("certs"), &ids, &[])
        .map_err(|e| DeployError::Pki(e.to_string()))?;
    write_secret_file(&dir.join("api-key"), API_KEY)
}

/// Poll `url` until it answers 2xx (bounded by [`START_BOUND`]).
pub async fn wait_http_ok(
    http: &reqwest::Client,
    url: &str,
    what: &str,
    proc: &mut Proc,
) -> Result<(), DeployError> {
    let deadline = Instant::now() + START_BOUND;
    loop {
        proc.check_alive()?;
        if let Ok(r) = http.get(url).timeout(PROBE_TIMEOUT).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(DeployError::NotReady(what.to_owned()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait until `/status` shows every provider's node ready (bounded).
pub async fn wait_providers_ready(
    http: &reqwest::Client,
    edge_http: SocketAddr,
    edge: &mut Proc,
) -> Result<(), DeployError> {
    let deadline = Instant::now() + START_BOUND;
    let url = format!("http://{edge_http}/status");
    loop {
        edge.check_alive()?;
        if let Ok(r) = http
            .get(&url)
            .bearer_auth(API_KEY)
            .timeout(PROBE_TIMEOUT)
            .send()
            .await
            && let Ok(body) = r.bytes().await
            && let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&body)
            && let Some(ps) = doc["providers"].as_array()
            && ps.iter().all(|p| p["node_ready"].as_bool() == Some(true))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(DeployError::NotReady("nodes".into()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Deployment {
    /// Start everything and wait until a request through each route works.
    pub async fn start(bins: &Binaries, spec: &DeploymentSpec) -> Result<Self, DeployError> {
        let dir = &spec.dir;
        eprintln!(
            "deployment: {} mock(s), {} node(s) in {}",
            spec.mocks.len(),
            spec.nodes,
            dir.display()
        );
        fresh_dir(dir)?;
        let node_ids: Vec<String> = (1..=spec.nodes).map(|i| format!("n{i}")).collect();
        write_pki(dir, &node_ids)?;
        let http = crate::load::client().map_err(|e| DeployError::Pki(e.to_string()))?;

        let mut mocks = Vec::new();
        for m in &spec.mocks {
            if let Some(addr) = m.external {
                mocks.push(RunningMock {
                    spec: m.clone(),
                    addr,
                    proc: None,
                });
                continue;
            }
            let addr = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
            let args = m.args(addr);
            let mut proc = Proc::spawn(&format!("mock-{}", m.name), &bins.node, &args, dir, false)?;
            wait_http_ok(
                &http,
                &format!("http://{addr}/mock/stats"),
                &m.name,
                &mut proc,
            )
            .await?;
            mocks.push(RunningMock {
                spec: m.clone(),
                addr,
                proc: Some(proc),
            });
        }

        let nats = if spec.journal.needs_nats() {
            let server = NatsServer::start(dir).await?;
            eprintln!("deployment: nats-server -js at {}", server.url());
            Some(server)
        } else {
            None
        };

        let edge_quic = SocketAddr::from(([127, 0, 0, 1], free_udp_port()?));
        let edge_http = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
        let mut edge_toml =
            edge_config_head(edge_quic.port(), edge_http.port(), spec.queue_capacity);
        spec.journal.add_to_edge_config_with(
            &mut edge_toml,
            nats.as_ref().map(NatsServer::url).as_deref(),
            &spec.extras,
        )?;
        for m in &spec.mocks {
            for (mode, short) in [("normalized", "norm"), ("tunnel", "tun")] {
                let mut pool = Vec::new();
                for id in &node_ids {
                    let pid = format!("{}-{short}-{id}", m.name);
                    edge_toml.push_str(&format!(
                        "[[providers]]\nid = \"{pid}\"\nnode = \"{id}\"\nadapter = \"openai\"\ntarget = \"{}\"\ncapacity = {}\nmode = \"{mode}\"\n",
                        m.name, spec.capacity
                    ));
                    pool.push(format!("\"{pid}\""));
                }
                let model = if mode == "tunnel" {
                    format!("{}-tunnel", m.name)
                } else {
                    m.name.clone()
                };
                edge_toml.push_str(&format!(
                    "[[routes]]\nmodel = \"{model}\"\nproviders = [{}]\n",
                    pool.join(", ")
                ));
            }
        }
        if let Some(endpoint) = &spec.otlp_traces {
            edge_toml.push_str(&crate::spans::otlp_traces_section(endpoint));
        }
        edge_toml.push_str(&runtime_section(spec.worker_threads));
        edge_toml.push_str(&quic_section(spec.quic.as_deref()));
        edge_toml.push_str(&spec.extras.tables);
        for (name, secret) in &spec.extras.key_files {
            write_secret_file(&dir.join(name), secret)?;
        }
        write(&dir.join("edge.toml"), &edge_toml)?;
        let mut edge = Proc::spawn(
            "edge",
            &bins.edge,
            &["run".into(), "--config".into(), "edge.toml".into()],
            dir,
            false,
        )?;
        wait_http_ok(
            &http,
            &format!("http://{edge_http}/healthz"),
            "edge",
            &mut edge,
        )
        .await?;

        let targets: String = mocks
            .iter()
            .map(|m| {
                format!(
                    "[[providers]]\nadapter = \"openai\"\ntarget = \"{}\"\nbase_url = \"http://{}\"\n",
                    m.spec.name, m.addr
                )
            })
            .collect();
        let mut nodes = Vec::new();
        for id in &node_ids {
            let file = format!("node-{id}.toml");
            let mut node_toml = node_config(id, edge_quic, spec.max_concurrent_runs, &targets);
            if let Some(endpoint) = &spec.otlp_traces {
                node_toml.push_str(&crate::spans::otlp_traces_section(endpoint));
            }
            node_toml.push_str(&runtime_section(spec.worker_threads));
            node_toml.push_str(&quic_section(spec.quic.as_deref()));
            write(&dir.join(&file), &node_toml)?;
            nodes.push(Proc::spawn(
                &format!("node-{id}"),
                &bins.node,
                &["run".into(), "--config".into(), file],
                dir,
                false,
            )?);
        }
        wait_providers_ready(&http, edge_http, &mut edge).await?;
        let d = Self {
            mocks,
            edge,
            edge_http,
            edge_quic,
            nodes,
            nats,
            http,
        };
        // One request through every route, retried until it works.
        for m in &d.mocks {
            for model in [m.spec.name.clone(), format!("{}-tunnel", m.spec.name)] {
                d.wait_route(&model).await?;
            }
        }
        Ok(d)
    }

    async fn wait_route(&self, model: &str) -> Result<(), DeployError> {
        let deadline = Instant::now() + START_BOUND;
        // Streamed, and dropped after the status: a slow mock's whole
        // answer may take minutes, its first chunk does not.
        let body = crate::load::chat_body(model, true);
        loop {
            let r = self
                .http
                .post(format!("http://{}/v1/chat/completions", self.edge_http))
                .bearer_auth(API_KEY)
                .header("content-type", "application/json")
                .body(body.clone())
                .timeout(PROBE_TIMEOUT)
                .send()
                .await;
            if let Ok(r) = r
                && r.status().is_success()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(DeployError::NotReady(format!("route {model}")));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Straight to mock `name`, bypassing iop.
    pub fn direct(&self, name: &str) -> Option<Target> {
        let m = self.mocks.iter().find(|m| m.spec.name == name)?;
        Some(Target {
            url: format!("http://{}/v1/chat/completions", m.addr),
            api_key: None,
            model: "mock".into(),
            durability: Durability::Ephemeral,
            headers: Vec::new(),
        })
    }

    /// Through the Edge to mock `name`, normalized (`tunnel = false`) or
    /// tunneled.
    pub fn via(&self, name: &str, tunnel: bool) -> Target {
        Target {
            url: format!("http://{}/v1/chat/completions", self.edge_http),
            api_key: Some(API_KEY.into()),
            model: if tunnel {
                format!("{name}-tunnel")
            } else {
                name.to_owned()
            },
            durability: Durability::Ephemeral,
            headers: Vec::new(),
        }
    }

    /// Provider calls the mock `name` is answering now.
    pub async fn mock_in_flight(&self, name: &str) -> Option<u64> {
        let m = self.mocks.iter().find(|m| m.spec.name == name)?;
        let r = self
            .http
            .get(format!("http://{}/mock/stats", m.addr))
            .timeout(PROBE_TIMEOUT)
            .send()
            .await
            .ok()?;
        let body = r.bytes().await.ok()?;
        let doc: serde_json::Value = serde_json::from_slice(&body).ok()?;
        doc["in_flight"].as_u64()
    }

    /// An error if any component has exited.
    pub fn check_alive(&mut self) -> Result<(), DeployError> {
        if let Some(n) = &mut self.nats {
            n.proc.check_alive()?;
        }
        self.edge.check_alive()?;
        for n in &mut self.nodes {
            n.check_alive()?;
        }
        for m in &mut self.mocks {
            if let Some(p) = &mut m.proc {
                p.check_alive()?;
            }
        }
        Ok(())
    }

    /// Sum of the node processes' RSS.
    pub fn nodes_rss_bytes(&self) -> Result<u64, DeployError> {
        self.nodes.iter().map(Proc::rss_bytes).sum()
    }

    /// Stop every process.
    pub async fn stop(self) {
        for n in self.nodes {
            n.stop().await;
        }
        self.edge.stop().await;
        for m in self.mocks.into_iter().filter_map(|m| m.proc) {
            m.stop().await;
        }
        if let Some(n) = self.nats {
            n.stop().await;
        }
    }
}

/// Read lines of a child's stdout until one satisfies `pick` (bounded).
pub async fn read_line_until<T>(
    stdout: &mut BufReader<ChildStdout>,
    bound: Duration,
    mut pick: impl FnMut(&str) -> Option<T>,
) -> Option<T> {
    let work = async {
        let mut line = String::new();
        loop {
            line.clear();
            match stdout.read_line(&mut line).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => {
                    if let Some(v) = pick(line.trim()) {
                        return Some(v);
                    }
                }
            }
        }
    };
    tokio::time::timeout(bound, work).await.ok().flatten()
}
