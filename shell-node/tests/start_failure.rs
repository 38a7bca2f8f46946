//! A node process that cannot start (a missing certificate, a recipient key
//! other users could read) exits non-zero at once and names the cause on
//! stderr, instead of waiting idle for a signal (SPEC §5: invalid setup
//! refuses to start and says why).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// Longer than any start error takes; far shorter than "waits for a signal".
const EXIT_BOUND: Duration = Duration::from_secs(20);

fn node_toml(cert: &str) -> String {
    format!(
        r#"
[node]
edge = "127.0.0.1:9"
state_dir = "node-state"
[tls]
ca = "certs/ca.pem"
cert = "{cert}"
key = "certs/node-node-1.key"
[[providers]]
adapter = "mock"
target = "t"
"#
    )
}

/// Run `iop-node run --config <dir>/node.toml`; its exit status and stderr.
async fn run_node(dir: &Path, toml: &str) -> (std::process::ExitStatus, String) {
    let config = dir.join("node.toml");
    std::fs::write(&config, toml).unwrap();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-node"))
        .args(["run", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn iop-node");
    let out = tokio::time::timeout(EXIT_BOUND, child.wait_with_output())
        .await
        .expect("a node that cannot start must exit, not wait for a signal")
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn missing_certificate_exits_non_zero_and_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    iop_transport::generate_dev_pki(&dir.path().join("certs"), &["node-1"], &[]).unwrap();
    let (status, stderr) = run_node(dir.path(), &node_toml("certs/missing-node.pem")).await;
    assert!(!status.success(), "exit status {status}; stderr: {stderr}");
    assert!(
        stderr.contains("missing-node.pem"),
        "stderr must name the missing file: {stderr}"
    );
    assert!(
        stderr.contains("could not start"),
        "stderr must say the node did not start: {stderr}"
    );
}

#[tokio::test]
async fn recipient_key_readable_by_others_exits_non_zero_and_names_the_mode() {
    let dir = tempfile::tempdir().unwrap();
    iop_transport::generate_dev_pki(&dir.path().join("certs"), &["node-1"], &[]).unwrap();
    let state = dir.path().join("node-state");
    std::fs::create_dir_all(&state).unwrap();
    let key = state.join("recipient.key");
    std::fs::write(&key, [7u8; 32]).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (status, stderr) = run_node(dir.path(), &node_toml("certs/node-node-1.pem")).await;
    assert!(!status.success(), "exit status {status}; stderr: {stderr}");
    assert!(
        stderr.contains("recipient.key") && stderr.contains("mode 644"),
        "stderr must name the key file and its mode: {stderr}"
    );
}

#[tokio::test]
async fn metrics_address_in_use_exits_non_zero_and_names_it() {
    let dir = tempfile::tempdir().unwrap();
    iop_transport::generate_dev_pki(&dir.path().join("certs"), &["node-1"], &[]).unwrap();
    // Another process holds the port.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let toml = node_toml("certs/node-node-1.pem").replace(
        "state_dir = \"node-state\"\n",
        &format!("state_dir = \"node-state\"\nmetrics_listen = \"{addr}\"\n"),
    );
    let (status, stderr) = run_node(dir.path(), &toml).await;
    assert!(!status.success(), "exit status {status}; stderr: {stderr}");
    assert!(
        stderr.contains(&addr.to_string()),
        "stderr must name the metrics address: {stderr}"
    );
    drop(taken);
}
