//! Series from the start (R-OBS-1, issue "what an operator sees"): a fresh
//! Edge and a fresh Node, before any request, already expose every metric
//! `docs/operations.md` lists, every listed label value of each counter,
//! and the per-provider (Edge) and per-target (Node) series, so alerts on
//! `increase()` or `absent()` and dashboards work on a new deployment.

mod common;

use iop_node::config::ConfigFile as _;
use std::collections::{BTreeMap, BTreeSet};

use common::*;
use iop_edge::server::RunningEdge;

/// One documented metric: name, type and its closed label values (labels
/// documented with a list of values only).
#[derive(Debug)]
struct Documented {
    name: String,
    kind: String,
    closed: BTreeMap<String, Vec<String>>,
}

/// Every metric row of the Metrics tables in `docs/operations.md`.
fn documented() -> Vec<Documented> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/operations.md"
    ))
    .expect("docs/operations.md");
    let section = doc
        .split("\n## Metrics\n")
        .nth(1)
        .expect("a Metrics section")
        .split("\n## ")
        .next()
        .unwrap();
    let mut out = Vec::new();
    for line in section.lines() {
        let Some(row) = line.strip_prefix("| `") else {
            continue;
        };
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        if cells.len() < 4 {
            continue;
        }
        let name = cells[0].trim_matches('`').to_owned();
        out.push(Documented {
            name,
            kind: cells[1].to_owned(),
            closed: closed_labels(cells[2]),
        });
    }
    assert!(out.len() > 30, "the tables were parsed: {out:?}");
    out
}

/// `label` (`a`, `b`), ... -> {label: [a, b]}; a label whose parenthesis
/// holds anything but a list of values (a description) is left out.
fn closed_labels(cell: &str) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let mut rest = cell;
    while let Some(open) = rest.find("` (") {
        let name_start = rest[..open].rfind('`').map_or(0, |i| i + 1);
        let name = rest[name_start..open].to_owned();
        let inner_start = open + 3;
        let Some(close) = rest[inner_start..].find(')') else {
            break;
        };
        let inner = &rest[inner_start..inner_start + close];
        let values: Vec<&str> = inner.split(", ").collect();
        if values
            .iter()
            .all(|v| v.len() > 2 && v.starts_with('`') && v.ends_with('`'))
        {
            out.insert(
                name,
                values
                    .iter()
                    .map(|v| v.trim_matches('`').to_owned())
                    .collect(),
            );
        }
        rest = &rest[inner_start + close..];
    }
    out
}

/// The sample lines of `metric` in a Prometheus text document.
fn samples<'a>(text: &'a str, metric: &str) -> Vec<&'a str> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.starts_with(metric)
                && matches!(l.as_bytes().get(metric.len()), Some(b'{') | Some(b' '))
        })
        .collect()
}

fn check(text: &str, surface: &str, metrics: &[&Documented]) {
    for m in metrics {
        if m.kind == "histogram" || m.name.starts_with("gen_ai_") {
            // Histograms appear with their first observation, the GenAI
            // counters with the first operation that counts (documented).
            continue;
        }
        let lines = samples(text, &m.name);
        assert!(
            !lines.is_empty(),
            "{surface}: documented {} {} is missing from a fresh scrape:\n{text}",
            m.kind,
            m.name
        );
        for (label, values) in &m.closed {
            let seen: BTreeSet<&str> = lines
                .iter()
                .filter_map(|l| {
                    let needle = format!("{label}=\"");
                    let start = l.find(&needle)? + needle.len();
                    let end = l[start..].find('"')?;
                    Some(&l[start..start + end])
                })
                .collect();
            for v in values {
                assert!(
                    seen.contains(v.as_str()),
                    "{surface}: {}{{{label}=\"{v}\"}} is not present from the start; seen {seen:?}",
                    m.name
                );
            }
            for v in &seen {
                assert!(
                    values.iter().any(|d| d == v),
                    "{surface}: {}{{{label}=\"{v}\"}} is not documented",
                    m.name
                );
            }
        }
        // No request was made: the request and attempt counters are 0.
        if [
            "iop_edge_requests_total",
            "iop_edge_attempts_total",
            "iop_node_runs_total",
        ]
        .contains(&m.name.as_str())
        {
            for l in &lines {
                assert!(l.ends_with(" 0"), "{surface}: a fresh counter is 0: {l}");
            }
        }
    }
}

#[tokio::test]
async fn a_fresh_edge_and_node_expose_every_documented_series() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"m1\"\n\
             [[providers]]\nid = \"p2\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"m2\"\nmodels = [\"small\"]\n\
             [[routes]]\nmodel = \"mock*\"\nproviders = [\"p1\", \"p2\"]\n",
        ))
        .await
        .unwrap();
        let port = free_tcp_port();
        // The node's metrics address goes into its [node] section.
        let node = iop_node::RunningNode::start({
            let text = format!(
                "[node]\nedge = \"{}\"\nstate_dir = \"node-node-1-state\"\nmetrics_listen = \"127.0.0.1:{port}\"\n\
                 [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/node-node-1.pem\"\nkey = \"certs/node-node-1.key\"\n\
                 [heartbeat]\ninterval_ms = {HB_INTERVAL_MS}\nwait_ms = {HB_WAIT_MS}\n\
                 [reconnect]\ninitial_ms = 50\nmax_ms = 400\n{}{}",
                edge.quic_addr,
                mock_provider_node("m1"),
                mock_provider_node("m2"),
            );
            iop_node::config::NodeConfig::parse(&text, pki.path()).expect("node config")
        });
        ready_generation(&edge, "node-1").await;

        let http = reqwest::Client::new();
        let edge_text = http
            .get(format!("http://{}/metrics", edge.http_addr))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let node_text = http
            .get(format!("http://127.0.0.1:{port}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();

        let docs = documented();
        let process: Vec<&Documented> =
            docs.iter().filter(|d| d.name.starts_with("process_")).collect();
        let edge_docs: Vec<&Documented> =
            docs.iter().filter(|d| d.name.starts_with("iop_edge_")).collect();
        let node_docs: Vec<&Documented> =
            docs.iter().filter(|d| d.name.starts_with("iop_node_")).collect();
        assert!(process.len() >= 3 && edge_docs.len() > 10 && node_docs.len() > 10);
        check(&edge_text, "edge", &edge_docs);
        check(&edge_text, "edge", &process);
        check(&node_text, "node", &node_docs);
        check(&node_text, "node", &process);

        // Per provider (Edge) and per target (Node) where a label names one.
        for p in ["p1", "p2"] {
            let lines = samples(&edge_text, "iop_edge_attempts_total");
            assert!(
                lines
                    .iter()
                    .any(|l| l.contains(&format!("provider=\"{p}\"")) && l.contains("outcome=\"response_stalled\"")),
                "attempts of {p}: {lines:?}"
            );
        }
        let tokens = samples(&edge_text, "iop_edge_provider_tokens_total");
        for (provider, model) in [("p1", "mock*"), ("p2", "mock*"), ("p2", "small")] {
            for kind in ["input", "output"] {
                assert!(
                    tokens.iter().any(|l| l.contains(&format!("provider=\"{provider}\""))
                        && l.contains(&format!("model=\"{model}\""))
                        && l.contains(&format!("kind=\"{kind}\""))),
                    "tokens of {provider}/{model}/{kind}: {tokens:?}"
                );
            }
        }
        for metric in [
            "iop_node_runs_total",
            "iop_node_provider_tokens_total",
            "iop_node_relayed_bytes_total",
            "iop_node_probes_total",
        ] {
            for target in ["m1", "m2"] {
                assert!(
                    samples(&node_text, metric)
                        .iter()
                        .any(|l| l.contains(&format!("target=\"{target}\"")) && l.contains("adapter=\"mock\"")),
                    "{metric} for target {target}"
                );
            }
        }
        for (text, name) in [(&edge_text, "iop_edge_build_info"), (&node_text, "iop_node_build_info")] {
            assert_eq!(
                samples(text, name),
                vec![format!("{name}{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION")).as_str()]
            );
        }

        // Every series the binaries expose is documented.
        let documented: BTreeSet<&str> = docs.iter().map(|d| d.name.as_str()).collect();
        for (surface, text) in [("edge", &edge_text), ("node", &node_text)] {
            for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
                let name = line.split(' ').nth(2).unwrap();
                let kind = line.split(' ').nth(3).unwrap();
                let full = if kind == "counter" && !name.ends_with("_total") {
                    format!("{name}_total")
                } else {
                    name.to_owned()
                };
                assert!(
                    documented.contains(full.as_str()),
                    "{surface}: {full} ({kind}) is exposed but not documented"
                );
            }
        }
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

/// Metric names a text refers to (`iop_...`, `process_...`), histogram
/// suffixes removed.
fn referenced(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let rest = &text[i..];
        let starts = (rest.starts_with("iop_") || rest.starts_with("process_"))
            && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if starts {
            let len = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let name = &rest[..len];
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            out.insert(base.to_owned());
            i += len;
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn the_alert_rules_and_the_dashboard_use_documented_series_only() {
    let documented: BTreeSet<String> = documented().into_iter().map(|d| d.name).collect();
    for file in ["alerts.yml", "grafana-dashboard.json"] {
        let text =
            std::fs::read_to_string(format!("{}/../docs/{file}", env!("CARGO_MANIFEST_DIR")))
                .unwrap();
        let names = referenced(&text);
        assert!(names.len() > 5, "{file} refers to metrics: {names:?}");
        for name in names {
            assert!(
                documented.contains(&name),
                "{file} uses {name}, which docs/operations.md does not list"
            );
        }
    }
}
