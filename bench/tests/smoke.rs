//! CI smoke of the benchmark tools, so they cannot rot: a few seconds of
//! load at a low rate against an in-process deployment (real HTTP into an
//! Edge, real QUIC to a Node, real HTTP to the mock), checking that every
//! report is well-formed and has zero errors. No timing is asserted: speed
//! is measured by `scripts/bench`, not by tests.

use iop_edge::config::ConfigFile as _;
use std::time::Duration;

use iop_bench::deployment::{
    API_KEY, DeployError, EdgeExtras, JournalStore, NatsServer, edge_config_head,
    nats_server_binary, node_config, write_pki, write_secret_file,
};
use iop_bench::load::{self, Durability, LoadSpec, Target};
use iop_bench::report::{LoadMode, LoadReport, added_latency_table, load_table};
use iop_bench::scenario::{self, DURABLE, DurableSettings, EPHEMERAL, Gateway};
use iop_bench::spans::{SpanCollector, TailProfile, join, otlp_traces_section};
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
    /// The `nats` store's server (a process; killed when dropped).
    nats: Option<NatsServer>,
}

impl InProcess {
    /// A mock, an Edge with a normalized (`mock`, `mock:*`) and a tunnel
    /// (`mock-tunnel`) provider, and one Node, all in this process.
    async fn start() -> Self {
        Self::start_with(JournalStore::default()).await
    }

    /// The same, with the Edge's journal on `journal`.
    async fn start_with(journal: JournalStore) -> Self {
        Self::start_full(journal, None).await
    }

    /// The same, the Edge and the Node exporting the spans of sampled
    /// requests to `traces` (an OTLP/HTTP endpoint).
    async fn start_full(journal: JournalStore, traces: Option<&str>) -> Self {
        Self::start_extras(journal, traces, &EdgeExtras::default()).await
    }

    /// The same, with `extras` in the Edge's config (its secret files
    /// written first).
    async fn start_extras(
        journal: JournalStore,
        traces: Option<&str>,
        extras: &EdgeExtras,
    ) -> Self {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().expect("tempdir");
        write_pki(dir.path(), &["n1".to_owned()]).expect("pki");
        let mock = MockServer::start(MockScript::default())
            .await
            .expect("mock");
        let nats = if journal.needs_nats() {
            Some(NatsServer::start(dir.path()).await.expect("nats-server"))
        } else {
            None
        };
        let mut edge_toml = edge_config_head(0, 0, 256);
        journal
            .add_to_edge_config_with(
                &mut edge_toml,
                nats.as_ref().map(NatsServer::url).as_deref(),
                extras,
            )
            .expect("journal config");
        for (name, secret) in &extras.key_files {
            write_secret_file(&dir.path().join(name), secret).expect("key file");
        }
        edge_toml.push_str(
            "[[providers]]\nid = \"norm\"\nnode = \"n1\"\nadapter = \"openai\"\ntarget = \"t\"\ncapacity = 64\n\
             [[providers]]\nid = \"tun\"\nnode = \"n1\"\nadapter = \"openai\"\ntarget = \"t\"\ncapacity = 64\nmode = \"tunnel\"\n\
             [[routes]]\nmodel = \"mock\"\nproviders = [\"norm\"]\n\
             [[routes]]\nmodel = \"mock:*\"\nproviders = [\"norm\"]\n\
             [[routes]]\nmodel = \"mock-tunnel\"\nproviders = [\"tun\"]\n",
        );
        let traces = traces.map(otlp_traces_section).unwrap_or_default();
        edge_toml.push_str(&traces);
        edge_toml.push_str(&extras.tables);
        let edge =
            RunningEdge::start(EdgeConfig::parse(&edge_toml, dir.path()).expect("edge config"))
                .await
                .expect("edge");
        let providers = format!(
            "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
            mock.base_url()
        );
        let node_toml = node_config("n1", edge.quic_addr, 256, &providers) + &traces;
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
            nats,
        }
    }

    fn via(&self, model: &str) -> Target {
        Target {
            url: format!("http://{}/v1/chat/completions", self.edge.http_addr),
            api_key: Some(API_KEY.to_owned()),
            model: model.to_owned(),
            durability: Durability::Ephemeral,
            headers: Vec::new(),
        }
    }

    fn direct(&self) -> Target {
        Target {
            url: format!("{}/v1/chat/completions", self.mock.base_url()),
            api_key: None,
            model: "mock".to_owned(),
            durability: Durability::Ephemeral,
            headers: Vec::new(),
        }
    }

    async fn stop(self) {
        let _ = self.node.shutdown().await;
        self.edge.shutdown().await;
        if let Some(n) = self.nats {
            n.stop().await;
        }
    }
}

/// The scenarios' mocks, played by the one in-process mock through
/// per-request scripts (short forms of the real ones).
fn mock_model(mock: &str) -> String {
    match mock {
        scenario::LONG_MOCK => "mock:tokens=50".to_owned(),
        _ => "mock:tokens=8".to_owned(),
    }
}

impl Gateway for InProcess {
    fn direct(&self, mock: &str) -> Option<Target> {
        let mut t = InProcess::direct(self);
        t.model = mock_model(mock);
        Some(t)
    }

    fn via(&self, mock: &str, tunnel: bool) -> Target {
        assert!(!tunnel, "the durable scenario runs normalized only");
        InProcess::via(self, &mock_model(mock))
    }

    fn edge_http(&self) -> std::net::SocketAddr {
        self.edge.http_addr
    }

    fn cpu_ticks(&self) -> Option<Result<(u64, u64), DeployError>> {
        // One process: no CPU time of the Edge's own.
        None
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

/// The tail scenario's pipeline: traced requests' spans reach the
/// collector from both processes' exporters and join into phases that add
/// up to what the client saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traced_requests_split_into_phases_from_the_edges_and_the_nodes_spans() {
    let collector = SpanCollector::start().await.expect("collector");
    let d = InProcess::start_full(JournalStore::default(), Some(&collector.endpoint())).await;
    let client = load::client().expect("client");
    let open = LoadMode::Open { rate_per_s: 40.0 };
    for (label, target) in [
        ("iop tunnel", d.via("mock-tunnel")),
        ("iop normalized", d.via("mock")),
    ] {
        let _ = collector.take();
        let (report, traced) = load::run_traced(&client, &spec(label, target, false, open), 2)
            .await
            .expect("run");
        assert_well_formed(&report, false);
        // One request in two is traced, and only those of the measured
        // window are listed.
        assert!(
            !traced.is_empty() && traced.len() as u64 <= report.ok,
            "{traced:?}"
        );
        // The exporters send every 100 ms.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut spans = Vec::new();
        let (phases, incomplete) = loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            spans.extend(collector.take().0);
            let joined = join(&traced, &spans);
            if joined.1 == 0 || tokio::time::Instant::now() > deadline {
                break joined;
            }
        };
        assert_eq!(incomplete, 0, "{label}: every traced request has its spans");
        for p in &phases {
            assert_eq!(p.ns.iter().sum::<i64>(), p.total_ns, "{label}: {p:?}");
            // The provider call, up to its first content, is inside the
            // client's latency (an event of the Node's span).
            assert!(p.ns[4] > 0 && p.ns[4] < p.total_ns, "{label}: {p:?}");
            assert!(p.ns[5] >= 0, "{label}: {p:?}");
        }
        let profile = TailProfile::of("open 40/s", label, phases, incomplete, 0);
        assert_eq!(profile.joined, traced.len());
        assert!(profile.markdown().contains("provider call"));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_scenario_journals_every_durable_run_and_no_ephemeral_one_on_both_stores() {
    for store in [JournalStore::Memory, JournalStore::Embedded] {
        durable_scenario_on(store).await;
    }
}

/// The same on a real `nats-server` (JetStream), when it is installed;
/// without it the test says why and passes, unless `CI` is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_scenario_journals_every_durable_run_and_no_ephemeral_one_on_nats() {
    if nats_server_binary().is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "nats-server is not installed and CI is set: install it (apt-get install -y nats-server)"
        );
        eprintln!("skipped: nats-server is not installed (apt-get install -y nats-server)");
        return;
    }
    durable_scenario_on(JournalStore::Nats).await;
}

/// The durable scenario, shortest form, on an in-process Edge whose journal
/// is on `store`: well-formed runs, one record per durable response, none
/// for an ephemeral one.
async fn durable_scenario_on(store: JournalStore) {
    let d = InProcess::start_with(store).await;
    let settings = DurableSettings {
        stores: vec![store],
        stream_concurrencies: vec![2],
        rates: vec![40.0],
        duration: Duration::from_millis(1500),
        durability: Durability::IdempotencyKey,
    };
    let r = scenario::durable_runs(&d, store, &settings)
        .await
        .expect("durable scenario");
    assert_eq!(r.store, store);
    assert_eq!((r.streaming.len(), r.latency.len()), (1, 1));
    for (row, stream) in [(&r.streaming[0], true), (&r.latency[0], false)] {
        let c = &row.comparison;
        assert_eq!(c.direct.label, "direct");
        let labels: Vec<&str> = c.via.iter().map(|v| v.label.as_str()).collect();
        assert_eq!(labels, [EPHEMERAL, DURABLE]);
        for report in std::iter::once(&c.direct).chain(&c.via) {
            assert_well_formed(report, stream);
        }
        assert!(row.load_avg_before.iter().all(|l| *l >= 0.0));
        // The journal was read around both runs through iop.
        assert_eq!(row.journal.len(), 2, "{store:?}: {:?}", row.journal);
        let ephemeral = row.journal.iter().find(|j| j.target == EPHEMERAL).unwrap();
        assert!(
            ephemeral.ops.is_empty(),
            "{store:?}: an ephemeral run journaled {:?}",
            ephemeral.ops
        );
        let durable = row.journal.iter().find(|j| j.target == DURABLE).unwrap();
        assert_eq!(durable.durability, Durability::IdempotencyKey);
        assert_eq!(durable.failed(), 0, "{store:?}: {:?}", durable.ops);
        // Every durable response (warm-up included) was created once,
        // appended at least once and finished once.
        let responses = durable.responses();
        assert!(responses >= c.via[1].ok, "{store:?}: {:?}", durable.ops);
        assert!(durable.appends_per_response().unwrap() >= 1.0);
        assert_eq!(durable.op("finish").map(|f| f.ok), Some(responses));
        let append = durable.op("append").unwrap();
        assert_eq!(append.count, append.ok, "every append timed");
        assert!(append.mean_s().unwrap() >= 0.0);
        assert!(append.p50_at_most_s <= append.p99_at_most_s);
        if stream {
            assert!(durable.chunks_per_ok >= 50.0, "{durable:?}");
            assert!(row.durable_over_ephemeral_chunks().unwrap() > 0.0);
        }
        // In process: no CPU of the Edge's own to read.
        assert!(row.cpu.is_empty());
    }
    let result = scenario::DurableResult { stores: vec![r] };
    let json = serde_json::to_string(&result).expect("json");
    let back: scenario::DurableResult = serde_json::from_str(&json).expect("json round trip");
    assert_eq!(back, result);
    let md = result.markdown();
    // Three tables: one row each for streaming and latency, one journal
    // row per durable run.
    let rows = md
        .lines()
        .filter(|l| l.starts_with(&format!("| {} |", store.as_str())));
    assert_eq!(rows.count(), 4, "{md}");

    // `"store": true` is the other way to ask: every request journaled.
    let client = load::client().expect("client");
    let before = iop_bench::journal::scrape(&client, d.edge.http_addr)
        .await
        .expect("scrape");
    let mut target = d.via("mock");
    target.durability = Durability::Store;
    let mut s = spec("stored", target, false, LoadMode::Closed { concurrency: 1 });
    s.warmup = Duration::ZERO;
    let r = load::run(&client, &s).await.expect("run");
    assert_well_formed(&r, false);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = iop_bench::journal::scrape(&client, d.edge.http_addr)
        .await
        .expect("scrape");
    let ops = after.since(&before);
    let created = ops.iter().find(|o| o.op == "create").map_or(0, |o| o.ok);
    assert_eq!(created, r.requests, "{ops:?}");
    d.stop().await;
}

/// The tenants scenario, shortest form, on an in-process Edge whose
/// tenants' counters are in `store`: both arms answered with zero errors
/// (nothing refused), latency pooled per arm, and the metered principal's
/// usage and spend counted in the store.
async fn tenants_scenario_on(store: JournalStore) {
    use iop_bench::tenants::{
        METERED_KEY, METERED_PRINCIPAL, MeteredLimits, OFF, ON, TenantArms, TenantResult,
        TenantSettings, metered_extras, tenant_runs,
    };
    let extras = metered_extras(
        "mock-metered",
        &["norm".to_owned()],
        &MeteredLimits::default(),
        store,
    );
    let d = InProcess::start_extras(store, None, &extras).await;
    let mut on = d.via("mock-metered");
    on.api_key = Some(METERED_KEY.to_owned());
    // The direct baseline once (on the embedded store's run), to keep the
    // test short.
    let direct = (store == JournalStore::Embedded).then(|| d.direct());
    let with_direct = direct.is_some();
    let arms = TenantArms {
        direct,
        off: d.via("mock"),
        on,
    };
    let settings = TenantSettings {
        stores: vec![store],
        rate_per_s: 40.0,
        round: Duration::from_millis(1500),
        rounds: 2,
        alternating_rounds: 2,
    };
    let r = tenant_runs(&d, store, &arms, &settings)
        .await
        .expect("tenants scenario");
    assert_eq!(r.direct.is_some(), with_direct);
    for arm in r.direct.iter().chain([&r.off, &r.on]) {
        assert_eq!(
            arm.errors,
            Default::default(),
            "{store:?} {}: {:?}",
            arm.label,
            arm.errors
        );
        assert_eq!(arm.rounds.len(), 2);
        for round in &arm.rounds {
            assert_well_formed(round, false);
        }
        let pooled = arm.pooled.expect("pooled percentiles");
        assert_eq!(pooled.count, arm.ok);
        assert_eq!(arm.ok, arm.rounds.iter().map(|r| r.ok).sum::<u64>());
        // In process: no CPU time of the Edge's own.
        assert!(arm.edge_us_per_request.is_none());
    }
    assert_eq!((r.off.label.as_str(), r.on.label.as_str()), (OFF, ON));
    assert!(r.added_us().is_some() && r.median_round_added_us().is_some());
    assert_eq!(r.round_added_us().len(), 2);
    // Alternating request by request: each arm half the rate, no error.
    for arm in [r.alternating_off.as_ref(), r.alternating_on.as_ref()] {
        let arm = arm.expect("alternating runs");
        assert_eq!(arm.errors, Default::default(), "{store:?} {}", arm.label);
        assert_eq!(arm.rounds.len(), 2);
        for round in &arm.rounds {
            assert_well_formed(round, false);
            assert_eq!(round.mode, LoadMode::Open { rate_per_s: 20.0 });
        }
        assert_eq!(arm.pooled.expect("pooled").count, arm.ok);
    }
    assert_eq!(r.alternating_round_added_us().len(), 2);
    assert!(r.alternating_added_us().is_some());
    // The metered key's requests were claimed from the store's counters
    // and settled into its usage (written every second).
    assert_eq!(r.status["store_reachable"], true, "{}", r.status);
    assert!(r.status["claims"].as_u64().unwrap_or(0) > 0, "{}", r.status);
    assert_eq!(r.status["claim_failures"], 0, "{}", r.status);
    let usage = &r.status["today"]["principals"][METERED_PRINCIPAL];
    assert!(usage["requests"].as_u64().unwrap_or(0) > 0, "{}", r.status);
    assert!(
        usage["spend_micros"].as_u64().unwrap_or(0) > 0,
        "{}",
        r.status
    );
    let result = TenantResult {
        limits: MeteredLimits::default(),
        stores: vec![r],
    };
    let json = serde_json::to_string(&result).expect("json");
    let back: TenantResult = serde_json::from_str(&json).expect("json round trip");
    assert_eq!(back, result);
    let md = result.markdown();
    let rows = md
        .lines()
        .filter(|l| l.starts_with(&format!("| {} |", store.as_str())));
    // The arms, the difference, the rounds, the alternating runs.
    assert_eq!(rows.count(), 5 + usize::from(with_direct), "{md}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_scenario_answers_both_arms_and_meters_the_limited_key() {
    tenants_scenario_on(JournalStore::Embedded).await;
    if nats_server_binary().is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "nats-server is not installed and CI is set: install it (apt-get install -y nats-server)"
        );
        eprintln!(
            "nats case skipped: nats-server is not installed (apt-get install -y nats-server)"
        );
        return;
    }
    tenants_scenario_on(JournalStore::Nats).await;
}

/// The retention scenario, shortest form: both loads answered, the
/// Edge sampled all along, the journal's record gauge read and growing
/// by the durable requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_scenario_samples_memory_and_the_journals_records() {
    use iop_bench::durable_memory::{
        EdgeUnderTest, RetentionResult, RetentionSettings, retention_run,
    };
    let d = InProcess::start().await;
    let settings = RetentionSettings {
        stores: vec![JournalStore::Embedded],
        ephemeral_rate: 30.0,
        durable_rate: 20.0,
        duration: Duration::from_secs(3),
        warmup: Duration::from_secs(1),
        sample_every: Duration::from_millis(200),
        durability: Durability::IdempotencyKey,
        control: false,
    };
    // In process: the RSS read is the test process's.
    let edge = EdgeUnderTest {
        pid: std::process::id(),
        journal_file: Some(d._dir.path().join("edge-state").join("journal.redb")),
    };
    let run = retention_run(&d, &edge, JournalStore::Embedded, 30.0, 20.0, &settings)
        .await
        .expect("retention run");
    assert_well_formed(&run.ephemeral, false);
    let durable = run.durable.as_ref().expect("durable load");
    assert_well_formed(durable, false);
    assert!(run.samples.len() >= 10, "{:?}", run.samples);
    assert!(run.samples.windows(2).all(|w| w[0].t_s < w[1].t_s));
    assert!(run.samples.iter().all(|s| s.rss_bytes > 0));
    let last = run.samples.last().unwrap();
    // Every durable request (the warm-up's too) is a retained record.
    assert!(
        last.records.expect("the records gauge") >= durable.ok,
        "{last:?}"
    );
    assert!(last.journal_bytes.expect("the bytes gauge") > 0);
    assert!(last.file_bytes.expect("the store's file") > 0);
    assert!(run.records_slope().expect("records over time") > 0.0);
    assert!(run.rss_slope().is_some() && run.bytes_per_retained_response().is_some());
    let result = RetentionResult { runs: vec![run] };
    let back: RetentionResult =
        serde_json::from_str(&serde_json::to_string(&result).expect("json")).expect("round trip");
    assert_eq!(back, result);
    let md = result.markdown();
    assert_eq!(
        md.lines()
            .filter(|l| l.starts_with("| embedded | 30 + 20 |"))
            .count(),
        1,
        "{md}"
    );
    d.stop().await;
}

/// The retrieve scenario, shortest form: one stored answer read back by
/// concurrent clients, every read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retrieve_scenario_reads_one_stored_response_back_many_times() {
    use iop_bench::durable_memory::{RetrieveResult, RetrieveSettings, retrieve_run};
    let d = InProcess::start().await;
    let settings = RetrieveSettings {
        store: JournalStore::Embedded,
        tokens: 2000,
        input_bytes: 4096,
        retrieves: 60,
        concurrency: 4,
        request_memory_bytes: None,
    };
    let r = retrieve_run(&d, std::process::id(), "mock:tokens=2000", &settings)
        .await
        .expect("retrieve scenario");
    assert_eq!((r.ok, r.retrieves), (60, 60), "{:?}", r.errors);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    // 2,000 tokens of `tok<i>` text, and the object around them.
    assert!(r.object_bytes > 2000 * 5, "{}", r.object_bytes);
    assert!(r.journal_bytes.expect("journal bytes") > 2000 * 5);
    assert_eq!(r.latency.expect("latency").count, 60);
    assert!(r.rss_peak >= r.rss_idle && r.rss_hwm > 0);
    let back: RetrieveResult =
        serde_json::from_str(&serde_json::to_string(&r).expect("json")).expect("round trip");
    assert_eq!(back, r);
    assert!(
        r.markdown().contains("| retrieves ok / sent | 60 / 60 |"),
        "{}",
        r.markdown()
    );
    d.stop().await;
}

/// The gateways scenario's measurements, shortest form, through the
/// in-process Edge: every path's cells are measured, the rate search
/// steps up from one client, and the summary reports the paths added
/// over direct. No peer (they are installed apart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_scenario_measures_every_path_and_adds_over_direct() {
    use iop_bench::gateways::{self, DIRECT, GatewayPath, GatewaySettings};
    let d = InProcess::start().await;
    let paths = [
        (DIRECT, d.direct()),
        ("iop tunnel", d.via("mock-tunnel")),
        ("iop normalized", d.via("mock")),
    ]
    .map(|(label, target)| GatewayPath {
        label: label.into(),
        target,
    });
    let settings = GatewaySettings {
        runs: 1,
        duration: Duration::from_millis(400),
        step_duration: Duration::from_millis(300),
        p99_bound: Duration::from_secs(5),
        max_concurrency: 2,
        open_rates: vec![40.0],
        worker_threads: vec![None],
        quic: vec![None],
        baseline: None,
        peers: Vec::new(),
        pause: Duration::ZERO,
    };
    let runs = gateways::measure(&paths, &settings).await.expect("measure");
    d.stop().await;
    assert_eq!(runs.len(), 1);
    let run = &runs[0];
    assert_eq!(run.paths.len(), 3);
    for (p, path) in run.paths.iter().zip(&paths) {
        assert_eq!(p.label, path.label);
        assert_well_formed(&p.single, false);
        assert_well_formed(&p.single_stream, true);
        // 1 and 2 clients, both under a 5 s bound.
        assert_eq!(p.steps.len(), 2, "{}", p.label);
        assert!(p.max_rps.is_some() && p.max_rps_concurrency.is_some());
        assert_eq!(p.open.len(), 1, "{}: 40/s sustained", p.label);
        assert_well_formed(&p.open[0], false);
    }
    let summary = gateways::summarize(&runs);
    assert!(summary[0].added_p50_us.is_none());
    for s in &summary[1..] {
        assert!(s.added_p99_us.is_some() && s.added_ttft_p99_us.is_some());
        assert!(s.max_rps.is_some(), "{}", s.label);
        assert_eq!(s.open.len(), 1, "{}", s.label);
    }
}
