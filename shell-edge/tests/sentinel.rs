//! R-OBS-1 sentinel: a known API key and raw payload markers are driven
//! through success, a stall and a provider error; none of them may appear
//! in `/metrics`, `/status` or the logs of the Edge and the Node, and every
//! label value belongs to its closed set.

mod common;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};

const KEY: &str = "sk-SENTINEL-KEY-7f3a9c1e5b";
const PAYLOAD: &str = "SENTINEL-PAYLOAD-d41d8cd9";

#[tokio::test]
async fn no_secret_or_payload_reaches_metrics_status_or_logs() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .json()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || writer.clone())
        .init();
    let _ = rustls::crypto::ring::default_provider().install_default();

    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript::default()).await.unwrap();
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"t\"\nstall_timeout_ms = 300\n\
             [[routes]]\nmodel = \"mock*\"\nproviders = [\"p1\"]\n\
             [[api_keys]]\nprincipal = \"sentinel\"\nkey_file = \"key\"\nadmin = true\n",
        ))
        .await
        .unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"t\"\nbase_url = \"{}\"\n",
                mock.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        let http = reqwest::Client::new();
        let url = format!("http://{}", edge.http_addr);
        for (model, stream) in [
            ("mock", false),
            ("mock", true),
            ("mock:stall_after=1", true),
            ("mock:stall_after=0", false),
            ("mock:error=500", false),
        ] {
            let body = format!(
                r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"{PAYLOAD}"}}]}}"#
            );
            let _ = http
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
                .text()
                .await;
        }
        // A wrong key carrying the marker is refused without echoing it.
        let r = http
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(format!("{KEY}-wrong"))
            .body("{}")
            .send()
            .await
            .unwrap();
        assert!(!r.text().await.unwrap().contains(KEY));
        // A durable response, read back and deleted: its id is the
        // client's, never the logs' (R-OBS-1).
        let stored: serde_json::Value = http
            .post(format!("{url}/v1/responses"))
            .bearer_auth(KEY)
            .json(&serde_json::json!({"model": "mock", "input": PAYLOAD, "store": true}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let response_id = stored["id"].as_str().expect("a stored response").to_owned();
        for method in [reqwest::Method::GET, reqwest::Method::DELETE] {
            let r = http
                .request(method, format!("{url}/v1/responses/{response_id}"))
                .bearer_auth(KEY)
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success());
        }
        // A runtime key's secret is shown once, to the admin, and is in no
        // log or audit event (R-TEN-4).
        let created: serde_json::Value = http
            .post(format!("{url}/admin/keys"))
            .bearer_auth(KEY)
            .json(&serde_json::json!({"principal": "sentinel-runtime"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let runtime_secret = created["secret"].as_str().expect("a secret").to_owned();
        let r = http
            .post(format!("{url}/admin/keys/{}/rotate", created["id"].as_str().unwrap()))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        let rotated: serde_json::Value = r.json().await.unwrap();
        let rotated_secret = rotated["secret"].as_str().expect("a new secret").to_owned();
        wait_for(&edge, "idle", |s| s.leases_in_use == 0).await;

        let metrics = http.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        let status = http
            .get(format!("{url}/status"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        node.shutdown().await.unwrap();
        edge.shutdown().await;
        let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        assert!(logs.contains("\"event\""), "logs were captured");
        for (surface, text) in [("metrics", &metrics), ("status", &status), ("logs", &logs)] {
            for marker in [KEY, PAYLOAD, "SENTINEL"] {
                assert!(!text.contains(marker), "{marker} leaked into {surface}");
            }
            assert!(!text.contains("run_id"), "run ids leaked into {surface}");
            for marker in [&response_id, &runtime_secret, &rotated_secret] {
                assert!(!text.contains(marker.as_str()), "{marker} leaked into {surface}");
            }
        }
        assert!(logs.contains("admin_key_rotated"), "the audit events were captured");
        // Every label value is from its closed set.
        // Attempt outcomes are `ok` or a wire failure code.
        let mut outcomes = vec!["ok", "invalid_request", "unauthorized", "not_found", "rate_limited",
            "provider_error", "unavailable", "timeout", "client_disconnected", "internal",
            "lowered", "recorded", "stale"];
        outcomes.extend(iop_wire::FailureCode::ALL.iter().map(|c| c.as_str()));
        outcomes.extend(iop_core::journal::JournalError::NAMES);
        outcomes.extend(iop_edge::metrics::CLIENT_CONNECTION_OUTCOMES);
        let closed: &[(&str, &[&str])] = &[
            ("route", iop_edge::metrics::ROUTES),
            ("op", &["create", "append", "finish", "raise_epoch"]),
            ("outcome", &outcomes),
            ("provider", &["p1"]),
            ("model", &["mock*"]),
            ("kind", &["input", "output"]),
            ("health", &["available", "unavailable", "unknown"]),
            ("transition", &["lowered", "recovered"]),
            ("eligibility", &["eligible", "not_eligible_committed", "not_eligible_attempts",
                "not_eligible_budget", "not_eligible_unconfirmed"]),
            ("result", &["readmitted", "recovered", "exhausted", "failed", "abandoned"]),
        ];
        let mut seen = 0;
        for line in metrics.lines().filter(|l| !l.starts_with('#')) {
            let Some(labels) = line.split_once('{').and_then(|(_, r)| r.split_once('}')).map(|(l, _)| l) else {
                continue;
            };
            for pair in labels.split(',') {
                let Some((k, v)) = pair.split_once('=') else { continue };
                let v = v.trim_matches('"');
                if let Some((_, allowed)) = closed.iter().find(|(name, _)| *name == k) {
                    assert!(allowed.contains(&v), "label {k}={v} is not in its closed set");
                    seen += 1;
                }
            }
        }
        assert!(seen > 0, "labels were checked: {metrics}");
    })
    .await;
}
