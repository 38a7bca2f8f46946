//! Tenants across Edges on real processes (SPEC §9, R-TEN-3): two Edge
//! processes on one `nats-server`, a Node process connected to both, the
//! mock provider counting its calls.
//!
//! * Eight clients on one key limited to 60 requests a minute, spread over
//!   both Edges for 60 s: each wall-clock minute admits at most the limit
//!   plus the bound (Edges x chunk), every 429 carries `Retry-After` and
//!   the `x-ratelimit-*` headers, and another key's traffic meanwhile is
//!   unaffected.
//! * A budget storm: 50 concurrent requests of one principal over both
//!   Edges against a small budget: the spend recorded in the store stays
//!   within the budget plus the bound, and the provider saw exactly the
//!   admitted requests (R-TEN-2).
//! * One key limited to 4 requests in flight, many clients holding slow
//!   streams over both Edges: the provider never sees more than 4 + the
//!   bound (Edges x chunk) at once, another key is served meanwhile, and
//!   the slots of an Edge killed with SIGKILL come back within
//!   `slot_lease_ms` (R-TEN-1 across Edges); an Edge stopped with SIGTERM
//!   gives its slots back as it stops, so the other gets them long before
//!   the lease.
//! * A budget used partly through one Edge, that Edge stopped with
//!   SIGTERM: it gives back the unused rest of what it claimed, so the
//!   other Edge spends the budget up to its end, not only what the first
//!   left unclaimed (R-TEN-2, R-TEN-3).
//! * A key created through one Edge works on the other within
//!   `key_sync_ms`, a key revoked on the other is refused on the first
//!   within it, and an Edge killed with SIGKILL and restarted keeps the
//!   runtime keys (R-TEN-4).
//!
//! Without `nats-server` installed each test says why and passes, unless
//! `CI` is set (then it fails), as the store's own tests do.

mod common;
#[path = "../../store-nats/tests/support/mod.rs"]
mod nats;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use iop_node::mock::{MockScript, MockServer};
use nats::NatsServer;
use serde_json::{Value, json};

const ADMIN: &str = "sk-tenants-edges-admin-0123456789";
const LIMITED: &str = "sk-tenants-edges-limited-0123456789";
const OTHER: &str = "sk-tenants-edges-other-0123456789";
const BUDGETED: &str = "sk-tenants-edges-budget-0123456789";
const CONCURRENT: &str = "sk-tenants-edges-concurrent-0123456789";
const GIVEN_BACK: &str = "sk-tenants-edges-given-back-0123456789";
/// The concurrent key's requests in flight.
const CONCURRENT_LIMIT: u64 = 4;
/// `[tenants] slot_lease_ms`: a dead Edge's slots come back within it.
const SLOT_LEASE_MS: u64 = 2_000;
/// The lease of the hand-back test: long, so that slots back within a few
/// seconds can only have been given back.
const LONG_SLOT_LEASE_MS: u64 = 30_000;
/// The limited key's requests per minute.
const RPM: u64 = 60;
/// The budgeted principal's budget, micro-units (1 a token).
const BUDGET: u64 = 3_000;
/// `[tenants] chunk_fraction`: each Edge claims a tenth of a limit.
const CHUNK_FRACTION: f64 = 0.1;
/// `[tenants] key_sync_ms`.
const KEY_SYNC_MS: u64 = 500;
const EDGES: u64 = 2;

fn edge_toml(
    edge_id: &str,
    nats_url: &str,
    quic_port: u16,
    http_port: u16,
    slot_lease_ms: u64,
) -> String {
    let head = edge_head_toml(edge_id, quic_port, http_port);
    format!(
        r#"
{head}[admission]
queue_capacity = 256
queue_timeout_ms = 10000
[journal]
store = "nats"
max_bytes = 16777216
lease_ttl_ms = 1500
takeover_scan_interval_ms = 200
[journal.nats]
servers = ["{nats_url}"]
stream = "TENANTS_JOURNAL"
bucket = "tenants_journal"
subject_prefix = "tenants.journal"
connect_timeout_ms = 5000
request_timeout_ms = 5000
tenant_bucket_max_bytes = 8388608
[tenants]
chunk_fraction = {CHUNK_FRACTION}
key_sync_ms = {KEY_SYNC_MS}
usage_flush_ms = 200
slot_lease_ms = {slot_lease_ms}
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
principal = "ops"
key_file = "admin"
admin = true
[[api_keys]]
principal = "team-a"
id = "team-a-limited"
key_file = "limited"
limits = {{ requests_per_minute = {RPM} }}
[[api_keys]]
principal = "team-b"
key_file = "other"
[[api_keys]]
principal = "team-c"
key_file = "budgeted"
[[api_keys]]
principal = "team-d"
id = "team-d-concurrent"
key_file = "concurrent"
limits = {{ concurrent_requests = {CONCURRENT_LIMIT} }}
[[api_keys]]
principal = "team-e"
key_file = "given-back"
[[principals]]
name = "team-c"
limits = {{ budget_micros = {BUDGET}, budget_period = "total" }}
[[principals]]
name = "team-e"
limits = {{ budget_micros = {BUDGET}, budget_period = "total" }}
[[prices]]
model = "m"
input_per_mtok = 1000000
output_per_mtok = 1000000
"#
    )
}

/// Two Edge processes and a Node process on `server`.
struct Deployment {
    edges: Vec<Component>,
    node: Component,
    http: Vec<String>,
    mock: MockServer,
    _pki: Pki,
}

impl Deployment {
    async fn start(server: &NatsServer) -> Deployment {
        Self::start_with(
            server,
            MockScript {
                tokens: 20,
                tokens_per_second: 2_000.0,
                ..MockScript::default()
            },
        )
        .await
    }

    /// The deployment with the mock provider playing `script`.
    async fn start_with(server: &NatsServer, script: MockScript) -> Deployment {
        Self::start_leased(server, script, SLOT_LEASE_MS).await
    }

    /// [`Self::start_with`], the Edges' `[tenants] slot_lease_ms` at
    /// `slot_lease_ms`.
    async fn start_leased(
        server: &NatsServer,
        script: MockScript,
        slot_lease_ms: u64,
    ) -> Deployment {
        let pki = Pki::new(&["node-1"]);
        for (file, key) in [
            ("admin", ADMIN),
            ("limited", LIMITED),
            ("other", OTHER),
            ("budgeted", BUDGETED),
            ("concurrent", CONCURRENT),
            ("given-back", GIVEN_BACK),
        ] {
            write_secret(&pki.path().join(file), key);
        }
        let mock = MockServer::start(script).await.unwrap();
        let ports: Vec<(u16, u16)> = (0..EDGES)
            .map(|_| (free_udp_port(), free_tcp_port()))
            .collect();
        let quic: Vec<String> = ports
            .iter()
            .map(|(q, _)| format!("127.0.0.1:{q}"))
            .collect();
        let http: Vec<String> = ports
            .iter()
            .map(|(_, h)| format!("http://127.0.0.1:{h}"))
            .collect();
        let mut edges = Vec::new();
        for (i, (q, h)) in ports.iter().enumerate() {
            let id = format!("edge-{}", i + 1);
            let toml = edge_toml(&id, &server.url(), *q, *h, slot_lease_ms);
            let mut edge = Component::edge(&pki, &id, &toml);
            edge.start();
            edges.push(edge);
        }
        let mut node = Component::node(&pki, "node-1", &quic, &mock.base_url());
        node.start();
        let d = Deployment {
            edges,
            node,
            http,
            mock,
            _pki: pki,
        };
        for edge in &d.http {
            d.wait_ready(edge).await;
        }
        d
    }

    /// Until `edge` answers and sees the node ready.
    async fn wait_ready(&self, edge: &str) {
        let components: Vec<&Component> = self.edges.iter().chain([&self.node]).collect();
        wait_node_ready(edge, ADMIN, &components).await;
    }

    async fn stop(mut self) {
        for e in &mut self.edges {
            e.kill().await;
        }
        self.node.kill().await;
    }
}

async fn chat(client: &reqwest::Client, edge: &str, key: &str) -> reqwest::Response {
    chat_up_to(client, edge, key, 20).await
}

/// A chat request that may produce `max_tokens` output tokens (what its
/// reservation holds).
async fn chat_up_to(
    client: &reqwest::Client,
    edge: &str,
    key: &str,
    max_tokens: u64,
) -> reqwest::Response {
    client
        .post(format!("{edge}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({
            "model": "m",
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello"}],
        }))
        .send()
        .await
        .unwrap()
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

async fn admin(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = client.request(method, url).bearer_auth(ADMIN);
    if let Some(body) = body {
        req = req.json(&body);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn r_ten_3_one_key_over_two_edges_is_held_to_its_requests_per_minute() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    bounded_long(async {
        let d = Deployment::start(&server).await;
        let client = reqwest::Client::new();
        let end = Instant::now() + Duration::from_secs(60);
        let mut clients = Vec::new();
        for c in 0..8usize {
            let (client, http) = (client.clone(), d.http.clone());
            clients.push(tokio::spawn(async move {
                // (minute the request was sent in, admitted)
                let mut seen: Vec<(u64, bool)> = Vec::new();
                let mut k = c;
                while Instant::now() < end {
                    let minute = unix_ms() / 60_000;
                    let r = chat(&client, &http[k % http.len()], LIMITED).await;
                    k += 1;
                    match r.status().as_u16() {
                        200 => seen.push((minute, true)),
                        429 => {
                            let retry: u64 = header(&r, "retry-after")
                                .and_then(|v| v.parse().ok())
                                .expect("Retry-After on every 429");
                            assert!((1..=60).contains(&retry));
                            for name in [
                                "x-ratelimit-limit-requests",
                                "x-ratelimit-remaining-requests",
                                "x-ratelimit-reset-requests",
                            ] {
                                assert!(header(&r, name).is_some(), "{name} on a 429");
                            }
                            assert_eq!(
                                header(&r, "x-ratelimit-limit-requests").as_deref(),
                                Some("60")
                            );
                            let body: Value = r.json().await.unwrap();
                            assert_eq!(body["error"]["code"], "rate_limit_exceeded");
                            seen.push((minute, false));
                        }
                        other => panic!("unexpected {other}"),
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                seen
            }));
        }
        // Another principal's traffic meanwhile: every request served.
        let other = {
            let (client, http) = (client.clone(), d.http.clone());
            tokio::spawn(async move {
                let mut served = 0;
                let mut k = 0;
                while Instant::now() < end {
                    let r = chat(&client, &http[k % http.len()], OTHER).await;
                    assert_eq!(r.status(), 200, "another key is unaffected");
                    served += 1;
                    k += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                served
            })
        };
        let mut per_minute: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        for c in clients {
            for (minute, admitted) in c.await.unwrap() {
                let e = per_minute.entry(minute).or_default();
                if admitted {
                    e.0 += 1;
                } else {
                    e.1 += 1;
                }
            }
        }
        let served = other.await.unwrap();
        let chunk = (RPM as f64 * CHUNK_FRACTION) as u64;
        // A request is put in the minute it was sent in: the 8 in flight
        // across a minute's end may be counted in the one before.
        let bound = RPM + EDGES * chunk + 8;
        println!("per minute (admitted, refused): {per_minute:?}; other key served {served}");
        let admitted: u64 = per_minute.values().map(|(a, _)| a).sum();
        for (minute, (a, refused)) in &per_minute {
            assert!(*a <= bound, "minute {minute}: {a} admitted, bound {bound}");
            let _ = refused;
        }
        assert!(
            admitted >= RPM,
            "60 s span a minute's worth of windows: {admitted} admitted"
        );
        assert!(per_minute.values().any(|(_, r)| *r > 0), "the limit bit");
        assert!(served > 100);
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn r_ten_2_a_budget_storm_over_two_edges_spends_within_the_budget_and_calls_only_for_admitted()
 {
    let Some(server) = NatsServer::start() else {
        return;
    };
    bounded_long(async {
        let d = Deployment::start(&server).await;
        let client = reqwest::Client::new();
        let before = d.mock.requests();
        // Each client asks until the budget says no for good (a refusal
        // without Retry-After); a refusal while its Edge's claim is on its
        // way says when to try again.
        let mut storm = Vec::new();
        for i in 0..50usize {
            let (client, edge) = (client.clone(), d.http[i % d.http.len()].clone());
            storm.push(tokio::spawn(async move {
                let (mut admitted, mut refused) = (0u64, 0u64);
                for _ in 0..200 {
                    let r = chat(&client, &edge, BUDGETED).await;
                    match r.status().as_u16() {
                        200 => admitted += 1,
                        429 => {
                            refused += 1;
                            let again = header(&r, "retry-after").is_some();
                            let body: Value = r.json().await.unwrap();
                            assert_eq!(body["error"]["code"], "insufficient_quota");
                            if !again {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        other => panic!("unexpected {other}"),
                    }
                }
                (admitted, refused)
            }));
        }
        let mut admitted = 0u64;
        let mut refused = 0u64;
        for s in storm {
            let (a, r) = s.await.unwrap();
            admitted += a;
            refused += r;
        }
        assert!(
            admitted > 0 && refused > 0,
            "admitted {admitted}, refused {refused}"
        );
        assert_eq!(
            d.mock.requests() - before,
            admitted,
            "no provider call for a refused request"
        );
        // The spend both Edges recorded, read from the store.
        let mut spend = 0;
        let mut requests = 0;
        for _ in 0..50 {
            let (status, usage) = admin(
                &client,
                reqwest::Method::GET,
                format!("{}/admin/usage?principal=team-c", d.http[1]),
                None,
            )
            .await;
            assert_eq!(status, 200, "{usage}");
            spend = usage["total"]["spend_micros"].as_u64().unwrap();
            requests = usage["total"]["requests"].as_u64().unwrap();
            if requests >= admitted {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let chunk = (BUDGET as f64 * CHUNK_FRACTION) as u64;
        println!(
            "budget storm: {admitted} admitted, {refused} refused, spend {spend} of {BUDGET} (+{})",
            EDGES * chunk
        );
        assert!(
            requests >= admitted,
            "every admitted request is recorded: {requests}"
        );
        assert!(
            spend >= BUDGET / 2,
            "the budget is used, not only guarded: {spend}"
        );
        assert!(
            spend <= BUDGET + EDGES * chunk,
            "spend {spend} over budget {BUDGET} + {EDGES} x {chunk}"
        );
        d.stop().await;
    })
    .await;
}

#[tokio::test]
async fn r_ten_4_a_key_made_on_one_edge_works_on_the_other_and_survives_a_restart() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    bounded_long(async {
        let mut d = Deployment::start(&server).await;
        let client = reqwest::Client::new();
        let create = |principal: &'static str| {
            let (client, url) = (client.clone(), format!("{}/admin/keys", d.http[0]));
            async move {
                let (status, key) = admin(
                    &client,
                    reqwest::Method::POST,
                    url,
                    Some(json!({"principal": principal, "models": ["m"]})),
                )
                .await;
                assert_eq!(status, 201, "{key}");
                (
                    key["id"].as_str().unwrap().to_owned(),
                    key["secret"].as_str().unwrap().to_owned(),
                )
            }
        };
        // Until `edge` answers `key` with `want`; how long it took.
        let until = |edge: String, key: String, want: u16| {
            let client = client.clone();
            async move {
                let started = Instant::now();
                loop {
                    if chat(&client, &edge, &key).await.status().as_u16() == want {
                        return started.elapsed();
                    }
                    assert!(
                        started.elapsed() < Duration::from_secs(10),
                        "{edge} never answered {want}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        let sync = Duration::from_millis(KEY_SYNC_MS);
        let (id, secret) = create("team-runtime").await;
        assert_eq!(
            chat(&client, &d.http[0], &secret).await.status(),
            200,
            "at once where it was made"
        );
        let took = until(d.http[1].clone(), secret.clone(), 200).await;
        assert!(
            took <= sync + Duration::from_millis(500),
            "on the other Edge after {took:?}"
        );

        let (status, _) = admin(
            &client,
            reqwest::Method::POST,
            format!("{}/admin/keys/{id}/revoke", d.http[1]),
            None,
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(chat(&client, &d.http[1], &secret).await.status(), 401);
        let took = until(d.http[0].clone(), secret.clone(), 401).await;
        assert!(
            took <= sync + Duration::from_millis(500),
            "revoked on the first after {took:?}"
        );

        // SIGKILL and restart: the stored keys are read again.
        let (_, kept) = create("team-kept").await;
        until(d.http[1].clone(), kept.clone(), 200).await;
        d.edges[0].kill().await;
        d.edges[0].start();
        let edge = d.http[0].clone();
        d.wait_ready(&edge).await;
        assert_eq!(chat(&client, &d.http[0], &kept).await.status(), 200);
        assert_eq!(chat(&client, &d.http[0], &secret).await.status(), 401);
        d.stop().await;
    })
    .await;
}

/// A streamed request of `key` at `edge`, held until its stream ends:
/// whether it was admitted; while its stream runs, `active` counts it.
async fn held_stream(
    client: &reqwest::Client,
    edge: &str,
    key: &str,
    active: &std::sync::atomic::AtomicU64,
) -> Result<(), Option<String>> {
    use std::sync::atomic::Ordering;
    let mut r = client
        .post(format!("{edge}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({
            "model": "m",
            "max_tokens": 20,
            "stream": true,
            "messages": [{"role": "user", "content": "hello"}],
        }))
        .send()
        .await
        .map_err(|_| None)?;
    if r.status() != 200 {
        assert_eq!(r.status(), 429, "{:?}", r.text().await);
        return Err(header(&r, "retry-after"));
    }
    active.fetch_add(1, Ordering::SeqCst);
    while let Ok(Some(_)) = r.chunk().await {}
    active.fetch_sub(1, Ordering::SeqCst);
    Ok(())
}

#[tokio::test]
async fn r_ten_1_a_keys_requests_in_flight_are_held_across_edges_and_a_dead_edges_slots_come_back()
{
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let Some(server) = NatsServer::start() else {
        return;
    };
    bounded_long(async {
        // Each answer streams for about 2 s.
        let mut d = Deployment::start_with(
            &server,
            MockScript {
                tokens: 20,
                tokens_per_second: 10.0,
                ..MockScript::default()
            },
        )
        .await;
        let client = reqwest::Client::new();
        // R-TEN-1 across Edges: limit + Edges x chunk (a chunk of 4 at
        // 0.1 is one slot).
        let bound = CONCURRENT_LIMIT + EDGES;
        let stop = Arc::new(AtomicBool::new(false));
        let active: Arc<Vec<AtomicU64>> = Arc::new((0..EDGES).map(|_| AtomicU64::new(0)).collect());
        let admitted: Arc<Vec<AtomicU64>> =
            Arc::new((0..EDGES).map(|_| AtomicU64::new(0)).collect());
        let refused = Arc::new(AtomicU64::new(0));
        let mut clients = Vec::new();
        for c in 0..12usize {
            let edge = c % EDGES as usize;
            let (client, url) = (client.clone(), d.http[edge].clone());
            let (stop, active, admitted, refused) = (
                stop.clone(),
                active.clone(),
                admitted.clone(),
                refused.clone(),
            );
            clients.push(tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    match held_stream(&client, &url, CONCURRENT, &active[edge]).await {
                        Ok(()) => _ = admitted[edge].fetch_add(1, Ordering::SeqCst),
                        Err(retry_after) => {
                            if retry_after.is_some() {
                                refused.fetch_add(1, Ordering::SeqCst);
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            }));
        }
        // At the provider (only this key's requests so far): never more
        // than the limit + the bound at once.
        let mut peak = 0;
        let until = Instant::now() + Duration::from_secs(6);
        while Instant::now() < until {
            peak = peak.max(d.mock.stats().in_flight);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let provider_max = d.mock.stats().max_in_flight;
        assert!(
            provider_max <= bound,
            "the provider saw {provider_max} of the key's requests at once (limit \
             {CONCURRENT_LIMIT}, bound {bound})"
        );
        assert!(
            peak >= CONCURRENT_LIMIT.min(3),
            "the key's requests ran: {peak}"
        );
        assert!(
            refused.load(Ordering::SeqCst) > 0,
            "12 clients over 4 slots"
        );
        for (edge, n) in admitted.iter().enumerate() {
            assert!(n.load(Ordering::SeqCst) > 0, "edge {edge} admitted none");
        }
        // Another key is served on both Edges meanwhile.
        for edge in &d.http {
            assert_eq!(chat(&client, edge, OTHER).await.status(), 200);
        }
        // The second Edge dies with its slots held: within the lease they
        // come back, and the first Edge alone gets the whole limit.
        d.edges[1].kill().await;
        let killed = Instant::now();
        let mut whole = None;
        while killed.elapsed() < Duration::from_millis(SLOT_LEASE_MS) + Duration::from_secs(8) {
            if active[0].load(Ordering::SeqCst) >= CONCURRENT_LIMIT {
                whole = Some(killed.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.store(true, Ordering::SeqCst);
        for c in clients {
            c.abort();
        }
        let whole = whole.expect("the dead Edge's slots never came back");
        // The lease, a request of the first Edge's ending (about 2 s) and
        // its renewal tick.
        assert!(
            whole <= Duration::from_millis(SLOT_LEASE_MS) + Duration::from_secs(4),
            "the first Edge reached the limit {whole:?} after the kill"
        );
        println!("the first Edge had all {CONCURRENT_LIMIT} slots {whole:?} after the kill");
        d.stop().await;
    })
    .await;
}

/// R-TEN-1, R-TEN-3: an Edge stopped with SIGTERM while it holds a key's
/// every slot gives them back as it stops (its requests drained): the other
/// Edge gets the whole limit within seconds, not after `slot_lease_ms`
/// (30 s here; SIGKILLed, it would wait that long).
#[tokio::test]
async fn r_ten_1_an_edge_stopped_with_sigterm_hands_its_slots_back_at_once() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let Some(server) = NatsServer::start() else {
        return;
    };
    bounded_long(async {
        // Each answer streams for about 10 s.
        let mut d = Deployment::start_leased(
            &server,
            MockScript {
                tokens: 100,
                tokens_per_second: 10.0,
                ..MockScript::default()
            },
            LONG_SLOT_LEASE_MS,
        )
        .await;
        let client = reqwest::Client::new();
        let stop = Arc::new(AtomicBool::new(false));
        let active: Arc<Vec<AtomicU64>> = Arc::new((0..EDGES).map(|_| AtomicU64::new(0)).collect());
        // Clients of the key on `edge` until `stop`.
        let spawn_clients = |edge: usize, n: usize| {
            (0..n)
                .map(|_| {
                    let (client, url) = (client.clone(), d.http[edge].clone());
                    let (stop, active) = (stop.clone(), active.clone());
                    tokio::spawn(async move {
                        while !stop.load(Ordering::SeqCst) {
                            if held_stream(&client, &url, CONCURRENT, &active[edge])
                                .await
                                .is_err()
                            {
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                        }
                    })
                })
                .collect::<Vec<_>>()
        };
        // The second Edge takes the key's every slot.
        let mut clients = spawn_clients(1, CONCURRENT_LIMIT as usize);
        let deadline = Instant::now() + Duration::from_secs(20);
        while active[1].load(Ordering::SeqCst) < CONCURRENT_LIMIT {
            assert!(
                Instant::now() < deadline,
                "the second Edge never held the limit"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The first Edge's clients wait for slots: the store has none left,
        // so it admits at most its chunk on credit (R-TEN-3's bound).
        clients.extend(spawn_clients(0, CONCURRENT_LIMIT as usize));
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let before = active[0].load(Ordering::SeqCst);
        assert!(
            before < CONCURRENT_LIMIT,
            "the limit is held on the second Edge: the first runs {before}"
        );
        // The second Edge stops.
        let stopped = Instant::now();
        d.edges[1].terminate(Duration::from_secs(10)).await;
        let exited = stopped.elapsed();
        // The first Edge holds every slot in the store: running the limit
        // is not enough (it may run one of them on credit, R-TEN-3), the
        // stopped Edge's last spare slot must have come back too.
        let mut whole = None;
        while stopped.elapsed() < Duration::from_millis(LONG_SLOT_LEASE_MS) {
            let held = client
                .get(format!("{}/status", d.http[0]))
                .bearer_auth(ADMIN)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()["tenants"]["slots_held"]
                .as_u64();
            if held == Some(CONCURRENT_LIMIT) {
                whole = Some(stopped.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.store(true, Ordering::SeqCst);
        for c in clients {
            c.abort();
        }
        let whole = whole.expect("the stopped Edge's slots never came back within the lease");
        // The drain, the first Edge's refusals of a moment ago (the store
        // said full: it asks again a second later) and its clients'
        // retries.
        assert!(
            whole <= Duration::from_secs(5),
            "the first Edge held the limit {whole:?} after the second's SIGTERM (lease \
             {LONG_SLOT_LEASE_MS} ms)"
        );
        let log =
            std::fs::read_to_string(d.edges[1].config.with_extension("log")).unwrap_or_default();
        assert!(
            log.contains("edge_tenant_slots_handed_back"),
            "the stopping Edge says it gave its slots back"
        );
        println!(
            "the first Edge held all {CONCURRENT_LIMIT} slots {whole:?} after the second was sent \
             SIGTERM (it exited after {exited:?})"
        );
        d.stop().await;
    })
    .await;
}

/// The spend recorded for `principal` over every Edge, read from the
/// store through `edge` once it counts `requests` requests (or after a
/// few seconds): (requests, spend).
async fn recorded_spend(
    client: &reqwest::Client,
    edge: &str,
    principal: &str,
    requests: u64,
) -> (u64, u64) {
    let mut seen = (0, 0);
    for _ in 0..50 {
        let (status, usage) = admin(
            client,
            reqwest::Method::GET,
            format!("{edge}/admin/usage?principal={principal}"),
            None,
        )
        .await;
        assert_eq!(status, 200, "{usage}");
        seen = (
            usage["total"]["requests"].as_u64().unwrap_or(0),
            usage["total"]["spend_micros"].as_u64().unwrap_or(0),
        );
        if seen.0 >= requests {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seen
}

/// R-TEN-2, R-TEN-3: Edge A admits one request that reserves a third of
/// the budget and uses a sliver of it; A claimed that reservation and a
/// chunk. Stopped with SIGTERM, A gives back what it claimed and did not
/// use, so Edge B spends the budget up to its end. Without the give-back
/// the store would keep A's whole claim (about 1,400 of 3,000) until the
/// period ends, and B could spend at most what A left unclaimed plus its
/// one chunk on credit: the recorded spend would stay under 2,000.
#[tokio::test]
async fn r_ten_3_an_edge_stopped_with_sigterm_gives_back_its_unused_budget_and_another_spends_it() {
    let Some(server) = NatsServer::start() else {
        return;
    };
    bounded_long(async {
        let started = Instant::now();
        let mut d = Deployment::start(&server).await;
        println!(
            "give-back: the deployment started in {:?}",
            started.elapsed()
        );
        let client = reqwest::Client::new();
        // A large reservation (its prompt's bytes + 1,000 output tokens),
        // a small use (the mock answers 20 tokens).
        let r = chat_up_to(&client, &d.http[0], GIVEN_BACK, 1_000).await;
        assert_eq!(r.status(), 200);
        let (_, spent_on_a) = recorded_spend(&client, &d.http[0], "team-e", 1).await;
        assert!(spent_on_a > 0 && spent_on_a < 100, "{spent_on_a}");

        let stopped = Instant::now();
        d.edges[0].terminate(Duration::from_secs(10)).await;
        let exited = stopped.elapsed();
        let log =
            std::fs::read_to_string(d.edges[0].config.with_extension("log")).unwrap_or_default();
        let line = log
            .lines()
            .find(|l| l.contains("edge_tenant_slots_handed_back"))
            .unwrap_or_else(|| panic!("the stopping Edge says what it gave back:\n{log}"));
        let given_back: u64 = line
            .split("given_back_spend_micros")
            .nth(1)
            .and_then(|rest| {
                rest.trim_start_matches(|c: char| !c.is_ascii_digit())
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
            })
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no amount in {line}"));
        assert!(
            given_back > 1_000,
            "the unused reservation and chunk went back: {line}"
        );

        // Edge B spends until the budget says no for good.
        let spending = Instant::now();
        let mut clients = Vec::new();
        for _ in 0..4 {
            let (client, edge) = (client.clone(), d.http[1].clone());
            clients.push(tokio::spawn(async move {
                let mut admitted = 0u64;
                for _ in 0..400 {
                    let r = chat(&client, &edge, GIVEN_BACK).await;
                    match r.status().as_u16() {
                        200 => admitted += 1,
                        429 => {
                            let again = header(&r, "retry-after").is_some();
                            let body: Value = r.json().await.unwrap();
                            assert_eq!(body["error"]["code"], "insufficient_quota");
                            if !again {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        other => panic!("unexpected {other}"),
                    }
                }
                admitted
            }));
        }
        let mut admitted = 1;
        for c in clients {
            admitted += c.await.unwrap();
        }
        let (requests, spend) = recorded_spend(&client, &d.http[1], "team-e", admitted).await;
        let chunk = (BUDGET as f64 * CHUNK_FRACTION) as u64;
        println!(
            "give-back: Edge A spent {spent_on_a} and gave back {given_back} at SIGTERM (it \
             exited after {exited:?}); over both Edges {admitted} requests ({requests} \
             recorded) spent {spend} of {BUDGET} ({:?} on B)",
            spending.elapsed()
        );
        assert!(requests >= admitted, "every admitted request is recorded");
        assert!(
            spend >= BUDGET - 600,
            "B spent what A gave back: {spend} of {BUDGET} (without the give-back at most \
             about {})",
            BUDGET - given_back + chunk + spent_on_a
        );
        assert!(
            spend <= BUDGET + EDGES * chunk,
            "spend {spend} over budget {BUDGET} + {EDGES} x {chunk}"
        );
        d.stop().await;
    })
    .await;
}

async fn bounded_long<T>(fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(240), fut)
        .await
        .expect("the test took too long")
}
