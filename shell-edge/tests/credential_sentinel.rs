//! R-CRED-2 sentinel: a managed secret driven through success and
//! rejection never appears in Edge or Node logs, error bodies, `/metrics`
//! or `/status`. Its own test binary: it installs a global subscriber.

mod common;

use std::time::Duration;

use common::*;
use iop_edge::server::RunningEdge;
use iop_node::mock::{MockScript, MockServer};

const KEY: &str = "sk-client-key-0123456789";
const SECRET: &str = "sk-CREDSENTINEL-5e1f0a9b77";

#[tokio::test]
async fn the_managed_secret_never_leaks() {
    let logs = Captured::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .json()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .init();
    let _ = rustls::crypto::ring::default_provider().install_default();

    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        write_secret(&pki.path().join("cred"), SECRET);
        let mock = MockServer::start(MockScript {
            require_key: Some(SECRET.into()),
            ..MockScript::default()
        })
        .await
        .unwrap();
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[[credentials]]\nprofile = \"k\"\nsecret_file = \"cred\"\n\
             [[providers]]\nid = \"p\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"m\"\ncredential = \"k\"\n\
             [[routes]]\nmodel = \"mock*\"\nproviders = [\"p\"]\n\
             [[api_keys]]\nprincipal = \"tester\"\nkey_file = \"key\"\nadmin = true\n",
        ))
        .await
        .unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"m\"\nbase_url = \"{}\"\n",
                mock.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        let http = reqwest::Client::new();
        let url = format!("http://{}", edge.http_addr);
        let mut bodies = Vec::new();
        let chat = |model: &'static str, stream: bool| {
            let http = http.clone();
            let url = url.clone();
            async move {
                let r = http
                    .post(format!("{url}/v1/chat/completions"))
                    .bearer_auth(KEY)
                    .header("content-type", "application/json")
                    .body(format!(
                        r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
                    ))
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), r.text().await.unwrap())
            }
        };
        let (status, body) = chat("mock", false).await;
        assert_eq!(status, 200, "{body}");
        bodies.push(body);
        bodies.push(chat("mock", true).await.1);
        bodies.push(chat("mock:error=500", false).await.1);
        // Revoked: the failure path.
        let r = http
            .post(format!("{url}/admin/credentials/k/revoke"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap();
        bodies.push(r.text().await.unwrap());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (status, body) = chat("mock", false).await;
        assert_eq!(status, 502, "{body}");
        bodies.push(body);
        wait_for(&edge, "idle", |s| s.leases_in_use == 0).await;

        let metrics = http.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        let node_metrics = node.shared().metrics.render();
        assert!(node_metrics.contains("iop_node_credential_rejections"), "{node_metrics}");
        let status = http
            .get(format!("{url}/status"))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let debug = format!("{:?} {:?}", edge.config, edge.creds);
        node.shutdown().await.unwrap();
        edge.shutdown().await;
        let logs = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
        assert!(logs.contains("node_credential_rejected"), "logs were captured");
        for (surface, text) in [
            ("edge metrics", &metrics),
            ("node metrics", &node_metrics),
            ("status", &status),
            ("logs", &logs),
            ("debug", &debug),
            ("bodies", &bodies.join("\n")),
        ] {
            assert!(!text.contains(SECRET), "the secret leaked into {surface}");
            assert!(!text.contains("CREDSENTINEL"), "part of the secret leaked into {surface}");
        }
    })
    .await;
}
