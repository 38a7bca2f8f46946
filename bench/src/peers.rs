//! Peer gateways measured beside iop in the gateways scenario, each a
//! process of its own in front of the same mock provider process:
//!
//! * [`PeerKind::Portkey`]: Portkey's open-source AI gateway
//!   (`@portkey-ai/gateway` from npm, `scripts/portkey-gateway` installs a
//!   pinned version), run with Node.js as `node start-server.js --port=P
//!   --headless`; every request names the provider (`openai`) and the
//!   mock's base URL in its `x-portkey-provider` and
//!   `x-portkey-custom-host` headers, as its documentation does for a
//!   self-hosted OpenAI-compatible server.
//! * [`PeerKind::Litellm`]: LiteLLM's proxy (`litellm --config`, one
//!   process, its defaults), the model `openai/mock` at the mock's base
//!   URL, as `scripts/bench-litellm` runs it.
//!
//! A peer that is not installed or does not answer is reported as skipped
//! with the reason, not as a failure of the run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::deployment::{Proc, free_tcp_port};
use crate::load::{Durability, Target};

/// How long a peer may take to answer its health check (LiteLLM's proxy
/// imports for tens of seconds on a busy 2-core machine).
const PEER_START_BOUND: Duration = Duration::from_secs(180);
/// Bound of one probe request.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// The key the LiteLLM proxy is started with (its `master_key`).
const LITELLM_KEY: &str = "sk-litellm-bench-0123456789";

/// A peer gateway.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum PeerKind {
    /// Portkey's open-source gateway (Node.js).
    Portkey,
    /// LiteLLM's proxy (Python).
    Litellm,
}

impl PeerKind {
    /// `portkey`, `litellm`: its label in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            PeerKind::Portkey => "portkey",
            PeerKind::Litellm => "litellm",
        }
    }
}

/// A peer that is running and answered a request.
#[derive(Debug)]
pub struct RunningPeer {
    /// Which peer.
    pub kind: PeerKind,
    /// Its process.
    pub proc: Proc,
    /// Chat Completions through it, to the mock.
    pub target: Target,
}

/// A peer that was not measured, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedPeer {
    /// Which peer.
    pub kind: PeerKind,
    /// Why (not installed, did not start, did not answer).
    pub reason: String,
}

/// Start `kind` from `program` (Portkey: its `start-server.js`; LiteLLM:
/// its `litellm` command) in `dir`, in front of the mock at `mock`, and
/// wait until a request through it is answered. `None` for `program`:
/// not installed.
pub async fn start(
    kind: PeerKind,
    program: Option<&Path>,
    mock: SocketAddr,
    dir: &Path,
) -> Result<RunningPeer, SkippedPeer> {
    let skipped = |reason: String| SkippedPeer { kind, reason };
    let program = program.ok_or_else(|| {
        skipped(match kind {
            PeerKind::Portkey => "not installed: scripts/portkey-gateway installs it (into \
                                  $IOP_PORTKEY_DIR, by default ~/.cache/iop/portkey)"
                .into(),
            PeerKind::Litellm => "not installed: scripts/provider-venv builds LiteLLM's \
                                  environment (in $IOP_PROVIDER_VENV/litellm, by default \
                                  ~/.cache/iop/provider-venv)"
                .into(),
        })
    })?;
    if !program.is_file() {
        return Err(skipped(format!(
            "not installed: {} does not exist",
            program.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| skipped(format!("{}: {e}", dir.display())))?;
    let port = free_tcp_port().map_err(|e| skipped(e.to_string()))?;
    let base = format!("http://127.0.0.1:{port}");
    let (mut proc, health, target) = match kind {
        PeerKind::Portkey => {
            let args = vec![
                program.display().to_string(),
                format!("--port={port}"),
                "--headless".into(),
            ];
            let proc = Proc::spawn("portkey", Path::new("node"), &args, dir, false)
                .map_err(|e| skipped(format!("node did not start: {e}")))?;
            let target = Target {
                url: format!("{base}/v1/chat/completions"),
                api_key: Some("unused".into()),
                model: "mock".into(),
                durability: Durability::Ephemeral,
                headers: vec![
                    ("x-portkey-provider".into(), "openai".into()),
                    ("x-portkey-custom-host".into(), format!("http://{mock}/v1")),
                ],
            };
            (proc, format!("{base}/"), target)
        }
        PeerKind::Litellm => {
            let config = dir.join("litellm.yaml");
            std::fs::write(&config, litellm_config(mock))
                .map_err(|e| skipped(format!("{}: {e}", config.display())))?;
            let args = [
                "--config",
                "litellm.yaml",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ]
            .map(String::from);
            // No network at start (the model price map is the package's
            // own copy), errors only in the log.
            let env = [
                ("LITELLM_LOG", "ERROR"),
                ("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
            ];
            let proc = Proc::spawn_with_env("litellm", program, &args, &env, dir, false)
                .map_err(|e| skipped(format!("litellm did not start: {e}")))?;
            let target = Target {
                url: format!("{base}/v1/chat/completions"),
                api_key: Some(LITELLM_KEY.into()),
                model: "mock".into(),
                durability: Durability::Ephemeral,
                headers: Vec::new(),
            };
            (proc, format!("{base}/health/liveliness"), target)
        }
    };
    let log = proc.log().to_path_buf();
    if let Err(why) = wait_answering(&mut proc, &health, &target).await {
        proc.stop().await;
        return Err(skipped(format!("{why}; see {}", log.display())));
    }
    Ok(RunningPeer { kind, proc, target })
}

/// LiteLLM's proxy config: `mock` routed to the mock as an OpenAI server.
fn litellm_config(mock: SocketAddr) -> String {
    format!(
        "model_list:\n  - model_name: mock\n    litellm_params:\n      model: openai/mock\n      \
         api_base: http://{mock}/v1\n      api_key: unused\ngeneral_settings:\n  master_key: \
         {LITELLM_KEY}\nlitellm_settings:\n  telemetry: false\n  set_verbose: false\n"
    )
}

/// Wait (bounded) until `health` answers 2xx, then send one request
/// through `target`, which must be answered 2xx too.
async fn wait_answering(proc: &mut Proc, health: &str, target: &Target) -> Result<(), String> {
    let http = crate::load::client().map_err(|e| e.to_string())?;
    let deadline = Instant::now() + PEER_START_BOUND;
    loop {
        if let Err(e) = proc.check_alive() {
            return Err(format!("it exited: {e}"));
        }
        if let Ok(r) = http.get(health).timeout(PROBE_TIMEOUT).send().await
            && r.status().is_success()
        {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{health} did not answer within {PEER_START_BOUND:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut req = http
        .post(&target.url)
        .header("content-type", "application/json")
        .body(crate::load::chat_body(&target.model, false))
        .timeout(PROBE_TIMEOUT);
    if let Some(key) = &target.api_key {
        req = req.bearer_auth(key);
    }
    for (name, value) in &target.headers {
        req = req.header(name, value);
    }
    let r = req
        .send()
        .await
        .map_err(|e| format!("a probe request failed: {e}"))?;
    let status = r.status();
    if !status.is_success() {
        let body = r.text().await.unwrap_or_default();
        let body: String = body.chars().take(300).collect();
        return Err(format!("a probe request was answered {status}: {body}"));
    }
    Ok(())
}

/// The program of `kind` found in the usual places when no flag names it:
/// `None` when it is not there.
pub fn default_program(kind: PeerKind) -> Option<PathBuf> {
    let home = PathBuf::from(std::env::var_os("HOME")?);
    let path = match kind {
        PeerKind::Portkey => std::env::var_os("IOP_PORTKEY_DIR")
            .map_or_else(|| home.join(".cache/iop/portkey"), PathBuf::from)
            .join("node_modules/@portkey-ai/gateway/build/start-server.js"),
        PeerKind::Litellm => std::env::var_os("IOP_PROVIDER_VENV")
            .map_or_else(|| home.join(".cache/iop/provider-venv"), PathBuf::from)
            .join("litellm/bin/litellm"),
    };
    path.is_file().then_some(path)
}
