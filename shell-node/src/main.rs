//! `iop-node`: the iop Node agent binary.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// The process allocator: mimalloc spends less CPU per request than glibc's
/// malloc on the many small, short-lived allocations of a request
/// (docs/benchmarks.md, "The allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
                let mut node = iop_node::RunningNode::start_with(
                    config,
                    iop_node::NodeOptions { record_trace },
                );
                // A node that cannot start (identity, recipient key,
                // certificates, QUIC endpoint) ends the process with the
                // cause instead of waiting idle for a signal.
                let ended = tokio::select! {
                    result = node.stopped() => Some(result),
                    () = iop_transport::signals::shutdown_signal() => None,
                };
                match ended {
                    Some(result) => {
                        if let Err(e) = &result {
                            tracing::error!(event = "node_start_failed", error = %e);
                        }
                        result.context("the node could not start")
                    }
                    None => {
                        tracing::info!(event = "node_shutdown");
                        node.shutdown().await?;
                        Ok(())
                    }
                }
            }
            Command::MockProvider(args) => iop_node::mock::run_cli(args).await,
        }
    })
}
