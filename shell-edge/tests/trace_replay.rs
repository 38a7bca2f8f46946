//! Traces recorded from a real loopback Edge + Node run (including a stall
//! and a reconnect) replay identically through the same core (iop-trace):
//! every machine either process drives is recorded, and each trace but
//! the tenants' replays.

mod common;

use std::io::BufReader;

use common::*;
use iop_edge::server::{EdgeOptions, RunningEdge};
use iop_node::mock::{MockScript, MockServer};
use iop_node::{NodeOptions, RunningNode};
use iop_trace::{MachineKind, ReplayError, TraceReader, replay};

const KEY: &str = "sk-trace-test-0123456789";

#[tokio::test]
async fn recorded_edge_and_node_traces_replay_identically() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let edge_trace = pki.path().join("edge.trace");
        let node_trace = pki.path().join("node.trace");
        let edge = RunningEdge::start_with(
            edge_config(
                &pki,
                0,
                "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\nstall_timeout_ms = 300\n\
                 [[routes]]\nmodel = \"mock*\"\nproviders = [\"p1\"]\n\
                 [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n",
            ),
            EdgeOptions {
                record_trace: Some(edge_trace.clone()),
                trace_machines: MachineKind::ALL.to_vec(),
            },
        )
        .await
        .unwrap();
        let node = RunningNode::start_with(
            node_config(
                &pki,
                "node-1",
                edge.quic_addr,
                &format!(
                    "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                    mock.base_url()
                ),
            ),
            NodeOptions {
                record_trace: Some(node_trace.clone()),
                trace_machines: vec![MachineKind::NodeLink, MachineKind::NodeRun],
            },
        );
        let g1 = ready_generation(&edge, "node-1").await;
        let http = reqwest::Client::new();
        let call = |model: &'static str| {
            let http = http.clone();
            let url = format!("http://{}/v1/chat/completions", edge.http_addr);
            async move {
                http.post(url)
                    .bearer_auth(KEY)
                    .header("content-type", "application/json")
                    .body(format!(
                        r#"{{"model":"{model}","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}"#
                    ))
                    .send()
                    .await
                    .unwrap()
                    .text()
                    .await
                    .unwrap()
            }
        };
        assert!(call("mock").await.contains("[DONE]"));
        // A stall after the first content: one in-stream error.
        assert!(call("mock:stall_after=1").await.contains("response_stalled"));
        // A reconnect: the edge drops the connection; the node comes back
        // with a new generation.
        let (_, link) = edge.hub.link("node-1".into()).await.unwrap().unwrap();
        RunningEdge::close(&link.conn, iop_wire::CloseCode::ProtocolError);
        let g2 = wait_for(&edge, "reconnect", |s| {
            matches!(node_state(s, "node-1"), (Some(g), true) if g > g1)
        })
        .await;
        let g2 = node_state(&g2, "node-1").0.unwrap();
        assert!(call("mock").await.contains("[DONE]"));
        wait_for(&edge, "idle", |s| s.leases_in_use == 0).await;
        node.shutdown().await.unwrap();
        edge.shutdown().await;

        let file = std::fs::File::open(&edge_trace).unwrap();
        let reader = TraceReader::new(BufReader::new(file)).expect("edge trace header");
        assert_eq!(reader.header().machine, MachineKind::EdgeDispatch);
        let report = replay(reader).expect("the edge trace replays identically");
        assert!(report.inputs > 10, "{report:?}");

        // One trace per connection of the node process, numbered from 1:
        // the first connection and the reconnect.
        assert!(g2 > g1);
        for n in [1, 2] {
            let path = format!("{}.{n}", node_trace.display());
            let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            let reader = TraceReader::new(BufReader::new(file)).expect("node trace header");
            assert_eq!(reader.header().machine, MachineKind::NodeLink);
            let report = replay(reader).expect("the node trace replays identically");
            assert!(report.inputs > 4, "{report:?}");
        }

        // Every other machine: one file per instance, named after its kind.
        let mut seen = std::collections::BTreeMap::<MachineKind, u64>::new();
        for entry in std::fs::read_dir(pki.path()).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let Some(kind) = MachineKind::ALL.into_iter().find(|k| {
                name.starts_with(&format!("edge.trace.{}.", k.as_str()))
                    || name.starts_with(&format!("node.trace.{}.", k.as_str()))
            }) else {
                continue;
            };
            *seen.entry(kind).or_default() += 1;
            let file = std::fs::File::open(&path).unwrap();
            let reader = TraceReader::new(BufReader::new(file))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(reader.header().machine, kind, "{name}");
            match replay(reader) {
                Ok(report) => assert!(report.inputs > 0 || report.checked > 0, "{name}: {report:?}"),
                Err(ReplayError::NotReplayable(k)) => assert_eq!(k, MachineKind::EdgeTenants),
                Err(e) => panic!("{name} does not replay: {e}"),
            }
        }
        // Three requests (one stalled), two connections, one run each.
        assert_eq!(seen.get(&MachineKind::EdgeRequest), Some(&3), "{seen:?}");
        assert_eq!(seen.get(&MachineKind::EdgeLink), Some(&2), "{seen:?}");
        assert_eq!(seen.get(&MachineKind::NodeRun), Some(&3), "{seen:?}");
        assert_eq!(seen.get(&MachineKind::EdgeTenants), Some(&1), "{seen:?}");
        assert_eq!(seen.get(&MachineKind::StoreAvailability), Some(&1), "{seen:?}");
        assert_eq!(seen.get(&MachineKind::EdgeCustody), Some(&1), "{seen:?}");
    })
    .await;
}
