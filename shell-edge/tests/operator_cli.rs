//! The operator's commands of the real `iop-edge` binary: `config example`
//! prints the commented example that `config check` (the real loader)
//! accepts, `--help` explains the environment rule, an Edge configured by
//! `IOP_EDGE__*` variables alone serves a request, and `health` is what a
//! container's HEALTHCHECK runs against it.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Pki, bounded, free_tcp_port, free_udp_port, mock_provider_node, start_node};

const KEY: &str = "sk-operator-cli-0123456789";

/// `iop-edge ARGS` with exactly the environment `env` (nothing inherited,
/// so a variable of the machine running the tests cannot change it).
fn iop_edge(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iop-edge"))
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run iop-edge")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn config_example_prints_a_config_that_config_check_accepts() {
    let out = iop_edge(&["config", "example"], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let example = text(&out.stdout);
    assert_eq!(example, iop_edge::config::EXAMPLE);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edge.toml");
    std::fs::write(&path, &example).unwrap();
    let path = path.to_str().unwrap();

    let out = iop_edge(
        &["config", "check", "--config", path],
        &[("IOP_ADMIN_KEY", KEY)],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with("configuration ok: http 127.0.0.1:8080"),
        "{}",
        text(&out.stdout)
    );

    // The secret its api key names is missing: refused, by field.
    let out = iop_edge(&["config", "check", "--config", path], &[]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("api_keys[0].key_env"), "{stderr}");
    assert!(stderr.contains("IOP_ADMIN_KEY"), "{stderr}");

    // A variable wins over the file; a bad one is named with its field.
    let out = iop_edge(
        &["config", "check", "--config", path],
        &[
            ("IOP_ADMIN_KEY", KEY),
            ("IOP_EDGE__EDGE__HTTP_LISTEN", "0.0.0.0:9999"),
        ],
    );
    assert!(text(&out.stdout).contains("http 0.0.0.0:9999"), "{out:?}");
    let out = iop_edge(
        &["config", "check", "--config", path],
        &[
            ("IOP_ADMIN_KEY", KEY),
            ("IOP_EDGE__ADMISSION__MAX_ATTEMPTS", "99"),
        ],
    );
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("admission.max_attempts")
            && stderr.contains("IOP_EDGE__ADMISSION__MAX_ATTEMPTS"),
        "{stderr}"
    );
}

#[test]
fn help_explains_the_config_and_health_commands_and_the_environment_rule() {
    let help = text(&iop_edge(&["--help"], &[]).stdout);
    for needle in ["config", "health", "IOP_EDGE__<SECTION>__<FIELD>"] {
        assert!(help.contains(needle), "--help lacks {needle}: {help}");
    }
    let run = text(&iop_edge(&["run", "--help"], &[]).stdout);
    assert!(run.contains("IOP_EDGE__"), "{run}");
    let config = text(&iop_edge(&["config", "--help"], &[]).stdout);
    assert!(
        config.contains("example") && config.contains("check"),
        "{config}"
    );
}

#[test]
fn health_of_a_closed_port_fails_and_says_why() {
    let port = free_tcp_port().to_string();
    let url = format!("http://127.0.0.1:{port}/healthz");
    let out = iop_edge(&["health", "--url", &url], &[]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("cannot connect"), "{out:?}");
}

#[tokio::test]
async fn an_edge_configured_by_the_environment_alone_serves_and_reports_healthy() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let certs = pki.certs();
        let cert = |name: &str| certs.join(name).to_str().unwrap().to_owned();
        let state = pki.path().join("edge-state");
        let (http_port, quic_port) = (free_tcp_port(), free_udp_port());
        let http_listen = format!("127.0.0.1:{http_port}");
        let quic_listen = format!("127.0.0.1:{quic_port}");
        let env = [
            (
                "IOP_EDGE__EDGE__STATE_DIR",
                state.to_str().unwrap().to_owned(),
            ),
            ("IOP_EDGE__EDGE__HTTP_LISTEN", http_listen.clone()),
            ("IOP_EDGE__EDGE__QUIC_LISTEN", quic_listen.clone()),
            ("IOP_EDGE__TLS__CA", cert("ca.pem")),
            ("IOP_EDGE__TLS__CERT", cert("edge.pem")),
            ("IOP_EDGE__TLS__KEY", cert("edge.key")),
            ("IOP_EDGE__HEARTBEAT__INTERVAL_MS", "200".into()),
            ("IOP_EDGE__HEARTBEAT__WAIT_MS", "300".into()),
            ("IOP_EDGE__PROVIDERS__0__ID", "p1".into()),
            ("IOP_EDGE__PROVIDERS__0__NODE", "node-1".into()),
            ("IOP_EDGE__PROVIDERS__0__ADAPTER", "mock".into()),
            ("IOP_EDGE__PROVIDERS__0__TARGET", "m".into()),
            ("IOP_EDGE__PROVIDERS__0__MODELS", "[\"mock*\"]".into()),
            ("IOP_EDGE__API_KEYS__0__PRINCIPAL", "ops".into()),
            ("IOP_EDGE__API_KEYS__0__KEY_ENV", "IOP_ADMIN_KEY".into()),
            ("IOP_EDGE__API_KEYS__0__ADMIN", "true".into()),
            ("IOP_ADMIN_KEY", KEY.into()),
        ];
        let mut edge = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-edge"))
            .arg("run")
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn iop-edge");

        // The HEALTHCHECK command passes once the Edge serves.
        let url = format!("http://{http_listen}/healthz");
        let started = Instant::now();
        loop {
            let out = iop_edge(&["health", "--url", &url, "--timeout-ms", "1000"], &[]);
            if out.status.success() {
                assert!(text(&out.stdout).contains("HTTP 200"), "{out:?}");
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the Edge never became healthy: {out:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        let node = start_node(
            &pki,
            "node-1",
            quic_listen.parse().unwrap(),
            &mock_provider_node("m"),
        );
        let http = reqwest::Client::new();
        let started = Instant::now();
        let body = loop {
            let resp = http
                .post(format!("http://{http_listen}/v1/chat/completions"))
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(r#"{"model":"mock:tokens=3","messages":[{"role":"user","content":"hi"}]}"#)
                .send()
                .await
                .unwrap();
            if resp.status() == 200 {
                break resp.text().await.unwrap();
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "no answer through the env-configured Edge: {}",
                resp.status()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(body.contains("tok0 tok1 tok2"), "{body}");

        node.shutdown().await.unwrap();
        edge.start_kill().unwrap();
        let _ = edge.wait().await;
        let out = iop_edge(&["health", "--url", &url, "--timeout-ms", "1000"], &[]);
        assert!(!out.status.success(), "a stopped Edge is not healthy");
    })
    .await;
}
