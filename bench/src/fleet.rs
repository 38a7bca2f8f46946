//! Many Nodes in one process (`iop-bench fleet`): each a full
//! [`iop_node::RunningNode`] with its own certificate, QUIC endpoint and
//! connection to the Edge, serving the built-in mock adapter. Used by the
//! node-scale scenario to put hundreds of connections on one Edge without
//! hundreds of processes.
//!
//! It prints one JSON line when the configs are loaded (before any node
//! starts) and one when every node is ready, each with its own RSS, then
//! runs until killed.

use iop_node::config::ConfigFile as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use iop_node::RunningNode;
use iop_node::config::NodeConfig;

/// The most nodes one fleet runs.
pub const MAX_FLEET_NODES: usize = 2_000;

/// How long every node may take to become ready.
const READY_BOUND: Duration = Duration::from_secs(120);

/// The config file of fleet node `i` (1-based) inside the fleet directory.
pub fn node_config_file(i: usize) -> String {
    format!("fleet-node-{i}.toml")
}

/// Node id of fleet node `i`.
pub fn node_id(i: usize) -> String {
    format!("f{i}")
}

/// Run `count` nodes from `dir/fleet-node-<i>.toml` until killed.
pub async fn run(dir: &Path, count: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=MAX_FLEET_NODES).contains(&count),
        "--count must be 1..={MAX_FLEET_NODES}"
    );
    let mut configs = Vec::with_capacity(count);
    for i in 1..=count {
        let path = dir.join(node_config_file(i));
        configs
            .push(NodeConfig::load(&path).with_context(|| format!("loading {}", path.display()))?);
    }
    let pid = std::process::id();
    println!(
        "{}",
        serde_json::json!({"event": "fleet_loaded", "nodes": count, "rss_bytes": crate::procfs::rss_bytes(pid)?})
    );
    let started = Instant::now();
    let nodes: Vec<RunningNode> = configs.into_iter().map(RunningNode::start).collect();
    loop {
        let ready = nodes.iter().filter(|n| n.generation().is_some()).count();
        if ready == count {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < READY_BOUND,
            "only {ready} of {count} nodes ready after {READY_BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "{}",
        serde_json::json!({
            "event": "fleet_ready",
            "nodes": count,
            "ready_after_ms": started.elapsed().as_millis() as u64,
            "rss_bytes": crate::procfs::rss_bytes(pid)?,
        })
    );
    iop_transport::signals::shutdown_signal().await;
    for n in nodes {
        let _ = n.shutdown().await;
    }
    Ok(())
}
