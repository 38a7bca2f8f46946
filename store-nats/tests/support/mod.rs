//! A real `nats-server` for the tests: started with JetStream on a free
//! loopback port and a fresh store directory, killed when dropped.
//!
//! Without `nats-server` installed a test says why and passes, except
//! when `CI` is set: then it fails (CI must install it).

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use iop_core::journal::JournalLimits;
use iop_store_nats::NatsOptions;

/// How long a started server may take to accept connections.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a test waits for a condition before it fails.
pub const WAIT: Duration = Duration::from_secs(20);

pub struct NatsServer {
    binary: PathBuf,
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    max_file_store: u64,
}

/// The servers' JetStream `max_file_store`. JetStream reserves every
/// file stream's `max_bytes` against it when the stream is made; its
/// default (three quarters of the disk free at start) would make the
/// tests depend on the machine's free disk. What is written is bounded
/// by the streams' own limits.
pub const MAX_FILE_STORE: u64 = 1 << 40;

fn find_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NATS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/bin", "/usr/bin"].map(PathBuf::from))
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
}

/// A loopback TCP port free now, below Linux's ephemeral range (which
/// starts at 32768): a server restarted on its port (the restart tests)
/// cannot find it given to an outgoing socket, e.g. a client reconnecting
/// while the server was down. Tried from a start that differs per call.
fn free_port() -> u16 {
    const FIRST: u16 = 20_000;
    const SPAN: u16 = 32_768 - FIRST;
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        ^ std::process::id().rotate_left(16)
        ^ (DIRS.load(Ordering::Relaxed) as u32).wrapping_mul(7919);
    let start = (seed % u32::from(SPAN)) as u16;
    (0..SPAN)
        .map(|i| FIRST + (start + i) % SPAN)
        .find(|port| TcpListener::bind(("127.0.0.1", *port)).is_ok())
        .expect("a free loopback port below the ephemeral range")
}

static DIRS: AtomicUsize = AtomicUsize::new(0);

impl NatsServer {
    /// Start a server, or `None` (having said why) when `nats-server` is
    /// not installed and `CI` is not set.
    pub fn start() -> Option<NatsServer> {
        Self::start_with(&[])
    }

    /// As [`Self::start`], with extra server arguments.
    pub fn start_with(extra: &[&str]) -> Option<NatsServer> {
        Self::start_with_file_store(MAX_FILE_STORE, extra)
    }

    /// As [`Self::start_with`], JetStream's `max_file_store` set.
    pub fn start_with_file_store(max_file_store: u64, extra: &[&str]) -> Option<NatsServer> {
        let Some(binary) = find_binary() else {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "nats-server is not installed and CI is set: install it (apt-get install -y nats-server)"
                );
            }
            eprintln!("skipped: nats-server is not installed (apt-get install -y nats-server)");
            return None;
        };
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!(
            "iop-nats-{}-{}-{nanos}",
            std::process::id(),
            DIRS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("the server's directory");
        let mut server = NatsServer {
            binary,
            child: None,
            port: free_port(),
            dir,
            max_file_store,
        };
        server.spawn(extra);
        Some(server)
    }

    fn spawn(&mut self, extra: &[&str]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .expect("the server's log");
        let config = self.dir.join("server.conf");
        let store = self.dir.join("js").display().to_string();
        std::fs::write(
            &config,
            format!(
                "jetstream {{\n  store_dir: {store:?}\n  max_file_store: {}\n}}\n",
                self.max_file_store
            ),
        )
        .expect("the server's config");
        let child = Command::new(&self.binary)
            .arg("-c")
            .arg(&config)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .args(extra)
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("nats-server starts");
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let deadline = Instant::now() + START_TIMEOUT;
        while TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not accept on port {} (log: {})",
                self.port,
                self.dir.join("server.log").display()
            );
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "nats-server exited with {status} (log: {})",
                    self.dir.join("server.log").display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start again on the same port and store directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn(&[]);
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Options for a store on `url`; stores given the same `name` share a
/// stream and a bucket (they are "Edges" of one deployment).
pub fn options(url: &str, name: &str, limits: JournalLimits) -> NatsOptions {
    let mut o = NatsOptions::new(vec![url.to_owned()], limits);
    o.stream = format!("J_{name}");
    o.bucket = format!("j_{name}");
    o.subject_prefix = format!("j.{name}");
    o.usage_refresh = Duration::ZERO;
    // The server reserves each bucket's bytes against its store.
    o.tenant_bucket_max_bytes = 8 << 20;
    o
}

/// Wait until `check` is true, polling it; fail after [`WAIT`].
pub async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A new record `id` (principal `p`) with `request`.
pub fn record(id: &str, request: &[u8]) -> iop_core::journal::NewRecord {
    iop_core::journal::NewRecord {
        id: id.into(),
        principal: "p".into(),
        api: iop_core::journal::JournalApi::Responses,
        model: "m".into(),
        fingerprint: iop_core::journal::fingerprint("/v1/responses", request),
        idempotency_key: None,
        background: false,
        request: request.to_vec(),
        created_unix_ms: 1,
        owner: "edge".into(),
        key_id: "key".into(),
    }
}
