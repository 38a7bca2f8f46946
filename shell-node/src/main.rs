//! `iop-node`: the iop Node agent binary.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use iop_transport::config_file::{ConfigFile as _, load_to_run};
use iop_transport::environment::Environment;

/// The process allocator: mimalloc spends less CPU per request than glibc's
/// malloc on the many small, short-lived allocations of a request
/// (docs/benchmarks.md, "The allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The iop Node: runs next to LLM inference servers, dials out to an iop
/// Edge over QUIC with mutual TLS, and executes the work the Edge sends.
#[derive(Parser)]
#[command(name = "iop-node", version, about, long_about = None, after_help = ENV_HELP)]
struct Cli {
    /// Log format: `text` for humans, `json` for log pipelines.
    #[arg(long, global = true, default_value = "text", env = "IOP_LOG_FORMAT")]
    log_format: iop_transport::logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// How the environment configures the Node (in `--help`, `run --help` and
/// `config check --help`).
const ENV_HELP: &str = "\
Configuration from the environment: every config field can also be set by a
variable IOP_NODE__<SECTION>__<FIELD>, which wins over the file: `__` between
the segments, an array entry by its index, the value read as TOML or else as
text. IOP_NODE__NODE__EDGE=edge.example.com:7443,
IOP_NODE__NODE__EDGES='[\"edge-1:7443\", \"edge-2:7443\"]',
IOP_NODE__PROVIDERS__0__BASE_URL=http://127.0.0.1:8000. Secrets are never
config values: a field names the variable (`api_key_env`) or the file
(`api_key_file`) that holds each. `iop-node config example` prints a
commented configuration.";

#[derive(Subcommand)]
enum Command {
    /// Run the node from a TOML config file until SIGINT/SIGTERM.
    #[command(after_help = ENV_HELP)]
    Run {
        /// Path of the config file (docs/operations.md). IOP_NODE__*
        /// variables are laid over it; without a file they give the whole
        /// configuration.
        #[arg(long, short, env = "IOP_NODE_CONFIG")]
        config: Option<PathBuf>,
        /// Record each connection's watchdog inputs and outputs to
        /// `FILE.<generation>`, for `iop-sim replay` (docs/simulation.md).
        #[arg(long, value_name = "FILE")]
        record_trace: Option<PathBuf>,
        /// With --record-trace: record these machines instead (repeatable;
        /// node-link to `FILE.<n>`, node-run to `FILE.node-run.<n>`).
        #[arg(long = "trace-machine", value_name = "KIND", value_parser = iop_trace::MachineKind::from_arg)]
        trace_machines: Vec<iop_trace::MachineKind>,
    },
    /// Serve the built-in deterministic mock provider over HTTP
    /// (OpenAI- and Ollama-compatible), for tests and benchmarks.
    MockProvider(iop_node::mock::MockArgs),
    /// Print a commented example configuration, or check a configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Check a running Node's health endpoint: exit 0 when it answers 2xx,
    /// else 1 with the reason. The command a container's HEALTHCHECK runs;
    /// the endpoints are served on `[node] metrics_listen`: `/healthz` (the
    /// process serves) and `/readyz` (an Edge connection is ready).
    Health {
        /// The endpoint.
        #[arg(
            long,
            env = "IOP_NODE_HEALTH_URL",
            default_value = "http://127.0.0.1:9464/healthz"
        )]
        url: String,
        /// Bound of the whole check.
        #[arg(long, default_value_t = 2000)]
        timeout_ms: u64,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print a commented configuration that loads as it is (the Debian
    /// package installs it as /etc/iop/node.toml). `# name = value` lines
    /// show defaults; `#: ...` lines are optional settings and sections.
    Example,
    /// Load the configuration as `run` would (the file, the IOP_NODE__*
    /// variables over it, the secrets it names) without starting: exit 0
    /// with a summary, or 1 naming the first field that is wrong.
    #[command(after_help = ENV_HELP)]
    Check {
        /// Path of the config file; without it, the environment alone.
        #[arg(long, short, env = "IOP_NODE_CONFIG")]
        config: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The commands that start nothing: no logging, no runtime.
    match &cli.command {
        Command::Config(ConfigCommand::Example) => {
            print!("{}", iop_node::config::EXAMPLE);
            return Ok(());
        }
        Command::Config(ConfigCommand::Check { config }) => {
            let env = Environment::from_process();
            let c = iop_node::config::NodeConfig::load_in(config.as_deref(), &env)?;
            let metrics = c
                .node
                .metrics_listen
                .map_or_else(|| "off".to_owned(), |a| a.to_string());
            println!(
                "configuration ok: {} Edges ({}), {} providers, metrics {metrics}",
                c.edges.len(),
                c.edges.join(", "),
                c.providers.len(),
            );
            return Ok(());
        }
        Command::Health { url, timeout_ms } => {
            println!("{}", iop_transport::health_check::report(url, *timeout_ms)?);
            return Ok(());
        }
        _ => {}
    }
    iop_transport::logging::init(cli.log_format);
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Command::Run {
        config,
        record_trace,
        trace_machines,
    } = cli.command
    {
        // The configuration first: its `[runtime]` says which runtime to
        // start.
        let (loaded, runtime) = load_to_run::<iop_node::config::NodeConfig>(config.as_deref())?;
        return runtime.block_on(run(loaded, record_trace, trace_machines));
    }
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        match cli.command {
            Command::MockProvider(args) => iop_node::mock::run_cli(args).await,
            Command::Run { .. } | Command::Config(_) | Command::Health { .. } => Ok(()),
        }
    })
}

/// `iop-node run`: the Node from `config` until SIGINT/SIGTERM, or until it
/// cannot start.
async fn run(
    config: iop_node::config::NodeConfig,
    record_trace: Option<PathBuf>,
    trace_machines: Vec<iop_trace::MachineKind>,
) -> anyhow::Result<()> {
    let options = iop_node::NodeOptions {
        record_trace,
        trace_machines,
    };
    let mut node = iop_node::RunningNode::start_with(config, options);
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
