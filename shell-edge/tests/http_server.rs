//! The client-facing HTTP server's limits: a client that never finishes its
//! request head is dropped after `[edge] header_read_timeout_ms`, and a
//! graceful shutdown lets an in-flight stream finish before the node links
//! close, and closes an idle keep-alive connection at once.

mod common;

use std::time::Duration;

use common::*;
use iop_edge::server::RunningEdge;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const KEY: &str = "sk-http-server-test-0123456789";

fn providers() -> String {
    String::from(
        "[[providers]]\nid = \"p1\"\nnode = \"node-1\"\nadapter = \"mock\"\ntarget = \"m\"\nmodels = [\"mock*\"]\n\
         [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n",
    )
}

#[tokio::test]
async fn a_request_head_that_never_completes_is_dropped() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let edge = RunningEdge::start(edge_config_with(
            &pki,
            0,
            "header_read_timeout_ms = 300",
            &providers(),
        ))
        .await
        .unwrap();
        // Slowloris: a partial head, then nothing.
        let mut tcp = tokio::net::TcpStream::connect(edge.http_addr)
            .await
            .unwrap();
        tcp.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        let mut buf = [0u8; 1024];
        // The Edge closes the connection (EOF or reset) instead of holding it.
        let read = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buf))
            .await
            .expect("the edge must drop a stalled request head");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        assert!(started.elapsed() >= Duration::from_millis(250));
        // Well-behaved clients are unaffected.
        let r = reqwest::get(format!("http://{}/metrics", edge.http_addr))
            .await
            .unwrap();
        assert!(r.status().is_success());
        edge.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_stream_finish() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let edge = RunningEdge::start(edge_config(&pki, 0, &providers()))
            .await
            .unwrap();
        let node = start_node(&pki, "node-1", edge.quic_addr, &mock_provider_node("m"));
        ready_generation(&edge, "node-1").await;
        let url = format!("http://{}/v1/chat/completions", edge.http_addr);
        // 10 tokens at 20/s: about half a second of streaming.
        let response = reqwest::Client::new()
            .post(url)
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(r#"{"model":"mock:tokens=10,tps=20","stream":true,"messages":[{"role":"user","content":"hi"}]}"#)
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success());
        // An idle keep-alive connection beside it: one request answered.
        let mut idle = tokio::net::TcpStream::connect(edge.http_addr)
            .await
            .unwrap();
        idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut head = [0u8; 1024];
        let n = idle.read(&mut head).await.unwrap();
        assert!(head[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &head[..n]);
        // Shut down while the stream is in flight.
        let started = tokio::time::Instant::now();
        let stopping = tokio::spawn(edge.shutdown());
        // The idle connection closes at once, not at the drain timeout
        // (2,000 ms in this profile) that ends what is still open.
        let mut rest = Vec::new();
        let _ = idle.read_to_end(&mut rest).await;
        let idle_closed = started.elapsed();
        assert!(
            idle_closed < Duration::from_millis(1500),
            "the idle connection closed after {idle_closed:?}"
        );
        let body = response.text().await.unwrap();
        assert!(body.contains("tok9"), "the whole answer arrived: {body}");
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
        stopping.await.unwrap();
        node.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn a_tunnel_that_fails_after_commit_ends_with_an_error_not_a_clean_end() {
    // R-GATE-3: after commit the client gets one terminal in its API's own
    // format; a truncated tunnel never looks like a complete answer.
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = iop_node::mock::MockServer::start(iop_node::mock::MockScript::default())
            .await
            .unwrap();
        let edge = RunningEdge::start(edge_config(
            &pki,
            0,
            "[[providers]]\nid = \"oa\"\nnode = \"node-1\"\nadapter = \"openai\"\ntarget = \"oa\"\nmode = \"tunnel\"\nstall_timeout_ms = 300\nmodels = [\"mock:stall_after=2\"]\n\
             [[providers]]\nid = \"ol\"\nnode = \"node-1\"\nadapter = \"ollama\"\ntarget = \"ol\"\nmode = \"tunnel\"\nstall_timeout_ms = 300\n\
             [[routes]]\nmodel = \"mock:stall_after=3\"\nproviders = [\"ol\"]\n\
             [[api_keys]]\nprincipal = \"t\"\nkey_file = \"key\"\n",
        ))
        .await
        .unwrap();
        let node = start_node(
            &pki,
            "node-1",
            edge.quic_addr,
            &format!(
                "[[providers]]\nadapter = \"openai\"\ntarget = \"oa\"\nbase_url = \"{u}\"\n\
                 [[providers]]\nadapter = \"ollama\"\ntarget = \"ol\"\nbase_url = \"{u}\"\n",
                u = mock.base_url()
            ),
        );
        ready_generation(&edge, "node-1").await;
        let http = reqwest::Client::new();
        let body = http
            .post(format!("http://{}/v1/chat/completions", edge.http_addr))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(r#"{"model":"mock:stall_after=2","stream":true,"messages":[{"role":"user","content":"hi"}]}"#)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(body.contains("tok1"), "content was relayed before the stall: {body}");
        assert!(!body.contains("[DONE]"), "{body}");
        let last = body.lines().rfind(|l| l.starts_with("data: ")).unwrap();
        let event: serde_json::Value = serde_json::from_str(&last["data: ".len()..]).unwrap();
        assert_eq!(event["error"]["code"], "response_stalled", "{body}");

        let body = http
            .post(format!("http://{}/api/chat", edge.http_addr))
            .bearer_auth(KEY)
            .body(r#"{"model":"mock:stall_after=3","messages":[{"role":"user","content":"hi"}]}"#)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let last: serde_json::Value =
            serde_json::from_str(body.lines().rfind(|l| !l.trim().is_empty()).unwrap()).unwrap();
        assert!(last["error"].is_string(), "an Ollama error line ends the stream: {body}");
        assert_ne!(last["done"], true);
        wait_for(&edge, "idle", |s| s.leases_in_use == 0).await;
        node.shutdown().await.unwrap();
        edge.shutdown().await;
    })
    .await;
}

/// `/metrics` moved to its own listener and kept for admin keys (issue of
/// exposure, R-OBS-1): the client listener no longer serves it; the
/// metrics listener does, to an admin key only.
#[tokio::test]
async fn metrics_move_to_their_own_listener_and_ask_for_an_admin_key() {
    bounded(async {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("admin"), "sk-metrics-admin-0123456789");
        write_secret(&pki.path().join("user"), "sk-metrics-user-0123456789");
        let edge = RunningEdge::start(edge_config_with(
            &pki,
            0,
            "metrics_listen = \"127.0.0.1:0\"\nmetrics_require_admin = true\n",
            "[[api_keys]]\nprincipal = \"ops\"\nkey_file = \"admin\"\nadmin = true\n\
             [[api_keys]]\nprincipal = \"team\"\nkey_file = \"user\"\n",
        ))
        .await
        .unwrap();
        let http = reqwest::Client::new();
        let get = |url: String, key: Option<&'static str>| {
            let mut r = http.get(url);
            if let Some(key) = key {
                r = r.bearer_auth(key);
            }
            async move { r.send().await.unwrap() }
        };
        let client = format!("http://{}/metrics", edge.http_addr);
        assert_eq!(
            get(client, Some("sk-metrics-admin-0123456789"))
                .await
                .status(),
            404
        );
        let metrics = format!(
            "http://{}/metrics",
            edge.metrics_addr.expect("its own address")
        );
        assert_eq!(get(metrics.clone(), None).await.status(), 401);
        assert_eq!(
            get(metrics.clone(), Some("sk-metrics-user-0123456789"))
                .await
                .status(),
            403
        );
        let r = get(metrics, Some("sk-metrics-admin-0123456789")).await;
        assert_eq!(r.status(), 200);
        assert!(r.text().await.unwrap().contains("# TYPE"));
        edge.shutdown().await;
    })
    .await;
}
