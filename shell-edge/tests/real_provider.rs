//! End to end in front of a real provider: the llama.cpp server of
//! `llama-cpp-python` serving SmolLM2-135M behind a Node, checked with the
//! official `openai` and `ollama` Python clients (`real_provider/clients_e2e.py`):
//! among the rest, a strict `json_schema` response format through the
//! node's `structured_output = "json_object_schema"` setting, the same
//! request to the server as it is (its own validation error passed on),
//! and its context-length error as the 400 it is, with its message.
//! Then LiteLLM's proxy serves the same model on its own Messages API, a
//! Messages server that is not ours, behind the node's `anthropic`
//! adapter: the official `anthropic` SDK reaches both providers
//! (`messages.create`, `messages.stream`, a tool-use round trip with a
//! forced `tool_choice`, `count_tokens`, an `Idempotency-Key` retry that
//! the llama.cpp server's access log shows made no second call, a 401, a
//! 404, a 400 and a rate-limited key's 429 as the SDK's classes), and the
//! `openai` and `ollama` clients the Messages-only one
//! (`real_provider/messages_e2e.py`). Last, the same llama.cpp server in
//! tunnel mode: its whole answer is charged the usage it reported in its
//! own bytes, its stream (no report) its text's estimate (R-TEN-2).
//!
//! The Python environment is built by `scripts/provider-venv` (outside the
//! checkout, cached); `IOP_PROVIDER_VENV` names it. Without it the test says
//! why it did not run; CI builds the environment first and sets the variable.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use iop_edge::server::RunningEdge;

const KEY: &str = "sk-real-provider";
const MODEL: &str = "smollm2";
/// The model LiteLLM's proxy serves on its Messages API (the same llama.cpp
/// server behind it); the Edge routes it to an `anthropic` provider.
const VIA_MESSAGES: &str = "smollm2-via-messages";
/// LiteLLM's master key: the `anthropic` provider's key (`x-api-key`).
const LITELLM_KEY: &str = "sk-litellm-real-provider-0123";
/// A key allowed one request a minute (the 429).
const LIMITED_KEY: &str = "sk-real-provider-limited";
/// A key of its own principal, for the answers of the server in tunnel
/// mode, and the admin key that reads its usage.
const TUNNELLED_KEY: &str = "sk-real-provider-tunnelled";
const ADMIN_KEY: &str = "sk-real-provider-admin";
/// The same llama.cpp server in tunnel mode.
const TUNNELLED: &str = "smollm2-tunnelled";

fn venv() -> Option<PathBuf> {
    let path = match std::env::var("IOP_PROVIDER_VENV") {
        Ok(p) => PathBuf::from(p),
        Err(_) => PathBuf::from(std::env::var("HOME").ok()?).join(".cache/iop/provider-venv"),
    };
    // Only a completed build (scripts/provider-venv stamps it last) that
    // has LiteLLM's proxy (an older build is completed by running it again).
    let ready = std::fs::read_dir(&path)
        .ok()?
        .filter_map(Result::ok)
        .any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(".iop-ready-"))
        });
    (ready && path.join("bin/python").exists() && path.join("litellm/bin/litellm").exists())
        .then_some(path)
}

/// The llama.cpp server, killed when dropped. Its access log (stdout) is
/// where the provider calls are counted.
struct LlamaServer {
    child: tokio::process::Child,
    base_url: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl LlamaServer {
    async fn start(venv: &std::path::Path) -> Self {
        let model = std::fs::read_dir(venv.join("model"))
            .expect("model dir")
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|e| e == "gguf"))
            .expect("a .gguf model in the venv");
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("llama.log");
        let log_file = std::fs::File::create(&log).expect("the server's log");
        let port = free_tcp_port();
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
            // Uvicorn's access log (on stdout): one line per call.
            .stdout(log_file)
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
        Self {
            child,
            base_url,
            log,
            _dir: dir,
        }
    }
}

/// LiteLLM's proxy serving [`VIA_MESSAGES`] from `llama` (its
/// OpenAI-compatible API) on its own Messages API; killed when dropped.
struct LiteLlm {
    child: tokio::process::Child,
    base_url: String,
    _dir: tempfile::TempDir,
}

impl LiteLlm {
    async fn start(venv: &std::path::Path, llama: &LlamaServer) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("litellm.yaml");
        std::fs::write(
            &config,
            format!(
                "model_list:\n  - model_name: {VIA_MESSAGES}\n    litellm_params:\n      \
                 model: hosted_vllm/{MODEL}\n      api_base: {}/v1\n      api_key: unused\n\
                 general_settings:\n  master_key: {LITELLM_KEY}\nlitellm_settings:\n  telemetry: false\n",
                llama.base_url
            ),
        )
        .expect("write the LiteLLM config");
        let port = free_tcp_port();
        let child = tokio::process::Command::new(venv.join("litellm/bin/litellm"))
            .arg("--config")
            .arg(&config)
            .args(["--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .env("LITELLM_LOG", "ERROR")
            // Its bundled model list, not a download at start.
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start LiteLLM's proxy");
        let base_url = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(r) = http
                .get(format!("{base_url}/health/liveliness"))
                .send()
                .await
                && r.status().is_success()
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "LiteLLM's proxy did not start"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Self {
            child,
            base_url,
            _dir: dir,
        }
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
    let mut litellm = LiteLlm::start(&venv, &llama).await;
    let pki = Pki::new(&["node-1"]);
    common::write_secret(&pki.path().join("key"), KEY);
    common::write_secret(&pki.path().join("limited"), LIMITED_KEY);
    common::write_secret(&pki.path().join("tunnelled"), TUNNELLED_KEY);
    common::write_secret(&pki.path().join("admin"), ADMIN_KEY);
    let edge = RunningEdge::start(edge_config(
        &pki,
        0,
        // No [[routes]] entry: the model is discovered from the
        // provider's own /v1/models.
        "[health]\nrefresh_interval_ms = 300\nprobe_timeout_ms = 2000\nstale_after_ms = 10000\n\
         [[providers]]\nid = \"llama\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"llama\"\ncapacity = 2\n\
         [[providers]]\nid = \"llama-as-is\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"llama-as-is\"\ncapacity = 2\ndiscover_models = false\n\
         [[routes]]\nmodel = \"smollm2-as-is\"\nproviders = [\"llama-as-is\"]\n\
         [[providers]]\nid = \"litellm\"\nnode = \"node-1\"\nadapter = \"anthropic\"\ntarget = \"litellm\"\ncapacity = 2\ndiscover_models = false\n\
         [[routes]]\nmodel = \"smollm2-via-messages\"\nproviders = [\"litellm\"]\n\
         [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n\
         [[providers]]\nid = \"llama-tunnel\"\nnode = \"node-1\"\nadapter = \"openai\"\nmode = \"tunnel\"\ntarget = \"llama-tunnel\"\ncapacity = 2\ndiscover_models = false\n\
         [[routes]]\nmodel = \"smollm2-tunnelled\"\nproviders = [\"llama-tunnel\"]\n\
         [[api_keys]]\nprincipal = \"limited\"\nkey_file = \"limited\"\nlimits = { requests_per_minute = 1 }\n\
         [[api_keys]]\nprincipal = \"tunnelled\"\nkey_file = \"tunnelled\"\n\
         [[api_keys]]\nprincipal = \"ops\"\nkey_file = \"admin\"\nadmin = true\n"
    ))
    .await
    .expect("edge");
    let mut node_config = node_config(
        &pki,
        "node-1",
        edge.quic_addr,
        &format!(
            "[[providers]]\nadapter = \"openai\"\ntarget = \"llama\"\nbase_url = \"{url}\"\nstream_usage = false\nstructured_output = \"json_object_schema\"\n\
             [[providers]]\nadapter = \"openai\"\ntarget = \"llama-as-is\"\nbase_url = \"{url}\"\nstream_usage = false\n\
             [[providers]]\nadapter = \"anthropic\"\ntarget = \"litellm\"\nbase_url = \"{litellm}\"\ncache_control = false\n\
             [[providers]]\nadapter = \"openai\"\ntarget = \"llama-tunnel\"\nbase_url = \"{url}\"\n",
            url = llama.base_url,
            litellm = litellm.base_url
        ),
    );
    // LiteLLM's key, as `api_key_env` would give it.
    node_config.providers[2].api_key = Some(LITELLM_KEY.into());
    let node = iop_node::RunningNode::start(node_config);
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
    wait_for(&edge, "LiteLLM's Messages API routable", |s| {
        s.providers
            .iter()
            .any(|p| p.provider_id.as_str() == "litellm" && p.runtime_eligible)
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
    // The Anthropic SDK against both, and the OpenAI and Ollama clients
    // against a Messages API server that is not ours (LiteLLM's, the
    // `anthropic` adapter in front of it).
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/real_provider/messages_e2e.py"
    );
    let out = tokio::time::timeout(
        Duration::from_secs(300),
        tokio::process::Command::new(venv.join("bin/python"))
            .arg(script)
            .arg(format!("http://{}", edge.http_addr))
            .arg(KEY)
            .arg(MODEL)
            .arg(VIA_MESSAGES)
            .arg(LIMITED_KEY)
            .arg(&llama.log)
            .output(),
    )
    .await
    .expect("clients finished within 300 s")
    .expect("run python");
    assert!(
        out.status.success(),
        "messages e2e failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    tunnelled_answers_are_charged_as_reported(&edge).await;
    node.shutdown().await.unwrap();
    edge.shutdown().await;
    let _ = litellm.child.kill().await;
    let _ = llama.child.kill().await;
}

/// R-TEN-2 in front of the real server in tunnel mode: its whole answer
/// is charged the usage it reported (read by the Edge from the relayed
/// bytes), its stream (which reports none here) its text's estimate.
async fn tunnelled_answers_are_charged_as_reported(edge: &RunningEdge) {
    wait_for(edge, "the tunnel-mode provider routable", |s| {
        s.providers
            .iter()
            .any(|p| p.provider_id.as_str() == "llama-tunnel" && p.runtime_eligible)
    })
    .await;
    let http = reqwest::Client::new();
    let chat = |stream: bool| {
        http.post(format!("http://{}/v1/chat/completions", edge.http_addr))
            .bearer_auth(TUNNELLED_KEY)
            .json(&serde_json::json!({
                "model": TUNNELLED,
                "max_tokens": 12,
                "stream": stream,
                "messages": [{"role": "user", "content": "Name a colour."}],
            }))
            .send()
    };
    let whole: serde_json::Value = chat(false).await.unwrap().json().await.unwrap();
    let reported = (
        whole["usage"]["prompt_tokens"]
            .as_u64()
            .expect("a usage report"),
        whole["usage"]["completion_tokens"]
            .as_u64()
            .expect("a usage report"),
    );
    let r = chat(true).await.unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    let chars: u64 = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .map(|t| t.chars().count() as u64)
        .sum();
    let mut total = serde_json::Value::Null;
    for _ in 0..100 {
        let usage: serde_json::Value = http
            .get(format!(
                "http://{}/admin/usage?principal=tunnelled",
                edge.http_addr
            ))
            .bearer_auth(ADMIN_KEY)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        total = usage["total"].clone();
        if total["requests"] == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(total["requests"], 2, "{total}");
    assert_eq!(
        total["output_tokens"].as_u64(),
        Some(reported.1 + chars.div_ceil(4)),
        "the whole answer's report and the stream's estimate: {total} ({reported:?}, {chars} characters)"
    );
    assert!(
        total["input_tokens"].as_u64().unwrap() > reported.0,
        "the report's prompt and the stream's estimate: {total}"
    );
}
