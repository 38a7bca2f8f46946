//! `iop-demo`: a complete local iop deployment in one process (an Edge and
//! a Node on loopback, dev certificates, Ollama if found, else the built-in
//! mock provider) that prints how to call it.
//!
//! It is a crate of its own so that the Edge does not depend on the Node:
//! `cargo run --release -p iop-demo`.

use anyhow::Context;
use clap::Parser;

mod demo;

/// The process allocator, as in `iop-edge` and `iop-node`
/// (docs/benchmarks.md, "The allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Run a complete local deployment (Edge + Node on loopback, dev
/// certificates, Ollama if found, else the built-in mock provider) and
/// print how to call it.
#[derive(Parser)]
#[command(name = "iop-demo", version, about, long_about = None)]
struct Cli {
    /// Log format: `text` for humans, `json` for log pipelines.
    #[arg(long, default_value = "text", env = "IOP_LOG_FORMAT")]
    log_format: iop_transport::logging::LogFormat,
    #[command(flatten)]
    demo: demo::DemoArgs,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    iop_transport::logging::init(cli.log_format);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new().context("starting the tokio runtime")?;
    runtime.block_on(demo::run(cli.demo))
}
