//! The operator's commands of the real `iop-node` binary: `config example`
//! prints the commented example that `config check` (the real loader)
//! accepts, `--help` explains the environment rule, and a Node configured
//! by `IOP_NODE__*` variables alone serves through an Edge while `health`
//! (a container's HEALTHCHECK) reports its liveness and readiness.

use iop_edge::config::ConfigFile as _;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;

const KEY: &str = "sk-node-operator-0123456789";

/// `iop-node ARGS` with exactly the environment `env`.
fn iop_node(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iop-node"))
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run iop-node")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Run `iop-node health --url URL` until its exit status is `healthy`
/// (bounded).
async fn wait_health(url: &str, healthy: bool) -> Output {
    let started = Instant::now();
    loop {
        let out = iop_node(&["health", "--url", url, "--timeout-ms", "1000"], &[]);
        if out.status.success() == healthy {
            return out;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{url} never became {}: {out:?}",
            if healthy { "healthy" } else { "unhealthy" }
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn config_example_prints_a_config_that_config_check_accepts() {
    let out = iop_node(&["config", "example"], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), iop_node::config::EXAMPLE);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.toml");
    std::fs::write(&path, &out.stdout).unwrap();
    let path = path.to_str().unwrap();
    let out = iop_node(&["config", "check", "--config", path], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("1 Edges (localhost:7443)"),
        "{out:?}"
    );
    let out = iop_node(
        &["config", "check", "--config", path],
        &[("IOP_NODE__NODE__EDGES", "[\"a:7443\", \"b:7443\"]")],
    );
    assert!(!out.status.success(), "edge and edges together");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("node.edges") && stderr.contains("IOP_NODE__NODE__EDGES"),
        "{stderr}"
    );
    let out = iop_node(
        &["config", "check", "--config", path],
        &[("IOP_NODE__PROVIDERS__0__BASE_URL", "vllm:8000")],
    );
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("providers[0].base_url")
            && stderr.contains("IOP_NODE__PROVIDERS__0__BASE_URL"),
        "{stderr}"
    );
}

#[test]
fn help_explains_the_config_and_health_commands_and_the_environment_rule() {
    let help = text(&iop_node(&["--help"], &[]).stdout);
    for needle in ["config", "health", "IOP_NODE__<SECTION>__<FIELD>"] {
        assert!(help.contains(needle), "--help lacks {needle}: {help}");
    }
    let run = text(&iop_node(&["run", "--help"], &[]).stdout);
    assert!(run.contains("IOP_NODE__"), "{run}");
    let health = text(&iop_node(&["health", "--help"], &[]).stdout);
    assert!(health.contains("/readyz"), "{health}");
}

#[tokio::test]
async fn a_node_configured_by_the_environment_alone_serves_and_reports_ready() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    iop_transport::generate_dev_pki(&certs, &["node-1"], &[]).unwrap();
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, KEY).unwrap();
    std::fs::set_permissions(
        &key_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let edge_toml = r#"
[edge]
quic_listen = "127.0.0.1:0"
http_listen = "127.0.0.1:0"
state_dir = "edge-state"
drain_timeout_ms = 1000
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge.key"
[[providers]]
id = "p1"
node = "node-1"
adapter = "mock"
target = "m"
models = ["mock*"]
[[api_keys]]
principal = "tester"
key_file = "key"
"#;
    let edge = RunningEdge::start(EdgeConfig::parse(edge_toml, dir.path()).unwrap())
        .await
        .unwrap();

    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cert = |name: &str| certs.join(name).to_str().unwrap().to_owned();
    let env = [
        ("IOP_NODE__NODE__EDGE", edge.quic_addr.to_string()),
        (
            "IOP_NODE__NODE__STATE_DIR",
            dir.path().join("node-state").to_str().unwrap().to_owned(),
        ),
        ("IOP_NODE__NODE__METRICS_LISTEN", metrics.to_string()),
        ("IOP_NODE__TLS__CA", cert("ca.pem")),
        ("IOP_NODE__TLS__CERT", cert("node-node-1.pem")),
        ("IOP_NODE__TLS__KEY", cert("node-node-1.key")),
        ("IOP_NODE__PROVIDERS__0__ADAPTER", "mock".into()),
        ("IOP_NODE__PROVIDERS__0__TARGET", "m".into()),
    ];
    let mut node = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-node"))
        .arg("run")
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn iop-node");

    let healthz = format!("http://{metrics}/healthz");
    let readyz = format!("http://{metrics}/readyz");
    wait_health(&healthz, true).await;
    let out = wait_health(&readyz, true).await;
    assert!(text(&out.stdout).contains("HTTP 200"), "{out:?}");
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", edge.http_addr))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(r#"{"model":"mock:tokens=2","messages":[{"role":"user","content":"hi"}]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("tok0 tok1"));

    // The Edge goes away: the node lives on, but is not ready.
    edge.shutdown().await;
    let out = wait_health(&readyz, false).await;
    assert!(text(&out.stderr).contains("HTTP 503"), "{out:?}");
    wait_health(&healthz, true).await;
    node.start_kill().unwrap();
    let _ = node.wait().await;
}
