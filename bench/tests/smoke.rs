//! CI smoke of the benchmark tools, so they cannot rot: a few seconds of
//! load at a low rate against an in-process deployment (real HTTP into an
//! Edge, real QUIC to a Node, real HTTP to the mock), checking that every
//! report is well-formed and has zero errors. No timing is asserted: speed
//! is measured by `scripts/bench`, not by tests.

use std::time::Duration;

use iop_bench::deployment::{API_KEY, edge_config_head, node_config, write_pki};
use iop_bench::load::{self, LoadSpec, Target};
use iop_bench::report::{LoadMode, LoadReport, added_latency_table, load_table};
use iop_edge::config::EdgeConfig;
use iop_edge::server::RunningEdge;
use iop_node::RunningNode;
use iop_node::config::NodeConfig;
use iop_node::mock::{MockScript, MockServer};

struct InProcess {
    _dir: tempfile::TempDir,
    edge: RunningEdge,
    node: RunningNode,
    mock: MockServer,
}

impl InProcess {
    /// A mock, an Edge with a normalized (`mock`, `mock:*`) and a tunnel
    /// (`mock-tunnel`) provider, and one Node, all in this process.
    async fn start() -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().expect("tempdir");
        write_pki(dir.path(), &["n1".to_owned()]).expect("pki");
        let mock = MockServer::start(MockScript::default())
            .await
            .expect("mock");
        let mut edge_toml = edge_config_head(0, 0, 256);
        edge_toml.push_str(
            "[[providers]]\nid = \"norm\"\nnode = \"n1\"\nadapter = \"openai\"\ntarget = \"t\"\ncapacity = 64\n\
             [[providers]]\nid = \"tun\"\nnode = \"n1\"\nadapter = \"openai\"\ntarget = \"t\"\ncapacity = 64\nmode = \"tunnel\"\n\
             [[routes]]\nmodel = \"mock\"\nproviders = [\"norm\"]\n\
             [[routes]]\nmodel = \"mock:*\"\nproviders = [\"norm\"]\n\
             [[routes]]\nmodel = \"mock-tunnel\"\nproviders = [\"tun\"]\n",
        );
        let edge =
            RunningEdge::start(EdgeConfig::parse(&edge_toml, dir.path()).expect("edge config"))
                .await
                .expect("edge");
        let providers = format!(
            "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
            mock.base_url()
        );
        let node_toml = node_config("n1", edge.quic_addr, 256, &providers);
        let node =
            RunningNode::start(NodeConfig::parse(&node_toml, dir.path()).expect("node config"));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while node.generation().is_none() {
            assert!(tokio::time::Instant::now() < deadline, "node not ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self {
            _dir: dir,
            edge,
            node,
            mock,
        }
    }

    fn via(&self, model: &str) -> Target {
        Target {
            url: format!("http://{}/v1/chat/completions", self.edge.http_addr),
            api_key: Some(API_KEY.to_owned()),
            model: model.to_owned(),
        }
    }

    fn direct(&self) -> Target {
        Target {
            url: format!("{}/v1/chat/completions", self.mock.base_url()),
            api_key: None,
            model: "mock".to_owned(),
        }
    }

    async fn stop(self) {
        let _ = self.node.shutdown().await;
        self.edge.shutdown().await;
    }
}

/// The report is internally consistent and the run had no error.
fn assert_well_formed(r: &LoadReport, stream: bool) {
    assert_eq!(
        r.errors,
        Default::default(),
        "{}: errors {:?}",
        r.label,
        r.errors
    );
    assert!(r.ok > 0, "{}: nothing completed", r.label);
    assert_eq!(r.requests, r.ok + r.error_count());
    let total = r.total.expect("total latency percentiles");
    assert_eq!(total.count, r.ok);
    let q = total.quantiles_us();
    assert!(
        q.windows(2).all(|w| w[0] <= w[1]),
        "{}: percentiles not ordered {q:?}",
        r.label
    );
    assert!(total.max_us >= total.p999_us);
    assert!(r.window_s > 0.0 && r.throughput_rps > 0.0);
    if stream {
        let ttft = r.ttft.expect("ttft percentiles");
        assert_eq!(ttft.count, r.ok, "{}: one TTFT per stream", r.label);
        assert!(r.gap.is_some() && r.chunks >= r.ok);
    } else {
        assert!(r.ttft.is_none() && r.gap.is_none());
        assert_eq!(r.chunks, 0);
    }
    let json = serde_json::to_string(r).expect("json");
    let back: LoadReport = serde_json::from_str(&json).expect("json round trip");
    assert_eq!(&back, r);
    let table = load_table(std::slice::from_ref(r));
    assert_eq!(table.lines().count(), 3, "{table}");
}

fn spec(label: &str, target: Target, stream: bool, mode: LoadMode) -> LoadSpec {
    let mut s = LoadSpec::new(label, target, stream, mode, Duration::from_millis(1500));
    s.warmup = Duration::from_millis(300);
    s.request_timeout = Duration::from_secs(10);
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_generator_reports_are_well_formed_with_zero_errors_through_the_gateway() {
    let d = InProcess::start().await;
    let client = load::client().expect("client");
    let open = LoadMode::Open { rate_per_s: 40.0 };
    let mut reports = Vec::new();
    for (label, target) in [
        ("direct", d.direct()),
        ("iop tunnel", d.via("mock-tunnel")),
        ("iop normalized", d.via("mock")),
    ] {
        let r = load::run(&client, &spec(label, target, false, open))
            .await
            .expect("run");
        assert_well_formed(&r, false);
        reports.push(r);
    }
    let table = added_latency_table(&[iop_bench::report::Comparison {
        direct: reports[0].clone(),
        via: reports[1..].to_vec(),
    }]);
    assert_eq!(table.lines().count(), 5, "{table}");

    // Streams, both loops, both modes.
    let closed = LoadMode::Closed { concurrency: 2 };
    for (label, target, mode) in [
        ("iop normalized", d.via("mock"), closed),
        ("iop tunnel", d.via("mock-tunnel"), closed),
        ("iop normalized", d.via("mock"), open),
    ] {
        let r = load::run(&client, &spec(label, target, true, mode))
            .await
            .expect("run");
        assert_well_formed(&r, true);
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_streams_stay_in_flight_until_closed() {
    let d = InProcess::start().await;
    let client = load::client().expect("client");
    // Slow streams: 100 tokens at 20 per second.
    let held = load::hold_streams(&client, &d.via("mock:tokens=100,tps=20"), 5, 100.0)
        .await
        .expect("hold");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while held.snapshot().first_chunk < 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            held.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(d.mock.in_flight(), 5);
    let s = held.snapshot();
    assert_eq!((s.started, s.failed, s.ended), (5, 0, 0));
    held.close().await;
    tokio::time::timeout(
        Duration::from_secs(20),
        d.mock.wait_for(|s| s.in_flight == 0),
    )
    .await
    .expect("closing the client streams ends the provider calls");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_counts_requests_it_cannot_launch_as_backlog() {
    let d = InProcess::start().await;
    let client = load::client().expect("client");
    // Each answer takes ~1 s; at most 2 may be outstanding.
    let mut s = spec(
        "direct",
        d.direct(),
        false,
        LoadMode::Open { rate_per_s: 20.0 },
    );
    s.target.model = "mock:prefill_ms=1000".into();
    s.max_in_flight = 2;
    let r = load::run(&client, &s).await.expect("run");
    assert!(
        r.errors.get("backlog").copied().unwrap_or(0) > 0,
        "{:?}",
        r.errors
    );
    assert_eq!(r.requests, r.ok + r.error_count());
    d.stop().await;
}

#[test]
fn load_command_prints_a_json_report_and_a_table() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mock = rt
        .block_on(MockServer::start(MockScript::default()))
        .expect("mock");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iop-bench"))
        .args([
            "load",
            "--url",
            &format!("{}/v1/chat/completions", mock.base_url()),
            "--stream",
            "--rate",
            "30",
            "--duration-s",
            "1.2",
            "--warmup-s",
            "0.2",
            "--label",
            "cli",
        ])
        .output()
        .expect("iop-bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let (json, table) = text.split_once("\n\n").expect("json then table");
    let r: LoadReport = serde_json::from_str(json).expect("json report");
    assert_well_formed(&r, true);
    assert!(table.contains("| cli | open 30/s | yes |"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_command_connects_every_node_to_one_edge() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().expect("tempdir");
    let ids: Vec<String> = (1..=3).map(iop_bench::fleet::node_id).collect();
    write_pki(dir.path(), &ids).expect("pki");
    let mut edge_toml = edge_config_head(0, 0, 16);
    for id in &ids {
        edge_toml.push_str(&format!(
            "[[providers]]\nid = \"p-{id}\"\nnode = \"{id}\"\nadapter = \"mock\"\ntarget = \"m\"\ncapacity = 1\n"
        ));
    }
    let edge = RunningEdge::start(EdgeConfig::parse(&edge_toml, dir.path()).expect("edge config"))
        .await
        .expect("edge");
    for (i, id) in ids.iter().enumerate() {
        let text = node_config(
            id,
            edge.quic_addr,
            4,
            "[[providers]]\nadapter = \"mock\"\ntarget = \"m\"\n",
        );
        std::fs::write(
            dir.path().join(iop_bench::fleet::node_config_file(i + 1)),
            text,
        )
        .expect("write");
    }
    let mut fleet = tokio::process::Command::new(env!("CARGO_BIN_EXE_iop-bench"))
        .args([
            "fleet",
            "--dir",
            &dir.path().display().to_string(),
            "--count",
            "3",
        ])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("fleet");
    let mut lines = tokio::io::BufReader::new(fleet.stdout.take().expect("stdout"));
    let ready = iop_bench::deployment::read_line_until(&mut lines, Duration::from_secs(30), |l| {
        let v: serde_json::Value = serde_json::from_str(l).ok()?;
        (v["event"] == "fleet_ready").then_some(v)
    })
    .await
    .expect("fleet_ready line");
    assert_eq!(ready["nodes"], 3);
    assert!(ready["rss_bytes"].as_u64().unwrap_or(0) > 0);
    let snap = edge.hub.snapshot().await.expect("hub");
    assert_eq!(
        snap.nodes
            .iter()
            .filter(|(_, g, ready, _)| g.is_some() && *ready)
            .count(),
        3
    );
    let _ = fleet.kill().await;
    edge.shutdown().await;
}
