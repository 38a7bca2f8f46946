//! End to end in front of a real provider: the llama.cpp server of
//! `llama-cpp-python` serving SmolLM2-135M behind a Node, checked with the
//! official `openai` and `ollama` Python clients (`real_provider/clients_e2e.py`):
//! among the rest, a strict `json_schema` response format through the
//! node's `structured_output = "json_object_schema"` setting, the same
//! request to the server as it is (its own validation error passed on),
//! and its context-length error as the 400 it is, with its message.
//!
//! The Python environment is built by `scripts/provider-venv` (outside the
//! checkout, cached); `IOP_PROVIDER_VENV` names it. Without it the test says
//! why it did not run; CI builds the environment first and sets the variable.

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use iop_edge::server::RunningEdge;

const KEY: &str = "sk-real-provider";
const MODEL: &str = "smollm2";

fn venv() -> Option<PathBuf> {
    let path = match std::env::var("IOP_PROVIDER_VENV") {
        Ok(p) => PathBuf::from(p),
        Err(_) => PathBuf::from(std::env::var("HOME").ok()?).join(".cache/iop/provider-venv"),
    };
    // Only a completed build (scripts/provider-venv stamps it last).
    let ready = std::fs::read_dir(&path)
        .ok()?
        .filter_map(Result::ok)
        .any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(".iop-ready-"))
        });
    (ready && path.join("bin/python").exists()).then_some(path)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The llama.cpp server, killed when dropped.
struct LlamaServer {
    child: tokio::process::Child,
    base_url: String,
}

impl LlamaServer {
    async fn start(venv: &std::path::Path) -> Self {
        let model = std::fs::read_dir(venv.join("model"))
            .expect("model dir")
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "gguf"))
            .expect("a .gguf model in the venv");
        let port = free_port();
        let child = tokio::process::Command::new(venv.join("bin/python"))
            .args(["-m", "llama_cpp.server", "--model"])
            .arg(&model)
            .args(["--model_alias", MODEL, "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--n_ctx", "2048", "--embedding", "true"])
            // By default the server cuts a streaming answer short whenever
            // another request arrives, even the Edge's `GET /v1/models`
            // health probe; the stream then ends as if complete
            // (docs/operations.md, llama-cpp-python).
            .args(["--interrupt_requests", "false"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start llama.cpp server");
        let base_url = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(r) = http.get(format!("{base_url}/v1/models")).send().await
                && r.status().is_success()
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "llama.cpp server did not start"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Self { child, base_url }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn official_clients_against_a_real_llama_cpp_server() {
    let Some(venv) = venv() else {
        eprintln!(
            "SKIPPED official_clients_against_a_real_llama_cpp_server: no provider venv \
             (run scripts/provider-venv, or set IOP_PROVIDER_VENV to a completed one)"
        );
        return;
    };
    init();
    let mut llama = LlamaServer::start(&venv).await;
    let pki = Pki::new(&["node-1"]);
    common::write_secret(&pki.path().join("key"), KEY);
    let edge = RunningEdge::start(edge_config(
        &pki,
        0,
        // No [[routes]] entry: the model is discovered from the
        // provider's own /v1/models.
        "[health]\nrefresh_interval_ms = 300\nprobe_timeout_ms = 2000\nstale_after_ms = 10000\n\
         [[providers]]\nid = \"llama\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"llama\"\ncapacity = 2\n\
         [[providers]]\nid = \"llama-as-is\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"llama-as-is\"\ncapacity = 2\ndiscover_models = false\n\
         [[routes]]\nmodel = \"smollm2-as-is\"\nproviders = [\"llama-as-is\"]\n\
         [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n"
    ))
    .await
    .expect("edge");
    let node = start_node(
        &pki,
        "node-1",
        edge.quic_addr,
        &format!(
            "[[providers]]\nadapter = \"openai\"\ntarget = \"llama\"\nbase_url = \"{url}\"\nstream_usage = false\nstructured_output = \"json_object_schema\"\n\
             [[providers]]\nadapter = \"openai\"\ntarget = \"llama-as-is\"\nbase_url = \"{url}\"\nstream_usage = false\n",
            url = llama.base_url
        ),
    );
    ready_generation(&edge, "node-1").await;
    // Both targets report the model; only the discovering one routes it.
    wait_for(&edge, "the model discovered", |_| {
        edge.hub
            .catalog()
            .pool_for(MODEL)
            .iter()
            .any(|p| p.as_str() == "llama")
    })
    .await;
    // The same server without the structured-output setting: a client's
    // JSON schema reaches it as sent, and its refusal is passed on.
    wait_for(&edge, "the server as it is routable", |s| {
        s.providers
            .iter()
            .any(|p| p.provider_id.as_str() == "llama-as-is" && p.runtime_eligible)
    })
    .await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/real_provider/clients_e2e.py"
    );
    let out = tokio::time::timeout(
        Duration::from_secs(300),
        tokio::process::Command::new(venv.join("bin/python"))
            .arg(script)
            .arg(format!("http://{}", edge.http_addr))
            .arg(KEY)
            .arg(MODEL)
            .arg("smollm2-as-is")
            .output(),
    )
    .await
    .expect("clients finished within 300 s")
    .expect("run python");
    assert!(
        out.status.success(),
        "clients e2e failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    node.shutdown().await.unwrap();
    edge.shutdown().await;
    let _ = llama.child.kill().await;
}
