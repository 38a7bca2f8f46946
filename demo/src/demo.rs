//! The demo: a working Edge + Node deployment on loopback in one process,
//! with real QUIC between them and a real HTTP provider behind the node.
//!
//! On first run it generates a dev PKI and an API key under the demo
//! directory. It uses Ollama if one answers on `localhost:11434`, and
//! otherwise serves the built-in mock provider over HTTP and points the
//! node's real `openai` adapter at it.

use iop_edge::config::ConfigFile as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;

/// Demo options.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DemoArgs {
    /// Where certificates, the API key and state are kept.
    #[arg(long, default_value = ".iop-demo")]
    pub(crate) dir: PathBuf,
    /// Client-facing HTTP address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub(crate) http_listen: SocketAddr,
    /// QUIC address nodes dial.
    #[arg(long, default_value = "127.0.0.1:7443")]
    pub(crate) quic_listen: SocketAddr,
    /// Ollama to use if it answers (set to an empty string to never use it).
    #[arg(long, default_value = "http://127.0.0.1:11434")]
    pub(crate) ollama: String,
}

const NODE_ID: &str = "demo-node";

/// Run the demo until Ctrl-C.
pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = args.dir.canonicalize()?;
    let certs = dir.join("certs");
    if !certs.join("ca.pem").exists() {
        iop_transport::generate_dev_pki(&certs, &[NODE_ID], &[])?;
        eprintln!("generated dev certificates in {}", certs.display());
    }
    let key = api_key(&dir)?;

    // A real provider if one is there, else the mock served over HTTP.
    let ollama_models = if args.ollama.is_empty() {
        None
    } else {
        ollama_models(&args.ollama).await
    };
    let mut mock = None;
    let (adapter, base_url, models) = match ollama_models {
        Some(models) if !models.is_empty() => ("ollama", args.ollama.clone(), models),
        _ => {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let server =
                iop_node::mock::serve(listener, iop_node::mock::MockScript::default()).await?;
            let url = format!("http://{}", server.addr());
            mock = Some(server);
            ("openai", url, vec!["mock".to_owned()])
        }
    };
    let model_list = models
        .iter()
        .map(|m| format!("\"{m}\""))
        .collect::<Vec<_>>()
        .join(", ");

    let edge_toml = format!(
        r#"
[edge]
quic_listen = "{quic}"
http_listen = "{http}"
state_dir = "edge-state"
[tls]
ca = "certs/ca.pem"
cert = "certs/edge.pem"
key = "certs/edge.key"
[[providers]]
id = "demo"
node = "{NODE_ID}"
adapter = "{adapter}"
target = "local"
models = [{model_list}]
capacity = 16
[[api_keys]]
principal = "demo"
key_file = "api-key"
admin = true
"#,
        quic = args.quic_listen,
        http = args.http_listen,
    );
    let node_toml = format!(
        r#"
[node]
edge = "{quic}"
state_dir = "node-state"
[tls]
ca = "certs/ca.pem"
cert = "certs/node-{NODE_ID}.pem"
key = "certs/node-{NODE_ID}.key"
[[providers]]
adapter = "{adapter}"
target = "local"
base_url = "{base_url}"
models = [{model_list}]
"#,
        quic = args.quic_listen,
    );
    std::fs::write(dir.join("edge.toml"), &edge_toml)?;
    std::fs::write(dir.join("node.toml"), &node_toml)?;
    let edge_config = EdgeConfig::load(&dir.join("edge.toml"))?;
    let node_config = iop_node::config::NodeConfig::load(&dir.join("node.toml"))?;

    let edge = RunningEdge::start(edge_config).await?;
    let node = iop_node::RunningNode::start(node_config);
    let http = edge.http_addr;

    // SIGINT is ours from now on: a Ctrl-C right after the banner stops
    // the demo gracefully instead of killing it.
    #[cfg(unix)]
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    // Wait until the node is ready so the printed curl works at once.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while node.generation().is_none() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let model = &models[0];
    println!();
    println!(
        "iop demo is running: an Edge and a Node on loopback (QUIC {}),",
        edge.quic_addr
    );
    match &mock {
        Some(_) => {
            println!("serving the built-in mock provider through the node's openai adapter.")
        }
        None => println!(
            "serving Ollama at {} through the node's ollama adapter.",
            args.ollama
        ),
    }
    println!();
    println!("  base URL : http://{http}/v1");
    println!("  API key  : {key}");
    println!("  models   : {}", models.join(", "));
    println!();
    println!("  curl -s http://{http}/v1/chat/completions \\");
    println!("    -H 'Authorization: Bearer {key}' -H 'content-type: application/json' \\");
    println!(
        "    -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}],\"stream\":true}}'"
    );
    println!();
    println!("  Python: OpenAI(base_url=\"http://{http}/v1\", api_key=\"{key}\")");
    println!("  Status: curl -s -H 'Authorization: Bearer {key}' http://{http}/status");
    println!("  Console: http://{http}/console (sign in with the API key above)");
    println!();
    println!("Ctrl-C to stop.");

    #[cfg(unix)]
    tokio::select! {
        _ = interrupt.recv() => {}
        () = iop_transport::signals::shutdown_signal() => {}
    }
    #[cfg(not(unix))]
    iop_transport::signals::shutdown_signal().await;
    eprintln!("stopping");
    let _ = node.shutdown().await;
    edge.shutdown().await;
    drop(mock);
    Ok(())
}

/// The demo's API key: generated once, kept in `dir/api-key` (0600).
fn api_key(dir: &Path) -> anyhow::Result<String> {
    let path = dir.join("api-key");
    if let Ok(text) = std::fs::read_to_string(&path) {
        let key = text.trim().to_owned();
        if key.len() >= 16 {
            return Ok(key);
        }
    }
    let bytes: [u8; 16] = rand::random();
    let key = format!(
        "iop-demo-{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    write_secret(&path, &key)?;
    Ok(key)
}

fn write_secret(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = options.open(path)?;
    writeln!(f, "{text}")
}

/// Models of an Ollama at `base`, if it answers quickly.
async fn ollama_models(base: &str) -> Option<Vec<String>> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(700))
        .build()
        .ok()?;
    let resp = client.get(format!("{base}/api/tags")).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let bytes = resp.bytes().await.ok()?;
    let body: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    Some(
        body.get("models")?
            .as_array()?
            .iter()
            .filter_map(|m| m.get("name")?.as_str().map(str::to_owned))
            .collect(),
    )
}
