//! Store faults degrade, never stop (R-JRN-6), on real processes: an
//! `iop-edge` process, an `iop-node` process in front of the mock
//! provider, and a real `nats-server` or the embedded file.
//!
//! * An Edge started while its `nats-server` is stopped serves ephemeral
//!   chat at once, answers durable requests 503
//!   `response_store_unavailable`, and serves them within seconds of the
//!   server starting, without a restart.
//! * An embedded journal file that cannot be opened: the same, once the
//!   file is moved aside.
//! * A journal file with one damaged record opens: the record is
//!   quarantined (counted in `/status` and `/metrics`) and every other
//!   response is served.
//!
//! Without `nats-server` installed the NATS test says why and passes,
//! unless `CI` is set (then it fails).

mod common;
#[path = "../../store-nats/tests/support/mod.rs"]
mod nats;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use iop_node::mock::{MockScript, MockServer};
use nats::NatsServer;
use serde_json::{Value, json};

const KEY: &str = "sk-store-faults-0123456789abcdef";

/// The Edge's config: `journal` is its `[journal]` section and what
/// follows it.
fn edge_toml(quic_port: u16, http_port: u16, journal: &str) -> String {
    let head = edge_head_toml("edge-a", quic_port, http_port);
    format!(
        r#"
{head}{journal}
[[providers]]
id = "p1"
node = "node-1"
adapter = "openai"
target = "t"
capacity = 64
[[routes]]
model = "m"
providers = ["p1"]
[[api_keys]]
principal = "tester"
key_file = "key"
admin = true
"#
    )
}

/// An Edge process and a Node process in front of the mock provider.
struct Deployment {
    pki: Pki,
    edge: Component,
    node: Component,
    http: String,
    _mock: MockServer,
}

impl Deployment {
    /// Start the Node first (it dials until the Edge is there), then the
    /// Edge; `journal` is the Edge's `[journal]` section.
    async fn start(journal: &str) -> Deployment {
        let pki = Pki::new(&["node-1"]);
        write_secret(&pki.path().join("key"), KEY);
        let mock = MockServer::start(MockScript {
            tokens: 6,
            ..MockScript::default()
        })
        .await
        .unwrap();
        let (quic_port, http_port) = (free_udp_port(), free_tcp_port());
        let toml = edge_toml(quic_port, http_port, journal);
        let mut edge = Component::edge(&pki, "edge-a", &toml);
        let edges = [format!("127.0.0.1:{quic_port}")];
        let mut node = Component::node(&pki, "node-1", &edges, &mock.base_url());
        node.start();
        edge.start();
        Deployment {
            pki,
            edge,
            node,
            http: format!("http://127.0.0.1:{http_port}"),
            _mock: mock,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.edge.config.with_extension("log")).unwrap_or_default()
    }

    fn pid(&self) -> Option<u32> {
        self.edge.child.as_ref().and_then(|c| c.id())
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap()
            .post(format!("{}{path}", self.http))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await;
        match r {
            Ok(r) => {
                let status = r.status().as_u16();
                let text = r.text().await.unwrap_or_default();
                (status, serde_json::from_str(&text).unwrap_or(Value::Null))
            }
            Err(_) => (0, Value::Null),
        }
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        let r = reqwest::Client::new()
            .get(format!("{}{path}", self.http))
            .bearer_auth(KEY)
            .send()
            .await;
        match r {
            Ok(r) => {
                let status = r.status().as_u16();
                let text = r.text().await.unwrap_or_default();
                (status, serde_json::from_str(&text).unwrap_or(Value::Null))
            }
            Err(_) => (0, Value::Null),
        }
    }

    async fn metrics(&self) -> String {
        reqwest::Client::new()
            .get(format!("{}/metrics", self.http))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Until an ephemeral chat completion succeeds: how long it took.
    async fn until_ephemeral_served(&self, since: Instant) -> Duration {
        let deadline = since + Duration::from_secs(30);
        loop {
            if self.post("/v1/chat/completions", &chat()).await.0 == 200 {
                return since.elapsed();
            }
            assert!(
                Instant::now() < deadline,
                "no ephemeral answer within 30 s; edge log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Until a durable response is stored and answered whole.
    async fn until_durable_served(&self, deadline: Duration) -> Value {
        let since = Instant::now();
        loop {
            let (status, body) = self.post("/v1/responses", &durable()).await;
            if status == 200 {
                assert_eq!(body["status"], "completed", "{body}");
                return body;
            }
            assert_eq!(status, 503, "{body}");
            assert_eq!(
                body["error"]["code"], "response_store_unavailable",
                "{body}"
            );
            assert!(
                since.elapsed() < deadline,
                "durable requests still refused after {deadline:?}: {body}; edge log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(mut self) {
        self.edge.kill().await;
        self.node.kill().await;
    }
}

fn chat() -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
}

fn durable() -> Value {
    json!({"model": "m", "input": "keep me", "store": true})
}

/// What `/status` says of the journal.
async fn journal(d: &Deployment) -> Value {
    let (status, doc) = d.get("/status").await;
    assert_eq!(status, 200, "{doc}");
    doc["journal"].clone()
}

/// R-JRN-6: an Edge started while its nats-server is stopped serves
/// ephemeral chat at once and durable requests within seconds of the
/// server starting, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_started_while_nats_is_stopped_serves_at_once_and_durable_once_nats_starts() {
    let Some(mut server) = NatsServer::start() else {
        return;
    };
    server.kill();
    // Built (or found up to date) before the test's clock starts.
    node_binary();
    bounded(async {
        let journal_section = format!(
            r#"[journal]
store = "nats"
max_bytes = 16777216
[journal.nats]
servers = ["{}"]
connect_timeout_ms = 2000
request_timeout_ms = 5000
tenant_bucket_max_bytes = 8388608
"#,
            server.url()
        );
        let started = Instant::now();
        let d = Deployment::start(&journal_section).await;
        let took = d.until_ephemeral_served(started).await;
        // The Edge and its node connection up: seconds, not the store's
        // connect bound over and over.
        assert!(took < Duration::from_secs(10), "took {took:?}");
        let (status, body) = d.post("/v1/responses", &durable()).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(
            body["error"]["code"], "response_store_unavailable",
            "{body}"
        );
        let (status, _) = d
            .post(
                "/v1/responses",
                &json!({"model": "m", "input": "hi", "store": false}),
            )
            .await;
        assert_eq!(status, 200, "an ephemeral Responses request");
        let j = journal(&d).await;
        assert_eq!(j["store_state"], "connecting", "{j}");
        assert_eq!(j["last_open_failure"], "unreachable", "{j}");
        assert!(
            d.metrics()
                .await
                .contains("iop_edge_journal_store_state{state=\"connecting\"} 1"),
        );
        let pid = d.pid();
        server.restart();
        let back = Instant::now();
        let answer = d.until_durable_served(Duration::from_secs(15)).await;
        let took = back.elapsed();
        assert!(took < Duration::from_secs(10), "took {took:?}");
        assert_eq!(d.pid(), pid, "no restart");
        // Stored: it reads back.
        let id = answer["id"].as_str().unwrap();
        let (status, fetched) = d.get(&format!("/v1/responses/{id}")).await;
        assert_eq!(
            (status, fetched["status"].clone()),
            (200, json!("completed"))
        );
        assert_eq!(journal(&d).await["store_state"], "up");
        eprintln!("durable served {took:?} after nats-server started");
        d.stop().await;
    })
    .await;
}

/// R-JRN-6: an embedded journal file that cannot be opened leaves the
/// Edge serving ephemeral requests; once the file can be opened (moved
/// aside here) durable requests are served without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unopenable_journal_file_degrades_and_is_opened_once_it_can_be() {
    node_binary();
    bounded(async {
        let pki_dir = tempfile::tempdir().unwrap();
        let file = pki_dir.path().join("journal.redb");
        std::fs::write(&file, vec![0xa5_u8; 64 * 1024]).unwrap();
        let journal_section = format!("[journal]\npath = \"{}\"\n", file.display());
        let started = Instant::now();
        let d = Deployment::start(&journal_section).await;
        let took = d.until_ephemeral_served(started).await;
        assert!(took < Duration::from_secs(10), "took {took:?}");
        let (status, body) = d.post("/v1/responses", &durable()).await;
        assert_eq!(status, 503, "{body}");
        let j = journal(&d).await;
        assert_eq!(
            (j["store_state"].clone(), j["last_open_failure"].clone()),
            (json!("connecting"), json!("damaged")),
            "{j}"
        );
        let pid = d.pid();
        std::fs::rename(&file, file.with_extension("redb.damaged")).unwrap();
        let back = Instant::now();
        d.until_durable_served(Duration::from_secs(10)).await;
        assert!(
            back.elapsed() < Duration::from_secs(8),
            "{:?}",
            back.elapsed()
        );
        assert_eq!(d.pid(), pid, "no restart");
        d.stop().await;
    })
    .await;
}

/// Overwrite the stored record of `id` in the journal file at `path` with
/// bytes that do not decode (through the engine: the file stays sound, one
/// record is damaged).
fn damage_record(path: &Path, id: &str) {
    const RECORDS: redb::TableDefinition<'static, &str, &[u8]> =
        redb::TableDefinition::new("records");
    use redb::ReadableTable as _;
    let db = redb::Database::create(path).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut records = txn.open_table(RECORDS).unwrap();
        assert!(records.get(id).unwrap().is_some(), "{id} is stored");
        records.insert(id, [0xff_u8; 11].as_slice()).unwrap();
    }
    txn.commit().unwrap();
}

/// R-JRN-6: a journal file with one damaged record opens; the record is
/// quarantined (counted, shown) and the rest is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_file_with_one_damaged_record_opens_quarantines_it_and_serves_the_rest() {
    node_binary();
    bounded(async {
        let mut d = Deployment::start("[journal]\n").await;
        d.until_ephemeral_served(Instant::now()).await;
        let mut ids = Vec::new();
        for _ in 0..3 {
            let body = d.until_durable_served(Duration::from_secs(10)).await;
            ids.push(body["id"].as_str().unwrap().to_owned());
        }
        d.edge.kill().await;
        let file = d.pki.path().join("edge-a-state").join("journal.redb");
        damage_record(&file, &ids[1]);
        let restarted = Instant::now();
        d.edge.start();
        d.until_ephemeral_served(restarted).await;
        let j = journal(&d).await;
        assert_eq!(j["store_state"], "up", "{j}");
        assert_eq!(j["quarantined_records"], 1, "{j}");
        assert!(
            d.metrics()
                .await
                .contains("iop_edge_journal_quarantined_records 1"),
        );
        // The rest is served, the damaged one is gone.
        for (i, id) in ids.iter().enumerate() {
            let (status, body) = d.get(&format!("/v1/responses/{id}")).await;
            if i == 1 {
                assert_eq!(status, 404, "{body}");
            } else {
                assert_eq!(status, 200, "{body}");
                assert_eq!(body["status"], "completed");
                assert!(!body["output"].as_array().unwrap().is_empty(), "{body}");
            }
        }
        d.until_durable_served(Duration::from_secs(5)).await;
        // Logged without its id (R-OBS-1).
        let log = d.log();
        assert!(log.contains("journal_records_quarantined"), "{log}");
        assert!(!log.contains(&ids[1]), "the damaged record's id is logged");
        d.stop().await;
    })
    .await;
}
