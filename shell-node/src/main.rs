//! `iop-node`: the iop Node agent binary.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// The iop Node: runs next to LLM inference servers, dials out to an iop
/// Edge over QUIC with mutual TLS, and executes the work the Edge sends.
#[derive(Parser)]
#[command(name = "iop-node", version, about, long_about = None)]
struct Cli {
    /// Log format: `text` for humans, `json` for log pipelines.
    #[arg(long, global = true, default_value = "text", env = "IOP_LOG_FORMAT")]
    log_format: iop_transport::logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node from a TOML config file until SIGINT/SIGTERM.
    Run {
        /// Path of the config file (see docs/operations.md).
        #[arg(long, short, env = "IOP_NODE_CONFIG")]
        config: PathBuf,
        /// Record each connection's watchdog inputs and outputs to
        /// `FILE.<generation>`, for `iop-sim replay` (docs/simulation.md).
        #[arg(long, value_name = "FILE")]
        record_trace: Option<PathBuf>,
    },
    /// Serve the built-in deterministic mock provider over HTTP
    /// (OpenAI- and Ollama-compatible), for tests and benchmarks.
    MockProvider(iop_node::mock::MockArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    iop_transport::logging::init(cli.log_format);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        match cli.command {
            Command::Run {
                config,
                record_trace,
            } => {
                let config = iop_node::config::NodeConfig::load(&config)?;
                let node = iop_node::RunningNode::start_with(
                    config,
                    iop_node::NodeOptions { record_trace },
                );
                iop_transport::signals::shutdown_signal().await;
                tracing::info!(event = "node_shutdown");
                node.shutdown().await?;
                Ok(())
            }
            Command::MockProvider(args) => iop_node::mock::run_cli(args).await,
        }
    })
}
