//! Failover before commit over real QUIC and real HTTP (R-FAIL-1): a
//! provider that answers 503 leaves the request to another provider of the
//! pool, called once each; a client error (400) is never retried. A
//! provider whose runs keep failing while its probes answer leaves
//! selection (R-FAIL-3).

mod common;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};

const KEY: &str = "sk-failover-0123456789";

/// Providers `p1` (node-1, answering with `first_status` if set) and `p2`
/// (node-2, healthy) both serving model `m`.
async fn deployment(
    pki: &Pki,
    first_status: u16,
) -> (
    RunningEdge,
    Vec<iop_node::RunningNode>,
    MockServer,
    MockServer,
) {
    write_secret(&pki.path().join("key"), KEY);
    let failing = MockServer::start(MockScript {
        http_error: Some(first_status),
        ..MockScript::default()
    })
    .await
    .unwrap();
    let healthy = MockServer::start(MockScript::default()).await.unwrap();
    let extra = "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\nmodels = [\"m\"]\n\
         [[providers]]\nid = \"p2\"\nnode = \"node-2\"\nadapter = \"openai\"\ntarget = \"t\"\nmodels = [\"m\"]\n\
         [[api_keys]]\nprincipal = \"tester\"\nkey_file = \"key\"\n";
    let edge = RunningEdge::start(edge_config(pki, 0, extra))
        .await
        .unwrap();
    let node = |url: String| {
        format!("[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{url}\"\n")
    };
    let nodes = vec![
        start_node(pki, "node-1", edge.quic_addr, &node(failing.base_url())),
        start_node(pki, "node-2", edge.quic_addr, &node(healthy.base_url())),
    ];
    ready_generation(&edge, "node-1").await;
    ready_generation(&edge, "node-2").await;
    (edge, nodes, failing, healthy)
}

async fn chat(edge: &RunningEdge, stream: bool) -> (u16, String) {
    let body = format!(
        r#"{{"model":"m","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", edge.http_addr))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.text().await.unwrap())
}

#[tokio::test]
async fn a_provider_5xx_before_commit_fails_over_to_the_other_provider_r_fail_1() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let (edge, nodes, failing, healthy) = deployment(&pki, 503).await;
        for i in 0..6 {
            let (status, body) = chat(&edge, i % 2 == 0).await;
            assert_eq!(status, 200, "{body}");
            assert!(!body.contains("\"error\""), "{body}");
        }
        // Every request reached a provider that answered it exactly once;
        // the failing one was tried at most once per request.
        assert_eq!(healthy.requests(), 6, "each request answered once");
        assert!(failing.requests() <= 6, "{}", failing.requests());
        assert!(failing.requests() >= 1, "the failing provider was tried");
        let snap = wait_for(&edge, "idle", |s| s.leases_in_use == 0).await;
        assert_eq!(snap.queue_depth, 0);
        for n in nodes {
            n.shutdown().await.unwrap();
        }
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_client_error_is_never_retried_r_fail_1() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let (edge, nodes, failing, healthy) = deployment(&pki, 400).await;
        // Both providers are empty: the pool's first (p1) is chosen.
        let (status, body) = chat(&edge, false).await;
        assert_eq!(failing.requests(), 1, "p1 was chosen first");
        assert_ne!(status, 200, "the 400 reaches the client: {body}");
        assert_eq!(healthy.requests(), 0, "no second provider call");
        for n in nodes {
            n.shutdown().await.unwrap();
        }
        edge.shutdown().await;
    })
    .await;
}

/// R-FAIL-3: p1's server answers its health probes but fails every run
/// with 503. Its run failures reach the health tracker: after
/// `RUN_FAILURES_TO_UNAVAILABLE` in a row it is `unavailable` and no
/// longer chosen, so twenty requests in quick succession call it only
/// that many times (without the rule it is chosen for about half of
/// them), every client is answered by p2, and `/status` shows p1's
/// outage with its class.
#[tokio::test]
async fn a_provider_failing_its_runs_leaves_selection_r_fail_3() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        let (edge, nodes, failing, healthy) = deployment(&pki, 503).await;
        // Both answered their first probe (the mock's probe is healthy).
        wait_for(&edge, "both providers ok", |s| {
            s.health.iter().filter(|h| h.state == "ok").count() == 2
        })
        .await;
        for i in 0..20 {
            let (status, body) = chat(&edge, i % 2 == 0).await;
            assert_eq!(status, 200, "{body}");
        }
        assert_eq!(healthy.requests(), 20, "each request answered by p2");
        assert_eq!(
            failing.requests(),
            u64::from(iop_core::edge::health::RUN_FAILURES_TO_UNAVAILABLE),
            "p1 left selection after its failures in a row"
        );
        let snap = wait_for(&edge, "p1 unavailable", |s| {
            s.health
                .iter()
                .any(|h| h.provider_id.as_str() == "p1" && h.state == "unavailable")
        })
        .await;
        let p1 = snap
            .health
            .iter()
            .find(|h| h.provider_id.as_str() == "p1")
            .unwrap();
        assert_eq!(p1.failure_code, Some("http_5xx"));
        for n in nodes {
            n.shutdown().await.unwrap();
        }
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_failover_with_nowhere_to_go_answers_the_providers_failure_at_once_r_fail_1() {
    bounded(async {
        let pki = Pki::new(&["node-1", "node-2"]);
        write_secret(&pki.path().join("key"), KEY);
        let failing = MockServer::start(MockScript {
            http_error: Some(503),
            ..MockScript::default()
        })
        .await
        .unwrap();
        // p2's node never connects: the pool's only alternate is offline.
        let extra = "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\nmodels = [\"m\"]\n\
             [[providers]]\nid = \"p2\"\nnode = \"node-2\"\nadapter = \"openai\"\ntarget = \"t\"\nmodels = [\"m\"]\n\
             [[api_keys]]\nprincipal = \"tester\"\nkey_file = \"key\"\n";
        let edge = RunningEdge::start(edge_config(&pki, 0, extra))
            .await
            .unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                failing.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        for stream in [false, true] {
            let started = std::time::Instant::now();
            let (status, body) = chat(&edge, stream).await;
            // The queue timeout here is 5 s: the answer comes well before.
            assert!(
                started.elapsed() < std::time::Duration::from_secs(2),
                "waited {:?}: {body}",
                started.elapsed()
            );
            assert!(status >= 500, "{status}: {body}");
            assert!(!body.contains("queue_timeout"), "{body}");
        }
        assert_eq!(failing.requests(), 2, "the provider was called once each");
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}
