//! The provider health tracker end to end with a short profile (R-HT-1..6):
//! a failing provider is probed only on its capped backoff, is never
//! selected, recovers when its probe succeeds, and `/status` shows every
//! field.

mod common;

use std::time::Duration;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer, ProbeHealth, serve};

const KEY: &str = "sk-health-test-0123456789";
const BACKOFF_CAP_MS: u64 = 400;

async fn status(http: &reqwest::Client, edge: &RunningEdge) -> serde_json::Value {
    http.get(format!("http://{}/status", edge.http_addr))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn failing_provider_backs_off_to_its_cap_and_recovers() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let sick = MockServer::start(MockScript {
            health: ProbeHealth::Unhealthy,
            ..MockScript::default()
        })
        .await
        .unwrap();
        let healthy = MockServer::start(MockScript::default()).await.unwrap();
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            &format!(
                "[health]\nrefresh_interval_ms = 150\nbackoff_base_ms = 50\nbackoff_cap_ms = {BACKOFF_CAP_MS}\n\
                 stale_after_ms = 5000\nprobe_timeout_ms = 1000\n\
                 [[providers]]\nid = \"sick\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"sick\"\nmodels = [\"m\"]\n\
                 [[providers]]\nid = \"fine\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"fine\"\nmodels = [\"m\"]\n\
                 [[api_keys]]\nprincipal = \"ops\"\nkey_file = \"key\"\nadmin = true\n"
            ),
        ))
        .await
        .unwrap();
        let sick_addr = sick.addr();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"sick\"\nbase_url = \"{}\"\n\
                 [[providers]]\nadapter = \"openai\"\ntarget = \"fine\"\nbase_url = \"{}\"\n",
                sick.base_url(),
                healthy.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        let http = reqwest::Client::new();

        // Detected, then held at the cap: consecutive failures keep counting
        // while probes are spaced by at most the cap.
        let snap = wait_for(&edge, "several failures", |s| {
            s.health
                .iter()
                .any(|h| h.provider_id.as_str() == "sick" && h.consecutive_failures >= 5)
        })
        .await;
        let sick_view = snap.health.iter().find(|h| h.provider_id.as_str() == "sick").unwrap();
        assert_eq!(sick_view.state, "unavailable");
        assert_eq!(sick_view.failure_code, Some("http_5xx"));
        let fine_view = snap.health.iter().find(|h| h.provider_id.as_str() == "fine").unwrap();
        assert_eq!(fine_view.state, "ok", "isolation: one failing provider changes no other");
        // Probes are spaced by the backoff: over a window of ten caps there
        // are at most ten (plus the one in flight), not one per refresh.
        let before = sick.probes();
        tokio::time::sleep(Duration::from_millis(10 * BACKOFF_CAP_MS)).await;
        let during = sick.probes() - before;
        assert!((5..=11).contains(&during), "{during} probes in ten caps");
        // next_retry_at never lies further ahead than the cap.
        let doc = status(&http, &edge).await;
        let p = doc["providers"].as_array().unwrap().iter().find(|p| p["id"] == "sick").unwrap();
        let next = p["next_retry_at"].as_u64().expect("next_retry_at");
        let now = iop_transport::clock::unix_ms();
        assert!(next <= now + BACKOFF_CAP_MS + 50, "next retry within the cap");

        // The failing provider is never selected (R-HT-5): every request of
        // pool [sick, fine] lands on fine.
        for _ in 0..5 {
            let r = http
                .post(format!("http://{}/v1/chat/completions", edge.http_addr))
                .bearer_auth(KEY)
                .body(r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
        assert_eq!(sick.requests(), 0);

        // /status has every field.
        for field in [
            "state",
            "last_success_at",
            "consecutive_failures",
            "failure_code",
            "next_retry_at",
            "node_connected",
            "node_generation",
            "leases_in_use",
            "capacity",
        ] {
            assert!(p.get(field).is_some(), "provider field {field}: {p}");
        }
        for field in ["queue_depth", "leases_in_use", "nodes_connected", "generation_fences"] {
            assert!(doc["instance"].get(field).is_some(), "instance field {field}");
        }

        // Recovery: the provider server heals (same address), the next probe
        // succeeds and the provider returns to the regular cadence.
        drop(sick);
        let listener = loop {
            match tokio::net::TcpListener::bind(sick_addr).await {
                Ok(l) => break l,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let _healed = serve(listener, MockScript::default()).await.unwrap();
        let snap = wait_for(&edge, "recovered", |s| {
            s.health
                .iter()
                .any(|h| h.provider_id.as_str() == "sick" && h.state == "ok")
        })
        .await;
        let sick_view = snap.health.iter().find(|h| h.provider_id.as_str() == "sick").unwrap();
        assert_eq!(sick_view.consecutive_failures, 0);
        assert!(sick_view.next_retry_at_ms.is_none());
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

/// Bind a mock with `health` at `addr` (the previous server at that
/// address was dropped; the port may take a moment to free).
async fn rebind(addr: std::net::SocketAddr, health: ProbeHealth) -> iop_node::mock::MockServer {
    let listener = loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => break l,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    serve(
        listener,
        MockScript {
            health,
            ..MockScript::default()
        },
    )
    .await
    .unwrap()
}

async fn transitions(http: &reqwest::Client, edge: &RunningEdge, transition: &str) -> f64 {
    let text = http
        .get(format!("http://{}/metrics", edge.http_addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    iop_edge::metrics::scrape_value(
        &text,
        "iop_edge_provider_health_transitions_total",
        &[("transition", transition)],
    )
}

#[tokio::test]
async fn probe_answer_recovering_a_lowered_provider_counts_the_transition() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let first = MockServer::start(MockScript::default()).await.unwrap();
        let addr = first.addr();
        // A long regular cadence: no probe lands between the swaps below
        // unless the test's own steps cause one.
        let mut config = edge_config(
            &pki,
            0,
            "[health]\nrefresh_interval_ms = 4000\nbackoff_base_ms = 50\nbackoff_cap_ms = 200\n\
             stale_after_ms = 60000\nprobe_timeout_ms = 1000\n\
             [[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\nstall_timeout_ms = 300\n\
             [[routes]]\nmodel = \"mock*\"\nproviders = [\"p\"]\n\
             [[api_keys]]\nprincipal = \"ops\"\nkey_file = \"key\"\n",
        );
        // No re-admission: the stall ends the request.
        config.admission.max_attempts = 1;
        let edge = RunningEdge::start(config).await.unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                first.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        wait_for(&edge, "the first probe to succeed", |s| {
            s.health.iter().any(|h| h.provider_id.as_str() == "p" && h.state == "ok")
        })
        .await;
        let http = reqwest::Client::new();
        let recovered_before = transitions(&http, &edge, "recovered").await;

        // The provider turns unhealthy: a stall's exact-target probe says
        // so, and the fresh `unavailable` evidence lowers the overlay
        // (R-OVL-2).
        drop(first);
        let sick = rebind(addr, ProbeHealth::Unhealthy).await;
        let _ = http
            .post(format!("http://{}/v1/chat/completions", edge.http_addr))
            .bearer_auth(KEY)
            .body(r#"{"model":"mock:stall_after=0","messages":[{"role":"user","content":"x"}]}"#)
            .send()
            .await
            .unwrap()
            .text()
            .await;
        assert!(transitions(&http, &edge, "lowered").await >= 1.0, "lowered");

        // It heals: the next CAPABILITIES probe answers a strictly newer
        // `available` (R-CAP-1), and the recovery is counted once.
        drop(sick);
        let _healed = rebind(addr, ProbeHealth::Ok).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while transitions(&http, &edge, "recovered").await < recovered_before + 1.0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no recovered transition was counted"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            transitions(&http, &edge, "recovered").await,
            recovered_before + 1.0,
            "counted once"
        );
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}
