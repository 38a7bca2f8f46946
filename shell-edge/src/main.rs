//! `iop-edge`: the iop gateway binary.

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

/// The iop Edge: a gateway that puts LLM inference servers, reached through
/// iop Nodes over QUIC with mutual TLS, behind the OpenAI and Ollama APIs.
#[derive(Parser)]
#[command(name = "iop-edge", version, about, long_about = None, after_help = ENV_HELP)]
struct Cli {
    /// Log format: `text` for humans, `json` for log pipelines.
    #[arg(long, global = true, default_value = "text", env = "IOP_LOG_FORMAT")]
    log_format: iop_transport::logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// How the environment configures the Edge (in `--help`, `run --help` and
/// `config check --help`).
const ENV_HELP: &str = "\
Configuration from the environment: every config field can also be set by a
variable IOP_EDGE__<SECTION>__<FIELD>, which wins over the file: `__` between
the segments, an array entry by its index, the value read as TOML or else as
text. IOP_EDGE__EDGE__HTTP_LISTEN=0.0.0.0:8080, IOP_EDGE__PROVIDERS__0__CAPACITY=8,
IOP_EDGE__JOURNAL__NATS__SERVERS='[\"nats://a:4222\"]'. Secrets are never config
values: a field names the variable (`key_env`) or the file (`key_file`) that
holds each. `iop-edge config example` prints a commented configuration.";

#[derive(Subcommand)]
enum Command {
    /// Run the Edge from a TOML config file until SIGINT/SIGTERM.
    ///
    /// Durable responses are kept in `[journal] store`: `embedded` (one
    /// file under `state_dir`, the default), `memory`, or `nats` (NATS
    /// JetStream, `[journal.nats]`, shared by every Edge of a deployment,
    /// each with its own `[edge] edge_id`): the Edge connects at start,
    /// within `connect_timeout_ms`, or exits naming the servers.
    #[command(after_help = ENV_HELP)]
    Run {
        /// Path of the config file (docs/operations.md). IOP_EDGE__*
        /// variables are laid over it; without a file they give the whole
        /// configuration.
        #[arg(long, short, env = "IOP_EDGE_CONFIG")]
        config: Option<PathBuf>,
        /// Record every dispatcher input and output to this file, for
        /// `iop-sim replay` (see docs/simulation.md).
        #[arg(long)]
        record_trace: Option<PathBuf>,
        /// With --record-trace: record these machines instead (repeatable;
        /// edge-dispatch to the file itself, each other machine to
        /// `FILE.<kind>.<n>`): edge-dispatch, edge-link, edge-request,
        /// edge-custody, edge-tenants, store-availability.
        #[arg(long = "trace-machine", value_name = "KIND", value_parser = iop_trace::MachineKind::from_arg)]
        trace_machines: Vec<iop_trace::MachineKind>,
    },
    /// The demo is its own binary (`cargo run --release -p iop-demo`), so
    /// the Edge does not depend on the Node; `iop-edge demo` only says so.
    #[command(hide = true, disable_help_flag = true)]
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        _args: Vec<String>,
    },
    /// Print a running Edge's provider status as a table (reads `/status`
    /// with an admin key).
    Status {
        /// The Edge's HTTP base URL.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        url: String,
        /// Environment variable holding an admin API key.
        #[arg(long, default_value = "IOP_ADMIN_KEY")]
        key_env: String,
        /// Print the raw JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Runtime API keys and usage, through a running Edge's admin API
    /// (docs/tenants.md). The admin key comes from an environment variable.
    Keys {
        /// The Edge's HTTP base URL.
        #[arg(
            long,
            global = true,
            default_value = "http://127.0.0.1:8080",
            env = "IOP_EDGE_URL"
        )]
        url: String,
        /// Environment variable holding an admin API key.
        #[arg(long, global = true, default_value = "IOP_ADMIN_KEY")]
        key_env: String,
        #[command(subcommand)]
        command: Box<iop_edge::keys_cli::KeysCommand>,
    },
    /// Certificate management for a deployment.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// Print a commented example configuration, or check a configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Check a running Edge's health endpoint: exit 0 when it answers 2xx,
    /// else 1 with the reason. The command a container's HEALTHCHECK runs.
    Health {
        /// The endpoint (`/healthz` on the Edge's HTTP listener).
        #[arg(
            long,
            env = "IOP_EDGE_HEALTH_URL",
            default_value = "http://127.0.0.1:8080/healthz"
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
    /// package installs it as /etc/iop/edge.toml). `# name = value` lines
    /// show defaults; `#: ...` lines are optional settings and sections.
    Example,
    /// Load the configuration as `run` would (the file, the IOP_EDGE__*
    /// variables over it, the secrets it names) without starting: exit 0
    /// with a summary, or 1 naming the first field that is wrong.
    #[command(after_help = ENV_HELP)]
    Check {
        /// Path of the config file; without it, the environment alone.
        #[arg(long, short, env = "IOP_EDGE_CONFIG")]
        config: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum CertsCommand {
    /// Generate a dev CA, an edge certificate and node certificates.
    Init {
        /// Directory to write PEM files into (must not already hold them).
        #[arg(long)]
        out: PathBuf,
        /// A node id to issue a certificate for (repeat for more).
        #[arg(long = "node", default_value = "node-1")]
        nodes: Vec<String>,
        /// An extra DNS name for the edge certificate (repeat for more);
        /// `localhost`, 127.0.0.1 and ::1 are always included.
        #[arg(long = "edge-name")]
        edge_names: Vec<String>,
    },
    /// Issue a certificate for one more node with an existing CA.
    IssueNode {
        /// Directory holding `ca.pem` and `ca.key`; the node files go there too.
        #[arg(long)]
        dir: PathBuf,
        /// The node id.
        #[arg(long)]
        node: String,
        /// Validity in days.
        #[arg(long, default_value_t = 365)]
        days: u64,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The commands that start nothing: no logging, no runtime.
    match &cli.command {
        Command::Config(ConfigCommand::Example) => {
            print!("{}", iop_edge::config::EXAMPLE);
            return Ok(());
        }
        Command::Config(ConfigCommand::Check { config }) => {
            let env = Environment::from_process();
            let c = iop_edge::config::EdgeConfig::load_in(config.as_deref(), &env)?;
            println!(
                "configuration ok: http {}, quic {}, {} providers, {} routes, {} API keys, \
                 journal {}",
                c.edge.http_listen,
                c.edge.quic_listen,
                c.providers.len(),
                c.routes.len(),
                c.api_keys.len(),
                c.journal.store.as_str()
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
        let (loaded, runtime) = load_to_run::<iop_edge::config::EdgeConfig>(config.as_deref())?;
        return runtime.block_on(run(config, record_trace, trace_machines, loaded));
    }
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(async move {
        match cli.command {
            Command::Demo { .. } => anyhow::bail!(
                "the demo is no longer part of iop-edge; run it with `cargo run --release -p iop-demo`"
            ),
            Command::Status { url, key_env, json } => {
                let key = std::env::var(&key_env)
                    .with_context(|| format!("environment variable `{key_env}` is not set"))?;
                let resp = reqwest::Client::new()
                    .get(format!("{}/status", url.trim_end_matches('/')))
                    .bearer_auth(key)
                    .send()
                    .await
                    .with_context(|| format!("calling {url}/status"))?;
                let status = resp.status();
                let body = resp.bytes().await?;
                let doc: serde_json::Value =
                    serde_json::from_slice(&body).context("/status did not return JSON")?;
                if !status.is_success() {
                    anyhow::bail!("{status}: {}", doc["error"]["message"]);
                }
                if json {
                    println!("{}", serde_json::to_string_pretty(&doc)?);
                } else {
                    print!(
                        "{}",
                        iop_edge::status::status_table(&doc, iop_transport::clock::unix_ms())
                    );
                }
                Ok(())
            }
            Command::Keys {
                url,
                key_env,
                command,
            } => {
                let key = std::env::var(&key_env)
                    .with_context(|| format!("environment variable `{key_env}` is not set"))?;
                print!("{}", iop_edge::keys_cli::run(&url, &key, &command).await?);
                Ok(())
            }
            Command::Certs(CertsCommand::Init {
                out,
                nodes,
                edge_names,
            }) => {
                let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
                let names: Vec<&str> = edge_names.iter().map(String::as_str).collect();
                iop_transport::pki::generate_dev_pki(&out, &nodes, &names)?;
                println!(
                    "wrote a dev CA, edge and node certificates to {}",
                    out.display()
                );
                Ok(())
            }
            Command::Certs(CertsCommand::IssueNode { dir, node, days }) => {
                iop_transport::pki::issue_node_files(&dir, &node, days)?;
                println!("wrote node certificate for `{node}` to {}", dir.display());
                Ok(())
            }
            Command::Run { .. } | Command::Config(_) | Command::Health { .. } => Ok(()),
        }
    })
}

/// `iop-edge run`: the Edge from `config` (loaded from `path`, which SIGHUP
/// re-reads) until SIGINT/SIGTERM.
async fn run(
    path: Option<PathBuf>,
    record_trace: Option<PathBuf>,
    trace_machines: Vec<iop_trace::MachineKind>,
    config: iop_edge::config::EdgeConfig,
) -> anyhow::Result<()> {
    let options = iop_edge::server::EdgeOptions {
        record_trace,
        trace_machines,
    };
    let edge = iop_edge::server::RunningEdge::start_with(config, options).await?;
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("installing the SIGHUP handler")?;
    let shutdown = iop_transport::signals::shutdown_signal();
    tokio::pin!(shutdown);
    let refused = edge.refused();
    tokio::pin!(refused);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            // R-TAKE-2: never beside the process that renews
            // this edge_id.
            why = &mut refused => {
                tracing::error!(event = "edge_refused_by_store", error = %why);
                edge.shutdown().await;
                anyhow::bail!("{why}");
            }
            _ = hup.recv() => {
                // Re-read [[credentials]] only: secrets, revisions,
                // disabled flags (docs/credentials.md).
                match iop_edge::config::EdgeConfig::load_credentials(path.as_deref(), &Environment::from_process()) {
                    Ok(profiles) => {
                        tracing::info!(event = "edge_credentials_reloaded", profiles = profiles.len());
                        edge.reload_credentials(&profiles);
                    }
                    Err(e) => tracing::error!(event = "edge_credentials_reload_failed", error = %e),
                }
                // And the node certificate denylist.
                match iop_edge::config::EdgeConfig::load_in(path.as_deref(), &Environment::from_process()) {
                    Ok(reloaded) => {
                        tracing::info!(
                            event = "edge_revoked_node_certificates_reloaded",
                            revoked = reloaded.edge.revoked_node_certificates.len()
                        );
                        edge.reload_revoked_node_certificates(&reloaded);
                    }
                    Err(e) => tracing::error!(event = "edge_revoked_node_certificates_reload_failed", error = %e),
                }
            }
        }
    }
    tracing::info!(event = "edge_shutdown");
    edge.shutdown().await;
    Ok(())
}
